"""Class contracts as data: each class of classes.yaml declares its variables (`vars:`); every rule of the class binds
them and its lane entries read only them, checked when the tables load and by `lanefuse rules --check`. A user folder
adds classes and lanes (`base: cuda` starts from the built-in table): a new class on an existing launch runs end to
end, and the example of rules/README.md plans and runs as written."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lanefuse.engine.front.demo import demo_config, demo_model
from lanefuse.engine.errors import UserError
from lanefuse.lane.run.generate import new_caches
from lanefuse.engine.interp import evaluate
from lanefuse.engine.front.model import build_step
from lanefuse.engine.rules import contract_problems, load_classes, load_table, rule_binds
from lanefuse.lane.lower.plan import plan
from lanefuse.lane.lower.table import load_lane
from lanefuse.lane.run.numpy_runner import NumpyRunner

TOL = 1e-4
# the built-in rules joining the ops the new class joins
HOLD = ("add_norm", "gemv_norm_epilogue", "glu_down_norm", "o_glu_down_norm", "attn_o_glu_down_norm",
        "qkv_attn_o_glu_down_norm")
README = Path(__file__).resolve().parent.parent / "rules" / "README.md"

CLASSES = """\
- class: my_add_norm
  joins: "a residual add and the RMSNorm of its sum, on the existing norm launch"
  launch: "Norm with add, sum"
  vars: [a, b, s, w, y, eps]
"""

RULE = """\
- name: my.add_norm
  class: my_add_norm
  why: the residual add and the norm of its sum in one launch that also writes the sum
  match:
    s: add(a, b)
    y: rmsnorm(s, w, eps=eps, heads=1)
  keeps: [s]
"""

LANE = """\
lane: cuda
base: cuda
why: the built-in CUDA lane, and my_add_norm linked whole
classes:
  my_add_norm:
    support: native
    launch: norm
    fields: {x: a, add: b, sum: s, w: w, out: y, rows: rows(y), cols: cols(y), eps: %s, into: into(y)}
