"""`plan(g, options)`: a step graph to its `Plan` — the engine's optimized graph under this lane's cost and shim,
each op linked to its launches, the schedule's settings, the buffers and the arena, built once. `PlanOptions` is
what a plan is made under (the command makes one from its flags; the explorer from its state)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

import numpy as np

from lanefuse.engine.errors import UserError, clip, did_you_mean, listed
from lanefuse.engine.ir import Constant, Graph, StepIO, Tensor
from lanefuse.engine.placement import aliases
from lanefuse.engine.refusal import Refusal
from lanefuse.lane.lower.arena import Arena
from lanefuse.lane.lower.buffers import Buffer, NotWritten, arena_for, buffers, counters
from lanefuse.lane.lower.knobs import Knobs
from lanefuse.lane.lower.shim import Shim, launch_us
from lanefuse.lane.lower.table import LaneTable, load_lane

NUMERICS = ("f32", "q8", "q8x2")
METHODS = ("ilp", "local")


@dataclass(frozen=True)
class PlanOptions:
    """What a plan is made under: the lane, the numerics, the chip (knobs), the rules and schedule steps held back,
    the user's rule folders, forced choices (tensor -> the engine's alternative index) and the extraction method."""

    lane: str = "cuda"
    numerics: str = "f32"
    knobs: Knobs = field(default_factory=Knobs)
    held: tuple[str, ...] = ()
    rules_dirs: tuple[str, ...] = ()
    forced: dict[str, int] = field(default_factory=dict)
    method: str = "ilp"

    def __post_init__(self):
        if self.numerics not in NUMERICS:
            hint = did_you_mean(self.numerics, NUMERICS)
            raise UserError(f"--numerics {self.numerics}: one of {', '.join(NUMERICS)}{hint}")
        if self.method not in METHODS:
            raise UserError(f"extraction method `{self.method}`: one of {', '.join(METHODS)}")
        object.__setattr__(self, "held", tuple(dict.fromkeys(self.held)))
        object.__setattr__(self, "rules_dirs", tuple(self.rules_dirs))
        object.__setattr__(self, "forced", dict(self.forced or {}))


OPTION_NAMES = tuple(f.name for f in fields(PlanOptions))


@dataclass
class Launched:
    """One launch of the plan: the launch, the lifted ops it computes (their outputs), its layer, and the class
    and rule of the fused op it came from."""

    launch: object
    ops: tuple[str, ...]
    layer: int
    cls: str | None
    rule: str | None
    cost_us: float


@dataclass
class Plan:
    """A step lowered: its launches in order, its buffers and arena, the fusions that fired, the census; what it
    was made under (lane, numerics, knobs, held), what the engine said (warnings) and how long each stage took."""

    model: str
    rows: int
    lane: str
    numerics: str
    knobs: Knobs
    held: tuple[str, ...]
    launches: list[Launched]
    buffers: dict[str, Buffer]
    arena: Arena
    counters: list
    fusions: dict[str, int]
    census: dict[str, int]
    cost_us: float
    layers: int
    io: StepIO
    tensors: dict[str, Tensor] = field(default_factory=dict)
    constants: dict[str, Constant] = field(default_factory=dict)
    source: dict = field(default_factory=dict)  # how to open the model again: {"kind": "demo"} or a path
    warnings: tuple[str, ...] = ()
    method: str = "ilp"  # how the engine extracted it: ilp (exact) or local (local search)
    f32_reads: tuple[tuple[str, str], ...] = ()  # under q8/q8x2: each product that reads its activation f32, and why
    timings: dict[str, float] = field(default_factory=dict)  # seconds by stage: engine_s, lower_s

    def per_layer(self) -> dict[int, int]:
        """Kernel launches by layer (-1: the step's head and tail outside every layer)."""
        out: dict[int, int] = {}
        for l in self.launches:
            out[l.layer] = out.get(l.layer, 0) + len(l.launch.kernels())
        return out

    @property
    def batch(self) -> int:
        """The sequences a batch step decodes (its position one a sequence); 1 for a step of one sequence."""
        t = self.tensors.get(self.io.position)
        return t.shape[0] if t is not None else 1

    def check_position(self, pos) -> None:
        """A step's rows must land inside the caches: the kernels do not check it on the device. `pos`: the step's
        position, or a batch's, one a sequence (each inside its slot)."""
        if not self.io.caches:
            return
        length = self.tensors[self.io.caches[0][0]].shape[0]
        if self.batch > 1:
            slot = length // self.batch
            for s, p in enumerate(np.asarray(pos).reshape(-1)):
                if not 0 <= p < slot:
                    raise UserError(f"sequence {s} of the batch at position {p} runs past its KV-cache slot of "
                                    f"{slot} rows")
            return
        pos = int(np.asarray(pos).reshape(-1)[0])
        if pos < 0 or pos + self.rows > length:
            raise UserError(f"a step of {self.rows} row(s) at position {pos} runs past the KV cache of {length} rows")

    @property
    def n_launches(self) -> int:
        return sum(len(l.launch.kernels()) for l in self.launches)

    def weight_bytes(self) -> dict[str, int]:
        """The bytes of checkpoint rows a step reads (every product's weights, the gathered embedding rows), in
        their stored formats, by format: what quantized weights save a decode step."""
        out: dict[str, int] = {}
        for x in self.launches:
            n = x.launch.checkpoint_bytes()
            if n:
                fmts = [f for w, f in x.launch.weights().items()
                        if f and w in self.constants and self.constants[w].kind == "rows"]
                fmt = fmts[0] if fmts else "f32"
                out[fmt] = out.get(fmt, 0) + n
        return dict(sorted(out.items()))


def steps_of(lt: LaneTable) -> dict[str, str]:
    """The lane's schedule steps a plan can hold back (its table is their one list): name -> what it does."""
    return dict(lt.schedule)


# rules a plan always takes, and why: holding one is refused in words
ALWAYS = {"fused_sampling": "the step's arg-max always advances the token and position the next step reads (the seed "
                            "takes the advance always: a decode step replayed on the device reads them from there)"}


def split_held(held, table, lt: LaneTable) -> tuple[frozenset[str], frozenset[str]]:
    """Held names as (rules, schedule steps); an unknown name lists the known ones; a rule the plan always takes
    (ALWAYS) is refused."""
    rules, steps = set(), set()
    lane_steps = steps_of(lt)
    known = set(table.names) | set(lane_steps)
    for h in held:
        if h in ALWAYS:
            raise UserError(f"--hold {h}: not held: {ALWAYS[h]}")
        if h in lane_steps:
            steps.add(h)
            kinds = set(lt.holds.get(h, ()))  # a step over lifted ops (fuse_quant: quantize) holds their rules
            rules |= {r.name for r in table.rules if any(set(it.kinds) & kinds for it in r.items)}
        elif h in table.by_name:
            rules.add(h)
        else:
            hint = did_you_mean(h, known)
            raise UserError(f"--hold {clip(h)}: no rule or schedule step of that name{hint}; known: the steps "
                            f"{listed(sorted(lane_steps), 12)}, the rules {listed(sorted(table.names), 6)} "
                            f"(`lanefuse rules` lists them)")
    return frozenset(rules), frozenset(steps)


def options(base: PlanOptions | None = None, **changes) -> PlanOptions:
    """`base` (or the defaults) with some fields changed; an unknown field name is a TypeError naming the fields."""
    bad = sorted(set(changes) - set(OPTION_NAMES))
    if bad:
        raise TypeError(f"plan options have no {', '.join(bad)} (they are {', '.join(OPTION_NAMES)})")
    o = base or PlanOptions()
    if not changes:
        return o
    kw = {n: getattr(o, n) for n in OPTION_NAMES}
    kw.update({k: v for k, v in changes.items() if v is not None})
    kw["knobs"] = kw["knobs"] or Knobs()
    return PlanOptions(**kw)


def census_of(launched) -> dict[str, int]:
    """A plan's census: its kernels counted by kind (a fused fold one, an unfused pair its two), sorted by kind."""
    census: dict[str, int] = {}
    for x in launched:
        for k in x.launch.kernels():
            census[k.census] = census.get(k.census, 0) + 1
    return dict(sorted(census.items()))


def plan(g: Graph, opts: PlanOptions | None = None, *, session=None, table=None, source: dict | None = None,
         **changes) -> Plan:
    """The step `g` lowered under `opts` (keyword arguments change single options: `plan(g, held=["add_norm"])`);
    `session`: an engine Session over `g` kept between plans (the explorer's), whose saturated e-graphs it reuses."""
    return plan_traced(g, opts, session=session, table=table, source=source, **changes)[0]


def plan_traced(g: Graph, opts: PlanOptions | None = None, *, session=None, table=None, source: dict | None = None,
                shim: Shim | None = None, cost=None, warnings=(), **changes):
    """`plan()` and the engine's result beside it (its trace: `lanefuse plan --trace`). A caller that plans the same
    step again and again (the explorer's what-ifs) may give its `shim` for these options (its costs memoized), a
    `cost` the extraction prices ops by in place of the shim's, and `warnings` the plan carries."""
    from lanefuse.engine.optimize import gc_paused

    with gc_paused():  # the cyclic collector's passes over planning's objects cost a tenth of plan() and free nothing
        return _plan_traced(g, opts, session=session, table=table, source=source, shim=shim, cost=cost,
                            warnings=warnings, **changes)


def _plan_traced(g: Graph, opts: PlanOptions | None, *, session, table, source: dict | None, shim, cost, warnings,
                 **changes):
    from lanefuse.engine.optimize import Session
    from lanefuse.engine.rules import load_table

    from lanefuse.engine.formats.quantize import with_numerics

    t0 = time.perf_counter()
    o = options(opts, **changes)
    if session is not None:
        g = session.g if hasattr(session, "g") else g
    g = with_numerics(g, o.numerics)  # q8 / q8x2: the quantize ops before the products over block-quantized rows
    lt = load_lane(o.lane, o.rules_dirs)
    table = table or (session.table if session is not None else load_table(o.rules_dirs))
    held_rules, held_steps = split_held(o.held, table, lt)
    if shim is None:
        shim = Shim(g, lt, o.knobs, held_steps)
    elif shim.g is not g or (shim.table.name, shim.knobs, shim.held_steps) != (lt.name, o.knobs, held_steps):
        raise ValueError("plan(): the shim given is not these options' (its graph, lane, knobs or held steps differ)")
    if session is not None and getattr(session, "g", g) is not g:
        raise UserError(f"a session over an f32 step graph cannot plan under {o.numerics} numerics (open one over "
                        f"the step under {o.numerics})")
    s = session if session is not None else Session(g, table)
    forced = o.forced
    if any(isinstance(k, dict) for k in forced.values()):  # a plan file's choices by what they are: the indices now
        from lanefuse.lane.lower.spec import resolve_choice

        made = {op.out for op in g.ops}
        forced = {t: resolve_choice(t, k, s.alternatives(t, held_rules), made) for t, k in forced.items()}
    opt = s.plan(held_rules, cost or shim.cost, forced or None, o.method)
    t1 = time.perf_counter()
    p = lower(opt, shim, held_rules, o.numerics, o.method, source or g.meta.get("source", {}), warnings,
              timings={"engine_s": t1 - t0})
    return p, opt


def lower(opt, shim: Shim, held_rules=frozenset(), numerics: str = "f32", method: str = "ilp",
          source: dict | None = None, warnings=(), timings: dict[str, float] | None = None) -> Plan:
    """The engine's optimized graph (`opt`, its result) linked, scheduled and placed under the shim's lane, knobs
    and held steps: the Plan, built once."""
    from lanefuse.engine.formats.quantize import f32_reads

    t0 = time.perf_counter()
    og: Graph = opt.graph
    lt, knobs, held_steps = shim.table, shim.knobs, shim.held_steps
    lk = shim.link
    lk.g = og
    launched: list[Launched] = []
    for op in og.ops:
        linked = lk.op(op)
        if isinstance(linked, Refusal):
            raise UserError(f"the {lt.name} lane cannot run {linked}")
        for x in linked:
            tuned = x.launch.tune(knobs, held_steps)
            # `sequences` held: a batch's launches one a sequence, the lifted ops counted with the last
            apart = tuned.apart() if "sequences" in held_steps else (tuned,)
            for i, l in enumerate(apart):
                why = l.check()
                if why:
                    raise UserError(f"the {lt.name} lane cannot run {x.cls or op.kind} -> `{op.out}`: "
                                    f"{getattr(why, 'reason', why)}")
                ops = x.ops if i == len(apart) - 1 else ()
                launched.append(Launched(l, ops, x.layer, x.cls, x.rule, launch_us(l, knobs, lt.costs)))
    al = aliases(og)
    bufs = buffers(og, al)
    seq = [x.launch for x in launched]
    try:
        arena = arena_for(seq, bufs)
    except NotWritten as e:  # a lowering bug, not the user's: said loudly, naming the array and the launch
        x = launched[e.launch]
        raise UserError(f"the {lt.name} lane's plan of `{og.meta.get('model', 'the step')}` is wrong: {e} "
                        f"(layer {x.layer}, computing {', '.join(x.ops) or '-'})") from None
    census = census_of(launched)
    times = dict(timings or {})
    times["lower_s"] = time.perf_counter() - t0
    return Plan(model=str(og.meta.get("model", "")), rows=int(og.meta.get("rows", 1)), lane=lt.name,
                numerics=numerics, knobs=knobs, held=tuple(sorted(set(held_rules) | set(held_steps))),
                launches=launched, buffers=bufs, arena=arena, counters=counters(seq),
                fusions=dict(sorted(opt.fusions.items())), census=census,
                cost_us=sum(x.cost_us for x in launched), layers=og.layers, io=og.io, tensors=dict(og.tensors),
                constants=dict(og.constants), source=dict(source or {}),
                warnings=tuple(opt.warnings) + tuple(warnings), method=method, timings=times,
                f32_reads=tuple(f32_reads(og)) if numerics != "f32" else ())
