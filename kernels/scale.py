"""`scale`: y = x · factor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from lanefuse.kernels.common import Launch
from lanefuse.kernels.elementwise import grid


@dataclass(frozen=True)
class Scale(Launch):
    x: str
    y: str
    n: int
    factor: float

    census: ClassVar[str] = "scale"
    stem: ClassVar[tuple[str, ...]] = ("scale",)

    def reads(self):
        return (self.x,)

    def writes(self):
        return (self.y,)

    def bytes(self):
        return 8 * self.n

    def flops(self):
        return self.n

    def numpy(self, env):
        env.array(self.y)[: self.n] = env.array(self.x)[: self.n].astype(np.float32) * np.float32(self.factor)

    def grid_block(self):
        return grid(self.n)

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import f32, i64

        g, b = self.grid_block()
        denv.function(self.stem, "scale")(g, b, (denv.array(self.x), denv.array(self.y), i64(self.n),
                                                 f32(self.factor)))
