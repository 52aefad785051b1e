"""chain.cu's fold_attn_o_glu_down with its q/k/v phase (qkv_attn_o_glu_down_norm: a decode layer from its q/k/v
products to its next norm as ONE ticket-ordered launch of five phases) on the CPU through the host emulator
(tests/cuda_host), against the numpy twin (the q/k/v fold's twin, then the attention's, the o fold's, the GLU's and
the down fold's, in order): bf16 and a block format, one and two rows, GQA groups, positions that are no multiple of a
split, q/k head norms (Qwen3) and none (Llama), biases (Qwen2), the value and the rotated key written straight into
their cache rows, every counter (the chain's, the attention's merge, the q/k/v heads') back at zero after a launch, a
relaunch in reverse block order with shuffled threads giving the same bits. The emulator runs blocks one after
another, in ticket order unless reversed. Mutation: blocks by blockIdx in reverse order with the attention's wait for
the q/k/v phase gone read q and the caches' new rows before they are written (the values are wrong)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import test_kernels_gpu as gpu
from cuda_host import emu
from lanefuse.kernels import Attention, Chain, Fold
from lanefuse.kernels.common import encode
from test_chain_attn_emulated import BY_BLOCK, NO_DOWN_WAIT, NO_GLU_WAIT, NO_O_WAIT, _mutated, o_glu_down
from test_kernels_emulated import again_same, counters_zero

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="no g++ to build the emulated kernels")
r32 = gpu.r32
L = 67  # the caches' rows


@pytest.fixture(scope="module", autouse=True)
def emulated():
    with emu.emulating([Chain.stem]) as env:
        yield env


def qkv_chain(g, fmt, m, heads, kv, hd, k, f, per_warp, pos, splits=1, per_block=1, norm=True, bias=False, rot=None):
    """The five phases and their inputs: tests/test_kernels_gpu.py's q/k/v fold of x (q and k heads normed or not and
    rotated; the rotated key and the value into their cache rows at pos), the attention of the rotated q over the
    caches into z, the o product of z with its residual and norm into x1, the GLU of x1 into h, the down product with
    its residual and the next norm into y."""
    fold, arrays, weights = gpu._qkv(g, fmt, m, k, heads, kv, hd, rot or hd, norm, per_warp, bias, L, pos)
    att = Attention("qr", "kc", "vc", "pos", "z", heads, heads // kv, hd, hd, L, m, hd ** -0.5, per_block=per_block,
                    splits=splits)
    ko = heads * hd
    o, glu, down = o_glu_down(fmt, m, ko, k, f, per_warp, x="x1")
    nan = np.float32("nan")
    arrays.update({"q": np.full(m * ko, nan, np.float32), "qr": np.full(m * ko, nan, np.float32),
                   "z": np.full(m * ko, nan, np.float32), "op": np.zeros(m * k, np.float32), "res0": r32(g, m, k),
                   "x1": np.full(m * k, nan, np.float32), "res": np.full(m * k, nan, np.float32),
                   "h": np.zeros(m * f, np.float32), "o": np.zeros(m * k, np.float32),
                   "sum": np.zeros(m * k, np.float32), "y": np.zeros(m * k, np.float32)})
    weights.update({"wo": (encode(r32(g, k, ko) * 0.3, fmt), fmt), "nw0": (r32(g, k), "f32"),
                    "wg": (encode(r32(g, f, k) * 0.3, fmt), fmt), "wu": (encode(r32(g, f, k) * 0.3, fmt), fmt),
                    "wd": (encode(r32(g, k, f) * 0.3, fmt), fmt), "nw": (r32(g, k), "f32")})
    return Chain((fold, att, o, glu, down)), arrays, weights


OUTS = ["q", "qr", "kc", "vc", "z", "op", "res", "x1", "h", "o", "sum", "y"]


def run(c, arrays, weights, tol=3e-4):
    dev = gpu.both(c, arrays, weights, tol=tol)
    counters_zero(c, dev)
    return dev


# (fmt, heads, kv, hd, k, f): bf16 at Qwen3's head of 128 and at 64 beside a GQA group of 4; q8_0 rows (whole blocks)
CASES = [("bf16", 8, 2, 64, 256, 264), ("bf16", 4, 1, 128, 256, 96), ("q8_0", 4, 2, 64, 288, 96),
         ("f32", 6, 3, 32, 130, 37)]


@pytest.mark.parametrize("fmt,heads,kv,hd,k,f", CASES)
@pytest.mark.parametrize("m,pos,splits,per_block,per_warp,norm,bias", [
    (1, 37, 4, 2, 4, True, False), (2, 50, 3, 1, 1, True, False), (1, 0, 1, 2, 4, False, False),
    (2, 21, 2, 2, 4, False, True)])
def test_qkv_chain_matches_its_phases_twins(fmt, heads, kv, hd, k, f, m, pos, splits, per_block, per_warp, norm,
                                            bias):
    per_block = min(per_block, heads // kv)
    g = np.random.default_rng(k + f + m + pos)
    c, arrays, weights = qkv_chain(g, fmt, m, heads, kv, hd, k, f, per_warp, pos, splits=splits, per_block=per_block,
                                   norm=norm, bias=bias)
    assert c.check() is None, c.check()
    gq = c.blocks_of()[0]
    assert gq == sum(-(-n // (4 * per_warp)) for n in (heads * hd, kv * hd, kv * hd)) and len(c.blocks_of()) == 5
    assert c.grid_block()[0][0] == sum(c.blocks_of())
    dev = run(c, arrays, weights)
    assert [n for n, *_ in dev.calls] == ["fold_attn_o_glu_down_" + str(per_warp)]
    again_same(c, dev, OUTS)


def test_partial_rotation_and_a_second_launch():
    """A rotation of half of each head (rot < hd); a second launch on results set to NaN (the cache rows it writes
    too): every counter was left zero, so the tickets start from 0, each head's epilogue and the merge run again and
    give the same bits."""
    g = np.random.default_rng(5)
    c, arrays, weights = qkv_chain(g, "bf16", 1, 8, 2, 64, 256, 72, 4, 40, splits=3, per_block=2, rot=32)
    dev = run(c, arrays, weights)
    want = {n: dev.host(n).copy() for n in ("qr", "kc", "vc", "z", "x1", "y")}
    for n in ("qr", "z", "x1"):
        dev.array(n)[...] = np.nan
    dev.array("y")[...] = 0
    c.cuda(dev)
    for n, v in want.items():
        np.testing.assert_array_equal(dev.host(n), v, err_msg=n)
    counters_zero(c, dev)


def batch_of(b: int = 2, fmt: str = "bf16"):
    """The chain of a batch step's b rows, each a sequence at its own position (posp) in its own slot of the caches
    (L // b rows), and its inputs (tests/test_kernels_gpu.py runs it on a device too); past two rows every product
    phase runs chain.cu's slab (gemv_slab_cp's ring, four outputs a warp)."""
    slot = L // b
    g = np.random.default_rng(21)
    c, arrays, weights = qkv_chain(g, fmt, b, 8, 2, 32, 256, 72, 4, 0, splits=3, per_block=4)
    fold, att, *rest = c.phases
    nk = 2 * 32
    parts = tuple(replace(p, y=replace(p.y, slot=slot)) if p.y.row is not None else p for p in fold.first.parts)
    sides = tuple(replace(s, y=replace(s.y, slot=slot)) if s.y.row is not None else s for s in fold.then.sides)
    fold = Fold(replace(fold.first, parts=parts), replace(fold.then, sides=sides, slot=slot))
    c = Chain((fold, replace(att, slot=slot, len=slot), *rest))
    assert c.check() is None, c.check()
    arrays["pos"] = np.array([13, 29] if b == 2 else g.integers(0, slot - 1, b), np.int32)
    arrays["kc"], arrays["vc"] = r32(g, L, nk), r32(g, L, nk)
    return c, arrays, weights


@pytest.mark.parametrize("b,fmt", [(2, "bf16"), (5, "bf16"), (8, "f32"), (3, "f16")])
def test_a_batch_of_sequences_each_in_its_slot(b, fmt):
    """The q/k/v phase rotates each row at its position and writes its key and value rows into its slot, as the
    fold's launch does; the attention reads each slot; past two rows the products run the slab."""
    c, arrays, weights = batch_of(b, fmt)
    dev = run(c, arrays, weights)
    again_same(c, dev, OUTS)


