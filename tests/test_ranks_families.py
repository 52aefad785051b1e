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
import threading

import numpy as np
import pytest

from lanefuse.engine.collectives import LocalComm
from lanefuse.engine.errors import UserError
from lanefuse.engine.front.families.gemma import GemmaConfig
from lanefuse.engine.front.families.olmo2 import Olmo2Config
from lanefuse.engine.front.model import ModelConfig, build_step
from lanefuse.engine.front.parallel import (build_rank_step, check_ranks, part, rank_config, rank_weight_bytes,
                                            rank_weights)
from lanefuse.engine.front.weights import Weights
from lanefuse.engine.interp import evaluate
from lanefuse.engine.ranks import evaluate_ranks
from lanefuse.lane.run.generate import new_caches


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
    cfg = GemmaConfig("Gemma2ForCausalLM" if family == "gemma2" else "Gemma3ForCausalLM", **base)
    if fmt != "f32":
        cfg = dataclasses.replace(cfg, formats=tuple((n, fmt) for n, s in cfg.weight_names().items() if len(s) == 2))
    return cfg


def _weights(cfg, seed: int = 3) -> Weights:
    """Random stored weights under the checkpoint's names (the norms' 1 + w generated from them), rows in the
    config's formats."""
    from lanefuse.engine.formats.blocks import encode

    r = np.random.default_rng(seed)
    arrays = {}
    for n, sh in cfg.weight_names().items():
        a = (r.standard_normal(sh) * (0.3 if "embed" in n else 1.0) / (sh[-1] ** 0.5 if len(sh) == 2 else 10))
        a = a.astype(np.float32)
        arrays[n] = (encode(a, cfg.fmt(n)), cfg.fmt(n)) if len(sh) == 2 and cfg.fmt(n) != "f32" else a
    return Weights.from_dict(arrays, cfg)


def _env(cfg, tokens, pos):
    return {"token": np.asarray(tokens, np.int32), "pos": np.asarray([pos], np.int32), **new_caches(cfg)}


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
@pytest.mark.parametrize("ranks, fmt, tied", [(2, "f32", True), (3, "bf16", False), (2, "bf16", False)])
@pytest.mark.parametrize("rows", [1, 5])
def test_gemma_ranks_equal_one_rank(family, ranks, fmt, tied, rows):
    """R ranks' step (decode, or a 5-row chunk, after a 3-row chunk: positions past the window) against the one-rank
    step: the same next token, the (capped) logits side by side within f32 rounding."""
    cfg = _gemma(family, ranks, fmt, tied)
    w = _weights(cfg)
    first, toks = [4, 9, 2], [(7 * i + rows) % 101 for i in range(rows)]
    one = _env(cfg, first, 0)
    evaluate(build_step(cfg, 3), w, one)
    one.update(token=np.asarray(toks, np.int32), pos=np.asarray([3], np.int32))
    want = evaluate(build_step(cfg, rows), w, one)
    gs = [build_rank_step(cfg, r, ranks, rows) for r in range(ranks)]
    ws = [rank_weights(w, cfg, r, ranks) for r in range(ranks)]
    envs = [_env(rank_config(cfg, r, ranks), first, 0) for r in range(ranks)]
    evaluate_ranks([build_rank_step(cfg, r, ranks, 3) for r in range(ranks)], ws, envs)
    for e in envs:
        e.update(token=np.asarray(toks, np.int32), pos=np.asarray([3], np.int32))
    got = evaluate_ranks(gs, ws, envs)
    logits = np.concatenate([o["logits"] for o in got], axis=-1)
    scale = float(np.abs(want["logits"]).max())
    assert float(np.abs(logits - want["logits"]).max()) <= 1e-5 * scale
    for o in got:
        np.testing.assert_array_equal(o["next"], want["next"])
    kinds = [op.kind for op in gs[0].ops]
    assert kinds[-3:] == (["matmul", "softcap", "all_argmax"] if family == "gemma2" else
                          ["rmsnorm", "matmul", "all_argmax"])
    assert kinds.count("all_reduce") == 2 * cfg.layers


