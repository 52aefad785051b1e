"""The cuBLAS forms of the tensor-core products (kernels/gemm_blas.py) on a CUDA device against gemm_tc's numpy twin
within its bound (gemm_tc.tc_bound, plus an f32 rounding of the result for the epilogue's additions: cuBLAS sums in
its own order), over awkward and prefill-sized shapes, destinations, parts and the GLU; and inside a captured CUDA
graph (the runner's way: one warm-up launch, then capture; a replay writes the same bits). Skipped without a CUDA
device; the calls' arguments are checked on the CPU against a stand-in cuBLAS in tests/test_gemm_blas.py."""

from __future__ import annotations

import numpy as np
import pytest

from lanefuse.kernels import Dst, GemmPart, GemmTcGlu, HostEnv, Part
from lanefuse.kernels.common import encode
from lanefuse.kernels.gemm_blas import GemmBlas, GemmBlasGlu, GemmBlasParts

from test_gemm_tc import check_within_bound, r32, tc_case
from test_gemm_tc_gpu import replayed, run  # the launch on the device, synchronized; captured in a graph, replayed
from test_kernels_gpu import _device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _device(), reason="no CUDA device")]


@pytest.mark.parametrize("m,n,k", [(16, 8, 16), (19, 24, 37), (17, 100, 80), (130, 33, 72), (33, 70000, 64),
                                   (512, 1024, 4096), (2048, 4096, 512), (64, 6144, 1024)])
def test_gemm_blas_within_the_bound(m, n, k):
    g = np.random.default_rng(m + n + k)
    launch = GemmBlas("x", "w", "bf16", Dst("y"), k, n, m, bias="b" if n % 2 else None)
    arrays, weights = tc_case(launch, g)
    dev = run(launch, arrays, weights)
    first = dev.host("y")
    check_within_bound(launch, arrays, weights, first)
    launch.cuda(dev)  # again: cuBLAS's default algorithm gives the same bits
    np.testing.assert_array_equal(dev.host("y"), first)


@pytest.mark.parametrize("dst", [Dst("y", unit=Part(23, 2, 19)), Dst("y", row="pos", pitch=19), Dst("y"),
                                 Dst("y", row=2, pitch=19)])
@pytest.mark.parametrize("epilogue", [True, False])
def test_gemm_blas_epilogue_and_destinations(dst, epilogue):
    g = np.random.default_rng(5)
    kw = dict(bias="b", add="res") if epilogue else {}
    launch = GemmBlas("x", "w", "bf16", dst, 48, 19, 33, **kw)
    arrays, weights = tc_case(launch, g)
    check_within_bound(launch, arrays, weights, run(launch, arrays, weights).host("y"))


def test_gemm_blas_residual_in_place():
    g = np.random.default_rng(6)
    launch = GemmBlas("x", "w", "bf16", Dst("y"), 40, 24, 17, add="y")
    arrays = {"x": r32(g, 17, 40), "y": r32(g, 17 * 24)}
    weights = {"w": (encode(r32(g, 24, 40) * 0.5, "bf16"), "bf16")}
    check_within_bound(launch, arrays, weights, run(launch, arrays, weights).host("y"))


def test_gemm_blas_parts_and_glu():
    from lanefuse.kernels.gemm_tc import tc_bound

    g = np.random.default_rng(7)
    m, k = 19, 72
    parts = (GemmPart("wq", Dst("q"), 130, bias="bq"), GemmPart("wk", Dst("kc", row="pos", pitch=20), 20),
             GemmPart("wv", Dst("qkv", unit=Part(133, 2, 129)), 129))
    launch = GemmBlasParts("x", "bf16", k, m, parts)
    arrays = {"x": r32(g, m, k), "q": np.zeros(m * 130, np.float32), "kc": np.zeros((m + 8) * 20, np.float32),
              "pos": np.array([4], np.int32), "qkv": np.zeros(m * 133, np.float32)}
    weights = {f"w{c}": (encode(r32(g, p.n, k) * 0.5, "bf16"), "bf16") for c, p in zip("qkv", parts)}
    weights["bq"] = (r32(g, 130), "f32")
    dev = run(launch, arrays, weights)
    host = HostEnv({n: a.copy() for n, a in arrays.items()}, weights)
    launch.numpy(host)
    from lanefuse.kernels.common import decode

    for c, p in zip("qkv", parts):  # each part within its product's bound (+ the bias's rounding), nothing else
        name = {"q": "q", "k": "kc", "v": "qkv"}[c]
        idx = p.y.indices(m * p.n, host)
        bound = tc_bound(arrays["x"], decode(*weights[p.w]).reshape(p.n, k)).reshape(-1)
        got, want = dev.host(name), host.array(name)
        assert (np.abs(got[idx] - want[idx]) <= bound + 2.0**-23 * np.abs(want[idx])).all(), name
        rest = np.ones(got.size, bool)
        rest[idx] = False
        np.testing.assert_array_equal(got[rest], arrays[name][rest], err_msg=name)
    n = 40
    glu = GemmBlasGlu("x", "wg", "wu", "bf16", "o", k, n, m)
    arrays = {"x": r32(g, m, k), "o": np.zeros(m * n, np.float32)}
    weights = {w: (encode(r32(g, n, k) * 0.5, "bf16"), "bf16") for w in ("wg", "wu")}
    got = run(glu, arrays, weights).host("o")
    host = HostEnv({n_: a.copy() for n_, a in arrays.items()}, weights)
    GemmTcGlu("x", "wg", "wu", "bf16", "o", k, n, m).numpy(host)
    b = max(tc_bound(arrays["x"], decode(*weights[w]).reshape(n, k)).max() for w in ("wg", "wu"))
    scale = np.abs(host.array("o")).max()
    assert np.abs(got - host.array("o")).max() <= 4 * b * (1 + scale) + 2.0**-22 * scale


def test_gemm_blas_in_a_captured_graph():
    """The runner's way: a warm-up launch (CuPy's handle and cuBLAS's workspace made outside capture), then the
    launch captured on a non-blocking stream; the replayed graph writes the twin's values within the bound, again
    the same bits."""
    replayed(GemmBlas("x", "w", "bf16", Dst("y"), 512, 1024, 200))
