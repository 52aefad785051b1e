"""The explorer: one step graph and lane kept live for what-ifs — hold or release a rule or schedule step, force a
tensor's alternative, set a knob — each re-planned on ONE engine Session (a saturated e-graph cached per held set),
with the diff against the plan before, each tensor's alternatives with their costs and refusals, and `why` in words.
`lanefuse explore` drives it from the terminal (lane/explore/shell.py) or the web page (lane/explore/server.py), whose
protocol `state / choices / hold / release / force / unforce / set_knob` this class implements. It stands on the
engine's public API (`Session.alternatives`, `Optimized.chosen`) and plans every what-if by the command line's path,
the lane's `plan(..., session=...)` under a PlanOptions; what a schedule step is and which classes it gates come from
the lane table.

Speed: the first plan is exact (the ILP); every what-if after it takes the engine's local search (`method="local"`),
about 20-30 ms on the demo model against ~350 ms for the ILP, unless `set_what_if("ilp")` keeps every plan exact;
`plan(exact=True)` re-plans the current choices exactly. `undo` and `goto` walk the history of changes back. A configuration seen before (say: hold, then release) answers its cached plan, so going back is exact too.

Alternative indices: a tensor's alternatives are numbered once, in the engine's order under NO held rule, and keep
those numbers across hold and release (an alternative is known by its `signature`, the same under every held set);
an alternative a held rule removes stays listed (support `held`, with the rule to release) and cannot be forced. A
plan file (`save`) records each forced choice by what it is (op or class, rule, output, what it writes, reads and
computes inside: `lane/lower/spec.py`), so `lanefuse plan --spec FILE` replays it after the rule set changes."""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from lanefuse.engine.errors import UserError, clip, did_you_mean, listed
from lanefuse.engine.ir import Graph, Op
from lanefuse.engine.optimize import Alternative, Optimized, Session
from lanefuse.engine.refusal import Refusal
from lanefuse.lane.lower.knobs import KNOB_NAMES, Knobs, parse_knobs, set_knob
from lanefuse.lane.lower.plan import (METHODS, NUMERICS, Launched, Plan, PlanOptions, options, plan_traced,
                                     split_held, steps_of)
from lanefuse.lane.lower.shim import Shim
from lanefuse.lane.lower.spec import resolve_choice
from lanefuse.lane.lower.table import LaneTable



@dataclass
class _Plan:
    """One configuration's plan: the lowered schedule, the engine's result behind it and how it was found."""

    sched: Plan
    opt: Optimized  # its cost, and which alternative each tensor got (`chosen`)
    method: str  # "ilp" (exact) or "local" (local search)
    warnings: list[str]
    ms: float
    shaped: dict[str, int] | None = None  # launches each schedule step shaped, worked out on first use
    step_map: dict | None = None  # the whole step for the page's mini-map, worked out on first use

    @property
    def engine_cost(self) -> float:
        return self.opt.cost


@dataclass
class _Config:
    held_rules: frozenset[str] = frozenset()
    held_steps: frozenset[str] = frozenset()
    knobs: Knobs = field(default_factory=Knobs)
    forced: dict[str, int] = field(default_factory=dict)  # tensor -> the explorer's stable alternative index


def _engine_thread(fn):
    """Run the method on the explorer's engine thread (directly when already there)."""

    @functools.wraps(fn)
    def on_thread(self, *args, **kwargs):
        if threading.current_thread() is self._thread:
            return fn(self, *args, **kwargs)
        return self._pool.submit(fn, self, *args, **kwargs).result()

    return on_thread


