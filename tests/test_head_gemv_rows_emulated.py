"""head_gemv.cu with ROWS_A_WARP rows of x a warp (issue 35 H5): each value of w read once for a warp's rows, not once
a row. The real kernel on the host emulator (tests/cuda_host) against its numpy twin: both layouts, the dense formats
and q8_0, row counts around the groups of 8 (1, 3, 8, 9, 20), many heads, a placed output (rows of a table), the filled
rows of a cache (`upto`), a part of a wider x; the quantizing form keeps one row a warp (its tail counts a block's
outputs as consecutive). ~10 s with the module cached."""

from __future__ import annotations

import numpy as np
import pytest

import test_kernels_gpu as gpu
from cuda_host import emu
from test_kernels_emulated import again_same
from lanefuse.kernels import Dst, HeadGemv, Part
from lanefuse.kernels.common import encode
from lanefuse.kernels.head_gemv import ROWS_A_WARP

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="no g++ to build the emulated kernels")
r32 = gpu.r32


@pytest.fixture(scope="module", autouse=True)
def emulated():
    with emu.emulating([HeadGemv.stem]) as env:
        yield env


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8_0"])
@pytest.mark.parametrize("m,heads,a,b,rows_out", [(1, 4, 32, 64, False), (3, 4, 64, 32, True), (8, 3, 64, 32, False),
                                                  (9, 2, 96, 24, True), (20, 1, 64, 40, True), (5, 16, 64, 32, False)])
def test_rows_a_warp_equal_the_twin(fmt, m, heads, a, b, rows_out):
    g = np.random.default_rng(m * heads + a + b)
    rows, cols = (heads * b, a) if rows_out else (heads * a, b)
    arrays = {"x": r32(g, m, heads * a), "y": np.zeros(m * heads * b, np.float32)}
    weights = {"w": (encode(r32(g, rows, cols) / np.sqrt(a), fmt), fmt)}
    launch = HeadGemv("x", "w", fmt, Dst("y"), m, heads, a, b, rows_out=rows_out)
    rw = 1 if m == 1 else ROWS_A_WARP  # a single row keeps head_gemv (32 registers)
    assert launch.rows_a_warp() == rw and launch.grid_block()[0][0] == -(-(-(-m // rw)) * heads * b // 4)
    dev = gpu.both(launch, arrays, weights, tol=2e-4, placed=m == 3)
    again_same(launch, dev, ["y"])


# the filled rows of a cache (`upto`), in groups of 8 with a short last one: test_kernels_emulated's
# test_head_gemv_filled_rows over test_kernels_gpu.HEAD_FILLED (the same kernel and case)


def test_a_part_of_a_wider_row_in_groups():
    m, heads, a, b, part = 11, 2, 32, 7, Part(40, 3, 32)
    g = np.random.default_rng(5)
    x = r32(g, m * heads * part.pitch)
    w = r32(g, heads * b, a)
    launch = HeadGemv("x", "w", "bf16", Dst("y"), m, heads, a, b, rows_out=True, part=part)
    dev = gpu.both(launch, {"x": x, "y": np.zeros(m * heads * b, np.float32)}, {"w": (encode(w, "bf16"), "bf16")},
                   tol=2e-4)
    again_same(launch, dev, ["y"])


def test_the_quantizing_form_keeps_a_row_a_warp():
    h = HeadGemv("x", "wh", "q8_0", Dst("o"), 3, 8, 64, 32, quant="oq", words=1)
    assert h.rows_a_warp() == 1 and h.grid_block()[0][0] == 3 * 8 * 32 // 4
