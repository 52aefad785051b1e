"""Each launch kind's CUDA launch against its numpy twin on random data across shapes (odd sizes, placements, the
widest head the attention admits, split-K, splits, four rows a warp). Skipped without a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

from lanefuse.kernels import (MAX_HEAD, Advance, ArgMax, Attention, Binary, Dst, Fold, Gather, GemmPart, GemmParts,
                              Gemv, GemvF32, GemvGlu, HostEnv, Join, Norm, Part, PreNorm, Rope, RopeParts, RopeSide,
                              Scale, SetRow, Slice, SwiGlu, Unary)
from lanefuse.kernels.common import encode


def _device() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _device(), reason="no CUDA device")]


def r32(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


def both(launch, arrays, weights, tol=1e-4, placed=False):
    """Run `launch` on the host and on the device from the same inputs; every array must agree afterwards."""
    from lanefuse.kernels.cupy_env import DeviceEnv

    assert launch.check() is None, launch.check()
    host = HostEnv({k: v.copy() for k, v in arrays.items()}, weights)
    launch.numpy(host)
    if placed:  # every array a view into one arena at 256-aligned offsets (odd gaps between them)
        offs, at = {}, 0
        for name, a in arrays.items():
            offs[name] = (at, a.nbytes, "i32" if a.dtype == np.int32 else "f32")
            at += (a.nbytes + 255 + 512) // 256 * 256
        dev = DeviceEnv(at, offs, {}, weights)
        for name, a in arrays.items():
            dev.array(name)[...] = dev.cp.asarray(a.reshape(-1))
    else:
        dev = DeviceEnv(0, {}, arrays, weights)
    launch.cuda(dev)
    launch.cuda(dev) if getattr(launch, "repeatable", False) else None
    dev.cp.cuda.Device().synchronize()
    for name in arrays:
        np.testing.assert_allclose(dev.host(name), host.array(name), rtol=tol, atol=tol, err_msg=name)
    return dev


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
# (8 x 4616: a slab past gemv_slab_cp's ring of shared memory at one output a warp and at four, its tail of 8 values)
@pytest.mark.parametrize("m,k,n", [(1, 7, 5), (1, 4096, 1031), (3, 129, 33), (9, 256, 64), (64, 96, 40),
                                   (8, 4616, 70)])
@pytest.mark.parametrize("per_warp,split", [(1, 1), (4, 1), (1, 3), (4, 2)])
def test_gemv(fmt, m, k, n, per_warp, split):
    g = np.random.default_rng(k + n)
    launch = Gemv("x", "w", fmt, Dst("y", unit=Part(n + 3, 1, n)), k, n, m, bias="b", per_warp=per_warp, split=split)
    if launch.check():
        pytest.skip(str(launch.check()))
    both(launch, {"x": r32(g, m, k), "y": np.zeros(m * (n + 3), np.float32)},
         {"w": (encode(r32(g, n, k), fmt), fmt), "b": (r32(g, n), "f32")}, placed=(m == 3))


def test_gemv_f32_and_into_a_cache_row():
    g = np.random.default_rng(1)
    both(GemvF32("x", "w", Dst("kc", row="pos", pitch=24), 33, 24, 2),
         {"x": r32(g, 2, 33), "kc": np.zeros(10 * 24, np.float32), "pos": np.array([4], np.int32)},
         {"w": (r32(g, 24, 33), "f32")})


@pytest.mark.parametrize("rows,cols,heads", [(1, 7, 1), (3, 4096, 1), (2, 256, 4), (5, 1000, 1)])
@pytest.mark.parametrize("variant", ["plain", "add", "pre", "part_into"])
def test_norm(rows, cols, heads, variant):
    g = np.random.default_rng(cols)
    hd, pos = cols // heads, 1
    # part_into writes the rows from row `pos` on: y holds pos + rows rows (and a tail past them, left untouched)
    arrays = {"x": r32(g, rows, cols + 5), "a": r32(g, rows, cols), "s": np.zeros(rows * cols, np.float32),
              "y": np.zeros((pos + rows) * cols + 11, np.float32), "pos": np.array([pos], np.int32)}
    launch = Norm("x", "w", "y", rows, cols, 1e-5, heads=heads, part=Part(cols + 5, 3, cols),
                  add="a" if variant != "plain" else None, sum="s" if variant != "plain" else None,
                  pre=PreNorm("pw", 1e-6) if variant == "pre" else None,
                  into=Dst("y", row="pos", pitch=cols) if variant == "part_into" else None)
    for name, n in launch.extents(pos, 1).items():  # each array holds what the launch reaches (a plan's check)
        assert name not in arrays or arrays[name].size >= n, (name, arrays[name].size, n)
    both(launch, arrays, {"w": (r32(g, hd), "f32"), "pw": (r32(g, cols), "f32")})


@pytest.mark.parametrize("rows,heads,hd,rot", [(1, 2, 8, 8), (3, 5, 128, 64), (2, 1, 1024, 1024), (4, 3, 10, 4)])
def test_rope_parts(rows, heads, hd, rot):
    g = np.random.default_rng(hd)
    L, pos = 40, 7
    ang = g.uniform(0, 6.28, (L, rot // 2))
    sides = (RopeSide("q", Dst("qo"), heads, part=Part(heads * hd + 2, 2, heads * hd), norm=("qn", 1e-6)),
             RopeSide("k", Dst("kc", row="pos", pitch=hd), 1))
    arrays = {"q": r32(g, rows, heads * hd + 2), "k": r32(g, rows, hd), "qo": np.zeros(rows * heads * hd, np.float32),
              "kc": np.zeros(L * hd, np.float32), "pos": np.array([pos], np.int32)}
    weights = {"cos": (np.cos(ang).astype(np.float32), "f32"), "sin": (np.sin(ang).astype(np.float32), "f32"),
               "qn": (r32(g, hd), "f32")}
    both(RopeParts(sides, "cos", "sin", "pos", rows, hd, rot), arrays, weights)
    both(Rope("k", "cos", "sin", "pos", Dst("kc", row="pos", pitch=hd), rows, 1, hd, rot, norm=("qn", 1e-6)),
         arrays, weights)


@pytest.mark.parametrize("heads,kv,hd,vd", [(4, 2, 8, 8), (6, 1, 64, 6), (32, 8, 128, 128),
                                            (8, 2, MAX_HEAD, MAX_HEAD), (3, 3, 36, 50), (4, 1, 576, 512)])
@pytest.mark.parametrize("rows,pos", [(1, 0), (1, 1000), (5, 37)])
@pytest.mark.parametrize("window,sinks,splits,per_block", [(0, False, 1, 1), (100, False, 1, 2), (0, True, 4, 1),
                                                           (17, True, 3, 2), (0, False, 16, 4)])
def test_attention(heads, kv, hd, vd, rows, pos, window, sinks, splits, per_block):
    """(4, 1, 576, 512): a latent attention's absorbed heads (DeepSeek-V3: latent 512 + rotated 64), the wide kernel."""
    if heads % per_block or (max(hd, vd) > MAX_HEAD and per_block > 1):
        pytest.skip("per_block does not divide the heads, or a wide head (one a block)")
    g = np.random.default_rng(heads * hd + pos)
    L = 1024 + 8
    arrays = {"q": r32(g, rows, heads * hd), "kc": r32(g, L, kv * hd), "vc": r32(g, L, kv * vd),
              "pos": np.array([pos], np.int32), "o": np.zeros(rows * heads * vd, np.float32)}
    a = Attention("q", "kc", "vc", "pos", "o", heads, heads // kv, hd, vd, L, rows, hd ** -0.5, window=window,
                  sinks="sk" if sinks else None, per_block=per_block, splits=splits)
    both(a, arrays, {"sk": (r32(g, heads), "f32")}, tol=2e-4)


