"""The cuBLAS forms of the tensor-core products (kernels/gemm_blas.py) on the CPU: the device side run against the
stand-in cupy of tests/test_cupy_runner_mock.py, whose stand-in cuBLAS records each cublasGemmEx (transposes, m/n/k,
leading dimensions, pointers, types, compute type, the current stream) and computes it on the memory its pointers
address, column-major as cuBLAS reads it — so a wrong transpose, leading dimension or offset gives wrong values —
and the twin within the bound; the lane's `cublas` step: chosen by price, held by --hold, never in a decode plan.
The device itself: tests/test_gemm_blas_gpu.py."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from test_cupy_runner_mock import _fake_cupy, _memory, _Stream, fake_cublas
from test_gemm_tc import check_within_bound, r32, tc_case

from lanefuse.kernels import Dst, GemmPart, GemmTc, GemmTcGlu, GemmTcParts, HostEnv, Part
from lanefuse.kernels.common import ACTS, act, encode
from lanefuse.kernels.gemm_blas import (CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT, CUBLAS_OP_N, CUBLAS_OP_T,
                                        CUDA_R_16BF, CUDA_R_32F, GemmBlas, GemmBlasGlu, GemmBlasParts, blas_bound,
                                        prefer)
from lanefuse.kernels.gemm_tc import bf16_round, kp
from lanefuse.lane.lower.knobs import Knobs


@pytest.fixture
def device(monkeypatch):
    """The stand-in cupy and cuBLAS, and gemm_tc_round / gemm_tc_combine / binary as numpy on the memory their
    arguments address: (the cuBLAS calls, the kernels' names in order)."""
    from lanefuse.kernels.cupy_env import NULL, DeviceEnv

    calls, kernels = [], []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    libs = types.ModuleType("cupy_backends.cuda.libs")
    libs.cublas = fake_cublas(calls)
    for name, mod in (("cupy_backends", types.ModuleType("cupy_backends")),
                      ("cupy_backends.cuda", types.ModuleType("cupy_backends.cuda")),
                      ("cupy_backends.cuda.libs", libs), ("cupy_backends.cuda.libs.cublas", libs.cublas)):
        monkeypatch.setitem(sys.modules, name, mod)

    def gemm_tc_round(x, xb, m, k, p):
        rows = np.zeros((int(m), int(p)), np.float32)
        rows[:, :k] = np.asarray(x)[: m * k].reshape(m, k)
        xb.view(np.uint16)[: m * p] = (bf16_round(rows).view(np.uint32) >> 16).astype(np.uint16).reshape(-1)

    def gemm_tc_combine(part, ksplit, bias, add, y, rowp, row, pitch, upitch, uoff, uwidth, n, m):
        v = np.asarray(part)[: m * n].astype(np.float32)
        for z in range(1, int(ksplit)):
            v = v + part[z * m * n:(z + 1) * m * n]
        if not isinstance(bias, np.uint64):
            v = v + np.tile(np.asarray(bias)[:n], int(m))
        if not isinstance(add, np.uint64):
            v = v + np.asarray(add)[: m * n]
        e = np.arange(m * n)
        if rowp and row < 0:  # prelude.cu dst_at
            r = e // pitch
            idx = (r * -row + _memory(rowp, np.int32, int(m))[r]) * pitch + e % pitch
        else:
            base = (int(_memory(rowp, np.int32, 1)[0]) if rowp else row) * pitch
            idx = base + ((e // uwidth) * upitch + uoff + e % uwidth if uwidth > 0 else e)
        _memory(y, np.float32, int(idx.max()) + 1)[idx] = v

    def binary(a, b, out, n, row, op, gate, each, qw, ql, qs, qwords):
        assert row == 0 and each == 0 and op == 1 and qw is NULL or isinstance(qw, np.uint64)
        out[:n] = np.asarray(a)[:n] * act(ACTS[gate], np.asarray(b)[:n]).astype(np.float32)

    fns = {"gemm_tc_round": gemm_tc_round, "gemm_tc_combine": gemm_tc_combine, "binary": binary}

    def function(self, stems, name):
        def call(grid, block, args):
            kernels.append(name)
            fns[name](*[int(a) if isinstance(a, np.integer) and not isinstance(a, np.uint64) else a for a in args])
        return call

    monkeypatch.setattr(DeviceEnv, "function", function)
    return calls, kernels


def on_device(launch, arrays, weights, scratch_at=None):
    """`launch` run by its cuda() on the stand-in device inside a stream: (the device env, the stream)."""
    from lanefuse.kernels.cupy_env import DeviceEnv

    assert launch.check() is None, launch.check()
    placed, off = {}, 0
    for name, a in arrays.items():  # every array a view of the arena, 256 bytes apart
        placed[name] = (off, a.nbytes, "i32" if a.dtype == np.int32 else "f32")
        off += -(-a.nbytes // 256) * 256
    scratch = {(launch.key(), tag): off + at for tag, at in (scratch_at or {}).items()}
    dev = DeviceEnv(off + sum(s.nbytes for s in launch.scratch()) + 1024, placed, {}, weights, scratch)
    for name, a in arrays.items():
        dev.array(name)[:] = a.reshape(-1)
    s = _Stream()
    with s:
        launch.cuda(dev)
    return dev, s


def blas_weights(g, n, k, name="w"):
    return {name: (encode(r32(g, n, k) * 0.5, "bf16"), "bf16")}


# (m, n, k): m not a multiple of 16, k odd (rows of bf16 at an odd pitch, the rounded x padded to 8), more outputs
# than a grid's 65535 tiles of y would allow, a prefill-like shape
SHAPES = [(19, 24, 37), (16, 8, 16), (33, 70000, 8), (130, 257, 96)]


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_one_cublas_call_its_arguments_and_the_twin(device, m, n, k):
    calls, kernels = device
    g = np.random.default_rng(m * n + k)
    launch = GemmBlas("x", "w", "bf16", Dst("y"), k, n, m)
    arrays = {"x": r32(g, m, k), "y": np.full(m * n, 7.0, np.float32)}
    weights = blas_weights(g, n, k)
    dev, stream = on_device(launch, arrays, weights, {"xb": 0})
    assert kernels == ["gemm_tc_round"] and len(calls) == 1
    c = calls[0]
    assert (c["transa"], c["transb"]) == (CUBLAS_OP_T, CUBLAS_OP_N)  # yᵀ = w · xᵀ, column-major
    assert (c["m"], c["n"], c["k"]) == (n, m, k) and (c["lda"], c["ldb"], c["ldc"]) == (k, kp(k), n)
    assert (c["Atype"], c["Btype"], c["Ctype"]) == (CUDA_R_16BF, CUDA_R_16BF, CUDA_R_32F)
    assert c["computeType"] == CUBLAS_COMPUTE_32F and c["algo"] == CUBLAS_GEMM_DEFAULT
    assert (c["alpha"], c["beta"]) == (1.0, 0.0) and c["stream"] is stream and c["handle"] == 0x5EED
    arena = int(dev.arena.data.ptr)
    assert c["A"] == dev.ptr("w") and c["C"] == dev.ptr("y") and c["B"] == arena + dev.scratch_at[(launch.key(), "xb")]
    assert dev.ptr("y") == arena + 256 * -(-arrays["x"].nbytes // 256)  # y's view at its arena offset
    got = dev.host("y")
    check_within_bound(launch, arrays, weights, got)
    host = HostEnv({"x": arrays["x"], "y": arrays["y"].copy()}, weights)
    launch.numpy(host)  # the stand-in sums exactly, as the twin does: the same bits
    np.testing.assert_array_equal(got, host.array("y"))


@pytest.mark.parametrize("dst,at,ld", [(Dst("y", unit=Part(40, 6, 19)), 6, 40),
                                       (Dst("y", row=2, pitch=19), 38, 19)])
def test_rows_of_a_wider_array_are_ldc_and_an_offset(device, dst, at, ld):
    calls, kernels = device
    g = np.random.default_rng(3)
    launch = GemmBlas("x", "w", "bf16", dst, 24, 19, 21)
    arrays, weights = tc_case(launch, g)
    arrays["y"][:] = 3.0
    weights = blas_weights(g, 19, 24)
    dev, _ = on_device(launch, arrays, weights)
    assert len(calls) == 1 and kernels == ["gemm_tc_round"]
    assert calls[0]["C"] == dev.ptr("y") + 4 * at and calls[0]["ldc"] == ld
    check_within_bound(launch, arrays, weights, dev.host("y"))  # and nothing written between the rows


def test_the_residual_added_in_place_is_beta_one(device):
    calls, kernels = device
    g = np.random.default_rng(4)
    launch = GemmBlas("x", "w", "bf16", Dst("y"), 40, 24, 17, add="y")
    arrays = {"x": r32(g, 17, 40), "y": r32(g, 17 * 24)}
    weights = blas_weights(g, 24, 40)
    dev, _ = on_device(launch, arrays, weights)
    assert len(calls) == 1 and calls[0]["beta"] == 1.0 and calls[0]["C"] == dev.ptr("y") and not launch.scratch()[1:]
    check_within_bound(launch, arrays, weights, dev.host("y"))


@pytest.mark.parametrize("dst", [Dst("y", row="pos", pitch=19), Dst("y", unit=Part(23, 2, 19)), Dst("y")])
def test_an_epilogue_cublas_cannot_do_is_the_combine_launch(device, dst):
    """A bias and rows added from another array (and a row at a position parameter): the product into scratch
    (ldc n), then gemm_tc_combine adds the bias, then the rows, and writes the Dst."""
    calls, kernels = device
    g = np.random.default_rng(5)
    launch = GemmBlas("x", "w", "bf16", dst, 48, 19, 33, bias="b", add="res")
    arrays, weights = tc_case(launch, g)
    weights["w"] = blas_weights(g, 19, 48)["w"]
    dev, _ = on_device(launch, arrays, weights)
    assert kernels == ["gemm_tc_round", "gemm_tc_combine"] and len(calls) == 1
    c = calls[0]
    assert c["C"] == int(dev.scratch(launch, launch.scratch()[1]).data.ptr) and c["ldc"] == 19 and c["beta"] == 0.0
    check_within_bound(launch, arrays, weights, dev.host("y"))


def test_parts_one_call_each_on_one_rounded_x(device):
    calls, kernels = device
    g = np.random.default_rng(6)
    m, k = 19, 72
    parts = (GemmPart("wq", Dst("q"), 130, bias="bq"), GemmPart("wk", Dst("kc", row="pos", pitch=20), 20),
             GemmPart("wv", Dst("qkv", unit=Part(133, 2, 129)), 129))
    launch = GemmBlasParts("x", "bf16", k, m, parts)
    arrays = {"x": r32(g, m, k), "q": np.zeros(m * 130, np.float32), "kc": np.zeros((m + 8) * 20, np.float32),
              "pos": np.array([4], np.int32), "qkv": np.zeros(m * 133, np.float32)}
    weights = {f"w{c}": blas_weights(g, p.n, k)["w"] for c, p in zip("qkv", parts)}
    weights["bq"] = (r32(g, 130), "f32")
    dev, _ = on_device(launch, arrays, weights)
    assert kernels == ["gemm_tc_round", "gemm_tc_combine", "gemm_tc_combine"]  # q's bias, k's row at pos
    assert len(calls) == 3 and len({c["B"] for c in calls}) == 1 and [c["m"] for c in calls] == [130, 20, 129]
    assert calls[2]["C"] == dev.ptr("qkv") + 4 * 2 and calls[2]["ldc"] == 133
    host = HostEnv({n: a.copy() for n, a in arrays.items()}, weights)
    launch.numpy(host)
    for name in ("q", "kc", "qkv"):
        np.testing.assert_array_equal(dev.host(name), host.array(name), err_msg=name)


@pytest.mark.parametrize("act_", ["silu", "gelu"])
def test_the_glu_two_calls_then_the_gated_mul(device, act_):
    calls, kernels = device
    g = np.random.default_rng(7)
    m, n, k = 21, 40, 56
    launch = GemmBlasGlu("x", "wg", "wu", "bf16", "o", k, n, m, act=act_)
    arrays = {"x": r32(g, m, k), "o": np.zeros(m * n, np.float32)}
    weights = {**blas_weights(g, n, k, "wg"), **blas_weights(g, n, k, "wu")}
    dev, _ = on_device(launch, arrays, weights)
    assert kernels == ["gemm_tc_round", "binary"] and len(calls) == 2
    assert calls[0]["A"] == dev.ptr("wu") and calls[0]["C"] == dev.ptr("o")  # up into out, gate into scratch
    assert calls[1]["A"] == dev.ptr("wg") and calls[1]["C"] == int(dev.scratch(launch, launch.scratch()[1]).data.ptr)
    host = HostEnv({n_: a.copy() for n_, a in arrays.items()}, weights)
    GemmTcGlu("x", "wg", "wu", "bf16", "o", k, n, m, act=act_).numpy(host)  # gemm_tc_glu's twin, to the bit
    np.testing.assert_array_equal(dev.host("o"), host.array("o"))


def test_the_bound_holds_against_cuBLAS_like_sums():
    """The twin's bound against sums in other orders than the exact one: f32 accumulation over 16-wide k steps (as
    mma does) and two halves of k added at the end (a split of k), on values of mixed sign and scale."""
    g = np.random.default_rng(8)
    m, n, k = 9, 11, 1000
    x = r32(g, m, k) * np.exp(g.uniform(-6, 6, (m, k))).astype(np.float32)
    w = r32(g, n, k)
    xb, wb = bf16_round(x), bf16_round(w)
    exact = (xb.astype(np.float64) @ wb.astype(np.float64).T).astype(np.float32)
    acc = np.zeros((m, n), np.float32)
    for t in range(0, k, 16):
        acc += (xb[:, t:t + 16].astype(np.float64) @ wb[:, t:t + 16].astype(np.float64).T).astype(np.float32)
    halves = sum((xb[:, h:h + k // 2] @ wb[:, h:h + k // 2].T).astype(np.float32) for h in (0, k // 2))
    for got in (acc, halves.astype(np.float32)):
        assert (np.abs(got.astype(np.float64) - exact) <= blas_bound(x, w, exact, 0)).all()
    assert blas_bound(x, w, exact, 2).min() > blas_bound(x, w, exact, 0).min() > 0


def test_refusals_in_one_line():
    for launch, words in [(GemmBlas("x", "w", "f16", Dst("y"), 64, 64, 32), "rows in f16 through cuBLAS"),
                          (GemmBlas("x", "w", "q8_0", Dst("y"), 64, 64, 32), "rows in q8_0 through cuBLAS"),
                          (GemmBlas("x", "w", "bf16", Dst("y"), 4096, 64, 32, ksplit=2), "in 2 parts along k"),
                          (GemmBlasGlu("x", "wg", "wu", "f32", "o", 64, 64, 32), "rows in f32 through cuBLAS")]:
        why = launch.check()
        assert why is not None and words in why.reason and "\n" not in why.reason, why


def test_the_step_prefers_cublas_where_the_lane_prices_it_cheaper():
    k = Knobs()
    big = GemmTc("x", "w", "bf16", Dst("y"), 4096, 4096, 2048)
    assert isinstance(big.tune(k), GemmBlas) and big.tune(k).check() is None
    assert type(big.tune(k, {"cublas"})) is GemmTc  # held: gemm_tc
    assert type(GemmTc("x", "w", "f16", Dst("y"), 4096, 4096, 2048).tune(k)) is GemmTc  # f16 rows: gemm_tc's
    assert type(GemmTc("x", "w", "bf16", Dst("y"), 4100, 4096, 2048).tune(k)) is GemmTc  # k not 16-byte rows
    small = GemmTc("x", "w", "bf16", Dst("y"), 4096, 4096, 64)  # 32 tiles on 132 SMs: a quarter of cuBLAS's rate
    assert type(small.tune(k)) is GemmTc and small.tune(k).ksplit > 1
    glu = GemmTcGlu("x", "wg", "wu", "bf16", "o", 4096, 12288, 2048)
    parts = GemmTcParts("x", "bf16", 4096, 2048, (GemmPart("wq", Dst("q"), 4096), GemmPart("wk", Dst("k"), 1024)))
    assert isinstance(glu.tune(k), GemmBlasGlu) and isinstance(parts.tune(k), GemmBlasParts)
    assert prefer(glu, Knobs(tflops_blas=300.0)) is glu  # an assumed rate below gemm_tc's: never


# -- the lane ---------------------------------------------------------------------------------------------------------

ONE_SM = Knobs(tc_rows=16, sms=1, hbm_gbps=1e9, launch_us=0.01, blas_call_us=0.0)  # a chip whose products are bound by flops (its
# launches nearly free: the cuBLAS forms' more launches a product do not decide): cuBLAS's rate pays


def _census(p):
    return {k: v for k, v in p.census.items() if k.startswith("gemm")}


def test_a_tiny_bf16_prefill_and_batch_choose_cublas_and_hold_it_back(tmp_path):
    """A tiny bf16 Qwen3's 16-row chunk and a batch of 16 sequences on a chip where flops bind: every product
    of bf16 rows through cuBLAS (gemm_blas for o and down, _parts for q/k/v, _glu for gate/up; the batch's f32
    head stays gemm_tc); --hold cublas gives gemm_tc's
    plan, launch for launch; under the default chip the tiny products stay gemm_tc (bound by their bytes: a tie);
    the decode plan of one row is the same plan either way."""
    from test_gemm_tc_lane import bf16_model

    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.lower.planfile import load, save

    cfg, _ = bf16_model()
    L = cfg.layers
    for g in (cfg.build_step(16), cfg.build_step(1, batch=16)):
        blas, held = plan(g, knobs=ONE_SM), plan(g, knobs=ONE_SM, held=["cublas"])
        got = {k: v for k, v in _census(blas).items() if k.startswith("gemm_blas")}
        assert got == {"gemm_blas": 2 * L, "gemm_blas_parts": L, "gemm_blas_glu": L}, _census(blas)
        assert all(x.launch.format != "bf16" for x in blas.launches if x.launch.census == "gemm_tc")  # f32 head
        assert {"gemm_tc_parts": L, "gemm_tc_glu": L}.items() <= _census(held).items()
        assert not any(k.startswith("gemm_blas") for k in held.census) and "cublas" in held.held
        assert len(blas.launches) == len(held.launches) and blas.cost_us < held.cost_us
        assert not any(k.startswith("gemm_blas") for k in plan(g, knobs=Knobs(tc_rows=16)).census)
    saved = tmp_path / "blas.json"  # a plan that travels to a device keeps its cuBLAS launches
    save(blas, str(saved))
    assert [x.launch for x in load(str(saved)).launches] == [x.launch for x in blas.launches]
    one = cfg.build_step(1)
    assert plan(one, knobs=ONE_SM).census == plan(one, knobs=ONE_SM, held=["cublas"]).census == plan(one).census


def test_the_tokens_and_logits_of_cublas_plans_are_gemm_tcs():
    """The cuBLAS forms run gemm_tc's twins: a 21-token prompt (chunks of 16 and 5 rows) and 4 greedy steps give the
    held plan's logits to the bit through the exact twins, and the same tokens through the fast ones."""
    from test_gemm_tc_lane import bf16_model

    gives_the_held_plans_tokens(*bf16_model(), ONE_SM, "cublas", 4)


def gives_the_held_plans_tokens(cfg, w, knobs, step: str, steps: int) -> None:
    """A 21-token prompt (chunks of 16 and 5 rows) and `steps` greedy steps under `knobs`: the plan gives the plan
    with schedule step `step` held the same tokens and logits to the bit through the exact twins, and the same tokens
    through the fast ones."""
    from lanefuse.lane.lower.plan import PlanOptions
    from lanefuse.lane.run.generate import generate
    from lanefuse.lane.run.step import plan_step_fn

    prompt = [int(t) for t in np.random.default_rng(5).integers(1, cfg.vocab, 21)]

    def run(held, exact):
        fn, _ = plan_step_fn(w, "cpu", PlanOptions(knobs=knobs, held=held), exact=exact)
        return generate(cfg, w, prompt, steps, step_fn=fn, chunk=16)

    new, kept = run((), True), run((step,), True)
    assert new.generated_ids == kept.generated_ids
    for a, b in zip(new.logits, kept.logits):
        np.testing.assert_array_equal(a, b)
    assert run((), False).generated_ids == new.generated_ids


def test_the_qwen3_8b_prefill_plan_takes_cublas_the_batch_of_64_keeps_gemm_tc():
    """The Qwen3-8B shape (config only) under the default chip: a 512-row chunk's products through cuBLAS (the lane's
    assumed 692 TFLOP/s at whole waves against gemm_tc's waves, gemm_tc.tc_waves), its held plan gemm_tc's; a batch
    of 64 sequences keeps gemm_tc for q/k/v (48 tiles, a lone block an SM) and the o and down products (a quarter-
    filled wave of cuBLAS tiles and a call's fixed cost price above gemm_tc's tail split), its GLU through cuBLAS (a
    near tie: bench/gemm_model.py predicts that step within 0.5% of the held one's)."""
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import gemm_model

    s, held = gemm_model.prefill_plan(512), gemm_model.prefill_plan(512, held=["cublas"])
    assert _census(s) == {"gemm_blas": 72, "gemm_blas_glu": 36, "gemm_tc_parts": 36}, _census(s)
    assert _census(held) == {"gemm_tc": 72, "gemm_tc_glu": 36, "gemm_tc_parts": 36}, _census(held)
    p, q = gemm_model.plan_prediction(s), gemm_model.plan_prediction(held)
    assert p["step_us"] < q["step_us"] and p["gemm_launches"] == q["gemm_launches"] == 144
    b64, b64_held = gemm_model.batch_plan(64), gemm_model.batch_plan(64, held=["cublas"])
    assert _census(b64) == {"gemm_tc": 73, "gemm_tc_parts": 36, "gemm_blas_glu": 36}, _census(b64)
    p, q = gemm_model.plan_prediction(b64, pos=512), gemm_model.plan_prediction(b64_held, pos=512)
    assert p["step_us"] < 1.005 * q["step_us"]


def test_the_gpu_tests_host_side_on_the_stand_in(device):
    """tests/test_gemm_blas_gpu.py's cases run here against the stand-in device (its cuBLAS sums exactly), so a
    device run spends its time on cuBLAS, not on the tests' bugs (the capture test needs a real graph: not here)."""
    import test_gemm_blas_gpu as t

    calls, _ = device
    for m, n, k in [(16, 8, 16), (19, 24, 37), (17, 100, 80), (130, 33, 72)]:
        t.test_gemm_blas_within_the_bound(m, n, k)
    for dst in (Dst("y", unit=Part(23, 2, 19)), Dst("y", row="pos", pitch=19), Dst("y"), Dst("y", row=2, pitch=19)):
        for epilogue in (True, False):
            t.test_gemm_blas_epilogue_and_destinations(dst, epilogue)
    t.test_gemm_blas_residual_in_place()
    t.test_gemm_blas_parts_and_glu()
    assert len(calls) == 2 * 4 + 8 + 1 + 3 + 2
