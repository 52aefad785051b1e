"""GGUF's block formats (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl; the K-quants q2_k, q3_k, q4_k, q5_k, q6_k; iq4_xs) as
the kernels read them in place: the format table (values and bytes
a block, bytes a value for the cost model), the numpy decoding of a block's values — the twin of the CUDA decoding in
prelude.cu, equal to `gguf.quants.dequantize` bit for bit — and encoders for tests, bench and demo weights.

A block-format tensor of logical shape (rows, cols) is held as C-contiguous uint8 (rows, cols / values · bytes): each
row's blocks in turn, the bytes a GGUF file holds for it (see /work/wt/briefs/formats.md). Every value is decoded by
the same f32 operations as gguf's numpy reference, in the same order (no fused multiply-add), so the numbers match to
the bit; a non-finite f16 scale decodes as gguf decodes it (inf or NaN values): the weight stores refuse such tensors
at load, the decoding itself never guesses. MXFP4 (`mxfp4`, gpt-oss's experts) is held the same way: blocks of 17
bytes, a transformers checkpoint's e8m0 scale byte then its 16 bytes of fp4 pairs (`pack_mxfp4`), decoded as
transformers' integrations/mxfp4.py decodes them (fp4 value times 2^(scale - 127))."""

from __future__ import annotations

import numpy as np

# the format's own, re-exported
from lanefuse.engine.formats.mxfp4 import FP4_VALUES, mxfp4_blocks, pack_mxfp4, unpack_mxfp4  # noqa: F401

# format -> (values a block, bytes a block): GGUF's layouts (gguf.GGML_QUANT_SIZES), and MXFP4 (`mxfp4`: gpt-oss's
# experts as transformers' checkpoints hold them, a block's e8m0 scale byte then its 16 bytes of fp4 e2m1 pairs)
BLOCKS = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_k": (256, 144), "q6_k": (256, 210), "mxfp4": (32, 17),
          "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q5_k": (256, 176), "q3_k": (256, 110),
          "q2_k": (256, 84), "iq4_nl": (32, 18), "iq4_xs": (256, 136)}
QK = 256  # the values of a K-quant super-block
# each format's f16 scales: their byte offsets in a block (mxfp4's scale is one e8m0 byte, at 0)
F16_SCALES = {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q6_k": (208,), "mxfp4": (), "q4_1": (0, 2), "q5_0": (0,),
              "q5_1": (0, 2), "q5_k": (0, 2), "q3_k": (108,), "q2_k": (80, 82), "iq4_nl": (0,), "iq4_xs": (0,)}
# iq4_nl's and iq4_xs's 16 levels (ggml's kvalues_iq4nl)
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def is_block(fmt: str) -> bool:
    return fmt in BLOCKS


def values_per_block(fmt: str) -> int:
    return BLOCKS[fmt][0]


def bytes_per_value(fmt: str) -> float:
    """What one value costs in memory and bandwidth: a block's bytes over its values (q4_0 0.5625, bf16's 2 apart)."""
    vb, bb = BLOCKS[fmt]
    return bb / vb


def row_bytes(fmt: str, cols: int) -> int:
    """The bytes a row of `cols` values takes (cols a multiple of the block's values)."""
    vb, bb = BLOCKS[fmt]
    return cols // vb * bb


def row_refusal(fmt: str, cols: int) -> str | None:
    """Why a row of `cols` values cannot be held in `fmt` (blocks never straddle two rows), in words; None if it can."""
    vb = BLOCKS[fmt][0]
    if cols % vb:
        return f"a row of {cols} values in {fmt}, whose blocks hold {vb} (rows must be a whole number of blocks)"
    return None


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes a value (little-endian f16) as f32, exactly."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _q8_0(b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Into `out` (n, 32) where given: the int8 values cast in, then times the block's scale."""
    out = np.empty((b.shape[0], 32), dtype=np.float32) if out is None else out
    np.copyto(out, b[:, 2:34].view(np.int8))
    np.multiply(out, _f16(b[:, 0:2]), out=out)  # the scale (n, 1)
    return out


