"""The GGUF block formats past q8_0 / q4_0 / q4_k / q6_k that llama.cpp's presets write — q4_1, q5_0, q5_1, q5_k,
q3_k, q2_k, iq4_nl, iq4_xs (formats/blocks.py): the numpy decoding equals `gguf.quants.dequantize` to the bit on random
blocks with extreme, subnormal, zero and non-finite f16 scales; the encoders the tests write files with (gguf's own
for q4_1 / q5_0 / q5_1, whose fallbacks here equal it byte for byte; the quantizers here for the others) round-trip
within a step; the CUDA decoding (prelude.cu's block section, compiled as host C++) equals the numpy twin to the bit;
the weight store holds them and refuses a non-finite scale in words."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from lanefuse.engine.errors import UserError
from lanefuse.engine.formats.layout import BLOCK_FORMATS, F16_SCALES
from lanefuse.engine.front.weights import Weights
from lanefuse.engine.formats import blocks
from lanefuse.kernels.common import FORMAT_CODE, decode

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

from test_blocks import EDGE_F16, host_qget, same_bits  # noqa: E402,F401  (host_qget: a fixture)

NEW = ["q4_1", "q5_0", "q5_1", "q5_k", "q3_k", "q2_k", "iq4_nl", "iq4_xs"]


def reference(raw: np.ndarray, fmt: str) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return gguf.quants.dequantize(raw, T[fmt.upper()])


def mine(raw: np.ndarray, fmt: str, cols: int) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return blocks.decode_rows(raw, fmt, cols)


def test_the_format_tables_are_ggufs():
    for fmt in NEW:
        assert blocks.BLOCKS[fmt] == tuple(gguf.GGML_QUANT_SIZES[T[fmt.upper()]]) == BLOCK_FORMATS[fmt]
        assert blocks.F16_SCALES[fmt] == F16_SCALES[fmt]
    assert [FORMAT_CODE[f] for f in NEW] == list(range(8, 16))  # prelude.cu's qget / qget_more
    assert blocks.bytes_per_value("q5_0") == 22 / 32 and blocks.row_bytes("q3_k", 512) == 220


@st.composite
def block_bytes(draw, fmt: str):
    """Rows of random `fmt` blocks: random, all-zero, all-0x80 or all-0xff bytes, the f16 scales drawn from the edge
    cases (zero, subnormal, largest, inf, NaN) or at random."""
    vb, bb = blocks.BLOCKS[fmt]
    rows, per_row = draw(st.integers(1, 4)), draw(st.integers(1, 3 if vb == 32 else 2))
    n = rows * per_row
    b = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, 256, size=(n, bb), dtype=np.uint8)
    for i in range(n):
        fill = draw(st.sampled_from(["random", "zero", "0x80", "0xff"]))
        if fill != "random":
            b[i] = {"zero": 0, "0x80": 0x80, "0xff": 0xFF}[fill]
        for o in blocks.F16_SCALES[fmt]:
            h = draw(st.one_of(st.sampled_from(EDGE_F16), st.integers(0, 0xFFFF)))
            b[i, o], b[i, o + 1] = h & 0xFF, h >> 8
    return b.reshape(rows, per_row * bb), per_row * vb


@pytest.mark.parametrize("fmt", NEW)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_blocks_decode_to_the_bit(fmt, data):
    raw, cols = data.draw(block_bytes(fmt))
    want = reference(raw, fmt)
    assert same_bits(mine(raw, fmt, cols), want)
    assert same_bits(decode(raw.reshape(-1), fmt), want.reshape(-1))  # flat, as the runners hold it


@pytest.mark.parametrize("fmt", ["q4_1", "q5_0", "q5_1"])
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1e-6, 1e-3, 1.0, 300.0, 3e3]),
       zero_block=st.booleans(), offset=st.sampled_from([0.0, 2.0, -5.0]))
def test_the_own_encoders_are_ggufs_byte_for_byte(fmt, seed, scale, zero_block, offset):
    """The fallback encoders (a machine without gguf) follow ggml's reference (gguf's quantizer) exactly."""
    x = ((np.random.default_rng(seed).standard_normal((3, 64)) + offset) * scale).astype(np.float32)
    if zero_block:
        x[1, :32] = 0.0
    with np.errstate(over="ignore"):
        own = blocks._OWN[fmt](x.reshape(-1, 32)).reshape(3, -1)
        assert np.array_equal(own, gguf.quants.quantize(x, T[fmt.upper()]))
    assert np.array_equal(blocks.encode(x, fmt), own)


# the round trip's RMS error against the values' RMS on normal values (measured: q4_1 0.079, q5_0 0.043, q5_1 0.038,
# q5_k 0.039, q3_k 0.185, q2_k 0.345, iq4_nl 0.080, iq4_xs 0.080; the encoders here are plain, not ggml's search)
RMS_BOUND = {"q4_1": 0.1, "q5_0": 0.055, "q5_1": 0.05, "q5_k": 0.05, "q3_k": 0.22, "q2_k": 0.4, "iq4_nl": 0.1,
             "iq4_xs": 0.1}


@pytest.mark.parametrize("fmt", NEW)
def test_round_trip_error_is_small(fmt):
    g = np.random.default_rng(3)
    for scale in (1e-2, 1.0, 100.0):
        x = (g.standard_normal((8, 512)) * scale).astype(np.float32)
        raw = blocks.encode(x, fmt)
        assert raw.shape == (8, blocks.row_bytes(fmt, 512)) and raw.dtype == np.uint8
        y = reference(raw, fmt)
        rel = float(np.sqrt(np.mean((y - x) ** 2)) / np.sqrt(np.mean(x ** 2)))
        assert rel < RMS_BOUND[fmt], (scale, rel)
    assert not reference(blocks.encode(np.zeros((2, 256), np.float32), fmt), fmt).any()
    const = np.full((1, 256), -0.75, np.float32)
    assert np.abs(reference(blocks.encode(const, fmt), fmt) - const).max() < 0.75 * 0.1


LEVELS = {"q4_1": 15, "q5_0": 31, "q5_1": 31, "q5_k": 31, "q3_k": 3, "q2_k": 3, "iq4_nl": 8,
          "iq4_xs": 8}  # steps across a span
SUB = {"q4_1": 32, "q5_0": 32, "q5_1": 32, "q5_k": 32, "q3_k": 16, "q2_k": 16, "iq4_nl": 32, "iq4_xs": 32}


@pytest.mark.parametrize("fmt", NEW)
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scale=st.floats(1e-2, 1e3), shift=st.floats(-2, 2))
def test_encoded_values_lie_within_a_step(fmt, seed, scale, shift):
    """Whatever the values (offset, one-signed, tiny or large), each decodes within about one step of its
    sub-block's range: the stored scales and levels are consistent (iq4's 16 levels are uneven: up to 24/254 of the
    range apart)."""
    x = ((np.random.default_rng(seed).standard_normal((2, 256)) + shift) * scale).astype(np.float32)
    y = reference(blocks.encode(x, fmt), fmt)
    assert np.isfinite(y).all()
    xs, ys = x.reshape(-1, SUB[fmt]), y.reshape(-1, SUB[fmt])
    span = np.maximum(xs.max(axis=1), 0) - np.minimum(xs.min(axis=1), 0)
    tol = span / LEVELS[fmt] * 1.1 + np.abs(x).max() * 4e-3
    assert (np.abs(ys - xs).max(axis=1) <= tol).all()


@pytest.mark.parametrize("fmt", NEW)
def test_the_cuda_decoding_equals_the_numpy_twin(host_qget, fmt):
    """Every value of random blocks (each edge-case scale, blocks of one byte among them), decoded by prelude.cu's
    qget (one value) and qget4 (four), equals engine/formats/blocks.py's decoding to the bit (NaN as NaN)."""
    g = np.random.default_rng(FORMAT_CODE[fmt])
    vb, bb = blocks.BLOCKS[fmt]
    raws = []
    for fill in (None, 0, 0x80, 0xFF):
        b = g.integers(0, 256, size=(len(EDGE_F16), 2 * bb), dtype=np.uint8)
        if fill is not None:
            b[:] = fill
        for i, h in enumerate(EDGE_F16):
            for o in blocks.F16_SCALES[fmt]:
                b[i, o::bb], b[i, o + 1::bb] = h & 0xFF, h >> 8
        raws.append((b, 2 * vb))
    raws.append((blocks.encode(g.standard_normal((5, 512)).astype(np.float32), fmt), 512))
    for raw, cols in raws:
        want = mine(raw, fmt, cols).reshape(-1)
        both = host_qget(raw, fmt, want.size)
        for got in (both[: want.size], both[want.size:]):
            nan = np.isnan(want)
            assert np.array_equal(np.isnan(got), nan)
            assert same_bits(got[~nan], want[~nan])


@pytest.mark.parametrize("fmt", NEW)
def test_the_store_holds_them_and_refuses_a_non_finite_scale(fmt):
    x = np.random.default_rng(4).standard_normal((3, 256)).astype(np.float32)
    raw = blocks.encode(x, fmt)
    w = Weights.from_dict({"m": (raw, fmt)})
    assert w.shape("m") == (3, 256) and w.format("m") == fmt
    assert same_bits(w.get("m"), reference(raw, fmt))
    bb = blocks.BLOCKS[fmt][1]
    for o in blocks.F16_SCALES[fmt]:
        bad = raw.copy().reshape(-1, bb)
        bad[-1, o:o + 2] = [0x00, 0x7C]  # the last block: an inf scale
        assert not blocks.scales_finite(bad, fmt)[-1] and blocks.scales_finite(bad, fmt)[:-1].all()
        with pytest.raises(UserError, match=f"tensor `w` holds 1 {fmt} block.*NaN or inf"):
            Weights.from_dict({"w": (bad.reshape(raw.shape), fmt)})
