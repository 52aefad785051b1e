"""Sampling (issue 37): temperature, top-k, top-p and min-p as transformers' logits processors define them (the same
kept tokens and probabilities on fixed logits), the draws' distribution (a χ² test over many counter-based draws),
the same tokens from the same seed however the run is split, greedy untouched; and `run`'s flags for it."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from lanefuse.engine.errors import UserError
from lanefuse.lane.run.sampling import Sampling

CASES = [dict(temp=0.7), dict(temp=1.3, top_k=5), dict(temp=1.0, top_p=0.9), dict(temp=0.9, min_p=0.05),
         dict(temp=1.1, top_k=50, top_p=0.8, min_p=0.02), dict(temp=2.0, top_k=1), dict(temp=0.5, top_p=0.05)]


def _hf(logits: np.ndarray, temp, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """transformers' warpers in generate's order on one row: the processed scores' probabilities."""
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    s = torch.tensor(logits, dtype=torch.float64)[None]
    ids = torch.zeros((1, 1), dtype=torch.long)
    s = lp.TemperatureLogitsWarper(temp)(ids, s)
    if top_k:
        s = lp.TopKLogitsWarper(top_k)(ids, s)
    if top_p < 1.0:
        s = lp.TopPLogitsWarper(top_p)(ids, s)
    if min_p > 0.0:
        s = lp.MinPLogitsWarper(min_p)(ids, s)
    return torch.softmax(s, -1)[0].numpy()


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("vocab", [7, 131, 1000])
def test_the_kept_tokens_and_probabilities_are_transformers(case, vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(5):
        logits = (rng.standard_normal(vocab) * rng.uniform(0.5, 4)).astype(np.float32)
        want = _hf(logits.astype(np.float64), **case)
        ids, p = Sampling(**case).kept(logits)
        # transformers' kept tokens but those below 2^-40 of the top's probability (a weight of 0: never drawn);
        # a token within 1% of that ratio may go either way
        ratio = want / want.max()
        near = np.abs(np.log2(np.where(ratio > 0, ratio, 1.0)) + 40) < 0.015
        assert set(ids) - set(np.flatnonzero(near)) == set(np.flatnonzero((ratio >= 2.0 ** -40) & ~near)), case
        want = np.bincount(ids, want[ids] / want[ids].sum(), minlength=vocab)  # over the same kept tokens
        # f32 scores (x / temp rounded: 2^-24 of |s| in the exponent), sp_exp's ~2 ulps, the 2^-40 floor
        rtol = 2.0 ** -22 * (1 + float(np.max(np.abs(logits))) / case["temp"])
        np.testing.assert_allclose(p, want[ids], rtol=rtol, atol=1e-12)


def test_the_draws_follow_the_kept_distribution():
    """χ² of 20,000 draws (one sequence, token indices 0..19,999) against the kept probabilities: below the 0.999
    quantile of χ² with (kept - 1) degrees of freedom; and a token outside the kept set is never drawn."""
    chi2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124}  # tables

    logits = np.log(np.array([0.30, 0.20, 0.15, 0.12, 0.10, 0.06, 0.04, 0.02, 0.01], np.float64)).astype(np.float32)
    s = Sampling(temp=1.0, top_p=0.95, seed=12345)
    ids, p = s.kept(logits)
    assert len(ids) < len(logits)  # top-p removed the tail
    n = 20_000
    got = np.bincount([s.pick(logits, 0, i) for i in range(n)], minlength=len(logits))
    assert got[np.setdiff1d(np.arange(len(logits)), ids)].sum() == 0
    expect = n * p
    stat = float((((got[ids] - expect) ** 2) / expect).sum())
    assert stat < chi2_999[len(ids) - 1], (stat, got, expect)


def test_a_draw_depends_on_seed_sequence_and_index_only():
    logits = np.random.default_rng(0).standard_normal(500).astype(np.float32)
    a = Sampling(temp=1.0, seed=7)
    assert [a.pick(logits, 2, i) for i in range(50)] == [Sampling(temp=1.0, seed=7).pick(logits, 2, i)
                                                         for i in range(50)]
    assert [a.pick(logits, 0, i) for i in range(50)] != [a.pick(logits, 1, i) for i in range(50)]
    assert [a.pick(logits, 0, i) for i in range(50)] != [Sampling(temp=1.0, seed=8).pick(logits, 0, i)
                                                         for i in range(50)]
    assert Sampling().greedy and Sampling().pick(logits) == int(np.argmax(logits))


