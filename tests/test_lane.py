"""The lane: fused plans run by the numpy backend inside their arena match the reference interpreter of the lifted
graph — tokens exactly, logits within 1e-4 of their scale — for every dense architecture, under random held sets;
goldens pin the demo's census and arena; errors say what is wrong."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from lanefuse.engine.front.demo import demo_model, random_arrays
from lanefuse.engine.errors import UserError
from lanefuse.lane.run.generate import generate, new_caches
from lanefuse.engine.interp import evaluate
from lanefuse.engine.front.model import ModelConfig, build_step
from lanefuse.engine.rules import load_table
from lanefuse.engine.front.weights import Weights
from lanefuse.lane.lower.arena import check
from lanefuse.lane.lower.plan import ALWAYS, plan
from lanefuse.lane.lower.table import load_lane
from lanefuse.lane.run.numpy_runner import NumpyRunner

TOL = 1e-4


def _rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / max(np.max(np.abs(b)), 1e-30))


def _step_fn(**kw):
    cache = {}

    def fn(g, env):
        rows = g.meta["rows"]
        if rows not in cache:
            cache[rows] = NumpyRunner(plan(g, **kw), kw_weights[0])
        return cache[rows].step(env, lifted=g)

    kw_weights = [None]
    return fn, kw_weights


def _parity(cfg, weights, prompt, n, **kw):
    fn, ws = _step_fn(**kw)
    ws[0] = weights
    fused = generate(cfg, weights, prompt, n, step_fn=fn, chunk=4)
    ref = generate(cfg, weights, prompt, n, chunk=4)
    assert fused.generated_ids == ref.generated_ids
    err = max(_rel(a, b) for a, b in zip(fused.logits, ref.logits))
    assert err <= TOL, err
    return ref.generated_ids, err


def test_demo_parity_32_tokens():
    cfg, w = demo_model()
    ids, err = _parity(cfg, w, [1, 2, 3, 4, 5, 6], 32)
    assert len(set(ids)) > 4


ARCHS = {
    "llama": ModelConfig("LlamaForCausalLM", 96, 2, 6, 2, 16, 160, 128, eps=1e-5, rope_theta=500000.0,
                         rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                                       ("original_max_position_embeddings", 64), ("rope_type", "llama3")),
                         max_len=64, name="tiny-llama"),
    "qwen2": ModelConfig("Qwen2ForCausalLM", 64, 2, 4, 2, 16, 128, 120, qkv_bias=True, rope_theta=1e6,
                         tie_embeddings=True, max_len=64, name="tiny-qwen2"),
    "qwen3": ModelConfig("Qwen3ForCausalLM", 64, 2, 4, 1, 32, 96, 100, qk_norm=True, max_len=64,
                         formats=(("model.layers.0.mlp.up_proj.weight", "bf16"),), name="tiny-qwen3"),
    "partial": ModelConfig("LlamaForCausalLM", 64, 1, 4, 4, 16, 64, 90, partial_rotary=0.5, max_len=64,
                           name="tiny-partial"),
}


def _weights(cfg: ModelConfig) -> Weights:
    arrays = random_arrays(cfg, seed=11)
    for name, fmt in cfg.formats:
        if fmt == "bf16":
            from lanefuse.engine.front.weights import f32_to_bf16

            arrays[name] = f32_to_bf16(arrays[name])
    return Weights.from_dict(arrays, cfg)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_architectures_parity(arch):
    cfg = ARCHS[arch]
    _parity(cfg, _weights(cfg), [3, 1, 4, 1, 5], 12)


@pytest.mark.parametrize("lane", ["cuda", "conservative"])
def test_prefill_chunk_parity_per_lane(lane):
    cfg, w = demo_model()
    _parity(cfg, w, list(range(1, 10)), 4, lane=lane)


def _one_step(cfg, w, rows, held):
    g = build_step(cfg, rows)
    env = new_caches(cfg)
    rng = np.random.default_rng(rows)
    for k in env:  # a cache with history, so the attention reads rows it did not just write
        env[k][:8] = rng.standard_normal(env[k][:8].shape).astype(np.float32)
    env["token"] = rng.integers(0, cfg.vocab, rows).astype(np.int32)
    env["pos"] = np.asarray([8], np.int32)
    ref_env = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in env.items()}
    ref = evaluate(g, w, ref_env)
    s = plan(g, held=held)
    out = NumpyRunner(s, w).step(env, lifted=g)
    assert int(out["next"][0]) == int(ref["next"][0])
    assert _rel(out["logits"], ref["logits"]) <= TOL
    for k in [f"kc{i}" for i in range(cfg.layers)] + [f"vc{i}" for i in range(cfg.layers)]:
        assert _rel(env[k], ref_env[k]) <= TOL, k
    return s


# the lane table lists the steps; a rule the plan always takes (plan.ALWAYS) is refused when held (test_issue40_meanings)
HOLDABLE = sorted(set(load_table().names) - set(ALWAYS)) + sorted(load_lane("cuda").schedule)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(held=st.sets(st.sampled_from(HOLDABLE), max_size=6), rows=st.sampled_from([1, 3]))
def test_random_held_sets_do_not_change_the_numbers(held, rows):
    cfg, w = demo_model()
    s = _one_step(cfg, w, rows, sorted(held))
    check(s.arena)
    fired = set(s.fusions)
    assert not fired & held


def test_each_rule_held_in_turn_removes_its_class():
    cfg, w = demo_model()
    g = build_step(cfg, 1)
    base = plan(g)
    for rule in sorted(set(base.fusions) - set(ALWAYS)):
        s = plan(g, held=[rule])
        assert rule not in s.fusions
        assert s.cost_us >= base.cost_us - 1e-9


# Reviewed by eye: per layer, the q/k/v products in parts with the head norms and rotations in their epilogue and
# k/v written into the cache rows; the attention; the o product folded with the add and the next norm; the gate/up
# products with the GLU; the down product folded with the add and the next norm. Counted in kernel launches: each
# fold here runs as one kernel (kernels/fold.py); at decode the q/k/v fold, the attention, the o fold, the GLU and
# the down fold are one chained launch (qkv_attn_o_glu_down_norm, kernels/chain.py: fold 6 and chain 4 with the
# q/k/v fold apart, attn_o_glu_down_norm; attention 4 and chain 4 with the three-phase chain, o_glu_down_norm; fold 10
# with the two-phase chain, glu_down_norm; fold 14, gemv_glu 4 before that). A chunk of 8 rows chains every layer but
# the last (the five-phase chain's products on chain.cu's slab; 13 launches where 28 kept five a layer), whose down
# product's norm reads the last row only: its q/k/v products as gemm_parts, their rotation as rope_parts, its
# attention, o fold, GLU and down product launches of their own.
GOLDEN_DECODE = {"chain": 4, "fold": 2}  # the embedding's norm fold; the head and its arg-max one fold (head_argmax)
GOLDEN_PREFILL8 = {"attention": 1, "binary": 1, "chain": 3, "fold": 3, "gemm_parts": 1, "gemv": 1, "gemv_glu": 1,
                   "norm": 1, "rope_parts": 1}


def test_goldens_demo_decode_and_prefill():
    cfg, _ = demo_model()
    dec = plan(build_step(cfg, 1))
    assert dec.census == GOLDEN_DECODE
    # the attention's keys in 4 splits (256 cache rows, at least 64 a split: attn_split_min), their partials in the
    # arena: 4 splits x 8 heads x (32 + 4) floats a row (attention.py part_stride: each split's values 16-byte aligned
    # for the chained merge's cp.async; 256 bytes less at 32 + 2); the chained launch's o product, sum, normed row,
    # GLU and down product all live through that one launch (7424 with the two-phase chain, o_glu_down_norm held; 10240 with the
    # three-phase chain; 15616 with the attention in the chain too: its q, partials and output live through it; 17920
    # with the q/k/v fold in it too: the raw q and k products beside the rotated q live through the one launch; 18176
    # with the partials' wider rows)
    assert dec.arena.bytes == 18176 and dec.arena.lower_bound == 18176
    pre = plan(build_step(cfg, 8))
    assert pre.census == GOLDEN_PREFILL8
    # (59392 with each layer's five launches: a chained launch's q/k/v, attention, o, GLU and down rows of 8 all live
    # through it; 143360 with the partials' rows 32 + 2 floats)
    assert pre.arena.bytes == 145408 and pre.arena.lower_bound == 145408


def test_launches_a_layer_of_a_qwen3_decode_step():
    cfg, _ = demo_model()
    s = plan(build_step(cfg, 1))
    per = [v for k, v in s.per_layer().items() if 0 <= k < cfg.layers - 1]
    assert per and max(per) <= 5
    # one a layer (the q/k/v fold, the attention, the o fold, the GLU and the down fold one chained launch,
    # qkv_attn_o_glu_down_norm), and the embedding, the head's product with its arg-max (head_argmax)
    assert s.n_launches == cfg.layers + 2


def test_conservative_lane_plans_from_data_alone():
    cfg, _ = demo_model()
    g = build_step(cfg, 1)
    cuda, cons = plan(g, lane="cuda"), plan(g, lane="conservative")
    assert cons.n_launches > cuda.n_launches
    assert "fold" not in cons.census and "gemm_parts" not in cons.census


def test_a_placement_bug_shows_as_a_wrong_number():
    """Every step-local array lives in the one arena: overlapping two live arrays breaks the numbers."""
    cfg, w = demo_model()
    g = build_step(cfg, 1)
    s = plan(g, held=["gemv_norm_epilogue", "add_norm", "embed_norm", "attn_o_glu_down_norm",
                      "qkv_attn_o_glu_down_norm"])  # the attention apart
    arrays = sorted(s.arena.arrays, key=lambda p: -p.bytes)
    a = next(p for p in arrays if p.name == "L1.resid_attn")
    b = next(p for p in arrays if p.name != a.name and p.first <= a.last and a.first <= p.last)
    bad = [dataclasses.replace(p, offset=b.offset) if p.name == a.name else p for p in s.arena.arrays]
    s.arena = dataclasses.replace(s.arena, arrays=bad)
    env = new_caches(cfg)
    env["token"], env["pos"] = np.asarray([7], np.int32), np.asarray([0], np.int32)
    out = NumpyRunner(s, w).step({k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in env.items()})
    ref = evaluate(g, w, {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in env.items()})
    assert _rel(out["logits"], ref["logits"]) > TOL


def test_check_2_names_the_first_divergent_launch(monkeypatch):
    from lanefuse.kernels import GemvGlu

    cfg, w = demo_model()
    g = build_step(cfg, 1)
    s = plan(g)
    real = GemvGlu.numpy

    def broken(self, env):
        real(self, env)
        env.array(self.out)[:] += 1.0

    monkeypatch.setattr(GemvGlu, "numpy", broken)
    env = new_caches(cfg)
    env["token"], env["pos"] = np.asarray([7], np.int32), np.asarray([0], np.int32)
    # the GLU runs in layer 0's chained launch (o_glu_down_norm), counted in layer 1 (whose norm it writes last)
    first = next(i for i, x in enumerate(s.launches) if x.launch.census == "chain")
    with pytest.raises(UserError, match=rf"launch {first} \(chain, layer 1.*diverges from the reference at `L0.glu`"):
        NumpyRunner(s, w, check=True).step(env, lifted=g)  # what LANEFUSE_CHECK=2 asks of `lanefuse run`


def test_check_2_names_a_wrong_cache_row_write():
    from lanefuse.kernels import SetRow

    cfg, w = demo_model()
    g = build_step(cfg, 1)
    # the row writes as launches of their own (the five-phase chain writes them in its q/k/v phase)
    s = plan(g, held=["place.key_row", "place.value_row", "qkv_attn_o_glu_down_norm"])
    real = SetRow.numpy

    def broken(self, env):
        real(self, env)
        env.array(self.table)[env.param(self.row) * self.cols] += 1.0

    env = new_caches(cfg)
    env["token"], env["pos"] = np.asarray([7], np.int32), np.asarray([3], np.int32)
    first = next(i for i, x in enumerate(s.launches) if x.launch.census == "set_row")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SetRow, "numpy", broken)
        with pytest.raises(UserError, match=rf"launch {first} \(set_row, layer 0"):
            NumpyRunner(s, w, check=True).step(env, lifted=g)


def test_check_2_names_the_first_launch_writing_nan():
    """A NaN in one embedding row: the check names the gather that first writes it (NaN compares as no difference,
    so it is looked for on its own)."""
    cfg, w = demo_model()
    g = build_step(cfg, 1)
    s = plan(g)
    table = np.array(w.get("model.embed_tokens.weight"), dtype=np.float32)
    table[7, 3] = np.nan

    class Poisoned:
        def __getattr__(self, name):
            return getattr(w, name)

        def get(self, name):
            return table if name == "model.embed_tokens.weight" else w.get(name)

        def raw(self, name):
            return (table, "f32") if name == "model.embed_tokens.weight" else w.raw(name)

    env = new_caches(cfg)
    env["token"], env["pos"] = np.asarray([7], np.int32), np.asarray([0], np.int32)
    assert s.launches[0].ops[0] == g.ops[0].out and g.ops[0].kind == "gather"  # the embedding gather, fused
    with pytest.raises(UserError, match=r"launch 0 \(fold, .*writes non-finite values.*the reference's too"):
        NumpyRunner(s, Poisoned(), check=True).step(env, lifted=g)


def test_unknown_held_name_lists_the_known_ones():
    cfg, _ = demo_model()
    with pytest.raises(UserError, match=r"no rule or schedule step.*did you mean `add_norm`.*known:"):
        plan(build_step(cfg, 1), held=["add_nrm"])


def test_refused_op_names_the_reason():
    cfg, _ = demo_model()
    g = build_step(cfg, 1)
    g.add("matmul", ["logits", "logits"], "gram")  # a product by a computed matrix (a soft cap has a kernel now)
    with pytest.raises(UserError, match="a matmul by a computed matrix has no kernel"):
        plan(g)


def _cli(*args, env=None, input=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", *args], capture_output=True, text=True,
                          env=e, input=input, timeout=300)


def test_plan_json_and_saved_plan_runs_without_the_solver(tmp_path):
    p = _cli("plan", "--json", str(tmp_path / "p.json"), "--save", str(tmp_path / "plan.json"))
    assert p.returncode == 0, p.stderr
    d = json.loads((tmp_path / "p.json").read_text())
    for k in ("launches", "census", "fusions", "layers", "arena", "cost_us"):
        assert k in d
    assert all("kind" in l for l in d["launches"]) and {"bytes", "lower_bound"} <= set(d["arena"])
    # run the saved plan with egglog and highspy made unimportable
    blocker = tmp_path / "block"
    blocker.mkdir()
    for m in ("egglog", "highspy"):
        (blocker / f"{m}.py").write_text("raise ImportError('the runtime must not import the solver')\n")
    r = _cli("run", "--plan", str(tmp_path / "plan.json"), "--prompt-ids", "1,2,3", "--tokens", "6",
             "--json", str(tmp_path / "out.json"), env={"PYTHONPATH": str(blocker)})
    assert r.returncode == 0, r.stderr
    ref = _cli("run", "--reference", "--prompt-ids", "1,2,3", "--tokens", "6", "--json", str(tmp_path / "ref.json"))
    assert ref.returncode == 0, ref.stderr
    a, b = json.loads((tmp_path / "out.json").read_text()), json.loads((tmp_path / "ref.json").read_text())
    assert a["generated_ids"] == b["generated_ids"] and len(a["logits"]) == 6


def test_plan_trace_file(tmp_path):
    """`plan --trace FILE`: saturation (iterations, stop reason, every rule's matches, unmatched ones included), the
    e-graph's size, time by stage, and each tensor's chosen alternative with the runners-up and their costs."""
    r = _cli("plan", "--hold", "add_norm", "--trace", str(tmp_path / "t.json"))
    assert r.returncode == 0, r.stderr
    t = json.loads((tmp_path / "t.json").read_text())
    assert t["held"] == ["add_norm"] and t["saturation"]["stop"] == "saturated" and t["saturation"]["iterations"] > 1
    assert set(t["saturation"]["matches"]) == {x.name for x in load_table().rules}
    assert t["saturation"]["matches"]["add_norm"] == 0 and t["saturation"]["matches"]["merged_qkv"] > 0
    assert t["egraph"]["nodes"] > t["egraph"]["classes"] > 0
    assert {"load", "saturate", "snapshot", "decode", "cost", "extract", "emit", "total"} <= set(t["time"])
    q = next(v for k, v in t["tensors"].items() if v["chosen"].startswith("qkv_attn_o_glu_down_norm"))
    assert q["runners_up"] and all(isinstance(a["cost"], (float, str)) for a in q["runners_up"])
    finite = [a["cost"] for a in q["runners_up"] if not isinstance(a["cost"], str)]
    assert finite == sorted(finite)  # cheapest first, refusals (their reasons) last


def test_cli_errors_are_one_line():
    r = _cli("plan", "--hold", "nope")
    assert r.returncode != 0 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert "no rule or schedule step" in r.stderr
    r = _cli("run", "--device", "gpu", "--tokens", "2")
    assert r.returncode != 0 and "no CUDA device" in r.stderr and "Traceback" not in r.stderr
    r = _cli("plan", "/nonexistent/model")
    assert r.returncode != 0 and "no such file or folder" in r.stderr
    r = _cli("run", "--prompt-ids", "1,x")
    assert r.returncode != 0 and "comma-separated integers" in r.stderr


def test_run_a_step_yaml_equals_the_demo(tmp_path):
    from lanefuse.engine.front.demo import demo_config
    from lanefuse.engine.stepyaml import to_yaml

    g = build_step(demo_config(), 1)
    g.meta["weights"] = {"demo": True}
    (tmp_path / "step.yaml").write_text(to_yaml(g))
    a = _cli("run", str(tmp_path / "step.yaml"), "--prompt-ids", "1,2,3", "--tokens", "5", "--json",
             str(tmp_path / "a.json"))
    b = _cli("run", "--reference", "--prompt-ids", "1,2,3", "--tokens", "5", "--json", str(tmp_path / "b.json"))
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    ja, jb = json.loads((tmp_path / "a.json").read_text()), json.loads((tmp_path / "b.json").read_text())
    assert ja["generated_ids"] == jb["generated_ids"]
    g.meta.pop("weights")
    (tmp_path / "bare.yaml").write_text(to_yaml(g))
    r = _cli("run", str(tmp_path / "bare.yaml"), "--tokens", "2")
    assert r.returncode != 0 and "names no weights" in r.stderr and "Traceback" not in r.stderr


@st.composite
def small_models(draw):
    """A random small dense decoder: architecture, heads and groups, head width, partial rotary, formats."""
    arch = draw(st.sampled_from(["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]))
    kv = draw(st.sampled_from([1, 2]))
    heads = kv * draw(st.sampled_from([1, 2, 3]))
    hd = draw(st.sampled_from([8, 12, 16, 32]))
    hidden = draw(st.sampled_from([24, 48, 64]))
    cfg = ModelConfig(arch, hidden, draw(st.integers(1, 2)), heads, kv, hd, draw(st.sampled_from([32, 40, 96])),
                      draw(st.sampled_from([50, 97, 128])), qkv_bias=arch == "Qwen2ForCausalLM",
                      qk_norm=arch == "Qwen3ForCausalLM", partial_rotary=draw(st.sampled_from([1.0, 0.5])),
                      tie_embeddings=draw(st.booleans()), max_len=32, name="random")
    fmt = draw(st.sampled_from(["f32", "f16", "bf16"]))
    fmts = tuple((n, fmt) for n, s in cfg.weight_names().items() if len(s) == 2 and "embed" not in n)
    return dataclasses.replace(cfg, formats=fmts)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=small_models(), rows=st.sampled_from([1, 2, 5]),
       held=st.sets(st.sampled_from(HOLDABLE), max_size=4), lane=st.sampled_from(["cuda", "conservative"]))
def test_random_models_shapes_and_held_sets(cfg, rows, held, lane):
    """Random architectures and shapes, random rows and held rules, both lanes: the plan run in its arena equals the
    reference interpreter of the lifted graph (the caches too)."""
    from lanefuse.engine.front.weights import f32_to_bf16

    arrays = random_arrays(cfg, seed=5)
    for name, fmt in cfg.formats:
        arrays[name] = f32_to_bf16(arrays[name]) if fmt == "bf16" else arrays[name].astype(np.float16)
    w = Weights.from_dict(arrays, cfg)
    g = build_step(cfg, rows)
    env = new_caches(cfg)
    rng = np.random.default_rng(rows)
    for k in env:
        env[k][:6] = rng.standard_normal(env[k][:6].shape).astype(np.float32)
    env["token"] = rng.integers(0, cfg.vocab, rows).astype(np.int32)
    env["pos"] = np.asarray([6], np.int32)
    ref_env = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in env.items()}
    ref = evaluate(g, w, ref_env)
    s = plan(g, lane=lane, held=sorted(held))
    check(s.arena)
    out = NumpyRunner(s, w).step(env, lifted=g)
    assert int(out["next"][0]) == int(ref["next"][0])
    assert _rel(out["logits"], ref["logits"]) <= TOL
    for k in g.io.tables:
        assert _rel(env[k], ref_env[k]) <= TOL, k


def test_a_saved_plan_runs_its_own_model_only(tmp_path):
    p = _cli("plan", "--save", str(tmp_path / "plan.json"))
    assert p.returncode == 0, p.stderr
    (tmp_path / "other").mkdir()
    r = _cli("run", str(tmp_path / "other"), "--plan", str(tmp_path / "plan.json"), "--tokens", "2")
    assert r.returncode != 0 and "the plan was made for `demo`" in r.stderr
    r = _cli("run", "--plan", str(tmp_path / "nope.json"))
    assert r.returncode != 0 and "cannot read the plan" in r.stderr
    (tmp_path / "bad.json").write_text("{not json")
    r = _cli("run", "--plan", str(tmp_path / "bad.json"))
    assert r.returncode != 0 and "not a lanefuse plan" in r.stderr and "Traceback" not in r.stderr


def test_operands_the_kernels_read_as_values_must_be_values():
    """A vector is never checkpoint rows; an elementwise operand held as checkpoint rows is refused with a reason."""
    from lanefuse.engine.ir import Constant, Graph

    with pytest.raises(UserError, match="checkpoint rows are a matrix"):
        Graph().constant(Constant("bias", (8,), "rows", "bf16"))
    cfg, _ = demo_model()
    g = build_step(cfg, 1)
    g.constant(Constant("shift", (1, cfg.vocab), "rows", "bf16", False, "shift"))
    g.add("add", ["logits", "shift"], "shifted")
    with pytest.raises(UserError, match="elementwise op on checkpoint rows"):
        plan(g)


def test_check_command_runs_every_plan_against_the_reference():
    r = _cli("check", "--rows", "1", "--rows", "3", "--hold", "add_norm")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("-> ok") == 2 and "rows 3:" in r.stdout


def test_a_step_of_too_many_rows_is_a_user_error():
    r = _cli("plan", "--rows", "4097")
    assert r.returncode == 2 and "prefill chunk of up to 4096" in r.stderr and "internal error" not in r.stderr


MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
              "sliding_window": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 32768,
              "torch_dtype": "bfloat16"}


def test_golden_mistral_7b_decode():
    """Mistral-7B v0.1's shape (its config.json alone): Llama's 5 launches a layer, every attention over the last 4096
    positions (the window the lifted graph's attention carries to its launch); 3 with the o fold, GLU and down fold
    chained, 1 with the q/k/v fold too."""
    from lanefuse.engine.front.hfconfig import config_from_hf

    cfg = config_from_hf(MISTRAL_7B, max_len=8192)
    s = plan(build_step(cfg, 1))
    # the q/k/v fold, attention, o fold, GLU, down fold chained (qkv_attn_o_glu_down_norm)
    assert s.census == {"chain": 32, "fold": 2}
    assert max(v for k, v in s.per_layer().items() if 0 < k < cfg.layers - 1) == 1  # 5 unchained
    windows = {p.window for x in s.launches for p in getattr(x.launch, "phases", ()) if p.census == "attention"}
    assert windows == {4096}
    assert plan(build_step(config_from_hf({**MISTRAL_7B, "sliding_window": None}), 1)).census == s.census


PHI3_MINI = {"architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 8192, "vocab_size": 32064,
             "sliding_window": 2047, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
             "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "torch_dtype": "bfloat16"}


def test_golden_phi3_mini_decode():
    """Phi-3-mini-4k's shape (its config.json alone): its fused projections read in parts plan as Llama's, 5 launches
    a layer (1 chained), every attention over the last 2047 positions."""
    from lanefuse.engine.front.hfconfig import config_from_hf

    cfg = config_from_hf(PHI3_MINI, max_len=4096)
    s = plan(build_step(cfg, 1))
    # the q/k/v fold, attention, o fold, GLU, down fold chained (qkv_attn_o_glu_down_norm)
    assert s.census == {"chain": 32, "fold": 2}
    assert max(v for k, v in s.per_layer().items() if 0 < k < cfg.layers - 1) == 1  # 5 unchained
    assert {p.window for x in s.launches for p in getattr(x.launch, "phases", ()) if p.census == "attention"} == {2047}