@pytest.mark.parametrize("family, rows, exact", [("gemma2", 1, True), ("gemma3", 5, False)])
def test_gemma_rank_plans_run_by_the_numpy_backend(family, rows, exact):
    """Each rank's step planned for the cuda lane (Gemma's fusions and the all-reduce's with the add and norm) and run
    by the numpy backend's twins, the ranks meeting through LocalComm: the reference ranks' token and logits."""
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    ranks = 2
    cfg = _gemma(family, ranks, "bf16")
    w = _weights(cfg)
    gs = [build_rank_step(cfg, r, ranks, rows) for r in range(ranks)]
    ws = [rank_weights(w, cfg, r, ranks) for r in range(ranks)]
    toks = np.asarray([(5 * i + 1) % 101 for i in range(rows)], np.int32)

    def envs():
        return [_env(rank_config(cfg, r, ranks), toks, 0) for r in range(ranks)]

    want = evaluate_ranks(gs, ws, envs())
    plans = [plan(g) for g in gs]
    assert all(s.census["collective"] == 2 * cfg.layers + 1 for s in plans)
    group, got, es = LocalComm(ranks), [None] * ranks, envs()

    def run(r):
        runner = NumpyRunner(plans[r], ws[r], exact=exact)
        runner.env.comm = group.at(r)
        got[r] = runner.step(es[r])

    ts = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    a = np.concatenate([np.asarray(o["logits"]).reshape(1, -1) for o in got], axis=-1)
    b = np.concatenate([np.asarray(o["logits"]).reshape(1, -1) for o in want], axis=-1)
    assert float(np.abs(a - b).max()) <= 1e-5 * float(np.abs(b).max())
    for o in got:
        assert int(np.asarray(o["next"]).reshape(-1)[0]) == int(np.asarray(want[0]["next"]).reshape(-1)[0])


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
    cfg = Olmo2Config("Olmo2ForCausalLM", **base)
    if fmt != "f32":
        cfg = dataclasses.replace(cfg, formats=tuple((n, fmt) for n, s in cfg.weight_names().items() if len(s) == 2))
    return cfg


@pytest.mark.parametrize("ranks, fmt", [(2, "f32"), (2, "bf16"), (3, "bf16")])
@pytest.mark.parametrize("rows", [1, 5])
def test_olmo2_ranks_equal_one_rank(ranks, fmt, rows):
    """OLMo 2's q and k norms over the whole projection: each rank's part gathered, normed whole, its heads taken back.
    R ranks' step (decode, or a 5-row chunk, after a 3-row chunk) against the one-rank step: the same next token, the
    logits side by side within f32 rounding; the norms' outputs each rank's heads of the one rank's, to the bit."""
    cfg = _olmo2(ranks, fmt)
    w = _weights(cfg, seed=5)
    first, toks = [4, 9, 2], [(7 * i + rows) % 101 for i in range(rows)]
    one = _env(cfg, first, 0)
    evaluate(build_step(cfg, 3), w, one)
    one.update(token=np.asarray(toks, np.int32), pos=np.asarray([3], np.int32))
    want = evaluate(build_step(cfg, rows), w, one)
    gs = [build_rank_step(cfg, r, ranks, rows) for r in range(ranks)]
    ws = [rank_weights(w, cfg, r, ranks) for r in range(ranks)]
    envs = [_env(rank_config(cfg, r, ranks), first, 0) for r in range(ranks)]
    evaluate_ranks([build_rank_step(cfg, r, ranks, 3) for r in range(ranks)], ws, envs)
    for e in envs:
        e.update(token=np.asarray(toks, np.int32), pos=np.asarray([3], np.int32))
    got = evaluate_ranks(gs, ws, envs)
    logits = np.concatenate([o["logits"] for o in got], axis=-1)
    assert float(np.abs(logits - want["logits"]).max()) <= 1e-5 * float(np.abs(want["logits"]).max())
    for o in got:
        np.testing.assert_array_equal(o["next"], want["next"])
    # layer 0's normed q and k: rank r's heads of the one rank's (its q part is the same product's columns)
    for r, o in enumerate(got):
        for t, h in (("q", 2), ("k", 1)):
            np.testing.assert_array_equal(o[f"L0.{t}_norm"], want[f"L0.{t}_norm"][:, r * h * 16:(r + 1) * h * 16])
    kinds = [op.kind for op in gs[0].ops]
    assert kinds.count("all_gather") == 2 * cfg.layers and kinds.count("all_reduce") == 2 * cfg.layers
    assert kinds[4:7] == ["all_gather", "rmsnorm", "head_slice"]
    assert gs[0].constants["model.layers.0.self_attn.q_norm.weight"].shape == (cfg.heads * 16,)