class Explorer:
    """A session over one step graph `g` and lane. Every change re-plans at once; `state()` is the page's JSON."""

    def __init__(self, g: Graph, lane: str = "cuda", rules_dirs=(), knobs: Knobs | dict | list | None = None,
                 held=(), forced: dict[str, int] | None = None, model_name: str = "", what_if: str = "local",
                 numerics: str = "f32"):
        # egglog's e-graph must stay on the thread that made it (the web server answers from many): the engine's
        # work runs on one thread of the explorer's own, and every public method goes there
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lanefuse-explore")
        self._thread = self._pool.submit(threading.current_thread).result()
        try:
            self._pool.submit(self._setup, g, lane, rules_dirs, knobs, held, forced, model_name, what_if,
                              numerics).result()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Drop the e-graph on its own thread and end that thread; the explorer is done with after this."""
        pool = self.__dict__.get("_pool")
        if pool is None:
            return
        d = self.__dict__
        if threading.current_thread() is self._thread:
            d.clear()
            pool.shutdown(wait=False)
        else:
            pool.submit(d.clear).result()
            pool.shutdown(wait=True)

    def __del__(self):
        pool = self.__dict__.get("_pool")
        if pool is not None:
            try:  # the work item keeps the attributes alive until the engine thread clears them
                pool.submit(self.__dict__.clear)
                pool.shutdown(wait=False)
            except RuntimeError:  # the interpreter is shutting down
                pass

    def _setup(self, g, lane, rules_dirs, knobs, held, forced, model_name, what_if, numerics) -> None:
        from lanefuse.engine.rules import load_table
        from lanefuse.lane.lower.table import load_lane

        if numerics not in NUMERICS:
            raise UserError(f"numerics `{numerics}`: this lane plans {', '.join(NUMERICS)}")
        self.numerics = numerics
        if what_if not in METHODS:
            raise UserError(f"what-if method `{what_if}`: local or ilp")
        from lanefuse.engine.formats.quantize import with_numerics

        t0 = time.perf_counter()
        g = with_numerics(g, numerics)  # q8 / q8x2: the quantize ops before the products over block-quantized rows
        self.g = g
        self.rules_dirs = tuple(rules_dirs)
        self.table = load_table(self.rules_dirs)
        self.lane = load_lane(lane, self.rules_dirs)
        self.model = model_name or str(g.meta.get("model", "") or "step")
        self.what_if = what_if
        self.steps = steps_of(self.lane)  # the lane's schedule steps: name -> what it does
        self.session = Session(g, self.table)
        self._shims: dict[tuple, tuple[Shim, dict]] = {}
        self._plans: dict[tuple, _Plan] = {}
        self._alt_cache: dict[tuple[frozenset, str], list[Alternative]] = {}
        self._sigs: dict[tuple[frozenset, str], list[tuple]] = {}
        self._order: dict[str, list[tuple]] = {}  # tensor -> alternative signatures, in stable index order
        self._plan_costs: dict[tuple, float | None] = {}
        self._sources: dict[str, dict] = {}
        # the step graph by layer: an op outside the layers (embedding, head) goes with the first or the last layer
        self.producer: dict[str, Op] = {op.out: op for op in g.ops}
        self.layers = max(1, g.layers)
        first = next((k for k, op in enumerate(g.ops) if op.layer >= 0), 0)
        self.layer_of: dict[str, int] = {}
        for k, op in enumerate(g.ops):
            self.layer_of[op.out] = op.layer if op.layer >= 0 else (0 if k < first else self.layers - 1)
        self.layer = 0

        kn = knobs if isinstance(knobs, Knobs) else parse_knobs(knobs or [], Knobs())
        for h in held:
            self._check_name(h)
        held_rules, held_steps = split_held(held, self.table, self.lane)
        self.cfg = _Config(held_rules, held_steps, kn)
        # a plan file's forced choices are the engine's indices under its held rules: number them the explorer's way
        for t, k in (forced or {}).items():
            self._tensor(t)
            k = resolve_choice(t, k, self._alts(t, held_rules), self.producer)
            sigs = self._cur_sigs(t)
            if not isinstance(k, int) or not 0 <= k < len(sigs):
                raise UserError(f"forced choice {k!r} for `{t}`: it has alternatives 0..{len(sigs) - 1}")
            self.cfg.forced[t] = self._stable(t).index(sigs[k])
        self._prev: _Plan | None = None
        self._what: str | None = None
        self._cur = self._plan_for(self.cfg, "ilp")
        self._base = self.cfg  # the configuration the session opened with; `_log`: each change since, in order
        self._log: list[tuple[str, _Config]] = []
        self.setup_ms = (time.perf_counter() - t0) * 1e3
        self.last_ms = self._cur.ms

    # ---- rules' source --------------------------------------------------------------------------------------------
    def rule_source(self, name: str) -> dict:
        """Rule `name`'s pattern (each matched tensor's op, what the fused op writes, its guards) and its YAML entry
        as the file holds it (`source`, from its line; None where the file cannot be read)."""
        hit = self._sources.get(name)
        if hit is None:
            self._check_name(name)
            r = self.table.by_name.get(name)
            if r is None:  # a lane schedule step: its entry in the lane table
                hit = {"pattern": [], "source": None}
            else:
                pattern = [f"{it.var}: {it.text}" for it in r.items]
                pattern.append(f"out: {r.out}" + (f"  keeps: {', '.join(r.keeps)}" if r.keeps else ""))
                for g, args in r.guards:
                    pattern.append(f"if {g}({', '.join(a.var if a.var is not None else repr(a.lit) for a in args)})")
                hit = {"pattern": pattern, "source": _yaml_entry(r.file, r.line)}
            self._sources[name] = hit
        return hit

    # ---- names ---------------------------------------------------------------------------------------------------
    def rule_names(self) -> list[str]:
        return list(self.table.names) + list(self.steps)

    def tensor_names(self) -> list[str]:
        return [op.out for op in self.g.ops]

    @staticmethod
    def knob_names() -> list[str]:
        return list(KNOB_NAMES)

    def _check_name(self, name: str) -> None:
        if name in self.steps or name in self.table.by_name:
            return
        known = self.rule_names()
        raise UserError(f"no rule or schedule step `{clip(name)}`{did_you_mean(name, known)}; known: the steps "
                        f"{listed(self.steps, 12)}, the rules {listed(self.table.names, 6)}")

    def _tensor(self, t: str) -> Op:
        op = self.producer.get(t)
        if op is None:
            if t in self.g.constants or t in self.g.io.inputs or t in self.g.tensors:
                raise UserError(f"`{clip(t)}` is a step input or constant: nothing computes it, so it has no "
                                f"alternatives")
            raise UserError(f"no tensor `{clip(t)}` in the step graph{did_you_mean(t, self.producer)}")
        return op

    # ---- the engine ------------------------------------------------------------------------------------------------
    def _shim(self, knobs: Knobs, held_steps: frozenset) -> tuple[Shim, dict]:
        key = (knobs, held_steps)
        if key not in self._shims:
            self._shims[key] = (Shim(self.g, self.lane, knobs, held_steps), {})
        return self._shims[key]

    def _own_cost(self, cfg: _Config, op: Op) -> float | Refusal:
        shim, memo = self._shim(cfg.knobs, cfg.held_steps)
        e = memo.get(id(op))
        if e is None or e[0] is not op:  # the snapshot keeps its ops alive, so an id names one op
            e = memo[id(op)] = (op, shim.cost(op, self.g))
        return e[1]

    def _cost_fn(self, cfg: _Config, forced: dict[str, int], local: bool):
        """The shim's cost, memoized per op. With forced choices, a fused op that would compute a forced tensor
        inside (not writing it) is refused: the exact extraction implies that already, and the local search then
        keeps a forced tensor written. For the local search, a multi-output op writing a forced tensor that is not
        forced to this op is refused too: the search's bundle moves would otherwise switch a forced class."""
        names = frozenset(forced)
        mine: dict[str, set[int]] = {}  # forced tensor -> the multi-output ops (ids) its forced alternative projects
        if local and forced:
            for t, k in forced.items():
                mine[t] = {id(op) for op in self._alts(t, cfg.held_rules)[k].bundle}

        def cost(op: Op, g=None):
            v = self._own_cost(cfg, op)
            if names and op.fused and not isinstance(v, Refusal):
                inside = ({p.out for p in op.parts} - set(op.outs)) & names
                if inside:
                    return Refusal(f"it computes the forced `{sorted(inside)[0]}` inside")
                if mine and len(op.outs) > 1:
                    for t in names.intersection(op.outs):
                        if id(op) not in mine[t]:
                            return Refusal(f"it writes `{t}`, which is forced to another alternative")
            return v

        return cost

    def _alts(self, t: str, held_rules: frozenset) -> list[Alternative]:
        """`t`'s alternatives in the engine's order under `held_rules` (the engine's indices)."""
        key = (held_rules, t)
        hit = self._alt_cache.get(key)
        if hit is None:
            hit = self._alt_cache[key] = self.session.alternatives(t, held_rules)
        return hit

    def _cur_sigs(self, t: str, held_rules: frozenset | None = None) -> list[tuple]:
        """The signatures of `t`'s alternatives under `held_rules` (the current ones by default), in the engine's
        order."""
        held_rules = self.cfg.held_rules if held_rules is None else held_rules
        key = (held_rules, t)
        if key not in self._sigs:
            self._sigs[key] = [a.signature for a in self._alts(t, held_rules)]
        return self._sigs[key]

    def _unheld(self, t: str, sig: tuple) -> Alternative | None:
        """The alternative of `t` with signature `sig` in the e-graph of no held rule."""
        return next((a for a in self._alts(t, frozenset()) if a.signature == sig), None)

    def _stable(self, t: str) -> list[tuple]:
        """`t`'s alternatives in their stable order: the engine's under no held rule, then any seen only since."""
        if t not in self._order:
            self._order[t] = list(self._cur_sigs(t, frozenset()))
        alts = self._order[t]
        for s in self._cur_sigs(t):
            if s not in alts:
                alts.append(s)
        return alts

    def _engine_forced(self, cfg: _Config) -> tuple[dict[str, int], list[str]]:
        """The forced choices as the engine's indices under `cfg`'s held rules; a force a held rule removed does not
        bind (and says so)."""
        out, notes = {}, []
        for t, k in sorted(cfg.forced.items()):
            sig = self._stable(t)[k]
            cur = self._cur_sigs(t, cfg.held_rules)
            if sig in cur:
                out[t] = cur.index(sig)
            else:
                notes.append(f"the force of `{t}` to #{k} does not bind: {self._held_why(t, k, cfg)}")
        return out, notes

    def _key(self, cfg: _Config, forced: dict[str, int]) -> tuple:
        return (cfg.held_rules, cfg.held_steps, cfg.knobs, tuple(sorted(forced.items())))

    def _plan_for(self, cfg: _Config, method: str | None = None) -> _Plan:
        forced, notes = self._engine_forced(cfg)
        key = self._key(cfg, forced)
        hit = self._plans.get(key)
        if hit is not None and (method != "ilp" or hit.method == "ilp"):
            return hit
        t0 = time.perf_counter()
        method = method or self.what_if
        sched, opt = self._planned(cfg, forced, method, notes)
        p = _Plan(sched, opt, method, list(opt.warnings) + notes, (time.perf_counter() - t0) * 1e3)
        self._plans[key] = p
        return p

    def _planned(self, cfg: _Config, forced: dict[str, int], method: str, notes: list[str]) -> tuple[Plan, Optimized]:
        """The plan under `cfg` by the command line's path, `plan(..., session=...)` with its PlanOptions (so a name
        holds here what `--hold` holds there), on this explorer's session, shim and memoized costs; a local search
        that leaves a forced tensor unwritten falls back to the exact ILP."""
        opts = PlanOptions(lane=self.lane.name, numerics=self.numerics, knobs=cfg.knobs,
                           held=tuple(sorted(cfg.held_rules | cfg.held_steps)), rules_dirs=self.rules_dirs,
                           forced=forced, method=method)
        shim, _ = self._shim(cfg.knobs, cfg.held_steps)

        def planned(o: PlanOptions):
            return plan_traced(self.g, o, session=self.session, table=self.table, shim=shim, warnings=notes,
                               cost=self._cost_fn(cfg, forced, o.method == "local"))

        got = None
        try:
            got = planned(opts)
        except UserError:
            if method != "local" or not forced:
                raise  # else the local search found nothing under the forces: the ILP decides
        if method == "local" and (got is None or any(got[1].chosen.get(t) != k for t, k in forced.items())):
            got = planned(options(opts, method="ilp"))
        return got

    def _extract(self, cfg: _Config, forced: dict[str, int], method: str) -> Optimized:
        """The engine's extraction alone under `cfg` (a what-if's cost, `_plan_cost`: nothing lowered), falling back
        to the exact ILP as `_planned` does."""
        opt = None
        try:
            opt = self.session.plan(cfg.held_rules, self._cost_fn(cfg, forced, method == "local"), forced, method)
        except UserError:
            if method != "local" or not forced:
                raise
        if method == "local" and (opt is None or any(opt.chosen.get(t) != k for t, k in forced.items())):
            opt = self.session.plan(cfg.held_rules, self._cost_fn(cfg, forced, False), forced, "ilp")
        return opt

    def _change(self, what: str, cfg: _Config, record: bool = True) -> None:
        """Re-plan under `cfg`; on a user error (no plan) the explorer stays as it was. A recorded change goes on
        the history (`undo`, `goto`)."""
        t0 = time.perf_counter()
        p = self._plan_for(cfg)
        self._prev, self._cur, self.cfg, self._what = self._cur, p, cfg, what
        self.last_ms = (time.perf_counter() - t0) * 1e3
        if record:
            self._log.append((what, cfg))

    def _copy(self) -> _Config:
        c = self.cfg
        return _Config(c.held_rules, c.held_steps, c.knobs, dict(c.forced))

    # ---- the actions ---------------------------------------------------------------------------------------------
    @_engine_thread
    def hold(self, rule: str) -> None:
        from lanefuse.lane.lower.plan import ALWAYS

        self._check_name(rule)
        if rule in ALWAYS:
            raise UserError(f"hold {rule}: not held: {ALWAYS[rule]}")
        cfg = self._copy()
        rules, steps = split_held([rule], self.table, self.lane)  # as `plan --hold`: a step holds its ops' rules too
        cfg.held_steps |= steps
        cfg.held_rules |= rules
        self._change(f"hold {rule}", cfg)

    @_engine_thread
    def release(self, rule: str) -> None:
        self._check_name(rule)
        if rule not in self.cfg.held_rules and rule not in self.cfg.held_steps:
            raise UserError(f"`{rule}` is not held (held: {', '.join(self.held) or 'nothing'})")
        cfg = self._copy()
        if rule in cfg.held_steps:  # the step, and the rules it held (fuse_quant: the quantize rules)
            cfg.held_rules -= split_held([rule], self.table, self.lane)[0]
        cfg.held_steps -= {rule}
        cfg.held_rules -= {rule}
        self._change(f"release {rule}", cfg)

    @_engine_thread
    def force(self, tensor: str, index: int) -> None:
        self._tensor(tensor)
        alts = self._stable(tensor)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(alts):
            raise UserError(f"`{tensor}` has alternatives 0..{len(alts) - 1}, not {index!r}")
        ch = self._alternative(self.cfg, tensor, index)
        if ch["support"] == "held":
            raise UserError(f"cannot force `{tensor}` to #{index} {ch['op']}: {ch['reason']}")
        if ch["support"] == "refuse":
            raise UserError(f"cannot force `{tensor}` to #{index} {ch['op']}: the {self.lane.name} lane refuses "
                            f"{ch['reason']}")
        cfg = self._copy()
        cfg.forced[tensor] = index
        self._change(f"force {tensor} #{index}", cfg)

    @_engine_thread
    def unforce(self, tensor: str) -> None:
        self._tensor(tensor)
        if tensor not in self.cfg.forced:
            now = ", ".join(sorted(self.cfg.forced)) or "nothing"
            raise UserError(f"`{tensor}` is not forced (forced: {now})")
        cfg = self._copy()
        del cfg.forced[tensor]
        self._change(f"unforce {tensor}", cfg)

    @_engine_thread
    def set_knob(self, name: str, value) -> None:
        cfg = self._copy()
        cfg.knobs = set_knob(cfg.knobs, name, value)
        self._change(f"knob {name}={getattr(cfg.knobs, name)}", cfg)

    # ---- history ---------------------------------------------------------------------------------------------
    @_engine_thread
    def history(self) -> list[dict]:
        """Each change since the session opened, oldest first: what it was and the step's launches and cost after
        it (`goto(n)` goes back to the plan after the first n)."""
        out = []
        for what, cfg in self._log:
            p = self._plans.get(self._key(cfg, self._engine_forced(cfg)[0]))
            out.append({"what": what, "launches": p.sched.n_launches if p else None,
                        "cost_us": round(p.sched.cost_us, 4) if p else None})
        return out

    @_engine_thread
    def undo(self) -> str:
        """Take the last change back (each undo one more); answer what was undone."""
        if not self._log:
            raise UserError("nothing to undo: the session has made no change")
        what, _ = self._log[-1]
        self.goto(len(self._log) - 1, f"undo {what}")
        return what

    @_engine_thread
    def goto(self, n: int, what: str | None = None) -> None:
        """Go back to the plan after the first `n` changes (0: the plan the session opened with); the later
        changes leave the history. Each configuration's plan is cached, so going back is what it was."""
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(self._log):
            raise UserError(f"history entry {n!r}: the history has entries 0..{len(self._log)} (0: the start)")
        cfg = self._log[n - 1][1] if n else self._base
        label = what or (f"back to #{n} {self._log[n - 1][0]}" if n else "back to the start")
        self._change(label, cfg, record=False)
        del self._log[n:]

    @_engine_thread
    def set_what_if(self, method: str) -> None:
        """How a change re-plans: `local` (the local search, the default) or `ilp` (exact, as the first plan);
        switching to `ilp` re-plans the current choices exactly."""
        if method not in METHODS:
            raise UserError(f"what-if method `{method}`: local or ilp")
        self.what_if = method
        if method == "ilp":
            self.plan(exact=True)

    @_engine_thread
    def plan(self, exact: bool = False) -> Plan:
        """The current plan; `exact` re-plans the current choices with the ILP (kept for this configuration)."""
        if exact and self._cur.method != "ilp":
            t0 = time.perf_counter()
            p = self._plan_for(self.cfg, "ilp")
            if _summary(p) != _summary(self._cur):
                self._prev, self._what = self._cur, "plan exactly"
            self._cur = p
            self.last_ms = (time.perf_counter() - t0) * 1e3
        return self._cur.sched

    @property
    def method(self) -> str:
        return self._cur.method

    @property
    def held(self) -> list[str]:
        """The names held as the user named them: a held step, not the rules it holds with it."""
        implied = split_held(sorted(self.cfg.held_steps), self.table, self.lane)[0]
        return sorted((self.cfg.held_rules - implied) | self.cfg.held_steps)

    @property
    def forced(self) -> dict[str, int]:
        return dict(sorted(self.cfg.forced.items()))

    @property
    def knobs(self) -> Knobs:
        return self.cfg.knobs

    @property
    def warnings(self) -> list[str]:
        return list(self._cur.warnings)

    @_engine_thread
    def diff(self) -> dict | None:
        """The current plan against the one before the last change: launches, cost, arena bytes as [before, after];
        census and fusions fired, the kinds and rules that changed only; what the change was."""
        if self._prev is None:
            return None
        b, a = _summary(self._prev), _summary(self._cur)
        ch = lambda x, y: {k: [x.get(k, 0), y.get(k, 0)] for k in sorted(set(x) | set(y))  # noqa: E731
                           if x.get(k, 0) != y.get(k, 0)}
        return {"what": self._what, "launches": [b["launches"], a["launches"]],
                "cost_us": [b["cost_us"], a["cost_us"]], "arena": [b["arena"], a["arena"]],
                "census": ch(b["census"], a["census"]), "fusions": ch(b["fusions"], a["fusions"]),
                "warnings": [w for w in self._cur.warnings if w not in self._prev.warnings],  # what this change said
                "method": self._cur.method, "ms": round(self.last_ms, 1)}

    @_engine_thread
    def save(self, path: str) -> None:
        """Write the held rules, the forced choices (the engine's indices under the held rules) and the knobs as a
        plan file `lanefuse plan --spec FILE` replays."""
        from lanefuse.lane.lower.files import write_atomic
        from lanefuse.lane.lower.spec import describe_choice, dump_spec

        forced, _ = self._engine_forced(self.cfg)
        forced = {t: describe_choice(self._alts(t, self.cfg.held_rules)[k], self.producer) for t, k in forced.items()}
        default = Knobs().to_json()
        knobs = {k: v for k, v in self.cfg.knobs.to_json().items() if default.get(k) != v}
        write_atomic(path, dump_spec(self.lane.name, self.numerics, self.held, knobs, forced,
                                     self.model if self.model != "step" else None))

    # ---- A/B: two configurations side by side ---------------------------------------------------------------------
    def spec(self) -> dict:
        """The current configuration as a spec `compare` takes: held rules and steps, forced choices (the explorer's
        indices, `"stable": True`), knobs that differ from the chip's defaults, numerics."""
        default = Knobs().to_json()
        knobs = {k: v for k, v in self.cfg.knobs.to_json().items() if default.get(k) != v}
        return {"held": self.held, "forced": self.forced, "knobs": knobs, "numerics": self.numerics, "stable": True}

    def _config_from(self, spec: dict, what: str) -> _Config:
        """A spec (a plan file's keys, or `spec()`) as a configuration of this explorer."""
        if not isinstance(spec, dict):
            raise UserError(f"{what}: a spec is a mapping of held, forced, knobs, numerics")
        bad = sorted(set(spec) - {"held", "forced", "knobs", "numerics", "stable", "lane", "model", "name"})
        if bad:
            raise UserError(f"{what}: unknown key `{clip(bad[0])}`; a spec has held, forced, knobs, numerics")
        numerics = spec.get("numerics") or self.numerics
        if numerics != self.numerics:
            raise UserError(f"{what}: numerics `{clip(numerics)}`: this explorer plans {self.numerics} (open another "
                            f"with --numerics {clip(numerics)} to compare)")
        if spec.get("lane") not in (None, self.lane.name):
            raise UserError(f"{what}: lane `{clip(spec['lane'])}`: this explorer plans the {self.lane.name} lane")
        held = spec.get("held") or []
        if isinstance(held, str):  # `a, b` as the names it lists, not its letters
            held = [h.strip() for h in held.split(",") if h.strip()]
        if not isinstance(held, list) or not all(isinstance(h, str) for h in held):
            raise UserError(f"{what}: `held` is a list of rule or step names, not {clip(held)}")
        for key in ("forced", "knobs"):
            if spec.get(key) is not None and not isinstance(spec[key], dict):
                raise UserError(f"{what}: `{key}` is a mapping, not {clip(spec[key])}")
        for h in held:
            self._check_name(h)
        held_rules, held_steps = split_held([str(h) for h in held], self.table, self.lane)
        kn = parse_knobs(spec.get("knobs") or {}, Knobs())
        cfg = _Config(held_rules, held_steps, kn)
        for t, k in (spec.get("forced") or {}).items():
            self._tensor(t)
            if spec.get("stable"):
                n = len(self._stable(t))
                if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n:
                    raise UserError(f"{what}: forced choice {clip(repr(k))} for `{clip(t)}`: it has alternatives "
                                    f"0..{n - 1}")
                cfg.forced[t] = k
                continue
            k = resolve_choice(t, k, self._alts(t, held_rules), self.producer, what)
            sigs = self._cur_sigs(t, held_rules)
            if not isinstance(k, int) or not 0 <= k < len(sigs):
                raise UserError(f"{what}: forced choice {clip(repr(k))} for `{clip(t)}`: it has alternatives "
                                f"0..{len(sigs) - 1}")
            cfg.forced[t] = self._stable(t).index(sigs[k])
        return cfg

    @_engine_thread
    def compare(self, a: dict | None = None, b: dict | None = None) -> dict:
        """A/B: spec `a` against spec `b` (None: the current configuration), each planned exactly: each side's
        launches, cost, arena and fusions, and what differs — the census and fusions that changed, the launches
        only one side has (by kind and the tensors they compute), launches per layer."""
        sides = []
        for name, spec in (("A", a), ("B", b)):
            cfg = self.cfg if spec is None else self._config_from(spec, f"spec {name}")
            p = self._plan_for(cfg, "ilp")
            sides.append((cfg, p))
        out = {}
        for name, (cfg, p) in zip("ab", sides):
            s = p.sched
            default = Knobs().to_json()
            out[name] = {"launches": s.n_launches, "cost_us": round(s.cost_us, 4), "arena": s.arena.bytes,
                         "lower_bound": s.arena.lower_bound, "census": dict(s.census), "fusions": dict(s.fusions),
                         "held": sorted(cfg.held_rules | cfg.held_steps), "forced": dict(sorted(cfg.forced.items())),
                         "knobs": {k: v for k, v in cfg.knobs.to_json().items() if default.get(k) != v},
                         "method": p.method, "per_layer": {str(k): v for k, v in sorted(s.per_layer().items())},
                         "current": (a if name == "a" else b) is None}
        ch = lambda x, y: {k: [x.get(k, 0), y.get(k, 0)] for k in sorted(set(x) | set(y))  # noqa: E731
                           if x.get(k, 0) != y.get(k, 0)}
        key = lambda x: (x.launch.census, tuple(x.ops))  # noqa: E731
        la = {key(x): (k, x) for k, x in enumerate(sides[0][1].sched.launches)}
        lb = {key(x): (k, x) for k, x in enumerate(sides[1][1].sched.launches)}
        only = lambda mine, other: [{"index": k, "launch": x.launch.census, "layer": x.layer, "cls": x.cls,  # noqa: E731
                                     "rule": x.rule, "tensors": list(x.ops), "cost_us": round(x.cost_us, 4)}
                                    for kk, (k, x) in sorted(mine.items(), key=lambda kv: kv[1][0]) if kk not in other]
        out["diff"] = {"launches": [out["a"]["launches"], out["b"]["launches"]],
                       "cost_us": [out["a"]["cost_us"], out["b"]["cost_us"]],
                       "arena": [out["a"]["arena"], out["b"]["arena"]],
                       "census": ch(out["a"]["census"], out["b"]["census"]),
                       "fusions": ch(out["a"]["fusions"], out["b"]["fusions"]),
                       "per_layer": ch(out["a"]["per_layer"], out["b"]["per_layer"]),
                       "only_a": only(la, lb), "only_b": only(lb, la), "same": len(set(la) & set(lb))}
        return out

    # ---- one launch ------------------------------------------------------------------------------------------------
    @_engine_thread
    def launch(self, index: int) -> dict:
        """Launch #index of the current plan: its kind's fields as planned, the CUDA functions it calls with grid
        and block and their source, bytes, flops, estimated µs, its numpy twins (lane/explore/launches.py)."""
        from lanefuse.lane.explore.launches import launch_detail

        n = len(self._cur.sched.launches)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
            raise UserError(f"launch {index!r}: the plan has launches 0..{n - 1}")
        return launch_detail(self._cur.sched.launches[index], index)

    # ---- saturation, step by step --------------------------------------------------------------------------------
    @_engine_thread
    def saturation(self) -> dict:
        """The saturation behind the current plan, iteration by iteration (each rule's matches, the e-graph's
        e-nodes after it), and per rule: its matches, how many of its fused ops the plan chose, and for a rule that
        matched but was not chosen (everywhere or somewhere), why — at one tensor it made an alternative for: the
        refusal and its reason, the held rule, or the cost comparison (the step's cost forced to it, against the
        plan's)."""
        p = self._cur
        sat = p.opt.summary.get("saturation", {})
        steps = [{"iteration": k + 1, **st, "rules": sorted(st["matches"], key=lambda r: -st["matches"][r])}
                 for k, st in enumerate(sat.get("steps", []))]
        chosen = p.opt.chosen
        made: dict[str, list[tuple[str, int, bool]]] = {}  # rule -> (tensor, stable index, chosen) it made
        for op in self.g.ops:
            t = op.out
            alts = self._alts(t, self.cfg.held_rules)
            for a in alts:
                if a.rule is not None:
                    k = self._stable(t).index(a.signature)
                    made.setdefault(a.rule, []).append((t, k, chosen.get(t) == a.index))
        rules = []
        for name in self.table.names:
            r = self.table.by_name[name]
            mine = made.get(name, [])
            out = {"name": name, "where": r.where, "cls": r.cls, "held": name in self.cfg.held_rules,
                   "matches": sat.get("matches", {}).get(name, 0), "fired": p.sched.fusions.get(name, 0),
                   "alternatives": len(mine), "chosen": sum(c for *_, c in mine), "why_not": None}
            if out["held"]:
                out["why_not"] = "held: the engine does not apply it"
            elif not out["matches"]:
                out["why_not"] = "its pattern matched nothing in this step"
            else:
                # a multi-output fusion's alternative at one of its outputs (the chain's GLU) is not the one chosen
                # there when the tensor is computed inside the launch the same rule made: not a loss
                lost = [(t, k) for t, k, c in mine if not c and getattr((self._owner(t) or (0, None))[1], "rule",
                                                                        None) != name]
                if lost:
                    t, k = lost[0]
                    out["why_not"] = self._why_not(t, k)
            rules.append(out)
        return {"iterations": steps, "stop": sat.get("stop", ""), "egraph": dict(p.opt.summary.get("egraph", {})),
                "method": p.method, "cost_us": round(p.engine_cost, 4), "rules": rules}

    def _why_not(self, t: str, k: int) -> dict:
        """Why the plan does not take alternative #k of `t`: one example of a rule's unchosen fused op."""
        c = self._alternative(self.cfg, t, k, plan_cost=True)
        step = self._cur.engine_cost
        got = next((x for x in self.choices(t) if x["chosen"]), None)
        if got is not None:
            instead = _what(got)
        else:
            own = self._owner(t)
            x = own[1] if own else None
            instead = (f"it computed inside launch #{own[0]} ({x.launch.census}, {x.cls or '?'}"
                       f"{' by `' + x.rule + '`' if x.rule else ''})") if x else "it computed inside a fused op"
        out = {"tensor": t, "index": k, "op": c["op"], "support": c["support"], "reason": c["reason"],
               "own_us": c["cost_us"], "plan_cost_us": c["plan_cost_us"], "step_us": round(step, 4),
               "instead": instead}
        if c["support"] in ("refuse", "held"):
            out["text"] = f"at {t} (#{k}): {c['support']}: {c['reason']}"
        elif c["plan_cost_us"] is None:
            out["text"] = f"at {t} (#{k}): no runnable plan takes it (a forced choice or a refusal conflicts)"
        else:
            d = c["plan_cost_us"] - step
            if abs(d) < 0.005:
                verdict = f"a tie at {step:.2f} µs with {instead}, broken by rank"
            elif d > 0:
                verdict = f"the step would cost {c['plan_cost_us']:.2f} µs with it ({d:+.2f} µs) against {step:.2f} µs " \
                          f"with {instead}"
            else:
                verdict = f"the step would cost {c['plan_cost_us']:.2f} µs with it ({d:+.2f} µs): cheaper, which the " \
                          f"{self._cur.method} search missed"
            why = f"; {c['reason']}" if c["support"] == "decompose" and c["reason"] else ""
            out["text"] = f"at {t} (#{k}): {verdict}{why}"
        return out

    # ---- alternatives ------------------------------------------------------------------------------------------
    @_engine_thread
    def choices(self, tensor: str) -> list[dict]:
        """`tensor`'s alternatives: the op or fused class, the rule that made it, its own cost (µs), its support
        (lifted, native, decompose, refuse, held) with the reason, the best whole-step cost if forced (the local
        search), and whether the plan chose it."""
        self._tensor(tensor)
        return [self._alternative(self.cfg, tensor, k, plan_cost=True) for k in range(len(self._stable(tensor)))]

    @_engine_thread
    def alternatives(self, tensor: str) -> list[dict]:
        """`choices` without the step's cost if forced (no search: what a static report can hold of every tensor)."""
        self._tensor(tensor)
        return [self._alternative(self.cfg, tensor, k) for k in range(len(self._stable(tensor)))]

    @_engine_thread
    def with_choices(self) -> list[dict]:
        """The tensors with more than one alternative, in step order: each with its layer, how many alternatives
        (those a held rule removed included) and the chosen one's label (None: computed inside a fused op)."""
        out = []
        chosen = self._cur.opt.chosen
        for op in self.g.ops:
            t = op.out
            n = len(self._stable(t))
            if n < 2:
                continue
            j = chosen.get(t)
            label = self._alts(t, self.cfg.held_rules)[j].label if j is not None else None
            out.append({"tensor": t, "layer": self.layer_of[t], "alternatives": n, "chosen": label,
                        "forced": t in self.cfg.forced})
        return out

    def _alternative(self, cfg: _Config, t: str, k: int, plan_cost: bool = False) -> dict:
        sig = self._stable(t)[k]
        cur = self._cur_sigs(t, cfg.held_rules)
        if sig not in cur:
            a = self._unheld(t, sig)
            d = self._describe(a, cfg) if a is not None else {"op": "?", "label": "?", "rule": None}
            d["also"] = [x for x in d.get("covers", []) if x != t]
            return {**d, "index": k, "cost_us": None, "support": "held", "reason": self._held_why(t, k, cfg),
                    "plan_cost_us": None, "chosen": False, "forced": cfg.forced.get(t) == k}
        j = cur.index(sig)
        d = self._describe(self._alts(t, cfg.held_rules)[j], cfg)
        d["also"] = [x for x in d.get("covers", []) if x != t]  # what else it computes: tells same-class ones apart
        p = self._cur if cfg is self.cfg else None
        chosen = p is not None and p.opt.chosen.get(t) == j
        out = {**d, "index": k, "chosen": chosen, "forced": cfg.forced.get(t) == k, "plan_cost_us": None}
        if plan_cost and out["support"] not in ("refuse", "input"):
            if chosen:
                out["plan_cost_us"] = round(p.engine_cost, 4)
            else:
                out["plan_cost_us"] = self._plan_cost(cfg, t, k)
        return out

    def _describe(self, a: Alternative, cfg: _Config) -> dict:
        """What alternative `a` is: label, op or class, rule, what it writes, reads and computes; its own cost and the
        lane's support for it (a class a held schedule step gates runs as its parts)."""
        out = {"label": a.label, "op": a.cls or a.label, "rule": a.rule}
        op = a.op
        if op is None:
            return {**out, "op": "input", "cost_us": 0.0, "support": "input", "reason": "a step input"}
        if a.output is not None:  # one output of a multi-output fused op: `op` is the op itself
            out["output"] = a.output
        v = self._own_cost(cfg, op)
        out["writes"] = list(op.outs)
        out["reads"] = [x for x in op.ins if x in self.producer]
        out["covers"] = [p.out for p in op.parts] if op.fused else [op.out]
        if isinstance(v, Refusal):
            entry = self.lane.support(op.cls) if op.fused else None
            table_says = entry is not None and entry.support == "refuse" and entry.reason
            return {**out, "cost_us": None, "support": "refuse", "reason": entry.reason if table_says else v.reason}
        out["cost_us"] = round(float(v), 4)
        if not op.fused:
            return {**out, "support": "lifted", "reason": None}
        entry = self.lane.support(op.cls)
        sup = entry.support
        gate = _gating_step(self.lane, op.cls, cfg.held_steps)
        if sup == "native" and gate is not None:
            return {**out, "support": "decompose",
                    "reason": f"the schedule step `{gate}` is held: the {self.lane.name} lane runs class `{op.cls}` "
                              f"as its parts' launches"}
        if sup == "decompose":
            return {**out, "support": "decompose",
                    "reason": entry.reason or entry.why or f"the {self.lane.name} lane runs class `{op.cls}` as its "
                                                          f"parts' launches"}
        return {**out, "support": sup, "reason": entry.reason or None if sup == "refuse" else None}

    def _held_why(self, t: str, k: int, cfg: _Config) -> str:
        a = self._unheld(t, self._stable(t)[k])
        rule = a.rule if a is not None else None
        if rule is None:
            return "the held rules do not make it"
        if rule in cfg.held_rules:
            return f"rule `{rule}` is held (release it to use this)"
        via = sorted(set(self.table.depends_on(rule)) & cfg.held_rules)
        if via:
            return f"rule `{rule}` builds on the held {', '.join(f'`{v}`' for v in via)} (release it to use this)"
        return f"the held rules ({', '.join(sorted(cfg.held_rules))}) leave it unmade"

    def _plan_cost(self, cfg: _Config, t: str, k: int) -> float | None:
        """The best whole-step cost (µs) with `t` forced to #k besides the current forces: the local search."""
        forced, _ = self._engine_forced(cfg)
        forced[t] = self._cur_sigs(t, cfg.held_rules).index(self._stable(t)[k])
        key = self._key(cfg, forced)
        if key not in self._plan_costs:
            hit = self._plans.get(key)
            if hit is not None:
                self._plan_costs[key] = hit.engine_cost
            else:
                try:
                    opt = self._extract(cfg, forced, "local")
                    self._plan_costs[key] = opt.cost
                except UserError:
                    self._plan_costs[key] = None
        v = self._plan_costs[key]
        return None if v is None else round(v, 4)

    def _owner(self, t: str) -> tuple[int, Launched] | None:
        """The launch of the current plan that computes `t`: (index, Launched)."""
        for n, x in enumerate(self._cur.sched.launches):
            if t in x.ops:
                return n, x
        return None

    @_engine_thread
    def why(self, tensor: str) -> str:
        """Why the plan computes `tensor` the way it does, and why not each other way, in words."""
        self._tensor(tensor)
        ch = self.choices(tensor)
        st = self._cur
        step = st.engine_cost
        lines = []
        chosen = next((c for c in ch if c["chosen"]), None)
        own = self._owner(tensor)
        where = ""
        if own is not None:
            n, x = own
            what = f"{x.cls} by `{x.rule}`" if x.rule else (x.cls or self.producer[tensor].kind)
            where = f"launch #{n} ({x.launch.census}, {what}, layer {x.layer})"
        if chosen is not None:
            forced = " — forced by you" if chosen["forced"] else ""
            lines.append(f"{tensor}: #{chosen['index']} {_what(chosen)}{forced}, own {_us(chosen['cost_us'])}; "
                         f"it runs in {where}." if where else f"{tensor}: #{chosen['index']} {_what(chosen)}{forced}.")
            lines.append(f"The step costs {step:.2f} µs with it ({st.method} extraction); the others:")
        else:
            lines.append(f"{tensor} is computed inside {where}, a fused op that does not write it: none of its own "
                         f"alternatives is chosen (forcing one makes the plan write it).")
            lines.append(f"The step costs {step:.2f} µs ({st.method} extraction); forced to each alternative:")
        for c in ch:
            if c is chosen:
                continue
            head = f"  #{c['index']} {_what(c)}: "
            if c["support"] == "held":
                lines.append(head + f"not made: {c['reason']}.")
            elif c["support"] == "refuse":
                lines.append(head + f"refused by the {self.lane.name} lane: {c['reason']}.")
            elif c["plan_cost_us"] is None:
                lines.append(head + "no runnable plan with it (it conflicts with a forced choice or a refusal).")
            else:
                d = c["plan_cost_us"] - step
                if d >= 0.005:
                    verdict = f"the step would cost {c['plan_cost_us']:.2f} µs (+{d:.2f} µs)"
                elif d <= -0.005 and tensor in self.cfg.forced:
                    verdict = f"the step would cost {c['plan_cost_us']:.2f} µs ({d:.2f} µs): cheaper than your force"
                elif d <= -0.005:
                    verdict = (f"the step would cost {c['plan_cost_us']:.2f} µs ({d:.2f} µs): cheaper than this plan, "
                               f"which the {st.method} search missed (`plan exact` re-plans exactly)")
                else:
                    verdict = f"the step would cost the same {c['plan_cost_us']:.2f} µs: a tie, broken by rank"
                extra = f"; {c['reason']}" if c["support"] == "decompose" and c["reason"] else ""
                lines.append(head + f"own {_us(c['cost_us'])}; {verdict}{extra}.")
        for w in st.warnings:
            lines.append(f"note: {w}")
        return "\n".join(lines)

    # ---- the state (the page's JSON) -------------------------------------------------------------------------------
    @_engine_thread
    def state(self, layer: int | None = None) -> dict:
        if layer is not None:
            if isinstance(layer, bool) or not 0 <= int(layer) < self.layers:
                raise UserError(f"layer {layer} is out of range: the model has layers 0..{self.layers - 1}")
            self.layer = int(layer)
        n = self.layer
        p = self._cur
        sched = p.sched
        ops = [op for op in self.g.ops if self.layer_of[op.out] == n]
        mine = {op.out for op in ops}
        groups, gid, idx = [], {}, []
        for k, x in enumerate(sched.launches):
            if not mine.intersection(x.ops):
                continue
            cls = x.cls or (self.producer[x.ops[0]].kind if x.ops and x.ops[0] in self.producer else None)
            g = {"id": len(groups), "launch": x.launch.census, "cls": cls, "rule": x.rule, "tensors": list(x.ops),
                 "layer": x.layer, "index": k, "cost_us": round(x.cost_us, 4)}
            for t in x.ops:
                gid.setdefault(t, g["id"])
            groups.append(g)
            idx.append(k)
        nodes = [{"id": op.out, "op": op.kind, "shape": list(self.g.shape(op.out)), "group": gid.get(op.out)}
                 for op in ops]
        edges = [[i, op.out] for op in ops for i in dict.fromkeys(op.ins)]
        inputs = sorted({i for op in ops for i in op.ins if i not in mine})
        s = _summary(p)
        rules = []
        for name in self.table.names:
            r = self.table.by_name[name]
            rules.append({"name": name, "cls": r.cls, "why": r.why, "where": r.where,
                          "held": name in self.cfg.held_rules, "fired": sched.fusions.get(name, 0),
                          "depends_on": self.table.depends_on(name), **self.rule_source(name)})
        if p.shaped is None:
            p.shaped = _steps_fired(sched, self.lane)
        for name, why in self.steps.items():
            rules.append({"name": name, "cls": "lane step", "why": why,
                          "where": self.lane.source, "held": name in self.cfg.held_steps,
                          "fired": p.shaped.get(name, 0), "depends_on": [], **self.rule_source(name)})
        return {"model": self.model, "lane": self.lane.name, "numerics": self.numerics, "rows": int(self.g.meta.get("rows", 1)),
                "layers": self.layers, "layer": n,
                "graph": {"nodes": nodes, "edges": edges, "inputs": inputs},
                "groups": groups, "rules": rules, "held": self.held, "knobs": self.cfg.knobs.to_json(),
                "forced": self.forced, "census": s["census"], "launches": s["launches"], "cost_us": s["cost_us"],
                "fusions": s["fusions"], "arena": _arena_window(sched, idx), "diff": self.diff(),
                "warnings": list(p.warnings), "method": p.method, "what_if": self.what_if,
                "ms": round(self.last_ms, 1), "history": self.history(), "step": self._step_map(p)}

    def _step_map(self, p: _Plan) -> dict:
        """The whole step at a glance (the page's mini-map and search): every launch with the layer whose view
        shows it — the plan's layer of it (the one `lanefuse plan --layer N`, the launch panel and the report count it
        in) where that view shows it, else its first tensor's (a fold of one layer's last add and the next one's norm
        is the next layer's launch, shown in both views) — kind, class, rule and tensors; and each tensor's layer."""
        if p.step_map is None:
            launches = []
            for k, x in enumerate(p.sched.launches):
                view = self.layer_of.get(x.ops[0], self.layers - 1) if x.ops else self.layers - 1
                if x.layer >= 0 and any(self.layer_of.get(t) == x.layer for t in x.ops):
                    view = x.layer
                launches.append({"index": k, "launch": x.launch.census, "layer": view, "plan_layer": x.layer,
                                 "cls": x.cls, "rule": x.rule, "tensors": list(x.ops)})
            p.step_map = {"launches": launches, "tensor_layer": dict(self.layer_of)}
        return p.step_map


