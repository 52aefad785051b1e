"""What the parity tests share: transformers' greedy tokens and logits (the reference), whether a reference's margins
make a token comparison meaningful, and a step function running the fused plan in the numpy arena."""

from __future__ import annotations

import numpy as np


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """transformers' `n` greedy tokens after `prompt` and the logits each was chosen from (the whole sequence run
    anew a token, no cache: the plainest reference)."""
    import torch

    ids, toks, logits = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            out = model(torch.tensor([ids])).logits[0, -1].float().numpy()
            toks.append(int(np.argmax(out)))
            logits.append(out)
            ids.append(toks[-1])
    return toks, logits


def margins_ok(logits, least: float = 1e-3, relative: bool = True) -> bool:
    """Whether each step's top two logits are more than `least` apart (of the step's largest |logit| when
    `relative`): else a token comparison could turn on rounding."""
    for l in logits:
        a, b = np.sort(l)[-2:]
        if float(b - a) <= least * (float(np.abs(l).max()) if relative else 1.0):
            return False
    return True


def fused_step(weights, **plan_kw):
    """A `generate` step function: each step graph planned once (`plan_kw` to plan()) and run by the exact numpy
    twins inside the plan's arena."""
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    runners = {}

    def step(g, env):
        rows = g.meta["rows"]
        if rows not in runners:
            runners[rows] = NumpyRunner(plan(g, **plan_kw), weights)
        return runners[rows].step(env)

    return step


def scaled_error(got, want) -> float:
    """The largest |got − want| of any step's logits over that step's largest |want|."""
    return max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(got, want))
