"""`norm_pair`: two RMSNorms of different rows, widths and weights in one launch (norm_pair, DeepSeek-V3's q_a and
latent norms, the latent's landing in its cache row): blocks 0..a.rows-1 norm a's rows, the rest b's, each block a
row as norm.cu's norm_rows does (norm_pair.cu). Each half is a plain `Norm` (its destination, its read as a part):
the residual add, the pre-norm and the quantized form are refused (a launch of their own)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import Launch, MAX_GRID_Y, names
from lanefuse.kernels.norm import Norm, threads


@dataclass(frozen=True)
class NormPair(Launch):
    a: Norm
    b: Norm

    census: ClassVar[str] = "norm_pair"
    stem: ClassVar[tuple[str, ...]] = ("quant", "norm", "norm_pair")

    def reads(self):
        return names(*self.a.reads(), *self.b.reads())

    def writes(self):
        return names(*self.a.writes(), *self.b.writes())

    def check(self):
        for n in (self.a, self.b):
            if n.add is not None or n.pre is not None or n.quant is not None or n.sum is not None:
                return Refusal("a pair of norms one of which adds a residual, pre-norms or quantizes (norm_pair "
                               "takes plain norms)")
        if self.a.rows + self.b.rows > (1 << 31) - 1 or max(self.a.rows, self.b.rows) > MAX_GRID_Y * 1024:
            return Refusal(f"a pair of norms of {self.a.rows} and {self.b.rows} rows (one grid row of blocks)")
        return self.a.check() or self.b.check()

    def extents(self, top, tokens):
        out = dict(self.a.extents(top, tokens))
        for k, v in self.b.extents(top, tokens).items():
            out[k] = max(out.get(k, 0), v)
        return out

    def weights(self):
        return {**self.a.weights(), **self.b.weights()}

    def bytes(self):
        return self.a.bytes() + self.b.bytes()

    def flops(self):
        return self.a.flops() + self.b.flops()

    def numpy(self, env):
        self.a.numpy(env)
        self.b.numpy(env)

    def fast(self, env):
        self.a.fast(env)
        self.b.fast(env)

    def fast_temp(self):
        return max(self.a.fast_temp(), self.b.fast_temp())

    def grid_block(self):
        w = max(self.a.cols // self.a.heads, self.b.cols // self.b.heads)
        return ((self.a.rows + self.b.rows, 1, 1), (threads(w), 1, 1))

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import i64

        grid, block = self.grid_block()
        denv.function(self.stem, "norm_pair_rows")(grid, block, (*self.a.args(denv), *self.b.args(denv),
                                                                  i64(self.a.rows)))