@pytest.mark.parametrize("fmt,m,pos", [("bf16", 5, 37), ("f32", 8, 0), ("f16", 3, 50)])
def test_a_chunk_of_rows_on_the_slab(fmt, m, pos):
    """A prompt's chunk of 3..8 rows at pos, pos + 1, ... (one sequence, slot 0: each row's keys up to its own), every
    product phase on chain.cu's slab at four outputs a warp: its phases' twins, then the same bits in reverse block
    order."""
    g = np.random.default_rng(m + pos)
    c, arrays, weights = qkv_chain(g, fmt, m, 4, 2, 64, 256, 96, 4, pos, splits=2, per_block=2)
    assert c.check() is None, c.check()
    dev = run(c, arrays, weights)
    assert [n for n, *_ in dev.calls] == ["fold_attn_o_glu_down_slab"]
    again_same(c, dev, OUTS)


def test_what_the_qkv_chain_refuses_in_one_line():
    g = np.random.default_rng(1)
    c, _, _ = qkv_chain(g, "bf16", 1, 8, 2, 32, 256, 72, 4, 9, splits=3, per_block=4)
    fold, att, o, glu, down = c.phases
    gp, rp = fold.first, fold.then
    cases = [
        (Chain((replace(fold, first=replace(gp, words=1)), att, o, glu, down)), "quantized activation"),
        (Chain((fold, replace(att, pos="pos2"), o, glu, down)), "one position"),
        (Chain((fold, replace(att, q="other"), o, glu, down)), "does not write"),
        (Chain((replace(fold, then=replace(rp, rows=2)), att, o, glu, down)), "rotation of 2 rows"),
    ]
    for ch, words in cases:
        r = ch.check()
        assert r is not None and words in str(r) and "\n" not in str(r), (words, r)
    assert "no chained kernel runs a fold then a fold" in str(Chain((fold, o, glu, down)).check())


