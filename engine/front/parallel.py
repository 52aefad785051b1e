"""Tensor and expert parallelism over R ranks for the dense decoders (Llama, Mistral, Qwen2, Qwen3) and the expert
mixtures (Qwen3-MoE, Qwen2-MoE, Mixtral): rank r's config, step graph and weights. Megatron's split: q/k/v
column-parallel by heads (each rank its KV heads and the query heads grouped on them, its own KV cache; where the
ranks outnumber the KV heads, one KV head held by R/KV ranks: `replicated`), o row-parallel
then an `all_reduce`; gate/up column-parallel, down row-parallel then an `all_reduce`; the LM head by vocabulary, the
next token an `all_argmax` (two values a row a rank, never the logits). The embedding, the norms and the biases after a
reduction are whole on every rank.

A mixture's layer is expert-parallel: each rank holds E/R of its experts (uneven parts allowed: the first E % R ranks
one more), the router whole on every rank. The rows are the same on every rank after the attention's all-reduce, so
every rank computes the same router logits and the same choices: the dispatch is local (each rank runs only its experts
for the rows that chose them, the `moe` op's `lo`/`local`) and the combine is a sum, the all-reduce the layer ends with
anyway (no all-to-all: that is what data-parallel attention, each rank its own rows, would need). A shared expert
(Qwen2-MoE) is split like a dense FFN (its gate score whole: the same sigmoid on every rank), its part added before the
one all-reduce.

OLMo 2's q and k norms span the whole projection (every head's values): each rank's part is gathered with the others'
(`all_gather`), normed whole and its own heads taken back (`head_slice`); see `_whole_qk_norms`.

Qwen3-Next as vLLM splits it: its gated full-attention layers as the other decoders (each head's query and gate rows,
k and v by KV heads, the per-head q/k norms whole, o row-parallel); its gated delta-net layers by key heads (R dividing
them), each rank its key heads and the value heads grouped on them (value head t reads key head t // (hv/hk)): its q, k,
v and z rows of the split in_proj_qkvz (`_qnext_qkvz`: four runs, one a part), its b and a rows, its convolution
channels, A_log and dt_bias by value head, the gated norm (one weight a head) whole, out_proj row-parallel then the
all-reduce the layer's `o` takes anyway; each rank its own rings and recurrent states (its heads'). The mixture and
its sigmoid-gated shared expert as Qwen2-MoE's."""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from lanefuse.engine.errors import UserError
from lanefuse.engine.ir import Constant, Graph, Op, attrs_of
from lanefuse.engine.front.model import ModelConfig, build_step

HEAD = "lm_head.weight"  # a rank's part of the LM head, tied or not (a tied one is served from the embedding's rows)
# a layer's tensors under its family's prefix (`model.layers.` or Gemma 3's `language_model.model.layers.`)
_ROWS = re.compile(r"(?:^|\.)layers\.\d+\.(self_attn\.(q|k|v)_proj|mlp\.(gate|up)_proj)\.(weight|bias)$")
_COLS = re.compile(r"(?:^|\.)layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight$")
_SHARED = re.compile(r"(?:^|\.)layers\.\d+\.mlp\.shared_experts?\.(gate|up|down)_proj\.weight$")  # DeepSeek's: experts
# DeepSeek-V3's latent attention, as its store serves it (families/deepseek.py DeepseekStore): each head's query rows
# (unrotated, rotated) and its key and value expansions of the latent
_MLA = re.compile(r"(?:^|\.)layers\.\d+\.self_attn\.(?:(?:q_b_proj|q_proj)\.(nope|rope)_rows|kv_b_proj\.(k|v)_rows)$")
# the stacked experts (mixtures.py; gpt-oss's rows and their biases: gptoss.py)
_EXPERTS = re.compile(r"(?:^|\.)layers\.\d+\.mlp\.experts\.(gate_up|down)_proj(?:(?:_bias)?\.rows)?$")
_SINKS = re.compile(r"(?:^|\.)layers\.\d+\.self_attn\.sinks$")  # gpt-oss: a value a head
# the partial sums every rank needs, by layer: the o product's; the FFN's down product, or a mixture's sum (with its
# shared expert's part where it has one)
_REDUCED = ("o", "down", "moe", "moe_out")


