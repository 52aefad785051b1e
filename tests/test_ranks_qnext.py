"""Qwen3-Next over R ranks (engine/front/parallel.py, as vLLM splits it): its gated full-attention layers by heads (each
head's query and gate rows, k and v by KV heads, replicated where 4 ranks outnumber its 2), its gated delta-net layers
by key heads (each rank its key heads and the value heads grouped on them: its runs of the split in_proj_qkvz, its b
and a rows, convolution channels, A_log and dt_bias, out_proj's columns; its own rings and recurrent states), its
mixture by experts with the sigmoid-gated shared expert split like a dense FFN. A tiny model (4 key heads over 8 value
heads of 32, a full-attention layer among three delta-net ones, two mixture layers beside two dense) over R = 2 and 4,
decode and a 5-row chunk after a 3-row one, f32 and bf16: the one rank's next token and logits, each rank's states its
heads' of the one rank's; the checkpoint's interleaved tensors (in_proj_qkvz grouped by key head, in_proj_ba,
conv1d, q_proj's query and gate a head) cut through the family's split store; each rank's plan run by the numpy
backend; the refusals in one line."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lanefuse.engine.errors import UserError
from lanefuse.engine.front.families.mixtures import MoeConfig
from lanefuse.engine.front.families.qwen3next import Qwen3NextConfig, SplitStore, _splits
from lanefuse.engine.front.parallel import (check_ranks, part, rank_carried, rank_config, rank_weight_bytes,
                                            rank_weights)
from lanefuse.engine.front.weights import DictStore, Weights
from ranks_helpers import RankPlans, after_a_chunk, assert_same_step, in_format, stored_weights

TYPES = ("linear_attention", "full_attention", "linear_attention", "linear_attention")


def _cfg(fmt: str = "f32", **kw) -> Qwen3NextConfig:
    """4 layers (delta, attention, delta, delta), the second and fourth a mixture of 6 experts of 24 (top 2, a shared
    expert of 20), the others dense (FFN 40); 4 heads of 16 over 2 KV heads; delta nets of 4 key heads of 32 and 8 value
    heads of 32, 4 taps; vocabulary 61."""
    m = MoeConfig(experts=6, k=2, inter=24, norm_topk=True, sparse=(1, 3), shared_inter=20)
    base = dict(hidden=32, layers=4, heads=4, kv_heads=2, head_dim=16, inter=40, vocab=61, qk_norm=True,
                partial_rotary=0.25, max_len=24, moe=m, layer_types=TYPES, taps=4, hk=4, hv=8, dk=32, dv=32)
    base.update(kw)
    return in_format(Qwen3NextConfig("Qwen3NextForCausalLM", **base), fmt)


def _weights(cfg):
    """Random weights under the split store's names (the norms' 1 + w generated from them)."""
    return stored_weights(cfg, 5, embed=0.5, vector=3.0)


@pytest.mark.parametrize("ranks, fmt", [(2, "f32"), (2, "bf16"), (4, "f32"), (4, "bf16")])
@pytest.mark.parametrize("rows", [1, 5])
def test_qnext_ranks_equal_one_rank(ranks, fmt, rows):
    """R ranks' step (decode, or a 5-row chunk, after a 3-row chunk) against the one-rank step: the same next token,
    the logits within f32 rounding; each rank's rings and recurrent states its heads' of the one rank's, its KV cache
    its KV head's (over 4 ranks: head r // 2, held by two ranks)."""
    cfg = _cfg(fmt)
    run = after_a_chunk(cfg, _weights(cfg), ranks, [(7 * i + rows) % 61 for i in range(rows)])
    assert_same_step(run.got, run.want)
    one, dk, dv, hd = run.one, cfg.dk, cfg.dv, cfg.head_dim
    g = cfg.hv // cfg.hk
    def same(a, b):  # within f32 rounding of the sums' order (a layer after an all-reduce reads a summed row)
        np.testing.assert_allclose(a, b, atol=1e-5 * max(float(np.abs(b).max()), 1e-30))

    for r, e in enumerate(run.envs):
        klo, khi = part(cfg.hk, ranks, r)
        for i in (0, 2, 3):
            same(e[f"ds{i}"], one[f"ds{i}"][klo * g * dk:khi * g * dk])
            for n in ("cq", "ck"):
                same(e[f"{n}{i}"], one[f"{n}{i}"][:, klo * dk:khi * dk])
            same(e[f"cv{i}"], one[f"cv{i}"][:, klo * g * dv:khi * g * dv])
        kv = r * cfg.kv_heads // ranks if ranks > cfg.kv_heads else r
        same(e["vc1"], one["vc1"][:, kv * hd:(kv + 1) * hd])
        mine = rank_carried(cfg, one, r, ranks)  # what `check --ranks` hands each rank of a one-rank history
        assert mine.keys() == e.keys() - {"token", "pos"}
        for n, a in mine.items():
            same(e[n], a)
    kinds = [op.kind for op in run.graphs[0].ops]
    assert kinds.count("all_reduce") == 2 * cfg.layers and kinds[-1] == "all_argmax"


