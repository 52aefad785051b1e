"""The GEMV family's CUDA kernels run on the CPU: their real sources (kernels/*.cu) built by g++ against a host
emulator of CUDA (tests/cuda_host/emu.h: a block's threads as fibers, __syncthreads and the warp shuffles as
barriers, every deadlock, mask disagreement, misaligned vector load or fault an error), each launch kind's own
`cuda()` run unmodified against them through a stand-in cupy (tests/cuda_host/emu.py), against its numpy twin — the
cases and tolerances of tests/test_kernels_gpu.py (its `both` and `_again`), at sizes emulation affords. Then the
same launch again, its blocks in the reverse order and each block's threads shuffled between barriers: the same
results, and every arrival counter back at zero. Skipped without g++."""

from __future__ import annotations

import numpy as np
import pytest

from parametrized import cases

from lanefuse.engine import flags

import test_kernels_gpu as gpu
import test_quant_gpu as qgpu
from cuda_host import emu
from lanefuse.kernels import Dst, Fold, GemmParts, GemmPart, Gemv, GemvGlu, Norm, Part
from lanefuse.kernels.common import encode

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="no g++ to build the emulated kernels")

r32 = gpu.r32
MODULES = [Gemv.stem, ("gemv_core", "gemv"), GemvGlu.stem, GemmParts.stem, Fold.stem, ("quant", "head_gemv")]


@pytest.fixture(scope="module", autouse=True)
def emulated():
    """The stand-in cupy in sys.modules and DeviceEnv the emulating one for this module's tests; every module built
    first, two at a time (cached across sessions by their sources' hash)."""
    with emu.emulating(MODULES) as env:
        yield env


def counters_zero(launch, dev):
    for s in launch.scratch():
        if s.counter:
            a = dev.scratch(launch, s)
            assert not np.asarray(a).any(), f"arrival counters {s.tag} left {np.asarray(a)[np.asarray(a) != 0]}"


def again_same(launch, dev, names):
    """The launch once more on the same inputs, its blocks in the reverse order, threads shuffled: the same values
    to the bit; the counters left zero after each launch."""
    counters_zero(launch, dev)
    first = {n: dev.host(n).copy() for n in names}
    dev.flags, dev.seed = 1, 12345
    try:
        launch.cuda(dev)
    finally:
        dev.flags, dev.seed = 0, 0
    for n in names:
        np.testing.assert_array_equal(dev.host(n), first[n], err_msg=f"{n} on a second launch")
    counters_zero(launch, dev)


# -- Gemv: the dense formats through gemv_tile16 (one or two rows, 16-byte loads) and gemv_tile_any -----------------

DENSE_K = [7, 130, 260, 256]  # odd; even, not whole words; whole words, not whole 8-value f16 loads; aligned


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("k", DENSE_K)
@pytest.mark.parametrize("m", [1, 2, 3, 9])
@pytest.mark.parametrize("per_warp,split", [(1, 1), (4, 1), (1, 2), (4, 2)])
def test_gemv(fmt, k, m, per_warp, split):
    n = 5 if k < 200 else 33
    gemv_case(fmt, k, n, m, per_warp, split, seed=k + n + m, placed=(m == 3))


def gemv_case(fmt, k, n, m, per_warp, split, seed, placed):
    """A biased GEMV of m rows into a strided output (n of every n + 3), emulated against its twin, and again."""
    g = np.random.default_rng(seed)
    launch = Gemv("x", "w", fmt, Dst("y", unit=Part(n + 3, 1, n)), k, n, m, bias="b", per_warp=per_warp, split=split)
    if launch.check():
        pytest.skip(str(launch.check()))
    dev = gpu.both(launch, {"x": r32(g, m, k), "y": np.zeros(m * (n + 3), np.float32)},
                   {"w": (encode(r32(g, n, k), fmt), fmt), "b": (r32(g, n), "f32")}, placed=placed)
    again_same(launch, dev, ["y"])


