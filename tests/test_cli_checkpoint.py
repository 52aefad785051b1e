"""The command on a checkpoint folder written without torch (safetensors from numpy, a config as transformers 4.x
writes it, a word-level tokenizer): `run --prompt` encodes and decodes text, `plan` and `run` agree with the
reference, and a broken checkpoint is one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from lanefuse.engine.front.demo import demo_config, random_arrays


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from safetensors.numpy import save_file

    d = tmp_path_factory.mktemp("ckpt")
    cfg = demo_config()
    arrays = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in random_arrays(cfg, seed=3).items()}
    save_file(arrays, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.inter, "vocab_size": cfg.vocab, "rms_norm_eps": cfg.eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": 256, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "float32"}))
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(cfg.vocab - 1)}
    vocab["[UNK]"] = cfg.vocab - 1
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.save(str(d / "tokenizer.json"))
    return d


def test_run_prompt_text_on_a_checkpoint(folder, tmp_path):
    r = _cli("run", str(folder), "--prompt", "w5 w17 w42", "--tokens", "6", "--json", str(tmp_path / "o.json"))
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "o.json").read_text())
    assert out["prompt_ids"] == [5, 17, 42] and len(out["generated_ids"]) == 6
    assert "text: " in r.stdout and "w" in r.stdout.split("text: ")[1]
    ref = _cli("run", str(folder), "--reference", "--prompt-ids", "5,17,42", "--tokens", "6")
    assert ref.returncode == 0, ref.stderr
    assert ",".join(map(str, out["generated_ids"])) in ref.stdout


def test_plan_a_checkpoint_folder(folder):
    r = _cli("plan", str(folder), "--json", "-")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    # each layer's attention inside its chained launch (attn_o_glu_down_norm: attention, o fold, GLU, down fold)
    assert d["census"]["chain"] == 4 and "attention" not in d["census"]
    assert d["arena"]["bytes"] >= d["arena"]["lower_bound"]


def test_a_misshaped_tensor_is_named(folder, tmp_path):
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    arrays = load_file(str(folder / "model.safetensors"))
    arrays["model.layers.1.mlp.up_proj.weight"] = arrays["model.layers.1.mlp.up_proj.weight"][:, :100].copy()
    save_file(arrays, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((folder / "config.json").read_text())
    r = _cli("run", str(bad), "--tokens", "2")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "model.layers.1.mlp.up_proj.weight" in r.stderr and r.stderr.count("\n") == 1
    os.remove(bad / "config.json")
    r = _cli("plan", str(bad))
    assert r.returncode != 0 and "config.json" in r.stderr and "Traceback" not in r.stderr
