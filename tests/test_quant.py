"""The q8 numerics in the engine: the `quantize` op's exact integer meaning (llama.cpp's q8_0 rounding; two words
under q8x2), the products of a quantized activation (int8 block sums scaled per block), and which activations a step
graph reads quantized (`with_numerics`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lanefuse.engine.front.demo import demo_config, random_arrays
from lanefuse.engine.errors import UserError
from lanefuse.engine.interp import evaluate
from lanefuse.engine.ir import Graph
from lanefuse.engine.front.model import build_step
from lanefuse.engine.formats.quantize import LOW_STEPS, f32_reads, product, quantize, with_numerics
from lanefuse.engine.stepyaml import from_yaml, to_yaml
from lanefuse.engine.front.weights import Weights
from lanefuse.engine.formats.blocks import BLOCKS, _enc_q8_0, encode, encode_matrices

FMTS = ("q8_0", "q4_0", "q4_k", "q6_k")


def x86_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's x86 SIMD quantize_row_q8_0 / q8_1 (ggml-cpu/arch/x86/quants.c), a value at a time in Python:
    amax, d32 = f32(amax/127), id = f32(127/amax), q = round(f32(x·id)) — Python's round, to nearest, halves to even;
    the words, the f16 d = f16(d32) both store, and q8_1's s = f16(f32(d32·Σq))."""
    f = np.float32
    words, d = np.zeros(x.shape, np.int8), np.zeros((x.shape[0], x.shape[1] // 32), f)
    s = np.zeros_like(d)
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            blk = x[r, 32 * b: 32 * b + 32]
            amax = max(abs(f(v)) for v in blk)
            idv = f(f(127) / amax) if amax else f(0)
            q = [round(float(f(f(v) * idv))) for v in blk]
            words[r, 32 * b: 32 * b + 32] = q
            d32 = f(amax / f(127))
            d[r, b] = np.float16(d32).astype(f)
            s[r, b] = np.float16(f(d32 * f(sum(q)))).astype(f)
    return words, d, s


def test_quantize_is_llama_cpps_x86_q8_0_rounding():
    """Words and scales as llama.cpp's CPU build (x86 SIMD: halves to even, id = 127/amax) makes them: the f32
    d32 = amax/127 held, its f16 rounding the block's d (as block_q8_0 / q8_1 hold it), q8_1's s = f16(d32·Σq) from
    the unrounded d32 — every block of random rows, an all-zero block, and values that land on halves; the scalar
    quantize_row_q8_0_ref (gguf's quantizer: halves away, id = 1/d) differs only at the halves."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 96)) * rng.uniform(0.01, 10, (3, 1))).astype(np.float32)
    x[1, 32:64] = 0.0
    x[2, :32] = np.arange(32, dtype=np.float32) - 15.5  # amax 16.5 ... and a block of exact halves below
    x[2, 64:96] = np.r_[127.0, np.arange(31, dtype=np.float32) - 14.5]  # amax 127: x·id are halves
    q = quantize(x)
    words, d, s = x86_q8_0(x)
    assert np.array_equal(q.words, words) and np.array_equal(q.d(), d) and np.array_equal(q.s(), s)
    assert np.array_equal(q.scales, (np.abs(x).reshape(3, 3, 32).max(axis=2) / np.float32(127)).astype(np.float32))
    assert not np.array_equal(q.s(), d * q.words.reshape(3, 3, 32).sum(axis=2))  # f16(d32·Σq) is not f16(d32)·Σq
    ref = _enc_q8_0(x.reshape(-1, 32))  # (blocks, 34): f16 d, then 32 int8 (the scalar _ref)
    assert np.array_equal(q.d().reshape(-1).astype(np.float16), ref[:, :2].copy().view(np.float16)[:, 0])
    apart = q.words.reshape(-1) != ref[:, 2:].view(np.int8).reshape(-1)
    assert apart.any()
    assert set(np.flatnonzero(apart) // 32) <= {6, 8}  # only the blocks of halves
    assert q.low is None and q.words.dtype == np.int8 and q.scales.dtype == np.float32
    assert np.all(q.words[1, 32:64] == 0) and q.scales[1, 1] == 0 and q.s()[1, 1] == 0
    assert list(q.words[2, 65:69]) == [-14, -14, -12, -12]  # -14.5 -> -14, -13.5 -> -14: halves to even
    assert q.words[2, 64] == 127 and q.scales[2, 2] == 1.0


def test_two_words_hold_the_residual():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    one, two = quantize(x, 1), quantize(x, 2)
    assert np.array_equal(one.words, two.words)  # the same words and scale held; one word's d is it rounded to f16
    assert np.array_equal(one.scales, two.scales) and np.array_equal(two.d(), two.scales)
    assert np.array_equal(one.d(), two.scales.astype(np.float16).astype(np.float32))
    d = np.repeat(two.scales, 32, axis=1).astype(np.float64)
    e1 = np.abs(one.values() - x)
    e2 = np.abs(two.values() - x)
    assert np.all(e1 <= d * (0.5 + 127 * 2.0**-12) * (1 + 1e-6))
    assert np.all(e2 <= d / (2 * LOW_STEPS) * (1 + 1e-3) + 1e-12)
    assert e2.max() < e1.max() / 50
    assert np.abs(two.low).max() <= 127 and two.low.dtype == np.int8


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_block_product_is_int32_sums_scaled(fmt):
    """Over q8_0 / q4_0 rows the product equals, to f64's rounding, the int32 sums of int8 products each times the
    weight block's f16 scale and the activation block's f32 scale — computed here from the raw blocks."""
    rng = np.random.default_rng(3)
    k, n = 96, 7
    w = rng.standard_normal((n, k)).astype(np.float32)
    raw = encode(w, fmt).reshape(n, k // 32, BLOCKS[fmt][1])
    dw = raw[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float64)  # (n, nb)
    if fmt == "q8_0":
        qw = raw[:, :, 2:].view(np.int8).astype(np.int32)
    else:
        nib = raw[:, :, 2:]
        qw = np.concatenate([nib & 15, nib >> 4], axis=2).astype(np.int32) - 8
    from lanefuse.engine.formats.blocks import decode_rows

    wf = decode_rows(encode(w, fmt), fmt, k)
    x = rng.standard_normal((2, k)).astype(np.float32)
    xq = quantize(x)
    sums = np.einsum("rbi,nbi->rnb", xq.words.astype(np.int32).reshape(2, -1, 32), qw)  # int32
    want = np.einsum("rnb,nb,rb->rn", sums.astype(np.float64), dw, xq.d().astype(np.float64))
    got = product(xq, wf)
    assert np.allclose(got, want, rtol=1e-6, atol=0)
    assert not np.allclose(got, x @ wf.T, rtol=1e-6)  # the activation's rounding shows


@pytest.mark.parametrize("fmt", ["q4_1", "q5_1"])
def test_min_rows_take_q8_1s_s(fmt):
    """Over q4_1 / q5_1 rows a one-word product is llama.cpp's vec_dot_q4_1_q8_1 / q5_1: each block
    d_w·f16(d32)·Σ q·q_w + m·s with q8_1's s = f16(f32(d32·Σq)) — computed here from the raw blocks and the
    value-at-a-time x86 quantizer — in the engine's product (the decoded rows and their mins) and the kernels' exact
    twin (kernels/q8dot.py) alike; without the mins (m·f16(d32)·Σq) it is measurably off. Under two words the min term
    stays d·Σ(q + low/254)."""
    from lanefuse.engine.formats.quantize import block_mins
    from lanefuse.engine.formats.blocks import decode_rows
    from lanefuse.engine.formats.ints import weight_ints
    from lanefuse.kernels.q8dot import q8_exact

    rng = np.random.default_rng(4)
    k, n, r = 160, 9, 3
    w = (rng.standard_normal((n, k)) + 0.7).astype(np.float32)  # mins far from 0
    raw = encode(w, fmt)
    wq, dw, mw = weight_ints(raw, fmt, n, k)
    assert np.array_equal(mw, block_mins(raw, fmt, n, k)) and np.abs(mw).min() > 0
    x = (rng.standard_normal((r, k)) * 3 + 0.5).astype(np.float32)
    words, d, s = x86_q8_0(x)
    ints = np.einsum("rbi,nbi->rnb", words.astype(np.int64).reshape(r, -1, 32), wq.astype(np.int64))
    want = (np.einsum("rnb,nb,rb->rn", ints.astype(np.float64), dw.astype(np.float64), d.astype(np.float64))
            + np.einsum("rb,nb->rn", s.astype(np.float64), mw.astype(np.float64)))
    xq = quantize(x)
    wf = decode_rows(raw, fmt, k)
    got = product(xq, wf, block_mins(raw, fmt, n, k))
    twin = q8_exact(*xq.parts(), raw, fmt, r, n, k)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-6 * scale and np.abs(twin - want).max() <= 1e-6 * scale
    old = product(xq, wf)  # m·f16(d32)·Σq
    assert np.abs(old - want).max() > 1e-4 * scale
    x2 = quantize(x, 2)
    assert np.allclose(q8_exact(*x2.parts(), raw, fmt, r, n, k), product(x2, wf, block_mins(raw, fmt, n, k)),
                       rtol=0, atol=1e-6 * scale)


def q8_model(fmt: str, max_len: int = 32):
    """The demo model (2 layers) with its matrices in `fmt`."""
    cfg = dataclasses.replace(demo_config(max_len), layers=2)
    arrays = encode_matrices(random_arrays(cfg), fmt)
    cfg = dataclasses.replace(cfg, formats=tuple((n, f) for n, (_, f) in arrays.items() if f != "f32"))
    return cfg, Weights.from_dict(arrays, cfg)


def _env(g: Graph, cfg, token=5, pos=0):
    env = {"token": np.array([token], np.int32), "pos": np.array([pos], np.int32)}
    for name in g.io.tables:
        env[name] = np.zeros(g.tensors[name].shape, np.float32)
    return env


@pytest.mark.parametrize("numerics", ["q8", "q8x2"])
def test_with_numerics_quantizes_each_block_product_activation_once(numerics):
    cfg, w = q8_model("q8_0")
    g = build_step(cfg, 1)
    gq = with_numerics(g, numerics)
    quants = [op for op in gq.ops if op.kind == "quantize"]
    matmuls = [op for op in gq.ops if op.kind == "matmul"]
    assert all(gq.dtype(m.ins[0]) == numerics for m in matmuls)  # every product here is over q8_0 rows
    # one quantize an activation: q/k/v share the normed input, gate/up theirs; 4 a layer and the head's
    assert len(quants) == 4 * cfg.layers + 1 == len({m.ins[0] for m in matmuls})
    assert all(op.a["words"] == (1 if numerics == "q8" else 2) for op in quants)
    for q in quants:  # right before its first reader
        k = gq.ops.index(q)
        assert gq.ops[k + 1].ins[0] == q.out
    gq.validate()
    assert from_yaml(to_yaml(gq)) == gq
    assert with_numerics(gq, numerics) is gq and with_numerics(g, "f32") is g
    with pytest.raises(UserError, match="cannot be planned under"):
        with_numerics(gq, "f32")
    assert f32_reads(gq) == []


def test_with_numerics_leaves_dense_rows_f32():
    cfg, w = q8_model("q8_0")
    cfg = dataclasses.replace(cfg, formats=tuple((n, f) for n, f in cfg.formats if "o_proj" not in n))
    gq = with_numerics(build_step(cfg, 1), "q8")
    o = [op for op in gq.ops if op.kind == "matmul" and "o_proj" in op.ins[1]]
    assert o and all(gq.dtype(op.ins[0]) == "f32" for op in o)
    why = dict(f32_reads(gq))
    assert why[o[0].out] == "its rows are f32 (only block-quantized rows are multiplied as int8)"


def test_a_quantized_activation_is_read_only_by_products():
    g = Graph()
    g.tensor("x", (1, 64))
    g.add("quantize", ["x"], "xq", words=1)
    with pytest.raises(UserError, match=r"only a product's activation \(or a row of it\) is read quantized"):
        g.add("add", ["xq", "x"], "y")
    with pytest.raises(UserError, match=r"only a product's activation \(or a row of it\) is read quantized"):
        g.add("quantize", ["xq"], "xqq")
    g.tensor("ids", (1, 32), "i32")
    with pytest.raises(UserError, match="it quantizes f32 values"):
        g.add("quantize", ["ids"], "iq")
    g.tensor("odd", (1, 40))
    with pytest.raises(UserError, match="not a whole number of 32-value blocks"):
        g.add("quantize", ["odd"], "oq")


@pytest.mark.parametrize("fmt", FMTS)
def test_q8_step_runs_in_the_interpreter_near_f32(fmt):
    """The reference interpreter runs a q8 and a q8x2 decode step: logits near the f32 step's (q8 within a few
    percent of their scale, q8x2 within 1e-3), and not equal to them (the words are what is multiplied)."""
    cfg, w = q8_model(fmt)
    g = build_step(cfg, 1)
    ref = evaluate(g, w, _env(g, cfg))["logits"]
    scale = np.abs(ref).max()
    errs = {}
    for numerics in ("q8", "q8x2"):
        gq = with_numerics(g, numerics)
        got = evaluate(gq, w, _env(gq, cfg))["logits"]
        errs[numerics] = np.abs(got - ref).max() / scale
    assert 1e-5 < errs["q8"] < 0.05
    assert errs["q8x2"] < 1e-3 and errs["q8x2"] < errs["q8"] / 20
