"""`l2norm`: each of `rows` units (a head of a row) of `cols` values scaled to unit length, x / sqrt(sum(x²) + eps); a
block a unit (l2norm.cu)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import Launch, names, reach
from lanefuse.kernels.norm import threads


@dataclass(frozen=True)
class L2Norm(Launch):
    x: str
    y: str
    rows: int  # units: rows times heads
    cols: int  # a unit's values
    eps: float

    census: ClassVar[str] = "l2norm"
    stem: ClassVar[tuple[str, ...]] = ("l2norm",)

    def reads(self):
        return names(self.x)

    def writes(self):
        return names(self.y)

    def check(self):
        return None if self.rows > 0 and self.cols > 0 else Refusal(f"an L2 norm of {self.rows} units of {self.cols}")

    def extents(self, top, tokens):
        n = self.rows * self.cols
        return reach((self.x, n), (self.y, n))

    def bytes(self):
        return 8 * self.rows * self.cols

    def flops(self):
        return 3 * self.rows * self.cols

    def numpy(self, env):
        n = self.rows * self.cols
        x = env.array(self.x)[:n].reshape(self.rows, self.cols).astype(np.float64)
        y = x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + self.eps)
        env.array(self.y)[:n] = y.reshape(-1).astype(np.float32)

    def grid_block(self):
        return ((self.rows, 1, 1), (threads(self.cols), 1, 1))

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import f32, i64

        g, b = self.grid_block()
        denv.function(self.stem, "l2norm")(g, b, (denv.array(self.x), denv.array(self.y), i64(self.cols),
                                                  f32(self.eps)))
