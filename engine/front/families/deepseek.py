"""The DeepSeek-V3 family (`DeepseekV3ForCausalLM`): its config.json read into a `DeepseekConfig` (4.x and 5.x
layouts), its checkpoint's tensors served as the step reads them (`DeepseekStore`: the query projection cut into each
head's unrotated and rotated rows, kv_a_proj_with_mqa into the latent's and the rotated key's, kv_b_proj into each
head's key and value expansions, the rotated rows de-interleaved where `rope_interleave` says) and the step graph of one
decode step or prefill chunk: multi-head latent attention, absorbed (the query's unrotated part times each head's key
expansion, scores against the latent cache and the shared rotated key, the output in latent space times each head's
value expansion), the cache two tables a layer (the normed latent, the rotated key part), and the first
`first_k_dense_replace` layers dense, the others an expert mixture routed by grouped sigmoid scores with always-on
shared experts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from lanefuse.engine.errors import UserError
from lanefuse.engine.front.family import Family
from lanefuse.engine.front.gguf_names import DENSE_FFN, EXPERTS, LAYER, Names
from lanefuse.engine.front.gguf_shapes import check_shapes, vocab_size
from lanefuse.engine.front.hfconfig import MAX_LAYERS, MAX_SIZE, Reader
from lanefuse.engine.front.model import ModelConfig

ARCHS = ("DeepseekV3ForCausalLM",)
# DeepSeek-V3 (llama.cpp's `deepseek2`): latent attention's projections and norms; the key and value expansions
# either in one `attn_kv_b` (older converters) or split, `attn_k_b` stored transposed (H, lora, nope) and `attn_v_b`
# (H, v, lora) (DeepseekGGUFStore, below, puts kv_b_proj back together); the dense first layers' FFN; the mixture's
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


class Deepseek(Family):
    name = "deepseek"
    hf = ARCHS
    # latent attention and grouped sigmoid routing, its own keys (deepseek_from_gguf, below)
    gguf = {"deepseek2": Names("DeepseekV3ForCausalLM", DEEPSEEK2_LAYER, moe="deepseek")}
    dense_gguf = False

    @classmethod
    def read_config(cls, c, arch, where, max_len, name):
        return deepseek_config(c, where, max_len, name)

    @classmethod
    def read_gguf(cls, meta, tensors, r, arch, where, max_len, name):
        return deepseek_from_gguf(meta, tensors, r, arch, where, max_len, name)

    @classmethod
    def gguf_store(cls, cfg, base, where):  # cut as a checkpoint's, kv_b_proj put back together first
        return deepseek_gguf_store(base, cfg, where)
ROPE_TYPES = ("default", "yarn")
NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: DeepseekV3RMSNorm's default, not rms_norm_eps
# What DeepseekV3Config (transformers 5.24) takes for a key the config.json leaves out
DEFAULTS = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
                norm_topk_prob=True, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
                tie_word_embeddings=False, rope_interleave=True, attention_bias=False, num_nextn_predict_layers=1)


@dataclass(frozen=True)
class DeepseekConfig(ModelConfig):
    """A DeepSeek-V3 model's shape: a ModelConfig (head_dim the rotated part's width, `moe` the mixture of the layers
    from first_k_dense_replace on) and what latent attention and the grouped routing add."""

    q_lora: int = 0  # q_lora_rank (0: the query straight from q_proj)
    kv_lora: int = 0  # kv_lora_rank: the latent's width
    nope: int = 0  # qk_nope_head_dim: each head's unrotated query/key part
    v_dim: int = 0  # v_head_dim
    scale: float = 1.0  # the softmax scale: (nope + rope)^-1/2, times YaRN's mscale(factor, mscale_all_dim)²
    interleave: bool = True  # rope_interleave: the rotated rows stored in pairs (x0, x1), (x2, x3)...
    shared_inter: int = 0  # n_shared_experts · moe_intermediate_size (0: no shared experts)
    groups: int = 1  # n_group
    topk_groups: int = 1  # topk_group
    route_scale: float = 1.0  # routed_scaling_factor
    nextn: int = 0  # num_nextn_predict_layers: the layers after the decoder's, whose weights the step ignores

    def layer(self, step, i: int, x: str) -> str:
        return deepseek_layer(step, i, x)

    @property
    def cache_widths(self) -> tuple[int, int]:
        return self.kv_lora, self.head_dim  # the normed latent, the rotated key part

    @property
    def extra_layers(self) -> int:
        return self.nextn

    def weight_names(self) -> dict[str, tuple[int, ...]]:
        d, h, r, f = self.hidden, self.heads, self.head_dim, self.inter
        w: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, d), "model.norm.weight": (d,)}
        if not self.tie_embeddings:
            w["lm_head.weight"] = (self.vocab, d)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            w[p + "input_layernorm.weight"] = (d,)
            w[p + "post_attention_layernorm.weight"] = (d,)
            q_in = self.q_lora or d
            if self.q_lora:
                w[a + "q_a_proj.weight"] = (self.q_lora, d)
                w[a + "q_a_layernorm.weight"] = (self.q_lora,)
            w[self.query(i) + ".nope_rows"] = (h * self.nope, q_in)
            w[self.query(i) + ".rope_rows"] = (h * r, q_in)
            w[a + "kv_a_proj_with_mqa.latent_rows"] = (self.kv_lora, d)
            w[a + "kv_a_proj_with_mqa.rope_rows"] = (r, d)
            w[a + "kv_a_layernorm.weight"] = (self.kv_lora,)
            w[a + "kv_b_proj.k_rows"] = (h * self.nope, self.kv_lora)
            w[a + "kv_b_proj.v_rows"] = (h * self.v_dim, self.kv_lora)
            w[a + "o_proj.weight"] = (d, h * self.v_dim)
            if self.sparse(i):
                from lanefuse.engine.front.families.mixtures import weight_names

                w.update(weight_names(self, i))
                w[p + "mlp.gate.e_score_correction_bias"] = (self.moe.experts,)
                if self.shared_inter:
                    s = p + "mlp.shared_experts."
                    w[s + "gate_proj.weight"] = (self.shared_inter, d)
                    w[s + "up_proj.weight"] = (self.shared_inter, d)
                    w[s + "down_proj.weight"] = (d, self.shared_inter)
                continue
            w[p + "mlp.gate_proj.weight"] = (f, d)
            w[p + "mlp.up_proj.weight"] = (f, d)
            w[p + "mlp.down_proj.weight"] = (d, f)
        return w

    def serve(self, store, where: str) -> "DeepseekStore":
        """`store` serving what the step reads cut from the stored tensors (the front calls it)."""
        return DeepseekStore(store, self, where)

    def query(self, i: int) -> str:
        """Layer i's query projection, without `.weight`: q_b_proj, or q_proj where q_lora_rank is null."""
        return f"model.layers.{i}.self_attn." + ("q_b_proj" if self.q_lora else "q_proj")


