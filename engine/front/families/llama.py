"""Llama (`LlamaForCausalLM`), Mistral (`MistralForCausalLM`: every layer over the last `sliding_window` positions)
and Phi-3 (`Phi3ForCausalLM`), transformers' dense decoder and the front's default step (engine/front/model.py), and
GGUF's `llama` (its q/k rows permuted for llama.cpp's adjacent-pair rotation; with `llama.expert_count`, Mixtral) and
`phi3`.

Phi-3: Llama's step over a checkpoint that holds each layer's q, k and v projections as one
`self_attn.qkv_proj` (q's rows, then k's, then v's) and its gate and up projections as one `mlp.gate_up_proj` (the
gate's rows, then the up's). The step reads them in parts, as Llama's names, each served as rows of the stored tensor
(engine/front/weights.py's PartsStore: a view of its rows, a block format's rows still whole blocks), so Phi-3 plans and
fuses as Llama does. Every layer's attention is over the last `sliding_window` positions where the config gives one
(read_decoder reads it). A checkpoint already holding the parts apart is read as it is."""

from __future__ import annotations

from dataclasses import dataclass, fields

from lanefuse.engine.errors import UserError
from lanefuse.engine.front.family import Family
from lanefuse.engine.front.gguf_names import EXPERTS, LAYER, MOE_LAYER, Names
from lanefuse.engine.front.hfconfig import read_decoder
from lanefuse.engine.front.model import ModelConfig
from lanefuse.engine.front.weights import PartsStore

PERMUTED = {"attn_q.weight": "heads", "attn_k.weight": "kv_heads"}  # llama.cpp's rows for its adjacent-pair rotation
PHI3_LAYER = {  # llama.cpp's phi3: q, k and v in one attn_qkv (or apart), gate and up in one ffn_up (the gate's rows
    # first), as a Phi-3 checkpoint holds them (read in parts, below); no row permutation (NEOX rotation)
    **{k: v for k, v in LAYER.items() if k not in ("ffn_gate.weight", "ffn_up.weight")},
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}


class Llama(Family):
    name = "llama"
    hf = ("LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM")
    gguf = {
        # llama.cpp writes Mixtral as `llama` with `llama.expert_count`: every layer a mixture (softmax routing, the
        # chosen weights renormalized), its experts 3-D tensors, q and k rows permuted as llama's, the experts as wide
        # as `llama.feed_forward_length`
        "llama": Names("LlamaForCausalLM", LAYER, permuted=PERMUTED,
                       mixture=Names("MixtralForCausalLM", {**MOE_LAYER, **EXPERTS}, permuted=PERMUTED, moe="normed",
                                     experts_ffn=True)),
        "phi3": Names("Phi3ForCausalLM", PHI3_LAYER),
    }

    @classmethod
    def read_config(cls, c, arch, where, max_len, name):
        llama = arch == "LlamaForCausalLM"  # its MLP's activation and biases as the config says (transformers')
        return read_decoder(c, arch, where, max_len, name, llama=llama, windowed=not llama,
                            config=Phi3Config if arch == "Phi3ForCausalLM" else ModelConfig)

    @classmethod
    def names(cls, arch, meta):
        n = cls.gguf[arch]
        return n.mixture if n.mixture is not None and meta.get(f"{arch}.expert_count") else n

    @classmethod
    def from_gguf(cls, cfg, r, arch, where, meta, tensors):
        return phi3_from_gguf(cfg, r, arch, where, tensors) if arch == "phi3" else cfg


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
    """A phi3 GGUF file's model (`cfg` as gguf.py reads any dense decoder): a Phi3Config, every layer's window
    from `phi3.attention.sliding_window`; LongRoPE (its factor tensors) refused."""
    long = [n for n in ("rope_factors_long.weight", "rope_factors_short.weight") if n in tensors]
    if long or r.has("rope.scaling.attn_factor"):
        why = f"tensor `{long[0]}`" if long else f"`{arch}.rope.scaling.attn_factor`"
        raise UserError(f"{where}: {why}: LongRoPE scaling (Phi-3's 128k variants) is not supported")
    window = r.size("attention.sliding_window") if r.has("attention.sliding_window") else 0
    return Phi3Config(**{**{f.name: getattr(cfg, f.name) for f in fields(cfg)}, "window": window})
