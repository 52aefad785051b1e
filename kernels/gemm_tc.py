"""`gemm_tc`: y (m, n) = x (m, k) · wᵀ (+ bias (n,)) (+ add (m, n)) on the tensor cores (gemm_tc.cu), the product of
many rows (a prompt's chunk, a batch) under the bf16 numerics: x and w each rounded to bf16 (to nearest, ties to
even), their products summed in f32. w is checkpoint rows (n, k) in any format (a block format decoded a tile at a
time); x is rounded once into scratch by a first kernel.

The numerics: a product of two bf16 values is exact in f32, so the twin's only departure from the kernel is the order
of the sums: the twin sums each output's k products exactly (f64, every product and partial sum of bf16 operands
with k <= 2^29 is exact there) and rounds once to f32; the kernel adds them into an f32 accumulator 16 at a time
(mma.sync's k-step, whose own internal order and rounding the PTX ISA leaves to the hardware). Each f32 addition
errs by at most half an ulp of its partial sum, so |y - twin| <= TC_ERROR_STEPS(k) · 2^-24 · Σ|x̂ ŵ| (x̂, ŵ the
rounded operands), which `tc_bound` gives and the tests hold the kernel to (before the bias and the added rows, which
both sides add in the same f32 order)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import (FORMAT_CODE, MAX_GRID_Y, Dst, Launch, Scratch, at_call, decode, dst_at,
                                     format_refusal, names, operand, reach, weight_bytes)
from lanefuse.kernels.gemm_parts import GemmPart, InParts
from lanefuse.kernels.gemv import RowsProduct
from lanefuse.kernels.gemv_glu import GateUp

BM, BN, BK = 128, 128, 32  # a block's tile of y (rows, outputs) and its k step (gemm_tc.cu's BM, TC_BN, TC_BK)
SMALL_BM = 64  # the rows of a tile for a product of at most this many rows (a batch): the *_64 kernels
THREADS = 256  # eight warps, each BM/2 x 32 of the tile (gemm_tc_any*, the *_64 kernels)
CP_THREADS = 128  # gemm_tc_cp, _parts_cp, _split_cp (bf16 rows, 128-row tiles): four warps of 64 x 64
STAGES = 3  # gemm_tc.cu's TC_STAGES: the shared-memory stages of the bf16 rows' kernels (the decoded formats: 2)


def block_threads(copied: bool, m: int) -> int:
    """The threads of a block of the kernel for a product of m rows whose w is copied to shared memory as it is
    (bf16 rows of whole 16-byte chunks) or not: 128 for the copied rows' 128-row tiles, else 256."""
    return CP_THREADS if copied and block_rows(m) == BM else THREADS


def block_rows(m: int) -> int:
    """The rows of a block's tile for a product of m rows: 64 up to 64 rows (half the padded mma work of a batch of
    16..64), else 128."""
    return SMALL_BM if m <= SMALL_BM else BM


def suffix(m: int) -> str:
    return "_64" if block_rows(m) == SMALL_BM else ""
BLOCKS_AN_SM = 2  # gemm_tc blocks an SM holds (ptxas sm_90: 128 registers x 256 threads and 32 KB shared, or
# 128 threads at <= 255 registers and 48 KB: the registers bind at two either way)
MAX_KSPLIT = 8  # the most parts the `tail` splits k into
MIN_STEPS = 4  # k steps (of BK) a part takes at least