# -- the checkpoint's tensors ---------------------------------------------------------------------------------------

class DeepseekStore:
    """A weight store that also serves what the step reads of each layer's attention, cut from the stored tensors in
    their stored format: q_b_proj / q_proj (H·(nope + rope), in) as each head's unrotated rows `*.nope_rows`
    (H·nope, in) and rotated rows `*.rope_rows` (H·rope, in); kv_a_proj_with_mqa (lora + rope, d) as the latent's
    rows `latent_rows` and the shared rotated key's `rope_rows`; kv_b_proj (H·(nope + v), lora) as each head's key
    expansion `kv_b_proj.k_rows` (H·nope, lora) and value expansion `kv_b_proj.v_rows` (H·v, lora). Where
    `rope_interleave`, each rotated part's rows are reordered from pairs (x0, x1), (x2, x3)... to halves (x0, x2, ...;
    x1, x3, ...): transformers rotates the pairs and lays the result out in halves, so the rotate-half op on the
    reordered rows computes the same query and key. The parts are products of one activation, which the lane runs in
    one launch (merged_pair, merged_qkv): no slice of a computed row."""

    def __init__(self, base, cfg: DeepseekConfig, where: str):
        self.base = base
        have = set(base.names())
        h, r, n, v, lora = cfg.heads, cfg.head_dim, cfg.nope, cfg.v_dim, cfg.kv_lora
        self.derived: dict[str, tuple[str, str, tuple[int, ...]]] = {}  # name -> (stored, how, shape)
        for i in range(cfg.layers):
            a = f"model.layers.{i}.self_attn."
            kvb = a + "kv_b_proj.weight"
            self._check(have, kvb, (h * (n + v), lora), where, f"{h} heads of key {n} and value {v} from a latent "
                                                                  f"of {lora}")
            self.derived[a + "kv_b_proj.k_rows"] = (kvb, "k", (h * n, lora))
            self.derived[a + "kv_b_proj.v_rows"] = (kvb, "v", (h * v, lora))
            q = cfg.query(i) + ".weight"
            qs = (h * (n + r), cfg.q_lora or cfg.hidden)
            self._check(have, q, qs, where, f"{h} heads of {n} + {r}")
            self.derived[cfg.query(i) + ".nope_rows"] = (q, "q_nope", (h * n, qs[1]))
            self.derived[cfg.query(i) + ".rope_rows"] = (q, "q_rope", (h * r, qs[1]))
            kva = a + "kv_a_proj_with_mqa.weight"
            self._check(have, kva, (lora + r, cfg.hidden), where, f"a latent of {lora} and a rotated key of {r}")
            self.derived[a + "kv_a_proj_with_mqa.latent_rows"] = (kva, "latent", (lora, cfg.hidden))
            self.derived[a + "kv_a_proj_with_mqa.rope_rows"] = (kva, "k_rope", (r, cfg.hidden))
        self.cfg = cfg
        self._cache: dict[str, tuple[np.ndarray, str]] = {}

    def _check(self, have, name, shape, where, what):
        if name not in have:
            raise UserError(f"{where}: the checkpoint has no tensor `{name}` (expected shape {shape})")
        got = tuple(self.base.info(name)[0])
        if got != shape:
            raise UserError(f"{where}: tensor `{name}` has shape {got}; the config makes it {shape} ({what})")

    def names(self) -> list[str]:
        return list(dict.fromkeys(list(self.base.names()) + list(self.derived)))

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        if name not in self.derived:
            return self.base.info(name)
        stored, _, shape = self.derived[name]
        return shape, self.base.info(stored)[1]

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        if name not in self.derived:
            return self.base.raw(name)
        if name not in self._cache:
            stored, how, shape = self.derived[name]
            a, fmt = self.base.raw(stored)
            a = np.asarray(a)
            c = self.cfg
            h, r, n, v = c.heads, c.head_dim, c.nope, c.v_dim
            if how in ("k", "v"):  # (H, nope + v, lora): each head's key rows, then its value rows
                t = a.reshape(h, n + v, -1)
                a = t[:, :n] if how == "k" else t[:, n:]
            elif how in ("q_nope", "q_rope"):  # (H, nope + rope, in): each head's unrotated rows, then its rotated
                t = a.reshape(h, n + r, -1)
                a = t[:, :n] if how == "q_nope" else self._halves(t[:, n:], axis=1)
            else:  # kv_a (lora + rope, d): the latent's rows, then the shared rotated rows
                a = a[: c.kv_lora] if how == "latent" else self._halves(a[c.kv_lora:], axis=0)
            self._cache[name] = (np.ascontiguousarray(a).reshape(shape[0], -1), fmt)  # -1: a GGUF block row's bytes
        return self._cache[name]

    def _halves(self, rot: np.ndarray, axis: int) -> np.ndarray:
        """Rotated rows stored in pairs (x0, x1), (x2, x3)... (rope_interleave) reordered to halves (x0, x2, ...;
        x1, x3, ...); as stored otherwise."""
        if not self.cfg.interleave:
            return rot
        idx = np.arange(rot.shape[axis])
        return np.take(rot, np.concatenate([idx[0::2], idx[1::2]]), axis=axis)

    def where(self, name: str) -> str:
        s = self.derived.get(name)
        return self.base.where(s[0] if s else name)


