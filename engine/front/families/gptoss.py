"""The gpt-oss family (`GptOssForCausalLM`): its config.json read into a `GptOssConfig` (4.x and 5.x layouts), its
checkpoint's tensors (the experts' fused gate/up tensor (E, d, 2f) with gate and up interleaved, and down (E, f, d),
stored as the matmul's transpose, served as the stacked rows the `moe` op reads: `GptOssStore`) and the step graph
of one decode step or prefill chunk: q/k/v/o biases, per-head attention sinks, a window on the sliding layers, YaRN
rotary tables (scaled by YaRN's attention factor, as transformers scales its cos and sin), and the mixture routed by
top-k then a softmax over the chosen logits, its experts biased, with the clamped GLU."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from lanefuse.engine.errors import UserError
from lanefuse.engine.front.gguf_shapes import check_shapes
from lanefuse.engine.front.family import Family
from lanefuse.engine.front.gguf_names import DENSE_FFN, LAYER, QKV_BIAS, Names
from lanefuse.engine.front.hfconfig import MAX_LAYERS, Reader
from lanefuse.engine.front.model import ModelConfig, read_layer_types
from lanefuse.engine.front.families.mixtures import ExpertStore

ARCHS = ("GptOssForCausalLM",)
# gpt-oss (llama.cpp's `gpt-oss`): biased q/k/v/o, the attention sinks, the norm before the mixture named
# post_attention_norm, a biased router, and each role's experts and their biases apart (gate and up split from the
# checkpoint's interleaved gate_up, rows (out, in)); GptOssGGUFStore serves the `moe` op's rows
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


class GptOss(Family):
    name = "gptoss"
    hf = ARCHS
    # top-k of a biased router, then a softmax over the chosen; the clamped GLU (gptoss_from_gguf)
    gguf = {"gpt-oss": Names("GptOssForCausalLM", GPTOSS_LAYER, moe="gptoss")}

    @classmethod
    def read_config(cls, c, arch, where, max_len, name):
        return gptoss_config(c, where, max_len, name)

    @classmethod
    def from_gguf(cls, cfg, r, arch, where, meta, tensors):
        return gptoss_from_gguf(cfg, r, arch, where)

    @classmethod
    def store(cls, cfg, base, where):
        return GptOssStore(base, cfg, where)

    @classmethod
    def gguf_store(cls, cfg, base, where):  # the experts and their biases as the op's rows
        return GptOssGGUFStore(base, cfg, where)
ROPE_TYPES = ("yarn", "default")
# What GptOssConfig (transformers 5.24) takes for a key the config.json leaves out
DEFAULTS = dict(num_hidden_layers=36, num_local_experts=128, vocab_size=201088, hidden_size=2880,
                intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8, sliding_window=128,
                tie_word_embeddings=False, max_position_embeddings=131072, rms_norm_eps=1e-5, num_experts_per_tok=4,
                swiglu_alpha=1.702, swiglu_limit=7.0, attention_bias=True, rope_theta=150000.0)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


@dataclass(frozen=True)
class GptOssConfig(ModelConfig):
    """A gpt-oss model's shape: a ModelConfig (its `moe` the mixture of every layer) and what the family adds."""

    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    def layer(self, step, i: int, x: str) -> str:
        return gptoss_layer(step, i, x)

    def weight_names(self) -> dict[str, tuple[int, ...]]:
        d, h, kv, hd, f, E = self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter, self.moe.experts
        w: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, d), "model.norm.weight": (d,)}
        if not self.tie_embeddings:
            w["lm_head.weight"] = (self.vocab, d)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            w[p + "input_layernorm.weight"] = (d,)
            w[p + "post_attention_layernorm.weight"] = (d,)
            for n, rows_, cols in (("q", h * hd, d), ("k", kv * hd, d), ("v", kv * hd, d), ("o", d, h * hd)):
                w[p + f"self_attn.{n}_proj.weight"] = (rows_, cols)
                w[p + f"self_attn.{n}_proj.bias"] = (rows_,)
            w[p + "self_attn.sinks"] = (h,)
            w[p + "mlp.router.weight"] = (E, d)
            w[p + "mlp.router.bias"] = (E,)
            w.update({n: s for n, s in stacked_names(i, self.moe.held, d, f).items()})  # a rank's experts, or all E
        return w


