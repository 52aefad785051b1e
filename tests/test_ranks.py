"""Tensor parallelism in the reference interpreter: the collectives' meaning (engine/collectives.py), rank r's step
graph and weights (front/parallel.py), and R ranks run together (evaluate_ranks: a thread a rank) giving the one-rank
step's tokens and logits — decode and a prefill chunk, f32, bf16 and q8_0 rows, R = 2 and 3 (uneven FFN and vocabulary
parts), and the refusals in words."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lanefuse.engine.collectives import combine, payload
from lanefuse.engine.errors import UserError
from lanefuse.engine.interp import run_op
from lanefuse.engine.ir import Op, attrs_of
from lanefuse.engine.front.model import ModelConfig, build_step
from lanefuse.engine.front.parallel import build_rank_step, check_ranks, part, rank_weight_bytes, rank_weights
from ranks_helpers import RankPlans, after_a_chunk, assert_same_step, in_format, seeded_weights

rng = np.random.default_rng(38)


def _cfg(fmt: str = "f32", **kw) -> ModelConfig:
    """A Qwen3-shaped toy: 6 heads over 3 KV heads of 8 (R = 3 takes one KV head a rank; R = 2 runs it over 2), an
    FFN of 70 (parts 35 / 24, 23, 23), a vocabulary of 101 (51, 50 / 34, 34, 33)."""
    base = dict(arch="Qwen3ForCausalLM", hidden=48, layers=2, heads=6, kv_heads=3, head_dim=8, inter=70, vocab=101,
                qk_norm=True, max_len=24)
    base.update(kw)
    return in_format(ModelConfig(**base), fmt)


def _weights(cfg: ModelConfig):
    return seeded_weights(cfg, 5)


def test_collectives_combine():
    a, b, c = (rng.standard_normal((3, 5)).astype(np.float32) for _ in range(3))
    got = combine("all_reduce", [a, b, c])
    np.testing.assert_array_equal(got, (a.astype(np.float64) + b + c).astype(np.float32))
    assert combine("all_gather", [a, b]).shape == (3, 10)
    np.testing.assert_array_equal(combine("all_gather", [a, b])[:, 5:], b)
    one = run_op(Op("all_reduce", ("x",), "y", attrs_of({"ranks": 1})), a)
    np.testing.assert_array_equal(one, a)
    with pytest.raises(UserError, match="runs only with its ranks"):
        run_op(Op("all_reduce", ("x",), "y", attrs_of({"ranks": 2})), a)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=5), st.integers(0, 2**31 - 1), st.booleans())
def test_all_argmax_is_the_whole_rows_argmax(widths, seed, ties):
    """Whatever the parts' widths, the collective's index is np.argmax of the whole row (the first of equal maxima):
    ties drawn from a few values cross the parts."""
    r = np.random.default_rng(seed)
    n = sum(widths)
    x = (r.integers(0, 3, size=(4, n)) if ties else r.standard_normal((4, n))).astype(np.float32)
    offs = np.cumsum([0] + widths[:-1])
    parts = [payload("all_argmax", x[:, o:o + w], int(o)) for o, w in zip(offs, widths)]
    np.testing.assert_array_equal(combine("all_argmax", parts), np.argmax(x, axis=-1))


def test_part_is_even_and_whole():
    for n, ranks, unit in [(70, 3, 1), (101, 2, 1), (96, 3, 32), (128, 3, 32), (7, 7, 1)]:
        cuts = [part(n, ranks, r, unit) for r in range(ranks)]
        assert cuts[0][0] == 0 and cuts[-1][1] == n // unit * unit
        assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
        sizes = [hi - lo for lo, hi in cuts]
        assert max(sizes) - min(sizes) <= unit and all(s % unit == 0 for s in sizes)


@pytest.mark.parametrize("ranks", [2, 3])
def test_rank_step_census(ranks):
    """A layer's step of a rank: its heads and FFN part, two all-reduces (after o and down), whose sums the residual
    adds read; the LM head its vocabulary part, the next token the all_argmax; its caches its own KV heads."""
    cfg = _cfg(kv_heads=ranks)
    for r in range(ranks):
        g = build_rank_step(cfg, r, ranks, 1)
        kinds = [op.kind for op in g.ops]
        assert kinds.count("all_reduce") == 2 * cfg.layers and kinds.count("all_argmax") == 1
        assert "argmax" not in kinds
        for op in g.ops:
            if op.kind == "add" and op.out.endswith(("resid_attn", "resid_ffn")):
                assert op.ins[1].endswith("_sum")
        lo, hi = part(cfg.vocab, ranks, r)
        assert g.tensors["logits"].shape == (1, hi - lo) and g.meta["vocab_from"] == lo
        assert g.tensors["kc0"].shape == (cfg.max_len, cfg.kv_heads // ranks * cfg.head_dim)
        assert g.constants["model.layers.0.self_attn.o_proj.weight"].shape == (48, 6 // ranks * 8)
    assert build_rank_step(cfg, 0, 1, 1) == build_step(cfg, 1)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8_0"])
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("rows", [1, 5])
def test_ranks_equal_one_rank(fmt, ranks, rows):
    """R ranks' step (decode, a chunk of 5 at position 3 after a chunk of 3) against the one-rank step: the same
    next token, the logits side by side within f32 rounding of the reductions' order."""
    q8 = fmt == "q8_0"  # a q8_0 step's rows whole blocks: the FFN parts of 64, 32 / 32 a rank, heads of 32
    cfg = _cfg(fmt, kv_heads=ranks, inter=96 if q8 else 70, hidden=64 if q8 else 48, head_dim=32 if q8 else 8)
    run = after_a_chunk(cfg, _weights(cfg), ranks, list(rng.integers(0, cfg.vocab, rows)))
    scale = assert_same_step(run.got, run.want)
    # each rank's cache holds its KV heads of the one rank's
    hd, kv = cfg.head_dim, cfg.kv_heads // ranks
    for r, e in enumerate(run.envs):
        np.testing.assert_allclose(e["kc1"], run.one["kc1"][:, r * kv * hd:(r + 1) * kv * hd], atol=1e-5 * scale)


