"""`head_gemv`: each head's own product, y (m, heads·b) from x (m, heads·a) — head h's a values times its matrix of
checkpoint rows in `format` (the lifted `head_matmul`: a latent attention's query absorbed into latent space, its
output expanded out of it). `rows_out`: w is (heads·b, a), head h's b output rows at h·b (y_h = x_h·W_hᵀ); else
(heads·a, b), head h's a input rows at h·a (y_h = x_h·W_h). Two kernels (head_gemv.cu): a warp an output of a row, or of ROWS_A_WARP rows. With
`quant` (gemv_quant.heads: the q8 numerics' o projection of a latent attention) the output's quantized form too: the
last block to arrive at each 32 outputs quantizes them (an arrival counter a block of 32; the q8k form, llama.cpp's
q8_K for K-quant o rows: at each 256). With `part` (seed 002's HeadGemv `part`: an access of its input) head h of row
r reads its a values at (r·heads + h)·pitch + offset of a wider x: each head's unrotated query values inside every
head's whole query row, as a latent attention's query absorbed in the seed's spelling (one query projection) reads
them. The real fronts cut the query projection's rows instead (engine/front/families/deepseek.py: `nope_rows`, a
product of its own beside the rotated rows', which the merged products take in one launch), so only a step YAML with
an access reaches it (tests/test_head_gemv_part.py plans one, DeepSeek-V3-shaped). Seed 002's `shared` (set false by
its link, described nowhere; read here as x's row shared by every head, as the key and value halves of a wide chunk's
expanded latent attention read the latent cache) is heads 1 with b every head's outputs here: one row of x times the heads' stacked rows (rows_out), as
lane/lower/hooks.py's expanded halves take it, with `upto` (tests/test_head_gemv_filled.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from lanefuse.kernels.common import (FORMAT_CODE, MAX_GRID_Y, Dst, Launch, Part, Scratch, decode, format_refusal,
                                     names, qblock, reach, weight_bytes)
from lanefuse.kernels.quant import QuantEpilogue
from lanefuse.engine.refusal import Refusal

WARPS = 4  # warps a block: one output each (of ROWS_A_WARP rows of x in head_gemv_rows)
ROWS_A_WARP = 8  # head_gemv.cu's HEAD_ROWS: head_gemv_rows reads each value of w once for this many rows of x

# What the loop runs at (the lane's price, `rate`; issue 35 H5). The loop (head_gemv.cu) keeps one value a lane of w in
# flight (64 bytes of bf16; nvcc 13's PTX for sm_90: one load of w an iteration behind the format's switch, beside the
# rows' loads of x) and makes ceil(a / 32) dependent rounds; ptxas (nvcc 13 -arch=sm_90 -Xptxas -v): head_gemv 32
# registers and 1028 B of shared memory (16 blocks of 4 warps a SM), head_gemv_rows 56 (9 blocks). Every row of x
# (head_gemv), or every ROWS_A_WARP rows (head_gemv_rows), re-reads all the heads' matrices, from L2 once the first
# pass has brought them there if they fit. The rounds'
# latencies are the lane's knobs hbm_round_us and l2_round_us (lane/lower/knobs.py: bench/launch_model_calibration.json's
# L_us 2.02 and L_l2_us 0.65, fitted on the 2026-12-04 H200 figures of the GEMV family's loop, not measured on this
# kernel). PREDICTIONS, not measured.
RESIDENT_BLOCKS = 16  # head_gemv's blocks a SM (32 registers)
RESIDENT_BLOCKS_ROWS = 9  # head_gemv_rows' (56 registers)
L2_SHARE = 0.5  # the matrices stay in L2 between rows when they take at most this share of it (knob l2_mib)


@dataclass(frozen=True)
class HeadGemv(QuantEpilogue, Launch):
    x: str
    w: str
    format: str
    y: Dst
    m: int  # rows
    heads: int
    a: int  # a head's input values
    b: int  # a head's output values
    rows_out: bool = True
    quant: str | None = None  # the output's quantized form, written by the last blocks (the q8 numerics)
    words: int = 0  # its int8 words a value (q8 1, q8x2 2, the q8k form 3)
    upto: str | None = None  # a position: only the rows below min(m, upto[0] + extra) computed (a cache's filled rows)
    extra: int = 0
    part: Part | None = None  # x read in parts: head h of row r's a values at (r·heads + h)·pitch + offset

    census: ClassVar[str] = "head_gemv"
    stem: ClassVar[tuple[str, ...]] = ("quant", "head_gemv")

    def __post_init__(self):
        if self.rows_out in (0, 1) and not isinstance(self.rows_out, bool):  # a flag through the e-graph: 0 / 1
            object.__setattr__(self, "rows_out", bool(self.rows_out))

    def reads(self):
        return names(self.x, self.w, self.upto, *self.y.params())

    def writes(self):
        return names(self.y.buf, self.quant)

    def scratch(self):
        if self.quant is None:
            return ()
        return (Scratch("arrivals", "i32", 4 * (self.m * self.heads * self.b // qblock(self.words)), counter=True),)

    def check(self):
        if self.upto is not None and self.quant is not None:
            return Refusal("a per-head product over a cache's filled rows that quantizes its output")
        if self.quant is not None:
            why = self.epilogue_refusal(self.heads * self.b, "a per-head product's output row")
            if why:
                return why
            if self.y != Dst(self.y.buf):
                return Refusal("a per-head product quantizing an output it writes into a table's rows")
        if self.part is not None and (self.part.width != self.a or self.part.offset + self.a > self.part.pitch):
            return Refusal(f"a per-head product reading {self.part.width} values at offset {self.part.offset} of every "
                           f"{self.part.pitch} as a head's {self.a}")
        if min(self.m, self.heads, self.a, self.b) < 1:
            return Refusal(f"a per-head product of no values ({self.m} rows, {self.heads} heads, {self.a} to {self.b})")
        cols = self.a if self.rows_out else self.b
        why = format_refusal(self.format, cols, "the per-head product")
        if why:
            return why
        if -(-self.m * self.heads * self.b // WARPS) > (1 << 31) - 1 or self.m > MAX_GRID_Y * 1024:
            return Refusal(f"a per-head product of {self.m * self.heads * self.b} outputs (one grid row of blocks)")
        return None

    def extents(self, top, tokens):
        n = self.m * self.heads
        return reach((self.x, self.part.extent(n) if self.part else n * self.a), (self.w, self.heads * self.a * self.b),
                     (self.y.buf, self.y.extent(n * self.b, top)), (self.quant, n * self.b), (self.upto, 1))

    def weights(self):
        return {self.w: self.format}

    def _rows(self) -> tuple[int, int]:
        h = self.heads
        return (h * self.b, self.a) if self.rows_out else (h * self.a, self.b)

    def checkpoint_bytes(self):
        return weight_bytes(self.format, *self._rows())

    def bytes(self):
        return (self.checkpoint_bytes() + 4 * self.m * self.heads * (self.a + self.b)
                + self.epilogue_bytes(self.m * self.heads * self.b))

    def flops(self):
        return 2 * self.m * self.heads * self.a * self.b

    def loop_us(self, knobs) -> float:
        """The loop's time as it runs (latency-bound: a round's loads a warp, RESIDENT_BLOCKS a SM): the warps of the
        m rows (rows_a_warp rows each) in waves of sms x RESIDENT_BLOCKS x WARPS, ceil(a / 32) rounds a wave; the first
        rows' waves at an HBM round (knob hbm_round_us), the later ones' at an L2 round (l2_round_us) where the
        matrices fit L2_SHARE of it (else every round from HBM). With `upto`
        the plan does not know the position: all m rows (the cache's), as the attention prices its keys. A partial
        wave takes a whole wave's rounds (latency, not bytes)."""
        per_wave = knobs.sms * (RESIDENT_BLOCKS if self.rows_a_warp() == 1 else RESIDENT_BLOCKS_ROWS) * WARPS
        rounds = -(-self.a // 32)
        waves = -(-self.warps() // per_wave)
        first = min(waves, -(-self.heads * self.b // per_wave))
        fits = self.checkpoint_bytes() <= L2_SHARE * knobs.l2_mib * 2 ** 20
        hbm, l2 = knobs.hbm_round_us, knobs.l2_round_us
        return rounds * (first * hbm + (waves - first) * (l2 if fits else hbm))

    def rate(self, knobs) -> float:
        """The lane's rate of its flops (TFLOP/s; lane/lower/shim.launch_us divides the flops by it): what loop_us
        leaves, at most the CUDA cores' peak (knob tflops_f32)."""
        flops = self.flops()
        return flops / max(self.loop_us(knobs), flops / (knobs.tflops_f32 * 1e6)) / 1e6

    def _stack(self, w: np.ndarray) -> np.ndarray:
        """The heads' matrices as (heads, a, b)."""
        h, a, b = self.heads, self.a, self.b
        return w.reshape(h, b, a).transpose(0, 2, 1) if self.rows_out else w.reshape(h, a, b)

    def filled(self, env) -> int:
        """The rows computed: all m, or (upto) those below min(m, upto[0] + extra)."""
        if self.upto is None:
            return self.m
        return min(self.m, max(0, int(env.array(self.upto)[0]) + self.extra))

    def _x(self, env, m: int) -> np.ndarray:
        """Rows 0..m-1 of x as (m, heads, a): whole, or each head's part of a wider row."""
        flat = env.array(self.x)
        if self.part is None:
            return flat[: m * self.heads * self.a].reshape(m, self.heads, self.a)
        return flat[self.part.indices(m * self.heads)].reshape(m, self.heads, self.a)

    def numpy(self, env):
        """As the kernel sums: each output's dot in f64, rounded to f32 (the filled rows)."""
        raw, fmt = env.weight(self.w)
        w = self._stack(decode(raw, fmt).astype(np.float64))
        m = self.filled(env)
        x = self._x(env, m)
        y = np.einsum("rha,hab->rhb", x.astype(np.float64), w).astype(np.float32)
        self.y.write(env, y.reshape(m, self.heads * self.b))
        self.epilogue_write(env, y)  # from the f32 values stored, as the last blocks read them back

    def fast(self, env):
        w = self._stack(env.matrix(self.w))
        m = self.filled(env)
        x = self._x(env, m)
        y = np.matmul(x.transpose(1, 0, 2), w).transpose(1, 0, 2)  # (m, heads, b) in f32
        if not (y.max() < np.inf and y.min() > -np.inf):  # NaN fails both: f32 overflowed where f64 may not
            with np.errstate(over="ignore", invalid="ignore"):
                y = np.einsum("rha,hab->rhb", x.astype(np.float64), w.astype(np.float64)).astype(np.float32)
        y = np.ascontiguousarray(y).reshape(m, self.heads * self.b)
        self.y.write(env, y)
        self.epilogue_write(env, y)

    def warps(self) -> int:
        """The launch's warps: one an output of each rows_a_warp rows of x."""
        return -(-self.m // self.rows_a_warp()) * self.heads * self.b

    def rows_a_warp(self) -> int:
        """The rows of x a warp takes: ROWS_A_WARP (head_gemv_rows), or 1 (head_gemv) for a single row or under
        `quant` (the quantizing tail counts each block's outputs as consecutive)."""
        return 1 if self.quant is not None or self.m == 1 else ROWS_A_WARP

    def grid_block(self):
        return ((-(-self.warps() // WARPS), 1, 1), (32 * WARPS, 1, 1))

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import NULL, i64

        grid, block = self.grid_block()
        counters = denv.scratch(self, self.scratch()[0]) if self.quant is not None else NULL
        head = (denv.array(self.x), denv.weight(self.w)[0], i64(FORMAT_CODE[self.format]), *denv.dst(self.y),
                i64(self.m), i64(self.heads), i64(self.a), i64(self.b), i64(int(self.rows_out)))
        tail = (denv.opt(self.upto), i64(self.extra), i64(self.part.pitch if self.part else self.a),
                i64(self.part.offset if self.part else 0))
        if self.rows_a_warp() > 1:  # head_gemv_rows: no quantizing tail
            denv.function(self.stem, "head_gemv_rows")(grid, block, head + tail)
            return
        denv.function(self.stem, "head_gemv")(grid, block, head + (counters, *self.epilogue_args(denv)) + tail)
