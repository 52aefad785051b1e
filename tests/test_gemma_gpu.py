"""Gemma's launches on the GPU: each CUDA launch against its numpy twin (the soft-capped attention with a window and
splits, the soft cap in a product's epilogue and its split-K combine, the soft cap alone, the exact GELU, the sandwich
norm folded into a product), and a transformers-made tiny Gemma 2's 32 greedy tokens, CuPy against numpy on the same
saved plan ($LANEFUSE_PLANS, bench/gpu_prepare.py). Skipped without a CUDA device."""

from __future__ import annotations

import os

import numpy as np
import pytest

from lanefuse.engine import flags
from lanefuse.kernels import Attention, Dst, Fold, Gemv, GemvGlu, Norm, PreNorm, Softcap, Unary
from lanefuse.kernels.common import encode
from lanefuse.lane.run.step import has_cuda

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_cuda(), reason="no CUDA device (or CuPy) here")]


def r32(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


def both(launch, arrays, weights=None, tol=1e-4):
    from lanefuse.kernels import HostEnv
    from lanefuse.kernels.cupy_env import DeviceEnv

    weights = weights or {}
    assert launch.check() is None, launch.check()
    host = HostEnv({k: v.copy() for k, v in arrays.items()}, weights)
    launch.numpy(host)
    dev = DeviceEnv(0, {}, {k: v.copy() for k, v in arrays.items()}, weights)
    launch.cuda(dev)
    dev.cp.cuda.Device().synchronize()
    for name in arrays:
        np.testing.assert_allclose(dev.host(name), host.array(name), rtol=tol, atol=tol, err_msg=name)


@pytest.mark.parametrize("rows,pos,window,splits,per_block", [(1, 40, 16, 1, 1), (1, 100, 16, 4, 2),
                                                                (5, 30, 8, 2, 1), (1, 63, 0, 8, 4)])
def test_attention_soft_cap(rows, pos, window, splits, per_block):
    g = np.random.default_rng(pos)
    heads, kv, hd, L = 8, 2, 64, 128
    arrays = {"q": 3 * r32(g, rows * heads * hd), "kc": r32(g, L * kv * hd), "vc": r32(g, L * kv * hd),
              "pos": np.array([pos], np.int32), "o": np.zeros(rows * heads * hd, np.float32)}
    both(Attention("q", "kc", "vc", "pos", "o", heads, heads // kv, hd, hd, L, rows, 0.125, window=window,
                   softcap=5.0, splits=splits, per_block=per_block), arrays)


@pytest.mark.parametrize("m,split,per_warp", [(1, 1, 4), (1, 3, 1), (3, 1, 1)])
def test_gemv_soft_cap(m, split, per_warp):
    g = np.random.default_rng(m + split)
    k, n = 512, 1031
    w = encode(r32(g, n, k), "bf16")
    arrays = {"x": r32(g, m * k), "y": np.zeros(m * n, np.float32)}
    both(Gemv("x", "w", "bf16", Dst("y"), k, n, m, split=split, per_warp=per_warp, cap=3.0), arrays,
         {"w": (w, "bf16")}, tol=2e-4)


def test_soft_cap_alone_and_the_exact_gelu():
    g = np.random.default_rng(1)
    n = 3001
    both(Softcap("x", "y", n, 30.0), {"x": 40 * r32(g, n), "y": np.zeros(n, np.float32)})
    both(Unary("gelu_erf", "x", "y", n), {"x": 3 * r32(g, n), "y": np.zeros(n, np.float32)})
    k, f = 96, 77
    weights = {"wg": (encode(r32(g, f, k), "bf16"), "bf16"), "wu": (encode(r32(g, f, k), "bf16"), "bf16")}
    both(GemvGlu("x", "wg", "wu", "bf16", "o", k, f, 1, act="gelu_erf"),
         {"x": r32(g, k), "o": np.zeros(f, np.float32)}, weights)


@pytest.mark.parametrize("m", [1, 4])
def test_sandwich_folded_into_the_product(m):
    g = np.random.default_rng(m)
    k, d = 160, 96
    weights = {"w": (encode(r32(g, d, k), "bf16"), "bf16"), "pw": ((1.5 + 0.2 * r32(g, d)), "f32"),
               "nw": ((1.5 + 0.2 * r32(g, d)), "f32")}
    arrays = {"x": r32(g, m * k), "o": np.zeros(m * d, np.float32), "r": r32(g, m * d),
              "s": np.zeros(m * d, np.float32), "y": np.zeros(m * d, np.float32)}
    f = Fold(Gemv("x", "w", "bf16", Dst("o"), k, d, m),
             Norm("r", "nw", "y", m, d, 1e-6, add="o", sum="s", pre=PreNorm("pw", 1e-6)))
    assert f.fused, f.form()
    both(f, arrays, weights)
    both(Norm("r", "nw", "y", m, d, 1e-6, add="o", sum="s", pre=PreNorm("pw", 1e-6)),
         {"r": arrays["r"], "o": r32(g, m * d), "s": arrays["s"], "y": arrays["y"]}, weights)


def test_transformers_made_gemma2_32_tokens():
    from lanefuse.engine.front.load import load_model
    from lanefuse.lane.lower.planfile import load
    from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState
    from lanefuse.lane.run.generate import generate
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    plans = flags.read("LANEFUSE_PLANS") or ""
    folder, saved = os.path.join(plans, "tiny-gemma2"), os.path.join(plans, "tiny-gemma2-decode.json")
    if not (os.path.isdir(folder) and os.path.exists(saved)):
        pytest.skip("no transformers-made Gemma 2 in $LANEFUSE_PLANS (bench/gpu_prepare.py makes one)")
    cfg, w = load_model(folder)
    s = load(saved)
    runs = []
    for cls, kw in ((NumpyRunner, {}), (CupyRunner, {"state": DeviceState()})):
        r = cls(s, w, **kw)
        runs.append(generate(cfg, w, [1, 2, 3, 4], 32, step_fn=lambda g, env, r=r: r.step(env), chunk=1))
    cpu, gpu = runs
    assert gpu.generated_ids == cpu.generated_ids
    err = max(float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(gpu.logits, cpu.logits))
    print(f"tiny Gemma 2: max relative logit difference over 32 tokens, CuPy against numpy: {err:.3g}")
    assert err < 1e-3
