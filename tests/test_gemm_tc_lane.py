"""The tensor-core GEMM in the lane (issue 35 item 2): with the `tc_rows` knob set, every product of at least that
many rows (a prompt's chunk, a batch of sequences) links as gemm_tc (rules/lanes/cuda.yaml: ops.matmul and
gemm_bias; the GEMV-based fused classes refuse it, so extraction takes the products apart); without it (the default)
no product does and the f32 numerics stays exact. A tiny model's prefill (f32 and bf16 checkpoints) and a batch of 16
decodes run under it: the fast runner's tokens equal the exact twins', and the logits lie within bf16's rounding of
the f32 plan's."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lanefuse.engine.front.demo import demo_model
from lanefuse.engine.errors import UserError
from lanefuse.engine.front.model import ModelConfig, build_step
from lanefuse.engine.front.demo import random_arrays
from lanefuse.engine.front.weights import Weights, f32_to_bf16
from lanefuse.kernels import GemmTc, GemmTcGlu, GemmTcParts, Gemv
from lanefuse.lane.lower.knobs import Knobs, parse_knobs
from lanefuse.lane.lower.plan import PlanOptions, plan
from lanefuse.lane.run.batch import generate_batch
from lanefuse.lane.run.generate import generate
from lanefuse.lane.run.step import plan_step_fn

TC = Knobs(tc_rows=16)
BF16_TOL = 5e-2  # bf16 operands (8 bits of mantissa) through a few layers: the logits' relative departure from f32
TWIN_TOL = 1e-2  # the fast twin against the exact: their f32 sums part by an ulp of f32, and where that crosses a
# bf16 rounding boundary of the next product's input the two take neighbouring bf16 values (2^-8 apart)


def products(p):
    return [x.launch for x in p.launches if isinstance(x.launch, (GemmTc, GemmTcParts, GemmTcGlu, Gemv))]


def test_the_knob_puts_products_of_16_rows_on_the_tensor_cores_and_of_3():
    cfg, _ = demo_model()
    g = build_step(cfg, 16)
    tc, f32 = plan(g, knobs=TC), plan(g)
    assert "gemm_tc" not in f32.census
    big = [l for l in products(tc) if l.m >= 16]
    assert big and all(isinstance(l, (GemmTc, GemmTcParts, GemmTcGlu)) for l in big), [l.census for l in big]
    # q, k and v one GEMM in parts, gate and up one GEMM with their GLU (gemv_gate_up_glu: no Binary), o and down one
    # each: four launches of products a layer
    assert tc.census["gemm_tc"] == 2 * cfg.layers and tc.census["gemm_tc_parts"] == cfg.layers
    held = plan(g, knobs=TC, held=["gemv_gate_up_glu"])  # gate and up in parts, then the gated mul: a Binary
    assert tc.census["gemm_tc_glu"] == cfg.layers and held.census["gemm_tc_parts"] == 2 * cfg.layers
    assert tc.census.get("binary", 0) == held.census["binary"] - cfg.layers
    assert [len(l.parts) for l in big if isinstance(l, GemmTcParts)] == [3] * cfg.layers
    assert all(isinstance(l, Gemv) for l in products(tc) if l.m < 16)  # the last row's logits: a GEMV
    # 2 rows: the GEMV's 16-byte tile streams them (gemm_tc.MIN_ROWS 3); from 3 rows the tensor cores where tc_rows
    # says so (a tile of 64 rows pads them)
    assert "gemm_tc" not in plan(build_step(cfg, 2), knobs=replace(TC, tc_rows=1)).census
    three = plan(build_step(cfg, 3), knobs=replace(TC, tc_rows=1))
    assert three.census["gemm_tc_parts"] == cfg.layers and three.census["gemm_tc_glu"] == cfg.layers
    assert "gemm_tc" not in plan(g, knobs=replace(TC, tc_rows=32)).census



def test_the_cost_model_prices_the_gemm_at_the_tensor_cores_rate():
    """A tiny model's plan costs more launches under the knob; a prefill chunk of an 8B model's product is cheaper
    as a GEMM (its tiles' waves on the tensor cores: gemm_tc.tc_waves) than as GEMV slabs (flops at tflops_f32):
    unsplit, its 128 tiles fill half a wave of lone blocks (4x cheaper); split in two along k (the lane's `tail`), a
    full wave (7x: its combine a third launch)."""
    from lanefuse.kernels import Dst
    from lanefuse.lane.lower.shim import launch_us

    k = Knobs()
    gemm = GemmTc("x", "w", "bf16", Dst("y"), 4096, 4096, 512)
    gemv = Gemv("x", "w", "bf16", Dst("y"), 4096, 4096, 512)
    split = gemm.tune(k, frozenset({"cublas"}))
    assert split.ksplit == 2
    assert launch_us(split, k) < launch_us(gemm, k) < launch_us(gemv, k) / 4
    assert launch_us(split, k) < launch_us(gemv, k) / 7


def test_knob_values_in_words():
    assert parse_knobs(["tc_rows=0"]).tc_rows == 0
    with pytest.raises(UserError, match="or 0: off"):
        parse_knobs(["tc_rows=-1"])
    with pytest.raises(UserError, match="positive"):
        parse_knobs(["sms=0"])


def bf16_model() -> tuple[ModelConfig, Weights]:
    """A tiny Qwen3 whose every layer matrix is a bf16 checkpoint tensor."""
    base = ModelConfig("Qwen3ForCausalLM", 64, 2, 4, 1, 32, 96, 100, qk_norm=True, max_len=64, name="tiny-qwen3")
    arrays = random_arrays(base, seed=11)
    names = tuple(n for n, a in arrays.items() if ".layers." in n and np.ndim(a) == 2)
    cfg = replace(base, formats=tuple((n, "bf16") for n in names))
    for n in names:
        arrays[n] = f32_to_bf16(arrays[n])
    return cfg, Weights.from_dict(arrays, cfg)


def _rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(np.max(np.abs(b)), 1e-30))


def _run(cfg, w, prompt, n, knobs, exact):
    fn, _ = plan_step_fn(w, "cpu", PlanOptions(knobs=knobs), exact=exact)
    return generate(cfg, w, prompt, n, step_fn=fn, chunk=16)


@pytest.mark.parametrize("model", ["demo_f32", "qwen3_bf16"])
def test_prefill_under_the_knob_equals_its_twins(model):
    cfg, w = demo_model() if model == "demo_f32" else bf16_model()
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, cfg.vocab, 37)]  # chunks of 16, 16 and 5 rows
    exact, fast = _run(cfg, w, prompt, 5, TC, True), _run(cfg, w, prompt, 5, TC, False)
    assert fast.generated_ids == exact.generated_ids
    assert max(_rel(a, b) for a, b in zip(fast.logits, exact.logits)) <= TWIN_TOL
    ref = _run(cfg, w, prompt, 5, Knobs(), True)  # the f32 plan
    first = _rel(exact.logits[0], ref.logits[0])
    assert 0 < first <= BF16_TOL, first  # bf16 operands: not the f32 numbers, near them


def test_the_glu_in_one_launch_leaves_the_tokens_and_logits():
    """The gate and up products' GLU as one tensor-core launch (gemm_tc_glu) against the same plan with that class
    held (gemm_tc_parts for gate and up, then Binary's gated mul): the exact twins' logits to the bit, the same
    tokens; the fast runner's tokens too."""
    cfg, w = bf16_model()
    prompt = [int(t) for t in np.random.default_rng(5).integers(1, cfg.vocab, 21)]  # chunks of 16 and 5 rows

    def run(held, exact):
        fn, _ = plan_step_fn(w, "cpu", PlanOptions(knobs=TC, held=held), exact=exact)
        return generate(cfg, w, prompt, 4, step_fn=fn, chunk=16)

    assert "gemm_tc_glu" in plan(build_step(cfg, 16), knobs=TC).census
    assert "gemm_tc_glu" not in plan(build_step(cfg, 16), knobs=TC, held=["gemv_gate_up_glu"]).census
    fused, apart = run((), True), run(("gemv_gate_up_glu",), True)
    assert fused.generated_ids == apart.generated_ids
    for a, b in zip(fused.logits, apart.logits):
        np.testing.assert_array_equal(a, b)
    assert run((), False).generated_ids == fused.generated_ids


@pytest.mark.slow
def test_batch_of_16_decodes_under_the_knob():
    """A batch step of 16 sequences: its products (16 rows) on the tensor cores; the fast runner's tokens equal the
    exact twins', the logits near the f32 batch's."""
    cfg, w = demo_model()
    g = build_step(cfg, 1, batch=16)
    census = plan(g, knobs=TC).census
    assert census.get("gemm_tc") == 2 * cfg.layers + 1 and census.get("gemm_tc_parts") == cfg.layers  # + logits
    assert census.get("gemm_tc_glu") == cfg.layers
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(1, cfg.vocab, 4)] for _ in range(16)]  # one prefill plan a run

    def run(knobs, exact):
        fn, _ = plan_step_fn(w, "cpu", PlanOptions(knobs=knobs), exact=exact)
        return generate_batch(cfg, w, prompts, 3, 16, step_fn=fn, chunk=8)  # a prompt one chunk

    exact, fast, ref = run(TC, True), run(TC, False), run(Knobs(), True)
    for e, f, r in zip(exact, fast, ref):
        assert f.generated_ids == e.generated_ids
        assert max(_rel(a, b) for a, b in zip(f.logits, e.logits)) <= TWIN_TOL
        assert max(_rel(a, b) for a, b in zip(e.logits, r.logits)) <= BF16_TOL


# -- prompt chunks as large as the lane wants (issue 35 item 3) ------------------------------------------------------

def test_chunk_rows_knob_bounds_in_words():
    from lanefuse.engine.ir import MAX_CHUNK

    assert Knobs().chunk_rows == 512 and MAX_CHUNK >= 2048
    assert parse_knobs([f"chunk_rows={MAX_CHUNK}"]).chunk_rows == MAX_CHUNK
    with pytest.raises(UserError, match="at most 4096"):
        parse_knobs([f"chunk_rows={MAX_CHUNK + 1}"])


def test_one_chunk_of_300_rows_equals_chunks_of_64():
    """A 300-token prompt as one step graph of 300 rows (its arena planned for them) gives the tokens of five chunks
    of 64 and one of 44, and logits within the fast twins' rounding."""
    cfg, w = demo_model(max_len=320)
    prompt = [int(t) for t in np.random.default_rng(8).integers(1, cfg.vocab, 300)]
    fn, _ = plan_step_fn(w, "cpu")
    big = generate(cfg, w, prompt, 4, step_fn=fn, chunk=300)
    small = generate(cfg, w, prompt, 4, step_fn=fn, chunk=64)
    assert big.generated_ids == small.generated_ids
    assert max(_rel(a, b) for a, b in zip(big.logits, small.logits)) <= 1e-4
