"""The reference interpreter: what each lifted op means, in numpy. Values are f32; every reduction (a norm's sum of
squares, a product's dot, a softmax) runs in f64 so a result does not depend on the order it is summed in. A fused op
runs as its parts. Other modules evaluate single ops through `run_op` / `apply_op`."""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from lanefuse.engine.collectives import COLLECTIVES, alone, meet
from lanefuse.engine.errors import UserError
from lanefuse.engine.ir import Access, Dst, Graph, Op, RowSel
from lanefuse.engine.opdefs import QBLOCK, full_attrs
from lanefuse.engine.formats import ggml
from lanefuse.engine.formats.quantize import MIN_FORMATS, Quantized, block_mins
from lanefuse.engine.formats.quantize import product as q8_product, quantize as q8_quantize

F32 = np.float32
F64 = np.float64


# -- the ops, one function each: (input arrays, attributes) -> result ------------------------------------------------

def _gather(table, index, **a):
    return np.asarray(table, dtype=F32)[np.asarray(index, dtype=np.int64)]  # (R, d)


def _rmsnorm(x, w, eps, heads=1, ggml_order=False, **a):
    r, n = x.shape
    if ggml_order:  # read quantized under q8: llama.cpp's arithmetic (engine/formats/ggml.py)
        y = ggml.rmsnorm(np.asarray(x, dtype=F32).reshape(r, heads, n // heads), np.asarray(w, dtype=F32), eps)
        return y.reshape(r, n)
    xs = np.asarray(x, dtype=F64).reshape(r, heads, n // heads)  # (R, heads, hd)
    ms = np.mean(xs * xs, axis=-1, keepdims=True)
    y = xs / np.sqrt(ms + eps) * np.asarray(w, dtype=F64)
    return y.reshape(r, n).astype(F32)


class MinRows(np.ndarray):
    """A constant's f32 rows (n, k) decoded from a block format, with the bytes they were decoded from (`raw`, in
    format `fmt`: a product of llama.cpp's q8_0 / q8_1 / q8_K form sums them in llama.cpp's order,
    engine/formats/ggml.dot) and for q4_1 / q5_1 their blocks' f16 mins `mins` (n, k/32): a product of a one-word
    quantized activation takes its blocks' min terms as llama.cpp's q8_1 pairing does (m·s, engine/quantize.product)."""

    mins: np.ndarray | None = None
    raw: np.ndarray | None = None
    fmt: str | None = None


def with_mins(weights: Any, name: str, v: np.ndarray) -> np.ndarray:
    """Constant `name`'s f32 value `v`; rows of a block format (where `weights` tells their format and bytes) as
    MinRows."""
    fmt = getattr(weights, "format", None)
    if fmt is None or v.ndim != 2 or v.shape[1] % QBLOCK or fmt(name) not in ggml.FORMATS:
        return v
    raw, f = weights.raw(name)
    out = v.view(MinRows)
    out.raw, out.fmt = raw, f
    if f in MIN_FORMATS:
        out.mins = block_mins(raw, f, *v.shape)
    return out


def _matmul(x, w, **a):
    if isinstance(x, Quantized):  # int8 block sums times the blocks' scales (engine/formats/quantize.py)
        if ggml.ordered(x, getattr(w, "fmt", None)):  # llama.cpp's q8_0 / q8_1 / q8_K form: summed in its order
            return ggml.dot_form(x, w.raw, w.fmt, *w.shape)
        return q8_product(x, w, getattr(w, "mins", None))
    return (np.asarray(x, dtype=F64) @ np.asarray(w, dtype=F64).T).astype(F32)  # (R, k) @ (k, n) -> (R, n)


def _binary(fn):
    def impl(a_, b, **a):
        return fn(np.asarray(a_, dtype=F64), np.asarray(b, dtype=F64)).astype(F32)
    return impl


def _positions(pos, rows: int) -> np.ndarray:
    """Each row's position: pos + r, or a batch's (pos one a row: row s, a sequence of its own, at pos[s])."""
    p = np.asarray(pos).reshape(-1).astype(np.int64)
    return p if p.size > 1 else int(p[0]) + np.arange(rows)


def _slots(pos, table_rows: int) -> tuple[int, int]:
    """A batch's sequences and the table rows each one's slot holds (one sequence: the whole table)."""
    n = np.asarray(pos).size
    return n, table_rows // n


def _rope(x, cos, sin, pos, heads, hd, rot, ggml_order=False, **a):
    r = x.shape[0]
    p = _positions(pos, r)
    if p.max() >= cos.shape[0] or p.min() < 0:
        raise UserError(f"rope: positions {p.min()}..{p.max()} outside the {cos.shape[0]} rows of the cos/sin tables")
    if ggml_order:  # llama.cpp's tables (evaluate gives them) and rotation, in f32
        xs = np.asarray(x, dtype=F32).reshape(r, heads, hd).copy()
        c, s = np.asarray(cos, dtype=F32)[p][:, None, :], np.asarray(sin, dtype=F32)[p][:, None, :]
        xs[..., :rot // 2], xs[..., rot // 2:rot] = ggml.rope(xs[..., :rot // 2], xs[..., rot // 2:rot], c, s)
        return xs.reshape(r, heads * hd)
    c = np.asarray(cos, dtype=F64)[p][:, None, :]  # (R, 1, rot/2)
    s = np.asarray(sin, dtype=F64)[p][:, None, :]
    xs = np.asarray(x, dtype=F64).reshape(r, heads, hd).copy()
    half = rot // 2
    x1, x2 = xs[..., :half].copy(), xs[..., half:rot].copy()
    xs[..., :half] = x1 * c - x2 * s
    xs[..., half:rot] = x2 * c + x1 * s
    return xs.reshape(r, heads * hd).astype(F32)


def _set_row(table, src, pos, **a):
    seqs, slot = _slots(pos, table.shape[0])
    if seqs > 1:  # a batch: row s into its sequence's slot, at its position
        for s_, p in enumerate(np.asarray(pos).reshape(-1)):
            if not 0 <= p < slot:
                raise UserError(f"set_row: sequence {s_}'s position {p} outside its slot of {slot} rows")
            table[s_ * slot + p] = src[s_]
        return table
    p = int(np.asarray(pos).reshape(-1)[0])
    r = src.shape[0]
    if p < 0 or p + r > table.shape[0]:
        raise UserError(f"set_row: rows {p}..{p + r - 1} outside a table of {table.shape[0]} rows")
    table[p:p + r] = src  # in place: the result is the table itself
    return table


def _attention(q, k, v, pos, sinks=None, *, heads, kv_heads, hd, vd, scale, window=0, softcap=0.0, ggml_order=False,
               pairs=False, **a):
    r = q.shape[0]
    p = _positions(pos, r)
    seqs, slot = _slots(pos, k.shape[0])
    if p.max() >= slot:
        raise UserError(f"attention: position {p.max()} outside a cache of {slot} rows")
    group = heads // kv_heads
    if ggml_order and sinks is None and not window and not softcap:  # llama.cpp's attention (ggml.attend)
        qs = np.asarray(q, dtype=F32).reshape(r, heads, hd)
        out32 = np.zeros((r, heads, vd), dtype=F32)
        for i in range(r):
            at = i * slot if seqs > 1 else 0
            ks = np.asarray(k[at:at + p[i] + 1], dtype=F32).reshape(-1, kv_heads, hd)
            vs = np.asarray(v[at:at + p[i] + 1], dtype=F32).reshape(-1, kv_heads, vd)
            for h in range(heads):
                out32[i, h] = ggml.attend(qs[i, h], ks[:, h // group], vs[:, h // group], scale, r, pairs)
        return out32.reshape(r, heads * vd)
    qs = np.asarray(q, dtype=F64).reshape(r, heads, hd)
    out = np.zeros((r, heads, vd), dtype=F64)
    for i in range(r):
        lo = max(0, p[i] - window + 1) if window > 0 else 0
        at = i * slot if seqs > 1 else 0  # a batch: row i reads its own sequence's slot
        ks = np.asarray(k[at + lo:at + p[i] + 1], dtype=F64).reshape(-1, kv_heads, hd)  # (T, kv, hd)
        vs = np.asarray(v[at + lo:at + p[i] + 1], dtype=F64).reshape(-1, kv_heads, vd)
        for h in range(heads):
            j = h // group
            s = ks[:, j, :] @ qs[i, h] * scale  # (T,)
            if softcap > 0:
                s = softcap * np.tanh(s / softcap)
            m = s.max()
            if sinks is not None:
                m = max(m, float(sinks[h]))
            e = np.exp(s - m)
            den = e.sum() + (np.exp(float(sinks[h]) - m) if sinks is not None else 0.0)
            out[i, h] = (e / den) @ vs[:, j, :]
    return out.reshape(r, heads * vd).astype(F32)


def _silu(x, ggml_order=False, **a):
    if ggml_order:  # of a product of a q8 form (q8 numerics): llama.cpp's ggml_v_silu
        return ggml.silu(x)
    x = np.asarray(x, dtype=F64)
    return (x / (1.0 + np.exp(-x))).astype(F32)


def _sigmoid(x, **a):
    return (1.0 / (1.0 + np.exp(-np.asarray(x, dtype=F64)))).astype(F32)


def _gelu(x, **a):
    x = np.asarray(x, dtype=F64)
    return (0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))).astype(F32)


_ERF = np.frompyfunc(math.erf, 1, 1)


def erf(x: np.ndarray) -> np.ndarray:
    """erf elementwise in f64 (math.erf: numpy has none)."""
    return _ERF(np.asarray(x, dtype=F64)).astype(F64)


def _gelu_erf(x, **a):
    x = np.asarray(x, dtype=F64)
    return (0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))).astype(F32)


def _swiglu(g, u, ggml_order=False, **a):
    if ggml_order:
        return ggml.swiglu(g, u)
    g = np.asarray(g, dtype=F64)
    return (g / (1.0 + np.exp(-g)) * np.asarray(u, dtype=F64)).astype(F32)


def _argmax(x, **a):
    return np.argmax(np.asarray(x), axis=-1).astype(np.int32)  # the first of equal maxima


def _scale(x, factor, **a):
    return (np.asarray(x, dtype=F64) * factor).astype(F32)


def _softcap(x, cap, **a):
    return (cap * np.tanh(np.asarray(x, dtype=F64) / cap)).astype(F32)


def _view(x, row, rows=1, **a):
    if isinstance(x, Quantized):  # rows of a quantized form: their words, low words or sums, scales
        cut = lambda v: None if v is None else np.array(v[row:row + rows])  # noqa: E731
        return Quantized(cut(x.words), cut(x.low), cut(x.scales), x.block, cut(x.sums))
    return np.array(x[row:row + rows], dtype=x.dtype)


def _quantize(x, words=1, **a):
    return q8_quantize(x, words)


def _moe(x, router, gate_up, down, router_bias=None, gate_up_bias=None, down_bias=None, *, experts, k, inter,
         norm_topk, act="silu", routing="softmax_topk", limit=0.0, alpha=1.702, groups=1, topk_groups=1,
         route_scale=1.0, lo=0, local=0, **a):
    """The mixture of each row (engine/opdefs.py `moe`); a rank's part (`local` > 0): its experts lo..lo+local-1
    alone, each row routed over all `experts`."""
    from lanefuse.engine.routing import route

    xs = np.asarray(x, dtype=F64)  # (R, d)
    r, d = xs.shape
    logits = xs @ np.asarray(router, dtype=F64).T
    choice_bias = None
    if router_bias is not None and routing == "sigmoid_group":  # DeepSeek's correction bias: the choice only
        choice_bias = np.asarray(router_bias, dtype=F64)
    elif router_bias is not None:
        logits = logits + np.asarray(router_bias, dtype=F64)
    chosen, weights = route(logits, k, bool(norm_topk), routing, choice_bias, groups, topk_groups,
                            route_scale)  # (R, k) each
    n = local or experts  # the experts held: lo..lo+n-1
    gu = np.asarray(gate_up, dtype=F64).reshape(n, 2 * inter, d)
    dn = np.asarray(down, dtype=F64).reshape(n, d, inter)
    gub = np.zeros((n, 2 * inter)) if gate_up_bias is None else \
        np.asarray(gate_up_bias, dtype=F64).reshape(n, 2 * inter)
    db = np.zeros((n, d)) if down_bias is None else np.asarray(down_bias, dtype=F64).reshape(n, d)
    out = np.zeros((r, d), dtype=F64)
    for i in range(r):
        for e, w in zip(chosen[i], weights[i]):
            e = int(e) - lo  # its slot among those held; another rank's expert adds nothing here
            if not 0 <= e < n:
                continue
            g = gu[e, :inter] @ xs[i] + gub[e, :inter]  # (f,) each
            u = gu[e, inter:] @ xs[i] + gub[e, inter:]
            h = clamped_glu(g, u, limit, alpha) if act == "clamped_glu" else _ACT64[act](g) * u
            out[i] += w * (dn[e] @ h + db[e])
    return out.astype(F32)


def clamped_glu(g, u, limit, alpha):
    """gpt-oss's GLU: the gate clamped above at `limit`, the up value both ways, (u + 1)·g·sigmoid(alpha·g)."""
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    return (u + 1.0) * g / (1.0 + np.exp(-alpha * g))


def _l2norm(x, heads=1, eps=1e-6, **a):
    r, n = x.shape
    xs = np.asarray(x, dtype=F64).reshape(r, heads, n // heads)
    y = xs / np.sqrt(np.sum(xs * xs, axis=-1, keepdims=True) + eps)
    return y.reshape(r, n).astype(F32)


def _causal_conv(x, w, ring, taps, start=0, **a):
    seqs = ring.shape[0] // (taps - 1)
    if seqs > 1:  # a batch: row s, sequence s's, after its own slot of the ring (rewritten in place)
        return np.concatenate([_causal_conv(x[s:s + 1], w, ring[s * (taps - 1):(s + 1) * (taps - 1)], taps, start)
                               for s in range(seqs)])
    c = w.shape[0]
    xs = np.asarray(x, dtype=F64)[:, start:start + c]  # (R, C): the channels it convolves
    xx = np.concatenate([np.asarray(ring, dtype=F64), xs])  # (taps-1 + R, C)
    ws = np.asarray(w, dtype=F64)  # (C, taps)
    r = x.shape[0]
    y = sum(ws[:, j] * xx[j:j + r] for j in range(taps))
    ring[:] = xx[r:].astype(F32)  # in place: the last taps-1 inputs
    return np.asarray(y, dtype=F64).astype(F32)


def softplus(x: np.ndarray) -> np.ndarray:
    """torch's softplus (beta 1, threshold 20): x past 20, else log(1 + exp(x)), in f64."""
    x = np.asarray(x, dtype=F64)
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def _decay(a_, dt, al, **a):
    return (-np.exp(np.asarray(al, dtype=F64)) * softplus(np.asarray(a_, dtype=F64) + np.asarray(dt, dtype=F64))
            ).astype(F32)


def _gated_delta(q, k, v, z, beta, g, state, gn, *, hk, hv, dk, dv, scale, eps, zoff=0, **a):
    r = q.shape[0]
    if state.shape[0] > hv * dk:  # a batch: row s, sequence s's, over its own slot of the state (in place)
        n = hv * dk
        return np.concatenate([_gated_delta(q[s:s + 1], k[s:s + 1], v[s:s + 1], z[s:s + 1], beta[s:s + 1],
                                            g[s:s + 1], state[s * n:(s + 1) * n], gn, hk=hk, hv=hv, dk=dk, dv=dv,
                                            scale=scale, eps=eps, zoff=zoff) for s in range(r)])
    group = hv // hk
    qs = np.asarray(q, dtype=F64).reshape(r, hk, dk) * scale
    ks = np.asarray(k, dtype=F64).reshape(r, hk, dk)
    vs = np.asarray(v, dtype=F64).reshape(r, hv, dv)
    bs, gs = np.asarray(beta, dtype=F64), np.asarray(g, dtype=F64)  # (R, hv)
    S = np.asarray(state, dtype=F64).reshape(hv, dk, dv).copy()
    o = np.zeros((r, hv, dv), dtype=F64)
    for i in range(r):  # the rows in order: each one's state is the one before it
        for h in range(hv):
            j = h // group
            S[h] *= np.exp(gs[i, h])
            delta = (vs[i, h] - ks[i, j] @ S[h]) * bs[i, h]  # (dv,)
            S[h] += np.outer(ks[i, j], delta)
            o[i, h] = qs[i, j] @ S[h]
    state[:] = S.reshape(hv * dk, dv).astype(F32)  # in place
    ms = np.mean(o * o, axis=-1, keepdims=True)
    zs = np.asarray(z, dtype=F64)[:, zoff:zoff + hv * dv].reshape(r, hv, dv)
    y = o / np.sqrt(ms + eps) * np.asarray(gn, dtype=F64) * (zs / (1.0 + np.exp(-zs)))
    return y.reshape(r, hv * dv).astype(F32)


_ACT64 = {"silu": lambda g: g / (1.0 + np.exp(-g)), "sigmoid": lambda g: 1.0 / (1.0 + np.exp(-g)),
          "gelu": lambda g: 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))}


def _head_slice(x, every, start, width, **a):
    r, n = x.shape
    return np.array(np.asarray(x, dtype=F32).reshape(r, n // every, every)[:, :, start:start + width]
                    .reshape(r, n // every * width))


def _join(a_, b, heads, **a):
    r = a_.shape[0]
    return np.concatenate([np.asarray(a_, dtype=F32).reshape(r, heads, -1),
                           np.asarray(b, dtype=F32).reshape(r, heads, -1)], axis=-1).reshape(r, -1)


def _head_matmul(x, w, heads, a, b, rows_out, **at):
    xs = np.asarray(x, dtype=F64).reshape(-1, heads, a)  # (rows, heads·a), or read in parts: a unit a row's head
    r = xs.shape[0]
    ws = np.asarray(w, dtype=F64)
    ws = ws.reshape(heads, b, a).transpose(0, 2, 1) if rows_out else ws.reshape(heads, a, b)  # (heads, a, b)
    return np.einsum("rha,hab->rhb", xs, ws).reshape(r, heads * b).astype(F32)


OP_IMPL: dict[str, Callable[..., np.ndarray]] = {
    "gather": _gather, "rmsnorm": _rmsnorm, "matmul": _matmul,
    "add": _binary(np.add), "mul": _binary(np.multiply), "sub": _binary(np.subtract),
    "rope": _rope, "set_row": _set_row, "attention": _attention,
    "silu": _silu, "sigmoid": _sigmoid, "gelu": _gelu, "gelu_erf": _gelu_erf, "swiglu": _swiglu, "argmax": _argmax,
    "scale": _scale, "softcap": _softcap, "view": _view, "moe": _moe, "quantize": _quantize, "l2norm": _l2norm,
    "causal_conv": _causal_conv, "decay": _decay, "gated_delta": _gated_delta, "head_slice": _head_slice,
    "join": _join, "head_matmul": _head_matmul,
    "all_reduce": lambda x, **a: alone("all_reduce", x, **a), "all_gather": lambda x, **a: alone("all_gather", x, **a),
    "all_argmax": lambda x, **a: alone("all_argmax", x, **a),  # without their ranks (engine/collectives.py)
}


# -- placements: an input's access, a result's destination ----------------------------------------------------------

def read_access(x: np.ndarray, acc: Access | None) -> np.ndarray:
    """The part of every unit of `x` an access names, as (units, width): unit u's values start at u*pitch+offset."""
    if acc is None:
        return x
    flat = x.reshape(-1)
    units = flat.size // acc.pitch
    idx = np.arange(units)[:, None] * acc.pitch + acc.offset + np.arange(acc.width)[None, :]
    return flat[idx]


def row_of(sel, env: dict[str, np.ndarray]) -> int:
    if sel is None:
        return 0
    if sel.param is not None:
        return int(np.asarray(env[sel.param]).reshape(-1)[0])
    return int(sel.fixed or 0)


def write_dst(table: np.ndarray, y: np.ndarray, dst: Dst, env: dict[str, np.ndarray]) -> None:
    """Write result `y` into `table` in place: rows from the row `dst.row` selects, or (with `dst.unit`) each
    `unit.width` values of y into a part of every unit of the table from that row on."""
    if dst.row is not None and dst.row.param is not None and np.asarray(env[dst.row.param]).size > 1:
        # a batch: result row s lands in its sequence's slot at its position
        pos = np.asarray(env[dst.row.param]).reshape(-1)
        slot = table.shape[0] // pos.size
        ys = np.asarray(y).reshape(pos.size, -1)
        for s_, p in enumerate(pos):
            write_dst(table, ys[s_], Dst(dst.table, RowSel(fixed=int(s_ * slot + p)), dst.unit), env)
        return
    row = row_of(dst.row, env)
    cols = table.shape[-1] if table.ndim > 1 else 1
    flat = table.reshape(-1)
    base = row * cols
    vals = np.asarray(y).reshape(-1)
    if dst.unit is None:
        if base + vals.size > flat.size:
            raise UserError(f"a write of {vals.size} values from row {row} overflows table {table.shape}")
        flat[base:base + vals.size] = vals
        return
    u = dst.unit
    units = vals.size // u.width
    idx = base + np.arange(units)[:, None] * u.pitch + u.offset + np.arange(u.width)[None, :]
    if idx.size and idx.max() >= flat.size:
        raise UserError(f"a write of {units} units of {u.width} from row {row} overflows table {table.shape}")
    flat[idx] = vals.reshape(units, u.width)


# -- evaluating ops ------------------------------------------------------------------------------------------------

def run_op(op: Op, *arrays: np.ndarray, ggml_order: dict[str, Any] | None = None) -> np.ndarray:
    """Lifted op `op` on its input arrays (whole tensors: each input's access is applied here), without its dst.
    A set_row writes its table argument in place and returns it. `ggml_order`: an rmsnorm / silu / swiglu / rope /
    attention computed as llama.cpp computes it, with these arguments (`ggml_ops`)."""
    if op.fused:
        raise ValueError("run_op takes a lifted op; evaluate a fused op with apply_op")
    ins = [x if isinstance(x, Quantized) else read_access(np.asanyarray(x), op.acc(i)) for i, x in enumerate(arrays)]
    extra = dict(ggml_order, ggml_order=True) if ggml_order is not None and op.kind in GGML_KINDS else {}
    return OP_IMPL[op.kind](*ins, **full_attrs(op), **extra)


GGML_KINDS = ("rmsnorm", "silu", "swiglu", "rope", "attention")
ROPE_TABLES = ("rope.cos", "rope.sin")


def ggml_ops(g: Graph, rope: ggml.LlamaRope | None = None) -> dict[str, dict[str, Any]]:
    """The outputs of the ops of `g` that compute as llama.cpp's CPU build does (engine/formats/ggml.py) under the
    q8 numerics, each with its arguments: an rmsnorm or attention whose result is quantized to llama.cpp's q8_0 /
    q8_K form and a silu / swiglu of a product of such a form — where the plan's launches do the same (a Norm,
    Attention writing that form or feeding a Quant launch that does, a GemvGlu over it) — and, where llama.cpp's rope
    of the model is known (`rope`: ggml.llama_rope), every rope over the step's rope tables (evaluate reads llama.cpp's
    in their place) and the attention in its head order."""
    if g.meta.get("numerics") != "q8":
        return {}
    leaves = [leaf for op in g.ops for leaf in (op.leaves() if op.fused else (op,))]
    quantized = {op.ins[0] for op in leaves if op.kind == "quantize" and int(op.a.get("words", 1)) in ggml.WORDS}
    forms = {op.out for op in leaves if op.kind == "quantize" and int(op.a.get("words", 1)) in ggml.WORDS}
    forms |= {op.out for op in leaves if op.kind == "view" and op.ins[0] in forms}
    products = {op.out for op in leaves if op.kind == "matmul" and op.ins[0] in forms}
    out: dict[str, dict[str, Any]] = {}
    for op in leaves:
        if (op.kind == "rmsnorm" and op.out in quantized) or (op.kind in ("silu", "swiglu") and op.ins[0] in products):
            out[op.out] = {}
        elif rope is not None and op.kind == "rope" and tuple(op.ins[1:3]) == ROPE_TABLES:
            out[op.out] = {}
        elif rope is not None and op.kind == "attention" and op.out in quantized:
            out[op.out] = {"pairs": rope.pairs}
    return out


def apply_op(op: Op, env: dict[str, np.ndarray], const: Callable[[str], np.ndarray] | None = None,
             comm=None, ggml_outs: dict[str, dict[str, Any]] | None = None) -> None:
    """Evaluate `op` against `env` (name -> array), binding its results in `env`; a fused op runs its parts in order.
    `const(name)` supplies a name `env` lacks (a constant); `comm` is this rank's communicator, which a collective op
    meets the other ranks through (engine/collectives.py)."""
    if op.fused:
        for p in op.parts:
            apply_op(p, env, const, comm, ggml_outs)
        return

    def get(name: str) -> np.ndarray:
        if name in env:
            return env[name]
        if const is not None:
            v = const(name)
            env[name] = v
            return v
        raise UserError(f"op `{op.kind}` -> `{op.out}` reads `{name}`, which has no value")

    if comm is not None and op.kind in COLLECTIVES:
        y = meet(comm, op, read_access(np.asanyarray(get(op.ins[0])), op.acc(0)))
    else:
        y = run_op(op, *[get(n) for n in op.ins], ggml_order=(ggml_outs or {}).get(op.out))
    if op.dst is not None and op.kind != "set_row":
        if op.dst.table not in env:
            raise UserError(f"op `{op.kind}` -> `{op.out}` writes into `{op.dst.table}`, which has no value")
        write_dst(env[op.dst.table], y, op.dst, env)
    env[op.out] = y


def evaluate(g: Graph, weights: Any, env: dict[str, np.ndarray], comm=None) -> dict[str, np.ndarray]:
    """Run graph `g` on step inputs `env` (token, pos, cache tables) with constants from `weights` (anything with
    `get(name) -> array`). Cache tables are written in place. Returns every value: the inputs and each op's results.
    `comm`: one rank's communicator, for a rank's step graph (engine/collectives.py)."""
    vals: dict[str, np.ndarray] = {}
    for name in g.io.inputs:
        if name not in env:
            raise UserError(f"step input `{name}` is missing")
    for name, x in env.items():
        t = g.tensors.get(name)
        if t is None:
            vals[name] = x
            continue
        if t.dtype == "i32":
            x = np.asarray(x, dtype=np.int32)
        elif name in g.io.tables:
            if not isinstance(x, np.ndarray) or x.dtype != F32:
                raise UserError(f"cache table `{name}` must be an f32 numpy array (it is written in place)")
        else:
            x = np.asarray(x, dtype=F32)
        if tuple(x.shape) != t.shape:
            raise UserError(f"step input `{name}` has shape {tuple(x.shape)}, the step declares {t.shape}")
        vals[name] = x
    cache: dict[str, np.ndarray] = {}

    def const(name: str) -> np.ndarray:
        c = g.constants.get(name)
        if c is None:
            raise UserError(f"`{name}` is neither a step input nor a constant")
        if name not in cache:
            v = np.asarray(weights.get(c.source or c.name), dtype=F32)
            if rope is not None and (c.source or c.name) in ROPE_TABLES and v.shape == rope.cos.shape:
                v = rope.cos if (c.source or c.name) == ROPE_TABLES[0] else rope.sin  # llama.cpp's, under q8
            if tuple(v.shape) != c.shape:
                raise UserError(f"constant `{name}`: the weights hold {tuple(v.shape)}, the step declares {c.shape}")
            cache[name] = with_mins(weights, c.source or c.name, v)
        return cache[name]

    rope = ggml.llama_rope(getattr(weights, "cfg", None)) if g.meta.get("numerics") == "q8" else None
    outs = ggml_ops(g, rope)
    for op in g.ops:
        apply_op(op, vals, const, comm, outs)
    for name in cache:
        vals.pop(name, None)
    return vals
