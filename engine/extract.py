"""DAG-aware extraction over a snapshot's e-classes: pick one e-node for every class the step needs, so that a
tensor read twice is computed once and a multi-output bundle is paid for once. `ilp` is exact (HiGHS, with dominator
tightening); `local` is a fast local search (switch a class, or all outputs of a bundle, with exact ref-count deltas)
for interactive what-ifs. Both break ties the same deterministic way (the lower node rank)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

INF = math.inf


@dataclass
class Problem:
    """Node ids are 0..n-1; `rank` orders them for tie-breaks (lower wins)."""

    classes: dict[int, list[int]]  # class -> its nodes, in rank order
    node_class: list[int]
    children: list[tuple[int, ...]]  # node -> the classes it reads (distinct)
    cost: list[float]  # INF: refused, never chosen
    roots: list[int]
    internal: list[tuple[int, ...]] = field(default_factory=list)  # node -> classes it computes inside (not chosen with it)
    forced: dict[int, int] = field(default_factory=dict)  # class -> node
    bundles: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # bundle class -> [(out class, proj node)]


class TimeLimit(Exception):
    """The ILP reached its time limit before proving an optimum (`solve_exact` then falls back to the local
    search)."""

    def __init__(self, seconds: float):
        super().__init__(f"the ILP reached its {seconds:g} s limit")
        self.seconds = seconds


class NoPlan(Exception):
    def __init__(self, classes: list[int]):
        super().__init__(f"no runnable choice for classes {classes}")
        self.classes = classes


def _usable(p: Problem, c: int) -> list[int]:
    if c in p.forced:
        return [p.forced[c]] if p.cost[p.forced[c]] < INF else []
    return [n for n in p.classes.get(c, ()) if p.cost[n] < INF]


def _usable_map(p: Problem) -> dict[int, list[int]]:
    cost = p.cost
    out = {c: [n for n in ns if cost[n] < INF] for c, ns in p.classes.items()}
    for c in p.forced:
        out[c] = _usable(p, c)
    return out


def requirements(p: Problem, usable: dict[int, list[int]] | None = None) -> dict[int, int]:
    """class -> the classes (a bitset: bit d) live whenever it is live: itself, and what every usable node of it
    requires through its children. Children are visited first; a child still being visited (a cycle) counts as
    itself only, so every set is a valid under-estimate on cyclic e-graphs too."""
    if usable is None:
        usable = _usable_map(p)
    children = p.children
    req: dict[int, int] = {}
    opened: set[int] = set()  # classes whose children were pushed
    for r in sorted(p.classes):
        if r in opened:
            continue
        stack = [r]
        while stack:
            c = stack[-1]
            if c in req:
                stack.pop()
                continue
            if c not in opened:  # first visit: its children go first
                opened.add(c)
                for n in usable.get(c, ()):
                    for d in children[n]:
                        if d not in opened:
                            stack.append(d)
                continue
            stack.pop()  # second visit: every child is done, or open below it (a cycle)
            acc = None
            for n in usable.get(c, ()):
                o = 0
                for d in children[n]:
                    x = req.get(d)
                    o |= (1 << d) if x is None else x
                acc = o if acc is None else acc & o
            req[c] = 1 << c | (acc or 0)
    return req


def needed_classes(p: Problem, live: set[int] | None = None, usable: dict[int, list[int]] | None = None) -> set[int]:
    """Dominator tightening: the roots, the forced classes the roots reach, and every class they require (all
    usable nodes of a required class read it, directly or through what they all require)."""
    if usable is None:
        usable = _usable_map(p)
    req = requirements(p, usable)
    live = reachable(p) if live is None else live
    mask = 0
    for c in [*p.roots, *(c for c in p.forced if c in live)]:
        mask |= req[c]
    need = {i for i, b in enumerate(bin(mask)[:1:-1]) if b == "1"}  # the set bits, lowest first
    for c in sorted(need):
        if not usable.get(c):
            raise NoPlan([c])
    return need


def reachable(p: Problem) -> set[int]:
    seen, stack = set(p.roots), list(p.roots)
    classes, cost, children = p.classes, p.cost, p.children
    while stack:
        c = stack.pop()
        for n in classes[c]:
            if cost[n] < INF:
                for d in children[n]:
                    if d not in seen:
                        seen.add(d)
                        stack.append(d)
    return seen


def total_cost(p: Problem, choice: dict[int, int]) -> float:
    return sum(p.cost[n] for n in choice.values())


def _closure(p: Problem, choice: dict[int, int]) -> dict[int, int]:
    """The choice restricted to the classes the roots reach through chosen nodes; raises on a cycle."""
    out: dict[int, int] = {}
    state: dict[int, int] = {}
    for r in p.roots:
        if state.get(r) == 2:
            continue
        stack = [(r, iter(p.children[choice[r]]))]
        state[r] = 1
        while stack:
            c, it = stack[-1]
            d = next(it, None)
            if d is None:
                stack.pop()
                state[c] = 2
                out[c] = choice[c]
                continue
            st = state.get(d)
            if st == 1:
                raise _Cycle(d)
            if st is None:
                state[d] = 1
                stack.append((d, iter(p.children[choice[d]])))
    return out


def has_cycle(p: Problem) -> bool:
    """Whether any choice at all could be cyclic: a cycle among classes through any usable node."""
    succ = {c: {d for n in ns if p.cost[n] < INF for d in p.children[n]} for c, ns in p.classes.items()}
    state: dict[int, int] = {}
    for r in succ:
        if r in state:
            continue
        state[r] = 1
        stack = [(r, iter(succ[r]))]
        while stack:
            c, it = stack[-1]
            d = next(it, None)
            if d is None:
                stack.pop()
                state[c] = 2
                continue
            if state.get(d) == 1:
                return True
            if d not in state:
                state[d] = 1
                stack.append((d, iter(succ.get(d, ()))))
    return False


class _Cycle(Exception):
    pass


# -- exact ----------------------------------------------------------------------------------------------------------
_quiet = False


def _highs():
    """A HiGHS instance; the first one of a process prints a banner on fd 1, which a plan's output must not carry."""
    global _quiet
    import highspy

    if _quiet:
        return highspy.Highs()
    import os
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    _quiet = True
    return h


