"""chain.cu's fold_glu_down (the gate/up GLU, then the down product with its residual and norm, as one ticket-ordered
launch) and fold_o_glu_down (the o product with its residual and post-attention norm before those: three phases) on
the CPU through the host emulator (tests/cuda_host), against the numpy twin (the GLU's twin, then the
fold's): every format the phases serve, sizes that are no multiple of a block's outputs, one and two rows, the
counters back at zero after every launch, a relaunch in reverse block order with shuffled threads giving the same
bits. The emulator runs blocks one after another, so a wait not met at once is never met: chain.cu's poll is
bounded there and traps. Two mutations show what the ticket does: phases by blockIdx in reverse order trap in the
wait; and with the wait gone too, the down blocks read a GLU not yet written and the values are wrong. (The wait
alone removed cannot be shown here: in ticket order every GLU block has finished before the first down block runs.)"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import test_kernels_gpu as gpu
from cuda_host import emu
from lanefuse.kernels import Chain, Dst, Fold, Gemv, GemvGlu, Norm, PreNorm
from lanefuse.kernels.common import encode
from test_kernels_emulated import again_same, counters_zero

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="no g++ to build the emulated kernels")
r32 = gpu.r32


@pytest.fixture(scope="module", autouse=True)
def emulated():
    with emu.emulating([Chain.stem]) as env:
        yield env


def chain(fmt, m, k, f, n, per_warp, fmt_down=None, pre=False, bias=False):
    glu = GemvGlu("x", "wg", "wu", fmt, "h", k, f, m, per_warp=per_warp, bg="bg" if bias else None)
    down = Gemv("h", "wd", fmt_down or fmt, Dst("o"), f, n, m, per_warp=per_warp, bias="bd" if bias else None)
    norm = Norm("res", "nw", "y", m, n, 1e-6, add="o", sum="sum", pre=PreNorm("pw", 1e-6) if pre else None)
    return Chain((glu, Fold(down, norm)))


def o_chain(fmt, m, ko, k, f, per_warp, fmt_o=None, bias=False):
    """The three phases: the o product of z (m x ko) into `op`, its residual `res0` added (the sum `res`) and normed
    into `x` by the o phase's last block; then the GLU of x and the down product, its residual `res` (the o phase's
    sum) and the next norm. n = k: the down product writes the hidden size the o product does."""
    o = Fold(Gemv("z", "wo", fmt_o or fmt, Dst("op"), ko, k, m, per_warp=per_warp, bias="bo" if bias else None),
             Norm("res0", "nw0", "x", m, k, 1e-5, add="op", sum="res"))
    return Chain((o, *chain(fmt, m, k, f, k, per_warp, bias=bias).phases))


def run(c, seed=3, tol=3e-4):
    g = np.random.default_rng(seed)
    glu, down = c.glu, c.down.first
    m, k, f, n = glu.m, glu.k, glu.n, down.n
    arrays = {"x": r32(g, m, k), "h": np.zeros(m * f, np.float32), "o": np.zeros(m * n, np.float32),
              "res": r32(g, m, n), "sum": np.zeros(m * n, np.float32), "y": np.zeros(m * n, np.float32)}
    weights = {"wg": (encode(r32(g, f, k) * 0.3, glu.format), glu.format),
               "wu": (encode(r32(g, f, k) * 0.3, glu.format), glu.format),
               "wd": (encode(r32(g, n, f) * 0.3, down.format), down.format),
               "nw": (r32(g, n), "f32"), "pw": (r32(g, n), "f32"), "bg": (r32(g, f), "f32"), "bd": (r32(g, n), "f32")}
    if len(c.phases) == 3:  # the o phase writes x and the residual `res` the down phase adds (NaN before: read late)
        og = c.phases[0].first
        arrays.update(z=r32(g, m, og.k), op=np.zeros(m * k, np.float32), res0=r32(g, m, k),
                      x=np.full(m * k, np.nan, np.float32), res=np.full(m * k, np.nan, np.float32))
        weights.update(wo=(encode(r32(g, k, og.k) * 0.3, og.format), og.format), nw0=(r32(g, k), "f32"),
                       bo=(r32(g, k), "f32"))
    dev = gpu.both(c, arrays, weights, tol=tol)
    counters_zero(c, dev)
    return dev


# (fmt, k, f, n): dense rows at k and f that are no whole 16-byte words (gemv_tile_any) and at whole words
# (gemv_tile16); q8_0 / q4_0 read in place (k, f whole blocks of 32 but not of 256) and staged (whole 256s); q4_k
# staged (256s); q6_k in place (k a multiple of 256 only) and staged (2048). n and f never a multiple of the 16
# outputs a block of four outputs a warp takes.
CASES = [("f32", 130, 37, 45), ("f16", 130, 37, 45), ("bf16", 130, 37, 45), ("bf16", 256, 264, 45),
         ("f32", 256, 72, 45), ("q8_0", 288, 96, 45), ("q8_0", 512, 256, 45), ("q4_0", 288, 96, 45),
         ("q4_0", 512, 256, 45), ("q4_k", 512, 256, 45), ("q6_k", 256, 256, 45)]


@pytest.mark.parametrize("fmt,k,f,n", CASES)
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("per_warp", [1, 4])
def test_glu_down_chain_matches_its_phases_twins(fmt, k, f, n, m, per_warp):
    c = chain(fmt, m, k, f, n, per_warp)
    assert c.check() is None, c.check()
    dev = run(c, seed=k + f + m)
    again_same(c, dev, ["h", "o", "sum", "y"])


def test_q6_k_staged_and_a_down_in_another_format():
    """q6_k rows staged (k and f multiples of 2048) at two rows; then the GLU in q4_k and the down product in q6_k (a
    Q4_K_M file's mix: the kernel takes each phase's format)."""
    dev = run(chain("q6_k", 2, 2048, 2048, 21, 4), seed=5)
    c = chain("q4_k", 1, 256, 512, 33, 4, fmt_down="q6_k")
    again_same(c, run(c, seed=6), ["h", "o", "sum", "y"])
    assert dev is not None


def test_biases_and_a_sandwich_norm():
    c = chain("bf16", 2, 130, 37, 45, 1, pre=True, bias=True)
    again_same(c, run(c, seed=9), ["h", "o", "sum", "y"])


def test_a_second_launch_runs_the_norm_again():
    """The counters were left zero: a second launch in order takes tickets from 0 again and its last block norms."""
    c = chain("bf16", 1, 256, 72, 45, 4)
    dev = run(c)
    y = dev.host("y").copy()
    dev.array("y")[...] = 0
    c.cuda(dev)
    np.testing.assert_array_equal(dev.host("y"), y)
    counters_zero(c, dev)


@pytest.mark.parametrize("fmt,k,f,n,m", [("bf16", 256, 264, 45, 3), ("f32", 130, 37, 45, 8), ("f16", 256, 72, 45, 5)])
def test_a_slab_of_rows_chains_at_four_outputs_a_warp(fmt, k, f, n, m):
    """3..8 rows (a batch's sequences, a chunk's rows) of f32/f16/bf16 rows: every product phase on chain.cu's slab
    (gemv_slab_cp's ring at four outputs a warp; k = 130 no whole 16-byte words: the slab's tile_any), the two- and the
    three-phase chain against their phases' twins, the same bits in reverse block order."""
    c = chain(fmt, m, k, f, n, 4)
    assert c.check() is None, c.check()
    again_same(c, run(c, seed=k + m), ["h", "o", "sum", "y"])
    c = o_chain(fmt, m, 2 * k - 6, k, f, 4)
    assert c.check() is None, c.check()
    again_same(c, run(c, seed=f + m), ["x", "res", "h", "o", "sum", "y"])


