"""Every launch kind that reads checkpoint rows, in every GGUF block format: its exact numpy twin against the formula
on the weights gguf dequantizes, its fast twin against the exact one, refusals in words for rows it cannot read,
split-K chunks that never split a block, costs that see the quantized bytes — and the demo model with its matrices
in q8_0 / q4_0 / q4_k / q6_k: the fused plan run by the numpy runner (exact twins under LANEFUSE_CHECK=2, and the fast
twins) against the reference interpreter on the same weights."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lanefuse.engine.front.demo import demo_config, random_arrays
from lanefuse.engine.front.model import build_step
from lanefuse.engine.front.weights import Weights
from lanefuse.kernels import (Dst, Fold, Gather, GemmPart, GemmParts, Gemv, GemvGlu, HostEnv, Norm, Part, RopeParts,
                              RopeSide)
from lanefuse.engine.formats.blocks import BLOCKS, encode_matrices
from lanefuse.kernels.common import encode
from lanefuse.kernels.gemv import chunk
from lanefuse.lane.lower.knobs import Knobs
from lanefuse.lane.lower.plan import plan
from lanefuse.lane.run.generate import generate
from lanefuse.lane.run.numpy_runner import NumpyRunner

FMTS = ["q8_0", "q4_0", "q4_k", "q6_k"]
SENTINEL = -777.0
FAST_TOL = 1e-4  # the fast twin (f32 BLAS) against the exact twin (f64 sums), relative to the values' scale


def r32(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


def close(a, b, tol=1e-4):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert float(np.max(np.abs(a - b))) <= tol * max(float(np.max(np.abs(b))), 1.0)


def quantized(g, fmt, n, k):
    """(the stored rows, flat as the runners hold them, and their values as gguf decodes them)."""
    from gguf import GGMLQuantizationType, quants

    raw = encode(r32(g, n, k), fmt)
    return raw.reshape(-1), quants.dequantize(raw, GGMLQuantizationType[fmt.upper()]).astype(np.float64)


def twins(launch, arrays, weights):
    """(exact env, fast env): both twins of `launch` run on copies of the same inputs."""
    out = []
    for how in ("numpy", "fast"):
        env = HostEnv({k: v.copy() for k, v in arrays.items()}, dict(weights))
        getattr(launch, how)(env)
        out.append(env)
    return out


def k_of(fmt, blocks_a_row):
    return BLOCKS[fmt][0] * blocks_a_row


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m,blocks_a_row,n", [(1, 1, 5), (3, 2, 33), (9, 3, 17)])
@pytest.mark.parametrize("per_warp,split", [(1, 1), (4, 1), (1, 2), (4, 3)])
def test_gemv(fmt, m, blocks_a_row, n, per_warp, split):
    k = k_of(fmt, blocks_a_row)
    launch = Gemv("x", "w", fmt, Dst("y", unit=Part(n + 3, 1, n)), k, n, m, bias="b", per_warp=per_warp, split=split)
    if launch.check() is not None:
        assert split > 1 and "split" in launch.check().reason  # a chunk would split a block or be empty
        return
    g = np.random.default_rng(m * k + n)
    raw, w = quantized(g, fmt, n, k)
    x, b = r32(g, m, k), r32(g, n)
    exact, fast = twins(launch, {"x": x, "y": np.full(m * (n + 3), SENTINEL, np.float32)},
                        {"w": (raw, fmt), "b": (b, "f32")})
    y = exact.array("y").reshape(m, n + 3)
    close(y[:, 1:1 + n], x.astype(np.float64) @ w.T + b)
    assert np.all(y[:, 0] == SENTINEL) and np.all(y[:, 1 + n:] == SENTINEL)
    close(fast.array("y"), exact.array("y"), FAST_TOL)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("per_warp", [1, 4])
def test_gemv_glu_and_parts(fmt, per_warp):
    g = np.random.default_rng(6)
    m, k, n = 3, k_of(fmt, 2), 19
    (rg, wg), (ru, wu) = quantized(g, fmt, n, k), quantized(g, fmt, n, k)
    x, bg = r32(g, m, k), r32(g, n)
    weights = {"wg": (rg, fmt), "wu": (ru, fmt), "bg": (bg, "f32")}
    exact, fast = twins(GemvGlu("x", "wg", "wu", fmt, "o", k, n, m, bg="bg", per_warp=per_warp),
                        {"x": x, "o": np.zeros(m * n, np.float32)}, weights)
    G, U = x.astype(np.float64) @ wg.T + bg, x.astype(np.float64) @ wu.T
    close(exact.array("o").reshape(m, n), G / (1 + np.exp(-G)) * U)
    close(fast.array("o"), exact.array("o"), FAST_TOL)
    W = 2 * n + 5
    parts = (GemmPart("wg", Dst("qkv", unit=Part(W, 0, n)), n, bias="bg"),
             GemmPart("wu", Dst("kc", row="pos", pitch=n), n), GemmPart("wu", Dst("qkv", unit=Part(W, n + 5, n)), n))
    arrays = {"x": x, "qkv": np.full(m * W, SENTINEL, np.float32), "kc": np.full(8 * n, SENTINEL, np.float32),
              "pos": np.array([2], np.int32)}
    exact, fast = twins(GemmParts("x", fmt, k, m, parts, per_warp=per_warp), arrays, weights)
    y = exact.array("qkv").reshape(m, W)
    close(y[:, :n], G)
    close(y[:, n + 5:], U)
    assert np.all(y[:, n:n + 5] == SENTINEL)
    close(exact.array("kc").reshape(8, n)[2:5], U)
    for name in ("qkv", "kc"):
        close(fast.array(name), exact.array(name), FAST_TOL)


@pytest.mark.parametrize("fmt", FMTS)
def test_gather_and_the_gather_norm_fold_decode_only_their_rows(fmt):
    g = np.random.default_rng(13)
    V, cols, rows = 11, k_of(fmt, 2), 3
    raw, table = quantized(g, fmt, V, cols)
    nw = r32(g, cols)
    idx = np.array([10, 0, 4], np.int32)
    gather = Gather("E", "t", "e", cols, rows=rows, format=fmt, scale=1.5)
    f = Fold(gather, Norm("e", "nw", "y", rows, cols, 1e-6))
    assert f.fused and f.check() is None
    exact, fast = twins(f, {"t": idx, "e": np.zeros(rows * cols, np.float32), "y": np.zeros(rows * cols, np.float32)},
                        {"E": (raw, fmt), "nw": (nw, "f32")})
    e = table[idx] * np.float32(1.5)
    close(exact.array("e"), e.reshape(-1), 1e-6)
    x = e.astype(np.float64)
    close(exact.array("y"), (x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * nw).reshape(-1))
    for name in ("e", "y"):
        close(fast.array(name), exact.array(name), FAST_TOL)
    # the gather reads the gathered rows' bytes only: a table whose other rows are garbage gathers the same
    junk = np.random.default_rng(1).integers(0, 256, raw.size, dtype=np.uint8).reshape(V, -1)
    junk[idx] = raw.reshape(V, -1)[idx]
    env = HostEnv({"t": idx, "e": np.zeros(rows * cols, np.float32)}, {"E": (junk.reshape(-1), fmt)})
    gather.numpy(env)
    assert np.array_equal(env.array("e"), exact.array("e"))
    assert gather.checkpoint_bytes() == rows * raw.size // V


@pytest.mark.parametrize("fmt", FMTS)
def test_fold_products_then_head_epilogue(fmt):
    """q/k/v in parts (block-format rows) with q and k normed and rotated, k and v into cache rows: the fused form's
    twin is the products' then the rotation's, on the decoded weights."""
    g = np.random.default_rng(12)
    m, hd, heads, kv, L, pos = 2, 8, 3, 1, 9, 4
    k = k_of(fmt, 1)
    parts = (GemmPart("wq", Dst("q"), heads * hd, bias="bq"), GemmPart("wk", Dst("k"), kv * hd),
             GemmPart("wv", Dst("vc", row="pos", pitch=kv * hd), kv * hd))
    sides = (RopeSide("q", Dst("qr"), heads, norm=("qn", 1e-6)),
             RopeSide("k", Dst("kc", row="pos", pitch=kv * hd), kv, norm=("kn", 1e-6)))
    f = Fold(GemmParts("x", fmt, k, m, parts, per_warp=4), RopeParts(sides, "cos", "sin", "pos", m, hd, hd))
    assert f.fused and f.form()[0] == "parts_rope" and f.check() is None
    (rq, wq), (rk, wk), (rv, wv) = (quantized(g, fmt, n, k) for n in (heads * hd, kv * hd, kv * hd))
    ang = g.uniform(0, 6.28, (L, hd // 2))
    arrays = {"x": r32(g, m, k), "q": np.zeros(m * heads * hd, np.float32), "k": np.zeros(m * kv * hd, np.float32),
              "qr": np.zeros(m * heads * hd, np.float32), "kc": np.zeros(L * kv * hd, np.float32),
              "vc": np.zeros(L * kv * hd, np.float32), "pos": np.array([pos], np.int32)}
    bq = r32(g, heads * hd)
    weights = {"wq": (rq, fmt), "wk": (rk, fmt), "wv": (rv, fmt), "bq": (bq, "f32"), "qn": (r32(g, hd), "f32"),
               "kn": (r32(g, hd), "f32"), "cos": (np.cos(ang).astype(np.float32), "f32"),
               "sin": (np.sin(ang).astype(np.float32), "f32")}
    exact, fast = twins(f, arrays, weights)
    x64 = arrays["x"].astype(np.float64)
    close(exact.array("q"), (x64 @ wq.T + bq).reshape(-1))
    close(exact.array("vc").reshape(L, -1)[pos:pos + m], x64 @ wv.T)
    for name in ("q", "k", "qr", "kc", "vc"):
        close(fast.array(name), exact.array(name), FAST_TOL)


@pytest.mark.parametrize("fmt", FMTS)
def test_rows_a_kind_cannot_read_are_refused_in_words(fmt):
    vb = BLOCKS[fmt][0]
    k = vb + 16  # a row of a block and a half
    for launch in (Gemv("x", "w", fmt, Dst("y"), k, 8, 1),
                   GemmParts("x", fmt, k, 1, (GemmPart("w", Dst("y"), 8),)),
                   GemvGlu("x", "wg", "wu", fmt, "o", k, 8, 1),
                   Gather("E", "t", "o", k, format=fmt)):
        why = launch.check()
        assert why is not None and f"a row of {k} values in {fmt}" in why.reason and "whole blocks" in why.reason
    assert "reads f32, f16, bf16, q8_0" in Gemv("x", "w", "iq2_xxs", Dst("y"), 256, 8, 1).check().reason
    mixed = GemvGlu("x", "wg", "wu", fmt, "o", 256, 8, 1, format_u="bf16" if fmt != "bf16" else "f32")
    assert "different formats" in mixed.check().reason


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(FMTS), blocks_a_row=st.integers(1, 64), n=st.integers(1, 3000), m=st.integers(1, 9),
       sms=st.sampled_from([8, 132]))
def test_split_k_chunks_never_split_a_block(fmt, blocks_a_row, n, m, sms):
    """The schedule's split-K over block-format rows: every chunk holds whole blocks, and the tuned launch runs."""
    k = k_of(fmt, blocks_a_row)
    t = Gemv("x", "w", fmt, Dst("y"), k, n, m).tune(dataclasses.replace(Knobs(), sms=sms))
    assert t.check() is None, t.check()
    if t.split > 1:
        assert chunk(k, t.split) % BLOCKS[fmt][0] == 0


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(FMTS), m=st.integers(1, 12), blocks=st.integers(1, 64), n=st.integers(1, 70),
       seed=st.integers(0, 2**16), sms=st.sampled_from([4, 132]))
