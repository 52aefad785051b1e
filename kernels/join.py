"""`join`: every (row, head) of the result is a's head of `ha` values then b's of `hb` (a latent attention's query
parts put back together), landing where a Dst says. Seed 002's Join and RopeSide carry a field `yz` that every site
of its link sets to 0 and nothing in the seed documents reads or describes (its link leaves such fields to the
lane's schedule, which the seeds do not hold): not carried, as no launch or pass it saves can be read from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from lanefuse.kernels.common import Dst, reach
from lanefuse.kernels.elementwise import Elementwise


@dataclass(frozen=True)
class Join(Elementwise):
    a: str
    b: str
    y: Dst
    rows: int
    heads: int
    ha: int
    hb: int

    census: ClassVar[str] = "join"
    stem: ClassVar[tuple[str, ...]] = ("join",)
    inputs: ClassVar[tuple[str, ...]] = ("a", "b")
    output: ClassVar[str] = "y"

    @property
    def units(self) -> int:
        return self.rows * self.heads

    def elements(self):
        return self.units * (self.ha + self.hb)

    def extents(self, top, tokens):
        u = self.units
        return reach((self.a, u * self.ha), (self.b, u * self.hb), (self.y.buf, self.y.extent(u * (self.ha + self.hb), top)))

    def bytes(self):
        return 8 * self.units * (self.ha + self.hb)

    def numpy(self, env):
        u = self.units
        a = env.array(self.a)[: u * self.ha].reshape(u, self.ha)
        b = env.array(self.b)[: u * self.hb].reshape(u, self.hb)
        self.y.write(env, np.concatenate([a, b], axis=1))

    def args(self, denv):
        from lanefuse.kernels.cupy_env import i64

        return (denv.array(self.a), denv.array(self.b), *denv.dst(self.y), i64(self.units), i64(self.ha),
                i64(self.hb))
