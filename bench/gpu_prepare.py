"""The GPU suite's prepare step (a CPU machine with the engine): plan the steps the GPU machine will run and save
them, so that machine needs no solver. Writes into PLANDIR:

    demo-decode.json, demo-prefill8.json   the demo model's decode step and an 8-row prefill chunk
    qwen3-8b-decode.json                   a Qwen3-8B-shaped decode step (bf16 rows; random weights on the device)
    qwen3-8b-q8_0-decode.json, ...-q4_0-, ...-q4_k-   the same step, its rows in GGUF block formats
    qwen3-8b-decode-b1.json ... -b64.json  the same step decoding a batch of B sequences (1024 cache rows a slot)
    tiny-hf/ + tiny-hf-decode.json         a transformers-made tiny Qwen3 checkpoint and its plan (needs torch)
    tiny-moe/ + tiny-moe-decode.json       a transformers-made tiny Qwen2-MoE (8 experts top-2, a shared expert):
      + tiny-moe-prefill8.json             its decode plan (the mixture finalized) and an 8-row chunk's (planned
                                           with launches nearly free: its rows sorted by expert)
    tiny-gemma2/ + tiny-gemma2-decode.json a transformers-made tiny Gemma 2 (soft caps, a window of 8) and its plan
    tiny-deepseek/ + tiny-deepseek-decode.json   a transformers-made tiny DeepSeek-V3 (latent 512 + rotated 64: the
      + tiny-deepseek-prefill8.json      wide attention; 16 experts in 4 groups keep 2, top-4, a correction bias, a
                                           shared expert, a dense first layer): its decode and 8-row chunk plans
    tiny-gptoss/ + tiny-gptoss-decode.json a transformers-made tiny gpt-oss (biased router and experts, the clamped
      + tiny-gptoss-prefill8.json          GLU, sinks, a window of 8): its decode plan and an 8-row chunk's (sorted)

    python bench/gpu_prepare.py PLANDIR
"""

from __future__ import annotations

import dataclasses
import os
import sys

from lanefuse.engine.demo import demo_config
from lanefuse.engine.model import build_step
from lanefuse.lane.lower.plan import plan
from lanefuse.lane.lower.planfile import save

BLOCK_PLANS = ("q8_0", "q4_0", "q4_k")  # the Qwen3-8B step's rows in these formats too (bench/gpu_decode.py)
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
    folder = os.path.join(out, "tiny-moe")
    c = transformers.Qwen2MoeConfig(vocab_size=320, hidden_size=128, intermediate_size=160, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                                    num_experts_per_tok=2, moe_intermediate_size=96,
                                    shared_expert_intermediate_size=64, max_position_embeddings=128)
    transformers.Qwen2MoeForCausalLM(c).eval().save_pretrained(folder)
    mcfg, _ = load_model(folder)
    from lanefuse.lane.lower.knobs import Knobs

    save(plan(build_step(mcfg, 1), source={"kind": "path", "path": "tiny-moe"}),
         os.path.join(out, "tiny-moe-decode.json"))
    # launches nearly free, so that the chunk's plan sorts its rows by expert on so small a model
    save(plan(build_step(mcfg, 8), knobs=Knobs(launch_us=0.01), source={"kind": "path", "path": "tiny-moe"}),
         os.path.join(out, "tiny-moe-prefill8.json"))
    print("saved tiny-moe and its decode and prefill plans")
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
    folder = os.path.join(out, "tiny-deepseek")
    c = transformers.DeepseekV3Config(vocab_size=320, hidden_size=128, intermediate_size=160, moe_intermediate_size=64,
                                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                                      n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                      n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=96,
                                      qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                                      max_position_embeddings=128)
    m = transformers.DeepseekV3ForCausalLM(c).eval()
    with torch.no_grad():  # norms near 1, products of a scale that keeps the residual alive, a bias that bites
        for name, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else
                    0.3 * torch.randn_like(p) if p.dim() == 1 else torch.randn_like(p) / p.shape[1] ** 0.5)
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn_like(b))
    m.save_pretrained(folder)
    dcfg, _ = load_model(folder)
    save(plan(build_step(dcfg, 1), source={"kind": "path", "path": "tiny-deepseek"}),
         os.path.join(out, "tiny-deepseek-decode.json"))
    save(plan(build_step(dcfg, 8), source={"kind": "path", "path": "tiny-deepseek"}),
         os.path.join(out, "tiny-deepseek-prefill8.json"))
    print("saved tiny-deepseek and its decode and prefill plans")
    folder = os.path.join(out, "tiny-gptoss")
    c = transformers.GptOssConfig(vocab_size=320, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8,
                                  num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
                                  layer_types=["sliding_attention", "full_attention"], swiglu_limit=1.5,
                                  rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                                   "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                   "original_max_position_embeddings": 32})
    m = transformers.GptOssForCausalLM(c).eval()
    with torch.no_grad():  # biases, sinks and a router that matter; experts stored (E, in, out)
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1 or name.endswith("_bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                p.copy_(2 * torch.randn_like(p) / p.shape[-2] ** 0.5)
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    m.save_pretrained(folder)
    ocfg, _ = load_model(folder)
    save(plan(build_step(ocfg, 1), source={"kind": "path", "path": "tiny-gptoss"}),
         os.path.join(out, "tiny-gptoss-decode.json"))
    save(plan(build_step(ocfg, 8), knobs=Knobs(launch_us=0.01), source={"kind": "path", "path": "tiny-gptoss"}),
         os.path.join(out, "tiny-gptoss-prefill8.json"))
    print("saved tiny-gptoss and its decode and prefill plans")


if __name__ == "__main__":
    main()