@pytest.mark.parametrize("heads,kv,own,tail,vd", [(4, 1, 512, 64, 512), (16, 1, 16, 8, 16), (6, 6, 128, 64, 128),
                                                  (5, 5, 10, 8, 12)])
@pytest.mark.parametrize("rows,pos,splits", [(1, 0, 1), (1, 1000, 4), (5, 37, 1), (3, 300, 3)])
def test_split_attention(heads, kv, own, tail, vd, rows, pos, splits):
    """The Split attention (000): each head's query and each key in two parts read in place — absorbed (the latent
    cache both the keys' first part and the values: DeepSeek-V3's 512 + 64, the wide kernel) and expanded (a key head
    a query head, the rotated key one shared table)."""
    a, arrays = split_attention_case(heads, kv, own, tail, vd, rows, pos, splits, 1024 + 8)
    both(a, arrays, {}, tol=2e-4)


def split_attention_case(heads, kv, own, tail, vd, rows, pos, splits, L):
    """test_split_attention's launch and arrays over a cache of L rows (kv == 1: absorbed, the latent cache both
    the keys' first part and the values)."""
    g = np.random.default_rng(heads * own + pos)
    same = kv == 1
    arrays = {"q": r32(g, rows, heads * own), "qt": r32(g, rows, heads * tail), "kc": r32(g, L, kv * own),
              "kt": r32(g, L, tail), "vc": r32(g, L, kv * vd), "pos": np.array([pos], np.int32),
              "o": np.zeros(rows * heads * vd, np.float32)}
    a = Attention("q", "kc", "kc" if same else "vc", "pos", "o", heads, heads // kv, own + tail, vd, L, rows,
                  (own + tail) ** -0.5, splits=splits, qtail="qt", ktail="kt", tail=tail,
                  vstride=kv * own if same else 0)
    return a, arrays


@pytest.mark.parametrize("rows,ca,cb", [(1, 1536, 512), (5, 24, 16), (3, 7, 1000)])
def test_norm_pair(rows, ca, cb):
    """Two norms in one launch (DeepSeek-V3's q_a and latent norms): the second read as a part of wider rows and
    written into a cache row."""
    from lanefuse.kernels import NormPair

    g = np.random.default_rng(ca + cb)
    L = 40
    arrays = {"qa": r32(g, rows, ca), "lat": r32(g, rows, cb + 9), "qn": np.zeros(rows * ca, np.float32),
              "lc": np.zeros(L * cb, np.float32), "pos": np.array([7], np.int32)}
    pair = NormPair(Norm("qa", "wa", "qn", rows, ca, 1e-6),
                    Norm("lat", "wl", "ln", rows, cb, 1e-5, part=Part(cb + 9, 9, cb), into=Dst("lc", row="pos", pitch=cb)))
    both(pair, arrays, {"wa": (r32(g, ca), "f32"), "wl": (r32(g, cb), "f32")})


@pytest.mark.parametrize("op,row,gate", [("add", 0, None), ("mul", 13, "silu"), ("sub", 0, "gelu"),
                                         ("mul", 0, "sigmoid")])
def test_binary(op, row, gate):
    g = np.random.default_rng(3)
    n = 13 * 77
    both(Binary(op, "a", "b", "o", n, row=row, gate=gate),
         {"a": r32(g, n), "b": r32(g, row or n), "o": np.zeros(n, np.float32)}, {})


def test_elementwise_kinds():
    g = np.random.default_rng(4)
    n = 100003
    arrays = {"x": r32(g, n), "u": r32(g, n), "o": np.zeros(n, np.float32)}
    both(SwiGlu("x", "u", "o", n), arrays, {})
    for a in ("silu", "sigmoid", "gelu"):
        both(Unary(a, "x", "o", n), arrays, {})
    both(Scale("x", "o", n, 0.3), arrays, {})
    both(Slice("x", "o", 7, 1000, 13, 77), arrays, {})
    both(Join("x", "u", Dst("o", unit=Part(20, 3, 11)), 3, 5, 4, 7), arrays, {})


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
def test_gather_and_set_row(fmt):
    g = np.random.default_rng(5)
    table = r32(g, 1000, 129)
    both(Gather("E", "t", "o", 129, rows=3, format=fmt, scale=1.5),
         {"t": np.array([999, 0, 17], np.int32), "o": np.zeros(3 * 129, np.float32)}, {"E": (encode(table, fmt), fmt)})
    both(SetRow("T", "src", "pos", 129, 3, 20),
         {"T": np.zeros(20 * 129, np.float32), "src": r32(g, 3, 129), "pos": np.array([18], np.int32)}, {})