# the configs whose steps split as above: the dense decoders', Phi-3's (its fused q/k/v and gate/up read in parts: the
# same tensors), Gemma's (its norms, soft caps and scaled embedding whole on every rank; a capped head capped a part at
# a time, the cap elementwise)
SPLITS = ("ModelConfig", "Phi3Config", "GemmaConfig", "DeepseekConfig", "GptOssConfig", "Olmo2Config",
          "Qwen3NextConfig")
UNSPLIT: dict[str, str] = {}  # why a family's config is not split, in the user's words (none today)
# Qwen3-Next's tensors as its split store serves them (families/qwen3next.py SplitStore): a delta-net layer's (group 1:
# what; 2: conv1d's part), a gated attention's query and gate rows of q_proj
_QNEXT = re.compile(r"(?:^|\.)layers\.\d+\.linear_attn\.(in_proj_qkvz\.split\.weight|in_proj_b\.weight|in_proj_a\.weight|"
                    r"conv1d\.(q|k|v)\.weight|A_log|dt_bias|out_proj\.weight)$")
_GATED_Q = re.compile(r"(?:^|\.)layers\.\d+\.self_attn\.q_proj\.(query|gate)\.weight$")


def part(n: int, ranks: int, rank: int, unit: int = 1) -> tuple[int, int]:
    """Rank `rank`'s share lo..hi of n values split over `ranks` in whole units of `unit` (a block format's block),
    as even as they go: the first n/unit % ranks ranks one unit more."""
    units = n // unit
    base, more = divmod(units, ranks)
    lo = rank * base + min(rank, more)
    return lo * unit, (lo + base + (1 if rank < more else 0)) * unit


