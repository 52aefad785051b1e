"""Greedy decode with no host round trip a token (issue 34 item 3), checked on the CPU through the stand-in `cupy` of
tests/test_cupy_runner_mock.py: the CuPy backend's decode steps replayed back to back, each step's token and logits
copied on the device into a chunk's run, the host reading the run once a chunk (`CupyRunner.decode_run`). The tokens
and logits equal the step-by-step CuPy loop's and the numpy runner's, bit for bit, with a graph and without, for the
demo model, a Gemma 2 shape and Qwen3-Next (carried convolution rings and delta-rule states); an end-of-sequence id
mid-chunk stops the run where the step-by-step loop stops, and the device is left so that decoding on from it gives
the step-by-step tokens; the host reads (every `cupy.asnumpy` and `.get()`) are at most one a chunk plus the
prefill's."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))

from test_cupy_runner_mock import _Arr, fake_cupy  # noqa: E402,F401  (the stand-in cupy fixture)

from lanefuse.engine.front.model import build_step  # noqa: E402
from lanefuse.lane.run.cupy_runner import DECODE_CHUNK, CupyRunner as _CupyRunner  # noqa: E402
from lanefuse.lane.run.generate import generate  # noqa: E402

PROMPT = [3, 1, 4, 1, 5]
MODELS = ["demo", "gemma2", "qwen3next"]


def _model(name, tmp_path):
    if name == "demo":
        from lanefuse.engine.front.demo import demo_model

        return demo_model()
    if name == "gemma2":
        from test_gemma import gemma_shape

        from lanefuse.engine.front.stepweights import random_weights

        cfg = gemma_shape("gemma2", layers=2, max_len=64)
        return cfg, random_weights(cfg.build_step(1), 1)  # its run changes token mid-chunk
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_qwen3next import build

    from lanefuse.engine.front.load import load_model

    return load_model(build("f32", tmp_path)[0])


class _Reads:
    """Counts the host's reads of the stand-in device: `cupy.asnumpy` and `ndarray.get`."""

    def __init__(self, monkeypatch):
        self.n = 0
        cp = sys.modules["cupy"]
        asnumpy, get = cp.asnumpy, _Arr.get

        def counted_asnumpy(a, stream=None):
            self.n += 1
            return asnumpy(a, stream)

        def counted_get(a, *k, **kw):
            self.n += 1
            return get(a)

        monkeypatch.setattr(cp, "asnumpy", counted_asnumpy)
        monkeypatch.setattr(_Arr, "get", counted_get)

    def during(self, f):
        n0 = self.n
        out = f()
        return out, self.n - n0


def _device_fn(w, graph, monkeypatch):
    """The CuPy backend's step function (plan_step_fn on a stand-in device), its runners under `graph` or not."""
    import lanefuse.lane.run.cupy_runner as cr
    import lanefuse.lane.run.step as step

    monkeypatch.setattr(step, "pick_device", lambda d: "gpu")

    monkeypatch.setattr(cr, "CupyRunner", lambda s, weights, state=None: _CupyRunner(s, weights, state, graph=graph))
    fn, label = step.plan_step_fn(w, "gpu")
    assert "CuPy" in label and hasattr(fn, "decode")
    return fn


def _one_a_step(fn):
    """The same backend stepped one token at a time (the host uploads each token, reads each step's logits): its
    step function without `decode` (with its `to_slot`, a batch's prefill into its slot)."""
    def step(g, env):
        return fn(g, env)

    step.to_slot, step.spent = fn.to_slot, fn.spent
    return step


def _numpy_fn(w):
    from lanefuse.lane.run.step import plan_step_fn

    return plan_step_fn(w, "cpu", exact=True)[0]  # the twins (the stand-in device runs them too)


def _same(a, b):
    assert a.generated_ids == b.generated_ids
    assert len(a.logits) == len(b.logits)
    for i, (x, y) in enumerate(zip(a.logits, b.logits)):
        assert np.array_equal(np.asarray(x).reshape(-1), np.asarray(y).reshape(-1)), f"logits of token {i}"


@pytest.mark.parametrize("graph", [True, False])
@pytest.mark.parametrize("name", MODELS)
def test_device_decode_equals_the_step_by_step_loop(fake_cupy, monkeypatch, tmp_path, name, graph):
    cfg, w = _model(name, tmp_path)
    n = 40
    reads = _Reads(monkeypatch)
    dev, r_dev = reads.during(lambda: generate(cfg, w, PROMPT, n, step_fn=_device_fn(w, graph, monkeypatch)))
    old, r_old = reads.during(lambda: generate(cfg, w, PROMPT, n,
                                               step_fn=_one_a_step(_device_fn(w, graph, monkeypatch))))
    ref = generate(cfg, w, PROMPT, n, step_fn=_numpy_fn(w))
    _same(dev, ref)
    _same(old, ref)
    assert len(dev.generated_ids) == n
    # the prompt's one prefill step reads its logits and token (2); the n - 1 decode steps one read a chunk
    assert r_old == 2 * n
    assert r_dev <= 2 + math.ceil((n - 1) / DECODE_CHUNK), r_dev
    print(f"{name}, graph {graph}: {n} tokens, host reads {r_old} one a step -> {r_dev} on the device")


