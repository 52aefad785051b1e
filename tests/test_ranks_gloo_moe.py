"""Expert parallelism over real CPU ranks: R processes (lane/run/ranks.launch, torch.distributed's gloo) each running
its rank's steps of a tiny transformers-made mixture — Qwen3-MoE (f32; a dense layer among its sparse ones, 7 experts),
Qwen2-MoE (bf16; its shared expert split like a dense FFN, 6 experts) and Mixtral (bf16; 5 experts) — saved with
save_pretrained (the per-expert spelling): a 6-token prompt in chunks of 4 and 2, then decode; R = 2, 3 and 4 where
the KV heads divide (uneven expert parts: 7 over 2 and 3, 5 over 2 and 4, 6 over 2 and 4). The tokens equal
transformers' and the one-rank run's, by each rank's plan on the numpy backend (run's default) and by the reference
interpreter."""

from __future__ import annotations

import time
import zlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_ref import hf_greedy, scaled_error  # noqa: E402
from lanefuse.engine.front.load import load_model  # noqa: E402
from lanefuse.lane.run.generate import generate  # noqa: E402
from lanefuse.lane.run.ranks import gloo_missing, joined_logits, launch  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow,
              pytest.mark.skipif(gloo_missing() is not None, reason=f"CPU ranks need gloo: {gloo_missing()}")]

PROMPT = [3, 17, 5, 42, 8, 11]
N_TOKENS = 6
CHUNK = 4
SMALL = dict(hidden_size=32, num_hidden_layers=2, head_dim=8, intermediate_size=37, vocab_size=61,
             max_position_embeddings=64)
MODELS = {  # name: (config class, its keywords, dtype, the rank counts it runs over)
    "qwen3_moe_f32": ("Qwen3MoeConfig", dict(num_attention_heads=12, num_key_value_heads=6, num_experts=7,
                                             num_experts_per_tok=2, moe_intermediate_size=20, norm_topk_prob=True,
                                             num_hidden_layers=3, mlp_only_layers=[1]), "float32", (2, 3)),
    "qwen2_moe_bf16": ("Qwen2MoeConfig", dict(num_attention_heads=8, num_key_value_heads=4, num_experts=6,
                                              num_experts_per_tok=2, moe_intermediate_size=20,
                                              shared_expert_intermediate_size=24, norm_topk_prob=False),
                       "bfloat16", (2, 4)),
    "mixtral_bf16": ("MixtralConfig", dict(num_attention_heads=8, num_key_value_heads=4, num_local_experts=5,
                                           num_experts_per_tok=2), "bfloat16", (2, 4)),
}


def _save(name: str, folder):
    cls_name, kw, dtype, _ = MODELS[name]
    cfg = getattr(transformers, cls_name)(**{**SMALL, **kw})
    model_cls = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))
    torch.manual_seed(zlib.crc32(name.encode()))
    model = model_cls(cfg).eval()
    with torch.no_grad():  # scales that keep the residual alive and the routing decisive
        for pname, p in model.named_parameters():
            if p.dim() == 1 or "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in pname else 0.1 * torch.randn_like(p))
            elif "embed_tokens" in pname:
                p.copy_(torch.randn_like(p))
            elif pname.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                p.copy_(3 * torch.randn_like(p) / p.shape[-1] ** 0.5)
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    return model_cls.from_pretrained(folder, dtype=torch.float32, experts_implementation="eager").eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each model's folder, transformers' tokens and logits, and the one-rank run's."""
    out = {}
    for name in MODELS:
        folder = tmp_path_factory.mktemp("ranks_moe") / name
        ref = _save(name, folder)
        toks, logits = hf_greedy(ref, PROMPT, N_TOKENS)
        cfg, w = load_model(folder, max_len=32)
        assert cfg.moe is not None and cfg.moe.sparse
        one = generate(cfg, w, PROMPT, N_TOKENS, chunk=CHUNK)
        assert one.generated_ids == toks, name
        out[name] = dict(folder=str(folder), hf_tokens=toks, hf_logits=logits, one=one)
    return out


VARIANTS = {"numpy plan": dict(exact=True, plan=True), "reference": dict(exact=True)}


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_gloo_mixture_ranks_give_one_ranks_tokens(models, ranks):
    names = [n for n, m in MODELS.items() if ranks in m[3]]
    variants = VARIANTS
    jobs = [dict(model=models[n]["folder"], prompt=PROMPT, n_tokens=N_TOKENS, chunk=CHUNK, max_len=32, **v)
            for n in names for v in variants.values()]
    t0 = time.perf_counter()
    res = launch(ranks, jobs)
    print(f"\n{ranks} gloo ranks, {len(jobs)} runs: {time.perf_counter() - t0:.1f} s (process start-up included)")
    for k, name in enumerate(names):
        m = models[name]
        for j, what in enumerate(variants):
            by_rank = res[len(variants) * k + j]
            for r in by_rank:
                assert r["tokens"] == m["hf_tokens"] == m["one"].generated_ids, (name, what)
            logits = joined_logits(by_rank)
            rel_one, rel_hf = scaled_error(logits, m["one"].logits), scaled_error(logits, m["hf_logits"])
            print(f"  {name} {what}: tokens equal; logits vs one rank {rel_one:.1e}, vs transformers {rel_hf:.1e} of "
                  f"their scale; {by_rank[0]['calls']} collectives, {by_rank[0]['bytes']} B sent a rank")
            assert rel_one < 1e-5 and rel_hf < 1e-4
            layers = MODELS[name][1].get("num_hidden_layers", 2)
            steps = 2 + N_TOKENS - 1  # 2 prefill chunks, then decode: 2 all-reduces a layer and the arg-max a step
            assert all(r["calls"] == steps * (2 * layers + 1) for r in by_rank)


