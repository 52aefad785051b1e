"""`rope` and `rope_parts`: the rotary embedding of every head of a row (HF rotate_half over the first `rot` values,
position pos + row), optionally per-head RMS-normed first, read as a part of every unit and landing where a Dst says
(e.g. rows of a cache table from the row `pos` names). `rope_parts` turns several sides (q and k) sharing cos, sin
and pos in one launch; `rope` is the launch of one side. One kernel (rope.cu). In a batch (`slot` set) each row is a
sequence of its own: row s (from `seq0`) at position pos[s], a Dst whose row pos names taking it to row s·slot + pos[s]
of its table (its sequence's slot: `Dst.slot`)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from lanefuse.engine.formats import ggml
from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import (Q8K, Dst, Launch, Part, RmsScale, batch_apart, batch_dsts, dst_at,
                                     format_refusal, names, reach, read_part, read_part_at, rms)
from lanefuse.kernels.head_gemv import HeadGemv
from lanefuse.kernels.quant import QuantEpilogue

MAX_HD = 1024


@dataclass(frozen=True)
class Absorb:
    """A side's heads taken into another space by each head's own matrix (the lifted `head_matmul`), instead of normed
    or rotated: y[r, h, j] = sum_i x[r, h, i] * W(h, i, j), W head h's checkpoint rows (rows_out: (b, a) at h*b; else
    (a, b) at h*a, as kernels/head_gemv.py lays them). DeepSeek-V3's query absorption in q_b's product epilogue."""

    w: str
    format: str
    b: int  # a head's output values
    rows_out: bool = False


@dataclass(frozen=True)
class RopeSide(QuantEpilogue):
    """One rotation of a launch: x (rows, heads·hd) (or a part of every row of a wider tensor), its optional
    per-head norm (weight (hd,), eps), and where the rotated heads land."""

    x: str
    y: Dst
    heads: int
    part: Part | None = None
    norm: tuple[str, float] | None = None
    hd: int = 0  # its own head width (0: the launch's)
    rot: int = -1  # its own rotated width (-1: the launch's; 0: normed only, no rotation: a row norm in a product's
    # epilogue, DeepSeek-V3's q_a and latent norms; only fold.cu's products-in-parts epilogue runs such a side)
    absorb: Absorb | None = None  # each head times its own matrix (hd its input width, rot 0, no norm): fold.cu only
    quant: str | None = None  # a row norm's result quantized as it is stored (the q8 numerics): fold.cu only
    words: int = 0  # its words a value (q8 1, q8x2 2, q8k 3: llama.cpp's q8_K, blocks of 256)

    @property
    def width(self) -> int:
        """The values a row of the side's result holds, given its head width: an absorbed side's heads are b wide."""
        return self.heads * self.absorb.b if self.absorb is not None else 0

    @property
    def own_shape(self) -> bool:
        return self.hd != 0 or self.rot != -1 or self.absorb is not None


def side_shape(s: RopeSide, hd: int, rot: int) -> tuple[int, int]:
    """The side's head width and rotated width: its own where it says, else the launch's."""
    return (s.hd or hd), (rot if s.rot < 0 else s.rot)


def absorbing(s: RopeSide, rows: int, hd: int) -> HeadGemv:
    """An absorbing side as the per-head product it computes (its numbers, its checkpoint rows): x the side's raw
    product read whole from its first row (an absorbing side reads no part and never runs apart: Fold.apart)."""
    ab = s.absorb
    return HeadGemv(s.x, ab.w, ab.format, s.y, rows, s.heads, hd, ab.b, rows_out=ab.rows_out)


def side_numpy(env, s: RopeSide, cos: str, sin: str, pos: str, rows: int, hd: int, rot: int, slot: int = 0,
               seq0: int = 0) -> None:
    hd, rot = side_shape(s, hd, rot)
    w = s.heads * hd
    n = seq0 + rows
    if s.absorb is not None:  # as the epilogue sums: each output's dot in f64, rounded to f32
        absorbing(s, rows, hd).numpy(env)
        return
    x = read_part(env, s.x, s.part, n, w)[seq0:].astype(np.float32).reshape(rows, s.heads, hd)
    if s.norm is not None and rot == 0 and s.quant is not None and s.words in ggml.WORDS:
        x = ggml.rmsnorm(x, np.asarray(env.weight(s.norm[0])[0], dtype=np.float32)[:hd], s.norm[1])  # llama.cpp's
    elif s.norm is not None:
        nw = np.asarray(env.weight(s.norm[0])[0], dtype=np.float64)[:hd]
        x = (x * rms(x, s.norm[1]) * nw).astype(np.float32)
    if rot == 0:  # normed only
        s.y.write(env, x, first=seq0 * w)
        # the quantized form from the f32 values stored, as the epilogue quantizes them
        s.epilogue_write(env, x.reshape(rows, w), start=seq0 * w)
        return
    half = rot // 2
    p = env.array(pos)[seq0:n].astype(np.int64) if slot else env.param(pos) + np.arange(rows)
    llama = ggml.plan_rope(env) if (cos, sin) == ("rope.cos", "rope.sin") and rot == hd else None
    if llama is not None and llama.cos.shape[1] == half:  # q8: llama.cpp's rope cache and rotation (interp's too)
        y = x.copy()
        y[..., :half], y[..., half:rot] = ggml.rope(x[..., :half], x[..., half:rot], llama.cos[p][:, None, :],
                                                    llama.sin[p][:, None, :])
        s.y.write(env, y, first=seq0 * w)
        return
    x = x.astype(np.float64)
    c = env.weight(cos)[0].reshape(-1, half)[p][:, None, :].astype(np.float64)
    sn = env.weight(sin)[0].reshape(-1, half)[p][:, None, :].astype(np.float64)
    y = x.copy()
    x1, x2 = x[..., :half], x[..., half:rot]
    y[..., :half] = x1 * c - x2 * sn
    y[..., half:rot] = x2 * c + x1 * sn
    s.y.write(env, y, first=seq0 * w)  # a batch's rows from its first sequence's (each in its slot: Dst.slot)


def rope_tables(env, cos: str, sin: str, half: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every position as the fast twin's rotation reads them, made once an env: C (positions, 2, half)
    holding (cos, cos) and S holding (-sin, sin), so that a head's rotated pairs are x·C + x'·S with x' the head's
    halves swapped (a view: the pair axis reversed)."""
    made = _TABLES.setdefault(env, {})
    key = (cos, sin, half)
    if key not in made:
        c, sn = env.weight(cos)[0].reshape(-1, half), env.weight(sin)[0].reshape(-1, half)
        made[key] = (np.stack([c, c], axis=1), np.stack([-sn, sn], axis=1))
    return made[key]