def test_tuned_gemv_twins_on_random_shapes(fmt, m, blocks, n, seed, sms):
    """Any shape the schedule tunes (rows a warp, split-K in whole blocks): the exact twin is the product of the
    decoded weights, the fast twin within f32 rounding of it."""
    k = k_of(fmt, blocks if BLOCKS[fmt][0] == 32 else 1 + blocks % 8)  # up to 2048 values a row
    launch = Gemv("x", "w", fmt, Dst("y"), k, n, m, bias="b").tune(dataclasses.replace(Knobs(), sms=sms, wide_rows=32))
    assert launch.check() is None
    g = np.random.default_rng(seed)
    raw, w = quantized(g, fmt, n, k)
    x, b = r32(g, m, k), r32(g, n)
    exact, fast = twins(launch, {"x": x, "y": np.zeros(m * n, np.float32)}, {"w": (raw, fmt), "b": (b, "f32")})
    close(exact.array("y").reshape(m, n), x.astype(np.float64) @ w.T + b)
    close(fast.array("y"), exact.array("y"), FAST_TOL)


def test_costs_see_the_quantized_bytes():
    """A q4_0 product moves a quarter of bf16's weight bytes (18 bytes a 32 values against 64), q8_0 about half: the
    extraction's cost (bytes over bandwidth) sees it."""
    k, n = 4096, 4096
    by = {f: Gemv("x", "w", f, Dst("y"), k, n, 1).checkpoint_bytes() for f in ("bf16", "q8_0", "q4_0", "q4_k", "q6_k")}
    assert by["bf16"] == 2 * n * k and by["q4_0"] == by["q4_k"] == n * k // 32 * 18
    assert by["q8_0"] == n * k // 32 * 34 and by["q6_k"] == n * k // 256 * 210
    assert by["q4_0"] / by["bf16"] == 0.28125
    total = {f: Gemv("x", "w", f, Dst("y"), k, n, 1).bytes() for f in by}
    assert total["q4_0"] < total["q8_0"] < total["bf16"]


