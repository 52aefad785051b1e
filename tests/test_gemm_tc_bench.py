"""bench/gemm_model.py's arithmetic (tiles, waves, the busiest SM's share, the memory floor) and bench/gpu_prefill.py's
host side on the CPU: the flops it divides by, the inputs it loads, the prediction of a plan made under the knob."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import gemm_model  # noqa: E402
import gpu_prefill  # noqa: E402

from lanefuse.engine.front.demo import demo_model  # noqa: E402
from lanefuse.engine.front.model import build_step  # noqa: E402
from lanefuse.lane.lower.knobs import Knobs  # noqa: E402
from lanefuse.lane.lower.plan import plan  # noqa: E402


def _step(warps, mi, nj, stages, bm, b):
    """A k step of an SM holding b blocks, restated from the docstring's assumptions: the longest of the tensor
    cores' time (a lone block at half the rate), shared memory's (ldmatrix.x4 of 512 B: mi + nj/2 a warp a k16, two
    k16 a step, plus the stage's (bm + 128) rows of 64 B) and the copies' latency over stages - 1 steps, all over
    EFFICIENCY."""
    m = gemm_model
    flops = 2 * bm * 128 * 32
    smem = warps * 2 * (mi + nj // 2) * 512 + (bm + 128) * 64
    return max(max(b, 2) * flops / (m.MMA_SYNC_TFLOPS * 1e12 / m.SMS) * 1e6,
               b * smem / (m.SMEM_BYTES_PER_CLK * m.CLOCK_GHZ * 1e9) * 1e6,
               m.LATENCY_US / (stages - 1)) / m.EFFICIENCY


def test_gemm_prediction_tiles_waves_and_bounds():
    """2048 x 4096 x 4096: 512 tiles of 128 x 128 in two waves of two blocks an SM, 128 k steps each; the kernels now
    (four warps of 64 x 64, three stages: 48 KB through shared memory a step) against 0f140e5's (eight of 64 x 32,
    two stages: 64 KB, and a step no shorter than the copies' whole latency): faster by the model's own arithmetic."""
    p = gemm_model.gemm_prediction(2048, 4096, 4096, 2 * 4096 * 4096)
    assert p["tiles"] == 16 * 32 and p["waves"] == math.ceil(512 / 264)
    assert p["compute_us"] == pytest.approx(2 * 128 * _step(4, 4, 8, 3, 128, 2), abs=0.01)
    assert p["bound"] == "smem" and p["us"] > p["compute_us"]
    before = gemm_model.gemm_prediction(2048, 4096, 4096, 2 * 4096 * 4096, kernel="before")
    assert before["compute_us"] == pytest.approx(2 * 128 * _step(8, 4, 4, 2, 128, 2), abs=0.01)
    assert before["us"] > p["us"] and before["bound"] in ("smem", "latency")
    small = gemm_model.gemm_prediction(16, 1024, 64, 2 * 1024 * 64)  # 8 tiles: most SMs idle, the launch dominates
    assert small["tiles"] == 8 and small["wave_fill"] < 0.05
    assert small["compute_us"] == pytest.approx(2 * _step(8, 2, 4, 3, 64, 1), abs=0.01)  # a lone block an SM
    # 16 rows run in tiles of 64 (the kernel pads m): a batch of 16's vocabulary product does 4x its work on the
    # tensor cores and is still bound by its bytes; 65 rows take tiles of 128: the same product bound on the SMs
    wide = gemm_model.gemm_prediction(16, 151936, 4096, 2 * 151936 * 4096)
    assert wide["bound"] == "hbm" and wide["compute_us"] > wide["memory_us"] / 2
    assert gemm_model.gemm_prediction(65, 151936, 4096, 2 * 151936 * 4096)["bound"] in ("mma", "smem", "latency")


def test_gemm_prediction_of_the_tail_split():
    """Under half a wave of tiles (512 x 4096 x 4096: 128 tiles, 264 block slots) each SM's lone block runs at half
    its rate; split in two along k the wave is full and each block does half the steps at the two blocks' step:
    faster, the combine (a launch, three f32 (m, n) arrays) included. The lane's tail_split (at its knobs) picks
    the same."""
    from lanefuse.kernels.gemm_tc import tail_split

    one = gemm_model.gemm_prediction(512, 4096, 4096, 2 * 4096 * 4096)
    two = gemm_model.gemm_prediction(512, 4096, 4096, 2 * 4096 * 4096, ksplit=2)
    assert one["waves"] == two["waves"] == 1 and two["wave_fill"] == pytest.approx(2 * one["wave_fill"], abs=1e-3)
    assert one["compute_us"] == pytest.approx(128 * _step(4, 4, 8, 3, 128, 1), abs=0.01)
    assert two["compute_us"] == pytest.approx(64 * _step(4, 4, 8, 3, 128, 2), abs=0.01)
    assert two["us"] < one["us"]
    k = Knobs()
    assert tail_split(512, 4096, 4096, k.sms, k.tflops_tc, k.hbm_gbps, k.launch_us) == 2


def test_batch_prediction_prices_each_sequences_cache():
    """A decode batch of 16 under tc_rows: its products on the tensor cores (tiles of 64 rows), its attention priced
    by each sequence's f32 keys and values up to the position over HBM (not by the chunk's causal work)."""
    cfg, _ = demo_model()
    s = plan(build_step(cfg, 1, batch=16), knobs=Knobs(tc_rows=16))
    p = gemm_model.plan_prediction(s, pos=40)
    assert p["batch"] == 16 and p["gemm_launches"] == 4 * cfg.layers + 1  # and every row's logits
    att = [x.launch for x in s.launches if x.launch.census == "attention"]
    assert att
    want = sum(gemm_model.LAUNCH_US + (4 * 16 * 41 * (a.heads // a.group) * (a.hd + a.vd)
                                       + 4 * 16 * a.heads * (a.hd + a.vd)) / (gemm_model.HBM_TBPS * 1e12) * 1e6
               for a in att)
    assert p["kinds_us"]["attention"] == pytest.approx(want, abs=0.2)
    assert p["tokens_per_s"] == pytest.approx(16 / (p["step_us"] * 1e-6), rel=1e-3)


def test_attention_tc_prediction_counts_the_tiles_each_warp_attends():
    """A 128-row chunk of 8 heads over 2 kv heads (GQA 4) of 128 values at position 0: 512 slots, 8 blocks a kv head;
    block b's keys [0, 16(b+1)) in one tile of 64 (b < 4) or two; each warp skips the tiles past its last row: the
    mma work is the warps' tiles x 2·2·16·64·128, and at least the causal work it does."""
    p = gemm_model.attention_tc_prediction(128, 8, 4, 128, 128)
    assert p["blocks"] == 16 and p["waves"] == 1
    warp_tiles = 0
    for b in range(8):
        for w in range(4):
            last_row = (64 * b + 16 * w + 15) // 4
            warp_tiles += last_row // 64 + 1
    assert p["mma_flops"] == 2 * warp_tiles * 2 * 2 * 16 * 64 * 128
    assert p["mma_flops"] >= p["useful_flops"] == 2 * 8 * 256 * 128 * 129 // 2
    assert p["us"] >= gemm_model.LAUNCH_US and p["bound"] in ("mma", "l2", "hbm")


