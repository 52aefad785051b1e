"""Placement: where a launch writes a result that does not go to its own buffer (a cache table's row, a part of every
unit of a wider tensor), and where it reads a part of one — the IR's destinations and accesses (engine/placement.py
says which they are) as the kernels' `Dst` and `Part`."""

from __future__ import annotations

from dataclasses import replace

from lanefuse.engine.ir import Graph, Op
from lanefuse.engine.placement import computed_row_writes, row_writes
from lanefuse.kernels import Dst, Part


def to_part(acc) -> Part | None:
    return None if acc is None else Part(acc.pitch, acc.offset, acc.width)


def to_dst(g: Graph, d) -> Dst:
    """An IR destination as a launch's: the table's rows from the row a parameter names (or a fixed row)."""
    pitch = g.shape(d.table)[-1]
    row = None if d.row is None else (d.row.param if d.row.param is not None else d.row.fixed)
    return Dst(d.table, row, pitch, to_part(d.unit))


def placed_whole(g: Graph, op: Op, placed: dict[str, Dst]) -> dict[str, Dst]:
    """Where a fused op linked whole writes its results (tensor -> destination), beyond `placed`: each part's own
    destination, and the rows of a row write among its parts that it computes itself land straight in the table
    (where the row write's result is placed itself, there)."""
    placed = dict(placed)
    for leaf in op.leaves():
        if leaf.dst is not None:
            placed.setdefault(leaf.out, to_dst(g, leaf.dst))
    for w in computed_row_writes(op):
        placed[w.src] = placed.get(w.out) or to_dst(g, w.dst)
    return placed


def placed_parts(op: Op, placed: dict[str, Dst]) -> tuple[list[Op], dict[str, Dst]]:
    """A fused op run as its parts: its parts, each result a row write among them copies into a table back in its own
    buffer (the row write's launch copies it there), and `placed` without those results."""
    written = {w.src for w in row_writes(op)}
    parts = [replace(p, dst=None) if p.dst is not None and p.out in written else p for p in op.parts]
    return parts, {k: v for k, v in placed.items() if k not in written}
