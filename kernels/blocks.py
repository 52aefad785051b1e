"""GGUF's block formats (q8_0, q4_0, q4_k, q6_k) as the kernels read them in place: the format table (values and bytes
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

from lanefuse.engine.mxfp4 import FP4_VALUES, mxfp4_blocks, pack_mxfp4, unpack_mxfp4  # noqa: F401  (the format's own)

# format -> (values a block, bytes a block): GGUF's layouts (gguf.GGML_QUANT_SIZES), and MXFP4 (`mxfp4`: gpt-oss's
# experts as transformers' checkpoints hold them, a block's e8m0 scale byte then its 16 bytes of fp4 e2m1 pairs)
BLOCKS = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_k": (256, 144), "q6_k": (256, 210), "mxfp4": (32, 17)}
QK = 256  # the values of a K-quant super-block


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


_DECODE = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_k": _q4_k, "q6_k": _q6_k, "mxfp4": mxfp4_blocks}
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


def _gguf_quantize(x: np.ndarray, fmt: str) -> np.ndarray:
    """q8_0 / q4_0 by gguf's quantizer (ggml's reference) where gguf is installed (the GPU machine may lack it), else
    by the same steps here (tests/test_blocks.py checks the two agree to the byte)."""
    try:
        from gguf import GGMLQuantizationType, quants
    except ImportError:
        blocks = x.reshape(-1, 32)
        return (_enc_q8_0 if fmt == "q8_0" else _enc_q4_0)(blocks).reshape(x.shape[0], -1)
    return quants.quantize(x, {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}[fmt])


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
    """f32 values (rows, cols) as checkpoint storage in `fmt`: the block formats as uint8 (rows, row_bytes) — q8_0 and
    q4_0 by gguf's own quantizer (ggml's, bit for bit), q4_k and q6_k by the quantizer here; f32, f16 and bf16
    (`_dense`) as the front reads them."""
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
    if fmt in ("q8_0", "q4_0"):
        out = _gguf_quantize(v, fmt)
    elif fmt == "mxfp4":
        out = _enc_mxfp4(v.reshape(-1, 32))
    else:
        blocks = v.reshape(-1, QK)
        out = (_enc_q4_k if fmt == "q4_k" else _enc_q6_k)(blocks)
    return np.ascontiguousarray(out, dtype=np.uint8).reshape(rows, row_bytes(fmt, cols))


def scales_finite(raw: np.ndarray, fmt: str) -> np.ndarray:
    """Per block, whether its f16 scales (d; and dmin for q4_k) are finite: the bits of a non-finite f16 have every
    exponent bit set."""
    bb = BLOCKS[fmt][1]
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, bb)
    if fmt == "mxfp4":  # e8m0's 255 is NaN
        return b[:, 0] != 0xFF
    at = {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}[fmt]
    ok = np.ones(b.shape[0], bool)
    for o in at:
        h = b[:, o].astype(np.uint16) | (b[:, o + 1].astype(np.uint16) << 8)
        ok &= (h & 0x7C00) != 0x7C00
    return ok


def encode_matrices(arrays: dict[str, np.ndarray], fmt: str) -> dict[str, tuple[np.ndarray, str]]:
    """Every 2-D array (checkpoint rows: projections, the embedding) of a model's `arrays` as (storage, fmt); 1-D ones
    (norm weights, biases) kept as f32 values — a DictStore model (engine/weights.py) in `fmt`."""
    return {n: (encode(a, fmt), fmt) if np.ndim(a) == 2 else (np.asarray(a, np.float32), "f32")
            for n, a in arrays.items()}
