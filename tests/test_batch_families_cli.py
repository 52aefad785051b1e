"""Qwen3-Next and DeepSeek-V3 batches as a user runs them (issue 40): `lanefuse run MODEL --prompt-ids ... --batch 2`
(three prompts of different lengths in two slots) on a tiny checkpoint of each family (Qwen3-Next f32, DeepSeek-V3
bf16), through the command's own step functions (the numpy backend's plans; the caches and carried states in the
arena its forms share; the third prompt in a slot one of the first two leaves, zeroed first): each prompt's tokens
those of `lanefuse run MODEL --prompt-ids` of it alone, its logits within 1e-5 of their scale."""

from __future__ import annotations

import json

import numpy as np
import pytest

PROMPTS = ["3,17,5,42,8,11", "9,2", "40,41,42,43,44,45,46,47,48"]
TOKENS = 5


def _model(family: str, dtype: str, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    if family == "qwen3next":
        from test_qwen3next import build

        folder, _ = build(dtype, tmp_path)
        return folder
    from test_deepseek import VARIANTS, build

    name, kw = VARIANTS[dtype]
    build(name, tmp_path / dtype, **kw)
    return tmp_path / dtype


def _run(capsys, *args) -> list[dict]:
    from lanefuse.lane.cli.main import main

    assert main(["run", *map(str, args), "--tokens", str(TOKENS), "--json", "-"]) == 0
    got = json.loads(capsys.readouterr().out)
    return got if isinstance(got, list) else [got]


@pytest.mark.parametrize("family,dtype", [("qwen3next", "f32"), ("deepseek_v3", "bf16")])  # (both dtypes of each:
# test_qwen3next / test_deepseek's batch tests, through generate_batch)
def test_a_batch_run_gives_each_prompt_its_run_alone(family, dtype, tmp_path, capsys):
    folder = _model(family, dtype, tmp_path)
    ids = [a for p in PROMPTS for a in ("--prompt-ids", p)]
    batch = _run(capsys, folder, *ids, "--batch", 2)
    assert [r["prompt_ids"] for r in batch] == [[int(t) for t in p.split(",")] for p in PROMPTS]
    for p, b in zip(PROMPTS, batch):
        (alone,) = _run(capsys, folder, "--prompt-ids", p)
        assert b["generated_ids"] == alone["generated_ids"], p
        x, y = np.array(b["logits"]), np.array(alone["logits"])
        assert x.shape == y.shape and np.abs(x - y).max() <= 1e-5 * max(1.0, float(np.abs(y).max())), p


def test_the_caches_bytes_a_batch_run_states_are_its_tables():
    """The bytes `run` states for a batch's caches and checks against the machine's memory (batch.cache_bytes) are
    those of the batch step's carried tables: DeepSeek-V3's latent and rotated-key caches, Qwen3-Next's
    full-attention caches, convolution rings and delta-rule states (they were 2 x layers x kv_heads x head_dim a
    row: DeepSeek-V3's shape understated 4.5x, Qwen3-Next's overstated 2.9x)."""
    from lanefuse.engine.front.demo import demo_model
    from lanefuse.engine.front.hfconfig import config_from_hf
    from lanefuse.lane.run.batch import batch_caches, cache_bytes

    from test_deepseek import tiny_cfg
    from test_qwen3next import _cfg

    for cfg in (demo_model()[0], tiny_cfg(), config_from_hf(_cfg())):
        g = cfg.build_step(1, batch=3)
        tables = {n: g.tensors[n].shape for n in cfg.carried()}
        assert cache_bytes(cfg, 3) == 4 * sum(int(np.prod(s)) for s in tables.values()), cfg.arch
        assert cache_bytes(cfg, 3) == sum(t.nbytes for t in batch_caches(cfg, 3).values()), cfg.arch
