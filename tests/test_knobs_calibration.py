"""The lane's latency knobs are the launch model's calibration (bench/launch_model_calibration.json, fitted on the
2026-12-04 H200 figures), kept in one place each: a refit of the calibration that moves them fails here until the lane's
defaults follow (lane/lower/knobs.py), and a latency-priced kind reads the knob, not a copy."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lanefuse.kernels.head_gemv import HeadGemv
from lanefuse.lane.lower.knobs import Knobs

CAL = json.loads((Path(__file__).resolve().parent.parent / "bench" / "launch_model_calibration.json").read_text())


def test_the_round_knobs_are_the_calibrations():
    k = Knobs()
    assert k.hbm_round_us == pytest.approx(CAL["L_us"], abs=0.005)
    assert k.l2_round_us == pytest.approx(CAL["L_l2_us"], abs=0.005)


def test_head_gemv_prices_its_rounds_by_the_knobs():
    from lanefuse.kernels.common import Dst

    hg = HeadGemv("x", "w", "bf16", Dst("y"), a=512, b=128, heads=16, m=1)
    base = hg.loop_us(Knobs())
    slower = hg.loop_us(dataclasses.replace(Knobs(), hbm_round_us=2 * Knobs().hbm_round_us))
    assert slower == pytest.approx(2 * base)
