"""Views of a row range at any offset of a computed tensor (seed 000: a view into the tensor, no launch; a view a
product reads quantized is a view into the quantized form when it starts on a whole block): the op's shape and
refusals, the reference interpreter, the plan (a free view: its buffer inside its tensor's at the range's first
value; a view whose table is rewritten before its last reader: a copy, one slice launch), the numpy twins exact, and
the device runner's views at their offsets (the stand-in cupy)."""

from __future__ import annotations

import numpy as np
import pytest

from lanefuse.engine.front.demo import demo_model
from lanefuse.engine.errors import UserError
from lanefuse.engine.interp import evaluate
from lanefuse.engine.ir import Constant, Graph, StepIO
from lanefuse.engine.front.model import build_step
from lanefuse.engine.formats.quantize import with_numerics
from lanefuse.lane.lower.plan import plan
from lanefuse.lane.lower.plancheck import check
from lanefuse.lane.run.numpy_runner import NumpyRunner


def test_a_range_views_shape_and_its_refusals_in_words():
    g = Graph(io=StepIO())
    g.tensor("x", (7, 48))
    g.add("view", ["x"], "v", row=2, rows=4)
    assert g.shape("v") == (4, 48)
    for row, rows, what in ((5, 3, r"rows 5\.\.7 outside 7 rows"), (7, 1, "row 7 outside 7 rows"),
                            (0, 0, "a view of 0 rows")):
        with pytest.raises(UserError, match=what):
            g.add("view", ["x"], f"bad{row}{rows}", row=row, rows=rows)
    g.tensor("xq", (7, 48), "q8")
    g.add("view", ["xq"], "vq", row=2, rows=3)  # 96 values in: two whole blocks
    assert (g.shape("vq"), g.dtype("vq")) == ((3, 48), "q8")
    with pytest.raises(UserError, match="starts inside a block of 32"):
        g.add("view", ["xq"], "vq1", row=1, rows=2)


def _env(cfg, g, pos, seed=0):
    rng = np.random.default_rng(seed)
    env = {n: (0.5 * rng.standard_normal(g.tensors[n].shape)).astype(np.float32) for n in g.io.tables}
    env["token"] = rng.integers(0, cfg.vocab, g.tensors["token"].shape[0]).astype(np.int32)
    env["pos"] = np.array([pos], np.int32)
    return env


@pytest.mark.parametrize("numerics, fmt", [("f32", None), ("f32", "bf16"), ("q8x2", "q8_0")])
def test_a_chunks_last_rows_logits_plan_a_view_of_those_rows(numerics, fmt):
    """The model's front asks for the logits of a chunk's last 4 rows (a verifier of 3 drafted tokens): a view of
    rows 5..8 of the last residual, planned as no launch inside that tensor's array; the plan equals the reference
    exactly and gives the rows the whole chunk's logits give."""
    from test_quant import q8_model

    cfg, w = demo_model(64) if fmt is None else q8_model(fmt, 64)
    g = build_step(cfg, 9, last=4)
    (v,) = [op for op in g.ops if op.kind == "view"]
    assert (v.a["row"], v.a["rows"], g.shape(v.out)) == (5, 4, (4, cfg.hidden))
    p = plan(g, numerics=numerics)
    check(p)
    b = p.buffers[v.out]
    assert b.home != v.out and b.offset == 5 * cfg.hidden and b.size == 4 * cfg.hidden and b.where == "arena"
    assert p.buffers[b.home].size == 9 * cfg.hidden
    assert "slice" not in p.census and [x.launch.census for x in p.launches].count("view") == 1
    env = _env(cfg, g, 3)
    out = NumpyRunner(p, w, exact=True).step({k: a.copy() for k, a in env.items()})
    ref = evaluate(with_numerics(g, numerics), w, {k: a.copy() for k, a in env.items()})
    assert out["logits"].shape == (4, cfg.vocab)
    assert np.array_equal(out["logits"], np.asarray(ref["logits"]))
    assert np.array_equal(out["next"], np.asarray(ref["next"]).reshape(-1))
    whole = evaluate(with_numerics(build_step(cfg, 9, last=9), numerics), w, {k: a.copy() for k, a in env.items()})
    assert np.array_equal(np.asarray(whole["logits"])[5:], out["logits"])


def test_the_last_rows_of_a_step_refused_in_words():
    cfg, _ = demo_model(64)
    with pytest.raises(UserError, match="the logits of the last 5 rows of a step of 4"):
        build_step(cfg, 4, last=5)


def ranges_read_graph(fmt: str = "q8_0", d: int = 64, rows: int = 7):
    """A chunk whose residual sum is read by two products over row ranges (rows 3..5 and 1..2): views at offsets
    3·d and d, over `fmt` rows."""
    g = Graph(io=StepIO())
    g.tensor("token", (rows,), "i32")
    g.tensor("pos", (1,), "i32")
    g.constant(Constant("emb", (50, d), "rows"))
    for n in ("w1", "w3", "w4"):
        g.constant(Constant(n, (d, d), "rows", format=fmt, transposed=True))
    g.constant(Constant("head", (50, d), "rows", format=fmt, transposed=True))
    g.add("gather", ["emb", "token"], "x")
    g.add("matmul", ["x", "w1"], "a")
    g.add("add", ["a", "x"], "s")
    g.add("view", ["s"], "late", row=3, rows=3)
    g.add("view", ["s"], "early", row=1, rows=2)
    g.add("matmul", ["late", "w3"], "p")
    g.add("matmul", ["early", "w4"], "r")
    g.add("view", ["p"], "p2", row=1, rows=2)
    g.add("add", ["p2", "r"], "o")
    g.add("matmul", ["o", "head"], "logits")
    g.add("argmax", ["logits"], "next")
    g.validate()
    return g


