"""`scale`: y = x · factor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from lanefuse.kernels.common import reach
from lanefuse.kernels.elementwise import Elementwise


@dataclass(frozen=True)
class Scale(Elementwise):
    x: str
    y: str
    n: int
    factor: float

    census: ClassVar[str] = "scale"
    stem: ClassVar[tuple[str, ...]] = ("scale",)
    inputs: ClassVar[tuple[str, ...]] = ("x",)
    output: ClassVar[str] = "y"

    def elements(self):
        return self.n

    def extents(self, top, tokens):
        return reach((self.x, self.n), (self.y, self.n))

    def bytes(self):
        return 8 * self.n

    def flops(self):
        return self.n

    def numpy(self, env):
        env.array(self.y)[: self.n] = env.array(self.x)[: self.n].astype(np.float32) * np.float32(self.factor)

    def args(self, denv):
        from lanefuse.kernels.cupy_env import f32, i64

        return (denv.array(self.x), denv.array(self.y), i64(self.n), f32(self.factor))
