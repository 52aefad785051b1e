"""GGUF's block formats (formats/blocks.py): the numpy decoding equals `gguf.quants.dequantize` to the bit on every
format — random blocks with extreme, subnormal, zero and non-finite f16 scales, all-zero blocks, -128, odd row counts
— the CUDA decoding (prelude.cu's block section, compiled as host C++) equals the numpy twin to the bit, the encoders
round-trip (q8_0 / q4_0 byte for byte as gguf's own quantizer, q4_k / q6_k within stated errors), and the weight
store holds block tensors at their logical shape and refuses broken ones in words."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from lanefuse.engine.errors import UserError
from lanefuse.engine.front.weights import Weights
from lanefuse.engine.formats import blocks
from lanefuse.kernels.common import FORMAT_CODE, decode, encode

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

FMTS = ["q8_0", "q4_0", "q4_k", "q6_k"]
QTYPE = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_k": T.Q4_K, "q6_k": T.Q6_K}
SCALES = {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}  # byte offsets of each block's f16 scales
# f16 bit patterns: zero, -0, the smallest and largest subnormals, the smallest normal, 1, the largest finite, a tiny
# negative, inf, -inf, a quiet NaN, a NaN with a payload
EDGE_F16 = [0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0x8001, 0x7C00, 0xFC00, 0x7E00, 0x7D55]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def reference(raw: np.ndarray, fmt: str) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return gguf.quants.dequantize(raw, QTYPE[fmt])


def mine(raw: np.ndarray, fmt: str, cols: int) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return blocks.decode_rows(raw, fmt, cols)


def test_the_format_table_is_ggufs():
    for fmt, q in QTYPE.items():
        assert blocks.BLOCKS[fmt] == tuple(gguf.GGML_QUANT_SIZES[q])
    assert blocks.bytes_per_value("q4_0") == 18 / 32 and blocks.row_bytes("q6_k", 512) == 420
    assert [FORMAT_CODE[f] for f in FMTS] == [3, 4, 5, 6]  # prelude.cu's qget


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rows,blocks_a_row", [(1, 1), (3, 2), (7, 3), (2, 1)])
def test_encoded_rows_decode_as_gguf_does(fmt, rows, blocks_a_row):
    cols = blocks_a_row * blocks.BLOCKS[fmt][0]
    g = np.random.default_rng(rows * 10 + blocks_a_row)
    x = (g.standard_normal((rows, cols)) * g.uniform(0.01, 10, (rows, 1))).astype(np.float32)
    raw = blocks.encode(x, fmt)
    assert raw.dtype == np.uint8 and raw.shape == (rows, blocks.row_bytes(fmt, cols)) and raw.flags.c_contiguous
    assert same_bits(mine(raw, fmt, cols), reference(raw, fmt))
    assert same_bits(decode(raw, fmt), reference(raw, fmt))  # common.decode: (rows, cols) from (rows, row bytes)
    assert same_bits(decode(raw.reshape(-1), fmt), reference(raw, fmt).reshape(-1))  # flat, as the runners hold it
    assert np.array_equal(encode(x, fmt), raw)  # common.encode delegates


@st.composite
def block_bytes(draw, fmt: str):
    """Rows of random blocks of `fmt`: random, all-zero, all-0x80 (int8 -128, nibble 8) or all-0xff value bytes, and
    f16 scales drawn from the edge cases or at random."""
    vb, bb = blocks.BLOCKS[fmt]
    rows = draw(st.integers(1, 5))
    per_row = draw(st.integers(1, 3 if vb == 32 else 2))
    n = rows * per_row
    seed = draw(st.integers(0, 2**32 - 1))
    b = np.random.default_rng(seed).integers(0, 256, size=(n, bb), dtype=np.uint8)
    for i in range(n):
        fill = draw(st.sampled_from(["random", "zero", "0x80", "0xff"]))
        if fill != "random":
            b[i] = {"zero": 0, "0x80": 0x80, "0xff": 0xFF}[fill]
        for o in SCALES[fmt]:
            h = draw(st.one_of(st.sampled_from(EDGE_F16), st.integers(0, 0xFFFF)))
            b[i, o], b[i, o + 1] = h & 0xFF, h >> 8
    return b.reshape(rows, per_row * bb), per_row * vb


@pytest.mark.parametrize("fmt", FMTS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_blocks_decode_to_the_bit(fmt, data):
    raw, cols = data.draw(block_bytes(fmt))
    assert same_bits(mine(raw, fmt, cols), reference(raw, fmt))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1e-6, 1e-3, 1.0, 300.0, 6e4]),
       zero_block=st.booleans())
def test_the_own_q8_0_q4_0_encoders_are_ggufs_byte_for_byte(fmt, seed, scale, zero_block):
    """The fallback encoders (for machines without gguf) follow ggml's reference exactly."""
    x = (np.random.default_rng(seed).standard_normal((3, 64)) * scale).astype(np.float32)
    if zero_block:
        x[1, :32] = 0.0
    own = (blocks._enc_q8_0 if fmt == "q8_0" else blocks._enc_q4_0)(x.reshape(-1, 32)).reshape(3, -1)
    assert np.array_equal(own, gguf.quants.quantize(x, QTYPE[fmt]))


