"""DeepSeek-V3's latent attention in a wide prefill chunk, priced as its per-head products run (issue 35 H5): HeadGemv's
loop re-reads every head's matrix for each row of x (a warp an output, one value a lane in flight), so the lane
prices its waves of dependent rounds (HeadGemv.rate), not the weights once and the flops at the f32 peak; the plan's
choice between the expanded halves and the absorbed form follows that price at every width."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

CHUNKS = (64, 128, 512, 2048)


def deepseek_v3_layer(max_len: int = 4096):
    """DeepSeek-V3's shape (its config's values) in two dense layers: one latent attention after the first layer."""
    from deepseek_figures import DEEPSEEK_V3, bf16
    from lanefuse.engine.front.hfconfig import config_from_hf

    return bf16(config_from_hf({**DEEPSEEK_V3, "num_hidden_layers": 2, "first_k_dense_replace": 2}, "config.json",
                               max_len=max_len))


def expanded_half(cfg, m: int):
    from lanefuse.kernels.common import Dst
    from lanefuse.kernels.head_gemv import HeadGemv

    return HeadGemv("lc", "wk", "bf16", Dst("kx"), m, 1, cfg.kv_lora, cfg.heads * cfg.nope, rows_out=True)


@pytest.mark.parametrize("rows,pos", [(64, 0), (64, 4096), (512, 0), (2048, 0), (2048, 4096)])
def test_the_lane_prices_a_half_as_the_wave_model_runs_it(rows, pos):
    """An expanded half over pos + rows filled rows: the lane's price (lane/lower/shim.launch_us) within 25% of
    bench/launch_model.py's wave model of the kernel as written (bench/deepseek_figures.head_gemv_prediction: the
    first rows' pass from HBM, the others from L2, 64 B a warp in flight, 8 rows a warp: head_gemv_rows)."""
    from deepseek_figures import head_gemv_prediction
    from lanefuse.lane.lower.knobs import Knobs
    from lanefuse.lane.lower.shim import launch_us
    from lanefuse.lane.lower.table import load_lane

    cfg = deepseek_v3_layer()
    f = rows + pos
    half = expanded_half(cfg, f)
    priced = launch_us(half, Knobs(), load_lane("cuda").costs)
    model = head_gemv_prediction(half, f)["us"]
    assert abs(priced / model - 1) <= 0.25, (priced, model)
    assert model > 2 * f  # over 2 µs a row of the cache: the rows' re-reads, not the 16 MiB matrix once (3.9 µs)


def expanding_lane(folder) -> dict:
    (folder / "lanes").mkdir(exist_ok=True)
    (folder / "lanes" / "expanding.yaml").write_text(
        "lane: expanding\nbase: cuda\nwhy: chunks of more than 16 rows may run expanded\nclasses:\n"
        "  mla: {support: native, hook: latent, fields: {expand_rows: 16}}\n")
    return dict(lane="expanding", rules_dirs=(str(folder),))


FORMS = {64: "absorbed", 128: "absorbed", 512: "absorbed", 2048: "expanded"}


def test_the_plan_takes_the_form_its_price_says_at_every_width(tmp_path):
    """At each chunk width (64 to 2048 rows, a 4096-row cache) the plan of the cuda lane, and of a lane whose `mla`
    may expand from 17 rows, takes the form the price says (FORMS; bench/results/2026-12-06-deepseek-expand.txt):
    absorbed to 512 rows, where the two expanded halves priced over the cache's rows (what the plan knows of the
    position; head_gemv_rows, 18.5 ms each) cost more than the absorbed output expansion and attention's excess;
    expanded at 2048, cheaper than the absorbed parts (mla held). Before HeadGemv.rate the chunks of 512 rows ran
    expanded too (each half a flat 1158.6 µs)."""
    from lanefuse.engine.front.model import build_step
    from lanefuse.engine.rules import load_table
    from lanefuse.lane.lower.knobs import Knobs
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.lower.shim import launch_us
    from lanefuse.lane.lower.table import load_lane

    cfg, table = deepseek_v3_layer(), load_table()
    halves = 2 * launch_us(expanded_half(cfg, cfg.max_len), Knobs(), load_lane("cuda").costs)
    for rows in CHUNKS:
        g = build_step(cfg, rows)
        for opts in ({}, expanding_lane(tmp_path)):
            s = plan(g, table=table, **opts)
            mine = [l for l in s.launches if l.layer == 1]
            expanded = [l for l in mine if l.launch.census == "head_gemv" and l.launch.upto is not None]
            if FORMS[rows] == "expanded":
                assert len(expanded) == 2 and all(l.launch.rows_a_warp() == 8 for l in expanded), mine
                assert sum(l.cost_us for l in expanded) == pytest.approx(halves)
                held = plan(g, table=table, held=("mla", "mla.absorbed"), **opts)
                assert sum(l.cost_us for l in mine) < sum(l.cost_us for l in held.launches if l.layer == 1)
                continue
            assert not expanded, (rows, opts.get("lane"), [l.cost_us for l in expanded])
            attn = [l for l in mine if l.launch.census in ("attention", "head_gemv")]
            # the query's absorption (q_nope by each head's key rows of kv_b) a head_gemv of its own where the
            # q/k/v fold would run its products at 3-8 rows a slab through gemv_tile_any, priced by its rounds since
            # bc666ef (at 64 rows: gemm_parts 93.8 + head_gemv 378.6 µs; the fold absorbing it was 111.7 by bytes)
            attn = [l for l in attn if not (l.launch.census == "head_gemv" and l.launch.w.endswith("k_rows"))]
            assert [l.launch.census for l in attn] == ["attention", "head_gemv"], attn
            assert attn[0].launch.hd == cfg.kv_lora + cfg.head_dim  # over the latent cache: absorbed
            out = attn[1].launch
            assert (out.m, out.heads, out.a, out.b) == (rows, cfg.heads, cfg.kv_lora, cfg.v_dim)
            assert attn[1].cost_us < halves, (rows, attn[1].cost_us, halves)


