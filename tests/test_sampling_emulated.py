"""sample.cu run on the CPU through the host emulator (tests/cuda_host: its real source built by g++, a block's 1024
threads as fibers) against kernels/sample.py's numpy twin: the tokens, the kept counts, the random bits, the kept
totals and both thresholds EQUAL (not close), over many seeds and token indices, awkward vocabularies (1, 7, 1000,
4099), ties, -inf logits, top-k 1, a tiny top-p, min-p 1, a batch's rows each its own (sequence, index); the advance
(token, position, index) as the twin's; the same bits again with the blocks reversed and threads shuffled."""

from __future__ import annotations

import numpy as np
import pytest

from cuda_host import emu
from lanefuse.kernels import Advance, HostEnv
from lanefuse.kernels.sample import Sample, params

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="no g++ to build the emulated kernels")


@pytest.fixture(scope="module", autouse=True)
def emulated():
    with emu.emulating([Sample.stem]) as env:
        yield env


def logits(kind: str, n: int, g) -> np.ndarray:
    if kind == "normal":
        return (g.standard_normal(n) * g.uniform(0.5, 4)).astype(np.float32)
    if kind == "ties":  # a few distinct values: every threshold lands inside a tie group
        return g.integers(-3, 3, n).astype(np.float32)
    if kind == "neginf":  # most tokens -inf (a mask), the rest normal; one row all -inf but one
        x = np.full(n, -np.inf, np.float32)
        keep = g.choice(n, max(1, n // 5), replace=False)
        x[keep] = g.standard_normal(keep.size).astype(np.float32) * 3
        return x
    if kind == "peaked":  # one token far above: most weights underflow to 0
        x = g.standard_normal(n).astype(np.float32)
        x[g.integers(n)] = 40.0
        return x
    raise ValueError(kind)


SETTINGS = [dict(temp=0.8), dict(temp=1.3, top_k=5), dict(temp=1.0, top_p=0.9), dict(temp=0.7, min_p=0.05),
            dict(temp=1.1, top_k=50, top_p=0.8, min_p=0.02), dict(temp=2.0, top_k=1), dict(temp=0.5, top_p=1e-6),
            dict(temp=1.0, min_p=1.0), dict(temp=0.05, top_p=0.5), dict(temp=3.0, top_k=1000, top_p=0.99)]


def run_both(x: np.ndarray, rows: int, s: dict, seed: int, pairs, batch: bool, dev_cls):
    n = x.size // rows
    p = params(s.get("temp", 1.0), s.get("top_k", 0), s.get("top_p", 1.0), s.get("min_p", 0.0), seed, pairs)
    arrays = {"x": x, "out": np.full(rows, -7, np.int32), "p": p, "tok": np.zeros(rows, np.int32),
              "pos": np.arange(rows, dtype=np.int32) + 5, "st": np.zeros(8 * rows, np.int32)}
    launch = Sample("x", "out", n, "p", rows, Advance("tok", "pos", 1, batch=batch), stats="st")
    assert launch.check() is None, launch.check()
    host = HostEnv({k: v.copy() for k, v in arrays.items()})
    launch.numpy(host)
    dev = dev_cls(0, {}, {k: v.copy() for k, v in arrays.items()}, {})
    launch.cuda(dev)
    for name in arrays:
        np.testing.assert_array_equal(dev.host(name), host.array(name), err_msg=f"{name} ({s}, seed {seed})")
    return launch, dev, arrays, host


@pytest.mark.parametrize("n", [1, 7, 1000, 4099])
@pytest.mark.parametrize("kind", ["normal", "ties", "neginf", "peaked"])
def test_the_kernel_draws_the_twins_tokens_to_the_bit(n, kind, emulated):
    g = np.random.default_rng(n * 7 + len(kind))
    for i, s in enumerate(SETTINGS):
        x = logits(kind, n, g)
        seed = int(g.integers(0, 2**63)) if i % 2 else i
        run_both(x, 1, s, seed, [(int(g.integers(0, 5)), int(g.integers(0, 10**6)))], False, emulated)


def test_many_seeds_and_indices_one_row(emulated):
    """One fixed row of 1000 logits, 24 (seed, sequence, index) draws: every token the twin's; they spread."""
    g = np.random.default_rng(5)
    x = logits("normal", 1000, g)
    toks = set()
    for k in range(24):
        _, dev, _, host = run_both(x, 1, dict(temp=1.0, top_p=0.95), k * 977, [(k % 3, k * 13)], False, emulated)
        toks.add(int(host.array("out")[0]))
    assert len(toks) > 8


def test_a_batch_draws_each_row_with_its_own_pair_and_advances_each(emulated):
    g = np.random.default_rng(9)
    rows, n = 5, 333
    x = np.concatenate([logits(k, n, g) for k in ("normal", "ties", "neginf", "peaked", "normal")])
    pairs = [(s, 3 * s + 1) for s in range(rows)]
    launch, dev, arrays, host = run_both(x, rows, dict(temp=0.9, top_k=40, top_p=0.9), 77, pairs, True, emulated)
    p = host.array("p")
    assert list(p[7::2]) == [3 * s + 2 for s in range(rows)]  # each sequence's index moved on by one
    assert list(host.array("pos")) == [6, 7, 8, 9, 10] and list(host.array("tok")) == list(host.array("out"))
    # the same launch again (blocks reversed, threads shuffled between barriers) from the advanced words: the twin's
    dev.flags, dev.seed = 1, 4321
    try:
        launch.cuda(dev)
    finally:
        dev.flags, dev.seed = 0, 0
    launch.numpy(host)
    for name in arrays:
        np.testing.assert_array_equal(dev.host(name), host.array(name), err_msg=f"{name} on the second launch")


def test_a_real_vocabulary(emulated):
    """Qwen's 151936 logits (each of the block's threads a run of 149 of them): the same bits."""
    g = np.random.default_rng(3)
    for kind, s in (("normal", SETTINGS[4]), ("ties", SETTINGS[2]), ("peaked", SETTINGS[1])):
        run_both(logits(kind, 151936, g), 1, s, int(g.integers(0, 2**63)), [(1, 12345)], False, emulated)