def _as_stored(cfg, w) -> dict:
    """The checkpoint's tensors the split store reads, made from the split ones: in_proj_qkvz grouped by key head
    (each group's q, k, v, z rows), in_proj_ba (each group's b then a rows), conv1d's q, k, v channels joined, a gated
    attention's q_proj (each head's query then gate rows); the rest as they are."""
    names = cfg.weight_names()
    arrays = {n: w.store.raw(n)[0] for n in w.store.names()}
    for i in range(cfg.layers):
        for name, (src, idx) in _splits(cfg, i).items():
            part_rows = arrays.pop(name)
            if src not in arrays:
                n = {"in_proj_qkvz.weight": 2 * cfg.hk * cfg.dk + 2 * cfg.hv * cfg.dv,
                     "in_proj_ba.weight": 2 * cfg.hv, "conv1d.weight": 2 * cfg.hk * cfg.dk + cfg.hv * cfg.dv,
                     "q_proj.weight": 2 * cfg.heads * cfg.head_dim}[src.rsplit(".", 2)[-2] + ".weight"]
                arrays[src] = np.zeros((n,) + part_rows.shape[1:], part_rows.dtype)
            arrays[src][idx] = part_rows
    fmts = tuple((s, cfg.fmt(n)) for n in names for s in [n.replace("in_proj_qkvz.split", "in_proj_qkvz")
                                                          .replace("q_proj.query", "q_proj")])
    return arrays, dataclasses.replace(cfg, formats=cfg.formats + fmts)


@pytest.mark.parametrize("ranks, fmt", [(2, "bf16"), (4, "f32")])
def test_the_checkpoints_interleaved_tensors_are_cut_by_head_group(ranks, fmt):
    """The weights as a checkpoint stores them (in_proj_qkvz and in_proj_ba grouped by key head, conv1d's channels
    joined, q_proj a head's query then its gate), served through the family's split store and cut by each rank: every
    tensor a rank reads equals the cut of the split weights, and R ranks over them give the one rank's step."""
    cfg = _cfg(fmt)
    w = _weights(cfg)
    stored, scfg = _as_stored(cfg, w)
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in stored
    sw = Weights(SplitStore(DictStore(stored), scfg, "tiny"), scfg)
    for r in range(ranks):
        mine, want = rank_weights(sw, scfg, r, ranks), rank_weights(w, cfg, r, ranks)
        for n in rank_config(cfg, r, ranks).weight_names():
            a, b = mine.store.raw(n)[0], want.store.raw(n)[0]
            assert np.asarray(a).shape == np.asarray(b).shape, n
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=n)
    run = after_a_chunk(scfg, sw, ranks, [11, 30])
    assert_same_step(run.got, run.want)


