"""Sampling on a CUDA device: sample.cu against kernels/sample.py's twin — tokens, kept counts, random bits, kept
totals and thresholds EQUAL — at tests/test_sampling_emulated.py's cases and at a real vocabulary (151936, Qwen's),
a relaunch the same bits; and whole runs: the CuPy backend's sampled run (its device decode loop, the launch moving
the token index on in the replayed graph) draws the twin's tokens from its own logits, and the same tokens as the
numpy backend's run, single and batched. Skipped without a CUDA device; the kernel's half runs on the CPU through the
host emulator in tests/test_sampling_emulated.py, the runner's through a stand-in cupy in tests/test_sampling.py."""

from __future__ import annotations

import numpy as np
import pytest

from test_kernels_gpu import _device
from test_sampling_emulated import SETTINGS, logits

from lanefuse.kernels import Advance, HostEnv
from lanefuse.kernels.sample import Sample, params
from lanefuse.lane.run.sampling import Sampling

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _device(), reason="no CUDA device")]


def both(x, rows, s, seed, pairs, batch):
    from lanefuse.kernels.cupy_env import DeviceEnv

    n = x.size // rows
    p = params(s.get("temp", 1.0), s.get("top_k", 0), s.get("top_p", 1.0), s.get("min_p", 0.0), seed, pairs)
    arrays = {"x": x, "out": np.full(rows, -7, np.int32), "p": p, "tok": np.zeros(rows, np.int32),
              "pos": np.arange(rows, dtype=np.int32) + 5, "st": np.zeros(8 * rows, np.int32)}
    launch = Sample("x", "out", n, "p", rows, Advance("tok", "pos", 1, batch=batch), stats="st")
    host = HostEnv({k: v.copy() for k, v in arrays.items()})
    launch.numpy(host)
    dev = DeviceEnv(0, {}, {k: v.copy() for k, v in arrays.items()}, {})
    launch.cuda(dev)
    dev.cp.cuda.Device().synchronize()
    for name in arrays:
        np.testing.assert_array_equal(dev.host(name), host.array(name), err_msg=f"{name} ({s}, seed {seed})")
    return launch, dev, host


@pytest.mark.parametrize("n", [1, 7, 1000, 4099, 151936])
@pytest.mark.parametrize("kind", ["normal", "ties", "neginf", "peaked"])
def test_the_device_draws_the_twins_tokens_to_the_bit(n, kind):
    g = np.random.default_rng(n * 7 + len(kind))
    for i, s in enumerate(SETTINGS):
        for k in range(3):
            seed = int(g.integers(0, 2**63)) if (i + k) % 2 else i + k
            both(logits(kind, n, g), 1, s, seed, [(int(g.integers(0, 5)), int(g.integers(0, 10**6)))], False)


def test_a_batch_on_the_device_and_again():
    g = np.random.default_rng(9)
    rows, n = 8, 151936
    x = np.concatenate([logits(("normal", "ties", "neginf", "peaked")[r % 4], n, g) for r in range(rows)])
    launch, dev, host = both(x, rows, dict(temp=0.9, top_k=40, top_p=0.9, min_p=0.01), 77,
                             [(r, 3 * r) for r in range(rows)], True)
    launch.cuda(dev)  # from the advanced words: the next draw of each sequence
    launch.numpy(host)
    dev.cp.cuda.Device().synchronize()
    for name in ("out", "p", "tok", "pos", "st"):
        np.testing.assert_array_equal(dev.host(name), host.array(name), err_msg=f"{name} on the second launch")


def test_cupy_and_numpy_runs_draw_the_same_tokens():
    pytest.importorskip("egglog", reason="the run plans its steps (no engine here)")
    from lanefuse.engine.front.demo import demo_model
    from lanefuse.lane.run.batch import generate_batch
    from lanefuse.lane.run.generate import generate
    from lanefuse.lane.run.step import plan_step_fn

    cfg, w = demo_model(128)
    s = Sampling(temp=0.8, top_k=50, top_p=0.95, seed=3)
    gpu, _ = plan_step_fn(w, "gpu", sampling=s)
    cpu, _ = plan_step_fn(w, "cpu", sampling=s, exact=True)
    got = generate(cfg, w, [3, 1, 4, 1, 5], 40, step_fn=gpu, chunk=2, sampling=s)
    want = generate(cfg, w, [3, 1, 4, 1, 5], 40, step_fn=cpu, chunk=2, sampling=s)
    assert got.generated_ids == [s.pick(row, 0, i) for i, row in enumerate(got.logits)]  # the launch's = the twin's
    assert got.generated_ids == want.generated_ids
    census = [x.launch.census for r in gpu.runners.values() for x in r.s.launches]
    assert "sample" in census and "argmax" not in census
    prompts = [[1, 2, 3], [7], [4, 4], [9, 8, 7, 6]]
    on_gpu = generate_batch(cfg, w, prompts, 12, slots=3, sampling=s, step_fn=gpu)
    on_cpu = generate_batch(cfg, w, prompts, 12, slots=3, sampling=s, step_fn=cpu)
    for k, (a, b) in enumerate(zip(on_gpu, on_cpu)):
        assert a.generated_ids == [s.pick(row, k, i) for i, row in enumerate(a.logits)], k
        assert a.generated_ids == b.generated_ids, k
