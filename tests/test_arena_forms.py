"""A model's forms in one arena (seed 003: "The forms share the arena, one form running at a time"), and the check
that every step-local array is written whole before any launch reads it (lifetimes from the launch that first writes
it). The numpy backend runs each form inside the one shared buffer, filled with NaN bytes before every step, and
equals the reference interpreter exactly: nothing a step reads of the arena was left by another form or step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lanefuse.engine.front.demo import demo_model
from lanefuse.engine.errors import UserError
from lanefuse.engine.interp import evaluate
from lanefuse.engine.front.model import build_step
from lanefuse.engine.formats.quantize import with_numerics
from lanefuse.kernels.common import Dst, Launch, Part
from lanefuse.lane.lower.arena import Arena, aligned, share
from lanefuse.lane.lower.buffers import Buffer, NotWritten, forms_of, lifetimes, tables_of, walk
from lanefuse.lane.lower.plan import plan
from lanefuse.lane.lower.plancheck import check
from lanefuse.lane.run.numpy_runner import NumpyRunner, SharedArena

FORMS = {"chunk 13": (13, 1), "chunk 5": (5, 1), "decode": (1, 1), "batch 3": (1, 3)}


def _inputs(cfg, g, pos, seed):
    rng = np.random.default_rng(seed)
    env = {}
    for k, v in g.io.caches:  # caches with values in them: the step reads rows it did not write
        for n in (k, v):
            env[n] = (0.5 * rng.standard_normal(g.tensors[n].shape)).astype(np.float32)
    rows = g.tensors[g.io.token].shape[0]
    env["token"] = rng.integers(0, cfg.vocab, rows).astype(np.int32)
    env["pos"] = np.full(g.tensors["pos"].shape, pos, np.int32)
    return env


@pytest.mark.parametrize("numerics, fmt", [("f32", None), ("f32", "bf16"), ("q8x2", "q8_0"), ("q8", "q8_0")])
def test_every_form_in_the_shared_arena_equals_the_reference(numerics, fmt):
    from test_quant import q8_model

    cfg, w = demo_model(64) if fmt is None else q8_model(fmt, 64)
    graphs = {k: build_step(cfg, r, b) for k, (r, b) in FORMS.items()}
    plans = {k: plan(g, numerics=numerics) for k, g in graphs.items()}
    for p in plans.values():
        check(p)
        # under q8 / q8x2 the products' quantized activations live in the arena too
        assert any(b.where == "arena" and b.dtype in ("q8", "q8x2") for b in p.buffers.values()) == (numerics != "f32")
    shared = SharedArena()
    runners = {k: NumpyRunner(p, w, exact=True, shared=shared) for k, p in plans.items()}
    assert shared.buf.size == max(r.env.need for r in runners.values())  # one buffer, the largest form's
    assert len({r.env.shared.buf.ctypes.data for r in runners.values()}) == 1
    for turn, k in enumerate(["decode", "chunk 13", "batch 3", "chunk 5", "decode", "chunk 13"]):
        shared.buf[:] = 0xFF  # NaN in every f32 of the arena: a value left from before would show
        g = graphs[k]
        env = _inputs(cfg, g, 7 + turn, turn)
        got = runners[k].step({n: v.copy() for n, v in env.items()})
        ref = evaluate(with_numerics(g, numerics), w, {n: v.copy() for n, v in env.items()})
        assert np.array_equal(got["logits"], np.asarray(ref["logits"]).reshape(got["logits"].shape)), k
        assert np.array_equal(got["next"], np.asarray(ref["next"]).reshape(-1)), k


def test_a_larger_form_grows_the_arena_and_the_earlier_runner_follows():
    cfg, w = demo_model(64)
    shared = SharedArena()
    g1, g9 = build_step(cfg, 1), build_step(cfg, 9)
    small = NumpyRunner(plan(g1), w, exact=True, shared=shared)
    before = shared.version
    big = NumpyRunner(plan(g9), w, exact=True, shared=shared)
    assert shared.version == before + 1 and shared.buf.size == big.env.need > small.env.need
    env = _inputs(cfg, g1, 3, 0)
    got = small.step({n: v.copy() for n, v in env.items()})
    assert np.shares_memory(small.env.arena, shared.buf)  # its views made anew in the grown buffer
    ref = evaluate(g1, w, {n: v.copy() for n, v in env.items()})
    assert np.array_equal(got["logits"], np.asarray(ref["logits"]).reshape(got["logits"].shape))


def test_generate_runs_its_forms_in_one_arena():
    from lanefuse.lane.run.generate import generate
    from lanefuse.lane.run.step import plan_step_fn

    cfg, w = demo_model(64)
    fn, _ = plan_step_fn(w, device="cpu", exact=True)
    out = generate(cfg, w, [5, 3, 9, 1, 4, 1, 5, 9, 2], 4, step_fn=fn, chunk=4)
    ref = generate(cfg, w, [5, 3, 9, 1, 4, 1, 5, 9, 2], 4, chunk=4)  # the reference interpreter
    assert out.generated_ids == ref.generated_ids
    envs = [r.env for r in fn.runners.values()]
    assert sorted(fn.runners) == [(1, 1), (4, 1)]  # chunks of 4 then 4, 1 (the decode step's width)
    assert len({id(e.shared) for e in envs}) == 1
    shared = envs[0].shared  # the caches first (the forms' tables, once), then the largest form's step-local arrays
    assert shared.buf.size == shared.base + max(e.need for e in envs)
    assert shared.base == forms_of({k: r.s for k, r in fn.runners.items()}).base


def test_the_forms_figure_places_the_tables_once_and_overlays_the_forms():
    cfg, _ = demo_model(64)
    plans = {k: plan(build_step(cfg, r)) for k, r in (("decode", 1), ("chunk 16", 16), ("chunk 3", 3))}
    f = forms_of(plans)
    tables = tables_of(plans["decode"].buffers)
    assert set(f.tables) == set(tables) == {f"{c}{i}" for i in range(cfg.layers) for c in ("kc", "vc")}
    assert all(f.tables[n][1] == tables[n] == 4 * 64 * cfg.kv_heads * cfg.head_dim for n in tables)
    spans = sorted((o, o + aligned(n)) for o, n in f.tables.values())  # side by side, none overlapping
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and f.base == spans[-1][1]
    own = {k: p.arena.bytes for k, p in plans.items()}
    assert f.own == own and f.bytes == f.base + aligned(max(own.values()))
    assert f.apart == f.base + sum(aligned(n) for n in own.values()) > f.bytes
    assert f.offset("chunk 3", 128) == f.base + 128
    with pytest.raises(ValueError, match="table `kc0` of 8 bytes"):
        share({"a": (Arena(bytes=64), {"kc0": 16}), "b": (Arena(bytes=64), {"kc0": 8})})


# -- written whole before read ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _W(Launch):
    """A stand-in launch: reads `ins`, writes `y` (through a destination that may place it in a part of every
    unit)."""

    ins: tuple[str, ...]
    y: Dst | None
    census: ClassVar[str] = "fake"

    def reads(self):
        return self.ins

    def writes(self):
        return (self.y.buf,) if self.y is not None else ()

    def kernels(self):
        return ("k",)


def _bufs(**sizes) -> dict[str, Buffer]:
    return {n: Buffer(n, n, 0, s, "f32", "arena") for n, s in sizes.items()}


def test_a_read_before_any_write_names_the_array_and_the_launch():
    bufs = _bufs(a=8, b=8)
    seq = [_W((), Dst("a")), _W(("b",), Dst("a"))]
    with pytest.raises(NotWritten, match=r"launch 1 \(fake\) reads `b` where no launch before it has written any "
                                         r"of it"):
        lifetimes(seq, bufs)


def test_parts_of_every_unit_count_once_all_are_written():
    bufs = _bufs(y=16, z=4)
    left, right = Dst("y", unit=Part(8, 0, 5)), Dst("y", unit=Part(8, 5, 3))
    with pytest.raises(NotWritten, match=r"reads `y` .* written 6 of its 16 values \(the first at 5\)"):
        walk([_W((), left), _W(("y",), Dst("z"))], bufs)
    first = walk([_W((), left), _W((), right), _W(("y",), Dst("z"))], bufs)
    assert first == {"y": 0, "z": 2}  # y lives from its first part's launch
    lives = {x.name: (x.first, x.last) for x in lifetimes([_W((), Dst("z")), _W((), left), _W((), right),
                                                             _W(("y",), Dst("z"))], bufs)}
    assert lives == {"y": (1, 3), "z": (0, 3)}


def test_a_view_of_rows_written_is_read_and_one_of_rows_not_written_is_refused():
    bufs = _bufs(t=12, u=4)
    bufs["row1"] = Buffer("row1", "t", 4, 4, "f32", "arena")
    bufs["row2"] = Buffer("row2", "t", 8, 4, "f32", "arena")
    seq = [_W((), Dst("row1")), _W(("row1",), Dst("u"))]
    assert walk(seq, bufs) == {"t": 0, "u": 1}
    with pytest.raises(NotWritten, match=r"reads `row2` \(a part of `t`\)"):
        walk(seq + [_W(("row2",), Dst("u"))], bufs)


def test_a_plan_whose_launches_read_before_writing_fails_its_check_in_words():
    cfg, _ = demo_model(64)
    p = plan(build_step(cfg, 1))
    moved = dataclasses.replace(p, launches=[p.launches[1], p.launches[0], *p.launches[2:]])
    with pytest.raises(UserError, match=r"launches\[0\]: launch 0 \(\w+\) reads `\S+` where no launch before it"):
        check(moved)


@st.composite
def _programs(draw):
    names = [f"t{i}" for i in range(draw(st.integers(1, 6)))]
    seq = []
    for _ in range(draw(st.integers(1, 12))):
        ins = tuple(draw(st.lists(st.sampled_from(names), max_size=2, unique=True)))
        out = draw(st.sampled_from(names + [None]))
        seq.append((ins, out))
    return names, seq


@settings(max_examples=200, deadline=None)
@given(_programs())
def test_the_check_refuses_exactly_a_read_before_the_first_write(prog):
    names, seq = prog
    bufs = _bufs(**{n: 6 for n in names})
    launches = [_W(ins, Dst(out) if out else None) for ins, out in seq]
    written, bad = {}, None
    for i, (ins, out) in enumerate(seq):
        miss = [n for n in ins if n not in written]
        if miss and bad is None:
            bad = (i, miss[0])
        if out:
            written.setdefault(out, i)
    if bad is None:
        assert walk(launches, bufs) == written
        lives = lifetimes(launches, bufs)
        assert all(x.first == written[x.name] for x in lives)
    else:
        with pytest.raises(NotWritten) as e:
            walk(launches, bufs)
        assert (e.value.launch, e.value.name) == bad


def test_device_runners_of_a_model_share_one_arena_allocation(monkeypatch):
    """The CuPy runners' wiring on the CPU (tests/test_cupy_runner_mock.py's stand-in cupy): made widest first, as a
    run prefills its widest chunk first, a model's forms take views into one device allocation, each at its own
    plan's offsets, and give the numpy runner's tokens and logits."""
    import test_cupy_runner_mock as mock

    from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState
    from lanefuse.lane.run.generate import generate

    mock.fake_cupy.__wrapped__(monkeypatch)
    cfg, w = demo_model(64)
    plans = {r: plan(build_step(cfg, r)) for r in (4, 1)}
    state = DeviceState()
    gpu = {r: CupyRunner(s, w, state) for r, s in plans.items()}
    a = state.arena  # the caches first (at the forms' table offsets), then the step-local arrays from `base`
    f = forms_of(plans)
    assert a.base == f.base and state.arena.buf.size == f.bytes
    for name, (off, nbytes) in f.tables.items():
        assert state.tables[name].ctypes.data - a.buf.ctypes.data == off and state.tables[name].nbytes == nbytes
    for r, s in plans.items():  # each array's device view at its plan's offset in the one allocation
        assert gpu[r].env.arena.ctypes.data == a.buf.ctypes.data + a.base
        base = a.buf.ctypes.data + a.base
        for name, p in s.arena.by_name().items():
            v = gpu[r].env.views.get(name)
            if v is not None and s.buffers[name].dtype == "f32":
                assert v.ctypes.data - base == p.offset
    cpu = {r: NumpyRunner(s, w) for r, s in plans.items()}
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    a = generate(cfg, w, prompt, 6, step_fn=lambda g, env: gpu[g.meta["rows"]].step(env), chunk=4)
    b = generate(cfg, w, prompt, 6, step_fn=lambda g, env: cpu[g.meta["rows"]].step(env), chunk=4)
    assert a.generated_ids == b.generated_ids
    assert max(float(np.max(np.abs(x - y))) for x, y in zip(a.logits, b.logits)) == 0.0
