"""`gemm_deq`, `gemm_deq_parts`, `gemm_deq_glu`: the tensor-core products of many rows (gemm_tc.py's GemmTc,
GemmTcParts, GemmTcGlu: their fields, twins and numerics) over checkpoint rows in a block format (q8_0, q4_0, q4_k,
q6_k, mxfp4), each matrix decoded to bf16 rows once a launch into scratch, then cuBLAS's bf16 product of those rows
(kernels/gemm_blas.py's forms) — issue 35's q4_k / q8_0 prefill: gemm_tc decodes a value at a time into registers for
every tile of rows that reads it (gemm_tc_any: bench/gemm_model.py prices that at a fraction of the bf16 kernel's
rate), where the decode here streams the block bytes once and writes 2 bytes a value, read back by cuBLAS at its rate.

What runs on the device, in order (one launch of the plan, the stream's order keeping each step after the last):
1. gemm_tc_round (gemm_tc.cu): x rounded to bf16 into scratch `xb`, as every tensor-core product does;
2. for each matrix (gate and up, q/k/v: one after the other, the scratch `wb` of the largest reused):
   gemm_tc_dequant (gemm_tc.cu): the rows decoded eight values a thread by prelude.cu's qget4 (gguf's order of
   operations: the value every other reader decodes, to the bit) and rounded to bf16 (bf16_rn) into `wb`, rows of k
   values (k a multiple of 32: whole 16-byte rows); then cublasGemmEx as gemm_blas.py's with A = `wb` (lda = k);
3. the epilogue launch where the product has one (gemm_tc_combine; the GLU's gated mul), as gemm_blas.py's.

The numerics are gemm_tc's for the same rows: w decoded to f32 as engine/formats decodes it, rounded to bf16 to
nearest even (gemm_tc_any's tc_get then bf16_rn: the same bits), x rounded the same way, products summed in f32 in
cuBLAS's order: the exact twin is GemmTc's (tc_products of the decoded rows), within gemm_blas.blas_bound; the
dequantize kernel's own twin is `decoded_bf16`, to the bit.

Chosen by the lane's `cublas` step (gemm_blas.prefer) where it prices below gemm_tc, held by `dequant` (block
formats keep gemm_tc's kernel) or `cublas`. Its price: the decode's bytes (the block bytes read, 2 bytes a value
written and read back by cuBLAS) over HBM beside cuBLAS's flops at knob tflops_blas plus the decode's instructions
(gemm_tc.DECODE_INSTR, once a value), against gemm_tc's kernel at the rate its own decode allows (once a value for
every tile of rows: gemm_tc.TcProduct.rate). The scratch: 2·n·k bytes for
the largest matrix of the launch (Qwen3-8B's gate or up: 100.7 MB), placed for the launch alone (the arena reuses it
for every other launch's scratch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import FORMAT_CODE, Scratch, decode
from lanefuse.kernels.gemm_blas import (DECODED_OF, GemmBlas, GemmBlasGlu, GemmBlasParts, INT_MAX)
from lanefuse.kernels.gemm_tc import DECODE_INSTR, GemmTc, GemmTcGlu, GemmTcParts, bf16_round, decode_us

DEQ_FORMATS = ("q8_0", "q4_0", "q4_k", "q6_k", "mxfp4")  # gemm_tc's block formats (TC_FORMATS), decoded by qget4
DEQ_THREADS = 256
DEQ_MAX_BLOCKS = 4096  # the dequantize grid's most blocks: each thread loops over the groups of 8 past them


def decoded_bf16(raw: np.ndarray, fmt: str, n: int, k: int) -> np.ndarray:
    """gemm_tc_dequant's twin: rows (n, k) in `fmt` decoded as engine/formats decodes them (kernels.common.decode),
    each value rounded to bf16 (gemm_tc.bf16_round): the bf16 bits, uint16 (n, k)."""
    w = np.asarray(decode(raw, fmt), dtype=np.float32).reshape(-1)[: n * k]
    return (bf16_round(w).view(np.uint32) >> 16).astype(np.uint16).reshape(n, k)


def dequant_grid(count: int) -> tuple[tuple[int], tuple[int]]:
    """gemm_tc_dequant's grid for `count` values: a thread a group of 8, at most DEQ_MAX_BLOCKS blocks."""
    return (max(1, min(DEQ_MAX_BLOCKS, -(-(count // 8) // DEQ_THREADS))),), (DEQ_THREADS,)


def deq_refusal(fmt: str, n: int, k: int) -> Refusal | None:
    if fmt not in DEQ_FORMATS:
        return Refusal(f"rows in {fmt} decoded to bf16 for cuBLAS (the decode reads {', '.join(DEQ_FORMATS)})")
    if k % 8:
        return Refusal(f"rows of k {k} decoded to bf16 for cuBLAS (whole 16-byte rows: k a multiple of 8)")
    if max(n, k) > INT_MAX:
        return Refusal(f"a cuBLAS product of {n} outputs, k {k} (its dimensions are ints)")
    return None


class Decoded:
    """What the decoded forms share: the scratch `wb` of the largest matrix (2·n·k bytes), each matrix decoded into it
    just before its cuBLAS call (gemm_blas.BlasProduct.rows_of), and those bytes in the price."""

    def matrices(self) -> list[tuple[str, int]]:
        """(weight, outputs) of each matrix the launch multiplies by, in the order it runs them."""
        raise NotImplementedError

    def decoded(self) -> Scratch:
        return Scratch("wb", "u8", 2 * max(n for _, n in self.matrices()) * self.k)

    def decode_bytes(self) -> int:
        """Each matrix's bf16 rows written by the decode and read back by cuBLAS."""
        return sum(4 * n * self.k for _, n in self.matrices())

    def scratch(self):
        """The cuBLAS form's scratch (gemm_blas.py), then the decoded rows `wb`."""
        return (*super().scratch(), self.decoded())

    def bytes(self):
        """The cuBLAS form's bytes and the decoded rows'."""
        return super().bytes() + self.decode_bytes()

    def rows_of(self, denv, w: str, owner):
        """Matrix `w` decoded into `owner`'s scratch `wb` (gemm_tc_dequant), which cuBLAS then reads as bf16 rows."""
        from lanefuse.kernels.cupy_env import i64

        n = dict(owner.matrices())[w]
        wb = denv.scratch(owner, owner.decoded())
        g, b = dequant_grid(n * self.k)
        denv.function(GemmTc.stem, "gemm_tc_dequant")(g, b, (denv.weight(w)[0], i64(FORMAT_CODE[self.format]), wb,
                                                             i64(n * self.k)))
        return wb

    def rate(self, knobs) -> float:
        """The lane's rate of its flops: cuBLAS's (gemm_blas.blas_rate) with the decode's instruction issue
        (DECODE_INSTR's second figure a value of each matrix, once) added to their time."""
        blas, flops = super().rate(knobs), self.flops()
        us = decode_us(sum(n for _, n in self.matrices()) * self.k, DECODE_INSTR[self.format][1], knobs.sms)
        return flops / (flops / (blas * 1e6) + us) / 1e6

    def device_launches(self) -> int:
        """The cuBLAS form's launches (gemm_blas.BlasProduct) and each matrix's decode."""
        return super().device_launches() + len(self.matrices())

    def refusal(self) -> Refusal | None:
        for _, n in self.matrices():
            why = deq_refusal(self.format, n, self.k)
            if why:
                return why
        return None


@dataclass(frozen=True)
class GemmDeq(Decoded, GemmBlas):
    """GemmTc's product over block-format rows: x rounded, w decoded to bf16 into scratch, then GemmBlas's call and
    epilogue."""

    census: ClassVar[str] = "gemm_deq"

    def matrices(self):
        return [(self.w, self.n)]

    def check(self):
        if self.ksplit != 1:
            return Refusal(f"a cuBLAS product in {self.ksplit} parts along k (cuBLAS splits k itself)")
        return GemmTc.check(self) or self.refusal()


@dataclass(frozen=True)
class GemmDeqParts(Decoded, GemmBlasParts):
    """GemmTcParts's products of one activation over block-format rows: x rounded once, then each part's matrix
    decoded into the one scratch and multiplied (GemmBlas's call and epilogue), part after part."""

    census: ClassVar[str] = "gemm_deq_parts"

    def matrices(self):
        return [(p.w, p.n) for p in self.parts]

    def one(self, p) -> GemmDeq:
        return GemmDeq(self.x, p.w, self.format, p.y, self.k, p.n, self.m, bias=p.bias)

    def check(self):
        return GemmTcParts.check(self) or self.refusal()


@dataclass(frozen=True)
class GemmDeqGlu(Decoded, GemmBlasGlu):
    """GemmTcGlu's gate and up products and their GLU over block-format rows: the up matrix decoded and multiplied
    into out, the gate's decoded into the same scratch and multiplied into the gate's, then the gated mul."""

    census: ClassVar[str] = "gemm_deq_glu"

    def matrices(self):
        return [(self.wu, self.n), (self.wg, self.n)]

    def check(self):
        return GemmTcGlu.check(self) or self.refusal()


DECODED_OF.update({GemmTc: GemmDeq, GemmTcParts: GemmDeqParts, GemmTcGlu: GemmDeqGlu})
