"""Each fast twin (the CPU runner's f32 path) against the exact twin (the kernels' sums in f64, equal to the reference
interpreter) launch by launch, on adversarial values: every f32 activation a launch reads scaled huge, tiny or into
denormals, or one value of it made inf or NaN, then both twins run from the same arena and their writes compared
(NaN where the exact twin's NaN, the same infinities, finite values within f32 rounding of their scale). Cases: every
launch kind with a fast twin, taken from the plans of the families' tiny shapes (tests/gpu_families.py) under both
lanes. A whole step of the fast runner with huge activations gives the reference's tokens."""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("egglog")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

from test_hardening_fast import LANES, copy_env, family_step  # noqa: E402

FAMS = ("llama", "qwen3", "gemma2", "gemma3", "qwen3_moe", "qwen2_moe", "gpt_oss", "phi3", "qwen3_next",
        "deepseek_v3")
TRANSFORMS = ("huge", "big", "edge", "max", "tiny", "denormal", "inf", "-inf", "nan", "zero")


def has_fast(launch) -> bool:
    return has_fast_class(type(launch))


def has_fast_class(cls) -> bool:
    from lanefuse.kernels import Launch

    return cls.bind_fast is not Launch.bind_fast or cls.fast is not Launch.fast


@functools.lru_cache(maxsize=None)
def cases() -> dict[str, list]:
    """census kind -> [(plan, weights, launch index, the state before it: arena bytes, tables, io)], a few of each
    kind from every family's decode step and 4-row chunk under both lanes, and from a q8_0 model's under q8 and
    q8x2 numerics (the fast twins of quantized activations)."""
    from test_hardening_check import q8_step

    from lanefuse.lane.lower.knobs import Knobs
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.numpy_runner import ArenaEnv

    steps = [(family_step, fam, lane, rows, "f32") for fam in FAMS for lane in LANES for rows in (1, 4)]
    steps += [(lambda _, rows: q8_step(rows), "q8_0", "cuda", rows, numerics) for rows in (1, 4)
              for numerics in ("q8", "q8x2")]
    steps += [(tc_step, "demo", "cuda", 16, "f32")]  # the tensor-core GEMMs (knob tc_rows): a 16-row chunk
    out: dict[str, list] = {}
    taken: dict[tuple[str, str], int] = {}
    for make, fam, lane, rows, numerics in steps:
        g, w, env0 = make(fam, rows)
        s = plan(g, lane=lane, numerics=numerics, **({"knobs": Knobs(tc_rows=16)} if make is tc_step else {}))
        env = ArenaEnv(s, w, copy_env({n: env0[n] for n in s.io.tables}), exact=True)
        for n in (s.io.token, s.io.position):
            env.array(n)[:] = np.asarray(env0[n], np.int32).reshape(-1)
        for i, x in enumerate(s.launches):
            kind = x.launch.census
            if has_fast(x.launch) and taken.get((kind, numerics), 0) < (12 if numerics == "f32" else 4):
                taken[kind, numerics] = taken.get((kind, numerics), 0) + 1
                out.setdefault(kind, []).append((s, w, i, env.arena.copy(), copy_env(env.tables),
                                                 {k: v.copy() for k, v in env.io.items()}))
            x.launch.numpy(env)
    return out


def tc_step(_, rows: int):
    """The demo's shape (2 layers) as a chunk of `rows` rows with 4 rows of cache history."""
    from lanefuse.engine.front.demo import demo_config, random_arrays
    from lanefuse.engine.front.model import build_step
    from lanefuse.engine.front.weights import Weights

    cfg = dataclasses.replace(demo_config(64), layers=2)
    g = build_step(cfg, rows)
    rng = np.random.default_rng(rows)
    env = {n: np.zeros(g.tensors[n].shape, np.float32) for n in g.io.tables}
    for t in env.values():
        t[:4] = 0.5 * rng.standard_normal(t[:4].shape)
    env[g.io.token] = rng.integers(0, cfg.vocab, rows).astype(np.int32)
    env[g.io.position] = np.asarray([4], np.int32)
    return g, Weights.from_dict(random_arrays(cfg), cfg), env


def _env(case, exact: bool):
    from lanefuse.lane.run.numpy_runner import ArenaEnv

    s, w, i, arena, tables, io = case
    temp = 0 if exact else s.launches[i].launch.fast_temp()
    env = ArenaEnv(s, w, copy_env(tables), exact=exact, temp=temp)
    env.arena[: arena.size - (arena.size - s.arena.bytes - (-s.arena.bytes % 64))] = arena[: s.arena.bytes + (-s.arena.bytes % 64)]
    env.io.update({k: v.copy() for k, v in io.items()})
    return env


def activations(s, launch) -> list[str]:
    """The f32 step-local arrays (not constants, token or position) a launch reads."""
    out = []
    for n in launch.reads():
        b = s.buffers.get(n)
        if b is None or n in s.constants or b.dtype != "f32" or n in (s.io.token, s.io.position):
            continue
        out.append(n)
    return out