def test_the_launchs_exp_is_within_two_ulps():
    """sp_exp (sample.cu's own exp, f32 operations one at a time) against float64's exp over [-28, 0]: within 2 ulps
    (2^-22 relative), e^0 exactly 1, 0 below -28 and for -inf."""
    from lanefuse.kernels.sample import sp_exp

    d = np.concatenate([np.linspace(-28, 0, 200_001, dtype=np.float32), np.float32([-1e-30, -0.0, 0.0])])
    got = sp_exp(d).astype(np.float64)
    want = np.exp(d.astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 2.0 ** -22
    assert sp_exp(np.float32([0.0]))[0] == 1.0
    assert not sp_exp(np.float32([-28.01, -np.inf, -1e30])).any()


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.integers(0, 2**32), st.sampled_from([0.3, 1.0, 2.5]), st.integers(0, 40),
       st.sampled_from([1.0, 0.99, 0.5, 1e-3]), st.sampled_from([0.0, 0.01, 0.5, 1.0]), st.integers(0, 3))
def test_the_draw_keeps_its_promises(n, seed, temp, top_k, top_p, min_p, ties):
    """On any logits (some tied, some -inf): the drawn token is kept; the arg-max is always kept; top-k keeps every
    token tied with the k-th score and none below it; a larger top-p or a smaller min-p never keeps fewer; the token
    is the first whose cumulative kept weight passes bits·total / 2^64 (the inverse of the cumulative, in id order)."""
    from lanefuse.kernels.sample import draw, keys, scores

    g = np.random.default_rng(seed)
    x = (g.standard_normal(n) * 3).astype(np.float32)
    if ties:
        x = np.round(x * ties) / ties  # a few values shared by many tokens
    x[g.random(n) < 0.2] = -np.inf
    d = draw(x, temp, top_k, top_p, min_p, seed, 1, seed % 1000)
    s = scores(x, temp)
    if np.isfinite(s).any():
        assert d.kept[d.token] and d.kept[int(np.argmax(s))]
        if 0 < top_k < n:
            kth = np.sort(s)[n - top_k]
            assert not d.kept[s < kth].any()
        wider = draw(x, temp, top_k, min(1.0, top_p * 2), min_p / 2, seed, 1, seed % 1000)
        assert (wider.kept | ~d.kept).all()  # every token kept here is kept there
        cum = np.cumsum(d.weights.astype(object))
        target = (d.bits * d.total) >> 64
        assert d.token == next(i for i, c in enumerate(cum) if c > target)
    else:
        assert d.token == 0 and not d.kept.any()
    assert keys(s).dtype == np.uint32


@pytest.mark.parametrize("bad", [dict(temp=-1.0), dict(temp=float("nan")), dict(temp=1.0, top_p=0.0),
                                 dict(temp=1.0, top_p=1.5), dict(temp=1.0, min_p=2.0), dict(temp=1.0, top_k=-2),
                                 dict(temp=1.0, seed=-1)])
def test_bad_sampling_values_are_refused_in_words(bad):
    with pytest.raises(UserError, match="--"):
        Sampling(**bad)


# ---- generation --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo():
    from lanefuse.engine.front.demo import demo_model

    return demo_model(64)


def test_greedy_is_untouched_and_tokens_stream_as_each_step_ends(demo):
    from lanefuse.lane.run.generate import generate

    cfg, w = demo
    steps, seen = [], []
    from lanefuse.engine.interp import evaluate

    def step_fn(g, env):
        steps.append(1)
        return evaluate(g, w, env)

    want = generate(cfg, w, [1, 2, 3], 5).generated_ids
    got = generate(cfg, w, [1, 2, 3], 5, step_fn=step_fn, sampling=Sampling(),
                   on_token=lambda t: seen.append((t, len(steps))))
    assert got.generated_ids == want and [t for t, _ in seen] == want
    assert [n for _, n in seen] == [1, 2, 3, 4, 5]  # each token out as its step ends, not at the run's end


def test_a_sampled_run_draws_from_each_steps_logits(demo):
    from lanefuse.lane.run.generate import generate

    cfg, w = demo
    s = Sampling(temp=0.9, top_k=20, seed=3)
    r = generate(cfg, w, [5, 6], 6, sampling=s, chunk=1)
    assert r.generated_ids == [s.pick(row, 0, i) for i, row in enumerate(r.logits)]
    assert r.generated_ids != generate(cfg, w, [5, 6], 6).generated_ids  # not greedy in disguise
    again = generate(cfg, w, [5, 6], 6, sampling=s, chunk=2)  # other chunks: the same draws
    assert again.generated_ids == r.generated_ids