def _q4_0(b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Into `out` (n, 32) where given: value v is byte v % 16's low nibble (v < 16) or high one, less 8, times the
    block's scale."""
    out = np.empty((b.shape[0], 32), dtype=np.float32) if out is None else out
    qs = b[:, 2:18]
    np.copyto(out[:, :16], qs & 0x0F)
    np.copyto(out[:, 16:], qs >> 4)
    np.subtract(out, 8, out=out)
    np.multiply(out, _f16(b[:, 0:2]), out=out)
    return out


def k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q4_k's 12 scale bytes (n, 12) as the 6-bit scale and min of each of its 8 sub-blocks (ggml's
    get_scale_min_k4)."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, mn


def _q4_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = k4_scales(b[:, 4:16])
    ds = (d * sc.astype(np.float32))[:, :, None]  # (n, 8, 1): a sub-block of 32 a scale
    dm = (dmin * mn.astype(np.float32))[:, :, None]
    qs = b[:, 16:144].reshape(n, 4, 1, 32)  # sub-block j: bytes of chunk j // 2, the low nibble for even j
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32).astype(np.float32)
    return (ds * q - dm).reshape(n, QK)


def _q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql, qh = b[:, 0:128].reshape(n, 2, 1, 64), b[:, 128:192].reshape(n, 2, 1, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)  # value 128h + 32t + l
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)  # (n, 2, 4, 32)
    q = ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32).reshape(n, 16, 16)
    return ((d * sc)[:, :, None] * q).reshape(n, QK)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """16 bytes a block (n, 16) as its 32 nibbles: value j the low nibble of byte j (j < 16), else the high one of
    byte j - 16 (uint8 (n, 32))."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """q5_0 / q5_1's 4 bytes of high bits (n, 4), a little-endian uint32 whose bit j is value j's fifth bit, as
    (n, 32) uint8 0/1."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")


def _q4_1(b: np.ndarray) -> np.ndarray:
    """d, m, 16 bytes of nibbles: value d·q + m."""
    return _f16(b[:, 0:2]) * _nibbles32(b[:, 4:20]).astype(np.float32) + _f16(b[:, 2:4])


def q5_ints(b: np.ndarray, at: int) -> np.ndarray:
    """q5_0 / q5_1's 5-bit values (n, 32) uint8: the nibbles at `at` + 4 and the high bits at `at`."""
    return _nibbles32(b[:, at + 4: at + 20]) | (_high_bits32(b[:, at: at + 4]) << 4)


def _q5_0(b: np.ndarray) -> np.ndarray:
    """d, 4 bytes of high bits, 16 of nibbles: value d·(q - 16)."""
    q = q5_ints(b, 2).astype(np.int8) - np.int8(16)
    return _f16(b[:, 0:2]) * q.astype(np.float32)


def _q5_1(b: np.ndarray) -> np.ndarray:
    """d, m, 4 bytes of high bits, 16 of nibbles: value d·q + m."""
    return _f16(b[:, 0:2]) * q5_ints(b, 4).astype(np.float32) + _f16(b[:, 2:4])


def _iq4_nl(b: np.ndarray) -> np.ndarray:
    """d, 16 bytes of nibbles (q4_0's places) indexing IQ4_LEVELS: value d·level."""
    return _f16(b[:, 0:2]) * IQ4_LEVELS[_nibbles32(b[:, 2:18])].astype(np.float32)


def k5_ints(b: np.ndarray) -> np.ndarray:
    """q5_k's 5-bit values (n, 8, 32) uint8: sub-block j's nibbles as q4_k's (bytes of chunk j // 2, the low nibble
    for even j), its fifth bits bit j of the 32 bytes of qh."""
    n = b.shape[0]
    qs = b[:, 48:176].reshape(n, 4, 1, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
    high = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return low | (high << 4)


def _q5_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = k4_scales(b[:, 4:16])
    ds = (d * sc.astype(np.float32))[:, :, None]
    dm = (dmin * mn.astype(np.float32))[:, :, None]
    return (ds * k5_ints(b).astype(np.float32) - dm).reshape(n, QK)


def k2_ints(qs: np.ndarray) -> np.ndarray:
    """q2_k / q3_k's 64 bytes of 2-bit pairs (n, 64) as the values' low two bits (n, 256): value 128h + 32t + l is
    bits 2t of byte 32h + l."""
    n = qs.shape[0]
    q = qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return (q & 3).reshape(n, QK)


def _q2_k(b: np.ndarray) -> np.ndarray:
    """16 scale bytes (sub-blocks of 16: the low nibble a scale, the high a min), 64 bytes of 2-bit values, d, dmin:
    value (d·sc)·q - dmin·mn."""
    n = b.shape[0]
    sc = b[:, 0:16]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (sc & 0x0F).astype(np.float32))[:, :, None]
    ml = (dmin * (sc >> 4).astype(np.float32))[:, :, None]
    q = k2_ints(b[:, 16:80]).reshape(n, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(n, QK)


def k3_scales(s: np.ndarray) -> np.ndarray:
    """q3_k's 12 scale bytes (n, 12) as its 16 sub-blocks' signed scales (n, 16) int8: 6 bits, less 32 — sub-block j's
    low four bits the low (j < 8) or high nibble of byte j % 8, its high two bits bits 2(j // 4) of byte 8 + j % 4."""
    lo = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1)
    hi = (np.tile(s[:, 8:12], 4) >> np.repeat(np.array([0, 2, 4, 6], np.uint8), 4)[None, :]) & 3
    return (lo | (hi << 4)).astype(np.int8) - np.int8(32)


