"""`gates`: a gated delta net's two gates in one pass (gdn_gating): the write strength beta = sigmoid(br) and the
forget gate decay = -exp(al[h]) · softplus(ar + dt[h]) (gates.cu)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from lanefuse.kernels.common import Launch, names, reach
from lanefuse.kernels.decay import forget
from lanefuse.kernels.elementwise import grid


@dataclass(frozen=True)
class Gates(Launch):
    br: str
    ar: str
    dt: str
    al: str
    beta: str
    decay: str
    n: int
    heads: int

    census: ClassVar[str] = "gates"
    stem: ClassVar[tuple[str, ...]] = ("decay", "gates")

    def reads(self):
        return names(self.br, self.ar, self.dt, self.al)

    def writes(self):
        return names(self.beta, self.decay)

    def extents(self, top, tokens):
        n, h = self.n, self.heads
        return reach((self.br, n), (self.ar, n), (self.dt, h), (self.al, h), (self.beta, n), (self.decay, n))

    def weights(self):
        return {self.dt: "f32", self.al: "f32"}

    def bytes(self):
        return 16 * self.n + 8 * self.heads

    def flops(self):
        return 10 * self.n

    def numpy(self, env):
        h, n = self.heads, self.n
        br = env.array(self.br)[:n].astype(np.float64)
        env.array(self.beta)[:n] = (1.0 / (1.0 + np.exp(-br))).astype(np.float32)
        dt = np.asarray(env.weight(self.dt)[0]).reshape(-1)[:h]
        al = np.asarray(env.weight(self.al)[0]).reshape(-1)[:h]
        env.array(self.decay)[:n] = forget(env.array(self.ar)[:n].reshape(-1, h), dt, al).reshape(-1).astype(
            np.float32)

    def grid_block(self):
        return grid(self.n)

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import i64

        g, b = self.grid_block()
        denv.function(self.stem, "gates")(g, b, (
            denv.array(self.br), denv.array(self.ar), denv.opt(self.dt), denv.opt(self.al), denv.array(self.beta),
            denv.array(self.decay), i64(self.n), i64(self.heads)))
