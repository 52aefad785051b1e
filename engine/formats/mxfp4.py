"""MXFP4, the block format of gpt-oss checkpoints' experts (not a GGUF type): blocks of 32 fp4 e2m1 values with one
e8m0 scale, stored here as `mxfp4` rows of 17-byte blocks (the scale byte, then the 16 bytes of the checkpoint's
`*_blocks`). What the front needs to read a checkpoint (packing, decoding to f32); engine/formats/blocks.py holds the
format among the others (its row sizes, encoder) and the kernels decode it in place."""

from __future__ import annotations

import numpy as np

# fp4 e2m1 by its 4 bits (transformers' integrations/mxfp4.py FP4_VALUES): the sign bit 8
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      dtype=np.float32)


def mxfp4_blocks(b: np.ndarray) -> np.ndarray:
    """A block: byte 0 the e8m0 scale s, byte 1 + j values 2j (low nibble) and 2j + 1 (high nibble); value
    fp4 · 2^(s - 127) by ldexp, as transformers' convert_moe_packed_tensors decodes (exact: a power of two)."""
    q = b[:, 1:17]
    v = np.empty((b.shape[0], 32), np.float32)
    v[:, 0::2], v[:, 1::2] = FP4_VALUES[q & 0x0F], FP4_VALUES[q >> 4]
    with np.errstate(over="ignore"):  # scales past 2^125 overflow to inf, as in transformers (refused at load: 255)
        return np.ldexp(v, b[:, :1].astype(np.int32) - 127).astype(np.float32, copy=False)


def pack_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A transformers MXFP4 checkpoint's `*_blocks` (..., rows, G, 16) and `*_scales` (..., rows, G) uint8 as `mxfp4`
    rows (..., rows, G·17): each block's scale byte before its 16 bytes (the bytes themselves unchanged)."""
    b, sc = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if b.shape[-1] != 16 or b.shape[:-1] != sc.shape:
        raise ValueError(f"MXFP4 blocks {b.shape} and scales {sc.shape} do not pair (blocks (..., G, 16), scales "
                         f"(..., G))")
    return np.concatenate([sc[..., None], b], axis=-1).reshape(*sc.shape[:-1], -1)


def unpack_mxfp4(raw: np.ndarray, rows_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """`mxfp4` rows back as a checkpoint's (`*_blocks` (*rows_shape, G, 16), `*_scales` (*rows_shape, G))."""
    b = np.asarray(raw, np.uint8).reshape(*rows_shape, -1, 17)
    return np.ascontiguousarray(b[..., 1:]), np.ascontiguousarray(b[..., 0])
