"""Block-format rows of a prefill chunk decoded to bf16, then cuBLAS (kernels/gemm_deq.py): gemm_tc.cu's
gemm_tc_dequant emulated on the CPU (tests/cuda_host) against its twin (engine/formats' decode rounded to bf16, to
the bit) for q8_0, q4_0, q4_k, q6_k and mxfp4, at counts no whole number of the grid's threads and through its
grid-stride loop; a mutated kernel caught; the whole launch (rounding, decoding, the stand-in cuBLAS of
tests/test_cupy_runner_mock.py summing exactly, the epilogue) equal to the exact twin; the lane's step chosen by price,
held by `dequant` and `cublas`; a tiny q4_k and q8_0 Qwen3's chunks give the held plan's tokens and logits."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from test_cupy_runner_mock import _fake_cupy, fake_cublas
from test_gemm_tc import emulated, r32  # noqa: F401  (emulated: a fixture, gemm_tc's module on the host emulator)

from lanefuse.kernels import Binary, Dst, GemmPart, GemmTc, GemmTcGlu, GemmTcParts, HostEnv
from lanefuse.kernels.common import FORMAT_CODE, encode
from lanefuse.kernels.gemm_blas import GemmBlas, price_us
from lanefuse.kernels.gemm_deq import (DEQ_MAX_BLOCKS, GemmDeq, GemmDeqGlu, GemmDeqParts, decoded_bf16,
                                       dequant_grid)
from lanefuse.kernels.gemm_tc import bf16_round
from lanefuse.lane.lower.knobs import Knobs

# (format, n, k): n odd, so n·k/8 groups are no whole number of the 256 threads of a block
CASES = [("q8_0", 37, 96), ("q4_0", 29, 64), ("q4_k", 13, 512), ("q6_k", 11, 256), ("mxfp4", 19, 64)]


def block_rows(g, fmt, n, k):
    """Rows (n, k) in `fmt` whose values span small and large magnitudes (so a truncating rounding shows)."""
    return encode(r32(g, n, k) * np.exp(r32(g, n, 1)), fmt)


def run_dequant(raw, fmt, n, k, grid=None):
    """gemm_tc_dequant of `raw` on the emulated device: the bf16 bits it wrote, and the 8 guard words past them."""
    from lanefuse.kernels.cupy_env import DeviceEnv, i64

    dev = DeviceEnv(0, {}, {}, {"w": (raw, fmt)})
    out = dev.cp.zeros(2 * (n * k + 8), dtype=np.uint8)
    out[...] = 0xAB
    g, b = grid or dequant_grid(n * k)
    dev.function(GemmTc.stem, "gemm_tc_dequant")(g, b, (dev.weight("w")[0], i64(FORMAT_CODE[fmt]), out,
                                                        i64(n * k)))
    host = np.asarray(out).copy().view(np.uint16)
    return host[: n * k].reshape(n, k), host[n * k:]


@pytest.mark.parametrize("fmt,n,k", CASES)
def test_emulated_dequant_is_the_twin_to_the_bit(emulated, fmt, n, k):
    g = np.random.default_rng(n * k)
    raw = block_rows(g, fmt, n, k)
    got, past = run_dequant(raw, fmt, n, k)
    want = decoded_bf16(raw, fmt, n, k)
    np.testing.assert_array_equal(got, want)
    assert (past == 0xABAB).all()  # nothing written past n·k
    # the same bits by one block looping over every group (the grid-stride loop)
    np.testing.assert_array_equal(run_dequant(raw, fmt, n, k, ((1,), (256,)))[0], want)


def test_the_twin_is_the_formats_decode_rounded():
    g = np.random.default_rng(1)
    raw = block_rows(g, "q4_k", 3, 256)
    from lanefuse.kernels.common import decode

    w = decode(raw, "q4_k").reshape(3, 256)
    bits = decoded_bf16(raw, "q4_k", 3, 256)
    np.testing.assert_array_equal((bits.astype(np.uint32) << 16).view(np.float32), bf16_round(w))
    assert not np.array_equal((bits.astype(np.uint32) << 16).view(np.float32), w)  # q4_k values are not all bf16
    assert dequant_grid(8 * 256 * DEQ_MAX_BLOCKS * 3)[0] == (DEQ_MAX_BLOCKS,) and dequant_grid(8)[0] == (1,)


@pytest.mark.forked
def test_a_truncating_dequant_is_caught(emulated, monkeypatch):
    """gemm_tc_dequant with its rounding made a truncation (bf16x2 of the top halves): the twin check fails."""
    import lanefuse.kernels.compile as kc

    real = kc.cu_text
    old = "*(uint4*)((u16*)wb + i) = make_uint4(bf16x2(a.x, a.y)"
    new = "*(uint4*)((u16*)wb + i) = make_uint4((__float_as_uint(a.x) >> 16) | (__float_as_uint(a.y) & 0xffff0000u)"
    text = real("gemm_tc")
    assert old in text, "gemm_tc.cu no longer holds the dequant's store: update the mutation"
    monkeypatch.setattr(kc, "cu_text", lambda stem: text.replace(old, new) if stem == "gemm_tc" else real(stem))
    from cuda_host import emu

    emu.build(GemmTc.stem)
    g = np.random.default_rng(3)
    raw = block_rows(g, "q8_0", 5, 64)
    got, _ = run_dequant(raw, "q8_0", 5, 64)
    assert not np.array_equal(got, decoded_bf16(raw, "q8_0", 5, 64))


# -- the whole launch, emulated (rounding, decoding, epilogue) with the stand-in cuBLAS ------------------------------

@pytest.fixture
def blas(emulated, monkeypatch):
    """The emulated DeviceEnv with the stand-in cuBLAS (exact sums, rounded once): its calls."""
    calls = []
    monkeypatch.setattr(emulated, "blas", lambda self: (fake_cublas(calls), 0x5EED))
    return calls


def launch_case(launch, g, weights_of):
    arrays = {"x": r32(g, launch.m, launch.k) * 2}
    weights = {w: (block_rows(g, launch.format, n, launch.k), launch.format) for w, n in weights_of}
    return arrays, weights


def on_emulator(launch, arrays, outs, weights):
    from lanefuse.kernels.cupy_env import DeviceEnv

    assert launch.check() is None, launch.check()
    dev = DeviceEnv(0, {}, {**arrays, **outs}, weights)
    launch.cuda(dev)
    return dev


def exact_twin(launch, arrays, outs, weights):
    env = HostEnv({**arrays, **{k: v.copy() for k, v in outs.items()}}, weights)
    launch.numpy(env)
    return env


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "q6_k"])
def test_emulated_gemm_deq_equals_the_exact_twin(blas, fmt):
    """y = x · wᵀ + bias through the decode, the stand-in cuBLAS and gemm_tc_combine: the exact twin to the bit (the
    stand-in sums exactly as the twin does, so only a wrong decode, pitch or epilogue could differ)."""
    g = np.random.default_rng(len(fmt))
    k = 256
    launch = GemmDeq("x", "w", fmt, Dst("y"), k, 21, 19, bias="b")
    arrays, weights = launch_case(launch, g, [("w", 21)])
    weights["b"] = (r32(g, 21), "f32")
    outs = {"y": np.zeros(19 * 21, np.float32)}
    dev = on_emulator(launch, arrays, outs, weights)
    assert len(blas) == 1 and blas[0]["lda"] == k and blas[0]["Atype"] == 14
    np.testing.assert_array_equal(dev.host("y"), exact_twin(launch, arrays, outs, weights).array("y"))


def test_emulated_parts_and_glu_decode_each_matrix_into_one_scratch(blas):
    g = np.random.default_rng(7)
    parts = GemmDeqParts("x", "q4_0", 64, 17, (GemmPart("wq", Dst("q"), 40), GemmPart("wk", Dst("kk"), 24)))
    arrays, weights = launch_case(parts, g, [("wq", 40), ("wk", 24)])
    outs = {"q": np.zeros(17 * 40, np.float32), "kk": np.zeros(17 * 24, np.float32)}
    assert [s.tag for s in parts.scratch()] == ["xb", "wb"] and parts.scratch()[1].nbytes == 2 * 40 * 64
    dev = on_emulator(parts, arrays, outs, weights)
    want = exact_twin(parts, arrays, outs, weights)
    for o in outs:
        np.testing.assert_array_equal(dev.host(o), want.array(o))
    glu = GemmDeqGlu("x", "wg", "wu", "q8_0", "o", 64, 24, 17)
    arrays, weights = launch_case(glu, g, [("wg", 24), ("wu", 24)])
    outs = {"o": np.zeros(17 * 24, np.float32)}
    from cuda_host import emu

    emu.build(Binary.stem)
    dev = on_emulator(glu, arrays, outs, weights)
    # the products exact, the gated mul's act by the host's expf (not numpy's: a few ulps, as binary.cu's own tests)
    np.testing.assert_allclose(dev.host("o"), exact_twin(glu, arrays, outs, weights).array("o"), rtol=1e-6, atol=0)
    assert len(blas) == 4 and blas[0]["A"] == blas[1]["A"] and blas[2]["A"] == blas[3]["A"]  # one scratch a launch


def test_the_gpu_tests_host_side_on_the_emulator(blas):
    """tests/test_gemm_deq_gpu.py's small cases run here on the emulated kernels and the stand-in cuBLAS (exact
    sums), so a device run spends its time on the device, not on the tests' bugs (the capture needs a real graph)."""
    import test_gemm_deq_gpu as t

    for fmt, n, k in CASES:
        t.test_dequant_is_the_twin_to_the_bit(fmt, n, k)
    for fmt in ("q4_k", "q8_0"):
        for m, n, k in [(16, 8, 256), (19, 24, 512)]:
            t.test_gemm_deq_within_the_bound(m, n, k, fmt)
    t.test_gemm_deq_parts_and_glu()
    assert len(blas) == 2 * 2 * 2 + 2 + 2


