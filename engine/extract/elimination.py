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
    comps = _components(specs)
    keys = [_component_key(comp, [specs[f] for f in fs]) if memo and len(comp) >= MEMO_MIN_CLASSES else None
            for comp, fs in comps]
    # the first component of each key is solved by the real costs; its choices are kept where no tie-break decided
    first: dict[tuple, int] = {}
    for i, key in enumerate(keys):
        if key is not None and key not in first:
            first[key] = i
    # the components over one pattern of classes are eliminated in one run (see `_solve_all`). Where the first
    # key's first component is undecided (a Qwen3 layer's: its real costs tie exactly), the others likely are too:
    # the tie-broken eliminations of the components with a key then ride along with the first ones' runs where
    # those are narrow, instead of a second run each pattern (unneeded where a first decides; the choices are the
    # same either way)
    runs = _Runs(comps, specs, keys, max_width)
    firsts = list(first.values())
    solved: dict[tuple, tuple[int, ...] | None] = {}  # component key -> its choices (None: the tie-break decides)
    got: dict[tuple[int, int], tuple] = {}
    for at, part in enumerate((firsts[:1], firsts[1:])):
        lanes = [(i, 3) for i in part]
        if at:  # the components no key covers need the tie-break whatever the firsts say
            lanes += [(i, 2) for i in range(len(comps)) if keys[i] is None]
            if firsts and solved.get(keys[firsts[0]], ()) is None:
                lanes += [(i, 2) for i in range(len(comps)) if keys[i] is not None and keys[i] not in solved
                          and runs.widest(i) <= SPECULATE_WIDTH]
        out = _solve_all(lanes, comps, specs, shapes, runs, np)
        if out is None:
            return None
        got.update(out)
        for i in part:
            bits, value, gap = got[i, 3]
            if value == INF:
                return None
            solved[keys[i]] = bits if gap > TIE_EPS * (len(comps[i][1]) + 1) else None
    val: dict[int, int] = {}
    rest = []
    for i, ((comp, fs), key) in enumerate(zip(comps, keys)):
        bits = solved[key] if key is not None else None
        if bits is None and (i, 2) not in got:
            rest.append((i, 2))
        elif bits is None:
            bits, value, _ = got[i, 2]
            if value == INF:
                return None
        if bits is not None:
            val.update(zip(comp, bits))
    got = _solve_all(rest, comps, specs, shapes, runs, np)
    if got is None:
        return None
    for i, w in rest:
        bits, value, _ = got[i, w]
        if value == INF:
            return None
        val.update(zip(comps[i][0], bits))

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


# the most table entries (doubles) one batch of equal components holds at once: their tables, or the widest table
# the elimination builds, times the batch (32 MiB)
BATCH_ENTRIES = 1 << 22
# the widest table (classes) a pattern's elimination may build for its components' tie-broken runs to ride along
# with its first ones' (work wasted where those decide: a few lanes of at most 16384 entries; a Qwen3 layer's is 14)
SPECULATE_WIDTH = 14


class _Runs:
    """Each component's pattern (its tables' scopes over its classes' places in it: the same layer after layer of a
    step), the elimination's order over it and the widest table that builds (`_order`, once a pattern), as asked."""

    def __init__(self, comps: list[tuple[list[int], list[int]]], specs: list[tuple], keys: list, max_width: int):
        self.comps, self.specs, self.keys, self.max_width = comps, specs, keys, max_width
        self.of: dict[int, tuple] = {}
        self.orders: dict[tuple, Any] = {}

    def pattern(self, i: int) -> tuple:
        got = self.of.get(i)
        if got is None:
            key = self.keys[i]
            if key is not None:  # a key names each table's scope by places already
                got = tuple([x[0] for x in key])
            else:
                comp, fs = self.comps[i]
                at = {v: j for j, v in enumerate(comp)}
                got = tuple([tuple([at[v] for v in self.specs[f][0]]) for f in fs])
            self.of[i] = got
        return got

    def order(self, pattern: tuple) -> tuple[list[tuple], int] | None:
        """`_order` over the pattern; None where too wide."""
        if pattern not in self.orders:
            self.orders[pattern] = _order(list(pattern), self.max_width)
        return self.orders[pattern]

    def widest(self, i: int) -> int:
        got = self.order(self.pattern(i))
        return self.max_width + 1 if got is None else got[1]


