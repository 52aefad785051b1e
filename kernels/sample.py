"""`sample`: the step's closing launch under sampling (beside the arg-max, which greedy keeps): each row of logits
draws a token from temperature, top-k, top-p and min-p as transformers' warpers define them (TemperatureLogitsWarper,
TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, in that order), with Philox4x64-10 keyed by the seed at counter
(token index + 1, sequence, 0, 0) — the first word numpy's own `np.random.Philox(key=seed, counter=[index, seq, 0, 0])`
gives. The numpy twin here and sample.cu compute every bit the same way, so they draw the same token:

- the scores: x / temperature in f32 (one rounding); NaN and ±inf count as -inf (a run refuses such logits anyway);
- the weights: w = floor(e^(s - max) · 2^40) as integers, with an exp of our own (`sp_exp`: a range reduction and a
  degree-7 Taylor polynomial, each f32 operation rounded alone, in one order; within ~2 ulps of e^x, e^0 = 1 exactly,
  0 below -28); every sum and count is over these integers, exact in any order;
- top-k: tokens whose score is at least the k-th largest score (ties with it kept, as TopKLogitsWarper keeps them);
- top-p: over the top-k tokens' weights (total W), the tokens whose weight w has sum(w' <= w) <= floor((1 - p)·W)
  dropped (f32 1 - p, one f64 product), at least the top kept. transformers sorts and drops one token at a time, so
  of tokens tied on the boundary it may drop some and keep the rest; here a tie group goes whole (kept);
- min-p: a weight of at least ceil(min_p · 2^40) (min-p of the top's, which is 2^40), rounded up;
- the draw: the 64-bit Philox word r, target floor(r · K / 2^64) over the kept total K (u = r / 2^64 in [0, 1)), the
  token the first in id order whose cumulative kept weight passes the target.

So the kept set is transformers' but where f32 rounding decides it: a token within f32 rounding of a top-p or min-p
boundary, a weight below 2^-40 of the top's (never drawn), a score that only f64 tells from the k-th, ties split by
TopPLogitsWarper. Their probabilities w / K agree with transformers' float64 ones within 1e-6 relative (plus 2^-40
of the top's, the integers' floor): tests/test_sampling.py checks both on fixed logits. The kernel finds each
threshold without a sort: radix selects over the keys' (the scores' ordered bits) and the weights' bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.argmax import Advance, Advancing
from lanefuse.kernels.common import MAX_GRID_Y, Launch, names, reach

WORDS = 6  # the parameters' leading words: temperature, top-k, top-p, min-p (f32 bits), seed low, seed high
SCALE = 2.0 ** 40  # the top token's weight
_M0, _M1 = 0xD2E7470EE14C6C93, 0xCA5A826395121157
_W0, _W1 = 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B
_MASK = (1 << 64) - 1
F = np.float32


def params(temp: float, top_k: int, top_p: float, min_p: float, seed: int, pairs) -> np.ndarray:
    """The launch's i32 parameter words: the four settings and the seed, then each (sequence, token index) pair."""
    head = np.array([temp, 0.0, top_p, min_p], np.float32).view(np.int32).copy()
    head[1] = int(top_k)
    seed = int(seed)
    words = [*head.tolist(), _i32(seed & 0xFFFFFFFF), _i32(seed >> 32)]
    for seq, index in pairs:
        words += [int(seq), int(index)]
    return np.array(words, np.int32)


def _i32(u: int) -> int:
    return u - (1 << 32) if u >= 1 << 31 else u


def philox(c0: int, c1: int, k0: int, k1: int = 0) -> int:
    """Philox4x64-10's first output word at counter (c0, c1, 0, 0), key (k0, k1) (sample.cu's sp_philox)."""
    c = [c0 & _MASK, c1 & _MASK, 0, 0]
    k0, k1 = k0 & _MASK, k1 & _MASK
    for _ in range(10):
        p0, p1 = _M0 * c[0], _M1 * c[2]
        c = [(p1 >> 64) ^ c[1] ^ k0, p1 & _MASK, (p0 >> 64) ^ c[3] ^ k1, p0 & _MASK]
        k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
    return c[0]


def draw_bits(seed: int, seq: int, index: int) -> int:
    """The 64 random bits token `index` of sequence `seq` is drawn with."""
    return philox(index + 1, seq, seed)