def check_ranks(cfg: ModelConfig, ranks: int) -> None:
    """Refuse, in one line, a model or a rank count this split does not serve."""
    if not isinstance(ranks, int) or ranks < 1:
        raise UserError(f"--ranks {ranks}: a step runs over 1 or more ranks")
    if ranks == 1:
        return
    kind = type(cfg).__name__
    if kind not in SPLITS:  # a family of its own (its config a subclass) this split does not know
        why = UNSPLIT.get(kind, "its family is not split over ranks yet")
        raise UserError(f"--ranks {ranks}: {cfg.arch}: {why} (the Llama, Mistral, Phi-3, Qwen2, Qwen3, Gemma 2 and 3, "
                        f"OLMo 2 decoders, Qwen3-Next and the Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss and DeepSeek-V3 "
                        f"mixtures split); run it with --ranks 1")
    m = cfg.moe
    if m is not None and m.spelling not in ("qwen", "mixtral", "gptoss"):
        raise UserError(f"--ranks {ranks}: {cfg.arch}'s expert mixture ({m.spelling}) is not split over ranks yet; run "
                        f"it with --ranks 1")
    if m is not None and m.sparse and m.experts < ranks:
        raise UserError(f"--ranks {ranks}: {cfg.name}'s {m.experts} experts over {ranks} ranks (each rank holds at "
                        f"least one expert); give at most {m.experts} ranks")
    if mla(cfg) and cfg.heads % ranks:
        raise UserError(f"--ranks {ranks}: {ranks} ranks do not divide {cfg.name}'s {cfg.heads} heads (each rank its "
                        f"heads; the latent cache whole on every rank); give a divisor of {cfg.heads}")
    if not mla(cfg) and cfg.kv_heads % ranks and not replicated(cfg, ranks):
        why = ("each rank holds whole KV heads, or one KV head shared with other ranks where the ranks are a multiple "
               "of the KV heads and divide the heads")
        if type(cfg).__name__ == "Olmo2Config":
            why = "each rank holds whole KV heads: OLMo 2's k norm over the whole projection gathers every rank's part"
        raise UserError(f"--ranks {ranks}: {ranks} ranks do not divide {cfg.name}'s {cfg.kv_heads} KV heads ({why}); "
                        f"give a divisor of {cfg.kv_heads}"
                        + ("" if type(cfg).__name__ == "Olmo2Config" else f" or a multiple of it that divides "
                                                                          f"{cfg.heads}"))
    if qnext(cfg):
        _check_delta(cfg, ranks)
    from lanefuse.engine.formats.layout import BLOCK_FORMATS

    for i in range(cfg.layers):
        o = f"{cfg.layer_prefix}{i}.self_attn.o_proj.weight"
        vb = BLOCK_FORMATS.get(cfg.fmt(o), (1,))[0]
        if cfg.heads // ranks * _o_width(cfg) % vb:
            raise UserError(f"--ranks {ranks}: tensor `{o}` ({cfg.fmt(o)}) would be cut across its blocks of {vb}: "
                            f"{cfg.heads // ranks} heads of {_o_width(cfg)} a rank")
    unit = _unit(cfg)
    dense = [i for i in range(cfg.layers) if not cfg.sparse(i)]
    if dense and cfg.inter // unit < ranks:
        raise UserError(f"--ranks {ranks}: {cfg.name}'s FFN of {cfg.inter} values splits into fewer than {ranks} parts "
                        f"of whole {unit}-value blocks")
    sh = _shared_inter(cfg)
    if m is not None and m.sparse and sh and sh // _unit(cfg, True) < ranks:
        raise UserError(f"--ranks {ranks}: {cfg.name}'s shared expert of {sh} values splits into fewer than {ranks} "
                        f"parts of whole {_unit(cfg, True)}-value blocks")
    if cfg.vocab < ranks:
        raise UserError(f"--ranks {ranks}: a vocabulary of {cfg.vocab} tokens over {ranks} ranks")


def qnext(cfg: ModelConfig) -> bool:
    """Whether the model is Qwen3-Next (gated delta-net layers beside its gated attention)."""
    return type(cfg).__name__ == "Qwen3NextConfig"


def _check_delta(cfg, ranks: int) -> None:
    """Refuse, in one line, a split of Qwen3-Next's delta-net layers that is not whole key heads a rank, or that cuts
    out_proj's stored blocks."""
    from lanefuse.engine.formats.layout import BLOCK_FORMATS

    if cfg.hk % ranks:
        raise UserError(f"--ranks {ranks}: {ranks} ranks do not divide {cfg.name}'s {cfg.hk} key heads of its gated "
                        f"delta-rule layers (each rank holds whole key heads and the {cfg.hv // cfg.hk} value heads "
                        f"grouped on each); give a divisor of {cfg.hk}")
    width = cfg.hv // ranks * cfg.dv
    for i in range(cfg.layers):
        o = f"{cfg.layer_prefix}{i}.linear_attn.out_proj.weight"
        vb = BLOCK_FORMATS.get(cfg.fmt(o), (1,))[0] if cfg.linear(i) else 1
        if width % vb:
            raise UserError(f"--ranks {ranks}: tensor `{o}` ({cfg.fmt(o)}) would be cut across its blocks of {vb}: "
                            f"{cfg.hv // ranks} value heads of {cfg.dv} a rank")