def _eos_of(ids: list[int]) -> tuple[int, int]:
    """A token of `ids` and the index it first comes at: the latest first coming past the first decode chunk's start
    and off a chunk boundary where there is one."""
    first = {}
    for i, t in enumerate(ids):
        first.setdefault(t, i)
    picks = sorted(((i, t) for t, i in first.items() if i >= 2), key=lambda it: (it[0] % DECODE_CHUNK != 0, it[0]))
    if not picks:
        pytest.skip("the run repeats one token")
    i, t = picks[-1]
    return t, i


@pytest.mark.parametrize("graph", [True, False])
@pytest.mark.parametrize("name", MODELS)
def test_an_end_of_sequence_mid_chunk_stops_where_the_step_by_step_loop_stops(fake_cupy, monkeypatch, tmp_path, name,
                                                                           graph):
    """The run stops at the eos token read back with its chunk, the tokens and logits after it dropped; the device's
    token, position and carried states left as the step-by-step loop leaves them: decoding on from the device's own
    token and position gives the tokens of the run without the eos."""
    cfg, w = _model(name, tmp_path)
    n = 40
    ref = generate(cfg, w, PROMPT, n, step_fn=_numpy_fn(w))
    eos, at = _eos_of(ref.generated_ids)
    want = generate(cfg, w, PROMPT, n, step_fn=_numpy_fn(w), eos=(eos,))
    assert want.generated_ids == ref.generated_ids[: at + 1]
    fn = _device_fn(w, graph, monkeypatch)
    got = generate(cfg, w, PROMPT, n, step_fn=fn, eos=(eos,))
    _same(got, want)
    old = generate(cfg, w, PROMPT, n, step_fn=_one_a_step(_device_fn(w, graph, monkeypatch)), eos=(eos,))
    _same(old, want)
    more = min(8, n - at - 1)
    on, _ = fn.decode(build_step(cfg, 1), None, more, logits=False)  # from the device's own token and position
    assert [int(t) for t in on[:, -1]] == ref.generated_ids[at + 1: at + 1 + more]


@pytest.mark.parametrize("graph", [True, False])
def test_decode_reads_the_device_once_a_chunk(fake_cupy, monkeypatch, graph):
    """`CupyRunner.decode` from the device's own token and position: one read of the position, then one a chunk
    (any chunk size; a last chunk shorter); the tokens of the reference."""
    from lanefuse.engine.front.demo import demo_model
    from lanefuse.engine.front.model import build_step as bs
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState
    from lanefuse.lane.run.generate import new_caches

    cfg, w = demo_model()
    ref = generate(cfg, w, [7], 45).generated_ids
    reads = _Reads(monkeypatch)
    for chunk in (1, 5, DECODE_CHUNK, 64):
        r = CupyRunner(plan(bs(cfg, 1)), w, DeviceState(), graph=graph)
        env = new_caches(cfg)
        env["token"], env["pos"] = np.array([7], np.int32), np.array([0], np.int32)
        first = int(r.step(env)["next"][0])
        (toks, logits), k = reads.during(lambda: r.decode_run(44, logits=True, chunk=chunk))
        assert [first] + [int(t) for t in toks[:, 0]] == ref
        assert logits.shape == (44, cfg.vocab) and logits.dtype == np.float32
        assert k == 1 + math.ceil(44 / chunk), (chunk, k)


@pytest.mark.parametrize("graph", [True, False])
@pytest.mark.parametrize("name", ["demo", "gemma2"])  # no batch of Qwen3-Next in this lane
def test_a_batch_decodes_chunks_on_the_device(fake_cupy, monkeypatch, tmp_path, name, graph):
    """generate_batch on the device: the batch step's steps back to back, one read a chunk (as many steps as the
    busy slot with the fewest tokens left takes), sequences that end inside a chunk (their count, an eos id) cut
    there and their slots refilled at the chunk's end: each prompt's tokens and logits are the numpy runner's stepping
    one token at a time."""
    from lanefuse.lane.run.batch import generate_batch

    cfg, w = _model(name, tmp_path)
    prompts = [[3, 1, 4], [1, 5, 9, 2], [6, 5], [3, 5, 8, 9, 7], [9, 3]]
    n = 30
    free = generate_batch(cfg, w, prompts, n, 2, step_fn=_numpy_fn(w))
    j = next((j for j, r in enumerate(free) if len(set(r.generated_ids[2:])) > 1), None)
    if j is None:  # every run repeats one token (the Gemma 2 shape's random weights): the first prompt's ends it
        j, eos = 0, free[0].generated_ids[0]  # at its first token, its slot refilled before a chunk runs
    else:
        eos, _ = _eos_of(free[j].generated_ids)  # one sequence at least ends on it inside a chunk
    want = generate_batch(cfg, w, prompts, n, 2, step_fn=_numpy_fn(w), eos=(eos,))
    cut = len(want[j].generated_ids)
    assert want[j].generated_ids == free[j].generated_ids[:cut] and cut < n
    reads = _Reads(monkeypatch)
    got, r_dev = reads.during(lambda: generate_batch(cfg, w, prompts, n, 2, eos=(eos,),
                                                     step_fn=_device_fn(w, graph, monkeypatch)))
    old, r_old = reads.during(lambda: generate_batch(cfg, w, prompts, n, 2, eos=(eos,),
                                                     step_fn=_one_a_step(_device_fn(w, graph, monkeypatch))))
    for a, b, c in zip(got, old, want):
        _same(a, c)
        _same(b, c)
    tokens = sum(len(r.generated_ids) for r in want)
    print(f"{name} batch of 2 slots, graph {graph}: {tokens} tokens, host reads {r_old} -> {r_dev}")
    assert r_dev < r_old / 3
