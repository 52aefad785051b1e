"""Views at any offset (issue 40, seed 000: "a row read at a literal index of a computed tensor is no launch at all:
a view into the tensor"; "a view a projection reads quantized is a view into its tensor's quantized form too (when it
starts on a whole block)"), as a property over offsets and lengths: a model-shaped chunk whose residual sum is read
by row ranges drawn at random — one by a product (quantized under q8 / q8x2 over q8_0 rows), one by an add, a range
of that range (a view of a view) by a second product, a range of a product's output — planned under each numerics:
every free range's buffer sits inside its tensor's (through every alias) at its first row times the row's width,
the quantized ones inside the one quantized form, no launch copies them, the plan check passes, and the numpy
backend in its arena (exact twins) gives the reference interpreter's logits and token. A range outside its tensor
is refused in one line naming the op and the tensor, from the graph and from `lanefuse plan` of a step YAML.

No kernel changes for a view (its readers take a pointer at the offset): the device runner runs such a plan with
every launch the real .cu on the host emulator, its readers given pointers at the ranges' arena offsets, and gives
the numpy backend's logits and tokens. `lanefuse plan/check --last K` reach the front's range (a chunk's last K
rows' logits)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cuda_host import emu

from lanefuse.engine.errors import UserError
from lanefuse.engine.formats.quantize import with_numerics
from lanefuse.engine.front.stepweights import random_weights
from lanefuse.engine.interp import evaluate
from lanefuse.engine.ir import Constant, Graph, StepIO
from lanefuse.lane.lower.plan import plan
from lanefuse.lane.lower.plancheck import check
from lanefuse.lane.run.numpy_runner import NumpyRunner

D = 64  # the residual's width: two whole blocks of 32 a row, so every row range starts on a whole block


def ranges_graph(rows: int, a: tuple[int, int], b: int, c: tuple[int, int]) -> Graph:
    """A chunk of `rows` token rows: s = x + x·w1 (rows, D); `late` rows a[0]..a[0]+a[1]-1 of s, read by a product
    (p = late·w3); `early` a[1] rows of s from row b, added to p; `inner` rows c[0]..c[0]+c[1]-1 of `late` (a view of
    a view: rows a[0]+c[0].. of s), read by a product; `tail` the last c[1] rows of p; the head over their sum."""
    (row, n), (crow, cn) = a, c
    g = Graph(io=StepIO())
    g.tensor("token", (rows,), "i32")
    g.tensor("pos", (1,), "i32")
    g.constant(Constant("emb", (50, D), "rows"))
    for w in ("w1", "w3", "w4"):
        g.constant(Constant(w, (D, D), "rows", format="q8_0", transposed=True))
    g.constant(Constant("head", (50, D), "rows", format="q8_0", transposed=True))
    g.add("gather", ["emb", "token"], "x")
    g.add("matmul", ["x", "w1"], "h")
    g.add("add", ["h", "x"], "s")
    g.add("view", ["s"], "late", row=row, rows=n)
    g.add("view", ["s"], "early", row=b, rows=n)
    g.add("view", ["late"], "inner", row=crow, rows=cn)
    g.add("matmul", ["late", "w3"], "p")
    g.add("add", ["p", "early"], "pe")
    g.add("matmul", ["inner", "w4"], "r")
    g.add("view", ["pe"], "tail", row=n - cn, rows=cn)
    g.add("add", ["tail", "r"], "o")
    g.add("matmul", ["o", "head"], "logits")
    g.add("argmax", ["logits"], "next")
    g.validate()
    return g


@st.composite
def chunks(draw):
    rows = draw(st.integers(1, 9))
    n = draw(st.integers(1, rows))
    row, b = draw(st.integers(0, rows - n)), draw(st.integers(0, rows - n))
    cn = draw(st.integers(1, n))
    return rows, (row, n), b, (draw(st.integers(0, n - cn)), cn), draw(st.sampled_from(["f32", "q8", "q8x2"]))


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks())
def test_ranges_at_any_offset_are_views_and_equal_the_reference(case):
    rows, (row, n), b, (crow, cn), numerics = case
    g = ranges_graph(rows, (row, n), b, (crow, cn))
    if b == row:  # `early` is `late` again: one view computed twice, refused in one line (not blamed on a rule)
        with pytest.raises(UserError) as e:
            plan(g, numerics=numerics)
        assert str(e.value).startswith("tensors `early`, `late` are one op over the same inputs (`s`) computed "
                                       "twice") and "\n" not in str(e.value)
        return
    p = plan(g, numerics=numerics)
    check(p)
    assert "slice" not in p.census  # no range copied: each is no launch
    views = {"late": ("s", row), "early": ("s", b), "inner": ("s", row + crow), "tail": ("pe", n - cn)}
    for v, (t, first) in views.items():
        if v in p.buffers:  # a range read only quantized has no f32 buffer of its own
            assert (p.buffers[v].home, p.buffers[v].offset, p.buffers[v].size) == (t, first * D, g.shape(v)[0] * D)
    if numerics != "f32":  # the products' ranges of s: views into s's one quantized form, at their first block
        gq = with_numerics(g, numerics)
        assert [op.ins[0] for op in gq.ops if op.kind == "quantize"].count("s") == 1
        for v in ("late", "inner"):
            q = p.buffers[f"{v}.{numerics}"]
            assert (q.home, q.offset, q.size, q.dtype) == (f"s.{numerics}", views[v][1] * D, g.shape(v)[0] * D,
                                                           numerics)
    gq = with_numerics(g, numerics)
    w = random_weights(gq, 5)
    rng = np.random.default_rng(rows * 100 + row * 10 + b)
    env = {"token": rng.integers(0, 50, rows).astype(np.int32), "pos": np.array([0], np.int32)}
    want = evaluate(gq, w, dict(env))
    out = NumpyRunner(p, w, exact=True, check=True).step(dict(env), lifted=g)
    scale = float(np.abs(want["logits"]).max())
    assert np.abs(out["logits"] - want["logits"]).max() <= 1e-6 * scale  # test_quant_lane's bound for exact twins
    assert np.array_equal(out["next"], np.asarray(want["next"]).reshape(-1))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(-3, 12), st.integers(-1, 12))
def test_a_range_outside_its_tensor_is_refused_in_one_line(rows, row, n):
    g = Graph(io=StepIO())
    g.tensor("s", (rows, D))
    if 0 <= row and 1 <= n and row + n <= rows:
        g.add("view", ["s"], "v", row=row, rows=n)
        assert g.shape("v") == (n, D)
        return
    with pytest.raises(UserError) as e:
        g.add("view", ["s"], "v", row=row, rows=n)
    text = str(e.value)
    assert "\n" not in text and "`view` -> `v`" in text and f"s ({rows}, {D})" in text


OUT_OF_RANGE = """meta: {model: ranges, rows: 3}
weights: {random: 3}
io:
  token: token
  position: pos
  logits: logits
  next: next
