"""Expert parallelism over real CPU ranks: R processes (lane/run/ranks.launch, torch.distributed's gloo) each running
its rank's steps of a tiny transformers-made mixture — Qwen3-MoE (f32; a dense layer among its sparse ones, 7 experts),
Qwen2-MoE (bf16; its shared expert split like a dense FFN, 6 experts) and Mixtral (bf16; 5 experts) — saved with
save_pretrained (the per-expert spelling): a 6-token prompt in chunks of 4 and 2, then decode; R = 2, 3 and 4 where
the KV heads divide (uneven expert parts: 7 over 2 and 3, 5 over 2 and 4, 6 over 2 and 4). The tokens equal
transformers' and the one-rank run's, by each rank's plan on the numpy backend (run's default) and by the reference
interpreter. The models and runs are tables in tests/ranks_helpers.py (HF_MODELS, MIXTURE_RUNS, OTHER_RUNS); the runs
of one rank count of the three gloo files are one launch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ranks_helpers import GLOO, MIXTURE_RUNS, check_run, gloo_run  # noqa: E402

pytestmark = GLOO


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_gloo_mixture_ranks_give_one_ranks_tokens(tmp_path_factory, ranks):
    """Each mixture over the rank counts its KV heads allow (tests/ranks_helpers.MIXTURE_RUNS), by its plans and by
    the reference interpreter."""
    for (name, what), (n_tokens, _) in MIXTURE_RUNS[ranks].items():
        by_rank, m = gloo_run(ranks, (name, what), tmp_path_factory)
        assert m["cfg"].moe is not None and m["cfg"].moe.sparse
        assert m["one"].generated_ids == m["hf_tokens"], name
        steps = 2 + n_tokens - 1  # 2 prefill chunks, then decode: 2 all-reduces a layer and the arg-max a step
        check_run(by_rank, m, f"{name} {what}", calls=steps * (2 * m["cfg"].layers + 1))


def test_gloo_deepseek_ranks_give_one_ranks_tokens(tmp_path_factory):
    """tests/test_deepseek.py's tiny DeepSeek-V3 (bf16: latent attention over 4 heads, YaRN, a dense first layer, the
    grouped routing with its correction bias, a shared expert) over 2 gloo ranks (each rank's plan on the numpy
    backend) and 4 (the reference interpreter): transformers' tokens and the one-rank run's."""
    for ranks, what in ((2, "numpy plan"), (4, "reference")):
        by_rank, m = gloo_run(ranks, ("deepseek", what), tmp_path_factory)
        assert m["one"].generated_ids == m["hf_tokens"]
        check_run(by_rank, m, f"DeepSeek-V3 over {ranks} gloo ranks ({what})")


def test_gloo_gptoss_ranks_give_one_ranks_tokens(tmp_path_factory):
    """tests/test_gptoss.py's tiny gpt-oss (f32: biased attention with sinks, sliding and full layers, YaRN, 8 biased
    experts with the clamped GLU) over 2 gloo ranks, each rank's plan on the numpy backend: transformers' tokens and
    the one-rank run's."""
    by_rank, m = gloo_run(2, ("gptoss", "numpy plan"), tmp_path_factory)
    assert m["one"].generated_ids == m["hf_tokens"]
    check_run(by_rank, m, "gpt-oss over 2 gloo ranks (numpy plan)")


@pytest.mark.parametrize("arch, fmt", [("qwen2moe", "q8_0"), ("qwen3moe", "f32")])
def test_gloo_gguf_mixture_ranks_give_one_ranks_tokens(tmp_path_factory, arch, fmt):
    """A llama.cpp mixture file (tests/test_gguf_moe.py's tiny model: its experts stacked in ffn_*_exps, gate and up
    apart, interleaved by expert as the rank reads them) over 2 gloo ranks, each rank's plan on the numpy backend:
    the one-rank run's tokens (q8_0: the shared expert's and the o product's parts whole 32-value blocks)."""
    by_rank, m = gloo_run(2, (f"{arch}-{fmt}", "numpy plan"), tmp_path_factory)
    check_run(by_rank, m, f"{arch} {fmt} over 2 gloo ranks (numpy plan)")
    assert len(set(m["one"].generated_ids)) > 1