# -- the lane's choice -------------------------------------------------------------------------------------------------

def test_the_step_takes_the_decoded_form_where_it_prices_cheaper_and_holds():
    k = Knobs()
    for fmt in ("q4_k", "q8_0", "q6_k", "q4_0"):
        big = GemmTc("x", "w", fmt, Dst("y"), 4096, 4096, 2048)
        assert type(big.tune(k)) is GemmDeq and big.tune(k).check() is None
        assert type(big.tune(k, {"dequant"})) is GemmTc and type(big.tune(k, {"cublas"})) is GemmTc
        # a product of one tile: its lone block's steps, each decoding its 4096 values a value at a time
        # (gemm_tc.tc_waves), outlast the decoded form's two more launches
        tiny = GemmTc("x", "w", fmt, Dst("y"), 256, 64, 16)
        assert type(tiny.tune(k)) is GemmDeq
        # at 16 rows of an 8B model's product, gemm_tc's kernel decodes each value once too, a value at a time
        # (DECODE_INSTR's first figure) against qget4's (its second) and 4 more bytes a value: the price chooses
        one = GemmTc("x", "w", fmt, Dst("y"), 4096, 4096, 16)
        deq = GemmDeq(**{f: getattr(one, f) for f in ("x", "w", "format", "y", "k", "n", "m")})
        assert (type(one.tune(k)) is GemmDeq) == (price_us(deq, k) < price_us(one.tune(k, {"cublas"}), k))
    assert type(GemmTc("x", "w", "bf16", Dst("y"), 4096, 4096, 2048).tune(k)) is GemmBlas  # bf16 as it is stored
    # 16 rows of q8_0 over 32 tiles: one tile of rows decodes each value once, bound by the rows' bytes; the decoded
    # rows' 4 more bytes a value cost more
    assert type(GemmTc("x", "w", "q8_0", Dst("y"), 4096, 4096, 16).tune(k)) is GemmTc
    glu = GemmTcGlu("x", "wg", "wu", "q4_k", "o", 4096, 12288, 512)
    parts = GemmTcParts("x", "q8_0", 4096, 2048, (GemmPart("wq", Dst("q"), 4096), GemmPart("wk", Dst("k"), 1024)))
    assert type(glu.tune(k)) is GemmDeqGlu and type(parts.tune(k)) is GemmDeqParts
    d = glu.tune(k)
    assert d.bytes() == GemmTcGlu.bytes(glu) + 16 * 512 * 12288 + 2 * 2 * 2 * 12288 * 4096  # gate, GLU; decode
    assert d.scratch()[-1].nbytes == 2 * 12288 * 4096  # one matrix's bf16 rows, reused for the other


