"""The q8k form, llama.cpp's q8_K (what a product over q4_k / q6_k rows reads under --numerics q8): the interpreter's
quantize against a value-by-value reading of ggml's quantize_row_q8_K_ref, the Quant launch's twin, the products'
exact twins (integer super-block sums) against the interpreter's, refusals in words, bytes, and which quantize a
q8 step graph gets for each product."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lanefuse.engine.interp import evaluate
from lanefuse.engine.front.model import build_step
from lanefuse.engine.formats.quantize import product, quantize, with_numerics
from lanefuse.kernels import Binary, Dst, GemmPart, GemmParts, Gemv, GemvGlu, HeadGemv, Norm, Part
from lanefuse.engine.formats.blocks import decode_rows, encode
from lanefuse.kernels.common import act
from lanefuse.kernels.env import HostEnv
from lanefuse.kernels.quant import Quant, quant_bytes, quant_layout
from lanefuse.lane.lower.plan import plan
from lanefuse.lane.run.numpy_runner import NumpyRunner
from test_quant import q8_model
from test_quant_lane import _chunk_env

F32 = np.float32


def _q8k_by_value(x: np.ndarray):
    """ggml's q8_K of one row, a block and a value at a time (Python scalars rounded to f32 at each step)."""
    words, sums, scales = [], [], []
    for b in range(0, x.size, 256):
        blk = x[b:b + 256]
        amax, mx = F32(0), F32(0)
        for v in blk:
            if abs(v) > amax:
                amax, mx = abs(v), v
        if amax == 0:
            words += [0] * 256
            sums += [0] * 16
            scales.append(F32(0))
            continue
        iscale = F32(F32(-127) / mx)
        q = []
        for v in blk:
            t = F32(iscale * v)
            r = int(np.floor(t))
            frac = float(t) - r
            r = r + 1 if frac > 0.5 or (frac == 0.5 and r % 2) else r  # nearest, halves to even
            q.append(min(127, r))
        words += q
        sums += [sum(q[16 * j:16 * j + 16]) for j in range(16)]
        scales.append(F32(F32(1) / iscale))
    return np.array(words, np.int8), np.array(sums, np.int16), np.array(scales, F32)


def _awkward(rng, n=1024):
    x = (rng.standard_normal(n) * 2).astype(F32)
    x[256:512] = 0  # an all-zero block
    x[512:768:37] = F32(-3.5)  # the largest |x| negative, several times: the first one is max
    x[768:1024] = ((np.arange(256) % 9) - 4).astype(F32) * F32(0.5)
    x[770] = F32(-127)  # iscale 1: the halves of the block round to even
    return x


def test_quantize_is_ggmls_q8_K_value_by_value():
    x = _awkward(np.random.default_rng(20))
    q = quantize(x.reshape(1, -1), 3)
    w, s, d = _q8k_by_value(x)
    assert q.block == 256 and np.array_equal(q.words.reshape(-1), w) and np.array_equal(q.sums.reshape(-1), s)
    assert np.array_equal(q.scales.reshape(-1), d) and q.scales.dtype == F32
    # iscale 1 there: -1.5 -> -2, -0.5 -> 0, 0.5 -> 0, 1.5 -> 2 (halves to even; C's roundf would give -1 and 1)
    assert q.words[0, 770] == -127 and list(q.words[0, [769, 771, 773, 775]]) == [-2, 0, 0, 2]
    assert np.abs(q.values().reshape(-1) - x).max() <= np.abs(x).max() / 254 * 1.0001


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1.0, 1e-3, 1e4]))
def test_quantize_k_matches_the_value_by_value_reading(seed, scale):
    x = (np.random.default_rng(seed).standard_normal(512) * scale).astype(F32)
    w, s, d = _q8k_by_value(x)
    q = quantize(x.reshape(1, -1), 3)
    assert np.array_equal(q.words.reshape(-1), w) and np.array_equal(q.sums.reshape(-1), s)
    assert np.array_equal(q.scales.reshape(-1), d)


