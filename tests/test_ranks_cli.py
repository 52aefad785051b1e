"""`--ranks R` on the command: plan (each rank's bytes and whether they fit, the collectives priced on the link; a
config-only folder of Llama-3-70B's shape over 8 ranks), check (R ranks' step against one rank's), run (R processes:
the tokens of one rank), and the refusals in one line with a non-zero exit."""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest

from lanefuse.engine.front.model import ModelConfig
from lanefuse.engine.front.parallel import rank_weight_bytes
from lanefuse.lane.cli.main import main
from lanefuse.lane.cli.ranks import rank_report
from lanefuse.lane.lower.knobs import Knobs
from ranks_helpers import seeded_weights

LLAMA70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
            "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 80,
            "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
            "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def _config_only(tmp_path, cfg: dict):
    d = tmp_path / "shape"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_plan_ranks_of_a_config_only_folder(tmp_path, capsys):
    d = _config_only(tmp_path, LLAMA70B)
    out = tmp_path / "r.json"
    assert main(["plan", str(d), "--ranks", "8", "--ctx", "4096", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert len(rep["rank"]) == 8 and all(r["fits"] for r in rep["rank"])
    assert [r["kv_heads"] for r in rep["rank"]] == [1] * 8 and [r["ffn"] for r in rep["rank"]] == [3584] * 8
    assert rep["rank"][7]["vocab"] == [7 * 16032, 128256]
    # the whole model's bf16 weights: the embedding (whole on every rank) once more a rank past the first
    d_, v, L, f = 8192, 128256, 80, 28672
    whole = 2 * (2 * v * d_ + L * (2 * d_ * d_ + 2 * d_ * 1024 + 3 * d_ * f)) + 2 * d_ * (2 * L + 1)
    embed, norms = 2 * v * d_, 2 * d_ * (2 * L + 1)
    assert sum(r["weight_bytes"] for r in rep["rank"]) == whole + 7 * (embed + norms)
    # 2 all-reduces a layer of one f32 row, and the arg-max's two values a row; priced on the link
    c = rep["collectives"]
    assert c["all_reduce"]["count"] == 160 and c["all_reduce"]["bytes"] == 160 * 4 * d_
    assert c["all_argmax"] == {"count": 1, "bytes": 16, "us": pytest.approx(10.0 + 7 * 16 / 450e3)}
    assert c["all_reduce"]["us"] == pytest.approx(160 * (10.0 + 2 * 7 / 8 * 4 * d_ / 450e3))
    capsys.readouterr()
    two = _config_only(tmp_path / "two", dict(LLAMA70B, num_hidden_layers=2))  # rank 0's plan printed after: 2 layers
    assert main(["plan", str(two), "--ranks", "8", "--ctx", "4096"]) == 0
    text = capsys.readouterr().out
    assert " GB " in text and " yes" in text and "PREDICTION" in text and "4 all_reduce" in text and "rank 0's step" in text
    assert "census: collective 5" in text  # 2 all-reduces a layer and the arg-max, each all-reduce with its add+norm


def test_one_rank_does_not_fit_where_two_do(tmp_path):
    from lanefuse.engine.front.hfconfig import config_from_hf

    cfg = config_from_hf(LLAMA70B, "config.json", max_len=4096, name="llama70b")
    cfg = __import__("dataclasses").replace(cfg, formats=tuple((w, "bf16") for w in cfg.weight_names()))
    one = rank_report(cfg, 1, 1, Knobs())
    two = rank_report(cfg, 2, 1, Knobs())
    assert not one["rank"][0]["fits"] and all(r["fits"] for r in two["rank"])
    assert rank_weight_bytes(cfg, 1)[0] > 141e9 > rank_weight_bytes(cfg, 2)[0]
    tight = rank_report(cfg, 2, 1, Knobs(device_gb=60.0))
    assert not any(r["fits"] for r in tight["rank"])


@pytest.mark.parametrize("argv, words", [
    (["plan", "--ranks", "3"], "3 ranks do not divide demo's 2 KV heads"),
    (["check", "--ranks", "3"], "3 ranks do not divide demo's 2 KV heads"),
    (["run", "--ranks", "2", "--prompt-ids", "1,2"], "give a checkpoint folder or a .gguf file"),
])
def test_refusals_one_line(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert words in err[-1] and err[-1].startswith("lanefuse: ")


def test_rank_count_is_a_number_of_ranks(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--ranks", "0"])
    assert e.value.code == 2 and "--ranks: 0: give at least 1 rank" in capsys.readouterr().err


@pytest.mark.parametrize("ranks", [2, 4])
def test_check_ranks_demo(capsys, ranks):
    """4 ranks: the demo's 2 KV heads replicated, rank r's cache history KV head r // 2's (it was head r's columns:
    rank 2's and 3's empty, refused at the step's inputs)."""
    assert main(["check", "--ranks", str(ranks), "--rows", "1", "--rows", "7"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all(l.endswith("-> ok") and "next token equal" in l for l in lines)


def _tiny_checkpoint(tmp_path):
    """A Qwen3 of 6 heads over 2 KV heads, FFN 37, vocabulary 61, f32, in a safetensors folder."""
    from safetensors.numpy import save_file

    hf = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 24,
          "intermediate_size": 37, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8,
          "num_hidden_layers": 2, "vocab_size": 61, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "max_position_embeddings": 64, "torch_dtype": "float32", "tie_word_embeddings": False}
    cfg = ModelConfig("Qwen3ForCausalLM", 24, 2, 6, 2, 8, 37, 61, qk_norm=True, max_len=64)
    w = seeded_weights(cfg, 11)
    arrays = {n: np.asarray(w.get(n), np.float32) * (3.0 if "embed" in n else 1.0) for n in cfg.weight_names()}
    d = tmp_path / "tiny"
    d.mkdir()
    save_file(arrays, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(hf))
    return d


@pytest.mark.slow
def test_run_ranks_gives_one_ranks_tokens(tmp_path, capsys):
    from lanefuse.lane.run.ranks import gloo_missing

    if gloo_missing():
        pytest.skip(f"CPU ranks need gloo: {gloo_missing()}")
    d = _tiny_checkpoint(tmp_path)
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert main(["run", str(d), "--prompt-ids", "3,5,7,11", "--tokens", "8", "--reference", "--json", str(one)]) == 0
    assert main(["run", str(d), "--prompt-ids", "3,5,7,11", "--tokens", "8", "--ranks", "2", "--json", str(two)]) == 0
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert b["generated_ids"] == a["generated_ids"] and b["ranks"] == 2
    assert len(set(a["generated_ids"])) > 2 and math.isfinite(len(a["generated_ids"]))


@pytest.mark.slow
def test_run_ranks_of_a_batch_gives_one_ranks_tokens(tmp_path, capsys):
    """run --ranks 2 of three prompts in two slots (one launch of 2 gloo processes, each its rank's batch plans on the
    numpy backend): each prompt's tokens of the one-rank batch run; plan --ranks 2 --batch 2 prices its collectives."""
    from lanefuse.lane.run.ranks import gloo_missing

    if gloo_missing():
        pytest.skip(f"CPU ranks need gloo: {gloo_missing()}")
    d = _tiny_checkpoint(tmp_path)
    prompts = ["--prompt-ids", "3,5,7,11", "--prompt-ids", "9,2", "--prompt-ids", "40,1,6"]
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert main(["run", str(d), *prompts, "--batch", "2", "--tokens", "5", "--reference", "--json", str(one)]) == 0
    assert main(["run", str(d), *prompts, "--batch", "2", "--tokens", "5", "--ranks", "2", "--json", str(two)]) == 0
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert [r["generated_ids"] for r in b] == [r["generated_ids"] for r in a] and all(r["ranks"] == 2 for r in b)
    out = capsys.readouterr()
    assert "prompt 3: 40,1,6 -> " in out.out and "3 prompt(s) in 2 slot(s)" in out.err
    assert main(["plan", str(d), "--ranks", "2", "--batch", "2"]) == 0
    assert "collectives a batch step of 2: 4 all_reduce (192 B a rank each), 1 all_argmax (32 B" in \
        capsys.readouterr().out


def _deepseek_v3() -> dict:
    """DeepSeek-V3's config.json keys (bench/deepseek_figures.py's: the released model's values), in bf16."""
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    if bench not in sys.path:
        sys.path.append(bench)
    from deepseek_figures import DEEPSEEK_V3

    return {**DEEPSEEK_V3, "torch_dtype": "bfloat16"}


def test_plan_ranks_of_deepseek_v3(tmp_path):
    """DeepSeek-V3's config over 8 ranks: 16 query heads and 32 of the 256 experts a rank, the latent cache whole on
    each; in bf16 171.18 GB a rank (no fit in 141 GB), in q8_0 90.94 GB (fits). The bytes: every rank's parts once,
    what every rank holds whole (the embedding, norms, routers and their biases, q_a and kv_a) eight times."""
    d = _config_only(tmp_path, _deepseek_v3())
    for fmt, gb, fits in (("bf16", 171.18, False), ("q8_0", 90.94, True)):
        out = tmp_path / f"{fmt}.json"
        assert main(["plan", str(d), "--ranks", "8", "--ctx", "4096", "--weights-format", fmt, "--json",
                     str(out)]) == 0
        rep = json.loads(out.read_text())
        assert [r["experts"] for r in rep["rank"]] == [[32 * r, 32 * r + 32] for r in range(8)]
        assert {r["heads"] for r in rep["rank"]} == {16} and {r["fits"] for r in rep["rank"]} == {fits}
        assert {round(r["weight_bytes"] / 1e9, 2) for r in rep["rank"]} == {gb}
        assert rep["collectives"]["all_reduce"]["count"] == 2 * 61
    # bf16 (a config-only folder's every tensor in the given format): the whole model once, and 7 more copies of
    # what each rank holds whole
    L, d_, v, E, sparse = 61, 7168, 129280, 256, 61 - 3
    whole_layer = (1536 + 512 + 64) * d_ + 2 * d_ + 1536 + 512  # q_a, kv_a's latent and rotated rows; 4 norms
    whole = 2 * (v * d_ + d_ + L * whole_layer + sparse * (E * d_ + E))  # the embedding, final norm, routers, biases
    rep = json.loads((tmp_path / "bf16.json").read_text())
    from lanefuse.engine.front.hfconfig import config_from_hf

    cfg = config_from_hf(_deepseek_v3(), "config.json", max_len=4096, name="ds")
    cfg = __import__("dataclasses").replace(cfg, formats=tuple((w, "bf16") for w in cfg.weight_names()))
    assert sum(r["weight_bytes"] for r in rep["rank"]) == rank_weight_bytes(cfg, 1)[0] + 7 * whole


@pytest.mark.parametrize("family", ["deepseek", "qwen2_moe"])
def test_check_ranks_of_a_mixture(family, capsys):
    """`check --ranks 2` of a tiny DeepSeek-V3 (its latent cache whole on every rank: every rank the one rank's
    history) and Qwen2-MoE (a shared expert): each step of 2 ranks against one rank's."""
    import types

    from lanefuse.lane.cli.ranks import check_ranks_cmd

    if family == "deepseek":
        from test_deepseek import tiny_cfg

        cfg = tiny_cfg()
    else:
        from test_ranks_moe import QWEN2, _cfg

        cfg = _cfg(QWEN2, 2)
    src = types.SimpleNamespace(cfg=cfg, weights=seeded_weights(cfg, 5), name=family)
    assert check_ranks_cmd(types.SimpleNamespace(ranks=2), src, [1, 5]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all(l.endswith("-> ok") for l in lines)


QWEN3_235B = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
              "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64,
              "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
              "norm_topk_prob": True, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "max_position_embeddings": 40960, "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def test_plan_ranks_of_qwen3_235b(tmp_path, capsys):
    """Qwen3-235B-A22B's shape in bf16: 118.56 GB a rank over 4 ranks (32 experts each, no dense FFN: `ffn` none);
    60.05 GB over 8 (16 experts each, its 4 KV heads each held by 2 ranks); over 6 refused in one line."""
    d = _config_only(tmp_path, QWEN3_235B)
    out = tmp_path / "r.json"
    assert main(["plan", str(d), "--ranks", "4", "--ctx", "4096", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [(r["experts"], r["ffn"], round(r["weight_bytes"] / 1e9, 2), r["fits"]) for r in rep["rank"]] == \
        [([32 * r, 32 * r + 32], None, 118.56, True) for r in range(4)]
    assert main(["plan", str(d), "--ranks", "8", "--ctx", "4096", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [(r["experts"], r["kv_heads"], round(r["weight_bytes"] / 1e9, 2), r["fits"]) for r in rep["rank"]] == \
        [([16 * r, 16 * r + 16], 1, 60.05, True) for r in range(8)]
    capsys.readouterr()
    assert main(["plan", str(d), "--ranks", "6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "6 ranks do not divide" in err[-1] and "4 KV heads" in err[-1] and err[-1].startswith("lanefuse: error:")
