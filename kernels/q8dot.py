"""The products of a quantized activation (the q8 numerics), as numpy twins of gemv_q8.cu: the exact twin sums each
32-value block as the kernel does — over q8_0 and q4_0 rows the int32 sum of the activation's int8 words times the
weights' integers (batched matmuls on integer-valued blocks, exact), times the weight block's f16 scale and the
activation block's f32 scale; over q4_k and q6_k rows the words times the decoded values — the blocks summed in f64;
the fast twin multiplies the activation's blocks, dequantized (d·q in f32), by the decoded rows with f32 BLAS: the
same products summed in another order. A q8k activation (llama.cpp's q8_K, read by q4_k and q6_k rows under q8: its
"low" words are its int16 sums of 16) is summed a 256-value super-block at a time as gemv_q8.cu's q8k tile sums it:
the int32 sum of its words times the weights' integers each times its sub-block's integer scale, times the two
scales, less (q4_k) the sub-blocks' integer mins times the activation's sums of 16, times dmin and its scale."""

from __future__ import annotations

import numpy as np

from lanefuse.kernels.blocks import BLOCKS, decode_rows, k4_scales
from lanefuse.kernels.common import QBLOCK, QBLOCK_K, QSUM

LOW_STEPS = 254


def weight_ints(raw: np.ndarray, fmt: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """q8_0 / q4_0 rows (n, k) as their integers (n, k/32, 32) int8 and each block's f16 scale (n, k/32) as f32."""
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // QBLOCK, BLOCKS[fmt][1])
    d = b[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if fmt == "q8_0":
        return b[:, :, 2:].view(np.int8), d
    nib = b[:, :, 2:]
    return (np.concatenate([nib & 15, nib >> 4], axis=2).astype(np.int16) - 8).astype(np.int8), d


def is_k(low: np.ndarray | None) -> bool:
    """Whether a quantized form's parts (words, low, scales) are a q8k form's: its "low" part is int16 sums."""
    return low is not None and low.dtype == np.int16


def k_ints(raw: np.ndarray, fmt: str, n: int, k: int):
    """q4_k / q6_k rows (n, k) as integers: each value's integer times its sub-block's integer scale (n, k/256, 256)
    int16 (q4_k: 6-bit scale · 4-bit value, at most 945; q6_k: int8 scale · (6-bit value - 32), at most 4096 in
    magnitude), each super-block's f16 d (n, k/256) f32, and for q4_k its f16 dmin and 6-bit sub-block mins
    (n, k/256, 8); None for q6_k."""
    nb = k // QBLOCK_K
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n * nb, BLOCKS[fmt][1])
    f16 = lambda c: c.copy().view(np.float16)[:, 0].astype(np.float32).reshape(n, nb)  # noqa: E731
    if fmt == "q4_k":
        sc, mn = k4_scales(b[:, 4:16])  # (n·nb, 8) each
        qs = b[:, 16:144].reshape(-1, 4, 1, 32)  # sub-block j: bytes of chunk j // 2, the low nibble for even j
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32).astype(np.int16)
        w = (q * sc.astype(np.int16)[:, :, None]).reshape(n, nb, QBLOCK_K)
        return w, f16(b[:, 0:2]), f16(b[:, 2:4]), mn.astype(np.int16).reshape(n, nb, 8)
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
    super-block's term (d·dx)·f32(I) - (dmin·dx)·f32(M) in f32, as the kernel rounds it, and the terms summed."""
    nb = k // QBLOCK_K
    w, d, dmin, mins = k_ints(raw, fmt, n, k)
    q = words[: m * k].reshape(m, nb, QBLOCK_K)
    dx = scales[: m * nb].reshape(m, nb)
    i1 = block_sums(q, w).astype(np.float32)  # (m, n, nb)
    t = (d[None, :, :] * dx[:, None, :]) * i1
    if mins is not None:
        s32 = sums[: m * k // QSUM].reshape(m, nb, 8, 2).astype(np.int64).sum(axis=3)  # (m, nb, 8): sums of 32
        i2 = np.einsum("mbj,nbj->mnb", s32, mins.astype(np.int64)).astype(np.float32)
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
    q8k form's (its int16 sums in `low`) by `q8k_exact`."""
    if is_k(low):
        return q8k_exact(words, low, scales, raw, fmt, m, n, k)
    nb = k // QBLOCK
    q = words[: m * k].reshape(m, nb, QBLOCK)
    lq = None if low is None else low[: m * k].reshape(m, nb, QBLOCK)
    dx = scales[: m * nb].reshape(m, nb).astype(np.float64)
    if fmt in ("q8_0", "q4_0"):
        wq, dw = weight_ints(raw, fmt, n, k)
        s = block_sums(q, wq)
        if lq is not None:
            s = s + block_sums(lq, wq) / LOW_STEPS
        s = s * dw.astype(np.float64)[None, :, :]
    else:
        wv = decode_rows(raw, fmt, k).reshape(n, nb, QBLOCK)
        s = block_sums(q, wv)
        if lq is not None:
            s = s + block_sums(lq, wv) / LOW_STEPS
    return np.einsum("mnb,mb->mn", s, dx).astype(np.float32)


def dequantized(words: np.ndarray, low: np.ndarray | None, scales: np.ndarray, m: int, k: int) -> np.ndarray:
    """The activation's values d·(q + low/254) (m, k) in f32: what the fast twins multiply by f32 BLAS."""
    bl = QBLOCK_K if is_k(low) else QBLOCK
    nb = k // bl
    q = words[: m * k].reshape(m, nb, bl).astype(np.float32)
    if low is not None and not is_k(low):
        q = q + low[: m * k].reshape(m, nb, QBLOCK).astype(np.float32) / np.float32(LOW_STEPS)
    return (q * scales[: m * nb].reshape(m, nb, 1)).reshape(m, k)
