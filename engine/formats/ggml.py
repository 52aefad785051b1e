"""llama.cpp's CPU arithmetic, restated in numpy, for the q8 numerics: the f32 operations ggml's x86 build (ggml 0.25.3
as llama-cpp-python 0.3.36 compiles it: AVX2, AVX-512, VNNI, FMA) performs, in its order, so that under `--numerics q8`
lanefuse rounds where llama.cpp rounds. At a real model's width a quantized activation turns every f32 ulp apart into
a q8 word or f16 scale apart now and then, and each such flip moves the logits by ~0.1 (tests/test_q8_real_width.py):
the same values summed in another order are not enough.

- Products (`dot`): ggml_vec_dot_<format>_<activation> (ggml-cpu/arch/x86/quants.c) and, for a product of two or
  more rows over q8_0 / q4_0 / q5_0 / iq4_nl, llamafile's tinyBLAS_Q0_AVX (ggml-cpu/llamafile/sgemm.cpp, which
  ggml_compute_forward_mul_mat takes for n >= 2). Both keep eight f32 accumulators: accumulator m collects, block
  after block (a 32-value block, or a 256-value super-block), the exact int32 sum of the products of the values whose
  place in their run of 32 is 4m..4m+3 (a VNNI dpbusd / maddubs+madd lane), times the block's scale product, by one
  fused multiply-add; then hsum_float_8 ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)). The formats differ in the scale
  product and in their extra terms: q4_1 / q5_1 add m·s block after block in an f32 scalar; q4_k its mins in four
  more fused lanes; q5_k its mins in a scalar; q6_k subtracts 32·(its q8_K sums times scales) per lane; iq4_nl's
  vec_dot keeps two accumulators (even and odd blocks) added before the hsum, tinyBLAS one.
- `rmsnorm`: ggml_compute_forward_rms_norm_f32: the f32 squares summed in a double one after another, mean =
  (float)(sum/n), scale = 1.0f/sqrtf(mean + eps), y = x·scale then ·w, each an f32 rounding.
- `silu` / `swiglu`: ggml_v_silu of AVX-512 (ggml-cpu/vec.h): x/(1 + ggml_v_expf(-x)), ggml_v_expf a polynomial of
  fused multiply-adds and a scalef, then ·up in f32 (ggml_vec_swiglu_f32).
- `attend`: the attention without flash attention over an f32 cache: K·Q by ggml_vec_dot_f32 (its 64-value steps of
  four 16-lane accumulators, _mm512_reduce_add_ps as gcc expands it), soft_max (scale, max, ggml_v_expf, a double sum
  of 16-lane sums), V by tinyBLAS<16> for a batch or ggml_vec_dot_f32 for one row; for a NORM-rope model in the
  converter's interleaved head order.
- `rope_tables` / `rope`: ggml_rope_cache_init (theta multiplied by powf(base, -2/n) in f32, libm cosf / sinf) and
  rotate_pairs' contracted rotation; `llama_rope` says for which model configs (the default rope of Llama / Mistral,
  Qwen2 / Qwen3).

`fma` is an exact single-rounding fused multiply-add of f32 values (the product in f64 is exact; the f64 sum's error
is recovered by TwoSum and the one f32 midpoint case corrected), so these are bit-exact restatements, checked against
the library's own exported functions (tests/test_ggml_order.py)."""

from __future__ import annotations

import numpy as np

