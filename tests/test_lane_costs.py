"""The lane's cost model per kernel kind (issue 34 item 5): rules/lanes/*.yaml `costs:` (a kind's fixed µs beyond the
launch gap and its share of the HBM bandwidth) read, checked and merged along `base:`; lane/lower/shim.launch_us
prices each kernel by them; and the built-in CUDA lane's entries agree with bench/launch_model.py's predictions for
the Qwen3-8B bf16 decode step within 25% a kind (the model is calibrated on the 2026-12-04 H200 figures; the device's
per-kind figures, bench/gpu_decode.py, replace it when measured)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lanefuse.engine.errors import UserError
from lanefuse.lane.lower.knobs import Knobs
from lanefuse.lane.lower.shim import launch_us
from lanefuse.lane.lower.table import KindCost, load_lane

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _lane(tmp_path, body: str, name: str = "mine") -> Path:
    d = tmp_path / "rules"
    (d / "lanes").mkdir(parents=True, exist_ok=True)
    (d / "lanes" / f"{name}.yaml").write_text(f"lane: {name}\nbase: cuda\n" + body)
    return d


def test_the_cuda_lane_prices_its_decode_kinds():
    costs = load_lane("cuda").costs
    for kind in ("attention", "argmax", *(f"default@{f}" for f in ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k",
                                                                    "q6_k"))):
        assert kind in costs, kind
        c = costs[kind]
        assert c.fixed_us >= 0 and 0 < c.bandwidth <= 1


def test_kind_cost_takes_kind_and_format_then_kind_then_format_then_default():
    from lanefuse.kernels.gemv import Gemv
    from lanefuse.kernels.common import Dst
    from lanefuse.lane.lower.shim import kind_cost

    costs = {"gemv@q8_0": KindCost(1, 1), "gemv": KindCost(2, 1), "default@q8_0": KindCost(3, 1),
             "default@q4_0": KindCost(4, 1), "default": KindCost(5, 1)}
    g = lambda f: Gemv("x", "w", f, Dst("y"), 64, 8, 1)  # noqa: E731
    assert kind_cost(g("q8_0"), costs).fixed_us == 1
    assert kind_cost(g("q4_0"), costs).fixed_us == 2
    del costs["gemv"]
    assert kind_cost(g("q4_0"), costs).fixed_us == 4 and kind_cost(g("bf16"), costs).fixed_us == 5


def test_a_user_lane_overrides_one_kind_and_keeps_the_rest(tmp_path):
    d = _lane(tmp_path, "costs:\n  gemv: {fixed_us: 50, bandwidth: 0.5}\n  attention: {fixed_us: 1, bandwidth: 1}\n")
    mine, cuda = load_lane("mine", [str(d)]).costs, load_lane("cuda").costs
    assert mine["gemv"] == KindCost(50.0, 0.5) and mine["attention"] == KindCost(1.0, 1.0)
    assert {k: v for k, v in mine.items() if k not in ("gemv", "attention")} == \
        {k: v for k, v in cuda.items() if k != "attention"}


@pytest.mark.parametrize("entry, says", [
    ("gemvv: {fixed_us: 1, bandwidth: 0.5}", "unknown launch kind `gemvv` (did you mean `gemv`?)"),
    ("gemv: {fixed_us: -1, bandwidth: 0.5}", "fixed_us must be a number >= 0"),
    ("gemv: {fixed_us: 1, bandwidth: 0}", "bandwidth a share in (0, 1]"),
    ("gemv: {fixed_us: 1, bandwidth: 1.5}", "bandwidth a share in (0, 1]"),
    ("gemv: {fixed_us: .nan, bandwidth: 0.5}", "fixed_us must be a number"),
    ("gemv: {fixed_us: 1}", "expected {fixed_us: µs, bandwidth: a share of hbm_gbps}"),
    ("gemv@q9_9: {fixed_us: 1, bandwidth: 0.5}", "unknown rows format `q9_9`"),
    ("gemv: 3", "expected {fixed_us"),
])
def test_a_bad_cost_entry_is_one_line_naming_the_file(tmp_path, entry, says):
    d = _lane(tmp_path, "costs:\n  " + entry + "\n")
    with pytest.raises(UserError) as e:
        load_lane("mine", [str(d)])
    msg = str(e.value)
    assert msg.startswith("mine.yaml:3: costs.") and says in msg and "\n" not in msg


def test_costs_must_be_a_mapping(tmp_path):
    d = _lane(tmp_path, "costs: [1, 2]\n")
    with pytest.raises(UserError, match=r"`costs:` must be a mapping"):
        load_lane("mine", [str(d)])


def test_launch_us_adds_the_kinds_fixed_time_and_bandwidth_share():
    from lanefuse.kernels.argmax import ArgMax

    l = ArgMax(x="x", out="y", n=151936)
    k = Knobs()
    plain = launch_us(l, k)
    assert plain == pytest.approx(k.launch_us + l.bytes() / (k.hbm_gbps * 1e3))
    priced = launch_us(l, k, {"argmax": KindCost(7.0, 0.25)})
    assert priced == pytest.approx(k.launch_us + 7.0 + l.bytes() / (k.hbm_gbps * 0.25 * 1e3))
    assert launch_us(l, k, {"gemv": KindCost(7.0, 0.25)}) == pytest.approx(plain)  # another kind's: untouched
    half = Knobs(fixed_scale=0.5)  # the knob scales a kind's own fixed time, not the gap or the bytes
    assert launch_us(l, half, {"argmax": KindCost(7.0, 0.25)}) == pytest.approx(priced - 3.5)


@pytest.fixture(scope="module")
def lm():
    sys.path.insert(0, str(BENCH))
    import launch_model

    return launch_model


def test_fit_lane_recovers_a_linear_kind(lm):
    pts = [("gemv", b, 2.0 + 5.0 + b / (4300e3 * 0.8)) for b in (1e6, 5e7, 3e8)] + [("argmax", 6e5, 9.0)] + \
        [("fold@q8_0", 4.3e8, 2.0 + 8.0 + 400.0)]
    got = lm.fit_lane(pts, 2.0, 4300.0, fixed_one=8.0)
    assert got["gemv"] == {"fixed_us": 5.0, "bandwidth": 0.8}
    # one size: the given fixed and the share that leaves (100 µs of bytes in 400), or share 1 and the rest; a
    # product's kind over a format is that format's entry for every product kind
    assert got["default@q8_0"] == {"fixed_us": 8.0, "bandwidth": 0.25} and "fold@q8_0" not in got
    assert got["argmax"]["bandwidth"] == 1.0 and got["argmax"]["fixed_us"] == pytest.approx(7 - 6e5 / 4300e3, abs=0.01)


def test_the_lane_agrees_with_the_launch_model_per_kind(lm, monkeypatch, tmp_path):
    # without nvcc: ptxas' figures from the committed bench/results/kernel-resources.json
    monkeypatch.setattr(lm.shutil, "which", lambda name: None)
    monkeypatch.setattr(lm, "CACHE", tmp_path)
    s = lm.qwen3_plan("bf16")
    ks = lm.model(s, None, lm.load_calibration(), 512)
    rows = lm.lane_vs_model(s, ks)
    # the LM head a fold with its arg-max (head_argmax); each layer's GLU and down fold one chain (glu_down_norm)
    # (and each layer's attention, o fold, GLU and down fold one chain: attn_o_glu_down_norm)
    assert {"fold", "chain"} <= set(rows)
    off = {kind: lane / pred for kind, (n, lane, pred) in rows.items() if pred > 0}
    assert all(0.75 <= r <= 1.25 for r in off.values()), off
    total_lane, total_model = sum(r[1] for r in rows.values()), sum(r[2] for r in rows.values())
    assert total_lane == pytest.approx(total_model, rel=0.1)
