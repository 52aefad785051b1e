"""The q8 kernels on the device against their numpy twins: quant.cu's words, low words and scales equal to the
twin's (the same f32 roundings), gemv_q8.cu's __dp4a products within f32 summation of the exact twin. Skips without
a CUDA device (bench/gpu_suite.sh runs every `gpu` test)."""

from __future__ import annotations

import numpy as np
import pytest

from lanefuse.engine.quantize import quantize
from lanefuse.kernels import Dst, Gemv
from lanefuse.kernels.common import encode
from lanefuse.kernels.env import HostEnv
from lanefuse.kernels.quant import Quant, quant_layout


def _device() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _device(), reason="no CUDA device")]


def _dev(n: int, words: int, arrays, weights):
    from lanefuse.kernels.cupy_env import DeviceEnv

    total = quant_layout(n, words)[2]
    return DeviceEnv(total, {"xq": (0, total, "u8")}, arrays, weights, quantized={"xq": (n, words)})


@pytest.mark.parametrize("words", [1, 2])
def test_quant_kernel_equals_its_twin(words):
    n = 4096 + 32
    x = (np.random.default_rng(6).standard_normal(n) * 3).astype(np.float32)
    dev = _dev(n, words, {"x": x}, {})
    Quant("x", "xq", n, words).cuda(dev)
    dev.cp.cuda.Device().synchronize()
    want = quantize(x.reshape(1, -1), words)
    w, low, sc = dev.quant("xq")
    assert np.array_equal(dev.cp.asnumpy(w), want.words.reshape(-1))
    assert np.array_equal(dev.cp.asnumpy(sc), want.scales.reshape(-1))
    if words == 2:
        assert np.array_equal(dev.cp.asnumpy(low), want.low.reshape(-1))


@pytest.mark.parametrize("words", [1, 2])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k", "q6_k"])
@pytest.mark.parametrize("m", [1, 9])
def test_gemv_q8_kernel_equals_its_twin(fmt, words, m):
    rng = np.random.default_rng(7)
    k, n = 512, 131
    raw = encode(rng.standard_normal((n, k)).astype(np.float32) / 20, fmt)
    x = rng.standard_normal(m * k).astype(np.float32)
    q = quantize(x.reshape(m, k), words)
    b = rng.standard_normal(n).astype(np.float32)
    g = Gemv("xq", "w", fmt, Dst("y"), k, n, m, bias="b", words=words)
    host = HostEnv({"y": np.zeros(m * n, np.float32), "b": b}, {"w": (raw, fmt)},
                   {"xq": (q.words.reshape(-1), None if q.low is None else q.low.reshape(-1), q.scales.reshape(-1))})
    g.numpy(host)
    dev = _dev(m * k, words, {"x": x, "y": np.zeros(m * n, np.float32), "b": b}, {"w": (raw, fmt)})
    Quant("x", "xq", m * k, words).cuda(dev)
    g.cuda(dev)
    dev.cp.cuda.Device().synchronize()
    want = host.array("y")
    np.testing.assert_allclose(dev.host("y"), want, rtol=0, atol=2e-5 * np.abs(want).max())