_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # env -> {(cos, sin, half): (C, S)}


def side_bind(env, s: RopeSide, cos: str, sin: str, pos: str, rows: int, hd: int, rot: int, t: np.ndarray,
              slot: int = 0, seq0: int = 0):
    """The fast twin of `side_numpy`, bound to `env`: the same rotation in f32 in a few whole-array operations on
    views resolved once (the part read in place, the rotation tables' rows of the positions the call finds), written
    straight into the destination's view where it is contiguous and apart from the source. A normed side scales each
    head after its rotation (the rotation is linear): x·(√hd·w) rotated, divided by √(Σx² + hd·eps). `t`
    (3·rows·heads·hd values of the arena's tail) holds x·(√hd·w), the rotated heads where they have no view of their
    own, and the swapped halves' products."""
    hd, rot = side_shape(s, hd, rot)
    n, w, heads = seq0 + rows, s.heads * hd, s.heads
    if s.absorb is not None:  # each head's product in f32 BLAS, a batched matmul over the heads
        return absorbing(s, rows, hd).bind_fast(env)
    xs = read_part_at(env, s.x, s.part, n, w)
    x0 = None if callable(xs) else xs[seq0:].reshape(rows, heads, hd)  # None: a gather each step
    view = dst_at(s.y, env, rows, w) if not seq0 else None
    if view is not None and s.norm is None and x0 is not None and np.may_share_memory(getattr(view, "fixed", ()), x0):
        view = None  # rotated in place: through the temporary
    half = rot // 2
    xn, yt = t[: rows * w].reshape(rows, heads, hd), t[rows * w: 2 * rows * w].reshape(rows, heads, hd)
    sw = t[2 * rows * w: 2 * rows * w + rows * heads * rot].reshape(rows, heads, 2, half) if rot else None
    norm = RmsScale(rows, heads, hd, env.weight(s.norm[0])[0], s.norm[1]) if s.norm is not None else None
    ct, st = rope_tables(env, cos, sin, half) if rot else (None, None)
    at = env.array(pos) if rot else None
    mul, add, divide = np.multiply, np.add, np.divide

    def call():
        x = x0 if x0 is not None else xs()[seq0:].reshape(rows, heads, hd)
        if norm is not None:
            ss = norm.prepare(x, xn)  # x·w' (a head f32 cannot norm: normed already, its root 1)
            x = xn
        if rot == 0:  # normed only
            if norm is not None:
                divide(x, ss, out=x)
            s.y.write(env, x, first=seq0 * w)
            s.epilogue_write(env, x.reshape(rows, w), start=seq0 * w)
            return
        if slot:
            p = at[seq0:n].astype(np.int64)
            c, sn = ct[p][:, None], st[p][:, None]
        else:
            p0 = int(at[0])
            c, sn = ct[p0: p0 + rows][:, None], st[p0: p0 + rows][:, None]
        y = view().reshape(rows, heads, hd) if view is not None else yt
        xr, yr = x[..., :rot].reshape(rows, heads, 2, half), y[..., :rot].reshape(rows, heads, 2, half)
        mul(xr, c, out=yr)
        mul(xr[:, :, ::-1], sn, out=sw)
        add(yr, sw, out=yr)
        if rot < hd:
            y[..., rot:] = x[..., rot:]
        if norm is not None:
            divide(y, ss, out=y)
        if view is None:
            s.y.write(env, y, first=seq0 * w)  # a batch's rows from its first sequence's (each in its slot: Dst.slot)

    return call


