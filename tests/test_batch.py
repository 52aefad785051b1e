"""Batches: a decode step of several sequences (`build_step(cfg, 1, batch=B)`), its launches over the sequences as
one (`sequences`) or apart (held), and generation in slots that refill: every sequence gets exactly the tokens it gets
alone (same greedy ids, logits within 1e-5 of their scale), on the demo and on transformers-made tiny models of every
family, for prompts of different lengths, sequences ending at different steps and more prompts than slots."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lanefuse.engine.front.demo import demo_model
from lanefuse.engine.errors import UserError
from lanefuse.engine.interp import evaluate
from lanefuse.engine.front.model import build_step
from lanefuse.lane.lower.plan import plan
from lanefuse.lane.run.batch import generate_batch
from lanefuse.lane.run.generate import generate
from lanefuse.lane.run.numpy_runner import NumpyRunner

TOL = 1e-5
DEMO = demo_model()
PLANS: dict = {}  # (model, rows, batch, held, exact) -> runner: each step planned once for the whole module


def fused(cfg, weights, exact: bool = True, held=()):
    """A step function running each step's fused plan with the numpy twins (exact or fast), planned once."""
    def step(g, env):
        key = (id(weights), g.meta["rows"], g.meta.get("batch", 1), tuple(held), exact)
        r = PLANS.get(key)
        if r is None:
            r = PLANS[key] = NumpyRunner(plan(g, held=list(held)), weights, exact=exact)
        return r.step(env)

    return step


def same_as_alone(cfg, weights, prompts, n, slots, step_fn=None, alone=None, eos=()):
    """Generate `prompts` in `slots` and each alone (the reference interpreter); each sequence's tokens equal, its
    logits within TOL of their scale. Returns the batch's results."""
    got = generate_batch(cfg, weights, prompts, n, slots, step_fn=step_fn, eos=eos, chunk=4)
    alone = alone or [generate(cfg, weights, p, n, chunk=4) for p in prompts]
    for k, (b, a) in enumerate(zip(got, alone)):
        want = a.generated_ids
        if eos:  # alone, the sequence stops at its first end-of-sequence id too
            cut = next((i + 1 for i, t in enumerate(want) if t in eos), len(want))
            want = want[:cut]
        assert b.prompt_ids == prompts[k]
        assert b.generated_ids == want, f"prompt {k}: {b.generated_ids} alone {want}"
        for x, y in zip(b.logits, a.logits):
            assert np.abs(x - y).max() <= TOL * max(1.0, float(np.abs(y).max()))
    return got


# -- the batched step ------------------------------------------------------------------------------------------------

def test_batch_step_graph_io():
    cfg, _ = DEMO
    g = build_step(cfg, 1, batch=5)
    assert g.tensors["token"].shape == (5,) and g.tensors["pos"].shape == (5,)
    assert g.tensors["kc0"].shape == (5 * cfg.max_len, cfg.kv_heads * cfg.head_dim)
    assert g.tensors["logits"].shape == (5, cfg.vocab) and g.tensors["next"].shape == (5,)
    assert g.meta["batch"] == 5 and g.meta["rows"] == 5


def test_batch_of_chunks_refused_in_words():
    cfg, _ = DEMO
    with pytest.raises(UserError, match="one row a sequence"):
        build_step(cfg, 4, batch=2)
    with pytest.raises(UserError, match="a batch of 0"):
        build_step(cfg, 1, batch=0)


def _random_env(cfg, B, seed):
    rng = np.random.default_rng(seed)
    kv = cfg.kv_heads * cfg.head_dim
    env = {f"{c}{i}": rng.standard_normal((B * cfg.max_len, kv)).astype(np.float32)
           for i in range(cfg.layers) for c in ("kc", "vc")}
    env["token"] = rng.integers(0, cfg.vocab, B).astype(np.int32)
    env["pos"] = rng.integers(0, 40, B).astype(np.int32)
    return env


def _copy(env):
    return {k: np.array(v, copy=True) for k, v in env.items()}


