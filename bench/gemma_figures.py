"""Gemma's figures, side by side in one run: launches per decode layer of Gemma 2 and Gemma 3 shapes (the census);
the whole plan() of a gemma-2-9b shape (42 layers) and a gemma-3-27b shape (62 layers) beside the dense Qwen3-8B
shape (36 layers); CPU decode ms/token of a small random Gemma 2 model, lanefuse's fast numpy runner against
transformers eager on the same model and threads (rounds interleaved, medians: the machine may be shared).

    python bench/gemma_figures.py [--repeat 3] [--rounds 5] [--tokens 24] [--threads 2] [--no-decode] [--json FILE]

The shapes are read from config.json dicts as the hub holds them (no weights: planned as bf16 checkpoint rows).
transformers runs in a subprocess whose cwd and sys.path leave this checkout out (bench/cpu_decode.py says why)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# google/gemma-2-9b and google/gemma-3-27b-it's text_config as their config.json give them (keys left out take
# transformers' defaults, as the front does)
GEMMA2_9B = {"architectures": ["Gemma2ForCausalLM"], "hidden_size": 3584, "num_hidden_layers": 42,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "intermediate_size": 14336,
             "vocab_size": 256000, "query_pre_attn_scalar": 256, "sliding_window": 4096,
             "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
             "max_position_embeddings": 8192, "rope_theta": 10000.0, "torch_dtype": "bfloat16"}
GEMMA3_27B = {"architectures": ["Gemma3ForConditionalGeneration"], "torch_dtype": "bfloat16",
              "text_config": {"hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
                              "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
                              "head_dim": 128, "query_pre_attn_scalar": 168,
                              "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}}

# the CPU decode model: Gemma 2 shaped as bench/cpu_decode.py's Qwen3 one, a window that the run crosses
SMALL = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=64,
             intermediate_size=3072, vocab_size=32000, max_position_embeddings=512, sliding_window=16,
             query_pre_attn_scalar=64, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)

def shape(c: dict, name: str, max_len: int = 4096):
    """A config dict's shape, every matrix planned as bf16 checkpoint rows."""
    from lanefuse.engine.front.hfconfig import config_from_hf

    cfg = config_from_hf(c, name, max_len=max_len, name=name)
    return dataclasses.replace(cfg, formats=tuple((n, "bf16") for n, s in cfg.weight_names().items() if len(s) == 2))


def census(out: dict, table) -> None:
    from lanefuse.lane.lower.plan import plan

    print("launches per decode layer (lane cuda, f32 numerics)")
    for name, c in (("gemma-2-9b", GEMMA2_9B), ("gemma-3-27b", GEMMA3_27B)):
        cfg = shape(c, name)
        s = plan(cfg.build_step(1), table=table)
        body = [v for k, v in s.per_layer().items() if 0 <= k < cfg.layers - 1]
        layer = [x.launch.census for x in s.launches if x.layer == 1]  # layer 1 files layer 0's down product fold
        out["launches_per_layer"][name] = max(body)
        out.setdefault("census", {})[name] = s.census
        print(f"  {name:12s} {max(body)} a layer (inner layers), {s.n_launches} a step, census {s.census}")
        print(f"  {'':12s} layer 1's launches: {', '.join(layer)}")