def perturb(a: np.ndarray, how: str, at: int) -> None:
    """Array `a` (f32, in place) made adversarial."""
    if not a.size:
        return
    if how == "huge":
        a *= np.float32(1e20)
    elif how == "big":
        a *= np.float32(1e30)
    elif how in ("edge", "max"):  # its largest value a tenth of f32's largest, or nine tenths
        top = float(np.max(np.abs(a[np.isfinite(a)]), initial=0.0))
        if top > 0:
            a *= np.float32((3.4e37 if how == "edge" else 3.0e38) / top)
    elif how == "tiny":
        a *= np.float32(1e-30)
    elif how == "denormal":
        a *= np.float32(1e-41)
    elif how == "zero":
        a[:] = 0
    else:
        a[at % a.size] = {"inf": np.inf, "-inf": -np.inf, "nan": np.nan}[how]


def compare(want: np.ndarray, got: np.ndarray, what: str) -> None:
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    nan_w, nan_g = np.isnan(want), np.isnan(got)
    assert (nan_w == nan_g).all(), f"{what}: NaN at {np.flatnonzero(nan_w != nan_g)[:5]} in one twin only"
    inf_w, inf_g = np.isinf(want), np.isinf(got)
    bad = (inf_w != inf_g) | (inf_w & (np.sign(want) != np.sign(got)))
    assert not bad.any(), (f"{what}: infinite in one twin only at {np.flatnonzero(bad)[:5]}: exact "
                           f"{want[bad][:3]}, fast {got[bad][:3]}")
    fin = np.isfinite(want)
    if fin.any():
        scale = float(np.max(np.abs(want[fin])))
        err = float(np.max(np.abs(got[fin] - want[fin])))
        assert err <= 1e-3 * scale + 1e-37, f"{what}: max |fast - exact| {err:.3g} at values up to {scale:.3g}"


def run_case(case, name: str | None, how: str, at: int) -> None:
    s, i = case[0], case[2]
    launch = s.launches[i].launch
    exact, fast = _env(case, True), _env(case, False)
    for env in (exact, fast):
        if name is not None:
            perturb(env.array(name), how, at)
    with np.errstate(all="ignore"):
        launch.numpy(exact)
        launch.bind_fast(fast)()
    for n in launch.writes():
        b = s.buffers.get(n)
        if b is None or b.dtype != "f32":
            continue
        compare(exact.array(n), fast.array(n), f"launch {i} ({launch.census}) `{n}` after {how} `{name}`")


KINDS = ("norm", "rope", "rope_parts", "attention", "gemv", "gemv_glu", "gemm_parts", "fold", "head_gemv", "moe",
         "gemm_tc", "gemm_tc_parts", "gemm_tc_glu", "chain")
# kinds no plan here makes whose fast twin is other kinds' or another test's: covered there
COMPOSED = {"norm_pair": "two Norms",
            "gemv_f32": "gemv_bind as gemv's (test_the_fast_product_equals_the_reference_product)",
            "gemm_blas": "gemm_tc's twins (kernels/gemm_blas.py: cuBLAS runs the same product; tests/test_gemm_blas.py)",
            "gemm_blas_parts": "gemm_tc_parts' twins (tests/test_gemm_blas.py)",
            "gemm_blas_glu": "gemm_tc_glu's twins (tests/test_gemm_blas.py)",
            "gemm_deq": "gemm_tc's twins (kernels/gemm_deq.py: decoded rows, cuBLAS's product; tests/test_gemm_deq.py)",
            "gemm_deq_parts": "gemm_tc_parts' twins (tests/test_gemm_deq.py)",
            "gemm_deq_glu": "gemm_tc_glu's twins (tests/test_gemm_deq.py)"}


def test_every_kind_with_a_fast_twin_is_covered():
    """A launch kind that gets a fast twin is added to KINDS (and so to the adversarial comparison), or said in
    COMPOSED to run twins covered elsewhere."""
    import lanefuse.kernels as kpkg
    from lanefuse.lane.lower.planfile import _classes
    from lanefuse.kernels import Launch

    fast = {c.census for c in _classes().values() if isinstance(c, type) and issubclass(c, Launch)
            and c is not Launch and getattr(c, "census", None) and has_fast_class(c)}
    assert kpkg and fast - set(KINDS) - set(COMPOSED) == set()


