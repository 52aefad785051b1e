"""The seed's saving of forms sharing one arena (seed 003: "The forms share the arena, one form running at a time"):
for the demo model, a Qwen3-8B-shaped and a Qwen3-30B-A3B-shaped (an expert mixture: 128 experts of 768, top-8,
bench/moe_figures.py's shape, bf16 rows) config-only plan, each form's own arena (its decode step, its prefill chunk
of `chunk_rows`, a shorter last chunk, a batch's decode step) against the one arena they share — the KV caches placed
once at the same offsets for every form, each form's step-local arrays overlaid past them. No weights, no device:
plans only. Run: python bench/arena_forms.py [--layers N] [--moe-layers N] [--chunk R] [--tail R] [--batch B]
[--numerics f32|q8|q8x2] [--json]"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from lanefuse.engine.front.demo import demo_config
from lanefuse.engine.front.model import ModelConfig, build_step
from lanefuse.lane.lower.buffers import forms_of
from lanefuse.lane.lower.plan import plan


def qwen3_8b(layers: int, max_len: int) -> ModelConfig:
    return ModelConfig("Qwen3ForCausalLM", hidden=4096, layers=layers, heads=32, kv_heads=8, head_dim=128,
                       inter=12288, vocab=151936, qk_norm=True, max_len=max_len, name=f"qwen3-8b-shape-{layers}")


def figure(cfg: ModelConfig, widths: dict[str, tuple[int, int]], numerics: str) -> dict:
    """{forms: {label: own arena bytes}, apart, shared, tables (bytes once), plan_s}: the plans of `widths` {label:
    (rows, batch)}; a batch's form has caches of its own (a slot a sequence), so it shares the arena, not the tables.
    Under q8 / q8x2 the products' rows are q8_0 (a quantized activation only where they are block-quantized)."""
    if numerics != "f32":
        cfg = dataclasses.replace(cfg, formats=tuple((n, "q8_0") for n, s in cfg.weight_names().items()
                                                     if len(s) == 2 and n != "model.embed_tokens.weight"))
    t0 = time.perf_counter()
    plans = {label: plan(build_step(cfg, rows, batch), numerics=numerics) for label, (rows, batch) in widths.items()}
    one = {k: p for k, p in plans.items() if p.batch == 1}
    f = forms_of(one)
    batch = {k: p.arena.bytes for k, p in plans.items() if p.batch > 1}
    # the batch's own tables are apart in both counts; its step-local arrays overlay the others'
    over = max([f.bytes - f.base] + list(batch.values()))
    return {"forms": {k: p.arena.bytes for k, p in plans.items()}, "tables": f.base,
            "apart": f.apart + sum(batch.values()), "shared": f.base + over,
            "step_local_apart": sum(p.arena.bytes for p in plans.values()), "step_local_shared": over,
            "plan_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36, help="the Qwen3-8B shape's layers (36: the model's)")
    ap.add_argument("--moe-layers", type=int, default=48, help="the Qwen3-30B-A3B shape's layers (48: the model's)")
    ap.add_argument("--chunk", type=int, default=512, help="the prefill chunk (the lane's chunk_rows knob)")
    ap.add_argument("--tail", type=int, default=100, help="a prompt's last, shorter chunk")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=4096, help="the Qwen3-8B shape's cache rows")
    ap.add_argument("--numerics", default="f32")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    out = {}
    demo = demo_config()
    out["demo"] = figure(demo, {"decode": (1, 1), "chunk 64": (64, 1), "chunk 23": (23, 1),
                                f"batch {a.batch}": (1, a.batch)}, a.numerics)
    out["qwen3-8b"] = figure(qwen3_8b(a.layers, a.ctx), {"decode": (1, 1), f"chunk {a.chunk}": (a.chunk, 1),
                                                          f"chunk {a.tail}": (a.tail, 1),
                                                          f"batch {a.batch}": (1, a.batch)}, a.numerics)
    from moe_figures import qwen3_30b_a3b  # bench/ is this script's directory: on the path when run as a script

    moe = dataclasses.replace(qwen3_30b_a3b(a.moe_layers), max_len=a.ctx)
    out["qwen3-30b-a3b"] = figure(moe, {"decode": (1, 1), f"chunk {a.chunk}": (a.chunk, 1),
                                        f"chunk {a.tail}": (a.tail, 1), f"batch {a.batch}": (1, a.batch)}, a.numerics)
    if a.json:
        print(json.dumps(out, indent=1))
        return
    for model, r in out.items():
        print(f"{model} ({a.numerics}): " + ", ".join(f"{k} {v:,} B" for k, v in r["forms"].items()))
        print(f"  step-local arenas apart {r['step_local_apart']:,} B, shared {r['step_local_shared']:,} B "
              f"(x{r['step_local_apart'] / max(r['step_local_shared'], 1):.2f}); with the caches once "
              f"({r['tables']:,} B): {r['apart']:,} B apart, {r['shared']:,} B shared "
              f"({r['apart'] - r['shared']:,} B saved, {100 * (r['apart'] - r['shared']) / r['apart']:.1f}%); "
              f"planned in {r['plan_s']} s")


if __name__ == "__main__":
    main()
