"""The q8 kernels on the device against their numpy twins: quant.cu's words, low words and scales equal to the
twin's (the same f32 roundings), gemv_q8.cu's __dp4a products within f32 summation of the exact twin. Skips without
a CUDA device (bench/gpu_suite.sh runs every `gpu` test)."""

from __future__ import annotations

import dataclasses

from dataclasses import replace

import numpy as np
import pytest

from lanefuse.engine.formats.quantize import quantize
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


@pytest.mark.parametrize("words", [1, 2, 3])
def test_quant_kernel_equals_its_twin(words):
    n = 4096 + (256 if words == 3 else 32)
    x = (np.random.default_rng(6).standard_normal(n) * 3).astype(np.float32)
    if words == 3:  # a block all zero, a block whose largest |x| is negative and twice, halves that round to even
        x[256:512] = 0
        x[512:768] = np.where(np.arange(256) % 7 == 0, np.float32(-127), x[512:768])
        x[768:1024] = (np.arange(256) % 9 - 4).astype(np.float32) * 0.5 + np.float32(0)
        x[768] = -127
    dev = _dev(n, words, {"x": x}, {})
    Quant("x", "xq", n, words).cuda(dev)
    dev.cp.cuda.Device().synchronize()
    want = quantize(x.reshape(1, -1), words)
    w, low, sc = dev.quant("xq")
    assert np.array_equal(dev.cp.asnumpy(w), want.words.reshape(-1))
    assert np.array_equal(dev.cp.asnumpy(sc), want.scales.reshape(-1))
    if words >= 2:  # q8x2's low words; the q8k form's sums of 16 words
        assert np.array_equal(dev.cp.asnumpy(low), want.parts()[1])


Q8K_CASES = [("q4_k", 3), ("q6_k", 3)]  # the q8k form (llama.cpp's q8_K) times K-quant rows: gemv_q8.cu's q8k_tile


@pytest.mark.parametrize("fmt,words", [(f, w) for w in (1, 2) for f in ("q8_0", "q4_0", "q4_k", "q6_k")] + Q8K_CASES)
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
                   {"xq": q.parts()})
    g.numpy(host)
    dev = _dev(m * k, words, {"x": x, "y": np.zeros(m * n, np.float32), "b": b}, {"w": (raw, fmt)})
    Quant("x", "xq", m * k, words).cuda(dev)
    g.cuda(dev)
    dev.cp.cuda.Device().synchronize()
    want = host.array("y")
    np.testing.assert_allclose(dev.host("y"), want, rtol=0, atol=2e-5 * np.abs(want).max())


def _both_q8(launch, x, words, arrays, weights, tol=2e-5):
    """`launch` (reading the quantized form `xq` of x) on the host from quantize(x) and on the device after quant.cu
    quantized x there: every array agrees afterwards, within f32 summation of the exact twin's sums."""
    reads = getattr(launch, "first", launch)  # a Fold's products (its first launch) read x: their rows and width
    q = quantize(x.reshape(reads.m, reads.k), words)
    assert launch.check() is None, launch.check()
    host = HostEnv({k: v.copy() for k, v in arrays.items()}, weights, {"xq": q.parts()})
    launch.numpy(host)
    dev = _dev(x.size, words, {"x": x, **arrays}, weights)
    Quant("x", "xq", x.size, words).cuda(dev)
    launch.cuda(dev)
    dev.cp.cuda.Device().synchronize()
    for name in arrays:
        want = host.array(name)
        np.testing.assert_allclose(dev.host(name), want, rtol=0, atol=tol * max(np.abs(want).max(), 1.0),
                                   err_msg=name)
    return dev


@pytest.mark.parametrize("fmt,words", [(f, w) for w in (1, 2) for f in ("q8_0", "q4_0", "q4_k", "q6_k")] + Q8K_CASES)
def test_gemv_glu_and_parts_q8_kernels_equal_their_twins(fmt, words):
    from lanefuse.kernels import GemmPart, GemmParts, GemvGlu, Part

    rng = np.random.default_rng(8)
    m, k, n = 3, 512, 299
    w = {"wg": (encode(rng.standard_normal((n, k)).astype(np.float32) / 20, fmt), fmt),
         "wu": (encode(rng.standard_normal((n, k)).astype(np.float32) / 20, fmt), fmt),
         "bg": (rng.standard_normal(n).astype(np.float32), "f32")}
    x = rng.standard_normal(m * k).astype(np.float32)
    _both_q8(GemvGlu("xq", "wg", "wu", fmt, "o", k, n, m, bg="bg", words=words), x, words,
             {"o": np.zeros(m * n, np.float32)}, w)
    W = 2 * n + 5
    parts = (GemmPart("wg", Dst("qkv", unit=Part(W, 0, n)), n, bias="bg"),
             GemmPart("wu", Dst("kc", row="pos", pitch=n), n), GemmPart("wu", Dst("qkv", unit=Part(W, n + 5, n)), n))
    _both_q8(GemmParts("xq", fmt, k, m, parts, words=words), x, words,
             {"qkv": np.zeros(m * W, np.float32), "kc": np.zeros(8 * n, np.float32), "pos": np.array([2], np.int32)},
             w)


