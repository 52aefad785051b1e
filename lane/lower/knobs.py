"""The lane's knobs: the chip it plans for (H200 defaults, each overridable) and the schedule's own settings."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

from lanefuse.engine.errors import UserError, did_you_mean


@dataclass(frozen=True)
class Knobs:
    sms: int = 132  # streaming multiprocessors
    smem_kib_per_block: int = 227  # shared memory a block may take
    hbm_gbps: float = 4300.0  # measured device-to-device bandwidth (spec 4800)
    launch_us: float = 2.0  # fixed cost of one kernel launch inside a CUDA graph
    fixed_scale: float = 1.0  # the share of each kind's own fixed time (the lane table's `costs:`) a launch pays:
    # near 0 prices launches by the gap and their bytes alone, as a tiny model's tests do to reach the chunk fusions
    tflops_f32: float = 60.0  # f32 CUDA-core peak, for products where flops dominate
    l2_mib: int = 60
    wide_rows: int = 4096  # a product with at least this many outputs takes four rows a warp (rows_a_warp)
    attn_split_min: int = 64  # attended positions a split of a split attention takes at least
    tc_rows: int = 0  # a product of at least this many rows (and 16) runs on the tensor cores (gemm_tc) under the bf16
    # numerics: x and w rounded to bf16, f32 sums; 0 (the default) never, the f32 numerics exact
    chunk_rows: int = 512  # the rows of a prompt's chunk `run` prefills a step (1..engine/ir.py's MAX_CHUNK);
    # 2048 fills the H200's tensor cores, 512 keeps a CPU step's arena small
    tflops_tc: float = 450.0  # what the cost model takes the tensor-core GEMM to reach (bf16 peak 989)
    tflops_blas: float = 692.0  # what the cost model takes cuBLAS's bf16 GEMM to reach (kernels/gemm_blas.py): an
    # ASSUMPTION, 70% of the 989 peak, not measured by this project (../shared/KERNEL-NOTES.md notes about 790 TFLOP/s
    # for a bf16 8192^3 product on the H200, 80%; an 8B model's products are smaller and fill fewer whole waves)
    blas_call_us: float = 2.3  # what a cuBLAS call costs beyond a launch gap: its bf16 GEMV measured 5.3 µs a call
    # beyond its bytes on the H200 (gpu-runs/2026-12-04/cublas-gemv.log) against bench/gemm_model.py's 3.0 µs launch
    hbm_round_us: float = 2.02  # a latency-bound loop's dependent round of loads from HBM, µs (a load in flight a
    # lane: kernels/head_gemv.py's loop), and one whose loads hit L2: bench/launch_model_calibration.json's L_us and
    # L_l2_us, fitted on the 2026-12-04 H200 figures of the GEMV family (tests/test_knobs_calibration.py keeps them so)
    l2_round_us: float = 0.65
    l1_tbps: float = 33.4  # the SMs' L1 / shared-memory reads in all, TB/s (128 bytes a clock a SM at 1.975 GHz: an
    # ASSUMPTION, bench/launch_model.py's L1_BYTES_CLK): a slab of block rows through the staged tile reads its rows
    # of x there once an output (kernels/gemv.py slab_loop_us)
    tc_attn_rows: int = 0  # a chunk of at least this many rows (and 16) attends on the tensor cores (attention_tc)
    # under the bf16 numerics: q, k, p and v rounded to bf16, f32 sums; 0 (the default) never
    link_gbps: float = 450.0  # the link between ranks' devices, GB/s one way (NVLink 4: 900 both ways; an
    # assumption, not measured): what a collective's bytes stream at (lane/lower/collectives.py)
    link_us: float = 10.0  # a collective's fixed time, µs (NCCL's small-message latency over NVLink; assumed)
    device_gb: float = 141.0  # a device's memory, GB (H200): `plan --ranks` says whether a rank's weights fit

    def to_json(self) -> dict:
        return asdict(self)


KNOB_NAMES = tuple(f.name for f in fields(Knobs))
OFF_AT_ZERO = ("tc_rows", "tc_attn_rows")  # knobs whose 0 turns their choice off


def set_knob(k: Knobs, name: str, value) -> Knobs:
    types = {f.name: f.type for f in fields(Knobs)}
    if name not in types:
        hint = did_you_mean(name, KNOB_NAMES)
        raise UserError(f"unknown knob `{name}`{hint}; knobs: {', '.join(KNOB_NAMES)}")
    conv = float if types[name] in (float, "float") else int
    try:
        v = conv(value)
    except (TypeError, ValueError):
        raise UserError(f"knob `{name}`: {value!r} is not a number") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and name not in OFF_AT_ZERO):
        raise UserError(f"knob `{name}`: {value!r} must be a positive finite number"
                        + (" (or 0: off)" if name in OFF_AT_ZERO else ""))
    if name == "chunk_rows":
        from lanefuse.engine.ir import MAX_CHUNK

        if v > MAX_CHUNK:
            raise UserError(f"knob `chunk_rows`: {value!r} rows a chunk (a step graph takes at most {MAX_CHUNK})")
    return replace(k, **{name: v})


def parse_knobs(pairs: list[str] | dict, base: Knobs | None = None) -> Knobs:
    k = base or Knobs()
    items = pairs.items() if isinstance(pairs, dict) else []
    if not isinstance(pairs, dict):
        parsed = []
        for p in pairs:
            if "=" not in p:
                raise UserError(f"--knob {p!r}: expected NAME=VALUE, e.g. --knob sms=108")
            n, v = p.split("=", 1)
            parsed.append((n.strip(), v.strip()))
        items = parsed
    for n, v in items:
        k = set_knob(k, n, v)
    return k