def test_a_batch_samples_each_prompt_as_a_run_alone(demo):
    from lanefuse.lane.run.batch import generate_batch
    from lanefuse.lane.run.generate import generate

    cfg, w = demo
    s = Sampling(temp=1.0, top_p=0.9, seed=11)
    res = generate_batch(cfg, w, [[1, 2, 3], [7], [4, 4]], 4, slots=2, sampling=s)
    alone = generate(cfg, w, [1, 2, 3], 4, sampling=s)  # sequence 0: the single run's draws
    assert res[0].generated_ids == alone.generated_ids
    for k, r in enumerate(res):
        assert r.generated_ids == [s.pick(row, k, i) for i, row in enumerate(r.logits)]


@pytest.mark.parametrize("mode", ["fast", "exact", "checked"])
def test_the_numpy_plan_draws_with_its_sample_launch(demo, mode):
    """The fused plan on the numpy backend closes each step (prefill chunks of 3, decode) with the `sample` launch in
    the arg-max's place: its tokens are the twin's draws from the plan's own logits (the launch read no logits back:
    it ran as a launch of the plan), under the fast twins, the exact ones, and checked launch by launch against the
    reference (its `next` a draw, not compared to the reference's arg-max); a batch's each prompt's own sequence."""
    from lanefuse.lane.run.batch import generate_batch
    from lanefuse.lane.run.generate import generate
    from lanefuse.lane.run.step import plan_step_fn

    cfg, w = demo
    s = Sampling(temp=0.9, top_k=30, min_p=0.01, seed=2**40 + 3)
    fn, _ = plan_step_fn(w, "cpu", sampling=s, exact=mode == "exact", check=mode == "checked")
    r = generate(cfg, w, [5, 6, 7, 8], 7, step_fn=fn, chunk=3, sampling=s)
    assert r.generated_ids == [s.pick(row, 0, i) for i, row in enumerate(r.logits)]
    census = [k.census for run in fn.runners.values() for x in run.s.launches for k in x.launch.kernels()]
    assert census.count("sample") == len(fn.runners) and "argmax" not in census  # each form's closing kernel (a
    # launch of its own, or the second kernel of the LM head's fold where head_argmax joined the head and arg-max)
    res = generate_batch(cfg, w, [[1, 2, 3], [7], [4, 4]], 4, slots=2, sampling=s, step_fn=fn)
    for k, one in enumerate(res):
        assert one.generated_ids == [s.pick(row, k, i) for i, row in enumerate(one.logits)], k


def test_a_plan_without_its_closing_arg_max_is_refused_in_words(demo):
    from dataclasses import replace

    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.sampling import with_sampling

    cfg, _ = demo
    p = plan(build_step(cfg, 1))
    cut = replace(p, launches=[x for x in p.launches if "argmax" not in (x.launch.census, getattr(
        getattr(x.launch, "then", None), "census", None))])  # the arg-max's own launch, or the head's fold with it
    with pytest.raises(UserError, match="sampling: the plan of .* closes its step with 0 arg-max launches"):
        with_sampling(cut)
    sampled = with_sampling(p)
    assert sampled.io.inputs[-1] == "sampling" and sampled.tensors["sampling"].shape == (8,)
    assert p.io.inputs[-1] != "sampling" and "sampling" not in p.tensors  # the greedy plan untouched


# ---- the command -----------------------------------------------------------------------------------------------

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_run_takes_llama_cli_flags_samples_and_times_the_whole(tmp_path):
    greedy = _cli("run", "--prompt-ids", "1,2,3", "-n", "4", "--reference")
    assert greedy.returncode == 0, greedy.stderr
    assert greedy.stdout.splitlines()[0] == "prompt ids:    1,2,3"  # the prompt echoed, then the tokens
    assert greedy.stdout.splitlines()[1].startswith("generated ids: ")
    assert "total      : " in greedy.stderr and "ms" not in greedy.stdout
    o = tmp_path / "o.json"
    r = _cli("run", "-m", "demo", "--prompt-ids", "1,2,3", "-n", "4", "--reference", "--temp", "0.8", "--top-k", "9",
             "-s", "5", "--json", str(o))
    assert r.returncode == 0, r.stderr
    d = json.loads(o.read_text())
    assert d["sampling"] == {"temp": 0.8, "top_k": 9, "top_p": 1.0, "min_p": 0.0, "seed": 5}
    assert d["timings"]["total_ms"] >= d["timings"]["prompt_ms"] + d["timings"]["decode_ms"]
    s = Sampling(temp=0.8, top_k=9, seed=5)
    assert d["generated_ids"] == [s.pick(row, 0, i) for i, row in enumerate(d["logits"])]
    assert "sampling: temp 0.8, top-k 9, seed 5" in r.stderr