# the round trip's RMS error against the values' RMS, measured on normal values (the bound sits above what is seen:
# q8_0 ~0.004, q4_0 ~0.085, q4_k ~0.08, q6_k ~0.02)
RMS_BOUND = {"q8_0": 0.01, "q4_0": 0.12, "q4_k": 0.12, "q6_k": 0.035}


@pytest.mark.parametrize("fmt", FMTS)
def test_round_trip_error_is_small(fmt):
    g = np.random.default_rng(3)
    for scale in (1e-2, 1.0, 100.0):  # (much smaller and the f16 scales go subnormal: coarser, as in ggml)
        x = (g.standard_normal((16, 512)) * scale).astype(np.float32)
        y = reference(blocks.encode(x, fmt), fmt)
        rel = float(np.sqrt(np.mean((y - x) ** 2)) / np.sqrt(np.mean(x ** 2)))
        assert rel < RMS_BOUND[fmt], (scale, rel)
    assert not reference(blocks.encode(np.zeros((2, 256), np.float32), fmt), fmt).any()  # zeros stay zeros
    const = np.full((1, 256), -0.75, np.float32)  # one value everywhere: held within a step of it
    assert np.abs(reference(blocks.encode(const, fmt), fmt) - const).max() < 0.75 * 0.1


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scale=st.floats(1e-2, 1e3), shift=st.floats(-2, 2))
def test_k_quant_encoder_bytes_are_valid(fmt, seed, scale, shift):
    """Whatever the values (offset, one-signed, tiny or large), every value decodes within one quantization step of
    its sub-block's range: the stored scales and levels are consistent."""
    x = ((np.random.default_rng(seed).standard_normal((2, 256)) + shift) * scale).astype(np.float32)
    raw = blocks.encode(x, fmt)
    y = reference(raw, fmt)
    assert np.isfinite(y).all()
    sub = 32 if fmt == "q4_k" else 16
    xs, ys = x.reshape(-1, sub), y.reshape(-1, sub)
    span = np.maximum(xs.max(axis=1), 0) - np.minimum(xs.min(axis=1), 0) if fmt == "q4_k" else \
        2 * np.abs(xs).max(axis=1)
    levels = 15 if fmt == "q4_k" else 62
    tol = span / levels * 1.1 + np.abs(x).max() * 2e-3  # a step (the f16 and 6/8-bit scale roundings beside it)
    assert (np.abs(ys - xs).max(axis=1) <= tol).all()


def test_encoding_refuses_rows_of_part_blocks_and_non_finite_values():
    with pytest.raises(ValueError, match="blocks hold 256"):
        blocks.encode(np.zeros((2, 300), np.float32), "q4_k")
    with pytest.raises(ValueError, match="non-finite"):
        blocks.encode(np.full((1, 32), np.inf, np.float32), "q8_0")
    assert blocks.row_refusal("q8_0", 96) is None and "whole number of blocks" in blocks.row_refusal("q6_k", 96)


# -- the CUDA decoding, compiled for the host -----------------------------------------------------------------------

