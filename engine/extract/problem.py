"""The extraction's problem: e-classes, their nodes, costs, roots, forced choices and bundles (`Problem`), and what
every solver shares: the usable nodes, the classes a plan needs, reachability, a choice's total cost and its closure,
and cycles."""

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