tensors:
  token: i32[3]
  pos: i32[1]
constants:
  emb: {shape: [32, 8]}
  wo: {shape: [32, 8], transposed: true}
ops:
  - {op: gather, out: x, ins: [emb, token]}
  - {op: view, out: last, ins: [x], row: 2, rows: 2}
  - {op: matmul, out: logits, ins: [last, wo]}
  - {op: argmax, out: next, ins: [logits]}
"""


def test_lanefuse_plan_refuses_a_step_yamls_range_outside_its_tensor_in_one_line(tmp_path, capsys):
    from lanefuse.lane.cli.main import main

    f = tmp_path / "ranges.yaml"
    f.write_text(OUT_OF_RANGE)
    assert main(["plan", str(f), "--rows", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert "`view` -> `last`" in err and "rows 2..3 outside 3 rows" in err and "x (3, 8)" in err
    f.write_text(OUT_OF_RANGE.replace("row: 2, rows: 2", "row: 1, rows: 2"))
    assert main(["plan", str(f), "--rows", "3"]) == 0


def test_lanefuse_plan_and_check_take_a_chunks_last_rows(tmp_path, capsys):
    """`--last K` reaches the front's range (build_step(last=K)) from the command line: the plan's final norm reads
    the view `last` of the chunk's last K rows (no launch), and check finds the plan equal to the reference."""
    import json

    from lanefuse.lane.cli.main import main

    out = tmp_path / "plan.json"
    for last in (1, 4):
        assert main(["plan", "--rows", "9", "--last", str(last), "--json", str(out)]) == 0
        d = json.loads(out.read_text())
        (norm,) = [x for x in d["launches"] if "last" in x["reads"]]
        assert norm["fields"]["rows"] == last and "view" not in d["census"]
    capsys.readouterr()
    assert main(["check", "--rows", "9", "--last", "4"]) == 0
    said = capsys.readouterr().out
    assert said.startswith("rows 9:") and "next token equal" in said and said.rstrip().endswith("ok")


