"""The gated delta net's launch kinds (conv, conv_parts, delta, decay, l2norm, gates, gate_proj) and the gated
attention: each numpy twin against the reference interpreter's meaning of the lifted ops it computes, over sizes
hypothesis draws (rings and states rewritten in place); their refusals; and (marked gpu, skipped without a CUDA
device) each CUDA launch against its numpy twin."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lanefuse.engine.interp import OP_IMPL
from lanefuse.engine.refusal import Refusal
from lanefuse.kernels import (Attention, Conv, ConvParts, Decay, Delta, GateProj, Gates, HostEnv, L2Norm)
from lanefuse.kernels.conv_parts import ConvPart
from lanefuse.kernels.common import encode


def r32(g, *shape, scale=1.0):
    return (scale * g.standard_normal(shape)).astype(np.float32)


def silu(x):
    x = np.asarray(x, np.float64)
    return (x / (1 + np.exp(-x))).astype(np.float32)


def close(a, b, tol=2e-5):
    np.testing.assert_allclose(np.asarray(a).reshape(-1), np.asarray(b).reshape(-1), rtol=tol, atol=tol)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 6), heads=st.integers(1, 3), taps=st.integers(2, 5), silu_=st.booleans(),
       l2=st.booleans(), start=st.sampled_from([0, 5]), seed=st.integers(0, 999))
def test_conv_equals_the_lifted_ops(rows, heads, taps, silu_, l2, start, seed):
    """Channels start..start+C of each row of a wider x (one product's part), or x whole."""
    g = np.random.default_rng(seed)
    hd = 32
    c = heads * hd
    x, w, ring = r32(g, rows, c + 2 * start), r32(g, c, taps), r32(g, taps - 1, c)
    want_ring = ring.copy()
    want = OP_IMPL["causal_conv"](x, w, want_ring, taps=taps, start=start)
    if silu_:
        want = silu(want)
    if l2:
        want = OP_IMPL["l2norm"](want, heads=heads, eps=1e-6)
    env = HostEnv({"x": x, "ring": ring, "y": np.zeros(rows * c, np.float32)}, {"w": (w, "f32")})
    k = Conv("x", "w", "ring", "y", c, taps, rows, silu=silu_, l2=hd if l2 else 0, xpitch=c + 2 * start, xoff=start)
    assert k.check() is None
    k.numpy(env)
    close(env.array("y"), want)
    close(env.array("ring"), want_ring)  # the ring holds the last taps-1 inputs


def test_conv_parts_equal_each_convolution():
    g = np.random.default_rng(1)
    rows, taps = 3, 4
    chans = {"q": 64, "k": 64, "v": 96}
    arrays, weights, want = {}, {}, {}
    for n, c in chans.items():
        x, w, ring = r32(g, rows, c), r32(g, c, taps), r32(g, taps - 1, c)
        arrays.update({n: x, "r" + n: ring, "y" + n: np.zeros(rows * c, np.float32)})
        weights["w" + n] = (w, "f32")
        rr = ring.copy()
        y = silu(OP_IMPL["causal_conv"](x, w, rr, taps=taps))
        if n != "v":
            y = OP_IMPL["l2norm"](y, heads=c // 32, eps=1e-6)
        want[n] = (y, rr)
    k = ConvParts(tuple(ConvPart(n, "w" + n, "r" + n, "y" + n, c, l2=n != "v") for n, c in chans.items()), taps,
                  rows, silu=True, block=32)
    assert k.check() is None and k.grid_block()[0][0] == 2 + 2 + 3
    env = HostEnv(arrays, weights)
    k.numpy(env)
    for n in chans:
        close(env.array("y" + n), want[n][0])
        close(env.array("r" + n), want[n][1])


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 5), hk=st.integers(1, 2), group=st.integers(1, 3), dk=st.sampled_from([32, 64]),
       dv=st.sampled_from([32, 64]), seed=st.integers(0, 999))
