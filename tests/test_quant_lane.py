"""The q8 numerics in the lane: the Quant launch and the GEMV of a quantized activation (numpy twins against the
reference interpreter's exact meaning, refusals in words, bytes), q8/q8x2 plans run by the numpy backend inside their
arena equal to the interpreter of the quantized step graph, and --numerics on the command."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from lanefuse.engine.interp import evaluate
from lanefuse.engine.front.model import build_step
from lanefuse.engine.formats.quantize import product, quantize, with_numerics
from lanefuse.kernels import Dst, Gemv
from lanefuse.engine.formats.blocks import decode_rows, encode
from lanefuse.kernels.env import HostEnv
from lanefuse.kernels.quant import Quant, quant_layout
from lanefuse.lane.lower.plan import plan
from lanefuse.lane.run.numpy_runner import NumpyRunner
from test_quant import _env, q8_model

FMTS = ("q8_0", "q4_0", "q4_k", "q6_k")


def _empty(n: int, words: int):
    return (np.zeros(n, np.int8), np.zeros(n, np.int8) if words == 2 else None, np.zeros(n // 32, np.float32))


@pytest.mark.parametrize("words", [1, 2])
def test_quant_twin_is_the_interpreters_quantize(words):
    x = np.random.default_rng(4).standard_normal(160).astype(np.float32)
    env = HostEnv({"x": x}, quantized={"xq": _empty(160, words)})
    Quant("x", "xq", 160, words).numpy(env)
    want = quantize(x.reshape(1, -1), words)
    w, low, sc = env.quant("xq")
    assert np.array_equal(w, want.words.reshape(-1)) and np.array_equal(sc, want.scales.reshape(-1))
    assert (low is None) == (words == 1) and (low is None or np.array_equal(low, want.low.reshape(-1)))


def test_quant_refusals_and_bytes():
    assert "whole number of blocks" in Quant("x", "xq", 40).check().reason
    assert "q8 takes one, q8x2 two" in Quant("x", "xq", 64, 4).check().reason
    assert Quant("x", "xq", 64).check() is None
    assert Quant("x", "xq", 64).bytes() == 4 * 64 + 64 + 4 * 2
    assert quant_layout(64, 1) == (256, 256, 512) and quant_layout(64, 2) == (256, 512, 768)
    assert quant_layout(4096, 2) == (4096, 8192, 8192 + 512)


@pytest.mark.parametrize("words", [1, 2])
@pytest.mark.parametrize("fmt", FMTS)
def test_gemv_of_a_quantized_activation(fmt, words):
    """The exact twin equals the interpreter's product; the fast twin is within f32 rounding of it; a bias and a
    destination in a table's rows are honoured."""
    rng = np.random.default_rng(5)
    m, k, n = 3, 256, 37
    raw = encode(rng.standard_normal((n, k)).astype(np.float32) / 16, fmt)
    x = rng.standard_normal((m, k)).astype(np.float32)
    xq = quantize(x, words)
    b = rng.standard_normal(n).astype(np.float32)
    want = product(xq, decode_rows(raw, fmt, k)) + b
    for exact in (True, False):
        env = HostEnv({"y": np.zeros(m * n, np.float32), "b": b}, {"w": (raw, fmt)},
                      {"xq": (xq.words.reshape(-1), None if xq.low is None else xq.low.reshape(-1),
                              xq.scales.reshape(-1))})
        g = Gemv("xq", "w", fmt, Dst("y"), k, n, m, bias="b", words=words)
        assert g.check() is None
        g.numpy(env) if exact else g.fast(env)
        got = env.array("y").reshape(m, n)
        tol = 0 if exact else 1e-5 * np.abs(want).max()
        assert np.abs(got - want).max() <= tol + 1e-7 * np.abs(want).max()
    assert g.bytes() < Gemv("x", "w", fmt, Dst("y"), k, n, m, bias="b").bytes()


def test_gemv_refuses_what_gemv_q8_cannot_run():
    assert "int8 products need block-quantized rows" in Gemv("xq", "w", "bf16", Dst("y"), 64, 8, 1, words=1).check().reason
    assert "sums k whole" in Gemv("xq", "w", "q8_0", Dst("y"), 4096, 8, 1, words=1, split=2).check().reason
    assert "one, q8x2 two" in Gemv("xq", "w", "q8_0", Dst("y"), 64, 8, 1, words=4).check().reason
    assert "q4_k, q6_k rows only" in Gemv("xq", "w", "q8_0", Dst("y"), 256, 8, 1, words=3).check().reason


def _chunk_env(g, rows, pos):
    env = {"token": np.arange(3, 3 + rows, dtype=np.int32) % 500, "pos": np.array([pos], np.int32)}
    for name in g.io.tables:
        env[name] = np.zeros(g.tensors[name].shape, np.float32)
    return env


