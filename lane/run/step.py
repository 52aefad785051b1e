"""Plans as step functions for generation: each step graph (a decode step, a prefill chunk of R rows) planned once
and run by the chosen backend (numpy on the CPU; CuPy on a CUDA device)."""

from __future__ import annotations

import time

from lanefuse.engine.errors import UserError
from lanefuse.lane.lower.plan import PlanOptions


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


def make_runner(p, weights, device: str, state=None, check: bool = False, exact: bool = False, shared=None):
    """The runner of plan `p` on `device` (gpu or cpu); on the CPU the fast numpy runner (f32 BLAS on weights decoded
    once), or the exact twins where `exact` or `check` (which runs the reference beside each numpy step). `shared`
    (cpu) / `state.arena` (gpu): the arena the model's forms share."""
    if device == "gpu":
        from lanefuse.lane.run.cupy_runner import CupyRunner

        return CupyRunner(p, weights, state)
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    return NumpyRunner(p, weights, check=check, exact=exact or check, shared=shared)


def check_saved(p, path: str, g, weights) -> None:
    """A saved plan against what it runs on: the step's inputs and outputs shaped as this model's step graph `g`
    has them, its constants as the checkpoint holds them."""
    from lanefuse.lane.run.constants import check_constants

    for n in (*p.io.inputs, *p.io.outputs):
        if n not in g.tensors:
            raise UserError(f"{path}: io: `{n}` is not a tensor of this model's step")
    for n, t in p.tensors.items():  # the step's own tensors (the fused ones are tied to them by their launches' sizes)
        want = g.tensors.get(n)
        if want is not None and tuple(t.shape) != tuple(want.shape):
            raise UserError(f"{path}: tensors[{n!r}].shape: {list(t.shape)} but this model's step has "
                            f"{list(want.shape)}")
    try:
        check_constants(p, weights)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None


def plan_step_fn(weights, device: str = "auto", options: PlanOptions | None = None, saved=None,
                 saved_path: str = "", check: bool = False, exact: bool = False, sampling=None):
    """A step function for `generate`: plans each step graph once under `options` (or runs the `saved` plan, read
    from `saved_path`) on the chosen backend; and its label. `check` runs the reference beside each numpy step.
    `sampling` (a lane.run.sampling.Sampling that is not greedy): each plan closes its step with the `sample` launch
    in the arg-max's place (`with_sampling`), its parameter words the step input `sampling` (`step_fn.sampling`)."""
    from lanefuse.lane.lower.plan import plan

    device = pick_device(device)
    runners: dict[tuple[int, int], object] = {}
    drawn = sampling if sampling is not None and not sampling.greedy else None  # sampled: the plans draw
    if drawn is not None:
        from lanefuse.lane.run.sampling import with_sampling
    state = batch_state = shared = None
    if device == "gpu":
        from lanefuse.lane.run.cupy_runner import DeviceState, holder, slot_copier

        state = DeviceState()  # the caches, weights and arena every plan of this model shares on the device
        batch_state = DeviceState("batch.")  # a batch step's caches (each sequence's slot), the same weights, arena
        batch_state.weights = state.weights
        batch_state.arena = state.arena
    else:
        from lanefuse.lane.run.numpy_runner import SharedArena

        shared = SharedArena()  # the one arena buffer the model's forms share, one form running at a time

    plans: dict[tuple[int, int], object] = {}

    def planned(g):
        """Step graph `g`'s form key (rows, batch) and its plan, made once (a batch step of B rows is not a prefill
        chunk of B)."""
        rows = int(g.meta.get("rows", 1))
        key = (rows, int(g.meta.get("batch", 1)))
        s = plans.get(key)
        if s is None:
            if saved is not None:
                if saved.rows != rows:
                    raise UserError(f"{saved_path}: the plan is a step of {saved.rows} rows; this step has {rows} "
                                    f"(save a decode plan and prefill with --rows, or run without --plan)")
                check_saved(saved, saved_path, g, weights)
                s = saved
            else:
                t0 = time.perf_counter()
                s = plan(g, options)
                spent["plan_s"] += time.perf_counter() - t0
            if drawn is not None:  # sampled: the draw launch closes the step
                s = with_sampling(s)
            plans[key] = s
        return key, s

    def runner(g):
        key, s = planned(g)
        r = runners.get(key)
        if r is None:
            t0 = time.perf_counter()
            r = runners[key] = make_runner(s, weights, device, batch_state if key[1] > 1 else state, check, exact,
                                           shared)
            spent["setup_s"] += time.perf_counter() - t0
        return r

    def step_fn(g, env):
        r = runner(g)
        bound = getattr(r, "bind_s", 0.0)
        out = r.step(env, lifted=g)
        spent["setup_s"] += getattr(r, "bind_s", 0.0) - bound  # the fast runner's first binding reads the weights
        return out

    step_fn.runners = runners  # the forms made so far, (rows, batch) -> runner: they share one arena
    step_fn.sampling = drawn  # the launch draws each token (the caller passes its `sampling` words)
    if shared is not None:
        step_fn.hold = shared.hold  # the caches and states in that arena buffer, before its forms' arrays
        step_fn.shared = shared
    spent = step_fn.spent = {"plan_s": 0.0, "setup_s": 0.0}  # seconds planning, setting up runners: `run`'s timings

    if device == "gpu":
        def decode(g, env, n: int, logits: bool = True, eos=(), on_chunk=None):
            """`n` decode steps of step graph `g` (a decode step, or a batch's) from `env`'s token and position, run
            back to back on the device, the host reading the tokens (and logits) once a chunk (CupyRunner.decode_run):
            the tokens (steps, rows) and the logits (steps, rows·vocab)."""
            return runner(g).decode_run(n, inputs=env, logits=logits, eos=eos, on_chunk=on_chunk)

        step_fn.decode = decode

        step_fn.to_slot = slot_copier(state, batch_state)
        step_fn.hold = holder(state, batch_state)  # the run's tables in the arena before its first form

        def reserve(graphs) -> None:
            """Room in the one device allocation for the largest of these step graphs' forms, before any runner
            takes it (a runner's captured graph keeps the allocation it was made with): a run's forms are not
            largest at its widest chunk where a decode step chains its layer (the chain's attention partials and
            counters), so a run reserves its forms' room up front and every form shares the first allocation."""
            if saved is None and graphs:
                state.arena.fit(max(planned(g)[1].arena.bytes for g in graphs), runner=False)

        step_fn.reserve = reserve

    label = f"fused plan, {'CuPy' if device == 'gpu' else 'numpy'} backend"
    if check and device == "cpu":
        label += ", checked launch by launch"
    elif exact and device == "cpu":
        label += ", exact twins"
    return step_fn, label