# -- config.json --------------------------------------------------------------------------------------------------

def _mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _rope(r, max_pos: int) -> tuple[float, tuple[tuple[str, Any], ...], float]:
    """rope_theta, the YaRN entries (the attention factor transformers scales cos and sin by among them) and the
    factor the softmax scale takes (mscale(factor, mscale_all_dim)²), from 5.x's `rope_parameters` or 4.x's
    `rope_theta` / `rope_scaling`."""
    c, where = r.c, r.where
    params, scaling = c.get("rope_parameters"), c.get("rope_scaling")
    for key, v in (("rope_parameters", params), ("rope_scaling", scaling)):
        if v is not None and not isinstance(v, dict):
            raise UserError(f"{where}: `{key}` is {v!r:.40}; expected a mapping (or null)")
    merged = {**(scaling or {}), **(params or {})}
    prefix = "rope_parameters." if params else "rope_scaling."
    m = Reader(merged, where, prefix)
    theta = m.number("rope_theta", r.number("rope_theta", 10000.0))
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UserError(f"{where}: rope type `{kind!s:.40}` is not supported for DeepSeek-V3 (supported: "
                        f"{', '.join(ROPE_TYPES)})")
    if m.number("partial_rotary_factor", 1.0, high=1.0) != 1.0:
        raise UserError(f"{where}: `{prefix}partial_rotary_factor` is not supported for DeepSeek-V3 (its "
                        f"qk_rope_head_dim part rotates whole)")
    if kind == "default":
        return theta, (), 1.0
    if merged.get("factor") is None:
        raise UserError(f"{where}: YaRN rope scaling without `{prefix}factor`")
    factor = m.number("factor", 1.0)
    old = m.size("original_max_position_embeddings")
    ms = m.number("mscale", 0.0, low=0.0, low_open=False, expected="a number of at least 0")
    ms_all = m.number("mscale_all_dim", 0.0, low=0.0, low_open=False, expected="a number of at least 0")
    if merged.get("attention_factor") is not None:
        att = m.number("attention_factor", 1.0)
    elif ms and ms_all:
        att = _mscale(factor, ms) / _mscale(factor, ms_all)
    else:
        att = _mscale(factor, 1.0)
    beta_fast = m.number("beta_fast", 32.0) if merged.get("beta_fast") else 32.0  # transformers: `or 32`
    beta_slow = m.number("beta_slow", 1.0) if merged.get("beta_slow") else 1.0
    truncate = merged.get("truncate", True)
    if not isinstance(truncate, bool):
        raise UserError(f"{where}: `{prefix}truncate` is {truncate!r:.40}; expected true or false")
    softmax = _mscale(factor, ms_all) ** 2 if ms_all else 1.0
    return theta, (("rope_type", "yarn"), ("factor", factor), ("beta_fast", beta_fast), ("beta_slow", beta_slow),
                   ("original_max_position_embeddings", old), ("truncate", truncate), ("attention_factor", att)), \
        softmax