@pytest.mark.parametrize("numerics", ["q8", "q8x2"])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k"])
def test_q8_plan_equals_the_interpreter(fmt, numerics):
    """A decode step and a prefill chunk of 3 rows under q8/q8x2, run by the exact twins inside the plan's arena
    (LANEFUSE_CHECK=2's launch-by-launch comparison on), equal the interpreter of the quantized step graph; the fast
    twins pick the same token, their logits no farther from the interpreter's than the quantization's own noise (its
    logits' distance from f32's): their f32 sums are rounded otherwise, so a value within that rounding of a half
    rounds to the other word and moves its block by one step (measured: in the q8_0 chunk of 3 rows one word of the
    first layer's GLU flips, 8e-3 of the logits' scale at the end)."""
    cfg, w = q8_model(fmt)
    for rows in (1, 3):
        g = build_step(cfg, rows)
        p = plan(g, numerics=numerics)
        gq = with_numerics(g, numerics)
        # every quantize rides in its producer's epilogue: no Quant launch (under q8 q4_k rows read the q8k form,
        # llama.cpp's q8_K, which the norms', the gate/up GEMV's and the attention's epilogues write too)
        quants = 0
        assert p.numerics == numerics and p.census.get("quant", 0) == quants and p.f32_reads == ()
        ref = evaluate(gq, w, _chunk_env(gq, rows, 0))
        f32 = evaluate(g, w, _chunk_env(g, rows, 0))["logits"]
        noise = np.abs(ref["logits"] - f32).max() / np.abs(f32).max()
        assert noise > 1e-6
        for exact in (True, False):
            out = NumpyRunner(p, w, exact=exact, check=exact).step(_chunk_env(g, rows, 0), lifted=g)
            err = np.abs(out["logits"] - ref["logits"]).max() / np.abs(ref["logits"]).max()
            assert err <= (1e-6 if exact else max(1e-4, noise)), (rows, exact, err, noise)
            assert np.array_equal(out["next"], ref["next"])


def test_q8_plan_says_which_products_read_f32():
    cfg, w = q8_model("q8_0")
    cfg = dataclasses.replace(cfg, formats=tuple((n, f) for n, f in cfg.formats if "down_proj" not in n))
    p = plan(build_step(cfg, 1), numerics="q8")
    downs = [o for o, _ in p.f32_reads if "down" in o]
    assert len(downs) == cfg.layers and all(w == "its rows are f32 (only block-quantized rows are multiplied as int8)"
                                            for o, w in p.f32_reads)


def test_numerics_on_the_command(capsys, tmp_path):
    from lanefuse.lane.cli.main import main

    assert main(["plan", "--numerics", "q8"]) == 0
    out = capsys.readouterr().out
    assert "q8" in out and "read their activation f32" in out  # the demo model's rows are f32
    with pytest.raises(SystemExit) as e:
        main(["plan", "--numerics", "q9"])
    assert e.value.code != 0
    saved = tmp_path / "q8.json"  # a q8 plan saved runs without the solver: the same tokens as planning anew
    assert main(["plan", "--numerics", "q8", "--weights-format", "q8_0", "--save", str(saved)]) == 0
    capsys.readouterr()
    run = ["--weights-format", "q8_0", "--prompt-ids", "1,2,3", "--tokens", "4"]
    assert main(["run", "--plan", str(saved), *run]) == 0
    a = capsys.readouterr().out
    assert main(["run", "--numerics", "q8", *run]) == 0
    b = capsys.readouterr().out
    ids = [line for line in a.splitlines() if line.startswith("generated ids")]
    assert ids and ids == [line for line in b.splitlines() if line.startswith("generated ids")]


@pytest.mark.parametrize("words", [1, 2])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_glu_and_parts_of_a_quantized_activation(fmt, words):
    """GemvGlu and GemmParts over a quantized activation: the exact twins equal the interpreter's products (int8 block
    sums) under the GLU and into each part's destination; the fast twins within f32 rounding of them."""
    from lanefuse.kernels import GemmPart, GemmParts, GemvGlu, Part
    from lanefuse.kernels.common import act

    rng = np.random.default_rng(10)
    m, k, n = 3, 256, 37
    raws = {w: encode(rng.standard_normal((n, k)).astype(np.float32) / 16, fmt) for w in ("wg", "wu")}
    bg = rng.standard_normal(n).astype(np.float32)
    xq = quantize(rng.standard_normal((m, k)).astype(np.float32), words)
    g, u = (product(xq, decode_rows(raws[w], fmt, k)) for w in ("wg", "wu"))
    want_glu = act("silu", (g + bg).astype(np.float32)) * u
    W = 2 * n + 3
    want_qkv = np.zeros((m, W), np.float32)
    want_qkv[:, :n], want_qkv[:, n + 3:] = g + bg, u
    for exact in (True, False):
        env = HostEnv({"o": np.zeros(m * n, np.float32), "qkv": np.zeros(m * W, np.float32), "bg": bg},
                      {w: (r, fmt) for w, r in raws.items()},
                      {"xq": (xq.words.reshape(-1), None if xq.low is None else xq.low.reshape(-1),
                              xq.scales.reshape(-1))})
        glu = GemvGlu("xq", "wg", "wu", fmt, "o", k, n, m, bg="bg", words=words)
        parts = GemmParts("xq", fmt, k, m, (GemmPart("wg", Dst("qkv", unit=Part(W, 0, n)), n, bias="bg"),
                                            GemmPart("wu", Dst("qkv", unit=Part(W, n + 3, n)), n)), words=words)
        for launch in (glu, parts):
            assert launch.check() is None and launch.tune({}).per_warp == 1
            launch.numpy(env) if exact else launch.fast(env)
        tol = 1e-6 if exact else 1e-5
        for got, want in ((env.array("o").reshape(m, n), want_glu), (env.array("qkv").reshape(m, W), want_qkv)):
            assert np.abs(got - want).max() <= tol * np.abs(want).max()
    assert "block-quantized rows" in GemvGlu("xq", "wg", "wu", "bf16", "o", k, n, m, words=1).check().reason
    assert glu.bytes() < GemvGlu("x", "wg", "wu", fmt, "o", k, n, m).bytes()