@pytest.mark.parametrize("numerics, fmt, d", [("q8", "q8_0", 64), ("q8x2", "q8_0", 64), ("q8", "q4_k", 256),
                                               ("f32", "q8_0", 64)])
def test_ranges_read_quantized_are_views_into_the_quantized_form(numerics, fmt, d):
    """Products reading row ranges of a computed tensor quantized read views into its one quantized form, each at
    its range's first block (words, low words or sums, scales); exact and fast twins equal the interpreter."""
    from lanefuse.engine.front.stepweights import random_weights

    g = ranges_read_graph(fmt, d)
    gq = with_numerics(g, numerics)
    p = plan(g, numerics=numerics)
    check(p)
    if numerics == "f32":
        assert p.buffers["late"].home == "s" and p.buffers["late"].offset == 3 * d
    else:
        form = numerics if fmt == "q8_0" else "q8k"
        quants = [op for op in gq.ops if op.kind == "quantize"]
        assert [op.ins[0] for op in quants].count("s") == 1
        for name, row, rows in (("late", 3, 3), ("early", 1, 2)):
            b = p.buffers[f"{name}.{form}"]
            assert (b.home, b.offset, b.size, b.dtype) == (f"s.{form}", row * d, rows * d, form)
    w = random_weights(gq, 5)
    env = {"token": np.array([3, 17, 41, 8, 0, 49, 22], np.int32), "pos": np.array([0], np.int32)}
    want = evaluate(gq, w, dict(env))
    for exact in (True, False):
        out = NumpyRunner(p, w, exact=exact, check=exact).step(dict(env), lifted=g)
        err = np.abs(out["logits"] - want["logits"]).max()
        assert err <= (1e-6 if exact else 1e-4) * np.abs(want["logits"]).max()  # test_quant_lane's bounds
        assert np.array_equal(out["next"], want["next"])


def test_device_views_of_ranges_sit_at_their_offsets(monkeypatch):
    """The CuPy runner (the stand-in cupy: each launch its numpy twin on the device env) gives a plan reading row
    ranges quantized the numpy runner's logits exactly: its views into the quantized form at the ranges' offsets."""
    import test_cupy_runner_mock as mock

    from lanefuse.engine.front.stepweights import random_weights
    from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState

    mock.fake_cupy.__wrapped__(monkeypatch)
    g = ranges_read_graph("q8_0", 64)
    p = plan(g, numerics="q8x2")
    w = random_weights(with_numerics(g, "q8x2"), 5)
    env = {"token": np.array([3, 17, 41, 8, 0, 49, 22], np.int32), "pos": np.array([0], np.int32)}
    r = CupyRunner(p, w, DeviceState(), graph=False)
    assert r.env.quantized["late.q8x2"] == (3 * 64, 2, 7 * 64, 3 * 64)
    got = r.step(dict(env))
    want = NumpyRunner(p, w, exact=True).step(dict(env))
    assert np.array_equal(got["logits"], want["logits"]) and np.array_equal(got["next"], want["next"])


COPIED_RANGE = """meta: {model: placement, rows: 1}
weights: {random: 3}
io:
  token: token
  position: pos
  caches: [[kc1, vc1]]
  logits: logits
  next: next
tensors:
  token: i32[1]
  pos: i32[1]
  kc1: f32[16, 8]
  vc1: f32[16, 8]
constants:
  emb: {shape: [32, 8]}
  wk: {shape: [8, 8], transposed: true}
  wo: {shape: [32, 8], transposed: true}
ops:
  - {op: gather, out: x, ins: [emb, token]}
  - {op: view, out: r, ins: [kc1], row: 3, rows: 3}
  - {op: matmul, out: k, ins: [x, wk]}
  - {op: set_row, out: kc, ins: [kc1, k, pos]}
  - {op: add, out: y, ins: [r, x]}
  - {op: matmul, out: logits, ins: [y, wo]}
  - {op: argmax, out: next, ins: [logits]}
"""


def test_a_range_of_a_table_rewritten_inside_it_is_copied_when_taken(tmp_path):
    """Rows 3..5 of a cache taken, row 4 (the position) written, then the range read: a copy of the rows as they were
    (one slice of the range's 24 values), equal to the reference."""
    from test_placement import _against_reference, _step

    from lanefuse.engine.placement import copied_views

    _, g = _step(COPIED_RANGE, tmp_path)
    assert copied_views(g) == {"r"}
    s = _against_reference(g, pos=4)
    (sl,) = [x.launch for x in s.launches if x.launch.census == "slice"]
    assert (sl.start, sl.width) == (3 * 8, 3 * 8)
    assert s.buffers["r"].home == "r" and s.buffers["r"].size == 24


def test_a_range_view_round_trips_through_the_step_text():
    from lanefuse.engine.stepyaml import from_yaml, to_yaml

    cfg, _ = demo_model(64)
    text = to_yaml(build_step(cfg, 9, last=4))
    assert "{op: view, out: last, ins: [L3.resid_ffn], row: 5, rows: 4}" in text
    assert to_yaml(from_yaml(text)) == text