def deepseek_config(c: dict[str, Any], where: str, max_len: int, name: str) -> DeepseekConfig:
    """A DeepSeek-V3 config.json (transformers 4.x or 5.x) read into a DeepseekConfig; what the step cannot express
    is refused naming the key."""
    from lanefuse.engine.front.families.mixtures import MoeConfig

    c = {**DEFAULTS, **{k: v for k, v in c.items() if v is not None or k in ("q_lora_rank",)}}
    r = Reader(c, where)
    act = r.text("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"{where}: hidden_act `{act}` is not supported (only silu)")
    q = c.get("quantization_config")
    if q is not None:  # the released checkpoints: FP8 blocks with `weight_scale_inv` tensors
        how = q.get("quant_method") if isinstance(q, dict) else q
        raise UserError(f"{where}: `quantization_config` ({how!s:.40}) is not supported: the step reads f32, f16, "
                        f"bf16 or GGUF rows; dequantize the checkpoint to bf16 first")
    if r.flag("attention_bias"):
        raise UserError(f"{where}: attention_bias (biases on q_a_proj, kv_a_proj_with_mqa and o_proj) is not "
                        f"supported for DeepSeek-V3")
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):  # DeepSeek's own 4.x configs
        if c.get(key) is not None and c[key] != want:
            raise UserError(f"{where}: `{key}` {c[key]!r:.40} is not supported (DeepSeek-V3 routes by `{want}`)")
    if r.size("moe_layer_freq", 1) != 1:
        raise UserError(f"{where}: `moe_layer_freq` {c['moe_layer_freq']} is not supported (every layer from "
                        f"first_k_dense_replace on is a mixture)")
    hidden, heads, layers, inter, vocab, kv = r.sizes(MAX_LAYERS)
    if kv != heads:
        raise UserError(f"{where}: `num_key_value_heads` {kv} differs from `num_attention_heads` {heads}; latent "
                        f"attention expands its keys and values for every query head")
    q_lora = r.size("q_lora_rank") if c.get("q_lora_rank") is not None else 0
    kv_lora, rope_dim = r.size("kv_lora_rank"), r.size("qk_rope_head_dim")
    nope, v_dim = r.size("qk_nope_head_dim"), r.size("v_head_dim")
    if rope_dim % 2:
        raise UserError(f"{where}: `qk_rope_head_dim` {rope_dim} is odd; the rotation turns pairs of values")
    experts, k = r.size("n_routed_experts"), r.size("num_experts_per_tok")
    if k > experts:
        raise UserError(f"{where}: `num_experts_per_tok` {k} is more than the {experts} routed experts")
    groups, topk_groups = r.size("n_group", 1), r.size("topk_group", 1)
    if experts % groups or experts // groups < 2:
        raise UserError(f"{where}: `n_group` {groups} does not split the {experts} routed experts into equal groups "
                        f"of at least 2 (a group is ranked by the sum of its two best scores)")
    if topk_groups > groups:
        raise UserError(f"{where}: `topk_group` {topk_groups} is more than the {groups} groups (`n_group`)")
    if topk_groups * (experts // groups) < k:
        raise UserError(f"{where}: `num_experts_per_tok` {k} is more than the {topk_groups * (experts // groups)} "
                        f"experts of the `topk_group` {topk_groups} groups kept")
    dense = c.get("first_k_dense_replace")
    if isinstance(dense, bool) or not isinstance(dense, int) or not 0 <= dense <= layers:
        raise UserError(f"{where}: `first_k_dense_replace` is {dense!r:.40}; expected a layer count (0..{layers}, "
                        f"`num_hidden_layers`)")
    shared = c.get("n_shared_experts") or 0
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise UserError(f"{where}: `n_shared_experts` is {shared!r:.40}; expected a count (0 or more)")
    nextn = c.get("num_nextn_predict_layers") or 0
    if isinstance(nextn, bool) or not isinstance(nextn, int) or nextn < 0:
        raise UserError(f"{where}: `num_nextn_predict_layers` is {nextn!r:.40}; expected a count (0 or more)")
    moe_inter = r.size("moe_intermediate_size")
    max_pos = r.size("max_position_embeddings")
    theta, scaling, softmax = _rope(r, max_pos)
    interleave = c.get("rope_interleave", True)
    if not isinstance(interleave, bool):
        raise UserError(f"{where}: `rope_interleave` is {interleave!r:.40}; expected true or false")
    moe = MoeConfig(experts, k, moe_inter, r.flag("norm_topk_prob"), tuple(range(min(dense, layers), layers)))
    return DeepseekConfig(
        arch="DeepseekV3ForCausalLM", hidden=hidden, layers=layers, heads=heads, kv_heads=1, head_dim=rope_dim,
        inter=inter, vocab=vocab, eps=r.number("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        tie_embeddings=r.flag("tie_word_embeddings"), max_len=min(max_len, max_pos), name=name, moe=moe,
        q_lora=q_lora, kv_lora=kv_lora, nope=nope, v_dim=v_dim, scale=(nope + rope_dim) ** -0.5 * softmax,
        interleave=interleave, shared_inter=shared * moe_inter, groups=groups, topk_groups=topk_groups,
        route_scale=r.number("routed_scaling_factor", 1.0), nextn=nextn)


# -- the step graph -------------------------------------------------------------------------------------------------

def deepseek_layer(s, i: int, x: str) -> str:
    """Layer i of a DeepSeek-V3 step (engine/front/decoder.py's skeleton around it; a batch's decode step too: each
    sequence its slot of the latent and rotated-key caches, the mixture routing every row): the latent attention,
    absorbed (the query's unrotated part to latent space, the values from it), then the mixture (with its shared
    experts) or, on the first dense layers, the gated MLP."""
    cfg, caches, w = s.cfg, s.caches, s.w
    h, r, n, lora, vd, m = cfg.heads, cfg.head_dim, cfg.nope, cfg.kv_lora, cfg.v_dim, cfg.moe

    def op(kind, ins, out, **attrs):
        return s.op(i, kind, ins, out, **attrs)

    def W(name, transposed=True):
        return s.W(i, name, transposed)

    hn = op("rmsnorm", [x, W("input_layernorm.weight")], "attn_norm", eps=cfg.eps)
    xq = hn
    if cfg.q_lora:
        xq = op("matmul", [hn, W("self_attn.q_a_proj.weight")], "q_a")
        xq = op("rmsnorm", [xq, W("self_attn.q_a_layernorm.weight")], "q_a_norm", eps=NORM_EPS)
    q_nope = op("matmul", [xq, w(cfg.query(i) + ".nope_rows")], "q_nope")  # (R, H·nope)
    q_pe = op("matmul", [xq, w(cfg.query(i) + ".rope_rows")], "q_pe")  # (R, H·rope)
    q_pe = op("rope", [q_pe, "rope.cos", "rope.sin", "pos"], "q_rot", heads=h, hd=r, rot=r)
    lat = op("matmul", [hn, W("self_attn.kv_a_proj_with_mqa.latent_rows")], "latent")  # (R, lora)
    lat = op("rmsnorm", [lat, W("self_attn.kv_a_layernorm.weight")], "latent_norm", eps=NORM_EPS)
    k_pe = op("matmul", [hn, W("self_attn.kv_a_proj_with_mqa.rope_rows")], "k_pe")  # (R, rope)
    k_pe = op("rope", [k_pe, "rope.cos", "rope.sin", "pos"], "k_rot", heads=1, hd=r, rot=r)
    lc = op("set_row", [caches[i][0], lat, "pos"], "lc")  # (L, lora): the latent cache
    kr = op("set_row", [caches[i][1], k_pe, "pos"], "krc")  # (L, rope): the rotated keys
    # absorbed: each head's unrotated query times its key expansion, to latent space
    q_lat = op("head_matmul", [q_nope, W("self_attn.kv_b_proj.k_rows", transposed=False)], "q_absorb",
               heads=h, a=n, b=lora, rows_out=False)  # (R, H·lora)
    qj = op("join", [q_lat, q_pe], "q_join", heads=h)  # (R, H·(lora + rope))
    keys = op("join", [lc, kr], "keys", heads=1)  # (L, lora + rope)
    a = op("attention", [qj, keys, lc, "pos"], "attn", heads=h, kv_heads=1, hd=lora + r, vd=lora,
           scale=cfg.scale, window=0, softcap=0.0)  # (R, H·lora)
    ov = op("head_matmul", [a, W("self_attn.kv_b_proj.v_rows")], "attn_v", heads=h, a=lora, b=vd,
            rows_out=True)  # (R, H·v)
    o = op("matmul", [ov, W("self_attn.o_proj.weight")], "o")
    x1 = op("add", [x, o], "resid_attn")
    h2 = op("rmsnorm", [x1, W("post_attention_layernorm.weight")], "ffn_norm", eps=cfg.eps)
    if cfg.sparse(i):
        y = op("moe", [h2, W("mlp.gate.weight"), W("mlp.experts.gate_up_proj"), W("mlp.experts.down_proj"),
                       W("mlp.gate.e_score_correction_bias")], "moe",
               experts=m.experts, k=m.k, inter=m.inter, norm_topk=m.norm_topk, act="silu",
               routing="sigmoid_group", groups=cfg.groups, topk_groups=cfg.topk_groups,
               route_scale=cfg.route_scale, **m.part_attrs())  # a rank's experts (engine/front/parallel.py)
        if cfg.shared_inter:
            se = "mlp.shared_experts."
            gp = op("matmul", [h2, W(se + "gate_proj.weight")], "sh_gate")
            up = op("matmul", [h2, W(se + "up_proj.weight")], "sh_up")
            sh = op("mul", [op("silu", [gp], "sh_gate_act"), up], "sh_glu")
            sh = op("matmul", [sh, W(se + "down_proj.weight")], "sh_down")
            y = op("add", [y, sh], "moe_out")
    else:
        gp = op("matmul", [h2, W("mlp.gate_proj.weight")], "gate")
        up = op("matmul", [h2, W("mlp.up_proj.weight")], "up")
        mm = op("mul", [op("silu", [gp], "gate_act"), up], "glu")
        y = op("matmul", [mm, W("mlp.down_proj.weight")], "down")
    return op("add", [x1, y], "resid_ffn")


# -- a GGUF file (llama.cpp's `deepseek2`) ----------------------------------------------------------------------------
# GGUF DeepSeek-V3 files (llama.cpp's `deepseek2` arch, as its convert_hf_to_gguf.py DeepseekV2Model writes them): the
# `DeepseekConfig` from the `deepseek2.*` keys, each refusal naming the file and the key, and a store putting back
# together what the converter split: newer converters write each layer's kv_b_proj as `attn_k_b` (each head's key
# expansion transposed, (H, lora, nope)) and `attn_v_b` ((H, v, lora)), older ones `attn_kv_b` as the checkpoint holds
# it. Nothing else is permuted: the converter writes q/kv_a rows as transformers holds them and llama.cpp rotates
# deepseek2 in adjacent pairs (its NORM rope), which is transformers' `rope_interleave`.


def deepseek_from_gguf(meta: dict[str, Any], tensors: dict[str, tuple[tuple[int, ...], str]], r, arch: str,
                       where: str, max_len: int, name: str):
    """The DeepseekConfig of a `deepseek2` file: `r` reads its `{arch}.*` keys, `tensors` GGUF name -> (shape,
    format) for the tied head and the vocabulary."""
    from lanefuse.engine.front.families.mixtures import MoeConfig

    def need(key: str, what: str) -> None:
        if not r.has(key):
            raise UserError(f"{where}: missing `{arch}.{key}` ({what})")

    def count(key: str, most: int = MAX_SIZE) -> int:  # 0 or more (at most `most`); absent 0
        v = r.c.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= most:
            raise UserError(f"{where}: `{arch}.{key}` is {v!r:.40}; expected a count (0..{most})")
        return v

    layers = r.size("block_count")
    if layers > MAX_LAYERS:
        raise UserError(f"{where}: `{arch}.block_count` is {layers}; expected at most {MAX_LAYERS}")
    if count("nextn_predict_layers"):  # DeepseekV2Model skips them; a file holding them counts them in block_count
        raise UserError(f"{where}: `{arch}.nextn_predict_layers` is {r.c['nextn_predict_layers']}; lanefuse's {arch} "
                        f"reads files without next-token-prediction layers (as llama.cpp's converter writes them)")
    hidden, heads = r.size("embedding_length"), r.size("attention.head_count")
    need("attention.kv_lora_rank", "the latent's width: latent attention")
    kv_lora = r.size("attention.kv_lora_rank")
    q_lora = r.size("attention.q_lora_rank") if r.has("attention.q_lora_rank") else 0
    need("rope.dimension_count", "the rotated part of each query and key head")
    rope = r.size("rope.dimension_count")
    if rope % 2:
        raise UserError(f"{where}: `{arch}.rope.dimension_count` {rope} is odd; the rotation turns pairs of values")
    # converters since MLA's absorbed form write the per-head widths as key/value_length_mla (key/value_length then
    # the latent's); older files hold them as key/value_length
    kk, vk = ("attention.key_length_mla", "attention.value_length_mla") \
        if r.has("attention.key_length_mla") else ("attention.key_length", "attention.value_length")
    need(kk, "each head's query/key width, unrotated and rotated parts")
    need(vk, "each head's value width")
    qk, v_dim = r.size(kk), r.size(vk)
    if qk <= rope:
        raise UserError(f"{where}: `{arch}.{kk}` {qk} leaves no unrotated part beside the {rope} rotated "
                        f"(`{arch}.rope.dimension_count`)")
    nope = qk - rope
    need("attention.layer_norm_rms_epsilon", "a positive number")
    eps = r.number("attention.layer_norm_rms_epsilon", 1e-6)
    theta = r.number("rope.freq_base", 10000.0)
    scaling, softmax = _yarn(r, arch, where)
    need("context_length", "a positive integer")
    ctx = r.size("context_length")
    need("expert_count", "the routed experts")
    experts, k = r.size("expert_count"), r.size("expert_used_count")
    if k > experts:
        raise UserError(f"{where}: `{arch}.expert_used_count` {k} is more than `{arch}.expert_count` {experts}")
    if not r.has("expert_gating_func"):  # llama.cpp takes its absence for DeepSeek-V2's softmax
        raise UserError(f"{where}: missing `{arch}.expert_gating_func`: llama.cpp reads its absence as DeepSeek-V2's "
                        f"softmax routing; lanefuse's {arch} routes by DeepSeek-V3's sigmoid (2)")
    if r.size("expert_gating_func") != 2:  # gguf.ExpertGatingFuncType.SIGMOID
        raise UserError(f"{where}: `{arch}.expert_gating_func` is {r.c['expert_gating_func']!r}; lanefuse's {arch} "
                        f"routes by DeepSeek-V3's sigmoid (2)")
    groups = r.size("expert_group_count") if r.has("expert_group_count") else 1
    topk_groups = r.size("expert_group_used_count") if r.has("expert_group_used_count") else groups
    if experts % groups or experts // groups < 2:
        raise UserError(f"{where}: `{arch}.expert_group_count` {groups} does not split the {experts} experts into "
                        f"equal groups of at least 2 (a group is ranked by the sum of its two best scores)")
    if topk_groups > groups:
        raise UserError(f"{where}: `{arch}.expert_group_used_count` {topk_groups} is more than the {groups} groups")
    if topk_groups * (experts // groups) < k:
        raise UserError(f"{where}: `{arch}.expert_used_count` {k} is more than the "
                        f"{topk_groups * (experts // groups)} experts of the {topk_groups} groups kept")
    dense, shared = count("leading_dense_block_count", layers), count("expert_shared_count")
    moe_inter = r.size("expert_feed_forward_length")
    inter = r.size("feed_forward_length") if dense else r.size("feed_forward_length", moe_inter)
    vocab = vocab_size(meta, tensors, r, where)
    moe = MoeConfig(experts, k, moe_inter, r.flag("expert_weights_norm") if r.has("expert_weights_norm") else False,
                    tuple(range(min(dense, layers), layers)))
    return DeepseekConfig(
        arch="DeepseekV3ForCausalLM", hidden=hidden, layers=layers, heads=heads, kv_heads=1, head_dim=rope,
        inter=inter, vocab=vocab, eps=eps, rope_theta=theta, rope_scaling=scaling,
        tie_embeddings="output.weight" not in tensors, max_len=min(max_len, ctx), name=name, moe=moe,
        q_lora=q_lora, kv_lora=kv_lora, nope=nope, v_dim=v_dim, scale=qk ** -0.5 * softmax, interleave=True,
        shared_inter=shared * moe_inter, groups=groups, topk_groups=topk_groups,
        route_scale=r.number("expert_weights_scale", 1.0) if r.has("expert_weights_scale") else 1.0)


def _yarn(r, arch: str, where: str) -> tuple[tuple[tuple[str, Any], ...], float]:
    """The rotation's scaling and the factor the softmax scale takes, as llama.cpp reads a deepseek2 file: YaRN from
    `rope.scaling.*`, `yarn_log_multiplier` the converter's 0.1 · mscale_all_dim (llama.cpp divides the 0.1 back out),
    cos and sin unscaled (llama.cpp takes mscale equal to mscale_all_dim for deepseek2: their ratio 1) and the softmax
    scale times mscale(factor, mscale_all_dim)², the ends of the ramp rounded out as ggml rounds them (transformers'
    `truncate`): transformers' DeepSeek-V3 with mscale == mscale_all_dim."""
    kind = r.text("rope.scaling.type", "none")
    if kind == "none":
        return (), 1.0
    if kind != "yarn":
        raise UserError(f"{where}: `{arch}.rope.scaling.type` is {kind!r:.40}; lanefuse's {arch} reads none or yarn")
    for key in ("rope.scaling.yarn_attn_factor", "rope.scaling.yarn_ext_factor"):
        if r.has(key) and r.number(key, 1.0) != 1.0:
            raise UserError(f"{where}: `{arch}.{key}` is {r.c[key]!r}; lanefuse's {arch} reads YaRN with the full "
                            f"ramp and llama.cpp's own attention factor (1)")
    if not r.has("rope.scaling.yarn_log_multiplier"):  # llama.cpp then scales cos/sin and the softmax both
        raise UserError(f"{where}: YaRN without `{arch}.rope.scaling.yarn_log_multiplier` (0.1 · mscale_all_dim, "
                        f"which the converter writes) is not read")
    if not r.has("rope.scaling.factor"):
        raise UserError(f"{where}: YaRN without `{arch}.rope.scaling.factor`")
    factor = r.number("rope.scaling.factor", 1.0)
    m = r.number("rope.scaling.yarn_log_multiplier", 0.0, low=0.0, low_open=False,
                 expected="a number of at least 0") / 0.1
    mscale = 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    return (("rope_type", "yarn"), ("factor", factor),
            ("beta_fast", r.number("rope.scaling.yarn_beta_fast", 32.0)),
            ("beta_slow", r.number("rope.scaling.yarn_beta_slow", 1.0)),
            ("original_max_position_embeddings", r.size("rope.scaling.original_context_length")),
            ("truncate", True), ("attention_factor", 1.0)), mscale * mscale


class DeepseekGGUFStore:
    """A `deepseek2` file's tensors (`base`: GGUFStore) with each layer's `kv_b_proj.weight` (H·(nope + v), lora)
    served as the checkpoint holds it where the file splits it into `attn_k_b` (H·lora, nope: each head's key
    expansion transposed) and `attn_v_b` (H·v, lora): head h's key rows (k_b[h] transposed), then its value rows, in
    f32 (a transposed block-format row is not a row of blocks: both are decoded). A file holding `attn_kv_b` is served
    as it is."""

    def __init__(self, base, cfg, where: str):
        self.base, self.cfg, self.where_ = base, cfg, where
        have = set(base.names())
        h, n, v, lora = cfg.heads, cfg.nope, cfg.v_dim, cfg.kv_lora
        self.joined: dict[str, tuple[str, str]] = {}
        for i in range(cfg.layers):
            a = f"model.layers.{i}.self_attn.kv_b_proj."
            kb, vb = a + "k_b", a + "v_b"
            s = f"model.layers.{i}.self_attn."
            for need, shape in ((cfg.query(i) + ".weight", (h * (n + cfg.head_dim), cfg.q_lora or cfg.hidden)),
                                (s + "kv_a_proj_with_mqa.weight", (lora + cfg.head_dim, cfg.hidden))):
                if need not in have:
                    why = "" if "kv_a" in need else (" (the metadata's `attention.q_lora_rank` names the low-rank "
                                                      "query, attn_q_a and attn_q_b)" if cfg.q_lora else
                                                      " (no `attention.q_lora_rank` in the metadata: the query "
                                                      "straight from attn_q)")
                    raise UserError(f"{where}: the file has no tensor `{base.file_name(need)}` (expected shape "
                                    f"{shape}){why}")
            if i in cfg.moe.sparse:  # named here as the file names them (ExpertStore names the checkpoint's)
                for need in ("mlp.gate.weight", "mlp.experts.gate_proj.stacked", "mlp.experts.up_proj.stacked",
                             "mlp.experts.down_proj"):
                    full = f"model.layers.{i}.{need}"
                    if full not in have:
                        raise UserError(f"{where}: the file has no tensor `{base.file_name(full)}`"
                                        f": layer {i} is a mixture ({cfg.moe.experts} experts; the metadata's "
                                        f"`leading_dense_block_count` makes the first {cfg.moe.sparse[0]} dense)")
            if a + "weight" in have:
                continue  # attn_kv_b as stored
            if kb not in have and vb not in have:
                raise UserError(f"{where}: the file has no tensor `{base.file_name(a + 'weight')}` (expected shape "
                                f"{(h * (n + v), lora)}), nor `{base.file_name(kb)}` and `{base.file_name(vb)}`: "
                                f"layer {i}'s key and value expansions are missing")
            check_shapes(base, have, {kb: (h * lora, n), vb: (h * v, lora)}, where,
                         f"{h} heads, key {n}, value {v}, latent {lora}",
                         lambda part, shape: (
                             f"the file has `{base.file_name(kb if part == vb else vb)}` but no "
                             f"`{base.file_name(part)}` (expected shape {shape}): layer {i}'s key and value "
                             f"expansions come in pairs"))
            self.joined[a + "weight"] = (kb, vb)
        self._cache: dict[str, tuple[np.ndarray, str]] = {}

    def names(self) -> list[str]:
        return list(dict.fromkeys(list(self.base.names()) + list(self.joined)))

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        if name not in self.joined:
            return self.base.info(name)
        c = self.cfg
        return (c.heads * (c.nope + c.v_dim), c.kv_lora), "f32"

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        if name not in self.joined:
            return self.base.raw(name)
        if name not in self._cache:
            from lanefuse.engine.front.weights import dequantize

            c = self.cfg
            kb, vb = (dequantize(np.asarray(a), f).reshape(s) for (a, f), s in (
                (self.base.raw(self.joined[name][0]), (c.heads, c.kv_lora, c.nope)),
                (self.base.raw(self.joined[name][1]), (c.heads, c.v_dim, c.kv_lora))))
            kv = np.concatenate([kb.transpose(0, 2, 1), vb], axis=1)  # (H, nope + v, lora)
            self._cache[name] = (np.ascontiguousarray(kv, np.float32).reshape(-1, c.kv_lora), "f32")
        return self._cache[name]

    def where(self, name: str) -> str:
        j = self.joined.get(name)
        return self.base.where(j[0] if j else name)

    def file_name(self, name: str) -> str:
        j = self.joined.get(name)
        return " + ".join(self.base.file_name(x) for x in j) if j else self.base.file_name(name)


class _Named:
    """A store (DeepseekStore) naming each tensor it cuts by the file tensor it is cut from."""

    def __init__(self, store, inner):
        self.store, self.inner = store, inner

    def __getattr__(self, k):
        return getattr(self.store, k)

    def file_name(self, name: str) -> str:
        d = getattr(self.store, "derived", {}).get(name)
        return self.inner.file_name(d[0] if d else name)


def deepseek_gguf_store(gstore, cfg, where: str):
    """A `deepseek2` file's store as the step reads it: kv_b_proj put back together, each mixture layer's experts
    stacked (mixtures.py), then cut as the step reads a checkpoint's (DeepseekStore); every name the file's."""
    from lanefuse.engine.front.families.mixtures import stack_store

    inner = stack_store(DeepseekGGUFStore(gstore, cfg, where), cfg, where)
    return _Named(cfg.serve(inner, where), inner)