def side_check(s: RopeSide, hd: int, rot: int, epilogue: bool = False) -> Refusal | None:
    """Why the side cannot run (None: it can); `epilogue`: in a products-in-parts fold (fold.cu), which also runs a
    side of its own head shape and a side normed only (a warp a row: any width)."""
    if s.absorb is not None and not epilogue:
        return Refusal("each head's own product (a query's absorption) outside its products' epilogue (only "
                       "fold.cu's products in parts run it)")
    if s.own_shape and not epilogue:
        return Refusal("a rotation side of its own head shape (a row norm alone) outside its products' epilogue "
                       "(only fold.cu's products in parts run it)")
    hd, rot = side_shape(s, hd, rot)
    if s.quant is not None:
        why = s.epilogue_refusal(s.heads * hd, "a row normed in a products' epilogue")
        if why:
            return why
        if not epilogue or rot != 0 or s.norm is None or s.absorb is not None or s.heads != 1:
            return Refusal("a rotation's result quantized as it is stored (only a row norm in a products' epilogue, "
                           "fold.cu's, quantizes its rows)")
        if s.words == Q8K and not s.y.contiguous:
            return Refusal("a normed row quantized as llama.cpp's q8_K (blocks of 256) in a products' epilogue but "
                           "stored as parts of units (the epilogue reads each block back from the row it stored)")
    if s.absorb is not None:
        if s.norm is not None or rot != 0 or s.part is not None:
            return Refusal("each head's own product after a norm, a rotation or from a part of a wider row (the "
                           "epilogue multiplies the raw product's heads as they are)")
        if min(s.heads, hd, s.absorb.b) < 1:
            return Refusal(f"each head's own product of no values ({s.heads} heads, {hd} to {s.absorb.b})")
        return format_refusal(s.absorb.format, s.absorb.b if not s.absorb.rows_out else hd,
                              "a head's product in a products' epilogue")
    if rot == 0:
        if s.norm is None:
            return Refusal("a side neither normed nor rotated")
        if s.part is not None and s.part.width != s.heads * hd:
            return Refusal(f"x read as parts {s.part.width} wide for {s.heads} heads of {hd}")
        return None
    if hd > MAX_HD:
        return Refusal(f"a head of {hd} values (the rotation holds at most {MAX_HD})")
    if rot % 2 or not 2 <= rot <= hd:
        return Refusal(f"a rotary width {rot} that is not even and within the head ({hd})")
    if s.part is not None and s.part.width != s.heads * hd:
        return Refusal(f"x read as parts {s.part.width} wide for {s.heads} heads of {hd}")
    return None