@pytest.mark.parametrize("fmt,words", [(f, w) for w in (1, 2) for f in ("q8_0", "q4_k")] + Q8K_CASES[:1])
def test_fold_q8_kernels_equal_their_twins(fmt, words):
    """gemv_norm and parts_rope over a quantized activation: the products by gemv_q8.cu's body, the norm by the
    last block, each rotated head by the last of its blocks (a second launch runs them again)."""
    from lanefuse.kernels import Fold, GemmPart, GemmParts, Norm, RopeParts, RopeSide

    rng = np.random.default_rng(9)
    m, k, n = 2, 512, 77
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    x = r(m * k)
    f = Fold(Gemv("xq", "w", fmt, Dst("o"), k, n, m, words=words), Norm("res", "nw", "y", m, n, 1e-6, add="o",
                                                                           sum="sum"))
    assert f.fused, f.form()
    arrays = {"o": np.zeros(m * n, np.float32), "res": r(m, n).reshape(-1), "sum": np.zeros(m * n, np.float32),
              "y": np.zeros(m * n, np.float32)}
    _both_q8(f, x, words, arrays, {"w": (encode(r(n, k) / 20, fmt), fmt), "nw": (r(n), "f32")}, tol=1e-4)
    heads, kv, hd, L, pos = 4, 2, 64, 16, 5
    nq, nk = heads * hd, kv * hd
    parts = (GemmPart("wq", Dst("q"), nq), GemmPart("wk", Dst("k"), nk), GemmPart("wv", Dst("vc", row="pos", pitch=nk),
                                                                                  nk))
    sides = (RopeSide("q", Dst("qr"), heads, norm=("qn", 1e-6)), RopeSide("k", Dst("kc", row="pos", pitch=nk), kv,
                                                                          norm=("kn", 1e-6)))
    f = Fold(GemmParts("xq", fmt, k, m, parts, words=words), RopeParts(sides, "cos", "sin", "pos", m, hd, hd))
    assert f.fused, f.form()
    ang = rng.uniform(0, 6.28, (L, hd // 2))
    arrays = {"q": np.zeros(m * nq, np.float32), "k": np.zeros(m * nk, np.float32), "qr": np.zeros(m * nq, np.float32),
              "kc": r(L * nk), "vc": r(L * nk), "pos": np.array([pos], np.int32)}
    weights = {"wq": (encode(r(nq, k) / 20, fmt), fmt), "wk": (encode(r(nk, k) / 20, fmt), fmt),
               "wv": (encode(r(nk, k) / 20, fmt), fmt), "qn": (r(hd), "f32"), "kn": (r(hd), "f32"),
               "cos": (np.cos(ang).astype(np.float32), "f32"), "sin": (np.sin(ang).astype(np.float32), "f32")}
    dev = _both_q8(f, x, words, arrays, weights, tol=1e-4)
    want = dev.host("qr").copy()
    dev.array("qr")[...] = 0
    f.cuda(dev)
    dev.cp.cuda.Device().synchronize()
    np.testing.assert_array_equal(dev.host("qr"), want)


@pytest.mark.parametrize("fmt,words", [("q8_0", 1), ("q4_k", 2)] + Q8K_CASES[:1])
@pytest.mark.parametrize("m,advance", [(1, "one"), (3, "batch")])
def test_fold_gemv_argmax_q8_kernel_equals_its_twin(fmt, words, m, advance):
    """The LM head over a quantized activation and the step's arg-max in one launch (fold_gemv_argmax_q8): the
    logits as gemv_q8's body sums them, the tied maximum's smallest index, the advance."""
    import test_kernels_gpu as gpu

    f, g, arrays, weights = gpu.gemv_argmax_case(fmt, m, 512, 299, 1, advance, True, words=words)
    f = replace(f, first=replace(f.first, x="xq"))
    dev = _both_q8(f, g.standard_normal(m * 512).astype(np.float32), words, arrays, weights, tol=1e-4)
    gpu.check_gemv_argmax(dev, m, 299)


@pytest.mark.parametrize("rows,cols,words", [(r, c, w) for w in (1, 2) for r, c in ((1, 4096), (3, 96))]
                         + [(1, 4096, 3), (3, 512, 3)])
def test_norm_quantizing_in_its_epilogue(rows, cols, words):
    """norm.cu's epilogue quantizes each row it stored (quant.cu's blocks; words 3: llama.cpp's q8_K, a warp a block
    of 256 read back from the stored row): the f32 rows within rounding of the twin's, and the words (sums, scales)
    the twin makes from the values the kernel stored."""
    from lanefuse.kernels import Norm

    rng = np.random.default_rng(11)
    x = rng.standard_normal(rows * cols).astype(np.float32)
    res = rng.standard_normal(rows * cols).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
    n = Norm("res", "nw", "y", rows, cols, 1e-6, add="x", sum="s", quant="xq", words=words)
    assert n.check() is None
    n_low = {2: np.zeros(rows * cols, np.int8), 3: np.zeros(rows * cols // 16, np.int16)}.get(words)
    host = HostEnv({"x": x.copy(), "res": res.copy(), "y": np.zeros(rows * cols, np.float32),
                    "s": np.zeros(rows * cols, np.float32)}, {"nw": (nw, "f32")},
                   {"xq": (np.zeros(rows * cols, np.int8), n_low,
                           np.zeros(rows * cols // (256 if words == 3 else 32), np.float32))})
    n.numpy(host)
    dev = _dev(rows * cols, words, {"x": x, "res": res, "y": np.zeros(rows * cols, np.float32),
                                    "s": np.zeros(rows * cols, np.float32)}, {"nw": (nw, "f32")})
    n.cuda(dev)
    dev.cp.cuda.Device().synchronize()
    np.testing.assert_allclose(dev.host("y"), host.array("y"), rtol=1e-5, atol=1e-5)
    want = quantize(dev.host("y").reshape(rows, cols), words).parts()  # the form of the values the kernel stored
    got = [None if a is None else dev.cp.asnumpy(a) for a in dev.quant("xq")]
    for a, b in zip(got, want):
        assert (a is None) == (b is None) and (a is None or np.array_equal(a.reshape(-1), b)), words


@pytest.mark.parametrize("heads,group,d,rows,splits", [(32, 4, 128, 1, 1), (32, 4, 128, 1, 5), (8, 2, 64, 3, 1),
                                                      (8, 2, 64, 3, 4), (16, 4, 32, 2, 1), (16, 4, 32, 1, 3),
                                                      (4, 1, 256, 1, 2)])
def test_attention_quantizing_q8k_in_its_epilogue(heads, group, d, rows, splits):
    """attention.cu's q8k epilogue (attn_output_quant over K-quant rows): a block the heads of whole 256-value blocks
    (two heads of 128, four of 64, eight of 32 in the narrow kernel), its merge as many: the f32 output within
    rounding of the twin's, the words, sums and scales those the twin makes of the values the kernel stored; tuned as
    the plan tunes it, and held `attn_splits`."""
    from lanefuse.kernels import Attention
    from lanefuse.lane.lower.knobs import Knobs

    rng = np.random.default_rng(13)
    L, n = 40, rows * heads * d
    base = Attention("q", "kc", "vc", "pos", "o", heads, group, d, d, L, rows, d ** -0.5, quant="xq", words=3)
    for a in (base.tune(Knobs(), frozenset({"attn_splits"})),
              dataclasses.replace(base.tune(Knobs()), splits=splits)):
        assert a.check() is None, a.check()
        arrays = {"q": rng.standard_normal(n).astype(np.float32),
                  "kc": rng.standard_normal(L * heads // group * d).astype(np.float32),
                  "vc": rng.standard_normal(L * heads // group * d).astype(np.float32),
                  "pos": np.array([30], np.int32), "o": np.zeros(n, np.float32)}
        host = HostEnv({k: v.copy() for k, v in arrays.items()}, {},
                       {"xq": (np.zeros(n, np.int8), np.zeros(n // 16, np.int16), np.zeros(n // 256, np.float32))})
        a.numpy(host)
        dev = _dev(n, 3, arrays, {})
        a.cuda(dev)
        dev.cp.cuda.Device().synchronize()
        np.testing.assert_allclose(dev.host("o"), host.array("o"), rtol=1e-5, atol=1e-5)
        want = quantize(dev.host("o").reshape(1, -1), 3).parts()  # the form of the values the kernel stored
        got = [dev.cp.asnumpy(x) for x in dev.quant("xq")]
        for g, w in zip(got, want):
            assert np.array_equal(g.reshape(-1), w), (a.heads_a_block, a.splits)


@pytest.mark.parametrize("words", [1, 2, 3])
@pytest.mark.parametrize("rows,hk,hv,dk,dv", [(1, 16, 32, 128, 128), (5, 2, 4, 32, 64)])
def test_delta_quantizing_in_its_epilogue(rows, hk, hv, dk, dv, words):
    """delta.cu's epilogue (gdn_output_quant) quantizes each output row it stored, a warp a block (words 3, the q8k
    form: after the rows, the last of a 256-value block's heads to arrive, its counter reset; a second launch over
    the state it left gives the same form of its own output): the f32 rows within rounding of the twin's, and the
    words (sums, scales) the twin makes of the values the kernel stored."""
    from lanefuse.kernels import Delta

    rng = np.random.default_rng(12)
    r32 = lambda n, s=1.0: (s * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    n = rows * hv * dv
    arrays = {"q": r32(rows * hk * dk, dk ** -0.5), "k": r32(rows * hk * dk, dk ** -0.5), "v": r32(n), "z": r32(n),
              "b": np.abs(r32(rows * hv)) % 1, "g": -np.abs(r32(rows * hv, 0.3)), "S": r32(hv * dk * dv, 0.1),
              "o": np.zeros(n, np.float32)}
    gn = {"gn": (r32(dv) + 1, "f32")}
    d = Delta("q", "k", "v", "z", "b", "g", "S", "gn", "o", hk, hv, dk, dv, rows, dk ** -0.5, 1e-6, quant="xq",
              words=words)
    assert d.check() is None
    low = {2: np.zeros(n, np.int8), 3: np.zeros(n // 16, np.int16)}.get(words)
    host = HostEnv({k: v.copy() for k, v in arrays.items()}, gn,
                   {"xq": (np.zeros(n, np.int8), low, np.zeros(n // (256 if words == 3 else 32), np.float32))})
    d.numpy(host)
    dev = _dev(n, words, arrays, gn)
    for _ in range(2 if words == 3 else 1):  # q8k: the counters the first launch reset serve the second
        d.cuda(dev)
        dev.cp.cuda.Device().synchronize()
        if _ == 0:
            np.testing.assert_allclose(dev.host("o"), host.array("o"), rtol=3e-4, atol=3e-4)
        want = quantize(dev.host("o").reshape(rows, hv * dv), words).parts()  # the values the kernel stored
        got = [None if a is None else dev.cp.asnumpy(a) for a in dev.quant("xq")]
        for a, b in zip(got, want):
            assert (a is None) == (b is None) and (a is None or np.array_equal(a.reshape(-1), b)), words


def _two_forms(n: int, words: int, arrays, weights, x_words: int = 0, xn: int = 0):
    """A device env with the quantized form `oq` of n values (the launch's result's) and, where x_words, `xq` of xn."""
    from lanefuse.kernels.cupy_env import DeviceEnv

    a = quant_layout(n, words)[2]
    placed, quantized = {"oq": (0, a, "u8")}, {"oq": (n, words)}
    if x_words:
        placed["xq"] = (a, quant_layout(xn, x_words)[2], "u8")
        quantized["xq"] = (xn, x_words)
    return DeviceEnv(a + (quant_layout(xn, x_words)[2] if x_words else 0), placed, arrays, weights,
                     quantized=quantized)


def _form_is(dev, name: str, values: np.ndarray, words: int, what=None) -> None:
    """The device's quantized form `name` is exactly the interpreter's quantize of `values` (rows, n)."""
    want = quantize(np.asarray(values, np.float32), words).parts()
    for g, w in zip((None if v is None else dev.cp.asnumpy(v) for v in dev.quant(name)), want):
        assert (g is None) == (w is None) and (g is None or np.array_equal(g.reshape(-1), w)), what


@pytest.mark.parametrize("words", [1, 2])
def test_quantizing_epilogues_equal_the_quant_kernel(words):
    """attention.cu (one split; three, the merging block quantizing; each gated by sigmoid(gate) too), binary.cu
    (glu_act_mul_quant) and gemv_glu.cu (the arrival-counted tail over an f32 activation, four outputs a warp;
    gemv_glu_q8_quant over a quantized one) on the device: the f32 result within
    rounding of the numpy twin's, and its quantized form exactly quant.cu's words and scales of the f32 values the
    kernel stored; a second launch of the GEMV (its counters reset) writes the same bytes; and each launch writing
    its quantized form alone (`f32` false: from the values in registers, the gate/up GEMV's over a quantized
    activation from shared memory, over an f32 one from its scratch) the same bytes,
    its f32 output untouched."""
    import dataclasses

    from lanefuse.kernels import Attention, Binary, GemvGlu, Norm

    rng = np.random.default_rng(12)
    H, G, hd, L, m, k, n = 8, 4, 64, 32, 3, 256, 512
    r = lambda *s: rng.standard_normal(s).astype(np.float32).reshape(-1)  # noqa: E731
    x = r(m, k)
    xq = quantize(x.reshape(m, k), words)
    w = {"wg": (encode(r(n, k).reshape(n, k) / 16, "q8_0"), "q8_0"),
         "wu": (encode(r(n, k).reshape(n, k) / 16, "q8_0"), "q8_0")}
    wb = {"wg": (encode(r(n, k).reshape(n, k) / 16, "bf16"), "bf16"),
          "wu": (encode(r(n, k).reshape(n, k) / 16, "bf16"), "bf16")}
    cases = [(Attention("q", "kc", "vc", "pos", "o", H, G, hd, hd, L, m, 0.125, per_block=4, quant="oq", words=words),
              m * H * hd, {}),
             (Attention("q", "kc", "vc", "pos", "o", H, G, hd, hd, L, m, 0.125, splits=3, quant="oq", words=words),
              m * H * hd, {}),
             (Attention("q", "kc", "vc", "pos", "o", H, G, hd, hd, L, m, 0.125, per_block=4, gate=("gt", "sigmoid"),
                        quant="oq", words=words), m * H * hd, {}),  # attn_output_gate.quant: the gated product
             (Attention("q", "kc", "vc", "pos", "o", H, G, hd, hd, L, m, 0.125, splits=3, gate=("gt", "sigmoid"),
                        quant="oq", words=words), m * H * hd, {}),
             (Binary("mul", "u", "g", "o", m * n, gate="silu", quant="oq", words=words), m * n, {}),
             (GemvGlu("x", "wg", "wu", "bf16", "o", k, n, m, per_warp=4, quant="oq", quant_words=words), m * n, wb),
             (GemvGlu("xq", "wg", "wu", "q8_0", "o", k, n, m, words=words, quant="oq", quant_words=words), m * n, w),
             (Norm("x", "nw", "o", m, k, 1e-6, add="g", sum="s", quant="oq", words=words), m * k,
              {"nw": (np.linspace(0.5, 1.5, k).astype(np.float32), "f32")})]
    for launch, size, weights in cases:
        assert launch.check() is None, launch.check()
        arrays = {"q": r(m, H, hd), "kc": r(L, H // G, hd), "vc": r(L, H // G, hd), "pos": np.array([7], np.int32),
                  "u": r(m * n), "g": r(m * n), "x": x, "gt": r(m, H * hd), "o": np.zeros(size, np.float32), "s": np.zeros(m * k, np.float32)}
        qx = (xq.words.reshape(-1), None if xq.low is None else xq.low.reshape(-1), xq.scales.reshape(-1))
        host = HostEnv({a: v.copy() for a, v in arrays.items()}, weights,
                       {"oq": (np.zeros(size, np.int8), np.zeros(size, np.int8) if words == 2 else None,
                               np.zeros(size // 32, np.float32)), "xq": qx})
        launch.numpy(host)
        xw = words if getattr(launch, "words", 0) and isinstance(launch, GemvGlu) else 0
        dev = _two_forms(size, words, arrays, weights, xw, m * k)
        if xw:
            Quant("x", "xq", m * k, words).cuda(dev)
        for _ in range(2):
            launch.cuda(dev)
            dev.cp.cuda.Device().synchronize()
            got = dev.host("o")
            np.testing.assert_allclose(got, host.array("o"), rtol=0, atol=2e-5 * np.abs(host.array("o")).max(),
                                       err_msg=launch.census)
            want = quantize(got.reshape(1, -1), words)
            qw, low, sc = (None if a is None else dev.cp.asnumpy(a) for a in dev.quant("oq"))
            assert np.array_equal(qw, want.words.reshape(-1)) and np.array_equal(sc, want.scales.reshape(-1)), launch
            if words == 2:
                assert np.array_equal(low, want.low.reshape(-1)), launch
        alone = dataclasses.replace(launch, f32=False)
        assert alone.check() is None, alone.check()
        dev2 = _two_forms(size, words, {**arrays, "o": np.zeros(size, np.float32)}, weights, xw, m * k)
        if xw:
            Quant("x", "xq", m * k, words).cuda(dev2)
        alone.cuda(dev2)
        dev2.cp.cuda.Device().synchronize()
        assert not dev2.host("o").any(), alone
        for a, b in zip(dev.quant("oq"), dev2.quant("oq")):
            assert (a is None) == (b is None)
            if a is not None and not isinstance(a, np.uint64):
                assert np.array_equal(dev.cp.asnumpy(a), dev2.cp.asnumpy(b)), alone


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
@pytest.mark.parametrize("m,f32", [(1, True), (3, False), (9, True)])
def test_gemv_glu_q8k_quant_equals_the_quant_kernel(fmt, m, f32):
    """gemv_glu_q8k_quant (the GLU of a q8k activation times K-quant rows quantized to the q8k form for a down
    projection over K-quant rows): a block's 256 outputs held in shared memory and quantized from there, a warp a
    row; the f32 GLU within rounding of the twin's where it is stored, and the q8k form exactly quant.cu's of the
    values the kernel computed (a second launch: the same bytes)."""
    from lanefuse.kernels import GemvGlu
    from test_q8k import _form

    rng = np.random.default_rng(14 + m)
    k, n = 512, 768
    x = rng.standard_normal(m * k).astype(np.float32)
    w = {"wg": (encode(rng.standard_normal((n, k)).astype(np.float32) / 16, fmt), fmt),
         "wu": (encode(rng.standard_normal((n, k)).astype(np.float32) / 16, fmt), fmt)}
    full = GemvGlu("xq", "wg", "wu", fmt, "o", k, n, m, words=3, quant="oq", quant_words=3)
    launch = full if f32 else dataclasses.replace(full, f32=False)
    assert launch.check() is None and launch.grid_block()[0][0] == n // 256, launch.check()
    # the twin writes the q8k form `oq` too: the host env holds one for it (as test_q8k's twins do)
    host = HostEnv({"o": np.zeros(m * n, np.float32)}, w,
                   {"xq": quantize(x.reshape(m, k), 3).parts(), "oq": _form(m * n, 3)})
    full.numpy(host)
    dev = _two_forms(m * n, 3, {"x": x, "o": np.zeros(m * n, np.float32)}, w, 3, m * k)
    Quant("x", "xq", m * k, 3).cuda(dev)
    ref = _two_forms(m * n, 3, {"x": x, "o": np.zeros(m * n, np.float32)}, w, 3, m * k)  # its f32 GLU, quant.cu's form
    Quant("x", "xq", m * k, 3).cuda(ref)
    full.cuda(ref)
    ref.cp.cuda.Device().synchronize()
    glu = ref.host("o")
    np.testing.assert_allclose(glu, host.array("o"), rtol=0, atol=2e-5 * np.abs(host.array("o")).max())
    want = quantize(glu.reshape(m, n), 3).parts()
    for _ in range(2):
        launch.cuda(dev)
        dev.cp.cuda.Device().synchronize()
        got = [None if a is None else dev.cp.asnumpy(a) for a in dev.quant("oq")]
        for a, b in zip(got, want):
            assert np.array_equal(a.reshape(-1), b), fmt
        assert dev.host("o").any() == f32


@pytest.mark.parametrize("words", [1, 2, 3])
def test_head_gemv_quantizing_tail_equals_the_quant_kernel(words):
    """head_gemv.cu's arrival-counted tail (gemv_quant.heads; words 3: the q8k form, the last of a 256-value block's
    64 blocks quantizing it): the f32 output within rounding of the twin's, its quantized form exactly quant.cu's of
    the values the kernel stored, and the same bytes from a second launch (its counters reset)."""
    from lanefuse.kernels import HeadGemv

    rng = np.random.default_rng(14)
    m, heads, a, b = 3, 8, 64, 32
    raw = encode(rng.standard_normal((heads * b, a)).astype(np.float32) / 8, "q8_0")
    x = rng.standard_normal(m * heads * a).astype(np.float32)
    h = HeadGemv("x", "wh", "q8_0", Dst("o"), m, heads, a, b, quant="oq", words=words)
    n = m * heads * b
    low = {2: np.zeros(n, np.int8), 3: np.zeros(n // 16, np.int16)}.get(words)
    host = HostEnv({"x": x, "o": np.zeros(n, np.float32)}, {"wh": (raw, "q8_0")},
                   {"oq": (np.zeros(n, np.int8), low, np.zeros(n // (256 if words == 3 else 32), np.float32))})
    h.numpy(host)
    dev = _two_forms(n, words, {"x": x, "o": np.zeros(n, np.float32)}, {"wh": (raw, "q8_0")})
    for _ in range(2):
        h.cuda(dev)
        dev.cp.cuda.Device().synchronize()
        got = dev.host("o")
        np.testing.assert_allclose(got, host.array("o"), rtol=0, atol=2e-5 * np.abs(host.array("o")).max())
        _form_is(dev, "oq", got.reshape(1, -1), words, words)


def _shared_moe(rng, rows: int, d: int, f: int, E: int, sf: int, fmt: str):
    """Seeded weights (router f32, experts and the shared expert with its gate score row in `fmt`, the norm) and
    arrays (the input, the residual, the output and the sum) of a mixture with a shared expert."""
    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    weights = {"wr": ((r(E, d) * 3 / np.sqrt(d)).astype(np.float32), "f32"),
               "wgu": (encode(r(E * 2 * f, d) / np.sqrt(d), fmt), fmt),
               "wd": (encode(r(E * d, f) / np.sqrt(f), fmt), fmt), "nw": (1 + 0.1 * r(d), "f32")}
    for n, shape in (("sg", (sf, d)), ("su", (sf, d)), ("sd", (d, sf)), ("sgt", (1, d))):
        weights[n] = (encode(r(*shape) / np.sqrt(shape[1]), fmt), fmt)
    arrays = {"x": r(rows * d), "a": r(rows * d), "y": np.zeros(rows * d, np.float32),
              "s": np.zeros(rows * d, np.float32)}
    return weights, arrays


def _moe_on_both(m, arrays, weights, words: int):
    """Moe launch `m` (its quantized form, if any, `xq` of `words`) run by its exact twin and by moe.cu over the same
    arrays: the mixture `y` and the sum `s` within f32 summation of the twin's; the device env back."""
    from lanefuse.kernels.common import qblock

    assert m.check() is None, m.check()
    n = m.rows * m.d
    low = {2: np.zeros(n, np.int8), 3: np.zeros(n // 16, np.int16)}.get(words)
    host = HostEnv({a: v.copy() for a, v in arrays.items()}, weights,
                   {"xq": (np.zeros(n, np.int8), low, np.zeros(n // qblock(words), np.float32))})
    m.numpy(host)
    dev = _dev(n, words, arrays, weights)
    m.cuda(dev)
    dev.cp.cuda.Device().synchronize()
    for a in ("y", "s"):
        np.testing.assert_allclose(dev.host(a), host.array(a), rtol=2e-4, atol=2e-4, err_msg=a)
    return dev


@pytest.mark.parametrize("words", [1, 2])
@pytest.mark.parametrize("rows,sort", [(1, False), (3, False), (5, True)])
@pytest.mark.parametrize("qgate", [True, False])
def test_moe_shared_expert_quantized(rows, sort, qgate, words):
    """moe.cu's shared expert under the q8 numerics (shared_expert_fusion.quant): the input row quantized in shared
    memory, the GLU quantized by moe_up's epilogue, gemv_q8.cu's block sums; with the finalize (a row at a time) the
    normed row's quantized form too. The mixture within f32 summation of the exact twin; the finalize's words those of
    the values the kernel stored (but for a word within rounding of a half, rare)."""
    from lanefuse.kernels import Moe

    rng = np.random.default_rng(rows * 3 + words + qgate)
    d, f, E, k, sf, fmt = 256, 96, 16, 4, 128, "q8_0"

    weights, arrays = _shared_moe(rng, rows, d, f, E, sf, fmt)
    fin = {} if sort else dict(sum="s", nw="nw", eps=1e-6, quant="xq", quant_words=words)
    m = Moe("x", "wr", "wgu", "wd", Dst("y"), d, f, E, k, rows, fmt, norm_topk=True, sort=sort, sg="sg", su="su",
            sd="sd", sgate="sgt", sf=sf, format_s=fmt, add="a", qwords=words, qgate=qgate, **fin)
    dev = _moe_on_both(m, arrays, weights, words)
    if fin:
        want = quantize(dev.host("y").reshape(rows, d), words)
        w, low, sc = (None if a is None else dev.cp.asnumpy(a) for a in dev.quant("xq"))
        assert np.mean(w != want.words.reshape(-1)) < 1e-2 and np.allclose(sc, want.scales.reshape(-1), rtol=1e-6)


@pytest.mark.parametrize("rows,sort,d", [(1, False, 256), (3, False, 512), (5, True, 512)])
def test_moe_finalize_quantizing_q8k(rows, sort, d):
    """moe.cu's finalize (the last block of a row to arrive, or moe_finish over sorted rows) quantizing the normed row
    as q8k (moe_deferred_finalize.quant over K-quant rows: a warp a block of 256 read back from the row it stored):
    the sum and the normed row within f32 summation of the twin's, the words, sums and scales those of the values the
    kernel stored."""
    from lanefuse.kernels import Moe

    rng = np.random.default_rng(rows + d)
    f, E, k = 96, 8, 2
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    weights = {"wr": ((r(E, d) * 3 / np.sqrt(d)).astype(np.float32), "f32"),
               "wgu": (encode(r(E * 2 * f, d) / np.sqrt(d), "bf16"), "bf16"),
               "wd": (encode(r(E * d, f) / np.sqrt(f), "bf16"), "bf16"), "nw": (1 + 0.1 * r(d), "f32")}
    arrays = {"x": r(rows * d), "a": r(rows * d), "y": np.zeros(rows * d, np.float32),
              "s": np.zeros(rows * d, np.float32)}
    m = Moe("x", "wr", "wgu", "wd", Dst("y"), d, f, E, k, rows, "bf16", norm_topk=True, sort=sort, add="a", sum="s",
            nw="nw", eps=1e-6, quant="xq", quant_words=3)
    dev = _moe_on_both(m, arrays, weights, 3)
    want = quantize(dev.host("y").reshape(rows, d), 3).parts()  # the form of the values the kernel stored
    got = [dev.cp.asnumpy(x) for x in dev.quant("xq")]
    for g, w in zip(got, want):
        assert np.array_equal(g.reshape(-1), w)


@pytest.mark.parametrize("rows,sort", [(1, False), (3, False), (5, True)])
@pytest.mark.parametrize("qgate", [True, False])
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_moe_shared_expert_quantized_q8k(rows, sort, qgate, fmt):
    """moe.cu's shared expert over K-quant rows under q8 (shared_expert_fusion.quant with words 3): the input row
    quantized to the q8k form in shared memory (quant_k_vals), the GLU quantized whole by each down block into its
    own shared memory, gemv_q8.cu's q8k_tile; a row at a time with the finalize writing the next norm's q8k form, and
    sorted. The mixture within f32 summation of the exact twin; the finalize's words those of the values the kernel
    stored (but for a word within rounding of a half, rare)."""
    from lanefuse.kernels import Moe

    rng = np.random.default_rng(rows * 5 + qgate)
    d, f, E, k, sf = 256, 256, 8, 2, 256

    weights, arrays = _shared_moe(rng, rows, d, f, E, sf, fmt)
    fin = {} if sort else dict(sum="s", nw="nw", eps=1e-6, quant="xq", quant_words=3)
    m = Moe("x", "wr", "wgu", "wd", Dst("y"), d, f, E, k, rows, fmt, norm_topk=True, sort=sort, sg="sg", su="su",
            sd="sd", sgate="sgt", sf=sf, format_s=fmt, add="a", qwords=3, qgate=qgate, **fin)
    dev = _moe_on_both(m, arrays, weights, 3)
    if fin:
        want = quantize(dev.host("y").reshape(rows, d), 3)
        w, sums, sc = (dev.cp.asnumpy(a) for a in dev.quant("xq"))
        assert np.mean(w != want.words.reshape(-1)) < 1e-2 and np.allclose(sc, want.scales.reshape(-1), rtol=1e-6)


@pytest.mark.parametrize("words,qa,pw", [(1, 96, 1), (2, 96, 4), (3, 512, 1), (3, 1536, 4)])
def test_products_row_norm_quantizing_in_its_epilogue(words, qa, pw):
    """fold.cu's products-in-parts epilogue quantizing a row norm as it stores it (DeepSeek-V3's q_a norm for q_b's
    products, merged_qkv.rotated_normed_quant; words 3: the warp reads the row it stored back a block of 256): the f32
    rows within rounding of the twin's, the quantized form exactly quant.cu's of the values the kernel stored, and the
    same bytes from a second launch (the arrival counters reset)."""
    from test_q8k import _form, _row_norm_fold

    f, arrays, weights = _row_norm_fold(words, qa, qname="oq")
    f = dataclasses.replace(f, first=dataclasses.replace(f.first, per_warp=pw))
    n = 3 * qa
    host = HostEnv({k: v.copy() for k, v in arrays.items()}, weights, {"oq": _form(n, words)})
    f.numpy(host)
    dev = _two_forms(n, words, {k: v.copy() for k, v in arrays.items()}, weights)
    for _ in range(2):
        f.cuda(dev)
        dev.cp.cuda.Device().synchronize()
        got = dev.host("qan")
        np.testing.assert_allclose(got, host.array("qan"), rtol=0, atol=1e-4 * np.abs(host.array("qan")).max())
        _form_is(dev, "oq", got.reshape(3, qa), words, words)


@pytest.mark.parametrize("pw", [1, 4])
@pytest.mark.parametrize("m,f32", [(1, True), (3, False), (9, True), (9, False)])
def test_gemv_glu_over_f32_quantizing_q8k(pw, m, f32):
    """gemv_glu's arrival-counted tail over an f32 activation writing the q8k form (gate and up over bf16 rows, a down
    projection over K-quant rows): the last block of each 256 outputs to arrive stages them through L2 and a warp
    quantizes them, a row of the slab at a time; the f32 GLU within rounding of the twin's, the form exactly quant.cu's
    of the values the kernel stored (in its scratch where `f32` is false), and the same bytes from a second launch."""
    from lanefuse.kernels import GemvGlu
    from test_q8k import _form

    rng = np.random.default_rng(40 + m + pw)
    k, n = 96, 768
    x = rng.standard_normal(m * k).astype(np.float32)
    w = {"wg": (encode(rng.standard_normal((n, k)).astype(np.float32) / 8, "bf16"), "bf16"),
         "wu": (encode(rng.standard_normal((n, k)).astype(np.float32) / 8, "bf16"), "bf16")}
    full = GemvGlu("x", "wg", "wu", "bf16", "o", k, n, m, per_warp=pw, quant="oq", quant_words=3)
    launch = full if f32 else dataclasses.replace(full, f32=False)
    assert launch.check() is None and launch.scratch()[0].nbytes == 4 * (n // 256) * -(-m // 8), launch.check()
    host = HostEnv({"x": x, "o": np.zeros(m * n, np.float32)}, w, {"oq": _form(m * n, 3)})
    full.numpy(host)
    ref = _two_forms(m * n, 3, {"x": x, "o": np.zeros(m * n, np.float32)}, w)
    full.cuda(ref)
    ref.cp.cuda.Device().synchronize()
    glu = ref.host("o")
    np.testing.assert_allclose(glu, host.array("o"), rtol=0, atol=2e-5 * np.abs(host.array("o")).max())
    want = quantize(glu.reshape(m, n), 3).parts()
    dev = _two_forms(m * n, 3, {"x": x, "o": np.zeros(m * n, np.float32)}, w)
    for _ in range(2):
        launch.cuda(dev)
        dev.cp.cuda.Device().synchronize()
        for a, b in zip((dev.cp.asnumpy(v) for v in dev.quant("oq")), want):
            assert np.array_equal(a.reshape(-1), b), (pw, m)
        assert dev.host("o").any() == f32


@pytest.mark.parametrize("gate,f32,n", [(None, True, 512), ("silu", True, 4096), ("silu", False, 256 * 4100)])
def test_binary_quantizing_q8k(gate, f32, n):
    """binary.cu writing the q8k form (elementwise_quant / glu_act_mul_quant before a product over K-quant rows): a
    block of 256 threads a block of 256 values, staged in shared memory and quantized by a warp (past 4096 blocks the
    grid strides); the f32 result within rounding of the twin's, the form exactly quant.cu's of the values computed."""
    from lanefuse.kernels import Binary

    rng = np.random.default_rng(n)
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    full = Binary("mul" if gate else "add", "a", "b", "o", n, gate=gate, quant="oq", words=3)
    launch = full if f32 else dataclasses.replace(full, f32=False)
    assert launch.check() is None, launch.check()
    ref = _two_forms(n, 3, {"a": a, "b": b, "o": np.zeros(n, np.float32)}, {})
    full.cuda(ref)
    ref.cp.cuda.Device().synchronize()
    y = ref.host("o")
    host = HostEnv({"a": a, "b": b, "o": np.zeros(n, np.float32)}, {}, {})
    dataclasses.replace(full, quant=None, words=0).numpy(host)
    np.testing.assert_allclose(y, host.array("o"), rtol=1e-6, atol=1e-6)
    want = quantize(y.reshape(1, -1), 3).parts()
    dev = _two_forms(n, 3, {"a": a, "b": b, "o": np.zeros(n, np.float32)}, {})
    launch.cuda(dev)
    dev.cp.cuda.Device().synchronize()
    for g, w in zip((dev.cp.asnumpy(v) for v in dev.quant("oq")), want):
        assert np.array_equal(g.reshape(-1), w)
    assert dev.host("o").any() == f32


@pytest.mark.parametrize("x_words,qwords,pw", [(0, 1, 1), (0, 2, 4), (0, 3, 4), (1, 1, 1), (2, 2, 1), (1, 3, 1)])
@pytest.mark.parametrize("m", [1, 3, 9])
def test_gemv_quantizing_tail_equals_the_quant_kernel(x_words, qwords, pw, m):
    """gemv_quant.cu (gemv_quant: a product another projection reads quantized), over an f32 activation (one and four
    outputs a warp) and a quantized one (gemv_q8's tile), its output quantized to one or two words or the q8k form,
    one slab of rows and two: the f32 output within rounding of the twin's, its quantized form exactly quant.cu's of
    the values the kernel stored, and the same bytes from a second launch (its counters reset)."""
    rng = np.random.default_rng(23)
    k, n = 128, 512
    raw = encode(rng.standard_normal((n, k)).astype(np.float32) / 8, "q8_0")
    x = rng.standard_normal(m * k).astype(np.float32)
    gv = Gemv("xq" if x_words else "x", "w", "q8_0", Dst("o"), k, n, m, per_warp=pw, words=x_words, quant="oq",
              quant_words=qwords)
    assert gv.check() is None
    size = m * n
    low = {2: np.zeros(size, np.int8), 3: np.zeros(size // 16, np.int16)}.get(qwords)
    quantized = {"oq": (np.zeros(size, np.int8), low, np.zeros(size // (256 if qwords == 3 else 32), np.float32))}
    if x_words:
        xq = quantize(x.reshape(m, k), x_words)
        quantized["xq"] = (xq.words.reshape(-1), None if xq.low is None else xq.low.reshape(-1), xq.scales.reshape(-1))
    host = HostEnv({"x": x, "o": np.zeros(size, np.float32)}, {"w": (raw, "q8_0")}, quantized)
    gv.numpy(host)
    dev = _two_forms(size, qwords, {"x": x, "o": np.zeros(size, np.float32)}, {"w": (raw, "q8_0")}, x_words, m * k)
    if x_words:  # quant.cu's form of x: the twin's words (test_quant_kernel_equals_its_twin)
        Quant("x", "xq", m * k, x_words).cuda(dev)
    for _ in range(2):
        gv.cuda(dev)
        dev.cp.cuda.Device().synchronize()
        got = dev.host("o")
        np.testing.assert_allclose(got, host.array("o"), rtol=0, atol=2e-5 * np.abs(host.array("o")).max())
        _form_is(dev, "oq", got.reshape(1, -1), qwords, (x_words, qwords))


@pytest.mark.parametrize("words", [1, 2])
@pytest.mark.parametrize("slot", [0, 6])
def test_set_row_quant_equals_its_twin(words, slot):
    """set_row.cu's set_row_quant (row_write_quant), one sequence and a batch's slots: the table after the write
    equals the twin's, and its quantized form is exactly quant.cu's of that table."""
    from lanefuse.kernels import SetRow

    rng = np.random.default_rng(29)
    cols, length = 96, 12
    s = SetRow("T", "src", "pos", cols, 2, length, slot=slot, quant="tq", words=words)
    pos = np.array([1, 4] if slot else [9], np.int32)
    arrays = {"T": rng.standard_normal(length * cols).astype(np.float32),
              "src": rng.standard_normal(2 * cols).astype(np.float32), "pos": pos}
    n = length * cols
    host = HostEnv({k: v.copy() for k, v in arrays.items()}, {},
                   {"tq": (np.zeros(n, np.int8), np.zeros(n, np.int8) if words == 2 else None,
                           np.zeros(n // 32, np.float32))})
    s.numpy(host)
    from lanefuse.kernels.cupy_env import DeviceEnv

    total = quant_layout(n, words)[2]
    dev = DeviceEnv(total, {"tq": (0, total, "u8")}, {k: v.copy() for k, v in arrays.items()}, {},
                    quantized={"tq": (n, words)})
    s.cuda(dev)
    dev.cp.cuda.Device().synchronize()
    assert np.array_equal(dev.host("T"), host.array("T"))
    _form_is(dev, "tq", host.array("T").reshape(1, -1), words)