# -- what the attention's wait for the q/k/v phase does: a mutated chain.cu ----------------------------------------

NO_QKV_WAIT = ("chain_wait(counters + 1, (unsigned)gq);", "")


def _reverse(monkeypatch, go):
    """go() with the chain's launches' blocks in the reverse order (threads shuffled)."""
    from lanefuse.kernels import cupy_env

    real = cupy_env.DeviceEnv.__init__

    def init(self, *a, **kw):
        real(self, *a, **kw)
        self.flags, self.seed = 1, 7

    monkeypatch.setattr(cupy_env.DeviceEnv, "__init__", init)
    return go()


def _case():
    g = np.random.default_rng(7)
    return qkv_chain(g, "bf16", 1, 8, 2, 32, 256, 72, 4, 40, splits=3, per_block=4)


def test_by_ticket_in_reverse_block_order_is_right(monkeypatch):
    c, arrays, weights = _case()
    _reverse(monkeypatch, lambda: run(c, arrays, weights))


@pytest.mark.forked
def test_attention_without_the_wait_reads_q_not_yet_written(monkeypatch):
    """Phases by blockIdx in reverse order, the o blocks' wait and the attention's wait gone: the attention blocks
    run before the q/k/v blocks, so they read q not yet rotated (NaN) and this position's key and value rows not yet
    written, and the values are wrong."""
    _mutated(monkeypatch, BY_BLOCK, NO_QKV_WAIT, NO_O_WAIT, NO_GLU_WAIT, NO_DOWN_WAIT)
    c, arrays, weights = _case()
    with pytest.raises(AssertionError):
        _reverse(monkeypatch, lambda: run(c, arrays, weights))


# -- the lane's plan: a decode step run by the device runner on the host emulator ---------------------------------

@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_a_planned_decode_step_on_the_emulator_gives_the_numpy_backends_tokens(arch, monkeypatch):
    """tests/test_lane.py's tiny Qwen3 (q/k head norms), Llama (none, llama3 rope scaling) and Qwen2 (q/k/v biases)
    planned as the lane plans a decode step (one five-phase chain a layer: qkv_attn_o_glu_down_norm), three steps
    run by the device runner with every launch the real .cu on the host emulator, the caches carried between them:
    the numpy backend's logits (within the kernels' summation order) and tokens, and the plan held back
    (`--hold qkv_attn_o_glu_down_norm`: the q/k/v fold and the four-phase chain) gives the same."""
    import sys

    from test_issue40_views import _Stream
    from test_lane import ARCHS, _weights

    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run import cupy_runner
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    cfg = ARCHS[arch]
    w = _weights(cfg)
    g = build_step(cfg, 1)
    on, off = plan(g), plan(g, held=["qkv_attn_o_glu_down_norm"])
    chained = on.fusions.get("qkv_attn_o_glu_down_norm", 0)  # (tiny-qwen3's layer 0: gate f32, up bf16: no chain)
    assert chained >= 1 and on.n_launches == off.n_launches - chained
    stems = sorted({x.launch.stem for p in (on, off) for x in p.launches if x.launch.kernels()})
    for p in (on, off):
        want_r = NumpyRunner(p, w, exact=True)
        tables = {n: np.zeros(g.shape(n), np.float32) for n in p.io.tables}  # each runner's caches, carried
        mine = {n: t.copy() for n, t in tables.items()}
        with emu.emulating(stems) as device_env:
            monkeypatch.setattr(cupy_runner, "DeviceEnv", device_env)
            monkeypatch.setattr(sys.modules["cupy"].cuda, "Stream", _Stream, raising=False)
            r = cupy_runner.CupyRunner(p, w, cupy_runner.DeviceState(), graph=False)
            for pos, tok in enumerate((3, 17, 5)):
                env = {"token": np.array([tok], np.int32), "pos": np.array([pos], np.int32)}
                want, got = want_r.step({**env, **tables}), r.step({**env, **mine})
                scale = float(np.abs(want["logits"]).max())
                assert np.abs(got["logits"] - want["logits"]).max() <= 2e-5 * scale, (arch, pos)
                assert np.array_equal(got["next"], want["next"]), (arch, pos)
