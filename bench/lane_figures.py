"""The lane's figures: launches per layer of a Qwen3 decode step, arena bytes over the lower bound on decode and
prefill plans, and the time of a whole plan() (engine + link + schedule + arena) at 36 and 80 layers.

    python bench/lane_figures.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from lanefuse.engine.front.demo import demo_config
from lanefuse.engine.front.model import ModelConfig, build_step
from lanefuse.engine.rules import load_table
from lanefuse.lane.lower.plan import plan


def qwen3_8b(layers: int = 36, fmt: str = "bf16") -> ModelConfig:
    """Qwen3-8B's shape (no weights needed to plan), checkpoint rows in `fmt` (bf16, or a block format: every row of
    the shape is whole K-quant blocks)."""
    cfg = ModelConfig("Qwen3ForCausalLM", 4096, layers, 32, 8, 128, 12288, 151936, qk_norm=True, rope_theta=1e6,
                      max_len=4096, name=f"qwen3-8b-shape-{layers}L" + ("" if fmt == "bf16" else f"-{fmt}"))
    fmts = tuple((n, fmt) for n, s in cfg.weight_names().items() if len(s) == 2)
    return ModelConfig(**{**cfg.__dict__, "formats": fmts})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    table = load_table()
    out = {"launches_per_layer": {}, "arena": [], "plan_seconds": {}}
    print("launches per layer (Qwen3 decode, lane cuda, f32 numerics)")
    for name, cfg in (("demo", demo_config()), ("qwen3-8b", qwen3_8b(36))):
        s = plan(build_step(cfg, 1), table=table)
        body = [v for k, v in s.per_layer().items() if 0 <= k < cfg.layers - 1]
        out["launches_per_layer"][name] = max(body)
        print(f"  {name:10s} {max(body)} a layer (inner layers), {s.n_launches} a step, census {s.census}")
    print("arena bytes / lower bound")
    for name, cfg in (("demo", demo_config()), ("qwen3-8b", qwen3_8b(36))):
        for rows in (1, 8, 64):
            s = plan(build_step(cfg, rows), table=table)
            r = s.arena.ratio
            out["arena"].append({"model": name, "rows": rows, "bytes": s.arena.bytes,
                                 "lower_bound": s.arena.lower_bound, "ratio": round(r, 4)})
            print(f"  {name:10s} rows {rows:3d}: {s.arena.bytes:>12,} B / {s.arena.lower_bound:>12,} B = {r:.4f}")
    print("whole plan() time (engine + link + schedule + arena), median of", args.repeat)
    for layers in (36, 80):
        g = build_step(qwen3_8b(layers), 1)
        times, eng = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            s = plan(g, table=table)
            times.append(time.perf_counter() - t0)
            eng.append(s.timings["engine_s"])
        med = statistics.median(times)
        out["plan_seconds"][str(layers)] = {"total": round(med, 4), "engine": round(statistics.median(eng), 4)}
        print(f"  {layers} layers: {med:.3f} s (engine {statistics.median(eng):.3f} s, "
              f"{s.n_launches} launches)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
