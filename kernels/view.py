"""`view`: a row or part of a computed tensor read in place, `offset` values into it — no launch: the lane's arena
places `out` inside `src`, so both backends run nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lanefuse.kernels.common import Launch, reach


@dataclass(frozen=True)
class View(Launch):
    src: str
    offset: int
    out: str

    census: ClassVar[str] = "view"
    partial: ClassVar[tuple[str, ...]] = ("src",)  # `out` is a part of it

    def reads(self):
        return (self.src,)

    def writes(self):
        return (self.out,)

    def kernels(self):
        return ()  # no kernel: the arena placed `out` inside `src`

    def extents(self, top, tokens):
        return reach((self.src, self.offset))  # `out` inside `src`: its buffer says where (lane/lower/plancheck.py)

    def bytes(self):
        return 0

    def numpy(self, env):
        return None

    def grid_block(self):
        return ((0, 0, 0), (0, 0, 0))

    def cuda(self, denv):
        return None
