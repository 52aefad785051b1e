"""`fold`: two launches as one, `first` then `then` over what `first` wrote (gemv_norm_epilogue, embed_norm,
qkv_head_epilogue, head_argmax). Four pairs run as one kernel (fold.cu): a GEMV then a norm (the norm done by the last
block to arrive); a GEMV then the arg-max of its rows (each block's best folded into a row's key by an atomic max, the
last block to arrive writing the index and the advance: the LM head and the step's next token); products in parts (or
one GEMV) then their heads' norm and rotation (each head's epilogue done by the last block of its outputs to arrive;
a side of its own shape, one head of its part's width and no rotation, is that part's rows normed: DeepSeek-V3's q_a
and latent norms); an embedding gather then a norm of the gathered rows (a block a row). Any other pair runs as its
two kernels in turn. The numpy twin is always `first` then `then`: exactly what each fused kernel does."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.argmax import ArgMax
from lanefuse.kernels.common import FORMAT_CODE, GEMV_ROWS, Dst, Launch, Part, Scratch, names, reach
from lanefuse.kernels.gather import Gather
from lanefuse.kernels.gemm_parts import GemmPart, GemmParts
from lanefuse.kernels.gemv import Gemv, loop_rate, q8_code
from lanefuse.kernels.norm import Norm
from lanefuse.kernels.rope import Rope, RopeParts, RopeSide, side_shape

PR = 32  # descriptor words a part of fold_parts_rope (fold.cu)


def as_parts(l: Launch) -> GemmParts | None:
    """A GEMV without split-K as products in one part; products in parts as they are; else None."""
    if isinstance(l, GemmParts):
        return l
    if isinstance(l, Gemv) and l.split == 1 and l.cap == 0:
        return GemmParts(l.x, l.format, l.k, l.m, (GemmPart(l.w, l.y, l.n, l.bias),), per_warp=l.per_warp,
                         words=l.words)
    return None


def as_rope_parts(l: Launch) -> RopeParts | None:
    if isinstance(l, RopeParts):
        return l
    if isinstance(l, Rope):
        return l.parts()
    return None


def _layout(d: Dst, n: int) -> tuple[int, int] | None:
    """(row pitch, offset in a row) of a product of n outputs a row written through d; None if rows of a table."""
    if d.row is not None:
        return None
    if d.unit is None:
        return (n, 0)
    return (d.unit.pitch, d.unit.offset) if d.unit.width == n else None


def _reads(s: RopeSide, hd: int) -> tuple[int, int]:
    p = s.part
    return (p.pitch, p.offset) if p is not None else (s.heads * hd, 0)


def rotated(gp: GemmParts, rp: RopeParts) -> tuple[list[RopeSide | None], Refusal | None]:
    """Each part's side (None: not rotated) when every side rotates exactly what one part writes, else the reason
    the pair runs as two kernels."""
    if rp.rows != gp.m:
        return [], Refusal(f"a rotation of {rp.rows} rows after products of {gp.m}")
    why = rp.check(epilogue=True)
    if why:
        return [], why
    by_part: list[RopeSide | None] = [None] * len(gp.parts)
    written = {p.y.buf for p in gp.parts}
    for s in rp.sides:
        hd = side_shape(s, rp.hd, rp.rot)[0]
        at = [i for i, p in enumerate(gp.parts)
              if p.y.buf == s.x and p.n == s.heads * hd and _layout(p.y, p.n) == _reads(s, hd)]
        if len(at) != 1 or by_part[at[0]] is not None:
            return [], Refusal(f"a rotation of `{s.x}` that is not exactly one product's result")
        p = gp.parts[at[0]]
        pitch, off = _reads(s, hd)
        for q in gp.parts:  # another part writing into what this side reads would be lost
            if q is p or q.y.buf != s.x:
                continue
            lq = _layout(q.y, q.n)
            if lq is None or lq[0] != pitch or not (lq[1] + q.n <= off or off + p.n <= lq[1]):
                return [], Refusal(f"products overlapping in `{s.x}`")
        if s.y.buf in written or s.y.buf == gp.x or any(s.y.buf == o.x for o in rp.sides):
            return [], Refusal(f"a rotation written into `{s.y.buf}`, which the products write or read")
        by_part[at[0]] = s
    return by_part, None


def argmax_of(g: Gemv, a: ArgMax) -> Refusal | None:
    """Why a GEMV then an arg-max is not one kernel (the arg-max must take the product's rows as they lie, whole);
    None if it is."""
    if g.split != 1:
        return Refusal(f"a product split {g.split} ways before its arg-max")
    if a.x != g.y.buf or g.y != Dst(g.y.buf) or a.rows != g.m or a.n != g.n:
        return Refusal(f"an arg-max of `{a.x}` ({a.rows}x{a.n}) that is not the product `{g.y.buf}` ({g.m}x{g.n}) "
                       f"as it lies")
    return None


def gathered(g: Gather, nm: Norm) -> Refusal | None:
    """Why a gather then a norm is not one kernel (the norm must take the gathered rows as they lie); None if it is."""
    if nm.x != g.out or nm.rows != g.rows or nm.cols != g.cols:
        return Refusal(f"a norm of `{nm.x}` ({nm.rows}x{nm.cols}) that is not the gathered `{g.out}` "
                       f"({g.rows}x{g.cols})")
    if nm.part is not None and nm.part != Part(g.cols, 0, g.cols):
        return Refusal("a norm reading the gathered rows as parts")
    return None


class Sequenced:
    """What a launch of launches run in turn shares (a Fold's `first` then `then`, a Chain's phases: `sequence()`): the
    tensors it reaches, its weights, bytes and flops are all of theirs; its twins run theirs in order."""

    def sequence(self) -> tuple:
        return (self.first, self.then)

    def extents(self, top, tokens):
        return reach(*(kv for l in self.sequence() for kv in l.extents(top, tokens).items()))

    def weights(self):
        return {k: v for l in self.sequence() for k, v in l.weights().items()}

    def bytes(self):
        return sum(l.bytes() for l in self.sequence())

    def checkpoint_bytes(self):
        return sum(l.checkpoint_bytes() for l in self.sequence())

    def flops(self):
        return sum(l.flops() for l in self.sequence())

    def numpy(self, env):
        for l in self.sequence():
            l.numpy(env)

    def fast(self, env):
        self.bind_fast(env)()

    def bind_fast(self, env):
        calls = tuple(l.bind_fast(env) for l in self.sequence())

        def call():
            for c in calls:
                c()

        return call

    def fast_temp(self):
        return max(l.fast_temp() for l in self.sequence())


@dataclass(frozen=True)
class Fold(Sequenced, Launch):
    first: Launch
    then: Launch

    census: ClassVar[str] = "fold"
    stem: ClassVar[tuple[str, ...]] = ("gemv_core", "gemv_q8", "quant", "norm", "parts_rope", "fold")

    def form(self) -> tuple[str | None, Refusal | None]:
        """(the fused kernel's form, None): "gemv_norm", "parts_rope" or "gather_norm"; or (None, why) when the pair
        runs as two kernels, why in the user's words. Computed once a launch (the lowering asks it a few times a
        launch: its scratch, kernels, check, grid): the fields are frozen."""
        hit = self.__dict__.get("_form")
        if hit is None:
            hit = self.__dict__["_form"] = self._form()
        return hit

    def _form(self) -> tuple[str | None, Refusal | None]:
        if isinstance(self.first, Gemv) and self.first.cap:
            return None, Refusal("a soft-capped product folded with what follows (the fused kernels store it uncapped)")
        if isinstance(self.first, Gemv) and self.first.quant is not None:
            return None, Refusal("a product quantizing its output folded with what follows (gemv_quant.cu's tail "
                                 "runs alone)")
        if isinstance(self.then, ArgMax) and isinstance(self.first, Gemv):
            why = argmax_of(self.first, self.then)
            return (None, why) if why else ("gemv_argmax", None)
        if isinstance(self.then, Norm):
            if isinstance(self.first, Gemv):
                if self.first.split == 1:
                    return "gemv_norm", None
                return None, Refusal(f"a product split {self.first.split} ways before its norm")
            if isinstance(self.first, Gather):
                why = gathered(self.first, self.then)
                return (None, why) if why else ("gather_norm", None)
        gp, rp = as_parts(self.first), as_rope_parts(self.then)
        if gp is not None and rp is not None:
            _, why = rotated(gp, rp)
            return (None, why) if why else ("parts_rope", None)
        if isinstance(self.first, Gemv) and rp is not None:
            return None, Refusal(f"a product split {self.first.split} ways before its rotation")
        return None, Refusal(f"no kernel runs a {self.first.census} then a {self.then.census}")

    def apart(self):
        """`sequences` held: a batch's rotations one launch a sequence, after the products (which take every row)."""
        sides = self.then.apart()
        if any(getattr(s, "own_shape", False) for s in getattr(self.then, "sides", ())):
            return (self,)  # an absorbing side or a row norm runs only in the products' epilogue (no position)
        return (self,) if len(sides) == 1 else (*self.first.apart(), *sides)

    @property
    def fused(self) -> bool:
        """Whether the pair runs as one kernel (see `form`)."""
        return self.form()[0] is not None

    def reads(self):
        return names(*self.first.reads(), *self.then.reads())

    def writes(self):
        return names(*self.first.writes(), *self.then.writes())

    def scratch(self):
        f = self.form()[0]
        if f == "gemv_norm":
            return (Scratch("arrivals", "i32", 4, counter=True),)
        if f == "parts_rope":  # an arrival count a rotated head and a slab of rows
            rp = as_rope_parts(self.then)
            heads = sum(s.heads for s in rp.sides)
            return (Scratch("arrivals", "i32", 4 * heads * -(-rp.rows // GEMV_ROWS), counter=True),)
        if f == "gather_norm":
            return ()
        if f == "gemv_argmax":  # a row's 64-bit key (two i32 words) and the arrivals, both left zero by the last block
            return (Scratch("keys", "i32", 8 * self.then.rows, counter=True), Scratch("arrivals", "i32", 4, counter=True))
        return (tuple(Scratch("first." + s.tag, s.dtype, s.nbytes, s.counter) for s in self.first.scratch())
                + tuple(Scratch("then." + s.tag, s.dtype, s.nbytes, s.counter) for s in self.then.scratch()))

    def check(self):
        """Each of the pair's refusals; a rotation in parts in the products' epilogue may have sides of their own head
        shape (a row norm alone), which only that kernel runs."""
        if self.form()[0] == "parts_rope":
            return self.first.check() or as_rope_parts(self.then).check(epilogue=True)
        return self.first.check() or self.then.check()

    def tune(self, knobs, held=frozenset()):
        """Each of the pair tuned by its own steps, except that a GEMV first takes no split-K: the fold's last block
        norms the whole product."""
        first = self.first.tune(knobs, held)
        if isinstance(first, Gemv):
            first = replace(first, split=1)
        return replace(self, first=first, then=self.then.tune(knobs, held))

    def loop_us(self, knobs) -> float:
        """A fused fold's product's loop at a slab (Gemv / GemmParts loop_us; its epilogue unpriced here): the products
        in parts before their heads' epilogue (fold_parts_rope) at one output a warp run a slab of dense rows by
        gemv_tile_any (parts_rope.cu: gemv_body without the slab's ring there, which spilled it); at four, the slab."""
        if not self.fused or not isinstance(self.first, (Gemv, GemmParts)):
            return 0.0
        return self.first.loop_us(knobs, ring=self.form()[0] != "parts_rope" or self.first.per_warp >= 4)

    def rate(self, knobs) -> float:
        return loop_rate(self.flops(), self.loop_us(knobs), knobs)

    def kernels(self):
        """One kernel when the pair is fused; else the kernels of each in turn."""
        return (self,) if self.fused else self.first.kernels() + self.then.kernels()

    def grid_block(self):
        f = self.form()[0]
        if f == "parts_rope":
            return as_parts(self.first).grid_block()
        if f == "gather_norm":
            return self.then.grid_block()  # a block a row, as wide as the norm's head
        return self.first.grid_block()

    def table(self, denv, gp: GemmParts, rp: RopeParts) -> list[int]:
        """fold_parts_rope's descriptor: each part's 11 words as gemm_parts takes them, then its side's heads (0: no
        epilogue), first arrival counter, norm weight (0: none), eps (f32 bits), Dst, head width and rotated width,
        an absorbing side's matrix (0: none), its format code, its outputs a head and whether its rows are the
        outputs', and a row norm's quantized form: its words, low words (or sums of 16), scales (0: none) and its words
        a value."""
        by_part, _ = rotated(gp, rp)
        words, first, head = [], 0, 0
        for p, nb, s in zip(gp.parts, gp.blocks(), by_part):
            words += [denv.ptr(p.w), denv.ptr(p.bias), p.n, first, *denv.dst_words(p.y)]
            first += nb
            if s is None:
                words += [0] * (PR - 11)
                continue
            eps = int(np.array(s.norm[1] if s.norm else 0.0, dtype=np.float32).view(np.int32))
            ab = s.absorb
            words += [s.heads, head, denv.ptr(s.norm[0] if s.norm else None), eps, *denv.dst_words(s.y),
                      *side_shape(s, rp.hd, rp.rot),
                      *((denv.ptr(ab.w), FORMAT_CODE[ab.format], ab.b, int(ab.rows_out)) if ab
                        else (0, 0, 0, 0)),
                      *s.epilogue_addresses(denv)]
            head += s.heads
        assert len(words) == PR * len(gp.parts)
        return words

    def cuda(self, denv):
        f = self.form()[0]
        if f is None:
            self.first.cuda(denv)
            self.then.cuda(denv)
            return
        from lanefuse.kernels.cupy_env import NULL, f32, i64

        grid, block = self.grid_block()
        if f == "gemv_norm":
            g: Gemv = self.first  # type: ignore[assignment]
            nm: Norm = self.then  # type: ignore[assignment]
            counter = denv.scratch(self, self.scratch()[0])
            x = denv.quant(g.x) if g.words else (denv.array(g.x),)
            name = "fold_gemv_norm_q8" if g.words else f"fold_gemv_norm_{g.per_warp}"
            denv.function(self.stem, name)(grid, block, (
                *x, denv.weight(g.w)[0], i64(q8_code(g.format, g.words)), denv.opt(g.bias), *denv.dst(g.y),
                i64(g.k), i64(g.n), i64(g.m), counter, i64(nm.rows), *nm.args(denv)))
        elif f == "gemv_argmax":
            g3: Gemv = self.first  # type: ignore[assignment]
            a: ArgMax = self.then  # type: ignore[assignment]
            keys, counter = (denv.scratch(self, s) for s in self.scratch())
            x = denv.quant(g3.x) if g3.words else (denv.array(g3.x),)
            name = "fold_gemv_argmax_q8" if g3.words else f"fold_gemv_argmax_{g3.per_warp}"
            adv = a.advance
            denv.function(self.stem, name)(grid, block, (
                *x, denv.weight(g3.w)[0], i64(q8_code(g3.format, g3.words)), denv.opt(g3.bias), *denv.dst(g3.y),
                i64(g3.k), i64(g3.n), i64(g3.m), keys, counter, denv.array(a.out),
                denv.array(adv.token) if adv else NULL, denv.array(adv.position) if adv else NULL,
                i64(adv.step if adv else 0), i64(1 if adv is not None and adv.batch else 0)))
        elif f == "parts_rope":
            gp, rp = as_parts(self.first), as_rope_parts(self.then)
            counters = denv.scratch(self, self.scratch()[0])
            t = denv.table(self.key(), self.table(denv, gp, rp))
            x = denv.quant(gp.x) if gp.words else (denv.array(gp.x),)
            name = "fold_parts_rope_q8" if gp.words else f"fold_parts_rope_{gp.per_warp}"
            denv.function(self.stem, name)(grid, block, (
                *x, t, i64(len(gp.parts)), i64(q8_code(gp.format, gp.words)), i64(gp.k), i64(gp.m),
                counters, denv.weight(rp.cos)[0], denv.weight(rp.sin)[0], denv.array(rp.pos), i64(rp.slot)))
        else:
            g2: Gather = self.first  # type: ignore[assignment]
            nm2: Norm = self.then  # type: ignore[assignment]
            denv.function(self.stem, "fold_gather_norm")(grid, block, (
                denv.weight(g2.table)[0], i64(FORMAT_CODE[g2.format]), denv.array(g2.index), denv.array(g2.out),
                f32(1.0 if g2.scale is None else g2.scale), *nm2.args(denv)))

