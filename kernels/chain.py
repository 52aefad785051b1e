"""`chain`: launches that run as the phases of one launch (chain.cu), each phase over what the one before wrote: the
gate/up GLU, then the down product folded with the residual and the next norm (`glu_down_norm`: gemv_gate_up_glu
then gemv_norm_epilogue, a layer's MLP in one launch where it took two). Every block takes a ticket as it starts; the
first tickets run the GLU, the rest the down product, each of those waiting until every GLU block has arrived (it only
waits on blocks that took earlier tickets, which are running: no deadlock, no cooperative launch). The numpy twin is
`first` then `then`: exactly what the phases compute, in order. Where the kernel does not serve the pair (a quantized
activation or GLU, a split or capped down product, more than two rows, the norm not the fold's) the chain is refused,
in one line, and the plan keeps its two launches."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import FORMAT_CODE, Launch, Scratch, names
from lanefuse.kernels.elementwise import act_code
from lanefuse.kernels.fold import Fold, Sequenced
from lanefuse.kernels.gemv import Gemv
from lanefuse.kernels.gemv_glu import GemvGlu

CHAIN_ROWS = 2  # the rows of x the chained kernel takes (a decode step, or two): gemv_rows' AR 1 / 2 accumulators


def blocks(n: int, per_warp: int) -> int:
    """A phase's blocks: gemv_body's blocks of four warps of `per_warp` outputs over n outputs."""
    return -(-n // (4 * per_warp))


@dataclass(frozen=True)
class Chain(Sequenced, Launch):
    first: Launch  # the GLU (GemvGlu)
    then: Launch  # the down product and its norm (Fold of a Gemv and a Norm)

    census: ClassVar[str] = "chain"
    stem: ClassVar[tuple[str, ...]] = ("quant", "gemv_core", "gemv_q8", "gemv_glu", "norm", "chain")

    def check(self) -> Refusal | None:
        """Why the pair is not one chained launch (the plan then keeps its two), in one line; None if it is."""
        glu, fold = self.first, self.then
        if not isinstance(glu, GemvGlu) or not isinstance(fold, Fold) or not isinstance(fold.first, Gemv):
            return Refusal(f"no chained kernel runs a {self.first.census} then a {self.then.census}")
        down = fold.first
        why = glu.check() or fold.check()
        if why:
            return why
        if fold.form()[0] != "gemv_norm":
            return Refusal("a chain whose second phase is not a product folded with its norm")
        if glu.words or down.words or glu.quant is not None or down.quant is not None:
            return Refusal("a chain over quantized activations (the q8 numerics): the GLU and the down product run "
                           "as two launches")
        if not glu.f32:
            return Refusal("a chain whose GLU is not stored in f32 (the down phase reads it)")
        if down.x != glu.out or down.k != glu.n or down.m != glu.m:
            return Refusal(f"a chain whose down product reads `{down.x}` ({down.m}x{down.k}), not the GLU `{glu.out}` "
                           f"({glu.m}x{glu.n})")
        if glu.m > CHAIN_ROWS:
            return Refusal(f"a chain of {glu.m} rows (the chained kernel takes at most {CHAIN_ROWS}: its phases keep "
                           f"an accumulator a row)")
        if down.split != 1 or down.cap:
            return Refusal("a chain whose down product is split or capped")
        if glu.per_warp != down.per_warp:
            return Refusal(f"a chain of {glu.per_warp} and {down.per_warp} outputs a warp (the kernel takes one)")
        return None

    def reads(self):
        return names(*self.first.reads(), *self.then.reads())

    def writes(self):
        return names(*self.first.writes(), *self.then.writes())

    def scratch(self):
        """The tickets and the arrivals, left zero by the last block."""
        return (Scratch("tickets", "i32", 8, counter=True),)

    def tune(self, knobs, held=frozenset()):
        """Each phase tuned as its own launch (the down product takes no split-K: its last block norms it), then both
        at the GLU's outputs a warp (one kernel template; the twin's bits are the same at either)."""
        first = self.first.tune(knobs, held)
        then = self.then.tune(knobs, held)
        if isinstance(then, Fold) and isinstance(then.first, Gemv) and isinstance(first, GemvGlu):
            then = replace(then, first=replace(then.first, split=1, per_warp=first.per_warp))
        return replace(self, first=first, then=then)

    def phases(self) -> tuple[int, int]:
        """Each phase's blocks (the grid is their sum, in x)."""
        return blocks(self.first.n, self.first.per_warp), blocks(self.then.first.n, self.first.per_warp)

    def grid_block(self):
        g1, g2 = self.phases()
        return ((g1 + g2, 1, 1), (128, 1, 1))

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import i64

        glu: GemvGlu = self.first  # type: ignore[assignment]
        fold: Fold = self.then  # type: ignore[assignment]
        down: Gemv = fold.first  # type: ignore[assignment]
        nm = fold.then
        grid, block = self.grid_block()
        counters = denv.scratch(self, self.scratch()[0])
        denv.function(self.stem, f"fold_glu_down_{glu.per_warp}")(grid, block, (
            denv.array(glu.x), denv.weight(glu.wg)[0], denv.weight(glu.wu)[0], i64(FORMAT_CODE[glu.format]),
            denv.opt(glu.bg), denv.opt(glu.bu), denv.array(glu.out), i64(glu.k), i64(glu.n), i64(act_code(glu.act)),
            denv.weight(down.w)[0], i64(FORMAT_CODE[down.format]), denv.opt(down.bias), *denv.dst(down.y),
            i64(down.n), i64(glu.m), counters, i64(self.phases()[0]), i64(nm.rows), *nm.args(denv)))