def tail_us(m: int, n: int, k: int, ksplit: int, sms: int, tflops: float, gbps: float, launch_us: float) -> float:
    """The predicted µs of a product's tiles run as `ksplit` parts along k (1: unsplit), and of the combine that adds
    the parts: bench/gemm_model.py's assumptions — an SM's mma rate tflops/sms is shared by the blocks it holds, and a
    block alone on an SM reaches half of it (one block's eight warps do not keep the tensor cores busy: two an SM
    do), so a wave of blocks lasts its k steps at half an SM's rate; the combine streams (ksplit + 1) f32 (m, n)
    arrays over HBM and pays a launch."""
    bm = block_rows(m)
    tiles = -(-m // bm) * -(-n // BN)
    steps = -(-kp(k) // BK)
    waves = -(-tiles * ksplit // (sms * BLOCKS_AN_SM))
    step_us = 2 * bm * BN * BK / (tflops * 1e12 / sms / 2) * 1e6
    us = waves * -(-steps // ksplit) * step_us
    if ksplit > 1:
        us += launch_us + 4 * m * n * (ksplit + 1) / (gbps * 1e9) * 1e6
    return us


def tail_split(m: int, n: int, k: int, sms: int, tflops: float, gbps: float, launch_us: float) -> int:
    """The seed's `tail`: how many parts along k a product's tiles run in — 1 unless its tiles fill less than one
    wave (sms x BLOCKS_AN_SM blocks), then the count (each part at least MIN_STEPS k steps, at most MAX_KSPLIT, the
    blocks within one wave) that `tail_us` predicts fastest, where that beats the unsplit product."""
    tiles = -(-m // block_rows(m)) * -(-n // BN)
    slots = sms * BLOCKS_AN_SM
    steps = -(-kp(k) // BK)
    if tiles >= slots:
        return 1
    best, best_us = 1, tail_us(m, n, k, 1, sms, tflops, gbps, launch_us)
    for s in range(2, MAX_KSPLIT + 1):
        if tiles * s > slots or steps < MIN_STEPS * s:
            break
        us = tail_us(m, n, k, s, sms, tflops, gbps, launch_us)
        if us < best_us:
            best, best_us = s, us
    return best


TC_FORMATS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q6_k", "mxfp4")  # gemm_tc.cu's tc_get
# What a thread spends decoding one value of block-format rows to bf16, in instructions (bench/decode_ptx.py: the PTX
# of nvcc 13 for sm_90, an upper-bound proxy of the SASS ptxas issues): (gemm_tc_any's tc_load_w, a value at a time
# by tc_get, for every tile of rows that reads it; gemm_tc_dequant's, kernels/gemm_deq.py, four values a qget4)
DECODE_INSTR = {"q8_0": (28.2, 16.0), "q4_0": (33.3, 19.8), "q4_k": (70.3, 29.8), "q6_k": (61.3, 30.1),
                "mxfp4": (71.3, 43.2)}
ISSUE_PER_CLK = 4  # warp instructions an SM issues a clock (four schedulers)
CLOCK_GHZ = 1.75  # the SMs' clock the decode's issue is priced at (an assumption, bench/gemm_model.py's)


def decode_us(values: int, per_value: float, sms: int) -> float:
    """µs to issue `per_value` instructions a thread for each of `values` (a lane a value) over `sms` SMs: a decode's
    bound by instruction issue."""
    return values * per_value / 32 / (sms * ISSUE_PER_CLK * CLOCK_GHZ * 1e3)


# The tensor-core kernels' waves: what a k step of an SM costs and how a launch's tiles fill the SMs' block slots.
# bench/gemm_model.py prints these figures (its docstring states each assumption) and the lane prices gemm_tc,
# gemm_tc_parts and gemm_tc_glu by them (TcProduct.rate): one arithmetic for both. ASSUMED rates, not measured:
MMA_SYNC_TFLOPS = 660.0  # mma.sync m16n8k16 bf16 (f32 sums) over the H200's 132 SMs, fed (two thirds of wgmma's 989)
MMA_SMS = 132  # the SMs that rate is over (an SM's share is the chip's; the knob sms counts the slots)
SMEM_BYTES_PER_CLK = 128  # shared memory a clock an SM
LATENCY_US = 0.6  # a cp.async's round trip under load
EFFICIENCY = 0.85  # the barriers, address arithmetic and epilogue no bound counts
# The kernels a product runs, by (kernel set, a product of at most 64 rows): rows of a block's tile, warps, each warp's
# 16-row fragments (mi) and 8-output fragments (nj), cp.async stages, blocks an SM holds (ptxas sm_90). "now": the
# bf16 rows' gemm_tc_cp (240 registers, 48 KB) / _64 (80-118, 36 KB); "before": 0f140e5's (two stages, eight warps
# of 64 x 32); "any": gemm_tc_any / _64 (rows that are not bf16, decoded a value at a time into registers).
KERNELS = {
    ("now", False): dict(bm=128, warps=4, mi=4, nj=8, stages=3, blocks=2),
    ("now", True): dict(bm=64, warps=8, mi=2, nj=4, stages=3, blocks=2),
    ("before", False): dict(bm=128, warps=8, mi=4, nj=4, stages=2, blocks=2),
    ("before", True): dict(bm=64, warps=8, mi=2, nj=4, stages=2, blocks=2),
    ("any", False): dict(bm=128, warps=8, mi=4, nj=4, stages=2, blocks=2),
    ("any", True): dict(bm=64, warps=8, mi=2, nj=4, stages=2, blocks=2),
}


def step_us(kern: dict, b: int, decode: float = 0.0) -> tuple[float, str]:
    """A k step of an SM holding b blocks of `kern` (all its blocks' step done): the µs and what bounds it — the
    tensor cores (a lone block at half an SM's rate), shared memory (every warp's ldmatrix.x4 and the stage's
    cp.async), the copies' latency over stages - 1 steps, or `decode` instructions a thread for each value of w's
    tile (gemm_tc_any over a block format; issued beside the rest: an optimistic overlap), over EFFICIENCY."""
    flops = 2 * kern["bm"] * BN * BK
    ldsm = kern["warps"] * (BK // 16) * (kern["mi"] + kern["nj"] // 2) * 512
    smem = ldsm + (kern["bm"] + BN) * BK * 2
    mma = max(b, 2) * flops / (MMA_SYNC_TFLOPS * 1e12 / MMA_SMS) * 1e6
    shared = b * smem / (SMEM_BYTES_PER_CLK * CLOCK_GHZ * 1e9) * 1e6
    latency = LATENCY_US / (kern["stages"] - 1)
    issue = decode_us(b * BN * BK, decode, 1)
    us, bound = max((mma, "mma"), (shared, "smem"), (latency, "latency"), (issue, "decode"))
    return us / EFFICIENCY, bound


def tc_kernel(m: int, fmt: str, kernel: str = "now") -> tuple[dict, float]:
    """The kernel (KERNELS' entry) a product of m rows in `fmt` runs and its decode instructions a value: bf16 rows
    gemm_tc_cp*, a block format gemm_tc_any* (DECODE_INSTR's first figure); `kernel` "before" (0f140e5's) or
    "tiles" (not built: a block format decoded into shared memory a tile at a time, DECODE_INSTR's second figure,
    inside gemm_tc_cp's pipeline)."""
    dec = DECODE_INSTR.get(fmt)
    small = m <= SMALL_BM
    if dec and kernel == "tiles":
        return KERNELS[("now", small)], dec[1]
    if dec and kernel == "now":
        return KERNELS[("any", small)], dec[0]
    return KERNELS[("now" if kernel == "tiles" else kernel, small)], 0.0


def tc_waves(m: int, ns, k: int, ksplit: int = 1, fmt: str = "bf16", sms: int = MMA_SMS,
             kernel: str = "now") -> dict:
    """A tensor-core launch's tiles of x (m, k) · w (n, k)ᵀ for each n of `ns` (the parts of gemm_tc_parts, each its
    own tiles; gemm_tc_glu: one n of 2n), each tile `ksplit` blocks along k, over `sms` SMs of BLOCKS an SM: its
    tiles, waves, wave fill, and the µs its waves take on the SMs (each wave's SMs hold b = ceil(blocks in it / sms)
    blocks, so a last partial wave runs at its own b; a lone block at half the rate), with what bounds them."""
    kern, decode = tc_kernel(m, fmt, kernel)
    tiles = -(-m // kern["bm"]) * sum(-(-n // BN) for n in ns)
    slots = sms * kern["blocks"]
    blocks = tiles * ksplit
    waves = -(-blocks // slots)
    steps = -(-(-(-kp(k) // BK)) // ksplit)  # a block's k steps (edges padded, as it runs)
    compute_us, bounds = 0.0, {}
    for wv in range(waves):
        b = min(kern["blocks"], -(-min(slots, blocks - wv * slots) // sms))
        us, bound = step_us(kern, b, decode)
        compute_us += steps * us
        bounds[bound] = bounds.get(bound, 0.0) + steps * us
    return {"tiles": tiles, "waves": waves, "wave_fill": blocks / (waves * slots), "compute_us": compute_us,
            "bound": max(bounds, key=bounds.get)}


# The fewest rows of x the knob tc_rows sends to the tensor cores; fewer run as GEMVs. The kernels take any m (a tile
# of 64 rows pads them; cuBLAS any m): one or two rows of x a GEMV streams at the copy bandwidth by 16-byte loads
# (gemv_core.cu gemv_tile16), a slab of 3-8 four values a lane a step, one step in flight (gemv_tile_any), which
# bench/launch_model.py predicts 2-4x slower than these forms (bench/batch_curve.py: a Qwen3-8B-shaped decode of 8
# sequences 26237 µs a step as GEMV slabs, 10911 here, at t0 10.3 µs a launch; 1 sequence 4566)
MIN_ROWS = 3


def bf16_round(a: np.ndarray) -> np.ndarray:
    """f32 values rounded to the nearest bf16 (ties to even; a NaN stays NaN), as f32: gemm_tc.cu's bf16_rn."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    r = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        r = np.where(nan, ((u >> 16) | 0x40) << 16, r).astype(np.uint32)
    return r.view(np.float32)


def kp(k: int) -> int:
    """The bf16 values a row of x's rounded copy holds: k rounded up to whole 16-byte chunks (8 values)."""
    return -(-k // 8) * 8


def tc_products(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (m, k) · w (n, k)ᵀ under the bf16 numerics, summed exactly and rounded once to f32 (see the module's note)."""
    xb, wb = bf16_round(x).astype(np.float64), bf16_round(w).astype(np.float64)
    return (xb @ wb.T).astype(np.float32)


def tc_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The most the kernel's sums of x (m, k) · w (n, k)ᵀ may differ from `tc_products`, output by output: k
    additions in f32 (at most k roundings of a partial sum no larger than Σ|x̂ ŵ|, each half an ulp: 2^-24 of it),
    plus the final rounding's half ulp, doubled for the accumulator's own order inside an mma."""
    k = x.shape[1]
    mag = np.abs(bf16_round(x)).astype(np.float64) @ np.abs(bf16_round(w)).astype(np.float64).T
    return 2.0 * (k + 1) * 2.0**-24 * mag + np.finfo(np.float32).tiny


_ROUNDED: dict[int, np.ndarray] = {}


def rounded_rows(w: np.ndarray) -> np.ndarray:
    """Decoded rows `w` rounded to bf16, once for each array (bf16 checkpoints round to themselves: no copy)."""
    got = _ROUNDED.get(id(w))
    if got is None:
        got = bf16_round(w)
        if np.array_equal(got.view(np.uint32), np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)):
            got = w
        _ROUNDED[id(w)] = got
        weakref.finalize(w, _ROUNDED.pop, id(w), None)
    return got


# The `cublas` step's choice (kernels/gemm_blas.py's `prefer`, which registers itself here when the kinds are imported:
# the cuBLAS forms build on these kinds, so this module cannot import that one).
BLAS_FORMS: list = []


class TcProduct(Launch):
    """What the tensor-core products share (GemmTc, GemmTcParts, GemmTcGlu; each declares x, format, k and m among
    its fields): x (m, k) rounded to bf16 once into scratch by a first kernel (gemm_tc_round), w's rows copied to
    shared memory as they are where they are bf16 of whole 16-byte chunks, and the tiles of 64 or 128 rows of the
    product's kernel."""

    stem: ClassVar[tuple[str, ...]] = ("gemm_tc",)
    tensor_cores: ClassVar[bool] = True  # on the tensor cores (its price: `rate`, by its waves)
    steps: ClassVar[tuple[str, ...]] = ("cublas", "dequant")  # held: never the cuBLAS form (kernels/gemm_blas.py);
    # never block-format rows decoded to bf16 for it (kernels/gemm_deq.py)

    def tune(self, knobs, held=frozenset()):
        """`cublas`: the product through cuBLAS (kernels/gemm_blas.py; block-format rows decoded to bf16 first,
        kernels/gemm_deq.py, unless `dequant` is held) where the lane prices it cheaper; held, this kernel."""
        if "cublas" in held or not BLAS_FORMS:
            return self
        return BLAS_FORMS[0](self, knobs, held)

    def device_launches(self) -> int:
        """The kernel launches it makes, each a launch gap in the lane's price: x rounded, the product, the tail's
        combine where k is split (kernels/gemm_blas.py's forms: each cuBLAS call and epilogue)."""
        return 2 + (getattr(self, "ksplit", 1) > 1)

    def call_us(self, knobs) -> float:
        """A fixed cost beyond its launch gaps (the cuBLAS forms' calls': kernels/gemm_blas.py); none."""
        return 0.0

    def outputs_tc(self) -> list[int]:
        """The outputs of each part of the launch's grid of tiles (GemmTc: n; gemm_tc_parts: each part's; the GLU:
        the gate's and the up's 2n)."""
        raise NotImplementedError

    def rate(self, knobs) -> float:
        """TFLOP/s the lane prices its flops at: its flops over the time `tc_waves` gives its tiles' waves on
        knob sms SMs — the wave fill, a lone block's half rate, shared memory, the copies' latency and a block
        format's decode, as bench/gemm_model.py predicts it (kernels/gemm_blas.py's cuBLAS forms: their own)."""
        w = tc_waves(self.m, self.outputs_tc(), self.k, getattr(self, "ksplit", 1), self.format, knobs.sms)
        return self.flops() / (w["compute_us"] * 1e6)

    def rounded_x(self) -> Scratch:
        """x rounded to bf16, rows of kp values: the first scratch of every tensor-core product."""
        return Scratch("xb", "u8", 2 * self.m * kp(self.k))

    def x_bytes(self) -> int:
        """The bytes of x: read in f32, its rounded copy written and read back."""
        return 4 * self.m * self.k + 2 * 2 * self.m * kp(self.k)

    def copied(self) -> bool:
        """w copied to shared memory as it is (bf16 rows of whole 16-byte chunks): the *_cp kernels."""
        return self.format == "bf16" and self.k % 8 == 0

    def block(self) -> tuple[int, int, int]:
        return (block_threads(self.copied(), self.m), 1, 1)

    def row_tiles(self) -> int:
        """The tiles of rows of the product's grid (y)."""
        return -(-self.m // block_rows(self.m))

    def fast(self, env):
        self.bind_fast(env)()

    def round_x(self, denv):
        """The first kernel: x rounded into its scratch (gemm_tc_round), which it gives back for the product's."""
        from lanefuse.kernels.cupy_env import i64

        xb = denv.scratch(self, self.scratch()[0])
        pairs = self.m * kp(self.k) // 2
        r = denv.function(self.stem, "gemm_tc_round")
        r((min(4096, -(-pairs // 256)),), (256,), (denv.array(self.x), xb, i64(self.m), i64(self.k), i64(kp(self.k))))
        return xb


@dataclass(frozen=True)
class GemmTc(TcProduct, RowsProduct):
    """y (m, n) = x (m, k) · wᵀ (+ bias) (+ add: an (m, n) array, the residual) under the bf16 numerics, w checkpoint
    rows (n, k) in `format`. Two kernels: x rounded into scratch, then the product a 128 x 128 tile of y a block."""

    add: str | None = None
    ksplit: int = 1  # the seed's `tail`: k in this many parts (a product of less than one wave of tiles), combined

    census: ClassVar[str] = "gemm_tc"
    steps: ClassVar[tuple[str, ...]] = ("split_k", "cublas", "dequant")  # held: no tail split; never the cuBLAS
    # form; never block-format rows decoded for it

    def reads(self):
        return names(self.x, self.w, self.bias, self.add, *self.y.params())

    def writes(self):
        return (self.y.buf,)

    def scratch(self):
        xb = self.rounded_x()
        if self.ksplit == 1:
            return (xb,)
        return (xb, Scratch("parts", "f32", 4 * self.ksplit * self.m * self.n))

    def tune(self, knobs, held=frozenset()):
        """`split_k`: the tail split along k where `tail_split` predicts it pays (a product whose tiles fill less
        than one wave of the chip); held, one part. Then `cublas` (TcProduct.tune)."""
        if "split_k" in held:
            tc = replace(self, ksplit=1)
        else:
            tc = replace(self, ksplit=tail_split(self.m, self.n, self.k, knobs.sms, knobs.tflops_tc, knobs.hbm_gbps,
                                                 knobs.launch_us))
        return TcProduct.tune(tc, knobs, held)

    def check(self):
        if min(self.k, self.n, self.m) < 1:
            return Refusal(f"a product of no values ({self.m} rows, k {self.k}, n {self.n})")
        why = format_refusal(self.format, self.k, "the tensor-core GEMM")
        if why:
            return why
        if self.format not in TC_FORMATS:
            return Refusal(f"rows in {self.format} (the tensor-core GEMM reads {', '.join(TC_FORMATS)})")
        if self.row_tiles() > MAX_GRID_Y:
            return Refusal(f"a product of {self.m} rows (a launch takes at most {MAX_GRID_Y} tiles of {BM} rows)")
        if self.add is not None and self.add == self.y.buf and self.y != Dst(self.y.buf):
            return Refusal("a residual added in place into rows of a table or parts of a wider array")
        if not 1 <= self.ksplit <= MAX_KSPLIT or (self.ksplit > 1 and -(-kp(self.k) // BK) < self.ksplit):
            return Refusal(f"a product of k {self.k} in {self.ksplit} parts along k (1..{MAX_KSPLIT}, each at least "
                           f"one step of {BK})")
        return None

    def extents(self, top, tokens):
        return reach((self.x, self.m * self.k), (self.w, self.n * self.k), (self.bias, self.n),
                     (self.add, self.m * self.n), (self.y.buf, self.y.extent(self.m * self.n, top)))

    def weights(self):
        return {self.w: self.format, **({self.bias: None} if self.bias else {})}

    def checkpoint_bytes(self):
        return weight_bytes(self.format, self.n, self.k)

    def bytes(self):
        return (self.checkpoint_bytes() + self.x_bytes() + 4 * self.m * self.n
                + (4 * self.n if self.bias else 0) + (4 * self.m * self.n if self.add else 0)
                + (8 * self.ksplit * self.m * self.n if self.ksplit > 1 else 0))  # the parts written and read back

    def flops(self):
        return 2 * self.m * self.n * self.k

    def outputs_tc(self):
        return [self.n]

    def finish(self, env, acc: np.ndarray) -> np.ndarray:
        """The epilogue in the kernel's order: the bias, then the added rows, each one f32 rounding."""
        if self.bias is not None:
            acc = (acc + operand(env, self.bias)[: self.n][None, :]).astype(np.float32)
        if self.add is not None:
            acc = (acc + env.array(self.add)[: self.m * self.n].reshape(self.m, self.n)).astype(np.float32)
        return acc

    def numpy(self, env):
        raw, fmt = env.weight(self.w)
        x = env.array(self.x)[: self.m * self.k].reshape(self.m, self.k)
        acc = tc_products(x, decode(raw, fmt).reshape(self.n, self.k))
        self.y.write(env, self.finish(env, acc))

    def bind_fast(self, env):
        """The fast twin: the rounded operands multiplied by f32 BLAS (its own sum order: within the bound of the
        exact twin), w rounded once."""
        m, n, k = self.m, self.n, self.k
        view = dst_at(self.y, env, m, n) if self.add is None else None  # added rows: y may be the residual
        x = env.array(self.x)[: m * k].reshape(m, k)
        fixed = None if env.stream else rounded_rows(env.matrix(self.w).reshape(n, k)).T  # rounded once

        def call():
            w = fixed if fixed is not None else rounded_rows(env.matrix(self.w).reshape(n, k)).T
            out = at_call(view) if view is not None else np.empty((m, n), np.float32)
            np.matmul(bf16_round(x), w, out=out)
            if not (out.max() < np.inf and out.min() > -np.inf):  # NaN fails both: f32 overflowed where f64 may not
                with np.errstate(over="ignore", invalid="ignore"):
                    out[...] = tc_products(x, env.matrix(self.w).reshape(n, k))  # as the exact twin has it
            if self.bias is not None or self.add is not None:
                out[...] = self.finish(env, out)
            if view is None:
                self.y.write(env, out)

        return call

    def grid_block(self):
        return (-(-self.n // BN), self.row_tiles(), self.ksplit), self.block()

    def kernel_name(self) -> str:
        """gemm_tc_cp (bf16 rows of whole 16-byte chunks, copied to shared memory as they are) or gemm_tc_any; _64
        for a product of at most 64 rows (tiles of 64 rows)."""
        base = "gemm_tc_cp" if self.copied() else "gemm_tc_any"
        return base + suffix(self.m)

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import NULL, i64

        xb = self.round_x(denv)
        g, b = self.grid_block()
        if self.ksplit > 1:  # the tail: each tile's k in parts into scratch, then added in order
            parts = denv.scratch(self, self.scratch()[1])
            f = denv.function(self.stem, self.kernel_name().replace("gemm_tc_", "gemm_tc_split_"))
            f(g, b, (xb, denv.weight(self.w)[0], i64(FORMAT_CODE[self.format]), parts, i64(self.ksplit),
                     i64(self.k), i64(self.n), i64(self.m)))
            c = denv.function(self.stem, "gemm_tc_combine")
            c((min(4096, -(-self.m * self.n // 256)),), (256,), (parts, i64(self.ksplit), denv.opt(self.bias),
                                                                denv.array(self.add) if self.add else NULL,
                                                                *denv.dst(self.y), i64(self.n), i64(self.m)))
            return
        f = denv.function(self.stem, self.kernel_name())
        f(g, b, (xb, denv.weight(self.w)[0], i64(FORMAT_CODE[self.format]), denv.opt(self.bias),
                 denv.array(self.add) if self.add else NULL, *denv.dst(self.y), i64(self.k), i64(self.n),
                 i64(self.m)))


@dataclass(frozen=True)
class GemmTcParts(InParts, TcProduct):
    """Several products of one activation in one launch under the bf16 numerics (q, k and v; gate and up): each part
    its weight (checkpoint rows (n, k), one format for all), bias, n and destination (kernels/gemm_parts.py's
    GemmPart), its own ceil(n / 128) tiles of outputs; x rounded once for all."""

    x: str
    format: str
    k: int
    m: int
    parts: tuple[GemmPart, ...]

    census: ClassVar[str] = "gemm_tc_parts"

    def blocks(self) -> list[int]:
        """Each part's tiles of outputs."""
        return [-(-p.n // BN) for p in self.parts]

    def outputs_tc(self):
        return [p.n for p in self.parts]

    def one(self, p: GemmPart) -> GemmTc:
        """Part `p` as a launch of its own (the twins run each so)."""
        return GemmTc(self.x, p.w, self.format, p.y, self.k, p.n, self.m, bias=p.bias)

    def scratch(self):
        return (self.rounded_x(),)

    def check(self):
        if not self.parts:
            return Refusal("a product in no parts")
        for p in self.parts:
            why = self.one(p).check()
            if why:
                return why
        if sum(self.blocks()) > 2**31 - 1:
            return Refusal(f"products in parts of {self.outputs()} outputs (too many tiles)")
        return None

    def bytes(self):
        return self.checkpoint_bytes() + self.x_bytes() + 4 * self.m * self.outputs()

    def numpy(self, env):
        for p in self.parts:
            self.one(p).numpy(env)

    def bind_fast(self, env):
        calls = [self.one(p).bind_fast(env) for p in self.parts]

        def call():
            for c in calls:
                c()

        return call

    def grid_block(self):
        return (sum(self.blocks()), self.row_tiles(), 1), self.block()

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import i64

        xb = self.round_x(denv)
        g, b = self.grid_block()
        t = denv.table(self.key(), self.table(denv))
        name = ("gemm_tc_parts_cp" if self.copied() else "gemm_tc_parts_any") + suffix(self.m)
        denv.function(self.stem, name)(g, b, (xb, t, i64(len(self.parts)), i64(FORMAT_CODE[self.format]),
                                              i64(self.k), i64(self.m)))


GLU_BN = BN // 2  # gemm_tc_glu: a block's outputs (the gate's and the up's rows of each, 128 product columns)


@dataclass(frozen=True)
class GemmTcGlu(TcProduct, GateUp):
    """The gate and up products of one activation and their GLU on the tensor cores, under the bf16 numerics: out
    (m, n) = (x · wuᵀ) · act(x · wgᵀ), wg and wu checkpoint rows (n, k) in one format — rules/lanes/cuda.yaml's
    gemv_gate_up_glu where the product has tc_rows rows (GemvGlu's fields). A block computes 64 outputs of both
    products and multiplies them in its epilogue, so neither (m, n) product is written; x rounded once. The twin: each
    product as GemmTc's exact twin, then act and the product in f32 as Binary's `mul` with a gate (the unfused plan's
    two launches, to the bit)."""

    format_u: str | None = None  # the up weights' format where the lane says it: the kernel reads both in `format`
    words: int = 0  # a quantized activation: refused (the tensor cores read x in f32, rounded to bf16)
    quant: str | None = None  # a quantized GLU: refused
    quant_words: int = 0
    f32: bool = True

    census: ClassVar[str] = "gemm_tc_glu"

    def reads(self):
        return names(self.x, self.wg, self.wu)

    def writes(self):
        return (self.out,)

    def scratch(self):
        return (self.rounded_x(),)

    def check(self):
        from lanefuse.kernels.common import ACTS

        if self.words or self.quant is not None or not self.f32:
            return Refusal("a quantized activation or GLU on the tensor cores (they read and write f32, bf16 "
                           "operands): the gate/up product's GLU quantizes in a launch of its own")
        if self.format_u is not None and self.format_u != self.format:
            return Refusal(f"gate and up weights in different formats ({self.format}, {self.format_u}): the kernel "
                           f"reads both in one")
        if self.act not in ACTS:
            return Refusal(f"a gate activation `{self.act}`")
        return GemmTc(self.x, self.wg, self.format, Dst(self.out), self.k, self.n, self.m).check()

    def extents(self, top, tokens):
        nk = self.n * self.k
        return reach((self.x, self.m * self.k), (self.wg, nk), (self.wu, nk), (self.out, self.m * self.n))

    def weights(self):
        return {self.wg: self.format, self.wu: self.format}

    def checkpoint_bytes(self):
        return 2 * weight_bytes(self.format, self.n, self.k)

    def bytes(self):
        return self.checkpoint_bytes() + self.x_bytes() + 4 * self.m * self.n

    def flops(self):
        return 4 * self.m * self.n * self.k

    def outputs_tc(self):
        return [2 * self.n]

    def glu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """Binary's `mul` with a gate: up · act(gate), act rounded to f32, then the f32 product."""
        from lanefuse.kernels.common import act

        return up * act(self.act, gate).astype(np.float32)

    def numpy(self, env):
        x = env.array(self.x)[: self.m * self.k].reshape(self.m, self.k)
        g, u = (tc_products(x, decode(*env.weight(w)).reshape(self.n, self.k)) for w in (self.wg, self.wu))
        env.array(self.out)[: self.m * self.n] = self.glu(g, u).reshape(-1)

    def bind_fast(self, env):
        """The fast twin: each product as GemmTc's (f32 BLAS of the rounded operands, w rounded once), then the GLU."""
        m, n, k = self.m, self.n, self.k
        x = env.array(self.x)[: m * k].reshape(m, k)
        fixed = None if env.stream else [rounded_rows(env.matrix(w).reshape(n, k)).T for w in (self.wg, self.wu)]
        out = env.array(self.out)[: m * n].reshape(m, n)

        def call():
            xb = bf16_round(x)
            ws = fixed or [rounded_rows(env.matrix(w).reshape(n, k)).T for w in (self.wg, self.wu)]
            g, u = xb @ ws[0], xb @ ws[1]
            if not all(a.max() < np.inf and a.min() > -np.inf for a in (g, u)):  # f32 overflowed (or NaN)
                with np.errstate(over="ignore", invalid="ignore"):
                    g, u = (tc_products(x, env.matrix(w).reshape(n, k)) for w in (self.wg, self.wu))
            out[...] = self.glu(g, u)

        return call

    def grid_block(self):
        return (-(-self.n // GLU_BN), self.row_tiles(), 1), self.block()

    def kernel_name(self) -> str:
        return ("gemm_tc_glu_cp" if self.copied() else "gemm_tc_glu_any") + suffix(self.m)

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import i64
        from lanefuse.kernels.elementwise import act_code

        xb = self.round_x(denv)
        g, b = self.grid_block()
        denv.function(self.stem, self.kernel_name())(
            g, b, (xb, denv.weight(self.wg)[0], denv.weight(self.wu)[0], i64(FORMAT_CODE[self.format]),
                   i64(act_code(self.act)), denv.array(self.out), i64(self.k), i64(self.n), i64(self.m)))
