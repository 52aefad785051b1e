"""Messages stay a line or two whatever the input's size (issue 36): a 60,000-character rule name, a `--hold` typo, a
plan no lane can run over a batch, the explorer's and the web's echoes of a name or a spec, each clipped
(engine/errors.py `clip`, `listed`); the web's compare reads a `held` string as the names it lists, not its letters;
the rules of many folders together are held to a total of queries, named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lanefuse.engine.front.demo import demo_model
from lanefuse.engine.errors import UserError, listed
from lanefuse.engine.front.model import build_step
from lanefuse.engine.rules import MAX_NAME, MAX_TABLE_QUERIES, load_table

HUGE = "x" * 60_000


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def _last(r) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-600:])
    last = r.stderr.splitlines()[-1]
    assert last.startswith("lanefuse: error: ") and "Traceback" not in r.stderr, r.stderr[-600:]
    return last


def chain(n: int, name: str = "mine.chain") -> str:
    """A rule of n chained adds then a norm: 2^n queries (each add's two orders)."""
    adds = "".join(f"    s{i}: add(s{i - 1}, b{i})\n" for i in range(1, n))
    return (f"- name: {name}\n  class: add_norm\n  match:\n    s0: add(a, b0)\n" + adds
            + f"    y: rmsnorm(s{n - 1}, w)\n")


def test_a_huge_rule_name_is_refused_clipped(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    (d / "mine.yaml").write_text(chain(1, HUGE))
    with pytest.raises(UserError, match=rf"`name:` x+\.\.\. \(60000 characters\): a rule's name is a stable key of at "
                                        rf"most {MAX_NAME}") as e:
        load_table([d])
    assert len(str(e.value)) < 300
    last = _last(_cli("check", "demo", "--rules", d))
    assert len(last) < 300 and "60000 characters" in last


def test_the_rules_of_many_folders_are_held_to_a_total(tmp_path):
    """Each folder's rule at the per-rule cap (2^8 queries): loaded one at a time each is fine, nine together pass
    the table's total and are refused, naming the rule that passes it and the bound."""
    dirs = []
    for i in range(9):
        d = tmp_path / f"r{i}"
        d.mkdir()
        (d / "mine.yaml").write_text(chain(8, f"mine.chain{i}"))
        dirs.append(d)
    load_table(dirs[:1], contracts=False)  # (the chain binds no `b`: its contract is not the point here)
    with pytest.raises(UserError, match=rf"mine.yaml:1 \(rule `mine.chain\d`\): the table's rules expand to \d+ "
                                        rf"queries with this one \(at most {MAX_TABLE_QUERIES} in all"):
        load_table(dirs)


def test_a_hold_typo_lists_a_few_names():
    last = _last(_cli("plan", "demo", "--hold", "gemv_norm_epilog"))
    assert "did you mean `gemv_norm_epilogue`" in last and "in all)" in last and len(last) < 600, last
    last = _last(_cli("plan", "demo", "--hold", HUGE))
    assert "(60000 characters)" in last and len(last) < 600, last


def test_listed():
    assert listed(["a", "b"]) == "a, b"
    assert listed(map(str, range(20)), 3) == "0, 1, 2, ... (20 in all)"


@pytest.fixture(scope="module")
def ex():
    from lanefuse.lane.explore.explorer import Explorer

    cfg, _ = demo_model()
    return Explorer(build_step(cfg, 1), model_name="demo")


def test_the_explorer_clips_what_it_echoes(ex):
    for call in (lambda: ex.hold(HUGE), lambda: ex.choices(HUGE), lambda: ex.compare({"held": [HUGE]}),
                 lambda: ex.compare({HUGE: 1}), lambda: ex.compare({"numerics": HUGE})):
        with pytest.raises(UserError) as e:
            call()
        assert len(str(e.value)) < 700 and "60000 characters" in str(e.value), str(e.value)[:300]


def test_compare_reads_a_held_string_as_names(ex):
    as_list = ex.compare({"held": ["add_norm", "merged_qkv"]})
    as_text = ex.compare({"held": "add_norm, merged_qkv"})
    assert json.dumps(as_list, sort_keys=True, default=str) == json.dumps(as_text, sort_keys=True, default=str)
    with pytest.raises(UserError, match=r"no rule or schedule step `a`"):  # before: the letters of "add_norm"
        ex.compare({"held": "a"})
    for bad in (3, {"add_norm": 1}, ["add_norm", 3]):
        with pytest.raises(UserError, match=r"`held` is a list of rule or step names"):
            ex.compare({"held": bad})
    with pytest.raises(UserError, match=r"`forced` is a mapping"):
        ex.compare({"forced": ["L0.q"]})


def test_no_runnable_plan_is_one_short_line(tmp_path):
    """A Qwen3 config whose heads are wider than any attention launch takes (1024 values), over a batch: every layer's
    attention refuses; said once, the other layers counted, a non-zero exit. (Until issue 40 a Qwen3-Next batch was
    this case; every family now runs a batch.)"""
    d = tmp_path / "wide"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 1024,
        "vocab_size": 320, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "torch_dtype": "float32", "tie_word_embeddings": False}))
    last = _last(_cli("plan", d, "--batch", "2"))
    assert "no runnable plan" in last and "a head wider than" in last, last
    # two a layer over 6 layers: the attention's tensors and the five-phase chain's bundle (qkv_attn_o_glu_down_norm)
    assert "(and 11 more tensor(s) with every way refused)" in last, last
    assert len(last) < 900, len(last)


def test_one_line_is_the_last_guard():
    from lanefuse.engine.errors import one_line

    assert one_line("line one\nline two") == "line one line two"
    cut = one_line("unknown `" + HUGE + "`; known: a, b")
    assert len(cut) < 350 and "(60003 characters)" in cut and cut.endswith("known: a, b")
    hub = "/home/me/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/" + "0" * 40 + "/model-00001-of-00005.safetensors:"
    assert one_line(f"{hub} truncated") == f"{hub} truncated"  # a real path is never cut
    assert len(one_line(" ".join(["word"] * 5000))) <= 2000


@pytest.mark.parametrize("flag", ["--knob {X}=1", "--knob sms={X}", "--lane {X}", "--numerics {X}",
                                  "--weights-format {X}", "--device {X}"])
def test_a_huge_flag_value_is_echoed_clipped(flag):
    r = _cli("plan", "demo", *flag.format(X=HUGE).split(" "))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "error: " in last and len(last) < 600 and "characters)" in last, last[:300]
