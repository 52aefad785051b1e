"""`gather`: embedding rows of a constant table (checkpoint rows in a format — a block format's rows decoded from their
own blocks alone — or f32 values) at the i32 indices, optionally scaled (embed_scale)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from lanefuse.kernels.common import FORMAT_CODE, Launch, decode, format_refusal, reach, table_rows, weight_bytes


@dataclass(frozen=True)
class Gather(Launch):
    table: str
    index: str
    out: str
    cols: int
    rows: int = 1
    format: str = "f32"
    scale: float | None = None

    census: ClassVar[str] = "gather"
    stem: ClassVar[tuple[str, ...]] = ("gather",)

    def reads(self):
        return (self.table, self.index)

    def writes(self):
        return (self.out,)

    def check(self):
        return format_refusal(self.format, self.cols, "the gather")

    def extents(self, top, tokens):
        return reach((self.table, tokens * self.cols), (self.index, self.rows), (self.out, self.rows * self.cols))

    def weights(self):
        return {self.table: self.format}

    def checkpoint_bytes(self):
        return weight_bytes(self.format, self.rows, self.cols)  # the gathered rows only

    def bytes(self):
        return self.checkpoint_bytes() + 4 * self.rows * self.cols + 4 * self.rows

    def numpy(self, env):
        raw, fmt = env.weight(self.table)
        idx = env.array(self.index)[: self.rows].astype(np.int64)
        rows = decode(table_rows(raw, fmt, self.cols)[idx], fmt)  # a block format: only the gathered rows' blocks
        if self.scale is not None:
            rows = rows * np.float32(self.scale)
        env.array(self.out)[: self.rows * self.cols] = rows.reshape(-1)

    def grid_block(self):
        return ((self.rows, 1, 1), (256, 1, 1))

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import f32, i64

        g, b = self.grid_block()
        denv.function(self.stem, "gather")(g, b, (
            denv.weight(self.table)[0], i64(FORMAT_CODE[self.format]), denv.array(self.index), denv.array(self.out),
            i64(self.cols), f32(1.0 if self.scale is None else self.scale)))
