"""`check` tells the truth: under q8 numerics the plan is compared with the reference of the quantized graph (not the
f32 one, which a q8 plan never equals), `run --reference --numerics q8` runs that reference, and the launch-by-launch
comparison (LANEFUSE_CHECK=2, `check`) compares each value where it is final: a product's bias added in place (gpt-oss:
`o + bias` in `o`'s buffer) against the op it stores, a table row written twice in one step after its last write."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("egglog")

from test_hardening_fast import copy_env, family_step  # noqa: E402


def q8_step(rows: int):
    """The demo's shape, 2 layers, every layer's rows q8_0 (seeded blocks), a step of `rows` with cache history."""
    from lanefuse.engine.front.demo import demo_config
    from lanefuse.engine.front.model import build_step
    from lanefuse.engine.front.stepweights import random_weights

    cfg = dataclasses.replace(demo_config(32), layers=2)
    names = [n for n in cfg.weight_names() if n.startswith("model.layers.") and n.endswith("proj.weight")]
    cfg = dataclasses.replace(cfg, formats=tuple((n, "q8_0") for n in names))
    g = build_step(cfg, rows)
    w = random_weights(g, 3)
    rng = np.random.default_rng(rows)
    env = {n: (0.5 * rng.standard_normal(g.tensors[n].shape)).astype(np.float32) for n in g.io.tables}
    env[g.io.token] = rng.integers(0, cfg.vocab, rows).astype(np.int32)
    env[g.io.position] = np.asarray([4], np.int32)
    return g, w, env


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64).reshape(-1), np.asarray(b, np.float64).reshape(-1)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("numerics", ["q8", "q8x2"])
def test_a_q8_plan_equals_the_q8_reference_not_the_f32_one(numerics):
    from lanefuse.engine.interp import evaluate
    from lanefuse.engine.formats.quantize import with_numerics
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    g, w, env = q8_step(1)
    s = plan(g, numerics=numerics)
    q = evaluate(with_numerics(g, numerics), w, copy_env(env))
    f = evaluate(g, w, copy_env(env))
    exact = NumpyRunner(s, w, check=True).step(copy_env(env), lifted=g)  # launch by launch, under the same numerics
    fast = NumpyRunner(s, w, exact=False).step(copy_env(env))
    assert _rel(exact["logits"], q["logits"]) <= 1e-4 and _rel(fast["logits"], q["logits"]) <= 1e-4
    # what `check` compared with before: under q8 a false failure (q8x2 lies closer to f32 on this shape)
    assert _rel(q["logits"], f["logits"]) > (1e-4 if numerics == "q8" else 0.0)


def test_run_reference_honors_numerics():
    from lanefuse.engine.interp import evaluate
    from lanefuse.engine.formats.quantize import with_numerics
    from lanefuse.lane.cli.commands import _step_fn

    g, w, env = q8_step(1)
    src = argparse.Namespace(weights=w)
    fn, label = _step_fn(argparse.Namespace(reference=True, numerics="q8"), src, None)
    assert label == "reference interpreter, q8 numerics"
    got = fn(g, copy_env(env))
    assert np.array_equal(got["logits"], evaluate(with_numerics(g, "q8"), w, copy_env(env))["logits"])
    assert _step_fn(argparse.Namespace(reference=True, numerics=None), src, None) == (None, "reference interpreter")


@pytest.mark.parametrize("rows", [1, 4])
def test_a_bias_added_in_place_is_no_divergence(rows):
    """gpt-oss's attention output product with its bias folded: `o + bias` lands in `o`'s buffer (check reported a
    divergence of 1.18 where the logits agreed to 1e-7)."""
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    g, w, env = family_step("gpt_oss", rows)
    s = plan(g)
    assert any("L0.o_bias" in x.ops and "L0.o" in x.launch.writes() for x in s.launches)
    NumpyRunner(s, w, check=True).step(copy_env(env), lifted=g)


def test_a_table_row_written_twice_is_compared_after_its_last_write():
    """A launch writing a cache table's rows, run twice in the step with other values first (a stand-in for a row
    written, then rewritten): no divergence where the row ends right; a wrong last write is still named."""
    from lanefuse.engine.front.demo import demo_model
    from lanefuse.engine.errors import UserError
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    cfg, w = demo_model(32)
    g = build_step(cfg, 1)
    s = plan(g)
    i = next(i for i, x in enumerate(s.launches) if "kc0" in x.launch.writes())
    x = s.launches[i]

    class Garbage:  # writes the same rows with other values first
        def __init__(self, inner):
            self.inner, self.census = inner, inner.census

        def writes(self):
            return self.inner.writes()

        def numpy(self, env):
            self.inner.numpy(env)
            for n in self.inner.writes():
                if n == "kc0":
                    a = env.array(n)
                    a[4 * a.size // 32: 5 * a.size // 32] += 1.0  # position 4's row of 32

    rng = np.random.default_rng(0)
    env = {n: np.zeros(g.tensors[n].shape, np.float32) for n in g.io.tables}
    for n in env:
        env[n][:4] = rng.standard_normal(env[n][:4].shape).astype(np.float32)
    env["token"], env["pos"] = np.asarray([5], np.int32), np.asarray([4], np.int32)
    twice = dataclasses.replace(s, launches=[*s.launches[:i], dataclasses.replace(x, launch=Garbage(x.launch)),
                                             *s.launches[i:]])
    NumpyRunner(twice, w, check=True).step(copy_env(env), lifted=g)
    wrong_last = dataclasses.replace(s, launches=[*s.launches[:i + 1], dataclasses.replace(x, launch=Garbage(x.launch)),
                                                  *s.launches[i + 1:]])
    with pytest.raises(UserError, match=f"launch {i + 1} .* at `kc0`"):
        NumpyRunner(wrong_last, w, check=True).step(copy_env(env), lifted=g)


def write_q8_llama(path: Path) -> Path:
    """A tiny llama GGUF file, its 2-D rows q8_0 (seeded; the gguf package's quantizer), its norms f32."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import quantize

    hidden, layers, heads, kv, inter, vocab = 64, 2, 4, 2, 96, 128
    rng = np.random.default_rng(5)
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in {"llama.context_length": 64, "llama.embedding_length": hidden, "llama.block_count": layers,
                 "llama.feed_forward_length": inter, "llama.attention.head_count": heads,
                 "llama.attention.head_count_kv": kv, "llama.vocab_size": vocab}.items():
        w.add_uint32(k, v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    hd = hidden // heads

    def put(name, *shape):
        if len(shape) == 1:
            w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            return
        a = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
        q8 = gguf.GGMLQuantizationType.Q8_0
        w.add_tensor(name, quantize(a, q8), raw_shape=quantize(a, q8).shape, raw_dtype=q8)

    put("token_embd.weight", vocab, hidden)
    for i in range(layers):
        put(f"blk.{i}.attn_norm.weight", hidden)
        put(f"blk.{i}.attn_q.weight", heads * hd, hidden)
        put(f"blk.{i}.attn_k.weight", kv * hd, hidden)
        put(f"blk.{i}.attn_v.weight", kv * hd, hidden)
        put(f"blk.{i}.attn_output.weight", hidden, heads * hd)
        put(f"blk.{i}.ffn_norm.weight", hidden)
        put(f"blk.{i}.ffn_gate.weight", inter, hidden)
        put(f"blk.{i}.ffn_up.weight", inter, hidden)
        put(f"blk.{i}.ffn_down.weight", hidden, inter)
    put("output_norm.weight", hidden)
    put("output.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _cli(*args):
    import subprocess

    return subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_the_command_checks_q8_against_the_q8_reference_and_runs_it(tmp_path):
    """`check --numerics q8|q8x2` on a q8_0 file passes (the f32 reference failed the q8 plan), and `run --reference
    --numerics q8` prints the tokens of `run --numerics q8`."""
    import json

    f = write_q8_llama(tmp_path / "q8.gguf")
    for numerics in ("q8", "q8x2"):
        r = _cli("check", str(f), "--numerics", numerics)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"(reference under {numerics})" in r.stdout and "FAIL" not in r.stdout, r.stdout
    ids = {}
    for how in ((), ("--reference",)):
        out = tmp_path / f"o{len(how)}.json"
        r = _cli("run", str(f), "--numerics", "q8", "--prompt-ids", "1,2,3", "--tokens", "6", "--json", str(out),
                 *how)
        assert r.returncode == 0, r.stderr
        ids[how] = json.loads(out.read_text())["generated_ids"]
        if how:
            assert "reference interpreter, q8 numerics" in r.stderr  # the model line (lane/cli/commands.py)
    assert ids[()] == ids[("--reference",)]


def test_a_wrong_write_into_a_later_sequences_slot_is_named():
    """A batch step's cache writes are compared in every sequence's slot (the comparison looked at the first
    sequence's rows only): a launch that writes the last sequence's row wrong is named."""
    from lanefuse.engine.front.demo import demo_model
    from lanefuse.engine.errors import UserError
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    cfg, w = demo_model(32)
    g = build_step(cfg, 1, batch=3)
    s = plan(g)
    i = next(i for i, x in enumerate(s.launches) if "kc0" in x.launch.writes())
    x = s.launches[i]

    class LastValueOff:  # the launch, then its last changed value of kc0 (the last sequence's slot) moved
        def __init__(self, inner):
            self.inner, self.census = inner, inner.census

        def writes(self):
            return self.inner.writes()

        def numpy(self, env):
            a = env.array("kc0")
            was = a.copy()
            self.inner.numpy(env)
            a[np.flatnonzero(a != was)[-1]] += 1.0

    rng = np.random.default_rng(0)
    env = {n: (0.5 * rng.standard_normal(g.tensors[n].shape)).astype(np.float32) for n in g.io.tables}
    env["token"], env["pos"] = np.asarray([5, 6, 7], np.int32), np.asarray([3, 9, 4], np.int32)
    NumpyRunner(s, w, check=True).step(copy_env(env), lifted=g)
    bad = dataclasses.replace(s, launches=[*s.launches[:i], dataclasses.replace(x, launch=LastValueOff(x.launch)),
                                           *s.launches[i + 1:]])
    with pytest.raises(UserError, match=f"launch {i} .* at `kc0`"):
        NumpyRunner(bad, w, check=True).step(copy_env(env), lifted=g)