def test_refusals_in_one_line():
    for launch, words in [(GemmDeq("x", "w", "bf16", Dst("y"), 64, 64, 32), "rows in bf16 decoded"),
                          (GemmDeq("x", "w", "f16", Dst("y"), 64, 64, 32), "rows in f16 decoded"),
                          (GemmDeq("x", "w", "q8_0", Dst("y"), 64, 64, 32, ksplit=2), "in 2 parts along k"),
                          (GemmDeqGlu("x", "wg", "wu", "q8_0", "o", 64, 64, 32, format_u="q4_0"),
                           "different formats")]:
        why = launch.check()
        assert why is not None and words in why.reason and "\n" not in why.reason, why


# -- plans: a tiny q4_k / q8_0 Qwen3 ----------------------------------------------------------------------------------

ONE_SM = Knobs(tc_rows=16, sms=1, hbm_gbps=1e9, launch_us=0.01, blas_call_us=0.0)  # a chip whose products are bound by flops (its
# launches nearly free: the decoded form's more launches a product do not decide): the decoded form pays


def block_model(fmt):
    """A tiny one-layer Qwen3 (hidden 256, MLP 512: rows of whole q4_k blocks), its matrices stored in `fmt`."""
    import dataclasses

    from lanefuse.engine.front.model import ModelConfig
    from lanefuse.engine.front.weights import Weights

    base = ModelConfig("Qwen3ForCausalLM", 256, 1, 4, 2, 64, 512, 100, qk_norm=True, max_len=64,
                       name="tiny-qwen3-" + fmt)
    cfg = dataclasses.replace(base, formats=tuple((n, fmt) for n, s in base.weight_names().items() if len(s) == 2))
    g = np.random.default_rng(4)
    arrays = {}
    for n, sh in cfg.weight_names().items():  # matrices by 1/sqrt(columns) in `fmt`, vectors small
        a = (g.standard_normal(sh) / (sh[-1] ** 0.5 if len(sh) == 2 else 10.0)).astype(np.float32)
        arrays[n] = (encode(a, fmt), fmt) if len(sh) == 2 else a
    return cfg, Weights.from_dict(arrays, cfg)


