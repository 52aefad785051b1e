"""Launches no model's front reaches (issue 40: "rows only a hand-written step YAML reaches"), each planned from a
model-shaped step: the demo decoder's step as its front builds it, changed only where the seed's front computes
differently — its FFN lifted as one `swiglu` op (SwiGlu), a projection's matrix held as f32 values (GemvF32) — and
run by the numpy backend against the reference interpreter; why each exists is in its launch's docstring. Two are
reached by a real front: `elementwise_quant` (OLMo 2's post-normed residual sums under q8, here) and Slice /
`head_slice` (OLMo 2 over ranks, tests/test_ranks_families.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lanefuse.engine.front.demo import demo_model
from lanefuse.engine.front.model import build_step
from lanefuse.engine.interp import evaluate
from lanefuse.engine.ir import Op, attrs_of
from lanefuse.lane.lower.plan import plan
from lanefuse.lane.run.numpy_runner import NumpyRunner


@pytest.fixture(scope="module")
def demo():
    return demo_model(64)


def _decode(cfg, run, steps=3):
    """`steps` greedy decode steps from token 3 at position 0: the tokens and each step's logits."""
    env = {n: np.zeros(s, np.float32) for n, s in cfg.carried().items()}
    tok, toks, logits = 3, [], []
    for p in range(steps):
        env.update(token=np.array([tok], np.int32), pos=np.array([p], np.int32))
        out = run(env)
        tok = int(np.asarray(out["next"]).reshape(-1)[0])
        toks.append(tok)
        logits.append(np.asarray(out["logits"]).reshape(-1).copy())
    return toks, logits


def _same_run(cfg, g, w, want, **plan_kw):
    """The plan of `g` (numpy backend, exact twins) against the reference of `g`, and both against `want` (the
    front's own step's tokens and logits): the plan."""
    p = plan(g, **plan_kw)
    ref = _decode(cfg, lambda e: evaluate(g, w, e))
    got = _decode(cfg, NumpyRunner(p, w, exact=True).step)
    assert ref[0] == want[0] and got[0] == want[0]
    for a, b, c in zip(want[1], ref[1], got[1]):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * float(np.abs(a).max()))
        np.testing.assert_allclose(c, b, rtol=0, atol=1e-5 * float(np.abs(b).max()))
    return p


def as_swiglu(g):
    """Step `g` with each layer's gated MLP lifted as the seed's front lifts it: act(gate) · up as one `swiglu`
    (the seed's TensorOpSpec::SwiGlu) in place of the `silu` and the `mul`."""
    out = dataclasses.replace(g, tensors=dict(g.tensors), ops=[])
    acts = {op.out: op for op in g.ops if op.kind == "silu"}
    for op in g.ops:
        if op.kind == "silu":
            continue
        if op.kind == "mul" and op.ins[0] in acts:
            out.ops.append(Op("swiglu", (acts[op.ins[0]].ins[0], op.ins[1]), op.out, attrs_of({}), layer=op.layer))
            out.tensors.pop(op.ins[0])
            continue
        out.ops.append(op)
    out.validate()
    return out


def test_a_lifted_swiglu_runs_as_the_gate_up_launch_and_held_as_swiglu(demo):
    """The FFN lifted as `swiglu`: the gate and up products and their SwiGLU one GemvGlu launch a layer
    (gemv_gate_up_glu.swiglu); that rule held, the SwiGlu launch a layer; both the front's step's tokens."""
    cfg, w = demo
    g = build_step(cfg, 1)
    want = _decode(cfg, lambda e: evaluate(g, w, e))
    s = as_swiglu(g)
    assert [op.kind for op in s.ops].count("swiglu") == cfg.layers and "silu" not in {op.kind for op in s.ops}
    fused = _same_run(cfg, s, w, want)
    assert fused.fusions.get("gemv_gate_up_glu.swiglu") == cfg.layers and "swiglu" not in fused.census
    held = _same_run(cfg, s, w, want, held=("gemv_gate_up_glu.swiglu",))
    assert held.census.get("swiglu") == cfg.layers, held.census
    (sw,) = {x.launch for x in held.launches if x.launch.census == "swiglu" and x.launch.out == "L0.glu"}
    assert sw.n == cfg.inter


def test_a_projection_by_f32_values_runs_as_gemv_f32(demo):
    """A projection whose matrix the step holds as f32 values (not checkpoint rows: a matrix the seed's front
    computes, or a step YAML's values): the GemvF32 launch, with no format, the front's step's tokens."""
    cfg, w = demo
    g = build_step(cfg, 1)
    want = _decode(cfg, lambda e: evaluate(g, w, e))
    names = ["model.layers.1.self_attn.k_proj.weight", "lm_head.weight"]  # k: out of merged_qkv
    v = dataclasses.replace(g, constants=dict(g.constants))
    for n in names:
        v.constants[n] = dataclasses.replace(g.constants[n], kind="values", transposed=False)
    v.validate()
    p = _same_run(cfg, v, w, want)  # the same stored values, read as f32 values
    f32 = [x.launch for x in p.launches if x.launch.census == "gemv_f32"]
    assert sorted(x.w for x in f32) == sorted(names), p.census
    head = next(x for x in f32 if x.w == "lm_head.weight")
    assert (head.k, head.n, head.m) == (cfg.hidden, cfg.vocab, 1)


