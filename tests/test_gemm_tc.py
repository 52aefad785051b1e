"""The tensor-core GEMM (kernels/gemm_tc.*): its numerics on the CPU — bf16 rounding to nearest even, the exact twin
against f64 products of the rounded operands, the fast twin within the stated bound — and its CUDA kernel run by the
host emulator (tests/cuda_host: mma.sync, ldmatrix and cp.async emulated lane by lane from the PTX ISA's fragment
layouts) against the twin within |y - twin| <= tc_bound over shapes with every edge (m, n and k not multiples of a
tile, of a fragment, of a 16-byte chunk), every checkpoint format, a bias, added rows and placed results; relaunched
in reverse block order with shuffled threads, the same bits. `tc_case` is shared with tests/test_gemm_tc_gpu.py."""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lanefuse.kernels import Dst, GemmTc, HostEnv, Part
from lanefuse.kernels.common import decode, encode
from lanefuse.kernels.gemm_tc import MAX_KSPLIT, bf16_round, kp, tail_us, tc_bound, tc_products


def r32(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


# -- the numerics on the CPU ----------------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_bf16_round_is_nearest_even(bits):
    """Every f32 rounds to the nearer of the two bf16 values around it (ties to the even one); inf stays inf, a NaN
    a NaN; a finite value past bf16's largest by half an ulp or more rounds to inf, as IEEE says."""
    f = np.array([bits], np.uint32).view(np.float32)
    r = bf16_round(f)
    rb = int(r.view(np.uint32)[0])
    assert rb & 0xFFFF == 0
    if np.isnan(f[0]):
        assert np.isnan(r[0])
        return
    lo = bits & 0xFFFF0000
    hi = lo + 0x10000
    rem = bits & 0xFFFF
    want = lo if rem < 0x8000 or (rem == 0x8000 and not (lo >> 16) & 1) else hi
    assert rb == want, (hex(bits), hex(rb), hex(want))


def test_bf16_round_of_bf16_is_itself_and_overflow_is_inf():
    g = np.random.default_rng(0)
    b = bf16_round(r32(g, 1000) * 1e3)
    np.testing.assert_array_equal(bf16_round(b).view(np.uint32), b.view(np.uint32))
    big = np.array([3.3895314e38, np.float32(3.4028235e38), np.inf, -np.inf], np.float32)
    assert np.isinf(bf16_round(big)[1:]).all() and np.isfinite(bf16_round(big)[0])


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16", "q8_0", "q4_k"])
def test_twins_agree_within_the_bound(fmt):
    """The exact twin is f64 sums of the rounded operands; the fast twin (f32 BLAS of them) lies within tc_bound of
    it; a bias and added rows go on in the kernel's order; bf16 rows round to themselves."""
    g = np.random.default_rng(1)
    m, n, k = 37, 29, 512
    raw = encode(r32(g, n, k), fmt)
    x, add = r32(g, m, k) * 3, r32(g, m, n)
    launch = GemmTc("x", "w", fmt, Dst("y"), k, n, m, bias="b", add="a")
    arrays = {"x": x, "a": add, "y": np.zeros(m * n, np.float32)}
    weights = {"w": (raw, fmt), "b": (r32(g, n), "f32")}
    exact, fast = HostEnv(dict(arrays), weights), HostEnv({k_: v.copy() for k_, v in arrays.items()}, weights)
    launch.numpy(exact)
    launch.fast(fast)
    w = decode(raw, fmt).reshape(n, k)
    prod = (bf16_round(x).astype(np.float64) @ bf16_round(w).astype(np.float64).T).astype(np.float32)
    want = ((prod + weights["b"][0][None, :]).astype(np.float32) + add).astype(np.float32)
    np.testing.assert_array_equal(exact.array("y"), want.reshape(-1))
    y = exact.array("y").reshape(m, n)
    assert (np.abs(fast.array("y").reshape(m, n) - y) <= tc_bound(x, w) + 2**-22 * np.abs(y)).all()
    if fmt == "bf16":
        np.testing.assert_array_equal(bf16_round(w), w)


def test_rounding_changes_products_the_f32_numerics_keep():
    """The bf16 numerics is a choice: it differs from the f32 product (which the default numerics keeps exact)."""
    g = np.random.default_rng(2)
    x, w = r32(g, 16, 64), r32(g, 8, 64)
    assert not np.array_equal(tc_products(x, w), (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32))


def test_refusals_in_words():
    assert "no values" in str(GemmTc("x", "w", "bf16", Dst("y"), 0, 4, 16).check())
    assert "q4_k" in str(GemmTc("x", "w", "q4_k", Dst("y"), 100, 4, 16).check())
    assert "in place" in str(GemmTc("x", "w", "bf16", Dst("y", row=2, pitch=4), 8, 4, 16, add="y").check())
    assert GemmTc("x", "w", "bf16", Dst("y"), 8, 4, 16, add="y").check() is None


# -- the kernel, emulated -------------------------------------------------------------------------------------------

def tc_case(launch: GemmTc, g, placed: bool = False):
    """Arrays and weights for `launch` (its y a Dst of `Part` units or rows of a table), random."""
    fmt, m, n, k = launch.format, launch.m, launch.n, launch.k
    size = launch.y.extent(m * n, 3) + 5
    arrays = {"x": r32(g, m, k), "y": np.zeros(size, np.float32)}
    if launch.add:
        arrays[launch.add] = r32(g, m, n)
    if isinstance(launch.y.row, str):
        arrays[launch.y.row] = np.array([3], np.int32)
    weights = {"w": (encode(r32(g, n, k) * 0.5, fmt), fmt)}
    if launch.bias:
        weights[launch.bias] = (r32(g, n), "f32")
    return arrays, weights


def check_within_bound(launch: GemmTc, arrays, weights, got_y: np.ndarray):
    """The device's y against the twin's: within tc_bound on every value the launch writes (carried through the
    bias's and the added rows' f32 roundings: 2^-23 of the value), untouched elsewhere."""
    host = HostEnv({k: v.copy() for k, v in arrays.items()}, weights)
    launch.numpy(host)
    m, n, k = launch.m, launch.n, launch.k
    w = decode(*weights["w"]).reshape(n, k)
    bound = tc_bound(arrays["x"].reshape(m, k), w).reshape(-1)
    idx = launch.y.indices(m * n, host)
    want = host.array("y")
    got = np.asarray(got_y).reshape(-1)
    err = np.abs(got[idx] - want[idx])
    tol = bound + 2.0**-23 * np.abs(want[idx])
    assert (err <= tol).all(), (f"{int((err > tol).sum())} of {idx.size} outside the bound; worst at "
                                f"{int(np.argmax(err - tol))}: {got[idx][np.argmax(err - tol)]} vs "
                                f"{want[idx][np.argmax(err - tol)]}")
    rest = np.ones(got.size, bool)
    rest[idx] = False
    np.testing.assert_array_equal(got[rest], arrays["y"].reshape(-1)[rest], err_msg="written outside the result")


# (m, n, k): one tile short every way; the brief's edge case; whole tiles; k past a tile by less than a chunk and
# not whole chunks (gemm_tc_any for bf16 too); tiles across a grid both ways
SHAPES = [(16, 8, 16), (17, 100, 80), (128, 128, 32), (130, 33, 72), (16, 129, 7), (200, 257, 96), (1, 5, 40),
          (64, 40, 24), (65, 40, 24), (5, 70, 48)]  # (64/65: either side of the 64-row tiles; 5: a batch of 5)


@pytest.fixture(scope="module")
def emulated():
    from cuda_host import emu

    if emu.compiler() is None:
        pytest.skip("no g++ to build the emulated kernels")
    with emu.emulating([GemmTc.stem], jobs=1) as env:
        yield env


def emulate(launch, arrays, weights, placed=False):
    from lanefuse.kernels.cupy_env import DeviceEnv

    assert launch.check() is None, launch.check()
    if placed:  # x and y views into one arena at 256-aligned offsets, odd gaps between them
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
    return dev


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("fmt", ["bf16", "f32", "f16"])
def test_emulated_gemm_within_the_bound(emulated, m, n, k, fmt):
    g = np.random.default_rng(m * 1000 + n + k)
    launch = GemmTc("x", "w", fmt, Dst("y"), k, n, m, bias="b" if n % 2 else None)
    arrays, weights = tc_case(launch, g)
    dev = emulate(launch, arrays, weights, placed=(m == 130))
    assert dev.calls[-1][0] == ("gemm_tc_cp" if fmt == "bf16" and k % 8 == 0 else "gemm_tc_any") + (
        "_64" if m <= 64 else "")  # tiles of 64 rows up to 64 rows
    check_within_bound(launch, arrays, weights, dev.host("y"))


@pytest.mark.parametrize("fmt,k", [("q8_0", 96), ("q4_0", 64), ("q4_k", 256), ("q6_k", 256), ("mxfp4", 64)])
def test_emulated_gemm_block_formats(emulated, fmt, k):
    g = np.random.default_rng(k + len(fmt))
    launch = GemmTc("x", "w", fmt, Dst("y"), k, 40, 19)
    arrays, weights = tc_case(launch, g)
    dev = emulate(launch, arrays, weights)
    check_within_bound(launch, arrays, weights, dev.host("y"))


@pytest.mark.parametrize("dst", [Dst("y", unit=Part(23, 2, 19)), Dst("y", row="pos", pitch=19), Dst("y")])
def test_emulated_gemm_epilogue_and_destinations(emulated, dst):
    """A bias and added rows (the residual) in the epilogue; y as parts of wider rows, or rows of a table from the
    row a parameter names; a second launch, blocks reversed and threads shuffled, writes the same bits."""
    g = np.random.default_rng(5)
    launch = GemmTc("x", "w", "bf16", dst, 48, 19, 33, bias="b", add="res")
    arrays, weights = tc_case(launch, g)
    dev = emulate(launch, arrays, weights)
    first = dev.host("y").copy()
    check_within_bound(launch, arrays, weights, first)
    dev.flags, dev.seed = 1, 777
    launch.cuda(dev)
    np.testing.assert_array_equal(dev.host("y"), first)


def test_emulated_one_hot_picks_each_rounded_weight(emulated):
    """x one-hot: each output is one weight rounded to bf16 times 1, summed with zeros: exact, so a fragment's row or
    column taken from the wrong lane or register shows as a wrong value, not a small error."""
    m, n, k = 32, 24, 48
    g = np.random.default_rng(9)
    w = r32(g, n, k)
    x = np.zeros((m, k), np.float32)
    cols = g.integers(0, k, m)
    x[np.arange(m), cols] = 1.0
    launch = GemmTc("x", "w", "f32", Dst("y"), k, n, m)
    dev = emulate(launch, {"x": x, "y": np.zeros(m * n, np.float32)}, {"w": (w, "f32")})
    np.testing.assert_array_equal(dev.host("y").reshape(m, n), bf16_round(w)[:, cols].T)


# -- what the emulator must catch in the pipeline (each a mutated gemm_tc.cu; cp.async lands only when waited for) --

def _mutated_tc(monkeypatch, old: str, new: str):
    from lanefuse.kernels import compile as kc

    text = kc.cu_text("gemm_tc")
    assert old in text, f"gemm_tc.cu no longer holds {old!r}: update the mutation"
    real = kc.cu_text
    monkeypatch.setattr(kc, "cu_text", lambda stem: text.replace(old, new) if stem == "gemm_tc" else real(stem))


@pytest.mark.parametrize("m", [40, 130])
@pytest.mark.parametrize("old,new,trap", [
    # one group too few waited for: step t's stage read before its copies land (the old bytes)
    ("tc_wait<S - 2>();", "tc_wait<S - 1>();", None),
    # the next step copied over the stage being multiplied (and its own stage never filled)
    ("tc_copy_w<T, GLU>(ws[bn],", "tc_copy_w<T, GLU>(ws[b],", None),
    # x's fragments read unswizzled (the copies swizzle): rows' chunks crossed
    ("tc_ldsm4(a[i], &xs[b][r][8 * tc_sw(r, kk + (lane >> 4))]);",
     "tc_ldsm4(a[i], &xs[b][r][8 * (kk + (lane >> 4))]);", None),
    # the ring's wrap missed: stages S, S + 1, ... past the shared tiles. -fsanitize=bounds traps at the first
    # (without it the copies wrote into the heap: CI's "corrupted double-linked list")
    ("bn = bn + 1 == S ? 0 : bn + 1;", "bn = bn + 1 == S - 1 ? 0 : bn + 1;", "index past an array's bound"),
])
@pytest.mark.forked
def test_the_emulator_catches_pipeline_mistakes(emulated, monkeypatch, old, new, trap, m):
    """Each mistake in a bf16 product through the three stages (130 outputs in two tiles, k 200 in seven steps, the
    last part-filled; 40 rows: gemm_tc_cp_64's eight warps, 130: gemm_tc_cp's four warps of 64 x 64 over two row
    tiles): values outside the bound, or the named trap where the mistake indexes past a shared tile (unmutated, the
    same cases pass: test_unmutated_pipeline_case)."""
    _mutated_tc(monkeypatch, old, new)
    g = np.random.default_rng(31)
    launch = GemmTc("x", "w", "bf16", Dst("y"), 200, 130, m)
    arrays, weights = tc_case(launch, g)
    if trap:  # caught as it happens, named
        with pytest.raises(RuntimeError, match=trap):
            emulate(launch, arrays, weights)
        return
    with pytest.raises(AssertionError, match="outside the bound"):
        dev = emulate(launch, arrays, weights)
        check_within_bound(launch, arrays, weights, dev.host("y"))


@pytest.mark.parametrize("m", [40, 130])
def test_unmutated_pipeline_case(emulated, m):
    g = np.random.default_rng(31)
    launch = GemmTc("x", "w", "bf16", Dst("y"), 200, 130, m)
    arrays, weights = tc_case(launch, g)
    dev = emulate(launch, arrays, weights)
    assert dev.calls[-1][0] == "gemm_tc_cp" + ("_64" if m <= 64 else "")
    assert dev.calls[-1][2] == (256 if m <= 64 else 128, 1, 1)  # eight warps, or four of 64 x 64
    check_within_bound(launch, arrays, weights, dev.host("y"))


def test_scratch_holds_rounded_rows():
    launch = GemmTc("x", "w", "bf16", Dst("y"), 13, 4, 17)
    assert launch.scratch()[0].nbytes == 2 * 17 * kp(13) == 2 * 17 * 16


@pytest.mark.parametrize("fmt,k", [("bf16", 72), ("bf16", 13), ("f16", 40), ("q8_0", 64)])
def test_emulated_gemm_in_parts(emulated, fmt, k):
    parts_case(fmt, k, 19 if fmt != "f16" else 130, emulate)


def parts_case(fmt, k, m, run):
    """q, k and v as one launch: parts of 130, 20 and 129 outputs (tiles of 128 each its own), one into parts of wider
    rows, one into a cache's rows at a position, a bias on one; each part within the bound of its own product. `run`
    launches it (emulated, or on a device: tests/test_gemm_tc_gpu.py)."""
    from lanefuse.kernels import GemmPart, GemmTcParts

    g = np.random.default_rng(k + len(fmt))
    parts = (GemmPart("wq", Dst("q"), 130, bias="bq"), GemmPart("wk", Dst("kc", row="pos", pitch=20), 20),
             GemmPart("wv", Dst("qkv", unit=Part(133, 2, 129)), 129))
    launch = GemmTcParts("x", fmt, k, m, parts)
    assert launch.check() is None and launch.grid_block()[0] == (2 + 1 + 2, -(-m // (64 if m <= 64 else 128)), 1)
    arrays = {"x": r32(g, m, k), "q": np.zeros(m * 130, np.float32), "kc": np.zeros((m + 8) * 20, np.float32),
              "pos": np.array([4], np.int32), "qkv": np.zeros(m * 133, np.float32)}
    weights = {f"w{c}": (encode(r32(g, p.n, k) * 0.5, fmt), fmt) for c, p in zip("qkv", parts)}
    weights["bq"] = (r32(g, 130), "f32")
    dev = run(launch, arrays, weights)
    if hasattr(dev, "calls"):
        assert [c[0] for c in dev.calls] == [
            "gemm_tc_round", ("gemm_tc_parts_cp" if fmt == "bf16" and k % 8 == 0 else "gemm_tc_parts_any")
            + ("_64" if m <= 64 else "")]
    for c, p in zip("qkv", parts):
        y = {"q": "q", "k": "kc", "v": "qkv"}[c]
        sub = {"x": arrays["x"], "y": arrays[y]}
        if p.y.row:
            sub[p.y.row] = arrays[p.y.row]
        check_within_bound(replace_y(launch.one(p), "y"), sub,
                           {"w": weights[p.w], **({p.bias: weights[p.bias]} if p.bias else {})}, dev.host(y))


def replace_y(launch: GemmTc, buf: str) -> GemmTc:
    from dataclasses import replace

    return replace(launch, w="w", y=replace(launch.y, buf=buf))


# -- the tail: k split into parts where the tiles fill less than one wave (seed 000's `tail`) -------------------------

@pytest.mark.parametrize("m,n,k,ksplit,fmt", [(17, 100, 80, 2, "bf16"), (130, 33, 72, 3, "f32"), (64, 40, 200, 7, "f16"),
                                              (19, 40, 96, 3, "q8_0"), (200, 257, 160, 4, "bf16")])
def test_emulated_tail_split_within_the_bound(emulated, m, n, k, ksplit, fmt):
    """Each tile's k in `ksplit` parts (grid z; the last part short or empty), the parts added in order by
    gemm_tc_combine with the bias and the added rows: within the same bound as one part (the parts' sums are k
    additions in another order), placed results too; a relaunch, blocks reversed and threads shuffled, the same bits."""
    from dataclasses import replace

    g = np.random.default_rng(m + n + k + ksplit)
    launch = GemmTc("x", "w", fmt, Dst("y", row="pos", pitch=n) if m == 19 else Dst("y"), k, n, m, bias="b",
                    add="res" if m != 19 else None, ksplit=ksplit)
    assert launch.check() is None and launch.grid_block()[0][2] == ksplit
    arrays, weights = tc_case(launch, g)
    dev = emulate(launch, arrays, weights)
    assert [c[0] for c in dev.calls] == ["gemm_tc_round", ("gemm_tc_split_cp" if fmt == "bf16" and k % 8 == 0 else
                                                           "gemm_tc_split_any") + ("_64" if m <= 64 else ""),
                                         "gemm_tc_combine"]
    first = dev.host("y").copy()
    check_within_bound(launch, arrays, weights, first)
    dev.flags, dev.seed = 1, 99
    launch.cuda(dev)
    np.testing.assert_array_equal(dev.host("y"), first)
    assert "parts along k" in str(replace(launch, ksplit=MAX_KSPLIT + 1).check())


def test_tail_split_is_chosen_where_the_model_says_it_pays():
    """At the H200's knobs: a 512-row chunk's o and down projections (128 tiles: under half a wave of 264 blocks)
    split k in two (each SM's lone block at half rate becomes two blocks of half the steps), predicted faster with
    the combine; the qkv/gate-up sizes and a 2048-row chunk (whole waves) do not split; a tiny k does not; held
    (`split_k`), no split."""
    from lanefuse.lane.lower.knobs import Knobs

    kn = Knobs()
    tc = frozenset({"cublas"})  # gemm_tc's own kernel, not its cuBLAS form (kernels/gemm_blas.py): the tail is its
    o = GemmTc("x", "w", "bf16", Dst("y"), 4096, 4096, 512).tune(kn, tc)
    down = GemmTc("x", "w", "bf16", Dst("y"), 12288, 4096, 512).tune(kn, tc)
    assert o.ksplit == 2 and down.ksplit == 2
    args = (kn.sms, kn.tflops_tc, kn.hbm_gbps, kn.launch_us)
    assert tail_us(512, 4096, 4096, 2, *args) < tail_us(512, 4096, 4096, 1, *args)
    assert GemmTc("x", "w", "bf16", Dst("y"), 4096, 4096, 2048).tune(kn, tc).ksplit == 1  # two whole waves
    assert GemmTc("x", "w", "bf16", Dst("y"), 4096, 12288, 512).tune(kn, tc).ksplit == 1  # 384 tiles: past one wave
    assert GemmTc("x", "w", "bf16", Dst("y"), 64, 4096, 512).tune(kn, tc).ksplit == 1  # two k steps
    assert GemmTc("x", "w", "bf16", Dst("y"), 4096, 4096, 512).tune(kn, tc | {"split_k"}).ksplit == 1
    small = GemmTc("x", "w", "bf16", Dst("y"), 4096, 64, 16).tune(kn, tc)  # one tile: as many parts as pay, at most 8
    assert 1 < small.ksplit <= MAX_KSPLIT


# -- the gate and up products' GLU in one launch (gemm_tc_glu*) -----------------------------------------------------

def glu_case(fmt, k, n, m, act="silu", seed=0):
    from lanefuse.kernels.gemm_tc import GemmTcGlu

    g = np.random.default_rng(seed + k + n + m)
    launch = GemmTcGlu("x", "wg", "wu", fmt, "y", k, n, m, act=act)
    arrays = {"x": r32(g, m, k), "y": np.zeros(m * n, np.float32)}
    weights = {w: (encode(r32(g, n, k) * 0.5, fmt), fmt) for w in ("wg", "wu")}
    return launch, arrays, weights


def test_glu_twin_is_the_unfused_plans_twins():
    """GemmTcGlu's twin: to the bit, GemmTcParts' gate and up (the exact twin) then Binary's gated `mul` — the launches
    the lane takes without it; the fast twin within the products' bound carried through the GLU."""
    from lanefuse.kernels import Binary, GemmPart, GemmTcParts

    launch, arrays, weights = glu_case("bf16", 72, 37, 19, act="gelu")
    fused = HostEnv({k: v.copy() for k, v in arrays.items()}, weights)
    launch.numpy(fused)
    m, n = launch.m, launch.n
    parts = GemmTcParts("x", "bf16", 72, 19, (GemmPart("wg", Dst("g"), n), GemmPart("wu", Dst("u"), n)))
    apart = HostEnv({**{k: v.copy() for k, v in arrays.items()}, "g": np.zeros(m * n, np.float32),
                     "u": np.zeros(m * n, np.float32)}, weights)
    parts.numpy(apart)
    Binary("mul", "u", "g", "y", m * n, gate="gelu").numpy(apart)
    np.testing.assert_array_equal(fused.array("y"), apart.array("y"))
    fast = HostEnv({k: v.copy() for k, v in arrays.items()}, weights)
    launch.fast(fast)
    np.testing.assert_allclose(fast.array("y"), fused.array("y"), rtol=2**-12, atol=1e-5)


def glu_bound(launch, arrays, weights):
    """|kernel - twin| of the GLU: the gate's and the up's sums each within tc_bound (bg, bu), through y = u · act(g)
    (|act'| < 1.2 for silu and gelu): |u|·1.2·bg + |act(g)|·bu + 1.2·bg·bu, plus the activation's and the product's
    f32 roundings (2^-21 of the value)."""
    from lanefuse.kernels.common import act

    m, n, k = launch.m, launch.n, launch.k
    x = arrays["x"].reshape(m, k)
    wg, wu = (decode(*weights[w]).reshape(n, k) for w in ("wg", "wu"))
    g, u = tc_products(x, wg), tc_products(x, wu)
    bg, bu = tc_bound(x, wg), tc_bound(x, wu)
    y = launch.glu(g, u)
    return (np.abs(u) * 1.2 * bg + np.abs(act(launch.act, g)) * bu + 1.2 * bg * bu + 2.0**-21 * np.abs(y)
            + 1e-30).reshape(-1), y.reshape(-1)


@pytest.mark.parametrize("fmt,k,n,m,act", [("bf16", 200, 130, 130, "silu"), ("bf16", 72, 37, 19, "gelu"),
                                           ("bf16", 13, 70, 140, "silu"), ("f32", 40, 65, 33, "silu"),
                                           ("q8_0", 64, 20, 70, "gelu_erf")])
def test_emulated_glu_within_the_bound(emulated, fmt, k, n, m, act):
    """gemm_tc_glu_cp (four warps of 64 x 64: 130, 140 rows), _cp_64 (19 rows), _any (k 13: not whole chunks; f32
    rows; q8_0 blocks) against the twin within the products' bounds carried through the GLU, nothing written past
    the m x n outputs; a relaunch, blocks reversed and threads shuffled, the same bits."""
    launch, arrays, weights = glu_case(fmt, k, n, m, act)
    assert launch.check() is None
    arrays["y"] = np.zeros(m * n + 7, np.float32)
    dev = emulate(launch, arrays, weights)
    copied = fmt == "bf16" and k % 8 == 0
    assert dev.calls[-1][0] == ("gemm_tc_glu_cp" if copied else "gemm_tc_glu_any") + ("_64" if m <= 64 else "")
    assert dev.calls[-1][1] == (-(-n // 64), -(-m // (64 if m <= 64 else 128)), 1)
    got = dev.host("y").copy()
    tol, want = glu_bound(launch, arrays, weights)
    err = np.abs(got[: m * n] - want)
    assert (err <= tol).all(), f"{int((err > tol).sum())} of {err.size} outside the bound"
    np.testing.assert_array_equal(got[m * n:], 0)
    dev.flags, dev.seed = 1, 515
    launch.cuda(dev)
    np.testing.assert_array_equal(dev.host("y"), got)


def test_emulated_glu_pairs_each_gate_with_its_up(emulated):
    """x one-hot and the up rows all ones: output (r, j) is act(ŵg[j, c_r]) exactly (one product of 1s, summed with
    zeros): a gate paired with another output's up, or a fragment out of place, shows as a wrong value."""
    from lanefuse.kernels.common import act

    m, n, k = 130, 72, 48
    g = np.random.default_rng(4)
    launch, arrays, weights = glu_case("bf16", k, n, m)
    x = np.zeros((m, k), np.float32)
    cols = g.integers(0, k, m)
    x[np.arange(m), cols] = 1.0
    wg = r32(g, n, k)
    wu = np.ones((n, k), np.float32) * (1.0 + np.arange(n, dtype=np.float32)[:, None])  # up of output j: j + 1
    arrays["x"] = x
    weights = {"wg": (encode(wg, "bf16"), "bf16"), "wu": (encode(wu, "bf16"), "bf16")}
    dev = emulate(launch, arrays, weights)
    gate = bf16_round(wg)[:, cols].T
    want = (1.0 + np.arange(n, dtype=np.float32))[None, :] * act("silu", gate).astype(np.float32)
    np.testing.assert_allclose(dev.host("y").reshape(m, n), want, rtol=2**-20)


def test_glu_refusals_in_words():
    from lanefuse.kernels.gemm_tc import GemmTcGlu

    base = GemmTcGlu("x", "wg", "wu", "bf16", "y", 64, 32, 16)
    assert base.check() is None
    assert "different formats" in str(GemmTcGlu("x", "wg", "wu", "bf16", "y", 64, 32, 16, format_u="q8_0").check())
    assert "quantized" in str(GemmTcGlu("x", "wg", "wu", "bf16", "y", 64, 32, 16, quant="q", quant_words=1).check())
    assert "activation" in str(GemmTcGlu("x", "wg", "wu", "bf16", "y", 64, 32, 16, act="relu6").check())
