"""GGUF DeepSeek-V3 files (llama.cpp's `deepseek2` arch, as its convert_hf_to_gguf.py DeepseekV2Model writes them):
the `DeepseekConfig` from the `deepseek2.*` keys, each refusal naming the file and the key, and a store putting back
together what the converter split: newer converters write each layer's kv_b_proj as `attn_k_b` (each head's key
expansion transposed, (H, lora, nope)) and `attn_v_b` ((H, v, lora)), older ones `attn_kv_b` as the checkpoint holds
it. Nothing else is permuted: the converter writes q/kv_a rows as transformers holds them and llama.cpp rotates
deepseek2 in adjacent pairs (its NORM rope), which is transformers' `rope_interleave`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from lanefuse.engine.errors import UserError
from lanefuse.engine.front.gguf_shapes import check_shapes, vocab_size
from lanefuse.engine.front.hfconfig import MAX_LAYERS, MAX_SIZE


def deepseek_from_gguf(meta: dict[str, Any], tensors: dict[str, tuple[tuple[int, ...], str]], r, arch: str,
                       where: str, max_len: int, name: str):
    """The DeepseekConfig of a `deepseek2` file: `r` reads its `{arch}.*` keys, `tensors` GGUF name -> (shape,
    format) for the tied head and the vocabulary."""
    from lanefuse.engine.front.families.deepseek import DeepseekConfig
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
    """A store (engine/front/families/deepseek.py's DeepseekStore) naming each tensor it cuts by the file tensor it is cut from."""

    def __init__(self, store, inner):
        self.store, self.inner = store, inner

    def __getattr__(self, k):
        return getattr(self.store, k)

    def file_name(self, name: str) -> str:
        d = getattr(self.store, "derived", {}).get(name)
        return self.inner.file_name(d[0] if d else name)


def deepseek_gguf_store(gstore, cfg, where: str):
    """A `deepseek2` file's store as the step reads it: kv_b_proj put back together, each mixture layer's experts
    stacked (engine/front/families/mixtures.py), then cut as the step reads a checkpoint's (DeepseekStore); every name the file's."""
    from lanefuse.engine.front.families.mixtures import stack_store

    inner = stack_store(DeepseekGGUFStore(gstore, cfg, where), cfg, where)
    return _Named(cfg.serve(inner, where), inner)
