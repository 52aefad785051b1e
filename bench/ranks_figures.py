"""Tensor-parallel figures (issue 38): for a Qwen3-8B-shaped and a Llama-3-70B-shaped config in bf16 over R ranks,
each rank's weight bytes (against the H200's 141 GB), the collectives of a decode step and their bytes, the launches
of rank 0's decode step with all_reduce_add_norm and held, the link time the lane's model PREDICTS for them (knobs
link_gbps 450, link_us 10: assumptions, never measured here), and plan time of rank 0's step against one rank's
(median of --rounds; the machine may be shared). Then CPU ranks' decode tokens/s (gloo processes, each rank's plan on
the numpy backend's fast twins) against one rank on the same machine: a random Qwen3-shaped f32 checkpoint made here.

--models picks the shapes (qwen3-8b, llama-3-70b, qwen3-next-80b-a3b: bench/qnext_figures.py's Qwen3-Next-80B-A3B,
its gated delta-net layers split by key heads, its 512 experts by rank, its 2 KV heads replicated past 2 ranks;
qwen2-57b-a14b: Qwen2-57B-A14B's shape, 64 experts and a sigmoid-gated shared expert of 20480, 4 KV heads). A rank
count a shape's split refuses is a line saying why.

    python bench/ranks_figures.py [--rounds 3] [--ranks 1,2,8] [--layers N] [--cpu-ranks 1,2] [--tokens 16]
                                  [--models qwen3-8b,llama-3-70b]"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

from lanefuse.engine.front.model import ModelConfig


def shapes(layers: int | None) -> dict[str, ModelConfig]:
    q = ModelConfig("Qwen3ForCausalLM", 4096, layers or 36, 32, 8, 128, 12288, 151936, eps=1e-6, qk_norm=True,
                    max_len=4096, name="qwen3-8b")
    ll = ModelConfig("LlamaForCausalLM", 8192, layers or 80, 64, 8, 128, 28672, 128256, eps=1e-5, max_len=4096,
                     name="llama-3-70b")
    out = {c.name: dataclasses.replace(c, formats=tuple((w, "bf16") for w in c.weight_names())) for c in (q, ll)}
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from qnext_figures import qwen3_next_80b_a3b

    out["qwen3-next-80b-a3b"] = qwen3_next_80b_a3b(4096)  # its 48 layers whatever --layers says (its layer types)
    out["qwen2-57b-a14b"] = qwen2_57b_a14b(layers)
    return out


def qwen2_57b_a14b(layers: int | None) -> ModelConfig:
    """Qwen2-57B-A14B's shape from its config.json's keys: 28 layers, 28 heads over 4 KV heads of 128, 64 experts of
    2560 (top 8, not renormalized), a sigmoid-gated shared expert of 20480; bf16 rows, 4096 positions."""
    from lanefuse.engine.front.hfconfig import config_from_hf

    c = {"architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 3584, "num_hidden_layers": layers or 28,
         "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
         "moe_intermediate_size": 2560, "shared_expert_intermediate_size": 20480, "num_experts": 64,
         "num_experts_per_tok": 8, "norm_topk_prob": False, "vocab_size": 151936, "rope_theta": 1000000.0,
         "rms_norm_eps": 1e-6, "max_position_embeddings": 32768}
    cfg = config_from_hf(c, "Qwen2-57B-A14B shape", max_len=4096, name="qwen2-57b-a14b")
    return dataclasses.replace(cfg, formats=tuple((w, "bf16") for w, sh in cfg.weight_names().items() if len(sh) == 2))


def plan_figures(cfg: ModelConfig, ranks: list[int], rounds: int) -> list[dict]:
    from lanefuse.engine.front.parallel import build_rank_step
    from lanefuse.lane.cli.ranks import rank_report
    from lanefuse.lane.lower.knobs import Knobs
    from lanefuse.lane.lower.plan import plan

    from lanefuse.engine.errors import UserError
    from lanefuse.engine.front.parallel import check_ranks

    rows = []
    for R in ranks:
        try:
            check_ranks(cfg, R)
        except UserError as e:
            rows.append({"model": cfg.name, "ranks": R, "refused": str(e)})
            continue
        rep = rank_report(cfg, R, 1, Knobs())
        g = build_rank_step(cfg, 0, R, 1)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            s = plan(g)
            times.append(time.perf_counter() - t0)
        held = plan(g, held=["all_reduce_add_norm"]) if R > 1 else s
        c = rep["collectives"]
        rows.append({"model": cfg.name, "ranks": R, "weights_gb": rep["rank"][0]["weight_bytes"] / 1e9,
                     "fits_141": rep["rank"][0]["fits"], "all_reduce": c.get("all_reduce", {}).get("count", 0),
                     "layers": cfg.layers,
                     "bytes_a_step": sum(v["bytes"] for v in c.values()),
                     "link_us_predicted": sum(v["us"] for v in c.values()), "launches": s.n_launches,
                     "launches_held": held.n_launches, "plan_s": statistics.median(times)})
    return rows


def cpu_ranks(ranks: list[int], tokens: int) -> list[dict]:
    """Decode tokens/s of R gloo processes (each rank's plan, fast twins) on a random Qwen3-shaped f32 checkpoint."""
    import numpy as np
    from safetensors.numpy import save_file

    from lanefuse.engine.front.model import build_step
    from lanefuse.engine.front.stepweights import random_weights
    from lanefuse.lane.run.ranks import launch

    cfg = ModelConfig("Qwen3ForCausalLM", 1024, 8, 16, 8, 64, 3072, 32000, qk_norm=True, max_len=128, name="cpu")
    hf = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
          "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64,
          "num_hidden_layers": 8, "vocab_size": 32000, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "max_position_embeddings": 128, "torch_dtype": "float32", "tie_word_embeddings": False}
    out = []
    with tempfile.TemporaryDirectory() as d:
        w = random_weights(build_step(cfg, 1), 3)
        save_file({n: np.asarray(w.get(n), np.float32) for n in cfg.weight_names()}, os.path.join(d, "model.safetensors"))
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(hf, f)
        for R in ranks:
            job = dict(model=d, prompt=[1, 2, 3, 4], n_tokens=tokens, chunk=4, max_len=128, plan=True,
                       exact_twins=False)
            res = launch(R, [job])[0]
            decode_s = max(r["decode_s"] for r in res)
            out.append({"ranks": R, "tokens": res[0]["tokens"][:6], "decode_tok_s": (tokens - 1) / decode_s})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", default="1,2,8")
    ap.add_argument("--layers", type=int, default=None, help="layers of both shapes (default: the models')")
    ap.add_argument("--cpu-ranks", default="1,2")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--models", default="qwen3-8b,llama-3-70b", help="shapes, comma-separated (also: "
                    "qwen3-next-80b-a3b)")
    a = ap.parse_args()
    ranks = [int(x) for x in a.ranks.split(",")]
    print("model                     R  weights/rank  fits 141 GB  all-reduces (a layer)  collective B/step  "
          "link us (PREDICTED)  launches (held)  plan s")
    known = shapes(a.layers)
    for name in a.models.split(","):
        if name not in known:
            raise SystemExit(f"--models: no shape `{name}` (known: {', '.join(known)})")
        cfg = known[name]
        for r in plan_figures(cfg, ranks, a.rounds):
            if "refused" in r:
                print(f"{r['model']:<24} {r['ranks']:>2} refused: {r['refused']}")
                continue
            per = f"{r['all_reduce']} ({r['all_reduce'] / r['layers']:g})"
            print(f"{r['model']:<24} {r['ranks']:>2} {r['weights_gb']:>10.2f} GB  {'yes' if r['fits_141'] else 'no':>11}"
                  f"  {per:>21}  {r['bytes_a_step']:>17,}  {r['link_us_predicted']:>19.1f}  "
                  f"{r['launches']:>8} ({r['launches_held']})  {r['plan_s']:>6.2f}")
    if a.cpu_ranks:
        print("\nCPU ranks (gloo processes, each rank's plan on the numpy fast twins), Qwen3-shaped f32, hidden 1024, "
              "8 layers: MEASURED on this machine")
        base = None
        for r in cpu_ranks([int(x) for x in a.cpu_ranks.split(",")], a.tokens):
            base = base or r["tokens"]
            print(f"  R = {r['ranks']}: {r['decode_tok_s']:.1f} decode tokens/s; tokens {r['tokens']} "
                  f"({'same as R = 1' if r['tokens'] == base else 'DIFFERENT from R = 1'})")


if __name__ == "__main__":
    main()
