"""Batches under --numerics q8 (issue 40): for every family, the checkpoint's rows of whole 32-value blocks held in
q8_0 (so the products over them read their activations quantized), three prompts of different lengths in two slots
that refill give each sequence the tokens it gets alone under the same numerics — the reference interpreter's batch
step against its one-sequence steps, and the fused plan's batch step (exact twins) against the fused plan alone —
logits within 1e-5 of their scale."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lanefuse.engine.interp import evaluate
from lanefuse.engine.formats.quantize import with_numerics
from lanefuse.engine.front.weights import Weights
from lanefuse.engine.formats.blocks import encode
from lanefuse.lane.lower.plan import plan
from lanefuse.lane.run.batch import generate_batch
from lanefuse.lane.run.generate import generate
from lanefuse.lane.run.numpy_runner import NumpyRunner
from test_batch import FAMILIES, _hf_model

# every family of test_batch, Mistral and Phi-3 in their variants whose rows are whole q8_0 blocks (hidden 32 / 64:
# the f32 variants' 48-value rows hold none)
Q8_MODELS = [{"mistral_window_f32": "mistral_window_bf16", "phi3_window_f32": "phi3_bf16"}.get(n, n) for n in FAMILIES]


def _model(name, tmp_path):
    if name in ("mistral_window_bf16", "phi3_bf16"):
        pytest.importorskip("transformers")
        from test_hf_parity import _build

        from lanefuse.engine.front.load import load_model

        folder, _ = _build(name, tmp_path)
        return load_model(folder)
    return _hf_model(name, tmp_path)

TOL = 1e-5
PROMPTS = [[3, 17, 5, 42, 8, 11], [9, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


def q8_rows(cfg, w):
    """The model with every 2-D checkpoint tensor whose rows are whole q8_0 blocks stored in q8_0 (the values
    quantized), the rest as they were; and the names so stored."""
    arrays, formats, moved = {}, dict(cfg.formats), []
    for n in w.store.names():
        raw, fmt = w.raw(n)
        a = w.get(n)
        if a.ndim == 2 and a.shape[-1] % 32 == 0 and fmt in ("f32", "f16", "bf16"):
            arrays[n] = (encode(a, "q8_0"), "q8_0")
            formats[n] = "q8_0"
            moved.append(n)
        else:
            arrays[n] = (raw, fmt)
    cfg = dataclasses.replace(cfg, formats=tuple(formats.items()))
    return cfg, Weights.from_dict(arrays, cfg), moved


def reference_q8(weights):
    def step(g, env):
        return evaluate(with_numerics(g, "q8"), weights, env)

    return step


def fused_q8(weights):
    runners: dict = {}

    def step(g, env):
        key = (g.meta["rows"], g.meta.get("batch", 1))
        r = runners.get(key)
        if r is None:
            r = runners[key] = NumpyRunner(plan(g, numerics="q8"), weights, exact=True)
        return r.step(env)

    step.runners = runners
    return step


def _same(got, alone):
    for k, (b, a) in enumerate(zip(got, alone)):
        assert b.generated_ids == a.generated_ids, f"prompt {k}: {b.generated_ids} alone {a.generated_ids}"
        for x, y in zip(b.logits, a.logits):
            assert np.abs(x - y).max() <= TOL * max(1.0, float(np.abs(y).max()))


@pytest.mark.parametrize("name", Q8_MODELS)
def test_every_family_batched_as_alone_under_q8(name, tmp_path):
    cfg, w = _model(name, tmp_path)
    cfg, w, moved = q8_rows(cfg, w)
    assert moved, f"{name}: no checkpoint rows of whole q8_0 blocks: the q8 numerics would change nothing"
    prompts = [[t % cfg.vocab for t in p] for p in PROMPTS]
    ref = reference_q8(w)
    alone = [generate(cfg, w, p, 4, chunk=4, step_fn=ref) for p in prompts]
    _same(generate_batch(cfg, w, prompts, 4, 2, step_fn=ref, chunk=4), alone)
    fused = fused_q8(w)
    alone = [generate(cfg, w, p, 4, chunk=4, step_fn=fused) for p in prompts]
    _same(generate_batch(cfg, w, prompts, 4, 2, step_fn=fused, chunk=4), alone)
    assert any(p.s.numerics == "q8" and p.s.batch == 2 for p in fused.runners.values())
    # the q8 plan quantizes activations: at least one of the batch step's launches writes a quantized form
    batch = next(p for p in fused.runners.values() if p.s.batch == 2)
    assert any(b.dtype == "q8" for b in batch.s.buffers.values())
