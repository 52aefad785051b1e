"""The tensor-core GEMM on a CUDA device against its numpy twin within the bound the numerics gives (tc_bound: the
kernel's f32 sums in another order than the twin's exact ones), over edge shapes and prefill-sized ones, every format
it reads, its epilogue and destinations; a relaunch writes the same bits. Skipped without a CUDA device; the same
cases' host side and kernels run on the CPU in tests/test_gemm_tc.py (the emulator)."""

from __future__ import annotations

import numpy as np
import pytest

from lanefuse.kernels import Dst, GemmTc, Part

from test_gemm_tc import check_within_bound, parts_case, tc_case
from test_kernels_gpu import _device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _device(), reason="no CUDA device")]


def run(launch, arrays, weights):
    from lanefuse.kernels.cupy_env import DeviceEnv

    assert launch.check() is None, launch.check()
    dev = DeviceEnv(0, {}, arrays, weights)
    launch.cuda(dev)
    dev.cp.cuda.Device().synchronize()
    return dev


def replayed(launch, seed: int = 8) -> None:
    """The runner's way with `launch` (one product writing y): a warm-up launch (CuPy's handle and cuBLAS's workspace
    made outside capture), then the launch captured on a non-blocking stream; the replayed graph writes the twin's
    values within the bound, and a second replay the same bits."""
    from lanefuse.kernels.cupy_env import DeviceEnv

    arrays, weights = tc_case(launch, np.random.default_rng(seed))
    dev = DeviceEnv(0, {}, arrays, weights)
    s = dev.cp.cuda.Stream(non_blocking=True)
    with s:
        launch.cuda(dev)
        s.synchronize()
        dev.array("y")[:] = 0
        s.begin_capture()
        launch.cuda(dev)
        graph = s.end_capture()
        graph.launch(s)
        s.synchronize()
    first = dev.host("y")
    check_within_bound(launch, arrays, weights, first)
    with s:
        dev.array("y")[:] = 0
        graph.launch(s)
        s.synchronize()
    np.testing.assert_array_equal(dev.host("y"), first)


@pytest.mark.parametrize("m,n,k", [(16, 8, 16), (17, 100, 80), (130, 33, 72), (16, 129, 7), (200, 257, 96),
                                   (512, 1024, 4096), (2048, 4096, 512), (64, 6144, 1024)])
@pytest.mark.parametrize("fmt", ["bf16", "f16", "f32"])
def test_gemm_tc_within_the_bound(m, n, k, fmt):
    g = np.random.default_rng(m + n + k)
    launch = GemmTc("x", "w", fmt, Dst("y"), k, n, m, bias="b" if n % 2 else None)
    arrays, weights = tc_case(launch, g)
    dev = run(launch, arrays, weights)
    first = dev.host("y")
    check_within_bound(launch, arrays, weights, first)
    launch.cuda(dev)
    np.testing.assert_array_equal(dev.host("y"), first)


@pytest.mark.parametrize("fmt,k", [("q8_0", 512), ("q4_0", 96), ("q4_k", 1024), ("q6_k", 512), ("mxfp4", 64)])
def test_gemm_tc_block_formats(fmt, k):
    g = np.random.default_rng(k)
    launch = GemmTc("x", "w", fmt, Dst("y"), k, 300, 70)
    arrays, weights = tc_case(launch, g)
    check_within_bound(launch, arrays, weights, run(launch, arrays, weights).host("y"))


@pytest.mark.parametrize("dst", [Dst("y", unit=Part(23, 2, 19)), Dst("y", row="pos", pitch=19), Dst("y")])
def test_gemm_tc_epilogue_and_destinations(dst):
    g = np.random.default_rng(5)
    launch = GemmTc("x", "w", "bf16", dst, 48, 19, 33, bias="b", add="res")
    arrays, weights = tc_case(launch, g)
    check_within_bound(launch, arrays, weights, run(launch, arrays, weights).host("y"))


@pytest.mark.parametrize("fmt,k,m", [("bf16", 72, 19), ("bf16", 13, 19), ("f16", 40, 300), ("q8_0", 512, 130)])
def test_gemm_tc_in_parts(fmt, k, m):
    parts_case(fmt, k, m, run)
