"""CPU decode speed, side by side in one run: lanefuse's numpy backend (the fast runner `lanefuse run` uses, and the
exact twin with --exact) against transformers eager (torch CPU, KV cache) on the same random Qwen3-shaped f32 model
(issue 18: hidden 1024, 8 layers, 16 heads, 8 kv heads, head_dim 64, intermediate 3072, vocab 32000), llama.cpp
(llama-cpp-python, where installed) on the same weights written as an f32 GGUF file, and the machine's f32 GEMV
bandwidth (numpy); and each system's prompt eval of a longer prompt (--prefill). Rounds are interleaved and figures
are medians: the machine may be shared.

    python bench/cpu_decode.py [--rounds 5] [--tokens 24] [--threads 2] [--exact] [--layers 8] [--dtype bfloat16]
                               [--prefill 128] [--no-llama]

--dtype saves the checkpoint in bf16 or f16: transformers loads it as f32, lanefuse decodes it to f32 once at load
(the cost is printed: the time, and 4 bytes a parameter held against the checkpoint's 2).

transformers and llama.cpp run in subprocesses, each loaded once and asked a round at a time; transformers' cwd and
sys.path leave this checkout out (its `kernels/` folder would shadow the `kernels` package transformers imports)."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT = [3, 17, 5, 42, 8, 11, 29, 7]  # an 8-token prompt, as in the issue
MAX_CHUNK_ROWS = 64  # engine/ir.py's MAX_CHUNK (not imported here: the transformers side runs without lanefuse)

SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=64,
             intermediate_size=3072, vocab_size=32000, max_position_embeddings=512, tie_word_embeddings=False)

# The transformers side: builds and saves the model (`build`), or serves decode timings round by round (`serve`).
# It runs as `python -c HF` in another folder, so nothing of this checkout is importable there.
HF = r'''
import json, sys, time
import torch, transformers
cmd, folder, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(threads)
if cmd == "build":
    shape, dtype = json.loads(sys.argv[4]), sys.argv[5]
    family = shape.pop("family", "Qwen3")  # Qwen3, Qwen3Moe (bench/moe_figures.py), Gemma2 (bench/gemma_figures.py)
    gemma = family.startswith("Gemma")  # Gemma's norms scale by 1 + w: norm weights near 0, a smaller embedding
    cfg = getattr(transformers, family + "Config")(**shape)
    torch.manual_seed(20 if gemma else 18)
    model = getattr(transformers, family + "ForCausalLM")(cfg).eval()
    with torch.no_grad():  # a scale that keeps the residual alive (see shared/PEERS-NOTES.md)
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_((0.05 if gemma else 1.0) * torch.randn_like(p))
            else:  # fan-in is the last dimension (a mixture's experts are (E, out, in))
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    if len(sys.argv) > 7:  # the same weights as an f32 GGUF file for llama.cpp, written by the tests' GGUF writer
        sys.path.insert(0, sys.argv[7])  # tests/ alone: the checkout's root would shadow transformers' `kernels`
        from gguf_files import bpe_tokenizer, write_gguf
        write_gguf(model.float(), sys.argv[6], "f32", tokenizer=bpe_tokenizer(cfg.vocab_size)[1:])
    print("saved")
    sys.exit(0)
attn = {"attn_implementation": sys.argv[4]} if len(sys.argv) > 4 else {}
model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **attn).eval()
print("ready", flush=True)
for line in sys.stdin:
    prompt, n = json.loads(line)
    times, toks = [], []
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(torch.tensor([prompt]), use_cache=True)
        prompt_s = time.perf_counter() - t0
        pkv, nxt = out.past_key_values, int(out.logits[0, -1].argmax())
        for _ in range(n):
            toks.append(nxt)
            t0 = time.perf_counter()
            out = model(torch.tensor([[nxt]]), past_key_values=pkv, use_cache=True)
            times.append(time.perf_counter() - t0)
            pkv, nxt = out.past_key_values, int(out.logits[0, -1].argmax())
    print(json.dumps({"times": times, "tokens": toks, "prompt_s": prompt_s}), flush=True)
'''


def hf_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", HF, *args]


TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")


def long_prompt(n: int, vocab: int) -> list[int] | None:
    """An n-token prompt for the prompt-eval figure (None for 0): ids spread over the vocabulary, seeded."""
    if n <= 0:
        return None
    import numpy as np

    return [int(i) for i in np.random.default_rng(18).integers(3, vocab, n)]


def have_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def llama_round(ll, prompt: list[int], n: int) -> dict:
    """llama.cpp's Llama `ll` (made with logits_all) decoding `prompt` greedily from an empty cache: the prompt's
    seconds, each of `n` decode steps' seconds and the greedy tokens."""
    import numpy as np

    ll.reset()
    t0 = time.perf_counter()
    ll.eval(prompt)
    prompt_s = time.perf_counter() - t0
    times, toks = [], []
    nxt = int(np.argmax(ll.scores[ll.n_tokens - 1]))
    for _ in range(n):
        toks.append(nxt)
        t0 = time.perf_counter()
        ll.eval([nxt])
        times.append(time.perf_counter() - t0)
        nxt = int(np.argmax(ll.scores[ll.n_tokens - 1]))
    return {"times": times, "tokens": toks, "prompt_s": prompt_s}


