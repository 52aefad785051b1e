"""The decoder step's skeleton, every dense family's alike: the frame (`step_frame`, every family's), the rope
tables, the embedding, one layer after another, the last rows, the final norm, the head and the arg-max (`build`); and
the blocks a layer is made of (`attention`: q/k/v, their biases and norms, the rotation, the caches, the attention and
the o product; `mlp`: the gated MLP). A family supplies only its layer (its config's `layer(step, i, x)`), made of
these blocks and what differs."""

from __future__ import annotations

from lanefuse.engine.errors import UserError
from lanefuse.engine.ir import MAX_BATCH, MAX_CHUNK, Constant, Graph, StepIO


def step_frame(cfg, rows: int, batch: int = 1, attention=None,
               states: dict[str, tuple[int, ...]] | None = None) -> tuple[Graph, dict[int, tuple[str, str]]]:
    """A step graph's frame, every family's alike: `rows` checked, the I/O (token, pos, each attention layer's K and V
    cache tables of max_len rows, `cfg.cache_widths` wide: every layer's, or those `attention` lists; and the carried
    `states`, name -> shape) declared; and the caches' names, a (K, V) pair by layer. A batch step (`batch` B > 1)
    decodes one row for each of B sequences: token (B,), pos (B,) (row s at position pos[s]), each cache table
    (B·max_len, kv·hd), sequence s's rows the slot from s·max_len (the `states` given already a slot a sequence: the
    family's own shapes)."""
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


class Step:
    """A step graph being built for `cfg`: its constants named as the checkpoint names them (`w`), layer i's ops
    (`op`, named `L{i}.out`) and tensors (`W`, under `model.layers.{i}.`), the caches by layer."""

    def __init__(self, cfg, g: Graph, caches: dict[int, tuple[str, str]]):
        self.cfg, self.g, self.caches = cfg, g, caches
        self.shapes = cfg.weight_names()
        self.generated = cfg.generated() if hasattr(cfg, "generated") else {}  # a family's generated constants
        self.embed = ""  # the embedding's constant (the head's too, where tied)

    def w(self, name: str, transposed: bool = True) -> str:
        """A checkpoint tensor as a constant: rows (a 2-D tensor, in its stored format) or f32 values."""
        shape = self.shapes[name]
        kind = "rows" if len(shape) == 2 else "values"
        if name not in self.g.constants:
            self.g.constant(Constant(name, shape, kind, self.cfg.fmt(name) if kind == "rows" else "f32",
                                     transposed if kind == "rows" else False, name))
        return name

    def W(self, i: int, name: str, transposed: bool = True) -> str:
        return self.w(f"{self.cfg.layer_prefix}{i}.{name}", transposed)

    def values(self, name: str) -> str:
        """An f32 values constant: one the family generates (rope tables, a norm's 1 + w), or a checkpoint tensor."""
        if name not in self.g.constants:
            shape = self.generated[name] if name in self.generated else self.shapes[name]
            self.g.constant(Constant(name, shape, "values", "f32", False, name))
        return name

    def op(self, i: int, kind: str, ins: list[str], out: str, **attrs) -> str:
        return self.g.add(kind, ins, f"L{i}.{out}", layer=i, **attrs)


def attention(s: Step, i: int, hn: str, qk_norm: str = "") -> str:
    """Layer i's attention over its normed input `hn`: q, k and v (biased where the config says), q and k normed
    (`qk_norm` "heads": each head's values, Qwen3's; "whole": the whole projection, OLMo 2's; "" as the config says),
    rotated, k and v written to the caches at `pos`, the attention, the o product (biased where Llama's
    attention_bias says). Returns the o product's output."""
    cfg, op, W = s.cfg, (lambda *a, **k: s.op(i, *a, **k)), (lambda n: s.W(i, n))
    h, kv, hd = cfg.heads, cfg.kv_heads, cfg.head_dim
    q = op("matmul", [hn, W("self_attn.q_proj.weight")], "q")
    k = op("matmul", [hn, W("self_attn.k_proj.weight")], "k")
    v = op("matmul", [hn, W("self_attn.v_proj.weight")], "v")
    if cfg.qkv_bias or cfg.attn_bias:
        q = op("add", [q, W("self_attn.q_proj.bias")], "q_bias")
        k = op("add", [k, W("self_attn.k_proj.bias")], "k_bias")
        v = op("add", [v, W("self_attn.v_proj.bias")], "v_bias")
    qk_norm = qk_norm or ("heads" if cfg.qk_norm else "")
    if qk_norm:
        per_head = ({"heads": h}, {"heads": kv}) if qk_norm == "heads" else ({}, {})
        q = op("rmsnorm", [q, W("self_attn.q_norm.weight")], "q_norm", eps=cfg.eps, **per_head[0])
        k = op("rmsnorm", [k, W("self_attn.k_norm.weight")], "k_norm", eps=cfg.eps, **per_head[1])
    q = op("rope", [q, "rope.cos", "rope.sin", "pos"], "q_rot", heads=h, hd=hd, rot=cfg.rot)
    k = op("rope", [k, "rope.cos", "rope.sin", "pos"], "k_rot", heads=kv, hd=hd, rot=cfg.rot)
    kc = op("set_row", [s.caches[i][0], k, "pos"], "kc")
    vc = op("set_row", [s.caches[i][1], v, "pos"], "vc")
    a = op("attention", [q, kc, vc, "pos"], "attn", heads=h, kv_heads=kv, hd=hd, vd=hd,
           scale=float(hd) ** -0.5, window=cfg.window if cfg.sliding(i) else 0, softcap=0.0)
    o = op("matmul", [a, W("self_attn.o_proj.weight")], "o")
    if cfg.attn_bias:
        o = op("add", [o, W("self_attn.o_proj.bias")], "o_bias")
    return o