def test_reference_batch_step_is_each_sequence_alone():
    """The interpreter's batch step: each row what a one-sequence step over that sequence's slot gives."""
    cfg, w = DEMO
    B, L = 3, cfg.max_len
    env = _random_env(cfg, B, 0)
    out = evaluate(build_step(cfg, 1, batch=B), w, _copy(env))
    one = build_step(cfg, 1)
    for s in range(B):
        e = {k: np.array(v[s * L:(s + 1) * L]) for k, v in env.items() if k.startswith(("kc", "vc"))}
        e["token"], e["pos"] = env["token"][s:s + 1], env["pos"][s:s + 1]
        alone = evaluate(one, w, e)
        assert np.abs(out["logits"][s] - alone["logits"][0]).max() == 0.0
        assert out["next"][s] == alone["next"][0]
        for k in e:  # the slot's cache rows: the sequence's row written, nothing else
            if k.startswith(("kc", "vc")):
                assert np.array_equal(out[k][s * L:(s + 1) * L], alone[k])


@pytest.mark.parametrize("held", [(), ("sequences",)])
@pytest.mark.parametrize("exact", [True, False])
def test_fused_batch_step_equals_the_reference(held, exact):
    cfg, w = DEMO
    B = 4
    g = build_step(cfg, 1, batch=B)
    env = _random_env(cfg, B, 1)
    ref = evaluate(g, w, _copy(env))
    e = _copy(env)
    got = fused(cfg, w, exact, held)(g, e)
    scale = float(np.abs(ref["logits"]).max())
    assert np.abs(got["logits"] - ref["logits"]).max() <= TOL * scale
    assert np.array_equal(got["next"], ref["next"])
    for k in e:
        if k.startswith(("kc", "vc")):
            assert np.abs(e[k] - ref[k]).max() <= 1e-5
    # the advance: each sequence's token and position, for the next step on the device
    r = PLANS[(id(w), B, B, tuple(held), exact)]
    assert np.array_equal(r.env.array("token"), ref["next"])
    assert np.array_equal(r.env.array("pos"), env["pos"] + 1)


def test_sequences_as_one_launch_and_held_apart():
    """Under `sequences` a batch of 8 takes as many launches a layer as one sequence, of the same kinds (the product
    folds writing each sequence's key and value rows into its slot); held, each sequence's attention and rotation is
    a launch of its own."""
    cfg, w = DEMO
    g1, g8 = build_step(cfg, 1, batch=1), build_step(cfg, 1, batch=8)
    # a batch of 8 rows runs each layer as one sequence does, one five-phase chain (its products on chain.cu's slab,
    # fold_attn_o_glu_down_slab; a batch of more than 2 kept five launches a layer before)
    one, as_one, apart = plan(g1), plan(g8), plan(g8, held=["sequences"])
    assert as_one.census == one.census and as_one.per_layer() == one.per_layer()
    assert as_one.fusions.get("qkv_attn_o_glu_down_norm") == cfg.layers
    assert apart.census["attention"] == 8 * cfg.layers and apart.census["rope_parts"] == 8 * cfg.layers
    assert all(apart.per_layer()[k] > one.per_layer()[k] for k in range(cfg.layers))
    assert "sequences" in apart.held


def test_a_batch_of_two_is_one_chain_a_layer_and_held_apart():
    """A batch of 2 runs each layer as one five-phase chain (qkv_attn_o_glu_down_norm: its attention phase reads each
    sequence's position and slot), as one sequence does; `sequences` held, no launch reads a batch's positions for
    two sequences (each attention and rotation a launch a sequence, the chain's phases apart where it had them), and
    the same logits and tokens."""
    from lanefuse.kernels import Chain

    cfg, w = DEMO
    g = build_step(cfg, 1, batch=2)
    on, apart = plan(g), plan(g, held=["sequences"])
    assert on.census == plan(build_step(cfg, 1)).census
    assert on.fusions.get("qkv_attn_o_glu_down_norm") == cfg.layers
    assert all(x.launch.attention.slot for x in on.launches if isinstance(x.launch, Chain))
    assert apart.census["attention"] == 2 * cfg.layers and apart.census["rope_parts"] == 2 * cfg.layers
    assert not any(isinstance(x.launch, Chain) and x.launch.attention is not None for x in apart.launches)
    env = _random_env(cfg, 2, 5)
    a = NumpyRunner(on, w, exact=True).step(_copy(env))
    b = NumpyRunner(apart, w, exact=True).step(_copy(env))
    assert np.abs(a["logits"] - b["logits"]).max() <= TOL * max(1.0, float(np.abs(a["logits"]).max()))
    assert np.array_equal(a["next"], b["next"])


