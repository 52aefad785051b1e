"""The command's plan flags (--lane, --numerics, --hold, --rules, --knob, --spec) as `PlanOptions`: the one place
that reads them; everything below takes the options."""

from __future__ import annotations

from lanefuse.lane.lower.knobs import parse_knobs
from lanefuse.lane.lower.plan import PlanOptions
from lanefuse.lane.lower.spec import load_spec


def plan_options(args) -> PlanOptions:
    """What `plan()` takes from the command's flags over an optional plan file (--spec): flags win, held rules
    add up."""
    spec = load_spec(args.spec) if getattr(args, "spec", None) else {}
    knobs = parse_knobs(getattr(args, "knob", None) or [], parse_knobs(spec.get("knobs", {})))
    held = list(spec.get("held", [])) + list(getattr(args, "hold", None) or [])
    return PlanOptions(lane=getattr(args, "lane", None) or spec.get("lane") or "cuda",
                       numerics=getattr(args, "numerics", None) or spec.get("numerics") or "f32",
                       knobs=knobs, held=tuple(held), rules_dirs=tuple(getattr(args, "rules", None) or ()),
                       forced=spec.get("forced") or {})