def scores(x, temp: float) -> np.ndarray:
    """sp_score: x / temperature in f32, NaN and ±inf as -inf, -0 as +0."""
    with np.errstate(all="ignore"):
        s = np.asarray(x, np.float32).reshape(-1) / F(temp)
    s = np.where(np.isfinite(s), s, F(-np.inf)).astype(np.float32)
    return s + F(0.0)


def keys(s: np.ndarray) -> np.ndarray:
    """sp_key: the f32 bits as unsigned keys in the values' order."""
    u = s.view(np.uint32)
    return np.where(u & np.uint32(0x80000000), ~u, u | np.uint32(0x80000000)).astype(np.uint32)


def sp_exp(d: np.ndarray) -> np.ndarray:
    """sample.cu's sp_exp, operation for operation in f32 (numpy rounds each alone, as __fmul_rn / __fadd_rn do)."""
    d = np.asarray(d, np.float32)
    with np.errstate(all="ignore"):
        ok = d >= F(-28.0)
        d = np.where(ok, d, F(0.0)).astype(np.float32)
        n = np.rint(d * F(1.44269504))
        r = d - n * F(0.693359375)
        r = r - n * F(-2.12194440e-4)
        p = F(1.98412698e-4)
        for c in (1.38888889e-3, 8.33333333e-3, 4.16666667e-2, 1.66666667e-1, 0.5, 1.0, 1.0):
            p = p * r + F(c)
        scale = ((127 + n.astype(np.int32)) << 23).astype(np.int32).view(np.float32)
        e = (p * scale).astype(np.float32)
    return np.where(ok, e, F(0.0)).astype(np.float32)


def weights(s: np.ndarray, m, kth: int) -> np.ndarray:
    """sp_weight: floor(e^(s - m) · 2^40) as u64, 0 below the top-k key `kth`."""
    with np.errstate(all="ignore"):
        d = (s - F(m)).astype(np.float32)
    e = sp_exp(d)
    w = (e * F(SCALE)).astype(np.float32).astype(np.uint64)
    w[keys(s) < np.uint32(kth)] = 0
    return w


class Draw(NamedTuple):
    token: int
    kept: np.ndarray  # bool, a token: in the kept set
    weights: np.ndarray  # u64: the kept tokens' weights (0 elsewhere)
    total: int  # their sum
    bits: int  # the draw's 64 random bits
    kth: int  # the top-k key (0: off)
    cut: int  # the least weight kept (top-p's and min-p's thresholds, at least 1)


def draw(x, temp: float, top_k: int, top_p: float, min_p: float, seed: int, seq: int, index: int) -> Draw:
    """One row's draw, as sample_rows makes it (the module's definitions)."""
    s = scores(x, temp)
    n = s.size
    m = s.max()
    kth = 0
    if 0 < top_k < n:
        kth = int(np.sort(keys(s))[n - top_k])
    w = weights(s, m, kth)
    total = int(w.sum(dtype=np.uint64))
    u = 0
    if F(top_p) < F(1.0) and total > 0:
        limit = min(math.floor(float(F(1.0) - F(top_p)) * float(total)), total - 1)
        vals, counts = np.unique(w, return_counts=True)
        mass = np.cumsum([int(v) * int(c) for v, c in zip(vals, counts)], dtype=object)
        u = int(vals[int(np.argmax(mass > limit))])
    floor_w = math.ceil(float(F(min_p)) * SCALE)
    cut = max(u, floor_w, 1)
    kept = w >= np.uint64(cut)
    kw = np.where(kept, w, np.uint64(0)).astype(np.uint64)
    k_total = int(kw.sum(dtype=np.uint64))
    bits = draw_bits(seed, seq, index)
    token = 0
    if k_total > 0:
        target = (bits * k_total) >> 64
        token = int(np.searchsorted(np.cumsum(kw, dtype=np.uint64), np.uint64(target), side="right"))
    return Draw(token, kept, kw, k_total, bits, kth, cut)


def unpack(p: np.ndarray) -> tuple[float, int, float, float, int]:
    """The settings and seed of parameter words `p`."""
    f = np.asarray(p[:4], np.int32).view(np.float32)
    seed = (int(p[4]) & 0xFFFFFFFF) | ((int(p[5]) & 0xFFFFFFFF) << 32)
    return float(f[0]), int(p[1]), float(f[2]), float(f[3]), seed


