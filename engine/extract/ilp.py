"""The exact extraction as an ILP (HiGHS): a binary variable a node, dominator tightening, the costs scaled to a median
of 1 with a deterministic tie-break (the lower node rank), cycles cut lazily."""

from __future__ import annotations

import math
import time

from lanefuse.engine.extract.problem import (INF, NoPlan, Problem, TimeLimit, _closure, _Cycle, _find_cycle,
                                             needed_classes, reachable)

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
