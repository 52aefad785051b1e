"""Phi-3 (`Phi3ForCausalLM`): Llama's step over a checkpoint that holds each layer's q, k and v projections as one
`self_attn.qkv_proj` (q's rows, then k's, then v's) and its gate and up projections as one `mlp.gate_up_proj` (the
gate's rows, then the up's). The step reads them in parts, as Llama's names, each served as rows of the stored tensor
(engine/front/weights.py's PartsStore: a view of its rows, a block format's rows still whole blocks), so Phi-3 plans and
fuses as Llama does. Every layer's attention is over the last `sliding_window` positions where the config gives one
(hfconfig.py reads it). A checkpoint already holding the parts apart is read as it is."""

from __future__ import annotations

from dataclasses import dataclass, fields

from lanefuse.engine.errors import UserError
from lanefuse.engine.front.model import ModelConfig
from lanefuse.engine.front.weights import PartsStore

ARCHS = ("Phi3ForCausalLM",)


@dataclass(frozen=True)
class Phi3Config(ModelConfig):
    def split_store(self, base, where: str) -> PartsStore:
        return PartsStore(base, fused_parts(self, base, where), where)


def fused_parts(cfg: ModelConfig, base, where: str) -> dict:
    """Each layer's q, k, v, gate and up rows as parts of its fused tensors (PartsStore's table); a fused tensor
    missing, or of a shape the config does not give, named at load."""
    name_of = getattr(base, "file_name", lambda n: n)
    have = set(base.names())
    q, kv, d, f = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.hidden, cfg.inter
    parts = {}
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        for src, split in (("self_attn.qkv_proj.weight", {"self_attn.q_proj.weight": (0, q),
                                                          "self_attn.k_proj.weight": (q, q + kv),
                                                          "self_attn.v_proj.weight": (q + kv, q + 2 * kv)}),
                           ("mlp.gate_up_proj.weight", {"mlp.gate_proj.weight": (0, f),
                                                        "mlp.up_proj.weight": (f, 2 * f)})):
            if all(p + n in have for n in split):
                continue  # held apart already
            want = (max(b for _, b in split.values()), d)
            if p + src not in have:
                raise UserError(f"{where}: the checkpoint has no tensor `{name_of(p + src)}` (expected shape {want}; "
                                f"nor its parts {', '.join(f'`{n}`' for n in split)} apart)")
            got = tuple(base.info(p + src)[0])
            if got != want:
                raise UserError(f"{where}: tensor `{name_of(p + src)}` has shape {got}, expected {want} (from the "
                                f"model's config)")
            for name, (a, b) in split.items():
                parts[p + name] = (((p + src, slice(a, b)),), (b - a, d))
    return parts


def phi3_from_gguf(cfg: ModelConfig, r, arch: str, where: str, tensors: dict) -> Phi3Config:
    """A phi3 GGUF file's model (`cfg` as engine/front/gguf.py reads any dense decoder): a Phi3Config, every layer's window
    from `phi3.attention.sliding_window`; LongRoPE (its factor tensors) refused."""
    long = [n for n in ("rope_factors_long.weight", "rope_factors_short.weight") if n in tensors]
    if long or r.has("rope.scaling.attn_factor"):
        why = f"tensor `{long[0]}`" if long else f"`{arch}.rope.scaling.attn_factor`"
        raise UserError(f"{where}: {why}: LongRoPE scaling (Phi-3's 128k variants) is not supported")
    window = r.size("attention.sliding_window") if r.has("attention.sliding_window") else 0
    return Phi3Config(**{**{f.name: getattr(cfg, f.name) for f in fields(cfg)}, "window": window})
