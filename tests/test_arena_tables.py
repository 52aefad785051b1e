"""The caches and carried states inside the one arena a model's forms share (seed 003, issue 40): placed first, each
at the offset `place_tables` gives it (the forms' figure's `Forms.tables`), the forms' step-local arrays from `base`
past them — in the numpy runner's buffer and in the CuPy runner's device allocation (the stand-in cupy of
tests/test_cupy_runner_mock.py). A batch's slots' tables likewise, each prompt's prefill writing straight into its
slot's rows there. The weights stay in allocations of their own (lane/run/cupy_runner.py says why)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lanefuse.engine.front.demo import demo_model
from lanefuse.engine.interp import evaluate
from lanefuse.engine.front.model import build_step
from lanefuse.lane.lower.arena import aligned, place_tables
from lanefuse.lane.lower.buffers import forms_of, tables_of
from lanefuse.lane.lower.plan import plan
from lanefuse.lane.run.batch import generate_batch
from lanefuse.lane.run.generate import generate, new_caches
from lanefuse.lane.run.numpy_runner import NumpyRunner, SharedArena
from lanefuse.lane.run.step import plan_step_fn

PROMPT = [5, 3, 9, 1, 4, 1, 5, 9, 2]
PROMPTS = [PROMPT, [7, 1], [3, 3, 3, 3, 3, 3], [11]]


def _at(a: np.ndarray, buf: np.ndarray) -> int:
    """The byte offset of array `a` in buffer `buf` (which must hold it)."""
    assert np.shares_memory(a, buf)
    return a.__array_interface__["data"][0] - buf.__array_interface__["data"][0]


def _no_overlap(shared, runners) -> None:
    """Every table inside [0, base), side by side; every form's step-local part from `base`, inside the buffer."""
    spans = sorted((off, off + aligned(n)) for off, n in shared.placed.values())
    assert spans[0][0] == 0 and all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= shared.base
    for r in runners:
        lo = _at(r.env.arena, shared.buf)
        assert lo == shared.base and lo + r.env.need <= shared.buf.size
        for name, p in r.s.arena.by_name().items():
            assert shared.base <= shared.base + p.offset and shared.base + p.offset + p.bytes <= shared.buf.size


@pytest.mark.parametrize("exact", [True, False])
def test_generate_holds_its_caches_in_the_arena_at_the_forms_offsets(exact):
    cfg, w = demo_model(64)
    fn, _ = plan_step_fn(w, device="cpu", exact=exact)
    out = generate(cfg, w, PROMPT, 5, step_fn=fn, chunk=4)
    ref = generate(cfg, w, PROMPT, 5, chunk=4)  # the reference interpreter, caches of its own
    assert out.generated_ids == ref.generated_ids
    shared = fn.shared
    f = forms_of({k: r.s for k, r in fn.runners.items()})
    assert {n: (o, b) for n, (o, b) in shared.placed.items()} == f.tables and shared.base == f.base
    _no_overlap(shared, fn.runners.values())
    for r in fn.runners.values():  # each step read and wrote the caches in place, at their offsets in the buffer
        for n, t in r.env.tables.items():
            assert _at(t, shared.buf) == f.tables[n][0]
    # what the run left in the caches is the reference's: the rows of the prompt and of the tokens it took
    env = new_caches(cfg)
    rows = len(PROMPT) + 4
    for c in range(0, len(PROMPT), 4):
        evaluate(build_step(cfg, len(PROMPT[c:c + 4])), w, {**env, "token": np.array(PROMPT[c:c + 4], np.int32),
                                                            "pos": np.array([c], np.int32)})
    for i, t in enumerate(out.generated_ids[:-1]):
        evaluate(build_step(cfg, 1), w, {**env, "token": np.array([t], np.int32),
                                         "pos": np.array([len(PROMPT) + i], np.int32)})
    for n in env:
        got = shared.table(n)[:rows]
        assert np.abs(got - env[n][:rows]).max() <= (0 if exact else 1e-5) * max(1.0, np.abs(env[n]).max()), n
        assert not shared.table(n)[rows:].any()  # nothing past them


def test_the_step_local_part_filled_with_nan_leaves_the_caches_whole():
    """Each step's arrays overlay each other from `base`, never the tables: NaN bytes over all of [base, end) before
    every step change no token, and the tables hold no NaN."""
    cfg, w = demo_model(64)
    fn, _ = plan_step_fn(w, device="cpu", exact=True)

    def step(g, env):
        if fn.runners:
            sh = fn.shared
            sh.buf[sh.base:] = 0xFF
        return fn(g, env)

    step.hold = fn.hold
    out = generate(cfg, w, PROMPT, 5, step_fn=step, chunk=4)
    assert out.generated_ids == generate(cfg, w, PROMPT, 5, chunk=4).generated_ids
    assert all(np.isfinite(fn.shared.table(n)).all() for n in fn.shared.placed)


