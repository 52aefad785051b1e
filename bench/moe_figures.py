"""Expert-mixture figures, side by side in one run: launches per decode layer (the census) of a Qwen3-30B-A3B-shaped
decode step; the whole plan() of that shape (48 layers, 128 experts, top-8) and of a gpt-oss-120b shape (36 layers,
128 experts, top-4) beside the dense Qwen3-8B shape's; the
bytes each decode step moves (a mixture reads only its chosen experts' rows); CPU decode ms/token of a small
Qwen3-MoE model against transformers on the same model and threads (bench/cpu_decode.py's measurement).

    python bench/moe_figures.py [--repeat 3] [--rounds 5] [--tokens 16] [--threads 2] [--no-cpu] [--json FILE]
        [--memo-off]

--memo-off also times each plan() with every component of the extraction eliminated alone (extract.solve_elimination's
memo=False: no layer reuses an equal layer's choices), beside the default, turn about in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from lanefuse.engine.front.model import ModelConfig, build_step
from lanefuse.engine.front.families.mixtures import MoeConfig
from lanefuse.engine.rules import load_table
from lanefuse.lane.lower.plan import plan

# a small Qwen3-MoE for the CPU figure: 16 experts of 512, top-4, over bench/cpu_decode.py's dense shape
CPU_SHAPE = dict(family="Qwen3Moe", hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=64, intermediate_size=3072, moe_intermediate_size=512, num_experts=16,
                 num_experts_per_tok=4, norm_topk_prob=True, vocab_size=32000, max_position_embeddings=512,
                 tie_word_embeddings=False)


def bf16(cfg: ModelConfig) -> ModelConfig:
    fmts = tuple((n, "bf16") for n, s in cfg.weight_names().items() if len(s) == 2)
    return ModelConfig(**{**cfg.__dict__, "formats": fmts})


def qwen3_30b_a3b(layers: int = 48) -> ModelConfig:
    """Qwen3-30B-A3B's shape (no weights needed to plan): 128 experts of 768, top-8, bf16 rows."""
    return bf16(ModelConfig("Qwen3MoeForCausalLM", 2048, layers, 32, 4, 128, 6144, 151936, qk_norm=True,
                            rope_theta=1e6, max_len=4096, name=f"qwen3-30b-a3b-shape-{layers}L",
                            moe=MoeConfig(128, 8, 768, True, tuple(range(layers)))))


def qwen3_8b(layers: int = 36) -> ModelConfig:
    return bf16(ModelConfig("Qwen3ForCausalLM", 4096, layers, 32, 8, 128, 12288, 151936, qk_norm=True,
                            rope_theta=1e6, max_len=4096, name=f"qwen3-8b-shape-{layers}L"))


def gptoss_120b(layers: int = 36, experts: str = "bf16") -> ModelConfig:
    """gpt-oss-120b's shape (config.json's keys, no weights): 128 experts of 2880, top-4, sliding layers of 128, YaRN,
    bf16 rows; `experts` "mxfp4" for the experts as a real checkpoint holds them (engine/formats/blocks.py's mxfp4)."""
    import dataclasses

    from lanefuse.engine.front.hfconfig import config_from_hf

    cfg = config_from_hf({"architectures": ["GptOssForCausalLM"], "num_hidden_layers": layers,
                          "num_local_experts": 128, "num_experts_per_tok": 4}, "gpt-oss-120b shape", max_len=4096,
                         name=f"gpt-oss-120b-shape-{layers}L")
    fmts = tuple((n, experts if n.endswith("proj.rows") and len(s) == 2 else "bf16")
                 for n, s in cfg.weight_names().items() if len(s) == 2)
    return dataclasses.replace(cfg, formats=fmts)