# -- the demo model in each block format ----------------------------------------------------------------------------

def block_demo(fmt: str, max_len: int = 64):
    """The demo model (hidden 256: every row whole K-quant blocks) with each matrix stored in `fmt`."""
    cfg = demo_config(max_len)
    arrays = encode_matrices(random_arrays(cfg), fmt)
    cfg = dataclasses.replace(cfg, formats=tuple((n, f) for n, (_, f) in arrays.items() if f != "f32"))
    return cfg, Weights.from_dict(arrays, cfg)


def _rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("fmt", FMTS)
def test_block_demo_fused_plan_matches_the_reference(fmt):
    """Prefill chunks of 4 rows then decode: the exact twins (with LANEFUSE_CHECK=2's launch-by-launch comparison)
    and the fast twins each give the reference interpreter's greedy tokens (on the weights gguf dequantizes), logits
    within 1e-4 of their scale."""
    cfg, w = block_demo(fmt)
    assert {c.format for c in build_step(cfg, 1).constants.values() if c.kind == "rows"} == {fmt}
    plans = {}

    def runner(exact: bool, check: bool):
        def fn(g, env):
            rows = g.meta["rows"]
            if rows not in plans:
                plans[rows] = plan(g)
            key = (rows, exact, check)
            if key not in runners:
                runners[key] = NumpyRunner(plans[rows], w, check=check, exact=exact)
            return runners[key].step(env, lifted=g)
        return fn

    runners: dict = {}
    prompt, n = [3, 1, 4, 1, 5, 9], 6
    ref = generate(cfg, w, prompt, n, chunk=4)
    assert len(set(ref.generated_ids)) > 2
    for exact, check in ((True, True), (False, False)):
        got = generate(cfg, w, prompt, n, step_fn=runner(exact, check), chunk=4)
        assert got.generated_ids == ref.generated_ids, (exact, check)
        err = max(_rel(a, b) for a, b in zip(got.logits, ref.logits))
        assert err <= 1e-4, (exact, check, err)
    kinds = {type(x.launch).__name__ for s in plans.values() for x in s.launches}
    assert {"Fold", "GemvGlu", "Gemv"} <= kinds  # the products, the GLU and the folds all read the blocks


