"""`lanefuse plan` as a user of git, llama.cpp and TORCH_LOGS reads it (issue 37): a concise summary by default (the
rules that matched, the rest in one line; `--all` every table), why a rule that matched was not chosen in its note
(the cost difference against what the plan took), rule names whole, and a reader that goes away (`| head`) ending
the command quietly with 0."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def plans():
    return _cli("plan"), _cli("plan", "--all")


def _rule_rows(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^ *(\S+)\s+(rules/\S+:\d+)\s+(\d+)\s+(\d+)\s*(.*)$", line)
        if m:
            rows[m.group(1)] = [m.group(2), m.group(3), m.group(4), m.group(5).strip()]
    return rows


def test_the_default_plan_is_a_summary_and_all_is_everything(plans):
    short, full = plans
    assert short.returncode == 0 and full.returncode == 0, short.stderr + full.stderr
    a, b = _rule_rows(short.stdout), _rule_rows(full.stdout)
    assert set(a) < set(b) and all(int(m) or int(c) for _, m, c, _ in a.values())  # only the rules that matched
    idle = [r for r, (_, m, c, _) in b.items() if m == c == "0"]
    assert f"{len(idle)} more rules matched nothing in this step (`--all` lists them)" in short.stdout
    assert len(short.stdout.splitlines()) < len(full.stdout.splitlines()) // 2
    assert "layer 0 launches" not in short.stdout and "layer 0 launches" in full.stdout
    # the LM head and its arg-max one fold; each layer's q/k/v fold, attention, o fold, GLU and down fold one chained
    # launch (qkv_attn_o_glu_down_norm)
    assert "census: chain 4, fold 2" in short.stdout
    # every line but the rules' notes (a sentence each, wrapped by the terminal) fits 100 columns
    long = [line for line in short.stdout.splitlines() if len(line.strip()) > 100 and "not chosen" not in line]
    assert not long, long


def test_a_rule_that_matched_and_lost_says_why_in_its_note(plans):
    short, _ = plans
    rows = _rule_rows(short.stdout)
    for rule, (_, matched, chosen, note) in rows.items():
        if int(matched) and not int(chosen):
            assert note.startswith("not chosen: "), (rule, note)
    # glu_act_mul lost at L0.glu to the chained q/k/v fold, attention, o fold, GLU and down fold
    # (qkv_attn_o_glu_down_norm, which the fused gate/up GEMV alone, the two-phase chain glu_down_norm, the three-phase
    # o_glu_down_norm and the four-phase attn_o_glu_down_norm lose to too): the step's cost with it, against the plan's
    note = rows["glu_act_mul"][3]
    m = re.search(r"\+(\d+\.\d\d) µs a step with it at L0\.glu \((\d+\.\d\d) against (\d+\.\d\d) µs with "
                  r"qkv_attn_o_glu_down_norm\)", note)
    assert m, note
    d, with_it, plan = map(float, m.groups())
    assert d > 0 and abs(with_it - plan - d) < 0.011
    assert re.search(rf"estimated step {plan:.1f} µs", short.stdout)
    assert f"note: glu_act_mul @ rules/ffn.yaml:2: {note}" in short.stdout
    assert rows["qkv_attn_o_glu_down_norm"][3] == ""  # chosen: no note
    assert "with qkv_attn_o_glu_down_norm" in rows["gemv_gate_up_glu"][3]
    assert "with qkv_attn_o_glu_down_norm" in rows["glu_down_norm"][3]
    assert "with qkv_attn_o_glu_down_norm" in rows["o_glu_down_norm"][3]  # the three-phase chain: the five's last
    assert "with qkv_attn_o_glu_down_norm" in rows["attn_o_glu_down_norm"][3]  # the four-phase: the five's last four
    assert "with qkv_attn_o_glu_down_norm" in rows["gemv_norm_epilogue"][3]  # the o products' folds are its phases
    assert "with qkv_attn_o_glu_down_norm" in rows["merged_qkv"][3]  # the q/k/v products in parts: its first phase


def test_the_note_is_in_the_json_too():
    doc = json.loads(_cli("plan", "--json", "-").stdout)
    notes = {r["rule"]: r["note"] for r in doc["rules"]}
    assert notes["glu_act_mul"].startswith("not chosen: +") and "qkv_attn_o_glu_down_norm" in notes["glu_act_mul"]
    assert notes["qkv_attn_o_glu_down_norm"] == ""


def test_a_held_rule_keeps_its_held_note_not_a_why_not():
    r = _cli("plan", "--hold", "glu_act_mul")
    row = _rule_rows(r.stdout)["glu_act_mul"]
    assert row[3].startswith("held back"), row


def test_a_closed_pipe_ends_quietly_with_0():
    for cmd in ("plan", "rules"):
        p = subprocess.run(f"{sys.executable} -m lanefuse.lane.cli {cmd} | head -2; exit ${{PIPESTATUS[0]}}",
                           shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and p.stderr == "", (cmd, p.returncode, p.stderr)
        assert len(p.stdout.splitlines()) == 2


def test_the_note_line_of_each_why_not():
    from lanefuse.lane.cli.report import why_not_note

    base = {"tensor": "L0.glu", "support": "native", "reason": None, "step_us": 10.0,
            "instead": "it computed inside launch #3 (fold, merged_qkv by `merged_qkv`)"}
    assert why_not_note({**base, "plan_cost_us": 12.5}) == \
        "not chosen: +2.50 µs a step with it at L0.glu (12.50 against 10.00 µs with merged_qkv)"
    assert why_not_note({**base, "plan_cost_us": 10.001}) == \
        "not chosen: a tie at L0.glu with merged_qkv (10.00 µs), broken by rank"
    assert "cheaper, which the local search missed" in why_not_note({**base, "plan_cost_us": 9.0}, "local")
    assert why_not_note({**base, "plan_cost_us": None, "support": "refuse", "reason": "no kernel"}) == \
        "not chosen: refuse at L0.glu: no kernel"
    assert why_not_note({**base, "plan_cost_us": None}).startswith("not chosen: no runnable plan takes it at L0.glu")


def test_on_an_80_column_terminal_every_line_fits(tmp_path):
    """On a terminal 80 columns wide (a pty): the rules table drops its source column (in the note lines below) and
    says each why-not in a few words; every line but the note sentences fits 80 columns, no rule name folded."""
    import os
    import pty

    main, sub = pty.openpty()
    env = {**os.environ, "COLUMNS": "80", "LINES": "50", "TERM": "xterm"}
    p = subprocess.Popen([sys.executable, "-m", "lanefuse.lane.cli", "plan"], stdout=sub, stderr=subprocess.PIPE,
                         env=env)
    os.close(sub)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:  # the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    assert p.wait(timeout=300) == 0, p.stderr.read()
    os.close(main)
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", b"".join(chunks).decode()).replace("\r", "")
    lines = [line for line in text.splitlines() if not line.startswith("note: ")]
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    assert re.search(r"│ glu_act_mul\s+│\s+4 │\s+0 │ \+\d+\.\d\d µs vs[\s│]*qkv_attn_o_glu_down_norm\s+│", text), text  # (wrapped at 80)
    assert "rules/ffn.yaml:2" in text  # in its note line


def test_the_short_note():
    from lanefuse.lane.cli.report import _short_note

    assert _short_note("not chosen: +2.00 µs a step with it at L0.glu (359.70 against 357.70 µs with x_y)") == \
        "+2.00 µs vs x_y"
    assert _short_note("not chosen: a tie at L0.glu with x (1.00 µs), broken by rank") == "a tie, broken by rank"
    assert _short_note("held back: released, the plan would choose it 4 times") == "held back"
    assert _short_note("") == ""
