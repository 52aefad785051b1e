"""The families with a config of their own over R ranks: Gemma 2 (its soft-capped attention and head: each rank caps
its vocabulary part, elementwise, before the arg-max meets) and Gemma 3 (q/k normed a head at a time, a second rope
table for its sliding layers), their norms' 1 + w, sandwich norms and scaled embedding whole on every rank; R = 2 and
3, decode and a 5-row chunk after a 3-row one, f32 and bf16, tied and untied heads, against the one-rank step, and each
rank's plan on the numpy backend; OLMo 2 (its q/k norms over the whole projection: each rank's part gathered, normed
whole, its heads taken back) against the one-rank step, on the numpy backend and against transformers in process; the
refusals of the families not split, each one line. (Phi-3 and Gemma against
transformers over real gloo ranks: tests/test_ranks_gloo_families.py.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lanefuse.engine.errors import UserError
from lanefuse.engine.front.families.gemma import GemmaConfig
from lanefuse.engine.front.families.olmo2 import Olmo2Config
from lanefuse.engine.front.model import ModelConfig
from lanefuse.engine.front.parallel import check_ranks, part, rank_weight_bytes, rank_weights
from ranks_helpers import RankPlans, after_a_chunk, assert_same_step, in_format, stored_weights


def _gemma(family: str, ranks: int, fmt: str = "f32", tied: bool = True, **kw) -> GemmaConfig:
    """2 layers (sliding, then global), 2R heads over R KV heads of 16, FFN 70 (uneven parts), vocabulary 101;
    Gemma 2 capped (attention 50, head 30), Gemma 3 q/k-normed with its local rope table."""
    base = dict(hidden=64, layers=2, heads=2 * ranks, kv_heads=ranks, head_dim=16, inter=70, vocab=101, max_len=24,
                window=4, attn_scale=0.25, tie_embeddings=tied, layer_types=("sliding_attention", "full_attention"))
    if family == "gemma2":
        base.update(attn_softcap=50.0, final_softcap=30.0)
    else:
        base.update(qk_norm=True, local_rope_theta=10000.0, rope_theta=1e6)
    base.update(kw)
    return in_format(GemmaConfig("Gemma2ForCausalLM" if family == "gemma2" else "Gemma3ForCausalLM", **base), fmt)


def _weights(cfg, seed: int = 3):
    """Random stored weights under the checkpoint's names (the norms' 1 + w generated from them), the embedding's
    rows 0.3 of the others'."""
    return stored_weights(cfg, seed, embed=0.3)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
@pytest.mark.parametrize("ranks, fmt, tied", [(2, "f32", True), (3, "bf16", False), (2, "bf16", False)])
@pytest.mark.parametrize("rows", [1, 5])
def test_gemma_ranks_equal_one_rank(family, ranks, fmt, tied, rows):
    """R ranks' step (decode, or a 5-row chunk, after a 3-row chunk: positions past the window) against the one-rank
    step: the same next token, the (capped) logits side by side within f32 rounding."""
    cfg = _gemma(family, ranks, fmt, tied)
    run = after_a_chunk(cfg, _weights(cfg), ranks, [(7 * i + rows) % 101 for i in range(rows)])
    assert_same_step(run.got, run.want)
    gs = run.graphs
    kinds = [op.kind for op in gs[0].ops]
    assert kinds[-3:] == (["matmul", "softcap", "all_argmax"] if family == "gemma2" else
                          ["rmsnorm", "matmul", "all_argmax"])
    assert kinds.count("all_reduce") == 2 * cfg.layers