def test_last_rows_the_step_cannot_give_are_refused_in_one_line(tmp_path, capsys):
    from lanefuse.lane.cli.main import main

    f = tmp_path / "ranges.yaml"
    f.write_text(OUT_OF_RANGE.replace("row: 2, rows: 2", "row: 1, rows: 2"))
    for argv, what in ((["check", "--last", "4"], "--last 4: the logits of the last 4 rows of a step of 1 (give "
                                                  "--rows of at least 4)"),
                       (["plan", "--batch", "2", "--last", "2"], "a batch step's logits are already every row's"),
                       (["plan", str(f), "--rows", "3", "--last", "2"], "--last needs a model"),
                       (["plan", "--rows", "9", "--last", "2", "--save", str(tmp_path / "p.plan")],
                        "a saved plan is a step `lanefuse run --plan` takes")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert what in err and err.count("\n") == 0 and "Traceback" not in err
    assert not (tmp_path / "p.plan").exists()


class _Stream:  # what CupyRunner asks of cupy.cuda.Stream, run in order on the host
    def __init__(self, **kw):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def synchronize(self):
        pass


@pytest.mark.skipif(emu.compiler() is None, reason="no g++ to build the emulated kernels")
@pytest.mark.parametrize("numerics, case", [("f32", (7, (2, 4), 1, (1, 2))), ("q8x2", (7, (2, 4), 1, (1, 2))),
                                            ("q8", (5, (3, 2), 0, (1, 1)))])
def test_the_cuda_kernels_read_the_ranges_at_their_arena_offsets(numerics, case, monkeypatch):
    """The plan run by the device runner with every launch the real .cu on the host emulator (gather, quant, gemv,
    binary, argmax; the head's arg-max apart, head_argmax held, so no fold module is built): the products and adds
    reading the ranges take pointers into the arena at the ranges' offsets (f32, and the quantized form's words and
    scales at their blocks), and give the numpy backend's logits (within the kernels' own summation order, 2e-5 of
    their scale) and tokens."""
    import sys

    from lanefuse.lane.run import cupy_runner

    rows, a, b, c = case
    g = ranges_graph(rows, a, b, c)
    p = plan(g, numerics=numerics, held=["head_argmax"])
    w = random_weights(with_numerics(g, numerics), 5)
    env = {"token": np.random.default_rng(rows).integers(0, 50, rows).astype(np.int32), "pos": np.array([0], np.int32)}
    want = NumpyRunner(p, w, exact=True).step(dict(env))
    with emu.emulating(sorted({x.launch.stem for x in p.launches if x.launch.kernels()})) as device_env:
        monkeypatch.setattr(cupy_runner, "DeviceEnv", device_env)  # bound by name as the runner was imported
        monkeypatch.setattr(sys.modules["cupy"].cuda, "Stream", _Stream, raising=False)
        r = cupy_runner.CupyRunner(p, w, cupy_runner.DeviceState(), graph=False)
        got = r.step(dict(env))
        ran = [k for k, _, _ in r.env.calls]
    assert ran.count("binary") == 3 and sum(k.startswith("gemv") for k in ran) == 4  # a launch a reader, no copy
    scale = float(np.abs(want["logits"]).max())
    assert np.abs(got["logits"] - want["logits"]).max() <= 2e-5 * scale
    assert np.array_equal(got["next"], want["next"])


def cache_range_step(row: int, n: int, view_at: int, read_first: bool) -> str:
    """A decode step over a cache of 16 rows of 8 taking rows row..row+n-1 of it (`view_at`: 0 before the key's
    product, 1 between it and the row write) and reading them with the head's product before the cache's row write
    (`read_first`: a free view) or after it (the rows copied when taken: seed 000)."""
    from test_placement import HEAD

    view = f"  - {{op: view, out: r, ins: [kc1], row: {row}, rows: {n}}}\n"
    read = "  - {op: matmul, out: logits, ins: [r, wo]}\n"
    ops = ["  - {op: gather, out: x, ins: [emb, token]}\n", "  - {op: matmul, out: k, ins: [x, wk]}\n"]
    ops.insert(1 + view_at, view)
    ops += [read, "  - {op: set_row, out: kc, ins: [kc1, k, pos]}\n"] if read_first else \
        ["  - {op: set_row, out: kc, ins: [kc1, k, pos]}\n", read]
    return HEAD + "".join(ops) + "  - {op: argmax, out: next, ins: [logits]}\n"


@settings(max_examples=16, deadline=None)
@given(st.integers(0, 15).flatmap(lambda row: st.tuples(st.just(row), st.integers(1, 16 - row))),
       st.integers(0, 1), st.booleans(), st.integers(0, 15))
def test_a_range_of_a_cache_is_the_rows_before_the_steps_write_wherever_it_lands(rn, view_at, read_first, pos):
    """Any range of a cache, any position written (inside the range or not): the rows the step reads are the cache's
    before its write, in the arena as in the reference. The step graph copies the range where its write comes
    before the range's reader; the plan may order the reader after the key's product, which writes the cache row
    itself (place.key_row), so it copies it then too: one slice of exactly the range, or a free view in the cache at
    the range's first row."""
    from lanefuse.engine.front.stepweights import step_weights
    from lanefuse.engine.placement import copied_views
    from lanefuse.engine.stepyaml import from_yaml

    (row, n) = rn
    g = from_yaml(cache_range_step(row, n, view_at, read_first), source="cache_range.yaml")
    assert copied_views(g) == (set() if read_first else {"r"})
    s = plan(g)
    check(s)
    slices = [x.launch for x in s.launches if x.launch.census == "slice"]
    if slices or not read_first:
        assert [(x.x, x.start, x.width) for x in slices] == [("kc1", row * 8, n * 8)] and s.buffers["r"].home == "r"
    else:
        assert (s.buffers["r"].home, s.buffers["r"].offset) == ("kc1", row * 8)
    w = step_weights(g)
    rng = np.random.default_rng(row * 16 + n)
    env = {t: rng.standard_normal(g.tensors[t].shape).astype(np.float32) for t in g.io.tables}
    env["token"], env["pos"] = np.array([5], np.int32), np.array([pos], np.int32)
    ref_env = {k: v.copy() for k, v in env.items()}
    want = evaluate(g, w, ref_env)
    out = NumpyRunner(s, w, exact=True, check=True).step(env, lifted=g)
    assert np.array_equal(out["logits"], np.asarray(want["logits"]))
    assert np.array_equal(out["next"], np.asarray(want["next"]).reshape(-1))
    for t in g.io.tables:  # the row write landed, in place, in both
        assert np.array_equal(env[t], ref_env[t]), t
