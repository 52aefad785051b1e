"""Batch decode steps planned as the lane plans them and run by the device runner with every launch the real .cu on
the host emulator (g++: tests/cuda_host/emu.h), tests/test_lane.py's tiny Qwen3, Llama and Qwen2, each sequence at its
own position in its own slot, two steps with the caches carried, against the numpy backend's logits (within the
kernels' order of sums) and tokens:
- a batch of 5 whose products run the GEMV slab (3-8 rows of x) through gemv_slab_cp's ring of shared memory (knob
  wide_rows low enough that they take four outputs a warp), the chains' rules held: the q/k/v products, head norms and
  rotation one fold_parts_rope_4 launch on the slab, the o and down products fold_gemv_norm_4, the GLU gemv_glu_4;
- a batch of 2, and of 5 and 8 on the slab, a layer one five-phase chain (qkv_attn_o_glu_down_norm: each phase
  batched by its own kind, the attention phase reading each sequence's position and slot; at 5 and 8 rows every
  product phase on chain.cu's slab, gemv_slab_cp's ring at four outputs a warp)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from cuda_host import emu

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="no g++ to build the emulated kernels")

B = 5
CHAINS = ("qkv_attn_o_glu_down_norm", "attn_o_glu_down_norm", "o_glu_down_norm", "glu_down_norm")


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_a_planned_batch_step_on_the_slab_gives_the_numpy_backends_tokens(arch, monkeypatch):
    from test_lane import ARCHS, _weights

    from lanefuse.engine.front.model import build_step
    from lanefuse.kernels import Fold, GemmParts
    from lanefuse.lane.lower.knobs import Knobs
    from lanefuse.lane.lower.plan import plan

    cfg = ARCHS[arch]
    g = build_step(cfg, 1, batch=B)
    p = plan(g, knobs=Knobs(wide_rows=16), held=list(CHAINS))
    kinds = [x.launch for x in p.launches]
    folds = [x for x in kinds if isinstance(x, Fold) and isinstance(x.first, GemmParts) and x.fused]
    assert folds and all(f.form()[0] == "parts_rope" and f.first.per_warp == 4 and f.first.m == B for f in folds)
    assert "gemm_parts" not in p.census and "rope_parts" not in p.census, p.census
    _emulated_steps(cfg, _weights(cfg), p, B, monkeypatch)


@pytest.mark.parametrize("arch,b", [("qwen3", 2), ("llama", 2), ("qwen2", 2), ("qwen3", 5), ("llama", 8)])
def test_a_planned_batch_runs_each_layer_as_one_chain(arch, b, monkeypatch):
    from test_lane import ARCHS, _weights

    from lanefuse.engine.front.model import build_step
    from lanefuse.kernels import Chain
    from lanefuse.lane.lower.plan import plan

    cfg = ARCHS[arch]
    g = build_step(cfg, 1, batch=b)
    p = plan(g)
    chains = [x.launch for x in p.launches if isinstance(x.launch, Chain) and x.launch.qkv is not None]
    # (tiny-qwen3's layer 0: gate f32, up bf16: no chain there)
    assert chains and p.fusions.get("qkv_attn_o_glu_down_norm", 0) == len(chains) >= cfg.layers - 1
    assert all(c.attention.slot and c.attention.rows == b for c in chains)
    assert all(c.glu.per_warp == 4 for c in chains) if b > 2 else True
    _emulated_steps(cfg, _weights(cfg), p, b, monkeypatch)


def _emulated_steps(cfg, w, p, b, monkeypatch):
    """Two steps of plan p (a batch of b) on the emulator against the numpy backend, the caches carried."""
    from test_batch import _random_env
    from test_issue40_views import _Stream

    from lanefuse.lane.run import cupy_runner
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    stems = sorted({x.launch.stem for x in p.launches if x.launch.kernels()})
    want_r = NumpyRunner(p, w, exact=True)
    tables = _random_env(cfg, b, 3)
    mine = {n: np.array(t, copy=True) for n, t in tables.items()}
    with emu.emulating(stems) as device_env:
        monkeypatch.setattr(cupy_runner, "DeviceEnv", device_env)
        monkeypatch.setattr(sys.modules["cupy"].cuda, "Stream", _Stream, raising=False)
        r = cupy_runner.CupyRunner(p, w, cupy_runner.DeviceState(), graph=False)
        for step in range(2):
            want, got = want_r.step(tables), r.step(mine)
            scale = float(np.abs(want["logits"]).max())
            assert np.abs(got["logits"] - want["logits"]).max() <= 2e-5 * scale, (cfg.name, step)
            assert np.array_equal(got["next"], want["next"]), (cfg.name, step)
            for env in (tables, mine):  # the next step: each sequence's token and position advanced
                env["token"] = np.asarray(want["next"], np.int32).reshape(-1)[:b].copy()
                env["pos"] = env["pos"] + 1


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_planned_prompt_chunk_of_eight_rows_chains_on_the_slab(arch, monkeypatch):
    """A prompt's chunks of 8 rows (positions 0..7, then 8..15, the caches carried) planned as the lane plans them:
    every layer but the last one five-phase chain on fold_attn_o_glu_down_slab (each row attending to the keys up to
    its own), run by the device runner with every launch emulated, against the numpy backend's logits and tokens."""
    from test_issue40_views import _Stream
    from test_lane import ARCHS, _weights

    from lanefuse.engine.front.model import build_step
    from lanefuse.kernels import Chain
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run import cupy_runner
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    cfg = ARCHS[arch]
    w = _weights(cfg)
    g = build_step(cfg, 8)
    p = plan(g)
    chains = [x.launch for x in p.launches if isinstance(x.launch, Chain)]
    assert len(chains) == cfg.layers - 1 and all(c.kernel_name() == "fold_attn_o_glu_down_slab" for c in chains)
    stems = sorted({x.launch.stem for x in p.launches if x.launch.kernels()})
    want_r = NumpyRunner(p, w, exact=True)
    tables = {n: np.zeros(g.shape(n), np.float32) for n in p.io.tables}
    mine = {n: t.copy() for n, t in tables.items()}
    toks = np.random.default_rng(3).integers(1, cfg.vocab, 16).astype(np.int32)
    with emu.emulating(stems) as device_env:
        monkeypatch.setattr(cupy_runner, "DeviceEnv", device_env)
        monkeypatch.setattr(sys.modules["cupy"].cuda, "Stream", _Stream, raising=False)
        r = cupy_runner.CupyRunner(p, w, cupy_runner.DeviceState(), graph=False)
        for pos in (0, 8):
            env = {"token": toks[pos:pos + 8], "pos": np.array([pos], np.int32)}
            want, got = want_r.step({**env, **tables}), r.step({**env, **mine})
            scale = float(np.abs(want["logits"]).max())
            assert np.abs(got["logits"] - want["logits"]).max() <= 2e-5 * scale, (arch, pos)
            assert np.array_equal(got["next"], want["next"]), (arch, pos)
