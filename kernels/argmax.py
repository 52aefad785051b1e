"""`argmax`: the index of each row's largest value (numpy's: the first on ties, a NaN above every number), as i32;
with an `advance` (fused_sampling) it also writes the next token into the token buffer the next decode step reads
and moves the position on, on the device (a batch's: every row's token and position). Block maxima in scratch, the last block to arrive finishing (argmax.cu)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import MAX_GRID_Y, Launch, Scratch, names, reach


@dataclass(frozen=True)
class Advance:
    """What the arg-max that closes a step writes besides its result: the last row's index into `token` (element 0)
    and `step` added to `position`; in a batch (`batch`), each row's, row s's token into element s and `step` added to
    sequence s's position."""

    token: str
    position: str
    step: int = 1
    batch: bool = False


class Advancing:
    """A launch closing a step with an `advance` (the arg-max, the sample launch): in a batch step over `pos`, the
    advance moves each sequence's token and position (its `batch` form); any other batching is the launch's own."""

    def batched(self, pos, slot):
        a = self.advance
        if a is None or a.position != pos:
            return super().batched(pos, slot)
        return replace(self, advance=replace(a, batch=True))


@dataclass(frozen=True)
class ArgMax(Advancing, Launch):
    x: str
    out: str
    n: int
    rows: int = 1
    advance: Advance | None = None

    census: ClassVar[str] = "argmax"
    stem: ClassVar[tuple[str, ...]] = ("argmax",)

    @property
    def blocks(self) -> int:
        return max(1, min(128, -(-self.n // 2048)))

    def reads(self):
        return names(self.x, self.advance.position if self.advance else None)

    def writes(self):
        a = self.advance
        return names(self.out, a.token if a else None, a.position if a else None)

    def check(self):
        if self.n < 1 or self.rows < 1:
            return Refusal(f"an arg-max over {self.rows} rows of {self.n} values")
        if self.rows > MAX_GRID_Y:
            return Refusal(f"an arg-max of {self.rows} rows (a launch takes at most {MAX_GRID_Y}, a block row each)")
        return None

    def scratch(self):
        nb = self.blocks * self.rows
        return (Scratch("maxima", "f32", 4 * nb), Scratch("indices", "i32", 4 * nb),
                Scratch("arrivals", "i32", 4, counter=True))

    def extents(self, top, tokens):
        a = self.advance
        each = self.rows if a is not None and a.batch else 1
        return reach((self.x, self.rows * self.n), (self.out, self.rows), (a.token if a else None, each),
                     (a.position if a else None, each))

    def bytes(self):
        return 4 * (self.rows * self.n + self.rows)

    def flops(self):
        return self.rows * self.n

    def numpy(self, env):
        x = env.array(self.x)[: self.rows * self.n].reshape(self.rows, self.n)
        idx = np.argmax(x, axis=1).astype(np.int32)  # the first index of the largest value
        env.array(self.out)[: self.rows] = idx
        a = self.advance
        if a is not None and a.batch:
            env.array(a.token)[: self.rows] = idx
            env.array(a.position)[: self.rows] += a.step
        elif a is not None:
            env.array(a.token)[0] = idx[-1]
            env.array(a.position)[0] += a.step

    def grid_block(self):
        return ((self.blocks, self.rows, 1), (256, 1, 1))

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import NULL, i64

        g, b = self.grid_block()
        bv, bi, cnt = (denv.scratch(self, s) for s in self.scratch())
        a = self.advance
        denv.function(self.stem, "argmax_rows")(g, b, (
            denv.array(self.x), denv.array(self.out), bv, bi, cnt, i64(self.n), i64(self.rows),
            denv.array(a.token) if a else NULL, denv.array(a.position) if a else NULL, i64(a.step if a else 0),
            i64(1 if a is not None and a.batch else 0)))
