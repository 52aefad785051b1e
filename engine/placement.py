"""Row placement on the IR side: a result written straight into rows of a cache table instead of its own buffer (a
placement rule's `absorb`: its row write folded into the op that computes the row), which tensors live inside
another (a table after a row write, a row view of a tensor), and which views must be copies because their table is
written in place before their last reader. An op's inputs are read by name (engine/opdefs.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from lanefuse.engine.ir import Dst, Graph, Op, RowSel, attrs_of
from lanefuse.engine.opdefs import OPS

ABSORB = "absorb"  # the attribute of a placement's fused op: the pattern variable whose producer writes the row
PLACED = "placed_rows"  # the bind a fused producer gains for each row placed in it: ((row, table, pos), ...)


def arg(op: Op, name: str) -> str | None:
    """Lifted op `op`'s input `name` (as its kind's definition names it), None where an optional one is missing."""
    k = OPS[op.kind].position[name]
    return op.ins[k] if k < len(op.ins) else None


@dataclass(frozen=True)
class RowWrite:
    """One row write (`set_row`): `src`'s rows into `table` from the row parameter `pos` names; `out` is the table
    after the write (the same array)."""

    table: str
    src: str
    pos: str
    out: str

    @property
    def dst(self) -> Dst:
        """Where the row write puts `src`: the table's rows from the row `pos` names."""
        return Dst(self.table, RowSel(param=self.pos))


def row_write(op: Op) -> RowWrite | None:
    if op.fused or op.kind != "set_row":
        return None
    return RowWrite(arg(op, "table"), arg(op, "src"), arg(op, "pos"), op.out)


def row_writes(op: Op) -> list[RowWrite]:
    """The row writes among `op`'s lifted ops, in order."""
    return [w for w in map(row_write, op.leaves()) if w is not None]


def absorbed(op: Op) -> str | None:
    """The tensor a placement's fused op places into a table's rows (its producer writes the row: the placement is
    no launch of its own); None for any other op."""
    var = op.a.get(ABSORB) if op.fused else None
    return None if var is None else op.b[var]


def computed_row_writes(op: Op) -> list[RowWrite]:
    """The row writes among a fused op's parts whose rows the op computes itself: linked whole, the op writes those
    rows straight into the table and the row write is no launch."""
    outs = {leaf.out for leaf in op.leaves()}
    return [w for w in row_writes(op) if w.src in outs]


# -- the engine: a placement folded into the op that computes its row --------------------------------------------------

def fold(ops: list[Op], pl: Op, writer: dict[str, int]) -> None:
    """Fold placement `pl` into the op of `ops` that writes the tensor it absorbs: that op's part computing it gets the
    row write's destination, the row write joins its parts, and the op's result (or kept result) is the table after the
    write. A lifted producer becomes a fused op of the placement's class. `writer` (tensor -> index in `ops`) follows
    the change."""
    src = absorbed(pl)
    row = pl.parts[-1]  # the row write the placement absorbs
    w = row_write(row)
    assert w is not None and w.src == src, f"placement `{pl.rule}` absorbs `{src}` but its last part writes `{row.out}`"
    k = writer.get(src)
    if k is None:
        raise RuntimeError(f"placement `{pl.rule}`: no op writes `{src}`")
    op = ops[k]
    d = w.dst
    ins = tuple(dict.fromkeys(op.ins + (w.table,)))
    if not op.fused:
        ops[k] = Op("fused", ins, pl.out, dst=d, layer=op.layer, cls=pl.cls, rule=pl.rule,
                    parts=(replace(op, dst=d), row), binds=pl.binds)
    else:
        parts = tuple(replace(p, dst=d) if p.out == src else p for p in op.parts) + (row,)
        placed = tuple(op.b.get(PLACED, ())) + ((src, w.table, w.pos),)
        ops[k] = replace(op, ins=ins, out=pl.out if op.out == src else op.out,
                         keeps=tuple(pl.out if x == src else x for x in op.keeps), parts=parts,
                         binds=attrs_of({**op.b, PLACED: placed}))
    del writer[src]
    writer[pl.out] = k


# -- buffers: what lives inside another tensor ---------------------------------------------------------------------

def _view_offset(g: Graph, leaf: Op) -> int:
    return leaf.a["row"] * g.shape(arg(leaf, "x"))[1]


def _inside(g: Graph) -> tuple[dict[str, tuple[str, int]], dict[str, tuple[str, int]]]:
    """What lives inside another tensor, name -> (the tensor it is part of, element offset): the tables after their
    row writes (the table itself), and every row view."""
    rows: dict[str, tuple[str, int]] = {}
    views: dict[str, tuple[str, int]] = {}
    for op in g.ops:
        for leaf in op.leaves():
            w = row_write(leaf)
            if w is not None:
                rows[w.out] = (w.table, 0)
            elif leaf.kind == "view":
                views[leaf.out] = (arg(leaf, "x"), _view_offset(g, leaf))
    return rows, views