def test_plan_prediction_and_step_flops_of_a_prefill_under_the_knob():
    cfg, _ = demo_model()
    s = plan(build_step(cfg, 32), knobs=Knobs(tc_rows=16))
    p = gemm_model.plan_prediction(s)
    gemms = [x.launch for x in s.launches if x.launch.census in ("gemm_tc", "gemm_tc_parts", "gemm_tc_glu")]
    assert p["gemm_launches"] == len(gemms) == 4 * cfg.layers
    assert p["step_us"] == pytest.approx(p["gemm_us"] + p["other_us"], abs=0.2)
    prod, att = gpu_prefill.step_flops(s)
    assert prod >= sum(l.flops() for l in gemms)
    assert att == cfg.layers * 4 * cfg.heads * cfg.head_dim * 32 * 33 // 2
    inputs = gpu_prefill.inputs_of(s, np.random.default_rng(0))
    assert inputs["token"].shape == (32,) and inputs["token"].dtype == np.int32 and inputs["pos"].tolist() == [0]
    assert int(inputs["token"].max()) < cfg.vocab


from test_cupy_runner_mock import fake_cupy  # noqa: E402,F401  (the stand-in cupy fixture)


def test_gpu_prefill_run_on_a_stand_in_device(fake_cupy, monkeypatch, tmp_path):  # noqa: F811
    """bench/gpu_prefill.py's device side run end to end against the stand-in cupy (each launch its numpy twin, CUDA
    events stubbed): a demo prefill plan under the knob saved as the bench's plan, its figures and per-kind table
    written, so a device's run spends its time on kernels, not on the script's bugs."""
    import json
    import types

    from lanefuse.lane.lower.planfile import save

    cp = sys.modules["cupy"]

    class Event:
        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

    cp.cuda.Event = Event
    cp.cuda.get_elapsed_time = lambda a, b: 2.0
    cp.random = types.SimpleNamespace(default_rng=np.random.default_rng)
    cfg, _ = demo_model()
    monkeypatch.setattr(gpu_prefill, "ROWS", (16,))
    save(plan(build_step(cfg, 16), knobs=Knobs(tc_rows=16), source={"kind": "random"}),
         str(tmp_path / "qwen3-8b-prefill16.json"))
    out = tmp_path / "prefill.json"
    gpu_prefill.run(types.SimpleNamespace(plans=str(tmp_path), iters=2, json=str(out), peer="", peer_s=1))
    got = json.loads(out.read_text())["results"][0]
    assert "error" not in got, got.get("error")
    assert got["us"] == 2000.0 and got["tokens_per_s"] == 8000.0 and got["census"]["gemm_tc_parts"] == cfg.layers
    assert got["census"]["gemm_tc_glu"] == cfg.layers  # gate, up and their GLU one launch
    assert got["kinds"]["gemm_tc"]["launches"] == 2 * cfg.layers and got["flops_products"] > 0


