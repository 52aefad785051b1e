"""Batch figures (issue 16): launches per decode layer for a batch of 8 under `sequences` (its launches over the
sequences as one) and held (one launch a sequence), against one sequence's step; and the aggregate CPU decode
tokens/s of the numpy backend's fast runner for B = 1, 2, 4, 8 sequences on bench/cpu_decode.py's model shape (a
random Qwen3-shaped f32 model: hidden 1024, 8 layers, 16 heads, 8 kv heads, head_dim 64, intermediate 3072, vocab
32000; weights made here, no transformers needed). Rounds interleaved, medians: the machine may be shared.

    python bench/batch_figures.py [--rounds 3] [--steps 8] [--batches 1,2,4,8] [--layers 8] [--threads 2]
    python bench/batch_figures.py --families        # the two families' batch plans alone (no CPU rates)

The families' section (issue 40): the Qwen3-Next-80B-A3B and DeepSeek-V3 shapes (bench/qnext_figures.py,
bench/deepseek_figures.py: shape only, bf16 rows, no weights), their decode step for one sequence and batches of 8
and 64 (every sequence's rings, delta-rule states and caches a slot; the latent caches a slot) and 8 held apart:
launches a step, by layer, and the lane's cost model's step time (a PREDICTION, no device).

The GPU figure (B = 1..64 on the Qwen3-8B-shaped step) lives in bench/gpu_decode.py --batch."""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _threads(n: int) -> None:
    for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(v, str(n))


def shape(layers: int):
    from lanefuse.engine.front.model import ModelConfig

    return ModelConfig(arch="Qwen3ForCausalLM", hidden=1024, layers=layers, heads=16, kv_heads=8, head_dim=64,
                       inter=3072, vocab=32000, qk_norm=True, max_len=128, name="cpu_decode")


def launches(cfg) -> None:
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan

    def per_layer(p) -> str:
        counts = sorted({v for k, v in p.per_layer().items() if k >= 0})
        return "/".join(map(str, counts))

    one = plan(build_step(cfg, 1))
    b8 = plan(build_step(cfg, 1, batch=8))
    held = plan(build_step(cfg, 1, batch=8), held=["sequences"])
    print("launches per decode layer (the last layer takes the final norm's fold too):")
    print(f"  one sequence               : {per_layer(one):>8}  ({one.n_launches} a step)")
    print(f"  batch of 8, sequences      : {per_layer(b8):>8}  ({b8.n_launches} a step)")
    print(f"  batch of 8, sequences held : {per_layer(held):>8}  ({held.n_launches} a step)")
    kinds = [x.launch.census for x in b8.launches if x.layer == 0]
    print(f"  batch of 8, layer 0 kinds  : {', '.join(kinds)}")


def families() -> None:
    """Qwen3-Next's and DeepSeek-V3's batch decode steps at their real shapes: launches and the cost model's time."""
    from deepseek_figures import deepseek_v3
    from qnext_figures import qwen3_next_80b_a3b

    from lanefuse.engine.rules import load_table
    from lanefuse.lane.lower.plan import plan

    table = load_table()
    for cfg in (qwen3_next_80b_a3b(4096), deepseek_v3()):
        print(f"{cfg.name} decode, KV caches of 4096 rows a slot (the lane's cost model: PREDICTIONS, no device):")
        for b, held in ((1, ()), (8, ()), (64, ()), (8, ("sequences",))):
            t0 = time.perf_counter()
            p = plan(cfg.build_step(1, batch=b), held=list(held), table=table)
            by = sorted({v for k, v in p.per_layer().items() if k >= 0})
            moe = [x.launch for x in p.launches if x.launch.census == "moe"]
            what = f"batch of {b}" + (", sequences held" if held else "") if b > 1 else "one sequence"
            print(f"  {what:<27}: {p.n_launches:>4} launches ({'/'.join(map(str, by))} a layer), "
                  f"estimated {p.cost_us:9.1f} us a step, {p.cost_us / b:8.1f} a token; mixture rows sorted: "
                  f"{'yes' if moe and moe[0].sort else 'no'} (planned in {time.perf_counter() - t0:.1f} s)")


def decode_rates(cfg, weights, batches, steps: int, rounds: int) -> None:
    import numpy as np

    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.batch import batch_caches
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    runners = {}
    for b in batches:
        p = plan(build_step(cfg, 1, batch=b))
        runners[b] = NumpyRunner(p, weights, exact=False)
    rates: dict[int, list[float]] = {b: [] for b in batches}
    rng = np.random.default_rng(16)
    for _ in range(rounds):
        for b in batches:  # interleaved: a busy moment of the machine touches every B alike
            env = batch_caches(cfg, b)
            for t in env.values():
                t[:8] = rng.standard_normal(t[:8].shape).astype(np.float32)
            env["token"] = rng.integers(0, cfg.vocab, b).astype(np.int32)
            env["pos"] = np.full(b, 8, dtype=np.int32)
            r = runners[b]
            r.step(env)  # warm
            t0 = time.perf_counter()
            for _ in range(steps):
                env["pos"] += 1
                out = r.step(env)
                env["token"] = np.asarray(out["next"], dtype=np.int32)
            rates[b].append(b * steps / (time.perf_counter() - t0))
    print(f"aggregate CPU decode (numpy fast runner, {cfg.layers} layers, f32; median of {rounds} rounds of "
          f"{steps} steps):")
    base = statistics.median(rates[batches[0]]) / batches[0]
    for b in batches:
        m = statistics.median(rates[b])
        print(f"  B = {b:>2}: {m:8.1f} tokens/s  ({m / b:6.1f} a sequence; x{m / base:4.2f} one sequence's)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--families", action="store_true", help="the Qwen3-Next and DeepSeek-V3 shapes' batch plans only")
    a = ap.parse_args()
    _threads(a.threads)
    if a.families:
        families()
        return
    from lanefuse.engine.front.demo import random_arrays
    from lanefuse.engine.front.weights import Weights

    cfg = shape(a.layers)
    launches(cfg)
    t0 = time.perf_counter()
    weights = Weights.from_dict(random_arrays(cfg, 18), cfg)
    print(f"(random weights made in {time.perf_counter() - t0:.1f} s)")
    decode_rates(cfg, weights, [int(b) for b in a.batches.split(",")], a.steps, a.rounds)


if __name__ == "__main__":
    main()