@pytest.mark.parametrize("kind", KINDS)
def test_fast_twin_equals_exact_twin_on_adversarial_values(kind):
    got = cases().get(kind)
    if not got:
        pytest.skip(f"no {kind} launch with a fast twin in these plans")

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(st.integers(0, len(got) - 1), st.sampled_from(TRANSFORMS), st.integers(0, 1 << 20), st.integers(0, 7))
    def prop(c, how, at, which):
        case = got[c]
        launch = case[0].launches[case[2]].launch
        names = activations(case[0], launch)
        name = names[which % len(names)] if names else None
        # a chain's q/k/v phase feeds its attention in the same launch: its input scaled by s gives q and k both
        # scaled by s and scores by s^2, past f32's range from s = 1e20 (1e40 > 3.4e38), where the kernel's and the
        # fast twin's f32 scores are infinite and only the exact twin's f64 sums are not: no f32 twin can agree there
        # (the attention kind alone scales one of q, k, v). inf, NaN, tiny, denormal and zero still reach it.
        qkv = getattr(launch, "qkv", None)
        hypothesis.assume(not (qkv is not None and how in ("huge", "big", "edge", "max")
                               and name in activations(case[0], qkv.first)))
        run_case(case, name, how, at)

    prop()


@pytest.mark.parametrize("scale", [1e20, 1e-25])
def test_huge_and_tiny_activations_give_the_references_tokens(scale):
    """The demo model's embeddings scaled by 1e20 (each norm's f32 sum of squares overflowed: every logit 0, token 0
    every step) or by 1e-25 (squares underflow): the fast runner prints the reference's tokens."""
    from lanefuse.engine.front.demo import demo_config, random_arrays
    from lanefuse.engine.front.weights import Weights
    from lanefuse.lane.run.generate import generate
    from lanefuse.lane.run.step import plan_step_fn

    cfg = demo_config(64)
    arrays = random_arrays(cfg)
    arrays["model.embed_tokens.weight"] = arrays["model.embed_tokens.weight"] * np.float32(scale)
    w = Weights.from_dict(arrays, cfg)
    want = generate(cfg, w, [1, 2, 3], 4, chunk=4)
    step_fn, label = plan_step_fn(w, "cpu")
    assert "numpy" in label and "exact" not in label
    got = generate(cfg, w, [1, 2, 3], 4, step_fn=step_fn, chunk=4)
    assert got.generated_ids == want.generated_ids
    if scale > 1:  # the norms undo the scale: the reference's tokens wander (the tiny one's eps dominates)
        assert len(set(want.generated_ids)) > 1


SCALES = (1e-44, 1e-38, 1e-30, 1e-20, 1.0, 1e10, 1e19, 1e25, 1e30, 3e37)


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(1, 3), heads=st.integers(1, 3), hd=st.sampled_from([1, 2, 16, 64, 128]),
       scale=st.sampled_from(SCALES), eps=st.sampled_from([0.0, 1e-12, 1e-6]), seed=st.integers(0, 1 << 16),
       special=st.sampled_from([None, np.inf, -np.inf, np.nan, 0.0]))
def test_the_fast_rms_norm_equals_the_reference_norm(rows, heads, hd, scale, eps, seed, special):
    """RmsScale (the norm of kernels/norm.py's and kernels/rope.py's fast twins) against the reference interpreter's
    rmsnorm, per head, at every scale f32 holds, eps 0 included, with an inf, NaN or zero in a row."""
    from lanefuse.engine.interp import _rmsnorm
    from lanefuse.kernels.common import RmsScale

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, heads * hd)) * scale).astype(np.float32)
    if special is not None:
        x[rng.integers(rows), rng.integers(heads * hd)] = special
    w = (1.0 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
    with np.errstate(all="ignore"):
        want = _rmsnorm(x, w, eps, heads=heads)
        got = np.empty((rows, heads, hd), np.float32)
        RmsScale(rows, heads, hd, w, eps)(x.reshape(rows, heads, hd), got)
    compare(want, got.reshape(rows, heads * hd), f"rmsnorm of values near {scale:g} (eps {eps})")


@settings(max_examples=100, deadline=None)
@given(m=st.integers(1, 5), n=st.integers(1, 40), k=st.integers(1, 64), scale=st.sampled_from(SCALES),
       seed=st.integers(0, 1 << 16), special=st.sampled_from([None, np.inf, -np.inf, np.nan]))
def test_the_fast_product_equals_the_reference_product(m, n, k, scale, seed, special):
    """The GEMV family's f32 BLAS product (bound_product, every way it binds: one row, GEMVs, a GEMM, a bias)
    against the reference interpreter's matmul (f64 dots rounded to f32), near f32's largest values too, where a
    partial sum past it gave inf or NaN."""
    from lanefuse.engine.interp import _matmul
    from lanefuse.kernels.gemv import bound_product

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * scale).astype(np.float32)
    if special is not None:
        x[rng.integers(m), rng.integers(k)] = special
    w = rng.standard_normal((n, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32) if seed % 2 else None
    with np.errstate(all="ignore"):
        want = _matmul(x, w)
        if bias is not None:
            want = (want.astype(np.float64) + bias).astype(np.float32)
        got = np.empty((m, n), np.float32)
        bound_product(x, w, got, bias)()
    compare(want, got, f"a product of values near {scale:g}")