def _quantized_forms(p, w, g):
    """Run plan `p` by its exact twins in its arena, keeping a copy of each quantized form (words, low words, scales)
    right after the launch that writes it (a later array may reuse its bytes)."""
    r = NumpyRunner(p, w)
    env, forms = r.env, {}
    inputs = _chunk_env(g, g.tensors["token"].shape[0], 0)
    for n in (p.io.token, p.io.position):
        env.array(n)[:] = inputs[n].reshape(-1)
    env.tables = {n: inputs[n] for n in p.io.tables}
    env._views.clear()
    for x in p.launches:
        x.launch.numpy(env)
        for name in x.launch.writes():
            b = p.buffers.get(name)
            if b is not None and b.dtype in ("q8", "q8x2"):
                forms[name] = tuple(None if a is None else a.copy() for a in env.quant(name))
    return forms, env.array(p.io.logits).copy()


@pytest.mark.parametrize("numerics", ["q8", "q8x2"])
def test_a_q8_decode_layer_is_the_f32_plans_five_launches(numerics):
    """Under q8 and q8x2 the products keep their fusions (q/k/v in parts with their heads' norm and rotation, the
    output projection and the down projection folded with the next norm, gate/up with their GLU) and every quantize
    rides in its producer's epilogue (embed_norm.quant, gemv_norm_epilogue.quant, attn_output_quant,
    gemv_gate_up_glu.quant): the f32 plan's census exactly, 5 launches a layer. Held `fuse_quant` (the lane's step
    holding every rule that joins a quantize): each quantize a Quant launch again, the same numbers, and every
    quantized form the same integers (words, low words) and scales as the Quant launch writes."""
    cfg, w = q8_model("q8_0")
    # the f32 plan with its layers unchained (the chain rules held): over quantized activations the
    # chained kernels have no body, so the q8 plan keeps the o fold, the GLU and the down fold three launches
    # (kernels/chain.py)
    f32 = plan(build_step(cfg, 1), numerics="f32", held=["qkv_attn_o_glu_down_norm", "attn_o_glu_down_norm",
                                                         "o_glu_down_norm", "glu_down_norm"])
    q8 = plan(build_step(cfg, 1), numerics=numerics)
    assert q8.census == f32.census == {"attention": 2, "fold": 8, "gemv_glu": 2}
    layer0 = [x for x in q8.launches if x.layer == 0]  # (the last layer's takes the final norm's fold too)
    assert len(layer0) == 5 and {x.launch.census for x in layer0} == {"fold", "attention", "gemv_glu"}
    assert {"attn_output_quant", "gemv_gate_up_glu.quant"} <= set(q8.fusions)
    held = plan(build_step(cfg, 1), numerics=numerics, held=("fuse_quant",))
    assert held.census["quant"] == 4 * cfg.layers + 1 and len(held.launches) == len(q8.launches) + 4 * cfg.layers + 1
    assert {"fuse_quant", "norm_quant", "embed_norm.quant", "attn_output_quant", "glu_act_mul_quant",
            "gemv_gate_up_glu.quant"} <= set(held.held)
    g = build_step(cfg, 1)
    (fa, la), (fb, lb) = (_quantized_forms(p, w, g) for p in (q8, held))
    assert fa.keys() == fb.keys() and len(fa) == 4 * cfg.layers + 1
    for name in fa:
        for got, want in zip(fa[name], fb[name]):
            assert (got is None) == (want is None) and (got is None or np.array_equal(got, want)), name
    assert np.array_equal(la, lb)
    a, b = (NumpyRunner(p, w).step(_env(build_step(cfg, 1), cfg)) for p in (q8, held))
    assert np.array_equal(a["logits"], b["logits"]) and np.array_equal(a["next"], b["next"])
    assert all(getattr(x.launch, "fused", True) for x in q8.launches)


QUANT_HOLDS = ("fuse_quant", "norm_quant", "add_norm_quant", "gemv_norm_epilogue.quant", "embed_norm.quant",
               "attn_output_quant", "glu_act_mul_quant", "gemv_gate_up_glu.quant", "gemv_norm_epilogue",
               "embed_norm", "merged_qkv", "gemv_gate_up_glu", "glu_act_mul")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(held=st.sets(st.sampled_from(QUANT_HOLDS)), numerics=st.sampled_from(["f32", "q8", "q8x2"]),
       rows=st.sampled_from([1, 3]), fmt=st.sampled_from(["q4_0", "q8_0"]))
def test_random_held_sets_and_numerics_keep_the_numbers(held, numerics, rows, fmt):
    """Any held set of the quantizing rules and their neighbours (and `fuse_quant`), under f32, q8 or q8x2, a decode
    step or a chunk of 3 rows, on the demo's matrices in q4_0 or q8_0: the plan, run by the exact twins in its arena,
    equals the interpreter of the quantized step graph."""
    cfg, w = _MODELS[fmt]
    g = build_step(cfg, rows)
    p = plan(g, numerics=numerics, held=tuple(sorted(held)))
    gq = with_numerics(g, numerics)
    ref = evaluate(gq, w, _chunk_env(gq, rows, 0))
    out = NumpyRunner(p, w).step(_chunk_env(g, rows, 0))
    assert np.abs(out["logits"] - ref["logits"]).max() <= 1e-6 * np.abs(ref["logits"]).max()
    assert np.array_equal(out["next"], ref["next"])


