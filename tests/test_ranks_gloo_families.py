"""The families with a config of their own over real CPU ranks (lane/run/ranks.launch, torch.distributed's gloo): tiny
transformers-made Gemma 2 (f32: soft-capped attention and head, sliding and global layers), Gemma 3 (bf16, untied
head: q/k normed a head at a time, the sliding layers' own rope) and Phi-3 (bf16: its fused qkv_proj and gate_up_proj
read in parts, a window, half its heads' width rotated; f32: GQA, no window) and OLMo 2 (bf16, GQA: its q/k norms
over the whole projection, each rank's part gathered) saved with save_pretrained; a 6-token
prompt in chunks of 4 and 2, then decode; R = 2 (each rank's plan on the numpy backend: run's default) and R = 4
(Phi-3, by the reference interpreter). The tokens equal transformers' and the one-rank run's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ranks_helpers import GLOO, Launches, check_run, hf_reference, job  # noqa: E402

pytestmark = GLOO

N_TOKENS = 6
NAMES = ("gemma2_f32", "gemma3_bf16", "phi3_bf16", "phi3_f32", "olmo2_bf16")  # tests/ranks_helpers.HF_MODELS
GATHERS = {"olmo2_bf16": 2 * 2}  # OLMo 2's q and k parts gathered a layer (its norms over the whole projection)
RUNS = {2: (NAMES, True), 4: (("phi3_bf16",), False)}  # ranks: the models, whether by their plans (else reference)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name in NAMES:
        out[name] = m = hf_reference(name, N_TOKENS, tmp_path_factory)
        assert m["one"].generated_ids == m["hf_tokens"] and len(set(m["hf_tokens"])) > 2, name
    return out


@pytest.fixture(scope="module")
def runs(models):
    return Launches({ranks: {name: job(models[name], N_TOKENS, exact=True, plan=plan) for name in names}
                     for ranks, (names, plan) in RUNS.items()})


@pytest.mark.parametrize("ranks, names, plan", [(r, *RUNS[r]) for r in RUNS])
def test_gloo_family_ranks_give_one_ranks_tokens(models, runs, ranks, names, plan):
    for name in names:
        steps = 2 + N_TOKENS - 1
        check_run(runs(ranks, name), models[name], f"{name} ({'numpy plan' if plan else 'reference'})",
                  calls=steps * (2 * 2 + 1 + GATHERS.get(name, 0)))
