"""Whole steps on the GPU: the CuPy backend against the numpy backend on the same Plan — a decode step's logits,
and 32 generated tokens of the demo model and of a transformers-made model. Skipped without a CUDA device. Plans come
from the engine where it is installed, else from $LANEFUSE_PLANS (bench/gpu_prepare.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from lanefuse.engine import flags
from lanefuse.lane.run.step import has_cuda

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_cuda(), reason="no CUDA device (or CuPy) here")]


def _plan(name: str, graph_fn):
    plans = flags.read("LANEFUSE_PLANS")
    if plans and os.path.exists(os.path.join(plans, name + ".json")):
        from lanefuse.lane.lower.planfile import load

        return load(os.path.join(plans, name + ".json"))
    pytest.importorskip("egglog", reason="no engine here and no saved plan in $LANEFUSE_PLANS")
    from lanefuse.lane.lower.plan import plan

    return plan(graph_fn())


def _generate(cfg, weights, s, runner_cls, n=32, state=None):
    """Greedy decode with one decode plan (the prompt prefilled row by row)."""
    from lanefuse.lane.run.generate import generate

    kw = {"state": state} if state is not None else {}
    r = runner_cls(s, weights, **kw)
    return generate(cfg, weights, [1, 2, 3, 4], n, step_fn=lambda g, env: r.step(env), chunk=1)


def _pair(cfg, weights, s):
    from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    cpu = _generate(cfg, weights, s, NumpyRunner)
    gpu = _generate(cfg, weights, s, CupyRunner, state=DeviceState())
    assert gpu.generated_ids == cpu.generated_ids
    err = max(float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(gpu.logits, cpu.logits))
    print(f"max relative logit difference over 32 tokens: {err:.3g}")
    assert err < 1e-3


def test_demo_32_tokens_cupy_equals_numpy():
    from lanefuse.engine.demo import demo_model
    from lanefuse.engine.model import build_step

    cfg, w = demo_model()
    _pair(cfg, w, _plan("demo-decode", lambda: build_step(cfg, 1)))


def test_transformers_made_model_32_tokens():
    from lanefuse.engine.front import load_model
    from lanefuse.engine.model import build_step

    plans = flags.read("LANEFUSE_PLANS")
    folder = os.path.join(plans, "tiny-hf")
    if not os.path.isdir(folder):
        pytest.skip("no transformers-made model in $LANEFUSE_PLANS (bench/gpu_prepare.py makes one)")
    cfg, w = load_model(folder)
    _pair(cfg, w, _plan("tiny-hf-decode", lambda: build_step(cfg, 1)))


def _model_and_chunk(name: str, what: str):
    """The transformers-made model $LANEFUSE_PLANS/`name` (bench/gpu_prepare.py makes it): 32 tokens CuPy against
    numpy with its saved decode plan, and its 8-row prefill chunk's logits on both."""
    from lanefuse.engine.front import load_model
    from lanefuse.engine.model import build_step
    from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState
    from lanefuse.lane.run.generate import new_caches
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    plans = flags.read("LANEFUSE_PLANS")
    folder = os.path.join(plans or "", name)
    if not os.path.isdir(folder):
        pytest.skip(f"no transformers-made {what} in $LANEFUSE_PLANS (bench/gpu_prepare.py makes one)")
    cfg, w = load_model(folder)
    _pair(cfg, w, _plan(f"{name}-decode", lambda: build_step(cfg, 1)))
    s = _plan(f"{name}-prefill8", lambda: build_step(cfg, 8))
    outs = []
    for runner in (NumpyRunner(s, w), CupyRunner(s, w, state=DeviceState())):
        env = {**new_caches(cfg), "token": np.arange(3, 11, dtype=np.int32), "pos": np.array([0], np.int32)}
        outs.append(np.asarray(runner.step(env)["logits"]).reshape(-1))
    assert float(np.max(np.abs(outs[0] - outs[1])) / np.max(np.abs(outs[0]))) < 1e-3


def test_expert_mixture_model_32_tokens_and_a_sorted_chunk():
    """A transformers-made Qwen2-MoE (shared expert; the mixture finalized with the next norm): 32 tokens CuPy
    against numpy, and its 8-row prefill chunk (rows sorted by expert) on both."""
    _model_and_chunk("tiny-moe", "mixture")


def test_gptoss_model_32_tokens_and_a_sorted_chunk():
    """A transformers-made gpt-oss (the biased router routed top-k then softmax, biased experts, the clamped GLU,
    sinks and a window): 32 tokens CuPy against numpy, and its 8-row prefill chunk (rows sorted by expert) on both."""
    _model_and_chunk("tiny-gptoss", "gpt-oss")


def test_deepseek_model_32_tokens_and_a_chunk():
    """A transformers-made DeepSeek-V3 (latent attention in the wide kernel, the per-head products, the grouped
    sigmoid routing with its correction bias and shared expert): 32 tokens CuPy against numpy, and an 8-row chunk."""
    _model_and_chunk("tiny-deepseek", "DeepSeek-V3")


def test_decode_step_cuda_graph_replays_match():
    """Graph capture on and off give the same logits; the device advances the token and position itself."""
    from lanefuse.engine.demo import demo_model
    from lanefuse.lane.run.generate import new_caches
    from lanefuse.engine.model import build_step
    from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState

    cfg, w = demo_model()
    s = _plan("demo-decode", lambda: build_step(cfg, 1))
    env = new_caches(cfg)
    env["token"], env["pos"] = np.array([5], np.int32), np.array([0], np.int32)
    a = CupyRunner(s, w, DeviceState(), graph=True)
    b = CupyRunner(s, w, DeviceState(), graph=False)
    ta = [int(a.step(env)["next"][0])] + a.decode(8)
    tb = [int(b.step(env)["next"][0])] + b.decode(8)
    assert ta == tb
