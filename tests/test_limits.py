"""Every size read from a file or a flag is checked against a stated bound before anything is allocated, and every
input is read with a cap (issue 36): each limit hit here, each refusal one line naming the file or flag and the
bound. GGUF files are written with the gguf package alone (tests/test_gguf_layout.py's tiny llama)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from lanefuse.engine.errors import UserError, clip  # noqa: E402
from lanefuse.engine.front.hfconfig import MAX_LAYERS, config_from_hf  # noqa: E402
from lanefuse.engine.userfile import MIB, read_capped, regular  # noqa: E402

HF = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 48, "vocab_size": 50, "rms_norm_eps": 1e-5,
      "max_position_embeddings": 64, "tie_word_embeddings": False, "rope_theta": 10000.0, "hidden_act": "silu"}


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def _one_line(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr[-800:])
    last = r.stderr.splitlines()[-1]
    assert last.startswith("lanefuse: error: ") and "Traceback" not in r.stderr, r.stderr[-800:]
    assert len(last) < 400, last
    for w in words:
        assert w in last, (w, last)
    return last


# -- layers ----------------------------------------------------------------------------------------------------------

def test_the_layer_bound_is_hit_and_named():
    config_from_hf({**HF, "num_hidden_layers": MAX_LAYERS})  # the bound itself reads
    for n in (MAX_LAYERS + 1, 2000, 10_000):
        with pytest.raises(UserError, match=rf"`num_hidden_layers` is {n}; expected at most {MAX_LAYERS}"):
            config_from_hf({**HF, "num_hidden_layers": n})


def test_building_a_step_is_linear_in_its_layers():
    """A config's weight formats are looked up once each (a dict built a lookup made a step of L layers cost L²):
    a step of 8x the layers builds in well under 8² x the time (the best of three, against a loaded machine)."""
    import dataclasses
    import time

    from lanefuse.engine.front.model import build_step

    def seconds(layers):
        cfg = config_from_hf({**HF, "num_hidden_layers": layers})
        cfg = dataclasses.replace(cfg, formats=tuple((w, "f32") for w in cfg.weight_names()))
        t = time.perf_counter()
        build_step(cfg, 1)
        return time.perf_counter() - t

    seconds(4)
    small, big = min(seconds(64) for _ in range(3)), min(seconds(512) for _ in range(3))
    assert big < 24 * small, (small, big)  # linear: about 10x here; the quadratic lookup made it ~60x


# -- sizes against the files that hold them --------------------------------------------------------------------------

def test_a_gguf_expert_count_of_a_billion_is_refused_before_any_store(tmp_path):
    pytest.importorskip("gguf")
    from test_gguf_layout import write_llama

    from lanefuse.engine.front.load import load_model

    p = write_llama(tmp_path / "m.gguf", keys={"llama.expert_count": 10 ** 9, "llama.expert_used_count": 2},
                    experts=4)
    with pytest.raises(UserError, match=r"the metadata's sizes call for [\d,]+ weight values .* more than the "
                                        r"file's [\d,]+ bytes hold at 1 bit a value") as e:
        load_model(p)
    assert "experts" in str(e.value) and "\n" not in str(e.value)
    ok = write_llama(tmp_path / "ok.gguf", keys={"llama.expert_count": 4, "llama.expert_used_count": 2}, experts=4)
    cfg, _ = load_model(ok)
    assert cfg.moe.experts == 4


def test_a_config_whose_sizes_its_files_cannot_hold_is_refused(tmp_path):
    from test_hardening_inputs import _folder

    from lanefuse.engine.front.load import load_model

    d = _folder(tmp_path / "m")
    (d / "config.json").write_text(json.dumps({**HF, "intermediate_size": 2 ** 30}))
    with pytest.raises(UserError, match=r"config.json's sizes call for [\d,]+ weight values"):
        load_model(d)


# -- the context -----------------------------------------------------------------------------------------------------

def test_a_given_ctx_is_held_to_the_memory_bound(monkeypatch):
    import lanefuse.lane.cli.source as source

    cfg = config_from_hf(HF)
    monkeypatch.setattr(source, "_memory_bytes", lambda: 1 << 30)  # 1 GiB: a quarter for the caches
    rows, _ = source.context_rows(10 ** 9, cfg, 100_000, "m")  # 100k rows of 2 layers x 2 x 16 f32: 24 MiB
    assert rows == 100_000
    with pytest.raises(UserError, match=r"--ctx 100000000: the KV caches and carried states of 100000000 rows need "
                                        r"23\.8 GiB, more than the 25% of this machine's 1 GiB"):
        source.context_rows(10 ** 9, cfg, 10 ** 8, "m")
    rows, said = source.context_rows(10 ** 9, cfg, None, "m")  # the default is capped, not refused
    assert rows == source.CTX_CAP and "capped at" in said


def test_the_command_refuses_a_ctx_past_memory(tmp_path):
    pytest.importorskip("gguf")
    from test_gguf_layout import write_llama

    p = write_llama(tmp_path / "m.gguf", keys={"llama.context_length": 2_000_000_000})
    r = _cli("run", p, "--ctx", 1_000_000_000, "--tokens", "2", "--prompt-ids", "1")  # ~240 GiB of caches
    _one_line(r, "--ctx 1000000000", "GiB", "this machine's")


# -- inputs read with a cap ------------------------------------------------------------------------------------------

def test_inputs_are_read_up_to_their_cap(tmp_path):
    with pytest.raises(UserError, match=r"/dev/zero: more than 1 MiB, the most lanefuse reads of a test input"):
        read_capped("/dev/zero", MIB, "a test input", pipes=True)
    with pytest.raises(UserError, match=r"/dev/zero: cannot read a test input: it is a character device"):
        read_capped("/dev/zero", MIB, "a test input")
    with pytest.raises(UserError, match=r"cannot read a GGUF file: it is a folder"):
        regular(tmp_path, "a GGUF file")
    f = tmp_path / "x"
    f.write_bytes(b"a" * MIB)
    assert len(read_capped(f, MIB, "x")) == MIB
    f.write_bytes(b"a" * (MIB + 1))
    with pytest.raises(UserError, match="more than 1 MiB"):
        read_capped(f, MIB, "x")


@pytest.mark.parametrize("line,words", [
    ("[" * 100_000, ["p.txt:2", "nested too deep"]),
    ("[" + "9" * 5000 + "]", ["p.txt:2", "not JSON", "characters)"]),
    ("[" + "9" * 4000 + "]", ["p.txt:2", "outside the vocabulary", "characters)"]),
    ('{"prompt": 3}', ["p.txt:2", "a line is a JSON list"]),
])
def test_a_prompts_file_line_of_any_size_is_one_short_line(tmp_path, line, words):
    f = tmp_path / "p.txt"
    f.write_text("[1, 2]\n" + line + "\n")
    _one_line(_cli("run", "demo", "--prompts", f, "--tokens", "2"), *words)


def test_a_config_json_nested_too_deep_is_one_line(tmp_path):
    from lanefuse.engine.jsonfile import read_json

    f = tmp_path / "config.json"
    f.write_text("[" * 100_000)
    with pytest.raises(UserError, match="nested deeper"):
        read_json(f, "config.json is JSON")


def test_clip_keeps_a_message_a_line():
    assert clip("abc") == "abc"
    long = clip("x" * 60_000, 60)
    assert len(long) < 80 and "60000 characters" in long
    assert clip("a\nb") == repr("a\nb")


def test_a_step_yamls_random_weights_are_bounded():
    from lanefuse.engine.front.stepweights import MAX_RANDOM_VALUES, step_weights
    from lanefuse.engine.stepyaml import from_yaml

    text = ("io: {token: token, position: pos, caches: [], logits: logits, next: next}\ntensors:\n  token: i32[1]\n"
            "  pos: i32[1]\nconstants:\n  emb: {shape: [%d, 4]}\n  w: {shape: [4], kind: values}\nops:\n"
            "  - {op: gather, out: x, ins: [emb, token]}\n  - {op: rmsnorm, out: n, ins: [x, w], eps: 1e-6}\n"
            "  - {op: matmul, out: logits, ins: [n, emb]}\n  - {op: argmax, out: next, ins: [logits]}\n"
            "weights: {random: 1}\n")
    assert step_weights(from_yaml(text % 7)).get("emb").shape == (7, 4)
    with pytest.raises(UserError, match=rf"the step's constants hold [\d,]+ values \(`emb` alone \(\d+, 4\)\); random "
                                        rf"weights are made for at most {MAX_RANDOM_VALUES:,}"):
        step_weights(from_yaml(text % (MAX_RANDOM_VALUES // 4 + 1)))


# -- each input's own cap, hit (lowered here so the files stay small) -------------------------------------------------

def test_each_inputs_cap_is_hit(tmp_path, monkeypatch, capsys):
    from lanefuse.engine import userfile
    from lanefuse.engine.jsonfile import read_json
    from lanefuse.engine.yamlsafe import read_text
    from lanefuse.lane.cli import prompts
    from lanefuse.lane.cli.main import main

    f = tmp_path / "config.json"
    f.write_text(json.dumps(HF))
    assert read_json(f, "config.json is JSON") == HF
    monkeypatch.setattr(userfile, "MAX_JSON", 100)
    with pytest.raises(UserError, match=r"config.json: more than 100 bytes, the most lanefuse reads of a JSON file"):
        read_json(f, "config.json is JSON")
    y = tmp_path / "r.yaml"
    y.write_text("- name: x\n" * 20)
    monkeypatch.setattr(userfile, "MAX_YAML", 64)
    with pytest.raises(UserError, match=r"r.yaml: more than 64 bytes, the most lanefuse reads of a YAML file"):
        read_text(y)
    p = tmp_path / "p.txt"
    p.write_text("[1, 2]\n" * 40)
    monkeypatch.setattr(userfile, "MAX_PROMPTS", 100)
    assert main(["run", "demo", "--prompts", str(p), "--tokens", "2"]) == 2
    assert "p.txt: more than 100 bytes, the most lanefuse reads of a --prompts file" in capsys.readouterr().err
    monkeypatch.setattr(userfile, "MAX_PROMPTS", 1 << 20)
    monkeypatch.setattr(prompts, "MAX_PROMPT_LINE", 5)
    assert main(["run", "demo", "--prompts", str(p), "--tokens", "2"]) == 2
    assert "p.txt:1: a line of 6 characters; a prompt line holds at most 5" in capsys.readouterr().err


def test_the_default_cache_rows_are_refused_where_even_one_row_is_too_big(monkeypatch):
    import lanefuse.lane.cli.source as source

    cfg = config_from_hf(HF)
    monkeypatch.setattr(source, "_memory_bytes", lambda: 256)  # a quarter: 64 bytes; one row of caches: 256
    with pytest.raises(UserError, match=r"m: the KV caches and carried states of 1 rows need .* GiB, more than the "
                                        r"25% of this machine's 0 GiB they may take; its sizes are wrong"):
        source.context_rows(64, cfg, None, "m")