"""


@pytest.fixture(autouse=True)
def _no_env_rules(monkeypatch):
    monkeypatch.delenv("LANEFUSE_RULES", raising=False)


def _folder(root: Path, classes=CLASSES, rules=RULE, lane=LANE % "eps") -> Path:
    d = root / "my_rules"
    (d / "lanes").mkdir(parents=True, exist_ok=True)
    if classes is not None:
        (d / "classes.yaml").write_text(classes)
    if rules is not None:
        (d / "my_norm.yaml").write_text(rules)
    if lane is not None:
        (d / "lanes" / "cuda.yaml").write_text(lane)
    return d


def _cli(*args, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "LANEFUSE_RULES"}
    return subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


def _rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(np.max(np.abs(b)), 1e-30))


# -- the built-in tables keep their contracts ----------------------------------------------------------------------
def test_every_builtin_class_declares_its_contract_and_every_rule_binds_it():
    table = load_table()
    assert contract_problems(table) == []
    assert table.classes["add_norm"]["vars"] == ("a", "b", "s", "w", "y", "eps")
    assert table.classes["gemv_gate_up_glu"]["vars"] == ("x", "wg", "wu", "y", "act", "yq?", "words?")
    assert all("vars" in c for c in table.classes.values())
    for r in table.rules:  # what the lane reads is what extraction's fused op carries
        need = set(c for c in table.classes[r.cls]["vars"] if not c.endswith("?"))  # `v?`: only some rules bind it
        assert need <= rule_binds(table, r), r.name
    for lane in ("cuda", "conservative"):
        assert load_lane(lane).classes


# -- a new class on an existing launch, from a user folder ---------------------------------------------------------
def test_a_user_class_on_an_existing_launch_plans_and_runs(tmp_path):
    d = _folder(tmp_path)
    lane = load_lane("cuda", [str(d)])
    builtin = load_lane("cuda")
    assert set(lane.classes) == set(builtin.classes) | {"my_add_norm"} and lane.ops.keys() == builtin.ops.keys()
    assert lane.classes["my_add_norm"].choice.launch == "norm"

    cfg, w = demo_model()
    for rows in (1, 3):
        g = build_step(demo_config(), rows)
        s = plan(g, held=HOLD, rules_dirs=[str(d)])
        # before each MLP and each next layer or the head (a chunk's head norms a view of its last row: no add)
        want = 2 * cfg.layers - (rows > 1)
        assert s.fusions.get("my.add_norm") == want
        mine = [x for x in s.launches if x.cls == "my_add_norm"]
        assert len(mine) == want and all(x.rule == "my.add_norm" for x in mine)
        assert all(x.launch.census == "norm" for x in mine)
        env = new_caches(cfg)
        rng = np.random.default_rng(rows)
        for k in env:  # a cache with history
            env[k][:8] = rng.standard_normal(env[k][:8].shape).astype(np.float32)
        env["token"] = rng.integers(0, cfg.vocab, rows).astype(np.int32)
        env["pos"] = np.asarray([8], np.int32)
        ref_env = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in env.items()}
        ref = evaluate(g, w, ref_env)
        out = NumpyRunner(s, w).step(env, lifted=g)
        assert np.array_equal(np.asarray(out["next"]).reshape(-1), np.asarray(ref["next"]).reshape(-1))
        assert _rel(out["logits"], ref["logits"]) <= TOL
    # without the folder, the same held plan has no such class
    assert "my.add_norm" not in plan(build_step(demo_config(), 1), held=HOLD).fusions


def test_a_user_class_through_the_command(tmp_path):
    d = _folder(tmp_path)
    hold = [a for h in HOLD for a in ("--hold", h)]
    p = _cli("plan", "--rules", str(d), *hold, "--json", str(tmp_path / "plan.json"))
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "plan.json").read_text())["fusions"]["my.add_norm"] == 8
    r = _cli("run", "--rules", str(d), *hold, "--prompt-ids", "1,2,3", "--tokens", "6", "--json",
             str(tmp_path / "run.json"))
    ref = _cli("run", "--reference", "--prompt-ids", "1,2,3", "--tokens", "6", "--json", str(tmp_path / "ref.json"))
    assert r.returncode == 0 and ref.returncode == 0, r.stderr + ref.stderr
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("run.json", "ref.json"))
    assert a["generated_ids"] == b["generated_ids"]
    assert max(_rel(x, y) for x, y in zip(a["logits"], b["logits"])) <= TOL
    c = _cli("rules", "--check", str(d))
    assert c.returncode == 0 and "error" not in c.stderr, c.stdout + c.stderr


# -- contract errors -----------------------------------------------------------------------------------------------
OTHER_NAMES = """\
- name: my.gate_up
  class: gemv_gate_up_glu
  why: the gate and up products of one activation, under other names
  match:
    g: matmul(h, w_gate)
    u: matmul(h, w_up)
    y: swiglu(g, u)
  with: {act: silu}
