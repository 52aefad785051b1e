"""Greedy generation of several prompts in slots: each prompt prefilled alone into its slot's rows of the caches, then
decoded with the others, one batch step (engine/front/model.py `build_step(cfg, 1, batch=B)`) a token for every slot; a
sequence that ends (its token count, or the config's end-of-sequence id) gives its slot to the next waiting prompt.
The steps' graphs never change while it runs: only which cache rows each slot holds."""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from lanefuse.engine.errors import UserError
from lanefuse.engine.interp import evaluate
from lanefuse.engine.ir import Graph
from lanefuse.engine.front.model import ModelConfig, build_step
from lanefuse.engine.ir import MAX_BATCH, MAX_CHUNK
from lanefuse.lane.run.generate import GenResult, StepFn, _not_finite, _setup_s, run_forms
from lanefuse.lane.run.sampling import PARAMS


def batch_caches(cfg: ModelConfig, slots: int, step_fn=None):
    """Zeroed carried tables for `slots` sequences, a slot of each a sequence: every KV cache (slots·max_len,
    kv_heads·head_dim) f32, slot s's rows from s·max_len; a family's carried states likewise (`cfg.carried()`:
    Qwen3-Next's convolution rings and recurrent states, slot s's rows from s times one sequence's). A step function
    with a `hold(shapes)` (the numpy backend's) places them in the arena buffer its forms share; else arrays."""
    shapes = {name: (slots * shape[0],) + tuple(shape[1:]) for name, shape in cfg.carried().items()}
    hold = getattr(step_fn, "hold", None)
    if hold is not None:
        return hold(shapes, slots=slots)
    return {name: np.zeros(shape, dtype=np.float32) for name, shape in shapes.items()}


def cache_bytes(cfg: ModelConfig, slots: int) -> int:
    """The bytes of the carried tables of `slots` sequences of max_len positions, f32: every KV cache at its family's
    widths and layers (`cfg.carried()`: DeepSeek-V3's latent and rotated-key caches, Qwen3-Next's full-attention
    layers' alone) and a family's carried states (Qwen3-Next's rings and delta-rule states), a slot of each a
    sequence, as batch_caches makes them."""
    return 4 * slots * sum(int(np.prod(shape)) for shape in cfg.carried().values())


