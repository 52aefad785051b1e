"""The link: each op of the optimized graph to the launches the lane's table names for it, each launch with the lifted
ops it computes. A lifted op takes its kind's launch; a fused op of a class the lane links whole takes its class's
launch (fields filled from the rule's pattern variables) or its hook's; a class the lane runs as its parts takes each
part's launches; a refused class is an error with the table's reason. Placements become launch fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lanefuse.engine.ir import Graph, Op
from lanefuse.engine.opdefs import full_attrs, opdef
from lanefuse.kernels import KINDS, Dst, Part
from lanefuse.lane.lower.fill import Scope, evaluate
from lanefuse.lane.lower.table import Choice, LaneTable


class Refused(Exception):
    """The lane cannot run an op: `reason` in the user's words, `where` the op (its class or kind and output)."""

    def __init__(self, reason: str, where: str = ""):
        super().__init__(f"{where}: {reason}" if where else reason)
        self.reason = reason
        self.where = where


@dataclass
class Linked:
    """One launch and the lifted ops (their outputs) it computes."""

    launch: object
    ops: tuple[str, ...]
    layer: int = -1
    cls: str | None = None
    rule: str | None = None


def covered(op: Op) -> tuple[str, ...]:
    return tuple(leaf.out for leaf in op.leaves())


def to_part(acc) -> Part | None:
    return None if acc is None else Part(acc.pitch, acc.offset, acc.width)


def to_dst(g: Graph, d) -> Dst:
    """An IR destination as a launch's: the table's rows from the row a parameter names (or a fixed row)."""
    pitch = g.shape(d.table)[-1]
    row = None if d.row is None else (d.row.param if d.row.param is not None else d.row.fixed)
    return Dst(d.table, row, pitch, to_part(d.unit))


@dataclass
class Link:
    g: Graph
    table: LaneTable
    held_steps: frozenset[str] = frozenset()
    hooks: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.hooks:
            from lanefuse.lane.lower.hooks import HOOKS

            self.hooks = HOOKS

    # -- the public entry --------------------------------------------------------------------------------------
    def op(self, op: Op, placed: dict[str, Dst] | None = None) -> list[Linked]:
        placed = dict(placed or {})
        if op.dst is not None:
            placed[op.out] = to_dst(self.g, op.dst)
        if not op.fused:
            return [Linked(self.lifted(op, placed), covered(op), op.layer)]
        entry = self.table.support(op.cls)
        support = entry.support
        if support == "native" and any(op.cls in self.table.gated.get(h, ()) for h in self.held_steps):
            support = "decompose"  # a held schedule step of the lane's table runs this class as its parts
        if support == "refuse":
            raise Refused(entry.reason, f"class `{op.cls}` ({op.rule}) -> `{op.out}`")
        if support == "decompose":
            # run as its parts: a result the fusion placed in a table's rows goes back to its own buffer, and the
            # row write among the parts copies it there
            written = {leaf.ins[1] for leaf in op.leaves() if leaf.kind == "set_row"}
            out: list[Linked] = []
            for p in op.parts:
                if p.dst is not None and p.out in written:
                    p = dataclasses.replace(p, dst=None)
                out.extend(self.op(p, {k: v for k, v in placed.items() if k not in written}))
            return out
        ch = entry.choice
        assert ch is not None
        placed = self.absorbed(op, placed)
        if ch.hook:
            hook = self.hooks.get(ch.hook)
            if hook is None:
                raise Refused(f"the lane table names link hook `{ch.hook}`, which lanefuse does not have",
                              entry.where)
            launches = hook(self, op, placed)
        else:
            scope = self.scope_fused(op, placed)
            launches = [self.build(ch, scope)]
        for l in launches:
            why = l.check()
            if why:
                raise Refused(why, f"class `{op.cls}` -> `{op.out}`")
        return [Linked(l, covered(op) if i == len(launches) - 1 else (), op.layer, op.cls, op.rule)
                for i, l in enumerate(launches)]

    # -- lifted ops --------------------------------------------------------------------------------------------
    def scope_lifted(self, op: Op, placed: dict[str, Dst]) -> Scope:
        d = opdef(op.kind)
        names: dict = {"out": op.out, "kind": op.kind}
        for i, n in enumerate(d.names):
            names[n] = op.ins[i] if i < len(op.ins) else None
        names.update(full_attrs(op))
        access = {op.ins[i]: to_part(a) for i, a in enumerate(op.access) if a is not None}
        return Scope(names, self.g, placed, access, where=f"lane {self.table.name}: ops.{op.kind}")

    def lifted(self, op: Op, placed: dict[str, Dst]):
        choices = self.table.ops.get(op.kind)
        if not choices:
            raise Refused(f"the {self.table.name} lane has no launch for `{op.kind}`", f"`{op.kind}` -> `{op.out}`")
        scope = self.scope_lifted(op, placed)
        ch = self.pick(choices, scope)
        if ch.refuse:
            raise Refused(ch.refuse, f"`{op.kind}` -> `{op.out}`")
        l = self.build(ch, scope)
        why = l.check()
        if why:
            raise Refused(why, f"`{op.kind}` -> `{op.out}`")
        return l

    def pick(self, choices: list[Choice], scope: Scope) -> Choice:
        for ch in choices:
            if ch.when is None or evaluate(ch.when, scope):
                return ch
        raise Refused("no entry of the lane's table applies", scope.where)

    # -- fused ops ---------------------------------------------------------------------------------------------
    def absorbed(self, op: Op, placed: dict[str, Dst]) -> dict[str, Dst]:
        """Where a fused op linked whole writes its results: a part's own destination, and the source of a row
        write among its parts lands straight in the table's rows (the row write is no launch)."""
        placed = dict(placed)
        leaves = op.leaves()
        for leaf in leaves:
            if leaf.dst is not None:
                placed.setdefault(leaf.out, to_dst(self.g, leaf.dst))
        outs = {leaf.out for leaf in leaves}
        for leaf in leaves:
            if leaf.kind == "set_row" and leaf.ins[1] in outs:
                pitch = self.g.shape(leaf.ins[0])[-1]
                placed[leaf.ins[1]] = placed.get(leaf.out) or Dst(leaf.ins[0], leaf.ins[2], pitch)
        return placed

    def scope_fused(self, op: Op, placed: dict[str, Dst]) -> Scope:
        names: dict = {"out": op.out, "kind": op.cls}
        names.update(op.b)
        access: dict[str, Part] = {}
        for leaf in op.leaves():
            for i, a in enumerate(leaf.access):
                if a is not None:
                    access[leaf.ins[i]] = to_part(a)
        return Scope(names, self.g, placed, access, where=f"lane {self.table.name}: classes.{op.cls}",
                     leaves=tuple(op.leaves()))

    def build(self, ch: Choice, scope: Scope):
        kw = {}
        for name, expr in ch.fields.items():
            if isinstance(expr, dict) and "launch" in expr:
                sub = Choice(None, expr["launch"], expr.get("fields") or {})
                kw[name] = self.build(sub, scope)
            else:
                kw[name] = evaluate(expr, scope)
        try:
            return KINDS[ch.launch](**kw)
        except TypeError as e:
            raise Refused(f"the table's fields do not make a `{ch.launch}` launch: {e}", scope.where) from None


def link(g: Graph, table: LaneTable, held_steps=frozenset()) -> list[Linked]:
    """Every op of `g` to its launches, in order; the first op the lane cannot run raises `Refused`."""
    lk = Link(g, table, frozenset(held_steps))
    out: list[Linked] = []
    for op in g.ops:
        out.extend(lk.op(op))
    return out
