"""Block-format rows as the integers llama.cpp's CPU products multiply (the q8 numerics): a 32-value block's integers
and scales (INT_FORMATS), a K-quant super-block's integers times their sub-blocks' integer scales. What the reference
interpreter (engine/formats/ggml.py) and the kernels' exact twins (kernels/q8dot.py) both read."""

from __future__ import annotations

import numpy as np

from lanefuse.engine.formats.blocks import (BLOCKS, IQ4_LEVELS, _nibbles32, k2_ints, k3_ints, k3_scales, k4_scales,
                                            k5_ints, q5_ints, xs_ints, xs_scales)
from lanefuse.engine.formats.quantize import MIN_FORMATS, block_mins
from lanefuse.engine.opdefs import QBLOCK, QBLOCK_K, QSUM

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