def k3_ints(b: np.ndarray) -> np.ndarray:
    """q3_k's values (n, 256) int8 in -4..3: the low two bits as q2_k's, less 4 where value v's bit in hmask (bit
    v // 32 of byte v % 32) is clear."""
    n = b.shape[0]
    hm = (b[:, 0:32].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return k2_ints(b[:, 32:96]).astype(np.int8) - ((hm.reshape(n, QK) ^ 1) << 2).astype(np.int8)


def _q3_k(b: np.ndarray) -> np.ndarray:
    """32 bytes of high bits, 64 of 2-bit values, 12 of 6-bit scales (sub-blocks of 16), d: value (d·(sc - 32))·q."""
    n = b.shape[0]
    dl = (_f16(b[:, 108:110]) * k3_scales(b[:, 96:108]).astype(np.float32))[:, :, None]
    return (dl * k3_ints(b).reshape(n, 16, 16).astype(np.float32)).reshape(n, QK)


def xs_scales(b: np.ndarray) -> np.ndarray:
    """iq4_xs's 8 sub-blocks' signed scales (n, 8) int8: 6 bits, less 32 — the low four nibble j % 2 of scales_l
    byte j // 2, the high two bits 2j of the uint16 scales_h."""
    lo = np.stack([b[:, 4:8] & 0x0F, b[:, 4:8] >> 4], axis=2).reshape(-1, 8)
    h = b[:, 2].astype(np.uint16) | (b[:, 3].astype(np.uint16) << 8)
    hi = ((h[:, None] >> (2 * np.arange(8, dtype=np.uint16))[None, :]) & 3).astype(np.uint8)
    return (lo | (hi << 4)).astype(np.int8) - np.int8(32)


def xs_ints(b: np.ndarray) -> np.ndarray:
    """iq4_xs's values as IQ4_LEVELS (n, 8, 32) int8: sub-block j's nibbles in bytes 8 + 16j.., q4_0's order."""
    n = b.shape[0]
    return IQ4_LEVELS[_nibbles32(b[:, 8:136].reshape(n * 8, 16)).reshape(n, 8, 32)]


def _iq4_xs(b: np.ndarray) -> np.ndarray:
    """d, scales_h, 4 bytes of scales_l, 128 of nibbles: value (d·(ls - 32))·level."""
    n = b.shape[0]
    dl = (_f16(b[:, 0:2]) * xs_scales(b).astype(np.float32))[:, :, None]
    return (dl * xs_ints(b).astype(np.float32)).reshape(n, QK)


_DECODE = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_k": _q4_k, "q6_k": _q6_k, "mxfp4": mxfp4_blocks, "q4_1": _q4_1,
           "q5_0": _q5_0, "q5_1": _q5_1, "q5_k": _q5_k, "q3_k": _q3_k, "q2_k": _q2_k, "iq4_nl": _iq4_nl,
           "iq4_xs": _iq4_xs}
INTO = ("q8_0", "q4_0")  # the formats whose decoder writes into an array given, with no array of the values made


def decode_blocks(raw: np.ndarray, fmt: str, out: np.ndarray | None = None) -> np.ndarray:
    """Blocks of `fmt` (any shape of uint8 holding whole blocks, in order) as their f32 values, flat: into `out` (flat,
    as many values) where given (a format not in INTO decoded first, then copied)."""
    vb, bb = BLOCKS[fmt]
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if b.size % bb:
        raise ValueError(f"{b.size} bytes are not whole {fmt} blocks of {bb} bytes")
    b = b.reshape(-1, bb)
    if out is None:
        return _DECODE[fmt](b).reshape(-1)
    if fmt in INTO:
        _DECODE[fmt](b, out.reshape(-1, vb))
    else:
        np.copyto(out, _DECODE[fmt](b).reshape(-1))
    return out