# The slab of 3..8 rows over f32/f16/bf16 rows (gemv_slab_cp: 16-byte loads, a ring of SLAB_STAGES steps a lane in
# shared memory): every slab size, and a slab plus a remainder of one and of three rows (9, 11); k of one load a lane
# or less than a warp step (8, 16), a step and a tail (264, 132 in f32), past the ring (4 steps at four outputs a warp:
# 1544 bf16 is 6 steps and a tail of 8 values; 16 at one: 4616 bf16 is 18 steps and a tail, 4612 f32 36), a k of whole
# four-value words but not eight (260: f16/bf16 take gemv_tile_any); n leaving a warp's rows past n (7 at four a warp);
# split-K into chunks of whole 8-value words (1544 / 2: 772 ... not, so the second chunk falls back to gemv_tile_any)
# or not.
SLAB_CASES = [(3, 8, 7), (4, 264, 13), (5, 1544, 7), (6, 16, 9), (7, 260, 7), (8, 776, 13), (9, 264, 7), (11, 520, 9),
              (5, 4616, 5)]


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("m,k,n", SLAB_CASES)
@pytest.mark.parametrize("per_warp,split", [(1, 1), (4, 1), (4, 2)])
def test_gemv_slab(fmt, m, k, n, per_warp, split):
    if fmt == "f32" and k % 8 == 0:
        k -= 4  # whole four-value words, not eight (f32's 16-byte load)
    gemv_case(fmt, k, n, m, per_warp, split, seed=k + n + m + 7 * per_warp, placed=(m == 5))


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("m,k,n", [(3, 264, 7), (8, 1544, 9), (6, 16, 13)])
@pytest.mark.parametrize("per_warp", [1, 4])
def test_gemv_glu_and_parts_slab(fmt, m, k, n, per_warp):
    """GemvGlu (the gate's sums kept one a lane through the up's tile, each lane storing its own output) and
    GemmParts over the slab's tile."""
    g = np.random.default_rng(m + k + per_warp)
    w = {"wg": (encode(r32(g, n, k), fmt), fmt), "wu": (encode(r32(g, n, k), fmt), fmt), "bg": (r32(g, n), "f32"),
         "bu": (r32(g, n), "f32")}
    glu = GemvGlu("x", "wg", "wu", fmt, "o", k, n, m, bg="bg", bu="bu", per_warp=per_warp)
    dev = gpu.both(glu, {"x": r32(g, m, k), "o": np.zeros(m * n, np.float32)}, w)
    again_same(glu, dev, ["o"])
    W = 2 * n + 5
    parts = (GemmPart("wg", Dst("qkv", unit=Part(W, 0, n)), n, bias="bg"),
             GemmPart("wu", Dst("qkv", unit=Part(W, n + 5, n)), n))
    gp = GemmParts("x", fmt, k, m, parts, per_warp=per_warp)
    dev = gpu.both(gp, {"x": r32(g, m, k), "qkv": np.zeros(m * W, np.float32)}, w)
    again_same(gp, dev, ["qkv"])


@pytest.mark.parametrize("fmt,k", [("q8_0", 64), ("q8_0", 96), ("q4_k", 256), ("q4_k", 512)])
@pytest.mark.parametrize("m", [1, 2, 3, 9])
@pytest.mark.parametrize("per_warp,split", [(1, 1), (4, 1), (1, 2), (4, 2)])
def test_gemv_blocks(fmt, k, m, per_warp, split):
    n = 9
    g = np.random.default_rng(k + n + m + len(fmt))
    launch = Gemv("x", "w", fmt, Dst("y", unit=Part(n + 3, 1, n)), k, n, m, bias="b", per_warp=per_warp, split=split)
    if launch.check():
        pytest.skip(str(launch.check()))
    dev = gpu.both(launch, {"x": r32(g, m, k), "y": np.zeros(m * (n + 3), np.float32)},
                   {"w": (encode(r32(g, n, k), fmt), fmt), "b": (r32(g, n), "f32")}, tol=2e-4, placed=(m == 3))
    again_same(launch, dev, ["y"])


# The block formats' one- and two-row path (gemv_tile_b32 over BlockQ8_0 / BlockQ4_0, gemv_tile_q6_k: a few lanes a
# block, x as float4; q4_k, and q8_0 / q4_0 at k 512, through gemv_tile_staged): k of fewer blocks than a warp's step,
# more (a tail), an odd count (q8_0 / q4_0 / q6_k rows then start 2 bytes off a 4-byte word), split-K in whole blocks;
# mxfp4 the four-value path.
BLOCK_ROWS_K = {"q8_0": [96, 352, 512], "q4_0": [96, 352, 512], "q4_k": [256, 1280, 512], "q6_k": [256, 768, 1280],
                "mxfp4": [96, 512]}


@pytest.mark.parametrize("fmt,k", [(f, k) for f, ks in BLOCK_ROWS_K.items() for k in ks])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("per_warp,split", [(1, 1), (4, 1), (1, 2), (4, 2)])
def test_gemv_block_rows(fmt, k, m, per_warp, split):
    n = 7 if k > 300 else 9
    g = np.random.default_rng(k + n + m + len(fmt) + 10 * split)
    launch = Gemv("x", "w", fmt, Dst("y", unit=Part(n + 3, 1, n)), k, n, m, bias="b", per_warp=per_warp, split=split)
    if launch.check():
        pytest.skip(str(launch.check()))
    dev = gpu.both(launch, {"x": r32(g, m, k), "y": np.zeros(m * (n + 3), np.float32)},
                   {"w": (encode(r32(g, n, k), fmt), fmt), "b": (r32(g, n), "f32")}, tol=2e-4)
    again_same(launch, dev, ["y"])


