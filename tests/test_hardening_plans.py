"""A saved plan proves it is the lowering that was saved: `plan --save` writes a digest of each launch and of every
other field that reaches a kernel or says what the plan was planned from, and `run --plan` refuses, in one line
naming the field, a plan edited since (a norm's eps, a launch reading another layer's weights, a launch removed,
the launch list emptied); a plan whose launches write no logits or no next token is never run."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

pytest.importorskip("egglog")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from lanefuse.engine.front.demo import demo_config
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.lower.planfile import save

    f = tmp_path_factory.mktemp("plans") / "demo.json"
    save(plan(build_step(demo_config(), 1), source={"kind": "demo"}), str(f))
    return f


def _records(x, path=()):
    if isinstance(x, dict):
        yield path, x
        for k, v in x.items():
            yield from _records(v, path + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _records(v, path + (i,))


def _launch_with(doc, pred):
    """(index, record) of the first launch holding a record `pred` accepts, and that record."""
    for i, x in enumerate(doc["plan"]["launches"]):
        for _, r in _records(x["launch"]):
            if pred(r):
                return i, r
    raise AssertionError("no such launch")


def _load(doc, tmp_path):
    from lanefuse.lane.lower.planfile import load

    f = tmp_path / "edited.json"
    f.write_text(json.dumps(doc))
    return load(str(f))


def _refused(doc, tmp_path, *words):
    from lanefuse.engine.errors import UserError

    with pytest.raises(UserError) as e:
        _load(doc, tmp_path)
    msg = str(e.value)
    assert all(w in msg for w in words), msg
    assert "\n" not in msg and len(msg) < 300, msg
    return msg


def _eps(doc):
    i, r = _launch_with(doc, lambda r: isinstance(r.get("eps"), float) and r["eps"] > 0)
    r["eps"] = r["eps"] * 10
    return i


def _other_layer(doc):
    def reads_layer0_weight(r):
        return any(isinstance(v, str) and v.startswith("model.layers.0.") and v.endswith(".weight") for v in r.values())

    i, r = _launch_with(doc, reads_layer0_weight)
    for k, v in r.items():
        if isinstance(v, str) and v.startswith("model.layers.0.") and v.endswith(".weight"):
            r[k] = v.replace("model.layers.0.", "model.layers.1.", 1)
            return i
    raise AssertionError


def test_the_saved_plan_loads_untouched(saved, tmp_path):
    doc = json.loads(saved.read_text())
    assert set(doc) == {"format", "plan", "digests"} and len(doc["digests"]["launches"]) == len(doc["plan"]["launches"])
    assert _load(doc, tmp_path).launches


@pytest.mark.parametrize("tamper", [_eps, _other_layer], ids=["a norm's eps", "another layer's weights"])
def test_an_edited_launch_is_refused_by_its_place(saved, tmp_path, tamper):
    doc = json.loads(saved.read_text())
    i = tamper(doc)
    _refused(doc, tmp_path, f"launches[{i}] (", "edited after the plan was saved", "plan --save")


def test_an_emptied_launch_list_and_no_argmax_are_never_run(saved, tmp_path):
    doc = json.loads(saved.read_text())
    d = copy.deepcopy(doc)
    d["plan"]["launches"] = []
    _refused(d, tmp_path, "launches: no launch writes `logits`", "never run")
    d = copy.deepcopy(doc)
    for x in d["plan"]["launches"]:  # the LM head's fold with its arg-max (head_argmax): the head's product alone
        if x["launch"]["_t"] == "Fold" and x["launch"]["then"]["_t"] == "ArgMax":
            x["launch"] = x["launch"]["first"]
    d["plan"]["launches"] = [x for x in d["plan"]["launches"] if x["launch"]["_t"] != "ArgMax"]
    assert [x["launch"]["_t"] for x in d["plan"]["launches"]].count("ArgMax") == 0
    _refused(d, tmp_path, "no launch writes `next`")


def test_a_removed_launch_a_plan_field_and_missing_digests_are_refused(saved, tmp_path):
    doc = json.loads(saved.read_text())
    d = copy.deepcopy(doc)
    d["digests"]["launches"].pop()
    _refused(d, tmp_path, "launches: ", "where the plan was saved with")
    d = copy.deepcopy(doc)
    d["plan"]["numerics"] = "q8"
    _refused(d, tmp_path, "numerics: edited after the plan was saved")
    d = copy.deepcopy(doc)
    d["plan"]["constants"]["model.norm.weight"]["format"] = "bf16"
    _refused(d, tmp_path)  # the launches read it as f32: a check before the digests names that
    d = copy.deepcopy(doc)
    d["plan"]["tensors"]["x0"]["name"] = "x0"
    d["digests"]["tensors"]["x0"] = "0" * 32
    _refused(d, tmp_path, "tensors['x0']: edited after the plan was saved")
    d = copy.deepcopy(doc)
    del d["digests"]
    _refused(d, tmp_path, "digests: none", "older lanefuse")
    d = copy.deepcopy(doc)
    d["digests"] = {"launches": "x"}
    _refused(d, tmp_path, "digests: not the digests")


def test_run_plan_refuses_an_edited_plan_in_one_line(saved, tmp_path):
    doc = json.loads(saved.read_text())
    i = _eps(doc)
    f = tmp_path / "edited.json"
    f.write_text(json.dumps(doc))
    r = subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", "run", "--plan", str(f), "--tokens", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert r.stderr.splitlines()[-1].startswith(f"lanefuse: error: {f}: launches[{i}] ("), r.stderr
    assert "Traceback" not in r.stderr