def test_delta_equals_gated_delta(rows, hk, group, dk, dv, seed):
    g = np.random.default_rng(seed)
    hv = hk * group
    q = OP_IMPL["l2norm"](r32(g, rows, hk * dk), heads=hk, eps=1e-6)
    k = OP_IMPL["l2norm"](r32(g, rows, hk * dk), heads=hk, eps=1e-6)
    v, z = r32(g, rows, hv * dv), r32(g, rows, hv * dv + 7)  # z: values 3.. of wider rows
    beta = (1 / (1 + np.exp(-r32(g, rows, hv)))).astype(np.float32)
    gl = -np.abs(r32(g, rows, hv, scale=0.5))
    state, gn = r32(g, hv * dk, dv, scale=0.3), r32(g, dv, scale=0.2) + 1
    attrs = dict(hk=hk, hv=hv, dk=dk, dv=dv, scale=dk ** -0.5, eps=1e-6, zoff=3)
    want_state = state.copy()
    want = OP_IMPL["gated_delta"](q, k, v, z, beta, gl, want_state, gn, **attrs)
    env = HostEnv({"q": q, "k": k, "v": v, "z": z, "b": beta, "g": gl, "S": state,
                   "o": np.zeros(rows * hv * dv, np.float32)}, {"gn": (gn, "f32")})
    d = Delta("q", "k", "v", "z", "b", "g", "S", "gn", "o", hk, hv, dk, dv, rows, dk ** -0.5, 1e-6,
              zpitch=hv * dv + 7, zoff=3)
    assert d.check() is None
    d.numpy(env)
    close(env.array("o"), want, 1e-4)
    close(env.array("S"), want_state, 1e-4)


