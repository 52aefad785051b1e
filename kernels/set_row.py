"""`set_row`: a cache write in place: `count` rows of src into the table's rows from the row a parameter names (or a
fixed row); rows past the table's `len` are dropped. In a batch (`slot` set) row s (from `seq0`) is a sequence's own:
it lands in the table's row s·slot + row[s], its sequence's slot at its position."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import batch_apart, reach
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
    slot: int = 0  # a batch's table rows a sequence (0: one sequence)
    seq0: int = 0  # a batch launch's first sequence (the `sequences` step held: one launch a sequence)

    census: ClassVar[str] = "set_row"
    stem: ClassVar[tuple[str, ...]] = ("set_row",)
    steps: ClassVar[tuple[str, ...]] = ("sequences",)  # a batch apart, one launch a sequence (`apart`)
    inputs: ClassVar[tuple[str, ...]] = ("src", "row")  # row: a parameter's name, or a fixed row (not read)
    output: ClassVar[str] = "table"

    def elements(self):
        return self.count * self.cols

    def check(self):
        return Refusal("a row write carrying its quantized form (not written yet)") if self.quant else None

    def batched(self, pos, slot):
        if self.row != pos:
            return super().batched(pos, slot)
        return replace(self, slot=slot)

    def apart(self):
        return batch_apart(self, "count")

    def extents(self, top, tokens):
        if self.slot:
            last = self.seq0 + self.count - 1
            return reach((self.src, (last + 1) * self.cols), (self.row, last + 1),
                         (self.table, min(last * self.slot + top + 1, self.len) * self.cols))
        r = top if isinstance(self.row, str) else self.row  # rows past `len` are dropped
        return reach((self.src, self.count * self.cols),
                     (self.table, min(r + self.count, self.len) * self.cols if r < self.len else 0))

    def bytes(self):
        return 8 * self.count * self.cols

    def numpy(self, env):
        if self.slot:
            table, src, c = env.array(self.table), env.array(self.src), self.cols
            for s in range(self.seq0, self.seq0 + self.count):
                r = s * self.slot + env.array(self.row)[s]
                table[r * c: (r + 1) * c] = src[s * c: (s + 1) * c]
            return
        r0 = env.param(self.row) if isinstance(self.row, str) else int(self.row)
        n = max(0, min(self.count, self.len - r0)) * self.cols
        env.array(self.table)[r0 * self.cols: r0 * self.cols + n] = env.array(self.src)[:n]

    def args(self, denv):
        from lanefuse.kernels.cupy_env import NULL, i64

        rowp = denv.array(self.row) if isinstance(self.row, str) else NULL
        fixed = self.row if isinstance(self.row, int) else 0
        return (denv.array(self.table), rowp, i64(fixed), denv.array(self.src), i64(self.cols), i64(self.count),
                i64(self.len), i64(self.slot), i64(self.seq0))
