"""The chains in the lane (issue 34): rule `qkv_attn_o_glu_down_norm` (a decode layer's q/k/v fold, then the four
phases below) -> Chain((Fold(GemmParts, RopeParts), Attention, ...)); held, rule `attn_o_glu_down_norm` (a decode
layer's attention, then the three phases below) -> the cuda lane's Chain((Attention, Fold(Gemv, Norm), GemvGlu, Fold(Gemv, Norm))); held, rule
`o_glu_down_norm` (rules/ffn.yaml: the o product with the residual's add and the post-attention norm, the gate/up GLU,
then the down product with the residual's add and the next norm) -> Chain((Fold(Gemv, Norm), GemvGlu, Fold(Gemv,
Norm))), and held, rule `glu_down_norm` (the last two phases) -> Chain((GemvGlu, Fold(Gemv, Norm))); each chosen by
the extraction's cost (one launch's fixed cost less) and held like any rule. A chain's numpy twin is its phases' twins
in order, so a decode step's numbers are the unchained plan's to the bit; a prompt's chunk of more rows than the
chained kernels take, and the q8 numerics, keep the launches."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lanefuse.engine.front.demo import demo_model, random_arrays
from lanefuse.engine.front.model import ModelConfig, build_step
from lanefuse.engine.front.weights import Weights, f32_to_bf16
from lanefuse.kernels import Chain, GemvGlu
from lanefuse.lane.lower.plan import PlanOptions, plan
from lanefuse.lane.run.generate import generate
from lanefuse.lane.run.step import plan_step_fn

HOLD5 = ("qkv_attn_o_glu_down_norm",)  # the five-phase rule held: the q/k/v fold apart, the four-phase chain
HOLD = HOLD5 + ("attn_o_glu_down_norm", "o_glu_down_norm", "glu_down_norm")  # all held: no chain
HOLD3 = HOLD5 + ("attn_o_glu_down_norm", "o_glu_down_norm")  # the five-, four-, three-phase held: the two-phase chain
HOLD4 = HOLD5 + ("attn_o_glu_down_norm",)  # the five- and four-phase rules held: the three-phase chain


def tiny_bf16():
    """A tiny Qwen3 (awkward sizes: FFN 88, hidden 40), every layer matrix a bf16 checkpoint tensor."""
    base = ModelConfig("Qwen3ForCausalLM", 40, 3, 4, 2, 16, 88, 97, qk_norm=True, max_len=64, name="tiny")
    arrays = random_arrays(base, seed=11)
    names = tuple(n for n, a in arrays.items() if ".layers." in n and np.ndim(a) == 2)
    cfg = dataclasses.replace(base, formats=tuple((n, "bf16") for n in names))
    for n in names:
        arrays[n] = f32_to_bf16(arrays[n])
    return cfg, Weights.from_dict(arrays, cfg)


def chains(p) -> list[Chain]:
    return [x.launch for x in p.launches if isinstance(x.launch, Chain)]


@pytest.mark.parametrize("model", ["demo", "bf16"])
def test_a_decode_step_chains_each_layers_o_and_mlp_and_held_keeps_the_launches(model):
    cfg, w = demo_model() if model == "demo" else tiny_bf16()
    g = build_step(cfg, 1)
    five, on, three = plan(g), plan(g, held=list(HOLD5)), plan(g, held=list(HOLD4))
    two, off = plan(g, held=list(HOLD3)), plan(g, held=list(HOLD))
    assert len(chains(on)) == cfg.layers and on.census["chain"] == cfg.layers and "gemv_glu" not in on.census
    assert "attention" not in on.census and three.census["attention"] == cfg.layers
    assert all(len(c.phases) == 4 for c in chains(on)) and all(len(c.phases) == 3 for c in chains(three))
    assert all(len(c.phases) == 2 for c in chains(two))
    assert len(chains(two)) == cfg.layers and two.fusions.get("glu_down_norm", 0) == cfg.layers
    assert not chains(off) and off.census["gemv_glu"] == cfg.layers
    assert on.n_launches == three.n_launches - cfg.layers == two.n_launches - 2 * cfg.layers \
        == off.n_launches - 3 * cfg.layers
    assert on.fusions.get("attn_o_glu_down_norm", 0) == cfg.layers and "glu_down_norm" not in on.fusions
    assert "o_glu_down_norm" not in on.fusions and three.fusions.get("o_glu_down_norm", 0) == cfg.layers
    for c in chains(on) + chains(three) + chains(two):
        assert c.check() is None and c.kernels() == (c,)
        assert all(p.first.per_warp == c.glu.per_warp and p.first.split == 1 for p in c.phases
                   if p is not c.glu and p.census == "fold")
    # each chain's phases are the held plans' launches, in order: the attention the held plan's own launch
    o_folds = [x.launch for x in two.launches if x.launch.census == "fold"]
    attentions = [x.launch for x in three.launches if x.launch.census == "attention"]
    assert [c.phases[1:] for c in chains(on)] == [c.phases for c in chains(three)]
    assert [c.phases[0] for c in chains(on)] == attentions
    assert [c.phases[1:] for c in chains(three)] == [c.phases for c in chains(two)]
    assert all(c.phases[0] in o_folds for c in chains(three))
    # the five-phase chain (qkv_attn_o_glu_down_norm): the held plan's q/k/v fold (its products at the chain's outputs
    # a warp), then the four-phase chain's phases; one launch a layer fewer
    assert len(chains(five)) == cfg.layers and all(len(c.phases) == 5 for c in chains(five))
    assert five.n_launches == on.n_launches - cfg.layers and five.fusions["qkv_attn_o_glu_down_norm"] == cfg.layers
    assert [c.phases[1:] for c in chains(five)] == [c.phases for c in chains(on)]
    qkv = [x.launch for x in on.launches if x.launch.census == "fold" and x.launch.form()[0] == "parts_rope"]
    assert [c.phases[0] for c in chains(five)] == [
        dataclasses.replace(f, first=dataclasses.replace(f.first, per_warp=c.glu.per_warp))
        for f, c in zip(qkv, chains(five))]
    assert all(c.check() is None and c.kernels() == (c,) for c in chains(five))


def test_a_chunk_of_up_to_eight_rows_chains_and_of_nine_keeps_the_launches():
    """A prompt's chunk of 3..8 rows over f32 rows chains every layer but the last (whose down product's next norm
    reads the last row only): every product phase on chain.cu's slab, four outputs a warp; past the slab's 8 rows the
    plan keeps its launches."""
    cfg, _ = demo_model()
    for m in (3, 8):
        p = plan(build_step(cfg, m))
        assert len(chains(p)) == cfg.layers - 1 and p.census["gemv_glu"] == 1
        assert all(c.glu.m == m and c.check() is None for c in chains(p))
        assert all(ph.first.per_warp == 4 for c in chains(p) for ph in c.phases if ph.census == "fold")
        assert all(c.glu.per_warp == 4 for c in chains(p))
    p = plan(build_step(cfg, 9))
    assert not chains(p) and p.census["gemv_glu"] == cfg.layers


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_a_batch_of_block_rows_past_two_keeps_the_launches(fmt):
    """Block-format rows at a batch of 4 (past two rows the chained kernel's slab takes f32/f16/bf16 rows only): no
    chain, the held plan's launches; at a batch of 2 each layer one chain."""
    from test_quant import q8_model

    cfg, _ = q8_model(fmt)
    p, held = (plan(build_step(cfg, 1, batch=4), held=h) for h in ([], list(HOLD)))
    assert not chains(p) and p.census == held.census
    assert len(chains(plan(build_step(cfg, 1, batch=2)))) == cfg.layers


@pytest.mark.parametrize("numerics", ["q8", "q8x2"])
def test_the_q8_numerics_keep_two_launches_over_quantized_activations(numerics):
    """Over a quantized activation (q8_0 rows under the q8 numerics) the chained kernel has no body (gemv_q8.cu's):
    the chain is refused and the plan is the one it was; f32 rows, read by the f32 products under any numerics,
    chain."""
    from test_quant import q8_model

    cfg, _ = q8_model("q8_0")
    p = plan(build_step(cfg, 1), numerics=numerics)
    held = plan(build_step(cfg, 1), numerics=numerics, held=list(HOLD))
    assert not chains(p) and p.census == held.census
    cfg, _ = demo_model()
    assert len(chains(plan(build_step(cfg, 1), numerics=numerics))) == cfg.layers


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_block_rows_under_f32_numerics_chain_to_the_bit(fmt):
    """q8_0 / q4_k rows read by the f32 products (the default numerics): chained, and the decode step's logits equal
    the held plan's to the bit."""
    from lanefuse.lane.run.numpy_runner import NumpyRunner
    from test_quant import _env, q8_model

    cfg, w = q8_model(fmt)
    g = build_step(cfg, 1)
    on, off = plan(g), plan(g, held=list(HOLD))
    assert len(chains(on)) == cfg.layers
    a, b = (NumpyRunner(p, w, exact=True).step(_env(g, cfg, token=7, pos=0)) for p in (on, off))
    np.testing.assert_array_equal(a["logits"], b["logits"])


@pytest.mark.parametrize("model", ["demo", "bf16"])
def test_chained_tokens_and_logits_equal_the_unchained_plan_to_the_bit(model):
    """Greedy tokens through the exact twins: the four-phase chained plan's logits equal the three-phase one's, the
    two-phase one's and the unchained plan's to the bit at every step (a prompt's chunk of 5 rows, then decode
    steps), and the reference interpreter's tokens (logits within 1e-5 of their scale), as tests/test_hf_parity.py
    compares."""
    cfg, w = demo_model() if model == "demo" else tiny_bf16()
    prompt = [int(t) for t in np.random.default_rng(5).integers(1, cfg.vocab, 5)]

    def run(held):
        fn, _ = plan_step_fn(w, "cpu", PlanOptions(held=held), exact=True)
        return generate(cfg, w, prompt, 6, step_fn=fn, chunk=8)

    got, three, two, apart = run(()), run(HOLD4), run(HOLD3), run(HOLD)
    ref = generate(cfg, w, prompt, 6, chunk=8)
    assert got.generated_ids == three.generated_ids == two.generated_ids == apart.generated_ids == ref.generated_ids
    for x, x3, x2, y, z in zip(got.logits, three.logits, two.logits, apart.logits, ref.logits):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(x3, y)
        np.testing.assert_array_equal(x2, y)
        assert np.abs(np.asarray(x, np.float64) - z).max() <= 1e-5 * float(np.abs(z).max())


def test_the_conservative_lane_runs_the_chain_as_its_parts():
    cfg, _ = demo_model()
    p = plan(build_step(cfg, 1), lane="conservative")
    assert not chains(p)


def test_a_chain_of_gemv_glu_launches_refuses_other_pairs_in_one_line():
    glu = GemvGlu("x", "wg", "wu", "bf16", "h", 64, 32, 1)
    r = Chain((glu, glu)).check()
    assert r is not None and "no chained kernel runs a gemv_glu then a gemv_glu" in str(r) and "\n" not in str(r)
