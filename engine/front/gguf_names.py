"""GGUF tensor names as data: the blocks every family's table is made of (llama.cpp's names, `{i}` the layer -> the
Hugging Face names the step graph's constants use), and `Names`, one `general.architecture`'s table: the
transformers architecture it builds, the tensors llama.cpp's converter stores with their rows permuted (for its
adjacent-pair rotation) and by which head count. Each family's own table is in its file (engine/front/families/)."""

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
DENSE_FFN = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
# An expert mixture's tensors (llama.cpp's qwen3moe / qwen2moe): the router, and each role's experts in one 3-D tensor
# (E, rows, cols), read as (E·rows, cols); gate and up are stacked into the `moe` op's gate_up rows by
# families/mixtures.py's ExpertStore (the `.stacked` names), down is already the op's down rows
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
ROPE_FREQS = "rope_freqs.weight"  # llama3 rope scaling: the factors each inverse frequency is divided by


MOE_LAYER = {k: v for k, v in LAYER.items() if k not in DENSE_FFN}


@dataclass(frozen=True)
class Names:
    """One GGUF architecture's tensor names (a family's `gguf` table, engine/front/family.py)."""

    hf_arch: str  # the transformers architecture the step graph is built for
    layer: dict[str, str]  # GGUF name inside `blk.{i}.` -> HF name inside `model.layers.{i}.`
    permuted: dict[str, str] = field(default_factory=dict)  # GGUF layer name -> "heads" | "kv_heads"
    moe: str | None = None  # an expert mixture in every layer: how it weighs its chosen experts (engine/front/gguf.py;
    # "deepseek": its first layers dense, read by families/deepseek.py)
    as_row: tuple[str, ...] = ()  # GGUF layer names of 1-D tensors read as one row (1, n)
    mixture: "Names | None" = None  # the names where `{arch}.expert_count` is set (Mixtral, written as llama)
    experts_ffn: bool = False  # the experts as wide as `{arch}.feed_forward_length` where no expert width is given


def hf_names(family: Names, layers: int) -> dict[str, str]:
    """Every GGUF tensor name the family may hold -> its HF name."""
    out = dict(TOP)
    for i in range(layers):
        out.update({f"blk.{i}.{g}": f"model.layers.{i}.{h}" for g, h in family.layer.items()})
    return out


def read_as_row(family: Names, gguf_name: str) -> bool:
    """Whether 1-D tensor `gguf_name` is read as one row (1, n)."""
    return gguf_name.startswith("blk.") and gguf_name.split(".", 2)[2] in family.as_row


def permuted_by(family: Names, gguf_name: str) -> str | None:
    """The head count ("heads" / "kv_heads") whose adjacent-pair permutation `gguf_name`'s rows carry, or None."""
    if not gguf_name.startswith("blk."):
        return None
    return family.permuted.get(gguf_name.split(".", 2)[2])
