"""tests/test_formats_more_gpu.py's cases — the GEMV, GLU and products-in-parts over q4_1, q5_0, q5_1, q5_k, q3_k,
q2_k, iq4_nl, iq4_xs rows read in place, each decoded value to the bit, and gemv_q8.cu over them under the q8, q8x2
and q8k forms — run on the host emulator of CUDA (tests/cuda_host) against their numpy twins. Skipped without g++."""

from __future__ import annotations

import pytest

import test_formats_more_gpu as fm
from cuda_host import emu
from test_kernels_emulated import emulated  # noqa: F401  (the module's emulating DeviceEnv: an autouse fixture)

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="no g++ to build the emulated kernels")


@pytest.mark.parametrize("fmt", fm.NEW)
@pytest.mark.parametrize("m,per_warp,split", [(1, 1, 1), (2, 4, 2), (3, 4, 1)])
def test_gemv(fmt, m, per_warp, split):
    fm.test_gemv_new_formats(fmt, m, per_warp, split)


@pytest.mark.parametrize("fmt", fm.NEW)
def test_gemv_decodes_each_value_to_the_bit(fmt):
    fm.test_gemv_new_formats_decode_each_value_to_the_bit(fmt, 4)


@pytest.mark.parametrize("fmt,words", fm.Q8_CASES)
def test_gemv_q8(fmt, words):
    fm.test_gemv_q8_new_formats(fmt, words, 9)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["q5_0", "q3_k"])
def test_glu_and_parts(fmt):
    fm.test_glu_and_parts_new_formats(fmt, 4)


@pytest.mark.parametrize("fmt", fm.NEW)
def test_gather_decodes_each_block_to_the_bit(fmt):
    fm.test_gather_decodes_each_block_to_the_bit(fmt)
