"""Moe `per_warp` (issue 40 item 4, seed 002's Moe `per_warp`; the schedule's `rows_a_warp`): a mixture a row at a time
(moe_up, moe_down: the decode step's) computes four of a warp's expert values (and router logits) at once, each warp's
loads of four weight rows in flight where it had one, every sum in the same order (moe.cu moe_dots). The real kernels run by the host
emulator of CUDA: equal to the numpy twin and to one value a warp to the bit (a shared expert, the finalize, gpt-oss's
biases and clamp, block formats, the q8 numerics' shared expert), again in reverse block order with shuffled threads;
the step's choice and refusal; a tiny Qwen3-MoE's decode planned with it, equal to the reference interpreter."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import test_kernels_gpu as gpu
from cuda_host import emu
from test_kernels_emulated import again_same
from lanefuse.kernels import Dst, HostEnv, Moe
from lanefuse.kernels.common import encode
from lanefuse.lane.lower.knobs import Knobs

needs_gxx = pytest.mark.skipif(emu.compiler() is None, reason="no g++ to build the emulated kernels")
r32 = gpu.r32


@pytest.fixture(scope="module")
def emulated():
    with emu.emulating([Moe.stem]) as env:
        yield env


def mixture(fmt, rows, d, f, E, k, shared=0, finalize=False, gptoss=False, qwords=0, seed=0):
    g = np.random.default_rng(seed + rows + d + f)
    arrays = {"x": r32(g, rows, d), "y": np.zeros(rows * d, np.float32)}
    weights = {"wr": ((r32(g, E, d) * 3 / np.sqrt(d)).astype(np.float32), "f32"),
               "wgu": (encode(r32(g, E * 2 * f, d) / np.sqrt(d), fmt), fmt),
               "wd": (encode(r32(g, E * d, f) / np.sqrt(f), fmt), fmt)}
    kw = {}
    if shared:
        for n, shape in (("sg", (shared, d)), ("su", (shared, d)), ("sd", (d, shared)), ("sgt", (1, d))):
            weights[n] = (encode(r32(g, *shape) / np.sqrt(shape[1]), fmt), fmt)
        kw.update(sg="sg", su="su", sd="sd", sgate="sgt", sf=shared, format_s=fmt, qwords=qwords)
    if finalize:
        arrays.update(a=r32(g, rows, d), s=np.zeros(rows * d, np.float32))
        weights["nw"] = (1 + 0.1 * r32(g, d), "f32")
        kw.update(add="a", sum="s", nw="nw", eps=1e-6)
    if gptoss:
        weights.update(br=(0.3 * r32(g, E), "f32"), bgu=(0.3 * r32(g, E * 2 * f), "f32"),
                       bd=(0.3 * r32(g, E * d), "f32"))
        kw.update(act="clamped_glu", routing="topk_softmax", br="br", bgu="bgu", bd="bd", limit=1.5)
    return Moe("x", "wr", "wgu", "wd", Dst("y"), d, f, E, k, rows, fmt, norm_topk=not gptoss, **kw), arrays, weights


CASES = [  # fmt, rows, d, f, E, k, shared, finalize, gptoss, qwords
    ("f32", 1, 32, 37, 8, 2, 0, False, False, 0),  # tiles of 37 and 32: a warp's last values fewer than four
    ("bf16", 2, 96, 64, 8, 3, 40, True, False, 0),
    ("bf16", 1, 64, 72, 6, 2, 0, True, True, 0),
    ("q8_0", 1, 128, 96, 8, 2, 64, True, False, 1),
    ("q4_k", 1, 256, 256, 4, 2, 256, False, False, 3),
    ("bf16", 1, 64, 40, 64, 4, 0, False, False, 0),  # the router four logits a warp: 64 experts, and 37
    ("f32", 2, 32, 37, 37, 3, 24, True, False, 0),
]


@needs_gxx
@pytest.mark.parametrize("fmt,rows,d,f,E,k,shared,finalize,gptoss,qwords", CASES)
def test_four_values_a_warp_equal_one_to_the_bit(emulated, fmt, rows, d, f, E, k, shared, finalize, gptoss, qwords):
    one, arrays, weights = mixture(fmt, rows, d, f, E, k, shared, finalize, gptoss, qwords)
    four = dataclasses.replace(one, per_warp=4)
    assert four.check() is None, four.check()
    outs = {}
    for launch in (one, four):
        dev = gpu.both(launch, {n: a.copy() for n, a in arrays.items()}, weights, tol=2e-4)
        assert [c[0] for c in dev.calls] == ["moe_up", "moe_down"]
        outs[launch.per_warp] = {n: dev.host(n).copy() for n in arrays}
        again_same(launch, dev, [n for n in ("y", "s") if n in arrays])
    for n in arrays:
        np.testing.assert_array_equal(outs[4][n], outs[1][n], err_msg=n)


def test_the_step_takes_four_a_row_at_a_time():
    """`rows_a_warp`: a row at a time with tiles giving every warp four values (widths of at least 32) takes four;
    sorted rows, narrow experts, or the step held: one. Bytes and launches unchanged; one line for a count the kernels
    do not take."""
    base, _, _ = mixture("bf16", 1, 64, 40, 8, 2)
    knobs = Knobs()
    t = base.tune(knobs)
    assert t.per_warp == 4 and t.bytes() == base.bytes() and len(t.kernels()) == len(base.kernels())
    assert dataclasses.replace(base, sort=True, rows=5).tune(knobs).per_warp == 1
    assert dataclasses.replace(base, f=24).tune(knobs).per_warp == 1
    assert base.tune(knobs, {"rows_a_warp"}).per_warp == 1
    assert "2 values a warp" in str(dataclasses.replace(base, per_warp=2).check())


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_a_tiny_qwen3_moes_decode_takes_four_a_warp(fmt):
    """The decode plan of a tiny Qwen3-MoE (experts of 37 over a model of 32) takes four values a warp in every
    mixture, held one; its logits and caches the reference interpreter's (test_moe's check), and a chunk's sorted
    mixture one."""
    from test_moe import plan_against_reference, tiny, weights_for

    cfg = tiny("Qwen3MoeForCausalLM")
    w = weights_for(cfg, fmt)
    s = plan_against_reference(cfg, w, 1)
    moes = [x.launch for x in s.launches if x.launch.census == "moe"]
    assert moes and {m.per_warp for m in moes} == {4}
    held = plan_against_reference(cfg, w, 1, held=["rows_a_warp"])
    assert {x.launch.per_warp for x in held.launches if x.launch.census == "moe"} == {1}
    assert held.n_launches == s.n_launches
    chunk = plan_against_reference(cfg, w, 5)
    assert all(x.launch.per_warp == 1 or not x.launch.sort for x in chunk.launches if x.launch.census == "moe")