def home_of(name: str, al: dict[str, tuple[str, int]]) -> tuple[str, int]:
    """The tensor whose array holds `name`, and `name`'s element offset there."""
    off = 0
    seen = set()
    while name in al and name not in seen:
        seen.add(name)
        name, o = al[name]
        off += o
    return name, off


def writes_in_place(op: Op) -> list[str]:
    """The tensors `op` writes in place: the tables of its row writes and of the destinations it or its parts
    write into."""
    out = [w.table for w in row_writes(op)]
    out += [leaf.dst.table for leaf in op.leaves() if leaf.dst is not None]
    if op.dst is not None:
        out.append(op.dst.table)
    return out


def copied_views(g: Graph, rows: dict[str, tuple[str, int]] | None = None) -> frozenset[str]:
    """The views that are copies when taken: those whose tensor's home is written in place after the view and before
    the view's last reader (a reader of a view of it included). The rest are free views into their tensor. `rows`:
    the tables after their row writes, where the caller has them."""
    ops = g.ops
    views = [(k, leaf) for k, op in enumerate(ops) for leaf in op.leaves() if leaf.kind == "view"]
    if not views:
        return frozenset()
    rows = _inside(g)[0] if rows is None else rows
    last: dict[str, int] = {}
    for k, op in enumerate(ops):
        for i in op.ins:
            last[i] = k
    for n in g.io.outputs:
        last[n] = len(ops)
    writes: dict[str, list[int]] = {}  # home -> the ops that write it in place
    for k, op in enumerate(ops):
        for t in writes_in_place(op):
            writes.setdefault(home_of(t, rows)[0], []).append(k)
    free: dict[str, str] = {}  # a free view -> its tensor
    copied: set[str] = set()
    end: dict[str, int] = {}  # a view -> the last op that reads it, through a free view of it too
    for k, leaf in reversed(views):  # a view of this view comes later: decided first
        x = arg(leaf, "x")
        stop = max([last.get(leaf.out, k)] + [end[v] for v, src in free.items() if src == leaf.out])
        if any(k < j <= stop for j in writes.get(home_of(x, rows)[0], ())):
            copied.add(leaf.out)
        else:
            free[leaf.out] = x
        end[leaf.out] = stop
    return frozenset(copied)


def aliases(g: Graph) -> dict[str, tuple[str, int]]:
    """Tensors that live inside another: a table after a row write (the table itself) and a row view that is not a
    copy (a part of its tensor). name -> (tensor it is part of, element offset)."""
    rows, views = _inside(g)
    copied = copied_views(g, rows)
    return {**rows, **{n: v for n, v in views.items() if n not in copied}}


def views_first(ops: list[Op], index: dict[str, int]) -> list[Op]:
    """`ops` (a valid order) with each view taken before the op that writes its tensor in place where the step graph
    (`index`: tensor -> its op's place there) takes the view first: a placement folds a row write into its producer,
    which may come before the view. A view reads only its tensor: it moves where that tensor is computed before the
    writer."""
    ops = list(ops)
    if not any(op.kind == "view" for op in ops):
        return ops
    rows: dict[str, tuple[str, int]] = {}
    for op in ops:
        for w in row_writes(op):
            rows[w.out] = (w.table, 0)
    k = 0
    while k < len(ops):
        op = ops[k]
        if op.fused or op.kind != "view":
            k += 1
            continue
        home = home_of(arg(op, "x"), rows)[0]
        at = index.get(op.out, -1)
        first = next((j for j in range(k) if any(home_of(t, rows)[0] == home for t in writes_in_place(ops[j]))
                      and _written_after(ops[j], home, rows, index, at)), None)
        made = next((j for j in range(k) if arg(op, "x") in ops[j].outs), -1)  # the view's tensor's op
        if first is None or made >= first:
            k += 1
            continue
        ops.insert(first, ops.pop(k))
        k += 1
    return ops


def _written_after(op: Op, home: str, rows, index: dict[str, int], at: int) -> bool:
    """Whether the step graph writes `home` in `op` after its place `at`: a row write or destination of a part that
    comes later there."""
    for leaf in op.leaves():
        w = row_write(leaf)
        t = w.table if w is not None else leaf.dst.table if leaf.dst is not None else None
        if t is not None and home_of(t, rows)[0] == home and index.get(leaf.out, -1) > at:
            return True
    return False
