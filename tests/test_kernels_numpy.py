"""Each launch kind's numpy twin against a hand-written numpy formula on random data: odd sizes, destinations in rows
of a table or parts of every unit, inputs read as parts, GQA, windows, sinks, splits, rows a warp. Every write goes
through the Env, so an element written where it should not be shows as a changed sentinel."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lanefuse.kernels import (KINDS, Advance, ArgMax, Attention, Binary, Dst, Fold, Gather, GemmPart, GemmParts,
                              Gemv, GemvF32, GemvGlu, HostEnv, Join, Norm, Part, PreNorm, Quant, Rope, RopeParts,
                              RopeSide, Scale, SetRow, Slice, SwiGlu, Unary, View)
from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import decode, encode

SENTINEL = -777.0


def rng(seed=0):
    return np.random.default_rng(seed)


def r32(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


def silu(x):
    return x / (1 + np.exp(-x))


def close(a, b, tol=2e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol)


def dst_case(kind, rows, n, g):
    """(Dst, the buffer's initial contents, a function giving the result's rows out of the buffer, the env extras)."""
    if kind == "own":
        return Dst("y"), np.full(rows * n, SENTINEL, np.float32), lambda b: b.reshape(rows, n), {}
    if kind == "table":
        L, p = rows + 5, 3
        buf = np.full(L * n, SENTINEL, np.float32)
        return (Dst("y", row="at", pitch=n), buf, lambda b: b.reshape(L, n)[p:p + rows],
                {"at": np.array([p], np.int32)})
    if kind == "fixed":
        L = rows + 2
        buf = np.full(L * n, SENTINEL, np.float32)
        return Dst("y", row=2, pitch=n), buf, lambda b: b.reshape(L, n)[2:2 + rows], {}
    # unit: a part of every row of a wider tensor
    w = n + 7
    buf = np.full(rows * w, SENTINEL, np.float32)
    return Dst("y", unit=Part(w, 4, n)), buf, lambda b: b.reshape(rows, w)[:, 4:4 + n], {}


def untouched(buf, view_rows):
    """Everything outside the result's place still holds the sentinel."""
    b = buf.copy()
    view_rows(b)[...] = SENTINEL
    assert np.all(b == SENTINEL), "a value was written outside the destination"


# -- gemv ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("m,k,n", [(1, 7, 5), (3, 64, 33), (9, 129, 17), (1, 256, 8)])
@pytest.mark.parametrize("per_warp,split", [(1, 1), (4, 1), (1, 3), (4, 2)])
@pytest.mark.parametrize("dst", ["own", "table", "unit"])
def test_gemv(fmt, m, k, n, per_warp, split, dst):
    if split > 1 and Gemv("x", "w", fmt, Dst("y"), k, n, m, split=split).check():
        pytest.skip("split leaves a chunk empty")
    g = rng(m * k + n)
    x, w, b = r32(g, m, k), r32(g, n, k), r32(g, n)
    raw = encode(w, fmt)
    d, buf, rows_of, extra = dst_case(dst, m, n, g)
    env = HostEnv({"x": x, "y": buf, **extra}, {"w": (raw, fmt), "b": (b, "f32")})
    Gemv("x", "w", fmt, d, k, n, m, bias="b", per_warp=per_warp, split=split).numpy(env)
    want = x.astype(np.float64) @ decode(raw, fmt).astype(np.float64).T + b
    out = env.array("y")
    close(rows_of(out), want, 1e-4)
    untouched(out, rows_of)


def test_gemv_f32_values():
    g = rng(1)
    x, w = r32(g, 2, 19), r32(g, 11, 19)
    env = HostEnv({"x": x, "y": np.zeros(22, np.float32)}, {"w": (w, "f32")})
    GemvF32("x", "w", Dst("y"), 19, 11, 2).numpy(env)
    close(env.array("y").reshape(2, 11), x.astype(np.float64) @ w.T, 1e-5)


# -- norm ----------------------------------------------------------------------------------------------------------

