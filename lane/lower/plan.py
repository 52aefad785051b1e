"""`plan()`: a step graph to its Schedule — the engine's optimized graph under this lane's cost and shim, each op
linked to its launches, the schedule's settings, the buffers and the arena."""

from __future__ import annotations

import time

from lanefuse.engine.errors import UserError, did_you_mean
from lanefuse.engine.ir import Graph
from lanefuse.lane.lower.buffers import aliases, arena_for, buffers, counters
from lanefuse.lane.lower.knobs import Knobs
from lanefuse.lane.lower.link import Link, Refused
from lanefuse.lane.lower.schedule import STEPS, Launched, Schedule, kernels_of, schedule_launch
from lanefuse.lane.lower.shim import Shim, launch_us
from lanefuse.lane.lower.table import LaneTable, load_lane

NUMERICS = ("f32",)


def split_held(held, table) -> tuple[frozenset[str], frozenset[str]]:
    """Held names as (rules, schedule steps); an unknown name lists the known ones."""
    rules, steps = set(), set()
    known = set(table.names) | set(STEPS)
    for h in held:
        if h in STEPS:
            steps.add(h)
        elif h in table.by_name:
            rules.add(h)
        else:
            hint = did_you_mean(h, known)
            raise UserError(f"--hold {h}: no rule or schedule step of that name{hint}; known: "
                            f"{', '.join(sorted(known))}")
    return frozenset(rules), frozenset(steps)


def plan(g: Graph, lane: str | LaneTable = "cuda", numerics: str = "f32", knobs: Knobs | None = None, held=(),
         rules_dirs=(), forced: dict[str, int] | None = None, method: str = "ilp", session=None, table=None,
         source: dict | None = None) -> Schedule:
    """The step `g` lowered under `lane` and `numerics`, with `held` rules and schedule steps held back."""
    from lanefuse.engine.optimize import Session
    from lanefuse.engine.rules import load_table

    t0 = time.perf_counter()
    if numerics not in NUMERICS:
        raise UserError(f"--numerics {numerics}: this lane runs {', '.join(NUMERICS)} (q8 comes later)")
    knobs = knobs or Knobs()
    lt = lane if isinstance(lane, LaneTable) else load_lane(lane, rules_dirs)
    table = table or (session.table if session is not None else load_table(rules_dirs))
    held_rules, held_steps = split_held(held, table)
    shim = Shim(g, lt, knobs, held_steps)
    s = session if session is not None else Session(g, table)
    opt = s.plan(held_rules, shim.cost, forced, method)
    t1 = time.perf_counter()
    sched = lower(opt.graph, lt, knobs, held_steps, shim)
    sched.held = tuple(sorted(held_rules | held_steps))
    sched.fusions = dict(sorted(opt.fusions.items()))
    sched.numerics = numerics
    sched.source = dict(source or g.meta.get("source", {}) or {})
    sched.timings = {"engine_s": t1 - t0, "lower_s": time.perf_counter() - t1, "optimized": opt,
                     "warnings": list(opt.warnings)}
    return sched


def lower(og: Graph, lt: LaneTable, knobs: Knobs, held_steps=frozenset(), shim: Shim | None = None) -> Schedule:
    """Link, schedule and place the optimized graph `og`."""
    lk = shim.link if shim is not None else Link(og, lt, frozenset(held_steps))
    lk.g = og
    launched: list[Launched] = []
    for op in og.ops:
        try:
            linked = lk.op(op)
        except Refused as e:
            raise UserError(f"the {lt.name} lane cannot run {e}") from None
        for x in linked:
            l = schedule_launch(x.launch, knobs, held_steps)
            why = l.check()
            if why:
                raise UserError(f"the {lt.name} lane cannot run {x.cls or op.kind} -> `{op.out}`: {why}")
            launched.append(Launched(l, x.ops, x.layer, x.cls, x.rule, launch_us(l, knobs)))
    al = aliases(og)
    bufs = buffers(og, al)
    seq = [x.launch for x in launched]
    arena = arena_for(seq, bufs)
    census: dict[str, int] = {}
    for x in launched:
        for k in kernels_of(x.launch):
            census[k.census] = census.get(k.census, 0) + 1
    return Schedule(model=str(og.meta.get("model", "")), rows=int(og.meta.get("rows", 1)), lane=lt.name,
                    numerics="f32", knobs=knobs, held=tuple(sorted(held_steps)), launches=launched, buffers=bufs,
                    arena=arena, counters=counters(seq), fusions={}, census=dict(sorted(census.items())),
                    cost_us=sum(x.cost_us for x in launched), layers=og.layers, io=og.io, tensors=dict(og.tensors),
                    constants=dict(og.constants))
