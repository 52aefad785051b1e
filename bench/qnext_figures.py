"""Qwen3-Next figures, side by side in one run: launches per decode layer of each layer type (a gated delta-net
layer and a gated full-attention layer) of a Qwen3-Next-80B-A3B-shaped decode step; the whole plan() of that shape
(48 layers, 512 experts, top-10; shape only, no weights) beside the dense Qwen3-8B shape's; the state bytes a sequence
carries (the delta-net layers' convolution rings and recurrent states) against the full-attention layers' KV bytes;
and the same shape in q8_0 and q4_k under --numerics q8: a delta-net layer's token mixer and the Quant launches left
(the delta launch quantizing its output for the out product: gdn_output_quant; on q4_k rows the q8_K form).

    python bench/qnext_figures.py [--repeat 3] [--ctx 4096] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

from lanefuse.engine.front.hfconfig import config_from_hf
from lanefuse.engine.front.model import ModelConfig, build_step
from lanefuse.engine.rules import load_table
from lanefuse.lane.lower.plan import plan


def bf16(cfg: ModelConfig) -> ModelConfig:
    fmts = tuple((n, "bf16") for n, s in cfg.weight_names().items() if len(s) == 2)
    return dataclasses.replace(cfg, formats=fmts)


def qwen3_next_80b_a3b(ctx: int) -> ModelConfig:
    """Qwen3-Next-80B-A3B's shape from its config.json's keys (transformers' defaults are that model's): 48 layers,
    every fourth full attention, 512 experts of 512, top-10, a shared expert; bf16 rows."""
    c = {"architectures": ["Qwen3NextForCausalLM"], "max_position_embeddings": 262144, "rope_theta": 10_000_000.0,
         "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 16,
         "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 5120, "moe_intermediate_size": 512,
         "shared_expert_intermediate_size": 512, "num_experts": 512, "num_experts_per_tok": 10}
    return bf16(config_from_hf(c, "Qwen3-Next-80B-A3B shape", max_len=ctx, name="qwen3-next-80b-a3b-shape"))


def qwen3_8b(ctx: int) -> ModelConfig:
    return bf16(ModelConfig("Qwen3ForCausalLM", 4096, 36, 32, 8, 128, 12288, 151936, qk_norm=True, rope_theta=1e6,
                            max_len=ctx, name="qwen3-8b-shape"))


def timed_plan(cfg: ModelConfig, table, repeat: int):
    """The median seconds of `repeat` plan() calls of cfg's decode step, the last plan, and the fastest call's seconds
    (this machine's speed swings by half from minute to minute: the median and the least side by side). The plan before
    is freed outside the timing (a plan() call that rebinds the name would pay for freeing the last one's objects)."""
    g = build_step(cfg, 1)
    times, s = [], None
    for _ in range(repeat):
        s = None
        t0 = time.perf_counter()
        s = plan(g, table=table)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), s, min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="plan() runs a shape (median)")
    ap.add_argument("--ctx", type=int, default=4096, help="KV-cache rows a full-attention layer holds")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    table = load_table()
    out = {}
    nxt = qwen3_next_80b_a3b(args.ctx)
    print(f"whole plan() of a decode step (engine + link + schedule + arena), median of {args.repeat}")
    for name, cfg in (("qwen3-next-80b-a3b", nxt), ("qwen3-8b", qwen3_8b(args.ctx))):
        sec, s, least = timed_plan(cfg, table, args.repeat)
        per = s.per_layer()
        out[name] = {"plan_s": round(sec, 4), "plan_min_s": round(least, 4), "launches": s.n_launches,
                     "census": s.census, "cost_us": round(s.cost_us, 1)}
        print(f"  {name:18s} {cfg.layers} layers: {sec:.3f} s (least {least:.3f} s; engine {s.timings['engine_s']:.3f} s); "
              f"{s.n_launches} launches; census {dict(sorted(s.census.items()))}")
        if name.startswith("qwen3-next"):
            for kind in ("linear_attention", "full_attention"):
                i = next(i for i in range(1, cfg.layers - 1) if cfg.layer_types[i] == kind)
                kernels = [k.census for l in s.launches if l.layer == i for k in l.launch.kernels()]
                first = kernels.index("gemm_parts")  # before it: the previous layer's FFN ends (its down product's
                mixer = kernels[first: kernels.index("fold", first) + 1]  # fold, the finalize), then this layer's
                out[name][kind] = {"layer": i, "launches": per[i], "kernels": kernels, "mixer": len(mixer)}
                print(f"  {'':18s} a {kind} decode layer (layer {i}): {per[i]} launches: {', '.join(kernels)}; its "
                      f"token mixer {len(mixer)} ({', '.join(mixer)})")
    for fmt in ("q8_0", "q4_k"):  # q4_k: the products read llama.cpp's q8_K form (blocks of 256)
        q8 = dataclasses.replace(nxt, formats=tuple((n, fmt) for n, f in nxt.formats))
        t0 = time.perf_counter()
        s = plan(build_step(q8, 1), table=table, numerics="q8")
        sec = time.perf_counter() - t0
        i = next(i for i in range(1, q8.layers - 1) if q8.layer_types[i] == "linear_attention")
        kernels = [k.census for l in s.launches if l.layer == i for k in l.launch.kernels()]
        first = kernels.index("gemm_parts")
        mixer = kernels[first: kernels.index("fold", first) + 1]
        quantized = sum(1 for l in s.launches if l.launch.census == "delta" and l.launch.quant is not None)
        out[f"q8 {fmt}"] = {"plan_s": round(sec, 4), "launches": s.n_launches, "census": s.census, "mixer": mixer,
                            "deltas_quantizing": quantized}
        print(f"  {nxt.name} {fmt}, --numerics q8: {sec:.3f} s; {s.n_launches} launches ({s.census.get('quant', 0)} "
              f"Quant); a linear_attention layer's token mixer {len(mixer)} ({', '.join(mixer)}); {quantized} of "
              f"{s.census['delta']} delta launches write their output quantized; census "
              f"{dict(sorted(s.census.items()))}")
    st, kv = nxt.state_bytes()
    out["state_bytes"] = {"carried_states": st, "kv_caches": kv, "ctx": args.ctx}
    lin = nxt.layer_types.count("linear_attention")
    print(f"state carried a sequence ({nxt.name}, f32): {st / 2**20:,.1f} MiB in {lin} delta-net layers' rings and "
          f"recurrent states (independent of the context) against {kv / 2**20:,.1f} MiB of KV caches in "
          f"{nxt.layers - lin} full-attention layers at {args.ctx} positions ({kv / st:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
