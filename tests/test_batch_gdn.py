"""A batch's gated delta net launches (Conv, ConvParts, Delta with `seqs`): each row a sequence of its own, over its
own slot of the rings (taps-1 rows a sequence) and of the recurrent state (hv·dk rows a sequence). The numpy twin of
the batch launch equals, to the bit, its sequences apart (the `sequences` step held) and each sequence's
one-sequence launch over its own slot; it meets the reference interpreter's batch meaning (causal_conv, gated_delta
over a batch's ring and state) within f32; the CUDA kernels (conv.cu, conv_parts.cu, delta.cu) on the host emulator
against the twin, then again with the blocks in reverse order and threads shuffled (the same bits); and on a device
(skipped without one)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lanefuse.engine.interp import OP_IMPL
from lanefuse.kernels import Conv, ConvParts, Delta, HostEnv
from lanefuse.kernels.conv_parts import ConvPart


def r32(g, *shape, scale=1.0):
    return (scale * g.standard_normal(shape)).astype(np.float32)


def run(launches, arrays, weights, quants=None):
    env = HostEnv({k: v.copy() for k, v in arrays.items()}, weights, quants or {})
    for l in launches:
        l.numpy(env)
    return env


# -- the convolutions ------------------------------------------------------------------------------------------------

def conv_case(g, B, taps, chans, start):
    """B sequences' rows of one wider product (q | k | v at `start` on, 3 spare values a row), each part's ring a slot
    a sequence."""
    pitch = start + sum(chans.values()) + 3
    arrays = {"x": r32(g, B, pitch)}
    weights = {}
    at = start
    parts = []
    for n, c in chans.items():
        arrays["r" + n] = r32(g, B * (taps - 1), c)
        arrays["y" + n] = np.zeros(B * c, np.float32)
        weights["w" + n] = (r32(g, c, taps), "f32")
        parts.append(ConvPart("x", "w" + n, "r" + n, "y" + n, c, l2=n != "v", xpitch=pitch, xoff=at))
        at += c
    return arrays, weights, tuple(parts)


def one_sequence(arrays, s, B, ring_names, widths):
    """Sequence s's own arrays: its row of each batch array, its slot of each ring/state."""
    out = {}
    for k, v in arrays.items():
        if k in ring_names:
            n = v.size // B
            out[k] = v.reshape(-1)[s * n:(s + 1) * n].copy()
        else:
            n = widths.get(k, v.size // B)
            out[k] = v.reshape(-1)[s * n:(s + 1) * n].copy()
    return out


@settings(max_examples=15, deadline=None)
@given(B=st.integers(1, 5), taps=st.integers(2, 5), silu_=st.booleans(), block=st.sampled_from([32, 64]),
       start=st.sampled_from([0, 7]), seed=st.integers(0, 999))
def test_conv_parts_batch_is_each_sequence_alone(B, taps, silu_, block, start, seed):
    g = np.random.default_rng(seed)
    chans = {"q": 2 * block, "k": 2 * block, "v": 96}
    arrays, weights, parts = conv_case(g, B, taps, chans, start)
    one = ConvParts(parts, taps, B, silu=silu_, block=block)
    k = one.batched("pos", 24)
    assert k.seqs and k.check() is None and k.grid_block()[0][1] == B
    whole = run([k], arrays, weights)
    apart = run(k.apart(), arrays, weights)
    assert len(k.apart()) == B and [p.seq0 for p in k.apart()] == list(range(B))
    rings = {"r" + n for n in chans}
    for n in chans:
        assert np.array_equal(whole.array("y" + n), apart.array("y" + n))
        assert np.array_equal(whole.array("r" + n), apart.array("r" + n))
    for s in range(B):  # the one-sequence launch over sequence s's own row and ring slot
        alone = run([replace(one, rows=1)],
                    one_sequence(arrays, s, B, rings, {}), weights)
        for n, c in chans.items():
            assert np.array_equal(alone.array("y" + n), whole.array("y" + n)[s * c:(s + 1) * c])
            ring = whole.array("r" + n).reshape(B, -1)[s]
            assert np.array_equal(alone.array("r" + n), ring)
    # the reference interpreter's meaning of a batch's convolution (rows over their ring slots), then SiLU and L2
    at = start
    for n, c in chans.items():
        ring = arrays["r" + n].copy()
        want = OP_IMPL["causal_conv"](arrays["x"], weights["w" + n][0], ring, taps=taps, start=at)
        at += c
        if silu_:
            want = (want / (1 + np.exp(-want.astype(np.float64)))).astype(np.float32)
        if n != "v":
            want = OP_IMPL["l2norm"](want, heads=c // block, eps=1e-6)
        np.testing.assert_allclose(whole.array("y" + n), want.reshape(-1), rtol=2e-5, atol=2e-5)
        assert np.array_equal(whole.array("r" + n), ring.reshape(-1))


@pytest.mark.parametrize("B,l2", [(1, 0), (4, 32), (3, 0)])
def test_conv_batch_is_each_sequence_alone(B, l2):
    g = np.random.default_rng(B)
    c, taps = 64, 4
    arrays = {"x": r32(g, B, c + 9), "ring": r32(g, B * (taps - 1), c), "y": np.zeros(B * c, np.float32)}
    weights = {"w": (r32(g, c, taps), "f32")}
    one = Conv("x", "w", "ring", "y", c, taps, B, silu=True, l2=l2, xpitch=c + 9, xoff=5)
    k = one.batched("pos", 16)
    whole = run([k], arrays, weights)
    apart = run(k.apart(), arrays, weights)
    for n in ("y", "ring"):
        assert np.array_equal(whole.array(n), apart.array(n))
    ring = arrays["ring"].copy()
    want = OP_IMPL["causal_conv"](arrays["x"], weights["w"][0], ring, taps=taps, start=5)
    assert np.array_equal(whole.array("ring"), ring.reshape(-1))
    for s in range(B):
        alone = run([replace(one, rows=1)], one_sequence(arrays, s, B, {"ring"}, {}), weights)
        assert np.array_equal(alone.array("y"), whole.array("y")[s * c:(s + 1) * c])
    assert not np.array_equal(want, 0)


def test_one_sequence_launch_unchanged_by_the_batch_fields():
    """A launch outside a batch (seqs False) runs the step's rows in order over its one ring and state, as before:
    two rows of one sequence are not two sequences."""
    g = np.random.default_rng(5)
    c, taps = 32, 3
    arrays = {"x": r32(g, 2, c), "ring": r32(g, 2 * (taps - 1), c), "y": np.zeros(2 * c, np.float32)}
    weights = {"w": (r32(g, c, taps), "f32")}
    k = Conv("x", "w", "ring", "y", c, taps, 2)
    seq = run([k], arrays, weights)
    bat = run([k.batched("pos", 8)], arrays, weights)
    assert not np.array_equal(seq.array("y")[c:], bat.array("y")[c:])  # row 1 after row 0, or after its own ring
    assert np.array_equal(seq.array("ring")[(taps - 1) * c:], arrays["ring"].reshape(-1)[(taps - 1) * c:])


# -- the delta rule --------------------------------------------------------------------------------------------------

def delta_case(g, B, hk, hv, dk, dv, zextra=7, zoff=3):
    q = OP_IMPL["l2norm"](r32(g, B, hk * dk), heads=hk, eps=1e-6)
    k = OP_IMPL["l2norm"](r32(g, B, hk * dk), heads=hk, eps=1e-6)
    return {"q": q, "k": k, "v": r32(g, B, hv * dv), "z": r32(g, B, hv * dv + zextra),
            "b": (1 / (1 + np.exp(-r32(g, B, hv)))).astype(np.float32), "g": -np.abs(r32(g, B, hv, scale=0.5)),
            "S": r32(g, B * hv * dk, dv, scale=0.3), "o": np.zeros(B * hv * dv, np.float32)}, \
        {"gn": (r32(g, dv, scale=0.2) + 1, "f32")}


def delta(B, hk, hv, dk, dv, **kw):
    return Delta("q", "k", "v", "z", "b", "g", "S", "gn", "o", hk, hv, dk, dv, B, dk ** -0.5, 1e-6,
                 zpitch=hv * dv + 7, zoff=3, **kw)


@settings(max_examples=12, deadline=None)
@given(B=st.integers(1, 4), hk=st.integers(1, 2), group=st.integers(1, 3), dk=st.sampled_from([32, 64]),
       dv=st.sampled_from([32, 64]), seed=st.integers(0, 999))
def test_delta_batch_is_each_sequence_alone(B, hk, group, dk, dv, seed):
    g = np.random.default_rng(seed)
    hv = hk * group
    arrays, weights = delta_case(g, B, hk, hv, dk, dv)
    k = delta(B, hk, hv, dk, dv).batched("pos", 24)
    assert k.seqs and k.check() is None and k.grid_block()[0] == (hv, B, 1)
    whole = run([k], arrays, weights)
    apart = run(k.apart(), arrays, weights)
    for n in ("o", "S"):
        assert np.array_equal(whole.array(n), apart.array(n)), n
    widths = {"q": hk * dk, "k": hk * dk, "v": hv * dv, "z": hv * dv + 7, "b": hv, "g": hv, "o": hv * dv}
    for s in range(B):
        alone = run([delta(1, hk, hv, dk, dv)], one_sequence(arrays, s, B, {"S"}, widths), weights)
        n = hv * dv
        assert np.array_equal(alone.array("o"), whole.array("o")[s * n:(s + 1) * n])
        assert np.array_equal(alone.array("S"), whole.array("S").reshape(B, -1)[s])
    state = arrays["S"].copy()
    want = OP_IMPL["gated_delta"](arrays["q"], arrays["k"], arrays["v"], arrays["z"], arrays["b"], arrays["g"], state,
                                  weights["gn"][0], hk=hk, hv=hv, dk=dk, dv=dv, scale=dk ** -0.5, eps=1e-6, zoff=3)
    np.testing.assert_allclose(whole.array("o"), want.reshape(-1), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(whole.array("S"), state.reshape(-1), rtol=1e-4, atol=1e-4)


def quant_form(n, words):
    return (np.zeros(n, np.int8), {2: np.zeros(n, np.int8), 3: np.zeros(n // 16, np.int16)}.get(words),
            np.zeros(n // (256 if words == 3 else 32), np.float32))


@pytest.mark.parametrize("words", [1, 3])
def test_delta_batch_quantizing_epilogue_apart_equal(words):
    """gdn_output_quant over a batch: each sequence's output row's quantized form where its row lies, apart or
    whole the same words; the q8k form's arrival counters a row (the batch's rows indexed from 0)."""
    g = np.random.default_rng(30 + words)
    B, hk, hv, dk, dv = 3, 2, 4, 32, 64
    arrays, weights = delta_case(g, B, hk, hv, dk, dv)
    k = delta(B, hk, hv, dk, dv, quant="oq", words=words).batched("pos", 8)
    assert k.check() is None
    whole = run([k], arrays, weights, {"oq": quant_form(B * hv * dv, words)})
    apart = run(k.apart(), arrays, weights, {"oq": quant_form(B * hv * dv, words)})
    for a, b in zip(whole.quant("oq"), apart.quant("oq")):
        if a is not None:
            assert np.array_equal(a, b)
    assert np.array_equal(whole.array("o"), apart.array("o"))
    assert all(p.scratch()[0].nbytes == 4 * (p.seq0 + 1) for p in k.apart()) if words == 3 else True


def test_batch_launch_reach():
    """What a saved plan's check reads of each batch launch: every sequence's rows and ring/state slot (a launch
    apart: up to its own)."""
    k = delta(4, 2, 4, 32, 64).batched("pos", 8)
    e = k.extents(7, 4)
    assert e["S"] == 4 * 4 * 32 * 64 and e["o"] == 4 * 4 * 64 and e["z"] == 3 * (4 * 64 + 7) + 3 + 4 * 64
    last = k.apart()[-1]
    assert last.extents(7, 4) == e and k.apart()[0].extents(7, 4)["S"] == 4 * 32 * 64
    c = Conv("x", "w", "ring", "y", 64, 4, 3).batched("pos", 8)
    assert c.extents(7, 3)["ring"] == 3 * 3 * 64 and c.apart()[1].extents(7, 3)["ring"] == 2 * 3 * 64


# -- the CUDA kernels: emulated on the host, and on a device ----------------------------------------------------------

def _cases():
    """(launch, arrays, weights, tolerance) of every batch kind at awkward sizes."""
    g = np.random.default_rng(40)
    out = []
    for B in (1, 3, 5):
        arrays, weights, parts = conv_case(g, B, 4, {"q": 64, "k": 64, "v": 96}, 7)
        out.append((ConvParts(parts, 4, B, block=32).batched("pos", 8), arrays, weights, 1e-4))
        c = 96
        out.append((Conv("x", "w", "ring", "y", c, 3, B, silu=True, l2=32, xpitch=c + 5, xoff=2).batched("pos", 8),
                    {"x": r32(g, B, c + 5), "ring": r32(g, B * 2, c), "y": np.zeros(B * c, np.float32)},
                    {"w": (r32(g, c, 3), "f32")}, 1e-4))
        arrays, weights = delta_case(g, B, 2, 4, 32, 64)
        out.append((delta(B, 2, 4, 32, 64).batched("pos", 8), arrays, weights, 3e-4))
    return out


def _emu():
    from cuda_host import emu

    if emu.compiler() is None:
        pytest.skip("no g++ to build the emulated kernels")
    return emu


def test_batch_kernels_emulated():
    """conv.cu, conv_parts.cu and delta.cu over a batch's sequences (a block row a sequence) and each sequence apart,
    on the host emulator, against the numpy twin; again with blocks reversed and threads shuffled: the same bits."""
    emu = _emu()
    import test_kernels_gpu as gpu

    with emu.emulating([Conv.stem, ConvParts.stem, Delta.stem]) as env:
        for launch, arrays, weights, tol in _cases():
            for l in (launch, *launch.apart()[1:]):
                dev = gpu.both(l, arrays, weights, tol=tol)
                assert dev.calls[-1][1][1] == (l.rows if l.seqs else 1)  # a block row a sequence
                # the rings and states are rewritten in place: the same inputs again, blocks reversed and threads
                # shuffled between barriers
                again = env(0, {}, arrays, weights)
                again.flags, again.seed = 1, 12345
                l.cuda(again)
                for n in arrays:
                    np.testing.assert_array_equal(again.host(n), dev.host(n), err_msg=f"{l.census} {n} reversed")


@pytest.mark.gpu
def test_batch_kernels_on_the_device():
    from test_kernels_gpu import _device, both

    if not _device():
        pytest.skip("no CUDA device")
    for launch, arrays, weights, tol in _cases():
        for l in (launch, *launch.apart()):
            both(l, arrays, weights, tol=tol)


def _quant_case(words, B=3, hk=2, hv=4, dk=32, dv=64):
    g = np.random.default_rng(50 + words)
    arrays, weights = delta_case(g, B, hk, hv, dk, dv)
    return delta(B, hk, hv, dk, dv, quant="xq", words=words).batched("pos", 8), arrays, weights


def _quant_run(env_class, launches, arrays, weights, words, n):
    """The launches on a device env holding the quantized form `xq` of n values; its output, state and form."""
    from lanefuse.kernels.quant import quant_layout

    total = quant_layout(n, words)[2]
    dev = env_class(total, {"xq": (0, total, "u8")}, {k: v.copy() for k, v in arrays.items()}, weights,
                    quantized={"xq": (n, words)})
    for l in launches:
        l.cuda(dev)
    dev.cp.cuda.Device().synchronize()
    return dev.host("o"), dev.host("S"), [None if a is None else dev.cp.asnumpy(a).reshape(-1) for a in dev.quant("xq")]


def _quant_agree(env_class, words):
    """delta_seqs's epilogue over a batch: the rows within the GPU tolerance of the twin's, each row's quantized form
    the words (sums, scales) engine/formats/quantize.py makes of the values the kernel stored — whole, and each sequence
    apart (a row's q8k arrival counters from its own row)."""
    from lanefuse.engine.formats.quantize import quantize

    launch, arrays, weights = _quant_case(words)
    B, n = launch.rows, launch.hv * launch.dv
    host = run([launch], arrays, weights, {"xq": quant_form(B * n, words)})
    whole = _quant_run(env_class, [launch], arrays, weights, words, B * n)
    apart = _quant_run(env_class, list(reversed(launch.apart())), arrays, weights, words, B * n)
    np.testing.assert_allclose(whole[0], host.array("o"), rtol=3e-4, atol=3e-4)
    np.testing.assert_allclose(whole[1], host.array("S"), rtol=3e-4, atol=3e-4)
    for o, s_, form in (whole, apart):
        want = quantize(o.reshape(B, n), words).parts()
        for a, b in zip(form, want):
            assert (a is None) == (b is None) and (a is None or np.array_equal(a, b.reshape(-1))), words
    assert np.array_equal(whole[0], apart[0]) and np.array_equal(whole[1], apart[1])


@pytest.mark.parametrize("words", [1, 2, 3])
def test_batch_delta_quantizing_emulated(words):
    emu = _emu()
    with emu.emulating([Delta.stem]) as env:
        _quant_agree(env, words)


@pytest.mark.gpu
@pytest.mark.parametrize("words", [1, 2, 3])
def test_batch_delta_quantizing_on_the_device(words):
    from test_kernels_gpu import _device

    if not _device():
        pytest.skip("no CUDA device")
    from lanefuse.kernels.cupy_env import DeviceEnv

    _quant_agree(DeviceEnv, words)
