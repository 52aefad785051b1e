"""The fast CPU runner `lanefuse run` takes (NumpyRunner(exact=False): f32 BLAS, launches bound once) against the
reference interpreter, on every family the front reads under every built-in lane, decode and a prefill chunk: the
same next token and logits within f32 rounding. `check` runs the same runner (tests/test_hardening_check.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from gpu_families import FAMILIES  # noqa: E402

pytest.importorskip("egglog")

LANES = ("cuda", "conservative")
TOL = 2e-4


def family_step(name: str, rows: int):
    """Family `name`'s tiny shape (tests/gpu_families.py, no transformers) as a step graph of `rows` rows, seeded
    weights for its constants, and an env with 4 rows of cache history."""
    from lanefuse.engine.front.hfconfig import config_from_hf
    from lanefuse.engine.front.model import build_step
    from lanefuse.engine.front.stepweights import random_weights

    stem, kw, *_ = FAMILIES[name]
    cfg = config_from_hf({"architectures": [f"{stem}ForCausalLM"], "max_position_embeddings": 128, **kw},
                         "config.json", max_len=32, name=name)
    g = build_step(cfg, rows)
    w = random_weights(g, 7)
    rng = np.random.default_rng(rows)
    env = {}
    for n in g.io.tables:
        t = np.zeros(g.tensors[n].shape, np.float32)
        t[:4] = 0.5 * rng.standard_normal(t[:4].shape)
        env[n] = t
    vocab = g.tensors[g.io.logits].shape[-1]
    env[g.io.token] = rng.integers(0, vocab, g.tensors[g.io.token].shape[0]).astype(np.int32)
    env[g.io.position] = np.asarray([4], np.int32)
    return g, w, env


def copy_env(env):
    return {k: np.array(v, copy=True) for k, v in env.items()}


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_fast_runner_agrees_with_the_reference(family, lane):
    from lanefuse.engine.interp import evaluate
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    for rows in (1, 4):
        g, w, env = family_step(family, rows)
        ref = evaluate(g, w, copy_env(env))
        s = plan(g, lane=lane)
        got = NumpyRunner(s, w, exact=False).step(copy_env(env))
        want = np.asarray(ref[g.io.logits], np.float64).reshape(got[g.io.logits].shape)
        err = float(np.max(np.abs(got[g.io.logits] - want)) / np.max(np.abs(want)))
        assert err <= TOL, (family, lane, rows, err)
        assert int(got[g.io.next].reshape(-1)[0]) == int(np.asarray(ref[g.io.next]).reshape(-1)[0])


def test_a_launch_asking_for_more_temporaries_than_it_declared_is_named():
    """A fast twin whose kind under-declares `fast_temp` (the conservative lane's Rope did: an empty view, then
    `cannot reshape array of size 0`) is said at binding, in words."""
    from lanefuse.engine.front.demo import demo_model
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.numpy_runner import ArenaEnv

    cfg, w = demo_model()
    s = plan(build_step(cfg, 1))
    env = ArenaEnv(s, w, {}, exact=False, temp=8)
    assert env.temp(8).size == 8
    with pytest.raises(RuntimeError, match="asked for 9 temporary values; the runner's tail holds 8"):
        env.temp(9)