def check_prompts(cfg: ModelConfig, prompts, n_tokens: int) -> list[list[int]]:
    """The prompts as id lists, each checked: not empty, ids in the vocabulary, room in a slot for its tokens."""
    out = []
    if not prompts:
        raise UserError("no prompts to generate from: give --prompt-ids (repeatable) or --prompts FILE")
    if n_tokens < 1:
        raise UserError(f"cannot generate {n_tokens} tokens for a batch (at least 1)")
    for k, p in enumerate(prompts):
        ids = [int(t) for t in p]
        if not ids:
            raise UserError(f"prompt {k + 1} is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < cfg.vocab]
        if bad:
            raise UserError(f"prompt {k + 1}: token {bad[0]} is outside the vocabulary (0..{cfg.vocab - 1})")
        need = len(ids) + n_tokens - 1
        if need > cfg.max_len:
            raise UserError(f"prompt {k + 1}: {len(ids)} prompt tokens and {n_tokens} generated need {need} "
                            f"positions; a slot's KV caches hold {cfg.max_len} (--ctx N gives them more rows)")
        out.append(ids)
    return out


def generate_batch(cfg: ModelConfig, weights, prompts, n_tokens: int, slots: int | None = None,
                   step_fn: StepFn | None = None, eos: tuple[int, ...] = (), chunk: int = MAX_CHUNK,
                   keep_logits: bool = True, sampling=None) -> list[GenResult]:
    """Greedy-decode up to `n_tokens` after each prompt, `slots` sequences at a time (default: every prompt, at most
    MAX_BATCH); a sequence ends at its `n_tokens`-th token or at an id of `eos`. One result a prompt, in order; each
    step's logits checked finite, kept in the results only with `keep_logits` (else the run's memory does not grow
    with its tokens). `sampling` (a lane.run.sampling.Sampling that is not greedy) draws each sequence's tokens,
    prompt k's token i as the k-th sequence's draw i (whatever slot it runs in): by the plans' `sample` launch where
    the step function's plans close with it (`step_fn.sampling`: the step input `sampling` names each slot's sequence
    and token index; the device's back-to-back decode runs as greedy's), else on the host by the launch's twin from
    the logits (the reference interpreter)."""
    prompts = check_prompts(cfg, prompts, n_tokens)
    draw = sampling is not None and not sampling.greedy
    launched = draw and getattr(step_fn, "sampling", None) == sampling  # a plan's sample launch draws the tokens
    slots = min(len(prompts), MAX_BATCH) if slots is None else slots
    if not 1 <= slots <= MAX_BATCH:
        raise UserError(f"--batch {slots}: a batch holds 1..{MAX_BATCH} slots")
    if step_fn is None:
        def step_fn(g: Graph, env: dict) -> dict:
            return evaluate(g, weights, env)

    caches = batch_caches(cfg, slots, step_fn)
    graphs: dict[tuple[int, int], Graph] = {}
    reserve = getattr(step_fn, "reserve", None)  # the device's: its forms' room in one allocation up front
    if reserve is not None:
        for key in run_forms(prompts, chunk, n_tokens, slots):
            graphs[key] = build_step(cfg, key[0], batch=key[1])
        reserve(list(graphs.values()))
    results = [GenResult(p, [], []) for p in prompts]
    ends = frozenset(eos)

    def run(rows: int, batch: int, env: dict) -> tuple[np.ndarray, np.ndarray, float]:
        """One step: its logits (a row a sequence), next tokens, and the seconds it ran, planning left out."""
        key = (rows, batch)
        if key not in graphs:
            graphs[key] = build_step(cfg, rows, batch=batch)
        t0, s0 = time.perf_counter(), _setup_s(step_fn)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused by the caller, naming the step
            out = step_fn(graphs[key], env)
            logits = np.asarray(out["logits"], dtype=np.float32).reshape(batch if batch > 1 else 1, -1)
        nxt = np.asarray(out["next"]).reshape(-1)
        return logits, nxt, time.perf_counter() - t0 - (_setup_s(step_fn) - s0)

    def prefill(s: int, k: int) -> tuple[np.ndarray, int]:
        """Prompt k alone into slot s's rows of the caches; the logits and first token it gives."""
        prompt = prompts[k]

        def view() -> dict:  # the slot's rows, written in place (taken anew each chunk: a grown arena moves them)
            return {n: t[s * (len(t) // slots):(s + 1) * (len(t) // slots)] for n, t in caches.items()}

        # zeroed first: a carried state (a ring, a delta-rule state) is read from its start, so the slot's last
        # sequence must leave nothing in it (KV rows past a position are never read either way)
        for t in view().values():
            t[...] = 0.0
        for c in range(0, len(prompt), chunk):
            env = view()
            env["token"] = np.asarray(prompt[c:c + chunk], dtype=np.int32)
            env["pos"] = np.asarray([c], dtype=np.int32)
            if launched:  # prompt k's first token: its sequence's draw 0
                env[PARAMS] = sampling.words([(k, 0)])
            logits, nxt, dt = run(len(env["token"]), 1, env)
            results[k].prompt_s += dt
            if not np.isfinite(logits).all():
                raise UserError(f"prompt {k + 1}: " + _not_finite(logits, len(env["token"]), c, len(prompt)))
        return logits[0], (sampling.pick(logits[0], k, 0) if draw and not launched else int(nxt[0]))

    waiting = deque(range(len(prompts)))
    held: list[int | None] = [None] * slots  # the prompt each slot decodes
    pos = np.zeros(slots, dtype=np.int32)  # each slot's next position
    last = np.zeros(slots, dtype=np.int32)  # each slot's last token

    def take(s: int, logits: np.ndarray, token: int) -> None:
        """Slot s's sequence takes `token`; where it ends, the next waiting prompt takes the slot (prefilled)."""
        k = held[s]
        r = results[k]
        r.generated_ids.append(token)
        if keep_logits:
            r.logits.append(logits)
        if len(r.generated_ids) < n_tokens and token not in ends:
            last[s] = token
            return
        held[s] = None
        pos[s] = 0
        last[s] = 0
        if waiting:
            admit(s)

    def admit(s: int) -> None:
        k = waiting.popleft()
        held[s] = k
        to_slot = getattr(step_fn, "to_slot", None)  # the device runner's: its caches into the slot's rows
        fresh = getattr(to_slot, "fresh", None)  # ... and its one-sequence caches zeroed for a prompt (its states)
        if fresh is not None:
            fresh()
        logits, token = prefill(s, k)
        if to_slot is not None and slots > 1:
            to_slot(s, slots)
        pos[s] = len(prompts[k])
        take(s, logits, token)

    def on_device(decode, env: dict) -> None:
        """Decode steps of the batch back to back on the device (`step_fn.decode`, the CuPy backend's), the host
        reading the chunk's tokens and logits once at its end: as many steps as the busy slot with the fewest tokens
        left still takes (at most a chunk), so no slot's rows run past its own. A sequence that ends inside the chunk
        (its count, or an eos id) takes no token after its end; its slot goes to the next waiting prompt at the
        chunk's end, not at the step (the read a slot's refill needs comes once a chunk): each sequence's tokens and
        logits are those of the step-by-step loop, its steps independent of the other slots'."""
        from lanefuse.lane.run.cupy_runner import DECODE_CHUNK

        busy = [s for s in range(slots) if held[s] is not None]
        steps = min(DECODE_CHUNK, min(n_tokens - len(results[held[s]].generated_ids) for s in busy))
        key = (1, slots)
        if key not in graphs:
            graphs[key] = build_step(cfg, 1, batch=slots)
        t0, s0 = time.perf_counter(), _setup_s(step_fn)
        with np.errstate(over="ignore", invalid="ignore"):
            toks, rows = decode(graphs[key], env, steps)
        dt = time.perf_counter() - t0 - (_setup_s(step_fn) - s0)
        live = set(busy)  # the slots whose sequence of the chunk's start has not ended
        for i in range(len(toks)):
            now = [s for s in busy if s in live]
            if not now:
                break
            logits = rows[i].reshape(slots, -1)
            for s in now:
                if not np.isfinite(logits[s]).all():
                    k = held[s]
                    raise UserError(f"prompt {k + 1}: " + _not_finite(logits[s], 1, int(pos[s]), len(prompts[k])))
            for s in now:
                results[held[s]].decode_s += dt / len(toks) / len(now)
            for s in now:
                k = held[s]
                pos[s] += 1
                take(s, np.array(logits[s], dtype=np.float32), int(toks[i, s]))
                if held[s] != k:  # ended (the slot free, or refilled with a prompt decoded from the next chunk)
                    live.discard(s)

    device = None if draw and not launched else getattr(step_fn, "decode", None)
    for s in range(slots):
        if waiting:
            admit(s)
    while any(k is not None for k in held):
        env = dict(caches)
        env["token"] = last.copy()
        env["pos"] = pos.copy()  # a free slot decodes a dummy row at position 0 of its own slot, read by no one
        if launched:  # each slot's sequence and the index of its next token (a free slot's: drawn, read by no one)
            env[PARAMS] = sampling.words([(k, len(results[k].generated_ids)) if k is not None else (0, 0)
                                           for k in held])
        if device is not None:
            on_device(device, env)
            continue
        logits, nxt, dt = run(1, slots, env)  # one slot: the decode step of one sequence
        busy = [s for s in range(slots) if held[s] is not None]
        for s in busy:
            if not np.isfinite(logits[s]).all():
                k = held[s]
                raise UserError(f"prompt {k + 1}: " + _not_finite(logits[s], 1, int(pos[s]), len(prompts[k])))
        for s in busy:  # the step's time shared by its sequences: the results' sum is the batch's decode time
            results[held[s]].decode_s += dt / len(busy)
            pos[s] += 1
            k = held[s]
            take(s, logits[s], sampling.pick(logits[s], k, len(results[k].generated_ids)) if draw and not launched
                 else int(nxt[s]))
    return results