def stacked_names(i: int, E: int, d: int, f: int) -> dict[str, tuple[int, ...]]:
    """Layer i's expert tensors as the step reads them (served by GptOssStore): gate_up rows (E·2f, d), expert e's
    gate rows at e·2f and its up rows at e·2f + f; their biases (E·2f,) alike; down rows (E·d, f); down biases (E·d,)."""
    p = f"model.layers.{i}.mlp.experts."
    return {p + "gate_up_proj.rows": (E * 2 * f, d), p + "gate_up_proj_bias.rows": (E * 2 * f,),
            p + "down_proj.rows": (E * d, f), p + "down_proj_bias.rows": (E * d,)}


# -- the checkpoint's experts -------------------------------------------------------------------------------------

class GptOssStore:
    """A weight store that also serves each layer's experts as stacked rows, from transformers' tensors: gate_up_proj
    (E, d, 2f), its columns gate and up interleaved (gate at 2j, up at 2j + 1), and down_proj (E, f, d), both the
    transpose of the rows a product reads; each one de-interleaved and transposed once, in memory, in its stored
    format. A real gpt-oss checkpoint's MXFP4 experts (`*_blocks` (E, rows, G, 16), `*_scales` (E, rows, G): rows
    (out, in), the product's own) are served as `mxfp4` rows (engine/formats/blocks.py), each block's scale byte packed
    before its 16 bytes, gate_up's interleaved rows put gate first (whole rows move, the bytes are unchanged)."""

    def __init__(self, base, cfg: GptOssConfig, where: str):
        self.base, self.where_ = base, where
        have = set(base.names())
        self.cfg = cfg
        self.stacked: dict[str, tuple[str, str, tuple[int, ...]]] = {}  # name -> (stored name, role, shape)
        E, d, f = cfg.moe.experts, cfg.hidden, cfg.inter
        for i in range(cfg.layers):
            p = f"model.layers.{i}.mlp.experts."
            mx = p + "gate_up_proj_blocks" in have or p + "down_proj_blocks" in have
            want = {"gate_up_proj": (E, d, 2 * f), "gate_up_proj_bias": (E, 2 * f), "down_proj": (E, f, d),
                    "down_proj_bias": (E, d)}
            if mx:  # MXFP4: each role's blocks and scales, rows (out, in) of blocks of 32 (transformers' layout)
                want = {"gate_up_proj_blocks": (E, 2 * f, d // 32, 16), "gate_up_proj_scales": (E, 2 * f, d // 32),
                        "gate_up_proj_bias": (E, 2 * f), "down_proj_blocks": (E, d, f // 32, 16),
                        "down_proj_scales": (E, d, f // 32), "down_proj_bias": (E, d)}
                if d % 32 or f % 32:
                    raise UserError(f"{where}: layer {i}'s experts are MXFP4, whose blocks hold 32 values, but hidden "
                                    f"{d} and intermediate {f} are not both multiples of 32")
            for role, shape in want.items():
                name = p + role
                if name not in have:
                    raise UserError(f"{where}: the checkpoint has no tensor `{name}` (expected shape {shape}): layer "
                                    f"{i}'s experts are missing")
                raw = base.u8(name) if role.endswith(("_blocks", "_scales")) and hasattr(base, "u8") else None
                if role.endswith(("_blocks", "_scales")) and raw is None:
                    raise UserError(f"{where}: tensor `{name}` is not U8 (MXFP4 {role[-6:]} are bytes)")
                got = tuple(raw.shape) if raw is not None else tuple(base.info(name)[0])
                if got != shape:
                    raise UserError(f"{where}: tensor `{name}` has shape {got}; the config makes it {shape} "
                                    f"({E} experts, hidden {d}, intermediate {f})")
            for n, s in stacked_names(i, E, d, f).items():
                role = n.split(".")[-2]
                self.stacked[n] = (n[: -len(".rows")], role + ("_mxfp4" if mx and not role.endswith("bias") else ""),
                                   s)
        self._cache: dict[str, tuple[np.ndarray, str]] = {}

    def names(self) -> list[str]:
        return list(dict.fromkeys(list(self.base.names()) + list(self.stacked)))

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        if name not in self.stacked:
            return self.base.info(name)
        stored, role, shape = self.stacked[name]
        return shape, "mxfp4" if role.endswith("_mxfp4") else self.base.info(stored)[1]

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        if name not in self.stacked:
            return self.base.raw(name)
        if name not in self._cache:
            stored, role, shape = self.stacked[name]
            if role.endswith("_mxfp4"):  # blocks and scales packed into mxfp4 rows (out, in): already the rows
                from lanefuse.engine.formats.mxfp4 import pack_mxfp4

                a = pack_mxfp4(self.base.u8(stored + "_blocks"), self.base.u8(stored + "_scales"))
                if role == "gate_up_proj_mxfp4":  # (E, 2f, row bytes): rows 2j gate, 2j + 1 up -> gate rows first
                    a = np.concatenate([a[:, 0::2], a[:, 1::2]], axis=1)
                from lanefuse.engine.front.weights import check_blocks

                a = np.ascontiguousarray(a).reshape(shape[0], -1)
                check_blocks(a, "mxfp4", f"{self.where_}: tensor `{stored}_scales`")
                self._cache[name] = (a, "mxfp4")
                return self._cache[name]
            a, fmt = self.base.raw(stored)
            a = np.asarray(a)
            if role == "gate_up_proj":  # (E, d, 2f) -> (E, 2f, d), then gate rows before up rows
                t = np.swapaxes(a, 1, 2)
                a = np.concatenate([t[:, 0::2], t[:, 1::2]], axis=1)
            elif role == "gate_up_proj_bias":  # (E, 2f): gate values before up values
                a = np.concatenate([a[:, 0::2], a[:, 1::2]], axis=1)
            elif role == "down_proj":  # (E, f, d) -> (E, d, f)
                a = np.swapaxes(a, 1, 2)
            self._cache[name] = (np.ascontiguousarray(a).reshape(shape), fmt)
        return self._cache[name]

    def where(self, name: str) -> str:
        s = self.stacked.get(name)
        return self.base.where(s[0] if s else name)


class GptOssGGUFStore(ExpertStore):
    """A GGUF file's gpt-oss experts (llama.cpp's `gpt-oss`: `ffn_{gate,up,down}_exps.weight` (E, rows, cols) rows
    (out, in), their biases (E, rows)) served as the stacked rows the `moe` op reads (`stacked_names`): expert e's
    gate rows, then its up rows (whole rows move, in their stored format: f32 to the block formats and ggml's MXFP4,
    which GGUFStore repacks); down's rows as stored; the biases as f32 values. An ExpertStore over its own name
    table (`ROLES`)."""

    ROLES = {"gate_up_proj": ("gate_proj", "up_proj"), "gate_up_proj_bias": ("gate_proj_bias", "up_proj_bias"),
             "down_proj": ("down_proj",), "down_proj_bias": ("down_proj_bias",)}

    def _table(self, cfg: GptOssConfig, have: set[str], where: str) -> dict[str, tuple[tuple[str, ...], tuple]]:
        """Every layer's stacked tensors from the file's parts, each part checked against the metadata's shape."""
        base = self.base
        E, d, f = cfg.moe.experts, cfg.hidden, cfg.inter
        want = {"gate_proj": (E * f, d), "up_proj": (E * f, d), "down_proj": (E * d, f), "gate_proj_bias": (E, f),
                "up_proj_bias": (E, f), "down_proj_bias": (E, d)}
        stacked = {}
        for i in range(cfg.layers):
            p = f"model.layers.{i}.mlp.experts."
            check_shapes(base, have, {p + part + ".gguf": shape for part, shape in want.items()}, where,
                         f"{E} experts, hidden {d}, intermediate {f}",
                         lambda name, shape: (
                             f"the file has no tensor `{base.file_name(name)}` (expected {E} experts of shape "
                             f"{shape[1:] if name.endswith('bias.gguf') else (shape[0] // E, shape[1])}): layer {i}'s "
                             f"experts are missing"))
            for n, shape in stacked_names(i, E, d, f).items():
                role = n.split(".")[-2]
                stacked[n] = (tuple(p + x + ".gguf" for x in self.ROLES[role]), shape)
        return stacked

    def _by_expert(self, parts: tuple[str, ...]) -> bool:
        return True  # gate and up (rows or biases): expert e's of each in turn

    def _mixed(self, name: str, parts: tuple[str, ...], fmts: set[str]) -> str:
        return (f"tensors `{self.base.file_name(parts[0])}` and `{self.base.file_name(parts[1])}` are stored in "
                f"different formats ({', '.join(sorted(fmts))}); the `moe` op reads gate and up experts in one")

    def file_name(self, name: str) -> str:
        s = self.stacked.get(name)
        return " + ".join(self.base.file_name(x) for x in s[0]) if s else self.base.file_name(name)


def gptoss_from_gguf(cfg: ModelConfig, r, arch: str, where: str) -> GptOssConfig:
    """A GGUF file's gpt-oss (llama.cpp's `gpt-oss`) from the dense reading `cfg` and the `{arch}.*` keys `r` reads,
    as llama.cpp takes them: even layers slide over `attention.sliding_window` positions (its pattern 2), YaRN from
    `rope.scaling.*` with the ends of its ramp rounded out (ggml_rope_yarn_corr_dims floors and ceils them:
    transformers' `truncate`), and the GLU clamped at 7 with alpha 1.702 (llama.cpp's constants for gpt-oss)."""
    import dataclasses

    from lanefuse.engine.front.model import ModelConfig as Base

    kind = r.text("rope.scaling.type", "none")
    if kind not in ("none", "yarn"):
        raise UserError(f"{where}: `{arch}.rope.scaling.type` is {kind!r:.40}; lanefuse's gpt-oss reads none or yarn")
    scaling: tuple = ()
    if kind == "yarn":
        for key in ("rope.scaling.yarn_attn_factor", "rope.scaling.yarn_ext_factor"):
            if r.has(key) and r.number(key, 1.0) != 1.0:
                raise UserError(f"{where}: `{arch}.{key}` is {r.c[key]!r}; lanefuse's gpt-oss reads YaRN with the "
                                f"attention factor its scaling factor gives and the full ramp (1)")
        factor = r.number("rope.scaling.factor", 1.0)
        old = r.size("rope.scaling.original_context_length")
        att = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
        scaling = (("rope_type", "yarn"), ("factor", factor),
                   ("beta_fast", r.number("rope.scaling.yarn_beta_fast", 32.0)),
                   ("beta_slow", r.number("rope.scaling.yarn_beta_slow", 1.0)),
                   ("original_max_position_embeddings", old), ("truncate", True), ("attention_factor", att))
    if cfg.partial_rotary != 1.0:
        raise UserError(f"{where}: `{arch}.rope.dimension_count` rotates part of each head; gpt-oss rotates whole "
                        f"heads")
    window = r.size("attention.sliding_window") if r.has("attention.sliding_window") else 0
    types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.layers))
    base = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Base)}
    base.update(inter=cfg.moe.inter, rope_scaling=scaling, qkv_bias=True, window=window, layer_types=types)
    return GptOssConfig(**base, swiglu_limit=7.0, swiglu_alpha=1.702)


