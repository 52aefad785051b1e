"""The batch curve of issue 35 (B = 8 >= 6.5x B = 1; B = 64 >= 4,000 tokens/s): the Qwen3-8B-shaped decode step of B
sequences at one position, planned as the lane plans it (knob tc_rows 16: a batch of >= 16 rows on the tensor cores),
each launch priced by the model that owns its kind, one fixed cost a kernel launch (t0) for all. PREDICTIONS only.

    python bench/batch_curve.py [--batch 1,2,4,8,16,32,64] [--format bf16 --format q8_0 --format q4_k] [--pos 512]
                                [--tc-rows 16 --tc-rows 3] [--hold RULE] [--json FILE]

- the plans: knob tc_rows 16 (a batch of 16 or more on the tensor cores, fewer as GEMVs) and 3 (from 3 rows on the
  tensor cores: gemm_tc.MIN_ROWS; the bf16 numerics of x from 3 sequences), a curve each;

- the tensor-core kinds (gemm_tc, gemm_tc_parts, gemm_tc_glu and their cuBLAS / decoded forms): bench/gemm_model.py's
  tc_prediction (tiles, waves, wave fill), every kernel launch of theirs (the rounding kernel, the product, a tail's
  combine, each cublasGemmEx, each decode) at t0;
- every other launch (the GEMV family, the chained launches, attention over the B slots, norms, rotations, the
  arg-max): bench/launch_model.py's model (Little's law over each kernel's loads in flight, ptxas' resources; a GEMV
  slab of 3-8 rows of f32/f16/bf16 rows as gemv_core.cu's gemv_slab16 streams it, SLAB_DEPTH 16-byte steps a row a
  lane in flight, floored by its x's L1 reads and its FMAs; of block-format rows as gemv_tile_any), its t0
  the calibration's (10.3 µs, fitted on the 2026-12-04 ncu figures), so B = 1 is launch-model-8's 4920 µs a token;
- the same at t0 = cuBLAS's measured fixed cost a launch (5.3 µs: launch_model.cublas_anchor), every launch of every
  B alike, as a sensitivity line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

BATCHES = (1, 2, 4, 8, 16, 32, 64)


def batch_plan(b: int, fmt: str, held=(), tc_rows: int = 16):
    """The Qwen3-8B-shaped decode step of `b` sequences (launch_model.qwen3_plan's: a cache of 1024 rows a sequence)
    under knob tc_rows."""
    import dataclasses

    from lane_figures import qwen3_8b
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.knobs import Knobs
    from lanefuse.lane.lower.plan import plan

    cfg = qwen3_8b(36, fmt)
    if b > 1:
        cfg = dataclasses.replace(cfg, max_len=1024)
    step = build_step(cfg, 1, batch=b) if b > 1 else build_step(cfg, 1)
    return plan(step, knobs=Knobs(tc_rows=tc_rows), held=list(held))


def price(s, pos: int, cal: dict, t0: float) -> dict:
    """Step `s` priced launch by launch at fixed cost `t0` a kernel launch: {kind: µs}, the step's µs, its tensor-core
    launches' predictions."""
    import gemm_model as gm
    import launch_model as lm

    kinds: dict[str, float] = {}
    tc, rest = [], []
    for x in s.launches:
        p = gm.tc_prediction(x.launch, launch_us=t0, blas_launch_us=t0)
        if p is None:
            rest.append(x)
            continue
        p["census"] = x.launch.census
        tc.append(p)
        kinds[x.launch.census] = kinds.get(x.launch.census, 0.0) + p["us"]
    ks = lm.model(SimpleNamespace(launches=rest, constants=s.constants), None, cal, pos)
    for k in ks:  # the launch model's kernels at t0 (its attention combine pays none: launch_model.at_t0)
        us = k.us - ((cal["t0_us"] - t0) if k.family != "attention_combine" else 0.0)
        kinds[k.kind] = kinds.get(k.kind, 0.0) + us
    return {"step_us": sum(kinds.values()), "kinds_us": kinds, "gemms": tc}


def distinct(gemms: list[dict]) -> list[dict]:
    """The tensor-core launches' predictions, one of each (kind, shape, parts along k) with its count."""
    out: dict[tuple, dict] = {}
    for g in gemms:
        key = (g["census"], g["m"], tuple(g["parts"]), g["k"], g.get("ksplit", 1))
        if key in out:
            out[key]["count"] += 1
        else:
            out[key] = {**g, "count": 1}
    return list(out.values())


def curve(fmt: str, batches, pos: int, cal: dict, t0s: dict, held=(), tc_rows: int = 16) -> list[dict]:
    rows = []
    for b in batches:
        s = batch_plan(b, fmt, held, tc_rows)
        row = {"format": fmt, "tc_rows": tc_rows, "batch": b, "launches": s.n_launches, "census": dict(s.census),
               "t0": {}}
        for label, t0 in t0s.items():
            p = price(s, pos, cal, t0)
            row["t0"][label] = {"t0_us": t0, "step_us": round(p["step_us"], 1),
                                "tokens_per_s": round(b / (p["step_us"] * 1e-6), 1),
                                "kinds_us": {k: round(v, 1) for k, v in sorted(p["kinds_us"].items(),
                                                                               key=lambda kv: -kv[1])},
                                "gemms": distinct(p["gemms"])}
        rows.append(row)
    return rows


def targets(rows: list[dict], labels) -> list[str]:
    """Issue 35's batch targets against the curve: B = 8 at >= 6.5x B = 1's tokens/s, B = 64 at >= 4,000 tokens/s."""
    by = {r["batch"]: r["t0"] for r in rows}
    out = []
    for lab in labels:
        t0 = by[min(by)][lab]["t0_us"]
        if 1 in by and 8 in by:
            x = by[8][lab]["tokens_per_s"] / by[1][lab]["tokens_per_s"]
            out.append(f"t0 {t0:.1f}: B=8 x{x:.2f} of B=1 (target 6.5: {'met' if x >= 6.5 else 'SHORT'})")
        if 64 in by:
            v = by[64][lab]["tokens_per_s"]
            out.append(f"t0 {t0:.1f}: B=64 {v:.0f} tokens/s (target 4000: {'met' if v >= 4000 else 'SHORT'})")
        worse = [b for b in sorted(by) if any(by[b][lab]["step_us"] > by[c][lab]["step_us"] for c in by if c > b)]
        if worse:
            out.append(f"t0 {t0:.1f}: a step slower than a larger batch's at B = {', '.join(map(str, worse))}")
    return out


def print_curve(rows: list[dict], labels) -> None:
    base = {lab: rows[0]["t0"][lab]["tokens_per_s"] for lab in labels} if rows and rows[0]["batch"] == 1 else None
    fmt = f"{rows[0]['format']} tc_rows {rows[0]['tc_rows']}"
    for r in rows:
        cells = []
        for lab in labels:
            t = r["t0"][lab]
            x = f" x{t['tokens_per_s'] / base[lab]:.2f} of B=1" if base else ""
            cells.append(f"t0 {t['t0_us']:.1f}: {t['step_us']:8.0f} µs a step {t['tokens_per_s']:7.0f} tok/s{x}")
        print(f"PREDICTION {fmt:16} B={r['batch']:3d} {r['launches']:4d} launches  " + "  |  ".join(cells))
    for line in targets(rows, labels):
        print(f"PREDICTION   {fmt} {line}")
    for r in rows:
        t = r["t0"][labels[0]]
        print(f"PREDICTION   {fmt} B={r['batch']}: census {r['census']}; µs by kind (t0 {t['t0_us']:.1f}): "
              + ", ".join(f"{k} {v:.0f}" for k, v in t["kinds_us"].items()))


def main() -> None:
    import launch_model as lm

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default=",".join(map(str, BATCHES)), help="the batches, comma-separated")
    ap.add_argument("--format", action="append", help="checkpoint rows, comma-separated or repeated (default bf16, "
                    "q8_0, q4_k)")
    ap.add_argument("--pos", type=int, default=512, help="every sequence's position (default 512)")
    ap.add_argument("--hold", action="append", default=[], help="rules or schedule steps the plans hold")
    ap.add_argument("--tc-rows", type=int, action="append", help="knob tc_rows of the plans (default 16, then 3: "
                    "from 3 rows on the tensor cores, gemm_tc.MIN_ROWS), a curve each")
    ap.add_argument("--json")
    a = ap.parse_args()
    from lanefuse.engine.ir import FORMATS

    formats = [f for arg in a.format or ["bf16,q8_0,q4_k"] for f in arg.split(",") if f]
    bad = [f for f in formats if f not in FORMATS]
    try:
        batches = [int(b) for b in a.batch.split(",")]
    except ValueError:
        batches = []
    if bad or not batches or min(batches) < 1:
        ap.error(f"--format {', '.join(bad)}: not a checkpoint format ({', '.join(FORMATS)})" if bad else
                 f"--batch {a.batch!r}: expected batches of at least 1, comma-separated (e.g. 1,8,64)")
    cal = lm.load_calibration()
    c0, _ = lm.cublas_anchor()
    t0s = {"calibration": cal["t0_us"], "cublas": round(c0, 2)}
    print(f"# PREDICTIONS (no device): bench/batch_curve.py, Qwen3-8B-shaped decode of B sequences at position {a.pos}, "
          f"knob tc_rows {'/'.join(map(str, a.tc_rows or [16, 3]))}; tensor-core kinds by bench/gemm_model.py, the rest by bench/launch_model.py; every "
          f"kernel launch at t0 = {t0s['calibration']} µs (the launch model's calibration) and, beside it, "
          f"{t0s['cublas']} µs (cuBLAS's measured fixed cost)")
    out = {"note": "PREDICTIONS (bench/batch_curve.py), not measurements", "pos": a.pos, "held": a.hold, "t0": t0s,
           "curves": {}}
    for fmt in formats:
        for tc in a.tc_rows or [16, 3]:
            rows = curve(fmt, batches, a.pos, cal, t0s, a.hold, tc)
            print_curve(rows, list(t0s))
            out["curves"][f"{fmt} tc_rows {tc}"] = rows
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
