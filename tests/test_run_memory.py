"""The memory of a long `run` does not grow with its tokens unless the logits are asked for (issue 36): `generate`
and `generate_batch` keep each step's logits only with `keep_logits` (the CLI's `--json`), on the numpy path and on
the device's chunked decode (the stand-in cupy of tests/test_cupy_runner_mock.py), the tokens the same either way."""

from __future__ import annotations

import gc
import sys
import tracemalloc
import weakref

import numpy as np
import pytest

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))

from test_cupy_runner_mock import fake_cupy  # noqa: E402,F401  (the stand-in cupy fixture)
from test_device_decode import _device_fn, _numpy_fn  # noqa: E402

from lanefuse.engine.front.demo import demo_model  # noqa: E402
from lanefuse.lane.run.batch import generate_batch  # noqa: E402
from lanefuse.lane.run.generate import generate  # noqa: E402

PROMPT = [3, 1, 4, 1, 5]


def _tracked(step_fn):
    """`step_fn` whose every logits array is a fresh one, watched by a weak reference."""
    alive = []

    def step(g, env):
        out = dict(step_fn(g, env))
        out["logits"] = np.array(out["logits"], dtype=np.float32)
        alive.append(weakref.ref(out["logits"]))
        return out

    step.spent = getattr(step_fn, "spent", None)
    step.alive = lambda: sum(r() is not None for r in alive)
    return step


@pytest.mark.parametrize("keep", [False, True])
def test_a_run_holds_its_logits_only_where_asked(keep):
    cfg, w = demo_model()
    base = generate(cfg, w, PROMPT, 30, step_fn=_numpy_fn(w))
    step = _tracked(_numpy_fn(w))
    res = generate(cfg, w, PROMPT, 30, step_fn=step, keep_logits=keep)
    gc.collect()
    assert res.generated_ids == base.generated_ids
    if keep:
        assert len(res.logits) == 30 and step.alive() == 30
        assert all(np.array_equal(a, b) for a, b in zip(res.logits, base.logits))
    else:
        assert res.logits == [] and step.alive() == 0


@pytest.mark.parametrize("keep", [False, True])
def test_a_batch_holds_its_logits_only_where_asked(keep):
    cfg, w = demo_model()
    prompts = [[3, 1, 4], [1, 5, 9, 2], [6, 5]]
    base = generate_batch(cfg, w, prompts, 12, 2, step_fn=_numpy_fn(w))
    step = _tracked(_numpy_fn(w))
    got = generate_batch(cfg, w, prompts, 12, 2, step_fn=step, keep_logits=keep)
    gc.collect()
    assert [r.generated_ids for r in got] == [r.generated_ids for r in base]
    if keep:
        assert all(len(r.logits) == 12 for r in got)
    else:
        assert all(r.logits == [] for r in got) and step.alive() == 0


@pytest.mark.slow
def test_the_device_decode_holds_a_chunk_of_logits_at_most(fake_cupy, monkeypatch):
    """On the device, a run of 120 tokens without logits peaks where one of 24 does (at most a chunk's logits read
    back, checked, dropped); with them it grows by the logits it keeps. The tokens are the numpy runner's."""
    cfg, w = demo_model()
    want = generate(cfg, w, PROMPT, 120, step_fn=_numpy_fn(w)).generated_ids
    runs, peaks = {}, {}
    for n, keep in [(24, False), (120, False), (120, True)]:
        fn = _device_fn(w, False, monkeypatch)
        generate(cfg, w, PROMPT, 2, step_fn=fn)  # planned and set up before the count starts
        gc.collect()
        tracemalloc.start()
        try:
            runs[n, keep] = generate(cfg, w, PROMPT, n, step_fn=fn, keep_logits=keep)
            peaks[n, keep] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert runs[120, False].generated_ids == want and runs[120, False].logits == []
    assert runs[120, True].generated_ids == want and len(runs[120, True].logits) == 120
    logits_of_96 = 96 * cfg.vocab * 4
    short, long, kept = peaks[24, False], peaks[120, False], peaks[120, True]
    print(f"peak bytes: 24 tokens {short}, 120 tokens {long}, 120 tokens with logits {kept}")
    assert long - short < logits_of_96 / 4, (short, long)
    assert kept - long > logits_of_96 / 2, (long, kept)


def test_the_json_record_is_the_one_json_dumps_writes():
    """`run --json` writes each logits row as text as it goes (no list of Python floats for the whole run): the same
    text json.dumps gives for the record with its logits as lists of floats; NaN refused in words as before."""
    from lanefuse.engine.errors import UserError
    from lanefuse.lane.cli.commands import _record_text
    from lanefuse.lane.lower.files import json_text

    rng = np.random.default_rng(3)
    rows = [(rng.standard_normal(7) * 10.0 ** rng.integers(-30, 30)).astype(np.float32) for _ in range(5)]
    rec = {"model": "m", "prompt_ids": [1, 2], "generated_ids": [3, 4, 5, 6, 7], "timings": {"load_s": 0.5}}
    old = {**{k: v for k, v in rec.items() if k != "timings"},
           "logits": [[float(v) for v in r.reshape(-1)] for r in rows], "timings": rec["timings"]}
    assert "".join(_record_text(rec, rows, "--json x")) + "\n" == json_text(old, "--json x")
    assert "".join(_record_text(rec, [], "--json x")) + "\n" == json_text(
        {**old, "logits": [], "timings": rec["timings"]}, "--json x")
    rows[2][3] = np.nan
    with pytest.raises(UserError, match=r"--json x: not written: .*non-finite"):
        "".join(_record_text(rec, rows, "--json x"))


def test_a_streamed_output_that_fails_leaves_nothing(tmp_path):
    from lanefuse.engine.errors import UserError
    from lanefuse.lane.lower.files import write_atomic

    def parts():
        yield "[1, "
        raise UserError("--json x: not written")

    with pytest.raises(UserError):
        write_atomic(str(tmp_path / "x.json"), parts())
    assert list(tmp_path.iterdir()) == []
    write_atomic(str(tmp_path / "y.json"), iter(["[1, ", "2]\n"]))
    assert (tmp_path / "y.json").read_text() == "[1, 2]\n"
