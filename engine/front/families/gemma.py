"""The Gemma 2 and Gemma 3 (text) family: its config.json read into a `GemmaConfig` (4.x and 5.x layouts, the text
model of a `Gemma3ForConditionalGeneration` among them), its checkpoint's tensor names and the step graph of one
decode step or prefill chunk: the embedding scaled by sqrt(hidden), Gemma's norm by (1 + w), four norms a layer (the
sandwich), GELU in a gated MLP, soft-capped attention logits and final logits, a window on the sliding layers, q/k
head norms and a rotary table per layer type (Gemma 3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from lanefuse.engine.errors import UserError
from lanefuse.engine.front.family import Family
from lanefuse.engine.front.gguf_names import LAYER, QK_NORM, Names
from lanefuse.engine.front.hfconfig import MAX_LAYERS, Reader, read_rope
from lanefuse.engine.front.decoder import mlp
from lanefuse.engine.front.model import LAYER_TYPES, ModelConfig, read_layer_types

ARCHS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
GEMMA_LAYER = {  # Gemma's four norms a layer: llama.cpp names the pre-feed-forward one ffn_norm
    **{k: v for k, v in LAYER.items() if k != "ffn_norm.weight"},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


class Gemma(Family):
    name = "gemma"
    hf = ARCHS
    gguf = {"gemma2": Names("Gemma2ForCausalLM", GEMMA_LAYER),
            "gemma3": Names("Gemma3ForCausalLM", {**GEMMA_LAYER, **QK_NORM})}

    @classmethod
    def read_config(cls, c, arch, where, max_len, name):
        return gemma_config(c, arch, where, max_len, name)

    @classmethod
    def from_gguf(cls, cfg, r, arch, where, meta, tensors):
        return gemma_from_gguf(cfg, r, arch, where)
# hidden_activation -> the lifted op: transformers' ACT2FN names of the tanh approximation, and the exact (erf) GELU
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu", "gelu_new": "gelu", "gelu_fast": "gelu", "gelu": "gelu_erf",
               "gelu_python": "gelu_erf"}
ONE_PLUS = "+1"  # a norm weight's generated f32 constant `<name>+1`: 1 + w, formed in f32 when the weights load

# What transformers (5.24) takes for a key the config.json leaves out, by family: Gemma2Config's and Gemma3TextConfig's
# defaults. Hub configs of Gemma 3 rely on them (google/gemma-3-4b-it's text_config names six keys).
_COMMON = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_size=2304, intermediate_size=9216,
               num_hidden_layers=26, rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=256,
               sliding_window=4096, hidden_activation="gelu_pytorch_tanh")
DEFAULTS = {
    "gemma2": dict(_COMMON, vocab_size=256000, max_position_embeddings=8192, rope_theta=10000.0,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0, sliding_window_pattern=2),
    "gemma3": dict(_COMMON, vocab_size=262208, max_position_embeddings=131072, rope_theta=1_000_000.0,
                   rope_local_base_freq=10000.0, final_logit_softcapping=None, attn_logit_softcapping=None,
                   sliding_window_pattern=6),
}


@dataclass(frozen=True)
class GemmaConfig(ModelConfig):
    """A Gemma 2 / Gemma 3 text model's shape: a ModelConfig (rope_theta and rope_scaling: the global layers') and
    what the family adds."""

    act: str = "gelu"  # the gated MLP's activation: gelu (tanh approximation) | gelu_erf
    attn_scale: float = 1.0  # query_pre_attn_scalar ** -0.5
    attn_softcap: float = 0.0  # attn_logit_softcapping (0: none)
    final_softcap: float = 0.0  # final_logit_softcapping (0: none)
    local_rope_theta: float = 0.0  # Gemma 3: the sliding layers' rotary base (0: the global table for every layer)
    local_rope_scaling: tuple[tuple[str, Any], ...] = ()
    norm_offset: float = 1.0  # the norms scale by norm_offset + w (0: a GGUF file, whose converter stored 1 + w)
    prefix: str = "model."  # where the text model's tensors live: model. | language_model.model. | model.language_model.
    head: str = "lm_head.weight"  # the untied output matrix's name

    @property
    def embed_scale(self) -> float:
        """sqrt(hidden) as transformers multiplies the embedding rows by it when it runs in f32 (a buffer made from
        the Python float, cast to the embedding's dtype: f32 here; bf16 would round it, 59.87 -> 60.0 for 3584)."""
        return float(np.float32(self.hidden ** 0.5))

    @property
    def layer_prefix(self) -> str:
        return self.prefix + "layers."

    # the step on engine/front/decoder.py's skeleton: the embedding scaled, a second rope table for the sliding
    # layers, the sandwich-normed layer, the head's soft cap
    def embed(self, step) -> str:
        step.embed = step.w(self.prefix + "embed_tokens.weight", transposed=self.tie_embeddings)  # tied: the head's
        e = step.g.add("gather", [step.embed, "token"], "embed")
        x = step.g.add("scale", [e], "x0", factor=self.embed_scale)
        for t in ("rope.cos", "rope.sin") + (("rope.local.cos", "rope.local.sin") if self.local_rope() else ()):
            step.values(t)
        return x

    def layer(self, step, i: int, x: str) -> str:
        return gemma_layer(step, i, x)

    def logits(self, step, x: str) -> str:
        g = step.g
        hn = g.add("rmsnorm", [x, norm_w(step, self.prefix + "norm.weight")], "final_norm", eps=self.eps)
        head = step.embed if self.tie_embeddings else step.w(self.head)
        if self.final_softcap > 0:
            return g.add("softcap", [g.add("matmul", [hn, head], "logits_raw")], "logits", cap=self.final_softcap)
        return g.add("matmul", [hn, head], "logits")

    def with_layout(self, stored: set[str]) -> "GemmaConfig":
        return with_layout(self, stored)

    def local_rope(self) -> "GemmaConfig | None":
        """The sliding layers' rotary config (Gemma 3), as a config whose rope_theta / rope_scaling are theirs."""
        if not self.local_rope_theta or "sliding_attention" not in self.layer_types:
            return None
        import dataclasses

        return dataclasses.replace(self, rope_theta=self.local_rope_theta, rope_scaling=self.local_rope_scaling,
                                   local_rope_theta=0.0)

    def norm_names(self) -> list[str]:
        p = self.prefix
        out = [p + "norm.weight"]
        for i in range(self.layers):
            q = f"{p}layers.{i}."
            out += [q + n + ".weight" for n in ("input_layernorm", "post_attention_layernorm",
                                                 "pre_feedforward_layernorm", "post_feedforward_layernorm")]
            if self.qk_norm:
                out += [q + "self_attn.q_norm.weight", q + "self_attn.k_norm.weight"]
        return out

    def weight_names(self) -> dict[str, tuple[int, ...]]:
        d, h, kv, hd, f = self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter
        p = self.prefix
        w: dict[str, tuple[int, ...]] = {p + "embed_tokens.weight": (self.vocab, d)}
        if not self.tie_embeddings:
            w[self.head] = (self.vocab, d)
        for i in range(self.layers):
            q = f"{p}layers.{i}."
            w[q + "self_attn.q_proj.weight"] = (h * hd, d)
            w[q + "self_attn.k_proj.weight"] = (kv * hd, d)
            w[q + "self_attn.v_proj.weight"] = (kv * hd, d)
            w[q + "self_attn.o_proj.weight"] = (d, h * hd)
            w[q + "mlp.gate_proj.weight"] = (f, d)
            w[q + "mlp.up_proj.weight"] = (f, d)
            w[q + "mlp.down_proj.weight"] = (d, f)
        for n in self.norm_names():
            w[n] = (hd,) if n.endswith(("q_norm.weight", "k_norm.weight")) else (d,)
        return w

    # -- the constants the weight store generates from the config (weights.py asks) --------------------------

    def generated(self) -> dict[str, tuple[int, ...]]:
        """name -> shape of each generated f32 constant: the rotary tables (a second pair for Gemma 3's sliding
        layers) and each norm weight's 1 + w."""
        t = (self.max_len, self.rot // 2)
        out = {"rope.cos": t, "rope.sin": t}
        if self.local_rope() is not None:
            out.update({"rope.local.cos": t, "rope.local.sin": t})
        if self.norm_offset:
            shapes = self.weight_names()
            out.update({n + ONE_PLUS: shapes[n] for n in self.norm_names()})
        return out

    def generate(self, name: str, weights) -> dict[str, np.ndarray]:
        """The generated constant `name` (with its siblings where they come together), from `weights`' stored ones.
        A norm's 1 + w: the stored weight decoded to f32 (bf16 exactly), then 1 added in f32 — transformers'
        `1.0 + self.weight.float()`; the stored bf16 weight itself is never changed."""
        from lanefuse.engine.front.weights import rope_tables

        if name.endswith(ONE_PLUS):
            w = np.asarray(weights.get(name[: -len(ONE_PLUS)]), dtype=np.float32)
            return {name: (np.float32(self.norm_offset) + w).astype(np.float32)}
        if name.startswith("rope.local."):
            t = rope_tables(self.local_rope())
            return {"rope.local.cos": t["rope.cos"], "rope.local.sin": t["rope.sin"]}
        return rope_tables(self)


# -- config.json --------------------------------------------------------------------------------------------------

def _family(arch: str) -> str:
    return "gemma2" if arch.startswith("Gemma2") else "gemma3"


def _text_config(c: dict[str, Any], arch: str, where: str) -> tuple[dict[str, Any], str]:
    """The text model's keys (a Gemma3ForConditionalGeneration's `text_config`, the vision tower left out) over the
    family's defaults, and where to name them in messages."""
    if arch == "Gemma3ForConditionalGeneration":
        text = c.get("text_config")
        if text is None:
            text = {}
        if not isinstance(text, dict):
            raise UserError(f"{where}: `text_config` is {text!r:.40}; expected a mapping (the text model's config)")
        merged = dict(text)
        # the top level's tie wins where the text config leaves it out (transformers ties at the top level)
        if "tie_word_embeddings" not in merged and "tie_word_embeddings" in c:
            merged["tie_word_embeddings"] = c["tie_word_embeddings"]
        return {**DEFAULTS["gemma3"], **merged}, f"{where} (text_config)"
    return {**DEFAULTS[_family(arch)], **c}, where


def _layer_types(r, layers: int, family: str) -> tuple[str, ...]:
    """`layer_types`, or transformers' pattern: Gemma 2 alternates (even layers sliding); Gemma 3 slides all but every
    `sliding_window_pattern`-th layer."""
    return read_layer_types(r, layers, lambda i: (i + 1) % r.size("sliding_window_pattern",
                                                                   DEFAULTS[family]["sliding_window_pattern"]))


def _cap(r, key: str) -> float:
    """A soft cap: a positive number, or null / absent-with-a-null-default for none."""
    if r.c.get(key) is None:
        return 0.0
    return r.number(key, 0.0, expected="a positive number (the cap), or null for none")


def _ropes(r, family: str) -> tuple[tuple[float, tuple, float], tuple[float, tuple, float] | None]:
    """(the global layers' rope_theta, scaling, partial), and Gemma 3's sliding layers' (None for Gemma 2): from
    5.x's `rope_parameters` keyed by layer type, or 4.x's rope_theta / rope_scaling / rope_local_base_freq."""
    c, where = r.c, r.where
    params = c.get("rope_parameters")
    if isinstance(params, dict) and any(k in params for k in LAYER_TYPES):
        for k in LAYER_TYPES:
            if not isinstance(params.get(k) or {}, dict):
                raise UserError(f"{where}: `rope_parameters.{k}` is {params.get(k)!r:.40}; expected a mapping")
        base = {k: v for k, v in c.items() if k not in ("rope_parameters", "rope_scaling")}
        full = read_rope(Reader({**base, "rope_parameters": params.get("full_attention") or {}},
                                f"{where} (rope_parameters.full_attention)"))
        local_theta = c.get("rope_local_base_freq", DEFAULTS["gemma3"]["rope_local_base_freq"])
        local = read_rope(Reader({**base, "rope_parameters": params.get("sliding_attention") or {},
                                  "rope_theta": local_theta}, f"{where} (rope_parameters.sliding_attention)"))
        return full, (local if family == "gemma3" else None)
    full = read_rope(r)  # rope_scaling, where given, scales the global layers only (as transformers applies it)
    if family == "gemma2":
        return full, None
    theta = r.number("rope_local_base_freq", DEFAULTS["gemma3"]["rope_local_base_freq"])
    return full, (theta, (), full[2])


def gemma_config(c: dict[str, Any], arch: str, where: str, max_len: int, name: str) -> GemmaConfig:
    """A Gemma 2 / Gemma 3 config.json read into a GemmaConfig; what the step cannot express refused naming the key."""
    family = _family(arch)
    t, where = _text_config(c, arch, where)
    r = Reader(t, where)
    act_name = t.get("hidden_activation") or t.get("hidden_act") or "gelu_pytorch_tanh"
    if act_name not in ACTIVATIONS:
        raise UserError(f"{where}: hidden_activation `{act_name!s:.40}` is not supported (supported: "
                        f"{', '.join(ACTIVATIONS)}: the GELU's tanh approximation, or the exact erf GELU)")
    if r.flag("attention_bias"):
        raise UserError(f"{where}: attention_bias is not supported for Gemma (its q/k/v/o products have no biases)")
    if r.flag("use_bidirectional_attention"):
        raise UserError(f"{where}: use_bidirectional_attention is not supported (a decode step attends causally)")
    if r.flag("mlp_bias"):
        raise UserError(f"{where}: mlp_bias is not supported")
    hidden, heads, layers, inter, vocab, kv = r.sizes(MAX_LAYERS)
    head_dim = r.size("head_dim")
    eps = r.number("rms_norm_eps", 1e-6)
    (theta, scaling, partial), local = _ropes(r, family)
    if partial != 1.0:
        raise UserError(f"{where}: partial_rotary_factor {partial} is not supported for Gemma (it rotates whole heads)")
    scalar = r.number("query_pre_attn_scalar", 256.0)
    window = r.size("sliding_window") if t.get("sliding_window") is not None else 0
    types = _layer_types(r, layers, family)
    max_pos = r.size("max_position_embeddings")
    p = "model."
    head = "lm_head.weight"
    if arch == "Gemma3ForConditionalGeneration":
        p = "language_model.model."  # the hub's layout (4.50-4.51, and 5.x's save_pretrained); see with_layout
        head = "language_model.lm_head.weight"
    return GemmaConfig(
        arch=arch, hidden=hidden, layers=layers, heads=heads, kv_heads=kv, head_dim=head_dim, inter=inter,
        vocab=vocab, eps=eps, rope_theta=theta, rope_scaling=scaling, tie_embeddings=r.flag("tie_word_embeddings"),
        qk_norm=family == "gemma3", max_len=min(max_len, max_pos), name=name,
        act=ACTIVATIONS[act_name], attn_scale=float(scalar) ** -0.5, attn_softcap=_cap(r, "attn_logit_softcapping"),
        final_softcap=_cap(r, "final_logit_softcapping"), window=window, layer_types=types,
        local_rope_theta=local[0] if local else 0.0, local_rope_scaling=local[1] if local else (),
        prefix=p, head=head)


# llama.cpp's Gemma models of a size whose attention scale is 1/sqrt(hidden / heads), not 1/sqrt(head_dim) (its
# LLM_TYPE_27B: query_pre_attn_scalar 144 and 168, which the GGUF metadata does not hold), by their layer counts
GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def gemma_from_gguf(cfg: ModelConfig, r, arch: str, where: str) -> GemmaConfig:
    """A GGUF file's Gemma 2 / Gemma 3 (llama.cpp's `gemma2`, `gemma3`) from the dense reading `cfg` and the
    `{arch}.*` keys `r` reads, as llama.cpp takes them: the window and its pattern (every layer but each
    pattern-th slides: 2 for gemma2, 6 for gemma3, unless `attention.sliding_window_pattern` says), the soft caps
    (gemma2: 50 and 30 where the file leaves them out), the sliding layers' rotary base 10000 (gemma3), and norm
    weights that already hold 1 + w (the converter adds the 1)."""
    import dataclasses

    from lanefuse.engine.front.model import ModelConfig as Base

    base = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Base)}
    layers, n = cfg.layers, r.size("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    types = tuple("sliding_attention" if i % n < n - 1 else "full_attention" for i in range(layers))
    caps = (50.0, 30.0) if arch == "gemma2" else (0.0, 0.0)
    attn_cap = r.number("attn_logit_softcapping", caps[0], low=0.0, low_open=False,
                        expected="a number, 0 or more (0: no cap)")
    final_cap = r.number("final_logit_softcapping", caps[1], low=0.0, low_open=False,
                         expected="a number, 0 or more (0: no cap)")
    scalar = cfg.hidden / cfg.heads if layers == GGUF_27B_LAYERS[arch] else cfg.head_dim
    base.update(window=r.size("attention.sliding_window") if r.has("attention.sliding_window") else 0,
                layer_types=types)
    base["act"] = "gelu"  # (the common reader's `act`, silu, is a Llama's; Gemma's MLP is GELU-tanh)
    return GemmaConfig(**base, attn_scale=float(scalar) ** -0.5, attn_softcap=attn_cap,
                       final_softcap=final_cap,
                       local_rope_theta=10000.0 if arch == "gemma3" else 0.0, norm_offset=0.0)


def with_layout(cfg: GemmaConfig, stored: set[str]) -> GemmaConfig:
    """A Gemma3ForConditionalGeneration's names as its checkpoint stores them: the hub's `language_model.model.*` with
    `language_model.lm_head.weight` (transformers 4.50-4.51 wrote it, and 5.x's save_pretrained writes it again), or
    `model.language_model.*` with `lm_head.weight` (4.52-4.57)."""
    import dataclasses

    if cfg.arch != "Gemma3ForConditionalGeneration" or cfg.prefix + "embed_tokens.weight" in stored:
        return cfg
    if "model.language_model.embed_tokens.weight" in stored:
        return dataclasses.replace(cfg, prefix="model.language_model.", head="lm_head.weight")
    return cfg


# -- the step graph -------------------------------------------------------------------------------------------------

def norm_w(s, name: str) -> str:
    """A Gemma norm's weight: the generated 1 + w (the norm scales by it), or a GGUF file's as stored."""
    return s.values(name + ONE_PLUS if s.cfg.norm_offset else name)


def gemma_layer(s, i: int, x: str) -> str:
    """Layer i of a Gemma step: the attention (q/k normed a head at a time on Gemma 3, rotated by the sliding layers'
    own table where it has one, scaled by query_pre_attn_scalar, soft-capped) and the GELU MLP, each normed before
    and after (the sandwich), each added to the residual."""
    cfg, caches = s.cfg, s.caches
    h, kv, hd = cfg.heads, cfg.kv_heads, cfg.head_dim
    q_ = f"{cfg.layer_prefix}{i}."

    def op(kind, ins, out, **attrs):
        return s.op(i, kind, ins, out, **attrs)

    def W(name):
        return s.W(i, name)

    sliding = cfg.sliding(i)
    cos, sin = ("rope.local.cos", "rope.local.sin") if sliding and cfg.local_rope() else ("rope.cos", "rope.sin")
    hn = op("rmsnorm", [x, norm_w(s, q_ + "input_layernorm.weight")], "attn_norm", eps=cfg.eps)
    q = op("matmul", [hn, W("self_attn.q_proj.weight")], "q")
    k = op("matmul", [hn, W("self_attn.k_proj.weight")], "k")
    v = op("matmul", [hn, W("self_attn.v_proj.weight")], "v")
    if cfg.qk_norm:
        q = op("rmsnorm", [q, norm_w(s, q_ + "self_attn.q_norm.weight")], "q_norm", eps=cfg.eps, heads=h)
        k = op("rmsnorm", [k, norm_w(s, q_ + "self_attn.k_norm.weight")], "k_norm", eps=cfg.eps, heads=kv)
    q = op("rope", [q, cos, sin, "pos"], "q_rot", heads=h, hd=hd, rot=cfg.rot)
    k = op("rope", [k, cos, sin, "pos"], "k_rot", heads=kv, hd=hd, rot=cfg.rot)
    kc = op("set_row", [caches[i][0], k, "pos"], "kc")
    vc = op("set_row", [caches[i][1], v, "pos"], "vc")
    a = op("attention", [q, kc, vc, "pos"], "attn", heads=h, kv_heads=kv, hd=hd, vd=hd, scale=cfg.attn_scale,
           window=cfg.window if sliding else 0, softcap=cfg.attn_softcap)
    o = op("matmul", [a, W("self_attn.o_proj.weight")], "o")
    on = op("rmsnorm", [o, norm_w(s, q_ + "post_attention_layernorm.weight")], "o_norm", eps=cfg.eps)
    x1 = op("add", [x, on], "resid_attn")
    h2 = op("rmsnorm", [x1, norm_w(s, q_ + "pre_feedforward_layernorm.weight")], "ffn_norm", eps=cfg.eps)
    dn = mlp(s, i, h2)
    dnn = op("rmsnorm", [dn, norm_w(s, q_ + "post_feedforward_layernorm.weight")], "down_norm", eps=cfg.eps)
    return op("add", [x1, dnn], "resid_ffn")
