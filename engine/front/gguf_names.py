"""The GGUF families lanefuse reads, as data: per `general.architecture`, the transformers architecture it builds, the
GGUF tensor names (llama.cpp's, `{i}` the layer) -> the Hugging Face names the step graph's constants use, and the
tensors llama.cpp's converter stores with their rows permuted (for its adjacent-pair rotation) and by which head count.
A family is one entry here; nothing else names a family."""

from __future__ import annotations

from dataclasses import dataclass, field

# every dense decoder's tensors
TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent: the embedding is tied
}
LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
QKV_BIAS = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
QK_NORM = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
PHI3_LAYER = {  # llama.cpp's phi3: q, k and v in one attn_qkv (or apart), gate and up in one ffn_up (the gate's rows
    # first), as a Phi-3 checkpoint holds them (engine/front/families/phi3.py reads them in parts); no row permutation (NEOX rotation)
    **{k: v for k, v in LAYER.items() if k not in ("ffn_gate.weight", "ffn_up.weight")},
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
GEMMA_LAYER = {  # Gemma's four norms a layer: llama.cpp names the pre-feed-forward one ffn_norm
    **{k: v for k, v in LAYER.items() if k != "ffn_norm.weight"},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
DENSE_FFN = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
# An expert mixture's tensors (llama.cpp's qwen3moe / qwen2moe): the router, and each role's experts in one 3-D tensor
# (E, rows, cols), read as (E·rows, cols); gate and up are stacked into the `moe` op's gate_up rows by engine/front/families/mixtures.py's
# ExpertStore (the `.stacked` names), down is already the op's down rows
EXPERTS = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.stacked",
    "ffn_up_exps.weight": "mlp.experts.up_proj.stacked",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
SHARED_EXPERT = {  # Qwen2-MoE's shared expert and its gate score row (a 1-D tensor in the file, read as one row)
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# Qwen3-Next (llama.cpp's `qwen3next`, every layer a mixture with the shared expert): the layer's norms (held as 1 + w
# by the converter, the gated delta net's own norm as w), a gated attention's q_proj whole (each head's query and gate),
# and the gated delta net's tensors under the HF names engine/front/families/qwen3next.py's split store reads: ssm_in is
# in_proj_qkvz as stored (key-head groups; older converters), attn_qkv / attn_gate its q, k, v rows and z rows apart
# (newer ones), ssm_a holds -exp(A_log), ssm_dt.bias dt_bias, ssm_conv1d the (channels, taps) convolution
QWEN3NEXT_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    **QK_NORM,
    "ssm_in.weight": "linear_attn.in_proj_qkvz.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
# gpt-oss (llama.cpp's `gpt-oss`): biased q/k/v/o, the attention sinks, the norm before the mixture named
# post_attention_norm, a biased router, and each role's experts and their biases apart (gate and up split from the
# checkpoint's interleaved gate_up, rows (out, in)); engine/front/families/gptoss.py's GptOssGGUFStore serves the `moe` op's rows
GPTOSS_LAYER = {
    **{k: v for k, v in LAYER.items() if k not in DENSE_FFN and k != "ffn_norm.weight"},
    **QKV_BIAS,
    "attn_output.bias": "self_attn.o_proj.bias",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    **{f"ffn_{r}_exps.{k}": f"mlp.experts.{r}_proj{'_bias' if k == 'bias' else ''}.gguf"
       for r in ("gate", "up", "down") for k in ("weight", "bias")},
}
# DeepSeek-V3 (llama.cpp's `deepseek2`): latent attention's projections and norms; the key and value expansions
# either in one `attn_kv_b` (older converters) or split, `attn_k_b` stored transposed (H, lora, nope) and `attn_v_b`
# (H, v, lora) (engine/front/families/deepseek_gguf.py puts kv_b_proj back together); the dense first layers' FFN; the mixture's
# router, its correction bias `exp_probs_b`, the stacked experts and the always-on shared experts
DEEPSEEK2_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_k_b.weight": "self_attn.kv_b_proj.k_b",
    "attn_v_b.weight": "self_attn.kv_b_proj.v_b",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{g: LAYER[g] for g in DENSE_FFN},
    **EXPERTS,
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
ROPE_FREQS = "rope_freqs.weight"  # llama3 rope scaling: the factors each inverse frequency is divided by


_MOE_LAYER = {k: v for k, v in LAYER.items() if k not in DENSE_FFN}


@dataclass(frozen=True)
class Family:
    hf_arch: str  # the transformers architecture the step graph is built for
    layer: dict[str, str]  # GGUF name inside `blk.{i}.` -> HF name inside `model.layers.{i}.`
    permuted: dict[str, str] = field(default_factory=dict)  # GGUF layer name -> "heads" | "kv_heads"
    moe: str | None = None  # an expert mixture in every layer: how it weighs its chosen experts (engine/front/gguf.py;
    # "deepseek": its first layers dense, read by engine/front/families/deepseek_gguf.py)
    as_row: tuple[str, ...] = ()  # GGUF layer names of 1-D tensors read as one row (1, n)


FAMILIES = {
    "llama": Family("LlamaForCausalLM", LAYER, permuted={"attn_q.weight": "heads", "attn_k.weight": "kv_heads"}),
    "qwen2": Family("Qwen2ForCausalLM", {**LAYER, **QKV_BIAS}),
    "qwen3": Family("Qwen3ForCausalLM", {**LAYER, **QK_NORM}),
    "phi3": Family("Phi3ForCausalLM", PHI3_LAYER),
    "gemma2": Family("Gemma2ForCausalLM", GEMMA_LAYER),
    "gemma3": Family("Gemma3ForCausalLM", {**GEMMA_LAYER, **QK_NORM}),
    # llama.cpp renormalizes qwen3moe's chosen weights and not qwen2moe's (build_moe_ffn's norm_w), whatever the
    # checkpoint's norm_topk_prob said; `{arch}.expert_weights_norm` overrides where a file holds it
    "qwen3moe": Family("Qwen3MoeForCausalLM", {**_MOE_LAYER, **QK_NORM, **EXPERTS}, moe="normed"),
    "qwen2moe": Family("Qwen2MoeForCausalLM", {**_MOE_LAYER, **QKV_BIAS, **EXPERTS, **SHARED_EXPERT}, moe="plain",
                       as_row=("ffn_gate_inp_shexp.weight",)),
    "qwen3next": Family("Qwen3NextForCausalLM", {**QWEN3NEXT_LAYER, **EXPERTS, **SHARED_EXPERT}, moe="normed",
                        as_row=("ffn_gate_inp_shexp.weight",)),
    # top-k of a biased router, then a softmax over the chosen; the clamped GLU (engine/front/families/gptoss.py's gptoss_from_gguf)
    "gpt-oss": Family("GptOssForCausalLM", GPTOSS_LAYER, moe="gptoss"),
    # latent attention and grouped sigmoid routing, its own keys (engine/front/families/deepseek_gguf.py's deepseek_from_gguf)
    "deepseek2": Family("DeepseekV3ForCausalLM", DEEPSEEK2_LAYER, moe="deepseek"),
}


# llama.cpp writes Mixtral as `llama` with `llama.expert_count`: every layer a mixture (softmax routing, the chosen
# weights renormalized), its experts 3-D tensors, q and k rows permuted as llama's, the experts as wide as
# `llama.feed_forward_length`
MIXTURE_OF = {
    "llama": Family("MixtralForCausalLM", {**_MOE_LAYER, **EXPERTS},
                    permuted={"attn_q.weight": "heads", "attn_k.weight": "kv_heads"}, moe="normed"),
}


def hf_names(family: Family, layers: int) -> dict[str, str]:
    """Every GGUF tensor name the family may hold -> its HF name."""
    out = dict(TOP)
    for i in range(layers):
        out.update({f"blk.{i}.{g}": f"model.layers.{i}.{h}" for g, h in family.layer.items()})
    return out


def read_as_row(family: Family, gguf_name: str) -> bool:
    """Whether 1-D tensor `gguf_name` is read as one row (1, n)."""
    return gguf_name.startswith("blk.") and gguf_name.split(".", 2)[2] in family.as_row


def permuted_by(family: Family, gguf_name: str) -> str | None:
    """The head count ("heads" / "kv_heads") whose adjacent-pair permutation `gguf_name`'s rows carry, or None."""
    if not gguf_name.startswith("blk."):
        return None
    return family.permuted.get(gguf_name.split(".", 2)[2])
