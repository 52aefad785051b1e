"""`slice`: a part of every group of a tensor copied out: y's group g is x's `width` values from g·every + start (a
head slice, or a row of a table written in place before the row's last reader). A real front reaches it: OLMo 2 over
R ranks (engine/front/parallel.py `_whole_qk_norms`) norms the gathered whole q and k and takes each rank's own heads
back with `head_slice`, one slice launch each a layer's q and k (tests/test_ranks_families.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import Part, reach
from lanefuse.kernels.elementwise import Elementwise


@dataclass(frozen=True)
class Slice(Elementwise):
    x: str
    y: str
    groups: int
    every: int
    start: int
    width: int

    census: ClassVar[str] = "slice"
    stem: ClassVar[tuple[str, ...]] = ("slice",)
    inputs: ClassVar[tuple[str, ...]] = ("x",)
    output: ClassVar[str] = "y"
    partial: ClassVar[tuple[str, ...]] = ("x",)  # a part of every group

    def elements(self):
        return self.groups * self.width

    def check(self):
        if self.start + self.width > self.every:
            return Refusal(f"a slice of {self.width} from {self.start} past a group of {self.every}")
        return None

    def extents(self, top, tokens):
        return reach((self.x, Part(self.every, self.start, self.width).extent(self.groups)),
                     (self.y, self.groups * self.width))

    def bytes(self):
        return 8 * self.groups * self.width

    def numpy(self, env):
        n = self.groups * self.width
        env.array(self.y)[:n] = env.array(self.x)[Part(self.every, self.start, self.width).indices(self.groups)]

    def args(self, denv):
        from lanefuse.kernels.cupy_env import i64

        return (denv.array(self.x), denv.array(self.y), i64(self.groups), i64(self.every), i64(self.start),
                i64(self.width))
