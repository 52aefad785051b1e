"""The explorer past a what-if: its history (undo, back to an entry), exact what-ifs, the tensors that have
alternatives, plan files that name a forced choice by what it is, the saturation step by step with why a rule was
not chosen, each rule's source, each launch's fields, CUDA functions and source; and the shell's commands for them,
scripted through stdin. All on the demo model."""

from __future__ import annotations

import dataclasses
import io
import re
from pathlib import Path

import pytest

pytest.importorskip("egglog", reason="the engine needs egglog (the GPU machine has none)")

import lanefuse.kernels as kernels_pkg
from lanefuse.engine.front.demo import demo_model
from lanefuse.engine.errors import UserError
from lanefuse.engine.front.model import build_step
from lanefuse.engine.optimize import Session
from lanefuse.engine.rules import load_table
from lanefuse.lane.cli.explore import explore_command
from lanefuse.lane.cli.main import build_parser
from lanefuse.lane.explore.explorer import Explorer
from lanefuse.lane.lower.plan import plan
from lanefuse.lane.lower.spec import load_spec
from test_explore import HELD


@pytest.fixture(scope="module")
def step():
    cfg, _ = demo_model()
    return build_step(cfg, 1)


@pytest.fixture
def ex(step):
    e = Explorer(step, model_name="demo", held=HELD)  # (test_explore.py's HELD: the q/k/v fold apart)
    yield e
    e.close()


def summary(s) -> tuple:
    return (dict(s.census), round(s.cost_us, 6), dict(s.fusions), s.arena.bytes, s.n_launches)


def shell(script: str) -> tuple[int, str]:
    args = build_parser().parse_args(["explore", "--hold", HELD[0]])
    out = io.StringIO()
    rc = explore_command(args, stdin=io.StringIO(script), stdout=out)
    return rc, out.getvalue()


# ---- history ---------------------------------------------------------------------------------------------------------

def test_undo_walks_back_every_change_and_goto_jumps(ex):
    start = summary(ex.plan())
    ex.hold("merged_qkv")
    after_hold = summary(ex.plan())
    ex.force("L0.q_rot", 0)
    ex.set_knob("sms", 100)
    assert [h["what"] for h in ex.history()] == ["hold merged_qkv", "force L0.q_rot #0", "knob sms=100"]
    assert ex.history()[-1]["launches"] == ex.plan().n_launches
    assert ex.undo() == "knob sms=100" and ex.knobs.sms != 100
    assert ex.undo() == "force L0.q_rot #0" and ex.forced == {}
    assert summary(ex.plan()) == after_hold and ex.diff()["what"] == "undo force L0.q_rot #0"
    assert ex.undo() == "hold merged_qkv" and ex.held == list(HELD)
    assert summary(ex.plan()) == start and ex.method == "ilp"  # the first, exact plan again
    with pytest.raises(UserError, match="nothing to undo"):
        ex.undo()
    # back to an entry: the later ones leave the history
    ex.hold("merged_qkv")
    ex.hold("add_norm")
    ex.force("L0.q_rot", 0)
    ex.goto(1)
    assert ex.held == sorted([*HELD, "merged_qkv"]) and ex.forced == {} and len(ex.history()) == 1
    assert summary(ex.plan()) == after_hold
    ex.goto(0)
    assert ex.history() == [] and summary(ex.plan()) == start
    with pytest.raises(UserError, match="entries 0..0"):
        ex.goto(3)
    assert ex.state()["history"] == []


def test_release_of_a_rule_not_held_says_so(ex):
    with pytest.raises(UserError, match=r"`add_norm` is not held \(held: qkv_attn_o_glu_down_norm\)"):
        ex.release("add_norm")
    ex.hold("add_norm")
    with pytest.raises(UserError, match=r"`merged_qkv` is not held \(held: [^)]*add_norm"):
        ex.release("merged_qkv")
    assert len(ex.history()) == 1


def test_exact_what_ifs(ex, step):
    ex.hold("merged_qkv")
    assert ex.method == "local" and ex.state()["what_if"] == "local"
    ex.set_what_if("ilp")
    assert ex.method == "ilp" and ex.state()["what_if"] == "ilp"
    ex.hold("rows_a_warp")
    assert ex.method == "ilp"
    assert summary(ex.plan()) == summary(plan(step, held=[*HELD, "merged_qkv", "rows_a_warp"]))
    with pytest.raises(UserError, match="local or ilp"):
        ex.set_what_if("greedy")