@pytest.mark.parametrize("fmt, ranks, rows", [("f32", 4, 1), ("bf16", 4, 5), ("f32", 8, 5)])
def test_kv_heads_replicated(fmt, ranks, rows):
    """More ranks than KV heads (8 heads over 2 KV heads; R = 4 and 8): each rank holds the one KV head its query
    heads read (rank r's is r·2/R), R/2 ranks the same one, and keeps that head's cache; the ranks' step (decode, a
    chunk) gives the one rank's token and logits, and each rank's plan run by the numpy backend the reference ranks'."""
    cfg = _cfg(fmt, heads=8, kv_heads=2)
    w = _weights(cfg)
    run = after_a_chunk(cfg, w, ranks, list(rng.integers(0, cfg.vocab, rows)))
    scale = assert_same_step(run.got, run.want)
    hd = cfg.head_dim
    for r, e in enumerate(run.envs):
        h = r * 2 // ranks
        assert e["kc1"].shape[1] == hd
        np.testing.assert_allclose(e["kc1"], run.one["kc1"][:, h * hd:(h + 1) * hd], atol=1e-5 * scale)
        np.testing.assert_array_equal(rank_weights(w, cfg, r, ranks).get("model.layers.0.self_attn.v_proj.weight"),
                                      w.get("model.layers.0.self_attn.v_proj.weight")[h * hd:(h + 1) * hd])
    if rows == 1:
        RankPlans(cfg, w, ranks, rng.integers(0, cfg.vocab, rows)).check()
    # the ranks' bytes: the whole tensors on every rank, the parts once, and each KV head's k and v rows R/2 times
    sz = 4 if fmt == "f32" else 2
    whole = sz * 101 * 48 + 4 * 48 * (1 + 2 * 2) + 4 * 8 * 2 * 2  # embedding, norms (final, 2 a layer), q/k norms
    head = 2 * 2 * hd * cfg.hidden * sz  # one KV head's k and v rows, both layers
    assert sum(rank_weight_bytes(cfg, ranks)) == rank_weight_bytes(cfg, 1)[0] + (ranks - 1) * whole + (ranks - 2) * head


def test_rank_weights_cut():
    cfg = _cfg("bf16")
    w = _weights(cfg)
    w1 = rank_weights(w, cfg, 1, 3)
    full = w.get("model.layers.1.mlp.down_proj.weight")
    lo, hi = part(70, 3, 1)
    np.testing.assert_array_equal(w1.get("model.layers.1.mlp.down_proj.weight"), full[:, lo:hi])
    np.testing.assert_array_equal(w1.get("model.layers.1.self_attn.k_proj.weight"),
                                  w.get("model.layers.1.self_attn.k_proj.weight")[8:16])
    assert w1.format("model.layers.1.self_attn.k_proj.weight") == "bf16"
    lo, hi = part(101, 3, 1)
    np.testing.assert_array_equal(w1.get("lm_head.weight"), w.get("lm_head.weight")[lo:hi])
    tied = _cfg(tie_embeddings=True)
    wt = _weights(tied)
    np.testing.assert_array_equal(rank_weights(wt, tied, 2, 3).get("lm_head.weight"),
                                  wt.get("model.embed_tokens.weight")[part(101, 3, 2)[0]:])


