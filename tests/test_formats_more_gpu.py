"""The kernels over the block formats past q8_0 / q4_0 / q4_k / q6_k (q4_1, q5_0, q5_1, q5_k, q3_k, q2_k, iq4_nl,
iq4_xs) on the device against their numpy twins: the GEMV and the GLU / products-in-parts reading the rows in place
(prelude.cu's qget / qget4 through gemv_tile_any), each decoded value to the bit (x one-hot), and gemv_q8.cu's
products of a quantized activation — the q8 form over the 32-value formats (q4_1 / q5_1 with their min's term), the
q8k form (llama.cpp's q8_K) over the K-quants and iq4_xs — within f32 summation of the exact twin. Skips without a
CUDA device; tests/test_formats_more_emulated.py runs the same cases on the host emulator."""

from __future__ import annotations

import numpy as np
import pytest

import test_kernels_gpu as gpu
import test_quant_gpu as qgpu
from lanefuse.engine.formats.quantize import K_FORMATS
from lanefuse.kernels import Dst, Gemv, Part
from lanefuse.engine.formats.blocks import decode_rows
from lanefuse.kernels.common import encode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu._device(), reason="no CUDA device")]

NEW = ["q4_1", "q5_0", "q5_1", "q5_k", "q3_k", "q2_k", "iq4_nl", "iq4_xs"]
r32 = gpu.r32


def k_of(fmt: str) -> int:
    """A width of whole blocks that a split-K of 2 splits into whole blocks: 448 (14 blocks of 32, a tail past the
    warp's 128-value steps) or 1536 (6 of 256)."""
    return 448 if fmt in ("q4_1", "q5_0", "q5_1", "iq4_nl") else 1536


@pytest.mark.parametrize("fmt", NEW)
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("per_warp,split", [(1, 1), (4, 1), (1, 2), (4, 2)])
def test_gemv_new_formats(fmt, m, per_warp, split):
    k, n = k_of(fmt), 9
    g = np.random.default_rng(k + n + m + len(fmt) + 10 * split)
    launch = Gemv("x", "w", fmt, Dst("y", unit=Part(n + 3, 1, n)), k, n, m, bias="b", per_warp=per_warp, split=split)
    if launch.check():
        pytest.skip(str(launch.check()))
    gpu.both(launch, {"x": r32(g, m, k), "y": np.zeros(m * (n + 3), np.float32)},
             {"w": (encode(r32(g, n, k), fmt), fmt), "b": (r32(g, n), "f32")}, tol=2e-4, placed=(m == 3))


@pytest.mark.parametrize("fmt", NEW)
@pytest.mark.parametrize("per_warp", [1, 4])
def test_gemv_new_formats_decode_each_value_to_the_bit(fmt, per_warp):
    """x one-hot (two rows, two positions): each output one decoded value times 1 plus zeros — the kernel's decoding
    equals the numpy twin's (gguf's) to the bit."""
    k, n = k_of(fmt), 5
    g = np.random.default_rng(k + per_warp)
    raw = encode(r32(g, n, k), fmt)
    ref = decode_rows(raw, fmt, k).reshape(n, k)
    for i0, i1 in [(0, k - 1), (13, 31 + k // 2), (k // 3, 7 + 4 * (k // 5))]:
        x = np.zeros((2, k), np.float32)
        x[0, i0] = x[1, i1] = 1.0
        dev = gpu.both(Gemv("x", "w", fmt, Dst("y"), k, n, 2, per_warp=per_warp),
                       {"x": x, "y": np.zeros(2 * n, np.float32)}, {"w": (raw, fmt)}, tol=0)
        np.testing.assert_array_equal(dev.host("y"), np.stack([ref[:, i0], ref[:, i1]]).reshape(-1))


@pytest.mark.parametrize("fmt", NEW)
@pytest.mark.parametrize("per_warp", [1, 4])
def test_glu_and_parts_new_formats(fmt, per_warp):
    gpu.test_gemv_glu_and_parts_blocks(fmt, per_warp)


Q8_CASES = [(f, w) for f in NEW for w in (1, 2)] + [(f, 3) for f in NEW if f in K_FORMATS]


@pytest.mark.parametrize("fmt,words", Q8_CASES)
@pytest.mark.parametrize("m", [1, 9])
def test_gemv_q8_new_formats(fmt, words, m):
    """gemv_q8.cu over each new format: q8 / q8x2 forms (the integer path of the 32-value formats; the decoded path of
    the K-quants under q8x2) and the q8k form over the K-quants and iq4_xs (q8k_tile's groups of 16)."""
    qgpu.test_gemv_q8_kernel_equals_its_twin(fmt, words, m)


@pytest.mark.parametrize("fmt,words", [("q4_1", 1), ("q5_0", 1), ("q5_k", 3), ("q2_k", 3), ("iq4_xs", 3)])
def test_glu_and_parts_q8_new_formats(fmt, words):
    qgpu.test_gemv_glu_and_parts_q8_kernels_equal_their_twins(fmt, words)


@pytest.mark.parametrize("fmt", NEW)
def test_gather_decodes_each_block_to_the_bit(fmt):
    """Embedding rows of random blocks (every edge-case f16 scale: zero, subnormals, the largest, inf, NaN; blocks of
    one byte) gathered by the kernel (qget, a value a thread) equal formats/blocks.py's decoding to the bit, NaN as
    NaN."""
    from lanefuse.kernels import Gather
    from lanefuse.engine.formats.blocks import BLOCKS, F16_SCALES
    from lanefuse.kernels.common import decode
    from lanefuse.kernels.cupy_env import DeviceEnv

    vb, bb = BLOCKS[fmt]
    g = np.random.default_rng(bb)
    edge = [0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0x8001, 0x7C00, 0xFC00, 0x7E00, 0x7D55]
    rows, per_row = 2 * len(edge), 2
    raw = g.integers(0, 256, size=(rows, per_row * bb), dtype=np.uint8)
    for r in range(rows):
        if r >= len(edge):
            raw[r] = (0, 0x80, 0xFF)[r % 3]
        h = edge[r % len(edge)]
        for o in F16_SCALES[fmt]:
            raw[r, o::bb], raw[r, o + 1::bb] = h & 0xFF, h >> 8
    cols = per_row * vb
    idx = np.arange(rows, dtype=np.int32)[::-1].copy()
    dev = DeviceEnv(0, {}, {"t": idx, "o": np.zeros(rows * cols, np.float32)}, {"E": (raw, fmt)})
    Gather("E", "t", "o", cols, rows=rows, format=fmt).cuda(dev)
    got = dev.host("o").reshape(rows, cols)
    with np.errstate(invalid="ignore", over="ignore"):
        want = decode(raw, fmt)[idx]
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