def test_plans_report_the_weight_bytes_a_step_reads():
    """The plan's weight bytes by format: every matrix once (the embedding one row), the quantized ones a fixed
    fraction of bf16's."""
    cfg = demo_config(64)
    by = {}
    for fmt in ("bf16", "q8_0", "q4_0", "q4_k", "q6_k"):
        c = dataclasses.replace(cfg, formats=tuple((n, fmt) for n, s in cfg.weight_names().items() if len(s) == 2))
        by[fmt] = plan(build_step(c, 1)).weight_bytes()
        assert list(by[fmt]) == [fmt]
    values = sum(s[0] * s[1] for n, s in cfg.weight_names().items() if len(s) == 2 and "embed" not in n)
    values += cfg.hidden + (cfg.vocab * cfg.hidden if cfg.tie_embeddings else 0)  # a row; all of it for tied logits
    assert by["bf16"]["bf16"] == 2 * values
    assert by["q4_0"]["q4_0"] == by["q4_k"]["q4_k"] == values // 32 * 18
    assert by["q8_0"]["q8_0"] == values // 32 * 34 and by["q6_k"]["q6_k"] == values // 256 * 210


# -- the command -----------------------------------------------------------------------------------------------------

def _cli(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", *args], capture_output=True, text=True,
                          timeout=300)


