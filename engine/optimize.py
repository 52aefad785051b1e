"""The engine's public API: `optimize(g, table, held, cost, forced, method)` saturates the step graph under the rules
not held back and extracts the cheapest runnable plan; `Session` keeps one loaded e-graph to re-plan for other held
sets, costs and forced choices (the explorer), and lists each tensor's alternatives (`Session.alternatives`), which
a plan's `Optimized.chosen` indexes."""

from __future__ import annotations

import contextlib
import gc
import heapq
import sys
import time
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Callable

from lanefuse.engine.cost_default import CostFn, Refusal, default_cost
from lanefuse.engine.egraph import EGraph, ENode, SatReport, Snapshot
from lanefuse.engine import flags
from lanefuse.engine.errors import UserError, clip, did_you_mean
from lanefuse.engine.extract import INF, NoPlan, Problem, solve_exact, solve_local
from lanefuse.engine.ir import Graph, Op
from lanefuse.engine import placement
from lanefuse.engine.rules import RuleTable, Variant


@dataclass(frozen=True)
class Alternative:
    """One way to compute a tensor: one e-node of its e-class under a held set (`Session.alternatives`).

    `index` is its place among the class's alternatives under that held set, the number `forced` takes; it can move
    when another held set adds or removes alternatives. `signature` says what it is — its constructor, the tensors it
    reads (a bundle it reads by that bundle's own alternatives), its attributes — and is equal for the same
    alternative in the e-graphs of every held set of one Session: compare signatures, not indices, across held sets.
    `op` is the op it stands for: the lifted op, or the fused op with its parts; for one output of a multi-output
    fused op, that fused op (`output` says which of its outputs) and `bundle` every fused op of the bundle (the
    e-graph may hold more than one way to compute the same outputs together); None for a step input or constant."""

    index: int
    label: str  # `matmul`, `gemv_norm_epilogue (gemv_norm_epilogue)`, `merged_qkv (merged_qkv) output 1`, `input`
    cls: str | None
    rule: str | None
    cost: float | Refusal | None  # under the cost function asked with; None when asked with none
    signature: tuple = ()
    op: Op | None = field(default=None, repr=False, compare=False)
    output: int | None = None
    bundle: tuple[Op, ...] = field(default=(), repr=False, compare=False)

    @property
    def kind(self) -> str:
        """`input` (a step input or constant), `lifted`, `fused`, or `output` (one output of a multi-output op)."""
        if self.op is None:
            return "input"
        if self.output is not None:
            return "output"
        return "fused" if self.op.fused else "lifted"


@dataclass
class Optimized:
    """The engine's result: the plan as a graph of lifted and fused ops, the fusions that fired, its cost, and which
    alternative each tensor got (`chosen`: tensor -> the index of its chosen alternative under the plan's held set,
    as `Session.alternatives` numbers them, for every tensor the plan computes or reads; a tensor computed inside a
    fused op that does not write it has none)."""

    graph: Graph
    fusions: dict[str, int]
    summary: dict[str, Any]  # held rules, saturation, e-graph size, time by stage
    cost: float
    warnings: list[str] = field(default_factory=list)
    runners_up: Callable[[], dict[str, Any]] | None = field(default=None, repr=False)
    chosen: dict[str, int] = field(default_factory=dict, repr=False)

    @cached_property
    def trace(self) -> dict[str, Any]:
        """The summary and, for each tensor, the chosen alternative with the runner-up costs (worked out on first
        use: a plan that writes no trace does not pay for it)."""
        return {**self.summary, "tensors": self.runners_up() if self.runners_up else {}}