def test_gloo_deepseek_ranks_give_one_ranks_tokens(tmp_path):
    """tests/test_deepseek.py's tiny DeepSeek-V3 (bf16: latent attention over 4 heads, YaRN, a dense first layer, the
    grouped routing with its correction bias, a shared expert) over 2 gloo ranks (each rank's plan on the numpy
    backend) and 4 (the reference interpreter): transformers' tokens and the one-rank run's."""
    from test_deepseek import build

    folder = tmp_path / "deepseek"
    ref = build("bfloat16", folder)
    want, hf_logits = hf_greedy(ref, PROMPT, N_TOKENS)
    cfg, w = load_model(folder, max_len=32)
    one = generate(cfg, w, PROMPT, N_TOKENS, chunk=CHUNK)
    assert one.generated_ids == want
    for ranks, plan in ((2, True), (4, False)):
        t0 = time.perf_counter()
        by_rank = launch(ranks, [dict(model=str(folder), prompt=PROMPT, n_tokens=N_TOKENS, chunk=CHUNK, max_len=32,
                                      exact=True, plan=plan)])[0]
        logits = joined_logits(by_rank)
        rel_one, rel_hf = scaled_error(logits, one.logits), scaled_error(logits, hf_logits)
        print(f"\nDeepSeek-V3 over {ranks} gloo ranks ({'numpy plan' if plan else 'reference'}): "
              f"{time.perf_counter() - t0:.1f} s; logits vs one rank {rel_one:.1e}, vs transformers {rel_hf:.1e}")
        assert all(r["tokens"] == want for r in by_rank)
        assert rel_one < 1e-5 and rel_hf < 1e-4


def test_gloo_gptoss_ranks_give_one_ranks_tokens(tmp_path):
    """tests/test_gptoss.py's tiny gpt-oss (f32: biased attention with sinks, sliding and full layers, YaRN, 8 biased
    experts with the clamped GLU) over 2 gloo ranks, each rank's plan on the numpy backend: transformers' tokens and
    the one-rank run's."""
    from test_gptoss import build

    folder = tmp_path / "gptoss"
    ref = build("float32", folder)
    want, hf_logits = hf_greedy(ref, PROMPT, N_TOKENS)
    cfg, w = load_model(folder, max_len=32)
    one = generate(cfg, w, PROMPT, N_TOKENS, chunk=CHUNK)
    assert one.generated_ids == want
    t0 = time.perf_counter()
    by_rank = launch(2, [dict(model=str(folder), prompt=PROMPT, n_tokens=N_TOKENS, chunk=CHUNK, max_len=32,
                              exact=True, plan=True)])[0]
    logits = joined_logits(by_rank)
    rel_one, rel_hf = scaled_error(logits, one.logits), scaled_error(logits, hf_logits)
    print(f"\ngpt-oss over 2 gloo ranks (numpy plan): {time.perf_counter() - t0:.1f} s; logits vs one rank "
          f"{rel_one:.1e}, vs transformers {rel_hf:.1e}")
    assert all(r["tokens"] == want for r in by_rank)
    assert rel_one < 1e-5 and rel_hf < 1e-4


@pytest.mark.parametrize("arch, fmt", [("qwen2moe", "q8_0"), ("qwen3moe", "f32")])
def test_gloo_gguf_mixture_ranks_give_one_ranks_tokens(arch, fmt, tmp_path):
    """A llama.cpp mixture file (tests/test_gguf_moe.py's tiny model: its experts stacked in ffn_*_exps, gate and up
    apart, interleaved by expert as the rank reads them) over 2 gloo ranks, each rank's plan on the numpy backend:
    the one-rank run's tokens (q8_0: the shared expert's and the o product's parts whole 32-value blocks)."""
    import gguf_files as gf
    from test_gguf_moe import _model

    model = _model(arch, **({"num_attention_heads": 4, "num_key_value_heads": 2} if arch == "qwen3moe" else {}))
    path = gf.write_gguf(model, tmp_path / f"{arch}-{fmt}.gguf", fmt)
    cfg, w = load_model(path, max_len=32)
    one = generate(cfg, w, PROMPT, N_TOKENS, chunk=CHUNK)
    by_rank = launch(2, [dict(model=str(path), prompt=PROMPT, n_tokens=N_TOKENS, chunk=CHUNK, max_len=32,
                              exact=True, plan=True)])[0]
    assert all(r["tokens"] == one.generated_ids for r in by_rank) and len(set(one.generated_ids)) > 1
    assert scaled_error(joined_logits(by_rank), one.logits) < 1e-5
