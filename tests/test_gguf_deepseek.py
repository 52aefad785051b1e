"""GGUF DeepSeek-V3 files (issue 15): llama.cpp's `deepseek2` arch as its convert_hf_to_gguf.py (DeepseekV2Model)
writes it — latent attention's attn_q_a / attn_q_a_norm / attn_q_b (or attn_q where q_lora_rank is null),
attn_kv_a_mqa, attn_kv_a_norm, the key and value expansions split into attn_k_b (transposed) and attn_v_b (or one
attn_kv_b, as older converters wrote), the dense first layers, the router, its correction bias exp_probs_b, the stacked
experts and the shared ones; the `deepseek2.*` keys (q/kv_lora_rank, key/value_length_mla, groups, the sigmoid gating
func, the weights' scale and norm, the leading dense blocks) — in f32 and q8_0, read by the front and run by the
reference interpreter and the fused plan against transformers on the file's weights decoded by gguf."""

from __future__ import annotations

import copy

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import gguf_files as gf  # noqa: E402
from hf_ref import hf_greedy, margins_ok, scaled_error  # noqa: E402
from lanefuse.engine.errors import UserError  # noqa: E402
from lanefuse.engine.front.load import load_model  # noqa: E402
from test_deepseek import build  # noqa: E402
from test_gguf import U32, VOCAB, _rewrite  # noqa: E402

pytestmark = pytest.mark.hf

PROMPT = [3, 17, 5, 42, 8, 11, 29, 2, 51, 13]
N = 6
TOL = 1e-4
# every product's rows whole 32-value blocks for q8_0 (attn_k_b's rows, qk_nope_head_dim 16 wide, stay f32);
# 8 experts in 4 groups, 2 kept, top-3; one dense layer first; one shared expert
SHAPE = dict(vocab_size=97, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
             routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=8,
             qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
             max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def tiny(folder, **kw):
    return build("float32", folder, **{**SHAPE, **kw})


def write_deepseek_gguf(model, path, fmt: str = "f32", split_kv: bool = True, tokenizer: bool = False):
    """`model` as llama.cpp's converter writes a DeepseekV3ForCausalLM: products in `fmt` (where their rows fill
    q8_0's blocks), norms, the router and its bias f32; kv_b_proj split into attn_k_b (each head's key expansion
    transposed) and attn_v_b where `split_kv`, else one attn_kv_b; a BPE tokenizer where `tokenizer` (llama.cpp loads
    no file without one). Returns the reference (`model` holding the values
    the file decodes to)."""
    import torch

    c = model.config
    H, n, v, lora, r = (c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank,
                        c.qk_rope_head_dim)
    E, f = c.n_routed_experts, c.moe_intermediate_size
    w = gguf.GGUFWriter(str(path), "deepseek2")
    gf.add_shape_keys(w, path, c, H, 1, lora + r, lora)  # MLA written as MQA over the latent
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_group_count(c.n_group)
    w.add_expert_group_used_count(c.topk_group)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_vocab_size(c.vocab_size)
    if c.q_lora_rank is not None:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(lora)
    w.add_key_length_mla(n + r)
    w.add_value_length_mla(v)
    w.add_expert_feed_forward_length(f)
    w.add_expert_count(E)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    if c.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(r)
    rope = c.rope_parameters
    if rope.get("rope_type") == "yarn":  # the converter: rope.scaling.* from rope_parameters, 0.1 · mscale_all_dim
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(float(rope["beta_fast"]))
        w.add_rope_scaling_yarn_beta_slow(float(rope["beta_slow"]))
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_file_type(gf.FILE_TYPES[fmt])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if tokenizer:
        gf.add_tokenizer(w, gf.bpe_tokenizer(c.vocab_size, "qwen2")[1:])

    sd = {k: t.detach().float().numpy() for k, t in model.state_dict().items()}
    decoded: dict[str, np.ndarray] = {}

    def put(gname, hf, a=None, f32=False):
        a = sd[hf] if a is None else a
        if a.ndim == 1 or f32:
            w.add_tensor(gname, np.ascontiguousarray(a, np.float32))
            return a
        kind = fmt if a.shape[-1] % 32 == 0 else "f32"  # rows that fill no whole q8_0 blocks stay f32
        gf.add_rows(w, gname, a, kind)
        back = gf.decoded(a.reshape(-1, a.shape[-1]), kind).reshape(a.shape)
        if a is sd.get(hf):
            decoded[hf] = back
        return back

    put("token_embd.weight", "model.embed_tokens.weight")
    put("output_norm.weight", "model.norm.weight")
    put("output.weight", "lm_head.weight")
    for i in range(c.num_hidden_layers):
        p, b, a = f"model.layers.{i}.", f"blk.{i}.", f"model.layers.{i}.self_attn."
        put(b + "attn_norm.weight", p + "input_layernorm.weight")
        put(b + "ffn_norm.weight", p + "post_attention_layernorm.weight")
        if c.q_lora_rank is not None:
            put(b + "attn_q_a.weight", a + "q_a_proj.weight")
            put(b + "attn_q_a_norm.weight", a + "q_a_layernorm.weight")
            put(b + "attn_q_b.weight", a + "q_b_proj.weight")
        else:
            put(b + "attn_q.weight", a + "q_proj.weight")
        put(b + "attn_kv_a_mqa.weight", a + "kv_a_proj_with_mqa.weight")
        put(b + "attn_kv_a_norm.weight", a + "kv_a_layernorm.weight")
        kvb = sd[a + "kv_b_proj.weight"].reshape(H, n + v, lora)
        if split_kv:  # the converter: view (H, n + v, lora), split, k_b transposed (H, lora, n)
            kb = put(b + "attn_k_b.weight", None, np.ascontiguousarray(kvb[:, :n].transpose(0, 2, 1)))
            vb = put(b + "attn_v_b.weight", None, np.ascontiguousarray(kvb[:, n:]))
            decoded[a + "kv_b_proj.weight"] = np.concatenate([kb.transpose(0, 2, 1), vb], 1).reshape(-1, lora)
        else:
            put(b + "attn_kv_b.weight", a + "kv_b_proj.weight")
        put(b + "attn_output.weight", a + "o_proj.weight")
        if i < c.first_k_dense_replace:
            for g in ("gate", "up", "down"):
                put(b + f"ffn_{g}.weight", p + f"mlp.{g}_proj.weight")
            continue
        put(b + "ffn_gate_inp.weight", p + "mlp.gate.weight", f32=True)
        put(b + "exp_probs_b.bias", p + "mlp.gate.e_score_correction_bias")
        gu = sd[p + "mlp.experts.gate_up_proj"]  # (E, 2f, d): gate rows, then up rows
        g_ = put(b + "ffn_gate_exps.weight", None, np.ascontiguousarray(gu[:, :f]))
        u_ = put(b + "ffn_up_exps.weight", None, np.ascontiguousarray(gu[:, f:]))
        decoded[p + "mlp.experts.gate_up_proj"] = np.concatenate([g_, u_], 1)
        put(b + "ffn_down_exps.weight", p + "mlp.experts.down_proj")
        for g in ("gate", "up", "down"):
            put(b + f"ffn_{g}_shexp.weight", p + f"mlp.shared_experts.{g}_proj.weight")
    gf.finish(w, path)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, t in ref.named_parameters():
            if name in decoded:
                t.copy_(torch.from_numpy(decoded[name].reshape(t.shape)))
    return ref.eval()


# YaRN as DeepSeek-V3's config.json has it (mscale == mscale_all_dim: llama.cpp's reading), a factor that moves the
# frequencies and a softmax scale mscale² = 1.23
YARN = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.8,
                            "mscale_all_dim": 0.8, "rope_theta": 10000.0, "beta_fast": 32, "beta_slow": 1}}