def _qnext_qkvz(cfg, rank: int, ranks: int) -> np.ndarray:
    """Rank `rank`'s rows of a delta-net layer's split in_proj_qkvz (every key head's q rows, then their k, v and z
    rows: families/qwen3next.py _splits): its key heads' q and k rows and its value heads' v and z rows, in that order
    (the rank's own split layout)."""
    klo, khi = part(cfg.hk, ranks, rank)
    g = cfg.hv // cfg.hk
    kd, vd = cfg.hk * cfg.dk, cfg.hv * cfg.dv
    runs = ((0, klo * cfg.dk, khi * cfg.dk), (kd, klo * cfg.dk, khi * cfg.dk),
            (2 * kd, klo * g * cfg.dv, khi * g * cfg.dv), (2 * kd + vd, klo * g * cfg.dv, khi * g * cfg.dv))
    return np.concatenate([np.arange(at + lo, at + hi) for at, lo, hi in runs])


def _qnext_cut(name: str, cfg, rank: int, ranks: int):
    """How rank `rank` cuts a Qwen3-Next tensor `name` (`_cut`'s answer), or None where `name` is none of its own."""
    m = _GATED_Q.search(name)
    if m:  # the query heads' rows (their query, or their gate)
        lo, hi = part(cfg.heads, ranks, rank)
        return "rows", lo * cfg.head_dim, hi * cfg.head_dim
    m = _QNEXT.search(name)
    if m is None:
        return None
    what, conv = m.group(1), m.group(2)
    klo, khi = part(cfg.hk, ranks, rank)
    vlo, vhi = klo * (cfg.hv // cfg.hk), khi * (cfg.hv // cfg.hk)  # the value heads grouped on its key heads
    if what.startswith("in_proj_qkvz"):
        return "pick", _qnext_qkvz(cfg, rank, ranks), None
    if conv in ("q", "k"):
        return "rows", klo * cfg.dk, khi * cfg.dk
    if conv == "v":
        return "rows", vlo * cfg.dv, vhi * cfg.dv
    if what.startswith("out_proj"):
        return "cols", vlo * cfg.dv, vhi * cfg.dv
    return "rows", vlo, vhi  # in_proj_b / in_proj_a rows, A_log, dt_bias: a value a value head


def _cut_shape(shape, cut) -> tuple[int, ...]:
    """A stored tensor's shape after a rank's cut."""
    how, lo, hi = cut
    if how == "pick":
        return (len(lo),) + tuple(shape[1:])
    return ((hi - lo,) + tuple(shape[1:])) if how == "rows" else (shape[0], hi - lo)


def replicated(cfg: ModelConfig, ranks: int) -> bool:
    """Whether each rank holds one KV head that other ranks hold too (vLLM's replication where the ranks outnumber
    the KV heads): R a multiple of the KV heads and a divisor of the heads, so that rank r's query heads
    r·H/R .. (r+1)·H/R - 1 all read KV head r·KV/R, the same on R/KV ranks. Each such rank keeps that head's cache
    (the bytes R/KV times over: the price of no all-gather a layer). Not OLMo 2's (its k norm spans the whole
    projection, gathered from every rank's part: a replicated head would be counted twice)."""
    return (not mla(cfg) and ranks > cfg.kv_heads and ranks % cfg.kv_heads == 0 and cfg.heads % ranks == 0
            and type(cfg).__name__ != "Olmo2Config")


def kv_part(cfg: ModelConfig, ranks: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s KV heads lo..hi-1: its share, or the one it holds with others (replicated)."""
    if replicated(cfg, ranks):
        h = rank * cfg.kv_heads // ranks
        return h, h + 1
    return part(cfg.kv_heads, ranks, rank)


def _unit(cfg: ModelConfig, shared: bool = False) -> int:
    """The FFN's split unit (`shared`: the shared expert's): the down product's block (its rows are cut across their
    columns), else one value."""
    from lanefuse.engine.formats.layout import BLOCK_FORMATS

    down = (_shared_prefix(cfg) + "down_proj.weight") if shared else "mlp.down_proj.weight"
    fmts = {cfg.fmt(f"{cfg.layer_prefix}{i}.{down}") for i in range(cfg.layers)}
    return max([BLOCK_FORMATS[f][0] for f in fmts if f in BLOCK_FORMATS] + [1])


def mla(cfg: ModelConfig) -> bool:
    """Whether the attention is DeepSeek-V3's latent attention: split by query heads, its latent and rotated-key
    caches (one, shared by every head) whole on every rank."""
    return type(cfg).__name__ == "DeepseekConfig"


def _o_width(cfg: ModelConfig) -> int:
    """The o product's columns a head (its value width)."""
    return cfg.v_dim if mla(cfg) else cfg.head_dim


