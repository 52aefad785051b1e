"""DeepSeek-V3's prefill chunks through the token-sort form (issue 40, "DeepSeek-V3's prefill chunks run the per-row
mixture"): a tiny DeepSeek-V3 (grouped sigmoid routing: 4 groups of 2 experts, 2 kept, a correction bias that changes
choices, routed scale 2.5, normalized top 3; a shared expert) prefilled in chunks of awkward rows (7 and 6), f32 and
bf16 experts. The sorted plan (moe_token_sort.grouped: moe_route, moe_up_sorted, moe_down_sorted, moe_finish) gives
the per-row plan's tokens and logits (the rule held: moe_up, moe_down) and the reference interpreter's; and its Moe
launches run by moe.cu's sorted kernels on the CUDA host emulator equal the twin and the per-row kernels."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hf_ref import fused_step, scaled_error
from test_deepseek import _mixture_case, tiny_cfg

PROMPT = [3, 17, 5, 42, 8, 11, 29, 2, 51, 13, 7, 33, 19]  # 13: chunks of 7 and 6
CHUNK = 7
N_TOKENS = 4
RULES = ("moe_token_sort.grouped", "moe_token_sort.grouped_plain")
SORTED = ["moe_route", "moe_up_sorted", "moe_down_sorted", "moe_finish"]


def knobs():
    """A chip where bytes dominate (launches nearly free): the cost model sorts a chunk of 6 or 7 rows of these
    wide experts (each chosen expert's weights read once, not once a row)."""
    from lanefuse.lane.lower.knobs import Knobs

    return Knobs(launch_us=0.001, fixed_scale=0.0001)


def model(fmt: str):
    """The tiny DeepSeek-V3 (experts 96 wide) with random weights, its matrices in `fmt` (q8_0: those whose rows are
    whole blocks of 32; the others f32)."""
    from lanefuse.engine.front.weights import Weights
    from lanefuse.kernels.common import encode

    cfg = tiny_cfg(moe_intermediate_size=96)
    r = np.random.default_rng(40 + len(fmt))
    consts = cfg.build_step(1).constants
    mine = [n for n, k in consts.items() if k.kind == "rows" and (fmt != "q8_0" or k.shape[-1] % 32 == 0)]
    arrays = {}
    for name, shape in cfg.weight_names().items():
        a = (r.standard_normal(shape) / (np.sqrt(shape[-1]) if len(shape) == 2 else 3)).astype(np.float32)
        if name.endswith("e_score_correction_bias"):  # large enough to change choices
            a = (0.5 * r.standard_normal(shape)).astype(np.float32)
        arrays[name] = (encode(a, fmt), fmt) if name in mine and fmt != "f32" else a
    cfg = dataclasses.replace(cfg, formats=tuple((n, fmt) for n in mine))
    return cfg, Weights.from_dict(arrays, cfg)


@pytest.fixture(scope="module", params=["f32", "bf16"])
def tiny(request):
    return (request.param, *model(request.param))


def test_the_chunks_plan_sorted_and_held_per_row(tiny):
    """The census: each chunk of 7 and 6 rows takes moe_token_sort.grouped in both mixture layers (four kernels a
    mixture, the grouped routing's fields carried); a decode step does not sort; the rule held, the chunk runs a row at
    a time (moe_up, moe_down) and no mixture is sorted."""
    from lanefuse.lane.lower.plan import plan

    fmt, cfg, _ = tiny
    sparse = len(cfg.moe.sparse)
    for rows in (CHUNK, len(PROMPT) - CHUNK):
        s = plan(cfg.build_step(rows), knobs=knobs())
        assert s.fusions.get("moe_token_sort.grouped") == sparse, s.fusions
        moes = [l.launch for l in s.launches if l.launch.census == "moe"]
        assert len(moes) == sparse and all(m.sort and m.rows == rows for m in moes)
        assert all(m.routing == "sigmoid_group" and (m.groups, m.topk_groups, m.route_scale) == (4, 2, 2.5)
                   and m.norm_topk and m.br and m.shared and m.format == fmt for m in moes)
        assert [k.stage for m in moes for k in m.kernels()] == [0, 1, 2, 3] * sparse
        held = plan(cfg.build_step(rows), knobs=knobs(), held=list(RULES))
        assert not set(RULES) & set(held.fusions) and not any(l.launch.census == "moe" and l.launch.sort
                                                               for l in held.launches)
        assert sum(len(l.launch.kernels()) for l in held.launches if l.launch.census == "moe") == 2 * sparse
    one = plan(cfg.build_step(1), knobs=knobs())
    assert not any(getattr(l.launch, "sort", False) for l in one.launches)


def fast_step(weights, **plan_kw):
    """fused_step's, by the fast twins (f32 BLAS, each expert's rows gathered)."""
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    runners = {}

    def step(g, env):
        rows = g.meta["rows"]
        if rows not in runners:
            runners[rows] = NumpyRunner(plan(g, **plan_kw), weights, exact=False)
        return runners[rows].step(env)

    return step


def test_sorted_chunks_give_the_per_row_plans_tokens_and_logits(tiny):
    """13 prompt tokens prefilled in chunks of 7 and 6, then 4 greedy tokens: the sorted plan (exact twins) gives the
    per-row plan's tokens and logits to the bit (the exact twin is one computation whatever `sort` says: each row's
    choices, weights and f32 sums in choice order, as moe_finish sums them), and the reference interpreter's tokens,
    its logits within 1e-5 of their scale (the plan's fusions sum in other orders). The fast twins (each expert's rows
    gathered into one BLAS product: f32 reordering) the same tokens, logits within 1e-4."""
    from lanefuse.lane.run.generate import generate

    fmt, cfg, w = tiny
    ref = generate(cfg, w, PROMPT, N_TOKENS, chunk=CHUNK)
    got = generate(cfg, w, PROMPT, N_TOKENS, chunk=CHUNK, step_fn=fused_step(w, knobs=knobs()))
    per_row = generate(cfg, w, PROMPT, N_TOKENS, chunk=CHUNK, step_fn=fused_step(w, knobs=knobs(), held=list(RULES)))
    assert got.generated_ids == per_row.generated_ids == ref.generated_ids
    for a, b in zip(got.logits, per_row.logits):
        np.testing.assert_array_equal(a, b)
    assert scaled_error(got.logits, ref.logits) < 1e-5
    fast = generate(cfg, w, PROMPT, N_TOKENS, chunk=CHUNK, step_fn=fast_step(w, knobs=knobs()))
    assert fast.generated_ids == ref.generated_ids
    assert scaled_error(fast.logits, ref.logits) < 1e-4


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_the_sorted_grouped_mixture_on_the_cuda_host_emulator(fmt):
    """The chunk plan's sorted Moe launches (7 rows; the grouped routing in moe_route, a block an expert over the rows
    that chose it, moe_finish adding the residual) run by moe.cu's real source on the host emulator: equal to the
    numpy twin, and the output to the per-row kernels' (moe_up, moe_down) over the same inputs to the bit (f32 sums in
    the same order: each choice's weighed down product in choice order, then the shared expert's). Skipped without
    g++."""
    from cuda_host import emu

    if emu.compiler() is None:
        pytest.skip("no g++ to build the emulated kernels")
    import test_kernels_gpu as gpu

    from lanefuse.lane.lower.plan import plan

    cfg, _ = model(fmt)
    s = plan(cfg.build_step(CHUNK), knobs=knobs())
    moes = [l.launch for l in s.launches if l.launch.census == "moe"]
    assert moes and all(m.sort and m.routing == "sigmoid_group" and m.format == fmt for m in moes)
    g = np.random.default_rng(71)
    with emu.emulating([moes[0].stem]):
        for moe in moes:
            arrays, weights = _mixture_case(moe, g)
            x = arrays[moe.x].reshape(moe.rows, moe.d)
            chosen, _ = moe._route(_host(arrays, weights), x)
            assert len(np.unique(chosen)) > 1 and any((chosen == e).sum() > 1 for e in np.unique(chosen))
            dev = gpu.both(moe, arrays, weights, tol=2e-4)
            row = gpu.both(dataclasses.replace(moe, sort=False), arrays, weights, tol=2e-4)
            for n in {moe.out.buf, moe.sum} - {None}:
                np.testing.assert_array_equal(dev.host(n), row.host(n), err_msg=n)


def _host(arrays, weights):
    from lanefuse.kernels import HostEnv

    return HostEnv({k: v.copy() for k, v in arrays.items()}, weights)


def test_the_bench_prices_a_sorted_chunk():
    """bench/deepseek_figures.py's sort_figures (PREDICTIONS of the lane's cost model): at DeepSeek-V3's shape a chunk
    of 64 rows sorts both mixtures, each chosen expert read once (2 x 256 against a row at a time's 2 x 64 x 8), and its
    Moe launches are estimated below the per-row plan's."""
    import os
    import sys

    from lanefuse.engine.rules import load_table

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    if bench not in sys.path:
        sys.path.append(bench)
    from deepseek_figures import sort_figures

    got = sort_figures(load_table(), rows_list=(64,))[64]
    assert got["chosen"]["sorted"] == got["chosen"]["mixtures"] == 2 and got["per_row"]["sorted"] == 0
    assert (got["chosen"]["experts_read"], got["per_row"]["experts_read"]) == (512, 1024)
    assert got["chosen"]["cost_us"] < got["per_row"]["cost_us"]


def test_q8_numerics_sorted_chunks_equal_the_per_row_plans():
    """Under --numerics q8 on q8_0 rows the chunk's sorted mixtures quantize the shared expert's input and GLU
    themselves (qwords 1: shared_expert_fusion.grouped_quant inside moe_token_sort.grouped, no Quant launch for
    them) and give the per-row plan's (the rules held: shared_expert_fusion.grouped_quant and
    moe_deferred_finalize.grouped_quant) tokens and logits to the bit."""
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.generate import generate

    cfg, w = model("q8_0")
    s = plan(cfg.build_step(CHUNK), knobs=knobs(), numerics="q8")
    moes = [l.launch for l in s.launches if l.launch.census == "moe"]
    assert s.fusions.get("moe_token_sort.grouped") == 2 and all(m.sort and m.qwords == 1 for m in moes)
    got = generate(cfg, w, PROMPT, N_TOKENS, chunk=CHUNK, step_fn=fused_step(w, knobs=knobs(), numerics="q8"))
    per_row = generate(cfg, w, PROMPT, N_TOKENS, chunk=CHUNK,
                       step_fn=fused_step(w, knobs=knobs(), numerics="q8", held=list(RULES)))
    assert got.generated_ids == per_row.generated_ids
    for a, b in zip(got.logits, per_row.logits):
        np.testing.assert_array_equal(a, b)


def test_the_sorted_q8_mixture_on_the_cuda_host_emulator():
    """The q8 chunk plan's sorted Moe launch (q8_0 experts, the shared expert's products over the input and GLU
    quantized in moe_up_sorted / moe_down_sorted) by moe.cu on the host emulator: equal to the twin and to the per-row
    kernels (moe_up, moe_down) to the bit. Skipped without g++."""
    from cuda_host import emu

    if emu.compiler() is None:
        pytest.skip("no g++ to build the emulated kernels")
    import test_kernels_gpu as gpu

    from lanefuse.lane.lower.plan import plan

    cfg, _ = model("q8_0")
    s = plan(cfg.build_step(CHUNK), knobs=knobs(), numerics="q8")
    moe = next(l.launch for l in s.launches if l.launch.census == "moe")
    assert moe.sort and moe.qwords == 1 and moe.format == "q8_0" and moe.shared
    g = np.random.default_rng(73)
    with emu.emulating([moe.stem]):
        arrays, weights = _mixture_case(moe, g)
        dev = gpu.both(moe, arrays, weights, tol=2e-4)
        row = gpu.both(dataclasses.replace(moe, sort=False), arrays, weights, tol=2e-4)
        for n in {moe.out.buf, moe.sum} - {None}:
            np.testing.assert_array_equal(dev.host(n), row.host(n), err_msg=n)
