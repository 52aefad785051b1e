"""The tensor-core chunk attention in the lane (issue 35): with the `tc_attn_rows` knob set, a prompt chunk of at
least that many rows (and 16) attends through attention_tc (rules/lanes/cuda.yaml ops.attention, condition
`tensor_core_attention`); without it (the default), or for a decode row, the attention launch; a tiny model's
prefill under it gives the exact runner's tokens and logits near the f32 plan's."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lanefuse.engine.front.demo import demo_model
from lanefuse.engine.errors import UserError
from lanefuse.engine.front.model import build_step
from lanefuse.lane.lower.knobs import Knobs, parse_knobs
from lanefuse.lane.lower.plan import PlanOptions, plan
from lanefuse.lane.run.generate import generate
from lanefuse.lane.run.step import plan_step_fn

TCA = Knobs(tc_attn_rows=16)
BF16_TOL = 5e-2  # as tests/test_gemm_tc_lane.py: bf16 operands through a few layers, the logits' relative departure


def test_the_knob_puts_a_chunks_attention_on_the_tensor_cores():
    cfg, _ = demo_model()
    g = build_step(cfg, 16)
    on, off = plan(g, knobs=TCA), plan(g)
    assert "attention_tc" not in off.census and off.census.get("attention") == cfg.layers
    assert on.census.get("attention_tc") == cfg.layers and "attention" not in on.census
    assert "attention_tc" not in plan(build_step(cfg, 1), knobs=TCA).census  # a decode row
    assert "attention_tc" not in plan(build_step(cfg, 15), knobs=replace(TCA, tc_attn_rows=1)).census  # < 16 rows
    assert "attention_tc" not in plan(g, knobs=replace(TCA, tc_attn_rows=32)).census


def test_knob_in_words():
    assert parse_knobs(["tc_attn_rows=0"]).tc_attn_rows == 0
    with pytest.raises(UserError, match="or 0: off"):
        parse_knobs(["tc_attn_rows=-4"])


def _rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(np.max(np.abs(b)), 1e-30))


def test_prefill_under_the_knob():
    """A 37-token prompt in chunks of 16, 16 and 5 rows (the last one's attention the f32 kernel's): the fast and
    exact runners agree on the tokens, the first logits within bf16's rounding of the f32 plan's and not equal."""
    cfg, w = demo_model()
    prompt = [int(t) for t in np.random.default_rng(5).integers(1, cfg.vocab, 37)]

    def run(knobs, exact):
        fn, _ = plan_step_fn(w, "cpu", PlanOptions(knobs=knobs), exact=exact)
        return generate(cfg, w, prompt, 4, step_fn=fn, chunk=16)

    exact, fast, ref = run(TCA, True), run(TCA, False), run(Knobs(), True)
    assert fast.generated_ids == exact.generated_ids
    first = _rel(exact.logits[0], ref.logits[0])
    assert 0 < first <= BF16_TOL, first