def test_batch_curve_targets_and_distinct_launches():
    """bench/batch_curve.py's verdicts from a curve: B = 8 against 6.5x B = 1's tokens/s, B = 64 against 4,000
    tokens/s, the batches whose step is slower than a larger batch's; and its launches one of each shape, counted."""
    import batch_curve

    def row(b, us):
        return {"batch": b, "t0": {"c": {"t0_us": 10.0, "step_us": us, "tokens_per_s": b / (us * 1e-6)}}}

    rows = [row(1, 5000.0), row(4, 25000.0), row(8, 6000.0), row(64, 15000.0)]
    lines = batch_curve.targets(rows, ["c"])
    assert "B=8 x6.67 of B=1 (target 6.5: met)" in lines[0] and "B=64 4267 tokens/s (target 4000: met)" in lines[1]
    assert lines[2].endswith("a step slower than a larger batch's at B = 4")
    short = batch_curve.targets([row(1, 5000.0), row(8, 7000.0), row(64, 17000.0)], ["c"])
    assert "SHORT" in short[0] and "SHORT" in short[1] and len(short) == 2
    g = {"census": "gemm_tc", "m": 8, "parts": [4096], "k": 4096, "ksplit": 8, "us": 20.0}
    got = batch_curve.distinct([g, dict(g), {**g, "k": 12288}])
    assert [(x["k"], x["count"]) for x in got] == [(4096, 2), (12288, 1)]
