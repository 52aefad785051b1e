"""A chunk's expanded latent attention multiplies only the cache rows it reads (issue 36): HeadGemv with `upto`
computes the rows below min(L, pos + rows) in both numpy twins, the same values as over every row, and leaves the
others as they were; a position with a quantized output is refused; the expanded plan's halves take the position."""

from __future__ import annotations

import numpy as np
import pytest

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels import Dst, HeadGemv
from lanefuse.kernels.env import HostEnv
from test_kernels_gpu import HEAD_FILLED, head_filled_case


@pytest.mark.parametrize("pos,extra", HEAD_FILLED)
@pytest.mark.parametrize("twin", ["numpy", "fast"])
def test_twins_compute_only_the_filled_rows(pos, extra, twin):
    launch, arrays, weights = head_filled_case(pos, extra, "f32")
    env = HostEnv({k: v.copy() for k, v in arrays.items()}, weights)
    getattr(launch, twin)(env)
    full = HeadGemv("lc", "wk", "f32", Dst("kx"), 64, 1, 96, 80, rows_out=True)
    whole = HostEnv({**{k: v.copy() for k, v in arrays.items()}, "kx": np.zeros(64 * 80, np.float32)}, weights)
    getattr(full, twin)(whole)
    n = min(64, pos + extra)
    y, want = env.array("kx").reshape(64, 80), whole.array("kx").reshape(64, 80)
    if twin == "numpy":  # f64 sums a value: the same bits whatever the rows
        np.testing.assert_array_equal(y[:n], want[:n])
    else:  # f32 BLAS, whose blocking follows the row count: an ulp or two
        np.testing.assert_allclose(y[:n], want[:n], rtol=1e-5, atol=1e-6)
    assert np.isnan(y[n:]).all()
    assert "pos" in launch.reads()


def test_a_position_with_a_quantized_output_is_refused():
    l = HeadGemv("lc", "wk", "f32", Dst("kx"), 64, 1, 96, 64, upto="pos", extra=4, quant="q", words=1)
    assert isinstance(l.check(), Refusal) and "filled rows" in l.check().reason


def test_the_expanded_halves_read_the_position(tmp_path):
    from test_deepseek import mla_launches, narrow_lane, plan_against_reference

    s = plan_against_reference(20, "f32", **narrow_lane(tmp_path))
    halves = [l.launch for l in mla_launches(s) if l.launch.census == "head_gemv"]
    assert len(halves) == 2 and all(h.upto is not None and h.extra == 20 for h in halves)
