"""Each lifted op of the reference interpreter against a hand-written formula on random data, including inputs read
through an access, results written through a dst, per-head norms, partial rotary, windowed attention and sinks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lanefuse.engine.errors import UserError
from lanefuse.engine.interp import OP_IMPL, apply_op, evaluate, read_access, run_op
from lanefuse.engine.ir import Access, Constant, Dst, Graph, Op, RowSel, StepIO, attrs_of
from lanefuse.engine.opdefs import OPS

rng = np.random.default_rng(1234)


def rand(*shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def op(kind, ins, out="y", access=(), dst=None, **attrs) -> Op:
    return Op(kind, tuple(ins), out, attrs_of(attrs), tuple(access), dst)


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), rtol=tol, atol=tol)


def test_every_op_kind_has_an_implementation():
    assert set(OP_IMPL) == set(OPS)


def test_gather():
    t, idx = rand(10, 6), np.array([3, 0, 9, 3], dtype=np.int32)
    y = run_op(op("gather", ["t", "i"]), t, idx)
    for r, i in enumerate(idx):
        close(y[r], t[i], 0)


@pytest.mark.parametrize("heads", [1, 4])
def test_rmsnorm(heads):
    x, eps = rand(3, 16), 1e-5
    hd = 16 // heads
    w = rand(hd)
    y = run_op(op("rmsnorm", ["x", "w"], eps=eps, heads=heads), x, w)
    for r in range(3):
        for h in range(heads):
            part = [float(v) for v in x[r, h * hd:(h + 1) * hd]]
            rms = math.sqrt(sum(v * v for v in part) / hd + eps)
            for j in range(hd):
                assert abs(y[r, h * hd + j] - part[j] / rms * w[j]) < 1e-5


def test_matmul():
    x, w = rand(3, 7), rand(5, 7)
    y = run_op(op("matmul", ["x", "w"]), x, w)
    for r in range(3):
        for n in range(5):
            assert abs(y[r, n] - sum(float(x[r, k]) * float(w[n, k]) for k in range(7))) < 1e-5


@pytest.mark.parametrize("kind,fn", [("add", lambda a, b: a + b), ("mul", lambda a, b: a * b),
                                     ("sub", lambda a, b: a - b)])
@pytest.mark.parametrize("bshape", [(3, 8), (1, 8), (8,)])
def test_binary_broadcast(kind, fn, bshape):
    a, b = rand(3, 8), rand(*bshape)
    y = run_op(op(kind, ["a", "b"]), a, b)
    brow = b.reshape(-1, 8)
    for r in range(3):
        for c in range(8):
            assert abs(y[r, c] - fn(float(a[r, c]), float(brow[r if brow.shape[0] == 3 else 0, c]))) < 1e-6


def _rope_formula(x, cos, sin, pos, heads, hd, rot):
    y = np.array(x, dtype=np.float64)
    half = rot // 2
    for r in range(x.shape[0]):
        p = pos + r
        for h in range(heads):
            for i in range(half):
                a, b = float(x[r, h * hd + i]), float(x[r, h * hd + half + i])
                c, s = float(cos[p, i]), float(sin[p, i])
                y[r, h * hd + i] = a * c - b * s
                y[r, h * hd + half + i] = b * c + a * s
    return y


@pytest.mark.parametrize("rot", [8, 4, 2])  # full, half (partial rotary), the least
def test_rope(rot):
    heads, hd, pos = 3, 8, 5
    ang = np.arange(20)[:, None] * (1.0 / 100 ** (np.arange(0, rot, 2) / rot))[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    x = rand(4, heads * hd)
    y = run_op(op("rope", ["x", "c", "s", "p"], heads=heads, hd=hd, rot=rot), x, cos, sin,
               np.array([pos], dtype=np.int32))
    close(y, _rope_formula(x, cos, sin, pos, heads, hd, rot))
    if rot < hd:  # the unrotated tail of each head passes through
        for h in range(heads):
            close(y[:, h * hd + rot:(h + 1) * hd], x[:, h * hd + rot:(h + 1) * hd], 0)


def test_set_row_writes_in_place():
    table, src = np.zeros((8, 4), dtype=np.float32), rand(3, 4)
    y = run_op(op("set_row", ["t", "s", "p"]), table, src, np.array([2], dtype=np.int32))
    assert y is table
    close(table[2:5], src, 0)
    assert not table[:2].any() and not table[5:].any()


def _attention_formula(q, k, v, pos, heads, kv_heads, hd, vd, scale, window=0, softcap=0.0, sinks=None):
    r = q.shape[0]
    out = np.zeros((r, heads * vd))
    for i in range(r):
        p = pos + i
        lo = max(0, p - window + 1) if window else 0
        for h in range(heads):
            j = h // (heads // kv_heads)
            scores = []
            for t in range(lo, p + 1):
                s = sum(float(q[i, h * hd + d]) * float(k[t, j * hd + d]) for d in range(hd)) * scale
                if softcap:
                    s = softcap * math.tanh(s / softcap)
                scores.append(s)
            m = max(scores + ([float(sinks[h])] if sinks is not None else []))
            e = [math.exp(s - m) for s in scores]
            den = sum(e) + (math.exp(float(sinks[h]) - m) if sinks is not None else 0.0)
            for d in range(vd):
                out[i, h * vd + d] = sum(e[n] / den * float(v[lo + n, j * vd + d]) for n in range(len(e)))
    return out


@pytest.mark.parametrize("window,softcap,sinks", [(0, 0.0, False), (3, 0.0, False), (0, 0.0, True),
                                                  (4, 5.0, True), (0, 2.0, False)])
def test_attention(window, softcap, sinks):
    heads, kv, hd, vd, pos, rows, L = 4, 2, 4, 3, 5, 3, 12
    q, k, v = rand(rows, heads * hd), rand(L, kv * hd), rand(L, kv * vd)  # rows past pos+r hold noise: never read
    s = rand(heads) if sinks else None
    attrs = dict(heads=heads, kv_heads=kv, hd=hd, vd=vd, scale=0.7, window=window, softcap=softcap)
    args = [q, k, v, np.array([pos], dtype=np.int32)] + ([s] if sinks else [])
    y = run_op(op("attention", ["q", "k", "v", "p"] + (["s"] if sinks else []), **attrs), *args)
    close(y, _attention_formula(q, k, v, pos, sinks=s, **attrs))


def test_attention_is_causal():
    heads, kv, hd, pos = 2, 1, 4, 3
    q, k, v = rand(1, heads * hd), rand(8, kv * hd), rand(8, kv * hd)
    a = dict(heads=heads, kv_heads=kv, hd=hd, vd=hd, scale=0.5)
    p = np.array([pos], dtype=np.int32)
    y1 = run_op(op("attention", ["q", "k", "v", "p"], **a), q, k, v, p)
    k[pos + 1:], v[pos + 1:] = 100.0, 100.0
    y2 = run_op(op("attention", ["q", "k", "v", "p"], **a), q, k, v, p)
    close(y1, y2, 0)


@pytest.mark.parametrize("kind,fn", [
    ("silu", lambda x: x / (1 + math.exp(-x))),
    ("sigmoid", lambda x: 1 / (1 + math.exp(-x))),
    ("gelu", lambda x: 0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))),
])
def test_unary(kind, fn):
    x = rand(3, 5) * 3
    y = run_op(op(kind, ["x"]), x)
    for a, b in zip(x.reshape(-1), y.reshape(-1)):
        assert abs(b - fn(float(a))) < 1e-6


def test_swiglu_scale_softcap_view():
    g, u = rand(2, 6), rand(2, 6)
    y = run_op(op("swiglu", ["g", "u"]), g, u)
    close(y, g / (1 + np.exp(-g.astype(np.float64))) * u)
    close(run_op(op("scale", ["x"], factor=0.25), g), g * 0.25, 0)
    close(run_op(op("softcap", ["x"], cap=1.5), g * 4), 1.5 * np.tanh(g.astype(np.float64) * 4 / 1.5))
    x = rand(4, 3)
    close(run_op(op("view", ["x"], row=2), x), x[2:3], 0)


def test_argmax_first_of_ties():
    x = np.array([[1, 5, 5, 0], [2, 2, 2, 2], [-1, -3, 0, 0]], dtype=np.float32)
    y = run_op(op("argmax", ["x"]), x)
    assert y.dtype == np.int32 and list(y) == [1, 0, 2]


def test_access_reads_a_part_of_every_unit():
    qkv = rand(2, 24)  # rows of [q 8 | k 8 | v 8]
    part = read_access(qkv, Access(pitch=24, offset=8, width=8))
    close(part, qkv[:, 8:16], 0)
    # a per-head norm reading heads 4 wide out of units 6 wide (a head's first 4 of 6)
    w = rand(4)
    y = run_op(op("rmsnorm", ["x", "w"], access=[Access(6, 0, 4)], eps=1e-6), qkv, w)
    heads = qkv.reshape(8, 6)[:, :4]
    close(y, heads / np.sqrt((heads.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w)
    # a product of the k part
    wk = rand(5, 8)
    y = run_op(op("matmul", ["x", "w"], access=[Access(24, 8, 8)]), qkv, wk)
    close(y, qkv[:, 8:16].astype(np.float64) @ wk.T)


def test_dst_writes_rows_of_a_table_from_a_parameter_row():
    table = np.zeros((10, 6), dtype=np.float32)
    x = rand(2, 6)
    env = {"x": x, "kc": table, "pos": np.array([4], dtype=np.int32)}
    apply_op(op("scale", ["x"], out="y", dst=Dst("kc", RowSel(param="pos")), factor=2.0), env)
    close(table[4:6], 2 * x, 0)
    assert not table[:4].any() and not table[6:].any()
    close(env["y"], 2 * x, 0)


def test_dst_writes_a_part_of_every_unit():
    table = np.zeros((6, 8), dtype=np.float32)  # rows of [k 4 | v 4]
    x = rand(2, 4)
    env = {"x": x, "t": table}
    apply_op(op("scale", ["x"], dst=Dst("t", RowSel(fixed=1), Access(8, 4, 4)), factor=1.0), env)
    close(table[1:3, 4:], x, 0)
    assert not table[:, :4].any() and not table[0].any() and not table[3:].any()


def test_fused_op_runs_its_parts():
    a, b, w = rand(2, 8), rand(2, 8), rand(8)
    add = op("add", ["a", "b"], out="s")
    norm = op("rmsnorm", ["s", "w"], out="n", eps=1e-6)
    fused = Op("fused", ("a", "b", "w"), "n", cls="add_norm", rule="add_norm", parts=(add, norm), keeps=("s",))
    env = {"a": a, "b": b, "w": w}
    apply_op(fused, env)
    close(env["s"], a + b, 0)
    close(env["n"], run_op(norm, a + b, w), 0)


def _tiny_graph() -> Graph:
    g = Graph()
    g.tensor("token", (1,), "i32")
    g.tensor("pos", (1,), "i32")
    g.constant(Constant("emb", (7, 4), "rows"))
    g.constant(Constant("w", (4,), "values"))
    x = g.add("gather", ["emb", "token"], "x")
    n = g.add("rmsnorm", [x, "w"], "n", eps=1e-6)
    g.add("matmul", [n, "emb"], "logits")
    g.add("argmax", ["logits"], "next")
    return g


class _W(dict):
    def get(self, name):  # the interpreter asks the store by name
        return self[name]


def test_evaluate_a_graph():
    g = _tiny_graph()
    emb, w = rand(7, 4), rand(4)
    vals = evaluate(g, _W(emb=emb, w=w), {"token": np.array([3]), "pos": np.array([0])})
    x = emb[3:4].astype(np.float64)
    n = x / np.sqrt((x ** 2).mean() + 1e-6) * w
    close(vals["logits"], n @ emb.T.astype(np.float64))
    assert int(vals["next"][0]) == int(np.argmax(vals["logits"]))
    assert "emb" not in vals


def test_evaluate_binds_a_cache_write_to_the_table():
    g = Graph(io=StepIO(caches=(("kc", "vc"),)))
    g.tensor("token", (2,), "i32")
    g.tensor("pos", (1,), "i32")
    g.tensor("kc", (6, 4))
    g.tensor("vc", (6, 4))
    g.tensor("k", (2, 4))
    g.add("set_row", ["kc", "k", "pos"], "L0.kc")
    table, k = np.zeros((6, 4), dtype=np.float32), rand(2, 4)
    env = {"token": np.array([0, 0]), "pos": np.array([3]), "kc": table, "vc": np.zeros((6, 4), np.float32), "k": k}
    vals = evaluate(g, _W(), env)
    assert vals["L0.kc"] is table
    close(table[3:5], k, 0)


def test_shape_mismatch_names_op_and_shapes():
    g = Graph()
    g.tensor("x", (2, 8))
    g.constant(Constant("w", (4, 6)))
    with pytest.raises(UserError) as e:
        g.add("matmul", ["x", "w"], "y")
    msg = str(e.value)
    assert "matmul" in msg and "(2, 8)" in msg and "(4, 6)" in msg


def test_missing_step_input_is_a_user_error():
    with pytest.raises(UserError, match="step input `pos` is missing"):
        evaluate(_tiny_graph(), _W(), {"token": np.array([1])})


def test_constant_of_the_wrong_shape_is_a_user_error():
    with pytest.raises(UserError, match="constant `w`.*\\(5,\\).*\\(4,\\)"):
        evaluate(_tiny_graph(), _W(emb=rand(7, 4), w=rand(5)), {"token": np.array([1]), "pos": np.array([0])})
