"""The tensor-core chunk attention on a CUDA device against its twin within `kernel_bound` (and so within the f32
path's `f32_bound` of attention.py's exact twin), over tests/test_attention_tc.py's awkward cases and a prefill-sized
one (Qwen3-8B's heads: 32 query heads over 8 kv heads of 128 values, 512 rows at position 0 and 300 rows after 700
cached); a relaunch writes the same bits. Skipped without a CUDA device; the same cases run on the CPU through the
host emulator in tests/test_attention_tc.py."""

from __future__ import annotations

import numpy as np
import pytest

from test_attention_tc import CASES, check_kernel, tc_attention_case
from test_kernels_gpu import _device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _device(), reason="no CUDA device")]


def run(launch, arrays, weights):
    from lanefuse.kernels.cupy_env import DeviceEnv

    assert launch.check() is None, launch.check()
    dev = DeviceEnv(0, {}, {k: v.copy() for k, v in arrays.items()}, weights)
    launch.cuda(dev)
    dev.cp.cuda.Device().synchronize()
    return dev


@pytest.mark.parametrize("case", CASES + [(512, 32, 8, 128, 128, 0, 0, 0.0, False, None, False),
                                          (300, 32, 8, 128, 128, 700, 0, 0.0, True, None, False)])
def test_attention_tc_within_the_bound(case):
    tc, _, arrays, weights = tc_attention_case(*case)
    dev = run(tc, arrays, weights)
    first = dev.host("o").copy()
    check_kernel(tc, arrays, weights, first)
    tc.cuda(dev)
    np.testing.assert_array_equal(dev.host("o"), first)