def test_the_tensors_that_have_alternatives(ex, step):
    rows = ex.with_choices()
    names = [r["tensor"] for r in rows]
    assert names == [op.out for op in step.ops if op.out in set(names)]  # step order
    for r in rows:
        assert r["alternatives"] == len(ex.choices(r["tensor"])) >= 2
        chosen = [c for c in ex.choices(r["tensor"]) if c["chosen"]]
        assert (r["chosen"] is None) == (not chosen)
    one = [op.out for op in step.ops if len(ex.choices(op.out)) == 1]
    assert one and not set(one) & set(names)  # a tensor with one way to compute it is not listed


# ---- plan files name a forced choice by what it is ---------------------------------------------------------------

def test_a_saved_force_replays_after_the_rule_set_changes(ex, step, tmp_path):
    ch = ex.choices("L0.q_rot")
    pick = next(c for c in ch if c["rule"] == "rope_qk_one_launch" and c["reads"] == ["L0.q_norm", "L0.k_norm"])
    ex.force("L0.q_rot", pick["index"])
    path = tmp_path / "plan.yaml"
    ex.save(str(path))
    f = load_spec(str(path))["forced"]["L0.q_rot"]
    assert f["op"] == "rope_qk_one_launch" and f["rule"] == "rope_qk_one_launch" and f["output"] == 0
    assert f["reads"] == ["L0.q_norm", "L0.k_norm"] and f["writes"] == ["L0.q_rot", "L0.k_rot"]
    # holding qk_norm_rope removes alternatives numbered before this one: the index moves, the description holds
    held = plan(step, held=[*HELD, "qk_norm_rope"], forced=load_spec(str(path))["forced"])
    x = next(x for x in held.launches if "L0.q_rot" in x.ops)
    assert x.rule == "rope_qk_one_launch" and "L0.k_rot" in x.ops
    s = Session(step, load_table(()))
    assert f["index"] != next(a.index for a in s.alternatives("L0.q_rot", frozenset({"qk_norm_rope"}))
                              if a.rule == "rope_qk_one_launch")
    # a choice the rules no longer make is refused, naming the tensor and the rule
    with pytest.raises(UserError, match=r"`L0.q_rot` is forced to rope_qk_one_launch by rule `rope_qk_one_launch`"):
        plan(step, held=[*HELD, "rope_qk_one_launch"], forced=load_spec(str(path))["forced"])
    # an explorer opened on it stands where this one stood
    again = Explorer(step, forced=load_spec(str(path))["forced"], held=HELD)
    assert again.forced == ex.forced
    again.close()


def test_a_malformed_forced_choice_is_one_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("forced:\n  L0.q: {rule: x}\n")
    with pytest.raises(UserError, match=r"bad.yaml: forced choice for 'L0.q': a choice names its `op`"):
        load_spec(str(p))


# ---- saturation step by step ---------------------------------------------------------------------------------------

def test_saturation_iterations_and_why_not(ex):
    s = ex.saturation()
    its = s["iterations"]
    assert its and [i["iteration"] for i in its] == list(range(1, len(its) + 1))
    assert its[-1]["enodes"] == s["egraph"]["nodes"]  # the last size is the snapshot's
    assert all(a["enodes"] <= b["enodes"] for a, b in zip(its, its[1:]))
    assert s["stop"] == "saturated"
    by = {r["name"]: r for r in s["rules"]}
    for name, r in by.items():  # an iteration's matches add up to the rule's
        assert r["matches"] == sum(i["matches"].get(name, 0) for i in its)
    # rules made of fused ops fire in a later stage than the ones they build on
    stage = {name: min(i["stage"] for i in its if name in i["matches"]) for name in by if by[name]["matches"]}
    assert stage["merged_qkv"] >= 1 and stage["qkv_head_epilogue"] > stage["qk_norm_rope"]
    assert by["attn_o_glu_down_norm"]["fired"] == ex.plan().fusions["attn_o_glu_down_norm"]
    # add_norm matched but lost to attn_o_glu_down_norm (the chained launch joins it): the cost comparison says by how
    # much
    w = by["add_norm"]["why_not"]
    assert by["add_norm"]["matches"] > 0 and by["add_norm"]["fired"] == 0
    assert w["plan_cost_us"] > w["step_us"] and "attn_o_glu_down_norm" in w["instead"]
    assert re.search(r"the step would cost [\d.]+ µs with it \(\+[\d.]+ µs\)", w["text"])
    assert by["embed_scale"]["why_not"] == "its pattern matched nothing in this step"
    ex.hold("add_norm")
    assert next(r for r in ex.saturation()["rules"] if r["name"] == "add_norm")["why_not"].startswith("held")


