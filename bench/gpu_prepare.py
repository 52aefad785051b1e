"""The GPU suite's prepare step (a CPU machine with the engine): plan the steps the GPU machine will run and save
them, so that machine needs no solver. Writes into PLANDIR:

    demo-decode.json, demo-prefill8.json   the demo model's decode step and an 8-row prefill chunk
    qwen3-8b-decode.json                   a Qwen3-8B-shaped decode step (bf16 rows; random weights on the device)
    tiny-hf/ + tiny-hf-decode.json         a transformers-made tiny Qwen3 checkpoint and its plan (needs torch)
    tiny-gemma2/ + tiny-gemma2-decode.json a transformers-made tiny Gemma 2 (soft caps, a window of 8) and its plan

    python bench/gpu_prepare.py PLANDIR
"""

from __future__ import annotations

import os
import sys

from lanefuse.engine.demo import demo_config
from lanefuse.engine.model import build_step
from lanefuse.lane.lower.plan import plan
from lanefuse.lane.lower.planfile import save


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
    print("saved demo-decode, demo-prefill8, qwen3-8b-decode")
    try:
        import torch
        import transformers
    except ImportError:
        print("no torch/transformers here: skipping the transformers-made model")
        return
    folder = os.path.join(out, "tiny-hf")
    torch.manual_seed(0)
    c = transformers.Qwen3Config(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                 max_position_embeddings=128, tie_word_embeddings=False)
    transformers.Qwen3ForCausalLM(c).eval().save_pretrained(folder)
    from lanefuse.engine.front import load_model

    hcfg, _ = load_model(folder)
    save(plan(build_step(hcfg, 1), source={"kind": "path", "path": "tiny-hf"}), os.path.join(out, "tiny-hf-decode.json"))
    print("saved tiny-hf and its decode plan")
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


if __name__ == "__main__":
    main()