def test_rank_weight_bytes_of_qnext():
    """Each rank holds its heads, its experts and its FFN parts once; the embedding, norms (the gated norm's weight
    a head), routers and shared-expert gates whole on every rank."""
    cfg = _cfg("bf16")
    one = rank_weight_bytes(cfg, 1)[0]
    two = rank_weight_bytes(cfg, 2)
    w = _weights(cfg)
    for r in range(2):
        mine = rank_weights(w, cfg, r, 2)
        names = dict(rank_config(cfg, r, 2).weight_names())
        assert two[r] == sum(np.asarray(mine.store.raw(n)[0]).nbytes for n in names if n != "lm_head.weight") \
            + np.asarray(mine.store.raw("lm_head.weight")[0]).nbytes
    d, v = cfg.hidden, cfg.vocab
    norms = 4 * (d * (1 + 2 * cfg.layers) + 2 * cfg.head_dim + 3 * cfg.dv)  # f32: layer and final norms, q/k, gated
    whole = 2 * v * d + norms + 2 * 2 * (6 * d + d)  # the embedding; two layers' routers and shared-expert gates
    assert sum(two) == one + whole


@pytest.mark.parametrize("ranks, rows, fmt, exact", [(2, 1, "bf16", True), (2, 5, "f32", False),
                                                     (4, 1, "f32", True)])
def test_qnext_rank_plans_run_by_the_numpy_backend(ranks, rows, fmt, exact):
    """Each rank's step planned for the cuda lane (its delta-net launches over its heads, its rings and states) and
    run by the numpy backend's exact or fast twins, the ranks meeting through LocalComm: the reference ranks' next
    token, the logits within 1e-5 of their scale."""
    cfg = _cfg(fmt)
    ranked = RankPlans(cfg, _weights(cfg), ranks, [(5 * i + 1) % 61 for i in range(rows)])
    for s in ranked.plans:
        deltas = [x.launch for x in s.launches if x.launch.census == "delta"]
        assert len(deltas) == 3 and all(d.hk == cfg.hk // ranks and d.hv == cfg.hv // ranks for d in deltas)
        assert s.census["collective"] == 2 * cfg.layers + 1
    ranked.check(exact)


def test_qnext_refusals_in_one_line():
    """Ranks that do not divide the key heads (6 over 4), and a block format's out_proj cut across its blocks."""
    with pytest.raises(UserError, match="4 ranks do not divide tiny's 6 key heads") as e:
        check_ranks(_cfg(hk=6, hv=12, heads=8, kv_heads=4, name="tiny"), 4)
    assert "\n" not in str(e.value) and "give a divisor of 6" in str(e.value)
    cfg = _cfg(dv=16, hv=4, hk=4)
    cfg = dataclasses.replace(cfg, formats=cfg.formats + (("model.layers.0.linear_attn.out_proj.weight", "q8_0"),))
    with pytest.raises(UserError, match="out_proj.weight` \\(q8_0\\) would be cut across its blocks of 32") as e:
        check_ranks(cfg, 4)  # a value head of 16 a rank
    assert "\n" not in str(e.value)
    check_ranks(cfg, 2)  # two value heads of 16 a rank: one block


@pytest.mark.hf
@pytest.mark.parametrize("name", ["f32", "bf16"])
def test_qnext_ranks_give_transformers_tokens_in_process(name, tmp_path):
    """tests/test_qwen3next.py's tiny transformers Qwen3-Next (2 key heads over 4 value heads of 32, its checkpoint's
    in_proj_qkvz grouped by key head; a mixture with its shared expert beside dense layers) over 2 in-process ranks
    (threads meeting through LocalComm, lane/run/ranks.rank_generate, the reference interpreter: a 4-row and a 2-row
    chunk, then decode): transformers' greedy tokens and logits (1e-4 of their scale) and the one-rank run's (1e-5)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ranks_helpers import check_run, one_torch_thread, reference, thread_ranks
    from test_qwen3next import build

    with one_torch_thread():
        folder, ref = build(name, tmp_path)
    m = reference(folder, ref, 6)
    assert m["one"].generated_ids == m["hf_tokens"] and len(set(m["hf_tokens"])) > 2
    check_run(thread_ranks(2, str(folder), 6), m, f"qwen3next {name} over 2 threads")
    if name == "bf16":  # `lanefuse check --ranks 2`: each rank its part of a random history (rank_carried)
        from lanefuse.lane.cli.main import main

        assert main(["check", str(folder), "--ranks", "2", "--rows", "1", "--rows", "5"]) == 0


def _gloo(fn):
    from ranks_helpers import GLOO

    for mark in GLOO:  # hf, slow, and skipped without gloo
        fn = mark(fn)
    return fn


@_gloo
def test_gloo_qnext_ranks_give_one_ranks_tokens(tmp_path_factory):
    """tests/test_qwen3next.py's tiny transformers Qwen3-Next (bf16) over 2 gloo processes, each rank's plan on the
    numpy backend (its delta-net launches over its heads, its mixture's Moe launches with the shared expert's part):
    transformers' tokens and the one-rank run's, 2 all-reduces a layer and the arg-max a step. One job in the launch
    of every 2-rank gloo run (tests/ranks_helpers.OTHER_RUNS): ~3 s of it here, the checkpoint and references ~4 s."""
    pytest.importorskip("transformers")
    from ranks_helpers import check_run, gloo_run

    by_rank, m = gloo_run(2, ("qnext", "numpy plan"), tmp_path_factory)
    assert m["one"].generated_ids == m["hf_tokens"]
    check_run(by_rank, m, "Qwen3-Next over 2 gloo ranks (numpy plan)", calls=(2 + 6 - 1) * (2 * m["cfg"].layers + 1))


@pytest.mark.hf
@pytest.mark.parametrize("legacy", [False, True])
def test_a_qnext_gguf_file_over_ranks(legacy, tmp_path):
    """tests/test_qwen3next_gguf.py's tiny model written as llama.cpp's converter writes it, q8_0 (in_proj_qkvz as
    attn_qkv + attn_gate, or `legacy` as ssm_in grouped by key head; A as -exp(A_log); norms held as 1 + w) over 2
    ranks: each rank's weights (its q8_0 rows whole blocks, out_proj's columns two value heads of 32: one block) give
    the one rank's step, decode and a 5-row chunk after a 3-row one."""
    pytest.importorskip("gguf")
    import gguf_files as gf
    from lanefuse.engine.front.load import load_model
    from ranks_helpers import one_torch_thread
    from test_qwen3next_gguf import tiny

    with one_torch_thread():
        path = gf.write_qwen3next(tiny(2), tmp_path / "qnext.gguf", "q8_0", legacy=legacy)
    cfg, w = load_model(path)
    assert cfg.fmt("model.layers.0.linear_attn.out_proj.weight") == "q8_0" and cfg.hk == 2
    for toks in ([11], [5, 60, 2, 29, 71]):
        run = after_a_chunk(cfg, w, 2, toks)
        assert_same_step(run.got, run.want)


