"""The families with a config of their own over real CPU ranks (lane/run/ranks.launch, torch.distributed's gloo): tiny
transformers-made Gemma 2 (f32: soft-capped attention and head, sliding and global layers), Gemma 3 (bf16, untied
head: q/k normed a head at a time, the sliding layers' own rope) and Phi-3 (bf16: its fused qkv_proj and gate_up_proj
read in parts, a window, half its heads' width rotated; f32: GQA, no window) and OLMo 2 (bf16, GQA: its q/k norms
over the whole projection, each rank's part gathered) saved with save_pretrained; a 6-token
prompt in chunks of 4 and 2, then decode; R = 2 (each rank's plan on the numpy backend: run's default) and R = 4
(Phi-3, by the reference interpreter). The tokens equal transformers' and the one-rank run's. The models and runs are
tables in tests/ranks_helpers.py (HF_MODELS, FAMILY_RUNS); the runs of one rank count of the three gloo files are one
launch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ranks_helpers import FAMILY_RUNS, GLOO, check_run, gloo_run  # noqa: E402

pytestmark = GLOO

GATHERS = {"olmo2_bf16": 2 * 2}  # OLMo 2's q and k parts gathered a layer (its norms over the whole projection)


@pytest.mark.parametrize("ranks, names, plan", [(r, tuple(n for n, _ in FAMILY_RUNS[r]),
                                                 all(v.get("plan") for _, v in FAMILY_RUNS[r].values()))
                                                for r in FAMILY_RUNS])
def test_gloo_family_ranks_give_one_ranks_tokens(tmp_path_factory, ranks, names, plan):
    for (name, what), (n_tokens, _) in FAMILY_RUNS[ranks].items():
        by_rank, m = gloo_run(ranks, (name, what), tmp_path_factory)
        assert m["one"].generated_ids == m["hf_tokens"] and len(set(m["hf_tokens"])) > 2, name
        check_run(by_rank, m, f"{name} ({what})", calls=(2 + n_tokens - 1) * (2 * 2 + 1 + GATHERS.get(name, 0)))
