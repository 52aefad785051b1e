"""A rank's part of a mixture in moe.cu (expert parallelism: Moe `lo`, `local`): the real kernels run by the host
emulator of CUDA over a part's experts alone (its gate/up, down rows and biases; every row routed over all E, the
choices of other ranks' experts adding nothing), a row at a time (moe_up, moe_down; one and four values a warp) and
over sorted rows (moe_route, moe_up_sorted, moe_down_sorted, moe_finish: a block a held expert), against the numpy
twin (test_ranks_moe checks the twin against the reference interpreter); the parts of every rank summing to the whole
mixture's launch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lanefuse.kernels import Moe
from test_moe_per_warp import emulated, mixture, needs_gxx  # noqa: F401 - the emulator fixture

E_PARTS = {"wgu": "gate_up", "wd": "down", "bgu": "gate_up", "bd": "down"}


def poisoned(launch: Moe, arrays: dict, weights: dict, tol: float = 2e-4):
    """test_kernels_gpu.both with the launch's scratch (choices, weights, hidden, parts) NaN before it runs, as a device's
    memory holds what it held: a slot of another rank's choice read anywhere shows."""
    from lanefuse.kernels import HostEnv
    from lanefuse.kernels.cupy_env import DeviceEnv

    host = HostEnv({n: a.copy() for n, a in arrays.items()}, weights)
    launch.numpy(host)
    dev = DeviceEnv(0, {}, {n: a.copy() for n, a in arrays.items()}, weights)
    for sc in launch.scratch():
        if not sc.counter:
            a = dev.scratch(launch, sc)
            a[...] = {"i": -1, "u": 255}.get(a.dtype.kind, np.nan)
    launch.cuda(dev)
    for name in arrays:
        np.testing.assert_allclose(dev.host(name), host.array(name), rtol=tol, atol=tol, err_msg=name)
    return dev


def part_of(launch: Moe, weights: dict, lo: int, hi: int) -> tuple[Moe, dict]:
    """`launch` over experts lo..hi-1 of its E, and its weights cut to theirs (rows of the stacked experts)."""
    f, d = launch.f, launch.d
    per = {"gate_up": 2 * f, "down": d}
    cut = dict(weights)
    for name, role in E_PARTS.items():
        if name in weights:
            a, fmt = weights[name]
            cut[name] = (np.ascontiguousarray(np.asarray(a)[lo * per[role]:hi * per[role]]), fmt)
    return dataclasses.replace(launch, lo=lo, local=hi - lo), cut


CASES = [  # fmt, rows, d, f, E, k, shared, gptoss, per_warp, sort, lo, hi
    ("f32", 1, 32, 37, 8, 2, 0, False, 1, False, 3, 6),
    ("bf16", 2, 64, 40, 8, 3, 0, False, 4, False, 0, 3),
    ("bf16", 1, 64, 72, 6, 2, 0, True, 4, False, 4, 6),  # gpt-oss's biases and clamp
    ("q8_0", 1, 64, 64, 8, 2, 32, False, 1, False, 5, 8),  # a shared expert's part beside the experts'
    ("f32", 6, 32, 37, 7, 2, 0, False, 1, True, 2, 5),  # sorted rows: a block a held expert
    ("bf16", 5, 64, 40, 6, 2, 24, False, 1, True, 0, 2),  # sorted, a shared expert
    ("bf16", 5, 64, 72, 6, 2, 0, True, 1, True, 3, 6),  # sorted, gpt-oss
]


@needs_gxx
@pytest.mark.parametrize("fmt,rows,d,f,E,k,shared,gptoss,per_warp,sort,lo,hi", CASES)
def test_a_part_of_the_mixture_in_the_kernels(emulated, fmt, rows, d, f, E, k, shared, gptoss, per_warp, sort, lo,
                                              hi):  # noqa: F811 - the fixture
    whole, arrays, weights = mixture(fmt, rows, d, f, E, k, shared, False, gptoss, seed=7)
    whole = dataclasses.replace(whole, per_warp=per_warp, sort=sort)
    launch, cut = part_of(whole, weights, lo, hi)
    assert launch.check() is None, launch.check()
    dev = poisoned(launch, arrays, cut)
    names = [c[0] for c in dev.calls]
    want = ["moe_route", "moe_up_sorted", "moe_down_sorted", "moe_finish"] if sort else ["moe_up", "moe_down"]
    assert names == want
    if sort:  # a block a held expert (and the shared slot)
        grids = {c[0]: c[1] for c in dev.calls}
        assert grids["moe_up_sorted"][1] == hi - lo + (shared > 0)


@needs_gxx
@pytest.mark.parametrize("sort", [False, True])
def test_the_ranks_parts_sum_to_the_whole(emulated, sort):  # noqa: F811 - the fixture
    """Experts 0..2, 3..4, 5..6 of 7 (uneven), each part's kernels on its own: their outputs' sum in f64 is the
    whole mixture's kernels' within f32 rounding, and a row none of a part's experts was chosen by is zero there."""
    from lanefuse.engine.routing import route

    rows, d, f, E, k = 4 if sort else 1, 32, 37, 7, 2
    whole, arrays, weights = mixture("f32", rows, d, f, E, k, seed=3)
    whole = dataclasses.replace(whole, sort=sort)
    full = poisoned(whole, arrays, weights).host("y").astype(np.float64)
    total = np.zeros_like(full)
    x = arrays["x"].reshape(rows, d).astype(np.float64)
    chosen, _ = route(x @ weights["wr"][0].astype(np.float64).T, k, True)
    for lo, hi in ((0, 3), (3, 5), (5, 7)):
        launch, cut = part_of(whole, weights, lo, hi)
        y = poisoned(launch, arrays, cut).host("y").reshape(rows, d)
        for r in range(rows):
            if not ((chosen[r] >= lo) & (chosen[r] < hi)).any():
                assert not y[r].any()
        total += y.reshape(-1)
    np.testing.assert_allclose(total, full, rtol=1e-5, atol=1e-5 * float(np.abs(full).max()))
