"""Issue 40 item 4: the launch model's PREDICTIONS for a chunk's attention with shared rows against the step held
(bench/results/2026-12-05-attention-shared-rows.txt; run from the repository root, ~3 min on 2 cores)."""
import sys
sys.path.insert(0, "bench")
import launch_model as LM
from lanefuse.engine.front.model import ModelConfig, build_step
from lanefuse.lane.lower.plan import plan
cal = LM.load_calibration()
# Qwen3-0.6B's attention shape (16 query heads over 8 key/value heads of 128), 28 layers; and an MHA of 32 heads of 128
for name, heads, kv in (("qwen3-0.6b", 16, 8), ("mha-32x128", 32, 32)):
    cfg = ModelConfig("Qwen3ForCausalLM", 1024 if kv == 8 else 4096, 28 if kv == 8 else 32, heads, kv, 128,
                      3072 if kv == 8 else 11008, 151936 if kv == 8 else 32000, qk_norm=kv == 8, max_len=4096,
                      name=name)
    for rows in (64, 16):
        for pos in (512, 2048):
            out = []
            for held in ((), ("shared_rows",)):
                s = plan(build_step(cfg, rows), held=list(held))
                ks = LM.model(s, None, cal, pos=pos)
                att = [k for k in ks if k.family == "attention"]
                out.append((sum(k.us for k in att), sum(k.bytes for k in att), len(att),
                            att[0].launch.shared if att else None))
            (u1, b1, n1, s1), (u0, b0, n0, s0) = out
            print(f"{name} chunk {rows} rows at pos {pos}: attention {n1} launches, shared {s1}: {u1:.0f} us "
                  f"{b1/1e6:.1f} MB  | held (shared {s0}): {u0:.0f} us {b0/1e6:.1f} MB  (PREDICTED)")
