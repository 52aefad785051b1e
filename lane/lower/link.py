"""The link: each op of the optimized graph to the launches the lane's table names for it, each launch with the lifted
ops it computes. A lifted op takes its kind's launch; a fused op of a class the lane links whole takes its class's
launch (fields filled from the rule's pattern variables) or its hook's; a class the lane runs as its parts takes each
part's launches; a class the lane refuses, or a launch whose kind refuses its fields, gives a `Refusal` (returned,
not raised: the shim prices it as never chosen, `plan()` turns it into the user's error). Placements become launch
fields; an input read strided (its access) that no field takes, or a placed result no field writes there, is a
refusal too."""

from __future__ import annotations

from dataclasses import dataclass, field

from lanefuse.engine.ir import Graph, Op
from lanefuse.engine.opdefs import full_attrs, opdef
from lanefuse.engine.placement import absorbed, copied_views, row_writes
from lanefuse.engine.refusal import Refusal
from lanefuse.kernels import KINDS, Dst
from lanefuse.lane.lower.fill import Scope, Strided, evaluate
from lanefuse.lane.lower.hooks import HOOKS
from lanefuse.lane.lower.placement import placed_parts, placed_whole, to_dst, to_part
from lanefuse.lane.lower.table import Choice, LaneTable, is_launches


@dataclass
class Linked:
    """One launch and the lifted ops (their outputs) it computes."""

    launch: object
    ops: tuple[str, ...]
    layer: int = -1
    cls: str | None = None
    rule: str | None = None


def refused(why, where: str) -> Refusal:
    """A kind's `check()` result (a Refusal) placed at `where`."""
    return why.at(where) if isinstance(why, Refusal) else Refusal(str(why), where)


def where_of(op: Op) -> str:
    """How a refusal names an op: its class and rule, or its kind, and its output."""
    return f"class `{op.cls}` ({op.rule}) -> `{op.out}`" if op.fused else f"`{op.kind}` -> `{op.out}`"


def covered(op: Op) -> tuple[str, ...]:
    return tuple(leaf.out for leaf in op.leaves())


def untaken(scope: Scope, what: str, where: str) -> Refusal | None:
    """A strided read of the op that the fields of its launch (`what`) did not take: it cannot be honoured."""
    left = scope.untaken()
    if not left:
        return None
    return Refusal(f"a strided read of {left[0]} that the {what} kernel cannot take", where)