"""


def test_a_rule_missing_a_variable_of_its_contract_is_refused_at_load(tmp_path):
    d = _folder(tmp_path, classes=None, lane=None, rules=OTHER_NAMES)
    with pytest.raises(UserError) as e:
        load_table([str(d)])
    msg = str(e.value)
    assert msg.startswith(f"my.gate_up @ {d / 'my_norm.yaml'}:1: rule of class `gemv_gate_up_glu` does not bind `x` "
                          f"(the class's contract: x, wg, wu, y, act, yq?, words?)")
    assert "and 2 more" in msg
    with pytest.raises(UserError, match="does not bind `x`"):  # plan stops there too, before the lane
        plan(build_step(demo_config(), 1), rules_dirs=[str(d)])
    r = _cli("rules", "--check", str(d))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    errors = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert [re.search(r"does not bind `(\w+)`", l).group(1) for l in errors] == ["x", "wg", "wu"]
    assert all(f"my.gate_up @ {d / 'my_norm.yaml'}:1: rule of class `gemv_gate_up_glu`" in l for l in errors)
    assert "(did you mean `w_up`?)" in errors[2]


def test_an_intermediate_is_not_bound(tmp_path):
    keeps_less = RULE.replace("  keeps: [s]\n", "")
    d = _folder(tmp_path, rules=keeps_less, lane=None)
    with pytest.raises(UserError) as e:
        load_table([str(d)])
    assert "my.add_norm @" in str(e.value) and "does not bind `s`" in str(e.value) and "keeps:" in str(e.value)


def test_a_lane_entry_reading_outside_the_contract_is_refused_at_load(tmp_path):
    d = _folder(tmp_path, lane=LANE % "epsilon")
    lane_file = d / "lanes" / "cuda.yaml"
    line = next(i for i, l in enumerate(lane_file.read_text().splitlines(), 1) if l.startswith("  my_add_norm:"))
    with pytest.raises(UserError) as e:
        load_lane("cuda", [str(d)])
    msg = str(e.value)
    assert msg.startswith(f"{lane_file}:{line}: classes.my_add_norm: field `eps` reads `epsilon`, which is not in "
                          f"class `my_add_norm`'s contract (a, b, s, w, y, eps; {d / 'classes.yaml'}:1)")
    assert "did you mean `eps`" in msg
    with pytest.raises(UserError, match="reads `epsilon`"):
        plan(build_step(demo_config(), 1), held=HOLD, rules_dirs=[str(d)])
    r = _cli("rules", "--check", str(d))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    errors = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == f"error: {msg}"  # the conservative lane stands on it: listed once


def test_a_builtin_class_entry_is_checked_against_its_contract_too(tmp_path):
    # an entry of a user cuda lane for a built-in class, reading an intermediate its rules do not bind
    d = _folder(tmp_path, classes=None, rules=None, lane="lane: cuda\nbase: cuda\nclasses:\n  gemv_norm_epilogue:\n"
                "    support: native\n    launch: norm\n    fields: {x: a, add: p, sum: s, w: w, out: y}\n")
    with pytest.raises(UserError, match=r"classes.gemv_norm_epilogue: field `add` reads `p`, which is not in class "
                                        r"`gemv_norm_epilogue`'s contract \(x, wp, a, s, w, y, eps, pw\?, peps\?, b\?, "
                                        r"q\?, words\?; "
                                        r"rules/classes.yaml:\d+\).*leaf"):
        load_lane("cuda", [str(d)])


def test_a_lifted_op_entry_reads_only_its_inputs_and_attributes(tmp_path):
    d = _folder(tmp_path, classes=None, rules=None, lane=None)
    (d / "lanes" / "mine.yaml").write_text("lane: mine\nbase: cuda\nops:\n  scale:\n    - launch: scale\n"
                                           "      fields: {x: x, y: out, n: size(out), factor: factr}\n")
    with pytest.raises(UserError, match=r"ops.scale: field `factor` reads `factr`, which is not in `scale`'s inputs "
                                        r"and attributes .*did you mean `factor`"):
        load_lane("mine", [str(d)])


def test_optional_variables_are_read_as_optional(tmp_path):
    classes = CLASSES.replace("vars: [a, b, s, w, y, eps]", 'vars: [a, b, s, w, y, "eps?"]')  # `?` quoted in YAML
    d = _folder(tmp_path, classes=classes)
    with pytest.raises(UserError, match=r"field `eps` reads `eps`, which class `my_add_norm`'s contract .* marks "
                                        r"optional: read it as `eps\?`"):
        load_lane("cuda", [str(d)])
    _folder(tmp_path, classes=classes, lane=LANE % '"eps?"')
    assert load_lane("cuda", [str(d)]).classes["my_add_norm"].choice.fields["eps"] == "eps?"
    assert contract_problems(load_table([str(d)])) == []


def test_classes_yaml_errors_cite_file_and_line(tmp_path):
    d = _folder(tmp_path, classes=CLASSES.replace("  vars: [a, b, s, w, y, eps]\n", ""), rules=None, lane=None)
    with pytest.raises(UserError, match=r"classes.yaml:1: class `my_add_norm` has no `vars:`"):
        load_classes([str(d)])
    _folder(tmp_path, classes="- class: add_norm\n  joins: mine\n  vars: [a]\n", rules=None, lane=None)
    with pytest.raises(UserError, match=r"class `add_norm` is defined twice \(first at rules/classes.yaml:\d+\)"):
        load_table([str(d)])
    _folder(tmp_path, classes=CLASSES.replace("vars:", "var:"), rules=None, lane=None)
    with pytest.raises(UserError, match="unknown key `var`.*did you mean `vars`"):
        load_table([str(d)])


# -- lanes of a user folder ----------------------------------------------------------------------------------------
def test_a_user_cuda_lane_with_base_cuda_starts_from_the_builtin_one(tmp_path):
    d = _folder(tmp_path)
    cons = load_lane("conservative", [str(d)])  # the built-in conservative lane stands on the user's cuda
    assert "my_add_norm" in cons.classes and cons.classes["gemv_norm_epilogue"].support == "decompose"
    (d / "lanes" / "solo.yaml").write_text("lane: solo\nbase: solo\n")
    with pytest.raises(UserError, match=r"solo.yaml: `base: solo` names this table itself, and no `solo` table"):
        load_lane("solo", [str(d)])
    (d / "lanes" / "solo.yaml").write_text("lane: solo\nbase: cuda_\n")
    with pytest.raises(UserError, match=r"base lane `cuda_` is not known \(did you mean `cuda`\?\)"):
        load_lane("solo", [str(d)])


# -- the README's example, as written ------------------------------------------------------------------------------
def _readme_example() -> tuple[dict[str, str], list[str]]:
    """The files (by the path on each block's first line) and the commands of the README's example section."""
    text = README.read_text()
    start = text.index("## Example: a class of your own")
    end = text.index("\n## ", start + 1)
    files, commands = {}, []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text[start:end], re.S):
        if lang == "yaml":
            first, _, rest = body.partition("\n")
            assert first.startswith("# "), first
            files[first[2:].strip()] = rest
        elif lang == "sh":
            commands += [l.strip() for l in body.splitlines() if l.strip()]
    return files, commands


def test_the_readme_example_plans_and_runs_as_written(tmp_path):
    files, commands = _readme_example()
    assert set(files) == {"my_rules/classes.yaml", "my_rules/my_norm.yaml", "my_rules/lanes/cuda.yaml"}
    for path, body in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(body)
    assert [c.split()[:2] for c in commands] == [["lanefuse", "rules"], ["lanefuse", "plan"], ["lanefuse", "run"],
                                                 ["lanefuse", "run"]]
    outs = []
    for c in commands:
        r = _cli(*shlex.split(c)[1:], cwd=tmp_path)
        assert r.returncode == 0, f"{c}: {r.stderr}"
        outs.append(r.stdout)
    assert "every class a rule makes is linked by some lane" in outs[0]
    # chosen twice a layer of the demo model: `rule  source  matched  chosen  note`, plain rows into a pipe
    assert re.search(r"^ *my\.add_norm\s+\S+:\d+\s+\d+\s+8\b", outs[1], re.M), outs[1]
    ids = [re.search(r"generated ids:\s*([\d,]+)", o).group(1) for o in outs[2:]]
    assert ids[0] == ids[1] and len(ids[0].split(",")) == 8


CHOICES = """\
lane: cuda
base: cuda
why: my_add_norm linked by the first of its choices whose `if` holds
classes:
  my_add_norm:
    support: native
    choices:
      - if: %s
        refuse: my norm refuses this one
      - launch: norm
        fields: {x: a, add: b, sum: s, w: w, out: y, rows: rows(y), cols: cols(y), eps: eps, into: into(y)}
"""


def test_a_class_entry_with_choices_links_by_the_first_that_holds(tmp_path):
    """A class entry's `choices:` (gemv_quant's: the HeadGemv or the Gemv by what the rule bound): the first whose
    `if:` holds links the op, a `refuse:` choice refusing it (extraction then leaves the class); each
    choice is checked against the class's contract; a list ending in an `if:`, a `launch:` beside `choices:` or a
    `choices:` that is not a list are refused at load, citing the entry."""
    g = build_step(demo_config(), 1)
    d = _folder(tmp_path, lane=CHOICES % "is_computed(w)")  # the norm weights are constants: the norm links
    lane = load_lane("cuda", [str(d)])
    assert [c.launch for c in lane.classes["my_add_norm"].choices] == [None, "norm"]
    assert plan(g, held=HOLD, rules_dirs=[str(d)]).fusions.get("my.add_norm") == 2 * demo_config().layers
    _folder(tmp_path, lane=CHOICES % "is_values(w)")  # refused every time (f32 values): the rule's ops stay apart
    s = plan(g, held=HOLD, rules_dirs=[str(d)])
    assert not s.fusions.get("my.add_norm"), s.fusions
    for lane_text, want in (
            (CHOICES % "is_values(eps2)", r"classes.my_add_norm: its `if:` reads `eps2`, which is not in class "
                                          r"`my_add_norm`'s contract"),
            (CHOICES.replace("      - launch: norm", "      - if: eps\n        launch: norm") % "eps",
             "the last of `choices:` has an `if:`"),
            (CHOICES.replace("    choices:", "    launch: norm\n    choices:") % "eps", "not both"),
            ("lane: cuda\nbase: cuda\nclasses:\n  my_add_norm:\n    support: native\n    choices: norm\n",
             "`choices:` must be a non-empty list")):
        _folder(tmp_path, lane=lane_text)
        with pytest.raises(UserError, match=want):
            load_lane("cuda", [str(d)])
