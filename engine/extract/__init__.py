"""DAG-aware extraction over a snapshot's e-classes: pick one e-node for every class the step needs, so that a
tensor read twice is computed once and a multi-output bundle is paid for once. `ilp` is exact (HiGHS, with dominator
tightening); `local` is a fast local search (switch a class, or all outputs of a bundle, with exact ref-count deltas)
for interactive what-ifs. Both break ties the same deterministic way (the lower node rank).

One module a solver: `problem` (the problem and what the solvers share), `ilp`, `elimination`, `local`; this one
picks among them (`solve_exact`) and names the API."""

from __future__ import annotations

from lanefuse.engine.extract.elimination import MAX_WIDTH, MEMO_MIN_CLASSES, solve_elimination
from lanefuse.engine.extract.ilp import HIGHS_TOLERANCE, TIE_EPS, solve_ilp
from lanefuse.engine.extract.local import solve_local
from lanefuse.engine.extract.problem import (INF, NoPlan, Problem, TimeLimit, has_cycle, needed_classes, reachable,
                                             requirements, total_cost)

__all__ = ["INF", "HIGHS_TOLERANCE", "ILP_SECONDS", "ILP_SECONDS_MAX", "ILP_SECONDS_PER_NODE", "MAX_WIDTH",
           "MEMO_MIN_CLASSES", "NoPlan", "Problem", "TIE_EPS", "TimeLimit", "has_cycle", "ilp_time_limit",
           "needed_classes", "reachable", "requirements", "solve_elimination", "solve_exact", "solve_ilp",
           "solve_local", "total_cost"]

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
