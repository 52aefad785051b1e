"""The exact extraction by variable elimination over the classes not every plan needs (the step's small tree-width),
component by component, equal components solved once (the memo)."""

from __future__ import annotations

from typing import Any

from lanefuse.engine.extract.ilp import TIE_EPS, _scaled
from lanefuse.engine.extract.problem import INF, Problem, _closure, _Cycle, _usable_map, needed_classes, reachable

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