def rmsnorm(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("rows,cols,heads", [(1, 7, 1), (3, 96, 1), (2, 24, 3), (5, 33, 1)])
@pytest.mark.parametrize("add,pre,part,dst", [(False, False, False, "own"), (True, False, False, "own"),
                                              (True, True, False, "own"), (False, False, True, "unit"),
                                              (True, False, True, "table")])
def test_norm(rows, cols, heads, add, pre, part, dst):
    g = rng(rows * cols)
    hd = cols // heads
    x, a, w, pw = r32(g, rows, cols), r32(g, rows, cols), r32(g, hd), r32(g, cols)
    arrays = {"a": a, "s": np.zeros(rows * cols, np.float32)}
    if part:
        wide = r32(g, rows, cols + 9)
        wide[:, 5:5 + cols] = x
        arrays["x"] = wide
    else:
        arrays["x"] = x
    d, buf, rows_of, extra = dst_case(dst, rows, cols, g)
    arrays.update(y=buf, **extra)
    env = HostEnv(arrays, {"w": (w, "f32"), "pw": (pw, "f32")})
    launch = Norm("x", "w", "y", rows, cols, 1e-5, heads=heads, part=Part(cols + 9, 5, cols) if part else None,
                  add="a" if add else None, sum="s" if add else None, pre=PreNorm("pw", 1e-6) if pre else None,
                  into=d if dst != "own" else None)
    assert launch.check() is None
    launch.numpy(env)
    s = x.astype(np.float64)
    if add:
        s = s + (rmsnorm(a, pw, 1e-6) if pre else a)
        close(env.array("s").reshape(rows, cols), s)
    want = rmsnorm(s.reshape(rows, heads, hd), w, 1e-5).reshape(rows, cols)
    close(rows_of(env.array("y")), want, 1e-4)
    untouched(env.array("y"), rows_of)


# -- rope ----------------------------------------------------------------------------------------------------------

def rope_ref(x, cos, sin, pos, hd, rot):
    """HF rotate_half over the first `rot` values of each head: x (rows, heads, hd), tables (L, rot/2)."""
    rows = x.shape[0]
    c = np.concatenate([cos, cos], -1)[pos + np.arange(rows)][:, None, :]
    s = np.concatenate([sin, sin], -1)[pos + np.arange(rows)][:, None, :]
    xr = x[..., :rot].astype(np.float64)
    half = rot // 2
    rotated = np.concatenate([-xr[..., half:], xr[..., :half]], -1)
    y = x.astype(np.float64).copy()
    y[..., :rot] = xr * c + rotated * s
    return y


def tables(g, L, rot):
    ang = g.uniform(0, 6.28, (L, rot // 2))
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@pytest.mark.parametrize("rows,heads,hd,rot", [(1, 2, 8, 8), (3, 3, 10, 4), (2, 1, 64, 64), (4, 2, 6, 2)])
@pytest.mark.parametrize("norm,part,dst", [(False, False, "own"), (True, False, "table"), (True, True, "unit")])
def test_rope(rows, heads, hd, rot, norm, part, dst):
    g = rng(rows * hd + rot)
    L, pos, n = 16, 5, heads * hd
    x, nw = r32(g, rows, n), r32(g, hd)
    cos, sin = tables(g, L, rot)
    arrays = {"pos": np.array([pos], np.int32)}
    if part:
        wide = r32(g, rows, n + 6)
        wide[:, 2:2 + n] = x
        arrays["x"] = wide
    else:
        arrays["x"] = x
    d, buf, rows_of, extra = dst_case(dst, rows, n, g)
    arrays.update(y=buf, **extra)
    env = HostEnv(arrays, {"cos": (cos, "f32"), "sin": (sin, "f32"), "nw": (nw, "f32")})
    launch = Rope("x", "cos", "sin", "pos", d, rows, heads, hd, rot, part=Part(n + 6, 2, n) if part else None,
                  norm=("nw", 1e-6) if norm else None)
    assert launch.check() is None
    launch.numpy(env)
    xh = x.reshape(rows, heads, hd)
    if norm:
        xh = rmsnorm(xh, nw, 1e-6).astype(np.float32)
    want = rope_ref(xh, cos, sin, pos, hd, rot).reshape(rows, n)
    close(rows_of(env.array("y")), want, 1e-4)
    untouched(env.array("y"), rows_of)


def test_rope_parts_q_and_k_into_cache():
    g = rng(7)
    rows, hd, rot, L, pos = 2, 8, 6, 12, 4
    q, k = r32(g, rows, 4 * hd), r32(g, rows, 2 * hd)
    cos, sin = tables(g, L, rot)
    env = HostEnv({"q": q, "k": k, "qo": np.zeros(rows * 4 * hd, np.float32),
                   "kc": np.full(L * 2 * hd, SENTINEL, np.float32), "pos": np.array([pos], np.int32)},
                  {"cos": (cos, "f32"), "sin": (sin, "f32"), "kn": (r32(g, hd), "f32")})
    sides = (RopeSide("q", Dst("qo"), 4), RopeSide("k", Dst("kc", row="pos", pitch=2 * hd), 2, norm=("kn", 1e-6)))
    RopeParts(sides, "cos", "sin", "pos", rows, hd, rot).numpy(env)
    close(env.array("qo").reshape(rows, 4, hd), rope_ref(q.reshape(rows, 4, hd), cos, sin, pos, hd, rot), 1e-4)
    kn = rmsnorm(k.reshape(rows, 2, hd), env.weight("kn")[0], 1e-6).astype(np.float32)
    kc = env.array("kc").reshape(L, 2, hd)
    close(kc[pos:pos + rows], rope_ref(kn, cos, sin, pos, hd, rot), 1e-4)
    assert np.all(kc[:pos] == SENTINEL) and np.all(kc[pos + rows:] == SENTINEL)


# -- attention -----------------------------------------------------------------------------------------------------

def attention_ref(q, kc, vc, pos, heads, kv, hd, vd, scale, window=0, sinks=None):
    rows = q.shape[0]
    out = np.zeros((rows, heads, vd))
    K, V = kc.reshape(-1, kv, hd).astype(np.float64), vc.reshape(-1, kv, vd).astype(np.float64)
    for r in range(rows):
        p = pos + r
        lo = max(0, p - window + 1) if window else 0
        for h in range(heads):
            gk = h // (heads // kv)
            logit = K[lo:p + 1, gk] @ q[r, h].astype(np.float64) * scale
            z = logit if sinks is None else np.append(logit, sinks[h])
            e = np.exp(z - z.max())
            out[r, h] = e[:p + 1 - lo] @ V[lo:p + 1, gk] / e.sum()
    return out


@pytest.mark.parametrize("heads,kv,hd,vd", [(4, 2, 8, 8), (6, 1, 16, 6), (2, 2, 4, 10), (8, 2, 64, 64)])
@pytest.mark.parametrize("rows,pos", [(1, 0), (1, 13), (3, 9)])
@pytest.mark.parametrize("window,sinks,splits,per_block", [(0, False, 1, 1), (5, False, 1, 2), (0, True, 3, 1),
                                                           (4, True, 2, 2), (0, False, 7, 1)])
def test_attention(heads, kv, hd, vd, rows, pos, window, sinks, splits, per_block):
    if heads % per_block:
        pytest.skip("per_block does not divide the heads")
    g = rng(heads * hd + pos)
    L = 20
    q, kc, vc, sk = r32(g, rows, heads * hd), r32(g, L, kv * hd), r32(g, L, kv * vd), r32(g, heads)
    env = HostEnv({"q": q, "kc": kc, "vc": vc, "pos": np.array([pos], np.int32),
                   "o": np.zeros(rows * heads * vd, np.float32)}, {"sk": (sk, "f32")})
    a = Attention("q", "kc", "vc", "pos", "o", heads, heads // kv, hd, vd, L, rows, hd ** -0.5, window=window,
                  sinks="sk" if sinks else None, per_block=per_block, splits=splits)
    assert a.check() is None
    a.numpy(env)
    want = attention_ref(q.reshape(rows, heads, hd), kc, vc, pos, heads, kv, hd, vd, hd ** -0.5, window,
                         sk if sinks else None)
    close(env.array("o").reshape(rows, heads, vd), want, 1e-5)


def test_attention_values_in_the_key_rows():
    """vstride/voff: the values read in place as a part of every row of another table."""
    g = rng(3)
    heads, hd, vd, L, pos = 2, 8, 4, 10, 6
    kc = r32(g, L, hd)
    wide = r32(g, L, 3 + vd)
    env = HostEnv({"q": r32(g, 1, heads * hd), "kc": kc, "vc": wide, "pos": np.array([pos], np.int32),
                   "o": np.zeros(heads * vd, np.float32)})
    Attention("q", "kc", "vc", "pos", "o", heads, heads, hd, vd, L, 1, 0.3, vstride=3 + vd, voff=3).numpy(env)
    want = attention_ref(env.array("q").reshape(1, heads, hd), kc, wide[:, 3:], pos, heads, 1, hd, vd, 0.3)
    close(env.array("o").reshape(1, heads, vd), want, 1e-5)


def test_attention_refuses_wide_heads_and_unknown_gates():
    """Heads up to 256 values in the main kernel, to 640 one a block in the wide one (a latent attention's), wider
    refused; an output gated by sigmoid (attn_output_gate), by another activation refused."""
    assert Attention("q", "k", "v", "pos", "o", 4, 2, 512, 512, 8, 1, 1.0).check() is None
    assert "one" in Attention("q", "k", "v", "pos", "o", 4, 2, 576, 512, 8, 1, 1.0, per_block=2).check().reason
    assert "wider" in Attention("q", "k", "v", "pos", "o", 4, 2, 704, 512, 8, 1, 1.0).check().reason
    relu = Attention("q", "k", "v", "pos", "o", 4, 2, 8, 8, 8, 1, 1.0, gate=("g", "relu"))
    assert "gated by `relu`" in relu.check().reason
    assert Attention("q", "k", "v", "pos", "o", 4, 2, 8, 8, 8, 1, 1.0, gate=("g", "sigmoid")).check() is None


# -- elementwise ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["add", "mul", "sub"])
@pytest.mark.parametrize("row", [0, 13])
@pytest.mark.parametrize("gate", [None, "silu", "sigmoid", "gelu"])
def test_binary(op, row, gate):
    g = rng(row)
    n = 39
    a, b = r32(g, n), r32(g, row or n)
    env = HostEnv({"a": a, "b": b, "o": np.zeros(n, np.float32)})
    Binary(op, "a", "b", "o", n, row=row, gate=gate).numpy(env)
    bb = np.tile(b, n // row).astype(np.float64) if row else b.astype(np.float64)
    acts = {None: lambda v: v, "silu": silu, "sigmoid": lambda v: 1 / (1 + np.exp(-v)),
            "gelu": lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))}
    bb = acts[gate](bb)
    want = {"add": a + bb, "mul": a * bb, "sub": a - bb}[op]
    close(env.array("o"), want, 1e-5)


def test_binary_broadcasts_a_constant_row():
    g = rng(2)
    a, b = r32(g, 3, 5), r32(g, 5)
    env = HostEnv({"a": a, "o": np.zeros(15, np.float32)}, {"b": (b, "f32")})
    Binary("add", "a", "b", "o", 15, row=5).numpy(env)
    close(env.array("o").reshape(3, 5), a + b)


def test_swiglu_unary_scale():
    g = rng(4)
    x, u = r32(g, 37), r32(g, 37)
    env = HostEnv({"x": x, "u": u, "o": np.zeros(37, np.float32), "s": np.zeros(37, np.float32),
                   "t": np.zeros(37, np.float32)})
    SwiGlu("x", "u", "o", 37).numpy(env)
    close(env.array("o"), silu(x.astype(np.float64)) * u)
    Unary("sigmoid", "x", "s", 37).numpy(env)
    close(env.array("s"), 1 / (1 + np.exp(-x.astype(np.float64))))
    Scale("x", "t", 37, 0.125).numpy(env)
    close(env.array("t"), x * 0.125, 0)


def test_slice_and_join():
    g = rng(5)
    x = r32(g, 4, 10)
    env = HostEnv({"x": x, "y": np.zeros(12, np.float32), "j": np.full(2 * 3 * 7 + 5, SENTINEL, np.float32)})
    Slice("x", "y", 4, 10, 6, 3).numpy(env)
    close(env.array("y").reshape(4, 3), x[:, 6:9], 0)
    a, b = r32(g, 2, 3 * 4), r32(g, 2, 3 * 3)
    env.arrays.update(a=a.reshape(-1), b=b.reshape(-1))
    Join("a", "b", Dst("j"), 2, 3, 4, 3).numpy(env)
    want = np.concatenate([a.reshape(6, 4), b.reshape(6, 3)], 1).reshape(-1)
    close(env.array("j")[:42], want, 0)
    assert np.all(env.array("j")[42:] == SENTINEL)


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("scale", [None, 2.5])
def test_gather(fmt, scale):
    g = rng(6)
    table = r32(g, 11, 9)
    raw = encode(table, fmt)
    idx = np.array([3, 0, 10], np.int32)
    env = HostEnv({"t": idx, "o": np.zeros(27, np.float32)}, {"E": (raw, fmt)})
    Gather("E", "t", "o", 9, rows=3, format=fmt, scale=scale).numpy(env)
    want = decode(raw, fmt)[idx] * (scale or 1.0)
    close(env.array("o").reshape(3, 9), want, 0)


@pytest.mark.parametrize("row", ["pos", 1, 6])
def test_set_row(row):
    g = rng(8)
    L, c, cnt = 8, 5, 3
    src = r32(g, cnt, c)
    env = HostEnv({"T": np.full(L * c, SENTINEL, np.float32), "src": src, "pos": np.array([2], np.int32)})
    SetRow("T", "src", row, c, cnt, L).numpy(env)
    r0 = 2 if row == "pos" else row
    want = np.full((L, c), SENTINEL, np.float32)
    keep = min(cnt, L - r0)
    want[r0:r0 + keep] = src[:keep]
    close(env.array("T").reshape(L, c), want, 0)


@pytest.mark.parametrize("rows,n", [(1, 5), (1, 5000), (3, 2049)])
def test_argmax_with_ties_and_advance(rows, n):
    g = rng(n)
    x = r32(g, rows, n)
    x[-1, n // 3] = x[-1, n // 2] = 99.0  # a tie: the first index wins
    env = HostEnv({"x": x, "o": np.zeros(rows, np.int32), "tok": np.zeros(1, np.int32),
                   "pos": np.array([7], np.int32)})
    ArgMax("x", "o", n, rows, advance=Advance("tok", "pos", step=rows)).numpy(env)
    want = [int(np.argmax(r)) for r in x]
    assert list(env.array("o")) == want and want[-1] == n // 3
    assert env.array("tok")[0] == n // 3 and env.array("pos")[0] == 7 + rows


def test_argmax_takes_numpys_nan_and_infinity_rules():
    """The twin is numpy's argmax: a NaN is above every number (the first NaN wins), and a row of -inf picks 0; the
    kernel's comparison (argmax.cu am_better) is written to agree."""
    n = 4100
    x = np.zeros((4, n), np.float32)
    x[0, 5] = 3.0
    x[0, [9, 4000]] = np.nan  # NaN beats the larger number before it; the first NaN wins
    x[1] = -np.inf
    x[2, [7, 3000]] = np.inf  # +inf ties: the first
    x[3, 2] = np.nan
    x[3, 4090] = np.inf
    env = HostEnv({"x": x, "o": np.zeros(4, np.int32)})
    ArgMax("x", "o", n, 4).numpy(env)
    assert list(env.array("o")) == [9, 0, 7, 2] == [int(np.argmax(r)) for r in x]


def test_launches_refuse_grids_past_the_limits():
    """Rows and splits are grid y and z (at most 65535 blocks each): past that a launch refuses, with the reason."""
    assert "65535" in Attention("q", "k", "v", "pos", "o", 8, 2, 64, 64, 128, 70000, 0.1).check().reason
    assert "65535" in Attention("q", "k", "v", "pos", "o", 8, 2, 64, 64, 128, 1, 0.1, splits=70000).check().reason
    assert "65535" in ArgMax("x", "o", 10, rows=70000).check().reason
    assert ArgMax("x", "o", 0).check() and ArgMax("x", "o", 151936, rows=64).check() is None
    assert "65535" in Gemv("x", "w", "f32", Dst("y"), 4 * 70000, 8, 1, split=70000).check().reason
    assert "65535" in Gemv("x", "w", "f32", Dst("y"), 64, 8, 8 * 65536).check().reason
    assert Gemv("x", "w", "f32", Dst("y"), 4096, 8, 64, split=32).check() is None


# -- products in parts, the GLU, folds -------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("per_warp", [1, 4])
def test_gemv_glu(fmt, per_warp):
    g = rng(9)
    m, k, n = 3, 21, 13
    x, wg, wu, bg = r32(g, m, k), r32(g, n, k), r32(g, n, k), r32(g, n)
    env = HostEnv({"x": x, "o": np.zeros(m * n, np.float32)},
                  {"wg": (encode(wg, fmt), fmt), "wu": (encode(wu, fmt), fmt), "bg": (bg, "f32")})
    GemvGlu("x", "wg", "wu", fmt, "o", k, n, m, bg="bg", per_warp=per_warp).numpy(env)
    G = x.astype(np.float64) @ decode(encode(wg, fmt), fmt).T + bg
    U = x.astype(np.float64) @ decode(encode(wu, fmt), fmt).T
    close(env.array("o").reshape(m, n), silu(G) * U, 1e-4)


def test_gemm_parts_into_one_wide_tensor():
    """merged_qkv: q, k, v products landing as parts of every row of one (rows, q+k+v) tensor, k also in a cache."""
    g = rng(10)
    m, k, nq, nk = 2, 17, 12, 4
    x = r32(g, m, k)
    wq, wk, wv, bq = r32(g, nq, k), r32(g, nk, k), r32(g, nk, k), r32(g, nq)
    W = nq + 2 * nk
    L = 6
    env = HostEnv({"x": x, "qkv": np.full(m * W, SENTINEL, np.float32), "kc": np.full(L * nk, SENTINEL, np.float32),
                   "pos": np.array([3], np.int32)},
                  {"wq": (wq, "f32"), "wk": (wk, "f32"), "wv": (wv, "f32"), "bq": (bq, "f32")})
    parts = (GemmPart("wq", Dst("qkv", unit=Part(W, 0, nq)), nq, bias="bq"),
             GemmPart("wk", Dst("kc", row="pos", pitch=nk), nk),
             GemmPart("wv", Dst("qkv", unit=Part(W, nq + nk, nk)), nk))
    GemmParts("x", "f32", k, m, parts, per_warp=4).numpy(env)
    y = env.array("qkv").reshape(m, W)
    x64 = x.astype(np.float64)
    close(y[:, :nq], x64 @ wq.T + bq)
    close(y[:, nq + nk:], x64 @ wv.T)
    assert np.all(y[:, nq:nq + nk] == SENTINEL)
    close(env.array("kc").reshape(L, nk)[3:5], x64 @ wk.T)


def test_fold_gemv_then_add_norm():
    g = rng(11)
    m, k, n = 1, 40, 24
    x, w, res, nw = r32(g, m, k), r32(g, n, k), r32(g, m, n), r32(g, n)
    env = HostEnv({"x": x, "o": np.zeros(n, np.float32), "res": res, "sum": np.zeros(n, np.float32),
                   "y": np.zeros(n, np.float32)}, {"w": (w, "f32"), "nw": (nw, "f32")})
    f = Fold(Gemv("x", "w", "f32", Dst("o"), k, n, m, per_warp=4),
             Norm("res", "nw", "y", m, n, 1e-6, add="o", sum="sum"))
    assert f.fused and [s.counter for s in f.scratch()] == [True]
    f.numpy(env)
    o = x.astype(np.float64) @ w.T
    close(env.array("sum"), (res + o).reshape(-1))
    close(env.array("y"), rmsnorm(res + o, nw, 1e-6).reshape(-1), 1e-4)


def test_the_lanes_folds_are_each_one_kernel():
    """Every fold the lane plans for the demo step (the head epilogue of q/k/v in parts, the GEMV-then-norms, the LM
    head then the arg-max) runs as one kernel: the decode step's launches are the kernels it runs."""
    from lanefuse.engine.front.demo import demo_config
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan

    # (at 5 rows the q/k/v products and their rotation a parts_rope fold too: the first phase of each chained layer
    # but the last, whose products run as gemm_parts and rotation as rope_parts)
    for rows, forms in ((1, {"gather_norm", "parts_rope", "gemv_norm", "gemv_argmax"}),
                        (5, {"gather_norm", "parts_rope", "gemv_norm", "gemv_argmax"})):
        s = plan(build_step(demo_config(), rows))
        folds = [f for x in s.launches for f in getattr(x.launch, "phases", (x.launch,)) if isinstance(f, Fold)]
        # (at one row the o and down products' folds are phases of each layer's chained launch, o_glu_down_norm)
        assert {f.form()[0] for f in folds} == forms
        for f in folds:
            assert f.fused, (f.form()[1], f.describe())
            assert f.check() is None


def qkv_fold(m=2, hd=8, heads=3, kv=1, norm=True, pw=1, fmt="f32"):
    """q/k/v of one activation in parts, q and k normed and rotated (k into a cache row), v into its cache row."""
    parts = (GemmPart("wq", Dst("q"), heads * hd, bias="bq"), GemmPart("wk", Dst("k"), kv * hd),
             GemmPart("wv", Dst("vc", row="pos", pitch=kv * hd), kv * hd))
    sides = (RopeSide("q", Dst("qr"), heads, norm=("qn", 1e-6) if norm else None),
             RopeSide("k", Dst("kc", row="pos", pitch=kv * hd), kv, norm=("kn", 1e-6) if norm else None))
    return Fold(GemmParts("x", fmt, 24, m, parts, per_warp=pw), RopeParts(sides, "cos", "sin", "pos", m, hd, hd))


def test_fold_products_then_head_epilogue_is_first_then_then():
    g = rng(12)
    m, hd, heads, kv, L, pos = 2, 8, 3, 1, 9, 4
    f = qkv_fold(m, hd, heads, kv)
    assert f.fused and f.form()[0] == "parts_rope"
    (sc,) = f.scratch()
    assert sc.counter and sc.nbytes == 4 * (heads + kv) * 1  # a counter a rotated head and a slab of rows
    assert f.grid_block() == f.first.grid_block()
    ang = g.uniform(0, 6.28, (L, hd // 2))
    arrays = lambda: {"x": r32(g, m, 24), "q": np.zeros(m * heads * hd, np.float32),  # noqa: E731
                      "k": np.zeros(m * kv * hd, np.float32), "qr": np.zeros(m * heads * hd, np.float32),
                      "kc": np.zeros(L * kv * hd, np.float32), "vc": np.zeros(L * kv * hd, np.float32),
                      "pos": np.array([pos], np.int32)}
    weights = {"wq": (r32(g, heads * hd, 24), "f32"), "wk": (r32(g, kv * hd, 24), "f32"),
               "wv": (r32(g, kv * hd, 24), "f32"), "bq": (r32(g, heads * hd), "f32"), "qn": (r32(g, hd), "f32"),
               "kn": (r32(g, hd), "f32"), "cos": (np.cos(ang).astype(np.float32), "f32"),
               "sin": (np.sin(ang).astype(np.float32), "f32")}
    a = arrays()
    one, two = HostEnv({k: v.copy() for k, v in a.items()}, weights), HostEnv(a, weights)
    f.numpy(one)
    f.first.numpy(two)
    f.then.numpy(two)
    for name in a:
        assert np.array_equal(one.array(name), two.array(name)), name
    q = a["x"].astype(np.float64) @ weights["wq"][0].T.astype(np.float64) + weights["bq"][0]
    close(one.array("q"), q.reshape(-1), 1e-4)
    qh = q.reshape(m, heads, hd)
    qh = qh / np.sqrt(np.mean(qh * qh, -1, keepdims=True) + 1e-6) * weights["qn"][0]
    c = np.cos(ang)[pos:pos + m][:, None, :]
    sn = np.sin(ang)[pos:pos + m][:, None, :]
    h = hd // 2
    want = np.concatenate([qh[..., :h] * c - qh[..., h:] * sn, qh[..., h:] * c + qh[..., :h] * sn], -1)
    close(one.array("qr").reshape(m, heads, hd), want, 1e-4)


def test_folds_that_stay_two_kernels_say_why():
    f = qkv_fold()
    gp, rp = f.first, f.then
    cases = {
        "not exactly one product": replace(f, then=replace(rp, sides=(replace(rp.sides[0], x="other"),))),
        "rows": replace(f, then=replace(rp, rows=3)),
        "which the products write": replace(f, then=replace(rp, sides=(replace(rp.sides[0], y=Dst("k")),))),
        "split 2 ways": Fold(Gemv("x", "wq", "f32", Dst("q"), 24, 24, 2, split=2),
                             Rope("q", "cos", "sin", "pos", Dst("qr"), 2, 3, 8, 8)),
        "not the gathered": Fold(Gather("E", "t", "e", 8), Norm("other", "nw", "y", 1, 8, 1e-6)),
        "no kernel runs a gemv_glu then a norm": Fold(GemvGlu("x", "wg", "wu", "f32", "o", 4, 8, 1),
                                                      Norm("o", "nw", "y", 1, 8, 1e-6)),
    }
    for why, fold in cases.items():
        form, reason = fold.form()
        assert form is None and not fold.fused and why in reason.reason, (why, reason)
        assert all(s.tag.startswith(("first.", "then.")) for s in fold.scratch())
    # a v part rotated too, written as a part of every row of one wide tensor next to q: still one kernel
    W = 24 + 8
    wide = replace(f, first=replace(gp, parts=(replace(gp.parts[0], y=Dst("qk", unit=Part(W, 0, 24))),
                                               replace(gp.parts[1], y=Dst("qk", unit=Part(W, 24, 8))), gp.parts[2])),
                   then=replace(rp, sides=(replace(rp.sides[0], x="qk", part=Part(W, 0, 24)),
                                           replace(rp.sides[1], x="qk", part=Part(W, 24, 8)))))
    assert wide.fused, wide.form()
    overlap = replace(wide, first=replace(wide.first, parts=(wide.first.parts[0],
                                                             replace(gp.parts[1], y=Dst("qk", unit=Part(W, 20, 8))),
                                                             gp.parts[2])))
    assert not overlap.fused and "overlapping" in overlap.form()[1].reason


def latent_fold(m=2, qa=24, lat=16, hd=8, L=9, fmt="f32", pw=1):
    """DeepSeek-V3's first product as the lane makes it: q_a, the latent and the rotated key of one activation in
    parts; q_a's and the latent's rows normed in the epilogue (a side of one head of the part's width, no rotation),
    the latent's into its cache row; the key rotated into its cache row."""
    parts = (GemmPart("wqa", Dst("qa"), qa), GemmPart("wl", Dst("lat"), lat), GemmPart("wk", Dst("kp"), hd))
    sides = (RopeSide("qa", Dst("qan"), 1, norm=("na", 1e-6), hd=qa, rot=0),
             RopeSide("lat", Dst("lc", row="pos", pitch=lat), 1, norm=("nl", 1e-6), hd=lat, rot=0),
             RopeSide("kp", Dst("kc", row="pos", pitch=hd), 1))
    return Fold(GemmParts("x", fmt, 20, m, parts, per_warp=pw), RopeParts(sides, "cos", "sin", "pos", m, hd, hd))


def fold_twin_is_first_then(f, arrays, weights) -> HostEnv:
    """Run the fold's numpy twin and, apart, its `first` then its `then` on copies of the same inputs; every array must
    be equal. The fold's env is returned."""
    one, two = (HostEnv({k: v.copy() for k, v in arrays.items()}, weights) for _ in range(2))
    f.numpy(one)
    f.first.numpy(two)
    f.then.numpy(two)
    for name in arrays:
        assert np.array_equal(one.array(name), two.array(name)), name
    return one


def absorbing_fold(m=2, heads=4, nope=10, rope=8, lora=16, fmt="f32", pw=1, rows_out=False, k=20):
    """DeepSeek-V3's q_b product as the lane makes it (merged_pair.rotated_absorbed): each head's unrotated query part
    and its rotated part in parts; in the epilogue each head of the unrotated part times its own key-expansion rows
    (into latent space: `lora` outputs a head), the rotated part rotated."""
    from lanefuse.kernels import Absorb

    parts = (GemmPart("wn", Dst("qn"), heads * nope), GemmPart("wr", Dst("qp"), heads * rope))
    sides = (RopeSide("qn", Dst("ql"), heads, hd=nope, rot=0, absorb=Absorb("wk", fmt, lora, rows_out)),
             RopeSide("qp", Dst("qr"), heads))
    return Fold(GemmParts("x", fmt, k, m, parts, per_warp=pw), RopeParts(sides, "cos", "sin", "pos", m, rope, rope))


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8_0"])
@pytest.mark.parametrize("m,pw,rows_out", [(1, 1, False), (3, 4, False), (2, 1, True)])
def test_fold_products_then_absorbed_and_rotated_heads(fmt, m, pw, rows_out):
    """The fold of q_b's products with the query's absorption in its epilogue: one kernel; its twin is `first` then
    `then`, each head's unrotated part times its own matrix (any layout: rows the inputs' or the outputs'), the rotated
    part rotated; both twins against explicit formulas."""
    g = rng(31 + m)
    heads, nope, rope, lora, k, pos, L = 4, 32, 8, 32, 64, 3, 9
    f = absorbing_fold(m, heads, nope, rope, lora, fmt, pw, rows_out, k)
    assert f.fused and f.form()[0] == "parts_rope" and f.check() is None, (f.form(), f.check())
    (sc,) = f.scratch()
    assert sc.nbytes == 4 * 2 * heads  # a counter a side's head and a slab of rows
    wk = r32(g, heads * lora, nope) if rows_out else r32(g, heads * nope, lora)
    ang = g.uniform(0, 6.28, (L, rope // 2))
    arrays = {"x": r32(g, m, k), "qn": np.zeros(m * heads * nope, np.float32),
              "qp": np.zeros(m * heads * rope, np.float32), "ql": np.full(m * heads * lora, SENTINEL, np.float32),
              "qr": np.zeros(m * heads * rope, np.float32), "pos": np.array([pos], np.int32)}
    weights = {"wn": (encode(r32(g, heads * nope, k), fmt), fmt), "wr": (encode(r32(g, heads * rope, k), fmt), fmt),
               "wk": (encode(wk, fmt), fmt),
               "cos": (np.cos(ang).astype(np.float32), "f32"), "sin": (np.sin(ang).astype(np.float32), "f32")}
    one = fold_twin_is_first_then(f, arrays, weights)
    x = arrays["x"].astype(np.float64)
    qn = (x @ decode(weights["wn"][0], fmt).astype(np.float64).T).astype(np.float32).reshape(m, heads, nope)
    w = decode(weights["wk"][0], fmt).astype(np.float64)
    w = w.reshape(heads, lora, nope).transpose(0, 2, 1) if rows_out else w.reshape(heads, nope, lora)
    want = np.einsum("rhi,hij->rhj", qn.astype(np.float64), w)
    close(one.array("ql").reshape(m, heads, lora), want, 1e-5)
    fast = HostEnv({k_: v.copy() for k_, v in arrays.items()}, weights)
    f.fast(fast)
    close(fast.array("ql").reshape(m, heads, lora), want, 1e-4)
    close(fast.array("qr"), one.array("qr"), 1e-4)
    assert f.checkpoint_bytes() == f.first.checkpoint_bytes() + weights["wk"][0].nbytes
    assert f.weights()["wk"] == fmt and "wk" in f.reads() and "ql" in f.writes()


def test_an_absorbing_side_runs_only_in_its_products_epilogue():
    """An absorbing side outside a products-in-parts fold, after a norm or a rotation, or over rows its format cannot
    decode: refused in words."""
    from lanefuse.kernels import Absorb

    f = absorbing_fold()
    side = f.then.sides[0]
    assert "outside its products' epilogue" in str(replace(f.then, sides=(side,)).check())
    for bad in (replace(side, norm=("nw", 1e-6)), replace(side, rot=8), replace(side, part=Part(80, 0, 40))):
        assert "after a norm, a rotation" in str(replace(f.then, sides=(bad, f.then.sides[1])).check(epilogue=True))
    q = replace(side, absorb=Absorb("wk", "q8_0", 20))  # rows of 20 values: not whole blocks of 32
    assert "whole blocks" in str(replace(f.then, sides=(q, f.then.sides[1])).check(epilogue=True))


@pytest.mark.parametrize("m,pw", [(1, 1), (3, 4)])
def test_fold_products_then_row_norms_and_a_rotation(m, pw):
    """The fold of DeepSeek-V3's first product: one kernel; its twin is `first` then `then`, q_a and the latent
    RMS-normed whole (each its own width), the latent landing in its cache row, the key rotated into its row."""
    g = rng(21 + m)
    qa, lat, hd, L, pos = 24, 16, 8, 9, 3
    f = latent_fold(m, qa, lat, hd, L, pw=pw)
    assert f.fused and f.form()[0] == "parts_rope" and f.check() is None, f.form()
    (sc,) = f.scratch()
    assert sc.nbytes == 4 * 3  # a counter a side's head (one each) and a slab of rows
    ang = g.uniform(0, 6.28, (L, hd // 2))
    arrays = {"x": r32(g, m, 20), "qa": np.zeros(m * qa, np.float32), "lat": np.zeros(m * lat, np.float32),
              "kp": np.zeros(m * hd, np.float32), "qan": np.zeros(m * qa, np.float32),
              "lc": r32(g, L, lat), "kc": r32(g, L, hd), "pos": np.array([pos], np.int32)}
    weights = {"wqa": (r32(g, qa, 20), "f32"), "wl": (r32(g, lat, 20), "f32"), "wk": (r32(g, hd, 20), "f32"),
               "na": (r32(g, qa), "f32"), "nl": (r32(g, lat), "f32"),
               "cos": (np.cos(ang).astype(np.float32), "f32"), "sin": (np.sin(ang).astype(np.float32), "f32")}
    one = fold_twin_is_first_then(f, arrays, weights)
    x = arrays["x"].astype(np.float64)
    a, lt = x @ weights["wqa"][0].T, x @ weights["wl"][0].T
    close(one.array("qan").reshape(m, qa), rmsnorm(a, weights["na"][0], 1e-6), 1e-4)
    lc = arrays["lc"].copy()
    lc[pos:pos + m] = rmsnorm(lt, weights["nl"][0], 1e-6)
    close(one.array("lc").reshape(L, lat), lc, 1e-4)
    k = x @ weights["wk"][0].T
    c, sn, h = np.cos(ang)[pos:pos + m], np.sin(ang)[pos:pos + m], hd // 2
    kc = arrays["kc"].copy()
    kc[pos:pos + m] = np.concatenate([k[:, :h] * c - k[:, h:] * sn, k[:, h:] * c + k[:, :h] * sn], -1)
    close(one.array("kc").reshape(L, hd), kc, 1e-4)
    fast = HostEnv({k: v.copy() for k, v in arrays.items()}, weights)
    f.fast(fast)
    for name in arrays:
        close(fast.array(name), one.array(name), 1e-5)


def test_row_norm_sides_run_only_in_a_products_epilogue():
    """A side of its own head shape (a row norm alone) is the products-in-parts fold's alone: rope.cu's rotation in
    parts refuses it, and so does the fold where its pair runs as two kernels; a side neither normed nor rotated is
    refused; a row norm whose width is not its part's is not that part's epilogue."""
    f = latent_fold()
    gp, rp = f.first, f.then
    assert "outside its products' epilogue" in rp.check().reason
    two = replace(f, then=replace(rp, rows=3))
    assert not two.fused and "outside its products' epilogue" in two.check().reason
    bare = replace(f, then=replace(rp, sides=(replace(rp.sides[0], norm=None), *rp.sides[1:])))
    assert not bare.fused and "neither normed nor rotated" in bare.form()[1].reason
    wrong = replace(f, then=replace(rp, sides=(replace(rp.sides[0], hd=12), *rp.sides[1:])))
    assert not wrong.fused and "not exactly one product's result" in wrong.form()[1].reason
    assert f.bytes() == gp.bytes() + 4 * (2 * 2 * (24 + 16 + 8) + 2 * 8)


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_fold_gather_then_norm(fmt):
    g = rng(13)
    V, cols, rows = 11, 40, 3
    table = r32(g, V, cols)
    nw = r32(g, cols)
    f = Fold(Gather("E", "t", "e", cols, rows=rows, format=fmt, scale=1.5), Norm("e", "nw", "y", rows, cols, 1e-6))
    assert f.fused and f.form()[0] == "gather_norm" and f.scratch() == ()
    assert f.grid_block() == ((rows, 1, 1), (64, 1, 1))
    env = HostEnv({"t": np.array([10, 0, 4], np.int32), "e": np.zeros(rows * cols, np.float32),
                   "y": np.zeros(rows * cols, np.float32)}, {"E": (encode(table, fmt), fmt), "nw": (nw, "f32")})
    f.numpy(env)
    e = decode(encode(table, fmt), fmt)[[10, 0, 4]] * 1.5
    close(env.array("e"), e.reshape(-1))
    close(env.array("y"), rmsnorm(e, nw, 1e-6).reshape(-1), 1e-4)


def test_view_runs_nothing_and_quant_refuses_partial_blocks():
    env = HostEnv({"x": np.ones(4, np.float32)})
    View("x", 2, "v").numpy(env)
    assert Quant("x", "xq", 64).check() is None  # its twin: tests/test_quant_lane.py
    assert Quant("x", "xq", 40).check() == Refusal("an activation of 40 values quantized in blocks of 32 (a whole "
                                                   "number of blocks is needed)")


# -- the registry ----------------------------------------------------------------------------------------------------

def test_registry_names_every_kind_once():
    want = {"gemv", "gemv_f32", "norm", "rope", "rope_parts", "attention", "binary", "swiglu", "gemv_glu",
            "gemm_parts", "gather", "set_row", "argmax", "slice", "join", "unary", "scale", "fold", "quant", "view",
            "moe", "softcap", "conv", "conv_parts", "delta", "decay", "l2norm", "gates", "gate_proj", "head_gemv", "norm_pair",
            "gemm_tc", "gemm_tc_parts", "gemm_tc_glu", "attention_tc", "collective", "sample", "chain", "gemm_blas",
            "gemm_blas_parts", "gemm_blas_glu", "gemm_deq", "gemm_deq_parts", "gemm_deq_glu"}
    assert set(KINDS) == want
    from importlib import resources

    here = resources.files("lanefuse.kernels")
    for name, k in KINDS.items():
        assert k.census == name
        for s in (k.stem if isinstance(k.stem, tuple) else ()):
            assert here.joinpath(f"{s}.cu").is_file(), f"{name}: no {s}.cu"


def test_scratch_and_costs():
    a = Attention("q", "k", "v", "pos", "o", 8, 2, 64, 64, 128, 1, 0.125, splits=4)
    s, c = a.scratch()  # the splits' partials, and the arrival counters the last split block of a row's heads reads
    # (a row's maximum, sum, two unused floats and its 64 values: attention.py part_stride, the values 16-byte aligned)
    assert s.tag == "partials" and s.nbytes == 4 * 8 * 4 * 68 and not s.counter
    assert c.tag == "arrivals" and c.counter and c.nbytes == 4 * (8 // a.heads_a_block)
    assert Attention("q", "k", "v", "pos", "o", 8, 2, 64, 64, 128, 1, 0.125, splits=1).scratch() == ()
    assert a.bytes() > 0 and a.flops() > 0
    gm = Gemv("x", "w", "bf16", Dst("y"), 4096, 1024, 1)
    assert gm.bytes() == 2 * 4096 * 1024 + 4 * 4096 + 4 * 1024 and gm.flops() == 2 * 4096 * 1024
    am = ArgMax("x", "o", 150000, advance=Advance("tok", "pos"))
    assert [x.counter for x in am.scratch()] == [False, False, True]
    assert set(am.writes()) == {"o", "tok", "pos"}
    assert Gemv("x", "w", "f32", Dst("kc", row="pos", pitch=8), 8, 8, 1).reads() == ("x", "w", "pos")
