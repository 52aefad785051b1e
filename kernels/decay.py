"""`decay`: a gated delta net's forget gate, y = -exp(al[h]) · softplus(a + dt[h]) for each of `heads` values a row
(decay.cu; torch's softplus: x past 20 is x)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from lanefuse.kernels.common import reach
from lanefuse.kernels.elementwise import Elementwise


def forget(a: np.ndarray, dt: np.ndarray, al: np.ndarray) -> np.ndarray:
    """-exp(al) · softplus(a + dt) in f64, a (rows, heads), dt and al (heads,)."""
    x = np.asarray(a, dtype=np.float64) + np.asarray(dt, dtype=np.float64)
    sp = np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))
    return -np.exp(np.asarray(al, dtype=np.float64)) * sp


@dataclass(frozen=True)
class Decay(Elementwise):
    a: str
    dt: str
    al: str
    y: str
    n: int
    heads: int

    census: ClassVar[str] = "decay"
    stem: ClassVar[tuple[str, ...]] = ("decay",)
    inputs: ClassVar[tuple[str, ...]] = ("a", "dt", "al")
    output: ClassVar[str] = "y"

    def elements(self):
        return self.n

    def extents(self, top, tokens):
        return reach((self.a, self.n), (self.dt, self.heads), (self.al, self.heads), (self.y, self.n))

    def weights(self):
        return {self.dt: "f32", self.al: "f32"}

    def bytes(self):
        return 8 * self.n + 8 * self.heads

    def flops(self):
        return 6 * self.n

    def numpy(self, env):
        h = self.heads
        a = env.array(self.a)[: self.n].reshape(-1, h)
        dt = np.asarray(env.weight(self.dt)[0]).reshape(-1)[:h]
        al = np.asarray(env.weight(self.al)[0]).reshape(-1)[:h]
        env.array(self.y)[: self.n] = forget(a, dt, al).reshape(-1).astype(np.float32)

    def args(self, denv):
        from lanefuse.kernels.cupy_env import i64

        return (denv.array(self.a), denv.opt(self.dt), denv.opt(self.al), denv.array(self.y), i64(self.n),
                i64(self.heads))
