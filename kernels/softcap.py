"""`softcap`: y = cap · tanh(x / cap) (a soft-capped tensor on its own: Gemma's final logits where the product's
epilogue does not take the cap)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import reach
from lanefuse.kernels.elementwise import Elementwise


def capped(x: np.ndarray, cap: float) -> np.ndarray:
    """cap · tanh(x / cap) in f64, as the kernels compute it in f32; x itself where cap is 0 (none)."""
    if cap <= 0:
        return x
    return cap * np.tanh(np.asarray(x, dtype=np.float64) / cap)


def cap_check(cap: float, what: str) -> Refusal | None:
    if not 0.0 <= cap < float("inf"):
        return Refusal(f"a soft cap of {cap} on {what} (a positive number, or 0: none)")
    return None


@dataclass(frozen=True)
class Softcap(Elementwise):
    x: str
    y: str
    n: int
    cap: float

    census: ClassVar[str] = "softcap"
    stem: ClassVar[tuple[str, ...]] = ("softcap",)
    inputs: ClassVar[tuple[str, ...]] = ("x",)
    output: ClassVar[str] = "y"

    def elements(self):
        return self.n

    def check(self):
        return cap_check(self.cap, "a tensor") or (Refusal("a soft cap of 0 (no cap) as a launch")
                                                    if self.cap == 0 else None)

    def extents(self, top, tokens):
        return reach((self.x, self.n), (self.y, self.n))

    def bytes(self):
        return 8 * self.n

    def flops(self):
        return 4 * self.n

    def numpy(self, env):
        env.array(self.y)[: self.n] = capped(env.array(self.x)[: self.n], self.cap)

    def args(self, denv):
        from lanefuse.kernels.cupy_env import f32, i64

        return (denv.array(self.x), denv.array(self.y), i64(self.n), f32(self.cap))
