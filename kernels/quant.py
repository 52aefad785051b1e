"""`quant`: an activation quantized to int8 blocks of QBLOCK values with one f32 scale a block — reserved for the q8
numerics; the kind exists so a plan can name it, and it refuses to run until written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import QBLOCK, Launch, reach

WHY = "an activation quantizer (the q8 numerics are not written yet)"


@dataclass(frozen=True)
class Quant(Launch):
    x: str
    n: int

    census: ClassVar[str] = "quant"

    def reads(self):
        return (self.x,)

    def writes(self):
        return (self.x + ".q8",)

    def check(self):
        return Refusal(WHY)

    def extents(self, top, tokens):
        return reach((self.x, self.n))

    def bytes(self):
        return 4 * self.n + self.n + 4 * (-(-self.n // QBLOCK))

    def numpy(self, env):
        raise NotImplementedError(WHY)

    def grid_block(self):
        raise NotImplementedError(WHY)

    def cuda(self, denv):
        raise NotImplementedError(WHY)