def test_quant_launch_writes_the_q8k_form_and_refusals():
    x = _awkward(np.random.default_rng(21))
    n = x.size
    env = HostEnv({"x": x}, quantized={"xq": (np.zeros(n, np.int8), np.zeros(n // 16, np.int16),
                                              np.zeros(n // 256, F32))})
    launch = Quant("x", "xq", n, 3)
    assert launch.check() is None and launch.grid_block()[0] == (1, 1, 1)
    launch.numpy(env)
    want = quantize(x.reshape(1, -1), 3).parts()
    assert all(np.array_equal(a, b) for a, b in zip(env.quant("xq"), want))
    assert "blocks of 256" in Quant("x", "xq", 288, 3).check().reason
    # bytes: words, sums of 16 (int16), a scale a block of 256 (f32), each part aligned
    assert launch.bytes() == 4 * n + n + 2 * (n // 16) + 4 * (n // 256) and quant_bytes(n, 3) == n + 128 + 16
    assert quant_layout(n, 3) == (1024, 1024 + 256, 1024 + 256 + 256)
    # a norm's epilogue writes the q8k form from the row it stored (a warp a block of 256); not stored, or stored
    # into a table's rows, refused in words; an elementwise op's epilogue writes it a block of 256 threads a block, its
    # values whole blocks
    assert Norm("x", "w", "y", 1, 256, 1e-6, quant="yq", words=3).check() is None
    for bad in (dict(f32=False), dict(into=Dst("T", row="pos", pitch=256))):
        why = Norm("x", "w", "y", 1, 256, 1e-6, quant="yq", words=3, **bad).check()
        assert why is not None and "not stored whole in its own buffer" in why.reason, bad
    assert Binary("add", "a", "b", "y", 512, quant="yq", words=3).check() is None
    assert Binary("add", "a", "b", "y", 512, quant="yq", words=3).grid_block() == ((2, 1, 1), (256, 1, 1))
    why = Binary("add", "a", "b", "y", 480, quant="yq", words=3).check()
    assert why is not None and "blocks of 256" in why.reason


def test_per_head_product_writes_the_q8k_form():
    """A per-head product (a latent attention's expansion, gemv_quant.heads / mla.quant) over K-quant o rows writes
    its output's q8k form: the last of a 256-value block's blocks to arrive quantizes it (an arrival counter a block of
    256); its twin's form is the interpreter's quantize of the output it stored; rows not whole blocks refused."""
    rng = np.random.default_rng(4)
    m, heads, a, b = 2, 8, 16, 32
    h = HeadGemv("x", "w", "f32", Dst("y"), m, heads, a, b, quant="yq", words=3)
    assert h.check() is None and h.scratch()[0].nbytes == 4 * (m * heads * b // 256)
    n = m * heads * b
    env = HostEnv({"x": rng.standard_normal(m * heads * a).astype(F32), "y": np.zeros(n, F32)},
                  {"w": (rng.standard_normal(heads * a * b).astype(F32), "f32")},
                  {"yq": (np.zeros(n, np.int8), np.zeros(n // 16, np.int16), np.zeros(n // 256, F32))})
    h.numpy(env)
    want = quantize(env.array("y").reshape(m, heads * b), 3).parts()
    assert all(np.array_equal(g, w) for g, w in zip(env.quant("yq"), want))
    why = HeadGemv("x", "w", "f32", Dst("y"), m, 4, a, b, quant="yq", words=3).check()
    assert why is not None and "blocks of 256" in why.reason


def test_attention_writes_the_q8k_form_by_whole_blocks_of_heads():
    """An attention quantizing its output as q8k takes the heads of one 256-value block a kernel block at least (its
    merge as many): heads of 128 two, of 64 four, of 32 eight (the narrow kernel), of 256 one, of 512 one
    (two blocks a head); tuned, its heads a block stay a multiple of that; refused in words: the form alone, heads of
    16, of 96, a row of no whole number of blocks. Its numpy twin's form is the interpreter's quantize of the output
    it stored, decode and a chunk."""
    from lanefuse.kernels import Attention
    from lanefuse.lane.lower.knobs import Knobs

    def att(heads, group, d, **kw):
        return Attention("q", "kc", "vc", "pos", "o", heads, group, d, d, 64, kw.pop("rows", 1), 0.2, quant="oq",
                         words=3, **kw)

    for heads, group, d, kh in ((8, 1, 128, 2), (8, 2, 64, 4), (16, 4, 32, 8), (4, 1, 256, 1), (2, 1, 512, 1)):
        a = att(heads, group, d)
        assert a.check() is None and a.kheads == kh and a.heads_a_block == kh, (heads, d)
        for held in (frozenset(), frozenset({"attn_splits"})):
            t = a.tune(Knobs(), held)
            assert t.check() is None and t.heads_a_block % kh == 0 and heads % t.heads_a_block == 0, (d, held)
            assert t.grid_block()[0][0] * t.heads_a_block == heads
    assert att(12, 3, 128).tune(Knobs()).heads_a_block == 2  # three heads of a group: one a block, two for the form
    for a, words in ((att(8, 1, 128, f32=False), "stored too"), (att(32, 1, 16), "at most 4 heads a block"),
                     (att(8, 1, 96), "whole blocks"), (att(3, 1, 128), "quantized in blocks of 256")):
        why = a.check()
        assert why is not None and words in why.reason, (a.heads, a.vd, why)
    rng = np.random.default_rng(5)
    for rows, splits in ((1, 1), (1, 3), (3, 2)):
        a = att(8, 2, 64, rows=rows, splits=splits)
        n = rows * 8 * 64
        env = HostEnv({"q": rng.standard_normal(n).astype(F32), "kc": rng.standard_normal(64 * 4 * 64).astype(F32),
                       "vc": rng.standard_normal(64 * 4 * 64).astype(F32), "pos": np.array([9], np.int32),
                       "o": np.zeros(n, F32)},
                      quantized={"oq": (np.zeros(n, np.int8), np.zeros(n // 16, np.int16), np.zeros(n // 256, F32))})
        a.numpy(env)
        want = quantize(env.array("o").reshape(1, -1), 3).parts()
        assert all(np.array_equal(g, w) for g, w in zip(env.quant("oq"), want)), (rows, splits)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_products_of_a_q8k_activation(fmt):
    """Gemv, GemmParts and GemvGlu over a q8k activation: the exact twins (int32 super-block sums, the scales in
    f32 as gemv_q8.cu's q8k_tile rounds them) within f32 rounding of the interpreter's product; the fast twins (f32
    BLAS of the activation's values) too."""
    rng = np.random.default_rng(22)
    m, k, n = 3, 512, 37
    raws = {w: encode(rng.standard_normal((n, k)).astype(F32) / 16, fmt) for w in ("w", "wu")}
    xq = quantize(rng.standard_normal((m, k)).astype(F32), 3)
    b = rng.standard_normal(n).astype(F32)
    y, u = (product(xq, decode_rows(raws[w], fmt, k)) for w in ("w", "wu"))
    W = 2 * n + 3
    want = {"y": y + b, "o": act("silu", (y + b).astype(F32)) * u,
            "qkv": np.concatenate([y + b, np.zeros((m, 3), F32), u], axis=1)}
    for exact in (True, False):
        env = HostEnv({"y": np.zeros(m * n, F32), "o": np.zeros(m * n, F32), "qkv": np.zeros(m * W, F32), "b": b},
                      {w: (r, fmt) for w, r in raws.items()}, {"xq": xq.parts()})
        launches = (Gemv("xq", "w", fmt, Dst("y"), k, n, m, bias="b", words=3),
                    GemvGlu("xq", "w", "wu", fmt, "o", k, n, m, bg="b", words=3),
                    GemmParts("xq", fmt, k, m, (GemmPart("w", Dst("qkv", unit=Part(W, 0, n)), n, bias="b"),
                                                GemmPart("wu", Dst("qkv", unit=Part(W, n + 3, n)), n)), words=3))
        for launch in launches:
            assert launch.check() is None, launch.check()
            launch.numpy(env) if exact else launch.fast(env)
        for name, v in want.items():
            got = env.array(name).reshape(v.shape)
            assert np.abs(got - v).max() <= (1e-6 if exact else 1e-5) * np.abs(v).max(), (name, exact)
    g = launches[0]
    assert g.bytes() == Gemv("xq", "w", fmt, Dst("y"), k, n, m, bias="b").bytes() - 4 * m * k + quant_bytes(m * k, 3)
    for other in ("q8_0", "q4_0"):
        why = Gemv("xq", "w", other, Dst("y"), k, n, m, words=3).check()
        assert why is not None and "q4_k, q6_k rows only" in why.reason


def test_q8_gives_k_quant_products_the_q8k_form():
    """Under q8 the products over q4_k rows read a q8k quantize, those over q8_0 rows a q8 one: an activation both
    read is quantized both ways; under q8x2 every product reads the 32-value two-word form."""
    cfg, w = q8_model("q4_k")
    fmts = tuple((n, "q8_0" if "down_proj" in n or "q_proj" in n else f) for n, f in cfg.formats)
    g = build_step(dataclasses.replace(cfg, formats=fmts), 1)
    gq = with_numerics(g, "q8")
    for op in gq.ops:
        if op.kind == "matmul" and op.ins[0] in gq.tensors and gq.dtype(op.ins[0]) != "f32":
            fmt = gq.constants[op.ins[1]].format
            assert gq.dtype(op.ins[0]) == ("q8k" if fmt in ("q4_k", "q6_k") else "q8"), (op.out, fmt)
    forms = {op.ins[0]: [] for op in gq.ops if op.kind == "quantize"}
    for op in gq.ops:
        if op.kind == "quantize":
            forms[op.ins[0]].append(op.a["words"])
    assert any(sorted(v) == [1, 3] for v in forms.values())  # the attention's normed input: q by q8, k/v by q8k
    gq.validate()
    g2 = with_numerics(g, "q8x2")
    assert {g2.dtype(o.ins[0]) for o in g2.ops if o.kind == "matmul"} <= {"q8x2", "f32"}


def test_q8_plan_of_k_quant_rows_equals_the_interpreter():
    """A q6_k decode step under q8, run by the exact twins in the plan's arena (launch by launch checked), equals the
    interpreter of the quantized graph; a norm's q8k quantize runs in its epilogue (from the row it stores), the
    GLU's in the gate/up GEMV's (gemv_glu_q8k_quant: a block's 256 outputs in shared memory), the attention's output's
    in the attention's (a block the heads of whole 256-value blocks): no Quant launch, decode and a 3-row chunk."""
    cfg, w = q8_model("q6_k")
    for rows in (1, 3):
        g = build_step(cfg, rows)
        p = plan(g, numerics="q8")
        gq = with_numerics(g, "q8")
        attended = {op.out for op in gq.ops if op.kind == "attention"}
        normed = {op.out for op in gq.ops if op.kind == "rmsnorm"}
        by_norm = [op for op in gq.ops if op.kind == "quantize" and op.ins[0] in normed]
        by_attention = [op for op in gq.ops if op.kind == "quantize" and op.ins[0] in attended]
        assert by_norm and all(op.a["words"] == 3 for op in by_norm)
        assert by_attention and all(op.a["words"] == 3 for op in by_attention)
        assert p.census.get("quant", 0) == 0 and p.fusions.get("attn_output_quant") == len(by_attention), p.census
        assert sum(v for k, v in p.fusions.items() if k.startswith(("add_norm_quant", "norm_quant",
                                                                    "gemv_norm_epilogue", "embed_norm"))) == \
            len(by_norm), p.fusions
        glus = [x.launch for x in p.launches if x.launch.census == "gemv_glu"]
        assert glus and all(x.quant is not None and x.quant_words == 3 for x in glus), glus
        atts = [x.launch for x in p.launches if x.launch.census == "attention"]
        assert atts and all(a.words == 3 and a.f32 and a.heads_a_block * a.vd % 256 == 0 for a in atts), atts
        ref = evaluate(gq, w, _chunk_env(gq, rows, 0))
        out = NumpyRunner(p, w, exact=True, check=True).step(_chunk_env(g, rows, 0), lifted=g)
        assert np.abs(out["logits"] - ref["logits"]).max() <= 1e-6 * np.abs(ref["logits"]).max(), rows
        assert np.array_equal(out["next"], ref["next"])


def test_plan_says_which_activations_are_q8K(capsys):
    from lanefuse.lane.cli.main import main

    assert main(["plan", "--numerics", "q8", "--weights-format", "q4_k"]) == 0
    out = capsys.readouterr().out
    assert "quantized as llama.cpp's q8_K (blocks of 256): " in out and "0 by a Quant launch" in out
    assert main(["plan", "--numerics", "q8", "--weights-format", "q8_0"]) == 0
    assert "q8_K" not in capsys.readouterr().out


@pytest.mark.parametrize("numerics", ["q8", "q8x2"])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_quantized_arena_stays_at_its_lower_bound(fmt, numerics):
    """Arena bytes over their lower bound under q8 and q8x2 (goal <= 1.02), decode and a 3-row chunk; a gate/up GEMV
    over a quantized activation that quantizes its GLU has no scratch (gemv_glu_q8_quant holds a block's 32 outputs
    in shared memory), so with `fuse_quant` the decode step's arena is no larger than with it held (but on K-quant
    rows under q8, whose norms quantize from the row they store)."""
    cfg, _ = q8_model(fmt)
    for rows in (1, 3):
        p = plan(build_step(cfg, rows), numerics=numerics)
        assert p.arena.bytes <= 1.02 * p.arena.lower_bound, (rows, p.arena.bytes, p.arena.lower_bound)
        glus = [x.launch for x in p.launches if x.launch.census == "gemv_glu" and x.launch.quant is not None]
        assert all(g.words and g.scratch() == () for g in glus)
        assert glus  # q8k GLUs too (gemv_glu_q8k_quant)
        held = plan(build_step(cfg, rows), numerics=numerics, held=("fuse_quant",))
        # a q8k norm epilogue quantizes from the row it stores: the f32 row and its q8k form are live in the same
        # launch (the fold beside its product's operands), so under q8 on K-quant rows the arena may be larger than
        # with the Quant launches (the demo's decode step 5,888 against 5,120 B), for two launches fewer a layer;
        # each arena stays at its lower bound
        if (fmt, numerics) != ("q4_k", "q8"):
            assert p.arena.bytes <= held.arena.bytes, (rows, p.arena.bytes, held.arena.bytes)


def test_a_saved_q8_plan_of_k_quant_rows_runs_the_same(capsys, tmp_path):
    from lanefuse.lane.cli.main import main

    saved = tmp_path / "q8k.json"
    assert main(["plan", "--numerics", "q8", "--weights-format", "q4_k", "--save", str(saved)]) == 0
    capsys.readouterr()
    run = ["--weights-format", "q4_k", "--prompt-ids", "1,2,3", "--tokens", "3"]
    assert main(["run", "--plan", str(saved), *run]) == 0
    a = capsys.readouterr().out
    assert main(["run", "--numerics", "q8", *run]) == 0
    b = capsys.readouterr().out
    ids = [line for line in a.splitlines() if line.startswith("generated ids")]
    assert ids and ids == [line for line in b.splitlines() if line.startswith("generated ids")]


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_q8_mixture_finalize_quantizes_the_next_norm(fmt):
    """A Qwen3-MoE step under q8 (experts read f32, as llama.cpp's do not, the projections their quantized rows): the
    mixture's last launch adds the residual, norms the sum and quantizes the norm for the next layer's projections
    (moe_deferred_finalize.quant; on q4_k rows the q8k form, a warp a block of 256 from the row it stored), so the step
    has no Quant launch and the f32 plan's launches; decode and a 3-row chunk, the exact twins in the plan's arena
    equal to the interpreter of the quantized graph."""
    from lanefuse.engine.front.demo import demo_config, random_arrays
    from lanefuse.engine.front.families.mixtures import MoeConfig
    from lanefuse.engine.front.weights import Weights
    from lanefuse.engine.formats.blocks import encode_matrices

    cfg = dataclasses.replace(demo_config(32), arch="Qwen3MoeForCausalLM", layers=2,
                              moe=MoeConfig(8, 2, 256, True, (0, 1)))
    arrays = encode_matrices(random_arrays(cfg), fmt)
    cfg = dataclasses.replace(cfg, formats=tuple((n, f) for n, (_, f) in arrays.items() if f != "f32"))
    w = Weights.from_dict(arrays, cfg)
    for rows in (1, 3):
        g = build_step(cfg, rows)
        p, p32 = plan(g, numerics="q8"), plan(g)
        gq = with_numerics(g, "q8")
        # no Quant launch: as many launches as the f32 plan's at one row; at a 3-row chunk no more (the f32 plan runs
        # its q/k/v as gemm_parts + rope_parts there, the staged slab of block rows, where q8's fold keeps them whole)
        assert p.census.get("quant", 0) == 0, p.census
        assert len(p.launches) == len(p32.launches) if rows == 1 else len(p.launches) <= len(p32.launches), p.census
        fins = [x.launch for x in p.launches if x.launch.census == "moe" and x.launch.quant is not None]
        # every mixture's finalize but a chunk's last, whose sum the step views to its last row before the final norm
        assert len(fins) == (2 if rows == 1 else 1), fins
        assert all(m.quant_words == (3 if fmt == "q4_k" else 1) for m in fins), fins
        ref = evaluate(gq, w, _chunk_env(gq, rows, 0))
        out = NumpyRunner(p, w, exact=True, check=True).step(_chunk_env(g, rows, 0), lifted=g)
        assert np.abs(out["logits"] - ref["logits"]).max() <= 1e-6 * np.abs(ref["logits"]).max(), rows
        assert np.array_equal(out["next"], ref["next"])


def test_mixture_finalize_writes_the_q8k_form_from_the_row_it_stored():
    """The Moe launch's finalize quantizing its normed row as q8k: the form of the values it stored (the twin's);
    refused in words for a row not whole blocks of 256 or written into a table's rows."""
    from lanefuse.kernels import Moe

    rng = np.random.default_rng(8)
    d, f, E, k, rows = 256, 64, 4, 2, 2
    r = lambda *s: rng.standard_normal(s).astype(F32)  # noqa: E731
    weights = {"wr": (r(E, d), "f32"), "wgu": (r(E * 2 * f, d) / 16, "f32"), "wd": (r(E * d, f) / 8, "f32"),
               "nw": (1 + 0.1 * r(d), "f32")}
    m = Moe("x", "wr", "wgu", "wd", Dst("y"), d, f, E, k, rows, "f32", add="a", sum="s", nw="nw", eps=1e-6,
            quant="yq", quant_words=3)
    assert m.check() is None, m.check()
    n = rows * d
    env = HostEnv({"x": r(n), "a": r(n), "y": np.zeros(n, F32), "s": np.zeros(n, F32)}, weights,
                  {"yq": (np.zeros(n, np.int8), np.zeros(n // 16, np.int16), np.zeros(n // 256, F32))})
    m.numpy(env)
    want = quantize(env.array("y").reshape(rows, d), 3).parts()
    assert all(np.array_equal(g, w) for g, w in zip(env.quant("yq"), want))
    bad = dataclasses.replace(m, out=Dst("T", row="pos", pitch=d))
    assert "not stored whole in its own buffer" in bad.check().reason
    narrow = dataclasses.replace(m, d=128)
    assert "blocks of 256" in narrow.check().reason


@pytest.mark.parametrize("numerics", ["q8", "q8x2"])
def test_elementwise_results_quantized_as_they_are_stored(numerics):
    """A step graph's add and sub read by products over q8_0 rows: each Binary launch writes its result's quantized
    form as it stores it (elementwise_quant, .sub; the f32 result alone where only the projections read it): one Quant
    launch left, the gathered embedding row's; held `fuse_quant` a Quant launch each. Both plans, run by the exact twins in their arenas, equal the
    interpreter of the quantized graph bit for bit."""
    from lanefuse.engine.front.stepweights import random_weights
    from test_engine import elementwise_graph

    g = elementwise_graph()
    gq = with_numerics(g, numerics)
    w = random_weights(gq, 3)
    p, held = plan(g, numerics=numerics), plan(g, numerics=numerics, held=("fuse_quant",))
    assert p.census.get("quant") == 1 and p.fusions.get("elementwise_quant") == 2 and \
        p.fusions.get("elementwise_quant.sub") == 1, (p.census, p.fusions)
    binaries = [x.launch for x in p.launches if x.launch.census == "binary"]
    assert binaries and all(b.quant and b.words == {"q8": 1, "q8x2": 2}[numerics] and not b.f32 for b in binaries)
    assert held.census["quant"] == 4
    env = {"token": np.array([7], np.int32), "pos": np.array([0], np.int32)}
    want = evaluate(gq, w, dict(env))
    for q in (p, held):
        out = NumpyRunner(q, w, exact=True, check=True).step(dict(env), lifted=g)
        assert np.array_equal(out["logits"], want["logits"]) and np.array_equal(out["next"], want["next"])


def test_q8_latent_attention_on_k_quant_rows():
    """A DeepSeek-V3-shaped step (latent attention, a dense layer then a grouped mixture with shared experts) on
    K-quant rows under q8: the latent expansion writes the o projection's q8k form in its last blocks (HeadGemv's
    arrival-counted tail at 256), the mixture's finalize the next norm's, and the q_a norm in the first products'
    epilogue reads its stored row back a warp a block of 256 (merged_qkv.rotated_normed_quant): no Quant launch; the
    exact twins in the plan's arena equal the interpreter of the quantized graph, decode and a 3-row chunk."""
    from lanefuse.engine.front.stepweights import random_weights
    from test_engine import deepseek, in_blocks

    cfg = in_blocks(deepseek(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, vocab_size=97,
                             n_routed_experts=4, n_group=2, topk_group=1, kv_lora_rank=256, q_lora_rank=256,
                             qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64), "q4_k")
    for rows in (1, 3):
        g = build_step(cfg, rows)
        gq = with_numerics(g, "q8")
        w = random_weights(gq, 2)
        p = plan(g, numerics="q8")
        heads = [x.launch for x in p.launches if x.launch.census == "head_gemv" and x.launch.quant is not None]
        assert heads and all(h.words == 3 for h in heads), [x.launch.census for x in p.launches]
        assert p.census.get("quant", 0) == 0, p.census
        assert p.fusions.get("merged_qkv.rotated_normed_quant") == cfg.layers, p.fusions
        qsides = [s for x in p.launches if x.launch.census == "fold" and hasattr(x.launch.then, "sides")
                  for s in x.launch.then.sides if s.quant is not None]
        assert len(qsides) == cfg.layers and all(s.words == 3 and s.rot == 0 for s in qsides), qsides
        env = {"token": np.arange(5, 5 + rows, dtype=np.int32), "pos": np.array([0], np.int32)}
        for name in g.io.tables:
            env[name] = np.zeros(g.tensors[name].shape, F32)
        want = evaluate(gq, w, dict(env))
        out = NumpyRunner(p, w, exact=True, check=True).step(dict(env), lifted=g)
        assert np.abs(out["logits"] - want["logits"]).max() <= 1e-6 * np.abs(want["logits"]).max(), rows
        assert np.array_equal(out["next"], want["next"])


def _row_norm_fold(words: int, qa: int, m: int = 3, fmt: str = "q8_0", qname: str = "qaq"):
    """DeepSeek-V3's first product (q_a, the latent and the rotated key of one activation in parts) whose q_a row norm
    in the epilogue also writes its quantized form (merged_qkv.rotated_normed_quant), with its arrays and weights."""
    from lanefuse.kernels import Fold, RopeParts, RopeSide

    rng = np.random.default_rng(qa + words)
    k, lat, hd, L = 64, 32, 8, 16
    parts = (GemmPart("wqa", Dst("qa"), qa), GemmPart("wl", Dst("lat"), lat), GemmPart("wk", Dst("kp"), hd))
    sides = (RopeSide("qa", Dst("qan"), 1, norm=("na", 1e-6), hd=qa, rot=0, quant=qname, words=words),
             RopeSide("lat", Dst("lc", row="pos", pitch=lat), 1, norm=("nl", 1e-6), hd=lat, rot=0),
             RopeSide("kp", Dst("kc", row="pos", pitch=hd), 1))
    f = Fold(GemmParts("x", fmt, k, m, parts), RopeParts(sides, "cos", "sin", "pos", m, hd, hd))
    r = lambda *s: rng.standard_normal(s).astype(F32)  # noqa: E731
    ang = rng.uniform(0, 6.28, (L, hd // 2))
    arrays = {"x": r(m * k), "qa": np.zeros(m * qa, F32), "lat": np.zeros(m * lat, F32), "kp": np.zeros(m * hd, F32),
              "qan": np.zeros(m * qa, F32), "lc": r(L * lat), "kc": r(L * hd), "pos": np.array([5], np.int32)}
    weights = {"wqa": (encode(r(qa, k) / 8, fmt), fmt), "wl": (encode(r(lat, k) / 8, fmt), fmt),
               "wk": (encode(r(hd, k) / 8, fmt), fmt), "na": (r(qa), "f32"), "nl": (r(lat), "f32"),
               "cos": (np.cos(ang).astype(F32), "f32"), "sin": (np.sin(ang).astype(F32), "f32")}
    return f, arrays, weights


def _form(n: int, words: int):
    low = {2: np.zeros(n, np.int8), 3: np.zeros(n // 16, np.int16)}.get(words)
    return np.zeros(n, np.int8), low, np.zeros(n // (256 if words == 3 else 32), F32)


@pytest.mark.parametrize("words,qa", [(1, 96), (2, 96), (3, 512)])
def test_products_row_norm_quantizes_what_it_stores(words, qa):
    """A row norm in a products' epilogue writing its quantized form (q8, q8x2, and the q8k form read back from the
    stored row): the exact twin's form is the interpreter's quantize of the f32 rows it stored, the fast twin's of its
    own; the fold's twin is its two launches in turn; refusals in words: a rotated side quantized, a row not whole
    blocks, a q8k row stored as parts of units, a quantizing side outside a products' epilogue."""
    from lanefuse.kernels.rope import side_check

    f, arrays, weights = _row_norm_fold(words, qa)
    assert f.fused and f.check() is None, (f.form(), f.check())
    assert "qaq" in f.writes() and "qaq" not in f.reads()
    assert f.extents(16, 1)["qaq"] == 3 * qa
    plain = dataclasses.replace(f, then=dataclasses.replace(f.then, sides=(
        dataclasses.replace(f.then.sides[0], quant=None, words=0), *f.then.sides[1:])))
    assert f.bytes() - plain.bytes() == quant_bytes(3 * qa, words)
    for twin in ("numpy", "fast"):
        env = HostEnv({k: v.copy() for k, v in arrays.items()}, weights, {"qaq": _form(3 * qa, words)})
        getattr(f, twin)(env)
        want = quantize(env.array("qan").reshape(3, qa), words).parts()
        for got, w in zip(env.quant("qaq"), want):
            assert (got is None) == (w is None) and (got is None or np.array_equal(got.reshape(-1), w)), twin
        if twin == "numpy":
            apart = HostEnv({k: v.copy() for k, v in arrays.items()}, weights, {"qaq": _form(3 * qa, words)})
            f.first.numpy(apart)
            f.then.numpy(apart)
            assert all(np.array_equal(a, b) for a, b in zip(env.quant("qaq")[::2], apart.quant("qaq")[::2]))
    side = f.then.sides[0]
    rotated = dataclasses.replace(side, hd=0, rot=-1)
    assert "quantized as it is stored" in side_check(rotated, qa, qa, epilogue=True).reason
    assert "whole number of blocks" in side_check(dataclasses.replace(side, hd=qa + 8), 8, 8, epilogue=True).reason
    assert "own head shape" in side_check(side, 8, 8).reason  # outside a products' epilogue
    if words == 3:
        parted = dataclasses.replace(side, y=Dst("qan", unit=Part(2 * qa, 0, qa)))
        assert "parts of units" in side_check(parted, 8, 8, epilogue=True).reason


def test_glu_over_an_f32_activation_writes_the_q8k_form():
    """gate and up over bf16 rows (their activation read f32) and down over q6_k rows under q8: the gate/up GEMV's
    arrival-counted tail quantizes its GLU as llama.cpp's q8_K (the last block of each 256 outputs to arrive, from the
    values stored), no Quant launch; the exact twins in the
    plan's arena equal the interpreter of the quantized graph, decode and a 3-row chunk."""
    from lanefuse.engine.front.stepweights import random_weights

    cfg, _ = q8_model("q6_k")
    cfg = dataclasses.replace(cfg, formats=tuple((n, "bf16" if "gate_proj" in n or "up_proj" in n else f)
                                                 for n, f in cfg.formats))
    for rows in (1, 3):
        g = build_step(cfg, rows)
        gq = with_numerics(g, "q8")
        w = random_weights(gq, 4)
        p = plan(g, numerics="q8")
        glus = [x.launch for x in p.launches if x.launch.census == "gemv_glu"]
        assert len(glus) == cfg.layers and all(x.words == 0 and x.quant is not None and x.quant_words == 3
                                               for x in glus), glus
        assert p.census.get("quant", 0) == 0, p.census
        assert glus[0].scratch()[0].nbytes == 4 * (cfg.inter // 256)  # a counter a block of 256 and a slab of rows
        ref = evaluate(gq, w, _chunk_env(gq, rows, 0))
        out = NumpyRunner(p, w, exact=True, check=True).step(_chunk_env(g, rows, 0), lifted=g)
        assert np.abs(out["logits"] - ref["logits"]).max() <= 1e-6 * np.abs(ref["logits"]).max(), rows
        assert np.array_equal(out["next"], ref["next"])
