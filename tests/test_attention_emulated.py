"""attention.cu run on the CPU: the real kernels (attention_split and its wide and narrow forms, the last split block
of a row's heads to arrive merging their splits) built by g++ against the host emulator of CUDA (tests/cuda_host),
each Attention launch's own `cuda()` run unmodified through the stand-in cupy, against the numpy twin — the cases
and tolerances of the GPU tests' attention tests (test_kernels_gpu's test_attention and test_split_attention through
its `both`, test_gemma_gpu's soft cap, test_gdn_kernels' gate, test_quant_gpu's quantizing epilogues, test_placement's
parts of one row, test_batch's batch) at sizes emulation affords: position 0, positions not a multiple of anything,
windows, sinks, soft caps, GQA groups, one to 257 splits (more splits than keys), heads of 6 to 640 values, keys and
values as parts of one wider row at odd offsets (no 16-byte alignment), a latent attention's split heads, a batch's
slots. Then each launch again, its blocks in the reverse order and each block's threads shuffled between barriers
(another block arrives last): the same results to the bit, the arrival counters left zero. Skipped without g++."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lanefuse.engine import flags

import test_kernels_gpu as gpu
from cuda_host import emu
from test_kernels_emulated import again_same
from lanefuse.kernels import MAX_HEAD, Attention, HostEnv

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="no g++ to build the emulated kernels")

r32 = gpu.r32


@pytest.fixture(scope="module", autouse=True)
def emulated():
    """The stand-in cupy in sys.modules and DeviceEnv the emulating one for this module's tests."""
    with emu.emulating([Attention.stem]) as env:
        yield env


def kernels_run(dev) -> list[str]:
    return [c[0] for c in dev.calls]


# -- test_kernels_gpu::test_attention's shapes, a smaller cache ----------------------------------------------------

SHAPES = [(4, 2, 8, 8), (6, 1, 64, 6), (8, 2, 128, 128), (8, 2, MAX_HEAD, MAX_HEAD), (3, 3, 36, 50), (4, 1, 576, 512),
          (16, 2, 32, 32)]


@pytest.mark.parametrize("heads,kv,hd,vd", SHAPES)
@pytest.mark.parametrize("rows,pos", [(1, 0), (1, 150), (3, 37)])
@pytest.mark.parametrize("window,sinks,splits,per_block,cap", [
    (0, False, 1, 1, 0.0), (100, False, 1, 2, 0.0), (0, True, 4, 1, 0.0), (17, True, 3, 2, 5.0), (0, False, 16, 4, 0.0),
    (0, True, 64, 4, 0.0), (0, False, 33, 2, 30.0)])
def test_attention(heads, kv, hd, vd, rows, pos, window, sinks, splits, per_block, cap):
    if heads % per_block or (max(hd, vd) > MAX_HEAD and per_block > 1) or per_block > heads // kv * 2:
        pytest.skip("per_block does not divide the heads, or a wide head (one a block)")
    g = np.random.default_rng(heads * hd + pos + splits)
    L = 160 + 3
    arrays = {"q": 2 * r32(g, rows, heads * hd), "kc": r32(g, L, kv * hd), "vc": r32(g, L, kv * vd),
              "pos": np.array([pos], np.int32), "o": np.zeros(rows * heads * vd, np.float32)}
    a = Attention("q", "kc", "vc", "pos", "o", heads, heads // kv, hd, vd, L, rows, hd ** -0.5, window=window,
                  sinks="sk" if sinks else None, per_block=per_block, splits=splits, softcap=cap)
    dev = gpu.both(a, arrays, {"sk": (r32(g, heads), "f32")}, tol=2e-4)
    assert len(kernels_run(dev)) == 1  # split or not, one launch: the last split block to arrive merges
    again_same(a, dev, ["o"])


