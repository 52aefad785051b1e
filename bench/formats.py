"""GGUF block formats' figures. (1) From the plan: the checkpoint bytes a Qwen3-8B-shaped decode step reads with its
rows in bf16, q8_0, q4_0, q4_k and q6_k, the plan's estimated step time, and that many bytes over the H200's HBM
bandwidth. (2) On this CPU: decode ms/token of a random Qwen3-shaped model built in memory (bench/cpu_decode.py's
shape: hidden 1024, 16 heads, 8 kv heads, head_dim 64, intermediate 3072, vocab 32000; --layers of them) with its
matrices in f32, q8_0, q4_0 and q4_k, run by the fast runner `lanefuse run` uses (a block format is decoded to f32
once, at its first step: the time and the memory it costs are printed), greedy tokens checked against the reference
interpreter on the first round. Rounds are interleaved, figures are medians.

    python bench/formats.py [--layers 4] [--tokens 16] [--rounds 3] [--threads 2] [--skip-cpu] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_decode import PROMPT, resident, timed_decode  # noqa: E402  (bench/'s shared measurement)

HBM_TBPS = 4.8  # H200 HBM3e, the datasheet's figure
PLAN_FORMATS = ("bf16", "q8_0", "q4_0", "q4_k", "q6_k")
CPU_FORMATS = ("f32", "q8_0", "q4_0", "q4_k")


def plan_figures(out: dict) -> None:
    from lane_figures import qwen3_8b

    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan

    print("Qwen3-8B-shaped decode step (36 layers, lane cuda), checkpoint bytes a step reads, from the plan:")
    base = None
    for fmt in PLAN_FORMATS:
        s = plan(build_step(qwen3_8b(36, fmt), 1))
        by = s.weight_bytes()
        total = sum(by.values())
        base = base or total
        hbm_us = total / (HBM_TBPS * 1e12) * 1e6
        out.setdefault("qwen3_8b_step", []).append({"format": fmt, "weight_bytes": total, "by_format": by,
                                                    "vs_bf16": round(total / base, 4), "plan_cost_us": s.cost_us,
                                                    "hbm_us": round(hbm_us, 1), "launches": s.n_launches})
        print(f"  {fmt:5s} {total / 1e9:7.3f} GB  ({total / base:6.1%} of bf16) · plan's estimate {s.cost_us:8.1f} µs · "
              f"bytes / {HBM_TBPS} TB/s {hbm_us:8.1f} µs · {s.n_launches} launches")


def cpu_model(layers: int):
    from lanefuse.engine.front.model import ModelConfig

    return ModelConfig("Qwen3ForCausalLM", 1024, layers, 16, 8, 64, 3072, 32000, qk_norm=True, rope_theta=1e6,
                       max_len=512, name=f"qwen3-shaped-{layers}L")


class Model:
    """One format of the model: its weights (stored bytes), its step function, timed decode steps."""

    def __init__(self, cfg, arrays, fmt: str):
        from lanefuse.engine.front.weights import Weights
        from lanefuse.engine.formats.blocks import encode_matrices
        from lanefuse.lane.run.step import plan_step_fn

        t0 = time.perf_counter()
        stored = encode_matrices(arrays, fmt) if fmt != "f32" else {k: (v, "f32") for k, v in arrays.items()}
        self.encode_s = time.perf_counter() - t0
        self.cfg = dataclasses.replace(cfg, formats=tuple((n, f) for n, (_, f) in stored.items() if f != "f32"))
        self.weights = Weights.from_dict(stored, self.cfg)
        self.fmt = fmt
        self.stored_bytes = sum(a.nbytes for a, f in stored.values())
        step_fn, self.label = plan_step_fn(self.weights, "cpu", exact=False)
        self.times: list[float] = []
        self.step_fn = timed_decode(step_fn, self.times)
        rss, t0 = resident(), time.perf_counter()
        self.first = self.round(2)[1]  # plans the steps and decodes the weights to f32 once
        self.first_s, self.first_bytes = time.perf_counter() - t0, resident() - rss

    def round(self, n: int):
        from lanefuse.lane.run.generate import generate

        self.times.clear()
        res = generate(self.cfg, self.weights, PROMPT, n + 1, step_fn=self.step_fn)
        return list(self.times), res.generated_ids


def cpu_figures(args, out: dict) -> None:
    from lanefuse.engine.front.demo import random_arrays
    from lanefuse.lane.run.generate import generate

    cfg = cpu_model(args.layers)
    arrays = random_arrays(cfg, seed=18)
    params = sum(a.size for a in arrays.values())
    print(f"\nCPU decode: Qwen3-shaped, {args.layers} layers, {params / 1e6:.0f}M parameters, {len(PROMPT)}-token "
          f"prompt, {args.tokens} decode steps a round, {args.rounds} rounds interleaved, "
          f"{os.environ['OPENBLAS_NUM_THREADS']} BLAS threads")
    models = [Model(cfg, arrays, f) for f in CPU_FORMATS]
    same = {}
    for m in models:  # the fused plan's greedy tokens against the reference interpreter on the same weights
        ref = generate(m.cfg, m.weights, PROMPT, args.tokens + 1)
        got = m.round(args.tokens)[1]
        same[m.fmt] = got == ref.generated_ids
    ms = {m.fmt: [] for m in models}
    for _ in range(args.rounds):
        for m in models:
            ms[m.fmt].append(1e3 * statistics.median(m.round(args.tokens)[0]))
    f32 = statistics.median(ms["f32"])
    for m in models:
        med = statistics.median(ms[m.fmt])
        row = {"format": m.fmt, "ms_per_token": round(med, 2), "vs_f32": round(med / f32, 3),
               "stored_mb": round(m.stored_bytes / 1e6, 1), "encode_s": round(m.encode_s, 2),
               "first_steps_s": round(m.first_s, 2), "first_steps_resident_mb": round(m.first_bytes / 1e6, 1),
               "tokens_equal_reference": same[m.fmt], "rounds_ms": [round(v, 2) for v in ms[m.fmt]]}
        out.setdefault("cpu_decode", []).append(row)
        print(f"  {m.fmt:5s} {med:7.2f} ms/token ({med / f32:5.2f}x f32) · stored {m.stored_bytes / 1e6:6.0f} MB · "
              f"first steps (plan + decode to f32 once) {m.first_s:5.2f} s, +{m.first_bytes / 1e6:5.0f} MB resident · "
              f"greedy tokens {'= reference' if same[m.fmt] else 'DIFFER from the reference'} · rounds "
              f"{', '.join(f'{v:.1f}' for v in ms[m.fmt])}")
    print(f"  (the fast runner multiplies f32: every format costs {4 * params / 1e6:.0f} MB of decoded weights held "
          f"beside its stored bytes, and runs at f32's speed)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))  # before numpy is imported
    out: dict = {}
    plan_figures(out)
    if not args.skip_cpu:
        cpu_figures(args, out)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