@contextlib.contextmanager
def gc_paused():
    """Planning allocates a few hundred thousand small objects that all live until the plan is made: the cyclic
    collector's full passes over them would cost a fifth of the time and free nothing."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _Decoded:
    """A snapshot turned into the extraction problem: each node's op (lifted or fused), cost and rank."""

    def __init__(self, snap: Snapshot, eg: EGraph, g: Graph, table: RuleTable):
        self.snap, self.g, self.table, self.eg = snap, g, table, eg
        self._plans: dict[str, tuple] = {}
        self.producer = {op.out: (k, op) for k, op in enumerate(g.ops)}
        self.proj_of: dict[int, dict[int, int]] = {}  # bundle class -> {output index: class}
        for ns in snap.classes.values():
            for n in ns:
                if n.fn == "proj":
                    self.proj_of.setdefault(n.children[0], {})[n.prims[0]] = n.cls
        # every class's nodes in a stable order: inputs, then lifted ops, then fused ops, then projections
        self.nodes: list[ENode] = []
        self.classes: dict[int, list[int]] = {}
        twins = self._twins()
        twin_cls = {t for t in twins if isinstance(t, int)}
        twin_nodes = twins - twin_cls
        for c in sorted(snap.classes, key=lambda c: (snap.names.get(c, "~"), c)):
            if c in twin_cls:
                continue
            ns = snap.classes[c]
            for n in (sorted(ns, key=self._rank_key) if len(ns) > 1 else ns):
                if (twin_nodes and n in twin_nodes) or (n.fn == "proj" and n.children[0] in twin_cls):
                    continue
                self.classes.setdefault(c, []).append(len(self.nodes))
                self.nodes.append(n)
        for t in twins:
            self.proj_of.pop(t, None) if isinstance(t, int) else None
        self.ops: list[Op | None] = [self._op(n) for n in self.nodes]
        self.leaves = {c for c, ns in self.classes.items() if len(ns) == 1 and self.nodes[ns[0]].fn == "Leaf"}
        self.pos = [0] * len(self.nodes)  # node -> its index among its class's nodes
        for ns in self.classes.values():
            for k, i in enumerate(ns):
                self.pos[i] = k
        self._alts: dict[int, list[Alternative]] = {}

    def _twins(self) -> set:
        """Fused nodes (and bundle classes) equal to another but for the order of a commutative op's inputs: the
        same variant over the same inputs into the same results. Extraction keeps the first of each."""
        seen, twins = set(), set()
        for c in sorted(self.snap.classes):
            for n in self.snap.classes[c]:
                if n.fn not in self.eg.variant_of:
                    continue
                outs = tuple(sorted(self.proj_of.get(c, {}).items())) if c in self.proj_of else (c,)
                key = (n.fn, tuple(sorted(n.children)), n.prims, outs)
                if key in seen:
                    twins.add(c if c in self.proj_of else n)
                seen.add(key)
        return twins

    def _rank_key(self, n: ENode):
        fn = n.fn
        tier = 0 if fn == "Leaf" else 1 if fn in self.eg.lifted else 2 if fn in self.eg.variant_of else 3
        get = self.snap.names.get
        return (tier, fn, tuple([get(c, "") for c in n.children]), repr(n.prims) if n.prims else "")

    def name(self, c: int) -> str:
        nm = self.snap.names.get(c)
        return nm if nm is not None else f"<bundle {c}>"

    def _op(self, n: ENode) -> Op | None:
        if n.fn in ("Leaf", "proj"):
            return None
        if n.fn in self.eg.lifted:
            return self.producer[self.snap.names[n.cls]][1]
        v = self.eg.variant_of[n.fn]
        return self._fused(n, v)

    def _fused(self, n: ENode, v: Variant) -> Op:
        plan = self._plans.get(v.ctor)
        if plan is None:  # what a variant's arguments bind, worked out once a variant
            rule = self.table.by_name[v.rule]
            plan = self._plans[v.ctor] = (rule, tuple((p.name, p.type == "T") for p in v.params), rule.outputs,
                                          rule.multi)
        rule, params, outputs, multi = plan
        names = self.snap.names
        binds: dict[str, Any] = {}
        ch, pr = iter(n.children), iter(n.prims)
        children = []
        for pname, is_t in params:
            if is_t:
                c = next(ch)
                nm = names.get(c)
                if nm is None:
                    nm = f"<bundle {c}>"
                binds[pname] = nm
                children.append(nm)
            else:
                binds[pname] = next(pr)
        if multi:
            outs_cls = self.proj_of.get(n.cls, {})
            outs = [self.name(outs_cls[i]) if i in outs_cls else None for i in range(len(outputs))]
            for var, nm in zip(outputs, outs):
                binds[var] = nm
            outs = [o for o in outs if o is not None]
        else:
            outs = [self.name(n.cls)]
            binds[outputs[0]] = outs[0]
        parts = self._parts(outs, set(children))
        layer = max([pt.layer for pt in parts], default=-1)
        attrs = ((placement.ABSORB, rule.absorb),) if rule.absorb else ()  # a placement: its producer writes the row
        return Op("fused", tuple(dict.fromkeys(children)), outs[0], attrs=attrs, layer=layer, cls=rule.cls,
                  rule=rule.name, parts=parts, keeps=tuple(outs[1:]), binds=tuple(sorted(binds.items())))

    def _parts(self, outs: list[str], stop: set[str]) -> tuple[Op, ...]:
        """The step graph's ops between the fused op's inputs and its outputs, in graph order."""
        seen: dict[int, Op] = {}
        producer = self.producer
        stack = [t for t in outs if t not in stop]
        while stack:
            ko = producer.get(stack.pop())
            if ko is None or ko[0] in seen:
                continue
            op = seen[ko[0]] = ko[1]
            stack += [i for i in op.ins if i not in stop]
        return tuple([seen[k] for k in sorted(seen)])

    def label(self, i: int) -> tuple[str, str | None, str | None]:
        n, op = self.nodes[i], self.ops[i]
        if n.fn == "Leaf":
            return "input", None, None
        if n.fn == "proj":
            v = self.eg.variant_of[self.snap.classes[n.children[0]][0].fn]
            r = self.table.by_name[v.rule]
            return f"{r.cls} ({r.name}) output {n.prims[0]}", r.cls, r.name
        if op.fused:
            return f"{op.cls} ({op.rule})", op.cls, op.rule
        return op.kind, None, None

    def signature(self, i: int, depth: int = 0) -> tuple:
        """Node `i` by what it is: (constructor, what it reads, attributes), a read tensor by its name and a read
        bundle by its nodes' signatures (four bundles deep at most). The constructors and names are the Session's
        e-graph's, so the same node under another held set has the same signature, where its index differs."""
        n = self.nodes[i]
        names = self.snap.names
        kids = []
        for c in n.children:
            name = names.get(c)
            if name is not None or depth > 3:
                kids.append(name)
            else:
                kids.append(tuple(self.signature(j, depth + 1) for j in self.classes.get(c, ())))
        return (n.fn, tuple(kids), n.prims)

    def alternatives(self, c: int) -> list[Alternative]:
        """Class `c`'s nodes as alternatives, without costs (worked out once a class)."""
        out = self._alts.get(c)
        if out is None:
            out = self._alts[c] = []
            for k, i in enumerate(self.classes.get(c, ())):
                n, op = self.nodes[i], self.ops[i]
                label, cls, rule = self.label(i)
                output, bundle = None, ()
                if n.fn == "proj":  # one output of a multi-output op: the op is its bundle's
                    bundle = tuple(self.ops[j] for j in self.classes.get(n.children[0], ()))
                    op, output = bundle[0], n.prims[0]
                out.append(Alternative(k, label, cls, rule, None, self.signature(i), op, output, bundle))
        return out