@pytest.mark.parametrize("heads,kv,hd,vd,pos", [(32, 8, 128, 128, 700), (8, 1, 64, 64, 1000), (4, 2, 256, 256, 300)])
def test_attention_long_tuned(heads, kv, hd, vd, pos):
    """A plan's own tuning (the lane's default knobs) at a cache of 1032 rows: positions far past one split."""
    from lanefuse.lane.lower.knobs import Knobs

    g = np.random.default_rng(pos)
    L = 1032
    arrays = {"q": r32(g, 1, heads * hd), "kc": r32(g, L, kv * hd), "vc": r32(g, L, kv * vd),
              "pos": np.array([pos], np.int32), "o": np.zeros(heads * vd, np.float32)}
    a = Attention("q", "kc", "vc", "pos", "o", heads, heads // kv, hd, vd, L, 1, hd ** -0.5).tune(Knobs())
    dev = gpu.both(a, arrays, {}, tol=2e-4)
    again_same(a, dev, ["o"])


@pytest.mark.parametrize("heads,kv,hd,vd,per_block,sinks", [(4, 1, 256, 256, 4, True), (2, 1, 64, 640, 1, False),
                                                            (3, 3, 36, 96, 1, True)])
@pytest.mark.parametrize("splits,pos", [(130, 300), (257, 256), (2, 0)])
def test_merge_in_chunks_and_passes(heads, kv, hd, vd, per_block, sinks, splits, pos):
    """attention_merge past its one-round paths: more splits than a chunk of weights (CW 128: 130, 257 with one key a
    split or none), a lane's values in two passes (heads of 256 four a block: 8 values a lane; 640 values over the
    four warps: 5), the sink; position 0 (two splits, one of them past every key)."""
    g = np.random.default_rng(splits + vd)
    L = 310
    arrays = {"q": r32(g, 1, heads * hd), "kc": r32(g, L, kv * hd), "vc": r32(g, L, kv * vd),
              "pos": np.array([pos], np.int32), "o": np.zeros(heads * vd, np.float32)}
    a = Attention("q", "kc", "vc", "pos", "o", heads, heads // kv, hd, vd, L, 1, hd ** -0.5, splits=splits,
                  per_block=per_block, sinks="sk" if sinks else None)
    assert a.check() is None
    dev = gpu.both(a, arrays, {"sk": (r32(g, heads), "f32")}, tol=2e-4)
    assert kernels_run(dev) == ["attention_split_wide" if vd > MAX_HEAD else "attention_split" if vd > 128 else
                                "attention_split_128"]
    again_same(a, dev, ["o"])


@pytest.mark.parametrize("heads,kv,own,tail,vd", [(4, 1, 512, 64, 512), (16, 1, 16, 8, 16), (6, 6, 128, 64, 128),
                                                  (5, 5, 10, 8, 12)])
@pytest.mark.parametrize("rows,pos,splits", [(1, 0, 1), (1, 150, 4), (5, 37, 1), (3, 100, 3), (1, 90, 32)])
def test_split_attention(heads, kv, own, tail, vd, rows, pos, splits):
    """test_kernels_gpu::test_split_attention: a head's query and each key in two parts, read in place."""
    a, arrays = gpu.split_attention_case(heads, kv, own, tail, vd, rows, pos, splits, 160 + 8)
    dev = gpu.both(a, arrays, {}, tol=2e-4)
    again_same(a, dev, ["o"])


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("pitch_pad,koff", [(5, 5), (4, 4), (0, 0)])
def test_keys_and_values_as_parts_of_one_row(splits, pitch_pad, koff):
    """test_placement's parts of one row: keys and values at offsets in a wider row (odd: no 16-byte loads)."""
    g = np.random.default_rng(5 + splits)
    heads, kv, hd, vd, L, pos = 8, 2, 64, 32, 200, 157
    pitch = kv * (hd + vd) + pitch_pad
    arrays = {"q": r32(g, heads * hd), "kv": r32(g, L * pitch), "pos": np.array([pos], np.int32),
              "o": np.zeros(heads * vd, np.float32)}
    a = Attention("q", "kv", "kv", "pos", "o", heads, heads // kv, hd, vd, L, 1, hd ** -0.5, splits=splits,
                  per_block=4, kstride=pitch, koff=koff, vstride=pitch, voff=koff + kv * hd)
    dev = gpu.both(a, arrays, {}, tol=2e-4)
    again_same(a, dev, ["o"])


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("rows,window", [(1, 0), (3, 8), (2, 0)])
def test_gated_and_soft_capped(splits, rows, window):
    """test_gdn_kernels::test_gpu_gated_attention and test_gemma_gpu::test_attention_soft_cap, smaller."""
    g = np.random.default_rng(14 + rows)
    heads, kv, hd, L = 16, 2, 64, 90
    a = Attention("q", "kc", "vc", "pos", "o", heads, heads // kv, hd, hd, L, rows, hd ** -0.5, splits=splits,
                  window=window, softcap=5.0 if window else 0.0, per_block=4, gate=("gate", "sigmoid"))
    arrays = {"q": 3 * r32(g, rows * heads * hd), "kc": r32(g, L * kv * hd), "vc": r32(g, L * kv * hd),
              "pos": np.array([61], np.int32), "gate": r32(g, rows * heads * hd),
              "o": np.zeros(rows * heads * hd, np.float32)}
    dev = gpu.both(a, arrays, {})
    again_same(a, dev, ["o"])


def test_batch_slots():
    """A batch's sequences, each at its own position over its own slot (test_batch's attention)."""
    g = np.random.default_rng(16)
    B, L, heads, kv, hd = 3, 40, 8, 2, 32
    for splits, per_block in ((1, 1), (3, 2), (16, 4)):
        a = Attention("q", "kc", "vc", "pos", "o", heads, heads // kv, hd, hd, B * L, B, hd ** -0.5, splits=splits,
                      per_block=per_block).batched("pos", L)
        arrays = {"q": r32(g, B * heads * hd), "kc": r32(g, B * L * kv * hd), "vc": r32(g, B * L * kv * hd),
                  "pos": np.array([5, 0, L - 1], np.int32), "o": np.zeros(B * heads * hd, np.float32)}
        dev = gpu.both(a, arrays, {}, tol=2e-4)
        again_same(a, dev, ["o"])


# -- the quantizing epilogues (test_quant_gpu): the f32 output and its quantized form ------------------------------

def _quant_dev(n, words, arrays):
    from lanefuse.kernels.cupy_env import DeviceEnv
    from lanefuse.kernels.quant import quant_layout

    total = quant_layout(n, words)[2]
    return DeviceEnv(total, {"oq": (0, total, "u8")}, arrays, {}, quantized={"oq": (n, words)})


@pytest.mark.parametrize("words", [1, 2, 3])
@pytest.mark.parametrize("heads,group,d,rows,splits,f32", [
    (8, 4, 64, 3, 1, True), (8, 4, 64, 3, 3, True), (8, 2, 64, 1, 1, False), (8, 2, 64, 2, 5, False),
    (16, 4, 32, 2, 1, True), (16, 4, 32, 1, 3, True), (4, 1, 256, 1, 2, True), (8, 2, 128, 1, 6, True)])
def test_attention_quantizing_its_output(words, heads, group, d, rows, splits, f32):
    from lanefuse.engine.formats.quantize import quantize

    if words == 3 and not f32:
        pytest.skip("the q8k form is written beside the output")
    rng = np.random.default_rng(13 + splits)
    L, n = 40, rows * heads * d
    base = Attention("q", "kc", "vc", "pos", "o", heads, group, d, d, L, rows, d ** -0.5, quant="oq", words=words,
                     f32=f32, gate=("gt", "sigmoid") if splits % 2 else None)
    from lanefuse.lane.lower.knobs import Knobs

    a = dataclasses.replace(base.tune(Knobs()), splits=splits)
    if a.check():
        pytest.skip(str(a.check()))
    arrays = {"q": rng.standard_normal(n).astype(np.float32),
              "kc": rng.standard_normal(L * heads // group * d).astype(np.float32),
              "vc": rng.standard_normal(L * heads // group * d).astype(np.float32), "gt": r32(rng, n),
              "pos": np.array([30], np.int32), "o": np.zeros(n, np.float32)}
    qz = {"oq": (np.zeros(n, np.int8), np.zeros(n // 16, np.int16) if words == 3 else
                 (np.zeros(n, np.int8) if words == 2 else None), np.zeros(n // (256 if words == 3 else 32),
                                                                          np.float32))}
    host = HostEnv({k: v.copy() for k, v in arrays.items()}, {}, qz)
    a.numpy(host)
    dev = _quant_dev(n, words, arrays)
    a.cuda(dev)
    if f32:
        np.testing.assert_allclose(dev.host("o"), host.array("o"), rtol=2e-4, atol=2e-4)
        vals = dev.host("o")
    else:  # the quantized form alone: the values the kernel held, within rounding of the twin's output
        ref = HostEnv({k: v.copy() for k, v in arrays.items()}, {}, qz)
        dataclasses.replace(a, f32=True).numpy(ref)
        vals = ref.array("o")
    got = [None if x is None else np.asarray(x).reshape(-1) for x in dev.quant("oq")]
    want = quantize(vals.reshape(1, -1).astype(np.float32), words).parts()
    if f32:  # the form of the values the kernel stored, exactly
        for x, w in zip(got, want):
            assert (x is None) == (w is None) and (x is None or np.array_equal(x, np.asarray(w).reshape(-1)))
    else:  # from values within rounding of the twin's: the scales close, the words within one step
        np.testing.assert_allclose(got[-1], np.asarray(want[-1]).reshape(-1), rtol=1e-3, atol=1e-6)
        assert np.abs(got[0].astype(int) - np.asarray(want[0]).reshape(-1).astype(int)).max() <= 1


# -- the GPU tests' own attention cases, at their sizes --------------------------------------------------------------

FULL = bool(flags.read("LANEFUSE_EMU_FULL"))


def _gpu_cases():
    import test_gdn_kernels as gdn
    import test_gemma_gpu as gemma
    from parametrized import cases

    out = []
    for mod, name in ((gpu, "test_attention"), (gpu, "test_split_attention"), (gemma, "test_attention_soft_cap"),
                      (gdn, "test_gpu_gated_attention")):
        fn = getattr(mod, name, None)
        for kw in cases(fn) if fn else []:
            out.append(pytest.param(mod, name, kw, id=f"{name}[{'-'.join(map(str, kw.values()))}]"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mod,name,kw", _gpu_cases() if FULL else [pytest.param(
    None, None, None, id="all", marks=pytest.mark.skip(reason="the GPU tests' attention cases at their sizes, "
                                                       "emulated: set LANEFUSE_EMU_FULL=1"))])
def test_gpu_case_emulated(mod, name, kw):
    try:
        getattr(mod, name)(**kw)
    except pytest.skip.Exception:
        raise
