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
