"""The GPU suite's prepare step (a CPU machine with the engine): plan the steps the GPU machine will run and save
them, so that machine needs no solver. Writes into PLANDIR:

    demo-decode.json, demo-prefill8.json   the demo model's decode step and an 8-row prefill chunk
    qwen3-8b-decode.json                   a Qwen3-8B-shaped decode step (bf16 rows; random weights on the device)
    qwen3-8b-q8_0-decode.json, ...-q4_0-, ...-q4_k-, ...-q6_k-   the same step, its rows in GGUF block formats
    qwen3-8b-decode-b1.json ... -b64.json  the same step decoding a batch of B sequences (1024 cache rows a slot)
    tiny-hf/ + tiny-hf-decode.json         a tiny Qwen3 checkpoint (config.json as transformers writes it, seeded
                                           weights saved from numpy: no torch needed) and its plan
                                           (tests/test_plancheck.py runs it through `lanefuse run --plan`)
    tiny-gemma2/ + tiny-gemma2-decode.json a transformers-made tiny Gemma 2 (soft caps, a window of 8) and its plan
                                           (tests/test_gemma_gpu.py)
    families/                              every family the front reads and the GGUF formats q8_0, q4_0, q4_k, q6_k
                                           (under --numerics f32 and q8) as tiny transformers-made models: each one's
                                           decode and 8-row chunk plans and a pack of the constants they read (no
                                           checkpoint, no gguf package needed on the device); one family's batch step
                                           of 8 slots (tests/gpu_families.py, tests/test_gpu_model.py)

Then the size of PLANDIR, all of which must travel to the GPU machine (the suite keeps it under 40 MB).

    python bench/gpu_prepare.py PLANDIR
"""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np

from lanefuse.engine.front.demo import demo_config
from lanefuse.engine.front.model import build_step
from lanefuse.lane.lower.plan import plan
from lanefuse.lane.lower.planfile import save

BLOCK_PLANS = ("q8_0", "q4_0", "q4_k", "q6_k")  # the Qwen3-8B step's rows in these formats too (bench/gpu_decode.py)
BATCHES = (1, 2, 4, 8, 16, 32, 64)  # the batch decode steps of the Qwen3-8B shape (bench/gpu_decode.py's batch figure)
BATCH_SLOT = 1024  # cache rows a sequence of those: 64 slots' caches take 19 GB beside 16 GB of bf16 weights


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from lane_figures import qwen3_8b

    cfg = demo_config()
    save(plan(build_step(cfg, 1), source={"kind": "demo"}), os.path.join(out, "demo-decode.json"))
    save(plan(build_step(cfg, 8), source={"kind": "demo"}), os.path.join(out, "demo-prefill8.json"))
    save(plan(build_step(qwen3_8b(36), 1), source={"kind": "random"}), os.path.join(out, "qwen3-8b-decode.json"))
    for fmt in BLOCK_PLANS:
        save(plan(build_step(qwen3_8b(36, fmt), 1), source={"kind": "random"}),
             os.path.join(out, f"qwen3-8b-{fmt}-decode.json"))
    print("saved demo-decode, demo-prefill8, qwen3-8b-decode and its", ", ".join(BLOCK_PLANS), "variants")
    batch_cfg = dataclasses.replace(qwen3_8b(36), max_len=BATCH_SLOT)
    for b in BATCHES:
        save(plan(build_step(batch_cfg, 1, batch=b), source={"kind": "random"}),
             os.path.join(out, f"qwen3-8b-decode-b{b}.json"))
    print("saved qwen3-8b-decode-b" + "/".join(map(str, BATCHES)) + " (batch decode steps)")
    from lanefuse.engine.front.load import load_model

    folder = os.path.join(out, "tiny-hf")
    write_tiny_qwen3(folder)
    hcfg, _ = load_model(folder)
    save(plan(build_step(hcfg, 1), source={"kind": "path", "path": "tiny-hf"}), os.path.join(out, "tiny-hf-decode.json"))
    print("saved tiny-hf and its decode plan")
    try:
        import torch
        import transformers
    except ImportError:
        print("no torch/transformers here: skipping the transformers-made models")
        report_size(out)
        return
    folder = os.path.join(out, "tiny-gemma2")
    c = transformers.Gemma2Config(vocab_size=320, hidden_size=128, intermediate_size=200, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=8,
                                  query_pre_attn_scalar=32, max_position_embeddings=128)
    m = transformers.Gemma2ForCausalLM(c).eval()
    with torch.no_grad():  # norms away from 0 (Gemma's 1 + w), products of a scale that keeps the residual alive
        for name, p in m.named_parameters():
            p.copy_(0.3 * torch.randn_like(p) if p.dim() == 1 else torch.randn_like(p) / p.shape[1] ** 0.5)
    m.save_pretrained(folder)
    gcfg, _ = load_model(folder)
    save(plan(build_step(gcfg, 1), source={"kind": "path", "path": "tiny-gemma2"}),
         os.path.join(out, "tiny-gemma2-decode.json"))
    print("saved tiny-gemma2 and its decode plan")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import gpu_families

    gpu_families.prepare(os.path.join(out, gpu_families.SUBDIR))
    report_size(out)


def write_tiny_qwen3(folder: str) -> None:
    """A tiny Qwen3 checkpoint as transformers saves one (config.json, model.safetensors), its weights seeded and
    written from numpy, so the suite's checkpoint plan needs no torch."""
    import json

    from safetensors.numpy import save_file

    from lanefuse.engine.front.demo import random_arrays
    from lanefuse.engine.front.model import ModelConfig

    cfg = ModelConfig(arch="Qwen3ForCausalLM", hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, inter=256,
                      vocab=320, eps=1e-6, rope_theta=1000000.0, qk_norm=True, max_len=128, name="tiny-hf")
    os.makedirs(folder, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in random_arrays(cfg, seed=0).items()},
              os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": cfg.hidden,
                   "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
                   "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
                   "intermediate_size": cfg.inter, "vocab_size": cfg.vocab, "rms_norm_eps": cfg.eps,
                   "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_len,
                   "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32"}, f, indent=1)


def tree_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


def report_size(out: str) -> int:
    """Print what must travel to the GPU machine: PLANDIR's bytes, its largest parts, against the suite's limit."""
    total = tree_bytes(out)
    parts = sorted(((tree_bytes(p) if os.path.isdir(p) else os.path.getsize(p), n)
                    for n in os.listdir(out) for p in [os.path.join(out, n)]), reverse=True)
    print(f"PLANDIR {out}: {total / 1e6:.1f} MB to travel (limit {LIMIT_MB} MB); largest: " +
          ", ".join(f"{n} {b / 1e6:.1f} MB" for b, n in parts[:4]))
    if total > LIMIT_MB * 1e6:
        sys.exit(f"PLANDIR is {total / 1e6:.1f} MB, over the {LIMIT_MB} MB the GPU machine takes")
    return total


LIMIT_MB = 40


if __name__ == "__main__":
    main()
