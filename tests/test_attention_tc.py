"""The tensor-core chunk attention (kernels/attention_tc.*, issue 35): its numerics on the CPU — the twin against the
f32 path (attention.py's exact twin) within `f32_bound`, the tolerance that follows from rounding q, k, p and v to
bf16 — and its CUDA kernel run by the host emulator (tests/cuda_host: mma.sync and ldmatrix lane by lane) against
the twin within `kernel_bound`, at awkward sizes: chunk rows not a multiple of 16 (nor of a block's 64 slots),
positions not a multiple of the 64-key tile, one key/value head and GQA groups of 3, 4 and 8, heads of 64 and 128
values and narrower ones padded, windows, soft caps, sinks, a gate, keys and values as parts of one wider cache row;
relaunched in reverse block order with shuffled threads, the same bits. `tc_attention_case` is shared with
tests/test_attention_tc_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lanefuse.kernels import Attention, HostEnv
from lanefuse.kernels.attention_tc import AttentionTc, f32_bound, gate_factor, kernel_bound


def r32(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


def tc_attention_case(rows, heads, kv, hd, vd, pos, window=0, cap=0.0, sinks=False, gate=None, shared=False, seed=0):
    """(AttentionTc, the same as an Attention, arrays, weights): random q, a cache of pos + rows + 3 rows (keys and
    values one table, key then value of each row, at an odd offset, when `shared`; at an offset and pitch of whole
    16-byte words when `shared` is "aligned": the kernel's 16-byte loads)."""
    g = np.random.default_rng(seed + rows * 7 + pos + hd)
    L = pos + rows + 3
    arrays = {"q": 2 * r32(g, rows * heads * hd), "pos": np.array([pos], np.int32),
              "o": np.full(rows * heads * vd, np.nan, np.float32)}
    kw = dict(window=window, softcap=cap, sinks="sk" if sinks else None)
    if shared:  # one row: 3 pad values, the keys, the values, 1 more (aligned: 4 and 4)
        pad = 4 if shared == "aligned" else 3
        pitch = pad + kv * (hd + vd) + (4 if shared == "aligned" else 1)
        arrays["kv"] = r32(g, L * pitch)
        kw.update(kstride=pitch, koff=pad, vstride=pitch, voff=pad + kv * hd)
        kc = vc = "kv"
    else:
        arrays["kc"], arrays["vc"] = r32(g, L * kv * hd), r32(g, L * kv * vd)
        kc, vc = "kc", "vc"
    if gate:
        arrays["gt"] = r32(g, rows * heads * vd)
        kw["gate"] = ("gt", gate)
    args = ("q", kc, vc, "pos", "o", heads, heads // kv, hd, vd, L, rows, hd ** -0.5)
    weights = {"sk": (r32(g, heads) + 1.0, "f32")} if sinks else {}
    return AttentionTc(*args, **kw), Attention(*args, **kw), arrays, weights


def host(arrays, weights):
    return HostEnv({k: v.copy() for k, v in arrays.items()}, weights)


def bounds(launch, env):
    q, keys, vals, p0, sinks = launch.operands(env)
    a = (q, keys, vals, p0, launch.group, launch.scale, launch.window, launch.softcap, sinks)
    kb, fb = kernel_bound(*a), f32_bound(*a)
    f = gate_factor(launch, env)
    if f is not None:  # the output times act(gate) (env holds the twin's output): the product's f32 rounding and the
        y = np.abs(env.array(launch.out)).reshape(kb.shape)  # kernel's activation against numpy's, 2^-21 of it
        kb, fb = kb * f + 2.0**-21 * y, fb * f
    return kb.reshape(-1), fb.reshape(-1)


# -- the numerics on the CPU ----------------------------------------------------------------------------------------

CASES = [  # rows, heads, kv, hd, vd, pos, window, cap, sinks, gate, shared
    (37, 6, 2, 64, 64, 21, 0, 0.0, False, None, False),     # GQA 3, 37 rows: 111 slots, two blocks a kv head
    (19, 4, 1, 128, 128, 70, 0, 0.0, True, None, False),    # one kv head (GQA 4), past one tile of keys
    (33, 8, 1, 64, 64, 0, 0, 30.0, False, None, False),     # GQA 8 at position 0, a soft cap
    (50, 8, 2, 128, 128, 5, 17, 0.0, True, None, False),    # GQA 4, a window, sinks
    (21, 3, 3, 40, 24, 63, 0, 0.0, False, "silu", True),    # no grouping; narrow heads padded; a gate; one table
    (70, 2, 2, 96, 80, 130, 40, 50.0, True, None, True),    # past a block of 64 slots; both heads padded to 128
    (45, 4, 2, 96, 72, 9, 0, 0.0, False, None, "aligned"),  # 16-byte loads of keys and values padded to 128, one
]                                                            # table


@pytest.mark.parametrize("case", CASES)
def test_twin_within_the_f32_bound(case):
    """The twin (bf16 operands, f32-rounded p to bf16, tiles of 64 keys) against attention.py's exact twin of the
    unrounded operands: within f32_bound at every output, and not equal to it (the rounding is a numerics)."""
    tc, exact, arrays, weights = tc_attention_case(*case)
    assert tc.check() is None, tc.check()
    e1, e2 = host(arrays, weights), host(arrays, weights)
    exact.numpy(e1)
    tc.numpy(e2)
    want, got = e1.array("o"), e2.array("o")
    _, fb = bounds(tc, e2)
    err = np.abs(got - want)
    assert np.isfinite(got).all()
    assert (err <= fb).all(), (err.max(), fb[np.argmax(err - fb)])
    assert err.max() > 0


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.integers(1, 90), st.sampled_from([(1, 1), (2, 1), (3, 1), (4, 2), (8, 1), (6, 2)]),
       st.sampled_from([(8, 8), (24, 40), (64, 64), (100, 72), (128, 128)]), st.integers(0, 140),
       st.sampled_from([0, 1, 7, 64]), st.sampled_from([0.0, 5.0]), st.booleans())
def test_twin_within_the_f32_bound_property(rows, hk, dims, pos, window, cap, sinks):
    """Any chunk (1-90 rows, positions 0-140, GQA 1-8, heads of 8-128 values, windows of 1 and 7, caps, sinks): the
    twin within f32_bound of the exact f32 path, finite."""
    heads, kv = hk
    tc, exact, arrays, weights = tc_attention_case(rows, heads, kv, *dims, pos, window, cap, sinks)
    assert tc.check() is None
    e1, e2 = host(arrays, weights), host(arrays, weights)
    exact.numpy(e1)
    tc.numpy(e2)
    err = np.abs(e2.array("o") - e1.array("o"))
    assert np.isfinite(e2.array("o")).all() and (err <= bounds(tc, e2)[1]).all()


def test_twin_one_key_and_one_hot_values_are_exact():
    """Row 0 at position 0 attends one key: its output is that value rounded to bf16, to the bit (p̂ = 1)."""
    tc, _, arrays, weights = tc_attention_case(5, 4, 2, 64, 64, 0)
    env = host(arrays, weights)
    tc.numpy(env)
    out = env.array("o").reshape(5, 4, 64)
    from lanefuse.kernels.gemm_tc import bf16_round

    v = arrays["vc"].reshape(-1, 2, 64)
    np.testing.assert_array_equal(out[0], bf16_round(v[0][[0, 0, 1, 1]]))


def test_refusals_in_words():
    tc = tc_attention_case(5, 4, 2, 64, 64, 0)[0]
    from dataclasses import replace

    assert "at most 128" in str(replace(tc, hd=192).check())
    assert "group evenly" in str(replace(tc, group=3).check())
    assert "soft cap" in str(replace(tc, softcap=-1.0).check())
    assert "gated by" in str(replace(tc, gate=("o", "relu")).check())


# -- the kernel, emulated -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def emulated():
    from cuda_host import emu

    if emu.compiler() is None:
        pytest.skip("no g++ to build the emulated kernels")
    with emu.emulating([AttentionTc.stem]) as env:
        yield env


def check_kernel(tc, arrays, weights, got):
    """The device's output against the twin's: within kernel_bound everywhere, and within the twin's f32_bound plus
    that of the f32 path."""
    env = host(arrays, weights)
    tc.numpy(env)
    want = env.array("o")
    kb, fb = bounds(tc, env)
    got = np.asarray(got).reshape(-1)
    err = np.abs(got - want)
    assert np.isfinite(got).all()
    bad = err > kb
    assert not bad.any(), (f"{int(bad.sum())} of {err.size} outside the kernel bound; worst at "
                           f"{int(np.argmax(err - kb))}: {got[np.argmax(err - kb)]} vs {want[np.argmax(err - kb)]}")
    return err, kb


@pytest.mark.parametrize("case", CASES)
def test_emulated_within_the_bound(emulated, case):
    tc, _, arrays, weights = tc_attention_case(*case)
    dev = emulated(0, {}, {k: v.copy() for k, v in arrays.items()}, weights)
    tc.cuda(dev)
    assert dev.calls[-1][0] == ("attention_tc_64" if max(case[3], case[4]) <= 64 else "attention_tc_128")
    assert dev.calls[-1][1] == (-(-case[0] * (case[1] // case[2]) // 64), case[2], 1)
    check_kernel(tc, arrays, weights, dev.host("o"))


def test_emulated_again_same_bits_and_one_hot(emulated):
    """Blocks in reverse order and threads shuffled between barriers: the same bits. Then keys all equal (every
    logit equal, p̂ = 1 after the first tile's max): each output is the mean of its rows' rounded values, which the
    kernel sums in f32 — close to the twin; and q one-hot against one key: a fragment taken from the wrong lane shows."""
    tc, _, arrays, weights = tc_attention_case(26, 4, 1, 64, 64, 40, sinks=True)
    dev = emulated(0, {}, {k: v.copy() for k, v in arrays.items()}, weights)
    tc.cuda(dev)
    first = dev.host("o").copy()
    dev.flags, dev.seed = 1, 4242
    tc.cuda(dev)
    np.testing.assert_array_equal(dev.host("o"), first)
    dev.flags, dev.seed = 0, 0
    check_kernel(tc, arrays, weights, first)


def test_emulated_picks_each_value(emulated):
    """Keys one-hot and a query that picks key j = row: each row's weight all on one key (logits 0 or 60 apart),
    so each output is the mean of the values (rounded to bf16) of the keys the row picks (keys j and j + 64 share a
    one-hot place): a value, lane or register out of place shows."""
    rows, heads, kv, hd, vd, pos = 20, 4, 2, 64, 64, 50
    tc, _, arrays, weights = tc_attention_case(rows, heads, kv, hd, vd, pos)
    L = pos + rows + 3
    keys = np.zeros((L, kv, hd), np.float32)
    keys[np.arange(L), :, np.arange(L) % hd] = 1.0
    q = np.zeros((rows, heads, hd), np.float32)
    want_key = (pos + np.arange(rows)) - np.arange(rows) % 7  # each row its own earlier key
    q[np.arange(rows), :, want_key % hd] = 60.0 / tc.scale
    arrays.update(kc=keys.reshape(-1), q=q.reshape(-1))
    dev = emulated(0, {}, {k: v.copy() for k, v in arrays.items()}, weights)
    tc.cuda(dev)
    from lanefuse.kernels.gemm_tc import bf16_round

    v = bf16_round(arrays["vc"].reshape(L, kv, vd))
    got = dev.host("o").reshape(rows, heads, vd)
    for r in range(rows):
        hit = [j for j in range(L) if j % hd == want_key[r] % hd and j <= pos + r]
        np.testing.assert_allclose(got[r], v[hit].sum(axis=0)[[0, 0, 1, 1]] / len(hit), rtol=2**-20, atol=1e-6)


# -- what the emulator must catch in the tile loads (each a mutated attention_tc.cu) ---------------------------------

@pytest.mark.parametrize("old,new,case", [
    # 16-byte loads: a value's two keys swapped in the transposed tile (case: heads of 64 in their own caches)
    ("*(unsigned*)&vt[d + 1][jj] = bf16x2(a.y, b.y);", "*(unsigned*)&vt[d + 1][jj] = bf16x2(b.y, a.y);", 0),
    # 16-byte loads: the second key's row one short of the tile's end (keys past the chunk read as zero)
    ("j + 1 < jhi && d < vd ?", "j + 2 < jhi && d < vd ?", 6),
    # 16-byte loads: a key's four values shifted by one word in shared memory
    ("*(uint2*)&ks[jj][d] = make_uint2(bf16x2(f.x, f.y), bf16x2(f.z, f.w));",
     "*(uint2*)&ks[jj][d] = make_uint2(bf16x2(f.y, f.x), bf16x2(f.z, f.w));", 3),
    # a value at a time (a table at an odd offset): one value of each pair dropped
    ("            if (d + 1 < vd) e = vr[d + 1];\n", "", 4),
])
@pytest.mark.forked
def test_the_emulator_catches_tile_load_mistakes(emulated, monkeypatch, old, new, case):
    """Each mistake in one of the two tile loads, on a case that takes that load: outside the kernel bound."""
    from lanefuse.kernels import compile as kc

    text = kc.cu_text("attention_tc")
    assert old in text, f"attention_tc.cu no longer holds {old!r}: update the mutation"
    real = kc.cu_text
    monkeypatch.setattr(kc, "cu_text", lambda stem: text.replace(old, new) if stem == "attention_tc" else real(stem))
    tc, _, arrays, weights = tc_attention_case(*CASES[case])
    dev = emulated(0, {}, {k: v.copy() for k, v in arrays.items()}, weights)
    tc.cuda(dev)
    with pytest.raises(AssertionError):
        check_kernel(tc, arrays, weights, dev.host("o"))