@pytest.mark.parametrize("why,c", [
    ("quantized", GemvGlu("x", "wg", "wu", "q8_0", "h", 256, 64, 1, words=1)),
    ("9 rows over bf16", GemvGlu("x", "wg", "wu", "bf16", "h", 256, 64, 9)),
    ("3 rows over q8_0", GemvGlu("x", "wg", "wu", "q8_0", "h", 256, 64, 3)),
])
def test_what_the_chain_refuses_in_one_line(why, c):
    m = c.m
    ch = Chain((c, Fold(Gemv("h", "wd", c.format, Dst("o"), 64, 32, m), Norm("res", "nw", "y", m, 32, 1e-6, add="o",
                                                                              sum="sum"))))
    r = ch.check()
    assert r is not None and "\n" not in str(r)
    assert why in str(r)


def test_a_down_product_of_another_tensor_is_refused():
    c = chain("bf16", 1, 256, 64, 32, 1)
    c = Chain((c.glu, Fold(Gemv("z", "wd", "bf16", Dst("o"), 64, 32, 1), c.down.then)))
    assert "not the GLU `h`" in str(c.check())


# -- what the ticket does: each a mutated chain.cu --------------------------------------------------------------------

def _mutated(monkeypatch, *pairs):
    from lanefuse.kernels import compile as kc

    text = kc.cu_text("chain")
    for old, new in pairs:
        assert old in text, f"chain.cu no longer holds {old!r}: update the mutation"
        text = text.replace(old, new)
    real = kc.cu_text
    monkeypatch.setattr(kc, "cu_text", lambda stem: text if stem == "chain" else real(stem))