def serve_llama(path: str, threads: int) -> int:
    """llama.cpp (llama-cpp-python) on GGUF file `path`, serving decode timings round by round as `HF` serves
    transformers': a line [prompt, n] in, {"times", "tokens"} out."""
    from llama_cpp import Llama

    ll = Llama(path, n_ctx=256, n_threads=threads, n_threads_batch=threads, n_batch=64, logits_all=True,
               verbose=False)  # logits_all: each step's scores where `scores` finds them
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(llama_round(ll, *json.loads(line))), flush=True)
    return 0


class Server:
    """A peer's decode timings served by a subprocess (`cmd`): started, asked a round at a time, closed."""

    def __init__(self, cmd: list[str], cwd: str, env: dict):
        self.p = subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.p.stdout.readline().strip() == "ready", f"{cmd[:3]} did not start"

    def round(self, tokens: int, prompt: list[int] = PROMPT) -> dict:
        self.p.stdin.write(json.dumps([prompt, tokens]) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait()


_MATS: list = []  # gemv_bandwidth's matrices, made once


def gemv_bandwidth(repeats: int = 8) -> float:
    """GB/s numpy's f32 GEMV streams from memory: four 64 MiB matrices in turn (256 MiB, past any cache: no matrix
    is read again before the other three, as a decode step reads each weight once), the median call. One matrix
    read again and again streams faster (some of it stays in a large last-level cache), which no step can use."""
    import numpy as np

    if not _MATS:
        g = np.random.default_rng(0)
        _MATS.extend(g.standard_normal((8192, 2048), dtype=np.float32) for _ in range(4))
    x = np.ones(2048, dtype=np.float32)
    y = np.empty(8192, dtype=np.float32)
    ts = []
    for _ in range(repeats):
        for w in _MATS:
            t0 = time.perf_counter()
            np.dot(w, x, out=y)
            ts.append(time.perf_counter() - t0)
    return _MATS[0].nbytes / statistics.median(ts) / 1e9


def products_alone(cfg, repeats: int = 5) -> float:
    """Seconds numpy takes for a dense decode step's products alone, back to back, on matrices of the step's shapes
    (q/k/v stacked, o, gate/up stacked, down a layer, then lm_head; fresh memory, none of them in a cache): what BLAS
    does on these shapes with no runner around it. None for a mixture (which experts a step reads varies)."""
    import numpy as np

    if cfg.moe is not None:
        return None
    h, q, kv = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    shapes = [(q + 2 * kv, h), (h, q), (2 * cfg.inter, h), (h, cfg.inter)]
    g = np.random.default_rng(0)
    mats = [g.standard_normal(s, dtype=np.float32) for _ in range(cfg.layers) for s in shapes]
    mats.append(g.standard_normal((cfg.vocab, h), dtype=np.float32))
    xs = {k: np.ones(k, np.float32) for k in {m.shape[1] for m in mats}}
    outs = [np.empty(m.shape[0], np.float32) for m in mats]
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for m, y in zip(mats, outs):
            np.matmul(m, xs[m.shape[1]], out=y)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def resident() -> int:
    """This process's resident anonymous bytes (Linux; the checkpoint's file pages it maps are the page cache's, not
    counted), 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def timed_decode(step_fn, times: list[float]):
    """`step_fn` with each decode step's (one row's) seconds appended to `times`."""

    def timed(g, env):
        t0 = time.perf_counter()
        out = step_fn(g, env)
        if int(g.meta.get("rows", 1)) == 1:
            times.append(time.perf_counter() - t0)
        return out

    return timed


def timed_generate(cfg, weights, step_fn, prompt: list[int], tokens: int) -> tuple[float, float, list[int]]:
    """A first run of 2 tokens (it plans the prefill chunk and the decode step and reads, or decodes, the weights
    once), then `tokens` greedy decode steps on `step_fn`, each timed: (the first run's seconds, the decode steps'
    median ms, the tokens of the second run)."""
    from lanefuse.lane.run.generate import generate

    times: list[float] = []
    timed = timed_decode(step_fn, times)
    t0 = time.perf_counter()
    generate(cfg, weights, prompt, 2, step_fn=timed)
    first = time.perf_counter() - t0
    times.clear()
    res = generate(cfg, weights, prompt, tokens + 1, step_fn=timed)
    return first, 1e3 * statistics.median(times), res.generated_ids


def side_by_side(lf, folder: str, elsewhere: str, env: dict, rounds: int, tokens: int, threads: int,
                 attn: str | None = None, alone=None, gguf: str | None = None,
                 prefill: list[int] | None = None) -> dict:
    """lanefuse (`lf`, a Lanefuse) and transformers (served from `folder` in a subprocess) decoding the same prompt,
    rounds interleaved with the machine's GEMV bandwidth (and `alone()`, the step's products alone, where given, and
    llama.cpp on GGUF file `gguf`, the same weights, where given): each's ms/token a round, and whether their greedy
    tokens agree with lanefuse's; and where `prefill` (a longer prompt) is given, each's seconds evaluating it a round
    (`prefill`: {system: [s, ...]}, each system warmed on it once first)."""
    peers = {"transformers": Server(hf_cmd("serve", folder, str(threads), *([attn] if attn else [])), elsewhere, env)}
    if gguf is not None:
        peers["llama.cpp"] = Server([sys.executable, os.path.abspath(__file__), "--serve-llama", gguf,
                                     "--threads", str(threads)], elsewhere, dict(env, OMP_NUM_THREADS=str(threads)))
    got_rounds: dict = {"lanefuse": [], "bandwidth": [], "alone": [], "same": True, "agree": {}, "prefill": {}}
    try:
        if prefill:  # the prompt's own chunk plans (lanefuse), allocations and caches warmed once
            lf.prefill(prefill)
            for peer in peers.values():
                peer.round(0, prefill)
        for _ in range(rounds):
            if prefill:
                got_rounds["prefill"].setdefault("lanefuse", []).append(lf.prefill(prefill))
                for name, peer in peers.items():
                    got_rounds["prefill"].setdefault(name, []).append(peer.round(0, prefill)["prompt_s"])
            t, lf_toks = lf.round(tokens)
            got_rounds["lanefuse"].append(1e3 * statistics.median(t))
            for name, peer in peers.items():
                got = peer.round(tokens)
                got_rounds.setdefault(name, []).append(1e3 * statistics.median(got["times"]))
                agree = next((i for i, (a, b) in enumerate(zip(got["tokens"], lf_toks)) if a != b), len(got["tokens"]))
                got_rounds["agree"][name] = min(agree, got_rounds["agree"].get(name, agree))
            got_rounds["bandwidth"].append(gemv_bandwidth())
            a = alone() if alone is not None else None
            if a is not None:
                got_rounds["alone"].append(1e3 * a)
    finally:
        for peer in peers.values():
            peer.close()
    got_rounds["same"] = got_rounds["agree"]["transformers"] == tokens
    return got_rounds


class Lanefuse:
    """lanefuse on the checkpoint: the decode step planned once, then timed step by step."""

    def __init__(self, folder: str, exact: bool):
        from lanefuse.engine.front.load import load_model
        from lanefuse.lane.run.step import plan_step_fn

        self.cfg, self.weights = load_model(folder)
        self.times: list[float] = []
        step_fn, self.label = plan_step_fn(self.weights, "cpu", exact=exact)
        self.step_fn = timed_decode(step_fn, self.times)
        rss, t0 = resident(), time.perf_counter()
        self.round(2)  # plans the prefill chunk and the decode step, reads (and decodes) the weights once
        self.load_s, self.load_bytes = time.perf_counter() - t0, resident() - rss

    def streamed(self, params: int) -> int:
        """Parameters a decode step reads: all of them, but of a mixture only the chosen experts'."""
        m = self.cfg.moe
        if m is None:
            return params
        unread = (m.experts - m.k) * 3 * m.inter * self.cfg.hidden
        return params - len(m.sparse) * unread

    def round(self, n: int) -> tuple[list[float], list[int]]:
        from lanefuse.lane.run.generate import generate

        self.times.clear()
        res = generate(self.cfg, self.weights, PROMPT, n + 1, step_fn=self.step_fn)
        return list(self.times), res.generated_ids

    def prefill(self, prompt: list[int]) -> float:
        """Seconds evaluating `prompt` (its chunks of up to MAX_CHUNK rows: the prompt eval `run` reports)."""
        from lanefuse.lane.run.generate import generate

        return generate(self.cfg, self.weights, prompt, 1, step_fn=self.step_fn).prompt_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians over them)")
    ap.add_argument("--tokens", type=int, default=24, help="decode steps timed a round")
    ap.add_argument("--threads", type=int, default=2, help="torch's threads and numpy's BLAS threads")
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    ap.add_argument("--exact", action="store_true", help="time the exact twin (the f64-sum imitation) instead")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="the checkpoint's dtype (both systems compute in f32)")
    ap.add_argument("--prefill", type=int, default=128, metavar="N",
                    help="also time each system's prompt eval of an N-token prompt a round (0: not)")
    ap.add_argument("--no-llama", action="store_true", help="leave llama.cpp out even where it is installed")
    ap.add_argument("--serve-llama", metavar="GGUF", help=argparse.SUPPRESS)  # the llama.cpp side's subprocess
    args = ap.parse_args()
    if args.serve_llama:
        return serve_llama(args.serve_llama, args.threads)
    # the same threads for both: numpy's OpenBLAS reads this when numpy is first imported (below, not before)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))
    shape = dict(SHAPE, num_hidden_layers=args.layers)
    elsewhere = tempfile.mkdtemp(prefix="lanefuse-bench-")
    folder = os.path.join(elsewhere, "qwen3")
    env = dict(os.environ, PYTHONPATH="")
    # llama.cpp reads the same weights from an f32 GGUF file the build writes beside the checkpoint (a bf16 or f16
    # checkpoint's values exactly, as f32)
    gguf = os.path.join(elsewhere, "qwen3-f32.gguf") if have_llama_cpp() and not args.no_llama else None
    try:
        subprocess.run(hf_cmd("build", folder, str(args.threads), json.dumps(shape), args.dtype,
                              *([gguf, TESTS] if gguf else [])), cwd=elsewhere, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        return measure(args, folder, elsewhere, env, gguf=gguf)
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)


