"""A dense decoder's shape (`ModelConfig`) and the step graph of one decode step or prefill chunk built from it
(`build_step`). Shapes only: the weights live in the model's weight store, which the graph's constants name."""

from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import Any

from lanefuse.engine.errors import UserError
from lanefuse.engine.front.decoder import build, embed, logits, pre_norm_layer
from lanefuse.engine.ir import Graph



LAYER_TYPES = ("sliding_attention", "full_attention")


def read_layer_types(r, layers: int, first, kinds: tuple[str, str] = LAYER_TYPES) -> tuple[str, ...]:
    """config.json's `layer_types` (a list of `layers` of `kinds`), or transformers' default for the family where it
    has none: `first(i)` whether layer i is of the first kind (sliding; Qwen3-Next's: linear attention)."""
    types = r.c.get("layer_types")
    if types is None:
        return tuple(kinds[0] if first(i) else kinds[1] for i in range(layers))
    if not isinstance(types, list) or len(types) != layers:
        raise UserError(f"{r.where}: `layer_types` is {types!r:.40}; expected a list of {layers} layer types (one a "
                        f"layer: {' or '.join(kinds)})")
    for i, t in enumerate(types):
        if t not in kinds:
            raise UserError(f"{r.where}: `layer_types[{i}]` is {t!r:.40}; expected {' or '.join(kinds)}")
    return tuple(types)


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # LlamaForCausalLM | MistralForCausalLM | Qwen2ForCausalLM | Qwen3ForCausalLM | the mixtures'
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # llama3: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    partial_rotary: float = 1.0
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before the rotation
    max_len: int = 256  # rows of each KV-cache table
    formats: tuple[tuple[str, str], ...] = ()  # weight name -> checkpoint format (f32 / f16 / bf16), default f32
    name: str = "model"
    moe: Any = None  # families/mixtures.py MoeConfig: the expert mixture of the layers it names (None: every FFN dense)
    window: int = 0  # the positions a sliding layer's query attends, its own the last (0: all before it)
    layer_types: tuple[str, ...] = ()  # sliding_attention | full_attention, a layer each (none: every layer slides
    # where `window` is set: Mistral, Mixtral, Phi-3; Qwen2 / Qwen3 from max_window_layers on, Gemma, gpt-oss by type;
    # Qwen3-Next's linear_attention | full_attention)
    attn_bias: bool = False  # Llama's attention_bias: q, k, v and o_proj biases
    mlp_bias: bool = False  # Llama's mlp_bias: gate, up and down_proj biases (a dense MLP's)
    act: str = "silu"  # the dense MLP's gate activation, as the step's op (silu, gelu: tanh approximation, gelu_erf)

    def sliding(self, i: int) -> bool:
        """Whether layer i's attention takes the window."""
        return not self.layer_types or self.layer_types[i] == LAYER_TYPES[0]

    def sparse(self, i: int) -> bool:
        """Whether layer i's FFN is an expert mixture."""
        return self.moe is not None and i in self.moe.sparse

    @property
    def cache_widths(self) -> tuple[int, int]:
        """The widths of a layer's two cache tables (keys, values); a family of its own caches other rows
        (DeepSeek-V3: the normed latent and the rotated key part)."""
        return self.kv_heads * self.head_dim, self.kv_heads * self.head_dim

    @property
    def extra_layers(self) -> int:
        """Layers a checkpoint may hold after the decoder's (DeepSeek-V3's next-token-prediction layers), whose
        weights the step does not read."""
        return 0

    @property
    def rot(self) -> int:
        r = int(self.head_dim * self.partial_rotary)
        return r - (r % 2)

    # the step's parts on engine/front/decoder.py's skeleton: Llama's; a family whose parts differ gives its own
    layer_prefix = "model.layers."  # where layer i's tensors are named: `{layer_prefix}{i}.`

    def frame_io(self, batch: int) -> dict[str, Any]:
        """The frame's layers with caches and the carried states (step_frame's `attention`, `states`)."""
        return {}

    def embed(self, step) -> str:
        """The rope tables and the embedded tokens: the residual's first rows."""
        return embed(step)

    def layer(self, step, i: int, x: str) -> str:
        """Layer i over the residual `x`: Llama's pre-norm layer."""
        return pre_norm_layer(step, i, x)

    def logits(self, step, x: str) -> str:
        """The final norm and the head over the last rows `x`."""
        return logits(step, x)

    def build_step(self, rows: int = 1, batch: int = 1, last: int = 1) -> Graph:
        """This model's step graph (`build_step`, below)."""
        return build_step(self, rows, batch, last)

    def carried(self) -> dict[str, tuple[int, ...]]:
        """The tables a step carries, name -> shape: each layer's K and V caches (a family with carried states adds
        them: engine/front/families/qwen3next.py)."""
        (kw, vw), L = self.cache_widths, self.max_len
        return {n: (L, w) for i in range(self.layers) for n, w in ((f"kc{i}", kw), (f"vc{i}", vw))}

    def fmt(self, weight: str) -> str:
        return self._format_of.get(weight, "f32")

    @functools.cached_property
    def _format_of(self) -> dict[str, str]:
        """`formats` as a mapping, built once a config (a lookup a weight: a dict built each call made building a
        step quadratic in its layers)."""
        return dict(self.formats)

    def weight_names(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor the graph reads, with its expected shape (HF names)."""
        d, h, kv, hd, f = self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter
        w: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, d), "model.norm.weight": (d,)}
        if not self.tie_embeddings:
            w["lm_head.weight"] = (self.vocab, d)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            w[p + "input_layernorm.weight"] = (d,)
            w[p + "post_attention_layernorm.weight"] = (d,)
            w[p + "self_attn.q_proj.weight"] = (h * hd, d)
            w[p + "self_attn.k_proj.weight"] = (kv * hd, d)
            w[p + "self_attn.v_proj.weight"] = (kv * hd, d)
            w[p + "self_attn.o_proj.weight"] = (d, h * hd)
            if self.qkv_bias or self.attn_bias:
                w[p + "self_attn.q_proj.bias"] = (h * hd,)
                w[p + "self_attn.k_proj.bias"] = (kv * hd,)
                w[p + "self_attn.v_proj.bias"] = (kv * hd,)
            if self.attn_bias:
                w[p + "self_attn.o_proj.bias"] = (d,)
            if self.qk_norm:
                w[p + "self_attn.q_norm.weight"] = (hd,)
                w[p + "self_attn.k_norm.weight"] = (hd,)
            if self.sparse(i):
                w.update(self.moe.names(self, i))
                continue
            w[p + "mlp.gate_proj.weight"] = (f, d)
            w[p + "mlp.up_proj.weight"] = (f, d)
            w[p + "mlp.down_proj.weight"] = (d, f)
            if self.mlp_bias:
                w[p + "mlp.gate_proj.bias"] = (f,)
                w[p + "mlp.up_proj.bias"] = (f,)
                w[p + "mlp.down_proj.bias"] = (d,)
        return w


def build_step(cfg: ModelConfig, rows: int = 1, batch: int = 1, last: int = 1) -> Graph:
    """The lifted graph of one step over `rows` token rows (1: a decode step; more: a prefill chunk) at the position
    `pos` names; the logits and next token of the last row — of each of the last `last` rows (a view of those rows of
    the residual: a verifier of `last - 1` drafted tokens reads the logits of each). `batch` B > 1: a decode step of
    B sequences, one row each (step_frame), the logits and next token of every row: engine/front/decoder.py's
    skeleton over the config's parts (`frame_io`, `embed`, `layer`, `logits`: a family gives those that differ)."""
    if not 1 <= last <= rows:
        raise UserError(f"the logits of the last {last} rows of a step of {rows}")
    return build(cfg, rows, batch, last, cfg.layer)
