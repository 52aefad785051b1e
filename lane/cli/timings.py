"""`lanefuse run`'s timings, as a llama.cpp user reads them: load, plan, prompt eval and decode, each in ms with tokens
and tokens/s; printed on stderr after the run and written under `timings` in `--json`."""

from __future__ import annotations

import sys


def run_timings(load_s: float, res, spent: dict | None) -> dict:
    """The figures of a generation `res` (a GenResult): `load_s` opening the model, `spent` the step function's
    planning and runner setup (`plan_s`, `setup_s`: a runner's setup loads its weights, so it counts as load).
    Decode counts the steps after the first generated token, which the prompt eval gives."""
    spent = spent or {}
    prompt = len(res.prompt_ids)
    decode = max(len(res.generated_ids) - 1, 0)
    pe_ms, de_ms = res.prompt_s * 1e3, res.decode_s * 1e3
    return {
        "load_ms": round((load_s + spent.get("setup_s", 0.0)) * 1e3, 3),
        "plan_ms": round(spent.get("plan_s", 0.0) * 1e3, 3),
        "prompt_tokens": prompt, "prompt_ms": round(pe_ms, 3),
        "prompt_tokens_per_s": round(prompt / res.prompt_s, 2) if res.prompt_s > 0 else None,
        "decode_tokens": decode, "decode_ms": round(de_ms, 3),
        "decode_ms_per_token": round(de_ms / decode, 3) if decode else None,
        "decode_tokens_per_s": round(decode / res.decode_s, 2) if decode and res.decode_s > 0 else None,
    }


def _rate(ms: float, n: int, per_s) -> str:
    if not n:
        return ""
    return f" ({ms / n:8.2f} ms/token, {per_s:8.2f} tokens/s)" if per_s else f" ({ms / n:8.2f} ms/token)"


def print_timings(t: dict, file=None) -> None:
    """Four lines, llama.cpp's layout: `prompt eval: 12.34 ms / 3 tokens (4.11 ms/token, 243.12 tokens/s)`."""
    out = file or sys.stderr
    print(f"load       : {t['load_ms']:10.2f} ms", file=out)
    print(f"plan       : {t['plan_ms']:10.2f} ms", file=out)
    print(f"prompt eval: {t['prompt_ms']:10.2f} ms / {t['prompt_tokens']:4d} tokens"
          + _rate(t["prompt_ms"], t["prompt_tokens"], t["prompt_tokens_per_s"]), file=out)
    print(f"decode     : {t['decode_ms']:10.2f} ms / {t['decode_tokens']:4d} tokens"
          + _rate(t["decode_ms"], t["decode_tokens"], t["decode_tokens_per_s"])
          + ("" if t["decode_tokens"] else " (the first token comes from the prompt eval)"), file=out)