@pytest.mark.parametrize("fmt", ["q4_k", "q8_0"])
def test_a_block_format_chunk_gives_the_held_plans_tokens_and_logits(fmt):
    """A 21-token prompt (chunks of 16 and 5 rows) and 2 greedy steps: the plan whose 16-row chunk decodes its rows
    for cuBLAS (gemm_deq, _parts, _glu) gives the plan with `dequant` held (gemm_tc's kernels) the same logits to
    the bit through the exact twins (one numerics: the rows' decoded values rounded to bf16, f32 sums; the device's
    sums differ within gemm_blas.blas_bound), the same tokens through the fast twins."""
    from test_gemm_blas import gives_the_held_plans_tokens

    from lanefuse.lane.lower.plan import plan

    cfg, w = block_model(fmt)
    L = cfg.layers
    chunk = plan(cfg.build_step(16), knobs=ONE_SM)
    got = {k: v for k, v in chunk.census.items() if k.startswith("gemm_deq")}
    assert got == {"gemm_deq": 2 * L, "gemm_deq_parts": L, "gemm_deq_glu": L}, chunk.census
    placed = {p.scratch_of: p.bytes for p in chunk.arena.arrays if p.name.endswith(".wb")}  # the decoded rows
    deqs = {i: x.launch for i, x in enumerate(chunk.launches) if x.launch.census.startswith("gemm_deq")}
    assert placed == {i: l.decoded().nbytes for i, l in deqs.items()} and max(placed.values()) == 2 * 512 * 256
    held = plan(cfg.build_step(16), knobs=ONE_SM, held=["dequant"])
    assert not any(k.startswith("gemm_deq") for k in held.census) and len(held.launches) == len(chunk.launches)
    gives_the_held_plans_tokens(cfg, w, ONE_SM, "dequant", 2)