# the tie-break's largest weight (on the costs scaled to a median of 1): far below any real difference
TIE_EPS = 1e-7


def _scaled(p: Problem, live_cls: list[int]) -> tuple[list[int], list[float], list[float]]:
    """The usable nodes of the live classes, their costs scaled to a median of 1, and those plus the tie-break (a
    node's place among them, times TIE_EPS over their count: the lower rank wins a tie)."""
    cost, classes = p.cost, p.classes
    nodes = [n for c in live_cls for n in classes[c] if cost[n] < INF]
    finite = [x for x in map(cost.__getitem__, nodes) if x > 0]
    scale = 1.0 / (sorted(finite)[len(finite) // 2] if finite else 1.0)
    eps = TIE_EPS
    m = max(1, len(nodes))
    return nodes, [cost[n] * scale for n in nodes], [cost[n] * scale + eps * i / m for i, n in enumerate(nodes)]


def _objective(p: Problem, live_cls: list[int]) -> tuple[list[int], list[float]]:
    """The usable nodes of the live classes and their costs as both exact solvers minimise them: scaled to a median
    of 1, plus a tie-break far below any real difference that prefers the lower rank."""
    nodes, _, tied = _scaled(p, live_cls)
    return nodes, tied


# The tolerance HiGHS judges an objective difference by: a reduced cost under dual_feasibility_tolerance (1e-7 by
# default) counts as zero, and its MIP search works to mip_feasibility_tolerance (1e-6), both absolute. The
# tie-break's step (TIE_EPS over the node count: 6e-9 at 16 nodes, 3e-11 at 3,000) lies far below them. At the
# scale the elimination works in, HiGHS 1.16's presolve (its dominated-column rule: with that rule off, bit 5 of
# presolve_rule_off, with dual_feasibility_tolerance 1e-10 or with the tie-break ten times larger it did not)
# removed the optimum and returned, as proven optimal, a plan costing 1 where one costing 0 satisfies every row
# (tests/test_extract.py::test_the_ilp_misses_no_cheaper_plan); and over 2,000 random repeated layers it returned
# 73 times a plan the tie-break ranks worse than the elimination's. `_for_highs` multiplies the objective so the
# tolerance lies midway (as a ratio) between the tie-break's step and the doubles' rounding of the largest cost; a
# scale changes no optimum.
HIGHS_TOLERANCE = 1e-6


def _for_highs(costs: list[float]) -> list[float]:
    """`costs` times K, the tie-break's step K·TIE_EPS/n as many times above HIGHS_TOLERANCE as the rounding of the
    largest cost, 2^-52·K·max, lies below it."""
    n = max(1, len(costs))
    top = max([1.0, *costs])
    k = HIGHS_TOLERANCE * math.sqrt(n / (TIE_EPS * 2.0 ** -52 * top))
    return [x * k for x in costs]


def solve_ilp(p: Problem, time_limit: float = 60.0, start: dict[int, int] | None = None) -> dict[int, int]:
    """The optimum. `start` (e.g. the local search's choice) is handed to HiGHS as its first incumbent. Past
    `time_limit` seconds (all its solves together) it raises `TimeLimit`."""
    import highspy
    import numpy as np

    need = needed_classes(p)
    live_cls = sorted(reachable(p))
    nodes, costs = _objective(p, live_cls)
    costs = _for_highs(costs)
    col = {n: i for i, n in enumerate(nodes)}
    lb = [0.0] * len(nodes)
    for c, n in p.forced.items():
        if n in col:
            lb[col[n]] = 1.0
    rows: list[tuple[float, float, list[int], list[float]]] = []
    for c in live_cls:
        idx = [col[n] for n in p.classes[c] if n in col]
        if not idx:
            if c in need:
                raise NoPlan([c])
            continue
        rows.append((1.0 if c in need else 0.0, 1.0, idx, [1.0] * len(idx)))
    # A class's nodes that read class d, together, imply d: at most one of them is chosen, so this aggregate is
    # valid, and far tighter than one row a node (the LP can no longer split a class over two alternatives that
    # share a child and pay for the child once).
    # A bundle's output reads what the bundle reads: counted so, the outputs of two alternatives of a class (a
    # bundle and a lifted op reading one product) cannot share that product in the LP either.
    via_bundle: dict[int, set[int]] = {}
    for bc, outs in p.bundles.items():
        usable = [n for n in p.classes.get(bc, []) if n in col]
        common = set(p.children[usable[0]]).intersection(*(p.children[n] for n in usable[1:])) if usable else set()
        for _, pn in outs:
            via_bundle[pn] = common
    for c in live_cls:
        by_child: dict[int, list[int]] = {}
        for n in p.classes[c]:
            if n in col:
                for d in set(p.children[n]) | via_bundle.get(n, set()):
                    by_child.setdefault(d, []).append(col[n])
        for d, parents in by_child.items():
            idx = [col[m] for m in p.classes[d] if m in col]
            rows.append((-INF, 0.0, parents + idx, [1.0] * len(parents) + [-1.0] * len(idx)))
    for n in nodes:  # a fused node's internal tensors are never also computed on their own
        for d in (p.internal[n] if p.internal else ()):
            idx = [col[m] for m in p.classes.get(d, []) if m in col]
            if idx:
                rows.append((-INF, 1.0, [col[n]] + idx, [1.0] * (1 + len(idx))))
    # One limit for the whole solve: a cyclic optimum adds a cut and solves again, and a rule matching a cross
    # product can need thousands of cuts, each solve well inside any limit of its own.
    deadline = time.monotonic() + float(time_limit)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeLimit(float(time_limit))
        h = _highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("mip_rel_gap", 0.0)
        h.setOptionValue("mip_abs_gap", 1e-9)
        h.setOptionValue("time_limit", left)
        h.setOptionValue("threads", 1)
        h.setOptionValue("random_seed", 0)
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = len(nodes), len(rows)
        lp.col_cost_ = np.array(costs)
        lp.col_lower_ = np.array(lb)
        lp.col_upper_ = np.ones(len(nodes))
        lp.row_lower_ = np.array([r[0] for r in rows])
        lp.row_upper_ = np.array([r[1] for r in rows])
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        starts, index, value = [0], [], []
        for r in rows:
            if len(set(r[2])) < len(r[2]):  # a node that reads (or computes inside) its own class: one entry a column
                merged: dict[int, float] = {}
                for j, v in zip(r[2], r[3]):
                    merged[j] = merged.get(j, 0.0) + v
                r = (r[0], r[1], list(merged), list(merged.values()))
            index += r[2]
            value += r[3]
            starts.append(len(index))
        lp.a_matrix_.start_ = np.array(starts, dtype=np.int32)
        lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
        lp.a_matrix_.value_ = np.array(value)
        lp.integrality_ = [highspy.HighsVarType.kInteger] * len(nodes)
        h.passModel(lp)
        if start:
            sol = highspy.HighsSolution()
            v = np.zeros(len(nodes))
            for n in start.values():
                if n in col:
                    v[col[n]] = 1.0
            sol.col_value = v
            sol.value_valid = True
            h.setSolution(sol)
        h.run()
        status = h.getModelStatus()
        if status == highspy.HighsModelStatus.kTimeLimit:
            raise TimeLimit(float(time_limit))
        if status != highspy.HighsModelStatus.kOptimal:
            raise NoPlan(sorted(need))
        x = h.getSolution().col_value
        choice = {}
        for c in live_cls:
            for n in p.classes[c]:
                if n in col and x[col[n]] > 0.5:
                    choice[c] = n
        try:
            return _closure(p, choice)
        except _Cycle:
            cyc = _find_cycle(p, choice)
            rows.append((-INF, float(len(cyc) - 1), [col[n] for n in cyc], [1.0] * len(cyc)))


# -- exact, by variable elimination ----------------------------------------------------------------------------------
# A step graph is a chain of layers that touch through a few tensors, so the choice problem has a small tree-width
# (about 9 at any depth for a Qwen3 step). One binary variable a class not every plan needs: is it computed. Each
# class gives one table over its own variable and those of the classes its nodes read or compute inside: the
# cheapest node whose needs the assignment meets (0 when the class is not computed). Eliminating the variables one
# at a time (fewest neighbours first) finds the minimum of the tables' sum exactly; the ILP's LP relaxation is weak
# here (bundles paid once serve both sides of a choice), which is what made HiGHS slow.
# The classes every plan needs are no variables, so the tables fall apart into components, about one a layer's
# attention (its q/k/v bundles) and a few across layers. A gpt-oss layer's is 26 variables wide 18 whatever the
# order (min-degree 18-20, min-fill 19, measured), and the 36 are the same tables up to names: solved once by the
# real costs, and where no choice on the way was decided by less than the tie-break can weigh, the others take its
# choices (the same plan as solving each: tests/test_extract.py); gpt-oss-120b's extraction 0.32 s -> 0.15 s.
# the widest table (variables) elimination may build before the ILP takes over: a Qwen3 step needs 9, a step
# with biased q/k/v products (Qwen2, gpt-oss: the bias adds beside the merged products) 17-18; a table of 18 is
# 2 MiB, and at 16 those steps fell to the ILP (gpt-oss-120b's plan 1.3 s; 0.7 s at 18). A Qwen3-Next step on
# K-quant rows under q8 joins a mixture layer's finalize and the next attention layer's projections into one
# component 20 wide (every producer writes the q8k form beside its f32 result): at 18 its extraction fell to the ILP
# (1.8 s of the 80B-A3B shape's plan), at 20 it is eliminated in 0.66 s (a table of 20 is 8 MiB)
MAX_WIDTH = 20
# The ILP's time limit: a few seconds, more for a bigger e-graph (every real step solves in well under a second; a
# rule that matches a cross product, every add with every norm, can keep HiGHS busy for many minutes).
ILP_SECONDS = 5.0
ILP_SECONDS_PER_NODE = 1e-3
ILP_SECONDS_MAX = 60.0


def ilp_time_limit(p: Problem) -> float:
    """The seconds `solve_exact` gives the ILP on `p`: ILP_SECONDS, plus a millisecond an e-node, at most a minute."""
    return min(ILP_SECONDS_MAX, ILP_SECONDS + ILP_SECONDS_PER_NODE * len(p.node_class))


def solve_exact(p: Problem, warnings: list[str] | None = None, time_limit: float | None = None) -> dict[int, int]:
    """The optimum of `solve_ilp`'s objective (same scaled costs, same tie-break), by variable elimination; the ILP
    decides when the elimination would be too wide, when no plan exists (for its error) or on a cyclic plan. Where
    the ILP reaches its time limit (`ilp_time_limit` by default), the local search's choice is returned instead and
    `warnings` (where given) says so."""
    choice = solve_elimination(p)
    if choice is not None:
        return choice
    limit = ilp_time_limit(p) if time_limit is None else time_limit
    try:
        return solve_ilp(p, time_limit=limit)
    except TimeLimit:
        if warnings is not None:
            warnings.append(f"the exact extraction (ILP) did not finish within its {limit:.3g} s limit "
                            f"({len(p.node_class):,} e-nodes); the plan is the local search's, which may not be "
                            f"optimal (a rule matching far more than it should, e.g. a pattern whose ops do not "
                            f"join, grows the e-graph)")
        return solve_local(p)


def solve_elimination(p: Problem, max_width: int = MAX_WIDTH, memo: bool = True) -> dict[int, int] | None:
    """The optimum by variable elimination, or None where it cannot tell (too wide, infeasible, cyclic).

    The tables fall apart into components that share no undecided class (a step's layers meet through classes every
    plan needs); each is eliminated alone. With `memo`, a component equal to one already solved (the same tables
    over the same pattern of classes, by the real costs: layer after layer of a step) takes that one's choices,
    where those were decided by more than the tie-break can weigh (see `_component_key`); the others are solved
    with the tie-break, as without `memo`. The plan is the same either way."""
    import numpy as np

    usable = _usable_map(p)
    live = reachable(p)
    need = needed_classes(p, live, usable)
    live_cls = sorted(live)
    nodes, real, tied = _scaled(p, live_cls)
    weight = dict(zip(nodes, tied))
    real_of = dict(zip(nodes, real))
    # each class's usable nodes: (cost, node, classes it needs computed, classes it needs not computed), free only
    opts: dict[int, list[tuple[float, int, tuple[int, ...], tuple[int, ...]]]] = {}
    internal, children = p.internal, p.children
    for c in live_cls:
        lst = []
        for n in usable[c]:
            inside = set(internal[n]) & live if internal and internal[n] else ()
            if inside and inside & need:
                continue
            on = [d for d in children[n] if d not in need]
            if inside and inside.intersection(on):
                continue
            lst.append((weight[n], n, tuple(on), tuple(inside)))
        if not lst and c in need:
            return None
        opts[c] = lst
    # one table a class over its scope: (scope, shape key, tie-broken weights, real weights), built when solved
    specs: list[tuple[tuple[int, ...], tuple, list[float], list[float]]] = []
    const = 0.0
    for c in live_cls:
        lst = opts[c]
        free = c not in need
        vs = {d for _, _, on, off in lst for d in on + off}
        if free:
            vs.add(c)
        if not vs:  # a needed class whose nodes need nothing undecided: its cheapest node, always
            const += min([o[0] for o in lst], default=INF)
            continue
        scope = sorted(vs)
        k = len(scope)
        if k > max_width:
            return None
        bit = {v: 1 << (k - 1 - j) for j, v in enumerate(scope)}  # axis j of the (2,)*k table
        own = bit[c] if free else 0
        rows, ws, rs = [], [], []
        for wn, n, on, off in lst:
            m_on = 0
            for d in on:
                m_on |= bit[d]
            m_off = 0
            for d in off:
                m_off |= bit[d]
            if not m_on & m_off:
                rows.append((m_on | own, m_off))
                ws.append(wn)
                rs.append(real_of[n])
        specs.append((tuple(scope), (k, own, free, tuple(rows)), ws, rs))
    if const == INF:
        return None
    shapes: dict[tuple, tuple[Any, Any, Any]] = {}
    solved: dict[tuple, tuple[tuple[int, ...], bool] | None] = {}  # component key -> its choices (None: tie-break)
    val: dict[int, int] = {}
    for comp, fs in _components(specs):
        key = _component_key(comp, [specs[f] for f in fs]) if memo and len(comp) >= MEMO_MIN_CLASSES else None
        if key is not None and key in solved:
            got = solved[key]
            if got is not None:
                bits, feasible = got
                if not feasible:
                    return None
                val.update(zip(comp, bits))
                continue
        elif key is not None:  # the first of its kind: solved by the real costs, kept where no tie-break decided
            out = _eliminate([(specs[f][0], _table(specs[f], shapes, 3, np)) for f in fs], max_width, np, gaps=True)
            if out is None:
                return None
            got_val, value, gap = out
            decided = value < INF and gap > TIE_EPS * (len(fs) + 1)
            solved[key] = (tuple(got_val[v] for v in comp), True) if decided else (
                ((), False) if value == INF else None)
            if value == INF:
                return None
            if decided:
                val.update(got_val)
                continue
        out = _eliminate([(specs[f][0], _table(specs[f], shapes, 2, np)) for f in fs], max_width, np, gaps=False)
        if out is None or out[1] == INF:
            return None
        val.update(out[0])

    comp = need | {v for v, x in val.items() if x}  # the classes computed

    choice = {}
    for c in live_cls:
        if c not in comp:
            continue
        best = None
        for wn, n, on, off in opts[c]:
            if comp.issuperset(on) and comp.isdisjoint(off) and (best is None or (wn, n) < best):
                best = (wn, n)
        if best is None:
            return None
        choice[c] = best[1]
    try:
        return _closure(p, choice)
    except _Cycle:
        return None


# the fewest undecided classes a component needs before `solve_elimination` looks for an equal one solved already
# (a smaller one is solved sooner than its key is built)
MEMO_MIN_CLASSES = 8


def _components(specs: list[tuple]) -> list[tuple[list[int], list[int]]]:
    """The tables' components: (its classes in order, its tables in order), no class shared between two."""
    parent: dict[int, int] = {}

    def find(v):
        while parent.setdefault(v, v) != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for scope, *_ in specs:
        r = find(scope[0])
        for v in scope[1:]:
            q = find(v)
            if q != r:
                parent[q] = r
    groups: dict[int, tuple[list[int], list[int]]] = {}
    for f, (scope, *_) in enumerate(specs):
        groups.setdefault(find(scope[0]), ([], []))[1].append(f)
    for v in sorted(parent):
        groups[find(v)][0].append(v)
    return list(groups.values())


def _component_key(comp: list[int], specs: list[tuple]) -> tuple:
    """What decides a component's choices by the real costs: each table's shape and real weights over its classes'
    places in the component. Two components with one key have the same real optimum; the tie-break (a node's rank,
    TIE_EPS at most) can only decide between assignments whose real costs differ by less than a table count of
    TIE_EPS, so where every choice of the first was decided by more, the second has the same one."""
    at = {v: i for i, v in enumerate(comp)}
    return tuple((tuple(at[v] for v in scope), shape, tuple(rs)) for scope, shape, _, rs in specs)


def _table(spec: tuple, shapes: dict, which: int, np) -> Any:
    """A class's table (2,)*k: the cheapest of its nodes that the assignment meets, by the tie-broken (which=2) or
    the real (3) weights; INF where none, 0 where the class is not computed."""
    key, ws = spec[1], spec[which]
    k, own, free, rows = key
    # the table's shape (which assignments each node's needs meet) repeats layer after layer: the masks are worked
    # out once a shape, and the cheapest node an assignment meets is one minimum over them
    shape = shapes.get(key)
    if shape is None:
        if len(rows) << k <= 32:  # small: the assignments each node meets, as lists
            init = [INF if a & own else 0.0 for a in range(1 << k)] if free else [INF] * (1 << k)
            meets = [[a for a in range(1 << k) if a & (m_on | m_off) == m_on] for m_on, m_off in rows]
            shape = shapes[key] = (False, init, meets)
        else:
            idx = np.arange(1 << k)
            init = np.where(idx & own, INF, 0.0) if free else np.full(1 << k, INF)
            meets = np.array([(idx & (m_on | m_off)) == m_on for m_on, m_off in rows]) if rows else None
            shape = shapes[key] = (True, init, meets)
    wide, init, meets = shape
    if wide:
        t = init if meets is None else np.minimum(init, np.where(meets, np.array(ws)[:, None], INF).min(axis=0))
    else:
        t = init[:]
        for wn, at in zip(ws, meets):
            for a in at:
                if wn < t[a]:
                    t[a] = wn
        t = np.array(t)
    return t.reshape((2,) * k)


def _eliminate(factors: list[tuple[tuple[int, ...], Any]], max_width: int, np,
               gaps: bool) -> tuple[dict[int, int], float, float] | None:
    """Eliminate every class of the tables (fewest neighbours first): (the minimising assignment, the minimum, and
    with `gaps` the least margin by which a choice on its way was decided; else INF), or None past `max_width`."""
    import bisect
    import heapq

    factors = list(factors)
    of_var: dict[int, set[int]] = {}
    adj: dict[int, set[int]] = {}
    for fid, (scope, _) in enumerate(factors):
        for v in scope:
            of_var.setdefault(v, set()).add(fid)
            adj.setdefault(v, set()).update(scope)
    for v in adj:
        adj[v].discard(v)
    # fewest neighbours first; a neighbour count is checked when its variable comes up (the tables it is in say it)
    # and the variable queued again if it grew, instead of every neighbour's count kept up to date
    heap = [(len(nb), v) for v, nb in adj.items()]
    heapq.heapify(heap)
    del adj
    trail = []
    const = 0.0
    heappop, heappush = heapq.heappop, heapq.heappush
    while heap:
        deg, v = heappop(heap)
        nb = set()
        for f in of_var.get(v, ()):
            nb.update(factors[f][0])
        nb.discard(v)
        if len(nb) > deg:
            heappush(heap, (len(nb), v))
            continue
        if len(nb) + 1 > max_width:
            return None
        # every table keeps its axes in variable order, so a factor only needs unit axes inserted (a view)
        z = sorted(nb)
        j = bisect.bisect(z, v)
        z.insert(j, v)
        n_z = len(z)
        total = None
        for f in sorted(of_var.pop(v, ())):
            scope, arr = factors[f]
            factors[f] = None
            for u in scope:
                if u != v:
                    of_var[u].discard(f)
            if len(scope) != n_z:
                shape = [1] * n_z
                for u in scope:
                    shape[bisect.bisect_left(z, u)] = 2
                arr = arr.reshape(shape)
            total = arr if total is None else total + arr
        if total is None or total.ndim != n_z or total.size != 1 << n_z:
            total = np.zeros((2,) * n_z) + (0.0 if total is None else total)
        # the variable's axis has two entries: its minimum and where it lies (0 on a tie, as argmin would say)
        lo, hi = total[(slice(None),) * j + (0,)], total[(slice(None),) * j + (1,)]
        zr = z[:j] + z[j + 1:]
        if gaps:
            with np.errstate(invalid="ignore"):
                margin = np.abs(hi - lo)  # nan where both are INF
        trail.append((v, zr, hi < lo, margin if gaps else None))
        rest = np.minimum(lo, hi)
        if not nb:
            const += float(rest)
            continue
        fid = len(factors)
        factors.append((tuple(zr), rest))
        for u in nb:
            of_var.setdefault(u, set()).add(fid)
    val: dict[int, int] = {}
    gap = INF
    for v, us, arg, margin in reversed(trail):
        at = tuple(val[u] for u in us)
        val[v] = int(arg[at])
        if gaps:
            m = float(margin[at])
            gap = m if not m >= gap else gap  # nan (both INF) counts as no margin
    return val, const, gap


def _find_cycle(p: Problem, choice: dict[int, int]) -> list[int]:
    state: dict[int, int] = {}
    path: list[int] = []

    def visit(c):
        state[c] = 1
        path.append(c)
        for d in p.children[choice[c]]:
            if state.get(d) == 1:
                return [choice[x] for x in path[path.index(d):]]
            if d not in state:
                r = visit(d)
                if r:
                    return r
        path.pop()
        state[c] = 2
        return None

    for r in p.roots:
        if r not in state:
            cyc = visit(r)
            if cyc:
                return cyc
    raise RuntimeError("no cycle found")


# -- local search ---------------------------------------------------------------------------------------------------
def solve_local(p: Problem, start: dict[int, int] | None = None, max_passes: int = 20) -> dict[int, int]:
    """Start from `start` (default: each class's first usable node, which for a step tensor is the lifted op), then
    take improving moves until none is left: switch one class's node, or switch every output of a bundle to it."""
    choice: dict[int, int] = {}
    for c, ns in p.classes.items():
        if c in p.forced:
            choice[c] = p.forced[c]
            continue
        # first usable node, preferring one with nothing inside it (a lifted op): a valid start
        usable = sorted((n for n in ns if p.cost[n] < INF), key=lambda n: bool(p.internal and p.internal[n]))
        if start and c in start:
            choice[c] = start[c]
        elif usable:
            choice[c] = usable[0]
    ref: dict[int, int] = {}

    def add(c0):
        stack = [c0]
        while stack:
            c = stack.pop()
            ref[c] = ref.get(c, 0) + 1
            if ref[c] == 1:
                if c not in choice:
                    raise NoPlan([c])
                stack.extend(p.children[choice[c]])

    for r in p.roots:
        if r not in choice:
            raise NoPlan([r])
        add(r)
    for r in p.roots:  # roots are pinned: an extra reference keeps them live
        ref[r] += 1
    internal_of: dict[int, list[int]] = {}
    for n, ins in enumerate(p.internal or []):
        for d in ins:
            internal_of.setdefault(d, []).append(n)

    def live(c):
        return ref.get(c, 0) > 0

    def try_moves(moves: list[tuple[int, int]]) -> bool:
        """Apply moves; keep them iff valid and strictly cheaper. Exact delta by reference counting."""
        delta = 0.0
        log: list[tuple[str, int, int]] = []
        touched: list[int] = [c for c, _ in moves]  # classes whose node or liveness changed
        ok = True

        def inc(c0):
            nonlocal delta, ok
            stack = [c0]
            while stack:
                c = stack.pop()
                ref[c] = ref.get(c, 0) + 1
                log.append(("inc", c, 0))
                if ref[c] == 1:
                    if choice.get(c) is None or p.cost[choice[c]] == INF:
                        ok = False
                        continue
                    delta += p.cost[choice[c]]
                    touched.append(c)
                    stack.extend(p.children[choice[c]])

        def dec(c0):
            nonlocal delta
            stack = [c0]
            while stack:
                c = stack.pop()
                ref[c] -= 1
                log.append(("dec", c, 0))
                if ref[c] == 0:
                    delta -= p.cost[choice[c]]
                    stack.extend(p.children[choice[c]])

        for c, n in moves:
            old = choice.get(c)
            if old == n:
                continue
            was_live = live(c)
            if was_live:
                for d in p.children[n]:
                    inc(d)
                delta += p.cost[n] - (p.cost[old] if old is not None else 0.0)
            choice[c] = n
            log.append(("set", c, old))
            if was_live and old is not None:
                for d in p.children[old]:
                    dec(d)
        if ok:
            ok = delta < -1e-12 and _valid(touched)
        if not ok:
            for kind, c, old in reversed(log):
                if kind == "inc":
                    ref[c] -= 1
                elif kind == "dec":
                    ref[c] += 1
                else:
                    choice[c] = old
            return False
        return True

    cyclic = has_cycle(p)

    def _valid(touched: list[int]) -> bool:
        if cyclic:
            try:
                _closure(p, choice)
            except _Cycle:
                return False
        for c in touched:
            if not live(c):
                continue
            n = choice[c]
            if p.internal and any(live(d) for d in p.internal[n]):
                return False
            if any(live(p.node_class[m]) and choice[p.node_class[m]] == m for m in internal_of.get(c, ())):
                return False
        return True

    order = sorted(p.classes)
    for _ in range(max_passes):
        improved = False
        for bc in sorted(p.bundles):
            # a forced output keeps its node: the bundle then writes it too, but never takes it over
            outs = [(oc, pn) for oc, pn in p.bundles[bc] if p.forced.get(oc, pn) == pn]
            for b in p.classes[bc]:
                if p.cost[b] == INF or p.forced.get(bc, b) != b:
                    continue
                if try_moves([(bc, b)] + outs):
                    improved = True
        for c in order:
            if c in p.forced or not live(c):
                continue
            for n in p.classes[c]:
                if n != choice[c] and p.cost[n] < INF and try_moves([(c, n)]):
                    improved = True
        if not improved:
            break
    if not _valid([c for c in p.classes if live(c)]):
        raise NoPlan(sorted(c for c in p.classes if live(c)))
    return _closure(p, choice)
