"""Expert parallelism in the reference interpreter and the numpy backend: a mixture's `moe` op over a rank's part of
its experts (`lo`, `local`: engine/opdefs.py), the parts summing to the whole mixture; rank r's step of a Qwen3-MoE
(a dense layer among its sparse ones) and of a Qwen2-MoE (its shared expert split like a dense FFN) over R = 2 and 3
ranks (7 experts: uneven parts 4/3 and 3/2/2), decode and a 5-row chunk after a 3-row one, f32 and bf16, against the
one-rank step; the Moe launch's twins over a part; each rank's weights (only its experts' rows read) and bytes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lanefuse.engine.errors import UserError
from lanefuse.engine.front.families.mixtures import MoeConfig
from lanefuse.engine.front.model import ModelConfig, build_step
from lanefuse.engine.front.parallel import (build_rank_step, check_ranks, expert_part, rank_config, rank_weight_bytes,
                                            rank_weights)
from lanefuse.engine.interp import OP_IMPL, evaluate
from ranks_helpers import RankPlans, after_a_chunk, assert_same_step, env, in_format, seeded_weights, stored_weights

QWEN3, QWEN2 = "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"


def _cfg(arch: str, ranks: int, fmt: str = "f32") -> ModelConfig:
    """3 layers, the middle one dense (FFN 40: Qwen3-MoE's mlp_only_layers); 7 experts of 20, top 2; Qwen2-MoE's
    shared expert of 30; 2R heads over R KV heads of 8; vocabulary 61."""
    m = MoeConfig(experts=7, k=2, inter=20, norm_topk=arch == QWEN3, sparse=(0, 2),
                  shared_inter=30 if arch == QWEN2 else 0)
    return in_format(ModelConfig(arch, 32, 3, 2 * ranks, ranks, 8, 40, 61, qk_norm=arch == QWEN3,
                                 qkv_bias=arch == QWEN2, max_len=24, moe=m), fmt)


def _weights(cfg):
    return seeded_weights(cfg, 3)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(1, 4), st.integers(1, 5), st.integers(1, 3), st.integers(0, 2**31 - 1),
       st.sampled_from(["softmax_topk", "topk_softmax"]))
def test_moe_parts_sum_to_the_mixture(experts, k, ranks, rows, seed, routing):
    """Whatever the experts, top-k and ranks (more ranks than experts: some hold none), the parts' sum in f64 is the
    whole mixture's within f32 rounding; a part's rows are zero where none of its experts was chosen."""
    k, ranks = min(k, experts), min(ranks, experts)
    r = np.random.default_rng(seed)
    d, f = 6, 5
    x = r.standard_normal((rows, d)).astype(np.float32)
    wr = (3 * r.standard_normal((experts, d))).astype(np.float32)
    gu = r.standard_normal((experts * 2 * f, d)).astype(np.float32)
    dn = r.standard_normal((experts * d, f)).astype(np.float32)
    a = dict(experts=experts, k=k, inter=f, norm_topk=True, routing=routing)
    whole = OP_IMPL["moe"](x, wr, gu, dn, **a)
    total = np.zeros_like(whole, dtype=np.float64)
    for rank in range(ranks):
        lo = rank * experts // ranks
        hi = (rank + 1) * experts // ranks
        part = OP_IMPL["moe"](x, wr, gu[lo * 2 * f:hi * 2 * f], dn[lo * d:hi * d], lo=lo, local=hi - lo, **a)
        total += part
    np.testing.assert_allclose(total, whole, rtol=1e-5, atol=1e-5 * float(np.abs(whole).max() + 1))


def test_expert_parts_are_uneven_and_whole():
    cfg = _cfg(QWEN3, 3)
    assert [expert_part(cfg, r, 3) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [expert_part(cfg, r, 2) for r in range(2)] == [(0, 4), (4, 7)]


@pytest.mark.parametrize("arch", [QWEN3, QWEN2])
@pytest.mark.parametrize("ranks", [2, 3])
def test_rank_step_of_a_mixture(arch, ranks):
    """Each sparse layer's mixture a `moe` over the rank's experts (the router whole) and one all-reduce after its
    sum (with the shared expert's part where it has one); the dense layer's FFN split as Megatron splits it."""
    cfg = _cfg(arch, ranks)
    for r in range(ranks):
        g = build_rank_step(cfg, r, ranks, 1)
        lo, hi = expert_part(cfg, r, ranks)
        moes = [op for op in g.ops if op.kind == "moe"]
        assert [op.layer for op in moes] == [0, 2]
        assert all(op.a["lo"] == lo and op.a["local"] == hi - lo and op.a["experts"] == 7 for op in moes)
        assert g.constants["model.layers.0.mlp.gate.weight"].shape == (7, 32)
        assert g.constants["model.layers.2.mlp.experts.gate_up_proj"].shape == ((hi - lo) * 40, 32)
        reduced = [op.ins[0] for op in g.ops if op.kind == "all_reduce"]
        ffn = "moe_out" if arch == QWEN2 else "moe"
        assert reduced == ["L0.o", f"L0.{ffn}", "L1.o", "L1.down", "L2.o", f"L2.{ffn}"]
        if arch == QWEN2:
            assert g.constants["model.layers.0.mlp.shared_expert.down_proj.weight"].shape[1] == \
                rank_config(cfg, r, ranks).moe.shared_inter
            assert g.constants["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 32)


@pytest.mark.parametrize("arch", [QWEN3, QWEN2])
@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("rows", [1, 5])
def test_mixture_ranks_equal_one_rank(arch, fmt, ranks, rows):
    """R ranks' step (decode, or a 5-row chunk, after a 3-row chunk) against the one-rank step: the same next token,
    the logits within f32 rounding of the sums' order; each rank's caches its KV heads of the one rank's."""
    cfg = _cfg(arch, ranks, fmt)
    run = after_a_chunk(cfg, _weights(cfg), ranks, [(7 * i + rows) % 61 for i in range(rows)])
    scale = assert_same_step(run.got, run.want)
    hd = cfg.head_dim
    for r, e in enumerate(run.envs):
        np.testing.assert_allclose(e["vc2"], run.one["vc2"][:, r * hd:(r + 1) * hd], atol=1e-5 * scale)


@pytest.mark.parametrize("arch, ranks, rows, fmt, exact", [(QWEN3, 2, 1, "bf16", True), (QWEN3, 3, 5, "f32", False),
                                                          (QWEN2, 2, 5, "f32", True), (QWEN2, 3, 1, "bf16", False)])
def test_mixture_rank_plans_run_by_the_numpy_backend(arch, ranks, rows, fmt, exact):
    """Each rank's step planned for the cuda lane (its mixtures Moe launches over its experts; Qwen2-MoE's shared
    expert's part inside them, shared_expert_fusion over the rank's part; the mixture's residual add and norm not: the
    part is summed over the ranks first, every all-reduce taking the residual add and the next norm) and run by the
    numpy backend's exact or fast twins, the ranks meeting through LocalComm: the reference ranks' next token, the
    logits within 1e-5 of their scale."""
    from lanefuse.kernels import Moe
    cfg = _cfg(arch, ranks, fmt)
    ranked = RankPlans(cfg, _weights(cfg), ranks, [(5 * i + 1) % 61 for i in range(rows)])
    shared = arch == QWEN2
    for r, s in enumerate(ranked.plans):
        lo, hi = expert_part(cfg, r, ranks)
        moes = [l.launch for l in s.launches if isinstance(l.launch, Moe)]
        assert len(moes) == 2 and all((m.lo, m.local, m.experts, m.shared) == (lo, hi - lo, 7, shared) for m in moes)
        fused = {n.split(".")[0] for n in s.fusions}
        assert not {"moe_deferred_finalize", "moe_token_sort"} & fused
        assert ("shared_expert_fusion" in fused) == shared
        if shared:  # the shared expert's part: its rows cut to the rank's 15 of 30 (10 of 30 over 3 ranks)
            assert all(m.sf == 30 // ranks for m in moes)
        assert s.census["collective"] == 2 * 3 + 1
    ranked.check(exact)


@pytest.mark.parametrize("sort", [False, True])
@pytest.mark.parametrize("twin", ["numpy", "fast"])
def test_moe_launch_twins_over_a_part(sort, twin):
    """The Moe launch over experts 2..4 of 7 (its weights theirs alone): the reference interpreter's part; its
    bytes read are its share (the router whole)."""
    from lanefuse.kernels import Dst, HostEnv, Moe

    r = np.random.default_rng(11)
    E, k, d, f, rows, lo, n = 7, 3, 32, 24, 4, 2, 3
    x = r.standard_normal((rows, d)).astype(np.float32)
    wr = (3 * r.standard_normal((E, d)) / d ** 0.5).astype(np.float32)
    gu = (r.standard_normal((n * 2 * f, d)) / d ** 0.5).astype(np.float32)
    dn = (r.standard_normal((n * d, f)) / f ** 0.5).astype(np.float32)
    want = OP_IMPL["moe"](x, wr, gu, dn, experts=E, k=k, inter=f, norm_topk=True, lo=lo, local=n)
    assert np.abs(want).max() > 0  # some row chose one of the part's experts
    env = HostEnv({"x": x.ravel(), "y": np.zeros(rows * d, np.float32)},
                  {"wr": (wr, "f32"), "wgu": (gu, "f32"), "wd": (dn, "f32")})
    m = Moe("x", "wr", "wgu", "wd", Dst("y"), d, f, E, k, rows, "f32", norm_topk=True, sort=sort, lo=lo, local=n)
    assert m.check() is None
    getattr(m, twin)(env)
    np.testing.assert_allclose(env.array("y").reshape(rows, d), want, rtol=2e-5, atol=2e-5)
    whole = Moe("x", "wr", "wgu", "wd", Dst("y"), d, f, E, k, rows, "f32", norm_topk=True, sort=sort)
    assert m.checkpoint_bytes() < whole.checkpoint_bytes()
    # the part's expert reads: 4 rows x 3 choices x 3/7 of them its own, 6 expected a row at a time; sorted, each of
    # its 3 experts once
    assert m.chosen() == (3 if sort else 6)
    assert Moe("x", "wr", "wgu", "wd", Dst("y"), d, f, E, k, rows, "f32", lo=5, local=3).check() is not None


def test_rank_weights_read_only_their_experts():
    """A rank's stacked experts are rows of the whole stack; from a per-expert checkpoint (4.x spelling) only its
    experts' tensors are read."""
    from lanefuse.engine.front.families.mixtures import ExpertStore
    from lanefuse.engine.front.weights import DictStore, Weights

    cfg = _cfg(QWEN3, 3)
    w = _weights(cfg)
    name = "model.layers.2.mlp.experts.gate_up_proj"
    full = w.get(name)
    for r in range(3):
        lo, hi = expert_part(cfg, r, 3)
        np.testing.assert_array_equal(rank_weights(w, cfg, r, 3).get(name), full[lo * 40:hi * 40])
    # the 4.x spelling: expert e's gate_proj and up_proj (20, 32) each, its down_proj (32, 20)
    arrays = {n: a for n, (a, _) in w.store.arrays.items() if ".experts." not in n}
    for i in (0, 2):
        gu = w.get(f"model.layers.{i}.mlp.experts.gate_up_proj").reshape(7, 40, 32)
        dn = w.get(f"model.layers.{i}.mlp.experts.down_proj").reshape(7, 32, 20)
        for e in range(7):
            arrays[f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight"] = gu[e, :20]
            arrays[f"model.layers.{i}.mlp.experts.{e}.up_proj.weight"] = gu[e, 20:]
            arrays[f"model.layers.{i}.mlp.experts.{e}.down_proj.weight"] = dn[e]
    read: list[str] = []

    class Counting(DictStore):
        def raw(self, n):
            read.append(n)
            return super().raw(n)

    stacked = Weights(ExpertStore(Counting(arrays), cfg, "test"), cfg)
    mine = rank_weights(stacked, cfg, 1, 3)  # experts 3, 4
    np.testing.assert_array_equal(mine.get(name), full[3 * 40:5 * 40])
    np.testing.assert_array_equal(mine.get("model.layers.2.mlp.experts.down_proj"),
                                  w.get("model.layers.2.mlp.experts.down_proj")[3 * 32:5 * 32])
    experts = {n.split(".experts.")[1].split(".")[0] for n in read if ".experts." in n}
    assert experts == {"3", "4"}


def test_rank_weight_bytes_of_a_mixture():
    """Each rank holds its experts once, the router, norms and embedding whole on every rank."""
    cfg = _cfg(QWEN2, 3, "bf16")
    one = rank_weight_bytes(cfg, 1)[0]
    three = rank_weight_bytes(cfg, 3)
    routers = 2 * 2 * (7 * 32) + 2 * 2 * 32  # two layers' router rows and shared-expert gate rows (bf16)
    whole = 2 * 61 * 32 + 4 * 32 * (1 + 2 * 3) + routers  # the embedding, the norms (f32), the routers
    assert sum(three) == one + 2 * whole
    # rank 0 holds 3 experts to rank 1's 2 (the shared experts' parts 10 each), one more of the dense layer's FFN
    # values (14 to 13: its gate, up and down) and one more LM-head row (21 to 20)
    per_expert = 2 * 2 * (40 * 32 + 32 * 20)  # two layers' gate_up and down rows of one expert (bf16)
    assert three[0] - three[1] == per_expert + 2 * 3 * 32 + 2 * 32


def test_mixture_refusals():
    cfg = _cfg(QWEN3, 2)
    with pytest.raises(UserError, match="7 experts over 8 ranks") as e:
        check_ranks(dataclasses.replace(cfg, kv_heads=8, heads=16), 8)
    assert "\n" not in str(e.value)


# -- DeepSeek-V3: latent attention split by query heads, the grouped mixture by experts ------------------------------

def _deepseek(fmt: str = "f32"):
    """tests/test_deepseek.py's tiny DeepSeek-V3: 4 heads (the latent of 16 and rotated key of 8 whole on every
    rank), a dense first layer (FFN 37), then 8 experts of 11 in 4 groups (top 3 of the best 2 groups, a correction
    bias) and a shared expert of 11."""
    from test_deepseek import tiny_cfg

    return in_format(tiny_cfg(), fmt)


@pytest.mark.parametrize("ranks, fmt", [(2, "f32"), (4, "bf16"), (3, "f32")])
@pytest.mark.parametrize("rows", [1, 5])
def test_deepseek_ranks_equal_one_rank(ranks, fmt, rows):
    """R ranks' DeepSeek-V3 step against one rank's: each rank its query heads (q, the key and value expansions and o
    cut by heads), the latent and rotated-key caches whole on every rank (the same rows on each), its experts of the
    grouped mixture (the routing over all 8 on every rank), its part of the shared expert; R = 3 refused (4 heads)."""
    cfg = _deepseek(fmt)
    if ranks == 3:
        with pytest.raises(UserError, match="3 ranks do not divide .*4 heads") as e:
            check_ranks(cfg, 3)
        assert "\n" not in str(e.value)
        return
    run = after_a_chunk(cfg, _weights(cfg), ranks, [(7 * i + rows) % 97 for i in range(rows)])
    scale = assert_same_step(run.got, run.want)
    for r, e in enumerate(run.envs):  # the latent cache: every rank's the one rank's
        np.testing.assert_allclose(e["kc2"], run.one["kc2"], atol=1e-5 * scale)
    gs = run.graphs
    moes = [op for op in gs[-1].ops if op.kind == "moe"]
    assert [op.a["lo"] for op in moes] == [8 - 8 // ranks] * 2 and gs[-1].ops[-1].kind == "all_argmax"
    assert [op.a["heads"] for op in gs[0].ops if op.kind == "attention"] == [4 // ranks] * 3


def test_deepseek_rank_plans_run_by_the_numpy_backend():
    """Each rank's DeepSeek-V3 decode step planned (the latent attention's fusions on its heads, its grouped mixture
    a Moe over its experts with its part of the shared experts inside: shared_expert_fusion.grouped) and run by the
    numpy backend's exact twins."""
    from lanefuse.kernels import Moe
    cfg = _deepseek("bf16")
    ranked = RankPlans(cfg, _weights(cfg), 2, [5])
    for r, s in enumerate(ranked.plans):
        moes = [l.launch for l in s.launches if isinstance(l.launch, Moe)]
        assert [(m.lo, m.local, m.groups, m.shared) for m in moes] == [(4 * r, 4, 4, True)] * 2
        assert s.fusions.get("shared_expert_fusion.grouped") == 2
        assert s.fusions.get("mla.absorbed") == 3
    ranked.check()


# -- gpt-oss: biased q/k/v/o and attention sinks split by heads, its biased, clamped experts by experts -------------

def _gptoss(fmt: str = "f32"):
    """tests/test_gptoss.py's tiny gpt-oss: 4 heads over 2 KV heads of 8 (their sinks), sliding and full layers,
    8 experts of 37, top 2 (topk then softmax, router and expert biases, the clamped GLU)."""
    from test_gptoss import tiny_cfg

    return in_format(tiny_cfg(layers=2), fmt)


def _gptoss_weights(cfg):
    """Random weights under the names the step reads (gpt-oss's stacked rows and their biases)."""
    return stored_weights(cfg, 3, vector=3.0)


@pytest.mark.parametrize("fmt, rows, plan_it", [("f32", 1, False), ("bf16", 5, False), ("bf16", 1, True),
                                                ("f32", 5, True)])
def test_gptoss_ranks_equal_one_rank(fmt, rows, plan_it):
    """gpt-oss over 2 ranks (its KV heads): each rank its heads' q/k/v rows and biases, sinks and o columns (o's
    bias added after the all-reduce, once), 4 of the 8 experts with their gate/up and down biases (the router and its
    bias whole); against one rank, by the reference interpreter or each rank's plan on the numpy backend."""
    from lanefuse.kernels import Moe

    cfg = _gptoss(fmt)
    w = _gptoss_weights(cfg)
    toks = [(7 * i + rows) % 97 for i in range(rows)]
    ranked = RankPlans(cfg, w, 2, toks)
    sinks = "model.layers.0.self_attn.sinks"
    assert ranked.weights[1].get(sinks).tolist() == w.get(sinks)[2:].tolist()
    if plan_it:
        for r, s in enumerate(ranked.plans):
            moes = [l.launch for l in s.launches if isinstance(l.launch, Moe)]
            assert [(m.lo, m.local, m.bgu is not None) for m in moes] == [(4 * r, 4, True)] * 2
    assert_same_step(ranked.run() if plan_it else ranked.want, evaluate(build_step(cfg, rows), w, env(cfg, toks)))


@pytest.mark.parametrize("rows", [1, 5])
def test_qwen2_moe_ranks_under_q8_numerics(rows):
    """A q8_0 Qwen2-MoE (its shared expert of 128: 64 a rank, whole blocks of 32) over 2 ranks under the q8 numerics:
    each rank's Moe launches take its part of the shared expert with the input and the GLU quantized inside them
    (shared_expert_fusion.quant over the rank's experts), and the ranks' plans run by the exact twins give the one
    rank's q8 plan's token and logits (to the bit here: the quantized products' block sums are the one rank's, the
    all-reduce sums them in f64 once), which are not the f32 numerics' (0.7% of their scale apart)."""
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.numpy_runner import NumpyRunner
    from ranks_helpers import env, rule_table

    m = MoeConfig(experts=6, k=2, inter=64, norm_topk=False, sparse=(0, 1), shared_inter=128)
    cfg = in_format(ModelConfig(QWEN2, 64, 2, 4, 2, 32, 128, 101, qkv_bias=True, max_len=24, moe=m), "q8_0")
    w = stored_weights(cfg, 3)
    toks = [(5 * i + 1) % 101 for i in range(rows)]
    ranked = RankPlans(cfg, w, 2, toks, numerics="q8")
    for s in ranked.plans:
        assert s.fusions.get("shared_expert_fusion.quant") == 2 and s.census["collective"] == 5
    one = NumpyRunner(plan(build_step(cfg, rows), table=rule_table(), numerics="q8"), w).step(env(cfg, toks))
    assert_same_step(ranked.run(), one, tol=1e-6)
