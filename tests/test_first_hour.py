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


def test_the_fast_runners_first_binding_counts_as_load_not_as_a_step(monkeypatch):
    """The fast runner binds its launches at its first step, and that binding reads (and stacks, or decodes) the
    weights: a one-time cost counted with the runners' setup (`load`), not in the prompt eval or the decode."""
    import time

    from lanefuse.engine.front.demo import demo_model
    from lanefuse.kernels import GemvGlu
    from lanefuse.lane.run.generate import generate
    from lanefuse.lane.run.step import plan_step_fn

    bound, orig, nap = [], GemvGlu.bind_fast, 0.05

    def slow(self, env):
        bound.append(self)
        time.sleep(nap)
        return orig(self, env)

    monkeypatch.setattr(GemvGlu, "bind_fast", slow)
    cfg, weights = demo_model()
    step_fn, _ = plan_step_fn(weights, "cpu")
    res = generate(cfg, weights, [1, 2, 3], 4, step_fn=step_fn)
    assert len(bound) >= 2 * cfg.layers  # a gate/up product a layer, in the prefill chunk's plan and the decode step's
    assert step_fn.spent["setup_s"] >= nap * len(bound)
    assert res.prompt_s + res.decode_s < nap * len(bound) / 2


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
    assert _cli("rules", "--json", "-").stdout == js.stdout  # as `plan --json -`


def test_rules_json_into_a_file(tmp_path):
    out = tmp_path / "rules.json"
    r = _cli("rules", "--json", str(out))
    assert r.returncode == 0 and r.stdout == "", r.stderr
    assert any(d["name"] == "glu_act_mul.sigmoid" for d in json.loads(out.read_text()))
    bad = _cli("rules", "--json", str(tmp_path / "no" / "such" / "rules.json"))
    assert bad.returncode != 0 and "rules.json" in bad.stderr and "Traceback" not in bad.stderr


def test_plan_summarizes_every_layer_and_the_tail():
    r = _cli("plan")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    # layers 1-2 alike: the chained o fold, GLU and down fold (o_glu_down_norm) counts in the layer whose norm it
    # writes last
    assert "every layer" in out and "1–2" in out and "tail" in out and "logits, next (fold)" in out
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
    # matched 8, chosen 0: the o and down products' folds ride in each layer's chained launch
    # (qkv_attn_o_glu_down_norm, whose first phase runs the q/k/v products in parts, merged_qkv held or not)
    assert row[1] == "rules/norm.yaml:11" and row[2:4] == ["8", "0"]
    chain = next(line.split() for line in r.stdout.splitlines() if line.split()[:1] == ["qkv_attn_o_glu_down_norm"])
    assert chain[1] == "rules/ffn.yaml:116" and chain[2:4] == ["4", "4"]
    notes = [line for line in r.stdout.splitlines() if line.startswith("note: ")]
    assert "note: merged_qkv @ rules/products.yaml:11: held back, and not chosen anyway: the plan with it released " \
           "does not choose it" in notes
    assert f"note: my.gelu_glu @ {tmp_path / 'mine.yaml'}:1: your rule never matched this step" in notes
    assert f"note: my.add @ {tmp_path / 'mine.yaml'}:9: class `my_add` is linked by no launch of the cuda lane: " \
           f"never chosen" in notes
    js = _cli("plan", "--json", "-")
    rule = next(r for r in json.loads(js.stdout)["rules"] if r["rule"] == "qkv_attn_o_glu_down_norm")
    assert rule == {"rule": "qkv_attn_o_glu_down_norm", "where": "rules/ffn.yaml:116",
                    "class": "qkv_attn_o_glu_down_norm", "matched": 4, "chosen": 4, "note": ""}
    idle = _cli("plan", "--hold", "embed_scale")  # the demo model scales no embedding: the hold changes nothing
    assert "note: embed_scale @ rules/norm.yaml:30: held back, and not chosen anyway: the plan with it released " \
           "does not choose it" in idle.stdout


def test_explore_help_lists_the_shell_commands():
    from lanefuse.lane.explore.shell import COMMANDS

    r = _cli("explore", "--help")
    assert r.returncode == 0, r.stderr
    for usage, what in COMMANDS:
        assert any(line.split() == [*usage.split(), *what.split()] for line in r.stdout.splitlines()), usage


