"""Expert parallelism over real CPU ranks: R processes (lane/run/ranks.launch, torch.distributed's gloo) each running
its rank's steps of a tiny transformers-made mixture — Qwen3-MoE (f32; a dense layer among its sparse ones, 7 experts),
Qwen2-MoE (bf16; its shared expert split like a dense FFN, 6 experts) and Mixtral (bf16; 5 experts) — saved with
save_pretrained (the per-expert spelling): a 6-token prompt in chunks of 4 and 2, then decode; R = 2, 3 and 4 where
the KV heads divide (uneven expert parts: 7 over 2 and 3, 5 over 2 and 4, 6 over 2 and 4). The tokens equal
transformers' and the one-rank run's, by each rank's plan on the numpy backend (run's default) and by the reference
interpreter."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ranks_helpers import GLOO, Launches, check_run, hf_reference, job, one_torch_thread, reference  # noqa: E402

pytestmark = GLOO

N_TOKENS = 6
MIXTURES = {"qwen3_moe_f32": (2, 3), "qwen2_moe_bf16": (2, 4), "mixtral_bf16": (2, 4)}  # the rank counts of each
VARIANTS = {"numpy plan": dict(exact=True, plan=True), "reference": dict(exact=True)}
GGUF = [("qwen2moe", "q8_0"), ("qwen3moe", "f32")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each model's folder (or .gguf file), transformers' tokens and logits (none for the llama.cpp files), and the
    one-rank run's."""
    import gguf_files as gf
    from test_deepseek import build as deepseek
    from test_gguf_moe import _model
    from test_gptoss import build as gptoss

    out = {}
    for name in MIXTURES:
        out[name] = m = hf_reference(name, N_TOKENS, tmp_path_factory)
        assert m["cfg"].moe is not None and m["cfg"].moe.sparse
        assert m["one"].generated_ids == m["hf_tokens"], name
    folder = tmp_path_factory.mktemp("ranks_moe")
    with one_torch_thread():
        out["deepseek"] = reference(folder / "deepseek", deepseek("bfloat16", folder / "deepseek"), N_TOKENS)
        out["gptoss"] = reference(folder / "gptoss", gptoss("float32", folder / "gptoss"), N_TOKENS)
    for name in ("deepseek", "gptoss"):
        assert out[name]["one"].generated_ids == out[name]["hf_tokens"], name
    for arch, fmt in GGUF:
        model = _model(arch, **({"num_attention_heads": 4, "num_key_value_heads": 2} if arch == "qwen3moe" else {}))
        out[arch, fmt] = reference(gf.write_gguf(model, folder / f"{arch}-{fmt}.gguf", fmt), None, N_TOKENS)
    return out


@pytest.fixture(scope="module")
def runs(models):
    """Every job of a rank count in one launch: the mixtures by their plans and by the reference interpreter over
    2, 3 and 4 ranks; DeepSeek-V3 by its plans over 2 and the reference interpreter over 4; gpt-oss and the llama.cpp
    files by their plans over 2."""
    jobs = {r: {(n, w): job(models[n], N_TOKENS, **v) for n, rs in MIXTURES.items() if r in rs
                for w, v in VARIANTS.items()} for r in (2, 3, 4)}
    for key, r, plan in [("deepseek", 2, True), ("deepseek", 4, False), ("gptoss", 2, True)] + \
            [(g, 2, True) for g in GGUF]:
        jobs[r][key] = job(models[key], N_TOKENS, exact=True, plan=plan)
    return Launches(jobs)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_gloo_mixture_ranks_give_one_ranks_tokens(models, runs, ranks):
    for name in [n for n, rs in MIXTURES.items() if ranks in rs]:
        for what in VARIANTS:
            steps = 2 + N_TOKENS - 1  # 2 prefill chunks, then decode: 2 all-reduces a layer and the arg-max a step
            check_run(runs(ranks, (name, what)), models[name], f"{name} {what}",
                      calls=steps * (2 * models[name]["cfg"].layers + 1))


def test_gloo_deepseek_ranks_give_one_ranks_tokens(models, runs):
    """tests/test_deepseek.py's tiny DeepSeek-V3 (bf16: latent attention over 4 heads, YaRN, a dense first layer, the
    grouped routing with its correction bias, a shared expert) over 2 gloo ranks (each rank's plan on the numpy
    backend) and 4 (the reference interpreter): transformers' tokens and the one-rank run's."""
    for ranks, what in ((2, "numpy plan"), (4, "reference")):
        check_run(runs(ranks, "deepseek"), models["deepseek"], f"DeepSeek-V3 over {ranks} gloo ranks ({what})")


def test_gloo_gptoss_ranks_give_one_ranks_tokens(models, runs):
    """tests/test_gptoss.py's tiny gpt-oss (f32: biased attention with sinks, sliding and full layers, YaRN, 8 biased
    experts with the clamped GLU) over 2 gloo ranks, each rank's plan on the numpy backend: transformers' tokens and
    the one-rank run's."""
    check_run(runs(2, "gptoss"), models["gptoss"], "gpt-oss over 2 gloo ranks (numpy plan)")


@pytest.mark.parametrize("arch, fmt", GGUF)
def test_gloo_gguf_mixture_ranks_give_one_ranks_tokens(models, runs, arch, fmt):
    """A llama.cpp mixture file (tests/test_gguf_moe.py's tiny model: its experts stacked in ffn_*_exps, gate and up
    apart, interleaved by expert as the rank reads them) over 2 gloo ranks, each rank's plan on the numpy backend:
    the one-rank run's tokens (q8_0: the shared expert's and the o product's parts whole 32-value blocks)."""
    m = models[arch, fmt]
    check_run(runs(2, (arch, fmt)), m, f"{arch} {fmt} over 2 gloo ranks (numpy plan)")
    assert len(set(m["one"].generated_ids)) > 1