def measure(args, folder: str, elsewhere: str, env: dict, family: str = "Qwen3", gguf: str | None = None) -> int:
    lf = Lanefuse(folder, args.exact)
    r = side_by_side(lf, folder, elsewhere, env, args.rounds, args.tokens, args.threads,
                     alone=lambda: products_alone(lf.cfg), gguf=gguf,
                     prefill=long_prompt(getattr(args, "prefill", 0), lf.cfg.vocab))
    lf_ms, hf_ms, bw, alone, same = r["lanefuse"], r["transformers"], r["bandwidth"], r["alone"], r["same"]
    store = lf.weights.store
    names = store.base.names() if hasattr(store, "base") else store.names()  # a mixture's: as stored, not stacked
    params = sum(math.prod(lf.weights.shape(n)) for n in names)
    # the f32 bytes a decode step streams: every weight but the embedding table, of which it reads one row (with
    # tied embeddings the lm_head product reads the whole table once), and of a mixture only the chosen experts
    vocab, hidden = lf.weights.shape("model.embed_tokens.weight")
    streamed = lf.streamed(params) - (0 if lf.cfg.tie_embeddings else (vocab - 1) * hidden)
    gb = 4 * streamed / 1e9
    ckpt = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
    lms, hms, gbs = statistics.median(lf_ms), statistics.median(hf_ms), statistics.median(bw)
    floor = 1e3 * gb / gbs
    # the ratios a round (its figures measured within seconds of each other), their medians: the machine's speed
    # drifts from minute to minute, and a ratio of medians taken minutes apart mixes its phases
    speed = statistics.median(h / lv for h, lv in zip(hf_ms, lf_ms))
    of_bw = statistics.median(1e3 * gb / b / lv for b, lv in zip(bw, lf_ms))
    print(f"model: {family}-shaped, {args.layers} layers, {params / 1e6:.0f}M parameters, {args.dtype} checkpoint "
          f"{ckpt / 1e6:.0f} MB; "
          f"{len(PROMPT)}-token prompt, {args.tokens} decode steps a round, {args.rounds} rounds interleaved")
    print(f"lanefuse first steps (plans, weights read and decoded to f32 once): {lf.load_s:.2f} s, resident memory "
          f"+{lf.load_bytes / 1e6:.0f} MB anonymous (f32 weights: {4 * params / 1e6:.0f} MB, "
          f"{1e3 * gb:.0f} MB of them read a decode step)")
    print(f"lanefuse ({lf.label}, {os.environ['OPENBLAS_NUM_THREADS']} BLAS threads): {lms:.1f} ms/token  "
          f"(rounds: {', '.join(f'{v:.1f}' for v in lf_ms)})")
    print(f"transformers eager, {args.threads} threads: {hms:.1f} ms/token  "
          f"(rounds: {', '.join(f'{v:.1f}' for v in hf_ms)})")
    if "llama.cpp" in r:
        ll_ms = r["llama.cpp"]
        print(f"llama.cpp (llama-cpp-python, the same weights as an f32 GGUF, {args.threads} threads): "
              f"{statistics.median(ll_ms):.1f} ms/token  (rounds: {', '.join(f'{v:.1f}' for v in ll_ms)}); "
              f"greedy tokens: the first {r['agree']['llama.cpp']} of {args.tokens} the same as lanefuse's")
    if r["prefill"]:
        pre = {k: statistics.median(v) for k, v in r["prefill"].items()}
        n = args.prefill
        print(f"prompt eval of a {n}-token prompt: " + ", ".join(
            f"{k} {1e3 * v:.0f} ms ({n / v:.0f} tokens/s)" for k, v in pre.items())
            + f"  (lanefuse: chunks of up to {MAX_CHUNK_ROWS} rows; medians of the rounds)")
    print(f"numpy f32 GEMV bandwidth from memory: {gbs:.1f} GB/s -> floor {floor:.1f} ms/token for the weights  "
          f"(rounds: {', '.join(f'{v:.1f}' for v in bw)})")
    if alone:
        ams = statistics.median(alone)
        of_alone = statistics.median(a / lv for a, lv in zip(alone, lf_ms))
        print(f"numpy, the step's products alone back to back (same shapes, no runner): {ams:.1f} ms/token "
              f"({gb / ams * 1e3:.1f} GB/s) -> lanefuse at {of_alone:.0%} of it")
    vs_llama = ""
    if "llama.cpp" in r:
        of_llama = statistics.median(c / lv for c, lv in zip(r["llama.cpp"], lf_ms))
        vs_llama = f"; lanefuse speed / llama.cpp f32: {of_llama:.2f}x"
        ll_bw = statistics.median(1e3 * gb / b / c for b, c in zip(bw, r["llama.cpp"]))
        print(f"the same bytes a step at the GEMV bandwidth: llama.cpp f32 at {ll_bw:.0%} of it, transformers at "
              f"{statistics.median(1e3 * gb / b / h for b, h in zip(bw, hf_ms)):.0%}")
    print(f"lanefuse speed / transformers: {speed:.2f}x{vs_llama}; lanefuse at {of_bw:.0%} of the GEMV bandwidth; "
          f"greedy tokens {'the same' if same else 'DIFFER'}  (medians of each round's ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
