"""Batch figures (issue 16): launches per decode layer for a batch of 8 under `sequences` (its launches over the
sequences as one) and held (one launch a sequence), against one sequence's step; and the aggregate CPU decode
tokens/s of the numpy backend's fast runner for B = 1, 2, 4, 8 sequences on bench/cpu_decode.py's model shape (a
random Qwen3-shaped f32 model: hidden 1024, 8 layers, 16 heads, 8 kv heads, head_dim 64, intermediate 3072, vocab
32000; weights made here, no transformers needed). Rounds interleaved, medians: the machine may be shared.

    python bench/batch_figures.py [--rounds 3] [--steps 8] [--batches 1,2,4,8] [--layers 8] [--threads 2]

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
    a = ap.parse_args()
    _threads(a.threads)
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