def test_held_sequences_unknown_before_now_is_a_step():
    cfg, _ = DEMO
    with pytest.raises(UserError, match="did you mean"):
        plan(build_step(cfg, 1, batch=2), held=["sequence"])


def test_a_position_past_a_slot_is_refused():
    cfg, w = DEMO
    g = build_step(cfg, 1, batch=2)
    r = NumpyRunner(plan(g), w)
    env = _random_env(cfg, 2, 3)
    env["pos"] = np.array([3, cfg.max_len], dtype=np.int32)
    with pytest.raises(UserError, match="sequence 1 of the batch at position"):
        r.step(env)


# -- kernels: a batch launch and its sequences apart give the same numbers -------------------------------------------

def test_batch_launches_apart_write_what_the_batch_launch_writes():
    cfg, w = DEMO
    g = build_step(cfg, 1, batch=5)
    p = plan(g, held=["qkv_attn_o_glu_down_norm", "attn_o_glu_down_norm"])  # the attention a launch of its own
    attn = [x.launch for x in p.launches if x.launch.census == "attention"]
    # each layer's rotations writing the key rows into each slot: rope_parts of their own at 5 rows (bc666ef), or a
    # fold's epilogue where the products and rotations fold
    folds = [x.launch.then for x in p.launches if x.launch.census == "fold" and getattr(x.launch.then, "slot", 0)]
    folds += [x.launch for x in p.launches if x.launch.census == "rope_parts" and x.launch.slot]
    assert attn and all(a.slot == cfg.max_len and a.len == cfg.max_len for a in attn)
    assert len(folds) == cfg.layers
    for l in attn + folds:
        parts = l.apart()
        assert len(parts) == 5 and [q.seq0 for q in parts] == list(range(5))


# -- generation in slots -----------------------------------------------------------------------------------------------

PROMPTS = [[1, 2, 3], [7, 8], [5, 9, 11, 4, 6], [100], [3, 3, 3, 3, 3, 3, 3]]


@pytest.mark.parametrize("slots", [1, 2, 5])
def test_slots_refill_reference(slots):
    cfg, w = DEMO
    same_as_alone(cfg, w, PROMPTS, 4, slots)


def test_slots_refill_fused_plan_fast_and_exact():
    cfg, w = DEMO
    alone = [generate(cfg, w, p, 4, chunk=4) for p in PROMPTS]
    for exact in (True, False):
        same_as_alone(cfg, w, PROMPTS, 4, 3, step_fn=fused(cfg, w, exact), alone=alone)


def test_sequences_end_at_their_eos_and_give_their_slot_on():
    cfg, w = DEMO
    alone = [generate(cfg, w, p, 6, chunk=4) for p in PROMPTS]
    eos = (alone[0].generated_ids[2], alone[2].generated_ids[0])  # prompt 0 ends at its 3rd token, prompt 2 at once
    got = same_as_alone(cfg, w, PROMPTS, 6, 2, alone=alone, eos=eos)
    assert len(got[0].generated_ids) <= 3 and len(got[2].generated_ids) == 1


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(st.integers(0, 511), min_size=1, max_size=9), min_size=1, max_size=6),
       st.integers(1, 4), st.integers(1, 4))
def test_random_prompt_sets_and_slot_counts(prompts, slots, n):
    cfg, w = DEMO
    same_as_alone(cfg, w, prompts, n, slots, step_fn=fused(cfg, w, exact=False))


def test_a_batch_that_does_not_fit_is_refused_before_it_runs():
    cfg, w = DEMO
    with pytest.raises(UserError, match="prompt 2: .* need"):
        generate_batch(cfg, w, [[1], list(range(cfg.max_len))], 3)
    with pytest.raises(UserError, match="prompt 1 is empty"):
        generate_batch(cfg, w, [[]], 3)