# gemv_tile_staged (q8_0 / q4_0 rows of whole 16-byte words, k a multiple of 256): one stage (k 256: 8 blocks), a
# full stage and a partial one (2304: 64 + 8 blocks), two full stages (4096); split-K whose chunks are whole runs of 8
# blocks (4096 / 2: staged) or not (2304 / 3: chunks of 768 values, the two-byte tile); rows past n in the warp.
# q4_k (stages of 16 super-blocks): one super-block (256), a partial stage (2304: 9), a full and a partial (5120:
# 16 + 4), split-K staged (4096 / 2: 8 a chunk; 2304 / 3: 3 a chunk). q6_k (stages of 8 super-blocks, k and the chunk's
# ends multiples of 2048): one stage (2048), two (4096), split-K staged (4096 / 2, 6144 / 3) or not (2304 / 3 and 2304:
# rows 2 bytes off a word, gemv_tile_q6_k). q4_0's stages are of 128 blocks (Q40_STAGE): a partial one (2304: 72), one
# full (4096), a full and a partial (4352: 128 + 8), two full (8192) and split-K staged at 8192 / 2 (a stage a chunk).
STAGED_K = {"q8_0": [(256, 1), (2304, 1), (4096, 1), (4096, 2), (2304, 3)],
            "q4_0": [(256, 1), (2304, 1), (4096, 1), (4352, 1), (8192, 1), (8192, 2), (4096, 2), (2304, 3)],
            "q4_k": [(256, 1), (2304, 1), (5120, 1), (4096, 2), (2304, 3)],
            "q6_k": [(2048, 1), (4096, 1), (4096, 2), (6144, 3), (2304, 3), (2304, 1)]}


@pytest.mark.parametrize("fmt,k,split", [(f, k, s) for f, ks in STAGED_K.items() for k, s in ks])
@pytest.mark.parametrize("m,per_warp", [(1, 4), (2, 1), (2, 4)])
def test_gemv_staged_rows(fmt, k, split, m, per_warp):
    staged_case(fmt, k, split, m, per_warp)


def staged_case(fmt, k, split, m, per_warp, placed=False):
    """A biased GEMV of m rows of block-format rows (6 outputs, strided) that the staged tile takes, emulated against
    its twin within 3e-4, and again."""
    n = 6
    g = np.random.default_rng(k + m + per_warp + len(fmt) + 10 * split)
    launch = Gemv("x", "w", fmt, Dst("y", unit=Part(n + 3, 1, n)), k, n, m, bias="b", per_warp=per_warp, split=split)
    assert launch.check() is None, launch.check()
    dev = gpu.both(launch, {"x": r32(g, m, k), "y": np.zeros(m * (n + 3), np.float32)},
                   {"w": (encode(r32(g, n, k), fmt), fmt), "b": (r32(g, n), "f32")}, tol=3e-4, placed=placed)
    again_same(launch, dev, ["y"])


# The staged tile at a slab of 3..8 rows (one output a warp; at four a slab of block rows takes gemv_tile_any): the
# slab's sizes and a remainder (11: a slab of 8 and one of 3), every staged format over one stage, a partial one and
# split-K in whole runs (and not: q8_0 2304 / 3's chunks of 768 values take gemv_tile_any), rows past n.
STAGED_SLAB_K = {"q8_0": [(2304, 1), (4096, 2), (2304, 3)], "q4_0": [(4352, 1), (8192, 2)],
                 "q4_k": [(2304, 1), (4096, 2)], "q6_k": [(2048, 1), (6144, 3)]}


@pytest.mark.parametrize("fmt,k,split", [(f, k, s) for f, ks in STAGED_SLAB_K.items() for k, s in ks])
@pytest.mark.parametrize("m,per_warp", [(3, 1), (8, 1), (11, 1), (5, 4)])
def test_gemv_staged_slab(fmt, k, split, m, per_warp):
    staged_case(fmt, k, split, m, per_warp, placed=(m == 8))