@dataclass(frozen=True)
class Sample(Advancing, Launch):
    """Each row of `x` (rows of n logits) draws its token into `out`, its settings and (sequence, index) pairs in the
    i32 words of `params`; with an `advance`, the arg-max's (the token and position the next step reads), and the
    token index drawn from moves on by one. `stats` (tests): 8 words a row — kept count, the random bits (low,
    high), the kept total (low, high), the top-k key, the least weight kept (low, high)."""

    x: str
    out: str
    n: int
    params: str
    rows: int = 1
    advance: Advance | None = None
    stats: str | None = None

    census: ClassVar[str] = "sample"
    stem: ClassVar[tuple[str, ...]] = ("sample",)
    THREADS: ClassVar[int] = 1024
    # reads of a row at most: its max, 4 top-k bytes, the total and 6 bytes for top-p, the kept, the draw (a
    # temperature alone: 3)
    PASSES: ClassVar[int] = 14

    @property
    def batch(self) -> bool:
        return self.advance is not None and self.advance.batch

    @property
    def words(self) -> int:
        return WORDS + 2 * (self.rows if self.batch else 1)

    def reads(self):
        return names(self.x, self.params, self.advance.position if self.advance else None)

    def writes(self):
        a = self.advance
        return names(self.out, a.token if a else None, a.position if a else None, self.params if a else None,
                     self.stats)

    def check(self):
        if self.n < 1 or self.rows < 1:
            return Refusal(f"a sampled draw over {self.rows} rows of {self.n} values")
        if self.rows > MAX_GRID_Y:
            return Refusal(f"a sampled draw of {self.rows} rows (a launch takes at most {MAX_GRID_Y}, a block each)")
        if self.rows > 1 and not self.batch:
            return Refusal(f"a sampled draw from {self.rows} rows of one sequence's logits (it draws from one row, "
                           f"or one a sequence of a batch)")
        return None

    def extents(self, top, tokens):
        a = self.advance
        each = self.rows if self.batch else 1
        return reach((self.x, self.rows * self.n), (self.out, self.rows), (self.params, self.words),
                     (a.token if a else None, each), (a.position if a else None, each),
                     (self.stats, 8 * self.rows))

    def bytes(self):
        return 4 * (self.PASSES * self.rows * self.n + self.rows + self.words)

    def flops(self):
        return 40 * self.PASSES * self.rows * self.n

    def numpy(self, env):
        x = env.array(self.x)[: self.rows * self.n].reshape(self.rows, self.n)
        p = env.array(self.params)
        temp, top_k, top_p, min_p, seed = unpack(p)
        out = env.array(self.out)
        got = []
        for r in range(self.rows):
            j = WORDS + 2 * (r if self.batch else 0)
            d = draw(x[r], temp, top_k, top_p, min_p, seed, int(p[j]) & 0xFFFFFFFF, int(p[j + 1]) & 0xFFFFFFFF)
            out[r] = d.token
            got.append(d)
            if self.stats is not None:
                env.array(self.stats)[8 * r: 8 * r + 8] = [_i32(v) for v in (
                    int(d.kept.sum()), d.bits & 0xFFFFFFFF, d.bits >> 32, d.total & 0xFFFFFFFF, d.total >> 32,
                    d.kth, d.cut & 0xFFFFFFFF, d.cut >> 32)]
        a = self.advance
        if a is not None and self.batch:
            env.array(a.token)[: self.rows] = out[: self.rows]
            env.array(a.position)[: self.rows] += a.step
            p[WORDS + 1: WORDS + 2 * self.rows: 2] += 1
        elif a is not None:
            env.array(a.token)[0] = out[self.rows - 1]
            env.array(a.position)[0] += a.step
            p[WORDS + 1] += 1

    def grid_block(self):
        return ((1, self.rows, 1), (self.THREADS, 1, 1))

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import NULL, i64

        g, b = self.grid_block()
        a = self.advance
        denv.function(self.stem, "sample_rows")(g, b, (
            denv.array(self.x), denv.array(self.out), denv.array(self.params), i64(self.n), i64(self.rows),
            denv.array(a.token) if a else NULL, denv.array(a.position) if a else NULL, i64(a.step if a else 0),
            i64(1 if self.batch else 0), denv.array(self.stats) if self.stats else NULL))
