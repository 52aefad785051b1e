"""Batches over ranks (issue 38): rank r's decode step of B sequences (front/parallel.build_rank_step(..., batch=B):
a row a slot, each slot's caches its KV heads' columns, Qwen3-Next's rings and states its heads'), R ranks against the
one-rank batch step (the reference interpreter; each rank's plan on the numpy backend), and a rank's greedy run of a
batch (lane/run/ranks.rank_generate with `prompts`: lane/run/batch.generate_batch over the rank's config) — three
prompts in two slots over 2 ranks give each prompt's one-rank tokens, in process (threads) and over gloo processes."""

from __future__ import annotations

import numpy as np
import pytest

from lanefuse.engine.front.families.mixtures import MoeConfig
from lanefuse.engine.front.model import ModelConfig, build_step
from lanefuse.engine.front.parallel import build_rank_step, rank_carried, rank_weights
from lanefuse.engine.interp import evaluate
from lanefuse.engine.ranks import evaluate_ranks
from lanefuse.lane.run.batch import batch_caches
from ranks_helpers import (CHUNK, GLOO, MAX_LEN, SLOTS_PROMPTS, in_threads, rule_table, run_plans, seeded_weights,
                           stored_weights)



def _qwen3() -> ModelConfig:
    return ModelConfig("Qwen3ForCausalLM", 48, 2, 4, 2, 8, 64, 101, qk_norm=True, max_len=24)


def _qwen2_moe() -> ModelConfig:
    m = MoeConfig(experts=6, k=2, inter=24, norm_topk=False, sparse=(0, 1), shared_inter=32)
    return ModelConfig("Qwen2MoeForCausalLM", 48, 2, 4, 2, 8, 64, 101, qkv_bias=True, max_len=24, moe=m)


def _qwen3_next():
    from test_ranks_qnext import _cfg

    return _cfg()


MODELS = {"qwen3": (_qwen3, lambda c: seeded_weights(c, 5)), "qwen2-moe": (_qwen2_moe, lambda c: seeded_weights(c, 5)),
          "qwen3-next": (_qwen3_next, lambda c: stored_weights(c, 5, embed=0.5, vector=3.0))}