_MODELS = {f: q8_model(f) for f in ("q4_0", "q8_0")}


def _quant_equals_quantize(env, name, values, words):
    want = quantize(np.asarray(values, np.float32).reshape(1, -1), words)
    w, low, sc = env.quant(name)
    assert np.array_equal(w, want.words.reshape(-1)) and np.array_equal(sc, want.scales.reshape(-1))
    assert (low is None) == (words == 1) and (low is None or np.array_equal(low, want.low.reshape(-1)))


@pytest.mark.parametrize("words", [1, 2])
def test_epilogues_quantize_what_they_store(words):
    """The quantizing epilogues (attn_output_quant's Attention, glu_act_mul_quant's Binary, gemv_gate_up_glu.quant's
    GemvGlu over an f32 and a quantized activation; and norm_quant's Norm), exact and fast twins: the quantized form
    is exactly the Quant launch's of the f32 result they store; writing that form alone (`f32` false: only
    projections read the result) they write the same bytes and leave the f32 result untouched (not among their
    writes, its bytes not counted); a batch launch from its first sequence writes its own rows' blocks only."""
    from lanefuse.kernels import Attention, Binary, GemvGlu, Norm

    rng = np.random.default_rng(11)
    H, G, hd, L = 4, 2, 32, 16
    q = rng.standard_normal(3 * H * hd).astype(np.float32)
    kc, vc = (rng.standard_normal(L * (H // G) * hd).astype(np.float32) for _ in range(2))
    k, n, m = 64, 64, 3
    raw = {w: encode(rng.standard_normal((n, k)).astype(np.float32) / 8, "q8_0") for w in ("wg", "wu")}
    x = rng.standard_normal(m * k).astype(np.float32)
    xq = quantize(x.reshape(m, k), words)
    launches = [Attention("q", "kc", "vc", "pos", "o", H, G, hd, hd, L, 3, 0.2, quant="oq", words=words),
                Attention("q", "kc", "vc", "pos", "o", H, G, hd, hd, L, 3, 0.2, splits=3, per_block=2, quant="oq",
                          words=words),
                Binary("mul", "u", "g", "o", m * n, gate="silu", quant="oq", words=words),
                GemvGlu("x", "wg", "wu", "q8_0", "o", k, n, m, quant="oq", quant_words=words),
                GemvGlu("xq", "wg", "wu", "q8_0", "o", k, n, m, words=words, quant="oq", quant_words=words),
                Norm("x", "nw", "o", m, k, 1e-6, add="u", sum="s", quant="oq", words=words)]
    u, gv = (rng.standard_normal(m * n).astype(np.float32) for _ in range(2))
    for launch in launches:
        assert launch.check() is None and "oq" in launch.writes()
        size = 3 * H * hd if isinstance(launch, Attention) else m * n
        alone = dataclasses.replace(launch, f32=False)
        assert alone.check() is None and "o" not in alone.writes() and "oq" in alone.writes()
        assert alone.bytes() == launch.bytes() - 4 * size
        for twin in ("numpy", "fast"):
            forms = []
            for one in (launch, alone):
                env = HostEnv({"q": q, "kc": kc, "vc": vc, "pos": np.array([5], np.int32),
                               "o": np.zeros(size, np.float32), "u": u, "g": gv, "x": x,
                               "s": np.zeros(m * k, np.float32)},
                              {**{w: (r, "q8_0") for w, r in raw.items()}, "nw": (np.linspace(0.5, 1.5, k), "f32")},
                              {"oq": _empty(size, words),
                               "xq": (xq.words.reshape(-1), None if xq.low is None else xq.low.reshape(-1),
                                      xq.scales.reshape(-1))})
                getattr(one, twin)(env)
                if one is launch:
                    _quant_equals_quantize(env, "oq", env.array("o"), words)
                else:
                    assert not env.array("o").any()
                forms.append(tuple(None if a is None else a.copy() for a in env.quant("oq")))
            for a, b in zip(*forms):
                assert (a is None and b is None) or np.array_equal(a, b), (launch.census, twin)
        assert launch.bytes() == dataclasses.replace(launch, quant=None).bytes() + words * size + 4 * (size // 32)
    batch = Attention("q", "kc", "vc", "pos", "o", H, G, hd, hd, 4, 1, 0.2, slot=4, seq0=2, quant="oq", words=words)
    env = HostEnv({"q": q, "kc": kc, "vc": vc, "pos": np.array([1, 2, 3], np.int32), "o": np.zeros(3 * H * hd,
                   np.float32)}, quantized={"oq": _empty(3 * H * hd, words)})
    batch.numpy(env)
    w, _, sc = env.quant("oq")
    assert not w[: 2 * H * hd].any() and not sc[: 2 * H * hd // 32].any()
    want = quantize(env.array("o")[2 * H * hd:].reshape(1, -1), words)
    assert np.array_equal(w[2 * H * hd:], want.words.reshape(-1)) and np.array_equal(sc[2 * H * hd // 32:],
                                                                                      want.scales.reshape(-1))


def test_epilogue_quant_refusals():
    """What the quantizing epilogues cannot run, in words: a head of a width that is not whole blocks (a block would
    span two heads, which two blocks of the attention write), a result of a length that is not whole blocks."""
    from lanefuse.kernels import Attention, Binary, GemvGlu

    assert "span two heads" in Attention("q", "kc", "vc", "pos", "o", 4, 2, 16, 16, 8, 1, 0.2, quant="oq",
                                         words=1).check().reason
    assert "whole number of blocks" in Binary("mul", "u", "g", "o", 40, quant="oq", words=1).check().reason
    assert "q8 takes one" in Binary("mul", "u", "g", "o", 64, quant="oq", words=4).check().reason
    assert Binary("mul", "u", "g", "o", 256, quant="oq", words=3).check() is None  # the q8k form: a block a block
    assert "whole number of blocks" in GemvGlu("x", "wg", "wu", "q8_0", "o", 64, 40, 1, quant="oq",
                                               quant_words=1).check().reason


def _quantizing(p):
    """(launch kind, quantized form, f32 stored) of every launch (a fold's parts apart) that writes a quantized form in
    its epilogue."""
    out = []
    for x in p.launches:
        for part in (x.launch, getattr(x.launch, "first", None), getattr(x.launch, "then", None)):
            if part is not None and getattr(part, "quant", None) is not None and hasattr(part, "f32"):
                out.append((part.census, part.quant, part.f32))
    return out


@pytest.mark.parametrize("numerics", ["q8", "q8x2"])
def test_only_projections_read_it_so_the_producer_writes_the_quantized_form_alone(numerics):
    """Where only projections read a result (the normed rows, the attention's output, the GLU), its producer writes
    the quantized form alone (`stored(y, q)` false): the f32 array has no place in the arena, which falls (the demo's
    q8_0 decode step from 5,376 to 4,352 B under q8) and stays at its lower bound (the placement's largest-ending-latest
    order: largest-first left q8x2 15% over it). Held `fuse_quant`, nothing is quantized in an epilogue and the f32
    results are stored again."""
    cfg, w = q8_model("q8_0")
    want = {"q8": {1: 4352, 3: 12032}, "q8x2": {1: 5120, 3: 14336}}[numerics]
    for rows in (1, 3):
        p = plan(build_step(cfg, rows), numerics=numerics)
        q = _quantizing(p)
        assert len(q) == 4 * cfg.layers + 1 and not any(f32 for _, _, f32 in q), q
        assert {k for k, _, _ in q} == {"norm", "attention", "gemv_glu"}
        placed = {a.name for a in p.arena.arrays}
        assert not {"L0.attn", "L0.glu", "L1.attn_norm"} & placed and {"L0.attn." + numerics} <= placed
        assert p.arena.bytes == p.arena.lower_bound == want[rows], (rows, p.arena.bytes, p.arena.lower_bound)
    held = plan(build_step(cfg, 1), numerics=numerics, held=("fuse_quant",))
    assert _quantizing(held) == [] and held.arena.bytes > want[1]


def test_a_result_read_f32_as_well_is_stored_beside_its_quantized_form():
    """A normed row that a product over block-quantized rows reads quantized and one over f32 rows reads f32 (the k
    projection's rows kept f32): its norm stores both forms (`stored(y, q)` true), the attention's output and the GLU
    the quantized form alone; the plan equals the interpreter."""
    cfg, w = q8_model("q8_0")
    cfg = dataclasses.replace(cfg, formats=tuple((n, f) for n, f in cfg.formats if "k_proj" not in n))
    g = build_step(cfg, 1)
    p = plan(g, numerics="q8")
    q = {name: f32 for _, name, f32 in _quantizing(p)}
    assert q["L0.attn_norm.q8"] and q["L1.attn_norm.q8"] and not q["L0.attn.q8"] and not q["L0.glu.q8"], q
    gq = with_numerics(g, "q8")
    ref = evaluate(gq, w, _chunk_env(gq, 1, 0))
    out = NumpyRunner(p, w, check=True).step(_chunk_env(g, 1, 0), lifted=g)
    assert np.abs(out["logits"] - ref["logits"]).max() <= 1e-6 * np.abs(ref["logits"]).max()


@pytest.mark.parametrize("numerics", ["q8", "q8x2"])
def test_a_latent_attention_quantizes_its_expansion_for_the_o_projection(numerics):
    """DeepSeek-V3's latent attention under q8 / q8x2, its `mla` fold held: each head's expanding product
    (head_matmul) quantizes its output in its last blocks (gemv_quant.heads) for the o projection, so the plan has no
    Quant launch; run by the exact twins in its arena (launch by launch against the interpreter) it equals the
    interpreter of the quantized step graph; held `fuse_quant` too, the same numbers from Quant launches. With the
    `mla` fold (its absorbed form, the query absorbed in q_b's product) the expansion inside it quantizes the same way
    (mla.absorbed.quant). The q_a norm runs in the first product's epilogue, which quantizes its row for q_b's
    products as it stores it (merged_qkv.rotated_normed_quant): no Quant launch either way; with fuse_quant held, the
    q_a norm's and the expansion's quantizes are Quant launches, the same numbers."""
    from lanefuse.engine.front.stepweights import random_weights
    from test_engine import deepseek, in_blocks

    cfg = in_blocks(deepseek(intermediate_size=64, moe_intermediate_size=32, q_lora_rank=64))
    g = build_step(cfg, 1)
    w = random_weights(g, 3)
    mla = ("mla", "mla.absorbed", "mla.quant", "mla.absorbed.quant")
    p = plan(g, numerics=numerics, held=mla)
    assert "quant" not in p.census and p.fusions.get("gemv_quant.heads") == cfg.layers, p.census
    assert p.fusions.get("merged_qkv.rotated_normed_quant") == cfg.layers, p.fusions
    # the mla fold's expansion quantizes in its last blocks too (mla.absorbed.quant: the query absorbed in q_b's
    # product epilogue)
    f = plan(g, numerics=numerics)
    assert "quant" not in f.census and f.fusions.get("mla.absorbed.quant") == cfg.layers, f.fusions
    assert f.fusions.get("merged_pair.rotated_absorbed") == cfg.layers, f.fusions
    gq = with_numerics(g, numerics)
    ref = evaluate(gq, w, _chunk_env(gq, 1, 0))
    held = plan(g, numerics=numerics, held=("fuse_quant", *mla))
    assert held.census["quant"] >= 2 * cfg.layers, held.census
    outs = [NumpyRunner(q, w, check=True).step(_chunk_env(g, 1, 0), lifted=g) for q in (p, f, held)]
    for out in outs:
        assert np.abs(out["logits"] - ref["logits"]).max() <= 1e-6 * np.abs(ref["logits"]).max()
    assert np.array_equal(outs[0]["logits"], outs[2]["logits"])


@pytest.mark.parametrize("words", [1, 2])
def test_head_gemv_quantizes_what_it_stores(words):
    """gemv_quant.heads' HeadGemv, exact and fast twins: the quantized form is exactly the Quant launch's of the f32
    output it stores; an output into a table's rows, or rows that are not whole blocks, refused in words."""
    from lanefuse.kernels import HeadGemv

    rng = np.random.default_rng(13)
    m, heads, a, b = 3, 4, 32, 16
    raw = encode(rng.standard_normal((heads * b, a)).astype(np.float32) / 8, "q8_0")
    h = HeadGemv("x", "wh", "q8_0", Dst("o"), m, heads, a, b, quant="oq", words=words)
    assert h.check() is None and "oq" in h.writes() and h.scratch()[0].counter
    for twin in ("numpy", "fast"):
        env = HostEnv({"x": rng.standard_normal(m * heads * a).astype(np.float32),
                       "o": np.zeros(m * heads * b, np.float32)}, {"wh": (raw, "q8_0")},
                      {"oq": _empty(m * heads * b, words)})
        getattr(h, twin)(env)
        _quant_equals_quantize(env, "oq", env.array("o"), words)
    assert "table's rows" in dataclasses.replace(h, y=Dst("kc", row="pos", pitch=64)).check().reason
    assert "whole number of blocks" in dataclasses.replace(h, b=12).check().reason  # rows of 48


def rows_read_graph(fmt: str = "q8_0", d: int = 64):
    """A 3-row chunk (as a user's step YAML may write it) whose residual sum is read by two products a row each
    (views of rows 2 and 1), over `fmt` rows."""
    from lanefuse.engine.ir import Constant, Graph, StepIO

    g = Graph(io=StepIO())
    g.tensor("token", (3,), "i32")
    g.tensor("pos", (1,), "i32")
    g.constant(Constant("emb", (50, d), "rows"))
    for n in ("w1", "w3", "w4"):
        g.constant(Constant(n, (d, d), "rows", format=fmt, transposed=True))
    g.constant(Constant("head", (50, d), "rows", format=fmt, transposed=True))
    g.add("gather", ["emb", "token"], "x")
    g.add("matmul", ["x", "w1"], "a")
    g.add("add", ["a", "x"], "s")
    g.add("view", ["s"], "last", row=2)
    g.add("view", ["s"], "mid", row=1)
    g.add("matmul", ["last", "w3"], "p")
    g.add("matmul", ["mid", "w4"], "r")
    g.add("add", ["p", "r"], "o")
    g.add("matmul", ["o", "head"], "logits")
    g.add("argmax", ["logits"], "next")
    g.validate()
    return g


@pytest.mark.parametrize("numerics,fmt,d", [("q8", "q8_0", 64), ("q8x2", "q8_0", 64), ("q8", "q4_k", 256)])
def test_rows_read_quantized_are_views_into_the_quantized_form(numerics, fmt, d):
    """Products reading rows of a computed tensor quantized read views into the tensor's quantized form (seed 000):
    the tensor is quantized once, by its producer (the add's epilogue: elementwise_quant), for both rows; the views
    are no launch and live in the form's bytes (words, low words or sums, scales each at the row's first block); the
    exact and fast twins in the plan's arena equal the interpreter of the quantized graph, and holding fuse_quant the
    same numbers."""
    from lanefuse.engine.front.stepweights import random_weights

    g = rows_read_graph(fmt, d)
    gq = with_numerics(g, numerics)
    form = {"q8": "q8", "q8x2": "q8x2"}[numerics] if fmt == "q8_0" else "q8k"
    quants = [op for op in gq.ops if op.kind == "quantize"]
    assert [op.ins[0] for op in quants].count("s") == 1 and not any(op.ins[0] in ("last", "mid") for op in quants)
    views = {op.out: op for op in gq.ops if op.kind == "view" and gq.dtype(op.out) == form}
    assert set(views) == {f"last.{form}", f"mid.{form}"} and {v.ins[0] for v in views.values()} == {f"s.{form}"}
    p = plan(g, numerics=numerics)
    assert p.fusions.get("elementwise_quant") == 2, p.fusions  # s's form and o's
    b = p.buffers[f"last.{form}"]
    assert b.home == f"s.{form}" and b.offset == 2 * d and b.size == d
    w = random_weights(gq, 5)
    env = {"token": np.array([3, 17, 41], np.int32), "pos": np.array([0], np.int32)}
    want = evaluate(gq, w, dict(env))
    held = plan(g, numerics=numerics, held=("fuse_quant",))
    assert held.census["quant"] >= 3 and "elementwise_quant" not in held.fusions
    for q, exact in ((p, True), (p, False), (held, True)):
        out = NumpyRunner(q, w, exact=exact, check=exact).step(dict(env), lifted=g)
        assert np.abs(out["logits"] - want["logits"]).max() <= (1e-6 if exact else 1e-4) * np.abs(want["logits"]).max()
        assert np.array_equal(out["next"], want["next"])


def test_a_quantized_row_inside_a_block_is_refused_in_words():
    """A view of a row of a quantized activation that starts inside a block is refused where the graph is checked."""
    from lanefuse.engine.errors import UserError
    from lanefuse.engine.ir import Constant, Graph, StepIO

    g = Graph(io=StepIO())
    g.tensor("xq", (3, 48), "q8")
    with pytest.raises(UserError, match="starts inside a block of 32"):
        g.add("view", ["xq"], "v", row=1)
    g.constant(Constant("w", (8, 48), "rows"))
    g.tensor("x", (3, 48))
    with pytest.raises(UserError, match="only a product's activation"):
        g.add("add", ["xq", "x"], "y")


@pytest.mark.parametrize("numerics,rows", [("q8", 1), ("q8x2", 1), ("q8", 3)])
def test_products_quantize_what_the_next_product_reads(numerics, rows):
    """Products whose results products over q8_0 rows read quantized (gemv_quant): the GEMV quantizes its output in
    its last blocks, over a quantized activation (the low-rank pair's first) and over f32 rows (whose result an add
    reads f32 too: stored beside its form), so no Quant launch is left but the gathered row's; the exact twins in the
    plan's arena equal the interpreter of the quantized graph bit for bit, the fast twins within f32 noise, and held
    `fuse_quant` (Quant launches) the same numbers."""
    from lanefuse.engine.front.stepweights import random_weights
    from test_engine import product_chain_graph

    g = product_chain_graph(rows=rows)
    gq = with_numerics(g, numerics)
    w = random_weights(gq, 7)
    p, held = plan(g, numerics=numerics), plan(g, numerics=numerics, held=("fuse_quant",))
    assert p.fusions.get("gemv_quant") == 2 and p.census.get("quant") == 1, (p.census, p.fusions)
    quantizing = {x.launch.y.buf: x.launch for x in p.launches if x.launch.census == "gemv" and x.launch.quant}
    assert set(quantizing) == {"a", "f"}, quantizing
    assert quantizing["a"].words == quantizing["a"].quant_words == {"q8": 1, "q8x2": 2}[numerics]
    assert quantizing["f"].words == 0 and quantizing["f"].split == 1
    assert held.census["quant"] == 4 and "gemv_quant" not in held.fusions
    env = {"token": np.arange(5, 5 + rows, dtype=np.int32), "pos": np.array([0], np.int32)}
    want = evaluate(gq, w, dict(env))
    for q, exact in ((p, True), (held, True), (p, False)):
        out = NumpyRunner(q, w, exact=exact, check=exact).step(dict(env), lifted=g)
        if exact:
            assert np.array_equal(out["logits"], want["logits"])
        else:
            assert np.abs(out["logits"] - want["logits"]).max() <= 1e-4 * np.abs(want["logits"]).max()
        assert np.array_equal(out["next"], want["next"])


@pytest.mark.parametrize("words,qwords", [(0, 1), (0, 2), (1, 1), (2, 2), (0, 3)])
def test_gemv_quantizes_what_it_stores(words, qwords):
    """gemv_quant's Gemv, exact and fast twins, over an f32 and a quantized activation: the quantized form is exactly
    the Quant launch's of the f32 output it stores (the q8k form over 256 outputs too); an output into a table's rows,
    a split of k or rows that are not whole blocks refused in words; the split is tuned away."""
    from lanefuse.lane.lower.knobs import Knobs

    rng = np.random.default_rng(17)
    m, k = 3, 64
    n = 256 if qwords == 3 else 64
    raw = encode(rng.standard_normal((n, k)).astype(np.float32) / 8, "q8_0")
    x = rng.standard_normal(m * k).astype(np.float32)
    xq = quantize(x.reshape(m, k), words or 1)
    gv = Gemv("xq" if words else "x", "w", "q8_0", Dst("o"), k, n, m, words=words, quant="oq", quant_words=qwords)
    assert gv.check() is None and "oq" in gv.writes() and gv.scratch()[0].counter
    assert gv.bytes() == dataclasses.replace(gv, quant=None).bytes() + (
        n * m + 2 * (n * m // 16) + 4 * (n * m // 256) if qwords == 3 else qwords * n * m + 4 * (n * m // 32))
    for twin in ("numpy", "fast"):
        env = HostEnv({"x": x, "o": np.zeros(m * n, np.float32)}, {"w": (raw, "q8_0")},
                      {"oq": (np.zeros(m * n, np.int8),
                              np.zeros(m * n // 16 if qwords == 3 else m * n, np.int16 if qwords == 3 else np.int8)
                              if qwords >= 2 else None, np.zeros(m * n // (256 if qwords == 3 else 32), np.float32)),
                       "xq": (xq.words.reshape(-1), None if xq.low is None else xq.low.reshape(-1),
                              xq.scales.reshape(-1))})
        getattr(gv, twin)(env)
        want = quantize(env.array("o").reshape(1, -1), qwords)
        got = env.quant("oq")
        assert np.array_equal(got[0], want.words.reshape(-1)) and np.array_equal(got[2], want.scales.reshape(-1))
        if qwords == 2:
            assert np.array_equal(got[1], want.low.reshape(-1))
        if qwords == 3:
            assert np.array_equal(got[1], want.sums.reshape(-1))
    assert "table's rows" in dataclasses.replace(gv, y=Dst("kc", row="pos", pitch=n)).check().reason
    assert "whole number of blocks" in dataclasses.replace(gv, n=48).check().reason
    if not words:
        assert "split 2 ways" in dataclasses.replace(gv, split=2).check().reason
        assert dataclasses.replace(gv, k=2048).tune(Knobs()).split == 1
        assert dataclasses.replace(gv, k=2048, quant=None).tune(Knobs()).split > 1


@pytest.mark.parametrize("numerics,rows,producer", [("q8", 1, "add"), ("q8x2", 3, "add"), ("q8", 3, "matmul")])
def test_a_row_write_quantizes_the_table_a_product_reads(numerics, rows, producer):
    """A step that writes its rows into a carried table and reads every row of it by a product over q8_0 rows: the
    row write quantizes the table as it writes it (row_write_quant: the SetRow with `quant`), so the only Quant launch
    left is the gathered row's; where a product computes the rows, the placement writing them straight into the table
    (`place.value_row`) competes, and held it is row_write_quant again. Every plan, and held `fuse_quant`, run by the
    exact twins in its arena equals the interpreter of the quantized graph bit for bit, the table after the step too."""
    from lanefuse.engine.front.stepweights import random_weights
    from test_engine import row_write_graph

    g = row_write_graph(rows, producer)
    gq = with_numerics(g, numerics)
    w = random_weights(gq, 3)
    plans = {held: plan(g, numerics=numerics, held=held) for held in ((), ("fuse_quant",), ("place.value_row",))}
    chosen = plans[("place.value_row",)]
    assert chosen.fusions.get("row_write_quant") == 1 and chosen.census["quant"] == 1, chosen.fusions
    sets = [x.launch for x in chosen.launches if x.launch.census == "set_row"]
    assert len(sets) == 1 and sets[0].quant == f"c.{numerics}" and sets[0].words == {"q8": 1, "q8x2": 2}[numerics]
    assert plans[("fuse_quant",)].census["quant"] == 2 and "row_write_quant" not in plans[("fuse_quant",)].fusions
    if producer == "add":
        assert plans[()].fusions.get("row_write_quant") == 1
    rng = np.random.default_rng(1)
    env = {"token": np.arange(3, 3 + rows, dtype=np.int32), "pos": np.array([2], np.int32),
           "mem": rng.standard_normal((8, 64)).astype(np.float32)}
    want = evaluate(gq, w, {k: v.copy() for k, v in env.items()})
    for p in plans.values():
        mine = {k: v.copy() for k, v in env.items()}
        out = NumpyRunner(p, w, exact=True, check=True).step(mine, lifted=g)
        assert np.array_equal(out["logits"], want["logits"]) and np.array_equal(mine["mem"], want["c"])


@pytest.mark.parametrize("words", [1, 2])
def test_set_row_quantizes_its_table(words):
    """row_write_quant's SetRow, one sequence and a batch's slots: the rows land where SetRow puts them and the
    table's quantized form is exactly the Quant launch's of the whole table after the write; rows that are not whole
    blocks and the q8k form refused in words."""
    from lanefuse.kernels import SetRow

    rng = np.random.default_rng(19)
    cols, length = 64, 12
    cases = [(SetRow("T", "src", "pos", cols, 2, length, quant="tq", words=words), np.array([5], np.int32)),
             (SetRow("T", "src", "pos", cols, 2, length, slot=6, seq0=0, quant="tq", words=words),
              np.array([1, 4], np.int32))]
    for s, pos in cases:
        table = rng.standard_normal(length * cols).astype(np.float32)
        src = rng.standard_normal(2 * cols).astype(np.float32)
        plain = HostEnv({"T": table.copy(), "src": src, "pos": pos})
        dataclasses.replace(s, quant=None, words=0).numpy(plain)
        env = HostEnv({"T": table.copy(), "src": src, "pos": pos}, quantized={"tq": _empty(length * cols, words)})
        s.numpy(env)
        assert np.array_equal(env.array("T"), plain.array("T")) and not np.array_equal(env.array("T"), table)
        _quant_equals_quantize(env, "tq", env.array("T"), words)
        assert s.check() is None and s.writes() == ("T", "tq")
        assert s.bytes() == 4 * (length + 2) * cols + words * length * cols + 4 * (length * cols // 32)
    assert "span a row written" in dataclasses.replace(cases[0][0], cols=48, len=16).check().reason
    assert "only the Quant launch" in dataclasses.replace(cases[0][0], cols=256, words=3).check().reason
