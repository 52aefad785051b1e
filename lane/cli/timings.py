"""`lanefuse run`'s timings, as a llama.cpp user reads them: load, plan, prompt eval, decode and total, each in ms with
tokens and tokens/s; printed on stderr after the run (a single run's and a batch's alike) and written under `timings`
in `--json`."""

from __future__ import annotations

import sys


def run_timings(load_s: float, res, spent: dict | None, total_s: float | None = None) -> dict:
    """The figures of a generation `res` (a GenResult): `load_s` opening the model, `spent` the step function's
    planning and runner setup (`plan_s`, `setup_s`: a runner's setup loads its weights, so it counts as load),
    `total_s` the command's wall time from its start to the last token. Decode counts the steps after the first
    generated token, which the prompt eval gives."""
    return _timings(load_s, spent, len(res.prompt_ids), res.prompt_s, max(len(res.generated_ids) - 1, 0),
                    res.decode_s, len(res.generated_ids), total_s)


def batch_timings(load_s: float, results, spent: dict | None, total_s: float | None = None) -> dict:
    """A batch's figures, as `run_timings`: the prompts' tokens and prefill seconds summed, the decode steps' tokens
    and seconds summed (a shared step's time is split over its sequences, so the sum is the batch's decode time)."""
    return _timings(load_s, spent, sum(len(r.prompt_ids) for r in results), sum(r.prompt_s for r in results),
                    sum(max(len(r.generated_ids) - 1, 0) for r in results), sum(r.decode_s for r in results),
                    sum(len(r.generated_ids) for r in results), total_s)


def _timings(load_s, spent, prompt, prompt_s, decode, decode_s, generated, total_s) -> dict:
    spent = spent or {}
    pe_ms, de_ms = prompt_s * 1e3, decode_s * 1e3
    out = {
        "load_ms": round((load_s + spent.get("setup_s", 0.0)) * 1e3, 3),
        "plan_ms": round(spent.get("plan_s", 0.0) * 1e3, 3),
        "prompt_tokens": prompt, "prompt_ms": round(pe_ms, 3),
        "prompt_tokens_per_s": round(prompt / prompt_s, 2) if prompt_s > 0 else None,
        "decode_tokens": decode, "decode_ms": round(de_ms, 3),
        "decode_ms_per_token": round(de_ms / decode, 3) if decode else None,
        "decode_tokens_per_s": round(decode / decode_s, 2) if decode and decode_s > 0 else None,
    }
    if total_s is not None:
        out["total_ms"] = round(total_s * 1e3, 3)
        out["total_tokens"] = prompt + generated
    return out


def _rate(ms: float, n: int, per_s) -> str:
    if not n:
        return ""
    return f" ({ms / n:8.2f} ms/token, {per_s:8.2f} tokens/s)" if per_s else f" ({ms / n:8.2f} ms/token)"


def print_timings(t: dict, file=None) -> None:
    """llama.cpp's layout: `prompt eval: 12.34 ms / 3 tokens (4.11 ms/token, 243.12 tokens/s)`, then the total."""
    out = file or sys.stderr
    print(f"load       : {t['load_ms']:10.2f} ms", file=out)
    print(f"plan       : {t['plan_ms']:10.2f} ms", file=out)
    print(f"prompt eval: {t['prompt_ms']:10.2f} ms / {t['prompt_tokens']:4d} tokens"
          + _rate(t["prompt_ms"], t["prompt_tokens"], t["prompt_tokens_per_s"]), file=out)
    print(f"decode     : {t['decode_ms']:10.2f} ms / {t['decode_tokens']:4d} tokens"
          + _rate(t["decode_ms"], t["decode_tokens"], t["decode_tokens_per_s"])
          + ("" if t["decode_tokens"] else " (the first token comes from the prompt eval)"), file=out)
    if "total_ms" in t:
        print(f"total      : {t['total_ms']:10.2f} ms / {t['total_tokens']:4d} tokens (load, plan and the run)",
              file=out)