def slot_parts(cfg, tables: dict, slots: int, rank: int, ranks: int) -> dict:
    """Rank `rank`'s part of a batch's carried tables (`slots` slots, a sequence's rows each): each slot's
    rank_carried, the slots stacked again."""
    out: dict = {}
    per = {n: len(t) // slots for n, t in tables.items()}
    for s in range(slots):
        mine = rank_carried(cfg, {n: t[s * per[n]:(s + 1) * per[n]] for n, t in tables.items()}, rank, ranks)
        for n, a in mine.items():
            out.setdefault(n, []).append(a)
    return {n: np.concatenate(a) for n, a in out.items()}


def _batch_step(model: str, slots: int = 3, ranks: int = 2):
    """A batch step of `slots` sequences at positions 2, 5, 1 over a random history of every slot: the one rank's
    outputs and tables after it, and R ranks' graphs, weights, environments (each rank's part of the same history)."""
    make, weigh = MODELS[model]
    cfg = make()
    w = weigh(cfg)
    rng = np.random.default_rng(7)
    one = batch_caches(cfg, slots)
    for t in one.values():
        t[...] = rng.standard_normal(t.shape).astype(np.float32) * 0.5
    tok, pos = np.array([5, 7, 9][:slots], np.int32), np.array([2, 5, 1][:slots], np.int32)
    envs = [dict(slot_parts(cfg, one, slots, r, ranks), token=tok, pos=pos) for r in range(ranks)]
    one.update(token=tok, pos=pos)
    want = evaluate(build_step(cfg, 1, batch=slots), w, one)
    graphs = [build_rank_step(cfg, r, ranks, 1, slots) for r in range(ranks)]
    ws = [rank_weights(w, cfg, r, ranks) for r in range(ranks)]
    return cfg, one, want, graphs, ws, envs


def _same(got: list[dict], want: dict, tol: float = 1e-5) -> None:
    """Every rank's next tokens (one a slot) the one rank's; the logits' parts side by side within `tol` of their
    scale."""
    joined = np.concatenate([np.asarray(o["logits"]) for o in got], axis=-1)
    scale = float(np.abs(want["logits"]).max())
    assert float(np.abs(joined - want["logits"]).max()) <= tol * scale
    for o in got:
        np.testing.assert_array_equal(np.asarray(o["next"]).reshape(-1), np.asarray(want["next"]).reshape(-1))


@pytest.mark.parametrize("model", list(MODELS))
def test_a_batch_step_over_ranks_is_the_one_ranks(model):
    """Three sequences, a row each, over 2 ranks (the reference interpreter): each slot's next token and logits the
    one rank's batch step's; each rank's tables after the step its part of the one rank's (each slot's row written
    where its position says)."""
    cfg, one, want, graphs, ws, envs = _batch_step(model)
    got = evaluate_ranks(graphs, ws, envs)
    _same(got, want)
    for r, e in enumerate(envs):
        mine = slot_parts(cfg, {n: one[n] for n in cfg.carried()}, 3, r, 2)
        for n, a in mine.items():
            np.testing.assert_allclose(e[n], a, atol=1e-5 * max(float(np.abs(a).max()), 1e-30), err_msg=n)
    assert graphs[0].meta["batch"] == 3 and graphs[0].tensors["logits"].shape[0] == 3


@pytest.mark.parametrize("model", ["qwen2-moe", "qwen3-next"])
def test_a_batch_steps_rank_plans_run_by_the_numpy_backend(model):
    """Each rank's batch step planned for the cuda lane (a mixture's Moe launches over its experts with its part of
    the shared expert inside) and run by the numpy backend's exact twins, the ranks meeting through LocalComm: the
    one rank's tokens and logits."""
    from lanefuse.kernels import Moe
    from lanefuse.lane.lower.plan import plan

    cfg, one, want, graphs, ws, envs = _batch_step(model)
    plans = [plan(g, table=rule_table()) for g in graphs]
    for p in plans:
        moes = [x.launch for x in p.launches if isinstance(x.launch, Moe)]
        assert moes and all(m.shared and m.local == 3 and m.rows == 3 for m in moes)
        assert p.census["collective"] == 2 * cfg.layers + 1
    _same(run_plans(plans, ws, envs), want)


# -- a rank's greedy run of a batch ------------------------------------------------------------------------------------

def _alone(folder: str, n_tokens: int) -> list:
    """Each prompt of SLOTS_PROMPTS alone on one rank (lane/run/generate, the reference interpreter, chunks of 4)."""
    from lanefuse.engine.front.load import load_model
    from lanefuse.lane.run.generate import generate

    cfg, w = load_model(folder, max_len=MAX_LEN)
    return [generate(cfg, w, p, n_tokens, chunk=CHUNK) for p in SLOTS_PROMPTS]


def _check_batch(by_rank: list[dict], alone: list, what: str) -> None:
    """Every rank's tokens of each prompt the prompt's one-rank tokens; its logits' parts joined within 1e-5 of the
    one rank's scale."""
    from hf_ref import scaled_error

    for r in by_rank:
        assert [b["tokens"] for b in r["batch"]] == [a.generated_ids for a in alone], what
    for k, a in enumerate(alone):
        joined = [np.concatenate([r["batch"][k]["logits"][s] for r in by_rank]) for s in range(len(a.logits))]
        assert scaled_error(joined, a.logits) < 1e-5, (what, k)


@pytest.mark.hf
def test_three_prompts_in_two_slots_over_two_ranks_in_process(tmp_path_factory):
    """tests/ranks_helpers.py's tiny transformers Qwen2-MoE (bf16; 6 experts, a shared expert) over 2 ranks in threads
    (LocalComm), each rank's plan on the numpy backend: three prompts in two slots, each prompt's one-rank tokens."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from lanefuse.engine.collectives import LocalComm
    from lanefuse.lane.run.ranks import rank_generate
    from ranks_helpers import hf_model

    folder, _ = hf_model("qwen2_moe_bf16", tmp_path_factory)
    group = LocalComm(2)
    by_rank = in_threads(2, lambda r: rank_generate(group.at(r), folder, None, 5, CHUNK, max_len=MAX_LEN, plan=True,
                                                    prompts=SLOTS_PROMPTS, slots=2))
    _check_batch(by_rank, _alone(folder, 5), "Qwen2-MoE, 2 threads")


def _gloo(fn):
    for mark in GLOO:  # hf, slow, and skipped without gloo
        fn = mark(fn)
    return fn


@_gloo
def test_three_prompts_in_two_slots_over_two_gloo_ranks(tmp_path_factory):
    """The same batch over 2 gloo processes (tests/ranks_helpers.BATCH_RUNS: in the one launch of every 2-rank gloo
    run), each rank's plan on the numpy backend: each prompt's one-rank tokens; the collectives a rank met."""
    pytest.importorskip("transformers")
    from ranks_helpers import gloo_run

    by_rank, m = gloo_run(2, ("qwen2_moe_bf16", "batch numpy plan"), tmp_path_factory)
    _check_batch(by_rank, _alone(m["folder"], 5), "Qwen2-MoE, 2 gloo ranks")
    # prefills: 6 -> chunks of 4 and 2, 3 -> one, 5 -> 4 and 1: five steps; decode steps of the batch: 4 while the
    # first two prompts run (their last token the 5th), then 4 for the third alone in its slot; each step 2
    # all-reduces a layer and the arg-max
    assert all(r["calls"] == (5 + 8) * (2 * m["cfg"].layers + 1) for r in by_rank)
