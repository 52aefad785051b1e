"""A transformers `config.json` (as 4.x writes it: rope_theta, rope_scaling; or 5.x: rope_parameters) read into a
`ModelConfig`, refusing in words what the step builder cannot express."""

from __future__ import annotations

from typing import Any

from lanefuse.engine.errors import UserError
from lanefuse.engine.model import ModelConfig

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3")
ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(c: dict[str, Any], where: str) -> tuple[float, tuple[tuple[str, Any], ...], float]:
    """rope_theta, the scaling entries (rope_type and its factors), partial rotary factor."""
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise UserError(f"{where}: rope_parameters / rope_scaling must be mappings")
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", c.get("rope_theta", 10000.0)))
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UserError(f"{where}: rope type `{kind}` is not supported (supported: {', '.join(ROPE_TYPES)})")
    entries = [("rope_type", kind)]
    for k in ROPE_KEYS:
        if kind != "default" and k in merged:
            entries.append((k, float(merged[k]) if k != "original_max_position_embeddings" else int(merged[k])))
    if kind == "linear" and "factor" not in merged:
        raise UserError(f"{where}: linear rope scaling without a `factor`")
    if kind == "llama3":
        missing = [k for k in ROPE_KEYS if k not in merged]
        if missing:
            raise UserError(f"{where}: llama3 rope scaling lacks {', '.join(missing)}")
    partial = float(merged.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))
    return theta, tuple(entries) if kind != "default" else (), partial


def config_from_hf(c: dict[str, Any], where: str = "config.json", max_len: int = 512, name: str = "model") -> ModelConfig:
    archs = c.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED:
        raise UserError(f"{where}: architecture `{arch}` is not supported (supported: {', '.join(SUPPORTED)})")

    def need(key: str) -> int:
        if key not in c or c[key] is None:
            raise UserError(f"{where}: missing `{key}`")
        return int(c[key])

    if c.get("hidden_act", "silu") != "silu":
        raise UserError(f"{where}: hidden_act `{c['hidden_act']}` is not supported (only silu)")
    if c.get("mlp_bias"):
        raise UserError(f"{where}: mlp_bias is not supported")
    if arch == "LlamaForCausalLM" and c.get("attention_bias"):
        raise UserError(f"{where}: attention_bias (an o_proj bias) is not supported for Llama")
    if arch == "Qwen3ForCausalLM" and c.get("attention_bias"):
        raise UserError(f"{where}: attention_bias is not supported for Qwen3")
    if c.get("use_sliding_window"):
        raise UserError(f"{where}: sliding-window attention (use_sliding_window) is not supported")
    hidden, heads = need("hidden_size"), need("num_attention_heads")
    kv = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    theta, scaling, partial = _rope(c, where)
    max_pos = int(c.get("max_position_embeddings") or max_len)
    return ModelConfig(
        arch=arch, hidden=hidden, layers=need("num_hidden_layers"), heads=heads, kv_heads=kv, head_dim=head_dim,
        inter=need("intermediate_size"), vocab=need("vocab_size"), eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling, partial_rotary=partial,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM", qk_norm=arch == "Qwen3ForCausalLM",
        max_len=min(max_len, max_pos), name=name,
    )
