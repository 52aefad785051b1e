"""A dense decoder's shape (`ModelConfig`) and the step graph of one decode step or prefill chunk built from it
(`build_step`). Shapes only: the weights live in the model's weight store, which the graph's constants name."""

from __future__ import annotations

import functools
import inspect

from dataclasses import dataclass
from typing import Any

from lanefuse.engine.errors import UserError
from lanefuse.engine.ir import Constant, Graph, StepIO

MAX_CHUNK = 4096  # the largest prefill chunk a step graph is built for (`run` cuts a prompt by the lane's knob
# chunk_rows, up to this: the tensor cores want chunks of 2048 rows; numpy's BLAS GEMM gains from them too)


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
    moe: Any = None  # engine/front/families/mixtures.py MoeConfig: the expert mixture of the layers it names (None: every FFN dense)
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


MAX_BATCH = 256  # the most sequences a batch step decodes


def step_frame(cfg: ModelConfig, rows: int, batch: int = 1, attention=None,
               states: dict[str, tuple[int, ...]] | None = None) -> tuple[Graph, dict[int, tuple[str, str]]]:
    """A step graph's frame, every family's alike: `rows` checked, the I/O (token, pos, each attention layer's K and V
    cache tables of max_len rows, `cfg.cache_widths` wide: every layer's, or those `attention` lists; and the carried `states`, name -> shape)
    declared; and the caches' names, a (K, V) pair by layer. A batch step (`batch` B > 1) decodes one row for each of
    B sequences: token (B,), pos (B,) (row s at position pos[s]), each cache table (B·max_len, kv·hd), sequence s's
    rows the slot from s·max_len (the `states` given already a slot a sequence: the family's own shapes)."""
    if not 1 <= rows <= MAX_CHUNK:
        raise UserError(f"a step of {rows} rows: a step is 1 row (decode) or a prefill chunk of up to {MAX_CHUNK}")
    if not 1 <= batch <= MAX_BATCH:
        raise UserError(f"a batch of {batch} sequences: a batch step decodes 1..{MAX_BATCH}")
    if batch > 1 and rows != 1:
        raise UserError(f"a batch step of {rows}-row chunks: a batch decodes one row a sequence (each prompt is "
                        f"prefilled alone, into its slot's cache rows)")
    (kw, vw), L = cfg.cache_widths, cfg.max_len
    layers = range(cfg.layers) if attention is None else attention
    caches = {i: (f"kc{i}", f"vc{i}") for i in layers}
    states = states or {}
    g = Graph(io=StepIO(caches=tuple(caches.values()), states=tuple(states)))
    g.meta = {"model": cfg.name, "arch": cfg.arch, "layers": cfg.layers, "rows": rows * batch}
    if batch > 1:
        g.meta["batch"] = batch
    g.tensor("token", (rows * batch,), "i32")
    g.tensor("pos", (batch,), "i32")
    for k, v in caches.values():
        g.tensor(k, (batch * L, kw))
        g.tensor(v, (batch * L, vw))
    for name, shape in states.items():
        g.tensor(name, shape)
    return g, caches