def test_a_form_made_after_the_caches_grows_the_buffer_and_keeps_them():
    """The decode step first, a wider chunk after it: the buffer grows past the tables, their bytes move with them,
    and a step given the views taken before the growth reads and writes them in the new buffer."""
    cfg, w = demo_model(64)
    shared = SharedArena()
    caches = shared.hold(cfg.carried())
    small = NumpyRunner(plan(build_step(cfg, 1)), w, exact=True, shared=shared)
    env = dict(caches)  # views taken now
    ref_env = {n: np.zeros_like(t) for n, t in env.items()}
    out = small.step({**env, "token": np.array([4], np.int32), "pos": np.array([0], np.int32)})
    evaluate(build_step(cfg, 1), w, {**ref_env, "token": np.array([4], np.int32), "pos": np.array([0], np.int32)})
    old, version = shared.buf, shared.version
    big = NumpyRunner(plan(build_step(cfg, 9)), w, exact=True, shared=shared)
    assert shared.version == version + 1 and shared.buf is not old
    assert shared.buf.size == shared.base + big.env.need
    toks = np.array(PROMPT, np.int32)
    out = big.step({**env, "token": toks, "pos": np.array([1], np.int32)})  # the views into the old buffer
    ref = evaluate(build_step(cfg, 9), w, {**ref_env, "token": toks, "pos": np.array([1], np.int32)})
    assert np.array_equal(out["logits"], np.asarray(ref["logits"]).reshape(out["logits"].shape))
    for n, t in big.env.tables.items():
        assert _at(t, shared.buf) == shared.placed[n][0]
        assert np.array_equal(caches[n], ref_env[n])  # the held mapping gives the new buffer's bytes


