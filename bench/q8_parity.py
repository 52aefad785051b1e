"""q8 parity with llama.cpp at a real model's width (issue 41): a random-weight llama of SmolLM-135M's shape (hidden
576, 9 heads over 3 KV heads of 64, FFN 1536, tied embeddings, a 49,152-token vocabulary; LAYERS layers) written in
each of llama.cpp's presets' formats (a K-quant or iq4_xs where rows are whole 256-value blocks, llama.cpp's fallback
elsewhere), a 12-token prompt and STEPS greedy steps in llama.cpp (llama-cpp-python, CPU, F32 KV cache, extra buffers
off; tests/llama_cpp_dump.py) and in lanefuse under --numerics q8 (the reference interpreter of the q8 step graph; or
`--plan`, the fused plan's exact numpy twins, what `lanefuse run --numerics q8` runs on the CPU; or `--fast`, its
fast twins, `run --fast-twins`), the prompt in one chunk as llama.cpp evaluates it in one batch. Prints,
per preset, the largest |logit - llama.cpp's| and each step's, and whether the greedy tokens are equal. The files and
llama.cpp's answers are kept in --files (made once).

    python bench/q8_parity.py [--layers 2] [--steps 8] [--vocab 49152] [--plan | --fast] [--files DIR] [PRESET ...]"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parent.parent / "tests"
PRESETS = {  # llama.cpp's preset: (the format of rows of whole 256-value blocks, its fallback)
    "Q8_0": ("q8_0", "q8_0"), "Q6_K": ("q6_k", "q8_0"), "Q5_K_M": ("q5_k", "q5_1"), "Q5_0": ("q5_0", "q5_0"),
    "Q4_K_M": ("q4_k", "q5_0"), "Q4_0": ("q4_0", "q4_0"), "Q3_K_M": ("q3_k", "q4_0"), "IQ4_NL": ("iq4_nl", "iq4_nl"),
    "IQ4_XS": ("iq4_xs", "iq4_nl"), "Q4_1": ("q4_1", "q4_1"), "Q5_1": ("q5_1", "q5_1"), "Q2_K": ("q2_k", "q4_0")}
COMMON = ["Q8_0", "Q6_K", "Q5_K_M", "Q5_0", "Q4_K_M", "Q4_0", "Q3_K_M", "IQ4_NL", "IQ4_XS"]  # the presets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("presets", nargs="*", default=COMMON)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--plan", action="store_true", help="the fused plan's exact twins, not the reference interpreter")
    ap.add_argument("--fast", action="store_true", help="the fused plan as `lanefuse run --numerics q8 --fast-twins` "
                    "runs it on the CPU (the fast twins: f32 BLAS on decoded rows), not the reference interpreter")
    ap.add_argument("--timing", type=int, default=0, metavar="ROUNDS", help="also time the exact and the fast twins "
                    "(ms a decode token and for the prompt, the median of ROUNDS rounds taken in turn)")
    ap.add_argument("--files", default=str(Path(tempfile.gettempdir()) / "lanefuse-q8-parity"))
    args = ap.parse_args()
    sys.path.insert(0, str(TESTS))
    import test_formats_more_gguf as tf

    from lanefuse.engine.formats.quantize import with_numerics
    from lanefuse.engine.front.load import load_model
    from lanefuse.engine.interp import evaluate
    from lanefuse.lane.run.generate import generate

    files = Path(args.files)
    files.mkdir(parents=True, exist_ok=True)
    shape = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                 vocab_size=args.vocab, tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5,
                 num_hidden_layers=args.layers, max_position_embeddings=256)
    prompt = [int(x) for x in np.random.default_rng(1).integers(100, args.vocab - 100, 12)]
    model = None
    what = ("fused plan (the fast twins, run --fast-twins)" if args.fast else
            "fused plan (exact twins, run's default)" if args.plan else "reference interpreter")
    print(f"{args.layers} layers, vocabulary {args.vocab}, {args.steps} steps, lanefuse {what} under q8", flush=True)
    for name in args.presets:
        main_f, fallback = PRESETS[name]
        path = files / f"{name}-{args.layers}-{args.vocab}.gguf"
        answer = path.with_suffix(f".s{args.steps}.pkl")
        if not path.exists():
            if model is None:
                model = tf.gf.tiny_model("llama", **shape)
            tf.write(model, path, lambda n, cols: main_f if cols % 256 == 0 else fallback, tokenizer=True)
        if not answer.exists():  # llama.cpp in a child process: a crash there takes only the child
            code = ("import pickle, sys; sys.path.insert(0, %r); from llama_cpp_dump import greedy; "
                    "pickle.dump(greedy(%r, %r, %d, n_ctx=256), open(%r, 'wb'))"
                    % (str(TESTS), str(path), prompt, args.steps, str(answer)))
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
            if p.returncode:
                print(f"{name}: llama.cpp failed ({p.returncode}): {p.stderr[-300:]}", flush=True)
                continue
        want, want_logits = pickle.loads(answer.read_bytes())
        t0 = time.time()
        cfg, weights = load_model(path)
        if args.fast or args.plan:  # as `lanefuse run --numerics q8 [--fast-twins]` runs on the CPU
            step = run_step(weights, exact=not args.fast)
        else:
            step = lambda g, env: evaluate(with_numerics(g, "q8"), weights, env)  # noqa: E731
        got = generate(cfg, weights, prompt, args.steps, chunk=len(prompt), step_fn=step)
        apart = [float(np.abs(a - b).max()) for a, b in zip(got.logits, want_logits)]
        first = next((i for i, (a, b) in enumerate(zip(got.generated_ids, want)) if a != b), None)
        scale = max(float(np.abs(b).max()) for b in want_logits)
        print(f"{name} ({main_f}/{fallback}): max |dlogit| {max(apart):.3g} (by step "
              f"{' '.join(f'{a:.2g}' for a in apart)}; logits up to {scale:.3g}); tokens "
              f"{'equal' if first is None else f'apart from step {first}'} [{time.time() - t0:.0f} s]", flush=True)
        if args.timing:
            print(f"  {token_ms(cfg, weights, prompt, args.timing)}", flush=True)


def run_step(weights, exact: bool):
    from lanefuse.lane.lower.plan import PlanOptions
    from lanefuse.lane.run.step import plan_step_fn

    return plan_step_fn(weights, "cpu", PlanOptions(numerics="q8"), exact=exact)[0]


def token_ms(cfg, weights, prompt: list[int], rounds: int, steps: int = 4) -> str:
    """The exact and the fast twins' milliseconds a decode token and for the prompt (one chunk), each the median of
    `rounds` rounds taken in turn (this machine's other load falls on both): a round's decode is (prompt + 1 +
    `steps` steps) less (prompt + 1 step), over `steps`."""
    from lanefuse.lane.run.generate import generate

    fns = {"exact": run_step(weights, True), "fast": run_step(weights, False)}
    times: dict[str, list] = {k: [] for k in fns}
    for _ in range(rounds + 1):  # the first round plans and binds (not counted)
        for k, fn in fns.items():
            t0 = time.perf_counter()
            generate(cfg, weights, prompt, 1, chunk=len(prompt), step_fn=fn)
            t1 = time.perf_counter()
            generate(cfg, weights, prompt, 1 + steps, chunk=len(prompt), step_fn=fn)
            t2 = time.perf_counter()
            times[k].append((1000 * (t1 - t0), 1000 * ((t2 - t1) - (t1 - t0)) / steps))
    med = {k: np.median(np.array(v[1:]), axis=0) for k, v in times.items()}
    return (f"ms a decode token: exact {med['exact'][1]:.0f}, fast {med['fast'][1]:.0f} "
            f"({med['exact'][1] / med['fast'][1]:.2f}x); the prompt of {len(prompt)}: exact {med['exact'][0]:.0f}, "
            f"fast {med['fast'][0]:.0f} (median of {rounds} rounds)")


if __name__ == "__main__":
    main()