@pytest.mark.parametrize("family, rows, exact", [("gemma2", 1, True), ("gemma3", 5, False)])
def test_gemma_rank_plans_run_by_the_numpy_backend(family, rows, exact):
    """Each rank's step planned for the cuda lane (Gemma's fusions and the all-reduce's with the add and norm) and run
    by the numpy backend's twins, the ranks meeting through LocalComm: the reference ranks' token and logits."""
    cfg = _gemma(family, 2, "bf16")
    ranked = RankPlans(cfg, _weights(cfg), 2, [(5 * i + 1) % 101 for i in range(rows)])
    assert all(s.census["collective"] == 2 * cfg.layers + 1 for s in ranked.plans)
    ranked.check(exact)


def test_gemma_rank_weights_and_bytes():
    """An untied head under Gemma 3's conditional prefix (`language_model.model.`, the head `language_model.lm_head`):
    each rank's part of it, of its q and down rows; the norms whole; the bytes its parts once, the rest on each."""
    cfg = _gemma("gemma3", 3, "bf16", tied=False, prefix="language_model.model.",
                 head="language_model.lm_head.weight")
    assert cfg.fmt("language_model.lm_head.weight") == "bf16"
    w = _weights(cfg)
    w1 = rank_weights(w, cfg, 1, 3)
    lo, hi = part(101, 3, 1)
    np.testing.assert_array_equal(w1.get("lm_head.weight"), w.get("language_model.lm_head.weight")[lo:hi])
    p = "language_model.model.layers.1."
    np.testing.assert_array_equal(w1.get(p + "self_attn.q_proj.weight"), w.get(p + "self_attn.q_proj.weight")[32:64])
    lo, hi = part(70, 3, 1)
    np.testing.assert_array_equal(w1.get(p + "mlp.down_proj.weight"), w.get(p + "mlp.down_proj.weight")[:, lo:hi])
    np.testing.assert_array_equal(w1.get(p + "self_attn.q_norm.weight+1"), w.get(p + "self_attn.q_norm.weight+1"))
    one, three = rank_weight_bytes(cfg, 1)[0], rank_weight_bytes(cfg, 3)
    whole = 2 * 101 * 64 + 4 * (64 * (1 + 4 * 2) + 16 * 2 * 2)  # the embedding; the norms (4 a layer, q/k of 16)
    assert sum(three) == one + 2 * whole


def _olmo2(ranks: int, fmt: str = "f32", **kw) -> Olmo2Config:
    """2 layers, 2R heads over R KV heads of 16 (each rank 2 q heads, one KV head), hidden 40 (heads wider than
    hidden / heads), FFN 70 (uneven parts over 3), vocabulary 101, an untied head."""
    base = dict(hidden=40, layers=2, heads=2 * ranks, kv_heads=ranks, head_dim=16, inter=70, vocab=101, max_len=24,
                tie_embeddings=False)
    base.update(kw)
    return in_format(Olmo2Config("Olmo2ForCausalLM", **base), fmt)


@pytest.mark.parametrize("ranks, fmt", [(2, "f32"), (2, "bf16"), (3, "bf16")])
@pytest.mark.parametrize("rows", [1, 5])
def test_olmo2_ranks_equal_one_rank(ranks, fmt, rows):
    """OLMo 2's q and k norms over the whole projection: each rank's part gathered, normed whole, its heads taken back.
    R ranks' step (decode, or a 5-row chunk, after a 3-row chunk) against the one-rank step: the same next token, the
    logits side by side within f32 rounding; the norms' outputs each rank's heads of the one rank's, to the bit."""
    cfg = _olmo2(ranks, fmt)
    run = after_a_chunk(cfg, _weights(cfg, seed=5), ranks, [(7 * i + rows) % 101 for i in range(rows)])
    assert_same_step(run.got, run.want)
    # layer 0's normed q and k: rank r's heads of the one rank's (its q part is the same product's columns)
    for r, o in enumerate(run.got):
        for t, h in (("q", 2), ("k", 1)):
            np.testing.assert_array_equal(o[f"L0.{t}_norm"], run.want[f"L0.{t}_norm"][:, r * h * 16:(r + 1) * h * 16])
    gs = run.graphs
    kinds = [op.kind for op in gs[0].ops]
    assert kinds.count("all_gather") == 2 * cfg.layers and kinds.count("all_reduce") == 2 * cfg.layers
    assert kinds[4:7] == ["all_gather", "rmsnorm", "head_slice"]
    assert gs[0].constants["model.layers.0.self_attn.q_norm.weight"].shape == (cfg.heads * 16,)


