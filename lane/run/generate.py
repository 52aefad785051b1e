"""Greedy generation: the prompt prefilled in chunks, then one decode step a token, the KV caches carried across
steps. Each step runs through `step_fn(graph, env) -> values` (the reference interpreter unless a backend plugs in)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from lanefuse.engine.errors import UserError
from lanefuse.engine.interp import evaluate
from lanefuse.engine.ir import Graph
from lanefuse.engine.front.model import ModelConfig, build_step
from lanefuse.engine.ir import MAX_CHUNK
from lanefuse.lane.run.sampling import PARAMS

StepFn = Callable[[Graph, dict], dict]


@dataclass
class GenResult:
    prompt_ids: list[int]
    generated_ids: list[int]
    logits: list[np.ndarray] = field(default_factory=list)  # (vocab,) the logits each generated token was taken from
    # (kept only where the caller asks, `keep_logits`: else empty, so a long run's memory does not grow with its tokens)
    prompt_s: float = 0.0  # seconds in the prefill steps (the prompt eval), planning inside them left out
    decode_s: float = 0.0  # seconds in the decode steps after the first generated token, planning left out
    setup_s: float = 0.0  # seconds the step function spent planning and setting up runners (its `spent` dict)


def _setup_s(step_fn) -> float:
    """Seconds a step function has spent planning and setting up its runners so far (`step_fn.spent`, where it
    keeps one), so the prompt-eval and decode times count the steps alone."""
    spent = getattr(step_fn, "spent", None)
    return sum(spent.values()) if spent else 0.0


def _not_finite(logits: np.ndarray, rows: int, pos: int, n_prompt: int) -> str:
    """The refusal of a step whose logits hold NaN or inf, naming the step: no token is taken from such logits."""
    what = (f"the prefill chunk of prompt rows {pos}..{pos + rows - 1}" if pos < n_prompt else
            f"the decode step of generated token {pos - n_prompt + 2} (position {pos})")
    n = int((~np.isfinite(logits)).sum())
    return (f"{what} gave {n} non-finite logit(s) of {logits.size} (NaN or inf): the model's weights or its "
            f"config's numbers overflow; no token taken from it")


def run_forms(prompts, chunk: int, n_tokens: int, slots: int) -> list[tuple[int, int]]:
    """The forms (rows, batch) a run of `prompts` in `slots` slots takes: each prefill chunk's width, then the decode
    step (a batch's of its slots) where a token follows the prefill's."""
    forms = {(min(chunk, len(p) - c), 1) for p in prompts for c in range(0, len(p), chunk)}
    if n_tokens > 1:
        forms.add((1, slots))
    return sorted(forms)


def new_caches(cfg: ModelConfig, step_fn=None):
    """Zeroed carried tables: the KV caches kc{i} / vc{i} (max_len, kv_heads*head_dim) f32 each, and any carried
    states the family's step holds (`cfg.carried()`). A step function with a `hold(shapes)` (the numpy backend's,
    lane/run/step.py) places them in the arena buffer its forms share (a mapping of views into it); else arrays."""
    shapes = cfg.carried()
    hold = getattr(step_fn, "hold", None)
    if hold is not None:
        return hold(shapes)
    return {name: np.zeros(shape, dtype=np.float32) for name, shape in shapes.items()}


def generate_step_graph(g: Graph, weights, prompt_ids, n_tokens: int, step_fn: StepFn | None = None,
                        progress: bool = False, keep_logits: bool = True, sampling=None, on_token=None) -> GenResult:
    """Greedy-decode with one given decode-step graph (a step YAML): the prompt fed row by row, the caches as the
    graph declares them."""
    rows = int(g.meta.get("rows", g.tensors[g.io.token].shape[0]))
    if rows != 1:
        raise UserError(f"a step of {rows} rows cannot generate tokens: give a decode step (1 row)")
    tables = [g.tensors[n] for n in g.io.tables]
    if not tables:
        raise UserError("the step carries no KV-cache tables to generate with")
    vocab = g.tensors[g.io.logits].shape[-1]
    layers = len(g.io.caches)
    first = tables[0]
    cfg = ModelConfig("step", 0, layers, 1, 1, first.shape[1], 0, vocab, max_len=first.shape[0])
    caches = {t.name: np.zeros(t.shape, dtype=np.float32) for t in tables}
    return generate(cfg, weights, prompt_ids, n_tokens, step_fn=step_fn, chunk=1, progress=progress,
                    graph=g, caches=caches, keep_logits=keep_logits, sampling=sampling, on_token=on_token)


def generate(cfg: ModelConfig, weights, prompt_ids, n_tokens: int, step_fn: StepFn | None = None,
             chunk: int = MAX_CHUNK, progress: bool = False, graph: Graph | None = None,
             caches: dict[str, np.ndarray] | None = None, eos: tuple[int, ...] = (),
             keep_logits: bool = True, sampling=None, on_token: Callable[[int], None] | None = None) -> GenResult:
    """Greedy-decode `n_tokens` after `prompt_ids` (with `graph`, that one decode step for every row); the run ends
    early after a token of `eos`. A step function with a `decode(graph, env, n, logits=, eos=, on_chunk=)` (the CuPy
    backend's) runs the decode steps after the first back to back on the device, the host reading the tokens and
    logits once a chunk of DECODE_CHUNK steps; the same tokens and logits as one step a token. Every step's logits
    are checked finite; they are kept in the result only with `keep_logits` (without it the run holds at most a
    chunk's logits at a time, whatever its length). `sampling` (a lane.run.sampling.Sampling that is not greedy) draws
    each token instead of the arg-max: by the plan's `sample` launch where the step function's plans close with it
    (`step_fn.sampling`, plan_step_fn's: the step input `sampling` gives it the token's index; the device's
    back-to-back decode runs as greedy's, no logits read back to draw), else on the host by the launch's twin from the
    step's logits (the reference interpreter). `on_token(id)` is called as each token is taken (the device's decode:
    as each chunk of them comes back), to stream them."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise UserError("the prompt is empty: give at least one token")
    bad = [t for t in prompt if not 0 <= t < cfg.vocab]
    if bad:
        raise UserError(f"prompt token {bad[0]} is outside the vocabulary (0..{cfg.vocab - 1})")
    if n_tokens < 0:
        raise UserError(f"cannot generate {n_tokens} tokens")
    if not 1 <= chunk <= MAX_CHUNK:
        raise UserError(f"a prefill chunk of {chunk} rows (1..{MAX_CHUNK})")
    need = len(prompt) + max(n_tokens - 1, 0)
    if need > cfg.max_len:
        raise UserError(f"{len(prompt)} prompt tokens and {n_tokens} generated need {need} positions; the KV caches "
                        f"hold {cfg.max_len} (--ctx N gives them more rows)")
    if step_fn is None:
        def step_fn(g: Graph, env: dict) -> dict:
            return evaluate(g, weights, env)

    graphs: dict[int, Graph] = {}

    def step(tokens: list[int], pos: int) -> tuple[np.ndarray, int]:
        rows = len(tokens)
        if rows not in graphs:
            graphs[rows] = graph if graph is not None else build_step(cfg, rows)
        env = dict(caches)
        env["token"] = np.asarray(tokens, dtype=np.int32)
        env["pos"] = np.asarray([pos], dtype=np.int32)
        if launched:  # the plan's sample launch draws token len(generated) of sequence 0
            env[PARAMS] = sampling.words([(0, len(result.generated_ids))])
        t0, s0 = time.perf_counter(), _setup_s(step_fn)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below, naming the step
            out = step_fn(graphs[rows], env)
            logits = np.asarray(out["logits"], dtype=np.float32).reshape(-1)
        nxt = int(np.asarray(out["next"]).reshape(-1)[0])  # on CuPy: waits for the step to finish
        setup = _setup_s(step_fn) - s0
        result.setup_s += setup
        if not np.isfinite(logits).all():
            raise UserError(_not_finite(logits, rows, pos, len(prompt)))
        if draw and not launched:  # the reference (no launch): the launch's twin on the last row's logits
            nxt = sampling.pick(logits[-cfg.vocab:], 0, len(result.generated_ids))
        return logits, nxt, time.perf_counter() - t0 - setup

    def decode_on_device(decode, tokens: list[int], pos: int) -> None:
        """The rest of the run from `tokens` at `pos`, back to back on the device (`step_fn.decode`), a chunk of
        DECODE_CHUNK steps a call: each call's logits checked, then kept or dropped, so the host never holds more
        than a chunk's logits it was not asked for (the token and position of each call after the first are the ones
        the device advanced to; uploading them again changes nothing)."""
        from lanefuse.lane.run.cupy_runner import DECODE_CHUNK

        if 1 not in graphs:
            graphs[1] = graph if graph is not None else build_step(cfg, 1)
        left = n_tokens - len(result.generated_ids)
        while left > 0:
            env = dict(caches)
            env["token"] = np.asarray(tokens, dtype=np.int32)
            env["pos"] = np.asarray([pos], dtype=np.int32)
            if launched:  # the first step's draw index; the launch moves it on step by step on the device
                env[PARAMS] = sampling.words([(0, len(result.generated_ids))])
            k = min(DECODE_CHUNK, left)
            t0, s0 = time.perf_counter(), _setup_s(step_fn)
            with np.errstate(over="ignore", invalid="ignore"):
                toks, rows = decode(graphs[1], env, k, eos=tuple(eos), on_chunk=bar.update if bar else None)
            setup = _setup_s(step_fn) - s0
            result.setup_s += setup
            result.decode_s += time.perf_counter() - t0 - setup
            for i, (t, row) in enumerate(zip(toks, rows)):  # refused at the first step whose logits are not finite
                if not np.isfinite(row).all():
                    raise UserError(_not_finite(row, 1, pos + i, len(prompt)))
                result.generated_ids.append(int(t[-1]))
                if on_token:
                    on_token(int(t[-1]))
                if keep_logits:
                    result.logits.append(np.array(row, dtype=np.float32))
            if len(toks) < k or (len(toks) and int(toks[-1][-1]) in ends):  # an end of sequence: the run stops
                return
            left -= len(toks)
            pos += len(toks)
            tokens = [int(toks[-1][-1])]

    caches = caches if caches is not None else new_caches(cfg, step_fn)
    reserve = getattr(step_fn, "reserve", None)  # the device's: its forms' room in one allocation up front
    if reserve is not None and graph is None and n_tokens > 0:
        for rows, _ in run_forms([prompt], chunk, n_tokens, 1):
            graphs[rows] = build_step(cfg, rows)
        reserve(list(graphs.values()))
    ends = frozenset(int(e) for e in eos)
    draw = sampling is not None and not sampling.greedy
    launched = draw and getattr(step_fn, "sampling", None) == sampling  # a plan's sample launch draws the tokens
    result = GenResult(prompt, [], [])
    if n_tokens == 0:
        return result
    n_chunks = (len(prompt) + chunk - 1) // chunk
    show = progress and sys.stdout.isatty()
    bar = None
    if show:
        from tqdm import tqdm

        # streamed tokens show the decode's progress themselves: the bar then counts the prompt's chunks alone, and
        # is gone before the first token is written
        bar = tqdm(total=n_chunks if on_token else n_chunks + n_tokens - 1,
                   desc="prompt eval" if on_token else "generating", unit="step", leave=False)
    try:
        for c in range(n_chunks):
            logits, nxt, dt = step(prompt[c * chunk:(c + 1) * chunk], c * chunk)
            result.prompt_s += dt
            if bar:
                bar.update(1)
        if bar and on_token:
            bar.close()
            bar = None
        pos = len(prompt)
        device = None if draw and not launched else getattr(step_fn, "decode", None)
        while True:
            result.generated_ids.append(nxt)
            if on_token:
                on_token(nxt)
            if keep_logits:
                result.logits.append(logits)
            if len(result.generated_ids) == n_tokens or nxt in ends:
                break
            if device is not None:
                decode_on_device(device, [nxt], pos)
                break
            logits, nxt, dt = step([nxt], pos)
            result.decode_s += dt
            pos += 1
            if bar:
                bar.update(1)
    finally:
        if bar:
            bar.close()
    return result
