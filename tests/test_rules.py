"""The rule table: it loads, every rule expands, and a mistake in a rules file is said with its file:line and a
near name; a user's rules dir adds a rule that fires with no Python written."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("egglog", reason="the engine needs egglog (the GPU machine has none)")

from lanefuse.engine.errors import UserError
from lanefuse.engine.ir import Constant, Graph, StepIO
from lanefuse.engine.optimize import optimize
from lanefuse.engine.rules import check_rules_dir, load_table, rules_listing


@pytest.fixture(scope="module")
def table():
    return load_table()


def test_table_loads_and_every_rule_expands(table):
    assert len(table.rules) >= 15
    for r in table.rules:
        assert table.variants[r.name], r.name
        assert r.cls in table.classes
        assert ":" in r.where and "@" in r.where


def test_listing_and_dependencies(table):
    rows = {r[0]: r for r in rules_listing(table)}
    assert rows["qkv_head_epilogue"][3] == ["qk_norm_rope"] or "qk_norm_rope" in rows["qkv_head_epilogue"][3]
    assert rows["add_norm"][2].startswith("rules/norm.yaml:")
    assert table.dependents("qk_norm_rope")["qkv_head_epilogue"] == "fully"


def _write(tmp_path, text, name="mine.yaml"):
    d = tmp_path / "rules"
    d.mkdir(exist_ok=True)
    (d / name).write_text(text)
    return d


def _err(tmp_path, text) -> str:
    d = _write(tmp_path, text)
    with pytest.raises(UserError) as e:
        load_table([d])
    return str(e.value)


def test_bad_yaml_cites_file_line(tmp_path):
    msg = _err(tmp_path, "- name: x\n  class: add_norm\n  match: {a: [\n")
    assert "mine.yaml:" in msg and "not valid YAML" in msg


def test_unknown_op_did_you_mean(tmp_path):
    msg = _err(tmp_path, "- name: mine\n  class: add_norm\n  match:\n    s: addd(a, b)\n    y: rmsnorm(s, w)\n")
    assert "mine.yaml:1" in msg and "`mine`" in msg and "did you mean `add`" in msg


def test_unknown_class_did_you_mean(tmp_path):
    msg = _err(tmp_path, "- name: mine\n  class: add_nrom\n  match:\n    y: silu(x)\n")
    assert "unknown class `add_nrom`" in msg and "did you mean `add_norm`" in msg and "mine.yaml:1" in msg


def test_duplicate_name_refused(tmp_path):
    msg = _err(tmp_path, "- name: add_norm\n  class: add_norm\n  match:\n    y: silu(x)\n")
    assert "defined twice" in msg and "rules/norm.yaml" in msg


def test_unknown_guard_and_key(tmp_path):
    msg = _err(tmp_path, "- name: mine\n  class: add_norm\n  match:\n    y: silu(x)\n  guards:\n    - single_readr(y)\n")
    assert "did you mean `single_reader`" in msg
    msg = _err(tmp_path, "- name: mine\n  class: add_norm\n  mach:\n    y: silu(x)\n")
    assert "unknown key `mach`" in msg and "did you mean `match`" in msg


def test_unknown_attribute_and_var(tmp_path):
    msg = _err(tmp_path, "- name: mine\n  class: add_norm\n  match:\n    y: rmsnorm(x, w, epss=e)\n")
    assert "no input or attribute `epss`" in msg and "did you mean `eps`" in msg
    msg = _err(tmp_path, "- name: mine\n  class: add_norm\n  match:\n    y: silu(x)\n  keeps: [z]\n")
    assert "output `z` is not a pattern variable" in msg


def test_unknown_held_lists_known(table):
    from lanefuse.engine.front.model import ModelConfig, build_step

    g = build_step(ModelConfig("Qwen3ForCausalLM", 64, 1, 4, 2, 16, 128, 100, qk_norm=True, max_len=16))
    with pytest.raises(UserError) as e:
        optimize(g, table, held=frozenset({"add_nrom"}))
    assert "did you mean `add_norm`" in str(e.value) and "known:" in str(e.value)


def sandwich_graph() -> Graph:
    """x + norm(y), normed: the sandwich pattern (the shared rule norm_then_add joins it; the test below holds that
    back and joins it by a class of the user's own)."""
    g = Graph(io=StepIO())
    g.tensor("token", (1,), "i32")
    g.tensor("pos", (1,), "i32")
    g.constant(Constant("emb", (50, 32), "rows"))
    g.constant(Constant("w1", (32,), "values"))
    g.constant(Constant("w2", (32,), "values"))
    g.constant(Constant("head", (50, 32), "rows", transposed=True))
    g.add("gather", ["emb", "token"], "x")
    g.add("silu", ["x"], "y")
    g.add("rmsnorm", ["y", "w1"], "n", eps=1e-6)
    g.add("add", ["x", "n"], "s")
    g.add("rmsnorm", ["s", "w2"], "z", eps=1e-6)
    g.add("matmul", ["z", "head"], "logits")
    g.add("argmax", ["logits"], "next")
    g.validate()
    return g


USER_CLASS = """\
- class: my_sandwich
  joins: "norm of (x + norm(y))"
  launch: "Norm with pre"
  vars: [x, y, w1, w2, e1, e2, z]
"""

USER_RULE = """\
- name: my.norm_then_add
  class: my_sandwich
  why: the sandwich norm in one launch
  match:
    n: rmsnorm(y, w1, eps=e1, heads=1)
    s: add(x, n)
    z: rmsnorm(s, w2, eps=e2, heads=1)
"""


def test_user_rule_dir_fires_and_changes_plan(tmp_path, monkeypatch):
    from lanefuse.engine.interp import evaluate
    from lanefuse.engine.front.stepweights import random_weights

    g = sandwich_graph()
    held = frozenset({"norm_then_add"})
    base = optimize(g, load_table(), held=held)
    d = _write(tmp_path, USER_RULE)
    _write(tmp_path, USER_CLASS, "classes.yaml")
    monkeypatch.setenv("LANEFUSE_RULES", str(d))
    table = load_table()
    assert "my.norm_then_add" in table.names
    o = optimize(g, table, held=held)
    assert o.fusions.get("my.norm_then_add") == 1
    assert len(o.graph.ops) < len(base.graph.ops)
    op = next(op for op in o.graph.ops if op.rule == "my.norm_then_add")
    assert op.cls == "my_sandwich" and op.b["w1"] == "w1" and op.b["w2"] == "w2" and op.b["x"] == "x"
    w = random_weights(g, 3)
    env = {"token": np.array([7], np.int32), "pos": np.array([0], np.int32)}
    ref, got = evaluate(g, w, dict(env)), evaluate(o.graph, w, dict(env))
    np.testing.assert_allclose(got["logits"], ref["logits"], rtol=1e-6, atol=1e-6)
    assert check_rules_dir(str(d), {"my_sandwich"}) == []
    problems = check_rules_dir(str(d), set())
    assert any("my_sandwich" in p and "no lane" in p for p in problems)
