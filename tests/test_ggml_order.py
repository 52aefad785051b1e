"""engine/formats/ggml.py, the q8 numerics' restatement of llama.cpp's CPU arithmetic, against llama.cpp's own
functions (tests/ggml_cpu.py: the exported quantize_row_* / ggml_vec_dot_* / ggml_vec_swiglu_f32 of the libggml-cpu
llama-cpp-python ships), bit for bit, at real widths (rows of 576 = 18 blocks of 32, 1536, 2304 = 9 super-blocks); and
its fused multiply-add against exact rational arithmetic. The sgemm / tiled orders (products of several rows) and the
RMS norm are checked against llama.cpp's own tensors in tests/test_q8_real_width.py."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ggml_cpu
from lanefuse.engine.formats import ggml
from lanefuse.engine.formats.quantize import quantize
from lanefuse.engine.formats.blocks import encode

F32 = np.float32
needs_ggml = pytest.mark.skipif(ggml_cpu.lib() is None, reason="needs llama-cpp-python (its libggml-cpu)")
FORMS = {"q8_0": 1, "q8_1": 1, "q8_K": 3}  # llama.cpp's activation form -> lanefuse's quantize words


def _activations(rng, rows: int, k: int) -> np.ndarray:
    """Unit-scale values with outlier channels and a zero block, as real activations look."""
    x = rng.standard_normal((rows, k)).astype(F32)
    x[:, rng.choice(k, 3, replace=False)] *= 40
    x[0, :32] = 0
    return x


@needs_ggml
@pytest.mark.parametrize("fmt", list(ggml_cpu.VEC_DOT_TYPE))
def test_one_row_product_is_llama_cpps_vec_dot_to_the_bit(fmt):
    """A product of one row of llama.cpp's activation form (q8_0, q8_1, q8_K) and rows of each format, summed as
    ggml.dot sums it (vec_dot's eight accumulators, each format's scale products and min terms), equals
    ggml_vec_dot_<fmt>_<form> bit for bit on lanefuse's quantization of the row — which is llama.cpp's own, byte for
    byte. Summing the same int32 block sums in f64 (the old q8 numerics) is an f32 ulp off on most outputs."""
    rng = np.random.default_rng(len(fmt))
    form = ggml_cpu.VEC_DOT_TYPE[fmt]
    for k in ((96, 576, 1536) if form != "q8_K" else (1536, 2304)):  # 3 blocks: iq4_nl's scalar tail
        n = 48
        raw = encode((rng.standard_normal((n, k)) / np.sqrt(k)).astype(F32), fmt).reshape(n, -1)
        x = _activations(rng, 3, k)
        want = ggml_cpu.vec_dot(fmt, raw, ggml_cpu.quantize_rows(x, form), k)
        q = quantize(x, FORMS[form])
        for i in range(3):
            got = ggml.dot_form(quantize(x[i:i + 1], FORMS[form]), raw, fmt, n, k)
            assert np.array_equal(got[0], want[i]), (fmt, k, i, np.abs(got[0] - want[i]).max())
        assert q.words.shape == (3, k)


@needs_ggml
@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_old_f64_sums_part_from_llama_cpp(fmt):
    """Why the restatement: the same products with every block's int sum exact and the blocks summed in f64, then
    rounded once (lanefuse's q8 numerics before), differ from llama.cpp's vec_dot by f32 ulps on many outputs — each
    a possible flip of a quantized word downstream."""
    from lanefuse.engine.formats.quantize import product
    from lanefuse.engine.formats.blocks import decode_rows

    rng = np.random.default_rng(3)
    k, n = 2304, 64
    raw = encode((rng.standard_normal((n, k)) / np.sqrt(k)).astype(F32), fmt).reshape(n, -1)
    x = _activations(rng, 1, k)
    form = ggml_cpu.VEC_DOT_TYPE[fmt]
    want = ggml_cpu.vec_dot(fmt, raw, ggml_cpu.quantize_rows(x, form), k)[0]
    old = product(quantize(x, FORMS[form]), decode_rows(raw.reshape(-1), fmt, k).reshape(n, k))[0]
    assert np.count_nonzero(old != want) >= n // 8
    assert np.array_equal(ggml.dot_form(quantize(x, FORMS[form]), raw, fmt, n, k)[0], want)


@needs_ggml
def test_swiglu_is_ggml_vec_swiglu_to_the_bit():
    """ggml.swiglu (ggml_v_silu's AVX-512 expf polynomial of fused multiply-adds, x/(1+e^-x), times up) equals
    ggml_vec_swiglu_f32 on 16 384 values over ±60, the saturating tails and zero included; numpy's f64 SiLU rounded
    once does not (an ulp apart on a share of them)."""
    rng = np.random.default_rng(5)
    g = np.concatenate([rng.standard_normal(8192) * 4, rng.uniform(-60, 60, 8178), [0.0, -0.0, 150.0, -150.0, 1e3,
                        -1e3, 88.5, -88.5, 1e30, -1e30, 3e38, -3e38, 120.0, -120.0]]).astype(F32)
    u = rng.standard_normal(g.size).astype(F32)
    want = ggml_cpu.swiglu(g, u)
    assert np.array_equal(ggml.swiglu(g, u), want)
    g64 = g.astype(np.float64)
    f64 = (g64 / (1 + np.exp(-g64)) * u).astype(F32)
    assert np.count_nonzero(f64 != want) > 100


def test_rmsnorm_sums_in_a_double_one_after_another():
    """ggml.rmsnorm: the f32 squares summed in a double in order, mean rounded to f32, 1/sqrtf(mean + eps) in f32,
    then x·scale·w each rounded — restated step by step here in Python floats (doubles) for a row of 576."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((2, 576)) * rng.uniform(0.01, 30, (2, 576))).astype(F32)
    w = rng.uniform(0.5, 1.5, 576).astype(F32)
    got = ggml.rmsnorm(x, w, 1e-5)
    for r in range(2):
        total = 0.0
        for v in x[r]:
            total += float(F32(v) * F32(v))
        mean = F32(total / 576)
        scale = F32(F32(1) / np.sqrt(F32(mean + F32(1e-5))))
        assert np.array_equal(got[r], ((x[r] * scale).astype(F32) * w).astype(F32))


def _exact_fma(a: float, b: float, c: float) -> F32:
    """a·b + c in rationals, rounded to f32 to nearest, ties to even (via the two f32 neighbours)."""
    t = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    lo = F32(float(t))  # float(t) rounds once to f64; step to the f32 neighbours around t
    cands = {lo, np.nextafter(lo, F32(np.inf)), np.nextafter(lo, F32(-np.inf))}
    best = min(cands, key=lambda v: (abs(Fraction(float(v)) - t), int(np.asarray(v).view(np.uint32)) & 1))
    return F32(best)


f32s = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-2.0 ** 60, max_value=2.0 ** 60)


@settings(max_examples=400, deadline=None)
@given(f32s, f32s, f32s)
def test_fma_rounds_once(a, b, c):
    """ggml.fma(a, b, c) is a·b + c rounded once to f32 (the FMA instruction's result), for any finite f32 values
    whose result is a normal f32."""
    want = _exact_fma(a, b, c)
    if not np.isfinite(want) or (want != 0 and abs(want) < np.finfo(F32).tiny):
        return
    assert ggml.fma(F32(a), F32(b), F32(c)) == want


def test_fma_breaks_the_double_rounding_tie():
    """The case rounding the f64 sum would get wrong: a·b + c just below an f32 midpoint by less than f64 resolves.
    a = 2^-24·(1 + 2^-18), b = 1 - 2^-18, c = 1 + 2^-23: a·b + c = (1 + 2^-23 + 2^-24) - 2^-60, whose f32 is
    1 + 2^-23; its f64 is the midpoint itself, which f32 rounds to the even 1 + 2^-22."""
    a, b, c = F32(2.0 ** -24 * (1 + 2.0 ** -18)), F32(1 - 2.0 ** -18), F32(1 + 2.0 ** -23)
    twice = F32(np.float64(a) * np.float64(b) + np.float64(c))
    assert twice == F32(1 + 2.0 ** -22)
    assert ggml.fma(a, b, c) == F32(1 + 2.0 ** -23) == _exact_fma(a, b, c)
    assert ggml.fma(np.array([a, a]), np.array([b, -b]), np.array([c, -c])).tolist() == [1 + 2.0 ** -23,
                                                                                         -(1 + 2.0 ** -23)]


def _planted_ties(rng, shape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scales (nb, R, N), integer lane sums (nb, L, R, N) and accumulators (L, R, N) f32 of unit size, with places
    where scale·I + acc is an f32 midpoint in f64 but not exactly (the double-rounding tie a one-pass f64 sum gets
    wrong): scale (2^12+1)·2^-20, I 2^24 - 4095 (their product 2^-20·(2^36 + 1)), acc ±2^40, both signs; and places
    where the f64 sum is an exact midpoint (ties to even, nothing to fix)."""
    nb, lanes, r, n = shape
    scale = rng.uniform(0.01, 0.1, (nb, r, n)).astype(F32)
    ints = rng.integers(-65024, 65025, shape).astype(F32)
    acc = (rng.standard_normal((lanes, r, n)) * 50).astype(F32)
    for _ in range(6):
        b, m, i, j = rng.integers(0, nb), rng.integers(0, lanes), rng.integers(0, r), rng.integers(1, n)
        sign = F32(rng.choice([-1, 1]))
        scale[b, i, j] = F32((2 ** 12 + 1) * 2.0 ** -20)
        ints[b, m, i, j] = sign * F32(2 ** 24 - 4095)
        if b == 0:
            acc[m, i, j] = sign * F32(2.0 ** 40)
    scale[0, 0, 0], ints[0, 0, 0, 0], acc[0, 0, 0] = F32(2.0 ** -24), F32(1), F32(1)  # 1 + 2^-24: an exact tie
    # (output 0 is the exact tie's alone: the planted ones are at outputs 1..N-1)
    return scale, ints, acc


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.sampled_from([(1, 8, 1, 5), (3, 8, 2, 7), (18, 8, 1, 33), (5, 4, 3, 2)]))
def test_the_whole_array_chain_is_fma_after_fma(seed, shape):
    """ggml.chain (each block's fused multiply-add over all lanes, rows and outputs at once, the f64 sum's halfway
    cases mended where they are inexact) equals ggml.fma applied block after block, element by element in turn, with
    planted double-rounding ties; and a tie it mends is where a plain f64-then-f32 rounding is wrong."""
    rng = np.random.default_rng(seed)
    scale, ints, acc = _planted_ties(rng, shape)
    got = ggml.chain([(scale, ints)], shape[0], acc=acc.copy())
    want = acc.copy()
    for b in range(shape[0]):
        for m in range(shape[1]):
            want[m] = ggml.fma(scale[b], ints[b, m], want[m])
    assert np.array_equal(got, want)
    plain = acc.copy()
    for b in range(shape[0]):
        plain = (scale[b].astype(np.float64) * ints[b].astype(np.float64) + plain).astype(F32)
    planted = ints == F32(2 ** 24 - 4095)
    if planted[0].any():
        assert not np.array_equal(plain, want)


def test_prepared_rows_are_kept_for_every_view_of_a_weight():
    """The rows' integers are laid out once a matrix (ggml.prepared) and found again for another view of the same
    bytes (each runner's view of a weight); a copy of them is other bytes, prepared anew; the product is the same."""
    rng = np.random.default_rng(11)
    n, k = 40, 576
    raw = encode((rng.standard_normal((n, k)) / 24).astype(F32), "q4_0").reshape(-1)
    p = ggml.prepared(raw, "q4_0", n, k, 4096)
    assert ggml.prepared(raw.reshape(n, -1), "q4_0", n, k, 4096) is p
    assert ggml.prepared(raw.copy(), "q4_0", n, k, 4096) is not p
    x = quantize(_activations(rng, 2, k), 1)
    assert np.array_equal(ggml.dot_form(x, raw, "q4_0", n, k), ggml.dot_form(x, raw.copy(), "q4_0", n, k))
