"""GGUF figures: load time and resident memory of a GGUF file against its size (memory-mapped: the file's pages are
read as they are used), and CPU decode ms/token of lanefuse (the fast numpy runner `lanefuse run` uses) against
llama.cpp (llama-cpp-python, where installed) on the same file, for f32 / q8_0 / q4_0 (and q4_k) files of one random
Qwen3-shaped model (issue 18's shape: hidden 1024, 8 layers, 16 heads, 8 kv heads, head_dim 64, intermediate 3072,
vocab 32000; 166M parameters). Each figure is measured in a fresh process; medians over the rounds.

    python bench/gguf_figures.py [--formats f32,q8_0,q4_0] [--tokens 16] [--rounds 3] [--threads 2] [--layers 8]

Resident memory is split as Linux counts it: anonymous pages (what the process allocated: decoded weights, caches)
and file pages (the GGUF file's pages mapped in, which the page cache holds and shares)."""

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

SHAPE = dict(hidden=1024, layers=8, heads=16, kv_heads=8, head_dim=64, inter=3072, vocab=32000, ctx=512)
PROMPT = [3, 17, 5, 42, 8, 11, 29, 7]
GGML = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k": "Q4_K", "q6_k": "Q6_K"}


def write_model(path: str, fmt: str, shape: dict, seed: int = 18) -> None:
    """A random Qwen3-shaped model as a GGUF file, 2-D tensors in `fmt` (1-D ones f32), with a byte-level vocabulary
    (llama.cpp loads no model without one)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    d, L, h, kv, hd, f, V = (shape[k] for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "inter", "vocab"))
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_context_length(shape["ctx"])
    w.add_embedding_length(d)
    w.add_block_count(L)
    w.add_feed_forward_length(f)
    w.add_head_count(h)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    alphabet = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)] + \
        [chr(c) for c in range(174, 256)] + [chr(256 + i) for i in range(68)]  # GPT-2's byte-level characters
    tokens = alphabet + ["Ġt"] + [f"[PAD{i}]" for i in range(len(alphabet) + 1, V)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(alphabet) + 1) + [5] * (V - len(alphabet) - 1))
    w.add_token_merges(["Ġ t"])
    w.add_eos_token_id(0)

    def mat(rows: int, cols: int, scale: float):
        a = (rng.standard_normal((rows, cols), dtype=np.float32) * scale).astype(np.float32)
        if fmt == "f32":
            return a, None
        if fmt == "f16":
            return a.astype(np.float16), None
        qt = gguf.GGMLQuantizationType[GGML[fmt]]
        if fmt in ("q4_k", "q6_k"):
            from lanefuse.engine.formats.blocks import encode

            return np.asarray(encode(a, fmt), dtype=np.uint8).reshape(rows, -1), qt
        return gguf.quants.quantize(a, qt), qt

    def vec(n: int):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def add(name, t):
        data, raw = t if isinstance(t, tuple) else (t, None)
        w.add_tensor(name, data, raw_dtype=raw)

    add("token_embd.weight", mat(V, d, 1.0))
    add("output_norm.weight", vec(d))
    add("output.weight", mat(V, d, d ** -0.5))
    for i in range(L):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", vec(d))
        add(p + "attn_q.weight", mat(h * hd, d, d ** -0.5))
        add(p + "attn_k.weight", mat(kv * hd, d, d ** -0.5))
        add(p + "attn_v.weight", mat(kv * hd, d, d ** -0.5))
        add(p + "attn_q_norm.weight", vec(hd))
        add(p + "attn_k_norm.weight", vec(hd))
        add(p + "attn_output.weight", mat(d, h * hd, (h * hd) ** -0.5))
        add(p + "ffn_norm.weight", vec(d))
        add(p + "ffn_gate.weight", mat(f, d, d ** -0.5))
        add(p + "ffn_up.weight", mat(f, d, d ** -0.5))
        add(p + "ffn_down.weight", mat(d, f, f ** -0.5))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def resident() -> dict[str, int]:
    """This process's resident bytes: anonymous and file-backed (Linux /proc/self/status; zeros elsewhere)."""
    out = {"anon": 0, "file": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    out["anon"] = int(line.split()[1]) * 1024
                elif line.startswith("RssFile:"):
                    out["file"] = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return out


def child_lanefuse(path: str, tokens: int) -> dict:
    """Load the file (timed, resident memory after), then decode `tokens` greedy steps on the fast numpy runner."""
    before = resident()
    t0 = time.perf_counter()
    from lanefuse.engine.front.load import load_model

    cfg, weights = load_model(path, max_len=64)
    load_s = time.perf_counter() - t0
    loaded = resident()
    out = {"load_s": load_s, "before": before, "loaded": loaded}
    try:
        from cpu_decode import timed_generate
        from lanefuse.lane.run.step import plan_step_fn

        step_fn, label = plan_step_fn(weights, "cpu")
        out["first_s"], ms, got = timed_generate(cfg, weights, step_fn, PROMPT, tokens)
        out.update(ms=ms, tokens=got, label=label, run=resident())
    except Exception as e:  # a format the kernels do not read yet: said in the figures, not a crash
        out["error"] = f"{type(e).__name__}: {str(e)[:160]}"
    return out


def child_llamacpp(path: str, tokens: int, threads: int) -> dict:
    from cpu_decode import llama_round
    from llama_cpp import Llama

    t0 = time.perf_counter()
    ll = Llama(path, n_ctx=64, n_threads=threads, n_batch=64, logits_all=True, verbose=False)  # scores each step
    out = {"load_s": time.perf_counter() - t0, "loaded": resident()}
    got = llama_round(ll, PROMPT, tokens)
    out.update(ms=1e3 * statistics.median(got["times"]), tokens=got["tokens"])
    return out


def run_child(*args: str, threads: int) -> dict:
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    r = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env,
                       timeout=1800)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def rounds(rs: list[dict]) -> str:
    return ", ".join(f"{r['ms']:.1f}" for r in rs)


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="f32,q8_0,q4_0")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=SHAPE["layers"])
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, path = args.child[0], args.child[1]
        res = child_lanefuse(path, args.tokens) if kind == "lanefuse" else \
            child_llamacpp(path, args.tokens, args.threads)
        print(json.dumps(res))
        return 0
    from cpu_decode import have_llama_cpp

    have_llama = have_llama_cpp()
    shape = dict(SHAPE, layers=args.layers)
    d = tempfile.mkdtemp(prefix="lanefuse-gguf-")
    try:
        params = None
        print(f"model: random Qwen3-shaped, {shape['layers']} layers, hidden {shape['hidden']}, intermediate "
              f"{shape['inter']}, vocab {shape['vocab']}; {len(PROMPT)}-token prompt, {args.tokens} decode steps, "
              f"{args.threads} threads, medians of {args.rounds} fresh processes")
        for fmt in args.formats.split(","):
            path = os.path.join(d, f"qwen3-{fmt}.gguf")
            t0 = time.perf_counter()
            write_model(path, fmt, shape)
            size = os.path.getsize(path)
            if params is None:
                import gguf

                params = sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors)
                print(f"parameters: {params / 1e6:.0f}M")
            lf = [run_child("lanefuse", path, "--tokens", str(args.tokens), threads=args.threads)
                  for _ in range(args.rounds)]
            lc = [run_child("llamacpp", path, "--tokens", str(args.tokens), "--threads", str(args.threads),
                            threads=args.threads) for _ in range(args.rounds)] if have_llama else []
            ok = [r for r in lf if "load_s" in r]
            print(f"\n{fmt}: file {mb(size)} (written in {time.perf_counter() - t0:.1f} s)")
            if ok:
                load = statistics.median(r["load_s"] for r in ok)
                anon = statistics.median(r["loaded"]["anon"] - r["before"]["anon"] for r in ok)
                fil = statistics.median(r["loaded"]["file"] - r["before"]["file"] for r in ok)
                print(f"  lanefuse load (metadata, config, every tensor's shape checked): {1e3 * load:.0f} ms; "
                      f"resident after load +{mb(anon)} anonymous, +{mb(fil)} of file pages "
                      f"(file pages: {fil / size:.1%} of the file)")
            runs = [r for r in lf if "ms" in r]
            if runs:
                r0 = runs[0]
                print(f"  lanefuse decode ({r0['label']}): {statistics.median(r['ms'] for r in runs):.1f} ms/token "
                      f"(rounds {rounds(runs)}); first steps (plans, weights read and "
                      f"decoded once) {statistics.median(r['first_s'] for r in runs):.2f} s; resident while "
                      f"decoding {mb(r0['run']['anon'])} anonymous + {mb(r0['run']['file'])} file pages")
            else:
                print(f"  lanefuse decode: not run ({(lf[0].get('error') if lf else '?')})")
            lruns = [r for r in lc if "ms" in r]
            if lruns:
                mine, theirs = (runs[0]["tokens"] if runs else []), lruns[0]["tokens"]
                agree = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
                said = f"; greedy tokens: the first {agree} of {len(theirs)} the same as lanefuse's" if runs else ""
                print(f"  llama.cpp decode: {statistics.median(r['ms'] for r in lruns):.1f} ms/token (rounds "
                      f"{rounds(lruns)}); load {1e3 * statistics.median(r['load_s'] for r in lruns):.0f} ms{said}")
                if runs:
                    ratio = statistics.median(r["ms"] for r in runs) / statistics.median(r["ms"] for r in lruns)
                    print(f"  lanefuse / llama.cpp time a token: {ratio:.2f}x")
            elif lc:
                print(f"  llama.cpp: not run ({lc[0].get('error')})")
            os.remove(path)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
