"""norm.cu's rows on the CPU through the host emulator (tests/cuda_host), against the numpy twin: rows whose every
array lies on 16-byte words take norm_row_vec (four values a load), the others norm_row's one value a thread; each
variant (plain, an added operand written to `sum`, a pre-normed one, heads, into a cache row) both ways, and the same
bits on a relaunch in reverse block order."""

from __future__ import annotations

import numpy as np
import pytest

import test_kernels_gpu as gpu
from cuda_host import emu
from lanefuse.kernels import Dst, Norm, Part, PreNorm
from test_kernels_emulated import again_same

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="no g++ to build the emulated kernels")
r32 = gpu.r32


@pytest.fixture(scope="module", autouse=True)
def emulated():
    with emu.emulating([Norm.stem]) as env:
        yield env


# (cols, heads, part): aligned rows (the vector path), a head of 250 values (not four-value words: one at a time), a
# part of a wider row two values in (not aligned)
@pytest.mark.parametrize("cols,heads,part", [(4096, 1, False), (512, 4, False), (1000, 4, False), (1024, 1, True)])
@pytest.mark.parametrize("variant", ["plain", "add", "pre", "into"])
def test_norm_rows_four_values_a_load(cols, heads, part, variant):
    g = np.random.default_rng(cols + heads)
    rows, hd, pos = 3, cols // heads, 1
    xw = cols + 8 if part else cols
    arrays = {"x": r32(g, rows, xw), "a": r32(g, rows, cols), "s": np.zeros(rows * cols, np.float32),
              "y": np.zeros((pos + rows) * cols, np.float32), "pos": np.array([pos], np.int32)}
    launch = Norm("x", "w", "y", rows, cols, 1e-5, heads=heads, part=Part(xw, 2, cols) if part else None,
                  add="a" if variant != "plain" else None, sum="s" if variant != "plain" else None,
                  pre=PreNorm("pw", 1e-6) if variant == "pre" else None,
                  into=Dst("y", row="pos", pitch=cols) if variant == "into" else None)
    dev = gpu.both(launch, arrays, {"w": (r32(g, hd), "f32"), "pw": (r32(g, cols), "f32")}, tol=2e-5)
    again_same(launch, dev, ["y", "s"])