def plan_times(out: dict, table, repeat: int) -> None:
    from lanefuse.engine.front.model import ModelConfig, build_step
    from lanefuse.lane.lower.plan import plan

    q = ModelConfig("Qwen3ForCausalLM", 4096, 36, 32, 8, 128, 12288, 151936, qk_norm=True, rope_theta=1e6,
                    max_len=4096, name="qwen3-8b")
    q = dataclasses.replace(q, formats=tuple((n, "bf16") for n, s in q.weight_names().items() if len(s) == 2))
    print(f"whole plan() (engine + link + schedule + arena), decode step, median of {repeat}")
    for name, cfg in (("qwen3-8b", q), ("gemma-2-9b", shape(GEMMA2_9B, "gemma-2-9b")),
                      ("gemma-3-27b", shape(GEMMA3_27B, "gemma-3-27b"))):
        g = build_step(cfg, 1)
        times, eng, cpu = [], [], []
        for _ in range(repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            s = plan(g, table=table)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            eng.append(s.timings["engine_s"])
        med = statistics.median(times)
        out["plan_seconds"][name] = {"layers": cfg.layers, "total": round(med, 4), "cpu": round(statistics.median(cpu), 4),
                                     "engine": round(statistics.median(eng), 4), "launches": s.n_launches}
        print(f"  {name:12s} {cfg.layers} layers: {med:.3f} s (this process's CPU time {statistics.median(cpu):.3f} s: "
              f"the rest is a shared machine's other work; engine {statistics.median(eng):.3f} s, "
              f"{s.n_launches} launches)")


def decode(out: dict, args) -> None:
    from cpu_decode import PROMPT, Lanefuse, hf_cmd, side_by_side

    elsewhere = tempfile.mkdtemp(prefix="lanefuse-gemma-bench-")
    folder = os.path.join(elsewhere, "gemma2")
    env = dict(os.environ, PYTHONPATH="")
    try:
        subprocess.run(hf_cmd("build", folder, str(args.threads), json.dumps(dict(SMALL, family="Gemma2")),
                              "float32"), cwd=elsewhere, env=env, check=True, stdout=subprocess.DEVNULL)
        lf = Lanefuse(folder, exact=False)
        r = side_by_side(lf, folder, elsewhere, env, args.rounds, args.tokens, args.threads, attn="eager")
        lf_ms, hf_ms, bw, same = r["lanefuse"], r["transformers"], r["bandwidth"], r["same"]
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)
    lms, hms = statistics.median(lf_ms), statistics.median(hf_ms)
    params = sum(math.prod(lf.weights.shape(n)) for n in lf.weights.store.names())
    out["cpu_decode"] = {"lanefuse_ms": round(lms, 2), "transformers_ms": round(hms, 2), "speedup": round(hms / lms, 3),
                         "same_tokens": same, "params": params, "threads": args.threads}
    print(f"CPU decode: Gemma 2 shaped, {SMALL['num_hidden_layers']} layers, {params / 1e6:.0f}M parameters, f32, "
          f"window {SMALL['sliding_window']} on the even layers, soft caps 50 / 30; {len(PROMPT)}-token prompt, "
          f"{args.tokens} decode steps a round, {args.rounds} rounds interleaved")
    print(f"  lanefuse ({lf.label}, {os.environ['OPENBLAS_NUM_THREADS']} BLAS threads): {lms:.1f} ms/token  "
          f"(rounds: {', '.join(f'{v:.1f}' for v in lf_ms)})")
    print(f"  transformers eager, {args.threads} threads: {hms:.1f} ms/token  "
          f"(rounds: {', '.join(f'{v:.1f}' for v in hf_ms)})")
    print(f"  lanefuse speed / transformers: {hms / lms:.2f}x; numpy f32 GEMV {statistics.median(bw):.1f} GB/s; "
          f"greedy tokens {'the same' if same else 'DIFFER'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="plan() runs a shape (median)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved decode rounds (medians over them)")
    ap.add_argument("--tokens", type=int, default=24, help="decode steps timed a round")
    ap.add_argument("--threads", type=int, default=2, help="torch's threads and numpy's BLAS threads")
    ap.add_argument("--no-decode", action="store_true", help="leave out the CPU decode comparison (needs torch)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))  # before numpy is first imported
    from lanefuse.engine.rules import load_table

    table = load_table()
    out: dict = {"launches_per_layer": {}, "plan_seconds": {}}
    census(out, table)
    plan_times(out, table, args.repeat)
    if not args.no_decode:
        decode(out, args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
