"""`gemv` and `gemv_f32`: y = x · wᵀ (+ bias) for m rows of x, over checkpoint rows (n, k) in f32/f16/bf16 or a GGUF
block format (decoded in the kernel from the quantized bytes), or f32 values of the same layout — one kernel
(gemv.cu), a warp per output or four (`per_warp`), optional split-K in chunks of whole blocks; a gemv's outputs
soft-capped in its epilogue where `cap` > 0 (gemv_softcap: Gemma's final logits). With `quant` (gemv_quant: a product
another projection reads quantized) the output's quantized form too, the last block to store each 32 outputs of a slab
of rows quantizing them (gemv_quant.cu; 256 for llama.cpp's q8_K)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace
from functools import partial, update_wrapper
from typing import ClassVar

import numpy as np

from lanefuse.engine.formats.quantize import BLOCK_FORMATS, K_FORMATS
from lanefuse.engine.refusal import Refusal
from lanefuse.engine.formats.blocks import BLOCKS
from lanefuse.kernels.common import (FORMAT_CODE, GEMV_ROWS, MAX_GRID_Y, Q8K, Chip, Dst, Launch, Scratch, decode,
                                     at_call, dst_at, format_refusal, names, operand, qblock, reach, weight_bytes)
from lanefuse.kernels.q8dot import dequantized, q8_exact
from lanefuse.kernels.quant import QuantEpilogue, quant_bytes
from lanefuse.kernels.softcap import cap_check, capped

WARPS = 4  # warps a block


def chunk(k: int, split: int) -> int:
    """The k values each split-K chunk sums: whole four-value words (gemv_chunk in gemv.cu)."""
    return ((k + split - 1) // split + 3) // 4 * 4


def products(x: np.ndarray, w: np.ndarray, split: int) -> np.ndarray:
    """x (m, k) · w (n, k)ᵀ as the kernel sums it: each k chunk in f64 rounded to f32, chunks summed in order in f32."""
    k = x.shape[1]
    kc = chunk(k, split)
    acc = np.zeros((x.shape[0], w.shape[0]), dtype=np.float32)
    for z in range(split):
        k0, k1 = min(k, z * kc), min(k, (z + 1) * kc)
        part = (x[:, k0:k1].astype(np.float64) @ w[:, k0:k1].astype(np.float64).T).astype(np.float32)
        acc = part if z == 0 else (acc + part).astype(np.float32)
    return acc


def gemv_numpy(env, x: str, wv: np.ndarray, bias: str | None, y: Dst, k: int, n: int, m: int, split: int,
               cap: float = 0.0) -> None:
    xv = env.array(x)[: m * k].reshape(m, k)
    acc = products(xv, wv.reshape(n, k), split)
    if bias is not None:
        acc = (acc + operand(env, bias)[:n][None, :]).astype(np.float32)
    y.write(env, capped(acc, cap))


FAST_GEMVS = 2  # the fast twins: up to this many rows a product is a GEMV a row, not a GEMM


def by_gemvs(m: int) -> bool:
    """Whether x (m, k) · w (n, k)ᵀ runs as m GEMVs: OpenBLAS's GEMM of a few rows costs 2-3.6 GEMVs on a decode
    step's shapes. Two GEMVs take 0.57-0.9 of a 2-row GEMM's time (each shape against its better GEMM layout; a
    batch of 2 decodes x1.56-1.73 the tokens/s, bench/batch_figures.py's model, both ways interleaved in one
    process); 3 or 4 were no faster in a step (x0.97-1.16, within the machine's noise)."""
    return m <= FAST_GEMVS


def fast_products(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    """out (m, n) = x (m, k) · w (n, k)ᵀ by f32 BLAS, in place: a GEMV a row for one or two rows (`by_gemvs`), else
    a GEMM."""
    if by_gemvs(x.shape[0]):
        for i in range(x.shape[0]):
            np.matmul(w, x[i], out=out[i])
    else:
        np.matmul(x, w.T, out=out)


def activation_at(env, name: str, m: int, k: int, words: int = 0):
    """A product's activation (m, k) for a bound call: a view of its array, or (a quantized activation, `words`) a
    call dequantizing it as the step finds it (kernels/q8dot.py)."""
    if words:
        return lambda: dequantized(*env.quant(name), m, k)
    return env.array(name)[: m * k].reshape(m, k)


COLUMNS_TALL = 2  # a stacked product of at least this many outputs a value of k reads its matrix stored transposed


def rows_at(env, names: tuple[str, ...], n: int, k: int):
    """The f32 matrix (n, k) of constants `names` (several: stacked, their rows in turn) for a bound call: decoded
    once, or (the env streams its weights) a call decoding it for each launch. A stacked matrix of n >= COLUMNS_TALL·k
    (q/k/v, gate and up) is stored transposed and given as the (n, k) view of it: OpenBLAS multiplies a few rows by a
    tall matrix much faster that way (6144 x 1024: 2, 4, 16 and 64 rows in 0.66, 0.62, 0.66 and 0.77 of the time;
    a GEMV 0.92), not a square or wide one (1024 x 3072: 0.97-1.07). bench/batch_figures.py's model, one process, the
    two layouts' runners interleaved: a batch of 2, 4, 8 at x1.14-1.16 the tokens/s, a prefill chunk of 64 x1.07,
    decode x1.04. The stacked copy costs nothing more so."""
    if not env.stream and len(names) > 1 and n >= COLUMNS_TALL * k:
        return env.columns(names, k).reshape(k, n).T

    def get():
        return (env.matrix(names[0]) if len(names) == 1 else env.stacked(names)).reshape(n, k)

    return get if env.stream else get()


def bound_product(x, w, out, bias: np.ndarray | None = None):
    """A call computing out (m, n) = x (m, k) · w (n, k)ᵀ (+ bias) by f32 BLAS; each of x, w and out an array resolved
    ahead or a call giving it as the step finds it (`activation_at`, `rows_at`, `dst_at`). All three fixed and no
    bias: the BLAS call itself, its arguments bound. Either way `finite_or_exact` guards it."""
    fixed = [getattr(v, "fixed", None) if callable(v) else v for v in (x, w, out)]
    if bias is None and all(v is not None for v in fixed):
        xf, wf, of = fixed
        if xf.shape[0] == 1:
            return finite_or_exact(partial(np.matmul, wf, xf[0], out=of[0]), x, w, out)
        if by_gemvs(xf.shape[0]):
            rows = [partial(np.matmul, wf, xf[i], out=of[i]) for i in range(xf.shape[0])]

            def gemvs():
                for row in rows:
                    row()

            return finite_or_exact(gemvs, x, w, out)
        return finite_or_exact(partial(np.matmul, xf, wf.T, out=of), x, w, out)

    def call():
        y = at_call(out)
        fast_products(at_call(x), at_call(w), y)

    guarded = finite_or_exact(call, x, w, out)
    if bias is None:
        return guarded

    def biased():
        guarded()
        y = at_call(out)
        np.add(y, bias, out=y)

    return biased


def finite_or_exact(product, x, w, out):
    """`product` (out = x · wᵀ in f32 BLAS), then each row of `out` that is not finite computed again in f64, as the
    exact twin and the reference compute it: an f32 partial sum past f32's largest value (or inf - inf) where the
    product itself fits, which f32 BLAS alone turns into inf or NaN. Two reductions a call when all is finite."""
    inf = np.inf

    def call():
        product()
        o = at_call(out)
        hi, lo = o.max(), o.min()
        if hi < inf and lo > -inf:  # NaN fails both
            return
        xs, ws = at_call(x), at_call(w)
        bad = ~np.isfinite(o).all(axis=1)
        w64 = np.asarray(ws, dtype=np.float64)
        for i in np.flatnonzero(bad):
            with np.errstate(over="ignore", invalid="ignore"):
                o[i] = (w64 @ np.asarray(xs[i], dtype=np.float64)).astype(np.float32)

    return update_wrapper(call, product)  # named as the product it guards (`gemvs`), which `__wrapped__` is


def gemv_bind(env, x: str, w: str, bias: str | None, y: Dst, k: int, n: int, m: int, cap: float = 0.0,
              words: int = 0):
    """The fast twin of `gemv_numpy`, bound to `env`: the product in f32 (any split-K sums the same values), written
    straight into y's view where y is contiguous, else through a temporary (`env.temp`, m·n values); a quantized
    activation (`words`) dequantized first."""
    view = dst_at(y, env, m, n)
    acc = view if view is not None else env.temp(m * n).reshape(m, n)
    product = bound_product(activation_at(env, x, m, k, words), rows_at(env, (w,), n, k), acc,
                            operand(env, bias)[:n] if bias is not None else None)
    if cap <= 0 and view is not None:
        return product

    def call():
        product()
        a = at_call(acc)
        if cap > 0:
            a /= cap
            np.tanh(a, out=a)
            a *= cap
        if view is None:
            y.write(env, a)

    return call


def gemv_grid(n: int, m: int, per_warp: int, split: int):
    return ((-(-n // (WARPS * per_warp)), -(-m // GEMV_ROWS), split), (32 * WARPS, 1, 1))


def gemv_cuda(launch, denv, fmt: str, per_warp: int, cap: float = 0.0) -> None:
    from lanefuse.kernels.cupy_env import NULL, f32, i64

    grid, block = gemv_grid(launch.n, launch.m, per_warp, launch.split)
    raw = denv.weight(launch.w)[0]
    bias = denv.opt(launch.bias)
    code = i64(FORMAT_CODE[fmt])
    if launch.split == 1:
        f = denv.function(("gemv_core", "gemv"), f"gemv_{per_warp}")
        f(grid, block, (denv.array(launch.x), raw, code, bias, *denv.dst(launch.y), NULL,
                        i64(launch.k), i64(launch.n), i64(launch.m), i64(1), f32(cap)))
        return
    part = denv.scratch(launch, launch.scratch()[0])
    f = denv.function(("gemv_core", "gemv"), f"gemv_{per_warp}")
    f(grid, block, (denv.array(launch.x), raw, code, NULL, *denv.dst(launch.y), part,
                    i64(launch.k), i64(launch.n), i64(launch.m), i64(launch.split), f32(0.0)))
    total = launch.m * launch.n
    c = denv.function(("gemv_core", "gemv"), "gemv_combine")
    c((min(1024, -(-total // 256)),), (256,), (part, bias, *denv.dst(launch.y), i64(launch.n), i64(launch.m),
                                              i64(launch.split), f32(cap)))


def block_values(fmt: str) -> int:
    """The values a tile of k must hold whole: a block format's block, else one four-value word."""
    return BLOCKS[fmt][0] if fmt in BLOCKS else 4


def gemv_check(k: int, n: int, m: int, per_warp: int, split: int, fmt: str = "f32") -> Refusal | None:
    if min(k, n, m) < 1:
        return Refusal(f"a product of no values ({m} rows, k {k}, n {n})")
    if per_warp not in (1, 4):
        return Refusal(f"{per_warp} outputs a warp (the GEMV takes 1 or 4)")
    if split < 1 or (split > 1 and chunk(k, split) * (split - 1) >= k):
        return Refusal(f"a split-K of {split} over k {k} leaves a chunk empty")
    if split > 1 and fmt in BLOCKS and chunk(k, split) % BLOCKS[fmt][0]:
        return Refusal(f"a split-K of {split} over k {k} in chunks of {chunk(k, split)} values, which split {fmt} "
                       f"blocks of {BLOCKS[fmt][0]}")
    if split > MAX_GRID_Y or -(-m // GEMV_ROWS) > MAX_GRID_Y:
        return Refusal(f"a product of {m} rows split {split} ways (a launch takes at most {MAX_GRID_Y} slabs of "
                       f"{GEMV_ROWS} rows and {MAX_GRID_Y} splits)")
    return None


STAGED_UNIT = {"q8_0": 256, "q4_0": 256, "q4_k": 256, "q6_k": 2048}  # gemv_core.cu's staged tile: k's multiple


def slab_staged(fmt: str, k: int, split: int = 1) -> bool:
    """Whether a slab of `fmt` rows takes the staged tile at one output a warp: k and each split's chunk whole runs
    of the format's stage units (gemv_core.cu gemv_tile's `st`)."""
    u = STAGED_UNIT.get(fmt, 0)
    return bool(u) and k % u == 0 and chunk(k, split) % u == 0


def rows_a_warp(n: int, knobs: Chip, held: Collection[str], fmt: str = "f32", m: int = 1, k: int = 0) -> int:
    """Outputs a warp for a product of n outputs (`rows_a_warp`): four once it has at least `wide_rows`; one where a
    slab of m > 2 rows of block-format rows takes the staged tile (built at one output a warp: at four it spilled)."""
    if m > GEMV_ROWS // 4 and slab_staged(fmt, k):
        return 1
    return 4 if "rows_a_warp" not in held and n >= knobs.wide_rows else 1


def split_k(n: int, k: int, m: int, per_warp: int, knobs: Chip, held: Collection[str], fmt: str = "f32") -> int:
    """The splits of k (`split_k`) for a product of one slab of rows whose blocks do not fill the chip: until they
    fill it once, each split at least 512 values of k, at most 16; in a block format, the most of those whose chunks
    hold whole blocks (a chunk never splits a block)."""
    if "split_k" in held or m > GEMV_ROWS:
        return 1
    blocks = -(-n // (WARPS * per_warp))
    if blocks >= knobs.sms:
        return 1
    split = max(1, min(-(-knobs.sms // blocks), k // 512, 16))
    while split > 1 and gemv_check(k, n, m, per_warp, split, fmt) is not None:
        split -= 1
    return split


# The lane's price of a GEMV-family loop at a slab of 3..GEMV_ROWS rows of x (gemv_core.cu gemv_tile's AR = GR) where
# the loop, not the bytes, bounds it. One or two rows stream near the copy bandwidth (gemv_tile16, the staged and
# block tiles), and so does a slab of f32/f16/bf16 rows of whole 16-byte words through gemv_slab_cp (a ring of
# SLAB_STAGES 16-byte steps a row a lane in shared memory): the lane's bytes over hbm_gbps price those. A slab of
# block-format rows (or of rows not whole words, or fold_parts_rope_1's products) runs gemv_tile_any, four values a lane a dependent
# round of knob hbm_round_us, many times its bytes' time (4096 x 4096 q8_0: 32 rounds, 65 µs against 4 µs of bytes),
# which the lane sees through `rate`. PREDICTIONS of bench/launch_model.py's kind (no device has run a slab). Dense
# slabs are left at the bytes price: priced by their rounds (2 µs each) a 3-row GLU of small k costs twice a
# gate-and-up product in parts, and the lane then splits it into parts and a GLU launch, whose 2 µs gap (knob
# launch_us) is a fifth of a launch's fixed cost in the launch model (t0 10.3 µs).
SLAB_STAGES = {4: 4, 1: 16}  # gemv_slab_cp's ring by outputs a warp (gemv_core.cu SLAB_STAGES)
GEMV_RESIDENT = 3  # the GEMV kernels' blocks a SM (GEMV_BOUNDS: __launch_bounds__(128, 3))


def slab_16byte(fmt: str, k: int, split: int) -> bool:
    """Whether a slab takes gemv_slab_cp: f32/f16/bf16 rows, k and each split's chunk whole 16-byte words."""
    vw = 4 if fmt == "f32" else 8
    return fmt in ("f32", "f16", "bf16") and k % vw == 0 and chunk(k, split) % vw == 0


def slab_loop_us(fmt: str, k: int, n: int, m: int, per_warp: int, split: int, tiles: int, knobs,
                 ring: bool = True) -> float:
    """The loop's µs of a GEMV-family kernel (`tiles` products a warp: the GLU's two) at m > 2 rows where the slab
    takes gemv_tile_any: each warp's dependent rounds (128 values of its k chunk each) times knob hbm_round_us (the
    launch model's fitted L), in waves of
    sms x GEMV_RESIDENT blocks over the slabs, outputs and splits. 0 at one or two rows, and where the slab streams
    through gemv_slab_cp (the bytes price it; ring False: a kernel built without it, fold_parts_rope_1). A slab of
    block rows through the staged tile (one output a warp) streams its weights but reads every output's rows of x from
    L1: those reads at knob l1_tbps (the weights' bytes price the rest)."""
    if m <= GEMV_ROWS // 4 or (ring and slab_16byte(fmt, k, split)):
        return 0.0
    if ring and per_warp == 1 and slab_staged(fmt, k, split):  # the staged tile: its rows of x read from L1 once
        return n * k * m * 4.0 * tiles / (knobs.l1_tbps * 1e6)  # an output (the weights stream: their bytes' price)
    rounds = -(-chunk(k, split) // 128)
    blocks = -(-n // (WARPS * per_warp)) * -(-m // GEMV_ROWS) * split
    waves = -(-blocks // (knobs.sms * GEMV_RESIDENT))
    return waves * rounds * tiles * knobs.hbm_round_us


def loop_rate(flops: int, loop_us: float, knobs) -> float:
    """The rate of a launch's flops (TFLOP/s; lane/lower/shim.launch_us divides the flops by it) that its loop's µs
    leaves: at most the CUDA cores' peak (knob tflops_f32), which a loop of 0 µs leaves as it is."""
    return knobs.tflops_f32 if loop_us <= flops / (knobs.tflops_f32 * 1e6) else flops / loop_us / 1e6


@dataclass(frozen=True)
class RowsProduct(Launch):
    """The fields a product of checkpoint rows leads with (Gemv; GemmTc, kernels/gemm_tc.py, on the tensor cores):
    y (m, n) = x (m, k) · wᵀ (+ bias (n,)), w checkpoint rows (n, k) in `format`, y landing in a Dst."""

    x: str
    w: str
    format: str
    y: Dst
    k: int
    n: int
    m: int
    bias: str | None = None


@dataclass(frozen=True)
class Gemv(QuantEpilogue, RowsProduct):
    """y (m, n) = x (m, k) · wᵀ (+ bias (n,)), w checkpoint rows (n, k) in `format`; `per_warp` outputs a warp;
    `split` > 1 sums k in that many chunks (partials in scratch, a combine pass)."""

    per_warp: int = 1
    split: int = 1
    cap: float = 0.0  # > 0: each output soft-capped, cap · tanh(y / cap), as it is stored
    words: int = 0  # > 0: x is a quantized activation of that many int8 words a value (q8 1, q8x2 2): gemv_q8.cu
    quant: str | None = None  # the output's quantized form, written by the last blocks (gemv_quant)
    quant_words: int = 0  # its int8 words a value (q8 1, q8x2 2, the q8k form 3)

    census: ClassVar[str] = "gemv"
    words_field: ClassVar[str] = "quant_words"  # the output's form (`words`: the activation's)
    stem: ClassVar[tuple[str, ...]] = ("quant", "gemv_core", "gemv", "gemv_q8", "gemv_quant")
    steps: ClassVar[tuple[str, ...]] = ("rows_a_warp", "split_k")

    def reads(self):
        return names(self.x, self.w, self.bias, *self.y.params())

    def writes(self):
        return names(self.y.buf, self.quant)

    def scratch(self):
        if self.quant is not None:  # an arrival counter a block of outputs and a slab of rows
            slabs = -(-self.m // GEMV_ROWS)
            return (Scratch("arrivals", "i32", 4 * (self.n // qblock(self.quant_words)) * slabs, counter=True),)
        if self.split == 1:
            return ()
        return (Scratch("partials", "f32", 4 * self.split * self.m * self.n),)

    def check(self):
        return (format_refusal(self.format, self.k, "the GEMV") or cap_check(self.cap, "a product's outputs")
                or q8_check(self.words, self.format, self.k, self.split) or self.quant_refusal()
                or gemv_check(self.k, self.n, self.m, self.per_warp, self.split, self.format))

    def quant_refusal(self) -> Refusal | None:
        if self.quant is None:
            return None
        why = self.epilogue_refusal(self.n, "a product's output row")
        if why:
            return why
        if self.y != Dst(self.y.buf):
            return Refusal("a product quantizing an output it writes into a table's rows or a part of a wider array")
        if self.split != 1:
            return Refusal(f"a product quantizing its output split {self.split} ways along k (its last blocks "
                           f"quantize whole outputs)")
        return None

    def tune(self, knobs, held=frozenset()):
        if self.words:
            return replace(self, per_warp=1, split=1)  # gemv_q8: a warp an output, no split of k
        pw = rows_a_warp(self.n, knobs, held, self.format, self.m, self.k)
        if self.quant is not None:
            return replace(self, per_warp=pw, split=1)
        return replace(self, per_warp=pw, split=split_k(self.n, self.k, self.m, pw, knobs, held, self.format))

    def extents(self, top, tokens):
        return reach((self.x, self.m * self.k), (self.w, self.n * self.k), (self.bias, self.n),
                     (self.y.buf, self.y.extent(self.m * self.n, top)), (self.quant, self.m * self.n))

    def weights(self):
        return {self.w: self.format, **({self.bias: None} if self.bias else {})}

    def checkpoint_bytes(self):
        return weight_bytes(self.format, self.n, self.k)

    def bytes(self):
        return (self.checkpoint_bytes() + activation_bytes(self.m * self.k, self.words) + 4 * self.m * self.n
                + (4 * self.n if self.bias else 0) + self.epilogue_bytes(self.m * self.n))

    def flops(self):
        return 2 * self.m * self.n * self.k

    def loop_us(self, knobs, ring: bool = True) -> float:
        """The loop's µs at a slab (slab_loop_us; gemv_q8.cu's product over a quantized activation: 0, unpriced);
        ring False: in a kernel built without the slab's ring (fold_parts_rope_1)."""
        return 0.0 if self.words else slab_loop_us(self.format, self.k, self.n, self.m, self.per_warp, self.split, 1,
                                                    knobs, ring)

    def rate(self, knobs) -> float:
        return loop_rate(self.flops(), self.loop_us(knobs), knobs)

    def numpy(self, env):
        raw, fmt = env.weight(self.w)
        if self.words:
            acc = q8_exact(*env.quant(self.x), raw, fmt, self.m, self.n, self.k)
            if self.bias is not None:
                acc = (acc + operand(env, self.bias)[: self.n][None, :]).astype(np.float32)
            self.y.write(env, capped(acc, self.cap))
        else:
            gemv_numpy(env, self.x, decode(raw, fmt), self.bias, self.y, self.k, self.n, self.m, self.split, self.cap)
        self.quantize(env)

    def quantize(self, env):
        """The output's quantized form from the f32 values stored (as the last blocks read them back; y is plain)."""
        if self.quant is not None:
            self.epilogue_write(env, env.array(self.y.buf)[: self.m * self.n])

    def fast(self, env):
        self.bind_fast(env)()

    def bind_fast(self, env):
        call = gemv_bind(env, self.x, self.w, self.bias, self.y, self.k, self.n, self.m, self.cap, self.words)
        if self.quant is None:
            return call

        def quantizing():
            call()
            self.quantize(env)

        return quantizing

    def fast_temp(self):
        return 0 if self.y.contiguous else self.m * self.n

    def grid_block(self):
        return gemv_grid(self.n, self.m, self.per_warp, self.split)

    def cuda(self, denv):
        if self.quant is not None:
            gemv_quant_cuda(self, denv)
        elif self.words:
            gemv_q8_cuda(self, denv)
        else:
            gemv_cuda(self, denv, self.format, self.per_warp, self.cap)


def activation_bytes(values: int, words: int) -> int:
    """The bytes a product reads of its activation: 4 a value, or its quantized form's words and scales (and a q8k
    form's sums of 16 words)."""
    return 4 * values if not words else quant_bytes(values, words)


def q8_check(words: int, fmt: str, k: int, split: int) -> Refusal | None:
    if not words:
        return None
    if words not in (1, 2, Q8K):
        return Refusal(f"an activation of {words} int8 words a value (q8 reads one, q8x2 two)")
    if words == Q8K and fmt not in K_FORMATS:
        return Refusal(f"a q8k activation (llama.cpp's q8_K) times {fmt} rows (gemv_q8 multiplies it by "
                       f"{', '.join(K_FORMATS)} rows only)")
    if fmt not in BLOCK_FORMATS:
        return Refusal(f"a quantized activation times {fmt} rows (int8 products need block-quantized rows: "
                       f"{', '.join(BLOCK_FORMATS)})")
    if k % qblock(words):
        return Refusal(f"a quantized activation of rows of {k} values, not whole {qblock(words)}-value blocks")
    if split != 1:
        return Refusal(f"a quantized activation's product split {split} ways along k (gemv_q8 sums k whole)")
    return None


def q8_code(fmt: str, words: int) -> int:
    """The format argument gemv_q8.cu's tile takes: the rows' FORMAT_CODE, plus Q8K_CODE where the activation is a
    q8k form (its super-block path)."""
    return FORMAT_CODE[fmt] | (Q8K_CODE if words == Q8K else 0)


Q8K_CODE = 16  # gemv_q8.cu's QK flag


def gemv_q8_cuda(launch, denv) -> None:
    from lanefuse.kernels.cupy_env import f32, i64

    words, low, scales = denv.quant(launch.x)
    grid = (-(-launch.n // WARPS), -(-launch.m // GEMV_ROWS), 1)
    f = denv.function(("gemv_core", "gemv", "gemv_q8"), "gemv_q8")
    f(grid, (32 * WARPS, 1, 1), (words, low, scales, denv.weight(launch.w)[0],
                                 i64(q8_code(launch.format, launch.words)),
                                 denv.opt(launch.bias), *denv.dst(launch.y), i64(launch.k), i64(launch.n),
                                 i64(launch.m), f32(launch.cap)))


def gemv_quant_cuda(launch: Gemv, denv) -> None:
    """gemv_quant.cu: the product (gemv_core's, or gemv_q8's over a quantized activation) and its quantizing tail."""
    from lanefuse.kernels.cupy_env import f32, i64

    tail = (denv.scratch(launch, launch.scratch()[0]), *launch.epilogue_args(denv))
    w, fmt = denv.weight(launch.w)[0], i64(q8_code(launch.format, launch.words) if launch.words
                                              else FORMAT_CODE[launch.format])
    y, cap = denv.array(launch.y.buf), f32(launch.cap)
    k, n, m = i64(launch.k), i64(launch.n), i64(launch.m)
    if launch.words:
        grid = (launch.n // WARPS, -(-launch.m // GEMV_ROWS), 1)
        f = denv.function(launch.stem, "gemv_q8_quant")
        f(grid, (32 * WARPS, 1, 1), (*denv.quant(launch.x), w, fmt, denv.opt(launch.bias), y, k, n, m, cap, *tail))
        return
    grid, block = gemv_grid(launch.n, launch.m, launch.per_warp, 1)
    f = denv.function(launch.stem, f"gemv_quant_{launch.per_warp}")
    f(grid, block, (denv.array(launch.x), w, fmt, denv.opt(launch.bias), y, k, n, m, cap, *tail))


@dataclass(frozen=True)
class GemvF32(Launch):
    """y (m, n) = x (m, k) · wᵀ (+ bias), w f32 values (n, k) (a constant that is not checkpoint rows).

    Why it exists (seed 002's link: a matmul by `values`, not rows, is `Launch::GemvF32`): a matrix the step holds as
    f32 values — one a step YAML declares `kind: values`, or one a front computes rather than reads from the checkpoint
    — has no format to decode. No front of this project declares a 2-D constant as values (engine/front/decoder.py
    makes every matrix checkpoint rows), so none reaches it; tests/test_issue40_rows.py plans it from the demo
    decoder's step with its LM head and one k projection held as values, against the reference."""

    x: str
    w: str
    y: Dst
    k: int
    n: int
    m: int
    bias: str | None = None
    split: int = 1

    census: ClassVar[str] = "gemv_f32"
    stem: ClassVar[tuple[str, ...]] = ("gemv_core", "gemv")
    per_warp: ClassVar[int] = 1

    def reads(self):
        return names(self.x, self.w, self.bias, *self.y.params())

    def writes(self):
        return (self.y.buf,)

    def scratch(self):  # no quantized output (Gemv's own reads its `quant`, a field this launch has not)
        return () if self.split == 1 else (Scratch("partials", "f32", 4 * self.split * self.m * self.n),)

    def check(self):
        return gemv_check(self.k, self.n, self.m, 1, self.split)

    def extents(self, top, tokens):
        return reach((self.x, self.m * self.k), (self.w, self.n * self.k), (self.bias, self.n),
                     (self.y.buf, self.y.extent(self.m * self.n, top)))

    def weights(self):
        return {self.w: "f32", **({self.bias: None} if self.bias else {})}

    def checkpoint_bytes(self):
        return 4 * self.n * self.k

    def bytes(self):
        return 4 * (self.n * self.k + self.m * self.k + self.m * self.n + (self.n if self.bias else 0))

    def flops(self):
        return 2 * self.m * self.n * self.k

    def numpy(self, env):
        raw, _ = env.weight(self.w)
        gemv_numpy(env, self.x, np.asarray(raw, dtype=np.float32), self.bias, self.y, self.k, self.n, self.m,
                   self.split)

    def fast(self, env):
        self.bind_fast(env)()

    def bind_fast(self, env):
        return gemv_bind(env, self.x, self.w, self.bias, self.y, self.k, self.n, self.m)

    def fast_temp(self):
        return Gemv.fast_temp(self)  # type: ignore[arg-type]

    def grid_block(self):
        return gemv_grid(self.n, self.m, 1, self.split)

    def cuda(self, denv):
        gemv_cuda(self, denv, "f32", 1)
