"""The families with a config of their own over real CPU ranks (lane/run/ranks.launch, torch.distributed's gloo): tiny
transformers-made Gemma 2 (f32: soft-capped attention and head, sliding and global layers), Gemma 3 (bf16, untied
head: q/k normed a head at a time, the sliding layers' own rope) and Phi-3 (bf16: its fused qkv_proj and gate_up_proj
read in parts, a window, half its heads' width rotated; f32: GQA, no window) and OLMo 2 (bf16, GQA: its q/k norms
over the whole projection, each rank's part gathered) saved with save_pretrained; a 6-token
prompt in chunks of 4 and 2, then decode; R = 2 (each rank's plan on the numpy backend: run's default) and R = 4
(Phi-3, by the reference interpreter). The tokens equal transformers' and the one-rank run's."""

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
MODELS = {  # name: (config class, model class, its keywords, dtype)
    "gemma2_f32": ("Gemma2Config", "Gemma2ForCausalLM",
                   dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, intermediate_size=37, vocab_size=97, sliding_window=3, query_pre_attn_scalar=20,
                        attn_logit_softcapping=1.5, final_logit_softcapping=3.0), "float32"),
    "gemma3_bf16": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=29, vocab_size=101, sliding_window=3, query_pre_attn_scalar=16,
                         layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
                         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
                    "bfloat16"),
    "phi3_bf16": ("Phi3Config", "Phi3ForCausalLM",
                  dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                       intermediate_size=37, vocab_size=97, sliding_window=4, partial_rotary_factor=0.5,
                       pad_token_id=0), "bfloat16"),
    "phi3_f32": ("Phi3Config", "Phi3ForCausalLM",
                 dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                      intermediate_size=37, vocab_size=97, sliding_window=None, pad_token_id=0), "float32"),
    "olmo2_bf16": ("Olmo2Config", "Olmo2ForCausalLM",
                   dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, intermediate_size=37, vocab_size=97, eos_token_id=2, pad_token_id=0), "bfloat16"),
}
GATHERS = {"olmo2_bf16": 2 * 2}  # OLMo 2's q and k parts gathered a layer (its norms over the whole projection)


def _save(name: str, folder):
    cfg_name, model_name, kw, dtype = MODELS[name]
    cfg = getattr(transformers, cfg_name)(max_position_embeddings=64, **kw)
    model_cls = getattr(transformers, model_name)
    torch.manual_seed(zlib.crc32(name.encode()))
    model = model_cls(cfg).eval()
    gemma = name.startswith("gemma")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_((0.5 + 0.3 * torch.randn_like(p)) if gemma else (1.0 + 0.1 * torch.randn_like(p)))
            elif "embed_tokens" in pname:
                p.copy_(torch.randn_like(p) * (0.05 if gemma else 1.0))
            elif p.ndim == 2:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    return model_cls.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name in MODELS:
        folder = tmp_path_factory.mktemp("ranks_fam") / name
        ref = _save(name, folder)
        toks, logits = hf_greedy(ref, PROMPT, N_TOKENS)
        cfg, w = load_model(folder, max_len=32)
        one = generate(cfg, w, PROMPT, N_TOKENS, chunk=CHUNK)
        assert one.generated_ids == toks and len(set(toks)) > 2, name
        out[name] = dict(folder=str(folder), hf_tokens=toks, hf_logits=logits, one=one)
    return out


@pytest.mark.parametrize("ranks, names, plan", [(2, tuple(MODELS), True), (4, ("phi3_bf16",), False)])
def test_gloo_family_ranks_give_one_ranks_tokens(models, ranks, names, plan):
    jobs = [dict(model=models[n]["folder"], prompt=PROMPT, n_tokens=N_TOKENS, chunk=CHUNK, max_len=32, exact=True,
                 plan=plan) for n in names]
    t0 = time.perf_counter()
    res = launch(ranks, jobs)
    print(f"\n{ranks} gloo ranks, {len(jobs)} runs: {time.perf_counter() - t0:.1f} s (process start-up included)")
    for name, by_rank in zip(names, res):
        m = models[name]
        for r in by_rank:
            assert r["tokens"] == m["hf_tokens"] == m["one"].generated_ids, name
        logits = joined_logits(by_rank)
        rel_one, rel_hf = scaled_error(logits, m["one"].logits), scaled_error(logits, m["hf_logits"])
        print(f"  {name} ({'numpy plan' if plan else 'reference'}): tokens equal; logits vs one rank {rel_one:.1e}, "
              f"vs transformers {rel_hf:.1e} of their scale")
        assert rel_one < 1e-5 and rel_hf < 1e-4
        steps = 2 + N_TOKENS - 1
        assert all(r["calls"] == steps * (2 * 2 + 1 + GATHERS.get(name, 0)) for r in by_rank)