# ---- helpers ---------------------------------------------------------------------------------------------------------
def _summary(p: _Plan) -> dict:
    s = p.sched
    return {"census": dict(s.census), "launches": s.n_launches, "cost_us": round(s.cost_us, 4),
            "fusions": dict(s.fusions), "arena": s.arena.bytes}


def _arena_window(sched: Plan, idx: list[int]) -> dict:
    """The whole step's arena bytes and bound, and the arrays alive during one layer's launches (`idx`, the global
    launch indices), their lifetimes renumbered to the layer's launches 0..len(idx)-1."""
    import bisect

    arrays = []
    if idx:
        lo, hi = idx[0], idx[-1]
        for a in sched.arena.arrays:
            if a.last < lo or a.first > hi:
                continue
            f = bisect.bisect_left(idx, a.first)
            l = bisect.bisect_right(idx, a.last) - 1
            if f > l:
                continue
            arrays.append({"name": a.name, "offset": a.offset, "bytes": a.bytes, "first": f, "last": l})
    return {"bytes": sched.arena.bytes, "lower_bound": sched.arena.lower_bound, "launches": len(idx),
            "arrays": arrays}


def _gating_step(lane: LaneTable, cls: str | None, held_steps) -> str | None:
    """The held schedule step that runs class `cls` as its parts (the lane table's `decompose:` of the step)."""
    return next((h for h in sorted(held_steps) if cls in lane.gated.get(h, ())), None)