def test_olmo2_sums_read_by_products_quantize_as_they_are_stored():
    """elementwise_quant reached from a real front: OLMo 2 norms after its attention and its MLP (post-norms), so its
    residual sums are read by the next products themselves — the MLP's gate and up, the next layer's q, k and v. Under
    q8 over q8_0 rows each such add quantizes its sum as it stores it (the Binary launch's `quant`): 3 in 2 layers
    (the last sum is read by the final norm). Run by the exact twins (launch by launch against the interpreter), it
    equals the interpreter of the quantized step; held, Quant launches give the same logits to the bit."""
    from lanefuse.engine.formats.quantize import with_numerics
    from lanefuse.engine.front.families.olmo2 import Olmo2Config
    from lanefuse.engine.front.stepweights import random_weights

    base = Olmo2Config("Olmo2ForCausalLM", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, inter=128,
                       vocab=96, max_len=24, tie_embeddings=False)
    g = build_step(base, 1)
    cfg = dataclasses.replace(base, formats=tuple((c.name, "q8_0") for c in g.constants.values()
                                                  if c.kind == "rows"))
    g = build_step(cfg, 1)
    w = random_weights(g, 3).with_config(cfg)
    p = plan(g, numerics="q8")
    assert p.fusions.get("elementwise_quant") == 3, p.fusions
    sums = [x.launch for x in p.launches if x.launch.census == "binary" and x.launch.quant]
    assert sorted(s.out for s in sums) == ["L0.resid_attn", "L0.resid_ffn", "L1.resid_attn"]
    gq = with_numerics(g, "q8")
    env = {"token": np.array([5], np.int32), "pos": np.array([0], np.int32)}
    env.update({n: np.zeros(g.tensors[n].shape, np.float32) for n in g.io.tables})
    want = evaluate(gq, w, {k: v.copy() for k, v in env.items()})
    got = NumpyRunner(p, w, check=True).step({k: v.copy() for k, v in env.items()}, lifted=g)
    assert np.abs(got["logits"] - want["logits"]).max() <= 1e-6 * np.abs(want["logits"]).max()  # test_quant_lane's
    held = plan(g, numerics="q8", held=("elementwise_quant",))
    assert "elementwise_quant" not in held.fusions and held.census["quant"] > p.census.get("quant", 0)
    again = NumpyRunner(held, w, check=True).step({k: v.copy() for k, v in env.items()}, lifted=g)
    assert np.array_equal(again["logits"], got["logits"])


def mla_one_cache(voff: int, H: int = 4, c: int = 32, r: int = 16, d: int = 64, L: int = 16, V: int = 50):
    """A latent attention's decode step over ONE cache a layer, as vLLM and llama.cpp keep DeepSeek's compressed KV:
    each row the latent (c values) and the rotated key (r) side by side (`voff` 0: latent first; r: rope first),
    written whole by one row write; the queries already in latent space (absorbed) attend over whole rows as keys and
    read the latent part of each row as values (Attention `vstride` = c + r, `voff`), no join of the caches a step."""
    from lanefuse.engine.ir import Access, Constant, Graph, StepIO

    g = Graph(io=StepIO(caches=(("kv", "kv"),)))
    g.tensor("token", (1,), "i32")
    g.tensor("pos", (1,), "i32")
    g.tensor("kv", (L, c + r))
    g.constant(Constant("emb", (V, d), "rows"))
    for n, shape in (("wq", (H * (c + r), d)), ("wkv", (c + r, d)), ("wo", (V, H * c))):
        g.constant(Constant(n, shape, "rows", transposed=True))
    g.add("gather", ["emb", "token"], "x")
    g.add("matmul", ["x", "wq"], "q")  # (1, H·(c + r)): each head's absorbed query and its rotated part
    g.add("matmul", ["x", "wkv"], "row")  # (1, c + r): the row the cache keeps
    g.add("set_row", ["kv", "row", "pos"], "kvc")
    g.add("attention", ["q", "kvc", "kvc", "pos"], "a", access=(None, None, Access(c + r, voff, c)), heads=H,
          kv_heads=1, hd=c + r, vd=c, scale=(c + r) ** -0.5, window=0, softcap=0.0)  # (1, H·c)
    g.add("matmul", ["a", "wo"], "logits")
    g.add("argmax", ["logits"], "next")
    g.validate()
    return g


@pytest.mark.parametrize("voff", [0, 16])
def test_values_read_as_a_part_of_the_key_rows(voff):
    """Attention `vstride` / `voff` from a latent attention's one cache: the plan's attention launch reads its values
    at pitch c + r from `voff` in the key table itself; 4 decode steps by the exact twins equal the reference, to
    the bit, the cache too."""
    from lanefuse.engine.front.weights import Weights

    g = mla_one_cache(voff)
    rng = np.random.default_rng(7)
    w = Weights.from_dict({n: (rng.standard_normal(c.shape) / np.sqrt(c.shape[1])).astype(np.float32)
                           for n, c in g.constants.items()})
    p = plan(g)
    (att,) = [x.launch for x in p.launches if x.launch.census == "attention"]
    assert (att.kc, att.vc, att.vstride, att.voff, att.hd, att.vd) == ("kvc", "kvc", 48, voff, 48, 32)
    run = NumpyRunner(p, w, exact=True)
    ref_kv, got_kv, tok = np.zeros((16, 48), np.float32), np.zeros((16, 48), np.float32), 3
    for step in range(4):
        want = evaluate(g, w, {"token": np.array([tok], np.int32), "pos": np.array([step], np.int32), "kv": ref_kv})
        got = run.step({"token": np.array([tok], np.int32), "pos": np.array([step], np.int32), "kv": got_kv})
        assert np.array_equal(got["logits"].reshape(-1), np.asarray(want["logits"]).reshape(-1))
        assert np.array_equal(got_kv, ref_kv) and np.abs(ref_kv[step]).max() > 0
        tok = int(np.asarray(want["next"]).reshape(-1)[0])
