"""GPU prefill benchmark (issue 35 item 5): prefill tokens/s of a Qwen3-8B-shaped bf16 prompt of 512 and 2048 tokens
(random weights) under the tensor-core knobs (tc_rows=16: every product of the chunk a gemm_tc launch; tc_attn_rows=16:
its attention attention_tc), its TFLOP/s and
share of the H200's 989 TFLOP/s bf16 peak, a per-kind breakdown (each launch alone between CUDA events) beside
bench/gemm_model.py's PREDICTIONS, and transformers (eager and sdpa attention) on the same device in the same run.

    python bench/gpu_prefill.py prepare PLANDIR     on the CPU (the engine): the two plans, the predictions
    python bench/gpu_prefill.py run --plans PLANDIR [--iters 5] [--json FILE] [--peer eager,sdpa]
                                                    on the device (CuPy; torch + transformers for the peer)

bench/gpu_suite.sh runs both (prepare with its plans, run after gpu_decode.py). A prompt's step is timed whole (its
CUDA graph, position 0, the inputs loaded before each replay), the median of `--iters`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = (512, 2048)
PEAK_TFLOPS = 989.0  # H200 dense bf16 (the datasheet's, without sparsity)


def plan_name(rows: int) -> str:
    return f"qwen3-8b-prefill{rows}"


def prepare(plans: str) -> None:
    sys.path.insert(0, HERE)
    from gemm_model import plan_prediction, prefill_plan, print_prediction

    from lanefuse.lane.lower.planfile import save

    os.makedirs(plans, exist_ok=True)
    out = {}
    for rows in ROWS:
        s = prefill_plan(rows)
        save(s, os.path.join(plans, plan_name(rows) + ".json"))
        p = out[plan_name(rows)] = plan_prediction(s)
        print_prediction(plan_name(rows), p)
    with open(os.path.join(plans, "gemm-model.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("saved " + ", ".join(plan_name(r) for r in ROWS) + " and gemm-model.json (PREDICTIONS)")


def step_flops(s) -> tuple[int, int]:
    """(the products' flops, the attention's) of a prefill step at position 0: each product's 2·m·n·k; each attention
    4 · heads · head_dim · rows(rows+1)/2 (causal: row i attends to i + 1 keys)."""
    prod = att = 0
    for x in s.launches:
        for k in x.launch.kernels():
            if k.census in ("gemm_tc", "gemm_tc_parts", "gemm_tc_glu", "gemv", "gemv_f32", "gemm_parts", "gemv_glu",
                            "head_gemv", "gemm_blas", "gemm_blas_parts", "gemm_blas_glu", "gemm_deq",
                            "gemm_deq_parts", "gemm_deq_glu"):
                prod += k.flops()
            elif k.census in ("attention", "attention_tc"):
                att += 4 * k.heads * k.hd * k.rows * (k.rows + 1) // 2
    return prod, att


def inputs_of(s, rng) -> dict:
    rows = s.tensors[s.io.token].shape[0]
    vocab = s.tensors[s.io.logits].shape[-1]
    return {s.io.token: rng.integers(0, vocab, rows).astype(np.int32), s.io.position: np.zeros(1, np.int32)}


def time_step(r, inputs, iters: int, graph: bool = True) -> list[float]:
    """Microseconds of each of `iters` replays of the step, the inputs loaded before each (outside the events)."""
    import cupy as cp

    r.load_inputs(inputs)
    r._replay()  # compiles, captures
    out = []
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(iters):
        r.load_inputs(inputs)
        e0.record(r._stream)
        if graph:
            r._graph.launch(stream=r._stream)
        else:
            with r._stream:
                r.run_launches()
        e1.record(r._stream)
        e1.synchronize()
        out.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
    return out


def per_kind(s, r, inputs) -> dict[str, dict]:
    """Each launch alone between CUDA events (no graph), summed by census kind."""
    sys.path.insert(0, HERE)
    from gpu_decode import launch_times

    kinds: dict[str, dict] = {}
    for i, us in launch_times(s, r, inputs):
        l = s.launches[i].launch
        k = kinds.setdefault(l.census, {"launches": 0, "us": 0.0, "flops": 0})
        k["launches"] += 1
        k["us"] += us
        k["flops"] += l.flops()
    return kinds


def run(args) -> None:
    sys.path.insert(0, HERE)
    from gpu_decode import device_weights, runner

    from lanefuse.lane.lower.planfile import load
    from lanefuse.lane.run.cupy_runner import DeviceState

    predicted = {}
    if os.path.exists(os.path.join(args.plans, "gemm-model.json")):
        with open(os.path.join(args.plans, "gemm-model.json")) as f:
            predicted = json.load(f)
    rng = np.random.default_rng(0)
    results = []
    state = None
    for rows in ROWS:
        name = plan_name(rows)
        path = os.path.join(args.plans, name + ".json")
        if not os.path.exists(path):
            print(f"{name}: no plan at {path} (run bench/gpu_suite.sh prepare)")
            continue
        s = load(path)
        if state is None:  # one set of random weights for both plans (the same constants)
            state = DeviceState()
            state.weights.update(device_weights(s))
        inputs = inputs_of(s, rng)
        row = {"plan": name, "rows": rows, "launches": s.n_launches, "census": s.census}
        try:
            r = runner(s, state, graph=True)
            r.state.loaded = True
            times = time_step(r, inputs, args.iters)
        except Exception as e:  # noqa: BLE001 (the first run of this kernel on a device: a failure is a figure too)
            print(f"prefill {name}: failed: {type(e).__name__}: {e}")
            row["error"] = f"{type(e).__name__}: {e}"
            results.append(row)
            continue
        us = statistics.median(times)
        prod, att = step_flops(s)
        tflops = (prod + att) / (us * 1e-6) / 1e12
        row.update(us=round(us, 1), times_us=[round(t, 1) for t in times], tokens_per_s=round(rows / (us * 1e-6), 0),
                   flops_products=prod, flops_attention=att, tflops=round(tflops, 1),
                   peak_share=round(tflops / PEAK_TFLOPS, 4))
        print(f"prefill {name}: {us / 1e3:8.2f} ms a {rows}-token step, {rows / (us * 1e-6):9.0f} tokens/s, "
              f"{tflops:6.1f} TFLOP/s ({tflops / PEAK_TFLOPS:.1%} of {PEAK_TFLOPS:.0f}) · {s.n_launches} launches")
        try:
            r2 = runner(s, state, graph=False)
            r2.state.loaded = True
            r2.load_inputs(inputs)
            r2._replay()
            kinds = per_kind(s, r2, inputs)
            row["kinds"] = {k: {"launches": v["launches"], "us": round(v["us"], 1), "flops": v["flops"]}
                            for k, v in kinds.items()}
            model = predicted.get(name, {}).get("kinds_us", {})
            total = sum(v["us"] for v in kinds.values())
            for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]["us"]):
                pred = f" · PREDICTION {model[k]:9.0f} µs" if k in model else ""
                extra = ""
                if k in ("gemm_tc", "gemm_tc_parts", "gemm_blas", "gemm_blas_parts", "gemm_blas_glu", "gemm_deq",
                         "gemm_deq_parts", "gemm_deq_glu"):
                    extra = f" ({v['flops'] / (v['us'] * 1e-6) / 1e12:.0f} TFLOP/s)"
                print(f"prefill {name}   {k:12s} {v['launches']:4d} launches {v['us']:10.0f} µs "
                      f"({v['us'] / total:5.1%}){extra}{pred}")
        except Exception as e:  # noqa: BLE001
            print(f"prefill {name}: per-kind breakdown failed: {type(e).__name__}: {e}")
        if name in predicted:
            p = predicted[name]
            print(f"prefill {name}: PREDICTION (bench/gemm_model.py) {p['step_us'] / 1e3:.2f} ms, "
                  f"{p['tokens_per_s']:.0f} tokens/s")
        results.append(row)
    peers = []
    for mode in [m for m in (args.peer or "").split(",") if m]:
        got = os.path.join(os.path.dirname(os.path.abspath(args.json or "x")), f"prefill-peer-{mode}.json")
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "peer", mode, ",".join(map(str, ROWS)), got],
                           capture_output=True, text=True, cwd="/", timeout=args.peer_s)
        for line in (p.stdout + p.stderr).strip().splitlines()[-6:]:
            print(f"prefill transformers {mode}: {line}")
        if p.returncode == 0 and os.path.exists(got):
            with open(got) as f:
                peers.append(json.load(f))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "peers": peers, "predicted": predicted}, f, indent=1)


def peer(mode: str, rows: list[int], out: str, shape: str = "8b") -> None:
    """transformers' bf16 forward of a Qwen3-8B-shaped model (random weights) over a prompt of each `rows` (no cache,
    the last row's logits alone, as the lane's prefill step computes), attention `mode` (eager, sdpa): the median
    of 5 after 2 warm-ups, CUDA events."""
    import torch
    import transformers

    dims = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    if shape == "tiny":  # the CPU smoke test's (tests/test_gemm_tc_bench.py)
        dims = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16)
    cfg = transformers.Qwen3Config(**dims, rope_theta=1e6, max_position_embeddings=4096, tie_word_embeddings=False,
                                   rms_norm_eps=1e-6)
    cfg._attn_implementation = mode
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(dev):
        model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    res = {"mode": mode, "transformers": transformers.__version__, "torch": torch.__version__, "rows": {}}
    for n in rows:
        ids = torch.randint(0, cfg.vocab_size, (1, n), device=dev)

        def fwd():
            with torch.no_grad():
                return model(ids, use_cache=False, logits_to_keep=1).logits

        for _ in range(2):
            fwd()
        times = []
        for _ in range(5):
            if dev == "cuda":
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fwd()
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1) * 1e3)
            else:
                import time

                t = time.perf_counter()
                fwd()
                times.append((time.perf_counter() - t) * 1e6)
        us = statistics.median(times)
        res["rows"][str(n)] = {"us": round(us, 1), "tokens_per_s": round(n / (us * 1e-6), 0)}
        print(f"transformers {transformers.__version__} {mode} {n} tokens: {us / 1e3:.2f} ms, "
              f"{n / (us * 1e-6):.0f} tokens/s", flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


def main() -> None:
    if len(sys.argv) >= 2 and sys.argv[1] == "prepare":
        if len(sys.argv) != 3:
            sys.exit(__doc__)
        prepare(sys.argv[2])
        return
    if len(sys.argv) >= 2 and sys.argv[1] == "peer":
        if len(sys.argv) not in (5, 6):
            sys.exit(__doc__)
        peer(sys.argv[2], [int(x) for x in sys.argv[3].split(",")], sys.argv[4], *sys.argv[5:])
        return
    from lanefuse.engine import flags

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cmd", choices=["run"])
    ap.add_argument("--plans", default=flags.read("LANEFUSE_PLANS") or "plans")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--peer", default="eager,sdpa", help="transformers attention modes beside (empty: none)")
    ap.add_argument("--peer-s", type=int, default=150, help="seconds each peer may take")
    run(ap.parse_args())


if __name__ == "__main__":
    main()