BY_BLOCK = ("const unsigned t = ticket;", "const unsigned t = blockIdx.x;")
NO_WAIT = ("chain_wait(counters + 1, (unsigned)g1);", "")
O_NO_WAIT = ("chain_wait(counters + 1, (unsigned)g0 + 1u);", "")
NO_WAIT_DOWN = ("chain_wait(counters + 1, (unsigned)(g0 + 1 + g1));", "")
O_TAIL_FIRST = ("if (prior != (unsigned)g0 - 1u) return;", "if (prior != 0u) return;")


def _reverse(monkeypatch, c, runner=None):
    """The chain's first launch with its blocks in the reverse order (threads shuffled)."""
    from lanefuse.kernels import cupy_env

    real = cupy_env.DeviceEnv.__init__

    def init(self, *a, **kw):
        real(self, *a, **kw)
        self.flags, self.seed = 1, 7

    monkeypatch.setattr(cupy_env.DeviceEnv, "__init__", init)
    return (runner or run)(c)


@pytest.mark.forked
def test_phases_by_block_index_trap_in_the_bounded_wait(monkeypatch):
    """Blocks in reverse order, phase by blockIdx: the first block to run is a down block whose GLU blocks have not
    run; its wait is never met (on a device with too few resident blocks, a hang): the emulator's bound traps."""
    _mutated(monkeypatch, BY_BLOCK)
    with pytest.raises(RuntimeError, match="trap"):
        _reverse(monkeypatch, chain("bf16", 1, 256, 72, 45, 4))


@pytest.mark.forked
def test_phases_by_block_index_without_the_wait_read_a_glu_not_yet_written(monkeypatch):
    _mutated(monkeypatch, BY_BLOCK, NO_WAIT)
    with pytest.raises(AssertionError):
        _reverse(monkeypatch, chain("bf16", 1, 256, 72, 45, 4))


def test_by_ticket_in_reverse_block_order_is_right(monkeypatch):
    """The real kernel, the same reverse order as the mutations: tickets, not block indices, order the phases."""
    _reverse(monkeypatch, chain("bf16", 1, 256, 72, 45, 4))


# -- three phases: the o fold, the GLU, the down fold (fold_o_glu_down) ---------------------------------------------

