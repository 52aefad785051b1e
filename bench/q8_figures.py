"""q8 / q8x2 figures: launches per Qwen3 decode layer under f32, q8 (with `fuse_quant`, and with it held) and q8x2;
arena bytes over their lower bound under each numerics, for the decode step and a prefill chunk of 8 rows; CPU decode ms/token of the fast numpy runner under f32, q8
and q8x2 numerics on the same q8_0 / q4_0 GGUF file of a random Qwen3-shaped model (bench/gguf_figures.py's), and
llama.cpp's on that file beside them where llama-cpp-python is installed. Each timing runs in a fresh process;
medians over the rounds. Then q8 beside f32 in one process (`side by side`): both runners built on the same weights,
their decodes interleaved round by round, so a loaded machine slows both alike; the ratio is the goal's figure (issue
#13: q8 no slower than twice f32).

    python bench/q8_figures.py [--formats q8_0,q4_0] [--layers 4] [--tokens 8] [--rounds 2] [--threads 2] [--plans-only]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_figures import PROMPT, SHAPE, child_llamacpp, write_model  # noqa: E402

NUMERICS = ("f32", "q8", "q8x2")


def layer_launches(p, layer: int) -> int:
    """The kernels one decode layer launches (a fold that runs as two kernels counts two)."""
    return sum(len(x.launch.kernels()) for x in p.launches if x.layer == layer)


def plan_figures(path: str, chunk: int = 1) -> list[tuple]:
    """Per numerics (and fuse_quant held): the middle layer's launches, the Quant launches, all launches, the arena's
    bytes, its lower bound and their ratio, and the plan's seconds, for a step of `chunk` rows."""
    from lanefuse.engine.front.load import load_model
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan

    cfg, _ = load_model(path, max_len=64)
    g = build_step(cfg, chunk)
    rows = []
    for numerics, held in (("f32", ()), ("q8", ()), ("q8", ("fuse_quant",)), ("q8x2", ()), ("q8x2", ("fuse_quant",))):
        t = time.perf_counter()
        p = plan(g, numerics=numerics, held=held)
        mid = cfg.layers // 2
        rows.append((numerics + (" held fuse_quant" if held else ""), layer_launches(p, mid),
                     p.census.get("quant", 0), len(p.launches), p.arena.bytes, p.arena.lower_bound, p.arena.ratio,
                     time.perf_counter() - t))
    return rows


def child_decode(path: str, numerics: str, tokens: int) -> dict:
    from cpu_decode import timed_generate
    from lanefuse.engine.front.load import load_model
    from lanefuse.lane.lower.plan import PlanOptions
    from lanefuse.lane.run.step import plan_step_fn

    cfg, weights = load_model(path, max_len=64)
    step_fn, label = plan_step_fn(weights, "cpu", PlanOptions(numerics=numerics))
    _, ms, got = timed_generate(cfg, weights, step_fn, PROMPT, tokens)
    return {"ms": ms, "tokens": got, "label": label}


def child_side_by_side(path: str, tokens: int, rounds: int) -> dict:
    """q8 and f32 fast CPU runners on one file's weights in this process, their decodes interleaved (f32, q8, f32,
    ...) `rounds` times: each numerics' median decode step, and their tokens."""
    from cpu_decode import timed_decode
    from lanefuse.engine.front.load import load_model
    from lanefuse.lane.lower.plan import PlanOptions
    from lanefuse.lane.run.generate import generate
    from lanefuse.lane.run.step import plan_step_fn

    cfg, weights = load_model(path, max_len=64)
    fns = {n: plan_step_fn(weights, "cpu", PlanOptions(numerics=n))[0] for n in ("f32", "q8")}
    times: dict[str, list[float]] = {n: [] for n in fns}
    timed = {n: timed_decode(fns[n], times[n]) for n in fns}
    out: dict[str, list[int]] = {}

    for n in fns:  # plans, weights read once
        generate(cfg, weights, PROMPT, 2, step_fn=timed[n])
        times[n].clear()
    for _ in range(rounds):
        for n in fns:
            out[n] = generate(cfg, weights, PROMPT, tokens + 1, step_fn=timed[n]).generated_ids
    return {n: {"ms": 1e3 * statistics.median(times[n]), "tokens": out[n]} for n in fns}


def run_child(*args: str, threads: int) -> dict:
    import subprocess

    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    r = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env,
                       timeout=1800)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="q8_0,q4_0")
    ap.add_argument("--layers", type=int, default=4)  # the middle layer counted: not the last (the head's norm)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plans-only", action="store_true", help="the plans' figures only, no CPU decode timing")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, path = args.child[0], args.child[1]
        res = child_llamacpp(path, args.tokens, args.threads) if kind == "llamacpp" else \
            child_side_by_side(path, args.tokens, args.rounds) if kind == "side" else \
            child_decode(path, kind, args.tokens)
        print(json.dumps(res))
        return 0
    shape = dict(SHAPE, layers=args.layers)
    print(f"Qwen3-shaped random model: {shape}; {args.tokens} decode steps, {args.rounds} rounds, "
          f"{args.threads} threads")
    from cpu_decode import have_llama_cpp

    have_llama = have_llama_cpp()
    with tempfile.TemporaryDirectory() as d:
        for fmt in args.formats.split(","):
            path = os.path.join(d, f"{fmt}.gguf")
            write_model(path, fmt, shape)
            print(f"\n{fmt} file ({os.path.getsize(path) / 1e6:,.0f} MB)")
            for chunk in (1, 8):
                print(f"  {'decode step' if chunk == 1 else f'prefill chunk of {chunk} rows'}")
                print(f"  {'numerics':<22} {'launches/layer':>14} {'quant':>6} {'launches':>9} {'arena B':>11} "
                      f"{'lower bound':>11} {'ratio':>7}")
                for name, per_layer, quants, total, arena, low, ratio, _ in plan_figures(path, chunk):
                    print(f"  {name:<22} {per_layer:>14} {quants:>6} {total:>9} {arena:>11,} {low:>11,} "
                          f"{ratio:>7.4f}")
            if args.plans_only:
                continue
            kinds = list(NUMERICS) + (["llamacpp"] if have_llama else [])
            for kind in kinds:
                rs = [run_child(kind, path, "--tokens", str(args.tokens), "--threads", str(args.threads),
                                threads=args.threads) for _ in range(args.rounds)]
                bad = [r["error"] for r in rs if "error" in r]
                if bad:
                    print(f"  CPU {kind:<9} error: {bad[0]}")
                    continue
                ms = statistics.median(r["ms"] for r in rs)
                what = "llama.cpp" if kind == "llamacpp" else f"lanefuse {kind}"
                each = ", ".join(f"{r['ms']:.1f}" for r in rs)
                print(f"  CPU {what:<15} {ms:8.1f} ms/token (rounds: {each}); tokens {rs[0]['tokens'][:6]}")
            r = run_child("side", path, "--tokens", str(args.tokens), "--rounds", str(args.rounds),
                          threads=args.threads)
            if "error" in r:
                print(f"  CPU side by side error: {r['error']}")
                continue
            f, q = r["f32"], r["q8"]
            print(f"  CPU side by side, one process, interleaved: f32 {f['ms']:.1f}, q8 {q['ms']:.1f} ms/token "
                  f"(q8/f32 {q['ms'] / f['ms']:.2f}; goal <= 2); same tokens: {f['tokens'] == q['tokens']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