@dataclass(frozen=True)
class RopeParts(Launch):
    """Several sides rotated in one launch, sharing cos, sin (positions, rot/2), pos and the head shape."""

    sides: tuple[RopeSide, ...]
    cos: str
    sin: str
    pos: str
    rows: int
    hd: int
    rot: int
    slot: int = 0  # a batch's cache rows a sequence (0: one sequence)
    seq0: int = 0  # a batch launch's first sequence (the `sequences` step held: one launch a sequence)

    census: ClassVar[str] = "rope_parts"
    stem: ClassVar[tuple[str, ...]] = ("rope",)
    steps: ClassVar[tuple[str, ...]] = ("sequences",)  # a batch apart, one launch a sequence (`apart`)

    def reads(self):
        ins = [v for s in self.sides for v in (s.x, s.norm[0] if s.norm else None, *s.y.params(),
                                                s.absorb.w if s.absorb else None)]
        return names(*ins, self.cos, self.sin, self.pos)

    def writes(self):
        return names(*(s.y.buf for s in self.sides), *(s.quant for s in self.sides))

    def batched(self, pos, slot):
        if self.pos != pos:
            return super().batched(pos, slot)
        got = batch_dsts(self, pos, slot)  # a side written into cache rows: each sequence's into its slot
        return got if isinstance(got, Refusal) else replace(got, slot=slot)

    def apart(self):
        return batch_apart(self)

    def check(self, epilogue: bool = False):
        """Why the launch cannot run; `epilogue`: as a products-in-parts fold's epilogue (see side_check)."""
        if not self.sides:
            return Refusal("a launch of no rotations")
        for s in self.sides:
            why = side_check(s, self.hd, self.rot, epilogue)
            if why:
                return why
        return None

    def _hd(self, s: RopeSide) -> int:
        return side_shape(s, self.hd, self.rot)[0]

    def extents(self, top, tokens):
        r = self.seq0 + self.rows
        sides = [v for s in self.sides for v in (
            (s.x, s.part.extent(r) if s.part is not None else r * s.heads * self._hd(s)),
            (s.norm[0] if s.norm else None, self._hd(s)), (s.y.buf, self._dst_extent(s, r, top)),
            (s.absorb.w if s.absorb else None, s.heads * self._hd(s) * s.absorb.b if s.absorb else 0),
            (s.quant, r * s.heads * self._hd(s)))]
        tab = (top + (1 if self.slot else r)) * (self.rot // 2)  # cos and sin: a row of rot/2 a position
        return reach(*sides, (self.cos, tab), (self.sin, tab), (self.pos, r if self.slot else 1))

    def _dst_extent(self, s: RopeSide, r: int, top: int) -> int:
        return s.y.extent(r * (s.width or s.heads * self._hd(s)), top)

    def weights(self):
        w = {w: "f32" for w in (self.cos, self.sin, *(s.norm[0] for s in self.sides if s.norm))}
        w.update({s.absorb.w: s.absorb.format for s in self.sides if s.absorb})
        return w

    def checkpoint_bytes(self):
        return sum(absorbing(s, self.rows, self._hd(s)).checkpoint_bytes() for s in self.sides if s.absorb)

    def bytes(self):
        n = sum(s.heads * self._hd(s) + (s.width or s.heads * self._hd(s)) for s in self.sides) * self.rows
        q = sum(s.epilogue_bytes(self.rows * s.heads * self._hd(s)) for s in self.sides)
        return 4 * (n + self.rows * self.rot) + q + self.checkpoint_bytes()

    def flops(self):
        return sum(2 * s.heads * self._hd(s) * s.absorb.b if s.absorb else 6 * s.heads * self._hd(s)
                   for s in self.sides) * self.rows

    def numpy(self, env):
        for s in self.sides:
            side_numpy(env, s, self.cos, self.sin, self.pos, self.rows, self.hd, self.rot, self.slot, self.seq0)

    def fast(self, env):
        self.bind_fast(env)()

    def bind_fast(self, env):
        """Each side bound once (`side_bind`); they run in turn, each through the same temporaries."""
        t = env.temp(self.fast_temp())
        calls = [side_bind(env, s, self.cos, self.sin, self.pos, self.rows, self.hd, self.rot, t, self.slot, self.seq0)
                 for s in self.sides]

        def run():
            for call in calls:
                call()

        return run

    def fast_temp(self):
        return 3 * self.rows * max(s.heads * self._hd(s) for s in self.sides)

    def grid_block(self):
        return ((self.rows * sum(s.heads for s in self.sides), 1, 1), (128, 1, 1))

    def table(self, denv) -> list[int]:
        words: list[int] = []
        first = 0
        for s in self.sides:
            p = s.part
            eps = int(np.array(s.norm[1] if s.norm else 0.0, dtype=np.float32).view(np.int32))
            words += [denv.ptr(s.x), p.pitch if p else s.heads * self.hd, p.offset if p else 0,
                      denv.ptr(s.norm[0] if s.norm else None), eps, s.heads, first, *denv.dst_words(s.y)]
            first += self.rows * s.heads
        return words

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import i64

        grid, block = self.grid_block()
        t = denv.table(self.key(), self.table(denv))
        denv.function(self.stem, "rope_parts")(grid, block, (t, i64(len(self.sides)), denv.weight(self.cos)[0],
                                                             denv.weight(self.sin)[0], denv.array(self.pos),
                                                             i64(self.hd), i64(self.rot), i64(self.slot),
                                                             i64(self.seq0)))


@dataclass(frozen=True)
class Rope(Launch):
    """The rotation of one tensor's heads: a launch of one side."""

    x: str
    cos: str
    sin: str
    pos: str
    y: Dst
    rows: int
    heads: int
    hd: int
    rot: int
    part: Part | None = None
    norm: tuple[str, float] | None = None
    slot: int = 0  # a batch's cache rows a sequence (0: one sequence)
    seq0: int = 0  # a batch launch's first sequence

    census: ClassVar[str] = "rope"
    stem: ClassVar[tuple[str, ...]] = ("rope",)
    steps: ClassVar[tuple[str, ...]] = ("sequences",)

    def parts(self) -> RopeParts:
        side = RopeSide(self.x, self.y, self.heads, self.part, self.norm)
        return RopeParts((side,), self.cos, self.sin, self.pos, self.rows, self.hd, self.rot, self.slot, self.seq0)

    def batched(self, pos, slot):
        got = self.parts().batched(pos, slot)
        return replace(self, slot=got.slot, y=got.sides[0].y) if isinstance(got, RopeParts) else got

    def apart(self):
        return batch_apart(self)

    def reads(self):
        return self.parts().reads()

    def writes(self):
        return (self.y.buf,)

    def check(self):
        return self.parts().check()

    def extents(self, top, tokens):
        return self.parts().extents(top, tokens)

    def weights(self):
        return self.parts().weights()

    def bytes(self):
        return self.parts().bytes()

    def flops(self):
        return self.parts().flops()

    def numpy(self, env):
        self.parts().numpy(env)

    def fast(self, env):
        self.parts().fast(env)

    def bind_fast(self, env):
        return self.parts().bind_fast(env)

    def fast_temp(self):
        return self.parts().fast_temp()  # the side's temporaries: the runner sizes its arena's tail by this

    def grid_block(self):
        return self.parts().grid_block()

    def cuda(self, denv):
        self.parts().cuda(denv)