# (fmt, ko, k, f): the o product's k (the attention's width), the hidden size k (the o and down products' outputs,
# the GLU's k) and the FFN width f, as CASES: dense rows not whole words and whole; the block formats in place and
# staged.
O_CASES = [("f32", 70, 130, 37), ("bf16", 70, 130, 37), ("f16", 256, 256, 72), ("bf16", 256, 256, 264),
           ("q8_0", 288, 288, 96), ("q4_0", 512, 512, 256), ("q4_k", 512, 512, 256), ("q6_k", 256, 256, 256)]


@pytest.mark.parametrize("fmt,ko,k,f", O_CASES)
@pytest.mark.parametrize("m,per_warp", [(1, 4), (2, 1), (2, 4)])
def test_o_glu_down_chain_matches_its_phases_twins(fmt, ko, k, f, m, per_warp):
    c = o_chain(fmt, m, ko, k, f, per_warp)
    assert c.check() is None, c.check()
    assert c.grid_block()[0][0] == sum(c.blocks_of()) and len(c.blocks_of()) == 3
    dev = run(c, seed=ko + f + m)
    again_same(c, dev, ["op", "res", "x", "h", "o", "sum", "y"])


def test_o_chain_biases_and_an_o_in_another_format():
    c = o_chain("q4_k", 1, 256, 256, 512, 4, fmt_o="q6_k", bias=True)
    again_same(c, run(c, seed=12), ["op", "res", "x", "h", "o", "sum", "y"])


def test_o_chain_a_second_launch_runs_both_norms_again():
    c = o_chain("bf16", 1, 70, 130, 37, 4)
    dev = run(c)
    x, y = dev.host("x").copy(), dev.host("y").copy()
    dev.array("x")[...] = np.nan
    dev.array("y")[...] = 0
    c.cuda(dev)
    np.testing.assert_array_equal(dev.host("x"), x)
    np.testing.assert_array_equal(dev.host("y"), y)
    counters_zero(c, dev)


def test_o_chain_by_ticket_in_reverse_block_order_is_right(monkeypatch):
    _reverse(monkeypatch, o_chain("bf16", 1, 70, 130, 37, 4))


@pytest.mark.forked
def test_o_chain_phases_by_block_index_trap_in_the_bounded_wait(monkeypatch):
    _mutated(monkeypatch, BY_BLOCK)
    with pytest.raises(RuntimeError, match="trap"):
        _reverse(monkeypatch, o_chain("bf16", 1, 70, 130, 37, 4))


@pytest.mark.forked
def test_o_chain_a_glu_reading_before_the_o_tail_fails(monkeypatch):
    """Phases by blockIdx in reverse order and no GLU wait: the GLU blocks run before the o phase and its norm tail,
    so they read an x not yet written (NaN) and the values are wrong."""
    _mutated(monkeypatch, BY_BLOCK, O_NO_WAIT, NO_WAIT_DOWN)
    with pytest.raises(AssertionError):
        _reverse(monkeypatch, o_chain("bf16", 1, 70, 130, 37, 4))


@pytest.mark.forked
def test_o_chain_a_tail_by_the_first_o_block_to_arrive_fails(monkeypatch):
    """The o tail run by the first o block to arrive, not the last: it norms a product not yet whole, and the GLU
    reads that norm."""
    _mutated(monkeypatch, O_TAIL_FIRST)
    with pytest.raises(AssertionError):
        run(o_chain("bf16", 1, 70, 130, 37, 4))


def test_what_the_three_phase_chain_refuses_in_one_line():
    c = o_chain("bf16", 1, 70, 130, 37, 4)
    o, glu, down = c.phases
    bad = Chain((replace(o, then=replace(o.then, out="other")), glu, down))
    assert "not the o product's norm `other`" in str(bad.check())
    r = Chain((o, down, glu)).check()
    assert "no chained kernel runs a fold then a fold then a gemv_glu" in str(r) and "\n" not in str(r)
    r = Chain((replace(o, first=replace(o.first, split=2)), glu, down)).check()
    assert r is not None and "\n" not in str(r)
