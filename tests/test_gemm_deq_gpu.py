"""Block-format rows decoded to bf16, then cuBLAS (kernels/gemm_deq.py), on a CUDA device: gemm_tc_dequant equal to
its twin to the bit for every block format it serves (a matrix of 4096 x 4096 through the grid's loop too), the
products within gemm_tc's bound of the exact twin (cuBLAS sums in its own order), parts and the GLU, and inside a
captured CUDA graph. Skipped without a CUDA device; the host side runs on the CPU in tests/test_gemm_deq.py (the
emulated kernels, the stand-in cuBLAS)."""

from __future__ import annotations

import numpy as np
import pytest

from lanefuse.kernels import Dst, GemmPart, GemmTc, HostEnv
from lanefuse.kernels.common import FORMAT_CODE, decode, encode
from lanefuse.kernels.gemm_deq import GemmDeq, GemmDeqGlu, GemmDeqParts, decoded_bf16, dequant_grid
from lanefuse.kernels.gemm_tc import tc_bound

from test_gemm_tc import check_within_bound, r32, tc_case
from test_gemm_tc_gpu import replayed, run  # the launch on the device, synchronized; captured in a graph, replayed
from test_kernels_gpu import _device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _device(), reason="no CUDA device")]


def dequant_on_device(raw, fmt, n, k):
    """gemm_tc_dequant of rows (n, k) in `fmt` on the device: the bf16 bits it wrote and the 8 words past them."""
    from lanefuse.kernels.cupy_env import DeviceEnv, i64

    dev = DeviceEnv(0, {}, {}, {"w": (raw, fmt)})
    out = dev.cp.zeros(2 * (n * k + 8), dtype=np.uint8)
    out[...] = 0xAB
    g, b = dequant_grid(n * k)
    dev.function(GemmTc.stem, "gemm_tc_dequant")(g, b, (dev.weight("w")[0], i64(FORMAT_CODE[fmt]), out, i64(n * k)))
    host = dev.cp.asnumpy(out).view(np.uint16)
    return host[: n * k].reshape(n, k), host[n * k:]


@pytest.mark.parametrize("fmt,n,k", [("q8_0", 37, 96), ("q4_0", 29, 64), ("q4_k", 13, 512), ("q6_k", 11, 256),
                                     ("mxfp4", 19, 64), ("q4_k", 4096, 4096), ("q8_0", 1024, 4096)])
def test_dequant_is_the_twin_to_the_bit(fmt, n, k):
    g = np.random.default_rng(n + k)
    raw = encode(r32(g, n, k) * np.exp(r32(g, n, 1)), fmt)
    got, past = dequant_on_device(raw, fmt, n, k)
    np.testing.assert_array_equal(got, decoded_bf16(raw, fmt, n, k))
    assert (past == 0xABAB).all()


@pytest.mark.parametrize("m,n,k", [(16, 8, 256), (19, 24, 512), (130, 33, 256), (512, 1024, 4096),
                                   (2048, 4096, 512)])
@pytest.mark.parametrize("fmt", ["q4_k", "q8_0", "q6_k", "q4_0"])
def test_gemm_deq_within_the_bound(m, n, k, fmt):
    g = np.random.default_rng(m + n + k)
    launch = GemmDeq("x", "w", fmt, Dst("y"), k, n, m, bias="b" if n % 2 else None)
    arrays, weights = tc_case(launch, g)
    dev = run(launch, arrays, weights)
    first = dev.host("y")
    check_within_bound(launch, arrays, weights, first)
    launch.cuda(dev)  # again: the same bits
    np.testing.assert_array_equal(dev.host("y"), first)


def test_gemm_deq_parts_and_glu():
    g = np.random.default_rng(7)
    m, k = 19, 256
    parts = (GemmPart("wq", Dst("q"), 130, bias="bq"), GemmPart("wk", Dst("kc", row="pos", pitch=20), 20))
    launch = GemmDeqParts("x", "q4_k", k, m, parts)
    arrays = {"x": r32(g, m, k), "q": np.zeros(m * 130, np.float32), "kc": np.zeros((m + 8) * 20, np.float32),
              "pos": np.array([4], np.int32)}
    weights = {p.w: (encode(r32(g, p.n, k) * 0.5, "q4_k"), "q4_k") for p in parts}
    weights["bq"] = (r32(g, 130), "f32")
    dev = run(launch, arrays, weights)
    host = HostEnv({n: a.copy() for n, a in arrays.items()}, weights)
    launch.numpy(host)
    for p, name in zip(parts, ("q", "kc")):
        idx = p.y.indices(m * p.n, host)
        bound = tc_bound(arrays["x"], decode(*weights[p.w]).reshape(p.n, k)).reshape(-1)
        got, want = dev.host(name), host.array(name)
        assert (np.abs(got[idx] - want[idx]) <= bound + 2.0**-23 * np.abs(want[idx])).all(), name
    n = 40
    glu = GemmDeqGlu("x", "wg", "wu", "q8_0", "o", k, n, m)
    arrays = {"x": r32(g, m, k), "o": np.zeros(m * n, np.float32)}
    weights = {w: (encode(r32(g, n, k) * 0.5, "q8_0"), "q8_0") for w in ("wg", "wu")}
    got = run(glu, arrays, weights).host("o")
    host = HostEnv({n_: a.copy() for n_, a in arrays.items()}, weights)
    glu.numpy(host)
    b = max(tc_bound(arrays["x"], decode(*weights[w]).reshape(n, k)).max() for w in ("wg", "wu"))
    scale = np.abs(host.array("o")).max()
    assert np.abs(got - host.array("o")).max() <= 4 * b * (1 + scale) + 2.0**-22 * scale


def test_gemm_deq_in_a_captured_graph():
    """A warm-up launch, then the launch captured on a non-blocking stream: the replay within the bound, again the
    same bits."""
    replayed(GemmDeq("x", "w", "q4_k", Dst("y"), 512, 1024, 200))
