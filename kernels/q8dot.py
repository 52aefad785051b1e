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

from lanefuse.engine.formats import ggml
from lanefuse.engine.formats.blocks import decode_rows
from lanefuse.engine.formats.ints import INT_FORMATS, k_ints, weight_ints
from lanefuse.engine.formats.quantize import half
from lanefuse.kernels.common import QBLOCK, QBLOCK_K, QSUM

LOW_STEPS = 254


def is_k(low: np.ndarray | None) -> bool:
    """Whether a quantized form's parts (words, low, scales) are a q8k form's: its "low" part is int16 sums."""
    return low is not None and low.dtype == np.int16


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
