"""A saved plan is checked before it runs (lane/lower/plancheck.py): a table of tampered plans, each refused through the
command with one line naming the file and the first bad field (rc 2, no internal error); every good plan still loads
and runs with the same tokens; `run --plan` refuses the flags the plan fixes."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    r = _cli("plan", "--save", str(d / "plan.json"))
    assert r.returncode == 0, r.stderr
    return d / "plan.json"


def _records(x):
    if isinstance(x, dict):
        yield x
        for v in x.values():
            yield from _records(v)
    elif isinstance(x, list):
        for v in x:
            yield from _records(v)


def _first(p, kind):
    return next(r for r in _records(p["launches"]) if r.get("_t") == kind)


def _array(p, name):
    return next(a for a in p["arena"]["arrays"] if a["name"] == name)


def _overlap(p):  # two live arrays at one offset: L0.attn_norm and x0 live together
    _array(p, "x0")["offset"] = _array(p, "L0.attn_norm")["offset"]


def _halve_cols(p):
    n = _first(p, "Norm")
    n["cols"] //= 2


def _far(p):
    _array(p, "x0")["offset"] = 256 * 4_000_000


def _bigger_n(p):
    _first(p, "ArgMax")["n"] *= 2


def _misaligned(p):
    _array(p, "x0")["offset"] += 4


def _kind(p):
    p["launches"][1]["launch"]["_t"] = "Frobnicate"


def _string(p):
    _first(p, "Attention")["rows"] = "1"


def _bool(p):
    _first(p, "Attention")["rows"] = True


def _missing(p):
    del _first(p, "Attention")["hd"]


def _unknown_field(p):
    _first(p, "Attention")["hdd"] = 32


def _past_home(p):
    p["buffers"]["L0.kc"]["offset"] = 64


def _no_home(p):
    p["buffers"]["L0.kc"]["home"] = "kc9"


def _shrunk_lifetime(p):
    a = _array(p, "x0")
    a["last"] = a["first"]


def _format_lie(p):
    glu = _first(p, "GemvGlu")
    glu["format"] = glu["format_u"] = "bf16"  # both weights said to be bf16 rows: the checkpoint's are f32


def _writes_nothing_known(p):
    _first(p, "Attention")["out"] = "L0.atn"


def _nan(p):
    _first(p, "Norm")["eps"] = float("nan")


def _huge_arena(p):
    p["arena"]["bytes"] = 10 ** 15


def _refused(p):
    _first(p, "Attention")["group"] = 3


def _weight_as_array(p):  # (its q: the chain refuses a query its q/k/v phase does not write first)
    _first(p, "Attention")["vc"] = "model.layers.0.input_layernorm.weight"


def _big_cache_row(p):
    _first(p, "Attention")["koff"] = 64


def _lower_bound(p):
    p["arena"]["lower_bound"] = p["arena"]["bytes"] + 1


def _shape_string(p):
    p["tensors"]["x0"]["shape"] = ["1", 256]


def _wrong_constant_shape(p):  # a constant bigger than the launches reach: only the checkpoint says it is wrong
    p["constants"]["model.norm.weight"]["shape"] = [512]


def _halve_k(p):  # the head's product over half of its input: other tokens, exit 0, before the checks
    g = _first(p, "Gemv")
    g["k"] //= 2


TAMPERED = [
    ("two live arrays at one offset", _overlap, "arena.arrays[", "overlap `L0.attn_norm`"),
    ("a norm's cols halved", _halve_cols, "launches[0] (fold).then.x", "128 values read but `x0` holds 256"),
    ("a far offset", _far, "(x0).offset", "past the arena's"),
    ("a bigger n", _bigger_n, "(fold).then.x", "1024 values of `logits` reached but it holds 512"),
    ("a misaligned offset", _misaligned, "(x0).offset", "not a multiple of 256"),
    ("an unknown launch kind", _kind, "launches[1]", "`Frobnicate` this lanefuse does not know"),
    ("a string where an int goes", _string, "launches[1] (chain).phases[1] (attention).rows",
     "expected an integer, got '1'"),
    ("a bool where an int goes", _bool, "launches[1] (chain).phases[1] (attention).rows",
     "expected an integer, got True"),
    ("a missing field", _missing, "launches[1] (chain).phases[1] (attention)", "has no `hd`"),
    ("an unknown field", _unknown_field, "launches[1] (chain).phases[1] (attention).hdd",
     "has no field `hdd` (did you mean `hd`?)"),
    ("a buffer past its home", _past_home, "buffers['L0.kc'].offset", "past `kc0`'s 16384"),
    ("a buffer with no home", _no_home, "buffers['L0.kc'].home", "`kc9` is not a buffer"),
    ("a lifetime shorter than its launches", _shrunk_lifetime, "(x0).last", "launches 0..1 use it"),
    # the GLU of layer 0's chained launch (qkv_attn_o_glu_down_norm: launches[1], the q/k/v fold its phases[0])
    ("a weight's format misstated", _format_lie, "launches[1] (chain)", "as bf16 values but the plan holds it as f32"),
    ("a result into no tensor", _writes_nothing_known, "launches[1] (chain)",
     "not the attention's output `L0.atn`"),
    ("a NaN eps", _nan, ".eps", "expected a finite number"),
    ("an arena of a petabyte", _huge_arena, "arena.bytes", "more than all its arrays side by side"),
    ("a launch its kernel refuses", _refused, "launches[1] (chain)", "refused: query heads that do not group"),
    ("a weight where an array goes", _weight_as_array, "launches[1] (chain)", "which is a constant"),
    ("a key offset past the cache row", _big_cache_row, "launches[1] (chain).phases[1].kc",
     "reached but it holds 16384"),
    ("a lower bound past the arena", _lower_bound, "arena.lower_bound", "for an arena of"),
    # the o product: the third phase of layer 0's chained launch (qkv_attn_o_glu_down_norm)
    ("a product's k halved", _halve_k, "launches[1] (chain)",
     "reads `L0.attn` (1x128), not the attention's output `L0.attn` (1x256)"),
    ("a string in a shape", _shape_string, "tensors['x0'].shape[0]", "expected an integer"),
    ("a constant shaped otherwise than the weights", _wrong_constant_shape, "constants['model.norm.weight']",
     "edited after the plan was saved"),  # its digest: before the checkpoint's shape is read
]


def _refusal(path: Path, *args):
    r = _cli("run", "--plan", str(path), "--tokens", "1", *args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()  # notices (`lanefuse: KV cache: ...`) may come first; one error line, the last
    assert [x for x in lines if "error" in x] == lines[-1:], r.stderr
    assert lines[-1].startswith(f"lanefuse: error: {path}"), r.stderr
    return lines[-1]


@pytest.mark.parametrize("what,tamper,where,message", TAMPERED, ids=[t[0] for t in TAMPERED])
def test_a_tampered_plan_is_refused_naming_the_field(saved, tmp_path, what, tamper, where, message):
    doc = json.loads(saved.read_text())
    tamper(doc["plan"])
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(doc))
    err = _refusal(bad)
    assert where in err and message in err, err


BAD_FILES = [
    ("wrong format version", lambda t: t.replace('"lanefuse-plan/2"', '"lanefuse-plan/1"'),
     "format: 'lanefuse-plan/1', but this lanefuse reads 'lanefuse-plan/2'"),
    ("truncated JSON", lambda t: t[: len(t) // 2], "not a lanefuse plan (bad JSON"),
    ("not a plan record", lambda t: json.dumps({"format": "lanefuse-plan/2", "plan": [1, 2]}),
     "expected a Plan record, got [1, 2]"),
    ("an extra top-level key", lambda t: t.replace('{"format"', '{"extra": 1, "format"', 1),
     "extra: not a field of a lanefuse plan"),
    ("nested too deep", lambda t: '{"format": "lanefuse-plan/2", "plan": ' + "[" * 100000 + "]" * 100000 + "}",
     "not a lanefuse plan"),
]


@pytest.mark.parametrize("what,change,message", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_a_bad_plan_file_is_refused(saved, tmp_path, what, change, message):
    bad = tmp_path / "plan.json"
    bad.write_text(change(saved.read_text()))
    err = _refusal(bad)
    assert message in err, err


@pytest.mark.parametrize("flags", [("--hold", "add_norm"), ("--hold", "no_such_rule"), ("--rules", "/tmp"),
                                   ("--spec", "x.yaml"), ("--knob", "sms=8"), ("--lane", "cuda"),
                                   ("--numerics", "f32")], ids=lambda f: f[0])
def test_run_plan_refuses_the_flags_the_plan_fixes(saved, flags):
    r = _cli("run", "--plan", str(saved), "--tokens", "1", *flags)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"the saved plan fixes {flags[0]}" in r.stderr and "internal error" not in r.stderr


def test_the_saved_plan_runs_with_the_tokens_of_a_fresh_plan(saved, tmp_path):
    a = _cli("run", "--plan", str(saved), "--prompt-ids", "1,2,3", "--tokens", "5", "--json", str(tmp_path / "a.json"))
    assert a.returncode == 0, a.stderr
    b = _cli("run", "--prompt-ids", "1,2,3", "--tokens", "5", "--json", str(tmp_path / "b.json"))
    assert b.returncode == 0, b.stderr
    ga = json.loads((tmp_path / "a.json").read_text())["generated_ids"]
    assert ga == json.loads((tmp_path / "b.json").read_text())["generated_ids"] and len(ga) == 5


def test_every_plan_the_gpu_suite_prepares_loads_and_the_runnable_ones_run(tmp_path):
    """`bench/gpu_suite.sh prepare` plans (demo decode and prefill, the 36-layer shape, a tiny HF checkpoint's):
    each loads through the checks, and the decode plans with weights run to the tokens of a fresh plan."""
    pytest.importorskip("egglog")
    from lanefuse.lane.lower.planfile import load

    out = tmp_path / "plans"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_prepare.py"), str(out)], capture_output=True,
                       text=True, timeout=600, cwd=ROOT / "bench")
    assert r.returncode == 0, r.stderr
    plans = sorted(out.glob("*.json"))
    assert len(plans) >= 4, plans
    for f in plans:
        assert load(str(f)).launches
    for name, model in (("demo-decode.json", None), ("tiny-hf-decode.json", "tiny-hf")):
        args = [model] if model else []
        a = _cli("run", *args, "--plan", name, "--tokens", "3", "--json", "a.json", cwd=out)
        assert a.returncode == 0, a.stderr
        b = _cli("run", *args, "--tokens", "3", "--json", "b.json", cwd=out)
        assert b.returncode == 0, b.stderr
        assert (json.loads((out / "a.json").read_text())["generated_ids"]
                == json.loads((out / "b.json").read_text())["generated_ids"])


def _round_trip(p):
    from lanefuse.lane.lower.plan import Plan
    from lanefuse.lane.lower.planfile import _classes, encode
    from lanefuse.lane.lower.plancheck import Decoder, check

    q = Decoder(_classes()).record(json.loads(json.dumps(encode(p))), Plan, "")
    check(q)
    return q


def test_the_plans_the_lane_makes_pass_the_checks():
    """Plans of every test architecture, decode and prefill, held rules and steps, the conservative lane: saved and
    read back, each passes every check (the checks refuse nothing the lane makes) and comes back equal."""
    pytest.importorskip("egglog")
    from test_lane import ARCHS

    from lanefuse.engine.front.demo import demo_model
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan

    cfg, _ = demo_model()
    cases = [(cfg, rows, {}) for rows in (1, 8)]
    cases += [(cfg, 1, {"held": ["add_norm", "split_k"]}), (cfg, 4, {"lane": "conservative"})]
    cases += [(c, rows, {}) for name, c in sorted(ARCHS.items()) if name != "qwen3" for rows in (1, 4)]
    for c, rows, kw in cases:
        p = plan(build_step(c, rows), **kw)
        q = _round_trip(p)
        assert [x.launch for x in q.launches] == [x.launch for x in p.launches]
        assert tuple(q.arena.arrays) == tuple(p.arena.arrays) and q.arena.bytes == p.arena.bytes


def test_a_gate_and_up_of_two_formats_is_not_one_gemv_glu():
    """A gate and an up product of two formats (f32, bf16: the tiny qwen3 model's) are not linked as one gemv_glu (its
    kernel reads both in one format: the bf16 up rows would be read as f32); the plan runs them apart and saves and
    loads clean; a gemv_glu stating two formats is refused in words."""
    pytest.importorskip("egglog")
    import dataclasses

    from test_lane import ARCHS

    from lanefuse.engine.front.model import build_step
    from lanefuse.kernels import GemvGlu
    from lanefuse.lane.lower.plan import plan

    # the GLU apart
    p = plan(build_step(ARCHS["qwen3"], 1), held=["qkv_attn_o_glu_down_norm", "attn_o_glu_down_norm", "o_glu_down_norm",
                                                  "glu_down_norm"])
    glu_layers = {x.layer for x in p.launches if isinstance(x.launch, GemvGlu)}
    assert 0 not in glu_layers and 1 in glu_layers  # layer 0's up rows are bf16, its gate's f32: apart
    _round_trip(p)
    demo = plan(build_step(ARCHS["llama"], 1), held=["o_glu_down_norm", "glu_down_norm"])
    (g, *_) = [x.launch for x in demo.launches if isinstance(x.launch, GemvGlu)] or [None]
    if g is not None:
        why = dataclasses.replace(g, format_u="bf16" if g.format != "bf16" else "f32").check()
        assert why is not None and "different formats" in why.reason


def test_random_edits_of_a_plan_load_or_are_refused_in_words(saved, tmp_path):
    """600 random one-field edits of a saved plan (a number halved, doubled, moved; a value of another type): each
    loads or is a UserError, never another exception; and those that load still pass the arena's invariants."""
    import random

    from lanefuse.engine.errors import UserError
    from lanefuse.lane.lower.arena import check as arena_check
    from lanefuse.lane.lower.planfile import load

    doc = json.loads(saved.read_text())
    rng = random.Random(7)
    values = [0, -1, 1, 3, 10 ** 9, 255, "x", "pos", "x0", None, True, [], {}, 1.5]
    f = tmp_path / "plan.json"
    refused = 0
    for _ in range(600):
        d = copy.deepcopy(doc)
        r = rng.choice(list(_records(d["plan"])))
        keys = [k for k in r if k != "_t"]
        if not keys:
            continue
        k = rng.choice(keys)
        v = r[k]
        r[k] = rng.choice([v // 2, v * 2, v + 1, v - 1, v + 256]) if type(v) is int and rng.random() < .6 \
            else rng.choice(values)
        f.write_text(json.dumps(d))
        try:
            arena_check(load(str(f)).arena)
        except UserError:
            refused += 1
    assert refused > 300
