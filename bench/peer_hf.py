"""The peer on the same device, for bench/gpu_decode.py's figures side by side (issue 34 item 7): transformers' bf16
greedy decode of a Qwen3-8B-shaped model (random weights, the shape bench/lane_figures.py's qwen3_8b plans), batch 1,
after a 512-token prompt. A token's time is (generate(N2) - generate(N1)) / (N2 - N1), the median of 3 rounds, so
the prompt and the first step cancel.

    python3 bench/peer_hf.py eager|static OUT.json

eager: transformers' default dynamic cache; static: cache_implementation="static" (transformers compiles the decode
forward with torch.compile and replays it as CUDA graphs; its first call takes a minute or two). Needs torch with
CUDA and transformers (the GPU machine has both); bench/gpu_suite.sh runs both modes after gpu_decode.py."""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in ("eager", "static"):
        sys.exit(__doc__)
    mode, out = sys.argv[1], sys.argv[2]
    import torch
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                                   max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    t = time.time()
    with torch.device("cuda"):
        model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    print(f"built in {time.time() - t:.1f} s", flush=True)
    ids = torch.randint(0, cfg.vocab_size, (1, 512), device="cuda")
    kw = dict(do_sample=False, min_new_tokens=0, eos_token_id=None, pad_token_id=0)
    if mode == "static":
        model.generation_config.cache_implementation = "static"

    def gen(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    t = time.time()
    gen(8)
    gen(8)
    print(f"warm-up {time.time() - t:.1f} s", flush=True)
    rounds = sorted((gen(80) - gen(16)) / 64 * 1e6 for _ in range(3))
    us = rounds[1]
    print(f"transformers {transformers.__version__} torch {torch.__version__} {mode}: {us:.1f} µs/token "
          f"{1e6 / us:.1f} tok/s (rounds {[round(x, 1) for x in rounds]})", flush=True)
    with open(out, "w") as f:
        json.dump({"mode": mode, "us_per_token": us, "rounds": rounds, "transformers": transformers.__version__,
                   "torch": torch.__version__}, f)


if __name__ == "__main__":
    main()
