"""`set_row`: a cache write in place: `count` rows of src into the table's rows from the row a parameter names (or a
fixed row); rows past the table's `len` are dropped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import reach
from lanefuse.kernels.elementwise import Elementwise


@dataclass(frozen=True)
class SetRow(Elementwise):
    table: str
    src: str
    row: str | int
    cols: int
    count: int
    len: int
    quant: bool = False  # reserved: the row's quantized form carried too

    census: ClassVar[str] = "set_row"
    stem: ClassVar[tuple[str, ...]] = ("set_row",)
    inputs: ClassVar[tuple[str, ...]] = ("src", "row")  # row: a parameter's name, or a fixed row (not read)
    output: ClassVar[str] = "table"

    def elements(self):
        return self.count * self.cols

    def check(self):
        return Refusal("a row write carrying its quantized form (not written yet)") if self.quant else None

    def extents(self, top, tokens):
        r = top if isinstance(self.row, str) else self.row  # rows past `len` are dropped
        return reach((self.src, self.count * self.cols),
                     (self.table, min(r + self.count, self.len) * self.cols if r < self.len else 0))

    def bytes(self):
        return 8 * self.count * self.cols

    def numpy(self, env):
        r0 = env.param(self.row) if isinstance(self.row, str) else int(self.row)
        n = max(0, min(self.count, self.len - r0)) * self.cols
        env.array(self.table)[r0 * self.cols: r0 * self.cols + n] = env.array(self.src)[:n]

    def args(self, denv):
        from lanefuse.kernels.cupy_env import NULL, i64

        rowp = denv.array(self.row) if isinstance(self.row, str) else NULL
        fixed = self.row if isinstance(self.row, int) else 0
        return (denv.array(self.table), rowp, i64(fixed), denv.array(self.src), i64(self.cols), i64(self.count),
                i64(self.len))