# -- config.json --------------------------------------------------------------------------------------------------

def _layer_types(r, layers: int) -> tuple[str, ...]:
    return read_layer_types(r, layers, lambda i: (i + 1) % 2)  # transformers' default: even layers slide


def _yarn(r, head_dim: int, max_pos: int) -> tuple[float, tuple[tuple[str, Any], ...]]:
    """rope_theta and the YaRN entries (with the attention factor transformers scales cos and sin by), from 5.x's
    `rope_parameters` or 4.x's `rope_theta` / `rope_scaling`; absent both, GptOssConfig's default YaRN."""
    c, where = r.c, r.where
    params, scaling = c.get("rope_parameters"), c.get("rope_scaling")
    for key, v in (("rope_parameters", params), ("rope_scaling", scaling)):
        if v is not None and not isinstance(v, dict):
            raise UserError(f"{where}: `{key}` is {v!r:.40}; expected a mapping (or null)")
    given = {**(scaling or {}), **(params or {})}
    merged = {**DEFAULT_ROPE, **given} if not given or given.get("rope_type", given.get("type")) in (None, "yarn") \
        else given
    prefix = "rope_parameters." if params else "rope_scaling."
    m = Reader(merged, where, prefix)
    theta = m.number("rope_theta", r.number("rope_theta", DEFAULTS["rope_theta"]))
    kind = merged.get("rope_type", merged.get("type", "yarn"))
    if kind not in ROPE_TYPES:
        raise UserError(f"{where}: rope type `{kind!s:.40}` is not supported for gpt-oss (supported: "
                        f"{', '.join(ROPE_TYPES)})")
    if m.number("partial_rotary_factor", 1.0, high=1.0) != 1.0:
        raise UserError(f"{where}: partial_rotary_factor is not supported for gpt-oss (it rotates whole heads)")
    if kind == "default":
        return theta, ()
    for key in ("mscale", "mscale_all_dim"):
        if merged.get(key) is not None:
            raise UserError(f"{where}: `{prefix}{key}` is not supported for gpt-oss's YaRN")
    old = m.size("original_max_position_embeddings")
    factor = m.number("factor", max_pos / old) if merged.get("factor") is not None else max_pos / old
    beta_fast = m.number("beta_fast", 32.0) if merged.get("beta_fast") else 32.0  # transformers: `or 32`
    beta_slow = m.number("beta_slow", 1.0) if merged.get("beta_slow") else 1.0
    truncate = merged.get("truncate", True)
    if not isinstance(truncate, bool):
        raise UserError(f"{where}: `{prefix}truncate` is {truncate!r:.40}; expected true or false")
    if merged.get("attention_factor") is not None:
        att = m.number("attention_factor", 1.0)
    else:
        att = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    return theta, (("rope_type", "yarn"), ("factor", factor), ("beta_fast", beta_fast), ("beta_slow", beta_slow),
                   ("original_max_position_embeddings", old), ("truncate", truncate), ("attention_factor", att))