@pytest.mark.parametrize("words", [1, 2, 3])
def test_delta_quantizing_in_its_epilogue(words):
    """gdn_output_quant's launch: the delta rule's f32 output and state as without it, and the output rows'
    quantized form (3: the q8k form, blocks of 256 over four heads of 64), the words (sums) engine/formats/quantize.py makes
    of the values stored; the q8k form over heads a block of 256 does not hold whole refused in words."""
    from lanefuse.engine.formats.quantize import quantize

    g = np.random.default_rng(3)
    rows, hk, hv, dk, dv = 3, 2, 4, 32, 64
    arrays = {"q": r32(g, rows * hk * dk, scale=0.2), "k": r32(g, rows * hk * dk, scale=0.2),
              "v": r32(g, rows * hv * dv), "z": r32(g, rows * hv * dv), "b": np.abs(r32(g, rows * hv)) % 1,
              "g": -np.abs(r32(g, rows * hv, scale=0.3)), "S": r32(g, hv * dk * dv, scale=0.1),
              "o": np.zeros(rows * hv * dv, np.float32)}
    gn = {"gn": (r32(g, dv) + 1, "f32")}
    n = rows * hv * dv
    qf = (np.zeros(n, np.int8), {2: np.zeros(n, np.int8), 3: np.zeros(n // 16, np.int16)}.get(words),
          np.zeros(n // (256 if words == 3 else 32), np.float32))
    plain = HostEnv({k: v.copy() for k, v in arrays.items()}, gn)
    Delta("q", "k", "v", "z", "b", "g", "S", "gn", "o", hk, hv, dk, dv, rows, dk ** -0.5, 1e-6).numpy(plain)
    env = HostEnv({k: v.copy() for k, v in arrays.items()}, gn, {"oq": qf})
    d = Delta("q", "k", "v", "z", "b", "g", "S", "gn", "o", hk, hv, dk, dv, rows, dk ** -0.5, 1e-6, quant="oq",
              words=words)
    assert d.check() is None and "oq" in d.writes()
    d.numpy(env)
    assert np.array_equal(env.array("o"), plain.array("o")) and np.array_equal(env.array("S"), plain.array("S"))
    want = quantize(env.array("o").reshape(rows, hv * dv), words).parts()
    for a, b in zip(qf, want):
        assert (a is None) == (b is None) and (a is None or np.array_equal(a, b)), words
    why = Delta("q", "k", "v", "z", "b", "g", "S", "gn", "o", hk, 8, dk, 96, rows, 1.0, 1e-6, quant="oq",
                words=3).check()
    assert why is not None and "a block spans whole heads" in why.reason


def _delta_as_the_kernel(a, gn, hk, hv, dk, dv, rows, scale, eps):
    """delta.cu's arithmetic in f32, in its order (a thread a value column j, its loops over the key width in turn):
    the state column decayed and read against k and q in one pass, o = S^T q + d (k . q), the update's pass; the
    arrays' f32 words as the kernel reads them (a float64 array's bytes reinterpreted, as a device would)."""
    F = np.float32
    w = {n: (x if x.dtype == F else x.view(F)) for n, x in a.items()}
    S = w["S"][: hv * dk * dv].reshape(hv, dk, dv).copy()
    kh, at = np.arange(hv) // (hv // hk), np.arange(dk)
    out = np.zeros((rows, hv, dv), F)
    with np.errstate(all="ignore"):
        for r in range(rows):
            qs = w["q"][(r * hk + kh)[:, None] * dk + at] * F(scale)
            ks = w["k"][(r * hk + kh)[:, None] * dk + at]
            e = np.exp(w["g"][r * hv:(r + 1) * hv])[:, None]
            kv, sq, kq = np.zeros((hv, dv), F), np.zeros((hv, dv), F), np.zeros((hv, 1), F)
            for i in range(dk):
                S[:, i] *= e
                kv += S[:, i] * ks[:, i:i + 1]
                sq += S[:, i] * qs[:, i:i + 1]
                kq += ks[:, i:i + 1] * qs[:, i:i + 1]
            d = (w["v"][r * hv * dv:(r + 1) * hv * dv].reshape(hv, dv) - kv) * w["b"][r * hv:(r + 1) * hv, None]
            o = sq + d * kq
            for i in range(dk):
                S[:, i] += ks[:, i:i + 1] * d
            inv = F(1) / np.sqrt((o * o).sum(-1, keepdims=True, dtype=F) / F(dv) + F(eps))
            z = w["z"][r * hv * dv:(r + 1) * hv * dv].reshape(hv, dv)
            out[r] = o * inv * gn[:dv] * (z / (F(1) + np.exp(-z)))
    return out.reshape(-1), S.reshape(-1)


@pytest.mark.parametrize("rows,hk,hv,dk,dv", [(1, 16, 32, 128, 128), (5, 2, 4, 32, 64), (64, 1, 2, 64, 32)])
def test_delta_kernels_f32_arithmetic_is_within_the_gpu_tolerance(rows, hk, hv, dk, dv):
    """test_gpu_delta's inputs through delta.cu's f32 arithmetic (emulated) meet the exact twin at its tolerance,
    output and state; q and k made float64, as that test first made them (np.sqrt's float64 scalar, NEP 50), their
    bytes read as f32 give the H200's first run's inf and NaN state — and the device env refuses such an array."""
    g = np.random.default_rng(12)
    f64 = [(r32(g, rows, hk, dk) / np.sqrt(dk)).reshape(-1) for _ in range(2)]
    a = {"q": f64[0].astype(np.float32), "k": f64[1].astype(np.float32), "v": r32(g, rows * hv * dv),
         "z": r32(g, rows * hv * dv), "b": np.abs(r32(g, rows * hv)) % 1, "g": -np.abs(r32(g, rows * hv, scale=0.3)),
         "S": r32(g, hv * dk * dv, scale=0.1), "o": np.zeros(rows * hv * dv, np.float32)}
    gn = r32(g, dv) + 1
    env = HostEnv({k: v.copy() for k, v in a.items()}, {"gn": (gn, "f32")})
    Delta("q", "k", "v", "z", "b", "g", "S", "gn", "o", hk, hv, dk, dv, rows, dk ** -0.5, 1e-6).numpy(env)
    o, S = _delta_as_the_kernel(a, gn, hk, hv, dk, dv, rows, dk ** -0.5, 1e-6)
    np.testing.assert_allclose(o, env.array("o"), rtol=3e-4, atol=3e-4)
    np.testing.assert_allclose(S, env.array("S"), rtol=3e-4, atol=3e-4)
    assert f64[0].dtype == np.float64
    _, bad = _delta_as_the_kernel({**a, "q": f64[0], "k": f64[1]}, gn, hk, hv, dk, dv, rows, dk ** -0.5, 1e-6)
    assert not np.isfinite(bad).all()


def test_decay_gates_and_gate_proj_equal_the_lifted_ops():
    g = np.random.default_rng(2)
    rows, h, d = 3, 8, 40
    a, b = r32(g, rows, h, scale=8), r32(g, rows, h)  # a past softplus' threshold in places
    dt, al = r32(g, h), r32(g, h, scale=0.5)
    want_g = OP_IMPL["decay"](a, dt, al)
    want_b = (1 / (1 + np.exp(-b.astype(np.float64)))).astype(np.float32)
    vals = {"dt": (dt, "f32"), "al": (al, "f32")}
    env = HostEnv({"a": a, "b": b, "y": np.zeros(rows * h, np.float32), "beta": np.zeros(rows * h, np.float32)},
                  vals)
    Decay("a", "dt", "al", "y", rows * h, h).numpy(env)
    close(env.array("y"), want_g)
    env.arrays["y"][:] = 0
    Gates("b", "a", "dt", "al", "beta", "y", rows * h, h).numpy(env)
    close(env.array("y"), want_g)
    close(env.array("beta"), want_b)
    x, wb, wa = r32(g, rows, d), r32(g, h, d, scale=0.3), r32(g, h, d, scale=0.3)
    for fmt in ("f32", "bf16"):
        ewb, ewa = encode(wb, fmt), encode(wa, fmt)
        from lanefuse.kernels.common import decode

        pb = OP_IMPL["matmul"](x, decode(ewb, fmt).reshape(h, d))
        pa = OP_IMPL["matmul"](x, decode(ewa, fmt).reshape(h, d))
        env = HostEnv({"x": x, "beta": np.zeros(rows * h, np.float32), "y": np.zeros(rows * h, np.float32)},
                      {**vals, "wb": (ewb, fmt), "wa": (ewa, fmt)})
        GateProj("x", "wb", "wa", fmt, "dt", "al", "beta", "y", d, h, rows).numpy(env)
        close(env.array("beta"), (1 / (1 + np.exp(-pb.astype(np.float64)))).astype(np.float32))
        close(env.array("y"), OP_IMPL["decay"](pa, dt, al))


def test_l2norm_equals_the_lifted_op():
    g = np.random.default_rng(3)
    x = r32(g, 4, 96)
    env = HostEnv({"x": x, "y": np.zeros(4 * 96, np.float32)})
    L2Norm("x", "y", 4 * 3, 32, 1e-6).numpy(env)
    close(env.array("y"), OP_IMPL["l2norm"](x, heads=3, eps=1e-6))


@pytest.mark.parametrize("splits", [1, 3])
def test_gated_attention_equals_attention_then_the_gate(splits):
    g = np.random.default_rng(4)
    rows, heads, kv, hd, L, pos = 2, 4, 2, 16, 12, 5
    q, kc, vc = r32(g, rows, heads * hd), r32(g, L, kv * hd), r32(g, L, kv * hd)
    gate = r32(g, rows, heads * hd)
    arrays = {"q": q, "kc": kc, "vc": vc, "pos": np.array([pos], np.int32), "gate": gate,
              "o": np.zeros(rows * heads * hd, np.float32)}
    want = OP_IMPL["attention"](q, kc, vc, np.array([pos]), heads=heads, kv_heads=kv, hd=hd, vd=hd, scale=0.25)
    want = want * (1 / (1 + np.exp(-gate.astype(np.float64))))
    for twin in ("numpy", "fast"):
        env = HostEnv({k: v.copy() for k, v in arrays.items()})
        a = Attention("q", "kc", "vc", "pos", "o", heads, heads // kv, hd, hd, L, rows, 0.25, splits=splits,
                      gate=("gate", "sigmoid"))
        assert a.check() is None and "gate" in a.reads()
        getattr(a, twin)(env)
        close(env.array("o"), want, 1e-5)


def test_refusals_are_values_in_the_users_words():
    cases = [Conv("x", "w", "r", "y", 64, 1, 1), Conv("x", "w", "r", "y", 96, 4, 1, l2=48),
             Delta("q", "k", "v", "z", "b", "g", "S", "gn", "o", 2, 4, 48, 32, 1, 1.0, 1e-6),
             Delta("q", "k", "v", "z", "b", "g", "S", "gn", "o", 2, 4, 256, 32, 1, 1.0, 1e-6),
             Delta("q", "k", "v", "z", "b", "g", "S", "gn", "o", 2, 5, 32, 32, 1, 1.0, 1e-6),
             Delta("q", "k", "v", "z", "b", "g", "S", "gn", "o", 2, 4, 32, 512, 1, 1.0, 1e-6),
             ConvParts((), 4, 1), GateProj("x", "wb", "wa", "q4_k", "dt", "al", "b", "g", 40, 4, 1),
             Attention("q", "k", "v", "pos", "o", 4, 2, 8, 8, 8, 1, 1.0, gate=("g", "relu"))]
    for c in cases:
        why = c.check()
        assert isinstance(why, Refusal) and str(why), c
    assert "multiple of 32" in str(cases[2].check())


# -- the CUDA launches against their twins (GPU) -----------------------------------------------------------------

def _device() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False




@pytest.mark.gpu
@pytest.mark.skipif(not _device(), reason="no CUDA device")
@pytest.mark.parametrize("rows,taps,silu_,l2", [(1, 4, True, 128), (7, 4, True, 0), (64, 3, False, 0),
                                                (5, 2, True, 32)])
def test_gpu_conv(rows, taps, silu_, l2):
    from test_kernels_gpu import both

    g = np.random.default_rng(10)
    c = 256
    both(Conv("x", "w", "ring", "y", c, taps, rows, silu=silu_, l2=l2),
         {"x": r32(g, rows * c), "ring": r32(g, (taps - 1) * c), "y": np.zeros(rows * c, np.float32)},
         {"w": (r32(g, c * taps), "f32")})


@pytest.mark.gpu
@pytest.mark.skipif(not _device(), reason="no CUDA device")
@pytest.mark.parametrize("rows", [1, 9])
def test_gpu_conv_parts(rows):
    from test_kernels_gpu import both

    g = np.random.default_rng(11)
    taps, chans = 4, {"q": 256, "k": 256, "v": 512}
    arrays, weights = {}, {}
    for n, c in chans.items():
        arrays.update({n: r32(g, rows * c), "r" + n: r32(g, (taps - 1) * c), "y" + n: np.zeros(rows * c, np.float32)})
        weights["w" + n] = (r32(g, c * taps), "f32")
    both(ConvParts(tuple(ConvPart(n, "w" + n, "r" + n, "y" + n, c, l2=n != "v") for n, c in chans.items()), taps,
                   rows, block=128), arrays, weights)


@pytest.mark.gpu
@pytest.mark.skipif(not _device(), reason="no CUDA device")
@pytest.mark.parametrize("rows,hk,hv,dk,dv", [(1, 16, 32, 128, 128), (5, 2, 4, 32, 64), (64, 1, 2, 64, 32)])
def test_gpu_delta(rows, hk, hv, dk, dv):
    from test_kernels_gpu import both

    g = np.random.default_rng(12)
    # float32 over np.float32: over np.sqrt's float64 scalar numpy (NEP 50) makes q and k float64, whose bytes the
    # kernel reads as f32 words (garbage: the state all inf and NaN, the H200's first run)
    qk = lambda: (r32(g, rows, hk, dk) / np.float32(np.sqrt(dk))).reshape(-1)  # noqa: E731
    both(Delta("q", "k", "v", "z", "b", "g", "S", "gn", "o", hk, hv, dk, dv, rows, dk ** -0.5, 1e-6),
         {"q": qk(), "k": qk(), "v": r32(g, rows * hv * dv), "z": r32(g, rows * hv * dv),
          "b": np.abs(r32(g, rows * hv)) % 1, "g": -np.abs(r32(g, rows * hv, scale=0.3)),
          "S": r32(g, hv * dk * dv, scale=0.1), "o": np.zeros(rows * hv * dv, np.float32)},
         {"gn": (r32(g, dv) + 1, "f32")}, tol=3e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not _device(), reason="no CUDA device")
@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_gpu_gates(fmt):
    from test_kernels_gpu import both

    g = np.random.default_rng(13)
    rows, h, d = 3, 32, 2048
    vals = {"dt": (r32(g, h), "f32"), "al": (r32(g, h), "f32")}
    arrays = {"a": r32(g, rows * h, scale=8), "b": r32(g, rows * h), "x": r32(g, rows * d),
              "y": np.zeros(rows * h, np.float32), "beta": np.zeros(rows * h, np.float32)}
    both(Decay("a", "dt", "al", "y", rows * h, h), arrays, vals)
    both(Gates("b", "a", "dt", "al", "beta", "y", rows * h, h), arrays, vals)
    both(L2Norm("x", "y", rows * 2, 48, 1e-6), {"x": arrays["x"], "y": np.zeros(rows * d, np.float32)}, {})
    w = {"wb": (encode(r32(g, h, d, scale=0.02), fmt), fmt), "wa": (encode(r32(g, h, d, scale=0.02), fmt), fmt)}
    both(GateProj("x", "wb", "wa", fmt, "dt", "al", "beta", "y", d, h, rows), arrays, {**vals, **w})


@pytest.mark.gpu
@pytest.mark.skipif(not _device(), reason="no CUDA device")
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_gated_attention(splits):
    from test_kernels_gpu import both

    g = np.random.default_rng(14)
    rows, heads, kv, hd, L = 3, 16, 2, 256, 300
    both(Attention("q", "kc", "vc", "pos", "o", heads, heads // kv, hd, hd, L, rows, hd ** -0.5, splits=splits,
                   gate=("gate", "sigmoid")),
         {"q": r32(g, rows * heads * hd), "kc": r32(g, L * kv * hd), "vc": r32(g, L * kv * hd),
          "pos": np.array([200], np.int32), "gate": r32(g, rows * heads * hd),
          "o": np.zeros(rows * heads * hd, np.float32)}, {})
