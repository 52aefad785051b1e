"""Qwen3-Next (`Qwen3NextForCausalLM`): its config.json read into a `Qwen3NextConfig` (4.x and 5.x layouts), its
checkpoint's fused projections served split (`SplitStore`) and the step graph of one decode step or prefill chunk:
per `layer_types`, gated delta-net layers (q/k/v/z and b/a products, causal convolutions with their carried rings,
SiLU, L2-normed q and k, the write strength and forget gate, the gated delta rule over a carried recurrent state with
its gated output norm) and gated full-attention layers (a query and its gate from one product, zero-centred q/k norms,
partial rotary, the attention output times sigmoid(gate)); zero-centred (1 + w) norms; Qwen2-MoE's mixture with its
sigmoid-gated shared expert (engine/front/families/mixtures.py) or a dense MLP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from lanefuse.engine.errors import UserError
from lanefuse.engine.front.families.gemma import ONE_PLUS
from lanefuse.engine.front.family import Family
from lanefuse.engine.front.gguf_names import EXPERTS, QK_NORM, SHARED_EXPERT, Names
from lanefuse.engine.front.hfconfig import MAX_LAYERS, Reader, read_rope
from lanefuse.engine.front.decoder import logits, mlp
from lanefuse.engine.front.model import ModelConfig, read_layer_types
from lanefuse.engine.formats.layout import BLOCK_FORMATS
from lanefuse.engine.front.weights import PartsStore

ARCHS = ("Qwen3NextForCausalLM",)
# Qwen3-Next (llama.cpp's `qwen3next`, every layer a mixture with the shared expert): the layer's norms (held as 1 + w
# by the converter, the gated delta net's own norm as w), a gated attention's q_proj whole (each head's query and gate),
# and the gated delta net's tensors under the HF names the split store (below) reads: ssm_in is
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


class Qwen3Next(Family):
    name = "qwen3next"
    hf = ARCHS
    gguf = {"qwen3next": Names("Qwen3NextForCausalLM", {**QWEN3NEXT_LAYER, **EXPERTS, **SHARED_EXPERT}, moe="normed",
                               as_row=("ffn_gate_inp_shexp.weight",))}

    @classmethod
    def read_config(cls, c, arch, where, max_len, name):
        return qwen3next_config(c, where, max_len, name)

    @classmethod
    def from_gguf(cls, cfg, r, arch, where, meta, tensors):  # the gated delta net's keys
        return qwen3next_from_gguf(cfg, r, arch, where, meta)
LAYER_TYPES = ("linear_attention", "full_attention")
L2_EPS = 1e-6  # the L2 norm of q and k inside transformers' delta rule (use_qk_l2norm_in_kernel), fixed
ELEMENTWISE = ("f32", "f16", "bf16")  # stored formats whose rows the split store can take apart

# What transformers (5.24) takes for a key config.json leaves out: Qwen3NextConfig's defaults (its __post_init__
# sets partial_rotary_factor 0.25 and the layer types from full_attention_interval 4).
DEFAULTS = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
                num_attention_heads=16, num_key_value_heads=2, hidden_act="silu", rms_norm_eps=1e-6, head_dim=256,
                linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_num_key_heads=16, linear_num_value_heads=32, decoder_sparse_step=1,
                moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts_per_tok=10,
                num_experts=512, norm_topk_prob=True, max_position_embeddings=32768, rope_theta=10000.0)


@dataclass(frozen=True)
class Qwen3NextConfig(ModelConfig):
    """A Qwen3-Next's shape: a ModelConfig (heads, kv_heads, head_dim: the full-attention layers') and the gated delta
    net's sizes."""

    taps: int = 4  # linear_conv_kernel_dim
    hk: int = 16  # linear_num_key_heads
    hv: int = 32  # linear_num_value_heads
    dk: int = 128  # linear_key_head_dim
    dv: int = 128  # linear_value_head_dim
    norm_offset: float = 1.0  # the zero-centred norms scale by norm_offset + w (a GGUF file holds 1 + w: 0)

    def linear(self, i: int) -> bool:
        return self.layer_types[i] == "linear_attention"

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.layers) if not self.linear(i))

    # the step on engine/front/decoder.py's skeleton: the attention layers' caches and the delta net's carried
    # states in the frame, the rope tables after the embedding, its layer, the zero-centred final norm
    def frame_io(self, batch: int) -> dict[str, Any]:
        return {"attention": self.attention_layers, "states": self.states(batch)}

    def embed(self, step) -> str:
        step.embed = step.w("model.embed_tokens.weight", transposed=self.tie_embeddings)  # tied: the head's too
        x = step.g.add("gather", [step.embed, "token"], "x0")
        step.values("rope.cos"), step.values("rope.sin")
        return x

    def layer(self, step, i: int, x: str) -> str:
        return qwen3next_layer(step, i, x)

    def logits(self, step, x: str) -> str:
        return logits(step, x, norm=step.values("model.norm.weight" + ONE_PLUS))

    def states(self, batch: int = 1) -> dict[str, tuple[int, ...]]:
        """Each delta-net layer's carried state, name -> shape: the q, k and v convolutions' rings (their last taps-1
        inputs) and the recurrent state (a (dk, dv) matrix a value head); a batch's, a slot of them a sequence."""
        t, kd, vd = batch * (self.taps - 1), self.hk * self.dk, self.hv * self.dv
        out: dict[str, tuple[int, ...]] = {}
        for i in range(self.layers):
            if self.linear(i):
                out.update({f"cq{i}": (t, kd), f"ck{i}": (t, kd), f"cv{i}": (t, vd),
                            f"ds{i}": (batch * self.hv * self.dk, self.dv)})
        return out

    def carried(self) -> dict[str, tuple[int, ...]]:
        shape = (self.max_len, self.kv_heads * self.head_dim)
        kv = {n: shape for i in self.attention_layers for n in (f"kc{i}", f"vc{i}")}
        return {**kv, **self.states()}

    def state_bytes(self) -> tuple[int, int]:
        """(bytes of the carried states, bytes of the full-attention layers' KV caches), f32, one sequence."""
        st = sum(int(np.prod(s)) for s in self.states().values()) * 4
        kv = len(self.attention_layers) * 2 * self.max_len * self.kv_heads * self.head_dim * 4
        return st, kv

    def norm_names(self) -> list[str]:
        out = ["model.norm.weight"]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            if not self.linear(i):
                out += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        return out

    def weight_names(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the step reads, with its shape: the split projections under the names `SplitStore` serves
    (`in_proj_qkvz.split`: in_proj_qkvz's rows reordered, every key head's q, then k, then v, then z)."""
        d, h, kv, hd, f = self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter
        kd, vd = self.hk * self.dk, self.hv * self.dv
        w: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, d)}
        if not self.tie_embeddings:
            w["lm_head.weight"] = (self.vocab, d)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            if self.linear(i):
                a = p + "linear_attn."
                w.update({a + "in_proj_qkvz.split.weight": (2 * kd + 2 * vd, d),
                          a + "in_proj_b.weight": (self.hv, d), a + "in_proj_a.weight": (self.hv, d),
                          a + "conv1d.q.weight": (kd, self.taps), a + "conv1d.k.weight": (kd, self.taps),
                          a + "conv1d.v.weight": (vd, self.taps), a + "A_log": (self.hv,),
                          a + "dt_bias": (self.hv,), a + "norm.weight": (self.dv,),
                          a + "out_proj.weight": (d, vd)})
            else:
                a = p + "self_attn."
                w.update({a + "q_proj.query.weight": (h * hd, d), a + "q_proj.gate.weight": (h * hd, d),
                          a + "k_proj.weight": (kv * hd, d), a + "v_proj.weight": (kv * hd, d),
                          a + "o_proj.weight": (d, h * hd)})
            if self.sparse(i):
                from lanefuse.engine.front.families.mixtures import weight_names

                w.update(weight_names(self, i))
            else:
                w.update({p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                          p + "mlp.down_proj.weight": (d, f)})
        for n in self.norm_names():
            w[n] = (hd,) if n.endswith(("q_norm.weight", "k_norm.weight")) else (d,)
        return w

    def split_store(self, base, where: str) -> "SplitStore":
        return SplitStore(base, self, where)

    # -- the constants the weight store generates (weights.py asks) ------------------------------------------

    def generated(self) -> dict[str, tuple[int, ...]]:
        """The rotary tables and each zero-centred norm's 1 + w (f32)."""
        t = (self.max_len, self.rot // 2)
        shapes = self.weight_names()
        return {"rope.cos": t, "rope.sin": t, **{n + ONE_PLUS: shapes[n] for n in self.norm_names()}}

    def generate(self, name: str, weights) -> dict[str, np.ndarray]:
        """A norm's 1 + w: the stored weight decoded to f32, then 1 added in f32 (transformers'
        `1.0 + self.weight.float()`), or as stored where the file holds 1 + w (GGUF); or the rotary tables."""
        from lanefuse.engine.front.weights import rope_tables

        if name.endswith(ONE_PLUS):
            w = np.asarray(weights.get(name[: -len(ONE_PLUS)]), dtype=np.float32)
            return {name: (np.float32(self.norm_offset) + w).astype(np.float32)}
        return rope_tables(self)


# -- the checkpoint's fused tensors, served split ---------------------------------------------------------------------

def _splits(cfg: Qwen3NextConfig, i: int) -> dict[str, tuple[str, np.ndarray]]:
    """Layer i's split tensors: name -> (the stored tensor, its rows taken in order). transformers' in_proj_qkvz and
    in_proj_ba lay their rows out by key-head group (`fix_query_key_value_ordering`): group j holds its q (dk), k (dk),
    v (r·dv) and z (r·dv) rows, r = hv / hk, and its r b then r a rows; in_proj_qkvz.split holds every group's q rows,
    then their k, v and z rows (one product whose outputs the convolutions and the delta rule read in parts); the
    convolution's channels are q, k, v joined; a gated attention's q_proj holds each head's query (hd) then its gate
    (hd)."""
    p = f"model.layers.{i}."
    if not cfg.linear(i):
        h, hd = cfg.heads, cfg.head_dim
        heads = np.arange(h)[:, None] * 2 * hd
        src = p + "self_attn.q_proj.weight"
        return {p + "self_attn.q_proj.query.weight": (src, (heads + np.arange(hd)).reshape(-1)),
                p + "self_attn.q_proj.gate.weight": (src, (heads + hd + np.arange(hd)).reshape(-1))}
    a = p + "linear_attn."
    hk, dk, dv, r = cfg.hk, cfg.dk, cfg.dv, cfg.hv // cfg.hk
    group = 2 * dk + 2 * r * dv
    base = np.arange(hk)[:, None] * group
    rows = {"q": (0, dk), "k": (dk, dk), "v": (2 * dk, r * dv), "z": (2 * dk + r * dv, r * dv)}
    order = np.concatenate([(base + off + np.arange(n)).reshape(-1) for off, n in rows.values()])
    out = {a + "in_proj_qkvz.split.weight": (a + "in_proj_qkvz.weight", order)}
    gb = np.arange(hk)[:, None] * 2 * r
    out[a + "in_proj_b.weight"] = (a + "in_proj_ba.weight", (gb + np.arange(r)).reshape(-1))
    out[a + "in_proj_a.weight"] = (a + "in_proj_ba.weight", (gb + r + np.arange(r)).reshape(-1))
    kd = hk * dk
    chans = {"q": np.arange(kd), "k": kd + np.arange(kd), "v": 2 * kd + np.arange(cfg.hv * dv)}
    for part, idx in chans.items():
        out[a + f"conv1d.{part}.weight"] = (a + "conv1d.weight", idx)
    return out


class SplitStore(PartsStore):
    """A weight store (weights.py's backends) that also serves Qwen3-Next's fused tensors split into the parts
    the step reads, as rows of the stored tensors in their stored format (no copy until read; a block format's rows
    are whole blocks, so rows of it taken apart are still that format). A GGUF file's (gguf_names.py) may hold
    in_proj_qkvz as its q, k, v rows and its z rows apart (served joined) and -exp(A_log) for A_log (served as
    log(-A)). A fused tensor missing or of the wrong shape is named at load."""

    def __init__(self, base, cfg: Qwen3NextConfig, where: str):
        super().__init__(base, {}, where)
        name_of = getattr(base, "file_name", lambda n: n)  # a GGUF store names its tensors as the file does
        self.log_neg: set[str] = set()  # the parts read as log(-values): A_log from a GGUF file's -exp(A_log)
        have = set(base.names())
        d, kd, vd = cfg.hidden, cfg.hk * cfg.dk, cfg.hv * cfg.dv
        stored = {"in_proj_qkvz.weight": [(2 * kd + 2 * vd, d)], "in_proj_qkv.weight": [(2 * kd + vd, d)],
                  "in_proj_z.weight": [(vd, d)], "in_proj_ba.weight": [(2 * cfg.hv, d)],
                  "conv1d.weight": [(2 * kd + vd, 1, cfg.taps), (2 * kd + vd, cfg.taps)],
                  "q_proj.weight": [(2 * cfg.heads * cfg.head_dim, d)], "A": [(cfg.hv,)]}
        shapes = cfg.weight_names()

        def check(src: str) -> str:
            want = stored[src.rsplit(".", 2)[-2] + ".weight" if src.endswith(".weight") else src.rsplit(".", 1)[-1]]
            if src not in have:
                raise UserError(f"{where}: the checkpoint has no tensor `{name_of(src)}` (expected shape {want[0]})")
            got, fmt = base.info(src)
            if tuple(got) not in want:
                raise UserError(f"{where}: tensor `{name_of(src)}` has shape {tuple(got)}, expected {want[0]} (from "
                                f"the model's config)")
            if fmt not in ELEMENTWISE + tuple(BLOCK_FORMATS):
                raise UserError(f"{where}: tensor `{name_of(src)}` is stored as {fmt}; Qwen3-Next's fused "
                                f"projections are read from {', '.join(ELEMENTWISE)} or block-format rows only")
            return fmt

        for i in range(cfg.layers):
            a = f"model.layers.{i}.linear_attn."
            for name, (src, idx) in _splits(cfg, i).items():
                pieces: tuple[tuple[str, np.ndarray], ...] = ((src, idx),)
                if src == a + "in_proj_qkvz.weight" and src not in have and a + "in_proj_qkv.weight" in have:
                    pieces = ((a + "in_proj_qkv.weight", np.arange(2 * kd + vd)), (a + "in_proj_z.weight",
                                                                                  np.arange(vd)))
                fmts = {check(p) for p, _ in pieces}
                if len(fmts) > 1:
                    raise UserError(f"{where}: tensors {' and '.join(f'`{name_of(p)}`' for p, _ in pieces)} are "
                                    f"stored as {' and '.join(sorted(fmts))}; lanefuse reads them as one product, "
                                    f"in one format")
                self.parts[name] = (pieces, shapes[name])
            if cfg.linear(i) and a + "A_log" not in have and a + "A" in have:  # a GGUF file's ssm_a: -exp(A_log)
                check(a + "A")
                self.parts[a + "A_log"] = (((a + "A", np.arange(cfg.hv)),), (cfg.hv,))
                self.log_neg.add(a + "A_log")

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        if name in self.log_neg:
            return self.parts[name][1], "f32"
        return super().info(name)

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        if name not in self.log_neg:
            return super().raw(name)
        from lanefuse.engine.front.weights import dequantize

        rows, fmt = self.rows(name)
        neg = -np.asarray(dequantize(rows.reshape(-1), fmt), dtype=np.float64)
        if not (neg > 0).all():
            raise UserError(f"{self.where(name)}: holds a value that is not negative; it is -exp(A_log), a "
                            f"negative number for every value head")
        return np.log(neg).astype(np.float32), "f32"


# -- config.json ------------------------------------------------------------------------------------------------------

def _layer_types(r, layers: int) -> tuple[str, ...]:
    """`layer_types`, or transformers' default: every `full_attention_interval`-th layer full attention."""
    return read_layer_types(r, layers, lambda i: (i + 1) % r.size("full_attention_interval", 4), LAYER_TYPES)


def qwen3next_config(c: dict[str, Any], where: str, max_len: int, name: str) -> Qwen3NextConfig:
    """A Qwen3-Next config.json over transformers' defaults, read into a Qwen3NextConfig; what the step cannot express
    refused naming the key. hfconfig, which imports this module, passes its reader class, rope reading and layer
    limit."""
    t = {**DEFAULTS, **{k: v for k, v in c.items() if v is not None or k == "rope_parameters"}}
    params = t.get("rope_parameters")
    if t.get("partial_rotary_factor") is None and not (isinstance(params, dict) and "partial_rotary_factor" in params):
        t["partial_rotary_factor"] = 0.25  # transformers' default for the family
    r = Reader(t, where)
    act = r.text("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"{where}: hidden_act `{act:.40}` is not supported for Qwen3-Next (only silu)")
    if r.flag("attention_bias"):
        raise UserError(f"{where}: attention_bias is not supported for Qwen3-Next (its q/k/v/o products have no "
                        f"biases)")
    hidden, heads, layers, inter, vocab, kv = r.sizes(MAX_LAYERS)
    head_dim = r.size("head_dim")
    eps = r.number("rms_norm_eps", 1e-6)
    theta, scaling, partial = read_rope(r)
    if int(head_dim * partial) < 2:
        raise UserError(f"{where}: a rotary width of {int(head_dim * partial)} (head_dim {head_dim} x "
                        f"partial_rotary_factor {partial}); expected at least 2")
    taps = r.size("linear_conv_kernel_dim")
    if taps < 2:
        raise UserError(f"{where}: `linear_conv_kernel_dim` is {taps}; expected at least 2 (a convolution over "
                        f"the rows before a row)")
    hk, hv = r.size("linear_num_key_heads"), r.size("linear_num_value_heads")
    if hv % hk:
        raise UserError(f"{where}: `linear_num_key_heads` {hk} does not divide `linear_num_value_heads` {hv} (value "
                        f"heads are grouped over the key heads)")
    dk, dv = r.size("linear_key_head_dim"), r.size("linear_value_head_dim")
    types = _layer_types(r, layers)
    experts = t.get("num_experts")
    moe = None
    if experts != 0:
        from lanefuse.engine.front.families.mixtures import read_moe

        moe = read_moe(r, "Qwen3NextForCausalLM", layers)
        if not moe.sparse:
            moe = None
    max_pos = r.size("max_position_embeddings")
    return Qwen3NextConfig(
        arch="Qwen3NextForCausalLM", hidden=hidden, layers=layers, heads=heads, kv_heads=kv, head_dim=head_dim,
        inter=inter, vocab=vocab, eps=eps, rope_theta=theta, rope_scaling=scaling, partial_rotary=partial,
        tie_embeddings=r.flag("tie_word_embeddings"), qk_norm=True, max_len=min(max_len, max_pos), name=name,
        moe=moe, layer_types=types, taps=taps, hk=hk, hv=hv, dk=dk, dv=dv)


# -- a GGUF file's keys (llama.cpp's `qwen3next`) ----------------------------------------------------------------------

def qwen3next_from_gguf(cfg: ModelConfig, r, arch: str, where: str, meta: dict[str, Any]) -> Qwen3NextConfig:
    """A GGUF file's Qwen3-Next from the dense reading `cfg` and the `{arch}.*` keys `r` reads, as llama.cpp takes
    them: the delta net's sizes from `ssm.*` (conv_kernel: the taps; state_size: a key head's width; group_count: the
    key heads; time_step_rank: the value heads; inner_size: all value heads' width), the layer types from
    `attention.recurrent_layers` or else `full_attention_interval` (default 4: every fourth layer full attention), a
    mixture in every layer, norms held as 1 + w."""
    import dataclasses

    from lanefuse.engine.front.model import ModelConfig as Base

    if cfg.moe is None:
        raise UserError(f"{where}: missing `{arch}.expert_count` (llama.cpp's {arch} has a mixture in every layer)")
    base = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Base)}
    base.update(qkv_bias=False, qk_norm=True)
    taps, dk = r.size("ssm.conv_kernel"), r.size("ssm.state_size")
    hk, hv, inner = r.size("ssm.group_count"), r.size("ssm.time_step_rank"), r.size("ssm.inner_size")
    if taps < 2:
        raise UserError(f"{where}: `{arch}.ssm.conv_kernel` is {taps}; expected at least 2")
    if hv % hk:
        raise UserError(f"{where}: `{arch}.ssm.group_count` {hk} does not divide `{arch}.ssm.time_step_rank` {hv} "
                        f"(value heads are grouped over the key heads)")
    if inner % hv:
        raise UserError(f"{where}: `{arch}.ssm.inner_size` {inner} is not a whole number of "
                        f"`{arch}.ssm.time_step_rank` {hv} value heads")
    layers = cfg.layers
    key = f"{arch}.attention.recurrent_layers"
    if key in meta:
        rec = meta[key]
        if not isinstance(rec, list) or len(rec) != layers or not all(isinstance(x, (bool, int)) for x in rec):
            raise UserError(f"{where}: `{key}` is {str(rec)[:40]}; expected {layers} flags, one a layer")
        types = tuple("linear_attention" if x else "full_attention" for x in rec)
    else:
        n = r.size("full_attention_interval", 4)
        types = tuple("linear_attention" if (i + 1) % n else "full_attention" for i in range(layers))
    base.update(layer_types=types)
    return Qwen3NextConfig(**base, taps=taps, hk=hk, hv=hv, dk=dk, dv=inner // hv, norm_offset=0.0)


# -- the step graph ---------------------------------------------------------------------------------------------------

def qwen3next_layer(s, i: int, x: str) -> str:
    """Layer i of a Qwen3-Next step (a batch's decode step too: each sequence its slot of the KV caches, the rings and
    the states): the gated delta net (its convolution ring and state carried) or the gated attention, then the
    mixture or the dense MLP; the norms zero-centred (scaling by 1 + w)."""
    cfg, caches = s.cfg, s.caches
    h, kv, hd = cfg.heads, cfg.kv_heads, cfg.head_dim
    hk, hv, dk, dv = cfg.hk, cfg.hv, cfg.dk, cfg.dv
    cos, sin, values = "rope.cos", "rope.sin", s.values
    p = f"model.layers.{i}."

    def op(kind, ins, out, **attrs):
        return s.op(i, kind, ins, out, **attrs)

    def W(name):
        return s.W(i, name)

    def norm_w(name: str) -> str:  # the zero-centred norm scales by 1 + w: the generated f32 constant
        return values(name + ONE_PLUS)

    hn = op("rmsnorm", [x, norm_w(p + "input_layernorm.weight")], "attn_norm", eps=cfg.eps)
    if cfg.linear(i):
        a = "linear_attn."
        kd, vd = hk * dk, hv * dv
        qkvz = op("matmul", [hn, W(a + "in_proj_qkvz.split.weight")], "qkvz")  # (R, q | k | v | z)
        b = op("matmul", [hn, W(a + "in_proj_b.weight")], "b")
        ar = op("matmul", [hn, W(a + "in_proj_a.weight")], "a")
        conv = {}
        for part, start, ring in (("q", 0, f"cq{i}"), ("k", kd, f"ck{i}"), ("v", 2 * kd, f"cv{i}")):
            c = op("causal_conv", [qkvz, values(p + a + f"conv1d.{part}.weight"), ring], f"{part}_conv",
                   taps=cfg.taps, start=start)
            conv[part] = op("silu", [c], f"{part}_act")
        qn = op("l2norm", [conv["q"]], "q_l2", heads=hk, eps=L2_EPS)
        kn = op("l2norm", [conv["k"]], "k_l2", heads=hk, eps=L2_EPS)
        beta = op("sigmoid", [b], "beta")
        decay = op("decay", [ar, values(p + a + "dt_bias"), values(p + a + "A_log")], "decay")
        o = op("gated_delta", [qn, kn, conv["v"], qkvz, beta, decay, f"ds{i}", values(p + a + "norm.weight")],
               "delta", hk=hk, hv=hv, dk=dk, dv=dv, scale=float(dk) ** -0.5, eps=cfg.eps, zoff=2 * kd + vd)
        mixed = op("matmul", [o, W(a + "out_proj.weight")], "o")
    else:
        a = "self_attn."
        q = op("matmul", [hn, W(a + "q_proj.query.weight")], "q")
        gate = op("matmul", [hn, W(a + "q_proj.gate.weight")], "q_gate")
        k = op("matmul", [hn, W(a + "k_proj.weight")], "k")
        v = op("matmul", [hn, W(a + "v_proj.weight")], "v")
        q = op("rmsnorm", [q, norm_w(p + a + "q_norm.weight")], "q_norm", eps=cfg.eps, heads=h)
        k = op("rmsnorm", [k, norm_w(p + a + "k_norm.weight")], "k_norm", eps=cfg.eps, heads=kv)
        q = op("rope", [q, cos, sin, "pos"], "q_rot", heads=h, hd=hd, rot=cfg.rot)
        k = op("rope", [k, cos, sin, "pos"], "k_rot", heads=kv, hd=hd, rot=cfg.rot)
        kc = op("set_row", [caches[i][0], k, "pos"], "kc")
        vc = op("set_row", [caches[i][1], v, "pos"], "vc")
        att = op("attention", [q, kc, vc, "pos"], "attn", heads=h, kv_heads=kv, hd=hd, vd=hd,
                 scale=float(hd) ** -0.5, window=0, softcap=0.0)
        ga = op("sigmoid", [gate], "q_gate_act")
        gated = op("mul", [att, ga], "attn_gated")
        mixed = op("matmul", [gated, W(a + "o_proj.weight")], "o")
    x1 = op("add", [x, mixed], "resid_attn")
    h2 = op("rmsnorm", [x1, norm_w(p + "post_attention_layernorm.weight")], "ffn_norm", eps=cfg.eps)
    dn = mlp(s, i, h2)
    return op("add", [x1, dn], "resid_ffn")