def timed_plan(cfg: ModelConfig, table, repeat: int, memo_off: bool = False) -> tuple[float, object, float | None]:
    """The median plan() seconds, the plan, and with `memo_off` the median with the extraction's memo off (the two
    timed turn about, so load on the machine falls on both alike; the plans must be equal)."""
    import functools

    from lanefuse.engine import extract

    g = build_step(cfg, 1)
    times, off, s = [], [], None
    solve = extract.solve_elimination
    for _ in range(repeat):
        t0 = time.perf_counter()
        s = plan(g, table=table)
        times.append(time.perf_counter() - t0)
        if memo_off:
            extract.solve_elimination = functools.partial(solve, memo=False)
            try:
                t0 = time.perf_counter()
                s_off = plan(g, table=table)
                off.append(time.perf_counter() - t0)
            finally:
                extract.solve_elimination = solve
            if [l.launch for l in s_off.launches] != [l.launch for l in s.launches]:
                raise SystemExit(f"{cfg.name}: the plan with the memo off differs")
    return statistics.median(times), s, (statistics.median(off) if off else None)


def cpu_figure(args) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cpu_decode

    elsewhere = tempfile.mkdtemp(prefix="lanefuse-bench-")
    folder = os.path.join(elsewhere, "qwen3moe")
    env = dict(os.environ, PYTHONPATH="")
    shape = dict(CPU_SHAPE, num_hidden_layers=args.layers)
    try:
        subprocess.run(cpu_decode.hf_cmd("build", folder, str(args.threads), json.dumps(shape), "float32"),
                       cwd=elsewhere, env=env, check=True, stdout=subprocess.DEVNULL)
        cpu_decode.measure(args, folder, elsewhere, env, family="Qwen3Moe")
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="plan() runs a shape (median)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=CPU_SHAPE["num_hidden_layers"])
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU decode figure (it needs torch)")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--memo-off", action="store_true", help="time plan() with the extraction's memo off beside it")
    args = ap.parse_args()
    args.exact, args.dtype = False, "float32"
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))
    table = load_table()
    out = {}
    print(f"whole plan() of a decode step (engine + link + schedule + arena), median of {args.repeat}")
    for name, cfg in (("qwen3-30b-a3b", qwen3_30b_a3b()), ("gpt-oss-120b", gptoss_120b()),
                      ("gpt-oss-120b-mxfp4", gptoss_120b(experts="mxfp4")), ("qwen3-8b", qwen3_8b())):
        sec, s, sec_off = timed_plan(cfg, table, args.repeat, args.memo_off)
        body = [v for k, v in s.per_layer().items() if 0 < k < cfg.layers - 1]
        wb = sum(s.weight_bytes().values())
        out[name] = {"plan_s": round(sec, 4), "launches": s.n_launches, "per_layer": max(body),
                     "census": s.census, "weight_bytes": wb, "cost_us": round(s.cost_us, 1)}
        if sec_off is not None:
            out[name]["plan_s_memo_off"] = round(sec_off, 4)
            print(f"  {name:14s} memo off (each layer's component eliminated alone): {sec_off:.3f} s, same plan")
        print(f"  {name:14s} {cfg.layers} layers: {sec:.3f} s (engine {s.timings['engine_s']:.3f} s); "
              f"{s.n_launches} launches, {max(body)} a layer; census {dict(sorted(s.census.items()))}")
        print(f"  {'':14s} weights read a decode step: {wb / 1e6:,.1f} MB "
              f"(estimated {s.cost_us:,.0f} µs on the lane's H200 knobs)")
        if cfg.moe is not None:
            moe = [l for l in s.launches if l.launch.census == "moe"]
            per = 17 / 32 if name.endswith("mxfp4") else 2  # bytes a value
            every = sum(cfg.moe.experts * 3 * cfg.moe.inter * cfg.hidden * per for _ in moe)
            chosen = sum(cfg.moe.k * 3 * cfg.moe.inter * cfg.hidden * per for _ in moe)
            print(f"  {'':14s} experts' rows read: {chosen / 1e6:,.1f} MB of {every / 1e6:,.1f} MB held "
                  f"({cfg.moe.k} of {cfg.moe.experts} a layer)")
            layer = [k.census for l in s.launches if l.layer == 1 for k in l.launch.kernels()]
            print(f"  {'':14s} layer 1's kernels: {', '.join(layer)}")
    if not args.no_cpu:
        print("CPU decode, a small Qwen3-MoE (16 experts of 512, top-4), lanefuse's fast numpy runner against "
              "transformers")
        cpu_figure(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