def test_a_decode_steps_expansion_is_priced_by_its_rounds():
    """The absorbed form's output expansion in a decode step (1 row, 128 heads of 512 -> 128: 16384 warps, two waves
    of 16 rounds from HBM): its loop 64.6 µs, where the weights' bytes alone are 3.9 µs; a chunk's rows in groups of
    8 (head_gemv_rows), the first group's pass from HBM, the others' from L2 where the 16 MiB fit half of it."""
    from lanefuse.kernels.common import Dst
    from lanefuse.kernels.head_gemv import HeadGemv
    from lanefuse.lane.lower.knobs import Knobs

    hg = HeadGemv("a", "wv", "bf16", Dst("y"), 1, 128, 512, 128, rows_out=True)
    assert hg.loop_us(Knobs()) == pytest.approx(2 * 16 * 2.02)
    assert hg.loop_us(dataclasses.replace(Knobs(), l2_mib=8)) == pytest.approx(2 * 16 * 2.02)  # one row: HBM either way
    assert hg.rows_a_warp() == 1  # a single row keeps head_gemv (16 blocks a SM)
    wide = dataclasses.replace(hg, m=20)  # head_gemv_rows: 3 groups of 8 rows, 49152 warps in 11 waves of 132 x 9 x 4
    assert wide.rows_a_warp() == 8
    assert wide.loop_us(Knobs()) == pytest.approx(16 * (4 * 2.02 + 7 * 0.65))  # the first group 4 waves, then L2
    assert wide.loop_us(dataclasses.replace(Knobs(), l2_mib=8)) == pytest.approx(16 * 11 * 2.02)  # 16 MiB > 4 MiB


# -- the expanded halves on the tensor cores ---------------------------------------------------------------------------

def test_deepseek_v3s_wide_chunks_expand_on_the_tensor_cores():
    """With the tensor cores on (knob tc_rows 16: the bf16 numerics), each expanded half of a chunk wider than
    `expand_rows` is one product of the cache's rows by every head's stacked expansion rows (lane/lower/hooks._half:
    GemmTc, x (L, 512) by w (16384, 512)ᵀ; the lane may take it through cuBLAS), priced at its waves: the plan then
    takes the expanded form at 128, 512 and 2048 rows, its halves far below the absorbed form's warp-an-output
    expansion; 64 rows (the lane's expand_rows) stays absorbed; without the knob nothing changes."""
    from lanefuse.engine.front.model import build_step
    from lanefuse.engine.rules import load_table
    from lanefuse.lane.lower.knobs import Knobs
    from lanefuse.lane.lower.plan import plan

    cfg, table = deepseek_v3_layer(), load_table()
    for rows in CHUNKS:
        s = plan(build_step(cfg, rows), table=table, knobs=Knobs(tc_rows=16))
        mla = [l for l in s.launches if l.layer == 1 and l.cls == "mla"]
        if rows <= 64:
            assert "head_gemv" in [l.launch.census for l in mla] and mla[0].launch.census != "gemm_tc", mla
            continue
        assert [l.launch.census in ("gemm_tc", "gemm_blas") for l in mla] == [True, True, False], mla
        for l, n in zip(mla, (cfg.heads * cfg.nope, cfg.heads * cfg.v_dim)):
            k = l.launch
            assert (k.m, k.n, k.k) == (cfg.max_len, n, cfg.kv_lora)  # every cache row by every head's rows
            assert l.cost_us < 1000, l.cost_us  # the warp-an-output half over 4096 rows: 83 ms
        assert mla[2].launch.hd == cfg.nope + cfg.head_dim  # the attention over the expanded keys


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("runner", ["exact", "fast"])
def test_the_tensor_core_halves_against_the_reference(fmt, runner, tmp_path):
    """A tiny DeepSeek-V3 (tests/test_deepseek.py's: 4 heads, latent 16, a 64-row cache) in a chunk of 20 rows under
    a lane expanding from 5 rows with the tensor cores on (tc_rows 16): the halves are tensor-core products of the 64
    cache rows, and the step's logits are the reference interpreter's within the bf16 numerics' tolerance (x and w
    rounded to bf16, f32 sums, every product of 16 rows or more: tests/test_gemm_tc_lane.py's 5e-2 of the logits'
    scale), at position 40 (60 of the 64 rows filled)."""
    from test_deepseek import mla_launches, narrow_lane, plan_against_reference

    opts = narrow_lane(tmp_path)
    opts["knobs"] = dataclasses.replace(opts["knobs"], tc_rows=16)
    # 60 of the 64 rows filled; the latent cache row is a product of the chunk's 20 rows on the tensor cores too
    s = plan_against_reference(20, fmt, runner, pos=40, seed=7, tol=5e-2, cache_tol=5e-2, **opts)
    halves = [l.launch for l in mla_launches(s)][:2]
    assert [h.census in ("gemm_tc", "gemm_blas") for h in halves] == [True, True], [h.census for h in halves]
    assert [h.m for h in halves] == [64, 64]
