"""The shared-row attention (issue 40 item 4, seed 002's Attention `shared`): a chunk's `shared` rows a block beside its
heads, each tile of keys and values loaded once for every (row, head) slot (attention.cu attention_rows_128). The real
kernel run by the host emulator of CUDA against the numpy twin (rows not a multiple of `shared`, positions 0 and
later, windows shorter than the block's rows, sinks, soft caps, splits past some rows' keys, odd widths off the
16-byte path, the gate and the quantizing epilogues), again in reverse block order with shuffled threads (the same
bits, the counters zero); the schedule step `shared_rows` (chosen where its blocks stream fewer bytes, held like any
step, refused where the kernel cannot), and a hypothesis property: any `shared` equals one row a block."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import test_kernels_gpu as gpu
from cuda_host import emu
from test_kernels_emulated import again_same
from lanefuse.kernels import Attention, HostEnv
from lanefuse.lane.lower.knobs import Knobs

r32 = gpu.r32
needs_gxx = pytest.mark.skipif(emu.compiler() is None, reason="no g++ to build the emulated kernels")


@pytest.fixture(scope="module")
def emulated():
    """The stand-in cupy in sys.modules and DeviceEnv the emulating one, for the tests that ask for it."""
    with emu.emulating([Attention.stem]) as env:
        yield env


def case(heads, kv, hd, vd, rows, pos, L, seed, **kw):
    g = np.random.default_rng(seed)
    arrays = {"q": 2 * r32(g, rows * heads * hd), "kc": r32(g, L * kv * hd), "vc": r32(g, L * kv * vd),
              "pos": np.array([pos], np.int32), "o": np.zeros(rows * heads * vd, np.float32)}
    if kw.get("gate"):
        arrays["gt"] = r32(g, rows * heads * vd)
    a = Attention("q", "kc", "vc", "pos", "o", heads, heads // kv, hd, vd, L, rows, hd ** -0.5, **kw)
    return a, arrays, {"sk": (r32(g, heads), "f32")}


# heads, kv, hd, vd, per_block, shared: one row of four heads' slots, two rows of two, four rows of one; odd widths
SLOTS = [(4, 4, 32, 32, 1, 4), (8, 4, 64, 64, 2, 2), (6, 2, 128, 128, 1, 3), (2, 1, 36, 50, 1, 4),
         (8, 2, 16, 16, 4, 1), (4, 2, 128, 96, 2, 2)]


@needs_gxx
@pytest.mark.parametrize("heads,kv,hd,vd,per_block,shared", SLOTS)
@pytest.mark.parametrize("rows,pos,window,splits", [(5, 0, 0, 1), (7, 37, 0, 3), (8, 20, 3, 1), (6, 90, 5, 16),
                                                    (3, 2, 0, 40)])
def test_shared_rows_equal_the_twin(emulated, heads, kv, hd, vd, per_block, shared, rows, pos, window, splits):
    a, arrays, w = case(heads, kv, hd, vd, rows, pos, 128, heads * hd + rows + splits, window=window,
                        per_block=per_block, splits=splits, shared=shared, sinks="sk" if splits % 2 else None,
                        softcap=4.0 if window else 0.0)
    assert a.check() is None, a.check()
    dev = gpu.both(a, arrays, w, tol=2e-4)
    assert [c[0] for c in dev.calls] == ["attention_split_128" if shared == 1 else "attention_rows_128"]
    again_same(a, dev, ["o"])
    # the same values as one row a block (the kernel's other rounding: the block's keys split as one row's)
    one = dataclasses.replace(a, shared=1)
    host = HostEnv({k: v.copy() for k, v in arrays.items()}, w)
    one.numpy(host)
    np.testing.assert_allclose(dev.host("o"), host.array("o"), rtol=2e-4, atol=2e-4)


@needs_gxx
@pytest.mark.parametrize("words,f32", [(1, True), (2, False), (3, True)])
@pytest.mark.parametrize("splits", [1, 3])
def test_shared_rows_gated_and_quantized(emulated, words, f32, splits):
    """The gate and the q8 epilogue (the merging block's, one split's; the quantized form alone: each warp its block)
    over each of a block's rows."""
    from lanefuse.kernels.moe import quantize  # the engine's quantizer, wherever the engine keeps it
    from lanefuse.kernels.cupy_env import DeviceEnv
    from lanefuse.kernels.quant import quant_layout

    heads, d, rows = 4, 64, 5
    # q8k: a block of 256 over four heads of 64 (a group of four) one row a block; else two heads of a group of two,
    # two rows a block
    kv, per_block, shared = (1, 4, 1) if words == 3 else (2, 2, 2)
    a, arrays, _ = case(heads, kv, d, d, rows, 11, 40, 7 + words, splits=splits, per_block=per_block, shared=shared,
                        gate=("gt", "sigmoid"), quant="oq", words=words, f32=f32)
    if words == 3:
        assert "slots" in str(dataclasses.replace(a, shared=2).check())  # eight slots: refused in one line
        assert dataclasses.replace(a, per_block=1).tune(Knobs()).shared == 1  # q8k's four heads fill the slots
    assert a.check() is None, a.check()
    n = rows * heads * d
    qz = {"oq": (np.zeros(n, np.int8), np.zeros(n // 16, np.int16) if words == 3 else
                 (np.zeros(n, np.int8) if words == 2 else None), np.zeros(n // (256 if words == 3 else 32),
                                                                          np.float32))}
    host = HostEnv({k: v.copy() for k, v in arrays.items()}, {}, qz)
    a.numpy(host)
    total = quant_layout(n, words)[2]
    dev = DeviceEnv(total, {"oq": (0, total, "u8")}, arrays, {}, quantized={"oq": (n, words)})
    a.cuda(dev)
    if f32:  # the form of the values the kernel stored, exactly
        np.testing.assert_allclose(dev.host("o"), host.array("o"), rtol=2e-4, atol=2e-4)
        vals = dev.host("o")
    else:  # the quantized form alone: from values within rounding of the twin's
        ref = HostEnv({k: v.copy() for k, v in arrays.items()}, {}, qz)
        dataclasses.replace(a, f32=True).numpy(ref)
        vals = ref.array("o")
    got = [None if x is None else np.asarray(x).reshape(-1) for x in dev.quant("oq")]
    want = quantize(vals.reshape(1, -1).astype(np.float32), words).parts()
    if f32:
        for x, w in zip(got, want):
            assert (x is None) == (w is None) and (x is None or np.array_equal(x, np.asarray(w).reshape(-1)))
    else:
        np.testing.assert_allclose(got[-1], np.asarray(want[-1]).reshape(-1), rtol=1e-3, atol=1e-6)
        assert np.abs(got[0].astype(int) - np.asarray(want[0]).reshape(-1).astype(int)).max() <= 1
    again_same(a, dev, ["o"] if f32 else [])


def test_tune_takes_shared_rows_where_they_stream_fewer_bytes():
    """`shared_rows` on a chunk: group 1 takes four rows a block, group 2 two (its two heads a block), group 4 none
    (four heads fill the slots); one row, a batch, a head wider than 128, or the step held: one row a block."""
    knobs = Knobs()
    def tuned(heads, kv, hd, rows, held=frozenset(), **kw):
        return Attention("q", "kc", "vc", "pos", "o", heads, heads // kv, hd, hd, 4096, rows, 0.1, **kw).tune(
            knobs, held)
    assert (tuned(16, 16, 64, 64).shared, tuned(16, 8, 128, 64).shared, tuned(32, 8, 128, 64).shared) == (4, 2, 1)
    t = tuned(16, 8, 128, 64)
    assert t.per_block == 2 and t.check() is None and t.pass_bytes() < dataclasses.replace(t, shared=1).pass_bytes()
    assert tuned(16, 16, 64, 1).shared == 1
    assert tuned(16, 16, 256, 64).shared == 1
    assert tuned(16, 16, 64, 64, held={"shared_rows"}).shared == 1
    held = tuned(16, 16, 64, 64, held={"attn_splits"})
    assert (held.per_block, held.splits, held.shared) == (1, 1, 4)
    b = tuned(4, 4, 64, 3).batched("pos", 100)
    assert b.shared == 1 and b.check() is None
    assert "batch" in str(dataclasses.replace(b, shared=2).check())


def test_refusals_name_the_reason():
    a, _, _ = case(8, 2, 64, 64, 4, 0, 16, 1, per_block=2)  # group 4
    assert a.check() is None and dataclasses.replace(a, shared=2).check() is None
    assert "holds 4 (row, head) slots" in str(dataclasses.replace(a, per_block=4, shared=2).check())
    b, _, _ = case(8, 4, 64, 64, 4, 0, 16, 1, per_block=4)  # group 2: four heads a block span two key/value heads
    assert b.check() is None
    assert "spanning key/value heads of 2" in str(dataclasses.replace(b, shared=2).check())
    assert "kernel takes whole heads" in str(dataclasses.replace(a, hd=256, vd=256, per_block=1, shared=2).check())
    assert "0 rows a block" in str(dataclasses.replace(a, shared=0).check())


@settings(max_examples=40, deadline=None)
@given(heads_kv=st.sampled_from([(4, 4), (4, 2), (6, 3), (2, 1)]), rows=st.integers(2, 9),
       pos=st.integers(0, 30), window=st.sampled_from([0, 1, 4, 50]), splits=st.integers(1, 12),
       shared=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_any_shared_rows_equal_one_row_a_block(heads_kv, rows, pos, window, splits, shared, seed):
    """The exact twin with `shared` rows a block (the block's keys split, each row's taken) equals one row a block to
    f64 rounding, for any rows, positions, windows and splits: the partition changes only where sums are cut."""
    heads, kv = heads_kv
    a, arrays, w = case(heads, kv, 8, 8, rows, pos, 48, seed, window=window, splits=splits, shared=shared,
                        sinks="sk")
    if a.check() is not None:
        return
    outs = []
    for s in (shared, 1):
        host = HostEnv({k: v.copy() for k, v in arrays.items()}, w)
        dataclasses.replace(a, shared=s).numpy(host)
        outs.append(host.array("o").copy())
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)


# -- reached from a real front: a tiny Qwen3's prefill chunks (group 2: two rows a block) and an MHA's (four) ---------

def tiny(kv: int, bf16: bool):
    """A tiny Qwen3 of four query heads over `kv` key/value heads (2: GQA of two, 4: multi-head), f32 or every layer
    matrix a bf16 checkpoint tensor."""
    from lanefuse.engine.front.demo import random_arrays
    from lanefuse.engine.front.model import ModelConfig
    from lanefuse.engine.front.weights import Weights, f32_to_bf16

    base = ModelConfig("Qwen3ForCausalLM", 64, 2, 4, kv, 32, 96, 100, qk_norm=True, max_len=64, name="tiny")
    arrays = random_arrays(base, seed=3 + kv)
    if not bf16:
        return base, Weights.from_dict(arrays, base)
    names = tuple(n for n, a in arrays.items() if ".layers." in n and np.ndim(a) == 2)
    cfg = dataclasses.replace(base, formats=tuple((n, "bf16") for n in names))
    for n in names:
        arrays[n] = f32_to_bf16(arrays[n])
    return cfg, Weights.from_dict(arrays, cfg)


def attentions(p) -> list[Attention]:
    """The plan's attentions: launches of their own, and a chained launch's attention phase (attn_o_glu_down_norm)."""
    return [a for x in p.launches for a in getattr(x.launch, "phases", (x.launch,)) if isinstance(a, Attention)]


@pytest.mark.parametrize("kv,bf16,shared", [(2, False, 2), (4, True, 4)])
def test_a_tiny_models_chunks_take_shared_rows(kv, bf16, shared):
    """The chunk plans (16 rows and 5) take `shared` rows a block in every layer's attention, the decode step one; held,
    one; the same launches either way; the blocks stream ceil(rows / shared) passes over the keys and values where
    they made one a row (pass_bytes). The prompt's
    tokens and logits through the exact twin equal the reference interpreter's (within 1e-4 of their scale), and the
    plan with the step held (f64 rounding apart)."""
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import PlanOptions, plan
    from lanefuse.lane.run.generate import generate
    from lanefuse.lane.run.step import plan_step_fn

    cfg, w = tiny(kv, bf16)
    # (a chunk of 5 rows chains its first layer, the chained attention one row a block: the chains' rules held here)
    chains = ["qkv_attn_o_glu_down_norm", "attn_o_glu_down_norm"]
    five = plan(build_step(cfg, 5))
    assert {x.shared for x in attentions(five)} == {1, shared} and five.census["chain"] == cfg.layers - 1
    for rows in (16, 5):
        on, off = plan(build_step(cfg, rows), held=chains), plan(build_step(cfg, rows), held=chains + ["shared_rows"])
        a, b = attentions(on), attentions(off)
        assert len(a) == cfg.layers and {x.shared for x in a} == {shared} and {x.shared for x in b} == {1}
        assert on.n_launches == off.n_launches
        # a block of `shared` rows streams its kv head's span (grown by shared - 1 keys) once: ceil(rows / shared)
        # passes where one row a block makes `rows`
        blocks, n = -(-rows // shared), a[0].len
        assert a[0].pass_bytes() * rows * n == b[0].pass_bytes() * blocks * (n + shared - 1)
    assert {x.shared for x in attentions(plan(build_step(cfg, 1)))} == {1}
    prompt = [int(t) for t in np.random.default_rng(kv).integers(1, cfg.vocab, 37)]  # chunks of 16, 16 and 5

    def run(held):
        fn, _ = plan_step_fn(w, "cpu", PlanOptions(held=held), exact=True)
        return generate(cfg, w, prompt, 4, step_fn=fn, chunk=16)

    got, apart, ref = run(()), run(("shared_rows",)), generate(cfg, w, prompt, 4, chunk=16)
    assert got.generated_ids == apart.generated_ids == ref.generated_ids
    for x, y, z in zip(got.logits, apart.logits, ref.logits):
        scale = float(np.abs(z).max())
        assert np.abs(np.asarray(x, np.float64) - z).max() <= 1e-4 * scale
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6 * scale)
