"""Plan time by stage (load, saturate, snapshot, decode, cost, extract, emit) and e-graph size for Qwen3-8B-shaped
decode steps of 1, 8, 36 and 80 layers, in one process after a 1-layer warm-up (imports). `engine` is the wall time of
a fresh `Session(g, table)` plus its first `plan()` (trace, held-set checks and all), not the sum of the stages; its
median and minimum over the repeats are printed, as the minimum says what the code costs on a machine shared with
others. Prints a table; run: python bench/plan_time.py [--method ilp|local] [--repeat N] [LAYERS...]"""

from __future__ import annotations

import argparse
import statistics
import time

from lanefuse.engine.front.model import ModelConfig, build_step
from lanefuse.engine.optimize import Session
from lanefuse.engine.rules import load_table


def qwen3_8b(layers: int) -> ModelConfig:
    return ModelConfig("Qwen3ForCausalLM", hidden=4096, layers=layers, heads=32, kv_heads=8, head_dim=128,
                       inter=12288, vocab=151936, qk_norm=True, name=f"qwen3-8b-shape-{layers}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("layers", nargs="*", type=int, default=[1, 8, 36, 80])
    ap.add_argument("--method", default="ilp", choices=["ilp", "local"])
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    t0 = time.perf_counter()
    table = load_table()
    print(f"rule table: {len(table.rules)} rules, {sum(len(v) for v in table.variants.values())} variants, "
          f"loaded in {1e3 * (time.perf_counter() - t0):.1f} ms")
    Session(build_step(qwen3_8b(1)), table).plan(method=args.method)  # warm imports (highspy) once
    stages = ["load", "saturate", "snapshot", "decode", "cost", "extract", "emit"]
    print(f"{'layers':>6} {'e-nodes':>8} {'classes':>8} {'ops':>5} {'launches':>8} " +
          " ".join(f"{s:>9}" for s in stages) + f" {'engine':>9} {'min':>7}   (ms, medians of {args.repeat}, "
          f"{args.method})")
    for n in args.layers:
        g = build_step(qwen3_8b(n))
        runs, walls = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            o = Session(g, table).plan(method=args.method)
            walls.append(time.perf_counter() - t0)
            runs.append(o)
        med = {k: statistics.median(r.trace["time"][k] for r in runs) for k in stages}
        o = runs[0]
        print(f"{n:>6} {o.trace['egraph']['nodes']:>8} {o.trace['egraph']['classes']:>8} {len(g.ops):>5} "
              f"{len(o.graph.ops):>8} " + " ".join(f"{1e3 * med[k]:>9.1f}" for k in stages) +
              f" {1e3 * statistics.median(walls):>9.1f} {1e3 * min(walls):>7.1f}")


if __name__ == "__main__":
    main()