def mlp(s: Step, i: int, h2: str) -> str:
    """Layer i's FFN over its normed input `h2`: the config's mixture where layer i has one, else the gated MLP (the
    config's activation of the gate times the up product, then the down product; biased where Llama's mlp_bias
    says). Returns the down product's output."""
    cfg, op, W = s.cfg, (lambda *a, **k: s.op(i, *a, **k)), (lambda n: s.W(i, n))
    if cfg.sparse(i):
        return cfg.moe.ffn(cfg, i, h2, op, W)
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
    return dn


def pre_norm_layer(s: Step, i: int, x: str) -> str:
    """Llama's layer: x + attention(norm(x)), then that + mlp(norm(that))."""
    cfg = s.cfg
    hn = s.op(i, "rmsnorm", [x, s.W(i, "input_layernorm.weight")], "attn_norm", eps=cfg.eps)
    x1 = s.op(i, "add", [x, attention(s, i, hn)], "resid_attn")
    h2 = s.op(i, "rmsnorm", [x1, s.W(i, "post_attention_layernorm.weight")], "ffn_norm", eps=cfg.eps)
    return s.op(i, "add", [x1, mlp(s, i, h2)], "resid_ffn")


def embed(s: Step) -> str:
    """The step's first rows: the rope tables, then the embedding's rows of the tokens (tied: the embedding is the
    head's outputs too, engine/orientation.py)."""
    cfg, g, L = s.cfg, s.g, s.cfg.max_len
    g.constant(Constant("rope.cos", (L, cfg.rot // 2), "values", "f32", False, "rope.cos"))
    g.constant(Constant("rope.sin", (L, cfg.rot // 2), "values", "f32", False, "rope.sin"))
    s.embed = s.w("model.embed_tokens.weight", transposed=cfg.tie_embeddings)
    return g.add("gather", [s.embed, "token"], "x0")


def logits(s: Step, x: str, norm: str = "model.norm.weight", head: str = "lm_head.weight") -> str:
    """The final norm of the residual rows `x` (its weight `norm`) and the head's product (the embedding where
    tied)."""
    cfg, g = s.cfg, s.g
    hn = g.add("rmsnorm", [x, norm if norm in g.constants else s.w(norm)], "final_norm", eps=cfg.eps)
    return g.add("matmul", [hn, s.embed if cfg.tie_embeddings else s.w(head)], "logits")


def build(cfg, rows: int, batch: int, last: int, layer) -> Graph:
    """The step graph over `rows` token rows (a batch of `batch` sequences, a row each): the frame (with the family's
    carried states, `cfg.frame_io`), the first rows (`cfg.embed`), `layer(step, i, x)` for each layer, the last `last`
    rows, the final norm and the head (`cfg.logits`), the arg-max."""
    if not 1 <= last <= rows:
        raise UserError(f"the logits of the last {last} rows of a step of {rows}")
    g, caches = step_frame(cfg, rows, batch, **cfg.frame_io(batch))
    s = Step(cfg, g, caches)
    x = cfg.embed(s)
    for i in range(cfg.layers):
        x = layer(s, i, x)
    if rows > last:
        x = g.add("view", [x], "last", row=rows - last, **({"rows": last} if last > 1 else {}))
    g.add("argmax", [cfg.logits(s, x)], "next")
    g.validate()
    return g
