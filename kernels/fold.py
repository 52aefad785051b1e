"""`fold`: two launches as one, `first` then `then` over what `first` wrote (gemv_norm_epilogue, embed_norm,
qkv_head_epilogue). A GEMV then a norm runs as one kernel, the norm done by the last block to arrive (fold.cu, an
arrival counter the launch resets to zero); any other pair runs as its two kernels in turn."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lanefuse.kernels.common import FORMAT_CODE, Launch, Scratch, names
from lanefuse.kernels.gemv import Gemv
from lanefuse.kernels.norm import Norm


@dataclass(frozen=True)
class Fold(Launch):
    first: Launch
    then: Launch

    census: ClassVar[str] = "fold"
    stem: ClassVar[tuple[str, ...]] = ("gemv_core", "norm", "fold")

    @property
    def fused(self) -> bool:
        """Whether the pair runs as one kernel: a GEMV without split-K, then a norm."""
        return isinstance(self.first, Gemv) and self.first.split == 1 and isinstance(self.then, Norm)

    def reads(self):
        return names(*self.first.reads(), *self.then.reads())

    def writes(self):
        return names(*self.first.writes(), *self.then.writes())

    def scratch(self):
        if self.fused:
            return (Scratch("arrivals", "i32", 4, counter=True),)
        return (tuple(Scratch("first." + s.tag, s.dtype, s.nbytes, s.counter) for s in self.first.scratch())
                + tuple(Scratch("then." + s.tag, s.dtype, s.nbytes, s.counter) for s in self.then.scratch()))

    def check(self):
        return self.first.check() or self.then.check()

    def bytes(self):
        return self.first.bytes() + self.then.bytes()

    def flops(self):
        return self.first.flops() + self.then.flops()

    def numpy(self, env):
        self.first.numpy(env)
        self.then.numpy(env)

    def grid_block(self):
        return self.first.grid_block()

    def cuda(self, denv):
        if not self.fused:
            self.first.cuda(denv)
            self.then.cuda(denv)
            return
        from lanefuse.kernels.cupy_env import i64

        g: Gemv = self.first  # type: ignore[assignment]
        nm: Norm = self.then  # type: ignore[assignment]
        grid, block = g.grid_block()
        counter = denv.scratch(self, self.scratch()[0])
        denv.function(self.stem, f"fold_gemv_norm_{g.per_warp}")(grid, block, (
            denv.array(g.x), denv.weight(g.w)[0], i64(FORMAT_CODE[g.format]), denv.opt(g.bias), *denv.dst(g.y), i64(g.k), i64(g.n), i64(g.m),
            counter, i64(nm.rows), *nm.args(denv)))
