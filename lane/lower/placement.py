"""Placement: where a launch writes a result that does not go to its own buffer (a cache table's row, a part of every
unit of a wider tensor), and where it reads a part of one — the IR's destinations and accesses as the kernels'
`Dst` and `Part`."""

from __future__ import annotations

from lanefuse.engine.ir import Graph
from lanefuse.kernels import Dst, Part


def to_part(acc) -> Part | None:
    return None if acc is None else Part(acc.pitch, acc.offset, acc.width)


def to_dst(g: Graph, d) -> Dst:
    """An IR destination as a launch's: the table's rows from the row a parameter names (or a fixed row)."""
    pitch = g.shape(d.table)[-1]
    row = None if d.row is None else (d.row.param if d.row.param is not None else d.row.fixed)
    return Dst(d.table, row, pitch, to_part(d.unit))
