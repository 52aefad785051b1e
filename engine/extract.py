"""DAG-aware extraction over a snapshot's e-classes: pick one e-node for every class the step needs, so that a
tensor read twice is computed once and a multi-output bundle is paid for once. `ilp` is exact (HiGHS, with dominator
tightening); `local` is a fast local search (switch a class, or all outputs of a bundle, with exact ref-count deltas)
for interactive what-ifs. Both break ties the same deterministic way (the lower node rank)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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


class NoPlan(Exception):
    def __init__(self, classes: list[int]):
        super().__init__(f"no runnable choice for classes {classes}")
        self.classes = classes


def needed_classes(p: Problem) -> set[int]:
    """Dominator tightening: a root is needed, and so is every class all usable nodes of a needed class read."""
    need = set(p.roots)
    stack = list(p.roots)
    while stack:
        c = stack.pop()
        if c in p.forced:
            common = set(p.children[p.forced[c]])
        else:
            usable = [n for n in p.classes[c] if p.cost[n] < INF]
            if not usable:
                raise NoPlan([c])
            common = set(p.children[usable[0]])
            for n in usable[1:]:
                common &= set(p.children[n])
        for d in common - need:
            need.add(d)
            stack.append(d)
    return need


def reachable(p: Problem) -> set[int]:
    seen, stack = set(p.roots), list(p.roots)
    while stack:
        c = stack.pop()
        for n in p.classes[c]:
            if p.cost[n] < INF:
                for d in p.children[n]:
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


def solve_ilp(p: Problem, time_limit: float = 60.0, start: dict[int, int] | None = None) -> dict[int, int]:
    """The optimum. `start` (e.g. the local search's choice) is handed to HiGHS as its first incumbent."""
    import highspy
    import numpy as np

    need = needed_classes(p)
    live_cls = sorted(reachable(p))
    nodes = [n for c in live_cls for n in p.classes[c] if p.cost[n] < INF]
    col = {n: i for i, n in enumerate(nodes)}
    finite = [p.cost[n] for n in nodes if p.cost[n] > 0]
    scale = 1.0 / (sorted(finite)[len(finite) // 2] if finite else 1.0)
    # a tie-break far below any real difference: prefer the lower rank
    eps = 1e-7
    costs = [p.cost[n] * scale + eps * i / max(1, len(nodes)) for i, n in enumerate(nodes)]
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
    while True:
        h = _highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("mip_rel_gap", 0.0)
        h.setOptionValue("mip_abs_gap", 1e-9)
        h.setOptionValue("time_limit", float(time_limit))
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
            outs = p.bundles[bc]
            for b in p.classes[bc]:
                if p.cost[b] == INF:
                    continue
                if try_moves([(bc, b)] + [(oc, pn) for oc, pn in outs]):
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
