"""A new user's first hour (issue 18), through the command as they would type it: timings after `run`, the default
prompt said, `--version`, output that pipes, every layer of a plan summarized, per-rule counts, `explore --help`,
`--ctx`, and a plan of a shape without its weights."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


# ---- what a llama.cpp user expects of `run` ------------------------------------------------------------------------
def test_run_prints_timings_on_stderr_and_in_json(tmp_path):
    r = _cli("run", "--prompt-ids", "1,2,3", "--tokens", "5", "--json", str(tmp_path / "o.json"))
    assert r.returncode == 0, r.stderr
    for head in ("load", "plan", "prompt eval", "decode"):
        assert any(line.startswith(head) for line in r.stderr.splitlines()), r.stderr
    assert "ms" not in r.stdout  # stdout keeps the ids only: it pipes
    assert "/    3 tokens" in r.stderr and "/    4 tokens" in r.stderr and "tokens/s" in r.stderr
    t = json.loads((tmp_path / "o.json").read_text())["timings"]
    assert t["prompt_tokens"] == 3 and t["decode_tokens"] == 4
    assert t["plan_ms"] > 0 and t["load_ms"] > 0 and t["decode_ms_per_token"] > 0 and t["decode_tokens_per_s"] > 0


def test_run_says_the_default_prompt():
    r = _cli("run", "--tokens", "1", "--reference")
    assert r.returncode == 0, r.stderr
    assert "no --prompt-ids or --prompt given: the prompt is token id 1" in r.stderr
    quiet = _cli("run", "--tokens", "1", "--reference", "--prompt-ids", "2")
    assert "no --prompt-ids" not in quiet.stderr


def test_version():
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("lanefuse ")


# ---- output that pipes ---------------------------------------------------------------------------------------------
def test_rules_into_a_pipe_keeps_whole_rows():
    r = _cli("rules")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    row = next(line for line in lines if line.split()[:1] == ["glu_act_mul.sigmoid"])
    assert "rules/ffn.yaml:10" in row  # one row, not split over two lines at 80 columns
    assert not any(c in r.stdout for c in "┃│┏")  # plain rows, no box drawing
    js = _cli("rules", "--json")
    assert js.returncode == 0 and any(d["source"] == "rules/ffn.yaml:10" for d in json.loads(js.stdout))


def test_plan_summarizes_every_layer_and_the_tail():
    r = _cli("plan")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "every layer" in out and "0–2" in out and "tail" in out and "logits (gemv), next (argmax)" in out
    assert "the final norm is fused into layer 3" in out
    assert "`--layer N` shows layer N's launches (0..3" in out
    tail = _cli("plan", "--layer", "-1")
    assert tail.returncode == 0 and "the step's tail: launches" in tail.stdout and "argmax" in tail.stdout


def test_plan_layer_out_of_range_is_an_error():
    r = _cli("plan", "--layer", "9")
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.strip() == "lanefuse: error: --layer 9: demo has layers 0..3 (-1: the step's tail outside every " \
                               "layer)"


def test_plan_counts_matches_and_choices_per_rule(tmp_path):
    (tmp_path / "classes.yaml").write_text(
        '- class: my_add\n  joins: "an add on its own"\n  launch: "none yet"\n  vars: [a, b, y]\n')
    (tmp_path / "mine.yaml").write_text(
        "- name: my.gelu_glu\n  class: glu_act_mul\n  why: a gate the demo step never has\n"
        "  match:\n    a: gelu(g)\n    y: mul(u, a)\n  with: {act: gelu}\n\n"
        "- name: my.add\n  class: my_add\n  why: an add as a class no lane links\n  match:\n    y: add(a, b)\n")
    r = _cli("plan", "--hold", "merged_qkv", "--rules", str(tmp_path))
    assert r.returncode == 0, r.stderr
    row = next(line.split() for line in r.stdout.splitlines() if line.split()[:1] == ["gemv_norm_epilogue"])
    assert row[1] == "rules/norm.yaml:11" and row[2:4] == ["8", "8"]  # matched 8, chosen 8
    notes = [line for line in r.stdout.splitlines() if line.startswith("note: ")]
    assert "note: merged_qkv @ rules/products.yaml:11: held back" in notes
    assert f"note: my.gelu_glu @ {tmp_path / 'mine.yaml'}:1: your rule never matched this step" in notes
    assert f"note: my.add @ {tmp_path / 'mine.yaml'}:9: class `my_add` is linked by no launch of the cuda lane: " \
           f"never chosen" in notes
