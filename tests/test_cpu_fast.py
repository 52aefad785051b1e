"""The fast numpy runner (what `lanefuse run` uses on the CPU: f32 BLAS on weights decoded once) against the exact
twins (the kernels' sums imitated in f64, what `lanefuse check`, LANEFUSE_CHECK=2 and the GPU tests use): each fast
twin on odd shapes and destinations, and whole generations — the same greedy tokens, logits within FAST_TOL of their
scale. The fast runner allocates no array a launch in its hot path beyond what it states."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lanefuse.engine.front.demo import demo_model, random_arrays
from lanefuse.engine.front.model import ModelConfig, build_step
from lanefuse.engine.front.weights import Weights, f32_to_bf16
from lanefuse.kernels import (Attention, Dst, Fold, GemmPart, GemmParts, Gemv, GemvF32, GemvGlu, HostEnv, Norm,
                              Part)
from lanefuse.kernels.common import encode
from lanefuse.lane.lower.plan import plan
from lanefuse.lane.run.generate import generate, new_caches
from lanefuse.lane.run.numpy_runner import NumpyRunner
from lanefuse.lane.run.step import make_runner, plan_step_fn

FAST_TOL = 1e-4  # f32 rounding of sums against the exact twin's f64 sums, relative to the values' scale
SENTINEL = -777.0


def r32(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


def twins(launch, arrays, weights):
    """Both twins of `launch` on copies of the same env: (exact env, fast env). The fast twin bound ahead
    (`bind_fast`: the fast runner binds each launch once and calls it every step) reads its parameters (a position, a
    batch's positions) when called, not when bound: bound while they hold other values, it writes what `fast` does,
    bit for bit."""
    envs = []
    for how in ("numpy", "fast", "bound"):
        env = HostEnv({k: v.copy() for k, v in arrays.items()}, dict(weights))
        if how == "bound":
            ints = [v for v in env.arrays.values() if v.dtype == np.int32]
            for v in ints:
                v += 1  # other positions when bound
            call = launch.bind_fast(env)
            for v in ints:
                v -= 1
            call()
        else:
            getattr(launch, how)(env)
        envs.append(env)
    exact, fast, bound = envs
    for n, a in fast.arrays.items():
        assert np.array_equal(a, bound.arrays[n], equal_nan=True), f"`{n}`: the bound fast twin differs from `fast`"
    return exact, fast


def agree(exact, fast, names):
    for n in names:
        want, got = exact.array(n), fast.array(n)
        assert np.array_equal(want == SENTINEL, got == SENTINEL), f"`{n}`: written in other places"
        scale = max(float(np.max(np.abs(want[want != SENTINEL]), initial=0.0)), 1.0)
        assert float(np.max(np.abs(got.astype(np.float64) - want))) <= FAST_TOL * scale, n


def dst(kind: str, rows: int, n: int):
    """(Dst, its buffer, env extras): a buffer of its own, rows of a table from a row `at` names, parts of units."""
    if kind == "own":
        return Dst("y"), np.full(rows * n, SENTINEL, np.float32), {}
    if kind == "table":
        return Dst("y", row="at", pitch=n), np.full((rows + 5) * n, SENTINEL, np.float32), {
            "at": np.array([3], np.int32)}
    return Dst("y", unit=Part(n + 7, 4, n)), np.full(rows * (n + 7), SENTINEL, np.float32), {}


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("m,k,n", [(1, 7, 5), (3, 64, 33), (9, 129, 17)])
@pytest.mark.parametrize("where", ["own", "table", "unit"])
@pytest.mark.parametrize("split", [1, 2])
def test_gemv_fast(fmt, m, k, n, where, split):
    g = np.random.default_rng(m * k + n)
    d, buf, extra = dst(where, m, n)
    arrays = {"x": r32(g, m, k), "y": buf, **extra}
    weights = {"w": (encode(r32(g, n, k), fmt), fmt), "b": (r32(g, n), "f32")}
    exact, fast = twins(Gemv("x", "w", fmt, d, k, n, m, bias="b", split=split), arrays, weights)
    agree(exact, fast, ["y"])
    exact, fast = twins(GemvF32("x", "w", d, k, n, m, split=split), arrays,
                        {"w": (r32(g, n, k).reshape(-1), "f32")})
    agree(exact, fast, ["y"])


@pytest.mark.parametrize("m", [1, 4])
def test_gemm_parts_fast(m):
    g = np.random.default_rng(m)
    k = 40
    arrays = {"x": r32(g, m, k), "a": np.full(m * 12, SENTINEL, np.float32),
              "t": np.full(9 * 20, SENTINEL, np.float32), "pos": np.array([2], np.int32)}
    parts = (GemmPart("wa", Dst("a", unit=Part(12, 2, 8)), 8, bias="ba"),
             GemmPart("wt", Dst("t", row="pos", pitch=20), 20))
    weights = {"wa": (encode(r32(g, 8, k), "bf16"), "bf16"), "wt": (encode(r32(g, 20, k), "bf16"), "bf16"),
               "ba": (r32(g, 8), "f32")}
    exact, fast = twins(GemmParts("x", "bf16", k, m, parts), arrays, weights)
    agree(exact, fast, ["a", "t"])


@pytest.mark.parametrize("act", ["silu", "sigmoid", "gelu"])
@pytest.mark.parametrize("m,bias", [(1, False), (3, True)])
def test_gemv_glu_fast(act, m, bias):
    g = np.random.default_rng(7)
    k, n = 33, 50
    arrays = {"x": 4 * r32(g, m, k), "o": np.full(m * n, SENTINEL, np.float32)}
    weights = {"wg": (encode(r32(g, n, k), "f16"), "f16"), "wu": (encode(r32(g, n, k), "f16"), "f16"),
               "bg": (r32(g, n), "f32"), "bu": (r32(g, n), "f32")}
    launch = GemvGlu("x", "wg", "wu", "f16", "o", k, n, m, act=act, bg="bg" if bias else None,
                     bu="bu" if bias else None)
    exact, fast = twins(launch, arrays, weights)
    agree(exact, fast, ["o"])


@pytest.mark.parametrize("heads,kv,hd,vd", [(4, 2, 8, 8), (6, 1, 16, 6), (8, 2, 64, 64)])
@pytest.mark.parametrize("rows,pos", [(1, 0), (1, 13), (3, 9)])
@pytest.mark.parametrize("window,sinks,splits", [(0, False, 1), (5, False, 2), (0, True, 3), (4, True, 1)])
def test_attention_fast(heads, kv, hd, vd, rows, pos, window, sinks, splits):
    g = np.random.default_rng(heads * hd + pos)
    L = 20
    arrays = {"q": r32(g, rows * heads * hd), "kc": r32(g, L * kv * hd), "vc": r32(g, L * kv * vd),
              "pos": np.array([pos], np.int32), "o": np.full(rows * heads * vd, SENTINEL, np.float32)}
    launch = Attention("q", "kc", "vc", "pos", "o", heads, heads // kv, hd, vd, L, rows, hd ** -0.5, window=window,
                       sinks="sk" if sinks else None, splits=splits)
    exact, fast = twins(launch, arrays, {"sk": (r32(g, heads), "f32")})
    agree(exact, fast, ["o"])


def test_attention_fast_keys_and_values_as_halves_of_one_row():
    g = np.random.default_rng(5)
    heads, kv, hd, L, pos = 4, 2, 8, 12, 7
    row = 2 * kv * hd + 3
    arrays = {"q": r32(g, heads * hd), "c": r32(g, L * row), "pos": np.array([pos], np.int32),
              "o": np.full(heads * hd, SENTINEL, np.float32)}
    launch = Attention("q", "c", "c", "pos", "o", heads, heads // kv, hd, hd, L, 1, 0.3, kstride=row, koff=1,
                       vstride=row, voff=1 + kv * hd)
    exact, fast = twins(launch, arrays, {})
    agree(exact, fast, ["o"])


def test_fold_fast_runs_both_fast_twins():
    g = np.random.default_rng(2)
    k, n = 24, 16
    arrays = {"x": r32(g, k), "y": np.zeros(n, np.float32), "r": r32(g, n), "s": np.zeros(n, np.float32),
              "o": np.zeros(n, np.float32)}
    f = Fold(Gemv("x", "w", "f32", Dst("y"), k, n, 1), Norm("r", "nw", "o", 1, n, 1e-6, add="y", sum="s"))
    exact, fast = twins(f, arrays, {"w": (r32(g, n, k), "f32"), "nw": (r32(g, n), "f32")})
    agree(exact, fast, ["y", "s", "o"])
    assert f.fast_temp() == 2 * n  # the norm's: a sum and a result, where they have no place of their own


# -- whole runs -------------------------------------------------------------------------------------------------------

MODELS = {
    "qwen2_bias_tied": ModelConfig("Qwen2ForCausalLM", 64, 2, 4, 2, 16, 128, 120, qkv_bias=True, rope_theta=1e6,
                                   tie_embeddings=True, max_len=64, name="tiny-qwen2"),
    "qwen3_bf16": ModelConfig("Qwen3ForCausalLM", 64, 2, 4, 1, 32, 96, 100, qk_norm=True, max_len=64,
                              formats=(("model.layers.0.mlp.up_proj.weight", "bf16"),
                                       ("model.layers.1.self_attn.q_proj.weight", "bf16")), name="tiny-qwen3"),
    "llama_partial": ModelConfig("LlamaForCausalLM", 64, 1, 4, 4, 16, 64, 90, partial_rotary=0.5, max_len=64,
                                 name="tiny-partial"),
    "mistral_window": ModelConfig("MistralForCausalLM", 48, 2, 3, 1, 16, 37, 90, window=3, max_len=64,
                                  name="tiny-mistral"),
}


def _weights(cfg: ModelConfig) -> Weights:
    arrays = random_arrays(cfg, seed=11)
    for name, fmt in cfg.formats:
        arrays[name] = f32_to_bf16(arrays[name])
    return Weights.from_dict(arrays, cfg)


def _gen(cfg, w, prompt, n, exact: bool):
    fn, _ = plan_step_fn(w, "cpu", exact=exact)
    return generate(cfg, w, prompt, n, step_fn=fn, chunk=4)


def _rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(np.max(np.abs(b)), 1e-30))


def _fast_against_exact(cfg, w, prompt, n):
    fast, exact = _gen(cfg, w, prompt, n, False), _gen(cfg, w, prompt, n, True)
    assert fast.generated_ids == exact.generated_ids
    err = max(_rel(a, b) for a, b in zip(fast.logits, exact.logits))
    assert err <= FAST_TOL, err
    return err, exact.generated_ids


def test_demo_fast_runner_matches_exact_32_tokens():
    cfg, w = demo_model()
    err, ids = _fast_against_exact(cfg, w, list(range(1, 10)), 32)  # a prefill of 4-row chunks, then decode
    assert len(set(ids)) > 4  # the tokens are not one repeated value
    print(f"\ndemo: fast runner against exact twins, max |diff| / max |logits| = {err:.2e}")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_fast_runner_matches_exact(name):
    cfg = MODELS[name]
    _fast_against_exact(cfg, _weights(cfg), [3, 1, 4, 1, 5], 12)


def test_runner_choice():
    """`lanefuse run` on the CPU gets the fast runner; a check (LANEFUSE_CHECK=2) or `exact` the exact twins; a
    NumpyRunner made directly (`lanefuse check`, the GPU tests) is exact unless told otherwise."""
    cfg, w = demo_model()
    s = plan(build_step(cfg, 1))
    assert not make_runner(s, w, "cpu").exact
    assert make_runner(s, w, "cpu", check=True).exact
    assert make_runner(s, w, "cpu", exact=True).exact
    assert NumpyRunner(s, w).exact
    assert plan_step_fn(w, "cpu")[1] == "fused plan, numpy backend"
    assert "exact" in plan_step_fn(w, "cpu", exact=True)[1]


def test_fast_step_reuses_its_arrays():
    """A second decode step at another position writes into the same arena and reads the same decoded weights: no
    weight decoded again, the arena not reallocated, the temporaries a tail of the arena."""
    cfg, w = demo_model()
    s = plan(build_step(cfg, 1))
    r = NumpyRunner(s, w, exact=False)
    env = new_caches(cfg)
    for p in (0, 1):
        env["token"], env["pos"] = np.array([5 + p], np.int32), np.array([p], np.int32)
        r.step(env)
        if p == 0:
            arena, mats = r.env.arena, {n: r.env.matrix(n) for n in s.constants}
    assert r.env.arena is arena
    assert all(np.shares_memory(r.env.matrix(n), m) for n, m in mats.items())
    assert r.env.temp(1).base is not None and np.shares_memory(r.env.temp(1), r.env.arena)


def test_stacked_weights_are_decoded_once_for_every_plan():
    """Products in parts (q, k, v; gate and up) read one stacked f32 matrix, the same for the decode step's plan and
    a prefill chunk's: decoded once from the stored rows (bf16 here)."""
    cfg = MODELS["qwen3_bf16"]
    w = _weights(cfg)
    runners = [NumpyRunner(plan(build_step(cfg, rows)), w, exact=False) for rows in (1, 4)]
    names = ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")
    a, b = (r.env.stacked(names) for r in runners)
    assert a is b and a.dtype == np.float32
    assert np.array_equal(a.reshape(2 * cfg.inter, cfg.hidden)[cfg.inter:], w.get(names[1]))


def test_a_tall_stack_is_read_through_its_columns():
    """A stacked product of at least COLUMNS_TALL outputs a value of k (gate and up here) reads its matrix stored
    transposed, decoded once straight into that layout and shared by the plans: `rows_at` gives the (n, k) view of it
    (the same values as the rows); a single matrix, a wide stack, and an env that streams its weights read rows."""
    from lanefuse.kernels.gemv import COLUMNS_TALL, rows_at

    cfg = MODELS["qwen3_bf16"]
    w = _weights(cfg)
    runners = [NumpyRunner(plan(build_step(cfg, rows)), w, exact=False) for rows in (1, 4)]
    names = ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")
    n, k = 2 * cfg.inter, cfg.hidden
    assert n >= COLUMNS_TALL * k
    views = [rows_at(r.env, names, n, k) for r in runners]
    assert views[0].base is views[1].base and views[0].flags.f_contiguous and not views[0].flags.c_contiguous
    assert np.array_equal(views[0], runners[0].env.stacked(names).reshape(n, k))
    assert rows_at(runners[0].env, names[:1], n // 2, k).flags.c_contiguous  # one matrix: its rows as stored
    down = ("model.layers.0.mlp.down_proj.weight",) * 2
    assert rows_at(runners[0].env, down, 2 * cfg.hidden, cfg.inter).flags.c_contiguous  # wide: rows
    runners[0].env.stream = True
    assert callable(rows_at(runners[0].env, names, n, k))
    runners[0].env.stream = False


@pytest.mark.parametrize("heads,add,sum_,where,part", [(1, False, False, "own", False), (1, True, True, "own", False),
                                                      (4, False, False, "table", True), (2, True, False, "unit", False),
                                                      (1, False, True, "own", True)])
def test_norm_fast(heads, add, sum_, where, part):
    g = np.random.default_rng(heads)
    rows, cols = 3, 32
    d, buf, extra = dst(where, rows, cols)
    wide = cols + 5
    arrays = {"x": r32(g, rows * (wide if part else cols)), "a": r32(g, rows * cols), "y": buf,
              "s": np.full(rows * cols, SENTINEL, np.float32), **extra}
    launch = Norm("x", "nw", "y", rows, cols, 1e-5, heads=heads, part=Part(wide, 3, cols) if part else None,
                  add="a" if add else None, sum="s" if sum_ else None, into=d)
    exact, fast = twins(launch, arrays, {"nw": (r32(g, cols // heads), "f32")})
    agree(exact, fast, ["y", "s"])


@pytest.mark.parametrize("rows,norm,rot,where,part", [(1, False, 8, "own", False), (3, True, 8, "table", True),
                                                      (2, True, 4, "unit", False), (1, False, 4, "table", True)])
def test_rope_fast(rows, norm, rot, where, part):
    from lanefuse.kernels.rope import RopeParts, RopeSide

    g = np.random.default_rng(rows + rot)
    heads, hd, ctx = 2, 8, 12
    n = heads * hd
    d, buf, extra = dst(where, rows, n)
    wide = 3 * n
    arrays = {"x": r32(g, rows * (wide if part else n)), "k": r32(g, rows * n), "y": buf,
              "y2": np.full(rows * n, SENTINEL, np.float32), "pos": np.array([5], np.int32), **extra}
    sides = (RopeSide("x", d, heads, Part(wide, n, n) if part else None, ("nw", 1e-6) if norm else None),
             RopeSide("k", Dst("y2"), heads))
    ang = g.uniform(0, 3, size=(ctx, rot // 2))
    weights = {"cos": (np.cos(ang).astype(np.float32).reshape(-1), "f32"),
               "sin": (np.sin(ang).astype(np.float32).reshape(-1), "f32"), "nw": (r32(g, hd), "f32")}
    exact, fast = twins(RopeParts(sides, "cos", "sin", "pos", rows, hd, rot), arrays, weights)
    agree(exact, fast, ["y", "y2"])


def test_a_few_rows_multiply_as_gemvs():
    """A product of 1 or 2 rows runs as GEMVs (OpenBLAS's GEMM of a few rows costs 2-3.6 GEMVs), of more as one GEMM;
    each way the same values as the GEMM to f32 rounding."""
    from lanefuse.kernels.gemv import bound_product, by_gemvs

    assert by_gemvs(1) and by_gemvs(2) and not by_gemvs(3)
    g = np.random.default_rng(2)
    w = r32(g, 64, 96)
    for m in (2, 3):
        x, out = r32(g, m, 96), np.empty((m, 64), np.float32)
        call = bound_product(x, w, out)
        assert (getattr(call, "__name__", "") == "gemvs") == by_gemvs(m)
        call()
        assert np.abs(out - x @ w.T).max() <= FAST_TOL * np.abs(x @ w.T).max()


@pytest.mark.parametrize("fmt,family", [("bf16", "qwen3"), ("f16", "qwen3"), ("q8_0", "qwen3"), ("q4_0", "qwen3"),
                                        ("bf16", "qwen3_moe"), ("f16", "qwen3_moe")])
def test_streamed_weights_decode_into_one_buffer(monkeypatch, fmt, family):
    """Past the decode budget the fast runner decodes each launch's bf16/f16/q8_0/q4_0 rows as it runs, into one buffer
    made once (each constant of a launch its own part of it: a mixture's launch reads its router, experts and shared
    expert at once), never kept: the same greedy tokens as decoding once, logits within f32 rounding."""
    from lanefuse.engine.front.model import build_step as build
    from lanefuse.engine.front.stepweights import random_weights
    from lanefuse.lane.run import numpy_runner
    from lanefuse.lane.run.constants import streamed_bytes

    if family == "qwen3":
        cfg = ModelConfig("Qwen3ForCausalLM", 64, 2, 4, 1, 32, 96, 100, qk_norm=True, max_len=64, name="tiny-qwen3")
    else:
        from lanefuse.engine.front.families.mixtures import MoeConfig

        cfg = ModelConfig("Qwen3MoeForCausalLM", 32, 2, 4, 2, 8, 40, 64, qk_norm=True, max_len=32,
                          moe=MoeConfig(experts=8, k=2, inter=37, norm_topk=True, sparse=(0, 1)))
    base = random_weights(build(cfg, 1), 5)
    stored = [n for n, (a, _) in base.store.arrays.items() if a.ndim >= 2 and n.startswith("model.layers.")]
    cfg = dataclasses.replace(cfg, formats=tuple((n, fmt) for n in stored))
    arrays = {n: (encode(a, fmt), fmt) if n in stored else a for n, (a, _) in base.store.arrays.items()}
    once = _gen(cfg, Weights.from_dict(arrays, cfg), [3, 1, 4, 1, 5], 8, False)
    w = Weights.from_dict(arrays, cfg)
    made = []

    class Streamed(NumpyRunner):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(numpy_runner, "decode_once", lambda p, budget=None: False)
    monkeypatch.setattr(numpy_runner, "NumpyRunner", Streamed)
    streamed = _gen(cfg, w, [3, 1, 4, 1, 5], 8, False)
    assert made and all(r.streamed and r.env._stream is not None for r in made)
    assert all(r.env._stream.size == streamed_bytes(r.s) > 0 for r in made)
    assert streamed.generated_ids == once.generated_ids
    assert max(_rel(a, b) for a, b in zip(streamed.logits, once.logits)) <= 1e-5
    assert not [n for n in stored if n in w._f32]  # nothing decoded was kept


@pytest.mark.parametrize("fmt", ["bf16", "f16", "q8_0", "q4_0", "q4_k", "f32"])
def test_decode_into_gives_decode_s_values(fmt):
    """The streamed path's decode into an array given writes exactly what `decode` returns, there and nowhere else."""
    from lanefuse.kernels.common import decode
    from lanefuse.lane.run.constants import IN_PLACE

    assert (fmt in IN_PLACE) == (fmt in ("bf16", "f16", "q8_0", "q4_0"))
    a = r32(np.random.default_rng(9), 5, 256) * 7
    raw = encode(a, fmt)
    out = np.full(a.size + 3, SENTINEL, np.float32)
    assert decode(raw, fmt, out[: a.size]) is not None
    assert np.array_equal(out[: a.size], np.asarray(decode(raw, fmt), np.float32).reshape(-1))
    assert np.all(out[a.size:] == SENTINEL)