def test_rank_weight_bytes():
    cfg = _cfg("bf16")
    one = rank_weight_bytes(cfg, 1)[0]
    assert one == 2 * sum(int(np.prod(s)) for s in cfg.weight_names().values() if len(s) == 2) + \
        4 * sum(int(np.prod(s)) for s in cfg.weight_names().values() if len(s) == 1)
    three = rank_weight_bytes(cfg, 3)
    whole = 2 * 101 * 48 + 4 * 48 * (1 + 2 * 2) + 4 * 8 * 2 * 2  # embedding, norms (final, 2 a layer), q/k norms
    assert sum(three) == one + 2 * whole  # the whole tensors on every rank, the parts once


@pytest.mark.parametrize("cfg, ranks, words", [
    (_cfg(), 2, "do not divide .*3 KV heads"),
    (_cfg(), 0, "1 or more ranks"),
    (_cfg(kv_heads=2), 4, "4 ranks do not divide .*2 KV heads .* or a multiple of it that divides 6"),  # 6 % 4
    (_cfg(heads=8, kv_heads=2), 3, "3 ranks do not divide .*2 KV heads"),
    (_cfg(inter=2), 3, "FFN of 2 values"),
    (_cfg("q8_0", hidden=64, inter=64, head_dim=16, kv_heads=2, heads=2), 2, "cut across its blocks of 32"),
])
def test_refusals(cfg, ranks, words):
    with pytest.raises(UserError, match=words) as e:
        check_ranks(cfg, ranks)
    assert "\n" not in str(e.value)


def test_refuses_mixtures_and_families():
    from lanefuse.engine.front.families.mixtures import MoeConfig

    moe = MoeConfig(8, 2, 16, True, (0, 1), spelling="another")  # a family's own spelling this split does not know
    with pytest.raises(UserError, match=r"expert mixture \(another\) is not split") as e:
        check_ranks(dataclasses.replace(_cfg(), moe=moe), 3)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="2 experts over 3 ranks"):
        check_ranks(dataclasses.replace(_cfg(), moe=MoeConfig(2, 1, 16, True, (0, 1))), 3)
    from lanefuse.engine.front.families.olmo2 import Olmo2Config

    olmo = Olmo2Config(**{f.name: getattr(_cfg(), f.name) for f in dataclasses.fields(ModelConfig)})
    check_ranks(olmo, 3)  # split (its whole-projection q/k norms gathered: tests/test_ranks_families.py)
    with pytest.raises(UserError, match="2 ranks do not divide .* 3 KV heads") as e:
        check_ranks(olmo, 2)
    assert "\n" not in str(e.value)
    check_ranks(_cfg(), 6)  # one KV head on two ranks each
    with pytest.raises(UserError, match="6 ranks do not divide .* 3 KV heads .*OLMo 2's k norm") as e:
        check_ranks(olmo, 6)  # its whole-projection k norm would count a replicated head twice
    assert "\n" not in str(e.value)
    check_ranks(olmo, 1)


def test_rank_step_round_trips_through_text():
    from lanefuse.engine.stepyaml import from_yaml, to_yaml

    g = build_rank_step(_cfg(), 2, 3, 4)
    assert from_yaml(to_yaml(g)) == g


@pytest.mark.parametrize("ranks, rows, fmt, held", [(2, 1, "bf16", ()), (3, 5, "f32", ()),
                                                    (2, 1, "f32", ("all_reduce_add_norm",))])
def test_rank_plans_run_by_the_numpy_backend(ranks, rows, fmt, held):
    """Each rank's step planned for the cuda lane (its collectives `collective` launches: 2 a layer and the arg-max;
    each all-reduce with the residual add and the next norm in it — all_reduce_add_norm @ rules/collectives.yaml —
    unless held) and run by the numpy backend's exact twins in its arena, the ranks meeting through LocalComm: the
    reference ranks' next token, logits within 1e-5 of their scale."""
    cfg = _cfg(fmt, kv_heads=ranks)
    ranked = RankPlans(cfg, _weights(cfg), ranks, rng.integers(0, cfg.vocab, rows), held=list(held))
    # the decode step's every all-reduce is followed by an add and a norm (the last one's the final norm); a chunk's
    # last is not (the last row's view comes between)
    fused = 0 if held else 2 * cfg.layers - (rows > 1)
    for s in ranked.plans:
        assert s.census.get("collective") == 2 * cfg.layers + 1
        assert s.fusions.get("all_reduce_add_norm", 0) == fused
    ranked.check()