@pytest.mark.parametrize("fmt,k", [("q8_0", 2304), ("q4_0", 4352), ("q4_k", 1280), ("q6_k", 2048)])
def test_gemv_staged_slab_decodes_each_value_to_the_bit(fmt, k):
    """Eight rows of x one-hot, each at its own position: each output is one decoded value, so the slab's eighths
    (decoded under a run-time h) must give the twin's values to the bit, each against its own row and position."""
    from lanefuse.engine.formats.blocks import decode_rows

    n = 5
    g = np.random.default_rng(k + 3)
    raw = encode(r32(g, n, k), fmt)
    ref = decode_rows(raw, fmt, k).reshape(n, k)
    at = [0, k - 1, 13, 31 + k // 2, k // 3, 7 + 4 * (k // 5), 8, 255]
    x = np.zeros((8, k), np.float32)
    x[np.arange(8), at] = 1.0
    launch = Gemv("x", "w", fmt, Dst("y"), k, n, 8, per_warp=1)
    dev = gpu.both(launch, {"x": x, "y": np.zeros(8 * n, np.float32)}, {"w": (raw, fmt)}, tol=0)
    np.testing.assert_array_equal(dev.host("y"), ref[:, at].T.reshape(-1))


# (the last five through gemv_tile_staged; q4_0 at 4352 across its 128-block stage)
@pytest.mark.parametrize("fmt,k", [("q8_0", 352), ("q4_0", 352), ("q6_k", 512), ("mxfp4", 96),
                                   ("q8_0", 2304), ("q4_0", 2304), ("q4_0", 4352), ("q4_k", 1280), ("q6_k", 2048)])
@pytest.mark.parametrize("per_warp", [1, 4])
def test_gemv_block_rows_decode_each_value_to_the_bit(fmt, k, per_warp):
    """x one-hot (two rows, two positions): each output is one decoded value times 1 plus zeros, so the kernel's
    decoded values must equal the numpy twin's (engine/formats/blocks.py, gguf's) to the bit."""
    from lanefuse.engine.formats.blocks import decode_rows

    n = 5
    g = np.random.default_rng(k + per_warp)
    raw = encode(r32(g, n, k), fmt)
    ref = decode_rows(raw, fmt, k).reshape(n, k)
    for i0, i1 in [(0, k - 1), (13, 31 + k // 2), (k // 3, 7 + 4 * (k // 5))]:
        x = np.zeros((2, k), np.float32)
        x[0, i0] = x[1, i1] = 1.0
        launch = Gemv("x", "w", fmt, Dst("y"), k, n, 2, per_warp=per_warp)
        dev = gpu.both(launch, {"x": x, "y": np.zeros(2 * n, np.float32)}, {"w": (raw, fmt)}, tol=0)
        np.testing.assert_array_equal(dev.host("y"), np.stack([ref[:, i0], ref[:, i1]]).reshape(-1))


# (the last four through gemv_tile_staged)
@pytest.mark.parametrize("fmt,k", [("q8_0", 160), ("q4_0", 160), ("q6_k", 512),
                                   ("q8_0", 2304), ("q4_0", 2304), ("q4_k", 512), ("q6_k", 2048)])
@pytest.mark.parametrize("m", [1, 2, 6])  # (6: a slab, the staged tile at one output a warp)
@pytest.mark.parametrize("per_warp", [1, 4])
def test_gemv_glu_and_parts_block_rows(fmt, k, m, per_warp):
    g = np.random.default_rng(16 + m)
    n = 11
    w = {"wg": (encode(r32(g, n, k), fmt), fmt), "wu": (encode(r32(g, n, k), fmt), fmt), "bg": (r32(g, n), "f32")}
    glu = GemvGlu("x", "wg", "wu", fmt, "o", k, n, m, bg="bg", per_warp=per_warp)
    dev = gpu.both(glu, {"x": r32(g, m, k), "o": np.zeros(m * n, np.float32)}, w, tol=3e-4)
    again_same(glu, dev, ["o"])
    W = 2 * n + 5
    parts = (GemmPart("wg", Dst("qkv", unit=Part(W, 0, n)), n, bias="bg"),
             GemmPart("wu", Dst("qkv", unit=Part(W, n + 5, n)), n))
    gp = GemmParts("x", fmt, k, m, parts, per_warp=per_warp)
    dev = gpu.both(gp, {"x": r32(g, m, k), "qkv": np.zeros(m * W, np.float32)}, w, tol=3e-4)
    again_same(gp, dev, ["qkv"])


def test_gemv_f32_into_a_cache_row():
    gpu.test_gemv_f32_and_into_a_cache_row()


# -- GemvGlu and GemmParts -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["f32", "bf16", "f16", "q8_0"])
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("per_warp", [1, 4])
def test_gemv_glu_and_parts(fmt, m, per_warp):
    g = np.random.default_rng(6 + m)
    k, n = 128, 19
    tol = 2e-4 if fmt == "q8_0" else 1e-4
    w = {"wg": (encode(r32(g, n, k), fmt), fmt), "wu": (encode(r32(g, n, k), fmt), fmt), "bg": (r32(g, n), "f32")}
    glu = GemvGlu("x", "wg", "wu", fmt, "o", k, n, m, bg="bg", per_warp=per_warp)
    dev = gpu.both(glu, {"x": r32(g, m, k), "o": np.zeros(m * n, np.float32)}, w, tol=tol)
    again_same(glu, dev, ["o"])
    W = 2 * n + 5
    parts = (GemmPart("wg", Dst("qkv", unit=Part(W, 0, n)), n, bias="bg"),
             GemmPart("wu", Dst("kc", row="pos", pitch=n), n), GemmPart("wu", Dst("qkv", unit=Part(W, n + 5, n)), n))
    gp = GemmParts("x", fmt, k, m, parts, per_warp=per_warp)
    dev = gpu.both(gp, {"x": r32(g, m, k), "qkv": np.zeros(m * W, np.float32), "kc": np.zeros(8 * n, np.float32),
                        "pos": np.array([2], np.int32)}, w, tol=tol)
    again_same(gp, dev, ["qkv", "kc"])


# -- Folds: a GEMV then a norm by the last block; products in parts then each head's epilogue by its last block -----

@pytest.mark.parametrize("fmt", ["bf16", "f32", "q8_0"])
@pytest.mark.parametrize("m,k,n,per_warp", [(1, 256, 64, 4), (2, 96, 77, 1), (3, 64, 20, 4)])
def test_fold_gemv_norm(fmt, m, k, n, per_warp):
    _fold_gemv_norm(fmt, m, k, n, per_warp)


def _fold_gemv_norm(fmt, m, k, n, per_warp):
    g = np.random.default_rng(7)
    f = Fold(Gemv("x", "w", fmt, Dst("o"), k, n, m, per_warp=per_warp),
             Norm("res", "nw", "y", m, n, 1e-6, add="o", sum="sum"))
    assert f.fused, f.form()
    arrays = {"x": r32(g, m, k), "o": np.zeros(m * n, np.float32), "res": r32(g, m, n),
              "sum": np.zeros(m * n, np.float32), "y": np.zeros(m * n, np.float32)}
    dev = gpu.both(f, arrays, {"w": (encode(r32(g, n, k), fmt), fmt), "nw": (r32(g, n), "f32")}, tol=3e-4)
    f.cuda(dev)  # the counter was reset: the second launch's last block runs the norm again
    np.testing.assert_allclose(dev.host("sum"), arrays["res"].reshape(-1) + dev.host("o"), rtol=1e-5, atol=1e-5)
    again_same(f, dev, ["o", "sum", "y"])


# A fold's tail two rows at a time (norm.cu's norm_rows_tail<2>): the same bits as a row at a time (the kernels with
# fold_tail<1>), for pairs and a row left over, a pre-normed added operand and heads; rows of 130 values (not
# four-value words) every one alone. (Wide rows: the pair's loads of a pass in one round, 4096 values a row.)
@pytest.mark.parametrize("m,n,heads,pre,per_warp", [(2, 4096, 1, False, 4), (5, 128, 2, True, 1),
                                                    (4, 512, 4, True, 4), (3, 130, 1, False, 1)])
def test_fold_tail_in_pairs_gives_the_bits_of_rows_alone(monkeypatch, m, n, heads, pre, per_warp):
    pairs, alone = _tail_both_ways(monkeypatch, m, n, heads, pre, per_warp)
    for b in pairs:
        np.testing.assert_array_equal(pairs[b], alone[b], err_msg=b)


def test_the_tail_cases_catch_a_pair_normed_by_its_first_row(monkeypatch):
    """The pairs' path is the one those cases run: a pair's second row scaled by the first's rms is off its twin."""
    with pytest.raises(AssertionError, match=r"\ny\n"):  # (the product and its sum are right)
        _tail_both_ways(monkeypatch, 2, 4096, 1, False, 4,
                        ("pinv[j], inv[j], h, hd);", "pinv[j], inv[0], h, hd);"))


def _tail_both_ways(monkeypatch, m, n, heads, pre, per_warp, norm_mutation=None):
    """The fold's o, sum and y (f32 rows: k 40) run by the kernels as they are and with fold_tail<1>: a row at a time;
    each run against the twin (norm.cu mutated by `norm_mutation` in both)."""
    from lanefuse.kernels import PreNorm
    from lanefuse.kernels import compile as kc

    def run():
        g = np.random.default_rng(m * n)
        f = Fold(Gemv("x", "w", "f32", Dst("o"), 40, n, m, per_warp=per_warp),
                 Norm("res", "nw", "y", m, n, 1e-6, heads=heads, add="o", sum="sum",
                      pre=PreNorm("pw", 1e-5) if pre else None))
        assert f.fused, f.form()
        arrays = {"x": r32(g, m, 40), "o": np.zeros(m * n, np.float32), "res": r32(g, m, n),
                  "sum": np.zeros(m * n, np.float32), "y": np.zeros(m * n, np.float32)}
        weights = {"w": (encode(r32(g, n, 40), "f32"), "f32"), "nw": (r32(g, n // heads), "f32"),
                   "pw": (r32(g, n), "f32")}
        dev = gpu.both(f, arrays, weights, tol=3e-4)
        return {b: dev.host(b).copy() for b in ("o", "sum", "y")}

    real = kc.cu_text
    texts = {stem: real(stem) for stem in ("fold", "norm")}
    if norm_mutation:
        assert norm_mutation[0] in texts["norm"], f"norm.cu no longer holds {norm_mutation[0]!r}: update the test"
        texts["norm"] = texts["norm"].replace(*norm_mutation)
    monkeypatch.setattr(kc, "cu_text", lambda stem: texts[stem] if stem in texts else real(stem))
    pairs = run()
    old = "fold_tail(counter, rows, NORM_ARGS);"
    assert old in texts["fold"], f"fold.cu no longer holds {old!r}: update the test"
    texts["fold"] = texts["fold"].replace(old, "fold_tail<1>(counter, rows, NORM_ARGS);")
    return pairs, run()


# -- The LM head and its arg-max in one launch (fold_gemv_argmax): ties, NaN, a batch's advance, the q8 body --------

@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "q4_k"])
@pytest.mark.parametrize("m,k,n,per_warp,advance,ties", [c for c in gpu.GEMV_ARGMAX if c[1] * c[2] <= 256 * 1031])
def test_fold_gemv_argmax(fmt, m, k, n, per_warp, advance, ties):
    if fmt == "q4_k" and k % 256:
        pytest.skip("q4_k rows are whole super-blocks of 256")
    f, g, arrays, weights = gpu.gemv_argmax_case(fmt, m, k, n, per_warp, advance, ties)
    arrays["x"] = r32(g, m, k)
    dev = gpu.both(f, arrays, weights, tol=3e-4)
    gpu.check_gemv_argmax(dev, m, n)
    again_same(f, dev, ["logits", "next"])


@pytest.mark.parametrize("fmt,words,m,advance", [("q8_0", 1, 3, "batch"), ("q4_k", 3, 1, "one")])
def test_fold_gemv_argmax_q8(fmt, words, m, advance):
    """fold_gemv_argmax_q8: the products by gemv_q8.cu's body over the quantized activation, then the arg-max."""
    qgpu.test_fold_gemv_argmax_q8_kernel_equals_its_twin(fmt, words, m, advance)


# q4_k / q6_k rows through gemv_tile_staged in the folds (k 2048: q4_k's eight super-blocks, q6_k's one stage): the
# GEMV then the norm by the last block, and the products in parts then each head's epilogue.
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
@pytest.mark.parametrize("m,n,per_warp", [(1, 40, 4), (2, 33, 1), (5, 33, 1)])  # (5: a slab, the staged tile)
def test_fold_gemv_norm_staged(fmt, m, n, per_warp):
    _fold_gemv_norm(fmt, m, 2048, n, per_warp)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
@pytest.mark.parametrize("m,pw", [(1, 4), (2, 1)])
def test_fold_products_then_head_epilogue_staged(fmt, m, pw):
    g = np.random.default_rng(m + pw + len(fmt))
    f, arrays, weights = gpu._qkv(g, fmt, m, 2048, 4, 2, 16, 16, True, pw, pw == 4, 16, 9)
    assert f.fused, f.form()
    dev = gpu.both(f, arrays, weights, tol=3e-4)
    gpu._again(f, dev, arrays, weights)
    counters_zero(f, dev)
    again_same(f, dev, ["q", "k", "qr", "kc", "vc"])


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("m", [1, 2, 5])
# (heads of 160: fold.cu's head epilogue in two chunks of HEAD_VALUES x 32, the second a part one)
@pytest.mark.parametrize("heads,kv,hd,rot", [(4, 2, 16, 16), (5, 1, 12, 8), (2, 1, 64, 32), (1, 1, 160, 96)])
@pytest.mark.parametrize("norm,pw,bias", [(True, 1, False), (False, 4, True)])
def test_fold_products_then_head_epilogue(fmt, m, heads, kv, hd, rot, norm, pw, bias):
    g = np.random.default_rng(m * hd + heads + pw)
    k, L, pos = (64 if hd != 12 else 33), 16, 9
    if fmt == "q8_0":
        k = 64
    f, arrays, weights = gpu._qkv(g, fmt, m, k, heads, kv, hd, rot, norm, pw, bias, L, pos)
    assert f.fused, f.form()
    dev = gpu.both(f, arrays, weights, tol=2e-4, placed=(m == 5))
    gpu._again(f, dev, arrays, weights)
    counters_zero(f, dev)
    again_same(f, dev, ["q", "k", "qr", "kc", "vc"])


# fold_parts_rope at a slab and four outputs a warp takes gemv_slab_cp (parts_rope.cu: gemv_body<PW, PW >= 4>): k past
# its ring (bf16 1544: 6 steps of the ring's 4; f32 1540: 13 steps and a tail), GQA heads normed and rotated, a slab
# of 6 and one of 8 and 3 (11), against the twin, again in reverse block order, the counters back at zero.
@pytest.mark.parametrize("fmt,k", [("bf16", 1544), ("f32", 1540), ("f16", 1544)])
@pytest.mark.parametrize("m", [6, 11])
def test_fold_parts_rope_slab_past_its_ring(fmt, k, m):
    g = np.random.default_rng(k + m)
    f, arrays, weights = gpu._qkv(g, fmt, m, k, 4, 2, 16, 16, True, 4, True, 32, 9)
    assert f.fused and f.form()[0] == "parts_rope" and f.first.per_warp == 4
    dev = gpu.both(f, arrays, weights, tol=2e-4)
    counters_zero(f, dev)
    again_same(f, dev, ["q", "k", "qr", "kc", "vc"])


# -- the emulator itself: what it must catch (each a mutated gemv_core.cu) ------------------------------------------

def _mutated(monkeypatch, old: str, new: str):
    from lanefuse.kernels import compile as kc

    text = kc.cu_text("gemv_core")
    assert old in text, f"gemv_core.cu no longer holds {old!r}: update the mutation"
    real = kc.cu_text
    monkeypatch.setattr(kc, "cu_text", lambda stem: text.replace(old, new) if stem == "gemv_core" else real(stem))


def _one_gemv(fmt="f16", k=256, m=1, n=9):
    g = np.random.default_rng(0)
    launch = Gemv("x", "w", fmt, Dst("y", unit=Part(n + 3, 1, n)), k, n, m, bias="b")
    return gpu.both(launch, {"x": r32(g, m, k), "y": np.zeros(m * (n + 3), np.float32)},
                    {"w": (encode(r32(g, n, k), fmt), fmt), "b": (r32(g, n), "f32")})


@pytest.mark.parametrize("old,new,error", [
    # the 16-byte loop one step short: wrong values
    ("i < k1; i += 32 * VW)", "i < k1 - VW; i += 32 * VW)", AssertionError),
    # half a warp shuffling: a deadlock in CUDA, an error here
    ("if (r < nr) acc[p][r] = warp_sum(acc[p][r]);",
     "if (r < nr && (threadIdx.x & 31) < 16) acc[p][r] = warp_sum(acc[p][r]);", RuntimeError),
    # a 16-byte load off its alignment
    ("__ldcs((const uint4*)(wr[p] + i * ES))", "__ldcs((const uint4*)(wr[p] + i * ES + 4))", RuntimeError),
    # a float4 load of x off its alignment (a plain dereference: -fsanitize=alignment's trap)
    ("x_values<VW>(x + (r0 + r) * k + i, xv);",
     "x_values<VW>(x + (r0 + r) * k + i + 1, xv);", RuntimeError),
    # a store past the output (the red zone)
    ("d.y[dst_at(d, row * n + j)] =", "d.y[dst_at(d, row * n + j) + 64] =", RuntimeError),
])
@pytest.mark.forked
def test_the_emulator_catches(monkeypatch, old, new, error):
    _mutated(monkeypatch, old, new)
    with pytest.raises(error):
        _one_gemv()


@pytest.mark.parametrize("old,new", [
    # a step read from the ring before its copies complete (the wait one group short: the emulator writes a
    # cp.async's bytes only when its group's wait lets it, so the slot still holds the step S steps back)
    ("tc_wait<S - 2>();  // step t's", "tc_wait<S - 1>();  // step t's"),
    # the ring refilled one step long: step t + S - 1 never copied, its slot read with the step before's values
    ("pn, t + S - 1, is + (S - 1) * STEP < k1);", "pn, t + S, is + S * STEP < k1);"),
    # the slab's rows of x in reverse order against their accumulators
    ("x_values<VW>(xr + r * k + is, xv);",
     "x_values<VW>(xr + (nr - 1 - r) * k + is, xv);"),
])
@pytest.mark.forked
def test_the_slab_cases_catch_a_broken_slab_tile(monkeypatch, old, new):
    """Each a mutated gemv_slab_cp: the slab's cases fail (wrong values), so they take the slab's tile (were it gone,
    `_mutated` fails: its text no longer in gemv_core.cu)."""
    _mutated(monkeypatch, old, new)
    for fmt, (m, k, n), pw in [("bf16", (5, 1544, 7), 4), ("f32", (8, 2052, 13), 1)]:
        with pytest.raises(AssertionError):
            test_gemv_slab(fmt, m, k, n, pw, 1)
    with pytest.raises(AssertionError):  # fold_parts_rope_4's products at a slab
        test_fold_parts_rope_slab_past_its_ring("bf16", 1544, 6)


@pytest.mark.forked
def test_the_one_hot_cases_catch_a_misplaced_staged_value(monkeypatch):
    """gemv_tile_staged's eighths of a piece decoded in the wrong order (values 24-31 of each 32 against x's 0-7, ...):
    the one-hot cases of q4_k and q6_k fail, so those shapes take the staged tile and the one-hot x catches a value
    out of its place."""
    _mutated(monkeypatch, "S::eighth(pc[p], H, wf[p]);", "S::eighth(pc[p], 3 - H, wf[p]);")
    for fmt, k in [("q4_k", 1280), ("q6_k", 2048)]:
        with pytest.raises(AssertionError):
            test_gemv_block_rows_decode_each_value_to_the_bit(fmt, k, 4)
        with pytest.raises(AssertionError):  # the slab's run-time eighth
            test_gemv_staged_slab_decodes_each_value_to_the_bit(fmt, k)


# -- the GPU tests' own GEMV-family cases, at their sizes, emulated --------------------------------------------------

REPLAY = {gpu: ["test_gemv", "test_gemv_f32_and_into_a_cache_row", "test_gemv_glu_and_parts", "test_fold_gemv_norm",
                "test_fold_products_then_head_epilogue", "test_fold_products_then_row_norms_and_a_rotation",
                "test_fold_products_then_absorbed_and_rotated_heads", "test_fold_one_product_then_head_epilogue",
                "test_gemv_blocks", "test_gemv_glu_and_parts_blocks", "test_fold_gemv_norm_blocks",
                "test_fold_products_then_head_epilogue_blocks", "test_norm", "test_rope_parts", "test_fold_gemv_argmax"],
          qgpu: ["test_quant_kernel_equals_its_twin", "test_gemv_q8_kernel_equals_its_twin",
                 "test_gemv_glu_and_parts_q8_kernels_equal_their_twins", "test_fold_q8_kernels_equal_their_twins",
                 "test_norm_quantizing_in_its_epilogue", "test_quantizing_epilogues_equal_the_quant_kernel",
                 "test_gemv_glu_q8k_quant_equals_the_quant_kernel", "test_products_row_norm_quantizing_in_its_epilogue",
                 "test_fold_gemv_argmax_q8_kernel_equals_its_twin",
                 "test_gemv_glu_over_f32_quantizing_q8k", "test_gemv_quantizing_tail_equals_the_quant_kernel"]}


def _replayed():
    out = []
    for mod, names in REPLAY.items():
        for name in names:
            fn = getattr(mod, name, None)
            if fn is None:  # renamed or gone from the GPU tests: nothing to replay
                continue
            for kw in cases(fn):
                out.append(pytest.param(mod, name, kw, id=f"{name}[{'-'.join(map(str, kw.values()))}]"))
    return out


FULL = bool(flags.read("LANEFUSE_EMU_FULL"))


@pytest.mark.slow
@pytest.mark.parametrize("mod,name,kw", _replayed() if FULL else [pytest.param(
    None, None, None, id="all", marks=pytest.mark.skip(reason="the GPU tests' GEMV-family cases at their sizes, "
                                                       "emulated (~500 cases, ~10 min): set LANEFUSE_EMU_FULL=1"))])
def test_gpu_case_emulated(mod, name, kw):
    getattr(mod, name)(**kw)


@pytest.mark.parametrize("pos,extra", gpu.HEAD_FILLED)
def test_head_gemv_filled_rows(pos, extra):
    """head_gemv with a position: the filled rows as the twin computes them, the others left as they were (NaN)."""
    launch, arrays, weights = gpu.head_filled_case(pos, extra)
    dev = gpu.both(launch, arrays, weights, tol=2e-4)
    y = dev.host("kx").reshape(64, -1)
    filled = min(64, pos + extra)
    assert not np.isnan(y[:filled]).any() and np.isnan(y[filled:]).all()
    again_same(launch, dev, ["kx"])
