"""bench/launch_model.py on the demo plan, without a device or nvcc: every launch's own cuda() recorded on the stand-in
device env, each recorded kernel's grid and block equal to its launch's grid_block() (a launch of two kernels: its
first), and the model's figures finite and positive."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def lm():
    sys.path.insert(0, str(BENCH))
    import launch_model

    return launch_model


@pytest.fixture(scope="module")
def demo_plan():
    from lanefuse.engine.front.demo import demo_config
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan

    return plan(build_step(demo_config(), 1))


def test_recorded_grids_are_each_launchs_grid_block(lm, demo_plan):
    ks = lm.plan_kernels(demo_plan)
    assert ks, "nothing recorded"
    launched = {k.index for k in ks}
    assert launched == {i for i, x in enumerate(demo_plan.launches) if x.launch.kernels()}
    seen = set()
    for k in ks:
        key = (k.index, id(k.launch))
        if key in seen:
            continue  # a launch's second kernel (a combine) has a grid of its own
        seen.add(key)
        grid, block = k.launch.grid_block()
        assert tuple(k.call.grid) == tuple(grid), (k.call.name, k.call.grid, grid)
        assert tuple(k.call.block) == tuple(block), (k.call.name, k.call.block, block)


def test_the_model_runs_on_the_demo_plan(lm, demo_plan, monkeypatch, tmp_path):
    # no compile here: ptxas' figures from the committed kernel-resources.json (what the model falls back to
    # without nvcc)
    monkeypatch.setattr(lm.shutil, "which", lambda name: None)
    monkeypatch.setattr(lm, "CACHE", tmp_path)
    cal = lm.load_calibration()
    ks = lm.model(demo_plan, None, cal, pos=16)
    assert all(k.us > 0 and math.isfinite(k.us) and k.bpsm >= 1 for k in ks)
    assert any(k.family == "gemv" for k in ks)
    rows = lm.summarize(ks)
    assert sum(r["count"] for r in rows) == len(ks)


def test_the_calibration_is_data(lm):
    cal = json.loads(lm.CALIBRATION.read_text())
    for key in ("L_us", "t0_us", "L_attn_us", "tail_norm_us", "tail_rope_us", "B_peak_TBps", "format_factor",
                "fixed_us", "measured"):
        assert key in cal
    assert 0.1 < cal["L_us"] < 10 and cal["B_peak_TBps"] == 4.25


@pytest.mark.parametrize("fmt,k,split,staged", [("q4_k", 4096, 1, 16 * 144), ("q4_k", 2304, 1, 9 * 144),
                                                  ("q4_k", 4096, 2, 16 * 144), ("q6_k", 12288, 1, 8 * 210),
                                                  ("q6_k", 4096, 2, 8 * 210), ("q6_k", 2304, 1, 0),
                                                  ("q6_k", 4096, 4, 0), ("q8_0", 4096, 1, 64 * 34),
                                                  ("q4_0", 4096, 1, 128 * 18), ("q4_0", 2304, 1, 72 * 18)])
def test_staged_tiles_are_read_off_gemv_core(lm, fmt, k, split, staged):
    """gemv_tile_staged's stages as gemv_core.cu defines them (STAGE_BLOCKS, Q4K_STAGE, Q6K_STAGE, Q40_STAGE: none of
    the k-quants' before 2026-12-05, q4_0's as q8_0's before b142039): a warp's rows in flight a stage each; q6_k rows only where k and the chunk's ends are
    whole runs of 8 super-blocks (2048 values), else its two-byte tile."""
    import re

    core = lm.gemv_core_source(None)
    feats = lm.features(None)
    assert feats["staged_k"] == {f: int(re.search(rf"#define {d} (\d+)", core).group(1))
                                 for f, d in (("q4_k", "Q4K_STAGE"), ("q6_k", "Q6K_STAGE"), ("q4_0", "Q40_STAGE"))}
    assert lm.features("4a43cc2")["staged_k"] == {}
    from lanefuse.kernels import Dst, Gemv

    launch = Gemv("x", "w", fmt, Dst("y"), k, 64, 1, per_warp=4, split=split)
    env = lm.recording_env()({"w": fmt})
    launch.cuda(env)
    kern = lm.Kernel(0, "gemv", launch, env.calls[0])
    lm.gemv_structure(kern, feats["wide"], feats["block_tiles"], feats["staged"], feats["q4k_wide"],
                      feats["staged_k"])
    if staged:
        assert kern.extra["loop"] == f"{fmt} staged" and kern.inflight_warp == 4 * staged
    else:
        assert kern.extra["loop"] != f"{fmt} staged"


@pytest.mark.parametrize("fmt,m,pw,loop", [("bf16", 5, 4, "slab x"), ("f32", 8, 1, "slab x"), ("bf16", 2, 4, "tile16 x4"),
                                             ("q8_0", 8, 4, "4-value x1"), ("f16", 9, 4, "slab x")])
def test_the_slab_tile_is_read_off_gemv_core(lm, fmt, m, pw, loop):
    """The slab's ring (gemv_slab_cp's SLAB_STAGES in shared memory: all but one of them in flight a row a lane, by
    outputs a warp; gemv_slab16's SLAB_DEPTH registers at d628a8c; none at 4a43cc2) as gemv_core.cu defines it: a slab of f32/f16/bf16 rows streams that many 16-byte steps a row a lane, its x's L1 reads
    recorded for time_us' floor; block formats at a slab take the four-value loop. The slab is priced well below
    the four-value loop it replaced, and never below its bytes at the copy bandwidth."""
    import re

    core = lm.gemv_core_source(None)
    s4, s1 = map(int, re.search(r"#define SLAB_STAGES\(PW\) \(\(PW\) >= 4 \? (\d+) : (\d+)\)", core).groups())
    d4, d1 = s4 - 1, s1 - 1  # gemv_slab_cp: every step of its ring but the one being summed in flight
    feats = lm.features(None)
    assert feats["slab_depth"] == {4: d4, 1: d1} and lm.features("4a43cc2")["slab_depth"] == {}
    assert lm.features("d628a8c")["slab_depth"] == {4: 2, 1: 4}
    from lanefuse.kernels import Dst, Gemv

    launch = Gemv("x", "w", fmt, Dst("y"), 4096, 4096, m, per_warp=pw)
    env = lm.recording_env()({"w": fmt})
    launch.cuda(env)
    cal = lm.load_calibration()

    def priced(depth):
        kern = lm.Kernel(0, "gemv", launch, env.calls[0])
        kern.bpsm = 3
        lm.gemv_structure(kern, feats["wide"], feats["block_tiles"], feats["staged"], feats["q4k_wide"],
                          feats["staged_k"], depth)
        lm.time_us(kern, cal)
        return kern

    kern = priced(feats["slab_depth"])
    assert kern.extra["loop"].startswith(loop)
    if loop == "slab x":
        d = d4 if pw == 4 else d1
        assert kern.extra["loop"] == f"slab x{d}" and kern.inflight_warp == pw * 32 * 16 * d
        assert kern.extra["l1_bytes"] == 4096 // pw * 4096 * m * 4
        old = priced({})
        assert old.extra["loop"] == "4-value x1" and kern.us < 0.6 * old.us
        assert kern.us >= cal["t0_us"] + launch.checkpoint_bytes() / (cal["B_peak_TBps"] * 1e6)


def test_pdl_model_only_removes_fixed_cost_and_prefetched_streaming(lm, demo_plan, monkeypatch, tmp_path):
    monkeypatch.setattr(lm.shutil, "which", lambda name: None)
    monkeypatch.setattr(lm, "CACHE", tmp_path)
    cal = lm.load_calibration()
    ks = lm.model(demo_plan, None, cal, pos=16)
    before = [k.us for k in ks]
    kp = lm.with_pdl(ks, cal)
    assert [k.us for k in ks] == before, "with_pdl must not change its input"
    saved_t0 = cal["t0_us"] - lm.T0_PDL_US
    for k, p in zip(ks, kp):
        hidden = p.extra.get("pdl_hidden_us", 0.0)
        assert 0 <= hidden <= k.us - k.fixed - k.tail + 1e-9  # never more than the launch's own waves
        want = k.us - (saved_t0 if k.family != "attention_combine" else 0.0) - hidden
        assert p.us == pytest.approx(want) and p.us > 0
    assert sum(p.us for p in kp) < sum(before)


def test_gpu_decode_per_kind_table_sums_launches(monkeypatch, capsys):
    sys.path.insert(0, str(BENCH))
    import gpu_decode

    rows = [dict(index=0, kind="fold", us=10.0, lane_us=5.0), dict(index=1, kind="attention", us=4.0, lane_us=2.0),
            dict(index=2, kind="fold", us=30.0, lane_us=20.0)]
    out = gpu_decode.print_kinds(rows, {"0": 12.0, "1": 3.0, "2": 27.0})
    by = {k["kind"]: k for k in out}
    assert by["fold"]["launches"] == 2 and by["fold"]["us"] == 40.0 and by["fold"]["lane_us"] == 25.0
    assert by["fold"]["model_us"] == 39.0 and by["attention"]["model_us"] == 3.0
    assert [k["kind"] for k in out] == ["fold", "attention"]
    assert "PREDICTION" in capsys.readouterr().out
    assert gpu_decode.print_kinds(rows, None)[0]["model_us"] is None


def test_predict_plans_writes_what_gpu_decode_reads(lm, demo_plan, monkeypatch, tmp_path):
    from lanefuse.lane.lower.planfile import save

    monkeypatch.setattr(lm.shutil, "which", lambda name: None)
    monkeypatch.setattr(lm, "CACHE", tmp_path / "cache")
    save(demo_plan, str(tmp_path / "qwen3-8b-decode.json"))
    doc = lm.predict_plans(str(tmp_path), lm.load_calibration(), pos=16)
    on_disk = json.loads((tmp_path / "launch-model.json").read_text())
    assert on_disk == json.loads(json.dumps(doc)) and "PREDICTIONS" in on_disk["note"]
    p = on_disk["plans"]["qwen3-8b-decode"]
    launched = {str(i) for i, x in enumerate(demo_plan.launches) if x.launch.kernels()}
    assert set(p["launches"]) == launched and 0 < p["us_pdl"] < p["us"]
    assert p["us"] == pytest.approx(sum(p["launches"].values()), rel=1e-3)


def test_rope_tail_rounds_follow_the_head_epilogue(lm):
    """fold.cu's head epilogue in rounds: the measured shape (Qwen3-8B's normed, rotated heads of 128) at 4a43cc2's
    value a lane a round is the ten rounds the fitted tail is spread over; the work tree's HEAD_VALUES chunk (read off
    fold.cu) four; a head without a norm has no sum-of-squares rounds."""
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import test_kernels_gpu as gpu

    f, _, _ = gpu._qkv(np.random.default_rng(0), "f32", 1, 64, 4, 2, 128, 128, True, 4, False, 16, 9)
    bare, _, _ = gpu._qkv(np.random.default_rng(0), "f32", 1, 64, 4, 2, 128, 128, False, 4, False, 16, 9)
    assert f.form()[0] == "parts_rope"
    assert lm.features("4a43cc2")["head_values"] == 1
    assert lm.rope_tail_rounds(f.then, 1) == lm.ROPE_ROUNDS_MEASURED == 10
    hv = lm.features(None)["head_values"]
    assert hv == 4 and lm.rope_tail_rounds(f.then, hv) == 4
    assert lm.rope_tail_rounds(bare.then, 1) == 5 and lm.rope_tail_rounds(bare.then, hv) == 2
    # the chain's q/k/v phase (parts_rope.cu head_epilogue's ONE, read off the sources): a normed head of one chunk
    # loaded once, its squares from the values the rotation uses (the arrival, the loads, the warp sum); a head
    # without a norm as before; the standalone fold keeps the two rounds
    assert lm.features(None)["rope_one"] and not lm.features("4a43cc2")["rope_one"]
    assert lm.rope_tail_rounds(f.then, hv, True) == 3 and lm.rope_tail_rounds(bare.then, hv, True) == 2
    assert lm.rope_tail_rounds(f.then, 1, True) == 10  # (a chunk of 32 values: four chunks, no single load)


def test_a_folds_tail_takes_its_rows_two_at_a_time(lm):
    """norm.cu's norm_rows_tail<2> (read off norm.cu: norm_pairs; not at 38929db): a Qwen3-8B fold's norm over 8 rows
    of 4096 in 16 dependent rounds where a row at a time took 24 (a pair: one sum-of-squares pass and one block_sums
    for both, then each row's write pass); a row left over alone; heads and a pre-normed operand paired alike; rows not
    of four-value words a row at a time."""
    from lanefuse.kernels import Norm, PreNorm

    assert lm.features(None)["norm_pairs"] and not lm.features("38929db")["norm_pairs"]
    # fold.cu says which fold keeps a row at a time (fold_tail<1>: the q8 fold, which pairs spilled)
    assert lm.features(None)["tail_one"] == {"fold_gemv_norm_q8"}
    nm = Norm("res", "nw", "y", 8, 4096, 1e-6, add="o", sum="s")
    assert lm.norm_tail_rounds(nm, 128, 8, 8) == 24 and lm.norm_tail_rounds(nm, 128, 8, 8, pairs=True) == 16
    odd = Norm("res", "nw", "y", 7, 4096, 1e-6, add="o", sum="s")
    assert lm.norm_tail_rounds(odd, 128, 8, 8, pairs=True) == 3 * 4 + 3
    pre = Norm("res", "nw", "y", 2, 1024, 1e-6, heads=2, add="o", sum="s", pre=PreNorm("pw", 1e-5))
    assert lm.norm_tail_rounds(pre, 128, 8, 8) == 2 * (2 + 2 * 3)
    assert lm.norm_tail_rounds(pre, 128, 8, 8, pairs=True) == 2 + 2 * 4
    words = Norm("res", "nw", "y", 8, 4098, 1e-6, add="o", sum="s")
    assert lm.norm_tail_rounds(words, 128, 8, 8, pairs=True) == lm.norm_tail_rounds(words, 128, 8, 8)


def _qwen3_attention():
    from lanefuse.kernels.attention import Attention
    from lanefuse.lane.lower.knobs import Knobs

    return Attention("q", "kc", "vc", "pos", "o", 32, 4, 128, 128, 4096, 1, 128 ** -0.5).tune(Knobs())


def test_a_split_attention_is_one_launch_its_merge_a_tail(lm):
    """Since attention_merge (issue 34 item 1) a split attention is one kernel, its merge (the last split block of a
    row's heads) charged as L2 rounds after its waves; before it (combine=True: sources without attention_merge) the
    combine is recorded after the split as its second kernel."""
    from types import SimpleNamespace

    a = _qwen3_attention()
    assert a.splits > 1
    plan = SimpleNamespace(launches=[SimpleNamespace(launch=a)], constants={})
    assert [k.call.name for k in lm.plan_kernels(plan)] == ["attention_split_128"]
    assert [k.call.name for k in lm.plan_kernels(plan, combine=True)] == ["attention_split_128", "attention_combine"]
    feats = lm.features(None)
    assert feats["attn_merge"] and feats["attn_mz"] >= 8
    # counted by hand off attention_merge: the arrival; the maxima and sums of <= 128 splits (one round); ceil(33 / mz)
    # value rounds (4 values a lane, a warp a head at 4 heads a block); the quantized form's read back
    mz = feats["attn_mz"]
    assert lm.merge_rounds(33, 128, 4, 128, 4, False, mz) == 1 + 1 + math.ceil(33 / mz)
    assert lm.merge_rounds(33, 128, 4, 128, 4, True, mz) == 2 + 1 + math.ceil(33 / mz)
    # 130 splits: a second chunk (its maxima, its weights: two rounds more), one head over four warps (128 values: a
    # pass); heads of 256 at 4 a block: two passes, the second chunk's weights again on the second
    assert lm.merge_rounds(130, 128, 1, 128, 4, False, mz) == 1 + 1 + 2 + math.ceil(128 / mz) + 1
    assert lm.merge_rounds(130, 256, 4, 128, 4, False, mz) == 1 + 1 + 1 + 2 * (1 + math.ceil(128 / mz) + 1)
    # the chain's merge stages its values in shared memory (chain.cu's CHAIN_MERGE_STAGE floats a warp, read off the
    # source): 18 splits of 128 values a batch, the first beside the maxima (the arrival and two rounds at 33 splits,
    # three at 40); a head over four warps (a value a lane) 72 a batch: 130 splits the arrival, the maxima with the
    # first batch, the second chunk's maxima, the first chunk's second batch, the second chunk's weights and batch
    stage = feats["attn_stage"]
    assert stage == 2304
    assert lm.merge_rounds(33, 128, 4, 128, 4, False, mz, stage=stage) == 1 + 2
    assert lm.merge_rounds(40, 128, 4, 128, 4, False, mz, stage=stage) == 1 + 3
    assert lm.merge_rounds(130, 128, 1, 128, 4, False, mz, stage=stage) == 1 + 5


def test_the_kv_cache_streams_at_70_percent_at_4096(lm):
    """Issue 34 item 2, PREDICTED: Qwen3-8B's attention (32 heads over 8, heads of 128, a 4096-row cache, the lane's
    own splits) at position 4096 streams its KV cache at >= 70% of B_peak over its waves (its µs less the launch's
    fixed t0 and the merge's tail), with sm_90's 168 registers (3 blocks a SM)."""
    import kernel_resources as kr

    a = _qwen3_attention()
    cal = lm.load_calibration()
    env = lm.recording_env()({})
    a.cuda(env)
    k = lm.Kernel(0, "attention", a, env.calls[0])
    k.regs, k.smem = 168, 12420
    k.bpsm, _ = kr.blocks_per_sm(k.regs, k.smem, k.threads)
    lm.structure(k, lm.features(None), 4096)
    lm.time_us(k, cal)
    waves = k.us - k.fixed - k.tail
    assert k.bytes == 4096 * 8 * 256 * 4 and k.tail > 0
    assert k.bytes / waves / 1e6 >= 0.7 * cal["B_peak_TBps"], lm.attention_stream(k, cal)


def test_a_chains_phase_boundary_hides_what_its_blocks_asked_l2_for(lm, demo_plan, monkeypatch, tmp_path):
    """chain_prefetch_bytes is what chain.cu's waiting blocks ask L2 for (fold_attn_o_glu_down): an attention phase
    after the q/k/v phase its keys and values before the position; a product phase its rows whole where the phase's
    rows (gate and up together) fit CHAIN_PREFETCH_PHASE, else each row's first PDL_PREFETCH_ROW bytes. A boundary
    hides at most those bytes' streaming, the phase before's tail and the poll, and the phase's own waves."""
    from types import SimpleNamespace as NS

    def phase(name, family, fmt, k, n, nbytes, blocks):
        return NS(family=family, bytes=nbytes, blocks=blocks, call=NS(name=name), extra=dict(fmt=fmt, k=k, n=n))

    o = phase("fold_gemv_norm_4", "gemv", "bf16", 4096, 4096, 4096 * 4096 * 2.0, 256)  # 32 MiB: whole rows
    assert lm.chain_prefetch_bytes(o, 256, 4, 4, 512) == 256 * 16 * 8192 == o.bytes
    assert lm.chain_prefetch_bytes(o, 100, 4, 4, 512) == 100 * 16 * 8192  # only the resident blocks' rows
    o32 = phase("fold_gemv_norm_4", "gemv", "f32", 4096, 4096, 4096 * 4096 * 4.0, 256)  # 64 MiB: 4 KB a row
    assert lm.chain_prefetch_bytes(o32, 256, 4, 4, 512) == 256 * 16 * lm.PDL_PREFETCH_ROW
    glu = phase("gemv_glu_4", "gemv", "bf16", 4096, 12288, 2 * 12288 * 4096 * 2.0, 768)  # 192 MiB: gate and up, 4 KB
    assert lm.chain_prefetch_bytes(glu, 396, 4, 4, 512) == 396 * 16 * 2 * lm.PDL_PREFETCH_ROW
    small = phase("gemv_glu_4", "gemv", "q8_0", 64, 88, 2 * 88 * 68.0, 6)  # a tiny model's GLU: whole rows, both
    assert lm.chain_prefetch_bytes(small, 6, 4, 4, 512) == pytest.approx(small.bytes)
    att = phase("attention_chain", "attention", "f32", 0, 0, 4.2e6, 264)
    assert lm.chain_prefetch_bytes(att, 264, 4, 4, 512) == pytest.approx(4.2e6 * 512 / 513)
    assert lm.chain_prefetch_bytes(att, 132, 4, 4, 512) == pytest.approx(4.2e6 * 512 / 513 / 2)

    # under PDL, before PDL_ENTER, the first wave's blocks (blockIdx below 396) of the q/k/v and the o phases ask for
    # their rows' first 4 KB (chain_prefetch_after): in the five-phase chain the o phase starts past the first wave
    qkv = phase("fold_parts_rope_4", "gemv", "bf16", 4096, 6144, 6144 * 4096 * 2.0, 384)
    down = phase("fold_gemv_norm_4", "gemv", "bf16", 12288, 4096, 4096 * 12288 * 2.0, 256)
    five, four = [qkv, att, o, glu, down], [att, o, glu, down]
    assert lm.pdl_prefetch_bytes(five, [0, 2], 396, 4, 4) == 384 * 16 * lm.PDL_PREFETCH_ROW
    assert lm.pdl_prefetch_bytes(four, [1], 396, 4, 4) == (396 - 264) * 16 * lm.PDL_PREFETCH_ROW
    assert lm.pdl_prefetch_bytes([glu, down], [0], 396, 4, 4) == 396 * 16 * 2 * lm.PDL_PREFETCH_ROW

    monkeypatch.setattr(lm.shutil, "which", lambda name: None)
    monkeypatch.setattr(lm, "CACHE", tmp_path)
    cal = lm.load_calibration()
    chained = [k for k in lm.model(demo_plan, None, cal, pos=16) if "phases" in k.extra]
    assert chained, "the demo plan chains its layers"
    for k in chained:
        hides = k.extra["chain_hides_us"]
        assert len(hides) == len(k.extra["phases"]) - 1 and sum(hides) == pytest.approx(k.extra["chain_hidden_us"])
        assert all(0 <= h for h in hides) and max(hides) > 0
        tails = k.extra["phase_tail_us"]  # never more than the tail of the phase before and the poll
        assert all(h <= t + lm.CHAIN_POLL_US + 1e-9 for h, t in zip(hides, tails))
        assert 0 < k.extra["pdl_prefetch_bytes"] <= k.bytes  # what with_pdl credits of it