@pytest.mark.parametrize("slots", [2, 3])
def test_a_batch_holds_its_slots_in_the_arena_and_prefills_into_them(slots):
    cfg, w = demo_model(64)
    fn, _ = plan_step_fn(w, device="cpu", exact=True)
    seen = []  # (rows, batch, each table's byte offset in the buffer)

    def step(g, env):
        out = fn(g, env)
        r = fn.runners[(int(g.meta["rows"]), int(g.meta.get("batch", 1)))]
        seen.append((r.s.rows, r.s.batch, {n: _at(t, fn.shared.buf) for n, t in r.env.tables.items()}))
        return out

    step.hold = fn.hold
    got = generate_batch(cfg, w, PROMPTS, 4, slots, step_fn=step, chunk=4)
    want = [generate(cfg, w, p, 4, chunk=4).generated_ids for p in PROMPTS]
    assert [r.generated_ids for r in got] == want
    shared = fn.shared
    one = {n: int(np.prod(s)) * 4 for n, s in cfg.carried().items()}
    at, base = place_tables({n: slots * b for n, b in one.items()})
    assert shared.placed == at and shared.base == base
    _no_overlap(shared, fn.runners.values())
    prefills = [t for rows, batch, t in seen if batch == 1]
    assert len(prefills) >= len(PROMPTS)
    for tabs in prefills:  # each prefill wrote into one slot's rows of the batch's tables, in the buffer
        slot = {(o - at[n][0]) // one[n] for n, o in tabs.items()}
        assert len(slot) == 1 and 0 <= slot.pop() < slots
        assert all((o - at[n][0]) % one[n] == 0 for n, o in tabs.items())
    assert {(o, b) for rows, b, tabs in seen if b > 1 for o in [tuple(tabs.values())]} == \
        {(tuple(at[n][0] for n in tabs), slots) for rows, b, tabs in seen if b > 1}


# -- the CuPy runner's allocation (the stand-in cupy) ----------------------------------------------------------------

@pytest.fixture
def stand_in(monkeypatch):
    import test_cupy_runner_mock as mock

    mock.fake_cupy.__wrapped__(monkeypatch)
    import lanefuse.lane.run.step as step

    monkeypatch.setattr(step, "pick_device", lambda d: "gpu")
    return sys.modules["cupy"]


def _dev_at(a, buf) -> int:
    return a.ctypes.data - buf.ctypes.data


def test_device_caches_and_forms_in_one_allocation(stand_in):
    cfg, w = demo_model(64)
    fn, label = plan_step_fn(w, "gpu")
    out = generate(cfg, w, PROMPT, 5, step_fn=fn, chunk=4)
    assert out.generated_ids == generate(cfg, w, PROMPT, 5, chunk=4).generated_ids
    r = fn.runners[(4, 1)]
    a = r.state.arena
    f = forms_of({k: x.s for k, x in fn.runners.items()})
    assert a.base == f.base and a.buf.size == f.bytes  # the tables, then the largest form's arrays
    for n, (off, nbytes) in f.tables.items():
        assert _dev_at(r.state.tables[n], a.buf) == off and r.state.tables[n].nbytes == nbytes
    for x in fn.runners.values():  # every form's step-local part from `base` of the one allocation
        assert _dev_at(x.env.arena, a.buf) == a.base
        for n, v in x.env.views.items():
            b = x.s.buffers.get(n)
            if b is not None and b.where == "table":
                assert _dev_at(v, a.buf) == f.tables[b.home][0] + 4 * b.offset


@pytest.mark.parametrize("slots", [2, 3])
def test_device_batch_slots_beside_the_one_sequence_tables(stand_in, slots):
    """generate_batch holds the slots' tables (and the one sequence's its prefills write, copied to a slot) before
    any form: the run's forms, one sequence's and the batch's, take the one allocation."""
    cfg, w = demo_model(64)
    fn, _ = plan_step_fn(w, "gpu")
    got = generate_batch(cfg, w, PROMPTS, 4, slots, step_fn=fn, chunk=4)
    assert [r.generated_ids for r in got] == [generate(cfg, w, p, 4, chunk=4).generated_ids for p in PROMPTS]
    one = fn.runners[(4, 1)].state
    batch = next(x for k, x in fn.runners.items() if k[1] == slots).state
    a = one.arena
    assert batch.arena is a
    bufs = {x.env.arena.ctypes.data for x in fn.runners.values()}
    assert bufs == {a.buf.ctypes.data + a.base}  # every form in the one allocation
    sizes = {n: 4 * int(np.prod(s)) for n, s in cfg.carried().items()}
    at, base = place_tables({**sizes, **{"batch." + n: slots * b for n, b in sizes.items()}})
    assert a.base == base
    for n in sizes:
        assert _dev_at(one.tables[n], a.buf) == at[n][0]
        assert _dev_at(batch.tables[n], a.buf) == at["batch." + n][0]
        assert batch.tables[n].size == slots * one.tables[n].size


def test_device_runners_without_held_tables_place_them_at_their_first_form(stand_in):
    """Runners made directly (no `hold`): the first places the caches in the allocation it makes; a form made after
    a runner used it and larger than its room takes a new one for its arrays alone, the caches staying where the
    first runners read them."""
    from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState

    cfg, w = demo_model(64)
    state = DeviceState()
    small = CupyRunner(plan(build_step(cfg, 1)), w, state)
    first = state.arena.buf
    kc0 = state.tables["kc0"]
    assert _dev_at(kc0, first) == place_tables(tables_of(small.s.buffers))[0]["kc0"][0]
    big = CupyRunner(plan(build_step(cfg, 9)), w, state)
    assert state.arena.buf is not first and state.tables["kc0"] is kc0  # the caches stayed
    assert not np.shares_memory(big.env.arena, kc0)
    cpu = {r: NumpyRunner(plan(build_step(cfg, r)), w) for r in (1, 9)}
    gpu = {1: small, 9: big}
    a = generate(cfg, w, PROMPT, 5, step_fn=lambda g, env: gpu[g.meta["rows"]].step(env), chunk=9)
    b = generate(cfg, w, PROMPT, 5, step_fn=lambda g, env: cpu[g.meta["rows"]].step(env), chunk=9)
    assert a.generated_ids == b.generated_ids


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(["kc0", "vc0", "kc1", "vc1", "conv0", "state0"]),
                       st.tuples(st.integers(1, 9), st.integers(1, 13)), min_size=1, max_size=6),
       st.lists(st.integers(0, 5000), min_size=1, max_size=6))
def test_held_tables_keep_their_bytes_and_offsets_as_forms_grow_the_buffer(shapes, rooms):
    """Tables held, then forms of random step-local sizes fitted in turn: the tables stay at place_tables' offsets
    with the values written into them (through views taken before any growth, read in the buffer at the next step),
    and the step-local part past them is as large as the largest form."""
    shared = SharedArena()
    held = shared.hold(shapes)
    at, base = place_tables({n: 4 * a * b for n, (a, b) in shapes.items()})
    rng = np.random.default_rng(len(shapes))
    want = {}
    for n in shapes:
        want[n] = rng.standard_normal(shapes[n]).astype(np.float32)
        held[n][...] = want[n]
    largest = 0
    for room in rooms:
        largest = max(largest, room)
        old = {n: held[n] for n in shapes}  # views taken before this form's growth
        shared.fit(room)
        for n in shapes:  # a step given the old views reads the same bytes in the buffer as it is now
            now = shared.inside(old[n])
            assert _at(now, shared.buf) == at[n][0] and np.array_equal(now, want[n])
        shared.moved = None  # what a step does once it has taken them
        assert shared.placed == at and shared.base == base and shared.buf.size == base + largest
        for n in shapes:
            assert np.array_equal(held[n], want[n]) and _at(held[n], shared.buf) == at[n][0]
        shared.buf[shared.base:] = 0xFF  # a form's arrays overwrite all of the step-local part
        assert all(np.array_equal(held[n], want[n]) for n in shapes)