def test_olmo2_rank_plans_run_by_the_numpy_backend():
    """Each rank's bf16 OLMo 2 step (a 4-row chunk) planned for the cuda lane and run by the numpy backend's exact
    twins, the ranks meeting through LocalComm: the reference ranks' last-row logits and token; a collective launch
    each gather and all-reduce, and the arg-max; a slice launch each of a layer's q and k norms taking the rank's own
    heads back (`head_slice`: the front that reaches kernels/slice.py's launch, issue 40)."""
    cfg = _olmo2(2, "bf16")
    ranked = RankPlans(cfg, _weights(cfg, seed=6), 2, [(5 * i + 1) % 101 for i in range(4)])
    assert all(s.census["collective"] == 4 * cfg.layers + 1 for s in ranked.plans)
    assert all(s.census["slice"] == 2 * cfg.layers for s in ranked.plans)
    ranked.check()  # the chunk's last row


def test_olmo2_rank_weights_and_bytes():
    """A rank's q/k rows its heads', its q and k norm weights whole (the norm runs over the gathered projection); the
    bytes: the cut parts once over the ranks, the rest (norms included) on each."""
    cfg = _olmo2(2, "bf16")
    w = _weights(cfg)
    w1 = rank_weights(w, cfg, 1, 2)
    p = "model.layers.1."
    np.testing.assert_array_equal(w1.get(p + "self_attn.k_proj.weight"), w.get(p + "self_attn.k_proj.weight")[16:32])
    for t in ("q", "k"):
        np.testing.assert_array_equal(w1.get(p + f"self_attn.{t}_norm.weight"), w.get(p + f"self_attn.{t}_norm.weight"))
    one, two = rank_weight_bytes(cfg, 1)[0], rank_weight_bytes(cfg, 2)
    whole = 2 * 101 * 40 + 4 * (40 + 2 * (2 * 40 + 64 + 32))  # the embedding; the final norm, 2 post-norms, q/k norms
    assert sum(two) == one + whole


@pytest.mark.hf
def test_olmo2_ranks_give_transformers_tokens_in_process(tmp_path_factory):
    """tests/ranks_helpers.py's tiny transformers OLMo 2 (bf16, GQA: 4 heads over 2 KV heads; the one
    tests/test_ranks_gloo_families.py runs over gloo) over 2 in-process ranks (threads meeting through LocalComm,
    lane/run/ranks.rank_generate, the reference interpreter): transformers' greedy tokens and logits within bf16's
    f32-rounded reference, and the one-rank run's."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ranks_helpers import check_run, model_reference, thread_ranks

    m = model_reference("olmo2_bf16", 6, tmp_path_factory)
    assert m["one"].generated_ids == m["hf_tokens"] and len(set(m["hf_tokens"])) > 2
    check_run(thread_ranks(2, m["folder"], 6), m, "olmo2_bf16 over 2 threads")


def test_families_not_split_are_refused_in_one_line():
    """A family's config this split does not know (a subclass of its own) is refused in one line; Qwen3-Next, once
    refused here, splits (tests/test_ranks_qnext.py)."""
    @dataclasses.dataclass(frozen=True)
    class NewFamilyConfig(ModelConfig):
        pass

    cfg = NewFamilyConfig("X", 32, 2, 4, 2, 8, 40, 61)
    with pytest.raises(UserError, match="its family is not split over ranks yet") as e:
        check_ranks(cfg, 2)
    assert "\n" not in str(e.value) and "--ranks 1" in str(e.value)