def gptoss_config(c: dict[str, Any], where: str, max_len: int, name: str) -> GptOssConfig:
    """A gpt-oss config.json (transformers 4.x or 5.x) read into a GptOssConfig; what the step cannot express is
    refused naming the key."""
    from lanefuse.engine.front.families.mixtures import MoeConfig

    c = {**DEFAULTS, **{k: v for k, v in c.items() if v is not None or k in ("sliding_window",)}}
    r = Reader(c, where)
    if c.get("attention_bias") is not True:
        raise UserError(f"{where}: a gpt-oss without its q/k/v/o biases (attention_bias false) is not supported")
    hidden, heads, layers, inter, vocab, kv = r.sizes(MAX_LAYERS)
    head_dim = r.size("head_dim")
    experts, k = r.size("num_local_experts"), r.size("num_experts_per_tok")
    if k > experts:
        raise UserError(f"{where}: `num_experts_per_tok` {k} is more than the {experts} experts")
    max_pos = r.size("max_position_embeddings")
    theta, scaling = _yarn(r, head_dim, max_pos)
    window = r.size("sliding_window") if c.get("sliding_window") is not None else 0
    limit = r.number("swiglu_limit", 7.0, expected="a positive number (the GLU's clamp)")
    alpha = r.number("swiglu_alpha", 1.702, expected="a positive number")
    moe = MoeConfig(experts, k, inter, False, tuple(range(layers)), spelling="gptoss")
    return GptOssConfig(
        arch="GptOssForCausalLM", hidden=hidden, layers=layers, heads=heads, kv_heads=kv, head_dim=head_dim,
        inter=inter, vocab=vocab, eps=r.number("rms_norm_eps", 1e-5), rope_theta=theta, rope_scaling=scaling,
        tie_embeddings=r.flag("tie_word_embeddings"), qkv_bias=True, max_len=min(max_len, max_pos), name=name,
        moe=moe, window=window, layer_types=_layer_types(r, layers), swiglu_limit=limit, swiglu_alpha=alpha)


