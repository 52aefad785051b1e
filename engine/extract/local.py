"""The fast extraction for interactive what-ifs: a local search that switches a class, or all outputs of a bundle,
with exact ref-count deltas; ties broken as the exact solvers break them (the lower node rank)."""

from __future__ import annotations

from lanefuse.engine.extract.problem import INF, NoPlan, Problem, _closure, _Cycle, has_cycle


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