def test_olmo2_rank_plans_run_by_the_numpy_backend():
    """Each rank's bf16 OLMo 2 step (a 4-row chunk) planned for the cuda lane and run by the numpy backend's exact
    twins, the ranks meeting through LocalComm: the reference ranks' last-row logits and token; a collective launch
    each gather and all-reduce, and the arg-max."""
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    ranks, rows = 2, 4
    cfg = _olmo2(ranks, "bf16")
    w = _weights(cfg, seed=6)
    gs = [build_rank_step(cfg, r, ranks, rows) for r in range(ranks)]
    ws = [rank_weights(w, cfg, r, ranks) for r in range(ranks)]
    toks = np.asarray([(5 * i + 1) % 101 for i in range(rows)], np.int32)

    def envs():
        return [_env(rank_config(cfg, r, ranks), toks, 0) for r in range(ranks)]

    want = evaluate_ranks(gs, ws, envs())
    plans = [plan(g) for g in gs]
    assert all(s.census["collective"] == 4 * cfg.layers + 1 for s in plans)
    group, got, es = LocalComm(ranks), [None] * ranks, envs()

    def run(r):
        runner = NumpyRunner(plans[r], ws[r], exact=True)
        runner.env.comm = group.at(r)
        got[r] = runner.step(es[r])

    ts = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    a = np.concatenate([np.asarray(o["logits"]).reshape(1, -1) for o in got], axis=-1)  # the chunk's last row
    b = np.concatenate([np.asarray(o["logits"]).reshape(1, -1) for o in want], axis=-1)
    assert float(np.abs(a - b).max()) <= 1e-5 * float(np.abs(b).max())
    for o in got:
        assert np.asarray(o["next"]).reshape(-1)[-1] == np.asarray(want[0]["next"]).reshape(-1)[-1]


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
def test_olmo2_ranks_give_transformers_tokens_in_process():
    """A tiny transformers OLMo 2 (bf16, GQA: 4 heads over 2 KV heads) over 2 in-process ranks (threads meeting
    through LocalComm, lane/run/ranks.rank_generate, the reference interpreter): transformers' greedy tokens and
    logits within bf16's f32-rounded reference, and the one-rank run's."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import tempfile

    from hf_ref import hf_greedy, scaled_error
    from lanefuse.engine.front.load import load_model
    from lanefuse.lane.run.generate import generate
    from lanefuse.lane.run.ranks import rank_generate

    prompt, n = [3, 17, 5, 42, 8, 11], 5
    hc = transformers.Olmo2Config(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, intermediate_size=37, vocab_size=97, max_position_embeddings=64,
                                  eos_token_id=2, pad_token_id=0)
    torch.manual_seed(38)
    model = transformers.Olmo2ForCausalLM(hc).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else
                    torch.randn_like(p) / (p.shape[1] ** 0.5 if "embed" not in name else 1.0))
    with tempfile.TemporaryDirectory() as folder:
        model.to(torch.bfloat16).save_pretrained(folder)
        ref = transformers.Olmo2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        toks, hf_logits = hf_greedy(ref, prompt, n)
        cfg, w = load_model(folder, max_len=32)
        one = generate(cfg, w, prompt, n, chunk=4)
        group, res = LocalComm(2), [None, None]

        def run(r):
            res[r] = rank_generate(group.at(r), folder, prompt, n, chunk=4, max_len=32)

        ts = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert one.generated_ids == toks and len(set(toks)) > 2
    for r in res:
        assert r["tokens"] == toks
    logits = [np.concatenate(parts, axis=-1) for parts in zip(*(r["logits"] for r in res))]
    assert scaled_error(logits, one.logits) < 1e-5 and scaled_error(logits, hf_logits) < 1e-4


@pytest.mark.parametrize("kind, words", [
    ("Qwen3NextConfig", "gated delta-rule layers"),
])
def test_families_not_split_are_refused_in_one_line(kind, words):
    import importlib

    mod = {"Qwen3NextConfig": "qwen3next"}[kind]
    cls = getattr(importlib.import_module(f"lanefuse.engine.front.families.{mod}"), kind)
    base = ModelConfig("X", 32, 2, 4, 2, 8, 40, 61)
    cfg = cls.__new__(cls)
    for f in dataclasses.fields(ModelConfig):
        object.__setattr__(cfg, f.name, getattr(base, f.name))
    with pytest.raises(UserError, match=words) as e:
        check_ranks(cfg, 2)
    assert "\n" not in str(e.value) and "--ranks 1" in str(e.value)