# -- the step graph -------------------------------------------------------------------------------------------------

def gptoss_layer(s, i: int, x: str) -> str:
    """Layer i of a gpt-oss step (engine/front/decoder.py's skeleton around it): biased q/k/v/o, the attention with
    its sinks (and its window on a sliding layer), the biased router's mixture with its clamped GLU."""
    cfg, caches = s.cfg, s.caches
    h, kv, hd, m = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.moe

    def op(kind, ins, out, **attrs):
        return s.op(i, kind, ins, out, **attrs)

    def W(name):
        return s.W(i, name)

    hn = op("rmsnorm", [x, W("input_layernorm.weight")], "attn_norm", eps=cfg.eps)
    q = op("add", [op("matmul", [hn, W("self_attn.q_proj.weight")], "q"), W("self_attn.q_proj.bias")], "q_bias")
    k = op("add", [op("matmul", [hn, W("self_attn.k_proj.weight")], "k"), W("self_attn.k_proj.bias")], "k_bias")
    v = op("add", [op("matmul", [hn, W("self_attn.v_proj.weight")], "v"), W("self_attn.v_proj.bias")], "v_bias")
    q = op("rope", [q, "rope.cos", "rope.sin", "pos"], "q_rot", heads=h, hd=hd, rot=cfg.rot)
    k = op("rope", [k, "rope.cos", "rope.sin", "pos"], "k_rot", heads=kv, hd=hd, rot=cfg.rot)
    kc = op("set_row", [caches[i][0], k, "pos"], "kc")
    vc = op("set_row", [caches[i][1], v, "pos"], "vc")
    a = op("attention", [q, kc, vc, "pos", W("self_attn.sinks")], "attn", heads=h, kv_heads=kv, hd=hd, vd=hd,
           scale=float(hd) ** -0.5, window=cfg.window if cfg.sliding(i) else 0, softcap=0.0)
    o = op("add", [op("matmul", [a, W("self_attn.o_proj.weight")], "o"), W("self_attn.o_proj.bias")], "o_bias")
    x1 = op("add", [x, o], "resid_attn")
    h2 = op("rmsnorm", [x1, W("post_attention_layernorm.weight")], "ffn_norm", eps=cfg.eps)
    e = "mlp.experts."
    y = op("moe", [h2, W("mlp.router.weight"), W(e + "gate_up_proj.rows"), W(e + "down_proj.rows"),
                   W("mlp.router.bias"), W(e + "gate_up_proj_bias.rows"), W(e + "down_proj_bias.rows")], "moe",
           experts=m.experts, k=m.k, inter=m.inter, norm_topk=False, act="clamped_glu", routing="topk_softmax",
           limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha, **m.part_attrs())  # a rank's experts (front/parallel.py)
    return op("add", [x1, y], "resid_ffn")
