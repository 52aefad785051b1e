"""The cost a plan is extracted under until a lane passes its own: one launch's fixed overhead plus the bytes it
moves over the bandwidth, in microseconds. `Refusal` is how any cost function says an op can never run."""

from __future__ import annotations

from typing import Protocol

from lanefuse.engine.ir import Graph, Op
from lanefuse.engine.placement import absorbed, arg, row_write
from lanefuse.engine.refusal import Refusal

LAUNCH_US = 2.5  # a kernel launch's fixed cost
BYTES_PER_US = 3.0e6  # ~3 TB/s of memory bandwidth
_WIDTH = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4}


class CostFn(Protocol):
    def __call__(self, op: Op, g: Graph) -> float | Refusal: ...


def nbytes(g: Graph, name: str) -> int:
    memo = g.__dict__.get("_nbytes")  # a name's size never changes once declared
    if memo is None:
        memo = g.__dict__["_nbytes"] = {}
    n = memo.get(name)
    if n is None:
        c = g.constants.get(name)
        if c is not None:
            n = c.size * _WIDTH.get(c.format if c.kind == "rows" else "f32", 4)
        else:
            t = g.tensors.get(name)
            if t is None:
                return 0  # not declared (yet): not remembered
            n = t.size * _WIDTH.get(t.dtype, 4)
        memo[name] = n
    return n


def _moved(op: Op, g: Graph) -> int:
    w = row_write(op)
    if w is not None:  # reads its rows, writes them into the table: the table itself is not streamed
        return 2 * nbytes(g, w.src)
    if op.kind == "gather":  # reads the rows it copies, not the table
        return 2 * nbytes(g, op.out)
    tables = g.io.table_set
    ins = sum(nbytes(g, i) for i in dict.fromkeys(op.ins) if i not in tables or op.kind == "attention")
    for p in op.leaves() if op.fused else ():
        if p.kind == "gather":  # a fused gather reads rows too
            ins -= nbytes(g, arg(p, "table")) - nbytes(g, p.out)
    return ins + sum(nbytes(g, o) for o in op.outs if o not in tables)


def default_cost(op: Op, g: Graph) -> float | Refusal:
    """One launch per op (a fused op is one launch; a bare arg-max of the next token needs a second to advance),
    plus its bytes moved. A placement (a fused op that absorbs a row write: its producer's launch writes the row
    straight into the table) costs nothing of its own."""
    if absorbed(op) is not None:
        return 0.0
    launches = 1
    if op.kind == "argmax" and op.out == g.io.next:
        launches = 2  # the advance of the token and position runs as a launch of its own
    return launches * LAUNCH_US + _moved(op, g) / BYTES_PER_US
