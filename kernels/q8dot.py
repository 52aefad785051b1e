"""The products of a quantized activation (the q8 numerics), as numpy twins of gemv_q8.cu: the exact twin sums each
32-value block as the kernel does — over rows of 32-value blocks (INT_FORMATS: q8_0, q4_0, q5_0, iq4_nl, q4_1, q5_1)
the int32 sum of the activation's int8 words times the weights' integers (batched matmuls on integer-valued blocks,
exact), times the weight block's f16 scale and the activation block's scale (under one word f16(d32) of the f32 d32
held, as llama.cpp's q8_0 / q8_1 store it), and for q4_1 / q5_1 (llama.cpp's q8_1 pairing: the q8 form's words and
d, and s = f16(d32·Σq), the f32 product of the unrounded scale and the words' sum rounded to f16, as
quantize_row_q8_1 stores it; under two words d·Σ(q + low/254)) the block's min m times s; over K-quant rows the
words times the decoded values — the blocks summed in f64;
the fast twin multiplies the activation's blocks, dequantized (d·q in f32), by the decoded rows with f32 BLAS: the
same products summed in another order (q4_1 / q5_1 blocks' min terms m·d·Σq there, not m·s). A q8k activation (llama.cpp's q8_K, read by the K-quants' and iq4_xs's rows
under q8: its "low" words are its int16 sums of 16) is summed a 256-value super-block at a time as gemv_q8.cu's q8k
tile sums it: the int32 sum of its words times the weights' integers each times its sub-block's integer scale, times
the two scales, less (q4_k, q5_k, q2_k) the sub-blocks' integer mins times the activation's sums of 16, times dmin
and its scale."""

from __future__ import annotations

import numpy as np

from lanefuse.kernels.blocks import (BLOCKS, IQ4_LEVELS, _nibbles32, decode_rows, k2_ints, k3_ints, k3_scales,
                                     k4_scales, k5_ints, q5_ints, xs_ints, xs_scales)
from lanefuse.engine.formats import ggml
from lanefuse.engine.formats.quantize import MIN_FORMATS, block_mins, half
from lanefuse.kernels.common import QBLOCK, QBLOCK_K, QSUM

LOW_STEPS = 254
INT_FORMATS = ("q8_0", "q4_0", "q5_0", "iq4_nl", "q4_1", "q5_1")  # 32-value blocks: d · integers (+ m)
# MIN_FORMATS (q4_1, q5_1): ... and a min m a block