def decode_rows(raw: np.ndarray, fmt: str, cols: int) -> np.ndarray:
    """Rows of `fmt` blocks (uint8 (rows, row_bytes), or flat) as f32 (rows, cols): the kernels' numpy twin."""
    why = row_refusal(fmt, cols)
    if why:
        raise ValueError(why)
    return decode_blocks(raw, fmt).reshape(-1, cols)


# -- encoders -------------------------------------------------------------------------------------------------------

def _as_f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float16)


def _enc_q4_k(x: np.ndarray) -> np.ndarray:
    """q4_k blocks of x (n, 256): per sub-block of 32 a 6-bit scale and min over the super-block's f16 d and dmin,
    values rounded to the nearest of the 16 levels the stored scales give."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32).astype(np.float64)
    lo = np.minimum(sub.min(axis=2), 0.0)  # every value >= -min: the min stored as a non-negative number
    step = (sub.max(axis=2) - lo) / 15.0
    d = _as_f16(step.max(axis=1) / 63.0)
    dmin = _as_f16((-lo).max(axis=1) / 63.0)
    df, dmf = d.astype(np.float64)[:, None], dmin.astype(np.float64)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.ceil(step / np.where(df > 0, df, 1)), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dmf > 0, np.rint(-lo / np.where(dmf > 0, dmf, 1)), 0).clip(0, 63).astype(np.uint8)
    ds = (df * sc)[:, :, None]
    dm = (dmf * mn)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(ds > 0, np.rint((sub + dm) / np.where(ds > 0, ds, 1)), 0).clip(0, 15).astype(np.uint8)
    scales = np.zeros((n, 12), np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    q = q.reshape(n, 4, 2, 32)
    qs = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(n, 128)
    return np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales, qs], axis=1)


def _enc_q6_k(x: np.ndarray) -> np.ndarray:
    """q6_k blocks of x (n, 256): per sub-block of 16 an int8 scale over the super-block's f16 d, values rounded to
    the nearest of -32..31 steps."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16).astype(np.float64)
    step = np.abs(sub).max(axis=2) / 31.0
    d = _as_f16(step.max(axis=1) / 127.0)
    df = d.astype(np.float64)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.ceil(step / np.where(df > 0, df, 1)), 0).clip(0, 127)
        s = (df * sc)[:, :, None]
        q = np.where(s > 0, np.rint(sub / np.where(s > 0, s, 1)), 0).clip(-32, 31)
    u = (q.astype(np.int16) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # value 128h + 32t + l
    low, high = u & 0x0F, u >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8),
                           d.view(np.uint8).reshape(n, 2)], axis=1)


def _enc_mxfp4(x: np.ndarray) -> np.ndarray:
    """MXFP4 blocks of x (n, 32): the scale 2^e the least that brings the largest magnitude within fp4's 6, each
    value the nearest fp4 level (ties to the even code) after dividing by it."""
    amax = np.abs(x).max(axis=1).astype(np.float64)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.ceil(np.log2(np.where(amax > 0, amax, 1) / 6.0)), -127).clip(-127, 127)
    y = x.astype(np.float64) / np.ldexp(1.0, e.astype(np.int32))[:, None]
    mags = FP4_VALUES[:8].astype(np.float64)
    code = np.abs(np.abs(y)[..., None] - mags).argmin(axis=-1).astype(np.uint8)  # first (even) code on a tie
    code |= np.where(np.signbit(y), 8, 0).astype(np.uint8)
    qs = code[:, 0::2] | (code[:, 1::2] << 4)
    return np.concatenate([(e + 127).astype(np.uint8)[:, None], qs], axis=1)


def _round_away(x: np.ndarray) -> np.ndarray:
    """C's roundf: halves away from zero."""
    return np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))