@dataclass
class Link:
    g: Graph
    table: LaneTable
    held_steps: frozenset[str] = frozenset()
    knobs: object = None  # the lane's knobs, which a table's `if:` may read (tensor_cores)
    hooks: dict = field(default_factory=lambda: dict(HOOKS))
    _copied: tuple | None = field(default=None, repr=False)

    # -- the public entry --------------------------------------------------------------------------------------
    def op(self, op: Op, placed: dict[str, Dst] | None = None) -> list[Linked] | Refusal:
        """`op`'s launches, or why the lane cannot run it. In a batch step (its position one a sequence) every launch
        that touches the position runs over the batch's sequences, each over its own slot of the caches, or says
        why it cannot (`Launch.batched`)."""
        got = self._op(op, placed)
        batch = self.batch()
        if isinstance(got, Refusal) or batch is None:
            return got
        why = self.batch_placement(op, batch)
        if why is not None:
            return why
        out = []
        for x in got:
            l = x.launch.batched(*batch)
            if isinstance(l, Refusal):
                return refused(l, where_of(op))
            out.append(Linked(l, x.ops, x.layer, x.cls, x.rule))
        return out

    def batch(self) -> tuple[str, int] | None:
        """A batch step's position parameter and the cache rows of each sequence's slot; None for one sequence."""
        io = self.g.io
        t = self.g.tensors.get(io.position)
        if t is None or t.shape[0] <= 1 or not io.caches:
            return None
        return io.position, self.g.tensors[io.caches[0][0]].shape[0] // t.shape[0]

    def batch_placement(self, op: Op, batch: tuple[str, int]) -> Refusal | None:
        """A placement in a batch step (before extraction folds it into its row's producer): refused where the
        lifted producer, writing straight into each sequence's cache row, cannot run over the batch."""
        r = absorbed(op)
        writes = [w for w in row_writes(op) if w.src == r]
        producer = next((o for o in self.g.ops if o.out == r and not o.fused), None)
        if r is None or not writes or producer is None:
            return None
        got = self._op(producer, {r: to_dst(self.g, writes[0].dst)})
        if isinstance(got, Refusal):
            return got
        for x in got:
            why = x.launch.batched(*batch)
            if isinstance(why, Refusal):
                return refused(why, where_of(op))
        return None

    def _op(self, op: Op, placed: dict[str, Dst] | None = None) -> list[Linked] | Refusal:
        placed = dict(placed or {})
        if op.dst is not None:
            placed[op.out] = to_dst(self.g, op.dst)
        if not op.fused:
            l = self.lifted(op, placed)
            return l if isinstance(l, Refusal) else [Linked(l, covered(op), op.layer)]
        entry = self.table.support(op.cls)
        support = entry.support
        if support == "native" and any(op.cls in self.table.gated.get(h, ()) for h in self.held_steps):
            support = "decompose"  # a held schedule step of the lane's table runs this class as its parts
        if support == "refuse":
            return Refusal(entry.reason, where_of(op))
        if support == "decompose":
            # run as its parts: a result the fusion placed in a table's rows goes back to its own buffer, and the
            # row write among the parts copies it there
            parts, rest = placed_parts(op, placed)
            out: list[Linked] = []
            for p in parts:
                got = self.op(p, rest)
                if isinstance(got, Refusal):
                    return got
                out.extend(got)
            return out
        scope = self.scope_fused(op, placed_whole(self.g, op, placed))
        ch = self.pick(list(entry.choices), scope)
        assert ch is not None  # the table's last choice has no `if:`
        if ch.refuse:
            return Refusal(ch.refuse, where_of(op))
        if ch.hook:
            hook = self.hooks.get(ch.hook)
            if hook is None:
                return Refusal(f"the lane table names link hook `{ch.hook}`, which lanefuse does not have",
                               entry.where)
            launches = hook(self, op, scope)
        else:
            launches = [self.build(ch, scope)]
        if isinstance(launches, Refusal):
            return launches
        for l in launches:
            if isinstance(l, Refusal):
                return l
        left = untaken(scope, ch.launch or ch.hook, where_of(op))
        if left:
            return left
        for l in launches:
            why = l.check()
            if why:
                return refused(why, f"class `{op.cls}` -> `{op.out}`")
        return [Linked(l, covered(op) if i == len(launches) - 1 else (), op.layer, op.cls, op.rule)
                for i, l in enumerate(launches)]

    def copied(self) -> frozenset[str]:
        """The views of the graph linked that are taken as copies (engine/placement.py), worked out once a graph."""
        hit = self._copied
        if hit is None or hit[0] is not self.g:
            hit = self._copied = (self.g, copied_views(self.g))
        return hit[1]

    # -- lifted ops --------------------------------------------------------------------------------------------
    def scope_lifted(self, op: Op, placed: dict[str, Dst]) -> Scope:
        d = opdef(op.kind)
        names: dict = {"out": op.out, "kind": op.kind}
        for i, n in enumerate(d.names):
            names[n] = op.ins[i] if i < len(op.ins) else None
        names.update(full_attrs(op))
        strided = _strided(op)
        via = {r.input: (k,) for k, r in enumerate(strided)}  # an input's reads by its name
        return Scope(names, self.g, placed, strided, via, where=f"lane {self.table.name}: ops.{op.kind}",
                     copied=self.copied, knobs=self.knobs)

    def lifted(self, op: Op, placed: dict[str, Dst]):
        choices = self.table.ops.get(op.kind)
        if not choices:
            return Refusal(f"the {self.table.name} lane has no launch for `{op.kind}`", where_of(op))
        scope = self.scope_lifted(op, placed)
        ch = self.pick(choices, scope)
        if ch is None:
            return Refusal("no entry of the lane's table applies", scope.where)
        if ch.refuse:
            return Refusal(ch.refuse, where_of(op))
        l = self.build(ch, scope)
        if isinstance(l, Refusal):
            return l
        left = untaken(scope, ch.launch, where_of(op))
        if left:
            return left
        if op.out in placed and op.out not in scope.wrote:
            return Refusal(f"a result placed in `{placed[op.out].buf}` that the {ch.launch} kernel cannot write there",
                           where_of(op))
        why = l.check()
        return refused(why, where_of(op)) if why else l

    def pick(self, choices: list[Choice], scope: Scope) -> Choice | None:
        """The first entry whose `if:` holds; None where none does."""
        for ch in choices:
            if ch.when is None or evaluate(ch.when, scope):
                return ch
        return None

    # -- fused ops ---------------------------------------------------------------------------------------------
    def scope_fused(self, op: Op, placed: dict[str, Dst]) -> Scope:
        names: dict = {"out": op.out, "kind": op.cls}
        names.update(op.b)
        leaves = op.leaves()
        strided = tuple(r for leaf in leaves if leaf.access for r in _strided(leaf))
        via = {}  # a pattern variable -> the reads of the tensor it binds
        if strided:
            for v, t in op.binds:
                ks = tuple(k for k, r in enumerate(strided) if isinstance(t, str) and r.tensor == t)
                if ks:
                    via[v] = ks
        return Scope(names, self.g, placed, strided, via, where=f"lane {self.table.name}: classes.{op.cls}",
                     copied=self.copied, leaves=leaves, knobs=self.knobs)

    def build(self, ch: Choice, scope: Scope):
        """The launch `ch` names with its fields filled in `scope`, or why its fields make none."""
        kw = {}
        for name, expr in ch.fields.items():
            if is_launches(expr):  # launches in turn (a chain's phases): a tuple of them
                subs = tuple(self.build(Choice(None, e["launch"], e.get("fields") or {}), scope) for e in expr)
                bad = next((x for x in subs if isinstance(x, Refusal)), None)
                if bad is not None:
                    return bad
                kw[name] = subs
            elif isinstance(expr, dict) and "launch" in expr:
                sub = self.build(Choice(None, expr["launch"], expr.get("fields") or {}), scope)
                if isinstance(sub, Refusal):
                    return sub
                kw[name] = sub
            else:
                kw[name] = evaluate(expr, scope)
        try:
            return KINDS[ch.launch](**kw)
        except TypeError as e:
            return Refusal(f"the table's fields do not make a `{ch.launch}` launch: {e}", scope.where)


def _strided(op: Op) -> tuple[Strided, ...]:
    """Lifted op `op`'s inputs read as a part of every unit of a wider tensor, by their names."""
    if not op.access:
        return ()
    names = opdef(op.kind).names
    return tuple(Strided(op.out, i, names[i], op.ins[i], to_part(a)) for i, a in enumerate(op.access)
                 if a is not None)


def link(g: Graph, table: LaneTable, held_steps=frozenset(), knobs=None) -> list[Linked] | Refusal:
    """Every op of `g` to its launches, in order; or the refusal of the first op the lane cannot run."""
    lk = Link(g, table, frozenset(held_steps), knobs=knobs)
    out: list[Linked] = []
    for op in g.ops:
        got = lk.op(op)
        if isinstance(got, Refusal):
            return got
        out.extend(got)
    return out
