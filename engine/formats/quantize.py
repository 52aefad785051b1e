"""The q8 numerics: what quantizing an activation means (llama.cpp's q8_0 rounding, and two words for q8x2), what a
product of a quantized activation computes, and which activations of a step graph are read quantized
(`with_numerics`: the `quantize` ops a q8 or q8x2 step graph gets, and why each other product reads f32)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from lanefuse.engine.errors import UserError
from lanefuse.engine.ir import Graph, Op, Tensor, attrs_of
from lanefuse.engine.opdefs import QBLOCK, QBLOCK_K, QFORMS
from lanefuse.engine.formats.layout import BLOCK_FORMATS as BLOCK_FORMATS_BYTES

NUMERICS = {"f32": 0, "q8": 1, "q8x2": 2}  # numerics -> int8 words a value of a quantized activation (0: none)
BLOCK_FORMATS = ("q8_0", "q4_0", "q4_k", "q6_k", "q4_1", "q5_0", "q5_1", "q5_k", "q3_k", "q2_k", "iq4_nl", "iq4_xs")
# under q8 the K-quants' and iq4_xs's products read the q8k form (llama.cpp's q8_K), as llama.cpp's do (their
# vec_dot_type); the others the q8 form: llama.cpp's q8_0 for q8_0, q4_0, q5_0, iq4_nl, and for q4_1 / q5_1 its q8_1 —
# the same words and f16 scale, and s = d·Σq, which the products sum from the words (kernels/q8dot.py)
MIN_FORMATS = ("q4_1", "q5_1")  # formats of 32-value blocks d·q + m, paired under q8 with llama.cpp's q8_1
K_FORMATS = ("q2_k", "q3_k", "q5_k", "iq4_xs", "q4_k", "q6_k")
Q8K = 3  # the quantize words of the q8k form
SUM = 16  # the q8k form keeps the sum of each 16 words (block_q8_K's bsums)
LOW_STEPS = 254  # the low word counts steps of d/254: the residual under the high word is within ±d/2

F32 = np.float32
F64 = np.float64


@dataclass(frozen=True)
class Quantized:
    """A quantized activation (R, n): int8 `words`, the low int8 words under two words (or None), a scale a block of
    `block` values (R, n/block) held f32 — under one word llama.cpp's unrounded f32 d = amax/127, whose f16 rounding
    (`d`) is the block's scale and from which q4_1 / q5_1 products take q8_1's s = f16(d·Σq) (`s`); under the q8k form
    (block 256) `sums`, the sum of each 16 words (R, n/16) int16. Its value is d·(q + low/254) — exactly, in f64."""

    words: np.ndarray
    low: np.ndarray | None
    scales: np.ndarray
    block: int = QBLOCK
    sums: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.words.shape

    def parts(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Its parts flat, as a launch's env holds a quantized form: words, low words (a q8k form: its sums of 16
        words; None under one word), scales."""
        low = self.sums if self.block != QBLOCK else self.low
        return self.words.reshape(-1), None if low is None else low.reshape(-1), self.scales.reshape(-1)

    @property
    def one_word(self) -> bool:
        """Whether it is the one-word q8 form (llama.cpp's q8_0 / q8_1): its held scale is the f32 d32."""
        return self.low is None and self.block == QBLOCK

    def d(self) -> np.ndarray:
        """Each block's scale as the products multiply by it (R, n/block) f32: under one word f16(d32), the d
        block_q8_0 / block_q8_1 store; else the scale as held."""
        return half(self.scales) if self.one_word else self.scales

    def s(self) -> np.ndarray:
        """Under one word each block's q8_1 s (R, n/32) f32: f16(d32·Σq), the f32 product of the unrounded scale and
        the words' sum rounded to f16, as llama.cpp's quantize_row_q8_1 stores it (what q4_1 / q5_1 products multiply
        their blocks' mins by)."""
        r, n = self.words.shape
        sq = self.words.reshape(r, n // QBLOCK, QBLOCK).astype(np.int32).sum(axis=2).astype(F32)
        return half(self.scales.astype(F32) * sq)

    def values(self) -> np.ndarray:
        """The values it stands for, in f64 (exact: an int8 or int16 times an f32)."""
        r, n = self.words.shape
        q = self.words.astype(F64)
        if self.low is not None:
            q = q + self.low.astype(F64) / LOW_STEPS
        return (q.reshape(r, n // self.block, self.block) * self.d().astype(F64)[:, :, None]).reshape(r, n)


def half(x: np.ndarray) -> np.ndarray:
    """f32 values rounded to f16 (to nearest, ties to even: F16C's and cvt.rn.f16.f32's), held f32."""
    return np.asarray(x, dtype=F32).astype(np.float16).astype(F32)


def block_mins(raw: np.ndarray, fmt: str, n: int, k: int) -> np.ndarray:
    """Rows (n, k) of q4_1 / q5_1 (MIN_FORMATS, as stored: (n, k/32·bytes) uint8) as each block's f16 min m (bytes
    2..3 of a block) (n, k/32) f32."""
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n * (k // QBLOCK), BLOCK_FORMATS_BYTES[fmt][1])
    return b[:, 2:4].copy().view(np.float16)[:, 0].astype(F32).reshape(n, k // QBLOCK)


def round_even(x: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: x + 1.5·2²³ in f32, whose rounding is to nearest, halves to even (np.rint's)."""
    return np.rint(np.asarray(x, dtype=F32)).astype(F32)


def quantize_k(x: np.ndarray) -> Quantized:
    """x (R, n) f32 as llama.cpp's q8_K (ggml's quantize_row_q8_K_ref, the activation of its K-quant products): per
    block of 256 values, `max` the first value of the largest |x|, iscale = -127/max and q = min(127,
    nearest_int(iscale·x)) in f32, d = 1/iscale kept f32 (0 and q 0 where the block is all zero), and the sum of each
    16 words."""
    xs = np.asarray(x, dtype=F32)
    r, n = xs.shape
    if n % QBLOCK_K:
        raise UserError(f"a q8_K row of {n} values is not a whole number of {QBLOCK_K}-value blocks")
    b = xs.reshape(r, n // QBLOCK_K, QBLOCK_K)
    at = np.abs(b).argmax(axis=2)  # the first of the largest |x|, as ggml's strict `ax > amax` keeps it
    mx = np.take_along_axis(b, at[:, :, None], axis=2)[:, :, 0]  # (R, nb), signed
    with np.errstate(divide="ignore"):
        iscale = np.where(mx == 0, F32(0), F32(-127) / mx).astype(F32)
        d = np.where(mx == 0, F32(0), F32(1) / iscale).astype(F32)
    q = np.minimum(round_even(b * iscale[:, :, None]), F32(127)).astype(np.int8)
    sums = q.reshape(r, n // SUM, SUM).astype(np.int16).sum(axis=2, dtype=np.int16)
    return Quantized(q.reshape(r, n), None, d, QBLOCK_K, sums)


def quantize(x: np.ndarray, words: int = 1) -> Quantized:
    """x (R, n) f32 in blocks of QBLOCK as llama.cpp's CPU build quantizes an activation (the x86 SIMD
    quantize_row_q8_0 / q8_1 of ggml-cpu/arch/x86/quants.c, which llama-cpp-python runs; not the scalar _ref):
    amax = max|x|, d = amax/127, id = 127/amax (not 1/d) and q = x·id in f32 rounded to nearest, halves to even
    (_mm256_round_ps; the scalar _ref and gguf's quantizer round halves away, a word apart at every tie). The scale
    held is d in f32 under both. Under one word the products multiply by d rounded to f16 (`Quantized.d`: what
    llama.cpp's block_q8_0 / q8_1 store and its dot products multiply by — with an f32 scale lanefuse's q8 logits
    were 4e-3 of their scale from llama.cpp's, with f16 1e-7), and q4_1 / q5_1 products their mins by q8_1's
    s = f16(d·Σq) of the unrounded d (`Quantized.s`; m·f16(d)·Σq was 0.1-0.19 of the logits off at real width).
    Under two words low = rint((x - q·d)·(id·254)), clipped to ±127. kernels/quant.cu's quant_block is the same
    arithmetic."""
    if words == Q8K:
        return quantize_k(x)
    xs = np.asarray(x, dtype=F32)
    r, n = xs.shape
    if n % QBLOCK:
        raise UserError(f"a quantized row of {n} values is not a whole number of {QBLOCK}-value blocks")
    b = xs.reshape(r, n // QBLOCK, QBLOCK)
    amax = np.abs(b).max(axis=2)  # (R, nb)
    d = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore", over="ignore"):
        inv = np.where(d == 0, F32(0), F32(127) / amax).astype(F32)
    q = round_even(b * inv[:, :, None])
    low = None
    if words == 2:
        res = (b - q * d[:, :, None]).astype(F32)
        low = np.clip(round_even(res * (inv * F32(LOW_STEPS))[:, :, None]), -127, 127).astype(np.int8).reshape(r, n)
    return Quantized(q.astype(np.int8).reshape(r, n), low, d)


def product(xq: Quantized, w: np.ndarray, mins: np.ndarray | None = None) -> np.ndarray:
    """xq (R, k) · wᵀ (n, k) as the q8 numerics compute it: each block's int8 words dotted with the weights' values
    (under q8_0 and q4_0 rows those are the block's f16 scale times its integers, so the block sum is that scale times
    an int32 sum of int8 products), times the block's activation scale, the blocks summed — in f64, exactly up to
    its rounding. Under two words the low words' sum, over 254, joins the high words'. Under the q8k form (K_FORMATS
    rows under q8) the blocks are its 256-value blocks, each a q8_K block times a super-block, as llama.cpp's
    vec_dot_q4_K_q8_K and the others sum them (their integer sums are these, grouped). `mins` (n, k/32), q4_1 / q5_1
    rows' block mins: under one word a block's min term is m·s (llama.cpp's vec_dot_q4_1_q8_1: q8_1's s =
    f16(d32·Σq)), not the m·f16(d32)·Σq the decoded rows give, so each block adds m·(s - d·Σq)."""
    r, k = xq.shape
    n = w.shape[0]
    bl = xq.block
    nb = k // bl
    wb = np.asarray(w, dtype=F64).reshape(n, nb, bl)
    q = xq.words.astype(F64).reshape(r, nb, bl)
    sums = np.einsum("rbi,nbi->rnb", q, wb)  # (R, n, nb)
    if xq.low is not None:
        sums = sums + np.einsum("rbi,nbi->rnb", xq.low.astype(F64).reshape(r, nb, bl), wb) / LOW_STEPS
    d = xq.d().astype(F64)
    y = np.einsum("rnb,rb->rn", sums, d)
    if mins is not None and xq.one_word:
        ds = xq.s().astype(F64) - q.sum(axis=2) * d  # (R, nb): s - d·Σq
        y = y + np.einsum("rb,nb->rn", ds, np.asarray(mins, dtype=F64).reshape(n, nb))
    return y.astype(F32)


# -- the step graph under a numerics ----------------------------------------------------------------------------------

def why_f32(g: Graph, op: Op) -> str | None:
    """Why product `op` (a matmul) reads its activation f32 under a quantized numerics, in words; None where it reads
    it quantized (its weights are block-quantized checkpoint rows)."""
    w = g.constants.get(op.ins[1])
    if w is None:
        return "its matrix is computed in the step"
    if w.kind != "rows":
        return "its matrix is f32 values"
    if w.format not in BLOCK_FORMATS:
        return f"its rows are {w.format} (only block-quantized rows are multiplied as int8)"
    if op.acc(0) is not None:
        return "its activation is read strided (a part of every unit of a wider tensor)"
    if g.dtype(op.ins[0]) != "f32":
        return None
    if g.shape(op.ins[0])[-1] % QBLOCK:
        return f"its activation's rows are not whole {QBLOCK}-value blocks"
    return None


def form_words(g: Graph, op: Op, words: int) -> int:
    """The quantize words product `op` reads its activation in under a numerics of `words`: under q8 a product over
    K-quant rows reads the q8k form (llama.cpp's q8_K: blocks of 256, as llama.cpp multiplies those rows), any other
    the q8 form; q8x2 is lanefuse's own, in blocks of 32 over every format."""
    w = g.constants.get(op.ins[1])
    return Q8K if words == 1 and w is not None and w.format in K_FORMATS else words


def with_numerics(g: Graph, numerics: str) -> Graph:
    """`g` under `numerics`: f32 unchanged; q8 / q8x2 with a `quantize` (one word / two) of every activation a product
    over block-quantized rows reads, placed right before the first such product, which with every other one of the
    same activation reads it — under q8 the products over K-quant rows read a q8k form of their own (`form_words`;
    an activation read by q8_0 and q4_k rows has both). A product over f32/f16/bf16 rows or values, and an expert mixture (its router and
    experts), read f32 (`f32_reads` says why)."""
    if numerics not in NUMERICS:
        raise UserError(f"numerics `{numerics}`: one of {', '.join(NUMERICS)}")
    words, now = NUMERICS[numerics], g.meta.get("numerics", "f32")
    if now == numerics or not words:
        if now != numerics:
            raise UserError(f"a step graph under {now} numerics cannot be planned under {numerics}")
        return g
    if now != "f32":
        raise UserError(f"a step graph under {now} numerics cannot be planned under {numerics}")
    tensors = dict(g.tensors)
    ops: list[Op] = []
    made: dict[tuple[str, int], str] = {}  # (activation, quantize words) -> its quantized form
    rows_of = _rows_viewed(g)

    def quantized(x: str, fw: int, layer) -> str:
        if (x, fw) not in made:
            if x in rows_of and g.shape(rows_of[x][0])[-1] % (QBLOCK_K if fw == Q8K else QBLOCK) == 0:
                src, row, rows = rows_of[x]  # rows (of whole blocks) of a computed tensor: a view into its form
                v = Op("view", (quantized(src, fw, layer),), x + "." + QFORMS[fw],
                       attrs_of({"row": row, "rows": rows}), layer=layer)
                _name(tensors, g, v.out, x)
                tensors[v.out] = Tensor(v.out, g.shape(x), QFORMS[fw])
                ops.append(v)
                made[x, fw] = v.out
                return v.out
            q = x + "." + QFORMS[fw]
            _name(tensors, g, q, x)
            tensors[q] = Tensor(q, g.shape(x), QFORMS[fw])
            ops.append(Op("quantize", (x,), q, attrs_of({"words": fw}), layer=layer))
            made[x, fw] = q
        return made[x, fw]

    for op in g.ops:
        if not op.fused and op.kind == "matmul" and why_f32(g, op) is None:
            op = replace(op, ins=(quantized(op.ins[0], form_words(g, op, words), op.layer),) + op.ins[1:])
        ops.append(op)
    meta = dict(g.meta)
    meta["numerics"] = numerics
    return replace(g, ops=ops, tensors=tensors, meta=meta)


def _name(tensors, g: Graph, q: str, x: str) -> None:
    if q in tensors or q in g.constants:
        raise UserError(f"the quantized form of `{x}` would be named `{q}`, which the step already names")


def _rows_viewed(g: Graph) -> dict[str, tuple[str, int, int]]:
    """The rows of computed tensors a step reads in place (free views: their tensor is no step input, no table and
    not written in place before the rows' last reader), view -> (its tensor, its first row, its rows): a product
    reading such rows quantized reads a view into the tensor's quantized form (seed 000), so the tensor is quantized
    once, by its producer, for every range of rows the products read of it."""
    from lanefuse.engine.placement import copied_views

    made = {o for op in g.ops for o in op.outs}
    copied = copied_views(g)
    return {op.out: (op.ins[0], int(op.a["row"]), int(op.a.get("rows", 1))) for op in g.ops
            if not op.fused and op.kind == "view" and op.out not in copied and op.ins[0] in made
            and op.ins[0] not in g.io.tables and op.ins[0] not in g.io.inputs}


def f32_reads(g: Graph) -> list[tuple[str, str]]:
    """Under a quantized numerics, each product that reads its activation f32 and why: (its output, the reason)."""
    out = []
    for op in g.ops:
        for leaf in op.leaves() if op.fused else (op,):
            if leaf.kind == "matmul" and g.dtype(leaf.ins[0]) == "f32":
                out.append((leaf.out, why_f32(g, leaf) or "its activation is f32"))
            elif leaf.kind == "moe":
                out.append((leaf.out, "an expert mixture reads f32 (its router under every numerics; its experts "
                                      "in this lane)"))
    return out