def _shape_folder(d, **over):
    import json

    cfg = demo_config()
    c = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": cfg.hidden, "num_hidden_layers": 2,
         "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
         "intermediate_size": cfg.inter, "vocab_size": cfg.vocab, "rms_norm_eps": cfg.eps, "rope_theta": 10000.0,
         "max_position_embeddings": 128, "hidden_act": "silu", "torch_dtype": "bfloat16", **over}
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(c))
    return d


def test_plan_prints_the_weight_bytes_and_weights_format_takes_the_block_formats(tmp_path):
    import json

    d = _shape_folder(tmp_path / "shape")
    r = _cli("plan", str(d), "--weights-format", "q4_0", "--json", "-")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert list(doc["weight_bytes"]["by_format"]) == ["q4_0"] and doc["weight_bytes"]["total"] > 0
    def formats(v):  # every `format` field, nested launches (a fold's, a chain's phases) included
        if isinstance(v, dict):
            return ({v["format"]} if "format" in v else set()) | set().union(*map(formats, v.values()))
        return set().union(*map(formats, v)) if isinstance(v, list) else set()

    assert formats([l["fields"] for l in doc["launches"]]) >= {"q4_0"}
    text = _cli("plan", str(d), "--weights-format", "q8_0")
    assert text.returncode == 0 and "weights read a step: " in text.stdout and "B (q8_0)" in text.stdout
    # a K-quant format the model's rows are not whole blocks of: one line naming the tensor
    odd = _shape_folder(tmp_path / "odd", intermediate_size=320)
    k = _cli("plan", str(odd), "--weights-format", "q4_k")
    assert k.returncode != 0 and len(k.stderr.strip().splitlines()) == 1, k.stderr
    assert "--weights-format q4_k: tensor `model.layers.0.mlp.down_proj.weight` [256, 320]" in k.stderr
    assert "Traceback" not in k.stderr


def test_the_demo_runs_and_checks_with_its_matrices_quantized():
    r = _cli("check", "--weights-format", "q4_k", "--rows", "1")
    assert r.returncode == 0 and "-> ok" in r.stdout, r.stdout + r.stderr
    import json

    run = _cli("run", "--weights-format", "q8_0", "--prompt-ids", "1,2,3", "--tokens", "4", "--json", "-")
    assert run.returncode == 0, run.stderr
    cfg, w = block_demo("q8_0")  # the same seeded matrices, quantized: the reference interpreter's tokens
    assert json.loads(run.stdout)["generated_ids"] == generate(cfg, w, [1, 2, 3], 4).generated_ids


