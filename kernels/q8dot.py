"""The products of a quantized activation (the q8 numerics), as numpy twins of gemv_q8.cu: the exact twin sums each
32-value block as the kernel does — over q8_0 and q4_0 rows the int32 sum of the activation's int8 words times the
weights' integers (batched matmuls on integer-valued blocks, exact), times the weight block's f16 scale and the
activation block's f32 scale; over q4_k and q6_k rows the words times the decoded values — the blocks summed in f64;
the fast twin multiplies the activation's blocks, dequantized (d·q in f32), by the decoded rows with f32 BLAS: the
same products summed in another order."""

from __future__ import annotations

import numpy as np

from lanefuse.kernels.blocks import BLOCKS, decode_rows
from lanefuse.kernels.common import QBLOCK

LOW_STEPS = 254


def weight_ints(raw: np.ndarray, fmt: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """q8_0 / q4_0 rows (n, k) as their integers (n, k/32, 32) int8 and each block's f16 scale (n, k/32) as f32."""
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // QBLOCK, BLOCKS[fmt][1])
    d = b[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if fmt == "q8_0":
        return b[:, :, 2:].view(np.int8), d
    nib = b[:, :, 2:]
    return (np.concatenate([nib & 15, nib >> 4], axis=2).astype(np.int16) - 8).astype(np.int8), d


def block_sums(q: np.ndarray, wq: np.ndarray) -> np.ndarray:
    """q (m, nb, 32) · wq (n, nb, 32) block by block: (m, n, nb), by batched matmuls in f64 (exact for integers)."""
    a = np.ascontiguousarray(q.transpose(1, 0, 2), dtype=np.float64)  # (nb, m, 32)
    b = np.ascontiguousarray(wq.transpose(1, 2, 0), dtype=np.float64)  # (nb, 32, n)
    return np.matmul(a, b).transpose(1, 2, 0)  # (m, n, nb)


def q8_exact(words: np.ndarray, low: np.ndarray | None, scales: np.ndarray, raw: np.ndarray, fmt: str, m: int,
             n: int, k: int) -> np.ndarray:
    """y (m, n) f32 of a quantized activation (words/low (m·k,) int8, scales (m·k/32,)) times rows `raw` in `fmt`."""
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
    nb = k // QBLOCK
    q = words[: m * k].reshape(m, nb, QBLOCK).astype(np.float32)
    if low is not None:
        q = q + low[: m * k].reshape(m, nb, QBLOCK).astype(np.float32) / np.float32(LOW_STEPS)
    return (q * scales[: m * nb].reshape(m, nb, 1)).reshape(m, k)