def test_the_qwen3_8b_q4_k_prefill_plan_decodes_its_rows_and_the_model_prices_it():
    """The Qwen3-8B shape in q4_k (config only) under the default chip: a 2048-row chunk's products all decode their
    rows for cuBLAS (the lane's price of gemm_tc's kernel over q4_k is its decode's issue rate, gemm_tc.TcProduct.rate),
    its dequant-held plan gemm_tc's; bench/gemm_model.py PREDICTS the decoded plan faster, and at least 60% of the
    bf16 plan's tokens/s (issue 35's goal; a prediction, not a measurement)."""
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import gemm_model

    s, held = gemm_model.prefill_plan(2048, "q4_k"), gemm_model.prefill_plan(2048, "q4_k", held=["dequant"])
    census = {k: v for k, v in s.census.items() if k.startswith("gemm")}
    assert census == {"gemm_deq": 72, "gemm_deq_glu": 36, "gemm_deq_parts": 36}, census
    assert {k: v for k, v in held.census.items() if k.startswith("gemm")} == {"gemm_tc": 72, "gemm_tc_glu": 36,
                                                                                "gemm_tc_parts": 36}
    p, q = gemm_model.plan_prediction(s), gemm_model.plan_prediction(held)
    bf16 = gemm_model.plan_prediction(gemm_model.prefill_plan(2048))
    assert q["tokens_per_s"] < p["tokens_per_s"] and p["tokens_per_s"] >= 0.6 * bf16["tokens_per_s"]
    assert p["gemms"][0]["dequant_us"] > 0 and all(g["bound"] == "decode" for g in q["gemms"])


def test_the_lane_prices_gemm_tc_by_its_waves_so_the_512_row_q8_0_chunk_decodes_k_and_v():
    """The lane's price of a tensor-core product follows bench/gemm_model.py's waves (one function: gemm_tc.tc_waves):
    the Qwen3-8B-shaped 512-row q8_0 chunk's k and v products (2 x 1024 outputs: 64 tiles, a quarter of a wave of lone
    blocks, latency-bound) were kept on gemm_tc_parts by a flat 450 TFLOP/s; priced by their waves, q, k and v take
    one decoded launch (gemm_deq_parts: each matrix decoded, then cuBLAS), as the model predicts faster; held
    (`dequant`), gemm_tc's kernel again (q, k and v each a launch of its own, split along k: a gemm_tc_parts launch is
    not split, and its waves price it above the three)."""
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import gemm_model

    from lanefuse.kernels.gemm_tc import tc_waves
    from lanefuse.lane.lower.shim import launch_us

    k = Knobs()
    kv = GemmTcParts("x", "q8_0", 4096, 512, (GemmPart("wk", Dst("k"), 1024), GemmPart("wv", Dst("v"), 1024)))
    w = tc_waves(512, [1024, 1024], 4096, 1, "q8_0", k.sms)
    assert w["tiles"] == 64 and w["waves"] == 1 and w["wave_fill"] < 0.25 and w["bound"] == "latency"
    p = gemm_model.tc_prediction(kv)
    assert p["compute_us"] == pytest.approx(w["compute_us"], abs=0.01)  # the model's and the lane's: one arithmetic
    assert launch_us(kv, k) == pytest.approx(k.launch_us * 2 + max(kv.bytes() / (k.hbm_gbps * 1e3), w["compute_us"]))
    s, held = gemm_model.prefill_plan(512, "q8_0"), gemm_model.prefill_plan(512, "q8_0", held=["dequant"])
    gemms = lambda p: {c: n for c, n in p.census.items() if c.startswith("gemm")}  # noqa: E731
    assert gemms(s) == {"gemm_deq": 72, "gemm_deq_glu": 36, "gemm_deq_parts": 36}, gemms(s)
    assert gemms(held) == {"gemm_tc": 180, "gemm_tc_glu": 36}, gemms(held)
    assert {x.launch.ksplit for x in held.launches if x.launch.census == "gemm_tc" and x.launch.n == 1024} == {8}
    parts = [x.launch for x in s.launches if x.launch.census == "gemm_deq_parts"]
    assert all([q.n for q in l.parts] == [4096, 1024, 1024] for l in parts)
    assert gemm_model.plan_prediction(s)["step_us"] < gemm_model.plan_prediction(held)["step_us"]