STEP = """meta: {model: blocks-step, rows: 1}
weights: {random: 3}
io: {token: token, position: pos, caches: [[kc1, vc1]], logits: logits, next: next}
tensors: {token: "i32[1]", pos: "i32[1]", kc1: "f32[16, 64]", vc1: "f32[16, 64]"}
constants:
  emb: {shape: [40, 256], format: q6_k}
  wk: {shape: [64, 256], transposed: true, format: q4_k}
  wv: {shape: [64, 256], transposed: true, format: q4_0}
  wo: {shape: [40, 64], transposed: true, format: q8_0}
ops:
  - {op: gather, out: x, ins: [emb, token]}
  - {op: matmul, out: k, ins: [x, wk]}
  - {op: matmul, out: v, ins: [x, wv]}
  - {op: set_row, out: kc, ins: [kc1, k, pos]}
  - {op: set_row, out: vc, ins: [vc1, v, pos]}
  - {op: add, out: y, ins: [k, v]}
  - {op: matmul, out: logits, ins: [y, wo]}
  - {op: argmax, out: next, ins: [logits]}
"""


def test_a_step_yamls_random_weights_are_blocks_of_its_formats():
    """`weights: {random: SEED}` makes each constant in the format it declares (random blocks with finite scales),
    so the kernels read what the plan says they read; the plan runs against the reference."""
    from lanefuse.engine.front.stepweights import step_weights
    from lanefuse.engine.stepyaml import from_yaml

    g = from_yaml(STEP)
    w = step_weights(g)
    for name, fmt in (("emb", "q6_k"), ("wk", "q4_k"), ("wv", "q4_0"), ("wo", "q8_0")):
        assert w.format(name) == fmt and w.shape(name) == g.constants[name].shape
        v = w.get(name)
        assert np.isfinite(v).all() and 0.3 < float(v.std()) * np.sqrt(v.shape[1]) < 3  # about 1/sqrt(cols)
    s = plan(g)
    env = {"kc1": np.zeros((16, 64), np.float32), "vc1": np.zeros((16, 64), np.float32),
           "token": np.array([7], np.int32), "pos": np.array([2], np.int32)}
    from lanefuse.engine.interp import evaluate

    ref = evaluate(g, w, {k: v.copy() for k, v in env.items()})
    out = NumpyRunner(s, w, check=True).step({k: v.copy() for k, v in env.items()}, lifted=g)
    assert int(out["next"][0]) == int(ref["next"][0])
    close(out["logits"], ref["logits"], 1e-5)


def test_fast_twins_decode_launch_by_launch_where_memory_does_not_allow_once():
    """Past the decode budget (half the machine's memory by default; 0 here) the fast runner decodes each launch's
    rows as it runs and keeps no f32 copy: the same numbers as decoding once, to f32 rounding (decoded once, a tall
    stacked product reads its matrix stored transposed, which BLAS sums in another order)."""
    cfg, w = block_demo("q4_0")
    s = plan(build_step(cfg, 1))
    env = {k: np.zeros((64, cfg.kv_heads * cfg.head_dim), np.float32) for c in
           [(f"kc{i}", f"vc{i}") for i in range(cfg.layers)] for k in c}
    env.update(token=np.array([5], np.int32), pos=np.array([0], np.int32))
    streamed = NumpyRunner(s, w, exact=False, decode_budget=0)
    assert streamed.streamed
    a = streamed.step({k: v.copy() for k, v in env.items()})
    assert not any(f == "q4_0" for n, f in cfg.formats if n in w._f32)  # nothing decoded was kept
    once = NumpyRunner(s, w, exact=False)
    assert not once.streamed
    b = once.step({k: v.copy() for k, v in env.items()})
    scale = float(np.abs(b["logits"]).max())
    assert float(np.abs(a["logits"] - b["logits"]).max()) <= 1e-5 * scale and int(a["next"][0]) == int(b["next"][0])
