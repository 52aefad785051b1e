"""The explorer (lane/explore/explorer.py) on the demo model: forced choices, hold and release, the diff, alternatives
with their refusals, a saved plan file replayed by `plan()`; the engine API it stands on, and that it reads no private
attribute and names no fused class; the terminal explorer driven by a script; the web server and page over the real
Explorer. What-if timings are printed, never asserted."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("egglog", reason="the engine needs egglog (the GPU machine has none)")

from lanefuse.engine import flags
from lanefuse.engine.front.demo import demo_model
from lanefuse.engine.errors import UserError
from lanefuse.engine.front.model import build_step
from lanefuse.lane.cli.main import build_parser
from lanefuse.lane.explore.explorer import Explorer
from lanefuse.lane.cli.explore import explore_command
from lanefuse.lane.lower.knobs import parse_knobs
from lanefuse.lane.lower.plan import plan
from lanefuse.lane.lower.spec import load_spec

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


# The explorer's mechanics (force, hold and release, alternatives, the shell, the page) are checked on the demo decode
# plan of two launches a layer, the q/k/v fold apart from the four-phase chain (qkv_attn_o_glu_down_norm held: with it
# each layer is one launch and the q/k/v tensors have no alternative left to force or hold)
HELD = ("qkv_attn_o_glu_down_norm",)


@pytest.fixture(scope="module")
def step():
    cfg, _ = demo_model()
    return build_step(cfg, 1)


@pytest.fixture
def ex(step):
    return Explorer(step, model_name="demo", held=HELD)


def summary(s) -> tuple:
    return (s.census, round(s.cost_us, 6), s.fusions, s.arena.bytes, s.n_launches)


def launch_of(sched, tensor):
    return next(x for x in sched.launches if tensor in x.ops)


# ---- the API ---------------------------------------------------------------------------------------------------------

def test_first_plan_is_exact_and_matches_plan(ex, step):
    assert ex.method == "ilp"
    assert summary(ex.plan()) == summary(plan(step, held=list(HELD)))
    assert ex.diff() is None


def test_a_forced_choice_shows_in_the_plan(ex):
    assert launch_of(ex.plan(), "L0.q").rule == "merged_qkv"  # extraction's pick: q inside the merged product
    ch = ex.choices("L0.q")
    lifted = next(c for c in ch if c["support"] == "lifted")
    ex.force("L0.q", lifted["index"])
    x = launch_of(ex.plan(), "L0.q")
    assert x.ops == ("L0.q",) and x.launch.census == "gemv" and x.rule is None
    assert ex.state()["forced"] == {"L0.q": lifted["index"]}
    now = {c["index"]: c for c in ex.choices("L0.q")}
    assert now[lifted["index"]]["chosen"] and now[lifted["index"]]["forced"]
    assert now[lifted["index"]]["plan_cost_us"] == pytest.approx(ex.plan().cost_us, abs=1e-3)
    assert ex.diff()["what"] == f"force L0.q #{lifted['index']}"
    assert "forced by you" in ex.why("L0.q")
    ex.unforce("L0.q")
    assert launch_of(ex.plan(), "L0.q").rule == "merged_qkv"
    with pytest.raises(UserError, match="not forced"):
        ex.unforce("L0.q")


def test_hold_then_release_gives_the_same_plan(ex):
    before = summary(ex.plan())
    ex.hold("attn_o_glu_down_norm")
    held = ex.plan()
    assert summary(held) != before and "attn_o_glu_down_norm" not in held.fusions
    d = ex.diff()
    assert d["what"] == "hold attn_o_glu_down_norm"
    assert d["launches"] == [before[4], held.n_launches] and d["launches"][1] > d["launches"][0]
    # held, each layer's attention a launch again before its three-phase chain (o_glu_down_norm)
    assert d["fusions"]["attn_o_glu_down_norm"] == [4, 0] and d["fusions"]["o_glu_down_norm"] == [0, 4]
    assert d["cost_us"][1] > d["cost_us"][0] and d["arena"] == [before[3], held.arena.bytes]
    assert d["census"]["attention"] == [0, 4]
    st = ex.state()
    assert next(r for r in st["rules"] if r["name"] == "attn_o_glu_down_norm")["held"]
    assert st["diff"] == d and st["held"] == sorted(["attn_o_glu_down_norm", *HELD])
    ex.release("attn_o_glu_down_norm")
    assert summary(ex.plan()) == before
    assert ex.diff()["fusions"]["attn_o_glu_down_norm"] == [0, 4]


def test_holding_a_rule_others_build_on_says_which(ex):
    ex.hold("qk_norm_rope")
    st = ex.state()
    assert any("qkv_head_epilogue" in w and "qk_norm_rope" in w for w in st["warnings"]), st["warnings"]
    assert any("qkv_head_epilogue" in w for w in st["diff"]["warnings"])
    rule = next(r for r in st["rules"] if r["name"] == "qkv_head_epilogue")
    assert "qk_norm_rope" in rule["depends_on"]


def test_schedule_steps_hold_like_rules(ex):
    ex.hold("gemv_parts")  # merged_qkv then runs as its parts' launches
    assert ex.plan().census.get("gemm_parts", 0) == 0
    assert "gemv_parts" in ex.state()["held"]
    ch = [c for c in ex.choices("L0.q") if c["rule"] == "merged_qkv"]
    assert ch and all(c["support"] == "decompose" and "gemv_parts" in c["reason"] for c in ch)
    ex.release("gemv_parts")


def test_choices_have_one_chosen_costs_and_kinds(ex):
    ch = ex.choices("L0.q_rot")
    assert [c["index"] for c in ch] == list(range(len(ch))) and len(ch) >= 3
    assert sum(c["chosen"] for c in ch) == 1
    chosen = next(c for c in ch if c["chosen"])
    assert chosen["plan_cost_us"] == pytest.approx(ex.plan().cost_us, abs=1e-3)
    assert ch[0]["support"] == "lifted" and ch[0]["op"] == "rope" and ch[0]["rule"] is None
    for c in ch:
        if c["support"] == "held":  # (HELD's own alternative: listed, no cost)
            assert c["rule"] in HELD and c["cost_us"] is None
            continue
        assert c["cost_us"] > 0 and c["plan_cost_us"] >= chosen["plan_cost_us"] - 1e-6
        assert c["support"] in ("lifted", "native")
    # a tensor computed inside a fused op it does not write: none of its own alternatives is chosen, and `why` says so
    assert not any(c["chosen"] for c in ex.choices("L0.q_norm"))
    assert "computed inside" in ex.why("L0.q_norm")
    text = ex.why("L0.q_rot")
    assert f"#{chosen['index']}" in text and "the step would cost" in text


def test_refusals_and_decompositions_carry_their_reasons(step, tmp_path):
    lanes = tmp_path / "lanes"
    lanes.mkdir()
    (lanes / "strict.yaml").write_text(
        "lane: strict\nbase: cuda\nwhy: a lane that refuses merged products\nclasses:\n"
        "  merged_qkv:\n    support: refuse\n    reason: a GEMV in parts is not trusted on this chip\n")
    ex = Explorer(step, lane="strict", rules_dirs=(str(tmp_path),))
    ch = ex.choices("L0.q")
    refused = [c for c in ch if c["support"] == "refuse"]
    assert refused and all(c["reason"] == "a GEMV in parts is not trusted on this chip" for c in refused)
    assert all(c["cost_us"] is None and c["plan_cost_us"] is None and not c["chosen"] for c in refused)
    with pytest.raises(UserError, match="refuses a GEMV in parts"):
        ex.force("L0.q", refused[0]["index"])
    assert "refused by the strict lane: a GEMV in parts is not trusted" in ex.why("L0.q")
    cons = Explorer(step, lane="conservative")
    dec = [c for c in cons.choices("L0.q_rot") if c["support"] == "decompose"]
    assert dec and all("not trusted" in c["reason"] for c in dec)


def test_alternative_indices_survive_hold_and_release(ex):
    before = ex.choices("L0.q")
    ex.hold("merged_pair")
    held = ex.choices("L0.q")
    assert [(c["index"], c["op"], c["rule"]) for c in held] == [(c["index"], c["op"], c["rule"]) for c in before]
    gone = [c for c in held if c["rule"] == "merged_pair"]
    assert gone and all(c["support"] == "held" and "`merged_pair` is held" in c["reason"] for c in gone)
    with pytest.raises(UserError, match="release"):
        ex.force("L0.q", gone[0]["index"])
    ex.release("merged_pair")
    assert [c["support"] for c in ex.choices("L0.q")] == [c["support"] for c in before]


def test_a_force_a_later_hold_removes_stops_binding(ex):
    pair = next(c for c in ex.choices("L0.q") if c["rule"] == "merged_pair")
    ex.force("L0.q", pair["index"])
    assert launch_of(ex.plan(), "L0.q").rule == "merged_pair"
    ex.hold("merged_pair")
    assert ex.forced == {"L0.q": pair["index"]}
    assert any("does not bind" in w for w in ex.warnings)
    ex.release("merged_pair")
    assert launch_of(ex.plan(), "L0.q").rule == "merged_pair"


def test_knobs(ex):
    cost = ex.plan().cost_us
    ex.set_knob("launch_us", 4)
    assert ex.knobs.launch_us == 4.0 and ex.plan().cost_us > cost
    assert ex.state()["knobs"]["launch_us"] == 4.0
    with pytest.raises(UserError, match="did you mean `launch_us`"):
        ex.set_knob("lanch_us", 3)
    with pytest.raises(UserError, match="not a number"):
        ex.set_knob("sms", "many")


def test_user_errors_name_what_is_known(ex):
    with pytest.raises(UserError, match=r"did you mean `add_norm`.*known: .*rows_a_warp"):
        ex.hold("add_nrom")
    with pytest.raises(UserError, match="did you mean `L0.q"):
        ex.choices("L0.qq")
    with pytest.raises(UserError, match="step input or constant"):
        ex.choices("token")
    with pytest.raises(UserError, match="alternatives 0.."):
        ex.force("L0.q", 99)
    with pytest.raises(UserError, match="out of range"):
        ex.state(99)


def test_save_then_the_plan_file_replays_the_same_plan(ex, step, tmp_path):
    ex.hold("merged_pair")
    ex.hold("rows_a_warp")
    ex.force("L0.q_rot", next(c["index"] for c in ex.choices("L0.q_rot") if c["rule"] == "qk_norm_rope"))
    ex.set_knob("sms", 100)
    path = tmp_path / "plan.yaml"
    ex.save(str(path))
    spec = load_spec(str(path))
    assert spec["held"] == sorted(["merged_pair", "rows_a_warp", *HELD]) and spec["knobs"] == {"sms": 100}
    assert set(spec["forced"]) == {"L0.q_rot"}
    replay = plan(step, lane=spec["lane"], knobs=parse_knobs(spec["knobs"]), held=spec["held"],
                  forced=spec["forced"])
    assert summary(replay) == summary(ex.plan(exact=True))
    assert launch_of(replay, "L0.q_rot").rule == "qk_norm_rope"
    # and an explorer opened on the plan file starts where this one stands
    again = Explorer(step, knobs=spec["knobs"], held=spec["held"], forced=spec["forced"])
    assert again.forced == ex.forced and summary(again.plan()) == summary(replay)


def test_state_has_the_page_protocol(ex):
    st = ex.state(1)
    assert {"model", "layers", "layer", "graph", "groups", "rules", "census", "launches", "cost_us", "fusions",
            "arena", "forced", "knobs", "diff"} <= set(st)
    assert st["layer"] == 1 and st["layers"] == 4
    ids = {n["id"] for n in st["graph"]["nodes"]}
    assert ids and all(i.startswith("L1.") for i in ids)
    for n in st["graph"]["nodes"]:  # every tensor of the layer sits in one launch's group
        g = st["groups"][n["group"]]
        assert g["id"] == n["group"] and n["id"] in g["tensors"]
    assert all(b in ids for _, b in st["graph"]["edges"])
    assert sum(1 for g in st["groups"] if len(g["tensors"]) > 1) >= 3
    a = st["arena"]
    assert a["bytes"] == ex.plan().arena.bytes and a["launches"] == len(st["groups"])
    assert a["arrays"] and all(0 <= r["first"] <= r["last"] < a["launches"] for r in a["arrays"])
    assert st["launches"] == ex.plan().n_launches and st["census"] == ex.plan().census
    # the embedding goes with layer 0, the head with the last layer
    assert "x0" in {n["id"] for n in ex.state(0)["graph"]["nodes"]}
    assert "next" in {n["id"] for n in ex.state(3)["graph"]["nodes"]}
    json.dumps(ex.state(), allow_nan=False)
    json.dumps(ex.choices("L0.q"), allow_nan=False)


def test_what_if_timings(step):
    t0 = time.perf_counter()
    ex = Explorer(step, model_name="demo", held=HELD)
    first = (time.perf_counter() - t0) * 1e3
    times = {}
    for name, act in [("hold attn_o_glu_down_norm", lambda: ex.hold("attn_o_glu_down_norm")),
                      ("hold merged_qkv", lambda: ex.hold("merged_qkv")),
                      ("force L0.q #0", lambda: ex.force("L0.q", 0)),
                      ("knob launch_us=3", lambda: ex.set_knob("launch_us", 3)),
                      ("unforce L0.q", lambda: ex.unforce("L0.q")),
                      ("choices L0.q_rot", lambda: ex.choices("L0.q_rot")),
                      ("release merged_qkv (cached)", lambda: ex.release("merged_qkv"))]:
        t0 = time.perf_counter()
        act()
        times[name] = (time.perf_counter() - t0) * 1e3
    print(f"\nexplorer on the demo model: open + exact plan {first:.0f} ms; what-ifs ({ex.what_if} search):")
    for k, v in times.items():
        print(f"  {k:<30} {v:7.1f} ms")


def test_schedule_steps_fired_come_from_the_lane_table(ex):
    lane_steps = list(ex.lane.schedule)

    def fired():
        return {r["name"]: r["fired"] for r in ex.state()["rules"] if r["cls"] == "lane step"}

    assert list(fired()) == lane_steps  # the lane table's `schedule:` is the one list of steps, in its order
    gated = [s for s in lane_steps if ex.lane.gated.get(s)]
    assert gated and all(fired()[s] > 0 for s in gated)  # merged products run whole: the step shaped them
    ex.hold(gated[0])
    assert fired()[gated[0]] == 0
    ex.release(gated[0])
    before = fired()["rows_a_warp"]
    ex.set_knob("wide_rows", 1)  # every product is now wide: four rows a warp shapes each one
    assert fired()["rows_a_warp"] > before
    ex.hold("rows_a_warp")
    assert fired()["rows_a_warp"] == 0


# ---- the engine's public API, as the explorer reads it ---------------------------------------------------------------

def test_session_alternatives_signatures_and_chosen(step):
    from lanefuse.engine.optimize import Session
    from lanefuse.engine.rules import load_table

    s = Session(step, load_table(()))
    free, held = s.alternatives("L0.q"), s.alternatives("L0.q", {"merged_pair"})
    assert [a.index for a in free] == list(range(len(free))) and all(a.cost is None for a in free)
    assert free[0].kind == "lifted" and free[0].op.kind == "matmul" and free[0].cls is None
    outputs = [a for a in free if a.kind == "output"]
    assert outputs and all(a.op.fused and a.bundle and a.output is not None and "L0.q" in a.op.outs for a in outputs)
    # a signature names the same alternative under every held set; the held rule's alternatives are gone
    assert {a.signature for a in held} < {a.signature for a in free}
    assert {a.rule for a in free} - {a.rule for a in held} == {"merged_pair"}
    assert [a.signature for a in s.alternatives("L0.q")] == [a.signature for a in free]  # stable
    # `choices` is `alternatives` with their costs
    assert [a.signature for a in s.choices("L0.q")] == [a.signature for a in free]
    assert all(a.cost is not None for a in s.choices("L0.q"))
    # the plan says which alternative each tensor got, in the same numbering: a force binds
    opt = s.plan(forced={"L0.q": 0})
    assert opt.chosen["L0.q"] == 0
    pair = next(a.index for a in free if a.rule == "merged_pair")
    assert s.plan(forced={"L0.q": pair}).chosen["L0.q"] == pair
    top = s.plan(held=frozenset(HELD))  # (unheld, L0.q_rot is computed inside the five-phase chain)
    q_rot = s.alternatives("L0.q_rot")
    assert q_rot[top.chosen["L0.q_rot"]].kind in ("lifted", "fused", "output")
    assert "L0.q_norm" not in top.chosen  # computed inside a fused op that does not write it
    with pytest.raises(UserError, match="did you mean `L0.q"):
        s.alternatives("L0.qq")


def _explore_modules():
    import lanefuse.lane.explore as pkg

    return sorted(Path(pkg.__file__).parent.glob("*.py"))


def test_the_explorer_reads_no_private_engine_attribute():
    """lane/explore/ reads only public attributes of what it did not define: an attribute starting with `_` only on
    `self`, `cls` or a name the module defines itself (dunders such as `super().__init__` are Python's, not the
    engine's)."""
    import ast

    bad = []
    for f in _explore_modules():
        tree = ast.parse(f.read_text(encoding="utf-8"))
        own = {"self", "cls"}
        for n in tree.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(n.name)
            elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                own.update(t.id for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                           if isinstance(t, ast.Name))
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                own.update(a.asname or a.name.split(".")[0] for a in n.names if (a.asname or a.name).startswith("_"))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
                continue
            if node.attr.startswith("__") and node.attr.endswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in own:
                continue
            bad.append(f"{f.name}:{node.lineno}: {ast.unparse(node)}")
    assert bad == [], "private attributes read in lane/explore/:\n" + "\n".join(bad)


def test_the_explorer_names_no_fused_class():
    """Which class a held schedule step runs as parts, or how a class links, is the lane table's to say: no fused
    class of classes.yaml is spelled in a string of lane/explore/*.py."""
    import ast

    from lanefuse.engine.rules import load_classes, rule_dirs

    classes = sorted(load_classes(rule_dirs()))
    assert "merged_qkv" in classes
    word = re.compile(r"(?<!\w)(" + "|".join(map(re.escape, classes)) + r")(?!\w)")
    bad = []
    for f in _explore_modules():
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                bad += [f"{f.name}:{node.lineno}: `{m}`" for m in word.findall(node.value)]
    assert bad == [], "fused class names in lane/explore/:\n" + "\n".join(bad)


# ---- the terminal explorer -----------------------------------------------------------------------------------------

SCRIPT = """\
# a scripted session
help
rules
choices L0.q_rot
why L0.q_rot
hold attn_o_glu_down_norm
hold add_nrom
fired
force L0.q 0
layer 0
diff
unforce L0.q
release attn_o_glu_down_norm
knob launch_us 3
plan
save {path}
frobnicate
"""


def test_terminal_explorer_scripted_in_process(tmp_path):
    args = build_parser().parse_args(["explore", "--hold", HELD[0]])
    out = io.StringIO()
    path = tmp_path / "s.yaml"
    rc = explore_command(args, stdin=io.StringIO(SCRIPT.format(path=path)), stdout=out)
    text = out.getvalue()
    assert rc == 1  # a command failed (two, on purpose), the loop went on to EOF
    assert "lanefuse> " not in text  # no prompt noise when scripted
    assert "choices [TENSOR]" in text and "save FILE" in text and "undo" in text  # help
    assert "rules/norm.yaml:11" in text and "blocked by" not in text  # rules
    assert "L0.q_rot: 10 alternatives" in text and "●" in text  # choices (HELD's among them)
    assert "the step would cost" in text  # why
    # each layer's attention apart before its three-phase chain (o_glu_down_norm)
    assert re.search(r"hold attn_o_glu_down_norm: launches 10 → 14 \(\+4\)", text)
    assert "fusions: attn_o_glu_down_norm 4→0  o_glu_down_norm 0→4" in text
    assert "error: no rule or schedule step `add_nrom` (did you mean `add_norm`?)" in text
    assert "fusions fired" in text and "launch census" in text
    assert "force L0.q #0: launches" in text
    assert "layer 0:" in text and "merged_qkv" in text
    assert re.search(r"release attn_o_glu_down_norm: launches \d+ → 10", text)
    assert "knob launch_us=3.0" in text
    assert "plan (local search" in text
    assert f"saved {path}" in text and load_spec(str(path))["knobs"] == {"launch_us": 3.0}
    assert "error: unknown command `frobnicate`" in text
    assert "Traceback" not in text


def test_terminal_explorer_as_a_subprocess(tmp_path):
    env = dict(os.environ, COLUMNS="200")
    r = subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", "explore", "--hold", HELD[0], "--hold", "merged_qkv"],
                       input="plan\nhold add_nrom\nrelease merged_qkv\nquit\nplan\n", capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 1, r.stderr
    assert "held:    merged_qkv" in r.stdout
    # each layer's attention, o fold and MLP one chained launch (attn_o_glu_down_norm)
    assert "release merged_qkv: launches 18 → 10" in r.stdout
    assert r.stdout.count("plan (") == 1  # `quit` ended it before the second plan
    errs = [l for l in r.stderr.splitlines() if l.strip()]
    assert errs == ["error: no rule or schedule step `add_nrom` (did you mean `add_norm`?); known: "
                    + errs[0].split("known: ")[1]]
    r = subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", "explore", "--hold", "nope"], input="",
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "nope" in r.stderr


# ---- the web server and page over the real Explorer ----------------------------------------------------------------

@pytest.fixture
def served(ex):
    from lanefuse.lane.explore.server import serve

    server, url = serve(ex)
    yield ex, url
    server.stop()


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def test_web_api_over_the_real_explorer(served):
    ex, url = served
    status, st = get(url + "api/state")
    assert status == 200 and st["model"] == "demo" and st["layer"] == 0 and st["diff"] is None
    status, st2 = post(url + "api/hold", {"rule": "attn_o_glu_down_norm", "layer": 2})
    assert status == 200 and st2["layer"] == 2
    assert st2["diff"]["launches"] == [st["launches"], st2["launches"]] and st2["launches"] > st["launches"]
    assert "attn_o_glu_down_norm" in st2["held"]
    status, ch = get(url + "api/choices?tensor=L2.q_rot")
    assert status == 200 and sum(c["chosen"] for c in ch) == 1
    status, st3 = post(url + "api/force", {"tensor": "L2.q_rot", "index": 0})
    assert status == 200 and st3["forced"] == {"L2.q_rot": 0}
    status, err = post(url + "api/hold", {"rule": "add_nrom"})
    assert status == 400 and "did you mean `add_norm`" in err["error"]
    status, st4 = post(url + "api/release", {"rule": "attn_o_glu_down_norm"})
    assert status == 200 and "attn_o_glu_down_norm" not in st4["held"]


@pytest.mark.browser
def test_page_over_the_real_explorer(served, tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is missing")
    ex, url = served
    shots = Path(flags.read("LANEFUSE_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            log: list[str] = []
            page.on("console", lambda m: log.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: log.append(f"pageerror: {e}"))
            page.goto(url)
            page.wait_for_selector(".node[data-tensor='L0.attn_norm']")
            page.locator("#fold-auto").uncheck()  # every op drawn: these tests click inner ops (folds have their own test)
            assert page.locator("#graph .node:not(.input)").count() == len(ex.state(0)["graph"]["nodes"])
            assert page.locator("#graph .gbox").count() >= 3
            assert page.locator("#arena .arr").count() > 0
            chains = ex.plan().census["chain"]
            assert page.locator("#census [data-count='chain']").inner_text() == str(chains)
            assert page.locator("#census [data-count='attention']").count() == 0  # each in its layer's chain
            page.locator("[data-rule-row='attn_o_glu_down_norm'] .switch").click()
            page.wait_for_selector("#census [data-count='attention']:text-is('4')")  # a launch of its own again
            assert "attn_o_glu_down_norm" in ex.held
            assert "hold attn_o_glu_down_norm" in page.locator("#diff").inner_text()
            page.locator(".node[data-tensor='L0.q_rot']").click()
            page.wait_for_selector("#choices tr[data-choice]")
            assert page.locator("#choices tr[data-choice]").count() == len(ex.choices("L0.q_rot"))
            page.locator("#choices button[data-force='0']").click()
            page.wait_for_selector("#forced-badge")
            assert ex.forced == {"L0.q_rot": 0}
            page.screenshot(path=str(shots / "explore-real.png"))
            page.locator("#undo").click()
            page.wait_for_selector("#forced [data-forced='L0.q_rot']", state="detached")
            assert ex.forced == {}
            page.select_option("#layer", "3")
            page.wait_for_selector(".node[data-tensor='next']")
            page.screenshot(path=str(shots / "explore-real-last-layer.png"))
            assert log == [], f"the page logged: {log}"
        finally:
            browser.close()


def test_the_shell_and_plan_agree_on_a_launchs_layer():
    """`layer N` in the shell lists every launch touching layer N's tensors, each with the layer `lanefuse plan`
    files it under: the down product fused with the next layer's norm shows layer 1 in layer 0's table."""
    args = build_parser().parse_args(["explore", "--hold", HELD[0]])
    out = io.StringIO()
    rc = explore_command(args, stdin=io.StringIO("layer 0\nquit\n"), stdout=out)
    assert rc == 0, out.getvalue()
    cfg, _ = demo_model()
    s = plan(build_step(cfg, 1), held=list(HELD))
    down = next(x for x in s.launches if "L0.down" in x.ops)
    text = out.getvalue()
    assert down.layer == 1 and "filed under layer 0" in text
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if "L0.down" in line)
    # the row's first line (a chained launch's ops wrap over several: its index and layer are on the first)
    row = next(lines[i] for i in range(at, -1, -1) if re.match(r"\s*│\s*\d", lines[i]))
    assert re.search(rf"\b{s.launches.index(down)}\b.*\b1\b", row), row


def test_a_held_step_holds_the_same_in_the_explorer_as_on_the_command_line():
    """Issue 39 item 5: `fuse_quant` (a schedule step over the quantize op) held in the explorer holds the rules that
    quantize in a producer's epilogue, as `plan --hold fuse_quant` does: the same launches; the explorer lists the step
    as held (not the rules it brings), and releasing it gives back the plan of nothing held."""
    from test_quant import q8_model

    from lanefuse.lane.lower.plan import plan

    cfg, _ = q8_model("q8_0")
    g = build_step(cfg, 1)
    free, cli = plan(g, numerics="q8"), plan(g, numerics="q8", held=("fuse_quant",))
    assert cli.census.get("quant", 0) > free.census.get("quant", 0)  # the held step changes the plan: this can fail
    ex = Explorer(g, numerics="q8")
    try:
        assert ex.plan().census == free.census
        ex.hold("fuse_quant")
        assert ex.held == ["fuse_quant"]
        assert ex.plan().census == cli.census and ex.plan().fusions == cli.fusions
        ex.release("fuse_quant")
        assert ex.held == [] and ex.plan().census == free.census and ex.plan().fusions == free.fusions
        opened = Explorer(g, numerics="q8", held=("fuse_quant",))  # held from the start, as a plan file holds it
        try:
            assert opened.held == ["fuse_quant"] and opened.plan().census == cli.census
        finally:
            opened.close()
    finally:
        ex.close()


def test_every_hold_the_command_line_accepts_holds_the_same_in_the_explorer():
    """Issue 39 item 5: the explorer plans a what-if by the command line's path (`plan(..., session=...)` under a
    PlanOptions), so each name `--hold` accepts — every schedule step of the lane and the rules a step holds with it —
    gives the explorer (exact what-ifs) the launches `plan --hold NAME` gives, and its release the plan of nothing
    held. On the demo in q8_0 under q8 numerics, where fuse_quant holds the quantize rules too."""
    from test_quant import q8_model

    from lanefuse.lane.lower.plan import plan

    cfg, _ = q8_model("q8_0")
    g = build_step(cfg, 1)
    ex = Explorer(g, numerics="q8", what_if="ilp")
    try:
        free = plan(g, numerics="q8")
        names = sorted(ex.steps) + ["add_norm", "gemv_gate_up_glu"]
        changed = 0
        for name in names:
            cli = plan(g, numerics="q8", held=(name,))
            ex.hold(name)
            got = ex.plan()
            assert [repr(x.launch) for x in got.launches] == [repr(x.launch) for x in cli.launches], name
            assert got.census == cli.census and got.fusions == cli.fusions, name
            changed += cli.census != free.census
            ex.release(name)
            assert ex.plan().census == free.census, name
        assert changed >= 2  # the holds change the plan: the comparison can fail
    finally:
        ex.close()