# ---- --ctx: the KV caches' rows ------------------------------------------------------------------------------------
def test_ctx_sets_the_cache_rows_and_is_said(tmp_path):
    r = _cli("run", "--ctx", "64", "--prompt-ids", "1,2", "--tokens", "3")
    assert r.returncode == 0, r.stderr
    assert "lanefuse: KV cache: 64 rows (--ctx;" in r.stderr and "the model allows 256" in r.stderr
    default = _cli("run", "--prompt-ids", "1,2", "--tokens", "3", "--reference")
    assert "lanefuse: KV cache: 256 rows (what the model allows;" in default.stderr
    assert r.stdout.splitlines()[-1] == default.stdout.splitlines()[-1]  # the same tokens: rows past the end unused
    p = _cli("plan", "--ctx", "128", "--save", str(tmp_path / "p.json"))
    assert p.returncode == 0 and "KV cache 128 rows" in p.stdout.splitlines()[0]
    saved = _cli("run", "--plan", str(tmp_path / "p.json"), "--prompt-ids", "1,2", "--tokens", "3")
    assert saved.returncode == 0, saved.stderr
    assert "lanefuse: KV cache: 128 rows (the saved plan's;" in saved.stderr


@pytest.mark.parametrize("args, said", [
    (["--ctx", "999"], "lanefuse: error: --ctx 999: the demo model allows at most 256 positions"),
    (["--ctx", "0"], "argument --ctx: 0: give at least 1 row"),
    (["--ctx", "8", "--tokens", "20"], "need 20 positions; the KV caches hold 8 (--ctx N gives them more rows)"),
])
def test_ctx_is_validated(args, said):
    r = _cli("run", "--prompt-ids", "1", *args)
    assert r.returncode != 0 and said in r.stderr and "Traceback" not in r.stderr


# ---- a shape without its weights -----------------------------------------------------------------------------------
def _config(d, **over):
    from lanefuse.engine.front.demo import demo_config

    cfg = demo_config()
    c = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers,
         "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
         "intermediate_size": cfg.inter, "vocab_size": cfg.vocab, "rms_norm_eps": cfg.eps, "rope_theta": 10000.0,
         "max_position_embeddings": 40960, "hidden_act": "silu", "torch_dtype": "bfloat16", **over}
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(c))
    return d


def _formats(out: str) -> set[str]:
    def walk(v):
        if isinstance(v, dict):
            if "format" in v:
                yield v["format"]
            for x in v.values():
                yield from walk(x)
        elif isinstance(v, list):
            for x in v:
                yield from walk(x)

    return set(walk(json.loads(out)["launches"]))


def test_a_config_only_folder_plans_in_its_torch_dtype_or_the_format_given(tmp_path):
    d = _config(tmp_path / "shape")
    r = _cli("plan", str(d), "--json", "-")
    assert r.returncode == 0, r.stderr
    assert _formats(r.stdout) == {"bf16"}
    assert "lanefuse: shape only: no weights in" in r.stderr and "bf16 (from config.json's torch_dtype" in r.stderr
    f16 = _cli("plan", str(d), "--weights-format", "f16", "--json", "-")
    assert f16.returncode == 0 and _formats(f16.stdout) == {"f16"}
    text = _cli("plan", str(d))
    assert text.returncode == 0 and "KV cache 4096 rows" in text.stdout and "every layer" in text.stdout
    ex = subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", "explore", str(d)], input="fired\nquit\n",
                        capture_output=True, text=True, timeout=300)
    assert ex.returncode == 0 and "fusions fired" in ex.stdout, ex.stderr


def test_a_config_only_folder_does_not_run(tmp_path):
    d = _config(tmp_path / "shape")
    r = _cli("run", str(d), "--prompt-ids", "1")
    assert r.returncode != 0 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith(f"lanefuse: error: {d}: config.json and no weights (*.safetensors): `plan` and "
                               f"`explore` take its shape")
    nodtype = _config(tmp_path / "nodtype", torch_dtype=None)
    p = _cli("plan", str(nodtype))
    assert p.returncode != 0 and "give --weights-format f32|f16|bf16" in p.stderr


def test_a_gguf_folder_is_read_as_its_file(tmp_path):
    (tmp_path / "model-q8_0.gguf").write_bytes(b"GGUF")  # a folder holding one GGUF file: that file (broken here)
    r = _cli("plan", str(tmp_path))
    assert r.returncode != 0
    assert r.stderr.strip().startswith(f"lanefuse: error: {tmp_path / 'model-q8_0.gguf'}: not a GGUF file the gguf "
                                       f"package can read (4 bytes")
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_slow_plan_shows_a_spinner_on_a_terminal_only(monkeypatch):
    """Work past the spinner's delay shows what it is doing on a terminal; quick work, or no terminal, shows nothing."""
    import io
    import time

    from lanefuse.lane.cli.slow import spinner

    class Tty(io.StringIO):
        def isatty(self):
            return True

    slow, quick, pipe = Tty(), Tty(), io.StringIO()
    with spinner("planning big", after=0.05, stream=slow):
        time.sleep(0.4)
    with spinner("planning small", after=5.0, stream=quick):
        pass
    with spinner("planning piped", after=0.0, stream=pipe):
        time.sleep(0.1)
    assert "planning big" in slow.getvalue()
    assert quick.getvalue() == "" and pipe.getvalue() == ""
