"""`unary`: y = act(x) for silu, sigmoid, gelu (tanh approximation), gelu_erf (exact)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import ACTS, act, reach
from lanefuse.kernels.elementwise import Elementwise, act_code


@dataclass(frozen=True)
class Unary(Elementwise):
    act: str
    x: str
    y: str
    n: int

    census: ClassVar[str] = "unary"
    stem: ClassVar[tuple[str, ...]] = ("unary",)
    inputs: ClassVar[tuple[str, ...]] = ("x",)
    output: ClassVar[str] = "y"

    def elements(self):
        return self.n

    def check(self):
        return None if self.act in ACTS else Refusal(f"an activation `{self.act}` (one of {', '.join(ACTS)})")

    def extents(self, top, tokens):
        return reach((self.x, self.n), (self.y, self.n))

    def bytes(self):
        return 8 * self.n

    def flops(self):
        return 4 * self.n

    def numpy(self, env):
        env.array(self.y)[: self.n] = act(self.act, env.array(self.x)[: self.n].astype("float32"))

    def args(self, denv):
        from lanefuse.kernels.cupy_env import i64

        return (denv.array(self.x), denv.array(self.y), i64(self.n), i64(act_code(self.act)))