# -- transformers-made models of every family ------------------------------------------------------------------------

HF_PROMPTS = [[3, 17, 5, 42, 8, 11], [9, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7]]


def _hf_model(name, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from lanefuse.engine.front.load import load_model

    if name in ("llama_llama3_f32", "mistral_window_f32", "phi3_window_f32", "qwen2_f32", "qwen3_f32"):
        from test_hf_parity import _build

        folder, _ = _build(name, tmp_path)
    elif name.startswith("gemma"):
        from test_gemma import _build

        folder, _ = _build(name, tmp_path)
    elif name == "qwen3_moe":
        from test_moe import build

        folder = tmp_path / name
        build(name, "float32", folder)
    elif name == "qwen3next":
        from test_qwen3next import build

        folder, _ = build("f32", tmp_path)
    elif name == "deepseek_v3":
        from test_deepseek import VARIANTS, build

        folder = tmp_path / name
        build(VARIANTS["f32"][0], folder, **VARIANTS["f32"][1])
    else:
        from test_gptoss import build

        folder = tmp_path / name
        build("float32", folder)
    return load_model(folder)


FAMILIES = ["llama_llama3_f32", "mistral_window_f32", "phi3_window_f32", "qwen2_f32", "qwen3_f32", "gemma2_f32",
            "gemma3_f32", "qwen3_moe", "gpt_oss", "qwen3next", "deepseek_v3"]


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_batched_as_alone(name, tmp_path):
    cfg, w = _hf_model(name, tmp_path)
    prompts = [[t % cfg.vocab for t in p] for p in HF_PROMPTS]
    alone = [generate(cfg, w, p, 5, chunk=4) for p in prompts]
    same_as_alone(cfg, w, prompts, 5, 2, alone=alone)  # the reference's batch step
    same_as_alone(cfg, w, prompts, 5, 3, step_fn=fused(cfg, w, exact=True), alone=alone)
    same_as_alone(cfg, w, prompts, 5, 2, step_fn=fused(cfg, w, exact=False, held=("sequences",)), alone=alone)


# -- each batch kind alone: its batch launch, its sequences apart, and each sequence as a one-sequence launch ---------

def _batch_kinds(g, B=3, L=24, hd=16, heads=4, kv=2):
    """A batch of B sequences of one row: the rotation (q to a buffer, k into each sequence's cache row), the value
    row writes and the attention, each with its slot set; random caches, positions inside each slot."""
    from lanefuse.kernels import Attention, Dst, Part, RopeParts, RopeSide, SetRow

    rot = hd
    ang = g.uniform(0, 6.28, (L, rot // 2))
    arrays = {"q": g.standard_normal((B, heads * hd + 3)).astype(np.float32),
              "k": g.standard_normal((B, kv * hd)).astype(np.float32),
              "v": g.standard_normal((B, kv * hd)).astype(np.float32),
              "qo": np.zeros(B * heads * hd, np.float32),
              "kc": g.standard_normal((B * L, kv * hd)).astype(np.float32).reshape(-1),
              "vc": g.standard_normal((B * L, kv * hd)).astype(np.float32).reshape(-1),
              "o": np.zeros(B * heads * hd, np.float32),
              "pos": np.array([5, 0, L - 1][:B] + [3] * max(0, B - 3), np.int32),
              "tok": np.zeros(B, np.int32), "x": g.standard_normal((B, 50)).astype(np.float32),
              "am": np.zeros(B, np.int32)}
    weights = {"cos": (np.cos(ang).astype(np.float32), "f32"), "sin": (np.sin(ang).astype(np.float32), "f32"),
               "qn": (g.standard_normal(hd).astype(np.float32), "f32")}
    sides = (RopeSide("q", Dst("qo"), heads, part=Part(heads * hd + 3, 1, heads * hd), norm=("qn", 1e-6)),
             RopeSide("k", Dst("kc", row="pos", pitch=kv * hd), kv))
    launches = [RopeParts(sides, "cos", "sin", "pos", B, hd, rot),
                SetRow("vc", "v", "pos", kv * hd, B, B * L),
                Attention("q_", "kc", "vc", "pos", "o", heads, heads // kv, hd, hd, B * L, B, hd ** -0.5,
                          splits=3, per_block=2)]
    return arrays, weights, [l.batched("pos", L) for l in launches]


def _run(launches, arrays, weights, fast=False):
    from lanefuse.kernels import HostEnv

    env = HostEnv({k: v.copy() for k, v in arrays.items()}, weights)
    env.arrays["q_"] = env.arrays["qo"]  # the attention reads the rotated queries
    for l in launches:
        l.fast(env) if fast else l.numpy(env)
    return env


def test_batch_kinds_apart_and_fast_equal_the_batch_launch():
    g = np.random.default_rng(16)
    arrays, weights, launches = _batch_kinds(g)
    assert all(not isinstance(l, type(None)) and l.slot == 24 for l in launches)
    whole = _run(launches, arrays, weights)
    apart = _run([p for l in launches for p in l.apart()], arrays, weights)
    fast = _run(launches, arrays, weights, fast=True)
    fast_apart = _run([p for l in launches for p in l.apart()], arrays, weights, fast=True)
    for name in ("qo", "kc", "vc", "o"):
        assert np.array_equal(whole.array(name), apart.array(name)), name
        np.testing.assert_allclose(fast.array(name), whole.array(name), rtol=1e-5, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(fast_apart.array(name), whole.array(name), rtol=1e-5, atol=1e-5, err_msg=name)


def test_batch_kinds_equal_each_sequence_alone():
    """Each sequence of the batch launches: what the one-sequence launches give over its own slot."""
    from dataclasses import replace

    from lanefuse.kernels import HostEnv

    g = np.random.default_rng(17)
    B, L, kv, hd = 3, 24, 2, 16
    arrays, weights, launches = _batch_kinds(g, B, L)
    whole = _run(launches, arrays, weights)
    rope, setrow, att = launches
    for s in range(B):
        c = kv * hd
        one = {"q": arrays["q"][s:s + 1], "k": arrays["k"][s:s + 1], "v": arrays["v"][s:s + 1],
               "qo": np.zeros(rope.sides[0].heads * hd, np.float32),
               "kc": arrays["kc"][s * L * c:(s + 1) * L * c].copy(), "vc": arrays["vc"][s * L * c:(s + 1) * L * c].copy(),
               "o": np.zeros(att.heads * hd, np.float32), "pos": arrays["pos"][s:s + 1].copy()}
        env = HostEnv(one, weights)
        env.arrays["q_"] = env.arrays["qo"]
        for l in (replace(rope, rows=1, slot=0), replace(setrow, count=1, len=L, slot=0),
                  replace(att, rows=1, len=L, slot=0)):
            l.numpy(env)
        assert np.array_equal(env.array("kc"), whole.array("kc")[s * L * c:(s + 1) * L * c])
        assert np.array_equal(env.array("vc"), whole.array("vc")[s * L * c:(s + 1) * L * c])
        n = att.heads * hd
        assert np.array_equal(env.array("o"), whole.array("o")[s * n:(s + 1) * n])


def test_batch_argmax_advances_every_sequence():
    from lanefuse.kernels import Advance, ArgMax, HostEnv

    g = np.random.default_rng(18)
    x = g.standard_normal((4, 33)).astype(np.float32)
    a = ArgMax("x", "o", 33, 4, advance=Advance("tok", "pos")).batched("pos", 10)
    env = HostEnv({"x": x, "o": np.zeros(4, np.int32), "tok": np.zeros(4, np.int32),
                   "pos": np.array([1, 5, 0, 9], np.int32)}, {})
    a.numpy(env)
    assert np.array_equal(env.array("tok"), x.argmax(axis=1)) and np.array_equal(env.array("o"), x.argmax(axis=1))
    assert np.array_equal(env.array("pos"), [2, 6, 1, 10])


def test_a_product_writes_each_sequence_row_into_its_slot_or_says_why_not():
    from lanefuse.engine.refusal import Refusal
    from lanefuse.kernels import Dst, Gemv, HostEnv, Part

    g = np.random.default_rng(20)
    B, L, k, n = 3, 6, 8, 16
    l = Gemv("x", "w", "f32", Dst("vc", row="pos", pitch=n), k, n, B).batched("pos", L)
    assert l.y.slot == L
    x, w = g.standard_normal((B, k)).astype(np.float32), g.standard_normal((n, k)).astype(np.float32)
    pos = np.array([2, 0, 5], np.int32)
    for twin in ("numpy", "fast"):
        env = HostEnv({"x": x, "vc": np.zeros(B * L * n, np.float32), "pos": pos}, {"w": (w, "f32")})
        getattr(l, twin)(env)
        vc = env.array("vc").reshape(B * L, n)
        for s_ in range(B):
            np.testing.assert_allclose(vc[s_ * L + pos[s_]], w @ x[s_], rtol=1e-5, atol=1e-5)
        assert np.count_nonzero(np.abs(vc).sum(axis=1)) == B  # nothing else written
    parts = Gemv("x", "w", "f32", Dst("kv", row="pos", pitch=2 * n, unit=Part(2 * n, 0, n)), k, n, B)
    why = parts.batched("pos", L)
    assert isinstance(why, Refusal) and "parts of a wider table row" in why.reason
    assert Gemv("x", "w", "f32", Dst("y"), k, n, B).batched("pos", L) == Gemv("x", "w", "f32", Dst("y"), k, n, B)


@pytest.mark.gpu
def test_batch_kinds_on_the_device():
    """The batch launches' CUDA against their numpy twins (with the GPU suite; skipped without a device)."""
    from test_kernels_gpu import _device, both

    if not _device():
        pytest.skip("no CUDA device")
    from lanefuse.kernels import Advance, ArgMax

    g = np.random.default_rng(19)
    for B in (1, 3, 8):
        arrays, weights, launches = _batch_kinds(g, B)
        arrays["q_"] = np.zeros(1, np.float32)
        for l in launches:
            ins = dict(arrays)
            if l.census == "attention":
                ins["q_"] = g.standard_normal(B * l.heads * l.hd).astype(np.float32)
            both(l, ins, weights, tol=2e-4)
            for p in l.apart():
                both(p, ins, weights, tol=2e-4)
        x = g.standard_normal((B, 2049)).astype(np.float32)
        both(ArgMax("x", "am", 2049, B, advance=Advance("tok", "pos")).batched("pos", 24),
             {"x": x, "am": np.zeros(B, np.int32), "tok": np.zeros(B, np.int32),
              "pos": np.arange(B, dtype=np.int32)}, {})


# -- the command -------------------------------------------------------------------------------------------------------

def _main(*args):
    from lanefuse.lane.cli.main import main

    return main(list(args))


def test_run_a_batch_json_records_in_prompt_order(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert _main("run", "--prompt-ids", "1,2,3", "--prompt-ids", "7,8", "--prompt-ids", "5", "--batch", "2",
                 "--tokens", "4", "--reference", "--json", str(out)) == 0
    said = capsys.readouterr()
    assert "KV caches: 2 slot(s) of 256 rows, 1.0 MiB" in said.err and "prompt 3: 5 ->" in said.out
    recs = __import__("json").loads(out.read_text())
    assert [r["prompt_ids"] for r in recs] == [[1, 2, 3], [7, 8], [5]]
    cfg, w = DEMO
    for r in recs:
        alone = generate(cfg, w, r["prompt_ids"], 4)
        assert r["generated_ids"] == alone.generated_ids
        assert set(r) >= {"model", "prompt_ids", "generated_ids", "logits", "timings"}
        assert np.abs(np.array(r["logits"]) - np.array(alone.logits)).max() <= TOL * 10


def test_run_prompts_file_and_its_bad_lines(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text("[1, 2]\n\n[9]\n")
    assert _main("run", "--prompts", str(f), "--tokens", "2", "--reference", "--json", "-") == 0
    recs = __import__("json").loads(capsys.readouterr().out)
    assert [r["prompt_ids"] for r in recs] == [[1, 2], [9]]
    for text, msg in (("[1, 2]\n{\"x\": 1}\n", "p.jsonl:2: a line is a JSON list"), ("[1,\n", "p.jsonl:1: not JSON"),
                      ("{\"prompt\": \"hi\"}\n", "p.jsonl:1: a text prompt needs"), ("[1, 99999]\n", "outside the voc")):
        f.write_text(text)
        assert _main("run", "--prompts", str(f), "--tokens", "2", "--reference") != 0
        err = capsys.readouterr().err
        assert msg in err and err.count("error:") == 1 and "Traceback" not in err, err


def test_run_batch_refusals_in_one_line(tmp_path, capsys, monkeypatch):
    assert _main("run", "--prompt-ids", "1", "--prompt-ids", "2", "--tokens", "300", "--reference") != 0
    assert "prompt 1: 1 prompt tokens and 300 generated need 300 positions" in capsys.readouterr().err
    for more in (["--prompt-ids", "2"], ["--batch", "1"]):  # a batch over ranks runs in rank processes, never in
        assert _main("run", "--prompt-ids", "1", *more, "--tokens", "2", "--ranks", "2") != 0  # one: the demo not
        err = capsys.readouterr().err  # in a file, refused (tests/test_ranks_cli.py runs a checkpoint's batch)
        assert "run --ranks 2: each rank process reads the model from its file" in err and err.count("error:") == 1 \
            and "Traceback" not in err, err
    saved = tmp_path / "b2.json"  # a saved batch step's caches hold 2 slots of the demo's 256 rows: a slot is 256
    assert _main("plan", "--batch", "2", "--save", str(saved)) == 0
    capsys.readouterr()
    assert _main("run", "--plan", str(saved), "--prompt-ids", "1", "--prompt-ids", "2", "--batch", "2") != 0
    err = capsys.readouterr().err  # (was: "--ctx 512: the demo model allows at most 256 positions")
    assert "a saved plan is one step; a batch plans its own steps" in err and err.count("error:") == 1, err
    import lanefuse.lane.cli.source as source

    # a slot's caches (0.5 MiB) within a quarter of 2.5 MiB, three slots' past half of it
    monkeypatch.setattr(source, "_memory_bytes", lambda: 5 << 19)
    assert _main("run", "--prompt-ids", "1", "--prompt-ids", "2", "--batch", "3", "--ctx", "256", "--reference") != 0
    err = capsys.readouterr().err
    assert "--batch 3 with --ctx 256: the KV caches of 3 slots need" in err and err.count("error:") == 1
    monkeypatch.setattr(source, "_memory_bytes", lambda: 1 << 20)  # one sequence's caches past a quarter: --ctx
    assert _main("run", "--prompt-ids", "1", "--prompt-ids", "2", "--batch", "2", "--ctx", "256", "--reference") != 0
    err = capsys.readouterr().err
    assert "--ctx 256: the KV caches and carried states of 256 rows need" in err and err.count("error:") == 1


def test_plan_batch_prints_the_caches(capsys):
    assert _main("plan", "--batch", "4", "--all") == 0  # --all: layer 0's launches and their fields
    cap = capsys.readouterr()
    assert "KV caches: 4 slots of 256 rows, 2.0 MiB" in cap.err
    # layer 0's attention to layer 1's norm one chained launch (listed under layer 1): its phases, rows and slot
    assert _main("plan", "--batch", "4", "--layer", "1") == 0
    assert "phases=fold+attention+fold+gemv_glu+fold rows=4 per_warp=4 slot=256" in capsys.readouterr().out
    held = [a for r in ("qkv_attn_o_glu_down_norm", "attn_o_glu_down_norm") for a in ("--hold", r)]
    assert _main("plan", "--batch", "4", "--all", *held) == 0  # the attention a launch of its own
    assert "slot=256" in capsys.readouterr().out
    assert _main("plan", "--batch", "4", "--rows", "2") != 0
    assert "a batch step decodes one row a sequence" in capsys.readouterr().err


def test_batch_launch_arguments_match_the_kernels():
    """Each sample launch of tests/test_kernels_compile.py batched (and apart): its CUDA arguments against its kernel's
    parameters (NVRTC's PTX), no device needed."""
    from test_kernels_compile import NVCC, RecordingEnv, arg_kind, fused_folds, nvrtc, ptx_params, samples

    from lanefuse.engine.refusal import Refusal

    if nvrtc() is None and NVCC is None:
        pytest.skip("neither NVRTC (cuda-python) nor nvcc is present: no PTX to read the kernels' parameters from")
    env = RecordingEnv()
    batched = 0
    for launch in samples() + fused_folds():
        b = launch.batched("pos", 4)
        if isinstance(b, Refusal) or b == launch:
            continue
        batched += 1
        for l in (b, *b.apart()):
            assert l.check() is None, (l.census, l.check())
            l.cuda(env)
    assert batched >= 10
    entries: dict = {}
    for stems, name, grid, block, args in env.calls:
        if stems not in entries:
            entries[stems] = ptx_params(stems)
        params = entries[stems][name]
        want = ["f32" if p == "f32" else "b64" if p in ("u64", "b64", "s64") else p for p in params]
        assert [arg_kind(a) for a in args] == want, name


@pytest.mark.parametrize("held", [(), ("sequences",)])
def test_a_saved_batch_plan_loads_and_runs_as_planned(tmp_path, held):
    from lanefuse.lane.lower.planfile import load, save

    cfg, w = DEMO
    g = build_step(cfg, 1, batch=3)
    p = plan(g, held=list(held))
    save(p, str(tmp_path / "b.json"))
    q = load(str(tmp_path / "b.json"))  # the plan check: every launch's reach against its tensors
    assert q.batch == 3 and q.n_launches == p.n_launches
    env = _random_env(cfg, 3, 5)
    want = evaluate(g, w, _copy(env))
    got = NumpyRunner(q, w).step(_copy(env))
    assert np.array_equal(got["next"], want["next"])
    assert np.abs(got["logits"] - want["logits"]).max() <= TOL * float(np.abs(want["logits"]).max())


@pytest.mark.parametrize("family,slots", [("demo", 2), ("qwen3next", 2), ("qwen3next", 1), ("deepseek_v3", 2)])
def test_slots_on_the_device_runner_wiring(monkeypatch, family, slots, tmp_path):
    """The CuPy runner's batch (a stand-in `cupy` backed by numpy, tests/test_cupy_runner_mock.py): each prompt
    prefilled into the one-sequence caches on the device and copied into its slot's rows, the batch step over the
    slots; the same tokens and logits as the numpy backend's. Qwen3-Next's rings and delta-rule states too: a prompt
    that takes a slot another left is prefilled from zeroed one-sequence states, not the last prompt's (in one slot
    too, where the one-sequence step decodes)."""
    from test_cupy_runner_mock import fake_cupy  # noqa: F401  (the fixture's body, run here)

    import test_cupy_runner_mock as mock

    monkeypatch.setitem(__import__("sys").modules, "cupy", mock._fake_cupy())
    from lanefuse.kernels import KINDS
    from lanefuse.kernels.common import Launch
    from lanefuse.kernels.cupy_env import DeviceEnv

    def cuda(self, denv):
        if mock._CAPTURE is not None:
            mock._CAPTURE.append((self, denv))
        else:
            self.numpy(denv)

    for k in KINDS.values():
        monkeypatch.setattr(k, "cuda", cuda)
    monkeypatch.setattr(Launch, "cuda", cuda, raising=False)
    monkeypatch.setattr(DeviceEnv, "param", lambda self, name: int(np.asarray(self.array(name))[0]))
    import lanefuse.lane.run.step as step

    monkeypatch.setattr(step, "pick_device", lambda d: "gpu")
    cfg, w = DEMO if family == "demo" else _hf_model(family, tmp_path)
    prompts = [[t % cfg.vocab for t in p] for p in PROMPTS]
    fn, label = step.plan_step_fn(w, "gpu")
    assert "CuPy" in label and hasattr(fn, "to_slot")
    got = generate_batch(cfg, w, prompts, 4, slots, step_fn=fn, chunk=4)
    want = generate_batch(cfg, w, prompts, 4, slots, step_fn=fused(cfg, w, exact=True), chunk=4)
    assert [r.generated_ids for r in got] == [r.generated_ids for r in want]
    assert max(float(np.abs(np.array(a.logits) - np.array(b.logits)).max()) for a, b in zip(got, want)) == 0.0