F32, F64 = np.float32, np.float64
LANES = 8  # f32 accumulators of a 256-bit register
RUN = 32  # values a register of int8 holds: accumulator m takes places 4m..4m+3 of each run
Q0_SGEMM = ("q8_0", "q4_0", "q5_0", "iq4_nl")  # the formats llamafile_sgemm multiplies (n >= 2 rows) on x86
TILED = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")  # ggml-cpu/tiled's formats, from TILED_ROWS rows on
TILED_ROWS = 8  # ggml_tiled_min_batch
FORMATS = ("q8_0", "q4_0", "q5_0", "iq4_nl", "q4_1", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")
WORDS = (1, 3)  # the quantize words of llama.cpp's own forms: q8_0 / q8_1 (one word), q8_K


def ordered(x, fmt: str | None) -> bool:
    """Whether a product of quantized activation x (engine/formats/quantize.Quantized) and rows of `fmt` is one of
    llama.cpp's: x in its q8_0 / q8_1 form (one word, blocks of 32) over rows of 32-value blocks, or in its q8_K form
    over K-quant or iq4_xs rows — what the q8 numerics pair (not q8x2's two words)."""
    if fmt not in FORMATS:
        return False
    if x.block == 256:
        return fmt in TILED
    return x.one_word and fmt not in TILED


def dot_parts(words: np.ndarray, low: np.ndarray | None, scales: np.ndarray, raw: np.ndarray, fmt: str, m: int,
              n: int, k: int) -> np.ndarray | None:
    """`dot` of a quantized activation's flat parts as a launch's env holds them (words (m·k,), low: a q8_K form's
    sums of 16 (int16) or None, scales: the held f32 d32 of each 32 or q8_K's d of each 256) and rows `raw` of `fmt`;
    None where the pair is not one of llama.cpp's (`ordered`)."""
    k_form = low is not None and low.dtype == np.int16
    if fmt not in FORMATS or (low is not None and not k_form) or k_form != (fmt in TILED):
        return None
    bl = 256 if k_form else RUN
    q = np.asarray(words[: m * k], dtype=np.int8).reshape(m, k)
    held = np.asarray(scales[: m * (k // bl)], dtype=F32).reshape(m, k // bl)
    if k_form:
        return dot(q, held, raw, fmt, n, k, sums=np.asarray(low[: m * k // 16]).reshape(m, k // 16))
    d = held.astype(np.float16).astype(F32)  # block_q8_0 / q8_1's f16 d
    sq = q.reshape(m, k // RUN, RUN).astype(np.int32).sum(axis=2).astype(F32)
    return dot(q, d, raw, fmt, n, k, s=(held * sq).astype(F32).astype(np.float16).astype(F32))


def dot_form(x, raw: np.ndarray, fmt: str, n: int, k: int) -> np.ndarray:
    """`dot` of a quantized activation x (R, k) as lanefuse holds it (its one-word form's f16 d and q8_1 s, or its
    q8_K form's d and sums) and rows `raw` (n, k) of `fmt`, R rows a batch."""
    return dot(x.words, x.d(), raw, fmt, n, k, s=x.s() if x.one_word else None, sums=x.sums)


def fma(a, b, c) -> np.ndarray:
    """round_f32(a·b + c), a, b, c f32 (broadcast), rounded once as the FMA instruction rounds: a·b is exact in f64, the
    f64 sum's rounding error (TwoSum) decides the one case where rounding the f64 sum to f32 would round twice (the
    sum exactly halfway between two f32 values)."""
    p = np.asarray(a, dtype=F32).astype(F64) * np.asarray(b, dtype=F32).astype(F64)
    cc = np.asarray(c, dtype=F32).astype(F64)
    s = p + cc
    bb = s - p
    err = (p - (s - bb)) + (cc - bb)
    mid = (np.asarray(s).view(np.uint64) & np.uint64(0x1FFFFFFF)) == np.uint64(0x10000000)  # halfway (normal f32)
    fix = mid & (err != 0)
    if np.any(fix):
        s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return np.asarray(s).astype(F32)


def hsum8(a: np.ndarray) -> np.ndarray:
    """hsum_float_8 of accumulators a (..., 8) f32: (a0+a4 + a2+a6) + (a1+a5 + a3+a7), each sum an f32 rounding."""
    r = (a[..., 4:] + a[..., :4]).astype(F32)
    s = (r[..., :2] + r[..., 2:]).astype(F32)
    return (s[..., 0] + s[..., 1]).astype(F32)


def hsum4(a: np.ndarray) -> np.ndarray:
    """The 4-lane reduction of q4_k's min accumulators: (a0+a2) + (a1+a3)."""
    s = (a[..., :2] + a[..., 2:]).astype(F32)
    return (s[..., 0] + s[..., 1]).astype(F32)


def by_lane(v: np.ndarray) -> np.ndarray:
    """Values (..., nb, B) of blocks of B (a multiple of 32) grouped by accumulator: (..., nb, 8, B/8), lane m holding
    places 4m..4m+3 of each run of 32, runs in order."""
    *lead, nb, bl = v.shape
    return v.reshape(*lead, nb, bl // RUN, LANES, 4).swapaxes(-3, -2).reshape(*lead, nb, LANES, bl // LANES)


def lanes_first(ints: np.ndarray, nb: int, bl: int) -> np.ndarray:
    """Integers (R, nb·bl) as the left operand of the lanes' batched product: (nb·8, R, bl/8) f32, group g = 8b + m
    the values of block b's lane m."""
    r = ints.shape[0]
    v = by_lane(np.asarray(ints).reshape(r, nb, bl).astype(F32))
    return np.ascontiguousarray(v.reshape(r, nb * LANES, bl // LANES).transpose(1, 0, 2))


def mid_fix(s: np.ndarray, scale: np.ndarray, ints: np.ndarray, acc: np.ndarray, low: np.ndarray,
            mid: np.ndarray) -> None:
    """Where the f64 sum s of scale·ints + acc lies exactly halfway between two f32 values (its low 29 bits), the one
    case where rounding it to f32 rounds twice: those places of s set to `fma`'s single rounding (its f64 stand-in)."""
    np.bitwise_and(s.view(np.uint64), np.uint64(0x1FFFFFFF), out=low)
    np.equal(low, np.uint64(0x10000000), out=mid)
    if mid.any():
        at = np.flatnonzero(mid)
        flat = s.reshape(-1)
        p = np.asarray(scale, dtype=F32).reshape(-1)[at % scale.size].astype(F64)  # scale (R, N) over (L, R, N)
        p *= np.asarray(ints, dtype=F32).reshape(-1)[at]
        c = acc.reshape(-1)[at].astype(F64)
        t = flat[at]
        bb = t - p
        err = (p - (t - bb)) + (c - bb)  # TwoSum: the f64 sum's rounding error (0 where it is exact)
        fix = err != 0
        if fix.any():
            flat[at[fix]] = np.nextafter(t[fix], np.where(err[fix] > 0, np.inf, -np.inf))


def chain(terms, nb: int, acc: np.ndarray | None = None, step: int = 1, start: int = 0) -> np.ndarray:
    """acc (L, R, N) f32 after, for blocks b = start, start+step, ... in turn and each (scale, ints) of `terms` in
    order, acc = fma(scale[b], f32(ints[b]), acc): scale (nb, R, N) f32 (one a block, over the L lanes), ints
    (nb, L, R, N) exact integers (f32, or f64 rounded to f32 here as cvtepi32_ps rounds). Each fused multiply-add
    over the whole array at once: the exact product and sum in f64, rounded to f32 (mid_fix: the halfway case)."""
    terms = [(np.asarray(sc, dtype=F32), np.asarray(i, dtype=F32)) for sc, i in terms]
    shape = terms[0][1].shape[1:]
    acc = np.zeros(shape, dtype=F32) if acc is None else acc
    s = np.empty(shape, dtype=F64)
    low, mid = np.empty(shape, dtype=np.uint64), np.empty(shape, dtype=bool)
    for b in range(start, nb, step):
        for sc, ints in terms:
            np.multiply(ints[b], sc[b], out=s, dtype=F64)  # exact: 24-bit scale times an integer below 2^24
            np.add(s, acc, out=s)
            mid_fix(s, sc[b], ints[b], acc, low, mid)
            np.copyto(acc, s, casting="same_kind")
    return acc


class Prepared:
    """Rows `raw` (n, k) of `fmt` as llama.cpp's products multiply them, made once a matrix: the integers of each
    accumulator's lane in f32, (nb·8, B/8, c) a chunk of c rows (exact: the integers are at most 4096 in magnitude
    and a lane's products sum below 2^24 in any order — at most 32 of 128·4096 — so one batched f32 matmul sums
    them), each block's f16 scale (n, nb) f32, and q4_1's / q5_1's mins, the K-quants' dmin and integer mins, q6_k's
    scales (and each value's, by lane)."""

    def __init__(self, raw: np.ndarray, fmt: str, n: int, k: int, chunk: int):
        from lanefuse.engine.formats.ints import INT_FORMATS, k_ints, weight_ints

        self.fmt, self.n, self.k = fmt, n, k
        self.bl = RUN if fmt in INT_FORMATS else 256
        self.nb = k // self.bl
        raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, -1)
        self.mw = self.dmin = self.mins = self.sc = None
        if fmt in INT_FORMATS:
            w, self.dw, self.mw = weight_ints(raw, fmt, n, k)
        else:
            w, self.dw, self.dmin, self.mins = k_ints(raw, fmt, n, k)
        self.spans = [(j, min(n, j + chunk)) for j in range(0, n, chunk)]
        self.lanes = [self._lanes(w[j0:j1]) for j0, j1 in self.spans]
        self.scv = None
        if fmt == "q6_k":  # each value's int8 scale, by lane; and the scales of 16 (n, nb, 16)
            sc = raw.reshape(n * self.nb, 210)[:, 192:208].view(np.int8).reshape(n, self.nb, 16)
            self.sc = sc.astype(np.int64)
            scv = np.repeat(sc.astype(np.int16), 16, axis=2)
            self.scv = [self._lanes(scv[j0:j1]) for j0, j1 in self.spans]
        self.bytes = sum(a.nbytes for a in self.lanes) + sum(a.nbytes for a in self.scv or ())

    def _lanes(self, w: np.ndarray) -> np.ndarray:
        c = w.shape[0]
        v = by_lane(np.asarray(w).reshape(c, self.nb, self.bl).astype(F32))  # (c, nb, 8, B/8)
        return np.ascontiguousarray(v.reshape(c, self.nb * LANES, self.bl // LANES).transpose(1, 2, 0))

    def lane_sums(self, xl: np.ndarray, i: int, lanes: list | None = None) -> np.ndarray:
        """xl (nb·8, R, B/8) f32 (lanes_first) times chunk i: (nb, 8, R, c) f32, each block's exact lane sums."""
        y = np.matmul(xl, (lanes or self.lanes)[i])
        return y.reshape(self.nb, LANES, xl.shape[1], y.shape[-1])


_PREPARED: dict[tuple, tuple] = {}  # (id(owner), offset, bytes, fmt, n, k, chunk) -> (weakref to owner, Prepared)
PREPARED_MEMORY = 0.25  # matrices prepared once while they take at most this share of the machine's memory
_held = [0]


def _budget() -> int:
    import os

    try:
        return int(PREPARED_MEMORY * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 1 << 31


def prepared(raw: np.ndarray, fmt: str, n: int, k: int, chunk: int) -> Prepared:
    """Rows `raw` of `fmt` Prepared, kept while the array that owns raw's bytes lives (a weight's: every view of it,
    each plan's runner's, finds the same) and the kept matrices fit PREPARED_MEMORY; else made for this product
    alone."""
    import weakref

    owner = raw
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    at = raw.__array_interface__["data"][0] - owner.__array_interface__["data"][0]
    key = (id(owner), at, raw.nbytes, fmt, n, k, chunk)
    hit = _PREPARED.get(key)
    if hit is not None and hit[0]() is owner:
        return hit[1]
    p = Prepared(raw, fmt, n, k, chunk)
    if _held[0] + p.bytes <= _budget():
        _PREPARED[key] = (weakref.ref(owner), p)
        _held[0] += p.bytes
        weakref.finalize(owner, _drop, key, p.bytes)
    return p


def _drop(key: tuple, size: int) -> None:
    if _PREPARED.pop(key, None) is not None:
        _held[0] -= size


def lane_sums(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Integers x (R, nb, B) and w (N, nb, B): each block's exact sum of products per accumulator, (R, N, nb, 8) f64
    (integers below 2^53: f64 matmuls are exact)."""
    r, nb, bl = x.shape
    n = w.shape[0]
    a = by_lane(np.asarray(x, dtype=F64)).transpose(1, 2, 0, 3).reshape(nb * LANES, r, bl // LANES)
    b = by_lane(np.asarray(w, dtype=F64)).transpose(1, 2, 3, 0).reshape(nb * LANES, bl // LANES, n)
    return np.matmul(a, b).reshape(nb, LANES, r, n).transpose(2, 3, 0, 1)


def lanes_last(a: np.ndarray) -> np.ndarray:
    """Accumulators (L, R, N) as (R, N, L), for hsum8 / hsum4."""
    return np.moveaxis(a, 0, -1)


# -- products ---------------------------------------------------------------------------------------------------------

def dot(words: np.ndarray, d: np.ndarray, raw: np.ndarray, fmt: str, n: int, k: int, s: np.ndarray | None = None,
        sums: np.ndarray | None = None, batch: int | None = None, chunk: int = 4096) -> np.ndarray:
    """y (R, n) f32 = x · wᵀ as llama.cpp's CPU build computes it: x a quantized activation — its int8 words (R, k), its
    blocks' scales d (R, k/B) f32 as ggml multiplies them (q8_0 / q8_1: the f16 d; q8_K: the f32 d), q8_1's s (R, k/32)
    f32 for q4_1 / q5_1 rows and q8_K's sums of 16 words (R, k/16) for the K-quants' — and w the rows `raw` of `fmt`
    (n, k), Prepared once a matrix. Two rows or more over Q0_SGEMM rows take tinyBLAS's order (one accumulator chain),
    else vec_dot's."""
    from lanefuse.engine.formats.ints import INT_FORMATS

    r = words.shape[0]
    batch = r if batch is None else batch
    p = prepared(raw, fmt, n, k, chunk)
    xl = lanes_first(words, p.nb, p.bl)
    d = np.asarray(d, dtype=F32).reshape(r, p.nb)
    out = np.empty((r, n), dtype=F32)
    for i, (j0, j1) in enumerate(p.spans):
        if fmt in INT_FORMATS:
            out[:, j0:j1] = _dot_q0(xl, d, s, p, i, batch)
        elif fmt in TILED and batch >= TILED_ROWS:
            out[:, j0:j1] = _dot_tiled(xl, d, sums, p, i)
        else:
            out[:, j0:j1] = _dot_k(xl, d, sums, p, i)
    return out


def _dot_q0(xl, d, s, p: Prepared, i: int, batch: int):
    """Rows of 32-value blocks: q8_0 / q4_0 / q5_0 / iq4_nl (with q8_0) and q4_1 / q5_1 (with q8_1)."""
    j0, j1 = p.spans[i]
    nb = p.nb
    ints = p.lane_sums(xl, i)  # (nb, 8, R, c)
    scale = (p.dw[j0:j1].T[:, None, :] * d.T[:, :, None]).astype(F32)  # (nb, R, c): f16 · f16, exact in f32
    if p.mw is not None:  # vec_dot_q4_1_q8_1 / q5_1: acc = fma(q, dx·dy, acc); summs += m·s, a block at a time
        acc = chain([(scale, ints)], nb)
        ms = (p.mw[j0:j1].T[:, None, :] * np.asarray(s, dtype=F32).T[:, :, None]).astype(F32)  # f16 · f16: exact
        summs = np.zeros(ms.shape[1:], dtype=F32)
        for b in range(nb):
            summs = (summs + ms[b]).astype(F32)
        return (hsum8(lanes_last(acc)) + summs).astype(F32)
    if p.fmt == "iq4_nl" and batch < 2:  # vec_dot_iq4_nl_q8_0: block pairs, even and odd in two accumulators
        pairs = nb - nb % 2
        a1 = chain([(scale, ints)], pairs, step=2, start=0)
        a2 = chain([(scale, ints)], pairs, step=2, start=1)
        y = hsum8(lanes_last((a1 + a2).astype(F32)))
        if nb % 2:  # its scalar tail: sumf += d·(sumi1 + sumi2), contracted to a fused multiply-add
            y = fma(scale[-1], ints[-1].sum(axis=0, dtype=F64).astype(F32), y)
        return y
    return hsum8(lanes_last(chain([(scale, ints)], nb)))


def _pair_sums(bs: np.ndarray, m: np.ndarray, groups: int) -> np.ndarray:
    """Σ over each of `groups` runs of adjacent j of bs (R, nb, J) · m (c, nb, J), integers: (nb, groups, R, c) f64
    (exact: below 2^53)."""
    r, nb, j = bs.shape
    c = m.shape[0]
    a = np.asarray(bs, dtype=F64).reshape(r, nb, groups, j // groups).transpose(1, 2, 0, 3)  # (nb, G, R, J/G)
    b = np.asarray(m, dtype=F64).reshape(c, nb, groups, j // groups).transpose(1, 2, 3, 0)  # (nb, G, J/G, c)
    return np.matmul(a, b)


def _dot_k(xl, d, sums, p: Prepared, i: int):
    """Rows of 256-value super-blocks (q2_k... q6_k, iq4_xs) with q8_K: ggml_vec_dot_<fmt>_q8_K's AVX2 order."""
    j0, j1 = p.spans[i]
    nb, fmt = p.nb, p.fmt
    r = xl.shape[1]
    ints = p.lane_sums(xl, i)  # (nb, 8, R, c)
    if fmt == "q6_k":  # q6's values are unsigned (0..63); 32·Σ sc·q8 over sub-blocks 2m, 2m+1 comes off lane m
        bs = np.asarray(sums).reshape(r, nb, 16)
        sub = _pair_sums(bs, p.sc[j0:j1], LANES)
        ints = ints.astype(F64) + 32 * p.lane_sums(xl, i, p.scv).astype(F64) - 32 * sub
    scale = (d.T[:, :, None] * p.dw[j0:j1].T[:, None, :]).astype(F32)  # (nb, R, c): y.d · f16(x.d)
    if fmt == "q2_k":  # per super-block its mins first (dmin · Σ mins·sums over 16-value pairs, a lane), then d · I
        bs = np.asarray(sums).reshape(r, nb, 16)
        prod = _pair_sums(bs, p.mins[j0:j1], LANES)
        dm = (-d.T[:, :, None] * p.dmin[j0:j1].T[:, None, :]).astype(F32)
        return hsum8(lanes_last(chain([(dm, prod), (scale, ints)], nb)))
    acc = chain([(scale, ints)], nb)
    if fmt in ("q4_k", "q5_k"):
        bs = np.asarray(sums, dtype=np.int64).reshape(r, nb, 16)
        s32 = bs.reshape(r, nb, 8, 2).sum(axis=3)  # q8_K's sums of 32
        mn = np.asarray(p.mins[j0:j1, :, ::2], dtype=np.int64)  # (c, nb, 8): the mins of sub-blocks of 32
        dm = (-d.T[:, :, None] * p.dmin[j0:j1].T[:, None, :]).astype(F32)  # -y.d · f16(x.dmin)
        if fmt == "q4_k":  # four more accumulators: lane i the mins of sub-blocks 2i, 2i+1
            am = chain([(dm, _pair_sums(s32, mn, 4))], nb)
            return (hsum8(lanes_last(acc)) + hsum4(lanes_last(am))).astype(F32)
        # q5_k: summs += dmin · M (M the int sum of the mins times the sums of 32): the compiler contracts it to one
        # fused multiply-add (gcc's default -ffp-contract=fast under -std=gnu11)
        m_all = _pair_sums(s32, mn, 1)[:, 0].astype(F32)  # (nb, R, c)
        summs = np.zeros(m_all.shape[1:], dtype=F32)
        for b in range(nb):
            summs = fma(dm[b], m_all[b], summs)
        return (hsum8(lanes_last(acc)) + summs).astype(F32)
    return hsum8(lanes_last(acc))


def _dot_tiled(xl, d, sums, p: Prepared, i: int):
    """K-quant and iq4_xs rows times 8 or more rows of q8_K (ggml-cpu/tiled, its AVX-512 VNNI microkernel): per
    super-block the exact int sum I of the products (and M of the mins times q8_K's sums), r = f32(I)·d, less dmin·M
    by one fused multiply-add, then buf = fma(r, dx, buf), super-block after super-block."""
    j0, j1 = p.spans[i]
    nb = p.nb
    r = xl.shape[1]
    ints = p.lane_sums(xl, i).sum(axis=1, dtype=F64)  # (nb, R, c): exact
    res = (ints.astype(F32) * p.dw[j0:j1].T[:, None, :]).astype(F32)
    if p.mins is not None:
        bs = np.asarray(sums).reshape(r, nb, 16)
        m = _pair_sums(bs, p.mins[j0:j1], 1)[:, 0].astype(F32)
        res = fma(-p.dmin[j0:j1].T[:, None, :], m, res)
    buf = np.zeros(res.shape[1:], dtype=F32)
    for b in range(nb):
        buf = fma(res[b], d.T[b][:, None], buf)
    return buf


# -- the other ops ----------------------------------------------------------------------------------------------------

def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """ggml_compute_forward_rms_norm_f32 then the mul by w, rows x (R, n) f32."""
    xs = np.asarray(x, dtype=F32)
    n = xs.shape[-1]
    sq = (xs * xs).astype(F32).astype(F64)
    total = np.cumsum(sq, axis=-1)[..., -1]  # one after another, in a double
    mean = (total / n).astype(F32)
    scale = (F32(1) / np.sqrt((mean + F32(eps)).astype(F32))).astype(F32)
    return ((xs * scale[..., None]).astype(F32) * np.asarray(w, dtype=F32)).astype(F32)


def _h(s: str) -> F32:
    return F32(float.fromhex(s))


def expf(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf (AVX-512): exp(x) in f32 by its fused multiply-adds, exactly as the instructions round."""
    x = np.asarray(x, dtype=F32)
    r = _h("0x1.8p23")
    z = fma(x, _h("0x1.715476p+0"), r)
    n = (z - r).astype(F32)
    b = fma(-n, _h("0x1.7f7d1cp-20"), fma(-n, _h("0x1.62e4p-1"), x))  # fnmadd(a, b, c) = -(a·b) + c
    u = (b * b).astype(F32)
    j = fma(fma(fma(_h("0x1.0e4020p-7"), b, _h("0x1.573e2ep-5")), u, fma(_h("0x1.555e66p-3"), b, _h("0x1.fffdb6p-2"))),
            u, fma(_h("0x1.ffffecp-1"), b, F32(1)))
    with np.errstate(over="ignore", under="ignore"):
        res = np.ldexp(j, np.clip(n, -300, 300).astype(np.int32)).astype(F32)
    big = np.abs(n) > 192
    return np.where(big, np.where(n <= 0, F32(0), F32(np.inf)), res).astype(F32)  # mask_blend: n <= 0 takes 0


def silu(x: np.ndarray) -> np.ndarray:
    """ggml_v_silu: x / (1 + expf(-x)) in f32."""
    x = np.asarray(x, dtype=F32)
    with np.errstate(over="ignore", invalid="ignore"):
        return (x / (F32(1) + expf((F32(0) - x).astype(F32))).astype(F32)).astype(F32)


def swiglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """ggml_vec_swiglu_f32: silu(g)·u in f32."""
    return (silu(g) * np.asarray(u, dtype=F32)).astype(F32)


# -- attention (no flash attention, an f32 KV cache) --------------------------------------------------------------------

def reduce16(a: np.ndarray) -> np.ndarray:
    """_mm512_reduce_add_ps of a (..., 16) f32 as gcc expands it: the halves added, then the quarters, then lanes
    (0+2) and (1+3), then those two."""
    t = (a[..., 8:] + a[..., :8]).astype(F32)
    t = (t[..., 4:] + t[..., :4]).astype(F32)
    t = (t[..., :2] + t[..., 2:]).astype(F32)
    return (t[..., 0] + t[..., 1]).astype(F32)


def _padded(a: np.ndarray, mult: int) -> np.ndarray:
    n = a.shape[-1]
    pad = -n % mult
    return a if not pad else np.concatenate([a, np.zeros(a.shape[:-1] + (pad,), dtype=a.dtype)], axis=-1)


def vec_dot_f32(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_f32 (AVX-512) of x and y (..., n) f32: four accumulators of 16 lanes over steps of 64 values,
    fused multiply-adds, then accumulators 0+2 and 1+3, their sum, and reduce16; the values past the last whole 64
    one at a time into the f32 sum (a fused multiply-add as the compiler contracts `sumf += x[i]*y[i]`)."""
    x, y = np.asarray(x, dtype=F32), np.asarray(y, dtype=F32)
    n = x.shape[-1]
    whole = n - n % 64
    lead = np.broadcast_shapes(x.shape[:-1], y.shape[:-1])
    acc = np.zeros(lead + (4, 16), dtype=F32)
    for i in range(0, whole, 64):
        acc = fma(x[..., i:i + 64].reshape(x.shape[:-1] + (4, 16)), y[..., i:i + 64].reshape(y.shape[:-1] + (4, 16)),
                  acc)
    s = ((acc[..., 0, :] + acc[..., 2, :]).astype(F32) + (acc[..., 1, :] + acc[..., 3, :]).astype(F32)).astype(F32)
    total = reduce16(s)
    for i in range(whole, n):
        total = fma(x[..., i], y[..., i], total)
    return total


def sgemm_dot_f32(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """llamafile's tinyBLAS<16, __m512> dot of x and y (..., k), k a multiple of 16 (zeros pad it here: they leave
    every accumulator as it is): one 16-lane accumulator of fused multiply-adds over steps of 16, then reduce16."""
    x, y = _padded(np.asarray(x, dtype=F32), 16), _padded(np.asarray(y, dtype=F32), 16)
    k = x.shape[-1]
    acc = np.zeros(np.broadcast_shapes(x.shape[:-1], y.shape[:-1]) + (16,), dtype=F32)
    for i in range(0, k, 16):
        acc = fma(x[..., i:i + 16], y[..., i:i + 16], acc)
    return reduce16(acc)


def softmax(s: np.ndarray, scale: float) -> np.ndarray:
    """ggml_compute_forward_soft_max_f32 of rows of kept logits s (..., T) (the masked ones are -inf there: they add
    0): s·scale in f32, the max, e = ggml_v_expf(s - max), their sum in a double 16 at a time (reduce16 each, added
    in order), then e·(float)(1/sum)."""
    w = (np.asarray(s, dtype=F32) * F32(scale)).astype(F32)
    e = expf((w - w.max(axis=-1, keepdims=True)).astype(F32))
    parts = reduce16(_padded(e, 16).reshape(e.shape[:-1] + (-1, 16))).astype(F64)
    total = np.cumsum(parts, axis=-1)[..., -1]  # one after another, in a double
    return (e * (1.0 / total).astype(F32)[..., None]).astype(F32)


def interleaved(a: np.ndarray) -> np.ndarray:
    """Heads (..., hd) in half-split order (transformers') as llama.cpp's converter orders a NORM-rope model's q / k
    rows: value i of the first half at 2i, of the second half at 2i+1."""
    a = np.asarray(a)
    half = a.shape[-1] // 2
    out = np.empty_like(a)
    out[..., 0::2], out[..., 1::2] = a[..., :half], a[..., half:]
    return out


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, batch: int, pairs: bool = False) -> np.ndarray:
    """One query row's head q (..., hd) over its kept keys k (..., T, hd) and values v (..., T, vd) (leading axes:
    heads attended at once, each alone), as llama.cpp's CPU build attends without flash attention over an f32 cache of
    a whole number of 64 cells (here its 256): K·Q by vec_dot_f32 (the query is a permuted view, never sgemm's), the
    softmax, and the values' sums by tinyBLAS where the batch has two rows or more (its V·KQ product is contiguous),
    else by vec_dot_f32 over the cells (the padding cells, zeros, change no sum). `pairs`: q and k in half-split
    order, summed in llama.cpp's interleaved one (a NORM-rope model, whose rows its converter permuted)."""
    if pairs:
        q, k = interleaved(q), interleaved(k)
    s = vec_dot_f32(k, np.asarray(q)[..., None, :])
    p = softmax(s, scale)
    vt = np.ascontiguousarray(np.swapaxes(np.asarray(v, dtype=F32), -1, -2))  # (..., vd, T): the transposed V cache
    if batch >= 2:
        return sgemm_dot_f32(vt, p[..., None, :])
    return vec_dot_f32(_padded(vt, 64), _padded(p, 64)[..., None, :])


# -- rope (llama.cpp's rope cache and rotation) ---------------------------------------------------------------------

def _libm():
    import ctypes
    import ctypes.util

    m = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    for name in ("cosf", "sinf"):
        getattr(m, name).restype, getattr(m, name).argtypes = ctypes.c_float, [ctypes.c_float]
    m.powf.restype, m.powf.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
    return m


def rope_tables(positions: int, n_dims: int, base: float, freq_scale: float = 1.0,
                freq_factors=None) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's rope cache (ggml_rope_cache_init and rope_yarn with no YaRN ramp, ext_factor 0, mscale 1): at
    position p, theta = (float)p, then theta *= powf(base, -2.0f/n_dims) pair after pair, in f32; pair i's angle
    freq_scale · (theta / freq_factors[i]) in f32 (linear scaling: freq_scale = 1/factor; llama3 scaling: the file's
    rope_freqs.weight as freq_factors) and its cosf / sinf (the C library's, which llama.cpp links): cos, sin
    (positions, n_dims/2) f32. (transformers' angles, p·base^(-2i/n) in f64, differ by up to ~1e-5 of a radian at the
    256th position.)"""
    m = _libm()
    scale = F32(m.powf(F32(base), F32(-2.0 / n_dims)))
    fs = F32(freq_scale)
    ff = np.ones(n_dims // 2, dtype=F32) if freq_factors is None else np.asarray(freq_factors, dtype=F32)
    c = np.zeros((positions, n_dims // 2), dtype=F32)
    s = np.zeros_like(c)
    for p in range(positions):
        theta = F32(p)
        for i in range(n_dims // 2):
            angle = F32(fs * F32(theta / ff[i]))  # theta_interp = freq_scale · theta_extrap, theta_extrap = theta/ff
            c[p, i], s[p, i] = m.cosf(angle), m.sinf(angle)
            theta = F32(theta * scale)
    return c, s


def rope(x1: np.ndarray, x2: np.ndarray, c: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """rotate_pairs' x0·cos - x1·sin and x0·sin + x1·cos as gcc compiles them: the first product fused into the
    subtraction / addition of the second, rounded."""
    return fma(x1, c, -(x2 * s).astype(F32)), fma(x1, s, (x2 * c).astype(F32))


NORM_ROPE = ("LlamaForCausalLM", "MistralForCausalLM")  # llama.cpp's NORM rope: its converter interleaves q / k rows
NEOX_ROPE = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")  # its NEOX rope: the halves as transformers holds them


class LlamaRope:
    """A model's rope as llama.cpp computes it: its cache (`rope_tables`) in place of the step's rope.cos / rope.sin,
    and whether its heads are summed in the converter's interleaved order (`pairs`: a NORM-rope architecture)."""

    def __init__(self, cos: np.ndarray, sin: np.ndarray, pairs: bool):
        self.cos, self.sin, self.pairs = cos, sin, pairs


_ROPES: dict[tuple, LlamaRope] = {}


def llama_rope(cfg) -> LlamaRope | None:
    """llama.cpp's rope for a model config, where its recipe is restated here: the default rope, linear scaling (its
    freq_scale 1/factor in f32) or a GGUF file's rope_freqs.weight (llama3 scaling: `freq_factors`), every dimension
    of a head rotated, of an architecture whose llama.cpp rope type is known (NORM_ROPE, NEOX_ROPE); else None (the
    step's own tables and f64 rotation then, and its own attention)."""
    arch = getattr(cfg, "arch", None)
    if arch not in NORM_ROPE + NEOX_ROPE or cfg.rot != cfg.head_dim:
        return None
    sc = dict(getattr(cfg, "rope_scaling", None) or {})
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        scaled: tuple = (1.0, None)
    elif kind == "linear":
        scaled = (float(F32(1) / F32(sc["factor"])), None)  # llama.cpp's rope_freq_scale_train = 1.0f/ropescale
    elif kind == "freq_factors":
        scaled = (1.0, tuple(float(F32(x)) for x in sc["freq_factors"]))
    else:
        return None
    key = (int(cfg.max_len), int(cfg.rot), float(cfg.rope_theta), arch in NORM_ROPE) + scaled
    if key not in _ROPES:
        c, sn = rope_tables(key[0], key[1], key[2], scaled[0], scaled[1])
        _ROPES[key] = LlamaRope(c, sn, key[3])
    return _ROPES[key]


def plan_rope(env) -> LlamaRope | None:
    """llama_rope of the model a twin's env runs under the q8 numerics (an ArenaEnv: its plan `s` and `weights`; a
    runner's DeviceEnv: the `llama_rope` it was given); None for any other env (a HostEnv of a launch alone) or
    numerics."""
    if hasattr(env, "llama_rope"):
        return env.llama_rope
    s = getattr(env, "s", None)
    if getattr(s, "numerics", None) != "q8":
        return None
    return llama_rope(getattr(getattr(env, "weights", None), "cfg", None))
