"""Plans as step functions for generation: each step graph (a decode step, a prefill chunk of R rows) planned once
and run by the chosen backend (numpy on the CPU; CuPy on a CUDA device)."""

from __future__ import annotations

import os

from lanefuse.engine.errors import UserError


def has_cuda() -> bool:
    try:
        import cupy  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver or no device: the CPU path
        return False


def pick_device(device: str) -> str:
    if device == "cpu":
        return "cpu"
    if device == "gpu":
        if not has_cuda():
            raise UserError("--device gpu: no CUDA device (or CuPy) is available here; use --device cpu")
        return "gpu"
    return "gpu" if has_cuda() else "cpu"


def plan_options(args) -> dict:
    """What `plan()` takes from the command's flags and an optional plan file (--spec)."""
    from lanefuse.lane.lower.knobs import parse_knobs
    from lanefuse.lane.lower.spec import load_spec

    opts = {"lane": "cuda", "numerics": "f32", "held": [], "knobs": {}, "forced": {}}
    if getattr(args, "spec", None):
        opts.update(load_spec(args.spec))
    if getattr(args, "lane", None):
        opts["lane"] = args.lane
    if getattr(args, "numerics", None):
        opts["numerics"] = args.numerics
    opts["held"] = list(dict.fromkeys(list(opts["held"]) + list(getattr(args, "hold", []) or [])))
    knobs = parse_knobs(opts["knobs"])
    opts["knobs"] = parse_knobs(getattr(args, "knob", []) or [], knobs)
    rules = list(getattr(args, "rules", []) or [])
    opts["rules_dirs"] = rules
    return opts


def make_runner(schedule, weights, device: str, state=None):
    if device == "gpu":
        from lanefuse.lane.run.cupy_runner import CupyRunner

        return CupyRunner(schedule, weights, state)
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    return NumpyRunner(schedule, weights)


def plan_step_fn(args, src):
    """A step function for `generate`: plans each step graph once (or loads a saved plan) and runs it."""
    from lanefuse.lane.lower.plan import plan

    device = pick_device(getattr(args, "device", "auto"))
    runners: dict[int, object] = {}
    saved = None
    if getattr(args, "plan", None):
        from lanefuse.lane.lower.planfile import load

        saved = load(args.plan)
    opts = None if saved is not None else plan_options(args)
    state = None
    if device == "gpu":
        from lanefuse.lane.run.cupy_runner import DeviceState

        state = DeviceState()  # the caches and weights every plan of this model shares on the device

    def step_fn(g, env):
        rows = int(g.meta.get("rows", 1))
        r = runners.get(rows)
        if r is None:
            if saved is not None:
                if saved.rows != rows:
                    raise UserError(f"{args.plan}: the plan is a step of {saved.rows} rows; this step has {rows} "
                                    f"(save a decode plan and prefill with --rows, or run without --plan)")
                s = saved
            else:
                s = plan(g, lane=opts["lane"], numerics=opts["numerics"], knobs=opts["knobs"], held=opts["held"],
                         rules_dirs=opts["rules_dirs"], forced=opts["forced"] or None)
            r = runners[rows] = make_runner(s, src.weights, device, state)
        return r.step(env, lifted=g)

    label = f"fused plan, {'CuPy' if device == 'gpu' else 'numpy'} backend"
    if os.environ.get("LANEFUSE_CHECK") == "2":
        label += ", checked launch by launch"
    return step_fn, label