def _steps_fired(sched: Plan, lane: LaneTable) -> dict[str, int]:
    """How many launches each schedule step of the lane shaped (none for a held one): a step some launch kind's
    `tune` honours shaped a launch where tuning it with that step held too gives another launch; a step that runs
    classes as their parts when held (its `decompose:` in the lane table) shaped each launch of those classes."""
    held = frozenset(h for h in sched.held if h in lane.schedule)
    out = dict.fromkeys(lane.schedule, 0)
    for x in sched.launches:
        l = x.launch
        base = None
        for step in out:
            if step in held:
                continue
            if x.cls in lane.gated.get(step, ()):
                out[step] += 1
                continue
            if base is None:
                base = l.tune(sched.knobs, held)
            if l.tune(sched.knobs, held | {step}) != base:
                out[step] += 1
    return out


def _yaml_entry(file: str, line: int) -> str | None:
    """The YAML entry that starts at `line` of `file` (a rules file: the lines up to the next entry of its list)."""
    import importlib.resources
    import os

    path = file
    if not os.path.isfile(path) and file.startswith("rules/"):  # a built-in table: the package's own copy
        path = str(importlib.resources.files("lanefuse.rules").joinpath(file[len("rules/"):]))
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    if not 1 <= line <= len(lines):
        return None
    first = lines[line - 1]
    indent = len(first) - len(first.lstrip())
    out = [first]
    for text in lines[line:]:
        stripped = text.lstrip()
        if stripped.startswith("- ") and len(text) - len(stripped) <= indent:
            break
        if stripped and len(text) - len(stripped) < indent:
            break
        out.append(text)
    while out and not out[-1].strip():
        out.pop()
    return "\n".join(out)


def _what(c: dict) -> str:
    if c["support"] == "lifted":
        return f"{c['op']} (the lifted op)"
    out = f" output {c['output']}" if "output" in c else ""
    rule = f" by `{c['rule']}`" if c.get("rule") and c["rule"] != c["op"] else ""
    writes = f" writing {', '.join(c['writes'])}" if len(c.get("writes", [])) > 1 else ""
    return f"{c['op']}{rule}{out}{writes}"


def _us(v) -> str:
    return "∞ (refused)" if v is None else f"{v:.2f} µs"