def _solve_all(lanes: list[tuple[int, int]], comps: list[tuple[list[int], list[int]]], specs: list[tuple],
               shapes: dict, runs: _Runs, np) -> dict[tuple[int, int], tuple] | None:
    """Each (component, weights) eliminated, by the real (3) or the tie-broken (2) weights: (its classes' values in
    order, the minimum, the least margin where a lane of real weights is in its run, else INF); None where one is
    too wide.

    Components over one pattern (`_Runs`) are eliminated together, their tables stacked on a last axis: the same
    order of elimination, the same sums and minima entry by entry, so each gets what eliminating it alone gives."""
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for lane in lanes:
        groups.setdefault(runs.pattern(lane[0]), []).append(lane)
    out: dict[tuple[int, int], tuple] = {}
    for pattern, members in groups.items():
        got = runs.order(pattern)
        if got is None:
            return None
        order, widest = got
        per = max(sum(1 << len(sc) for sc in pattern), 1 << widest)
        step = max(1, BATCH_ENTRIES // per)
        for b0 in range(0, len(members), step):
            part = members[b0:b0 + step]
            gaps = any(w == 3 for _, w in part)
            factors = [(scope, _tables([(specs[comps[i][1][t]], w) for i, w in part], shapes, np))
                       for t, scope in enumerate(pattern)]
            bits, value, gap = _eliminate(factors, order, np, gaps)
            for b, lane in enumerate(part):
                out[lane] = (tuple(bits[b].tolist()), float(value[b]), float(gap[b]))
    return out


def _tables(group: list[tuple[tuple, int]], shapes: dict, np) -> Any:
    """`_table` of each (spec, weights), stacked on a last axis: (2,)*k+(B,). Specs of one shape (the masks repeat
    layer after layer) are built in one minimum over their stacked weights: each entry the least weight of the nodes
    the assignment meets, as `_table` has it."""
    key = group[0][0][1]
    k, own, free, rows = key
    if len(group) == 1:
        sp, which = group[0]
        return _table(sp, shapes, which, np).reshape((2,) * k + (1,))
    if not rows or any(sp[1] != key for sp, _ in group):
        return np.stack([_table(sp, shapes, which, np) for sp, which in group], axis=-1)
    mkey = ("mask", key)
    got = shapes.get(mkey)
    if got is None:
        wide, init, meets = _shape(key, shapes, np)
        if not wide:  # the small form's lists of assignments, as a mask
            mask = np.zeros((len(rows), 1 << k), dtype=bool)
            for r, at in enumerate(meets):
                mask[r, at] = True
            init, meets = np.array(init), mask
        got = shapes[mkey] = (init, meets)
    init, meets = got
    w = np.array([sp[which] for sp, which in group])  # (B, nodes)
    t = np.minimum(init[:, None], np.where(meets[:, :, None], w.T[:, None, :], INF).min(axis=0))  # (2**k, B)
    return t.reshape((2,) * k + (len(group),))


def _shape(key: tuple, shapes: dict, np) -> tuple[bool, Any, Any]:
    """A table shape's initial entries and which assignments each of its nodes' needs meet, worked out once."""
    shape = shapes.get(key)
    if shape is None:
        k, own, free, rows = key
        if len(rows) << k <= 32:  # small: the assignments each node meets, as lists
            init = [INF if a & own else 0.0 for a in range(1 << k)] if free else [INF] * (1 << k)
            meets = [[a for a in range(1 << k) if a & (m_on | m_off) == m_on] for m_on, m_off in rows]
            shape = shapes[key] = (False, init, meets)
        else:
            idx = np.arange(1 << k)
            init = np.where(idx & own, INF, 0.0) if free else np.full(1 << k, INF)
            meets = np.array([(idx & (m_on | m_off)) == m_on for m_on, m_off in rows]) if rows else None
            shape = shapes[key] = (True, init, meets)
    return shape


def _table(spec: tuple, shapes: dict, which: int, np) -> Any:
    """A class's table (2,)*k: the cheapest of its nodes that the assignment meets, by the tie-broken (which=2) or
    the real (3) weights; INF where none, 0 where the class is not computed."""
    key, ws = spec[1], spec[which]
    k, own, free, rows = key
    # the table's shape (which assignments each node's needs meet) repeats layer after layer: the masks are worked
    # out once a shape, and the cheapest node an assignment meets is one minimum over them
    shape = _shape(key, shapes, np)
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


def _eliminate(factors: list[tuple[tuple[int, ...], Any]], order: list[tuple], np,
               gaps: bool) -> tuple[Any, Any, Any]:
    """Eliminate every class of the tables in `_order`'s order (fewest neighbours first), for a batch of B problems
    over the same scopes at once (each table (2,)*k+(B,), the batch innermost: the sums' loops run along it): per
    problem the minimising assignment (B, classes, in the order of their numbers), the minimum (B,), and with `gaps`
    the least margin by which a choice on its way was decided (else INF)."""
    return _run(order, [arr for _, arr in factors], np, gaps)


def _order(scopes: list[tuple[int, ...]], max_width: int) -> tuple[list[tuple], int] | None:
    """The elimination's steps over the tables' scopes (fewest neighbours first; ties by the lower class): each
    (the class, its new table's axes z with the class's place j, the tables summed in order with the axes each
    lacks, the new table's id, or None where it is the last), and the widest table a step builds; None past
    `max_width`."""
    import bisect
    import heapq

    scopes = list(scopes)
    of_var: dict[int, set[int]] = {}
    adj: dict[int, set[int]] = {}
    for fid, scope in enumerate(scopes):
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
    heappop, heappush = heapq.heappop, heapq.heappush
    order = []
    widest = 0
    while heap:
        deg, v = heappop(heap)
        nb = set()
        for f in of_var.get(v, ()):
            nb.update(scopes[f])
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
        widest = max(widest, n_z)
        terms = []
        for f in sorted(of_var.pop(v, ())):
            scope = scopes[f]
            scopes[f] = None
            for u in scope:
                if u != v:
                    of_var[u].discard(f)
            shape = None
            if len(scope) != n_z:
                shape = [1] * n_z
                for u in scope:
                    shape[bisect.bisect_left(z, u)] = 2
            terms.append((f, shape))
        fid = None
        if nb:
            fid = len(scopes)
            scopes.append(tuple(z[:j] + z[j + 1:]))
            for u in nb:
                of_var.setdefault(u, set()).add(fid)
        order.append((v, z, j, terms, fid))
    return order, widest


def _run(order: list[tuple], arrays: list[Any], np, gaps: bool) -> tuple[Any, Any, Any]:
    """`_order`'s steps over a batch of tables (each (2,)*k+(B,)): the assignments (B, classes), minima, margins."""
    arrays = list(arrays)
    n = arrays[0].shape[-1] if arrays else 1
    trail = []
    const = np.zeros(n)
    with np.errstate(invalid="ignore"):  # a margin between two INF entries is nan
        for v, z, j, terms, fid in order:
            n_z = len(z)
            total = None
            for f, shape in terms:
                arr = arrays[f]
                arrays[f] = None
                if shape is not None:
                    arr = arr.reshape(shape + [n])
                total = arr if total is None else total + arr
            if total is None or total.ndim != n_z + 1 or total.size != n << n_z:
                total = np.zeros((2,) * n_z + (n,)) + (0.0 if total is None else total)
            # the variable's axis has two entries: its minimum and where it lies (0 on a tie, as argmin would say)
            lo, hi = total[(slice(None),) * j + (0,)], total[(slice(None),) * j + (1,)]
            trail.append((v, z[:j] + z[j + 1:], hi < lo, np.abs(hi - lo) if gaps else None))
            rest = np.minimum(lo, hi)
            if fid is None:
                const = const + rest
            else:
                arrays.append(rest)
    val: dict[int, Any] = {}
    gap = np.full(n, INF)
    batch = np.arange(n)
    for v, us, arg, margin in reversed(trail):
        at = tuple([val[u] for u in us]) + (batch,)
        val[v] = arg[at].astype(np.int64)
        if gaps:
            m = margin[at]
            gap = np.where(m >= gap, gap, m)  # nan (both INF) counts as no margin
    bits = np.stack([val[v] for v in sorted(val)], axis=1) if val else np.zeros((n, 0), dtype=np.int64)
    return bits, const, gap