class Session:
    """One step graph loaded into an e-graph with every rule compiled; each held set is saturated once (inside
    push/pop, so a held rule never fires) and its snapshot kept for re-extraction under other costs and choices."""

    def __init__(self, g: Graph, table: RuleTable, max_iters: int = 12, node_budget: int | None = None,
                 match_limit: int = 100_000):
        self.g, self.table = g, table
        self.max_iters, self.node_budget, self.match_limit = max_iters, node_budget, match_limit
        self.debug = flags.read("LANEFUSE_DEBUG")  # 2: print each rule's matches per plan
        with gc_paused():
            self.eg = EGraph(g, table)
        self._snaps: dict[frozenset, tuple[_Decoded, SatReport, dict]] = {}
        self._pushed = False  # a saturation is on the e-graph, inside a push not yet popped

    def _saturated(self, held: frozenset) -> tuple[_Decoded, SatReport, dict]:
        if held not in self._snaps:
            times = {}
            t0 = time.perf_counter()
            if self._pushed:  # the last held set's saturation, undone only now: a one-shot plan never pays the pop
                self.eg.pop()
                self._pushed = False
            self.eg.push()
            self._pushed = True
            try:
                rep = self.eg.saturate(held, self.max_iters, self.node_budget, self.match_limit)
                times["saturate"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                snap = self.eg.snapshot()
            except BaseException:
                self.eg.pop()
                self._pushed = False
                raise
            times["snapshot"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            dec = _Decoded(snap, self.eg, self.g, self.table)
            times["decode"] = time.perf_counter() - t0
            self._snaps[held] = (dec, rep, times)
        return self._snaps[held]

    def _held(self, held) -> tuple[frozenset, list[str]]:
        held = frozenset(held)
        warnings = []
        for h, deps in self.table.check_held(held).items():
            deps = {d: how for d, how in deps.items() if d not in held}
            if deps:
                said = ", ".join(f"`{d}` ({'disabled' if how == 'fully' else 'its matches through it'})"
                                 for d, how in sorted(deps.items()))
                warnings.append(f"holding `{h}` also holds back {said}: they build on its class "
                                f"`{self.table.by_name[h].cls}`")
        return held, warnings

    def alternatives(self, tensor: str, held=frozenset(), cost: CostFn | None = None) -> list[Alternative]:
        """Every way to compute `tensor` under the rules not `held` (its e-class's nodes, saturated once a held set),
        in the engine's order: the index of each is what `plan(forced=...)` takes and `Optimized.chosen` gives.
        With `cost`, each carries its own cost or refusal under it; without, `cost` is None."""
        held, _ = self._held(held)
        with gc_paused():
            dec = self._saturated(held)[0]
        c = dec.snap.by_name.get(tensor)
        if c is None:
            raise UserError(f"unknown tensor `{clip(tensor)}`{did_you_mean(tensor, dec.snap.by_name)}")
        alts = dec.alternatives(c)
        if cost is None:
            return list(alts)
        return [replace(a, cost=cost(a.op, self.g) if a.op is not None else 0.0) for a in alts]

    def choices(self, tensor: str, held=frozenset(), cost: CostFn = default_cost) -> list[Alternative]:
        """`alternatives` with their costs under `cost` (the default cost unless given)."""
        return self.alternatives(tensor, held, cost)

    def plan(self, held=frozenset(), cost: CostFn = default_cost, forced: dict[str, int] | None = None,
             method: str = "ilp") -> Optimized:
        with gc_paused():
            return self._plan(held, cost, forced, method)

    def _plan(self, held, cost: CostFn, forced: dict[str, int] | None, method: str) -> Optimized:
        if method not in ("ilp", "local"):
            raise UserError(f"unknown extraction method `{method}` (ilp or local)")
        t_all = time.perf_counter()
        held, warnings = self._held(held)
        warnings = [w for w in self.table.warnings if w.split(" @ ", 1)[0] not in held] + warnings  # unjoined patterns
        dec, rep, times = self._saturated(held)
        times = dict(times, load=self.eg.load_seconds)
        t0 = time.perf_counter()
        costs: list[float] = []
        refusals: dict[int, Refusal] = {}
        for i, op in enumerate(dec.ops):
            v = cost(op, self.g) if op is not None else 0.0
            if isinstance(v, Refusal):
                refusals[i] = v
                v = INF
            costs.append(float(v))
        times["cost"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        prob = self._problem(dec, costs, forced or {})
        try:
            # ilp: the exact optimum (the local search's choice, with a warning, where the ILP runs out of time)
            choice = solve_exact(prob, warnings) if method == "ilp" else solve_local(prob)
            choice = self._with_leaves(dec, choice)
        except NoPlan as e:
            raise UserError(self._no_plan(dec, e.classes, refusals, forced)) from None
        times["extract"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        graph, fusions = self._emit(dec, choice)
        times["emit"] = time.perf_counter() - t0
        total = sum(costs[n] for n in choice.values())
        summary = {
            "held": sorted(held),
            "saturation": {"iterations": rep.iterations, "stop": rep.stop, "matches": dict(rep.matches),
                           "steps": [dict(st) for st in rep.steps]},
            "egraph": {"nodes": dec.snap.n_nodes, "classes": len(dec.snap.classes)},
            "time": {k: round(v, 6) for k, v in times.items()},
        }
        summary["time"]["total"] = time.perf_counter() - t_all
        if self.debug >= 2:
            print(match_table(self.table, rep), file=sys.stderr)
        names, pos = dec.snap.names, dec.pos
        chosen = {names[c]: pos[i] for c, i in choice.items() if c in names}
        return Optimized(graph, fusions, summary, total, warnings,
                         lambda: self._runners_up(dec, choice, costs, refusals), chosen)

    # -- the problem ----------------------------------------------------------------------------------------------
    def _problem(self, dec: _Decoded, costs: list[float], forced: dict[str, int]) -> Problem:
        snap = dec.snap
        # an input or constant is there for the taking (its one node costs nothing and needs nothing): its class stays
        # out of the problem, a third of the classes fewer; `_with_leaves` adds those the plan reads back
        leaves = dec.leaves
        children = []
        for n in dec.nodes:
            ch = [d for d in n.children if d not in leaves]
            if len(ch) > 1 and len(set(ch)) < len(ch):  # a node reading one class twice reads it once
                ch = list(dict.fromkeys(ch))
            children.append(tuple(ch))
        internal = []
        for i, n in enumerate(dec.nodes):
            ins: tuple[int, ...] = ()
            op = dec.ops[i]
            if op is not None and op.fused:  # the tensors it computes inside and does not write
                outs = set(op.outs)
                ins = tuple(snap.by_name[p.out] for p in op.parts if p.out not in outs and p.out in snap.by_name)
            internal.append(ins)
        g = self.g
        read = {i for op in g.ops for i in op.ins}
        root_names = list(dict.fromkeys([*g.io.outputs, *(op.out for op in g.ops if op.out not in read)]))
        roots = [snap.by_name[r] for r in root_names if r in snap.by_name]
        fixed = {}
        for t, k in forced.items():
            c = snap.by_name.get(t)
            if c is None:
                import difflib

                near = difflib.get_close_matches(t, snap.by_name, n=1)
                raise UserError(f"forced choice for unknown tensor `{t}`" + (f" (did you mean `{near[0]}`?)" if near else ""))
            alts = dec.classes[c]
            if not 0 <= k < len(alts):
                raise UserError(f"forced choice {k} for `{t}`: it has alternatives 0..{len(alts) - 1}")
            if c not in leaves:
                fixed[c] = alts[k]
        proj = {(n.children[0], n.prims[0]): i for i, n in enumerate(dec.nodes) if n.fn == "proj"}
        bundles = {bc: [(oc, proj[bc, k]) for k, oc in sorted(outs.items())] for bc, outs in dec.proj_of.items()}
        node_class = [n.cls for n in dec.nodes]
        classes = {c: ns for c, ns in dec.classes.items() if c not in leaves}
        return Problem(classes, node_class, children, costs, roots, internal, fixed, bundles)

    @staticmethod
    def _with_leaves(dec: _Decoded, choice: dict[int, int]) -> dict[int, int]:
        """The choice with the inputs and constants its nodes read (the problem left them out)."""
        out = dict(choice)
        for i in choice.values():
            for d in dec.nodes[i].children:
                if d in dec.leaves:
                    out[d] = dec.classes[d][0]
        return out

    def _no_plan(self, dec: _Decoded, classes, refusals, forced) -> str:
        lines = []
        refused_all = [c for c in dec.classes if dec.classes[c] and all(i in refusals for i in dec.classes[c])]
        for c in list(classes) + [c for c in refused_all if c not in set(classes)]:
            ref = [(dec.label(i)[0], refusals[i]) for i in dec.classes.get(c, []) if i in refusals]
            if ref and len(ref) == len(dec.classes[c]) and not any(dec.name(c) in x for x in lines):
                lines.append(f"`{dec.name(c)}`: " + "; ".join(f"{lab} refused: {why}" for lab, why in ref))
        if not lines:
            refused = sorted({(dec.label(i)[0], str(r)) for i, r in refusals.items()})
            why = "; ".join(f"{lab}: {r}" for lab, r in refused[:8])
            return ("no runnable plan: the forced choices and refusals leave no valid choice"
                    + (f" (forced: {clip(forced, 200)})" if forced else "") + (f"; refused: {clip(why, 600)}" if why
                                                                                else ""))
        more = f" (and {len(lines) - 1} more tensor(s) with every way refused)" if len(lines) > 1 else ""
        return "no runnable plan: every way to compute " + clip(lines[0], 600) + more  # a line, not one a tensor

    # -- the plan as a graph --------------------------------------------------------------------------------------
    def _emit(self, dec: _Decoded, choice: dict[int, int]) -> tuple[Graph, dict[str, int]]:
        ops: list[Op] = []
        placements: list[Op] = []
        fusions: dict[str, int] = {}
        for c, i in sorted(choice.items()):
            op = dec.ops[i]
            if op is None:
                continue
            if op.fused:
                fusions[op.rule] = fusions.get(op.rule, 0) + 1
                if placement.absorbed(op) is not None:
                    placements.append(op)
                    continue
            ops.append(op)
        writer = {o: k for k, op in enumerate(ops) for o in op.outs}
        for pl in placements:
            placement.fold(ops, pl, writer)
        # keeps: what another op reads or the step outputs
        read = {i for op in ops for i in op.ins} | set(self.g.io.outputs)
        ops = [replace(op, keeps=tuple(k for k in op.keeps if k in read)) if op.fused else op for op in ops]
        index = {op.out: k for k, op in enumerate(self.g.ops)}
        ops = placement.views_first(_topo(ops, index), index)
        out = self.g.replace_ops(ops)
        return out, fusions

    def _runners_up(self, dec, choice, costs, refusals) -> dict:
        tensors = {}
        for c, i in sorted(choice.items(), key=lambda kv: dec.name(kv[0])):
            if c not in dec.snap.names or dec.nodes[i].fn == "Leaf":
                continue
            alts = []
            for j in dec.classes[c]:
                if j == i:
                    continue
                alts.append({"alt": dec.label(j)[0], "cost": str(refusals[j]) if j in refusals else costs[j]})
            alts.sort(key=lambda a: (isinstance(a["cost"], str), a["cost"] if not isinstance(a["cost"], str) else 0))
            tensors[dec.name(c)] = {"chosen": dec.label(i)[0], "cost": costs[i], "runners_up": alts}
        return tensors


def _topo(ops: list[Op], index: dict[str, int]) -> list[Op]:
    """A valid order close to the step graph's: among ready ops, the one whose first part came first."""
    writer = {o: k for k, op in enumerate(ops) for o in op.outs}
    key = [min((index.get(p.out, 1 << 30) for p in op.leaves()), default=1 << 30) for op in ops]
    deps = [{writer[i] for i in op.ins if i in writer and writer[i] != k} for k, op in enumerate(ops)]
    users: dict[int, list[int]] = {}
    for k, ds in enumerate(deps):
        for d in ds:
            users.setdefault(d, []).append(k)
    left = [len(ds) for ds in deps]
    heap = [(key[k], k) for k in range(len(ops)) if left[k] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        _, k = heapq.heappop(heap)
        out.append(ops[k])
        for u in users.get(k, []):
            left[u] -= 1
            if left[u] == 0:
                heapq.heappush(heap, (key[u], u))
    if len(out) != len(ops):
        raise RuntimeError("the extracted plan has a cycle")
    return out


def match_table(table: RuleTable, rep: SatReport) -> str:
    """The per-rule match counts of a saturation, rules that never matched included (LANEFUSE_DEBUG=2)."""
    w = max((len(r.where) for r in table.rules), default=10)
    lines = [f"saturation: {rep.iterations} iterations, stopped: {rep.stop}", f"{'rule':<{w}}  matches"]
    for r in table.rules:
        m = rep.matches.get(r.name, 0)
        lines.append(f"{r.where:<{w}}  {m}" + ("  (never matched)" if m == 0 else ""))
    return "\n".join(lines)


def optimize(g: Graph, table: RuleTable, held: frozenset[str] = frozenset(), cost: CostFn = default_cost,
             forced: dict[str, int] | None = None, method: str = "ilp", session: Session | None = None) -> Optimized:
    """The cheapest runnable plan of `g` under the rules of `table` not `held`, as a graph of lifted and fused ops."""
    s = session if session is not None else Session(g, table)
    return s.plan(held, cost, forced, method)