def _enc_q8_0(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_0_ref: d = max|x| / 127, values roundf(x / d) (the same f32 steps as gguf's)."""
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    q = _round_away(x * inv).astype(np.int8)
    return np.concatenate([_as_f16(d).view(np.uint8), q.view(np.uint8)], axis=1)


def _enc_q4_0(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q4_0_ref: d = (the value of largest magnitude) / -8, values trunc(x / d + 8.5) in 0..15,
    value j in the low nibble of byte j, value 16 + j in its high nibble."""
    n = x.shape[0]
    big = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)
    d = big / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    q = np.trunc(x * inv + np.float32(8.5)).astype(np.float32).astype(np.uint8).clip(0, 15).reshape(n, 2, 16)
    return np.concatenate([_as_f16(d).view(np.uint8), q[:, 0] | (q[:, 1] << 4)], axis=1)


def _enc_min_max(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's quantize_row_q4_1_ref / q5_1_ref steps: d = (max - min) / levels, q = trunc((x - min)·(1/d) + 0.5) in
    0..levels; (d, min) as f16 bytes (n, 2) each, q (n, 32) uint8."""
    mx, mn = x.max(axis=1, keepdims=True), x.min(axis=1, keepdims=True)
    d = (mx - mn) / np.float32(levels)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = np.trunc((x - mn) * inv + np.float32(0.5)).astype(np.float32).astype(np.uint8).clip(0, levels)
    return _as_f16(d).view(np.uint8), _as_f16(mn).view(np.uint8), q


def _pack5(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """5-bit values (n, 32) as q5_0 / q5_1's 4 bytes of fifth bits and 16 bytes of nibbles."""
    qh = np.packbits((q >> 4).reshape(-1, 32), axis=1, bitorder="little")
    return qh, (q[:, :16] & 0x0F) | (q[:, 16:] << 4)


def _enc_q4_1(x: np.ndarray) -> np.ndarray:
    d, m, q = _enc_min_max(x, 15)
    return np.concatenate([d, m, q[:, :16] | (q[:, 16:] << 4)], axis=1)


def _enc_q5_1(x: np.ndarray) -> np.ndarray:
    d, m, q = _enc_min_max(x, 31)
    return np.concatenate([d, m, *_pack5(q)], axis=1)


def _enc_q5_0(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q5_0_ref: d = (the value of largest magnitude) / -16, q = trunc(x / d + 16.5) in 0..31."""
    big = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)
    d = big / np.float32(-16)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = np.trunc(x * inv + np.float32(16.5)).astype(np.float32).astype(np.uint8).clip(0, 31)
    return np.concatenate([_as_f16(d).view(np.uint8), *_pack5(q)], axis=1)


def _nearest_level(v: np.ndarray) -> np.ndarray:
    """The index of the IQ4_LEVELS level nearest each value (the lower on a tie)."""
    return np.abs(v[..., None] - IQ4_LEVELS.astype(np.float64)).argmin(axis=-1).astype(np.uint8)


def _div0(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0.0)


def _enc_iq4_nl(x: np.ndarray) -> np.ndarray:
    """iq4_nl blocks of x (n, 32): d = (the value of largest magnitude) / -127 in f16, each value the nearest level
    of x / d."""
    big = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1).astype(np.float64)
    d = _as_f16(big / -127.0)
    q = _nearest_level(_div0(x.astype(np.float64), d.astype(np.float64)))
    return np.concatenate([d.view(np.uint8), q[:, :16] | (q[:, 16:] << 4)], axis=1)


def _enc_iq4_xs(x: np.ndarray) -> np.ndarray:
    """iq4_xs blocks of x (n, 256): a sub-block of 32's scale s = (its value of largest magnitude) / -127, stored as
    the 6-bit ls - 32 = rint(s / d) over the super-block's f16 d = max|s| / 31; values the nearest level of x / (d·
    (ls - 32))."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32).astype(np.float64)
    big = np.take_along_axis(sub, np.abs(sub).argmax(axis=2)[:, :, None], axis=2)[:, :, 0]
    s = big / -127.0
    d = _as_f16(np.abs(s).max(axis=1) / 31.0)
    df = d.astype(np.float64)[:, None]
    ls = np.rint(_div0(s, df)).clip(-32, 31)
    q = _nearest_level(_div0(sub, (df * ls)[:, :, None]))  # (n, 8, 32)
    u = (ls + 32).astype(np.uint16)
    lo = (u & 0x0F).astype(np.uint8)
    scales_l = lo[:, 0::2] | (lo[:, 1::2] << 4)
    h = ((u >> 4) << (2 * np.arange(8, dtype=np.uint16))[None, :]).sum(axis=1).astype(np.uint16)
    qs = (q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(n, 128)
    return np.concatenate([d.view(np.uint8).reshape(n, 2), h.view(np.uint8).reshape(n, 2), scales_l, qs], axis=1)


def _scales_mins(x: np.ndarray, width: int, levels: int, top: int):
    """A K-quant's search of x (n, 256) in sub-blocks of `width` values: each sub-block's scale and min (both
    non-negative, at most `top`) over the super-block's f16 d and dmin, each value the nearest of levels + 1 levels
    the stored scales give. (d, dmin, sc, mn, q): q (n, 256 / width, width)."""
    n = x.shape[0]
    sub = x.reshape(n, QK // width, width).astype(np.float64)
    lo = np.minimum(sub.min(axis=2), 0.0)
    step = (sub.max(axis=2) - lo) / float(levels)
    d, dmin = _as_f16(step.max(axis=1) / float(top)), _as_f16((-lo).max(axis=1) / float(top))
    df, dmf = d.astype(np.float64)[:, None], dmin.astype(np.float64)[:, None]
    sc = np.ceil(_div0(step, df)).clip(0, top).astype(np.uint8)
    mn = np.rint(_div0(-lo, dmf)).clip(0, top).astype(np.uint8)
    q = np.rint(_div0(sub + (dmf * mn)[:, :, None], (df * sc)[:, :, None])).clip(0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q


def _enc_q5_k(x: np.ndarray) -> np.ndarray:
    """q5_k blocks of x (n, 256): q4_k's encoder over 32 levels, the fifth bits in qh."""
    n = x.shape[0]
    d, dmin, sc, mn, q = _scales_mins(x, 32, 31, 63)
    scales = np.zeros((n, 12), np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8)  # (n, 32)
    low = (q & 0x0F).reshape(n, 4, 2, 32)
    qs = (low[:, :, 0, :] | (low[:, :, 1, :] << 4)).reshape(n, 128)
    return np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales, qh, qs], axis=1)


def _pack2(q: np.ndarray) -> np.ndarray:
    """Values' low two bits (n, 256) as q2_k / q3_k's 64 bytes: value 128h + 32t + l at bits 2t of byte 32h + l."""
    n = q.shape[0]
    b = (q & 3).reshape(n, 2, 4, 32)
    return (b[:, :, 0] | (b[:, :, 1] << 2) | (b[:, :, 2] << 4) | (b[:, :, 3] << 6)).reshape(n, 64)


def _enc_q2_k(x: np.ndarray) -> np.ndarray:
    """q2_k blocks of x (n, 256): per sub-block of 16 a 4-bit scale and min over the super-block's f16 d and dmin,
    values the nearest of the 4 levels the stored scales give."""
    n = x.shape[0]
    d, dmin, sc, mn, q = _scales_mins(x, 16, 3, 15)
    return np.concatenate([sc | (mn << 4), _pack2(q.reshape(n, QK)), d.view(np.uint8).reshape(n, 2),
                           dmin.view(np.uint8).reshape(n, 2)], axis=1)


def _enc_q3_k(x: np.ndarray) -> np.ndarray:
    """q3_k blocks of x (n, 256): per sub-block of 16 a 6-bit scale (as sc - 32, non-negative here) over the
    super-block's f16 d, values the nearest of -4..3 steps."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16).astype(np.float64)
    step = np.maximum(np.maximum(-sub.min(axis=2), 0.0) / 4.0, np.maximum(sub.max(axis=2), 0.0) / 3.0)
    d = _as_f16(step.max(axis=1) / 31.0)
    df = d.astype(np.float64)[:, None]
    sc = np.ceil(_div0(step, df)).clip(0, 31)
    q = np.rint(_div0(sub, (df * sc)[:, :, None])).clip(-4, 3).astype(np.int16).reshape(n, QK)
    u = (q + 4).astype(np.uint8)  # 0..7: its high bit is hmask's (set: q = low bits; clear: low bits - 4)
    hm = ((u >> 2).reshape(n, 8, 32) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8)
    s6 = (sc + 32).astype(np.uint8)  # (n, 16)
    scales = np.zeros((n, 12), np.uint8)
    scales[:, 0:8] = (s6[:, 0:8] & 0x0F) | ((s6[:, 8:16] & 0x0F) << 4)
    hi = (s6 >> 4).reshape(n, 4, 4)  # sub-block 4i + j's high bits at bits 2i of byte 8 + j
    scales[:, 8:12] = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    return np.concatenate([hm, _pack2(u), scales, d.view(np.uint8).reshape(n, 2)], axis=1)


GGUF_QUANTIZED = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")  # the formats gguf's own quantizer writes (ggml's reference)
_OWN = {"q8_0": _enc_q8_0, "q4_0": _enc_q4_0, "q4_1": _enc_q4_1, "q5_0": _enc_q5_0, "q5_1": _enc_q5_1}
_ENCODE = {"q4_k": _enc_q4_k, "q6_k": _enc_q6_k, "q5_k": _enc_q5_k, "q3_k": _enc_q3_k, "q2_k": _enc_q2_k,
           "iq4_nl": _enc_iq4_nl, "iq4_xs": _enc_iq4_xs, "mxfp4": _enc_mxfp4}


def _gguf_quantize(x: np.ndarray, fmt: str) -> np.ndarray:
    """A GGUF_QUANTIZED format by gguf's quantizer (ggml's reference) where gguf is installed (the GPU machine may
    lack it), else by the same steps here (tests/test_blocks.py and tests/test_formats_more.py check the two agree to
    the byte)."""
    try:
        from gguf import GGMLQuantizationType, quants
    except ImportError:
        return _OWN[fmt](x.reshape(-1, 32)).reshape(x.shape[0], -1)
    return quants.quantize(x, GGMLQuantizationType[fmt.upper()])


def _dense(values: np.ndarray, fmt: str) -> np.ndarray:
    """f32 values as f32, f16, or bf16 bits (uint16, rounded to nearest even as torch rounds)."""
    v = np.asarray(values, dtype=np.float32)
    if fmt == "f32":
        return v.copy()
    if fmt == "f16":
        return v.astype(np.float16)
    if fmt == "bf16":
        u = v.view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    raise ValueError(f"unknown checkpoint format `{fmt}`")


def encode(values: np.ndarray, fmt: str) -> np.ndarray:
    """f32 values (rows, cols) as checkpoint storage in `fmt`: the block formats as uint8 (rows, row_bytes) — q8_0,
    q4_0, q4_1, q5_0, q5_1 by gguf's own quantizer (ggml's, bit for bit), the K-quants and i-quants by the
    quantizers here (simple ones: valid blocks, each value within a step, not ggml's error-minimizing search); f32,
    f16 and bf16 (`_dense`) as the front reads them."""
    if fmt not in BLOCKS:
        return _dense(values, fmt)
    v = np.asarray(values, dtype=np.float32)
    if v.ndim == 1:
        v = v[None, :]
    if v.ndim != 2:
        raise ValueError(f"block-format values must be rows (rows, cols), not shape {v.shape}")
    why = row_refusal(fmt, v.shape[1])
    if why:
        raise ValueError(why)
    if not np.isfinite(v).all():
        raise ValueError(f"non-finite values cannot be encoded in {fmt}")
    rows, cols = v.shape
    if fmt in GGUF_QUANTIZED:
        out = _gguf_quantize(v, fmt)
    else:
        out = _ENCODE[fmt](v.reshape(-1, BLOCKS[fmt][0]))
    return np.ascontiguousarray(out, dtype=np.uint8).reshape(rows, row_bytes(fmt, cols))


def scales_finite(raw: np.ndarray, fmt: str) -> np.ndarray:
    """Per block, whether its f16 scales (F16_SCALES: d, and dmin or m where the format has one) are finite: the bits
    of a non-finite f16 have every exponent bit set."""
    bb = BLOCKS[fmt][1]
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, bb)
    if fmt == "mxfp4":  # e8m0's 255 is NaN
        return b[:, 0] != 0xFF
    at = F16_SCALES[fmt]
    ok = np.ones(b.shape[0], bool)
    for o in at:
        h = b[:, o].astype(np.uint16) | (b[:, o + 1].astype(np.uint16) << 8)
        ok &= (h & 0x7C00) != 0x7C00
    return ok


def encode_matrices(arrays: dict[str, np.ndarray], fmt: str) -> dict[str, tuple[np.ndarray, str]]:
    """Every 2-D array (checkpoint rows: projections, the embedding) of a model's `arrays` as (storage, fmt); 1-D ones
    (norm weights, biases) kept as f32 values — a DictStore model (engine/front/weights.py) in `fmt`."""
    return {n: (encode(a, fmt), fmt) if np.ndim(a) == 2 else (np.asarray(a, np.float32), "f32")
            for n, a in arrays.items()}
