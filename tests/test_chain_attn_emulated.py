"""chain.cu's fold_attn_o_glu_down (a decode layer's attention, o product with its residual and post-attention norm,
gate/up GLU and down product with its residual and next norm as ONE ticket-ordered launch of four phases) on the CPU
through the host emulator (tests/cuda_host), against the numpy twin (the attention's twin, then the o fold's, the
GLU's and the down fold's, in order): every format the product phases serve, one and two rows, positions that are no
multiple of a split (and splits past the keys), GQA groups, sinks, a window, a soft cap, the arrival counters (the
chain's and the attention's merge) back at zero after every launch, a relaunch in reverse block order with shuffled
threads giving the same bits. The emulator runs blocks one after another, so a wait not met at once is never met:
chain.cu's poll is bounded there and traps. Two mutations show what the ticket and the wait do: phases by blockIdx in
reverse order trap in the o blocks' wait; with the waits gone too, the o blocks read an attention output not yet
written (NaN) and the values are wrong."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import test_kernels_gpu as gpu
from cuda_host import emu
from lanefuse.kernels import Attention, Chain, Dst, Fold, Gemv, GemvGlu, Norm
from lanefuse.kernels.common import encode
from test_kernels_emulated import again_same, counters_zero

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="no g++ to build the emulated kernels")
r32 = gpu.r32
L = 67  # the caches' rows


@pytest.fixture(scope="module", autouse=True)
def emulated():
    with emu.emulating([Chain.stem]) as env:
        yield env


def attn_chain(fmt, m, heads, kv, hd, k, f, per_warp, splits=1, per_block=1, window=0, sinks=False, cap=0.0):
    """The four phases: the attention of q over the caches (heads of hd values, kv key/value heads) into z, the o
    product of z into `op`, its residual `res0` added (the sum `res`) and normed into `x`; then the GLU of x into h and
    the down product, its residual `res` and the next norm into y."""
    att = Attention("q", "kc", "vc", "pos", "z", heads, heads // kv, hd, hd, L, m, hd ** -0.5, window=window,
                    sinks="sk" if sinks else None, per_block=per_block, splits=splits, softcap=cap)
    return Chain((att, *o_glu_down(fmt, m, heads * hd, k, f, per_warp)))


def o_glu_down(fmt, m, ko, k, f, per_warp, x="x"):
    """The chain's last three phases after its attention into z (ko values a row): the o product of z into `op`, its
    residual `res0` added (the sum `res`) and normed into `x`; the GLU of x into h; the down product, its residual
    `res` and the next norm into y."""
    o = Fold(Gemv("z", "wo", fmt, Dst("op"), ko, k, m, per_warp=per_warp),
             Norm("res0", "nw0", x, m, k, 1e-5, add="op", sum="res"))
    glu = GemvGlu(x, "wg", "wu", fmt, "h", k, f, m, per_warp=per_warp)
    down = Fold(Gemv("h", "wd", fmt, Dst("o"), f, k, m, per_warp=per_warp),
                Norm("res", "nw", "y", m, k, 1e-6, add="o", sum="sum"))
    return o, glu, down


OUTS = ["z", "op", "res", "x", "h", "o", "sum", "y"]


def run(c, pos, seed=3, tol=3e-4):
    g = np.random.default_rng(seed)
    att, o, glu, down = c.phases
    m, k, f, ko = glu.m, glu.k, glu.n, o.first.k
    kv = att.heads // att.group
    nan = np.float32("nan")
    arrays = {"q": 2 * r32(g, m, att.heads * att.hd), "kc": r32(g, L, kv * att.hd), "vc": r32(g, L, kv * att.vd),
              "pos": np.array([pos], np.int32), "z": np.full(m * ko, nan, np.float32),
              "op": np.zeros(m * k, np.float32), "res0": r32(g, m, k), "x": np.full(m * k, nan, np.float32),
              "res": np.full(m * k, nan, np.float32), "h": np.zeros(m * f, np.float32),
              "o": np.zeros(m * k, np.float32), "sum": np.zeros(m * k, np.float32), "y": np.zeros(m * k, np.float32)}
    fmt = glu.format
    weights = {"wo": (encode(r32(g, k, ko) * 0.3, fmt), fmt), "nw0": (r32(g, k), "f32"),
               "wg": (encode(r32(g, f, k) * 0.3, fmt), fmt), "wu": (encode(r32(g, f, k) * 0.3, fmt), fmt),
               "wd": (encode(r32(g, k, f) * 0.3, fmt), fmt), "nw": (r32(g, k), "f32"), "sk": (r32(g, att.heads), "f32")}
    dev = gpu.both(c, arrays, weights, tol=tol)
    counters_zero(c, dev)
    return dev


# (fmt, heads, kv, hd, k, f): the o product's k = heads x hd; dense at widths that are no whole 16-byte words of the
# products (72 = 6 x 12) and whole; the block formats at k = 256 (q8_0 / q4_0 in place, q4_k / q6_k at 256s)
CASES = [("f32", 6, 2, 12, 130, 37), ("bf16", 6, 3, 12, 130, 37), ("f16", 4, 2, 64, 256, 72),
         ("bf16", 8, 2, 32, 256, 264), ("q8_0", 4, 2, 64, 288, 96), ("q4_0", 4, 1, 64, 256, 96),
         ("q4_k", 4, 2, 64, 256, 256), ("q6_k", 2, 2, 128, 256, 256)]


@pytest.mark.parametrize("fmt,heads,kv,hd,k,f", CASES)
@pytest.mark.parametrize("m,pos,splits,per_block,per_warp", [(1, 37, 4, 2, 4), (2, 50, 3, 1, 1), (1, 0, 1, 2, 4)])
def test_attn_chain_matches_its_phases_twins(fmt, heads, kv, hd, k, f, m, pos, splits, per_block, per_warp):
    per_block = min(per_block, heads // kv)
    c = attn_chain(fmt, m, heads, kv, hd, k, f, per_warp, splits=splits, per_block=per_block)
    assert c.check() is None, c.check()
    assert c.blocks_of()[0] == heads // per_block * m * splits and len(c.blocks_of()) == 4
    assert c.grid_block()[0][0] == sum(c.blocks_of())
    dev = run(c, pos, seed=k + f + m + pos)
    assert [n for n, *_ in dev.calls] == ["fold_attn_o_glu_down_" + str(per_warp)]
    again_same(c, dev, OUTS)


def test_attn_chain_sinks_window_cap_and_more_splits_than_keys():
    """gpt-oss's sinks, a window, Gemma's soft cap; 16 splits over 9 keys (splits past every key: weight 0)."""
    c = attn_chain("bf16", 2, 8, 2, 32, 256, 72, 4, splits=16, per_block=4, window=20, sinks=True, cap=30.0)
    again_same(c, run(c, 8, seed=11), OUTS)
    c = attn_chain("bf16", 1, 8, 2, 32, 256, 72, 4, splits=5, per_block=4, window=20, sinks=True, cap=30.0)
    again_same(c, run(c, 61, seed=12), OUTS)


def test_attn_chain_a_second_launch_runs_again():
    """The counters were left zero (the tickets, the arrivals, the attention's merge counters): a second launch takes
    tickets from 0 again, its attention merges and both norms run."""
    c = attn_chain("bf16", 1, 8, 2, 32, 256, 72, 4, splits=3, per_block=4)
    dev = run(c, 40)
    want = {n: dev.host(n).copy() for n in ("z", "x", "y")}
    for n in ("z", "x"):
        dev.array(n)[...] = np.nan
    dev.array("y")[...] = 0
    c.cuda(dev)
    for n, v in want.items():
        np.testing.assert_array_equal(dev.host(n), v, err_msg=n)
    counters_zero(c, dev)


def test_what_the_attention_chain_refuses_in_one_line():
    c = attn_chain("bf16", 1, 8, 2, 32, 256, 72, 4, splits=3, per_block=4)
    att, o, glu, down = c.phases
    cases = [
        (replace(att, hd=256, vd=256), "heads of 256 values"),
        (replace(att, gate=("g", "sigmoid")), "gated"),
        (replace(att, quant="zq", words=1), "quantiz"),
        (replace(att, out="other"), "not the attention's output `other`"),
        (replace(att, seq0=1), "sequences from one past the first"),
    ]
    for a, words in cases:
        r = Chain((a, o, glu, down)).check()
        assert r is not None and words in str(r) and "\n" not in str(r), (words, r)
    r = Chain((att, glu, o, down)).check()
    assert "no chained kernel runs a attention then a gemv_glu" in str(r)
    r = Chain((replace(att, rows=2), o, glu, down)).check()
    assert r is not None and "\n" not in str(r)


# -- what the ticket and the wait do: each a mutated chain.cu -------------------------------------------------------

def _mutated(monkeypatch, *pairs, stem="chain"):
    from lanefuse.kernels import compile as kc

    text = kc.cu_text(stem)
    for old, new in pairs:
        assert text.count(old) == 1, f"{stem}.cu holds {old!r} {text.count(old)} times: update the mutation"
        text = text.replace(old, new)
    real = kc.cu_text
    monkeypatch.setattr(kc, "cu_text", lambda s: text if s == stem else real(s))


BY_BLOCK = ("const unsigned t = ticket;\n    if (t < (unsigned)gq) {",
            "const unsigned t = blockIdx.x;\n    if (t < (unsigned)gq) {")
NO_O_WAIT = ("chain_wait(counters + 1, (unsigned)ea);", "")
NO_GLU_WAIT = ("chain_wait(counters + 1, (unsigned)eo + 1u);", "")
NO_DOWN_WAIT = ("chain_wait(counters + 1, (unsigned)eg + 1u);", "")


def _reverse(monkeypatch, c, pos):
    """The chain's first launch with its blocks in the reverse order (threads shuffled)."""
    from lanefuse.kernels import cupy_env

    real = cupy_env.DeviceEnv.__init__

    def init(self, *a, **kw):
        real(self, *a, **kw)
        self.flags, self.seed = 1, 7

    monkeypatch.setattr(cupy_env.DeviceEnv, "__init__", init)
    return run(c, pos)


def test_by_ticket_in_reverse_block_order_is_right(monkeypatch):
    _reverse(monkeypatch, attn_chain("bf16", 1, 8, 2, 32, 256, 72, 4, splits=3, per_block=4), 40)


@pytest.mark.forked
def test_phases_by_block_index_trap_in_the_bounded_wait(monkeypatch):
    """Blocks in reverse order, phase by blockIdx: the first block to run is a down block whose phases before have
    not run; its wait is never met (on a device with too few resident blocks, a hang): the emulator's bound traps."""
    _mutated(monkeypatch, BY_BLOCK)
    with pytest.raises(RuntimeError, match="trap"):
        _reverse(monkeypatch, attn_chain("bf16", 1, 8, 2, 32, 256, 72, 4, splits=3, per_block=4), 40)


@pytest.mark.forked
def test_o_blocks_without_the_wait_read_an_attention_not_yet_written(monkeypatch):
    """Phases by blockIdx in reverse order and no waits: the o blocks run before the attention's blocks and merges,
    so they read z not yet written (NaN) and the values are wrong."""
    _mutated(monkeypatch, BY_BLOCK, NO_O_WAIT, NO_GLU_WAIT, NO_DOWN_WAIT)
    with pytest.raises(AssertionError):
        _reverse(monkeypatch, attn_chain("bf16", 1, 8, 2, 32, 256, 72, 4, splits=3, per_block=4), 40)


def test_a_batch_of_two_sequences_each_in_its_slot():
    """A batch step's two rows, each a sequence of its own at its own position over its own slot of the caches (the
    attention's `slot`: its rows from r x slot): the chain's attention phase takes the slots as the attention's own
    launch does."""
    slot = L // 2
    c = attn_chain("bf16", 2, 8, 2, 32, 256, 72, 4, splits=3, per_block=4)
    att = replace(c.phases[0], slot=slot, len=slot)
    c = Chain((att, *c.phases[1:]))
    assert c.check() is None, c.check()
    g = np.random.default_rng(21)
    o, glu = c.phases[1], c.glu
    m, k, f, ko = 2, glu.k, glu.n, o.first.k
    nan = np.float32("nan")
    arrays = {"q": 2 * r32(g, m, att.heads * att.hd), "kc": r32(g, 2 * slot, 2 * att.hd),
              "vc": r32(g, 2 * slot, 2 * att.vd), "pos": np.array([29, 17], np.int32),
              "z": np.full(m * ko, nan, np.float32), "op": np.zeros(m * k, np.float32), "res0": r32(g, m, k),
              "x": np.full(m * k, nan, np.float32), "res": np.full(m * k, nan, np.float32),
              "h": np.zeros(m * f, np.float32), "o": np.zeros(m * k, np.float32), "sum": np.zeros(m * k, np.float32),
              "y": np.zeros(m * k, np.float32)}
    weights = {"wo": (encode(r32(g, k, ko) * 0.3, "bf16"), "bf16"), "nw0": (r32(g, k), "f32"),
               "wg": (encode(r32(g, f, k) * 0.3, "bf16"), "bf16"), "wu": (encode(r32(g, f, k) * 0.3, "bf16"), "bf16"),
               "wd": (encode(r32(g, k, f) * 0.3, "bf16"), "bf16"), "nw": (r32(g, k), "f32")}
    dev = gpu.both(c, arrays, weights, tol=3e-4)
    again_same(c, dev, OUTS)


# -- the merge's staged batches (attention.cu attention_merge<STAGE>: the chain hands it its staging buffer) ---------

def staged_case(heads, kv, hd, per_block, splits, pos):
    """A case of test_kernels_gpu.py's STAGED: its chain, run (every array against the twins'); sinks at position 23."""
    c = attn_chain("bf16", 1, heads, kv, hd, 64, 40, 4, splits=splits, per_block=per_block, sinks=pos == 23)
    assert c.check() is None, c.check()
    return c, run(c, pos, seed=hd + splits)


@pytest.mark.parametrize("case", gpu.STAGED)
def test_the_merge_stages_its_values_in_batches(case):
    again_same(*staged_case(*case), OUTS)


@pytest.mark.forked
@pytest.mark.parametrize("old,new", [
    ("                        tc_wait_all();\n", ""),  # a batch read before its copies land
    ("merge_issue(wb, pp, st, vd, z0 + zb, n,", "merge_issue(wb, pp, st, vd, z0, n,"),  # every batch the first's values
])
def test_a_mutated_staged_merge_is_caught(monkeypatch, old, new):
    _mutated(monkeypatch, (old, new), stem="attention")
    with pytest.raises(AssertionError):
        run(attn_chain("bf16", 1, 8, 2, 128, 64, 40, 4, splits=40, per_block=4), 60, seed=168)