VARIANTS = {  # name -> (fmt, split kv_b, config changes)
    "f32-split": ("f32", True, {}),
    "q8_0-split": ("q8_0", True, {}),
    "q8_0-kv_b": ("q8_0", False, {}),
    "q8_0-yarn": ("q8_0", True, YARN),
    "f32-no-q-lora": ("f32", True, {"q_lora_rank": None, "n_shared_experts": 2, "first_k_dense_replace": 0}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gguf_deepseek_parity_with_transformers(variant, tmp_path):
    """The reference interpreter and the fused plan (a chunk of 4, then decode steps) against transformers on the
    file's weights: the same greedy tokens, logits within 1e-4 of their scale."""
    fmt, split, kw = VARIANTS[variant]
    ref = write_deepseek_gguf(tiny(tmp_path / "hf", **kw), tmp_path / f"ds-{variant}.gguf", fmt, split)
    want, want_logits = hf_greedy(ref, PROMPT, N)
    assert len(set(want)) > 2 and margins_ok(want_logits)
    cfg, weights = load_model(tmp_path / f"ds-{variant}.gguf")
    assert cfg.arch == "DeepseekV3ForCausalLM" and cfg.groups == 4 and cfg.topk_groups == 2 and cfg.moe.k == 3
    assert cfg.q_lora == (0 if "no-q-lora" in variant else 32) and cfg.nope == 16 and cfg.v_dim == 8
    assert cfg.route_scale == 2.5 and cfg.moe.norm_topk
    if fmt == "q8_0":
        assert cfg.fmt("model.layers.1.self_attn.o_proj.weight") == "q8_0"
        assert cfg.fmt("model.layers.1.mlp.experts.gate_up_proj") == "q8_0"
        assert cfg.fmt("model.layers.1.self_attn.kv_b_proj.v_rows") == ("f32" if split else "q8_0")
    gf.check_plans(cfg, weights, want, want_logits, PROMPT, N, f"deepseek2 {variant}", TOL)


def test_gguf_deepseek_refusals_are_one_line(tmp_path):
    src = tmp_path / "m.gguf"
    write_deepseek_gguf(tiny(tmp_path / "hf"), src, "f32")
    dst = tmp_path / "bad.gguf"
    cases = [
        (dict(drop_tensors=("blk.1.attn_v_b.weight",)), r"has `blk.1.attn_k_b.weight` but no `blk.1.attn_v_b.weight`"),
        (dict(drop_tensors=("blk.2.attn_k_b.weight", "blk.2.attn_v_b.weight")),
         r"no tensor `blk.2.attn_kv_b.weight`.*nor `blk.2.attn_k_b.weight`"),
        (dict(drop_tensors=("blk.0.attn_q_b.weight",)), r"no tensor `blk.0.attn_q_b.weight`.*q_lora_rank"),
        (dict(drop_tensors=("blk.1.exp_probs_b.bias",)), r"no tensor `blk.1.exp_probs_b.bias`"),
        (dict(drop_tensors=("blk.1.ffn_up_exps.weight",)), r"blk.1.ffn_up_exps.weight"),
        (dict(drop_keys=("deepseek2.attention.kv_lora_rank",)), r"missing `deepseek2.attention.kv_lora_rank`"),
        (dict(drop_keys=("deepseek2.expert_gating_func",)), r"missing `deepseek2.expert_gating_func`.*softmax"),
        (dict(set_keys={"deepseek2.expert_gating_func": (1, U32)}), r"expert_gating_func` is 1"),
        (dict(set_keys={"deepseek2.expert_group_used_count": (5, U32)}), r"expert_group_used_count` 5 is more"),
        (dict(set_keys={"deepseek2.attention.value_length_mla": (12, U32)}), r"attn_v_b.weight` has shape"),
        (dict(set_keys={"deepseek2.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING)}),
         r"YaRN without `deepseek2.rope.scaling.yarn_log_multiplier`"),
        (dict(set_keys={"deepseek2.nextn_predict_layers": (1, U32)}), r"nextn_predict_layers` is 1"),
        (dict(set_keys={"deepseek2.leading_dense_block_count": (10 ** 9, U32)}),
         r"leading_dense_block_count` is 1000000000; expected a count \(0\.\.\d+\)"),
        (dict(set_keys={"deepseek2.expert_count": (10 ** 9, U32)}), r"call for [\d,]+ weight values"),
        (dict(set_keys={"deepseek2.rope.scaling.type": ("longrope", gguf.GGUFValueType.STRING)}),
         r"rope.scaling.type` is 'longrope'"),
    ]
    for how, msg in cases:
        _rewrite(src, dst, **how)
        with pytest.raises(UserError, match=msg) as e:
            load_model(dst)
        assert "\n" not in str(e.value), str(e.value)


@pytest.mark.llamacpp
@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_llama_cpp_on_a_deepseek_file(rope, tmp_path):
    """llama.cpp decoding the f32 file written here: the same tokens as transformers and lanefuse's fused plan,
    logits within 1e-4 of their scale (its names, keys, rope and grouped routing are llama.cpp's)."""
    pytest.importorskip("llama_cpp")
    path = tmp_path / "ds.gguf"
    kw = {"vocab_size": VOCAB, **(YARN if rope == "yarn" else {})}  # a BPE needs 258 tokens or more
    ref = write_deepseek_gguf(tiny(tmp_path / "hf", **kw), path, "f32", tokenizer=True)
    gf.check_llama_cpp(path, ref, PROMPT, N, f"deepseek2 f32 {rope}")


def test_yarn_the_softmax_scale_and_the_pair_rotation_matter(tmp_path):
    """The parity above is not blind to the file's reading: without YaRN's frequencies, without mscale² in the softmax
    scale, or rotating halves instead of llama.cpp's adjacent pairs, the logits leave transformers'."""
    import dataclasses

    from lanefuse.engine.front.weights import Weights
    from lanefuse.lane.run.generate import generate

    path = tmp_path / "m.gguf"
    ref = write_deepseek_gguf(tiny(tmp_path / "hf", **YARN), path, "f32")
    _, want_logits = hf_greedy(ref, PROMPT, 2)
    cfg, weights = load_model(path)
    assert abs(cfg.scale * 24 ** 0.5 - (0.08 * np.log(4.0) + 1) ** 2) < 1e-6
    for bad in (dataclasses.replace(cfg, rope_scaling=()), dataclasses.replace(cfg, scale=24 ** -0.5),
                dataclasses.replace(cfg, interleave=False)):
        w = Weights(weights.store if bad.interleave else bad.serve(weights.store.inner, str(path)), bad)
        got = generate(bad, w, PROMPT, 2, chunk=4)
        rel = scaled_error(got.logits, want_logits)
        assert rel > 4 * TOL, rel
