"""Whole steps on the GPU: the CuPy backend against the numpy backend on the same Plan — the demo model's 32 tokens
and its CUDA graph replays, and every family the front reads (Llama, Mistral, Phi-3, Qwen2, Qwen3, Qwen3-MoE,
Mixtral, Qwen2-MoE, gpt-oss, Gemma 2, Gemma 3, Qwen3-Next, DeepSeek-V3) and the GGUF block formats (q8_0, q4_0,
q4_k, q6_k under --numerics f32 and q8) as transformers-made tiny models: a decode step's 32 greedy tokens and an
8-row prefill chunk, CuPy = numpy; and a batch of 8 sequences in slots that refill. Skipped without a CUDA device.

The models and their plans come from $LANEFUSE_PLANS/families, made on a CPU machine by bench/gpu_prepare.py
(tests/gpu_families.py: a model's plans and a pack of the constants they read, so the device needs no solver, no
checkpoint, no gguf package); the demo's plan from the engine where it is installed, else from there too. The CPU
half of this (the packs, the loops, the CuPy runner's wiring) is checked on the CPU by
tests/test_gpu_families_cpu.py."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

import gpu_families as gfm
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


def test_demo_32_tokens_cupy_equals_numpy():
    from lanefuse.engine.front.demo import demo_model
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    cfg, w = demo_model()
    s = _plan("demo-decode", lambda: build_step(cfg, 1))
    cpu = _generate(cfg, w, s, NumpyRunner)
    gpu = _generate(cfg, w, s, CupyRunner, state=DeviceState())
    assert gpu.generated_ids == cpu.generated_ids
    err = max(float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(gpu.logits, cpu.logits))
    print(f"max relative logit difference over 32 tokens: {err:.3g}")
    assert err < 1e-3


def test_decode_step_cuda_graph_replays_match():
    """Graph capture on and off give the same logits; the device advances the token and position itself."""
    from lanefuse.engine.front.demo import demo_model
    from lanefuse.lane.run.generate import new_caches
    from lanefuse.engine.front.model import build_step
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


@pytest.mark.parametrize("graph", [True, False])
def test_demo_with_programmatic_dependent_launch_equals_numpy(graph, monkeypatch):
    """LANEFUSE_PDL=1 (kernels/pdl.py: every kernel through cuLaunchKernelEx, each free to start while the one before
    it drains, waiting in PDL_ENTER): the demo's 32 tokens and logits as numpy's, in a CUDA graph (programmatic
    edges) and launched one by one. Below sm_90 the flag is ignored (the plain launch)."""
    from lanefuse.engine.front.demo import demo_model
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    monkeypatch.setenv("LANEFUSE_PDL", "1")
    cfg, w = demo_model()
    s = _plan("demo-decode", lambda: build_step(cfg, 1))
    cpu = _generate(cfg, w, s, NumpyRunner)
    r = CupyRunner(s, w, DeviceState(), graph=graph)
    import cupy

    assert r.env.pdl == (int(cupy.cuda.Device().compute_capability) >= 90)
    from lanefuse.lane.run.generate import generate

    gpu = generate(cfg, w, [1, 2, 3, 4], 32, step_fn=lambda g, env: r.step(env), chunk=1)
    assert gpu.generated_ids == cpu.generated_ids
    err = max(float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(gpu.logits, cpu.logits))
    assert err < 1e-3, err


def _saved(name: str):
    plans_dir = os.path.join(flags.read("LANEFUSE_PLANS") or "", gfm.SUBDIR)
    if name not in gfm.read_manifest(plans_dir):
        pytest.skip(f"no {name} in $LANEFUSE_PLANS (bench/gpu_prepare.py makes it)")
    plans, pack, entry = gfm.load_model_plans(plans_dir, name)
    for e in entry["check_errors"]:  # run anyway (the device's numbers are wanted), but say so
        warnings.warn(f"the plan check refuses a saved plan of {name}, run unchecked: {e}")
    return plans, pack, entry


def _device(graph: bool = True):
    from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState

    return lambda s, w: CupyRunner(s, w, DeviceState(), graph=graph)


@pytest.mark.parametrize("name", gfm.model_names())
def test_model_32_tokens_and_a_chunk_cupy_equals_numpy(name):
    """A family's (or a GGUF format's) decode plan: the prompt row by row and 32 greedy tokens, CuPy (a CUDA graph
    replayed a step) against the numpy runner's exact twins, the same tokens and logits within 1e-3 of their scale;
    its 8-row prefill chunk's logits likewise."""
    plans, pack, entry = _saved(name)
    print(f"{name} ({entry['what']}): " + gfm.check_model(plans, pack, _device()))


@pytest.mark.parametrize("graph", [True, False])
def test_batch_of_8_slots_that_refill_cupy_equals_numpy(graph):
    """The batch family's 12 prompts in 8 slots (each prompt prefilled on the device and copied into its slot, the
    batch step over the slots; sequences ending at an end id give their slots to the waiting prompts): each prompt's
    tokens and logits the numpy runner's."""
    plans, pack, entry = _saved(f"fam-{gfm.BATCH_FAMILY}")
    print(gfm.check_batch(plans, pack, entry, graph=graph))


def test_qwen3_next_without_a_cuda_graph():
    """Qwen3-Next's steps run launch by launch (no graph capture): its kernels apart from the runner's capture, whose
    warm-up run before capturing applies the carried states' update once more than the host asked (the CuPy
    runner's bug, shown on the CPU by tests/test_gpu_families_cpu.py)."""
    plans, pack, entry = _saved("fam-qwen3_next")
    print("Qwen3-Next, no graph: " + gfm.check_model(plans, pack, _device(graph=False)))
