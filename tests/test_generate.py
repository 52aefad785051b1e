"""Greedy generation: prefill in chunks then decode equals recomputing the whole sequence each token; the demo model
decodes a varied run; a plugged-in step function sees the documented env; mistakes are UserErrors."""

from __future__ import annotations

import numpy as np
import pytest

from lanefuse.engine.front.demo import demo_model, random_arrays
from lanefuse.engine.errors import UserError
from lanefuse.lane.run.generate import generate
from lanefuse.engine.interp import evaluate
from lanefuse.engine.front.model import ModelConfig, build_step
from lanefuse.engine.front.weights import Weights

PROMPT = [5, 77, 301, 12, 9, 140, 33]


@pytest.fixture(scope="module")
def demo():
    return demo_model()


@pytest.fixture(scope="module")
def demo_run(demo):
    cfg, w = demo
    return generate(cfg, w, PROMPT, 32)


def test_demo_is_not_degenerate(demo_run):
    toks = demo_run.generated_ids
    assert len(toks) == 32 and len(demo_run.logits) == 32
    assert len(set(toks)) > 8
    for period in range(1, 5):  # not settled into a short cycle at the end
        tail = toks[-12:]
        assert any(tail[i] != tail[i + period] for i in range(len(tail) - period))


def test_demo_is_deterministic(demo, demo_run):
    cfg, _ = demo
    _, w2 = demo_model()
    assert generate(cfg, w2, PROMPT, 32).generated_ids == demo_run.generated_ids


def test_logits_pick_the_tokens(demo_run):
    for t, lg in zip(demo_run.generated_ids, demo_run.logits):
        assert lg.shape == (512,) and int(np.argmax(lg)) == t


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_prefill_then_decode_equals_recompute(demo, demo_run, chunk):
    """Token k's logits equal those of one prefill over the prompt and the first k generated tokens."""
    cfg, w = demo
    run = generate(cfg, w, PROMPT, 8, chunk=chunk)
    assert run.generated_ids == demo_run.generated_ids[:8]
    seq = PROMPT + run.generated_ids
    for k in (0, 3, 7):
        whole = seq[:len(PROMPT) + k]
        fresh = generate(cfg, w, whole, 1, chunk=64)
        scale = np.abs(fresh.logits[0]).max()
        assert np.abs(fresh.logits[0] - run.logits[k]).max() <= 1e-5 * scale
        assert fresh.generated_ids[0] == run.generated_ids[k]


def test_step_fn_is_plugged_in(demo):
    cfg, w = demo
    seen = []

    def step(g, env):
        seen.append((g.meta["rows"], int(env["pos"][0]), env["token"].tolist(), sorted(k for k in env if "c" in k)[:2]))
        return evaluate(g, w, env)

    run = generate(cfg, w, PROMPT, 3, step_fn=step, chunk=4)
    assert seen[0] == (4, 0, PROMPT[:4], ["kc0", "kc1"])
    assert seen[1] == (3, 4, PROMPT[4:], ["kc0", "kc1"])
    assert seen[2][:3] == (1, 7, [run.generated_ids[0]])
    assert len(seen) == 4  # two prefill chunks, then two decode steps for the 2nd and 3rd tokens


def test_a_small_llama_and_qwen2_decode():
    for arch, extra in (("LlamaForCausalLM", {}), ("Qwen2ForCausalLM", {"qkv_bias": True})):
        cfg = ModelConfig(arch, 32, 2, 4, 2, 8, 48, 64, partial_rotary=0.5, max_len=32, **extra)
        w = Weights.from_dict(random_arrays(cfg, 1), cfg)
        a = generate(cfg, w, [1, 2, 3, 4, 5], 6, chunk=2)
        b = generate(cfg, w, [1, 2, 3, 4, 5], 6, chunk=5)
        assert a.generated_ids == b.generated_ids


@pytest.mark.parametrize("prompt,n,expect", [
    ([], 3, "the prompt is empty"),
    ([1, 600], 3, "prompt token 600 is outside the vocabulary"),
    ([1] * 250, 10, "need 259 positions; the KV caches hold 256"),
])
def test_errors(demo, prompt, n, expect):
    cfg, w = demo
    with pytest.raises(UserError, match=expect):
        generate(cfg, w, prompt, n)


def test_zero_tokens(demo):
    cfg, w = demo
    assert generate(cfg, w, [1], 0).generated_ids == []


def test_step_graphs_are_valid(demo):
    cfg, _ = demo
    for rows in (1, 5):
        build_step(cfg, rows).validate()
