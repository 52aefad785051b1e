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