def _shared_inter(cfg: ModelConfig) -> int:
    """A mixture's shared expert width (DeepSeek-V3's on its config, Qwen2-MoE's on the mixture's); 0: none."""
    if mla(cfg):
        return cfg.shared_inter
    return cfg.moe.shared_inter if cfg.moe is not None else 0


def _shared_prefix(cfg: ModelConfig) -> str:
    return "mlp.shared_experts." if mla(cfg) else "mlp.shared_expert."


def expert_part(cfg: ModelConfig, rank: int, ranks: int) -> tuple[int, int]:
    """Rank `rank`'s experts lo..hi-1 of a mixture's E (the first E % R ranks one more)."""
    return part(cfg.moe.experts, ranks, rank)


def rank_config(cfg: ModelConfig, rank: int, ranks: int) -> ModelConfig:
    """Rank `rank`'s config: its heads, KV heads and FFN values (its caches' widths follow); the vocabulary whole
    (the embedding is whole on every rank)."""
    check_ranks(cfg, ranks)
    if ranks == 1:
        return cfg
    lo, hi = part(cfg.inter, ranks, rank, _unit(cfg))
    if all(cfg.sparse(i) for i in range(cfg.layers)):  # no dense FFN to split (gpt-oss's inter is its experts')
        lo, hi = 0, cfg.inter
    moe, sh = cfg.moe, _shared_inter(cfg)
    slo, shi = part(sh, ranks, rank, _unit(cfg, True)) if sh else (0, 0)
    if moe is not None and moe.sparse:
        elo, ehi = expert_part(cfg, rank, ranks)
        moe = dataclasses.replace(moe, lo=elo, local=ehi - elo)
        if not mla(cfg):
            moe = dataclasses.replace(moe, shared_inter=shi - slo)
    if mla(cfg):  # the query heads split; the latent (one "KV head") whole on every rank
        return dataclasses.replace(cfg, heads=cfg.heads // ranks, inter=hi - lo, moe=moe, shared_inter=shi - slo)
    klo, khi = kv_part(cfg, ranks, rank)
    more = dict(hk=cfg.hk // ranks, hv=cfg.hv // ranks) if qnext(cfg) else {}  # its delta-net heads
    return dataclasses.replace(cfg, heads=cfg.heads // ranks, kv_heads=khi - klo, inter=hi - lo, moe=moe, **more)


def rank_carried(cfg: ModelConfig, tables: dict, rank: int, ranks: int) -> dict:
    """Rank `rank`'s part of the one rank's carried tables `tables` (one sequence's, cfg.carried()'s names): each KV
    cache its KV heads' columns (`kv_part`: a replicated head's on every rank that holds it), a cache whole on every
    rank whole (DeepSeek-V3's latent); Qwen3-Next's rings its key heads' (q, k) or value heads' (v) channels and its
    recurrent states its value heads' rows. Copies: a step that writes a rank's tables leaves `tables` as they were."""
    rc = rank_config(cfg, rank, ranks)
    out = {}
    for n, shape in rc.carried().items():
        whole = np.asarray(tables[n])
        if tuple(whole.shape) == tuple(shape):
            out[n] = np.array(whole)
            continue
        if qnext(cfg) and n[:2] in ("ds", "cq", "ck", "cv"):
            klo, _ = part(cfg.hk, ranks, rank)
            vlo = klo * (cfg.hv // cfg.hk)
            at = {"ds": vlo * cfg.dk, "cq": klo * cfg.dk, "ck": klo * cfg.dk, "cv": vlo * cfg.dv}[n[:2]]
            rows = n.startswith("ds")
        else:  # a KV cache: its KV heads' columns
            klo, _ = kv_part(cfg, ranks, rank)
            at, rows = klo * (shape[1] // rc.kv_heads), False
        out[n] = np.array(whole[at:at + shape[0]] if rows else whole[:, at:at + shape[1]], order="C")  # a copy
    return out


def build_rank_step(cfg: ModelConfig, rank: int, ranks: int, rows: int = 1, batch: int = 1) -> Graph:
    """Rank `rank`'s step graph of `ranks`: the step of its config (its heads, FFN part and experts) with an
    `all_reduce` after each o and down product and each mixture's sum (what reads the partial sum reads the whole),
    and its part of the LM head, the next token the `all_argmax` over every rank's part (each row's). `batch` B > 1:
    the decode step of B sequences (build_step's), a row each, over the rank's slots of its caches (its KV heads'
    columns, a slot a sequence). `meta` gains rank, ranks and vocab_from (where its logits start)."""
    rc = rank_config(cfg, rank, ranks)
    g = build_step(rc, rows, batch)
    if ranks == 1:
        return g
    *body, head, amax = g.ops
    cap = None
    if head.kind == "softcap":  # Gemma 2's capped logits: each rank caps its part (elementwise), then the arg-max
        cap, (*body, head) = head, body
    if head.kind != "matmul" or (cap or head).out != g.io.logits or amax.kind != "argmax":
        raise AssertionError("a dense step ends with the LM head's product (its soft cap) and its arg-max")
    ops: list[Op] = []
    renamed: dict[str, str] = {}
    outs = {op.out for op in body}
    for op in body:
        op = dataclasses.replace(op, ins=tuple(renamed.get(i, i) for i in op.ins))
        ops.append(op)
        mine = op.layer >= 0 and op.out in {f"L{op.layer}.{n}" for n in _REDUCED}
        if mine and op.kind == "moe" and f"L{op.layer}.moe_out" in outs:  # its shared expert's part is added first
            mine = False
        if mine and op.kind in ("matmul", "moe", "add"):
            total = g.tensor(op.out + "_sum", g.tensors[op.out].shape)
            ops.append(Op("all_reduce", (op.out,), total, attrs_of({"ranks": ranks}), layer=op.layer))
            renamed[op.out] = total
    g.ops = ops
    if type(cfg).__name__ == "Olmo2Config":
        _whole_qk_norms(g, cfg, rank, ranks)
    lo, hi = part(cfg.vocab, ranks, rank)
    fmt = cfg.fmt(head_source(cfg))
    if not cfg.tie_embeddings:
        g.constants.pop(head.ins[1], None)
    g.constant(Constant(HEAD, (hi - lo, cfg.hidden), "rows", fmt, True, HEAD))
    for n in (g.io.logits, g.io.next, head.out):
        g.tensors.pop(n, None)
    y = g.add("matmul", [renamed.get(head.ins[0], head.ins[0]), HEAD], head.out)
    if cap is not None:
        g.add("softcap", [y], g.io.logits, **cap.a)
    g.add("all_argmax", [g.io.logits], g.io.next, ranks=ranks, offset=lo)
    g.meta.update(rank=rank, ranks=ranks, vocab_from=lo)
    g.validate()
    return g


def _whole_qk_norms(g: Graph, cfg: ModelConfig, rank: int, ranks: int) -> None:
    """OLMo 2's q and k norms over the whole projection (every head's values) in rank `rank`'s step: its part of q
    (k) is gathered with the others' (`all_gather`, rank 0's first: the whole projection in head order), normed whole
    by the whole norm weight (on every rank, as one rank norms it), and its own heads' values taken back
    (`head_slice`). The norm's sum of squares is then the one rank's, to the bit; the gather moves a row's q and k
    values (not one sum of squares a row: an op that takes its sum from outside is not built)."""
    out: list[Op] = []
    for op in g.ops:
        i = op.layer
        if op.kind != "rmsnorm" or op.out not in (f"L{i}.q_norm", f"L{i}.k_norm"):
            out.append(op)
            continue
        heads = cfg.heads if op.out.endswith("q_norm") else cfg.kv_heads
        n, w = heads * cfg.head_dim, op.ins[1]
        rows, width = g.tensors[op.out].shape
        lo, _ = part(heads, ranks, rank)
        g.constants[w] = dataclasses.replace(g.constants[w], shape=(n,))
        whole = g.tensor(op.out + "_all", (rows, n))
        normed = g.tensor(op.out + "_whole", (rows, n))
        out += [Op("all_gather", (op.ins[0],), whole, attrs_of({"ranks": ranks}), layer=i),
                dataclasses.replace(op, ins=(whole, w), out=normed),
                Op("head_slice", (normed,), op.out,
                   attrs_of({"every": n, "start": lo * cfg.head_dim, "width": width}), layer=i)]
    g.ops = out


def embed_name(cfg: ModelConfig) -> str:
    """The embedding's checkpoint name (under Gemma's prefix where it has one)."""
    return getattr(cfg, "prefix", "model.") + "embed_tokens.weight"


def head_source(cfg: ModelConfig) -> str:
    """The stored tensor a rank's LM-head part is cut from: the embedding where tied, else the family's head."""
    return embed_name(cfg) if cfg.tie_embeddings else getattr(cfg, "head", HEAD)


def _cut(name: str, cfg: ModelConfig, rank: int, ranks: int) -> tuple | None:
    """How rank `rank` cuts stored tensor `name`: ("rows" | "cols", lo, hi), ("pick", the rows in order, None), or
    None (whole)."""
    hd, unit = cfg.head_dim, _unit(cfg)
    if qnext(cfg):
        cut = _qnext_cut(name, cfg, rank, ranks)
        if cut is not None:
            return cut
    m = _ROWS.search(name)
    if m:
        if m.group(2) == "q":
            lo, hi = part(cfg.heads, ranks, rank)
            return "rows", lo * hd, hi * hd
        if m.group(2) in ("k", "v"):
            lo, hi = kv_part(cfg, ranks, rank)
            return "rows", lo * hd, hi * hd
        return ("rows",) + part(cfg.inter, ranks, rank, unit)
    m = _COLS.search(name)
    if m:
        if "o_proj" in name:
            lo, hi = part(cfg.heads, ranks, rank)
            return "cols", lo * _o_width(cfg), hi * _o_width(cfg)
        return ("cols",) + part(cfg.inter, ranks, rank, unit)
    if name == HEAD:
        return ("rows",) + part(cfg.vocab, ranks, rank)
    m = _EXPERTS.search(name)
    if m:  # a rank's experts' rows: expert e's 2f gate/up rows at e·2f, its d down rows at e·d
        lo, hi = expert_part(cfg, rank, ranks)
        n = 2 * cfg.moe.inter if m.group(1) == "gate_up" else cfg.hidden
        return "rows", lo * n, hi * n
    if _SINKS.search(name):
        return ("rows",) + part(cfg.heads, ranks, rank)
    m = _SHARED.search(name)
    if m:
        lo, hi = part(_shared_inter(cfg), ranks, rank, _unit(cfg, True))
        return ("cols" if m.group(1) == "down" else "rows"), lo, hi
    m = _MLA.search(name) if mla(cfg) else None
    if m:  # a rank's heads' rows: unrotated query / key expansion `nope` a head, rotated query `rope`, value `v_dim`
        lo, hi = part(cfg.heads, ranks, rank)
        n = {"nope": cfg.nope, "rope": cfg.head_dim, "k": cfg.nope, "v": cfg.v_dim}[m.group(1) or m.group(2)]
        return "rows", lo * n, hi * n
    return None


class RankStore:
    """Rank `rank`'s weights over the whole model's store (engine/front/weights.py's backends): each tensor its rank
    cuts (`_cut`), under its checkpoint name; the LM head's part from the embedding's rows where they are tied. A
    block format's columns are cut in whole blocks."""

    def __init__(self, base, cfg: ModelConfig, rank: int, ranks: int):
        self.base, self.cfg, self.rank, self.ranks = base, cfg, rank, ranks

    def _source(self, name: str) -> str:
        return head_source(self.cfg) if name == HEAD else name

    def names(self) -> list[str]:
        names = list(self.base.names())
        return names if HEAD in names else names + [HEAD]

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        shape, fmt = self.base.info(self._source(name))
        cut = _cut(name, self.cfg, self.rank, self.ranks)
        if cut is None:
            return shape, fmt
        return _cut_shape(shape, cut), fmt

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        from lanefuse.engine.formats.layout import BLOCK_FORMATS

        cut = _cut(name, self.cfg, self.rank, self.ranks)
        if cut is None:
            return self.base.raw(self._source(name))
        how, lo, hi = cut
        if how == "rows" and hasattr(self.base, "expert_rows"):  # only its experts read (mixtures.py)
            return self.base.expert_rows(self._source(name), lo, hi)
        arr, fmt = self.base.raw(self._source(name))
        a = np.asarray(arr)
        if how == "pick":  # rows in a rank's order (whole rows: a block format's too)
            return np.ascontiguousarray(a[lo]), fmt
        if how == "rows":
            return np.ascontiguousarray(a[lo:hi]), fmt
        if fmt in BLOCK_FORMATS:
            vb, bb = BLOCK_FORMATS[fmt]
            if lo % vb or hi % vb:
                raise UserError(f"tensor `{name}`: rank {self.rank}'s columns {lo}..{hi - 1} are not whole {fmt} "
                                f"blocks of {vb}")
            return np.ascontiguousarray(a[:, lo // vb * bb:hi // vb * bb]), fmt
        return np.ascontiguousarray(a[:, lo:hi]), fmt

    def where(self, name: str) -> str:
        return self.base.where(self._source(name))


def rank_weights(weights, cfg: ModelConfig, rank: int, ranks: int):
    """Rank `rank`'s weight store (engine/weights.Weights over a RankStore), its config's generated tables."""
    from lanefuse.engine.front.weights import Weights

    if ranks == 1:
        return weights
    return Weights(RankStore(weights.store, cfg, rank, ranks), rank_config(cfg, rank, ranks))


def rank_weight_bytes(cfg: ModelConfig, ranks: int) -> list[int]:
    """The bytes of the weights each rank holds (its parts in their stored formats; the whole embedding, norms and
    reduced biases on each). Arithmetic on the config alone: a config-only folder plans any rank count."""
    from lanefuse.engine.formats.layout import BLOCK_FORMATS

    size = {"f32": 4, "f16": 2, "bf16": 2}
    out = []
    for r in range(ranks):
        total = 0
        names = dict(cfg.weight_names())
        if ranks > 1:
            if not cfg.tie_embeddings:
                names.pop(head_source(cfg), None)  # served as the rank's part (HEAD)
            names[HEAD] = (cfg.vocab, cfg.hidden)
        for name, shape in names.items():
            cut = _cut(name, cfg, r, ranks) if ranks > 1 else None
            if cut is not None:
                shape = _cut_shape(shape, cut)
            fmt = cfg.fmt(head_source(cfg) if name == HEAD else name)
            n = int(np.prod(shape))
            if fmt in BLOCK_FORMATS:
                vb, bb = BLOCK_FORMATS[fmt]
                total += n // vb * bb
            else:
                total += n * size.get(fmt, 4)
        out.append(total)
    return out