def weight_ints(raw: np.ndarray, fmt: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Rows (n, k) of an INT_FORMATS format as their integers (n, k/32, 32) int8 (q4_0's nibbles less 8, q5_0's
    values less 16, iq4_nl's levels, q4_1's / q5_1's values), each block's f16 scale (n, k/32) as f32, and q4_1's /
    q5_1's f16 min a block (n, k/32) f32 (else None)."""
    nb = k // QBLOCK
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n * nb, BLOCKS[fmt][1])
    f16 = lambda c: c.copy().view(np.float16)[:, 0].astype(np.float32).reshape(n, nb)  # noqa: E731
    m = block_mins(raw, fmt, n, k) if fmt in MIN_FORMATS else None
    if fmt == "q8_0":
        q = b[:, 2:].view(np.int8)
    elif fmt == "q4_0":
        q = _nibbles32(b[:, 2:18]).astype(np.int8) - np.int8(8)
    elif fmt == "q5_0":
        q = q5_ints(b, 2).astype(np.int8) - np.int8(16)
    elif fmt == "iq4_nl":
        q = IQ4_LEVELS[_nibbles32(b[:, 2:18])]
    elif fmt == "q4_1":
        q = _nibbles32(b[:, 4:20]).astype(np.int8)
    else:
        q = q5_ints(b, 4).astype(np.int8)
    return q.reshape(n, nb, QBLOCK), f16(b[:, 0:2]), m


def is_k(low: np.ndarray | None) -> bool:
    """Whether a quantized form's parts (words, low, scales) are a q8k form's: its "low" part is int16 sums."""
    return low is not None and low.dtype == np.int16


def k_ints(raw: np.ndarray, fmt: str, n: int, k: int):
    """Rows (n, k) of a K_FORMATS format as integers: each value's integer times its sub-block's integer scale
    (n, k/256, 256) int16 (at most 4096 in magnitude: q4_k 6-bit scale · 4-bit value, 945; q5_k 1953; q6_k int8
    scale · (6-bit value - 32), 4096; q3_k (6-bit scale - 32) · (-4..3), 128; q2_k 4-bit scale · 2-bit value, 45;
    iq4_xs (6-bit scale - 32) · level, 4064), each super-block's f16 d (n, k/256) f32, and for q4_k, q5_k, q2_k its
    f16 dmin and the integer min of each 16 values (n, k/256, 16) (None, None for the others)."""
    nb = k // QBLOCK_K
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n * nb, BLOCKS[fmt][1])
    f16 = lambda c: c.copy().view(np.float16)[:, 0].astype(np.float32).reshape(n, nb)  # noqa: E731

    def scaled(q, sc):  # q (n·nb, G, 256 / G) times each group's scale sc (n·nb, G)
        return (q.astype(np.int16) * sc.astype(np.int16)[:, :, None]).reshape(n, nb, QBLOCK_K)

    def per16(mn):  # the mins of sub-blocks of 32 (or 16) as one a 16 values
        return np.repeat(mn.astype(np.int16), QBLOCK_K // QSUM // mn.shape[1], axis=1).reshape(n, nb, QBLOCK_K // QSUM)

    if fmt in ("q4_k", "q5_k"):
        sc, mn = k4_scales(b[:, 4:16])  # (n·nb, 8) each
        if fmt == "q4_k":
            qs = b[:, 16:144].reshape(-1, 4, 1, 32)  # sub-block j: bytes of chunk j // 2, the low nibble for even j
            q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
        else:
            q = k5_ints(b)
        return scaled(q, sc), f16(b[:, 0:2]), f16(b[:, 2:4]), per16(mn)
    if fmt == "q2_k":
        sc = b[:, 0:16]
        return (scaled(k2_ints(b[:, 16:80]).reshape(-1, 16, 16), sc & 0x0F), f16(b[:, 80:82]), f16(b[:, 82:84]),
                per16(sc >> 4))
    if fmt == "q3_k":
        return scaled(k3_ints(b).reshape(-1, 16, 16), k3_scales(b[:, 96:108])), f16(b[:, 108:110]), None, None
    if fmt == "iq4_xs":
        return scaled(xs_ints(b), xs_scales(b)), f16(b[:, 0:2]), None, None
    ql, qh = b[:, 0:128].reshape(-1, 2, 1, 64), b[:, 128:192].reshape(-1, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 2, 4, 32)  # value 128h + 32t + l
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
    q = ((low | (high << 4)).astype(np.int16) - 32).reshape(-1, 16, 16)
    w = (q * b[:, 192:208].view(np.int8).astype(np.int16)[:, :, None]).reshape(n, nb, QBLOCK_K)
    return w, f16(b[:, 208:210]), None, None


def q8k_exact(words: np.ndarray, sums: np.ndarray, scales: np.ndarray, raw: np.ndarray, fmt: str, m: int, n: int,
              k: int) -> np.ndarray:
    """y (m, n) f32 of a q8k activation (words (m·k,) int8, sums (m·k/16,) int16, scales (m·k/256,) f32) times q4_k
    or q6_k rows: per super-block the int32 sum I of words times scaled integers (batched f64 matmuls: exact, every
    partial sum an integer below 2^53), and for q4_k the int32 sum M of the mins times the sums of 32 words; the
    super-block's term (d·dx)·f32(I) - (dmin·dx)·f32(M) in f32, as the kernel rounds it, and the terms summed (the
    mins of q4_k / q5_k / q2_k: M the int32 sum of each 16 values' integer min times their sum of words)."""
    nb = k // QBLOCK_K
    w, d, dmin, mins = k_ints(raw, fmt, n, k)
    q = words[: m * k].reshape(m, nb, QBLOCK_K)
    dx = scales[: m * nb].reshape(m, nb)
    i1 = block_sums(q, w).astype(np.float32)  # (m, n, nb)
    t = (d[None, :, :] * dx[:, None, :]) * i1
    if mins is not None:
        s16 = sums[: m * k // QSUM].reshape(m, nb, QBLOCK_K // QSUM).astype(np.int64)  # (m, nb, 16)
        i2 = np.einsum("mbj,nbj->mnb", s16, mins.astype(np.int64)).astype(np.float32)
        t = t - (dmin[None, :, :] * dx[:, None, :]) * i2
    return t.astype(np.float64).sum(axis=2).astype(np.float32)


def block_sums(q: np.ndarray, wq: np.ndarray) -> np.ndarray:
    """q (m, nb, 32) · wq (n, nb, 32) block by block: (m, n, nb), by batched matmuls in f64 (exact for integers)."""
    a = np.ascontiguousarray(q.transpose(1, 0, 2), dtype=np.float64)  # (nb, m, 32)
    b = np.ascontiguousarray(wq.transpose(1, 2, 0), dtype=np.float64)  # (nb, 32, n)
    return np.matmul(a, b).transpose(1, 2, 0)  # (m, n, nb)


def q8_exact(words: np.ndarray, low: np.ndarray | None, scales: np.ndarray, raw: np.ndarray, fmt: str, m: int,
             n: int, k: int) -> np.ndarray:
    """y (m, n) f32 of a quantized activation (words/low (m·k,) int8, scales (m·k/32,)) times rows `raw` in `fmt`; a
    q8k form's (its int16 sums in `low`) by `q8k_exact`. llama.cpp's own pairs (the q8 numerics: a q8_0 / q8_1 form
    over rows of 32-value blocks, a q8_K form over K-quant rows) are summed in llama.cpp's order (engine/formats/ggml.py),
    as the reference interpreter sums them."""
    y = ggml.dot_parts(words, low, scales, raw, fmt, m, n, k)
    if y is not None:
        return y
    if is_k(low):
        return q8k_exact(words, low, scales, raw, fmt, m, n, k)
    nb = k // QBLOCK
    q = words[: m * k].reshape(m, nb, QBLOCK)
    lq = None if low is None else low[: m * k].reshape(m, nb, QBLOCK)
    d32 = scales[: m * nb].reshape(m, nb).astype(np.float32)
    dx = (half(d32) if lq is None else d32).astype(np.float64)  # one word: f16(d32)
    if fmt in INT_FORMATS:
        wq, dw, mw = weight_ints(raw, fmt, n, k)
        s = block_sums(q, wq)
        if lq is not None:
            s = s + block_sums(lq, wq) / LOW_STEPS
        s = s * dw.astype(np.float64)[None, :, :]
        if mw is not None:  # + m · s: q8_1's s = f16(d32·Σq) under one word, d·Σ(q + low/254) under two
            sq = q.astype(np.int32).sum(axis=2)
            if lq is None:
                sx = half(d32 * sq.astype(np.float32)).astype(np.float64)
            else:
                sx = (sq + lq.astype(np.float64).sum(axis=2) / LOW_STEPS) * dx
            return (np.einsum("mnb,mb->mn", s, dx) + np.einsum("mb,nb->mn", sx, mw.astype(np.float64))
                    ).astype(np.float32)
    else:
        wv = decode_rows(raw, fmt, k).reshape(n, nb, QBLOCK)
        s = block_sums(q, wv)
        if lq is not None:
            s = s + block_sums(lq, wv) / LOW_STEPS
    return np.einsum("mnb,mb->mn", s, dx).astype(np.float32)


def dequantized(words: np.ndarray, low: np.ndarray | None, scales: np.ndarray, m: int, k: int) -> np.ndarray:
    """The activation's values d·(q + low/254) (m, k) in f32 (one word: d = f16 of the f32 scale held): what the
    fast twins multiply by f32 BLAS."""
    bl = QBLOCK_K if is_k(low) else QBLOCK
    nb = k // bl
    q = words[: m * k].reshape(m, nb, bl).astype(np.float32)
    if low is not None and not is_k(low):
        q = q + low[: m * k].reshape(m, nb, QBLOCK).astype(np.float32) / np.float32(LOW_STEPS)
    d = scales[: m * nb].reshape(m, nb, 1)
    return (q * (half(d) if low is None else d)).reshape(m, k)  # one word: f16(d32)
