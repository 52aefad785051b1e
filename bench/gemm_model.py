"""A model of the tensor-core GEMM's launches without a device (issue 35 item 5): for each gemm_tc launch of a plan its
block tiles, the waves they make on the H200's SMs, and a predicted time from a stated throughput assumption; the
rest of the step priced by the lane's own cost model (lane/lower/shim.py). Everything printed here is a PREDICTION.

    python bench/gemm_model.py [--rows 512 --rows 2048] [--batch 64] [--kernel before] [--plans PLANDIR] [--json FILE]

The assumptions, each a figure to be replaced by a measurement (bench/gpu_prefill.py measures the same plans):
- the GEMM kernels (KERNELS; ptxas sm_90 through bench/kernel_resources.py): a bf16 product of more than 64 rows runs
  gemm_tc_cp / _parts_cp / _split_cp: 128x128x32 tiles, four warps of 64 x 64, three cp.async stages (240-246
  registers, 48 KB shared memory: BLOCKS an SM = 2); at most 64 rows the *_64 kernels: 64x128x32 tiles, eight warps
  of 32 x 32, three stages (80-118 registers, 36 KB: counted as 2 an SM); `--kernel before` prices the kernels of
  0f140e5 (8 warps of 64 x 32 at 128 rows, two stages, wait_group 0) for comparison;
- a k step of BK = 32 on an SM holding b of a launch's blocks lasts the longest of (each divided by EFFICIENCY):
  * the tensor cores: b x the step's 2·BM·BN·32 flops at MMA_SYNC_TFLOPS / SMS — the chip's rate for mma.sync
    m16n8k16 bf16 (f32 sums) when fed, assumed 660 TFLOP/s (two thirds of wgmma's 989: mma.sync does not reach
    wgmma's rate on sm_90; not measured here); a block alone on an SM reaches half of it (its warps alone do not keep
    the tensor cores busy: as before);
  * shared memory: b x the step's bytes through it — every warp's ldmatrix.x4 (512 B each: per k16 one a 16-row
    fragment of x and one a pair of 8-output fragments of w) plus the stage's (BM + BN) x 64 B written by cp.async —
    at SMEM_BYTES_PER_CLK = 128 B a clock at CLOCK_GHZ = 1.75 (the layouts are conflict-free: padded rows before,
    swizzled chunks now). Eight warps of 64 x 32: 64 KB a 128x128 step; four of 64 x 64: 48 KB;
  * the copies' latency: a stage's copies are issued STAGES - 1 steps before they are read, so a step lasts at least
    LATENCY_US / (STAGES - 1), LATENCY_US = 0.6 µs assumed for a cp.async's round trip under load;
  EFFICIENCY = 0.85 (the barriers, address arithmetic and epilogue no bound above counts; assumed). Under these the
  old kernel was bound by the latency, shared memory close behind (~390 TFLOP/s over a whole wave), the new one by
  shared memory, the tensor cores close behind (~540): past that, mma.sync's operands through registers bound it
  (a 64 x 64 warp tile is the largest the registers hold), wgmma's the way on;
- waves: the blocks fill SMS x BLOCKS slots; a wave's SMs hold b = ceil(blocks in the wave / SMS) blocks each, so a
  last partial wave is priced at its own b (b = 1: the lone block's half rate);
- the seed's `tail` (gemm_tc.py `tail_split`, the lane's `split_k` step): a GemmTc launch of less than one wave of
  tiles runs each tile as ksplit blocks of 1/ksplit of the k steps, then gemm_tc_combine adds the parts (a launch
  and (ksplit + 1) f32 (m, n) arrays over HBM); the lane picks ksplit by its own simpler rule (gemm_tc.tail_us at
  its knobs: a flat 450 TFLOP/s, 132 SMs, 4300 GB/s), which picks the same splits this model prices fastest at the
  prefill's and the batch's sizes (tests/test_gemm_tc_bench.py checks the 512-row one); GemmTcParts launches are
  not split;
- a decode batch (--batch B, every sequence at --pos): its products as above (tiles of 64 rows up to 64 sequences),
  its attention (attention.cu, CUDA cores) by each sequence's f32 keys and values up to the position over HBM;
- the launch is never faster than its bytes over HBM (4.3 TB/s measured copy bandwidth) and pays LAUNCH_US;
- the rounding kernel (x to bf16) streams 4 + 2 bytes a value of x;
- gemm_tc_glu (the gate and up products and their GLU, one launch) as a product of 2n outputs (its tiles 64 outputs
  of each) that writes n;
- a prefill chunk's attention at position 0 (CUDA cores, f32: attention.cu, no flash-attention kernel yet) does its
  causal work, 2 · heads · (hd + vd) · rows(rows+1)/2 flops, at ATTN_TFLOPS = 30 TFLOP/s (half the f32 peak): the
  lane's own estimate prices every row over the whole cache (its `flops`), a bound for decode, not a chunk;
- a chunk's attention on the tensor cores (attention_tc.cu, knob tc_attn_rows, on in this model's plans): a block
  is 128 threads, one kv head and 64 (row, head) slots, at 206 registers (heads of 128: ptxas sm_90) so an SM holds
  ATTN_BLOCKS_PER_SM = 2; its keys in tiles of 64, each warp (16 slots) q·kᵀ and p·v of 2·16·64·D flops each
  (D the head padded to 64 or 128) for every tile it attends (a warp skips the tiles past its last row); the chip
  runs that mma work at ATTN_TC_TFLOPS = 200 TFLOP/s (20% of peak: mma.sync with k and v loaded as f32 — 16-byte
  loads since 21a8bc6 — rounded and stored to shared memory through registers, one buffer, no overlap of loads and
  mma — FA2-class kernels with cp.async pipelines reach 35-45% on Hopper; not measured here; the 16-byte loads are
  not priced as a gain: this rate is an assumption, not derived from the loads), and the launch lasts at least its
  busiest block's tiles at half an SM's share; its f32 k/v tile loads (64 KB a tile a block at D = 128) stream from L2 at
  L2_TBPS = 10 TB/s at most (an assumption), q and out once over HBM;
- with --cuda-core-attention, the chunk's attention on CUDA cores (attention.cu, f32) as before: its causal work,
  2 · heads · (hd + vd) · rows(rows+1)/2 flops, at ATTN_TFLOPS = 30 TFLOP/s (half the f32 peak);
- a product through cuBLAS (kernels/gemm_blas.py: gemm_blas, _parts, _glu, the lane's `cublas` step; `--hold cublas`
  prices gemm_tc's plan instead): the rounding kernel as above, then each cublasGemmEx at BLAS_TFLOPS = 692 TFLOP/s
  (ASSUMED: 70% of the 989 peak; ../shared/KERNEL-NOTES.md notes about 790 TFLOP/s, 80%, for a bf16 8192^3 product
  on this H200, with no log kept; nothing here measured cuBLAS's GEMM) times the share of the SMs its tiles of
  BLAS_TILE x BLAS_TILE keep busy over its waves (gemm_blas.blas_fill: one tile an SM at a time, no split of k — an
  assumption; cuBLAS may split k for a product of few tiles, which this prices slower than it may be), never faster
  than its bytes (w, the rounded x, y written, y read where beta is 1) over HBM, plus BLAS_LAUNCH_US = 5.3 µs a call
  (what cuBLAS's bf16 GEMV cost beyond its bytes on the H200, cublas-gemv.log 2026-12-04: taken for its GEMM too);
  then its epilogue launch where it has one (gemm_tc_combine for a bias, rows added from another array or a
  destination of rows apart; the GLU's gated mul), which streams 12 bytes an output over HBM and pays LAUNCH_US;
- rows in a block format (--format q4_k, q8_0, ...; issue 35's q4_k / q8_0 prefill): gemm_tc's own kernel for them is
  gemm_tc_any (eight warps of 64 x 32, two stages), each thread decoding 16 values of w's tile a k step a value at a
  time (tc_get), for every tile of rows: a step also lasts at least its blocks' decode instructions at ISSUE_PER_CLK
  warp instructions an SM a clock, DECODE_PTX's first figure a value (kernels/gemm_tc.py DECODE_INSTR, counted by
  bench/decode_ptx.py in nvcc 13's sm_90 PTX: an upper-bound proxy of the SASS, no cuobjdump here); the decoded form
  (kernels/gemm_deq.py: gemm_deq, _parts, _glu, the lane's `dequant` step; `--hold dequant` prices gemm_tc_any's
  plan) as a cuBLAS launch whose calls read bf16 rows (2 bytes a value), each matrix first decoded by a
  gemm_tc_dequant launch: its block bytes read and bf16 rows written over HBM, or DECODE_PTX's second figure a value
  issued, whichever is longer, + LAUNCH_US; `--kernel tiles` prices the other choice, not built: block-format rows
  decoded into shared memory a tile at a time inside gemm_tc_cp's pipeline (Marlin style), DECODE_PTX's second figure
  a value for every tile of rows, issued beside the mma (an optimistic overlap);
- every other launch: the lane's cost model (its cost_us).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

SMS = 132
BLOCKS_PER_SM = 2
PEAK_TFLOPS = 989.0
HBM_TBPS = 4.3
LAUNCH_US = 3.0
ATTN_TFLOPS = 30.0
ATTN_TC_TFLOPS = 200.0
ATTN_BLOCKS_PER_SM = 2
L2_TBPS = 10.0
BM = BN = 128
BK = 32
BLAS_TFLOPS = 692.0  # cuBLAS's bf16 GEMM at full waves: ASSUMED (see the docstring)
BLAS_LAUNCH_US = 5.3  # cuBLAS's fixed cost a call: its GEMV's, measured 2026-12-04, taken for its GEMM (assumed)
# The tensor-core kernels' wave arithmetic and its assumptions (MMA_SYNC_TFLOPS, SMEM_BYTES_PER_CLK, CLOCK_GHZ,
# LATENCY_US, EFFICIENCY, KERNELS, step_us, tc_waves) live in kernels/gemm_tc.py: the lane prices gemm_tc by the same
# function (TcProduct.rate). Instructions a thread spends decoding one value of block-format rows to bf16:
# kernels/gemm_tc.py's DECODE_INSTR (bench/decode_ptx.py: PTX of nvcc 13 sm_90, an upper-bound proxy of the SASS; no
# cuobjdump here): (gemm_tc_any's tc_load_w, a value at a time by tc_get; gemm_tc_dequant's qget4, four values a call)
from lanefuse.kernels.gemm_tc import DECODE_INSTR as DECODE_PTX  # noqa: E402 (one table: the lane prices by it too)
from lanefuse.kernels.gemm_tc import (CLOCK_GHZ, EFFICIENCY, ISSUE_PER_CLK, KERNELS, LATENCY_US,  # noqa: E402,F401
                                      MMA_SYNC_TFLOPS, SMEM_BYTES_PER_CLK, step_us, tc_waves)
from lanefuse.kernels.gemm_tc import decode_us as _decode_us  # noqa: E402


def decode_us(values: int, per_value: float, sms: int = SMS) -> float:
    """µs to issue `per_value` instructions a thread for each of `values` (a warp's 32 lanes one value each) over
    `sms` SMs at ISSUE_PER_CLK warp instructions a clock: the decode's bound by instruction issue."""
    return _decode_us(values, per_value, sms)


def gemm_prediction(m: int, n, k: int, weight_bytes: int, ksplit: int = 1, kernel: str = "now",
                    out_n: int | None = None, fmt: str = "bf16", launch_us: float = LAUNCH_US) -> dict:
    """One gemm_tc launch of x (m, k) · w (n, k)ᵀ (n a list: a gemm_tc_parts launch, each part its own tiles), its
    tiles each `ksplit` blocks along k (the tail), by the kernels of `kernel` ("now" or "before"): tiles, waves, the
    predicted µs and what bounds it. out_n: the outputs written a row where not n (gemm_tc_glu: n = the gate's and
    the up's 2n product columns, n written). Rows in a block format `fmt` run gemm_tc_any (decoded a value at a time
    into registers, DECODE_PTX's figure a value, for every tile of rows). launch_us: the fixed cost of each of its
    kernel launches (the product, the rounding kernel, the tail's combine)."""
    ns = list(n) if isinstance(n, (list, tuple)) else [n]
    n = sum(ns)
    w = tc_waves(m, ns, k, ksplit, fmt, SMS, kernel)
    tiles, waves, compute_us = w["tiles"], w["waves"], w["compute_us"]
    nbytes = weight_bytes + 4 * m * k + 4 * m * (n if out_n is None else out_n)
    memory_us = nbytes / (HBM_TBPS * 1e12) * 1e6
    round_us = launch_us + 6 * m * k / (HBM_TBPS * 1e12) * 1e6
    combine_us = launch_us + 4 * m * n * (ksplit + 1) / (HBM_TBPS * 1e12) * 1e6 if ksplit > 1 else 0.0
    us = launch_us + max(compute_us, memory_us) + round_us + combine_us
    return {"m": m, "n": n, "parts": ns, "k": k, "ksplit": ksplit, "tiles": tiles, "waves": waves, "format": fmt,
            "wave_fill": round(w["wave_fill"], 3),
            "compute_us": round(compute_us, 2), "memory_us": round(memory_us, 2), "us": round(us, 2),
            "bound": "hbm" if memory_us > compute_us else w["bound"],
            "tflops": round(2 * m * n * k / (us * 1e-6) / 1e12, 1)}


def blas_prediction(l, launch_us: float = LAUNCH_US, blas_launch_us: float = BLAS_LAUNCH_US) -> dict:
    """One cuBLAS launch (kernels/gemm_blas.py: GemmBlas, GemmBlasParts, GemmBlasGlu): the rounding kernel, each
    cublasGemmEx (its tiles' fill of the SMs at BLAS_TFLOPS, or its bytes over HBM, + blas_launch_us), its epilogue
    launches (each + launch_us, as the rounding and decoding kernels); the predicted µs and what bounds the calls."""
    from lanefuse.kernels.gemm_blas import GemmBlas, GemmBlasGlu, blas_fill
    from lanefuse.kernels.gemm_deq import Decoded
    from lanefuse.kernels.gemm_tc import kp

    m, k = l.m, l.k
    decoded = isinstance(l, Decoded)
    if isinstance(l, GemmBlasGlu):
        calls = [(l.n, l.checkpoint_bytes() // 2, True, False)] * 2  # (n, weight bytes, direct, beta)
        epilogues = [l.n]  # the gated mul
    else:
        ones = [l] if isinstance(l, GemmBlas) else [l.one(p) for p in l.parts]
        calls = [(o.n, o.checkpoint_bytes(), o.direct() is not None, o.add is not None and o.direct() is not None)
                 for o in ones]
        epilogues = [o.n for o in ones if o.direct() is None]  # gemm_tc_combine
    compute_us = memory_us = calls_us = dequant_us = 0.0
    for n, wb, _, beta in calls:
        if decoded:  # gemm_tc_dequant: the block bytes read, bf16 rows written (or its instructions' issue), then
            # cuBLAS reads those rows
            dequant_us += launch_us + max((wb + 2 * n * k) / (HBM_TBPS * 1e12) * 1e6,
                                          decode_us(n * k, DECODE_PTX[l.format][1]))
            wb = 2 * n * k
        c = 2 * m * n * k / (BLAS_TFLOPS * 1e12 * blas_fill(m, n, SMS)) * 1e6
        b = (wb + 2 * m * kp(k) + 4 * m * n * (1 + beta)) / (HBM_TBPS * 1e12) * 1e6
        compute_us, memory_us = compute_us + c, memory_us + b
        calls_us += blas_launch_us + max(c, b)
    round_us = launch_us + 6 * m * k / (HBM_TBPS * 1e12) * 1e6
    epilogue_us = sum(launch_us + 12 * m * n / (HBM_TBPS * 1e12) * 1e6 for n in epilogues)
    ns = [n for n, *_ in calls]
    us = calls_us + round_us + epilogue_us + dequant_us
    return {"m": m, "n": sum(ns), "parts": ns, "k": k, "ksplit": 1, "blas": True, "calls": len(calls),
            "format": l.format, "dequant_us": round(dequant_us, 2),
            "tiles": sum(-(-m // 128) * -(-n // 128) for n in ns), "waves": 0, "wave_fill": min(
                blas_fill(m, n, SMS) for n in ns), "compute_us": round(compute_us, 2), "memory_us": round(memory_us, 2),
            "us": round(us, 2), "bound": "hbm" if memory_us > compute_us else "cublas",
            "tflops": round(2 * m * sum(ns) * k / (us * 1e-6) / 1e12, 1)}


def attention_tc_prediction(rows: int, heads: int, group: int, hd: int, vd: int, pos: int = 0, window: int = 0) -> dict:
    """One attention_tc launch of a chunk of `rows` rows at position `pos`: blocks, waves, the mma work each warp
    does over the key tiles it attends (as attention_tc.cu skips), and the predicted µs and what bounds it."""
    from lanefuse.kernels.attention_tc import SLOTS, TILE, dim

    D = dim(hd, vd)
    kv = heads // group
    slots = rows * group
    blocks_a_head = math.ceil(slots / SLOTS)
    tile_warp_flops = 2 * 2 * 16 * TILE * D  # q·kᵀ and p·v for one warp's 16 slots over one tile of keys
    per_head_flops, biggest, tiles_loaded = 0, 0, 0
    for b in range(blocks_a_head):
        s0 = b * SLOTS
        last = min(slots, s0 + SLOTS) - 1
        jlo = max(0, pos + s0 // group - window + 1) if window > 0 else 0
        jhi = pos + last // group + 1
        tiles = math.ceil((jhi - jlo) / TILE)
        tiles_loaded += tiles
        work = 0
        for w in range(4):
            f = s0 + 16 * w
            if f >= slots:
                break
            whi = pos + min(slots - 1, f + 15) // group
            wlo = max(0, pos + f // group - window + 1) if window > 0 else 0
            work += sum(1 for t in range(tiles) if not (jlo + t * TILE > whi or jlo + (t + 1) * TILE <= wlo))
        per_head_flops += work * tile_warp_flops
        biggest = max(biggest, work * tile_warp_flops)
    blocks = blocks_a_head * kv
    flops = per_head_flops * kv
    per_sm = ATTN_TC_TFLOPS * 1e12 / SMS
    compute_us = max(flops / (ATTN_TC_TFLOPS * 1e12), biggest / (per_sm / ATTN_BLOCKS_PER_SM)) * 1e6
    l2_us = tiles_loaded * kv * TILE * (hd + vd) * 4 / (L2_TBPS * 1e12) * 1e6
    hbm_us = (4 * rows * heads * (hd + vd) + 4 * kv * (pos + rows) * (hd + vd)) / (HBM_TBPS * 1e12) * 1e6
    us = LAUNCH_US + max(compute_us, l2_us, hbm_us)
    useful = 2 * heads * (hd + vd) * sum(min(pos + r + 1, window) if window else pos + r + 1 for r in range(rows))
    return {"rows": rows, "pos": pos, "blocks": blocks, "waves": math.ceil(blocks / (SMS * ATTN_BLOCKS_PER_SM)),
            "mma_flops": flops, "useful_flops": useful, "compute_us": round(compute_us, 2), "l2_us": round(l2_us, 2),
            "us": round(us, 2), "bound": max((compute_us, "mma"), (l2_us, "l2"), (hbm_us, "hbm"))[1],
            "tflops": round(useful / (us * 1e-6) / 1e12, 1)}


def tc_prediction(l, kernel: str = "now", launch_us: float = LAUNCH_US,
                  blas_launch_us: float = BLAS_LAUNCH_US) -> dict | None:
    """The prediction of launch `l` where it is a tensor-core product (gemm_tc, _parts, _glu by `gemm_prediction`;
    their cuBLAS and decoded forms by `blas_prediction`), each kernel launch at `launch_us` (a cuBLAS call at
    `blas_launch_us`); None for any other kind."""
    from lanefuse.kernels import GemmTc, GemmTcGlu, GemmTcParts
    from lanefuse.kernels.gemm_blas import BlasProduct

    if isinstance(l, BlasProduct):
        p = blas_prediction(l, launch_us, blas_launch_us)
        p["glu"] = l.census == "gemm_blas_glu"
        return p
    if isinstance(l, (GemmTc, GemmTcParts, GemmTcGlu)):
        ns = [l.n] if isinstance(l, GemmTc) else [2 * l.n] if isinstance(l, GemmTcGlu) else [p.n for p in l.parts]
        p = gemm_prediction(l.m, ns, l.k, l.checkpoint_bytes(), getattr(l, "ksplit", 1), kernel,
                            l.n if isinstance(l, GemmTcGlu) else None, l.format, launch_us)
        p["glu"] = isinstance(l, GemmTcGlu)
        return p
    return None


def plan_prediction(s, kernel: str = "now", pos: int = 0) -> dict:
    """Every launch of plan `s`: gemm_tc and gemm_tc_parts by `gemm_prediction` (the kernels of `kernel`), a chunk's
    attention on the tensor cores by `attention_tc_prediction` (at position 0: a prompt's first chunk), on CUDA cores
    by its causal flops; a batch's attention (s.batch > 1, every sequence at `pos`) by its f32 keys and values of
    pos + 1 rows a sequence over HBM (attention.cu reads each once: an assumption of its bandwidth bound); the rest by
    the lane's cost model (its cost_us)."""
    batch = getattr(s, "batch", 1) or 1
    gemms, attn, other, kinds = [], [], 0.0, {}
    for x in s.launches:
        l = x.launch
        p = tc_prediction(l, kernel)
        if p is not None:
            gemms.append(p)
            kinds[l.census] = kinds.get(l.census, 0.0) + p["us"]
        else:
            us = float(getattr(x, "cost_us", 0.0))
            if l.census == "attention_tc":
                p = attention_tc_prediction(l.rows, l.heads, l.group, l.hd, l.vd, 0, l.window)
                attn.append(p)
                us = p["us"]
            elif l.census == "attention" and batch > 1:  # each sequence's row over its own cache at pos
                cache = 4 * batch * (pos + 1) * (l.heads // l.group) * (l.hd + l.vd)
                us = LAUNCH_US + (cache + 4 * batch * l.heads * (l.hd + l.vd)) / (HBM_TBPS * 1e12) * 1e6
            elif l.census == "attention" and not getattr(l, "slot", 0) and l.rows > 1:  # a chunk, not a batch
                causal = 2 * l.heads * (l.hd + l.vd) * l.rows * (l.rows + 1) // 2
                us = LAUNCH_US + causal / (ATTN_TFLOPS * 1e12) * 1e6
            other += us
            kinds[l.census] = kinds.get(l.census, 0.0) + us
    gemm_us = sum(p["us"] for p in gemms)
    flops = sum(2 * p["m"] * p["n"] * p["k"] for p in gemms)
    total = gemm_us + other
    return {"rows": s.rows, "batch": batch, "pos": pos, "kernel": kernel,
            "gemm_launches": len(gemms), "gemm_us": round(gemm_us, 1), "other_us": round(other, 1),
            "step_us": round(total, 1), "tokens_per_s": round(s.rows / (total * 1e-6), 0),
            "gemm_tflops": round(flops / (gemm_us * 1e-6) / 1e12, 1) if gemm_us else 0.0,
            "kinds_us": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}, "gemms": gemms,
            "attention_tc": attn[:1]}


def prefill_plan(rows: int, fmt: str = "bf16", tc_attention: bool = True, held=()):
    """The Qwen3-8B-shaped prefill step of `rows` rows under the tensor-core knobs (tc_rows; tc_attn_rows unless
    `tc_attention` is false), the rules and schedule steps `held` held (needs the engine: egglog)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    from lane_figures import qwen3_8b

    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.knobs import Knobs
    from lanefuse.lane.lower.plan import plan

    return plan(build_step(qwen3_8b(36, fmt), rows), knobs=Knobs(tc_rows=16, chunk_rows=max(rows, 512),
                                                                  tc_attn_rows=16 if tc_attention else 0),
                source={"kind": "random"}, held=list(held))


def batch_plan(batch: int, fmt: str = "bf16", held=()):
    """The Qwen3-8B-shaped decode step of `batch` sequences under the tensor-core knob tc_rows (a batch of >= 16 rows
    runs its products on the tensor cores), `held` held."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    from lane_figures import qwen3_8b

    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.knobs import Knobs
    from lanefuse.lane.lower.plan import plan

    return plan(build_step(qwen3_8b(36, fmt), 1, batch=batch), knobs=Knobs(tc_rows=16), source={"kind": "random"},
                held=list(held))


def print_prediction(name: str, p: dict) -> None:
    what = f"{p['batch']} sequences at position {p['pos']}" if p.get("batch", 1) > 1 else f"{p['rows']} rows"
    print(f"PREDICTION {name} (kernels: {p.get('kernel', 'now')}): {what}, "
          f"{p['gemm_launches']} tensor-core GEMM launches {p['gemm_us']:.0f} µs "
          f"({p['gemm_tflops']:.0f} TFLOP/s, {p['gemm_tflops'] / PEAK_TFLOPS:.0%} of {PEAK_TFLOPS:.0f}) + the rest "
          f"{p['other_us']:.0f} µs (attention by its tiles or causal flops, the rest the lane's cost model) = "
          f"{p['step_us']:.0f} µs a step, {p['tokens_per_s']:.0f} tokens/s")
    print(f"PREDICTION   per kind: " + ", ".join(f"{k} {v:.0f} µs" for k, v in p["kinds_us"].items()))
    for a in p.get("attention_tc", []):
        print(f"PREDICTION   {p['kinds_us'].get('attention_tc', 0) / a['us']:.0f} x attention_tc {a['rows']} rows: "
              f"{a['blocks']} blocks, {a['waves']} waves, {a['us']:.1f} µs ({a['bound']}-bound, {a['tflops']:.0f} "
              f"TFLOP/s of causal work; mma work {a['mma_flops'] / a['useful_flops']:.2f}x it)")
    seen = set()
    for g in p["gemms"]:
        key = (g["m"], tuple(g["parts"]), g["k"], g.get("ksplit", 1))
        if key in seen:
            continue
        seen.add(key)
        count = sum(1 for x in p["gemms"] if (x["m"], tuple(x["parts"]), x["k"], x.get("ksplit", 1)) == key)
        n = f"(2x{g['n'] // 2}: gate, up and GLU)" if g.get("glu") else "+".join(map(str, g["parts"]))
        split = f" in {g['ksplit']} parts along k (tail)" if g.get("ksplit", 1) > 1 else ""
        rows = "" if g.get("format", "bf16") == "bf16" else f" {g['format']} rows"
        if g.get("dequant_us"):
            rows += f" decoded to bf16 ({g['calls']} x gemm_tc_dequant {g['dequant_us']:.1f} µs in all)"
        if g.get("blas"):
            print(f"PREDICTION   {count:3d} x cuBLAS {g['m']}x{n}x{g['k']}{rows}: {g['calls']} cublasGemmEx, {g['tiles']} "
                  f"tiles of 128 x 128 (the least-filled call {g['wave_fill']:.0%} of its waves), {g['us']:.1f} µs "
                  f"({g['bound']}-bound, {g['tflops']:.0f} TFLOP/s; BLAS_TFLOPS {BLAS_TFLOPS:.0f} assumed)")
            continue
        print(f"PREDICTION   {count:3d} x gemm {g['m']}x{n}x{g['k']}{rows}{split}: {g['tiles']} tiles, {g['waves']} waves "
              f"({g['wave_fill']:.0%} full), {g['us']:.1f} µs ({g['bound']}-bound, {g['tflops']:.0f} TFLOP/s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, action="append", help="prefill rows (default 512 and 2048)")
    ap.add_argument("--batch", type=int, action="append", help="decode batches (B sequences at --pos; default 64; 0: "
                                                                "none)")
    ap.add_argument("--pos", type=int, default=512, help="the batch's position (default 512)")
    ap.add_argument("--kernel", choices=("now", "before", "tiles"), default="now",
                    help="price the GEMMs by the kernels now, or by 0f140e5's (two stages, eight warps of 64 x 32), or "
                         "(tiles, not built) block-format rows decoded into shared memory a tile at a time inside "
                         "gemm_tc_cp's pipeline (Marlin style: qget4's instructions a value, for every tile of rows)")
    ap.add_argument("--plans", help="read PLANDIR/qwen3-8b-prefillN.json (bench/gpu_prefill.py prepare) instead of "
                                    "planning")
    ap.add_argument("--format", action="append", help="the prefill plans' checkpoint rows (default bf16; q4_k, q8_0, "
                                                      "q4_0, q6_k: a plan each, named qwen3-8b-FORMAT-prefillN)")
    ap.add_argument("--json")
    ap.add_argument("--hold", action="append", default=[],
                    help="rules or schedule steps the plans hold (`--hold cublas`: gemm_tc's plans, before the cuBLAS "
                         "form)")
    ap.add_argument("--cuda-core-attention", action="store_true", help="plan the chunk's attention on CUDA cores "
                                                                        "(attention.cu), as before attention_tc")
    args = ap.parse_args()
    out = {"assumptions": {"sms": SMS, "blocks_per_sm": BLOCKS_PER_SM, "mma_sync_tflops": MMA_SYNC_TFLOPS,
                           "smem_bytes_per_clk": SMEM_BYTES_PER_CLK, "clock_ghz": CLOCK_GHZ, "latency_us": LATENCY_US,
                           "efficiency": EFFICIENCY, "kernels": {f"{k[0]}{'_64' if k[1] else ''}": v
                                                                 for k, v in KERNELS.items()},
                           "hbm_tbps": HBM_TBPS, "launch_us": LAUNCH_US, "attn_tflops": ATTN_TFLOPS,
                           "attn_tc_tflops": ATTN_TC_TFLOPS, "attn_blocks_per_sm": ATTN_BLOCKS_PER_SM,
                           "l2_tbps": L2_TBPS, "blas_tflops": BLAS_TFLOPS, "blas_launch_us": BLAS_LAUNCH_US,
                           "issue_per_clk": ISSUE_PER_CLK, "decode_ptx": DECODE_PTX},
           "kernel": args.kernel, "held": args.hold, "plans": {}}
    for fmt in args.format or ["bf16"]:
        for rows in args.rows or [512, 2048]:
            name = f"qwen3-8b-prefill{rows}" if fmt == "bf16" else f"qwen3-8b-{fmt}-prefill{rows}"
            if args.plans:
                from lanefuse.lane.lower.planfile import load

                s = load(os.path.join(args.plans, name + ".json"))
            else:
                s = prefill_plan(rows, fmt, tc_attention=not args.cuda_core_attention, held=args.hold)
            p = plan_prediction(s, args.kernel)
            out["plans"][name] = p
            print_prediction(name, p)
    for b in args.batch or [64]:
        if b <= 1:
            continue
        name = f"qwen3-8b-decode-b{b}"
        if args.plans:
            from lanefuse.lane.lower.planfile import load

            s = load(os.path.join(args.plans, name + ".json"))
        else:
            s = batch_plan(b, held=args.hold)
        p = plan_prediction(s, args.kernel, args.pos)
        out["plans"][name] = p
        print_prediction(name, p)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