def test_the_80b_shape_fits_a_device_a_rank_over_2_ranks():
    """Qwen3-Next-80B-A3B's shape (bench/qnext_figures.py's config: 16 key heads over 32 value heads, 16 heads over 2
    KV heads, 512 experts; bf16 rows), planned from its config alone: 159.3 GB on one rank (no 141 GB device holds
    it), 80.0 GB a rank over 2 and 40.4 over 4 (its 2 KV heads replicated), 10.7 over 16 (one key head a rank); 32
    ranks refused in one line."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from qnext_figures import qwen3_next_80b_a3b

    cfg = qwen3_next_80b_a3b(4096)
    assert (cfg.hk, cfg.hv, cfg.heads, cfg.kv_heads) == (16, 32, 16, 2)
    got = {r: rank_weight_bytes(cfg, r) for r in (1, 2, 4, 16)}
    assert round(got[1][0] / 1e9, 1) == 159.3
    assert [round(b / 1e9, 1) for b in got[2]] == [80.0, 80.0] and max(got[4]) < 40.5e9 and max(got[16]) < 10.7e9
    rc = rank_config(cfg, 3, 16)
    assert (rc.hk, rc.hv, rc.heads, rc.kv_heads) == (1, 2, 1, 1)
    with pytest.raises(UserError, match="--ranks 32: ") as e:
        check_ranks(cfg, 32)
    assert "\n" not in str(e.value)