@pytest.mark.parametrize("rows,n", [(1, 5), (1, 151936), (3, 32000), (64, 2049)])
def test_argmax_advance(rows, n):
    g = np.random.default_rng(n)
    x = r32(g, rows, n)
    x[-1, n // 3] = x[-1, n // 2] = 50.0
    dev = both(ArgMax("x", "o", n, rows, advance=Advance("tok", "pos", step=rows)),
               {"x": x, "o": np.zeros(rows, np.int32), "tok": np.zeros(1, np.int32), "pos": np.array([9], np.int32)},
               {})
    # the arrival counter was left zero: a second launch runs the same
    a = ArgMax("x", "o", n, rows, advance=Advance("tok", "pos", step=rows))
    a.cuda(dev)
    assert int(dev.host("pos")[0]) == 9 + 2 * rows and int(dev.host("tok")[0]) == n // 3


@pytest.mark.parametrize("n", [5, 4100, 151936])
def test_argmax_nan_and_infinities(n):
    """numpy's rules on the device: a NaN above every number (the first NaN wins, across blocks), +inf ties to the
    first, a row of -inf picks 0."""
    g = np.random.default_rng(n)
    x = r32(g, 5, n)
    x[0, [n - 1, n // 2]] = np.nan
    x[0, 0] = np.inf
    x[1] = -np.inf
    x[2, [n // 3, n - 1]] = np.inf
    x[3, n - 1] = np.nan
    x[4, :] = np.nan
    both(ArgMax("x", "o", n, 5), {"x": x, "o": np.full(5, -1, np.int32)}, {})


@pytest.mark.parametrize("fmt", ["f16", "bf16"])
@pytest.mark.parametrize("per_warp", [1, 4])
def test_gemv_glu_and_parts(fmt, per_warp):
    g = np.random.default_rng(6)
    m, k, n = 3, 1024, 299
    w = {"wg": (encode(r32(g, n, k), fmt), fmt), "wu": (encode(r32(g, n, k), fmt), fmt), "bg": (r32(g, n), "f32")}
    both(GemvGlu("x", "wg", "wu", fmt, "o", k, n, m, bg="bg", per_warp=per_warp),
         {"x": r32(g, m, k), "o": np.zeros(m * n, np.float32)}, w)
    W = 2 * n + 5
    parts = (GemmPart("wg", Dst("qkv", unit=Part(W, 0, n)), n, bias="bg"),
             GemmPart("wu", Dst("kc", row="pos", pitch=n), n), GemmPart("wu", Dst("qkv", unit=Part(W, n + 5, n)), n))
    both(GemmParts("x", fmt, k, m, parts, per_warp=per_warp),
         {"x": r32(g, m, k), "qkv": np.zeros(m * W, np.float32), "kc": np.zeros(8 * n, np.float32),
          "pos": np.array([2], np.int32)}, w)


# (8 x 4096 x 4096: Qwen3-8B's o fold at a batch of 8, its slab through the ring and its tail two rows at a time)
@pytest.mark.parametrize("m,k,n,per_warp", [(1, 4096, 4096, 4), (2, 333, 77, 1), (1, 2048, 896, 1),
                                            (8, 4096, 4096, 4)])
def test_fold_gemv_norm(m, k, n, per_warp):
    g = np.random.default_rng(7)
    f = Fold(Gemv("x", "w", "bf16", Dst("o"), k, n, m, per_warp=per_warp),
             Norm("res", "nw", "y", m, n, 1e-6, add="o", sum="sum"))
    arrays = {"x": r32(g, m, k), "o": np.zeros(m * n, np.float32), "res": r32(g, m, n),
              "sum": np.zeros(m * n, np.float32), "y": np.zeros(m * n, np.float32)}
    dev = both(f, arrays, {"w": (encode(r32(g, n, k), "bf16"), "bf16"), "nw": (r32(g, n), "f32")}, tol=3e-4)
    f.cuda(dev)  # the counter was reset: the second launch's last block runs the norm again
    np.testing.assert_allclose(dev.host("sum"), arrays["res"].reshape(-1) + dev.host("o"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b", [2, 8])
def test_chain_over_a_batch(b):
    """The five-phase decode layer (chain.cu fold_attn_o_glu_down with its q/k/v phase) over a batch of b
    sequences, each at its own position in its own slot of the caches: a batch's layer since the lane batches the
    chain (tests/test_chain_qkv_emulated.py's case, there on the host emulator; at 8 every product phase on the
    slab), against its phases' twins."""
    from test_chain_qkv_emulated import batch_of

    c, arrays, weights = batch_of(b)
    both(c, arrays, weights, tol=3e-4)


# The chained merge's staged batches (heads, kv, hd, per_block, splits, pos): a warp a head of 128 values (18 splits a
# batch: 40 splits three batches, the last of 4), two warps a head of 64 (72 a batch: 80 splits two), heads of 10
# values (no whole 16-byte chunk at the row's end, three warps a block of three heads: 230 splits a batch, 25 one),
# splits past every key beside; Qwen3-8B's heads (32 over 8) and 33 splits (two batches: 18 and 15). Here and on the
# host emulator (tests/test_chain_attn_emulated.py).
STAGED = [(8, 2, 128, 4, 40, 60), (4, 2, 64, 2, 80, 66), (6, 2, 10, 3, 25, 41), (8, 2, 128, 4, 40, 23),
          (32, 8, 128, 4, 33, 66)]


@pytest.mark.parametrize("case", STAGED)
def test_the_chained_merge_stages_its_values(case):
    """The chained attention's merge through the chain's staging buffer (cp.async batches: attention.cu
    attention_merge<STAGE>) at 25-80 splits and at Qwen3-8B's heads and 33 splits, against the phases' twins."""
    from test_chain_attn_emulated import staged_case

    staged_case(*case)


def gemv_argmax_case(fmt, m, k, n, per_warp, advance, ties, words=0):
    """The LM head and the step's arg-max as one launch (head_argmax): random rows, or (`ties`) the largest output
    copied to three other rows, two of them below it and one above (the smallest index must win), and a NaN row
    after the first quarter (the first NaN wins, as numpy's argmax); an advance of one sequence or of a batch."""
    g = np.random.default_rng(11 + m + n)
    w = r32(g, n, k)
    if ties:
        top = int(np.argmax(r32(g, m, k)[0] @ w.T))
        for j in (n // 2, n - 1, max(top - 5, 0)):
            w[j] = w[top]
    if ties == "nan" and fmt in ("f32", "f16", "bf16"):  # a block format encodes no NaN: its case keeps the ties
        w[n // 4 + 1, 3] = np.nan
        w[n - 2, 0] = np.nan
    adv = {None: None, "one": Advance("tok", "posn"), "batch": Advance("tok", "posn", step=1, batch=True)}[advance]
    f = Fold(Gemv("x", "w", fmt, Dst("logits"), k, n, m, per_warp=per_warp, words=words),
             ArgMax("logits", "next", n, m, adv))
    assert f.fused, f.form()
    arrays = {"logits": np.zeros(m * n, np.float32), "next": np.full(m, -1, np.int32),
              "tok": np.full(m, -1, np.int32), "posn": np.arange(5, 5 + m, dtype=np.int32)}
    return f, g, arrays, {"w": (encode(w, fmt), fmt)}


def check_gemv_argmax(dev, m, n):
    """The indices are numpy's argmax of the logits the launch itself stored (its own sums), to the index."""
    logits = dev.host("logits").reshape(m, n)
    np.testing.assert_array_equal(dev.host("next"), np.argmax(logits, axis=1).astype(np.int32))


GEMV_ARGMAX = [(1, 256, 1031, 4, "one", True), (1, 96, 77, 1, None, "nan"), (3, 64, 40, 4, "batch", False),
               (9, 128, 33, 1, "batch", True), (2, 2048, 300, 4, "one", False)]


@pytest.mark.parametrize("fmt", ["bf16", "f32", "q8_0", "q4_k"])
@pytest.mark.parametrize("m,k,n,per_warp,advance,ties", GEMV_ARGMAX)
def test_fold_gemv_argmax(fmt, m, k, n, per_warp, advance, ties):
    if fmt == "q4_k" and k % 256:
        pytest.skip("q4_k rows are whole super-blocks of 256")
    f, g, arrays, weights = gemv_argmax_case(fmt, m, k, n, per_warp, advance, ties)
    arrays["x"] = r32(g, m, k)
    dev = both(f, arrays, weights, tol=3e-4)
    check_gemv_argmax(dev, m, n)
    f.cuda(dev)  # the keys and the counter were left zero: a second launch picks the same and advances again
    np.testing.assert_array_equal(dev.host("posn"), arrays["posn"] + (0 if advance is None else 2) * (
        np.arange(m) < (m if advance == "batch" else 1)))


def _qkv(g, fmt, m, k, heads, kv, hd, rot, norm, pw, bias, L, pos):
    """A q/k/v fold as the lane makes it: q, k, v of one activation in parts, q's and k's heads normed (or not) and
    rotated, the rotated key and the value straight into their cache rows at pos."""
    nq, nk = heads * hd, kv * hd
    parts = (GemmPart("wq", Dst("q"), nq, bias="bq" if bias else None), GemmPart("wk", Dst("k"), nk,
                                                                                  bias="bk" if bias else None),
             GemmPart("wv", Dst("vc", row="pos", pitch=nk), nk))
    sides = (RopeSide("q", Dst("qr"), heads, norm=("qn", 1e-6) if norm else None),
             RopeSide("k", Dst("kc", row="pos", pitch=nk), kv, norm=("kn", 1e-6) if norm else None))
    f = Fold(GemmParts("x", fmt, k, m, parts, per_warp=pw), RopeParts(sides, "cos", "sin", "pos", m, hd, rot))
    ang = g.uniform(0, 6.28, (L, rot // 2))
    arrays = {"x": r32(g, m, k), "q": np.zeros(m * nq, np.float32), "k": np.zeros(m * nk, np.float32),
              "qr": np.zeros(m * nq, np.float32), "kc": r32(g, L, nk), "vc": r32(g, L, nk),
              "pos": np.array([pos], np.int32)}
    weights = {"wq": (encode(r32(g, nq, k), fmt), fmt), "wk": (encode(r32(g, nk, k), fmt), fmt),
               "wv": (encode(r32(g, nk, k), fmt), fmt), "bq": (r32(g, nq), "f32"), "bk": (r32(g, nk), "f32"),
               "qn": (r32(g, hd), "f32"), "kn": (r32(g, hd), "f32"), "cos": (np.cos(ang).astype(np.float32), "f32"),
               "sin": (np.sin(ang).astype(np.float32), "f32")}
    return f, arrays, weights


def _written(f, arrays, weights, names):
    """Where the launch writes each of `names`: the numpy twin run on those arrays filled with NaN; what it leaves NaN
    it never writes (a cache's other rows, say)."""
    host = HostEnv({k: (np.full_like(v, np.nan) if k in names else v.copy()) for k, v in arrays.items()}, weights)
    f.numpy(host)
    return {n: ~np.isnan(host.array(n)) for n in names}


def _again(f, dev, arrays, weights, host_names=("qr", "kc")):
    """A second launch on zeroed results: the arrival counters were left zero, so every head's epilogue runs again and
    writes what the first launch wrote, to the bit; what the launch never writes (a cache's other rows) stays zero."""
    written = _written(f, arrays, weights, host_names)
    want = {n: np.where(written[n], dev.host(n), 0).astype(np.float32) for n in host_names}
    for n in host_names:
        assert written[n].any(), f"{n}: the launch writes none of it"
        dev.array(n)[...] = 0
    f.cuda(dev)
    dev.cp.cuda.Device().synchronize()
    for n in host_names:
        np.testing.assert_array_equal(dev.host(n), want[n], err_msg=f"{n} on a second launch")


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("heads,kv,hd,rot", [(8, 2, 64, 64), (16, 4, 128, 128), (4, 1, 256, 256), (4, 2, 64, 32),
                                             (5, 1, 12, 8)])
@pytest.mark.parametrize("norm,pw,bias", [(True, 1, False), (False, 4, True), (True, 4, False)])
def test_fold_products_then_head_epilogue(fmt, m, heads, kv, hd, rot, norm, pw, bias):
    g = np.random.default_rng(m * hd + heads + pw)
    k, L, pos = (1024 if hd != 12 else 129), 64, 37
    f, arrays, weights = _qkv(g, fmt, m, k, heads, kv, hd, rot, norm, pw, bias, L, pos)
    assert f.fused, f.form()
    dev = both(f, arrays, weights, tol=2e-4, placed=(m == 5))
    _again(f, dev, arrays, weights)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8_0"])
@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("qa,lat,rope,pw", [(1536, 512, 64, 4), (1536, 512, 64, 1), (24, 16, 8, 1), (96, 64, 32, 4)])
def test_fold_products_then_row_norms_and_a_rotation(fmt, m, qa, lat, rope, pw):
    """DeepSeek-V3's first product as the lane makes it (merged_qkv.rotated_normed): q_a, the latent and the rotated
    key in parts, q_a's and the latent's rows normed by the last block of their part to arrive (the latent into its
    cache row), the key rotated into its cache row; against the numpy twin, then once more (the counters reset)."""
    g = np.random.default_rng(m + qa + pw)
    k, L, pos = 7168 if qa == 1536 else 64, 64, 37
    parts = (GemmPart("wqa", Dst("qa"), qa), GemmPart("wl", Dst("lat"), lat), GemmPart("wk", Dst("kp"), rope))
    sides = (RopeSide("qa", Dst("qan"), 1, norm=("na", 1e-6), hd=qa, rot=0),
             RopeSide("lat", Dst("lc", row="pos", pitch=lat), 1, norm=("nl", 1e-6), hd=lat, rot=0),
             RopeSide("kp", Dst("kc", row="pos", pitch=rope), 1))
    f = Fold(GemmParts("x", fmt, k, m, parts, per_warp=pw), RopeParts(sides, "cos", "sin", "pos", m, rope, rope))
    assert f.fused, f.form()
    ang = g.uniform(0, 6.28, (L, rope // 2))
    arrays = {"x": r32(g, m, k), "qa": np.zeros(m * qa, np.float32), "lat": np.zeros(m * lat, np.float32),
              "kp": np.zeros(m * rope, np.float32), "qan": np.zeros(m * qa, np.float32), "lc": r32(g, L, lat),
              "kc": r32(g, L, rope), "pos": np.array([pos], np.int32)}
    weights = {"wqa": (encode(r32(g, qa, k), fmt), fmt), "wl": (encode(r32(g, lat, k), fmt), fmt),
               "wk": (encode(r32(g, rope, k), fmt), fmt), "na": (r32(g, qa), "f32"), "nl": (r32(g, lat), "f32"),
               "cos": (np.cos(ang).astype(np.float32), "f32"), "sin": (np.sin(ang).astype(np.float32), "f32")}
    dev = both(f, arrays, weights, tol=3e-4, placed=(m == 5))
    _again(f, dev, arrays, weights, host_names=("qan", "lc", "kc"))


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8_0"])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("heads,nope,rope,lora,pw,rows_out", [(128, 128, 64, 512, 4, False), (16, 128, 64, 512, 1, False),
                                                             (4, 32, 8, 32, 1, True), (3, 64, 32, 96, 4, False)])
def test_fold_products_then_absorbed_and_rotated_heads(fmt, m, heads, nope, rope, lora, pw, rows_out):
    """DeepSeek-V3's q_b products as the lane makes them (merged_pair.rotated_absorbed): each head's unrotated part
    taken into latent space by its own key-expansion rows by the last block of the head to arrive, the rotated part
    rotated; against the numpy twin, then once more (the counters reset)."""
    from lanefuse.kernels import Absorb

    g = np.random.default_rng(m + heads + lora)
    k, L, pos = 1536 if heads == 128 else 64, 64, 37
    parts = (GemmPart("wn", Dst("qn"), heads * nope), GemmPart("wr", Dst("qp"), heads * rope))
    sides = (RopeSide("qn", Dst("ql"), heads, hd=nope, rot=0, absorb=Absorb("wk", fmt, lora, rows_out)),
             RopeSide("qp", Dst("qr"), heads))
    f = Fold(GemmParts("x", fmt, k, m, parts, per_warp=pw), RopeParts(sides, "cos", "sin", "pos", m, rope, rope))
    assert f.fused, f.form()
    ang = g.uniform(0, 6.28, (L, rope // 2))
    wk = r32(g, heads * lora, nope) if rows_out else r32(g, heads * nope, lora)
    arrays = {"x": r32(g, m, k), "qn": np.zeros(m * heads * nope, np.float32),
              "qp": np.zeros(m * heads * rope, np.float32), "ql": np.zeros(m * heads * lora, np.float32),
              "qr": np.zeros(m * heads * rope, np.float32), "pos": np.array([pos], np.int32)}
    weights = {"wn": (encode(r32(g, heads * nope, k) / 8, fmt), fmt),
               "wr": (encode(r32(g, heads * rope, k) / 8, fmt), fmt), "wk": (encode(wk / 8, fmt), fmt),
               "cos": (np.cos(ang).astype(np.float32), "f32"), "sin": (np.sin(ang).astype(np.float32), "f32")}
    dev = both(f, arrays, weights, tol=3e-4, placed=(m == 5))
    _again(f, dev, arrays, weights, host_names=("ql", "qr"))


@pytest.mark.parametrize("fmt", ["bf16", "f32"])
@pytest.mark.parametrize("m,hd", [(1, 128), (5, 64), (3, 256)])
def test_fold_one_product_then_head_epilogue(fmt, m, hd):
    g = np.random.default_rng(hd + m)
    heads, k, L, pos = 4, 512, 16, 3
    n = heads * hd
    ang = g.uniform(0, 6.28, (L, hd // 2))
    f = Fold(Gemv("x", "w", fmt, Dst("o"), k, n, m, bias="b", per_warp=4),
             Rope("o", "cos", "sin", "pos", Dst("kc", row="pos", pitch=n), m, heads, hd, hd, norm=("nw", 1e-6)))
    assert f.fused, f.form()
    arrays = {"x": r32(g, m, k), "o": np.zeros(m * n, np.float32), "kc": np.zeros(L * n, np.float32),
              "pos": np.array([pos], np.int32)}
    weights = {"w": (encode(r32(g, n, k), fmt), fmt), "b": (r32(g, n), "f32"), "nw": (r32(g, hd), "f32"),
               "cos": (np.cos(ang).astype(np.float32), "f32"), "sin": (np.sin(ang).astype(np.float32), "f32")}
    dev = both(f, arrays, weights, tol=2e-4)
    _again(f, dev, arrays, weights, ("kc",))


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("rows,cols,heads,scale", [(1, 7, 1, None), (3, 1000, 1, 1.5), (2, 4096, 1, 64.0 ** 0.5),
                                                   (5, 256, 4, None)])
def test_fold_gather_then_norm(fmt, rows, cols, heads, scale):
    g = np.random.default_rng(cols + rows)
    V = 50
    f = Fold(Gather("E", "t", "e", cols, rows=rows, format=fmt, scale=scale),
             Norm("e", "nw", "y", rows, cols, 1e-6, heads=heads))
    assert f.fused, f.form()
    idx = g.integers(0, V, rows).astype(np.int32)
    idx[0] = V - 1
    both(f, {"t": idx, "e": np.zeros(rows * cols, np.float32), "y": np.zeros(rows * cols, np.float32)},
         {"E": (encode(r32(g, V, cols), fmt), fmt), "nw": (r32(g, cols // heads), "f32")}, placed=(rows == 3))


# -- GGUF's block formats, decoded in the kernels ---------------------------------------------------------------------

BLOCK_FMTS = ["q8_0", "q4_0", "q4_k", "q6_k"]


@pytest.mark.parametrize("fmt", BLOCK_FMTS)
def test_block_decoding_on_the_device_is_bit_exact(fmt):
    """Rows of random blocks (every edge-case f16 scale: zero, subnormals, the largest, inf, NaN) gathered by the
    kernel (times 1.0) equal engine/formats/blocks.py's decoding to the bit, NaN as NaN."""
    from lanefuse.engine.formats.blocks import BLOCKS
    from lanefuse.kernels.common import decode

    vb, bb = BLOCKS[fmt]
    g = np.random.default_rng(bb)
    edge = [0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0x8001, 0x7C00, 0xFC00, 0x7E00, 0x7D55]
    rows, per_row = 4 * len(edge), 2
    raw = g.integers(0, 256, size=(rows, per_row * bb), dtype=np.uint8)
    for r in range(rows):
        if r >= len(edge):
            raw[r] = (0, 0x80, 0xFF)[r // len(edge) - 1]
        h = edge[r % len(edge)]
        for o in {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}[fmt]:
            raw[r, o::bb], raw[r, o + 1::bb] = h & 0xFF, h >> 8
    cols = per_row * vb
    idx = np.arange(rows, dtype=np.int32)[::-1].copy()
    from lanefuse.kernels.cupy_env import DeviceEnv

    dev = DeviceEnv(0, {}, {"t": idx, "o": np.zeros(rows * cols, np.float32)}, {"E": (raw, fmt)})
    Gather("E", "t", "o", cols, rows=rows, format=fmt).cuda(dev)
    got = dev.host("o").reshape(rows, cols)
    with np.errstate(invalid="ignore", over="ignore"):
        want = decode(raw, fmt)[idx]
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("fmt", BLOCK_FMTS)
@pytest.mark.parametrize("m,k,n", [(1, 4096, 1031), (3, 512, 33), (9, 256, 64), (64, 768, 40), (1, 4096, 96),
                                   (8, 2048, 70)])  # (a slab of 3..8 through the staged tile at one output a warp)
@pytest.mark.parametrize("per_warp,split", [(1, 1), (4, 1), (1, 3), (4, 2), (1, 16)])
def test_gemv_blocks(fmt, m, k, n, per_warp, split):
    g = np.random.default_rng(k + n + len(fmt))
    launch = Gemv("x", "w", fmt, Dst("y", unit=Part(n + 3, 1, n)), k, n, m, bias="b", per_warp=per_warp, split=split)
    if launch.check():
        pytest.skip(str(launch.check()))
    both(launch, {"x": r32(g, m, k), "y": np.zeros(m * (n + 3), np.float32)},
         {"w": (encode(r32(g, n, k), fmt), fmt), "b": (r32(g, n), "f32")}, tol=2e-4, placed=(m == 3))


@pytest.mark.parametrize("fmt", BLOCK_FMTS)
@pytest.mark.parametrize("per_warp", [1, 4])
def test_gemv_glu_and_parts_blocks(fmt, per_warp):
    g = np.random.default_rng(6)
    m, k, n = 3, 1024, 299
    w = {"wg": (encode(r32(g, n, k), fmt), fmt), "wu": (encode(r32(g, n, k), fmt), fmt), "bg": (r32(g, n), "f32")}
    both(GemvGlu("x", "wg", "wu", fmt, "o", k, n, m, bg="bg", per_warp=per_warp),
         {"x": r32(g, m, k), "o": np.zeros(m * n, np.float32)}, w, tol=2e-4)
    W = 2 * n + 5
    parts = (GemmPart("wg", Dst("qkv", unit=Part(W, 0, n)), n, bias="bg"),
             GemmPart("wu", Dst("kc", row="pos", pitch=n), n), GemmPart("wu", Dst("qkv", unit=Part(W, n + 5, n)), n))
    both(GemmParts("x", fmt, k, m, parts, per_warp=per_warp),
         {"x": r32(g, m, k), "qkv": np.zeros(m * W, np.float32), "kc": np.zeros(8 * n, np.float32),
          "pos": np.array([2], np.int32)}, w, tol=2e-4)


@pytest.mark.parametrize("fmt", BLOCK_FMTS)
@pytest.mark.parametrize("m,k,n,per_warp", [(1, 4096, 4096, 4), (2, 512, 77, 1)])
def test_fold_gemv_norm_blocks(fmt, m, k, n, per_warp):
    g = np.random.default_rng(7)
    f = Fold(Gemv("x", "w", fmt, Dst("o"), k, n, m, per_warp=per_warp),
             Norm("res", "nw", "y", m, n, 1e-6, add="o", sum="sum"))
    arrays = {"x": r32(g, m, k), "o": np.zeros(m * n, np.float32), "res": r32(g, m, n),
              "sum": np.zeros(m * n, np.float32), "y": np.zeros(m * n, np.float32)}
    both(f, arrays, {"w": (encode(r32(g, n, k), fmt), fmt), "nw": (r32(g, n), "f32")}, tol=3e-4)


@pytest.mark.parametrize("fmt", BLOCK_FMTS)
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("heads,kv,hd,rot", [(8, 2, 64, 64), (16, 4, 128, 128)])
def test_fold_products_then_head_epilogue_blocks(fmt, m, heads, kv, hd, rot):
    g = np.random.default_rng(m * hd + heads)
    f, arrays, weights = _qkv(g, fmt, m, 1024, heads, kv, hd, rot, True, 4, False, 64, 37)
    assert f.fused, f.form()
    dev = both(f, arrays, weights, tol=2e-4, placed=(m == 5))
    _again(f, dev, arrays, weights)


@pytest.mark.parametrize("fmt", BLOCK_FMTS)
@pytest.mark.parametrize("rows,cols,heads", [(3, 1024, 1), (2, 4096, 1), (5, 256, 4)])
def test_fold_gather_then_norm_blocks(fmt, rows, cols, heads):
    test_fold_gather_then_norm(fmt, rows, cols, heads, 1.5)  # the same case, the table's rows in blocks


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("rows,sort", [(1, False), (3, False), (16, True), (5, True)])
@pytest.mark.parametrize("shared,finalize", [(0, ""), (40, "norm"), (24, "add"), (0, "norm"), (40, "")])
def test_moe(fmt, rows, sort, shared, finalize):
    """The expert mixture a row at a time (moe_up, moe_down) and over sorted rows (four kernels), with a shared expert
    and the finalize (the last block of a row norms it), hidden 32 and experts of 37 (8, top-2), and a wide one."""
    from lanefuse.kernels import Moe

    for d, f, E, k in ((32, 37, 8, 2), (1024, 96, 64, 6)):
        g = np.random.default_rng(rows * 7 + shared + d)
        sf = shared and (shared if d == 32 else 128)
        arrays = {"x": r32(g, rows, d), "y": np.zeros(rows * d, np.float32)}
        weights = {"wr": ((r32(g, E, d) * 3 / np.sqrt(d)).astype(np.float32), "f32"),
                   "wgu": (encode(r32(g, E * 2 * f, d) / np.sqrt(d), fmt), fmt),
                   "wd": (encode(r32(g, E * d, f) / np.sqrt(f), fmt), fmt)}
        kw = {}
        if sf:
            for n, shape in (("sg", (sf, d)), ("su", (sf, d)), ("sd", (d, sf)), ("sgt", (1, d))):
                weights[n] = (encode(r32(g, *shape) / np.sqrt(shape[1]), fmt), fmt)
            kw.update(sg="sg", su="su", sd="sd", sgate="sgt", sf=sf, format_s=fmt)
        if finalize:
            arrays.update(a=r32(g, rows, d))
            kw.update(add="a")
        if finalize == "norm":
            arrays.update(s=np.zeros(rows * d, np.float32))
            weights["nw"] = (1 + 0.1 * r32(g, d), "f32")
            kw.update(sum="s", nw="nw", eps=1e-6)
        both(Moe("x", "wr", "wgu", "wd", Dst("y"), d, f, E, k, rows, fmt, norm_topk=True, sort=sort, **kw),
             arrays, weights, tol=2e-4, placed=rows == 3)


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("rows,sort", [(1, False), (3, False), (16, True), (5, True)])
@pytest.mark.parametrize("finalize", ["", "add", "norm"])
def test_moe_gptoss(fmt, rows, sort, finalize):
    """gpt-oss's mixture (the router's bias, top-k then the softmax of the chosen logits, the experts' gate/up and
    down biases, the clamped GLU with a clamp low enough to bite) both ways, hidden 32 and experts of 37 (8, top-2),
    and a wide one (64 experts, top-4)."""
    from lanefuse.kernels import Moe

    for d, f, E, k in ((32, 37, 8, 2), (1024, 96, 64, 4)):
        g = np.random.default_rng(rows * 11 + d + len(finalize))
        arrays = {"x": r32(g, rows, d), "y": np.zeros(rows * d, np.float32)}
        weights = {"wr": ((r32(g, E, d) * 3 / np.sqrt(d)).astype(np.float32), "f32"),
                   "br": (0.3 * r32(g, E), "f32"),
                   "wgu": (encode(2 * r32(g, E * 2 * f, d) / np.sqrt(d), fmt), fmt),
                   "bgu": (0.3 * r32(g, E * 2 * f), "f32"),
                   "wd": (encode(r32(g, E * d, f) / np.sqrt(f), fmt), fmt), "bd": (0.3 * r32(g, E * d), "f32")}
        kw = dict(act="clamped_glu", routing="topk_softmax", br="br", bgu="bgu", bd="bd", limit=1.5, alpha=1.702)
        if finalize:
            arrays.update(a=r32(g, rows, d))
            kw.update(add="a")
        if finalize == "norm":
            arrays.update(s=np.zeros(rows * d, np.float32))
            weights["nw"] = (1 + 0.1 * r32(g, d), "f32")
            kw.update(sum="s", nw="nw", eps=1e-6)
        both(Moe("x", "wr", "wgu", "wd", Dst("y"), d, f, E, k, rows, fmt, sort=sort, **kw), arrays, weights,
             tol=2e-4, placed=rows == 3)


@pytest.mark.parametrize("fmts", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q4_k", "q6_k"), ("q6_k", "q6_k"),
                                  ("mxfp4", "mxfp4")])
@pytest.mark.parametrize("rows,sort", [(1, False), (3, False), (8, True)])
def test_moe_block_formats(fmts, rows, sort):
    """A GGUF file's mixture (and MXFP4 experts): gate/up experts in one block format, down in another (Q4_K_M keeps
    ffn_down_exps in q6_k), a shared expert in q8_0 with its gate score row in f32, finalized with the next norm."""
    from lanefuse.kernels import Moe

    fgu, fd = fmts
    d, f, E, k, sf = 256, 256, 8, 2, 256
    g = np.random.default_rng(rows + len(fgu))
    arrays = {"x": r32(g, rows, d), "y": np.zeros(rows * d, np.float32), "a": r32(g, rows, d),
              "s": np.zeros(rows * d, np.float32)}
    weights = {"wr": ((r32(g, E, d) * 3 / np.sqrt(d)).astype(np.float32), "f32"),
               "wgu": (encode(r32(g, E * 2 * f, d) / np.sqrt(d), fgu), fgu),
               "wd": (encode(r32(g, E * d, f) / np.sqrt(f), fd), fd), "nw": (1 + 0.1 * r32(g, d), "f32"),
               "sgt": ((r32(g, 1, d) / np.sqrt(d)).astype(np.float32), "f32")}
    for n, shape in (("sg", (sf, d)), ("su", (sf, d)), ("sd", (d, sf))):
        weights[n] = (encode(r32(g, *shape) / np.sqrt(shape[1]), "q8_0"), "q8_0")
    both(Moe("x", "wr", "wgu", "wd", Dst("y"), d, f, E, k, rows, fgu, format_d=fd, norm_topk=True, sort=sort,
             sg="sg", su="su", sd="sd", sgate="sgt", sf=sf, format_s="q8_0", format_sgate="f32", add="a", sum="s",
             nw="nw", eps=1e-6), arrays, weights, tol=2e-4, placed=rows == 3)


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("m,heads,a,b,rows_out", [(1, 4, 32, 64, False), (3, 4, 64, 32, True), (1, 128, 128, 512, False),
                                                  (5, 16, 512, 128, True)])
def test_head_gemv(fmt, m, heads, a, b, rows_out):
    """Each head's own product (a latent attention's absorption and expansion), both layouts, into a placed arena."""
    from lanefuse.kernels import HeadGemv

    g = np.random.default_rng(m * heads + a)
    rows, cols = (heads * b, a) if rows_out else (heads * a, b)
    arrays = {"x": r32(g, m, heads * a), "y": np.zeros(m * heads * b, np.float32)}
    weights = {"w": (encode(r32(g, rows, cols) / np.sqrt(a), fmt), fmt)}
    both(HeadGemv("x", "w", fmt, Dst("y"), m, heads, a, b, rows_out=rows_out), arrays, weights, tol=2e-4,
         placed=m == 3)


HEAD_FILLED = [(0, 1), (3, 5), (9, 12), (60, 8), (62, 9)]  # (position, the chunk's rows): 1, 8, 21 (groups of 8,
# the last short), 64 (all 64), 64 (clipped)


def head_filled_case(pos: int, extra: int, fmt: str = "bf16"):
    """A chunk's expanded latent key half over a 64-row cache at `pos` with `extra` rows: the launch, its arrays
    (the output NaN-filled: rows past the filled ones must stay so) and weights."""
    from lanefuse.kernels import HeadGemv

    g = np.random.default_rng(pos + extra)
    L, lora, cols = 64, 96, 80
    arrays = {"lc": r32(g, L, lora), "kx": np.full(L * cols, np.nan, np.float32), "pos": np.array([pos], np.int32)}
    weights = {"wk": (encode(r32(g, cols, lora) / np.sqrt(lora), fmt), fmt)}
    launch = HeadGemv("lc", "wk", fmt, Dst("kx"), L, 1, lora, cols, rows_out=True, upto="pos", extra=extra)
    return launch, arrays, weights


@pytest.mark.parametrize("pos,extra", HEAD_FILLED)
def test_head_gemv_computes_only_the_filled_rows(pos, extra):
    """The expanded latent attention's halves (lane/lower/hooks._expanded): rows below min(L, pos + rows) only."""
    both(*head_filled_case(pos, extra), tol=2e-4)


@pytest.mark.parametrize("rows,sort", [(1, False), (3, False), (16, True), (7, True)])
@pytest.mark.parametrize("shared", [0, 24])
def test_moe_grouped_sigmoid(rows, sort, shared):
    """DeepSeek-V3's routing on the device: sigmoid scores, a correction bias large enough to change the choices, the
    best groups by their top two, weights renormalized and scaled; an ungated shared expert. Over sorted rows also a
    chunk of 7 (a prefill chunk's moe_token_sort.grouped: tests/test_deepseek_sorted_chunk.py on the emulator)."""
    for d, f, E, k, groups, topk in ((32, 11, 8, 3, 4, 2), (256, 64, 256, 8, 8, 4)):
        both(*grouped_moe(rows, d, f, E, k, groups, topk, shared, seed=rows + shared + d, sort=sort), tol=2e-4)


def grouped_moe(rows: int, d: int, f: int, E: int, k: int, groups: int, topk: int, shared: int, seed: int,
                sort: bool = False):
    """(launch, arrays, weights): DeepSeek-V3's routing (sigmoid scores, a correction bias large enough to change the
    choices, the best groups kept) over bf16 experts, an ungated bf16 shared expert of width `shared` (0: none)."""
    from lanefuse.kernels import Moe

    g = np.random.default_rng(seed)
    arrays = {"x": r32(g, rows, d), "y": np.zeros(rows * d, np.float32)}
    weights = {"wr": ((r32(g, E, d) * 3 / np.sqrt(d)).astype(np.float32), "f32"),
               "cb": (0.5 * r32(g, E), "f32"),
               "wgu": (encode(r32(g, E * 2 * f, d) / np.sqrt(d), "bf16"), "bf16"),
               "wd": (encode(r32(g, E * d, f) / np.sqrt(f), "bf16"), "bf16")}
    kw = {}
    if shared:
        for n, shape in (("sg", (shared, d)), ("su", (shared, d)), ("sd", (d, shared))):
            weights[n] = (encode(r32(g, *shape) / np.sqrt(shape[1]), "bf16"), "bf16")
        kw.update(sg="sg", su="su", sd="sd", sf=shared, format_s="bf16")
    return (Moe("x", "wr", "wgu", "wd", Dst("y"), d, f, E, k, rows, "bf16", norm_topk=True, sort=sort,
                routing="sigmoid_group", br="cb", groups=groups, topk_groups=topk, route_scale=2.5, **kw),
            arrays, weights)
