"""`set_row`: a cache write in place: `count` rows of src into the table's rows from the row a parameter names (or a
fixed row); rows past the table's `len` are dropped. In a batch (`slot` set) row s (from `seq0`) is a sequence's own:
it lands in the table's row s·slot + row[s], its sequence's slot at its position. With `quant` (row_write_quant: a
product reads the table quantized) the table's quantized form too, every block of it from the rows written or the
table's own values (set_row_quant: a warp a block of 32)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import QBLOCK, batch_apart, names, reach
from lanefuse.kernels.elementwise import Elementwise
from lanefuse.kernels.quant import QuantEpilogue

WARPS = 4  # set_row_quant: warps a block, a block of 32 values each


@dataclass(frozen=True)
class SetRow(QuantEpilogue, Elementwise):
    table: str
    src: str
    row: str | int
    cols: int
    count: int
    len: int
    slot: int = 0  # a batch's table rows a sequence (0: one sequence)
    seq0: int = 0  # a batch launch's first sequence (the `sequences` step held: one launch a sequence)
    quant: str | None = None  # the table's quantized form after the write (the q8 numerics), all `len` rows of it
    words: int = 0  # its int8 words a value (q8 1, q8x2 2)

    census: ClassVar[str] = "set_row"
    stem: ClassVar[tuple[str, ...]] = ("quant", "set_row")
    steps: ClassVar[tuple[str, ...]] = ("sequences",)  # a batch apart, one launch a sequence (`apart`)
    inputs: ClassVar[tuple[str, ...]] = ("src", "row")  # row: a parameter's name, or a fixed row (not read)
    output: ClassVar[str] = "table"
    k_form: ClassVar[bool] = False  # set_row_quant writes q8 and q8x2 forms, blocks of 32

    def elements(self):
        return self.count * self.cols

    def writes(self):
        return names(self.table, self.quant)

    def check(self):
        if self.quant is None:
            return None
        why = self.epilogue_refusal(self.len * self.cols, "a table written by rows")
        if why:
            return why
        if self.cols % QBLOCK:
            return Refusal(f"a table of rows of {self.cols} values quantized in blocks of {QBLOCK} (a block would "
                           f"span a row written and one not)")
        return None

    def batched(self, pos, slot):
        if self.row != pos:
            return super().batched(pos, slot)
        return replace(self, slot=slot)

    def apart(self):
        return batch_apart(self, "count")

    def extents(self, top, tokens):
        if self.quant is not None:  # every row of the table read, its whole quantized form written
            return reach((self.src, (self.seq0 + self.count) * self.cols if self.slot else self.count * self.cols),
                         (self.row, self.seq0 + self.count if self.slot else 0), (self.table, self.len * self.cols),
                         (self.quant, self.len * self.cols))
        if self.slot:
            last = self.seq0 + self.count - 1
            return reach((self.src, (last + 1) * self.cols), (self.row, last + 1),
                         (self.table, min(last * self.slot + top + 1, self.len) * self.cols))
        r = top if isinstance(self.row, str) else self.row  # rows past `len` are dropped
        return reach((self.src, self.count * self.cols),
                     (self.table, min(r + self.count, self.len) * self.cols if r < self.len else 0))

    def bytes(self):
        if self.quant is not None:  # the rows written, every other row read, the whole form written
            return 4 * (self.len + self.count) * self.cols + self.epilogue_bytes(self.len * self.cols)
        return 8 * self.count * self.cols

    def numpy(self, env):
        if self.slot:
            table, src, c = env.array(self.table), env.array(self.src), self.cols
            for s in range(self.seq0, self.seq0 + self.count):
                r = s * self.slot + env.array(self.row)[s]
                table[r * c: (r + 1) * c] = src[s * c: (s + 1) * c]
        else:
            r0 = env.param(self.row) if isinstance(self.row, str) else int(self.row)
            n = max(0, min(self.count, self.len - r0)) * self.cols
            env.array(self.table)[r0 * self.cols: r0 * self.cols + n] = env.array(self.src)[:n]
        if self.quant is not None:  # from the table's values after the write, as the kernel's blocks take them
            self.epilogue_write(env, np.asarray(env.array(self.table)[: self.len * self.cols]))

    def grid_block(self):
        if self.quant is None:
            return super().grid_block()
        return ((-(-self.len * self.cols // (QBLOCK * WARPS)), 1, 1), (32 * WARPS, 1, 1))

    def cuda(self, denv):
        if self.quant is None:
            super().cuda(denv)
            return
        g, b = self.grid_block()
        denv.function(self.stem, "set_row_quant")(g, b, (*self.args(denv), *self.epilogue_args(denv)))

    def args(self, denv):
        from lanefuse.kernels.cupy_env import NULL, i64

        rowp = denv.array(self.row) if isinstance(self.row, str) else NULL
        fixed = self.row if isinstance(self.row, int) else 0
        return (denv.array(self.table), rowp, i64(fixed), denv.array(self.src), i64(self.cols), i64(self.count),
                i64(self.len), i64(self.slot), i64(self.seq0))