def test_a_refused_or_decomposed_alternative_says_its_reason(step, tmp_path):
    # a cuda lane of the user's that refuses one class: the rule matched, the lane said no, and why
    lanes = tmp_path / "lanes"
    lanes.mkdir()
    (lanes / "cuda.yaml").write_text("lane: cuda\nbase: cuda\nwhy: the built-in lane, refusing one class\nclasses:\n"
                                     "  gemv_norm_epilogue:\n    support: refuse\n"
                                     "    reason: the test's lane has no fold of a product and a norm\n")
    ex = Explorer(step, rules_dirs=(str(tmp_path),))
    try:
        r = next(r for r in ex.saturation()["rules"] if r["name"] == "gemv_norm_epilogue")
        assert r["matches"] > 0 and r["fired"] == 0
        w = r["why_not"]
        assert w["support"] == "refuse" and w["reason"] == "the test's lane has no fold of a product and a norm"
        assert w["text"].endswith("refuse: the test's lane has no fold of a product and a norm")
    finally:
        ex.close()
    # the conservative lane runs fused classes as their parts: the comparison says so
    ex = Explorer(step, lane="conservative")
    try:
        r = next(r for r in ex.saturation()["rules"] if r["name"] == "gemv_gate_up_glu")
        w = r["why_not"]
        assert w["support"] == "decompose" and w["reason"] and w["text"].endswith(w["reason"])
    finally:
        ex.close()


# ---- rules' source and launches' code --------------------------------------------------------------------------------

def test_every_rule_shows_its_yaml_entry(ex):
    import importlib.resources

    for r in ex.state()["rules"]:
        if r["cls"] == "lane step":
            continue
        name, where = r["where"].split(" @ ")
        file, line = where.rsplit(":", 1)
        text = importlib.resources.files("lanefuse.rules").joinpath(file.removeprefix("rules/")).read_text()
        assert text.splitlines()[int(line) - 1] == r["source"].splitlines()[0]
        assert f"name: {name}" in r["source"] and r["why"].split()[0] in r["source"]
        assert r["source"].count("- name:") == 1
        assert r["pattern"] and any(p.startswith("out: ") for p in r["pattern"])


def test_every_launch_shows_its_fields_cuda_and_twin(ex):
    s = ex.plan()
    for n, x in enumerate(s.launches):
        d = ex.launch(n)
        assert d["census"] == x.launch.census and d["tensors"] == list(x.ops)
        assert d["bytes"] == x.launch.bytes() and d["cost_us"] == pytest.approx(x.cost_us, abs=1e-4)
        assert set(d["fields"]) == {f.name for f in dataclasses.fields(x.launch)}
        assert d["calls"], d["calls_note"]
        for c in d["calls"]:
            assert all(v >= 1 for v in c["grid"] + c["block"])
            f = next(f for f in d["functions"] if f["function"] == c["function"])
            assert f["source"] and c["function"] in f["source"], (n, c["function"])
            cu = Path(kernels_pkg.__file__).parent / Path(f["file"]).name
            assert f["file"].startswith("kernels/") and cu.is_file()
        mod, cls, meth = d["numpy"].rsplit(".", 2)
        assert meth == "numpy" and cls == type(x.launch).__name__ and mod.startswith("kernels.")
        assert x.launch.grid_block() in [(tuple(c["grid"]), tuple(c["block"])) for c in d["calls"]] or \
            len(d["calls"]) > 1 or x.launch.census == "fold"
    with pytest.raises(UserError, match=r"launches 0\.\.9"):
        ex.launch(99)


# ---- the shell ---------------------------------------------------------------------------------------------------

SCRIPT = """\
HOLD merged_qkv
Choices
force L0.q_rot 0
history
undo
UNDO
undo
release add_norm
hold attn_o_glu_down_norm
exact on
release attn_o_glu_down_norm
history 0
rule gemv_norm_epilogue
saturation
launch 0
"""