HARNESS = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
typedef unsigned short u16;
typedef long long i64;
#define __device__
#define __forceinline__ inline
#define __noinline__
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
struct float4 { float x, y, z, w; };
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
static inline float f16f(unsigned h) {  // IEEE half to float, exactly (what cvt.f32.f16 does)
    unsigned s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? std::ldexp((float)m, -24) : e == 31 ? (m ? NAN : INFINITY) : std::ldexp((float)(m + 1024), (int)e - 25);
    return s ? -v : v;
}
SECTION
int main(int argc, char** argv) {
    int fmt = atoi(argv[1]);
    i64 n = atoll(argv[2]), nbytes = atoll(argv[3]);
    std::vector<unsigned char> w(nbytes);
    if (fread(w.data(), 1, nbytes, stdin) != (size_t)nbytes) return 2;
    std::vector<float> out(2 * n);  // every value by qget, then by qget4 four at a time
    for (i64 i = 0; i < n; i++) out[i] = qget(fmt, w.data(), i);
    for (i64 i = 0; i < n; i += 4) {
        float4 v = qget4(fmt, w.data(), i);
        out[n + i] = v.x, out[n + i + 1] = v.y, out[n + i + 2] = v.z, out[n + i + 3] = v.w;
    }
    fwrite(out.data(), 4, 2 * n, stdout);
    return 0;
}
"""


@pytest.fixture(scope="module")
def host_qget(tmp_path_factory):
    """prelude.cu's block section built as a host program: bytes in, every value decoded out."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the CUDA decoding for the host")
    src = (Path(__file__).parents[1] / "kernels" / "prelude.cu").read_text()
    m = re.search(r"// -- block formats:.*?// -- end of block formats", src, re.S)
    assert m, "prelude.cu's block section markers are missing"
    d = tmp_path_factory.mktemp("qget")
    (d / "qget.cpp").write_text(HARNESS.replace("SECTION", m.group(0)))
    subprocess.run([cxx, "-O1", "-ffp-contract=off", "-Wall", "-Werror", "-o", str(d / "qget"), str(d / "qget.cpp")],
                   check=True, capture_output=True, text=True)

    def run(raw: np.ndarray, fmt: str, count: int) -> np.ndarray:
        b = np.ascontiguousarray(raw, np.uint8).tobytes()
        p = subprocess.run([str(d / "qget"), str(FORMAT_CODE[fmt]), str(count), str(len(b))], input=b,
                           capture_output=True, check=True)
        return np.frombuffer(p.stdout, np.float32)

    return run


@pytest.mark.parametrize("fmt", FMTS)
def test_the_cuda_decoding_equals_the_numpy_twin(host_qget, fmt):
    """Every value of random blocks (edge-case scales and fills among them), decoded by the device functions the
    kernels call inside their dot products (one value: qget; four: qget4), equals formats/blocks.py's decoding to the
    bit (NaN as NaN)."""
    g = np.random.default_rng(FORMAT_CODE[fmt])
    vb, bb = blocks.BLOCKS[fmt]
    raws = []
    for fill in (None, 0, 0x80, 0xFF):  # random bytes, then blocks of one byte, each with every edge-case scale
        b = g.integers(0, 256, size=(len(EDGE_F16), 2 * bb), dtype=np.uint8)
        if fill is not None:
            b[:] = fill
        for i, h in enumerate(EDGE_F16):
            for o in SCALES[fmt]:
                b[i, o::bb], b[i, o + 1::bb] = h & 0xFF, h >> 8
        raws.append((b, 2 * vb))
    x = g.standard_normal((5, 512)).astype(np.float32)
    raws.append((blocks.encode(x, fmt), 512))
    for raw, cols in raws:
        want = mine(raw, fmt, cols).reshape(-1)
        both = host_qget(raw, fmt, want.size)
        for got in (both[: want.size], both[want.size:]):  # wget's one value, wget4's four
            nan = np.isnan(want)
            assert np.array_equal(np.isnan(got), nan)
            assert same_bits(got[~nan], want[~nan])


# -- the weight store ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FMTS)
def test_the_store_holds_block_tensors_at_their_logical_shape(fmt):
    g = np.random.default_rng(4)
    x = g.standard_normal((5, 256)).astype(np.float32)
    raw = blocks.encode(x, fmt)
    w = Weights.from_dict({"m": (raw, fmt), "n": np.ones(256, np.float32)})
    assert w.shape("m") == (5, 256) and w.format("m") == fmt
    got_raw, got_fmt = w.raw("m")
    assert got_fmt == fmt and got_raw is raw or np.array_equal(got_raw, raw)
    assert same_bits(w.get("m"), reference(raw, fmt))


def test_the_store_refuses_broken_block_tensors_in_words():
    raw = blocks.encode(np.ones((2, 64), np.float32), "q8_0")
    with pytest.raises(UserError, match="tensor `w`: q8_0 rows are stored as uint8"):
        Weights.from_dict({"w": (raw[:, :-1], "q8_0")})  # not whole blocks
    with pytest.raises(UserError, match="not float32"):
        Weights.from_dict({"w": (raw.astype(np.float32), "q8_0")})
    bad = raw.copy()
    bad[1, 34:36] = [0x00, 0x7C]  # the second block of row 1: an inf scale
    with pytest.raises(UserError, match="tensor `w` holds 1 q8_0 block.*NaN or inf.*first block 3"):
        Weights.from_dict({"w": (bad, "q8_0")})
    assert list(blocks.scales_finite(bad, "q8_0")) == [True, True, True, False]
    from lanefuse.engine.front.weights import check_finite  # what a file's store calls on each tensor it reads

    with pytest.raises(UserError, match="x.gguf: tensor `w` holds 1 q8_0 block"):
        check_finite(bad, "q8_0", "x.gguf: tensor `w`")
    check_finite(raw, "q8_0", "x.gguf: tensor `w`")
