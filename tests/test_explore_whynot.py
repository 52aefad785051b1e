"""The explorer and its static report as issue 37 asks: the report's header (how it was made) and every
alternative's step cost (or why it has none), a launch's layer the same in the mini-map/search and its panel, the
shell's `choices` with equal layers in one row and `why RULE`, a config-only folder said to be a shape only, and a
checkpoint file given for its folder named."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("egglog", reason="the engine needs egglog")


def _cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", *args], capture_output=True, text=True,
                          timeout=300, input=stdin)


@pytest.fixture(scope="module")
def ex():
    from lanefuse.engine.front.demo import demo_model
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.explore.explorer import Explorer

    cfg, _ = demo_model(64)
    e = Explorer(build_step(cfg, 1), model_name="demo")
    yield e
    e.close()


def test_the_report_data_has_a_header_and_every_step_cost(ex):
    from lanefuse.lane.explore.report import report_data

    r = report_data(ex, budget_s=600)
    h = r["header"]
    assert {"version", "command", "date", "model", "lane", "numerics", "knobs", "held", "rows", "layers"} <= set(h)
    assert h["model"] == "demo" and h["lane"] == "cuda" and h["numerics"] == "f32" and h["held"] == []
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", h["date"])
    step = r["common"]["cost_us"]
    n = 0
    for t, alts in r["choices"].items():
        if len(alts) < 2:
            continue
        for c in alts:
            assert c.get("plan_cost_us") is not None or c.get("plan_cost_why"), (t, c)
            if c["chosen"]:
                assert abs(c["plan_cost_us"] - step) < 1e-3
            elif c.get("plan_cost_us") is not None:
                n += 1
                assert c["plan_cost_us"] >= step - 1e-3  # the plan is the cheapest the search found
    assert n > 20
    live = {c["index"]: c["plan_cost_us"] for c in ex.choices("L0.glu")}  # the live explorer's figures
    assert {c["index"]: c["plan_cost_us"] for c in r["choices"]["L0.glu"]} == live


def test_past_its_budget_the_report_says_why_a_cost_is_missing(ex):
    from lanefuse.lane.explore.report import report_data

    r = report_data(ex, budget_s=0)
    alts = r["choices"]["L0.glu"]
    assert all(c.get("plan_cost_us") is None for c in alts if not c["chosen"])
    assert all("not worked out" in c["plan_cost_why"] for c in alts if not c["chosen"])


def test_a_launch_lands_on_the_layer_its_panel_names(ex):
    st = ex.state(0)
    for x in st["step"]["launches"]:
        d = ex.launch(x["index"])
        if d["layer"] >= 0:
            assert x["layer"] == d["layer"], (x, d["layer"])
            view = ex.state(x["layer"])
            assert x["index"] in [g["index"] for g in view["groups"]]  # and that layer's view shows it
    ex.state(0)


def test_the_shell_compresses_equal_layers_and_answers_why_rule():
    r = _cli("explore", "--hold", "qkv_attn_o_glu_down_norm", stdin="choices\nchoices --all\nwhy glu_act_mul\nwhy attn_o_glu_down_norm\nquit\n")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    short, full = out.split("tensors with alternatives")[1:3]
    assert re.search(r"L1\.q_rot\s*[│ ]\s*1–2\b", short) and "L2.q_rot" not in short
    assert "L2.q_rot" in full
    assert re.search(r"glu_act_mul: matched 4 times in saturation, fired 0 times in this plan; not chosen: at L0\.glu "
                     r"\(#1\): the step would cost [\d.]+ µs with it \(\+[\d.]+ µs\)", re.sub(r"\s+", " ", out)), out
    said = "attn_o_glu_down_norm: matched 4 times in saturation, fired 4 times in this plan; chosen wherever it matched"
    assert said in re.sub(r"\s+", " ", out)


def test_a_config_only_folder_is_said_to_be_a_shape_and_a_checkpoint_file_names_its_folder(tmp_path):
    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6, "torch_dtype": "float32"}))
    e = _cli("explore", str(d), stdin="quit\n")
    assert e.returncode == 0, e.stderr
    assert "lanefuse: shape only: no weights in" in e.stderr and "(shape only: no weights)" in e.stdout
    for f in ("config.json", "model.safetensors"):
        (d / f).touch() if f.endswith(".safetensors") else None
        r = _cli("plan", str(d / f))
        assert r.returncode == 2 and r.stderr.strip() == \
            f"lanefuse: error: {d / f}: is a file of a checkpoint folder; give the folder: `{d}`", r.stderr