def build_step(cfg: ModelConfig, rows: int = 1, batch: int = 1, last: int = 1) -> Graph:
    """The lifted graph of one step over `rows` token rows (1: a decode step; more: a prefill chunk) at the position
    `pos` names; the logits and next token of the last row — of each of the last `last` rows (a view of those rows of
    the residual: a verifier of `last - 1` drafted tokens reads the logits of each). `batch` B > 1: a decode step of
    B sequences, one row each (step_frame), the logits and next token of every row. A family of its own builds its
    own (engine/front/families/gemma.py)."""
    if not 1 <= last <= rows:
        raise UserError(f"the logits of the last {last} rows of a step of {rows}")
    build = getattr(cfg, "build_step", None)
    if last > 1 and build is not None:
        raise UserError(f"the logits of a step's last {last} rows: {cfg.arch}'s family builds the last row's only")
    if build is not None:
        if batch > 1 and "batch" not in inspect.signature(build).parameters:
            raise UserError(f"a batch step of {cfg.arch}: its family builds steps of one sequence only (yet); "
                            f"decode one sequence at a time")
        return build(rows, batch) if batch > 1 else build(rows)
    g, caches = step_frame(cfg, rows, batch)
    h, kv, hd, L = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.max_len

    def w(name: str, shape: tuple[int, ...], transposed: bool = True) -> str:
        kind = "rows" if len(shape) == 2 else "values"
        if name not in g.constants:
            g.constant(Constant(name, shape, kind, cfg.fmt(name) if kind == "rows" else "f32",
                                transposed if kind == "rows" else False, name))
        return name

    shapes = cfg.weight_names()
    g.constant(Constant("rope.cos", (L, cfg.rot // 2), "values", "f32", False, "rope.cos"))
    g.constant(Constant("rope.sin", (L, cfg.rot // 2), "values", "f32", False, "rope.sin"))
    embed = w("model.embed_tokens.weight", shapes["model.embed_tokens.weight"],
              transposed=cfg.tie_embeddings)  # tied: its rows the head's outputs too (engine/orientation.py)
    x = g.add("gather", [embed, "token"], "x0")
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        t = f"L{i}."

        def op(kind, ins, out, **attrs):
            return g.add(kind, ins, t + out, layer=i, **attrs)

        def W(name):
            return w(p + name, shapes[p + name])

        hn = op("rmsnorm", [x, W("input_layernorm.weight")], "attn_norm", eps=cfg.eps)
        q = op("matmul", [hn, W("self_attn.q_proj.weight")], "q")
        k = op("matmul", [hn, W("self_attn.k_proj.weight")], "k")
        v = op("matmul", [hn, W("self_attn.v_proj.weight")], "v")
        if cfg.qkv_bias or cfg.attn_bias:
            q = op("add", [q, W("self_attn.q_proj.bias")], "q_bias")
            k = op("add", [k, W("self_attn.k_proj.bias")], "k_bias")
            v = op("add", [v, W("self_attn.v_proj.bias")], "v_bias")
        if cfg.qk_norm:
            q = op("rmsnorm", [q, W("self_attn.q_norm.weight")], "q_norm", eps=cfg.eps, heads=h)
            k = op("rmsnorm", [k, W("self_attn.k_norm.weight")], "k_norm", eps=cfg.eps, heads=kv)
        q = op("rope", [q, "rope.cos", "rope.sin", "pos"], "q_rot", heads=h, hd=hd, rot=cfg.rot)
        k = op("rope", [k, "rope.cos", "rope.sin", "pos"], "k_rot", heads=kv, hd=hd, rot=cfg.rot)
        kc = op("set_row", [caches[i][0], k, "pos"], "kc")
        vc = op("set_row", [caches[i][1], v, "pos"], "vc")
        a = op("attention", [q, kc, vc, "pos"], "attn", heads=h, kv_heads=kv, hd=hd, vd=hd,
               scale=float(hd) ** -0.5, window=cfg.window if cfg.sliding(i) else 0, softcap=0.0)
        o = op("matmul", [a, W("self_attn.o_proj.weight")], "o")
        if cfg.attn_bias:
            o = op("add", [o, W("self_attn.o_proj.bias")], "o_bias")
        x1 = op("add", [x, o], "resid_attn")
        h2 = op("rmsnorm", [x1, W("post_attention_layernorm.weight")], "ffn_norm", eps=cfg.eps)
        if cfg.sparse(i):
            dn = cfg.moe.ffn(cfg, i, h2, op, W)
        else:
            gp = op("matmul", [h2, W("mlp.gate_proj.weight")], "gate")
            up = op("matmul", [h2, W("mlp.up_proj.weight")], "up")
            if cfg.mlp_bias:
                gp = op("add", [gp, W("mlp.gate_proj.bias")], "gate_bias")
                up = op("add", [up, W("mlp.up_proj.bias")], "up_bias")
            act = op(cfg.act, [gp], "gate_act")
            m = op("mul", [act, up], "glu")
            dn = op("matmul", [m, W("mlp.down_proj.weight")], "down")
            if cfg.mlp_bias:
                dn = op("add", [dn, W("mlp.down_proj.bias")], "down_bias")
        x = op("add", [x1, dn], "resid_ffn")
    if rows > last:
        x = g.add("view", [x], "last", row=rows - last, **({"rows": last} if last > 1 else {}))
    hn = g.add("rmsnorm", [x, w("model.norm.weight", shapes["model.norm.weight"])], "final_norm", eps=cfg.eps)
    head = embed if cfg.tie_embeddings else w("lm_head.weight", shapes["lm_head.weight"])
    g.add("matmul", [hn, head], "logits")
    g.add("argmax", ["logits"], "next")
    g.validate()
    return g