def test_run_samples_with_the_plans_launch(tmp_path):
    """`lanefuse run --temp 0.8 --seed 3` on the numpy backend: the fused plan draws (the launch), each token the
    twin's draw from the logits the plan gave; the same again from the same seed."""
    o = tmp_path / "o.json"
    args = ("run", "--prompt-ids", "1,2,3", "-n", "6", "--temp", "0.8", "--seed", "3", "--device", "cpu")
    r = _cli(*args, "--json", str(o))
    assert r.returncode == 0, r.stderr
    assert "fused plan, numpy backend" in r.stderr and "sampling: temp 0.8, seed 3" in r.stderr
    d = json.loads(o.read_text())
    s = Sampling(temp=0.8, seed=3)
    assert d["generated_ids"] == [s.pick(row, 0, i) for i, row in enumerate(d["logits"])]
    again = _cli(*args)
    assert again.returncode == 0 and ",".join(map(str, d["generated_ids"])) in again.stdout, again.stdout


@pytest.mark.parametrize("argv, says", [
    (["-ngl", "99"], "-ngl is llama-cli's; lanefuse does not take it: the whole step runs on the device"),
    (["-cnv"], "-cnv is llama-cli's"),
    (["--repeat-penalty", "1.1"], "sampling takes --temp, --top-k, --top-p, --min-p and --seed"),
    (["--top-p", "0.9"], "--top-p without --temp: the run is greedy"),
    (["--temp", "0.5", "--top-p", "0"], "--top-p 0.0: give a value in (0, 1]"),
    (["-m", "demo", "nope"], "-m demo and MODEL nope: give the model once"),
])
def test_run_refuses_in_one_line(argv, says):
    r = _cli("run", *argv)
    assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("lanefuse"), r.stderr


def test_a_batch_prints_the_timings_block_on_stderr_and_only_its_lines_on_stdout():
    r = _cli("run", "--prompt-ids", "1,2", "--prompt-ids", "3", "-n", "3", "--reference")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [line for line in r.stdout.splitlines() if line.startswith("prompt ")]
    assert len(r.stdout.splitlines()) == 2
    for head in ("load", "plan", "prompt eval", "decode", "total"):
        assert any(line.startswith(head) for line in r.stderr.splitlines()), r.stderr
    assert "/    3 tokens" in r.stderr  # the prompts' 3 tokens evaluated


# ---- the device path (a stand-in cupy: tests/test_cupy_runner_mock.py) ---------------------------------------------

from test_cupy_runner_mock import fake_cupy  # noqa: E402,F401  (the fixture)


def test_on_the_device_sampling_is_the_launch_in_the_devices_loop(fake_cupy, monkeypatch):  # noqa: F811
    """Greedy and sampled runs on the CuPy runner both take the device's back-to-back decode loop (the sampled plan
    closes its step with the `sample` launch, its index moved on by the replayed step itself: no logits read back to
    draw); the sampled tokens are the numpy plan's and the twin's on each step's logits, token for token; a batch
    likewise, each prompt its own sequence."""
    from lanefuse.engine.front.demo import demo_model
    from lanefuse.lane.run.batch import generate_batch
    from lanefuse.lane.run.generate import generate
    from lanefuse.lane.run import step as step_mod
    from lanefuse.lane.run.step import plan_step_fn

    monkeypatch.setattr(step_mod, "has_cuda", lambda: True)  # the stand-in cupy is the device
    cfg, w = demo_model(64)
    s = Sampling(temp=0.8, top_p=0.95, seed=21)
    for sampling in (None, s):
        calls = []
        gpu, _ = plan_step_fn(w, "gpu", sampling=sampling)
        loop = gpu.decode

        def counted(*a, **k):
            calls.append(1)
            return loop(*a, **k)

        gpu.decode = counted
        cpu, _ = plan_step_fn(w, "cpu", sampling=sampling)
        want = generate(cfg, w, [3, 1, 4], 20, step_fn=cpu, chunk=2, sampling=sampling)
        got = generate(cfg, w, [3, 1, 4], 20, step_fn=gpu, chunk=2, sampling=sampling)
        assert got.generated_ids == want.generated_ids and calls, sampling  # the device loop ran
        census = [getattr(x.launch, "then", x.launch).census for r in gpu.runners.values() for x in r.s.launches]
        assert ("sample" in census) == (sampling is not None) and ("argmax" in census) == (sampling is None)
    assert got.generated_ids == [s.pick(row, 0, i) for i, row in enumerate(got.logits)]
    assert got.generated_ids != generate(cfg, w, [3, 1, 4], 20, chunk=2).generated_ids  # not greedy in disguise
    gpu, _ = plan_step_fn(w, "gpu", sampling=s)
    res = generate_batch(cfg, w, [[1, 2, 3], [7], [4, 4]], 5, slots=2, sampling=s, step_fn=gpu)
    for k, r in enumerate(res):
        assert r.generated_ids == [s.pick(row, k, i) for i, row in enumerate(r.logits)], k
