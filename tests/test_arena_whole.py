"""Lifetimes from the launch that first writes an array, over random programs whose writes are whole, a part of every
unit, or one row (a view): lane/lower/buffers.py's check refuses exactly the first read of an element no launch has
written yet (an oracle kept here, element by element), and where it passes, two programs (two forms) placed by
lifetimes() and run turn about in ONE buffer, never poisoned between them, read back exactly what each launch wrote:
nothing a launch reads was left by another array sharing its bytes, nor by the other form."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from lanefuse.kernels.common import Dst, Part
from lanefuse.lane.lower.arena import check as check_arena, place
from lanefuse.lane.lower.buffers import Buffer, NotWritten, lifetimes, walk

from test_arena_forms import _W

PITCH = 4  # values a unit (a row)
HALVES = (Part(PITCH, 0, 2), Part(PITCH, 2, 2))


@st.composite
def _programs(draw):
    """(buffers, launches, writes): homes of 1-3 rows and a view of each row; each launch reads up to two buffers and
    writes a home whole, one half of every row of it, or one row through its view; `writes` the elements each writes.
    """
    homes = {f"h{i}": draw(st.integers(1, 3)) for i in range(draw(st.integers(1, 3)))}
    bufs = {h: Buffer(h, h, 0, r * PITCH, "f32", "arena") for h, r in homes.items()}
    for h, r in homes.items():
        for j in range(r):
            bufs[f"{h}.r{j}"] = Buffer(f"{h}.r{j}", h, j * PITCH, PITCH, "f32", "arena")
    names = sorted(bufs)
    done = {h: np.zeros(b.size, bool) for h, b in bufs.items() if b.home == h}
    launches, writes = [], []
    for _ in range(draw(st.integers(1, 14))):
        # mostly reads of what is written by now (so most programs pass and are run), now and then any buffer
        ready = [n for n in names if done[bufs[n].home][bufs[n].offset:bufs[n].offset + bufs[n].size].all()]
        pool = names if draw(st.integers(0, 3)) == 0 or not ready else ready
        ins = tuple(draw(st.lists(st.sampled_from(pool), max_size=2, unique=True)))
        h = draw(st.sampled_from(sorted(homes)))
        n = bufs[h].size
        kind = draw(st.sampled_from(["whole", "half", "row"]))
        if kind == "whole":
            dst, at = Dst(h), np.arange(n)
        elif kind == "half":
            part = draw(st.sampled_from(HALVES))
            dst = Dst(h, unit=part)
            at = np.array([u * PITCH + part.offset + k for u in range(n // PITCH) for k in range(part.width)])
        else:
            j = draw(st.integers(0, homes[h] - 1))
            dst, at = Dst(f"{h}.r{j}"), np.arange(j * PITCH, (j + 1) * PITCH)
        launches.append(_W(ins, dst))
        writes.append((h, at))
        done[h][at] = True
    return bufs, launches, writes


def _oracle(bufs, launches, writes):
    """(the first unwritten read (launch, name) or None, each home's first write)."""
    done = {h: np.zeros(b.size, bool) for h, b in bufs.items() if b.home == h}
    first = {}
    for i, (l, (h, at)) in enumerate(zip(launches, writes)):
        for name in l.ins:
            b = bufs[name]
            if not done[b.home][b.offset:b.offset + b.size].all():
                return (i, name), first
        done[h][at] = True
        first.setdefault(h, i)
    return None, first


def _run(arena, bufs, launches, writes, mem, tag):
    """Run the program in `mem` at the arena's offsets: launch i writes tag + 1000 i + e at element e of its home; each
    read must see exactly what the launch that last wrote each element wrote."""
    at_of = {p.name: p.offset // 4 for p in arena.arrays}
    ref = {h: np.full(b.size, np.nan, np.float32) for h, b in bufs.items() if b.home == h}
    for i, (l, (h, at)) in enumerate(zip(launches, writes)):
        for name in l.ins:
            b = bufs[name]
            lo = at_of[b.home] + b.offset
            got = mem[lo:lo + b.size]
            want = ref[b.home][b.offset:b.offset + b.size]
            assert np.array_equal(got, want), f"launch {i} read `{name}`: {got} where {want} was written"
        vals = (tag + 1000 * i + at).astype(np.float32)
        mem[at_of[h] + at] = vals
        ref[h][at] = vals


@settings(max_examples=200, deadline=None)
@given(_programs(), _programs())
def test_lifetimes_from_the_first_write_share_bytes_and_read_only_what_was_written(a, b):
    placed = []
    for bufs, launches, writes in (a, b):
        bad, first = _oracle(bufs, launches, writes)
        if bad is not None:
            try:
                walk(launches, bufs)
            except NotWritten as e:
                assert (e.launch, e.name) == bad
                continue
            raise AssertionError(f"launch {bad[0]} reads `{bad[1]}` before all of it is written, and walk passed")
        lives = lifetimes(launches, bufs)
        assert {x.name: x.first for x in lives} == first  # from the first write, whole or a part of it
        arena = place(lives)
        check_arena(arena)
        placed.append((arena, bufs, launches, writes))
    if not placed:
        return
    mem = np.full(max(x[0].bytes for x in placed) // 4 + 1, np.nan, np.float32)  # one buffer, the largest form's
    for turn in range(3):  # the forms turn about, one running at a time, nothing cleared between them
        for k, form in enumerate(placed):
            _run(*form, mem, tag=0.5 * (k + 2 * turn))


def test_a_half_written_row_read_whole_is_refused_and_both_halves_pass():
    bufs = {"h": Buffer("h", "h", 0, 8, "f32", "arena"), "h.r1": Buffer("h.r1", "h", 4, 4, "f32", "arena"),
            "z": Buffer("z", "z", 0, 4, "f32", "arena")}
    left, right = _W((), Dst("h", unit=HALVES[0])), _W((), Dst("h", unit=HALVES[1]))
    try:
        walk([left, _W(("h.r1",), Dst("z"))], bufs)
        raise AssertionError("walk passed a read of a row only half written")
    except NotWritten as e:
        assert (e.launch, e.name, e.home) == (1, "h.r1", "h") and "2 of its 4 values" in str(e)
    assert walk([_W((), Dst("z")), left, right, _W(("h.r1",), Dst("z"))], bufs) == {"z": 0, "h": 1}


# -- an expert mixture's forms in one buffer ---------------------------------------------------------------------------

MOE_FORMS = {"chunk 12": (12, 1), "decode": (1, 1), "batch 2": (1, 2), "chunk 5": (5, 1)}


def test_a_mixtures_forms_in_one_poisoned_buffer_equal_each_form_in_its_own():
    """A tiny Qwen3-MoE (8 experts of 96, top 2; on a chip where bytes dominate its 12-row chunk sorts its rows by
    expert, test_moe's test_a_chunk_sorted_by_expert, with scratch of its own): its decode
    step, two chunk widths and a batch of 2 run turn about in ONE buffer filled with NaN bytes before every step give
    the logits, tokens and caches of each form run in a zeroed buffer of its own, to the bit (exact twins), and the
    reference interpreter's tokens, logits within 1e-6 of their scale (the mixture's sums run in another order)."""
    from test_arena_forms import _inputs
    from test_moe import tiny, weights_for

    from lanefuse.engine.front.model import build_step
    from lanefuse.engine.interp import evaluate
    from lanefuse.lane.lower.knobs import Knobs
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.numpy_runner import NumpyRunner, SharedArena

    cfg = tiny("Qwen3MoeForCausalLM", inter=96)
    w = weights_for(cfg, "f32", 2)
    graphs = {k: build_step(cfg, r, b) for k, (r, b) in MOE_FORMS.items()}
    plans = {k: plan(g, knobs=Knobs(launch_us=0.01, fixed_scale=0.001)) for k, g in graphs.items()}
    assert any(getattr(l.launch, "sort", False) for l in plans["chunk 12"].launches)
    shared = SharedArena()
    one = {k: NumpyRunner(p, w, exact=True, shared=shared) for k, p in plans.items()}
    assert shared.buf.size == max(r.env.need for r in one.values())
    for turn, k in enumerate(["chunk 12", "decode", "batch 2", "chunk 5", "decode", "chunk 12", "batch 2"]):
        shared.buf[:] = 0xFF
        env = _inputs(cfg, graphs[k], 5 + turn, turn)
        mine = {n: v.copy() for n, v in env.items()}
        apart = {n: v.copy() for n, v in env.items()}
        got = one[k].step(mine)
        assert np.shares_memory(one[k].env.arena, shared.buf), k  # it ran inside the one buffer
        want = NumpyRunner(plans[k], w, exact=True).step(apart)
        ref = evaluate(graphs[k], w, {n: v.copy() for n, v in env.items()})
        logits = np.asarray(ref["logits"]).reshape(got["logits"].shape)
        assert np.abs(got["logits"] - logits).max() <= 1e-6 * np.abs(logits).max(), k
        assert np.array_equal(got["next"], np.asarray(ref["next"]).reshape(-1)), k
        assert np.all(np.isfinite(got["logits"])), k
        assert np.array_equal(got["logits"], want["logits"]) and np.array_equal(got["next"], want["next"]), k
        for n in env:  # the caches, written in place
            assert np.array_equal(mine[n], apart[n]), (k, n)
        assert not np.array_equal(mine["kc0"], env["kc0"]), k


# -- the plan check over sampled plans ----------------------------------------------------------------------------------

def test_every_sampled_form_passes_the_plan_check_and_a_swap_in_it_is_refused_in_words():
    """with_sampling's plans (every plan a run makes: decode, a chunk, a batch) are checked whole as they are made,
    the written-whole check among the rest; the check let a sampled step advance its `sampling` words (it refused
    every sampled plan: 'writes the step's input `sampling`'), and still refuses a read before any write in one."""
    import dataclasses

    import pytest

    from lanefuse.engine.errors import UserError
    from lanefuse.engine.front.demo import demo_config
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.lower.plancheck import check
    from lanefuse.lane.run.sampling import with_sampling

    cfg = demo_config()
    for rows, batch in ((1, 1), (9, 1), (1, 3)):
        s = with_sampling(plan(build_step(cfg, rows, batch)))
        check(s)
        assert "sampling" in s.io.inputs and any(x.launch.census == "fold" and "sampling" in x.launch.writes()
                                                 for x in s.launches)
    moved = dataclasses.replace(s, launches=[s.launches[1], s.launches[0], *s.launches[2:]])
    with pytest.raises(UserError, match=r"launches\[0\]: launch 0 \(\w+\) reads `\S+` where no launch before it"):
        check(moved)