def test_shell_history_exact_choices_rule_saturation_launch():
    rc, text = shell(SCRIPT)
    assert rc == 1  # `undo` with nothing left, `release add_norm`: two errors, the loop went on
    # a command in capitals (each layer's attention, o fold and MLP chained: attn_o_glu_down_norm)
    assert "hold merged_qkv: launches 10 → 18" in text
    assert "[local search," in text and "`exact on` keeps them exact" in text
    assert re.search(r"\d+ tensors with alternatives", text) and "L0.q_rot" in text
    assert "1  hold merged_qkv: 18 launches" in text and "2  force L0.q_rot #0" in text
    assert "undo force L0.q_rot #0: launches" in text and "undo hold merged_qkv: launches 18 → 10" in text
    assert "error: nothing to undo" in text
    assert "error: `add_norm` is not held (held: qkv_attn_o_glu_down_norm)" in text
    assert "exact on: every change re-plans exactly" in text
    # held, each layer's attention runs apart before its three-phase chain (-4)
    assert "release attn_o_glu_down_norm: launches 14 → 10 (-4)" in text and "[exact (ILP)," in text
    assert "back to the start" in text
    assert "gemv_norm_epilogue @ rules/norm.yaml:11" in text and "p: matmul(x, wp)" in text
    assert "- name: gemv_norm_epilogue" in text
    assert re.search(r"saturation: \d+ iterations, stopped: saturated; e-graph \d+ e-nodes", text)
    assert "the step would cost" in text
    assert re.search(r"CUDA fold_gather_norm<<<grid \(1, 1, 1\), block \(\d+, 1, 1\)>>>", text)
    assert "numpy twin: kernels.fold.Fold.numpy" in text and "fold_gather_norm @ kernels/fold.cu:" in text
    assert "Traceback" not in text and "internal error" not in text


# ---- A/B -------------------------------------------------------------------------------------------------------------

def test_compare_two_specs(ex, step, tmp_path):
    a = ex.spec()
    ex.hold("merged_qkv")
    ex.force("L0.q_rot", 0)
    r = ex.compare(a)  # the pinned start against now
    want_a, want_b = plan(step, held=HELD), plan(step, held=[*HELD, "merged_qkv"], forced={"L0.q_rot": 0})
    assert r["a"]["launches"] == want_a.n_launches and r["a"]["census"] == dict(want_a.census)
    assert sorted(r["b"]["held"]) == sorted([*HELD, "merged_qkv"]) and r["b"]["forced"] == {"L0.q_rot": 0} and r["b"]["current"]
    assert r["b"]["launches"] == want_b.n_launches and r["b"]["census"] == dict(want_b.census)
    d = r["diff"]
    assert d["launches"] == [want_a.n_launches, r["b"]["launches"]]
    assert d["fusions"]["merged_qkv"][0] == 4 and d["fusions"]["merged_qkv"][1] < 4
    assert d["same"] + len(d["only_a"]) == want_a.n_launches and d["same"] + len(d["only_b"]) == r["b"]["launches"]
    assert any(x["rule"] == "merged_qkv" for x in d["only_a"])
    assert ex.compare(a, a)["diff"]["only_a"] == [] and sorted(ex.held) == sorted([*HELD, "merged_qkv"])  # comparing changes nothing
    # plan files on both sides: by what each forced choice is
    pa, pb = tmp_path / "a.yaml", tmp_path / "b.yaml"
    ex.save(str(pb))
    ex.goto(0)
    ex.save(str(pa))
    r2 = ex.compare(load_spec(str(pa)), load_spec(str(pb)))
    assert r2["diff"] == {**d, "only_a": r2["diff"]["only_a"], "only_b": r2["diff"]["only_b"]}
    with pytest.raises(UserError, match="spec A: unknown key `hold`"):
        ex.compare({"hold": ["x"]})
    with pytest.raises(UserError, match=r"no rule or schedule step `add_nrom`"):
        ex.compare({"held": ["add_nrom"]})


def test_shell_pin_and_compare(tmp_path):
    rc, text = shell(f"compare\npin\nhold merged_qkv\ncompare\nsave {tmp_path / 'b.yaml'}\nundo\n"
                     f"compare {tmp_path / 'b.yaml'}\n")
    assert rc == 1 and "error: nothing pinned" in text
    assert "pinned as A: held qkv_attn_o_glu_down_norm" in text
    assert re.search(r"launches\s+│ 10\s+│ 18\s+│\s+\+8", text), text
    assert re.search(r"6 launches alike; 4 only in A, 12 only in B", text)
    assert re.search(r"launches\s+│ 18\s+│ 10\s+│\s+-8", text)
