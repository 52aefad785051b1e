"""What every launch kind shares: where a launch reads (`Part`) and writes (`Dst`), its scratch (`Scratch`), checkpoint
row formats and their decoding, the activations, and the `Launch` base the kinds fill in (what a launch of the kind
computes, costs and refuses, how the schedule tunes it and which kernels it makes)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, fields
from functools import partial
from typing import ClassVar, Protocol

import numpy as np

from lanefuse.engine.refusal import Refusal
from lanefuse.engine.formats.blocks import BLOCKS, bytes_per_value, decode_blocks, row_bytes, row_refusal
from lanefuse.engine.formats.blocks import encode as encode_any

GEMV_ROWS = 8  # rows of x one GEMV warp multiplies at once (an accumulator per row); more rows run as slabs of this many
QBLOCK = 32  # values of an activation's quantized form that share one scale
QBLOCK_K = 256  # ... under the q8k form (words 3: llama.cpp's q8_K, the activation of a product over K-quant rows)
Q8K = 3  # a launch's `words` of a q8k form: one int8 word a value, a scale a block of 256, the sums of each 16 words
QSUM = 16  # the q8k form's words a sum
ALIGN = 256  # every array's alignment in the arena: cudaMalloc's, past every vector load the kernels make
MAX_GRID_Y = 65535  # the most blocks a launch's grid takes in y (and in z)
MAX_HEAD = 256  # the widest attention head (key or value) the attention kernel holds; wider is refused
DENSE = {"f32": 4, "f16": 2, "bf16": 2}  # checkpoint row format -> bytes a value, a value at a time
FORMATS = {**DENSE, **{f: bytes_per_value(f) for f in BLOCKS}}  # every format the kernels read -> bytes a value
FORMAT_CODE = {"f32": 0, "f16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4, "q4_k": 5, "q6_k": 6, "mxfp4": 7, "q4_1": 8,
               "q5_0": 9, "q5_1": 10, "q5_k": 11, "q3_k": 12, "q2_k": 13, "iq4_nl": 14, "iq4_xs": 15}  # kernels' arg
# (prelude.cu's qget; below 16, gemv_q8.cu's flag of a q8k activation)
ACTS = ("silu", "sigmoid", "gelu", "gelu_erf")  # gelu: the tanh approximation; gelu_erf: the exact GELU


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def qblock(words: int) -> int:
    """The values that share a scale in a quantized form of `words` (q8, q8x2: 32; q8k: 256)."""
    return QBLOCK_K if words == Q8K else QBLOCK


def quant_layout(n: int, words: int) -> tuple[int, int, int]:
    """Where the parts of a quantized array of `n` values start, and its bytes: (low words, scales, total) — the low
    words' start equals the scales' under one word (it has none); under the q8k form the "low" part is its int16
    sums of 16 words."""
    low = _aligned(n)
    scales = low + (_aligned(n) if words == 2 else _aligned(2 * (n // QSUM)) if words == Q8K else 0)
    return low, scales, scales + _aligned(4 * (n // qblock(words)))


def quant_parts_at(n: int, words: int, home_n: int = 0, first: int = 0) -> tuple[int, int, int]:
    """The byte offsets, in its home's array, of the words, low words (the q8k form's sums of 16) and scales of a
    quantized form of n values that is the part from value `first` (a whole block) of a form of home_n values: a row
    of a tensor read quantized is a view into the tensor's quantized form (home_n 0: its own form)."""
    lo, sc, _ = quant_layout(home_n or n, words)
    low = lo + (first if words == 2 else 2 * (first // QSUM) if words == Q8K else 0)
    return first, low, sc + 4 * (first // qblock(words))


@dataclass(frozen=True)
class Part:
    """A part of every unit of a wider tensor: unit u's `width` values start at `u*pitch + offset`."""

    pitch: int
    offset: int
    width: int

    def indices(self, units: int) -> np.ndarray:
        u = np.arange(units, dtype=np.int64)[:, None]
        return (u * self.pitch + self.offset + np.arange(self.width, dtype=np.int64)[None, :]).reshape(-1)

    def extent(self, units: int) -> int:
        """The elements of the wider tensor `units` units reach: one past the last value read."""
        return (units - 1) * self.pitch + self.offset + self.width if units > 0 and self.width > 0 else 0


@dataclass(frozen=True)
class Dst:
    """Where a launch writes its result of `count` values: `buf` from its start (row None), or the rows of a table
    `pitch` values a row from a starting row — the row an i32 parameter names (`row` a str: its value, 0-based) or a
    fixed row (`row` an int); the result laid contiguously there, or (`unit`) as a part of every unit of it: value e in
    unit e // unit.width."""

    buf: str
    row: str | int | None = None
    pitch: int = 0
    unit: Part | None = None
    slot: int = 0  # a batch's (the row a parameter names, one a sequence): result row r, `pitch` values, lands in
    # the table's row r·slot + row[r], its sequence's slot at its position (the kernels: `row` word -slot)

    @staticmethod
    def to(name: str) -> "Dst":
        return Dst(name)

    @property
    def contiguous(self) -> bool:
        """Whether the result lies as it is from `base` on (no parts of units, no batch's rows apart)."""
        return self.unit is None and not self.slot

    def base(self, env) -> int:
        if self.row is None:
            return 0
        r = env.param(self.row) if isinstance(self.row, str) else int(self.row)
        return r * self.pitch

    def indices(self, count: int, env, first: int = 0) -> np.ndarray:
        """The flat indices in `buf` that values first..first+count-1 of the result land at."""
        e = np.arange(first, first + count, dtype=np.int64)
        if self.slot:
            r = e // self.pitch
            at = env.array(self.row).astype(np.int64)[r]
            return (r * self.slot + at) * self.pitch + e % self.pitch
        base = self.base(env)
        if self.unit is None:
            return base + e
        u = self.unit
        return base + (e // u.width) * u.pitch + u.offset + e % u.width

    def write(self, env, values: np.ndarray, first: int = 0) -> None:
        v = np.asarray(values, dtype=np.float32).reshape(-1)
        env.array(self.buf)[self.indices(v.size, env, first)] = v

    def params(self) -> tuple[str, ...]:
        return (self.row,) if isinstance(self.row, str) else ()

    def extent(self, count: int, top: int) -> int:
        """The elements of `buf` a result of `count` values reaches (one past the last index written), a row that a
        parameter names being at most `top`."""
        if count <= 0:
            return 0
        if self.slot:  # the last sequence's row of its slot, at most at `top`
            rows = -(-count // self.pitch)
            return ((rows - 1) * self.slot + top + 1) * self.pitch
        row = 0 if self.row is None else (top if isinstance(self.row, str) else self.row)
        e, u = count - 1, self.unit
        last = e if u is None else (e // max(u.width, 1)) * u.pitch + u.offset + e % max(u.width, 1)
        return row * self.pitch + last + 1


@dataclass(frozen=True)
class Scratch:
    """A launch's scratch: `tag` names it beside the launch, `dtype` its element type, `nbytes` its size. A counter (an
    arrival count the launch's last block resets) is zero before the launch and left zero by it, so it keeps a zeroed
    buffer of its own; the rest live in the arena while the launch runs."""

    tag: str
    dtype: str
    nbytes: int
    counter: bool = False


def batch_dsts(l: "Launch", pos: str, slot: int):
    """Launch `l` with every Dst among its fields (and its parts' fields) whose row `pos` names written into each
    sequence's slot, each nested launch batched by its own kind; a Refusal where one cannot be."""
    from dataclasses import fields as fields_of, is_dataclass, replace

    def walk(v):
        if isinstance(v, Dst):
            if v.row != pos:
                return v
            if v.unit is not None:
                return Refusal("a batch's row written as parts of a wider table row")
            return replace(v, slot=slot)
        if isinstance(v, Launch):
            return v.batched(pos, slot)
        if isinstance(v, tuple):
            out = []
            for x in v:
                got = walk(x)
                if isinstance(got, Refusal):
                    return got
                out.append(got)
            return tuple(out)
        if is_dataclass(v) and not isinstance(v, type):
            return fields(v)
        return v

    def fields(obj):
        changes = {}
        for f in fields_of(obj):
            v = getattr(obj, f.name)
            got = walk(v)
            if isinstance(got, Refusal):
                return got
            if got is not v:
                changes[f.name] = got
        return replace(obj, **changes) if changes else obj

    return fields(l)


def own_names(obj) -> set[str]:
    """The names a launch's fields hold outside its Dsts' rows and its nested launches (a field's, or a tuple's of
    them: a chain's phases): what it reads itself."""
    from dataclasses import fields as fields_of, is_dataclass

    out: set[str] = set()
    if isinstance(obj, str):
        out.add(obj)
    elif isinstance(obj, Dst):
        out.add(obj.buf)
    elif isinstance(obj, tuple):
        for x in obj:
            if not isinstance(x, Launch):
                out |= own_names(x)
    elif is_dataclass(obj):
        for f in fields_of(obj):
            v = getattr(obj, f.name)
            if not isinstance(v, Launch):
                out |= own_names(v)
    return out


def batch_apart(l, rows_field: str = "rows") -> tuple:
    """A batch launch (its `slot` set) as one launch a sequence: the same fields, one row from each `seq0`."""
    from dataclasses import replace

    if not getattr(l, "slot", 0) or getattr(l, rows_field) == 1:
        return (l,)
    return tuple(replace(l, seq0=l.seq0 + s, **{rows_field: 1}) for s in range(getattr(l, rows_field)))


def dst_view(d: Dst, env, m: int, n: int) -> np.ndarray | None:
    """The (m, n) values Dst `d` writes as a view of its buffer where they lie contiguous (from a buffer's start, rows
    of a table), for a fast twin to write in place; None where they are parts of units (or a batch's rows apart)."""
    if not d.contiguous:
        return None
    b = d.base(env)
    return env.array(d.buf)[b: b + m * n].reshape(m, n)


def dst_at(d: Dst, env, m: int, n: int):
    """A call giving `dst_view(d, env, m, n)` as the step finds it, its buffer resolved once: a table's rows at the
    position a parameter holds, or the same view each step (then also the call's `fixed`); None where the values are
    not contiguous."""
    if not d.contiguous:
        return None
    a, size = env.array(d.buf), m * n
    if isinstance(d.row, str):
        row, pitch = env.array(d.row), d.pitch
        return lambda: a[int(row[0]) * pitch: int(row[0]) * pitch + size].reshape(m, n)
    v = dst_view(d, env, m, n)
    call = lambda: v  # noqa: E731
    call.fixed = v
    return call


def at_call(v):
    """What a bound operand is when the call runs: the array itself, or what its call gives."""
    return v() if callable(v) else v


def read_part_at(env, name: str, part: Part | None, units: int, width: int):
    """`read_part` for a bound call: its view, resolved once, where it is one; else a call gathering the part as
    the step finds it."""
    if part is None or units * part.pitch <= env.array(name).size:
        return read_part(env, name, part, units, width)
    return lambda: read_part(env, name, part, units, width)


def read_part(env, name: str, part: Part | None, units: int, width: int) -> np.ndarray:
    """`units` rows of `width` values of tensor `name`: the whole of it, or a part of every unit of it."""
    a = env.array(name)
    if part is None:
        return a[: units * width].reshape(units, width)
    assert part.width == width, f"part of width {part.width} read as {width}"
    if units * part.pitch <= a.size:  # a strided view: unit u's values from u·pitch + offset, nothing copied
        return a[: units * part.pitch].reshape(units, part.pitch)[:, part.offset: part.offset + width]
    return a[part.indices(units)].reshape(units, width)


def operand(env, name: str) -> np.ndarray:
    """The flat f32 values of an operand that may be a computed array or a constant (a bias, a broadcast row)."""
    try:
        return env.array(name)
    except KeyError:
        raw, fmt = env.weight(name)
        return decode(raw, fmt).reshape(-1)


_STORED = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}  # the dtype a format's values are stored as


def decode(raw: np.ndarray, fmt: str, out: np.ndarray | None = None) -> np.ndarray:
    """Checkpoint values to f32: f16 as float16, bf16 as the uint16 of its top half (shifted into the high half of
    an f32 word), a block format's bytes (rows of whole blocks, or flat) by its blocks (formats/blocks.py): (rows,
    cols) from (rows, row bytes), else flat. With `out` (flat f32, as many values): written there in one pass where
    the format allows (f16, bf16 and engine/formats/blocks.py's INTO), and `out` returned."""
    if fmt in BLOCKS:
        a = np.asarray(raw, dtype=np.uint8)
        if out is not None:
            return decode_blocks(a, fmt, out)
        v = decode_blocks(a, fmt)
        return v.reshape(a.shape[0], -1) if a.ndim == 2 else v
    if fmt not in _STORED:
        raise ValueError(f"unknown checkpoint format `{fmt}` (expected one of {', '.join(FORMATS)})")
    src = np.asarray(raw, dtype=_STORED[fmt])
    if out is None:
        if fmt == "f32":
            return src
        out = np.empty(src.shape, dtype=np.float32)
    else:
        src = src.reshape(-1)
    if fmt == "bf16":
        np.left_shift(src, 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(out, src)
    return out


def encode(values: np.ndarray, fmt: str) -> np.ndarray:
    """f32 values as checkpoint storage in `fmt` (bf16 rounded to nearest even; a block format's rows (rows, cols) as
    uint8 (rows, row bytes)), for tests and demo weights: formats/blocks.py's `encode`, which holds every format."""
    return encode_any(values, fmt)


def weight_bytes(fmt: str, rows: int, cols: int) -> int:
    """The bytes `rows` checkpoint rows of `cols` values take in `fmt` (a block format's rows whole blocks)."""
    if fmt in BLOCKS:
        return rows * row_bytes(fmt, cols)
    return rows * cols * DENSE.get(fmt, 4)


def table_rows(raw: np.ndarray, fmt: str, cols: int) -> np.ndarray:
    """Stored checkpoint rows (flat or not) as one row a row: (rows, cols) values, or (rows, row bytes) of blocks."""
    return np.asarray(raw).reshape(-1, row_bytes(fmt, cols) if fmt in BLOCKS else cols)


def format_refusal(fmt: str, cols: int, what: str) -> Refusal | None:
    """Why `what` (a kind, in words) cannot read checkpoint rows of `cols` values in `fmt`; None when it can."""
    if fmt not in FORMATS:
        return Refusal(f"weights in format `{fmt}` ({what} reads {', '.join(FORMATS)})")
    if fmt in BLOCKS:
        why = row_refusal(fmt, cols)
        if why:
            return Refusal(f"{why}: {what} decodes whole blocks")
    return None


def act(name: str, x: np.ndarray) -> np.ndarray:
    """The activations in f64, as the kernels compute them in f32."""
    x = np.asarray(x, dtype=np.float64)
    if name == "silu":
        return x / (1.0 + np.exp(-x))
    if name == "sigmoid":
        return 1.0 / (1.0 + np.exp(-x))
    if name == "gelu":
        return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
    if name == "gelu_erf":
        from lanefuse.engine.interp import erf

        return 0.5 * x * (1.0 + erf(x * 0.7071067811865476))
    raise ValueError(f"unknown activation `{name}` (expected one of {', '.join(ACTS)})")


def rms(x: np.ndarray, eps: float) -> np.ndarray:
    """1/sqrt(mean(x²) + eps) over the last axis, in f64."""
    x = np.asarray(x, dtype=np.float64)
    return 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


_vecdot = getattr(np, "vecdot", None)  # numpy >= 2: each head's sum of squares in one call


class RmsScale:
    """The fast twins' RMS norm of each head of `hd` values in f32, in a few calls on arrays made once (bound ahead):
    rmsnorm(x)·w = x·w' / r(x), w' = √hd·w (√hd without a weight) and r(x) = √(Σx² + hd·eps) each head's (`prepare`).
    A rotation, linear, may come between the product and the division (kernels/rope.py). A head whose f32 sum of
    squares leaves [SS_LOW, SS_HIGH] — it overflowed (activations past ~1e19), its squares underflowed (tiny or
    denormal values, a small eps), or it is NaN — is normed in f64 as the reference interpreter norms it."""

    SS_LOW = 2.0 ** -90  # below: squares lost to underflow may be more than f32 rounding of the sum
    SS_HIGH = 2.0 ** 100  # above: a partial sum may have overflowed (f32's largest is about 2^128)

    def __init__(self, rows: int, heads: int, hd: int, w: np.ndarray | None, eps: float):
        ones = np.ones(hd, np.float32) if w is None else np.asarray(w[:hd], dtype=np.float32)
        self.w = ones * np.float32(np.sqrt(hd))
        self.w64 = ones.astype(np.float64)
        self.eps = float(eps)
        self.hde = np.float32(hd * eps)
        self.ss = np.empty((rows, heads, 1), np.float32)

    def prepare(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out = x·w' and the roots r(x) (rows, heads, 1), in the array made once: out / r is rmsnorm(x)·w. A head
        the f32 sum cannot norm (see the class) is written to `out` normed already, in f64, its root 1. `out` may be
        x."""
        ss = self.ss
        if _vecdot is not None:
            _vecdot(x, x, out=ss[..., 0])
        else:
            np.einsum("rhd,rhd->rh", x, x, out=ss[..., 0])
        np.add(ss, self.hde, out=ss)
        bad = fixed = None
        if not (ss.min() >= self.SS_LOW and ss.max() <= self.SS_HIGH):  # NaN fails the comparison too
            bad = ~((ss >= self.SS_LOW) & (ss <= self.SS_HIGH))[..., 0]  # (rows, heads)
            x64 = x[bad].astype(np.float64)  # (heads normed apart, hd)
            fixed = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + self.eps) * self.w64
        np.sqrt(ss, out=ss)
        np.multiply(x, self.w, out=out)
        if bad is not None:
            out[bad] = fixed
            ss[bad] = 1.0
        return ss

    def __call__(self, x: np.ndarray, out: np.ndarray) -> None:
        """out = rmsnorm(x)·w (out may be x)."""
        r = self.prepare(x, out)
        np.divide(out, r, out=out)


def f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


class Chip(Protocol):
    """What a launch's `tune` reads of the lane's knobs (lane/lower/knobs.py `Knobs`)."""

    sms: int  # streaming multiprocessors
    wide_rows: int  # a product with at least this many outputs takes four rows a warp (rows_a_warp)
    attn_split_min: int  # attended positions a split of a split attention takes at least


class Launch:
    """The interface every launch kind fills in. Fields are the kind's frozen dataclass; everything else derives.
    A kind is a concrete subclass with a `census` name, found in its module by the registry (kernels/__init__.py)."""

    census: ClassVar[str] = ""
    stem: ClassVar[tuple[str, ...]] = ()  # the CUDA source: prelude.cu + each stem's .cu, in order (see compile.py)
    steps: ClassVar[tuple[str, ...]] = ()  # the lane's schedule steps `tune` honours (a held step is not taken)
    partial: ClassVar[tuple[str, ...]] = ()  # fields naming a tensor the launch reaches only a part of, by design

    def reads(self) -> tuple[str, ...]:
        """Tensors (arrays, weights, parameters) the launch reads."""
        raise NotImplementedError

    def writes(self) -> tuple[str, ...]:
        raise NotImplementedError

    def scratch(self) -> tuple[Scratch, ...]:
        return ()

    def check(self) -> Refusal | None:
        """Why the kernel cannot run this launch, in the user's words (`where` left to the caller); None when it
        can."""
        return None

    def extents(self, top: int, tokens: int) -> dict[str, int]:
        """How many elements of each tensor it names the launch reaches (reads or writes), from its fields: a saved
        plan's arrays and constants must hold at least that many (lane/lower/plancheck.py). `top` is the highest row
        a position parameter names (the cache's rows less the step's), `tokens` the number of token ids."""
        raise NotImplementedError

    def weights(self) -> dict[str, str | None]:
        """The constants the launch reads as weights, each with the format its kernel reads it in; None for an
        operand that may be an array or f32 values. Everything else it names is an array."""
        return {}

    def tune(self, knobs: Chip, held: Collection[str] = frozenset()) -> Launch:
        """This launch with the schedule's settings filled in for the chip `knobs` describes, taking none of the
        `held` steps; a kind with no settings (no `steps`) is as it is."""
        return self

    def kernels(self) -> tuple[Launch, ...]:
        """The kernel launches this launch makes, which the census and the launch counts count: itself."""
        return (self,)

    def batched(self, pos: str, slot: int) -> Launch | Refusal:
        """This launch in a batch step, each of its rows a sequence of its own at the position `pos` names for it,
        its cache rows the slot of `slot` rows from row·slot: itself where it touches no position; each result it
        writes into a table's rows at `pos` written into each sequence's slot (`Dst.slot`; every kernel writes
        through its Dst); a kind that reads the position itself sets its own batch fields in its own method (`slot`,
        and `seq0`, its first sequence); else why not."""
        if pos not in self.reads() and pos not in self.writes():
            return self
        got = batch_dsts(self, pos, slot)
        if isinstance(got, Refusal):
            return got
        if pos in own_names(got):
            return Refusal(f"a {self.census} launch over a batch's sequences (its kernel takes one sequence's "
                           f"position)")
        return got

    def bind_fast(self, env) -> Callable[[], None]:
        """The fast twin bound to `env`: a call that runs `fast(env)`, with what does not change from step to step
        (views of the arena and the tables, weights decoded once) resolved once where the kind does so. A decode
        step's launches each follow a product that streamed its weights through the caches, so every lookup a launch
        makes is a memory miss; the runner binds anew when the cache tables change."""
        return partial(self.fast, env)

    def apart(self) -> tuple[Launch, ...]:
        """The launch with each sequence of a batch apart (the `sequences` schedule step held): the same numbers,
        one launch a sequence for a kind that runs a batch's sequences as one; itself for the rest."""
        return (self,)

    def bytes(self) -> int:
        raise NotImplementedError

    def checkpoint_bytes(self) -> int:
        """The bytes of checkpoint rows (weight matrices, embedding rows) the launch reads, in their stored format:
        part of `bytes`, what a step's plan reports as the weight bytes it reads."""
        return 0

    def flops(self) -> int:
        return 0

    def numpy(self, env) -> None:
        """The exact twin: what the kernel computes, its sums imitated in f64 (what the GPU tests compare against)."""
        raise NotImplementedError

    def fast(self, env) -> None:
        """The fast twin the CPU runner runs: the same result within f32 rounding (f32 BLAS on weights decoded once);
        the exact twin where a kind has no faster one."""
        self.numpy(env)

    def fast_temp(self) -> int:
        """f32 values of temporaries the fast twin takes from `env.temp` (the tail of the numpy runner's arena)."""
        return 0

    def grid_block(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        raise NotImplementedError

    def cuda(self, denv) -> None:
        raise NotImplementedError

    def key(self) -> str:
        """A stable name for this launch: its census name, the first tensor it writes, a hash of its fields."""
        w = self.writes()
        return f"{self.census}:{w[0] if w else ''}:{hash(self) & 0xFFFFFFFF:08x}"

    def describe(self) -> str:
        vals = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return f"{self.census}({vals})"


def reach(*pairs) -> dict[str, int]:
    """(name, elements) pairs as {name: the most elements}, names that are None skipped."""
    out: dict[str, int] = {}
    for name, n in pairs:
        if isinstance(name, str):
            out[name] = max(out.get(name, 0), int(n))
    return out


def names(*xs) -> tuple[str, ...]:
    """The tensor names among xs, skipping None, in order, once each."""
    out: list[str] = []
    for x in xs:
        if isinstance(x, str) and x not in out:
            out.append(x)
    return tuple(out)
