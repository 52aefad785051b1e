"""`transposed` (issue 40, seed 002): a checkpoint constant's rows are the outputs of the product that reads them,
(n, k) as a Hugging Face `Linear` stores a projection — or, not transposed, each a row a step takes whole or a
per-head product's inputs. Every front declares it so and every step graph is checked to read its rows as they are
stored (engine/orientation.py, in Graph.validate). A step YAML whose product's matrix says `transposed: false` is
stored (k, n), GPT-2's Conv1D layout: it is read transposed as it is loaded (the same tokens as the model stored as a
Linear stores it, reference and plan), or refused in one line where it cannot be (a block format; a Linear's (n, k)
said to be (k, n))."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lanefuse.engine.front.demo import demo_model
from lanefuse.engine.errors import UserError
from lanefuse.engine.interp import evaluate
from lanefuse.engine.ir import Constant
from lanefuse.engine.front.model import build_step
from lanefuse.engine.orientation import refusal, wants
from lanefuse.engine.stepyaml import from_yaml, to_yaml
from test_cupy_runner_mock import fake_cupy  # noqa: F401  (a fixture: the stand-in cupy)
from test_issue40_rows import _decode as decode_steps


def _roles(g):
    """Each rows constant's readers: the ops that multiply by it (and whether they want it transposed) and gathers."""
    out: dict[str, set] = {}
    for op in g.ops:
        w = wants(g, op)
        if w is not None:
            out.setdefault(w[0], set()).add((op.kind, w[1]))
        elif op.kind == "gather" and op.ins[0] in g.constants:
            out.setdefault(op.ins[0], set()).add(("gather", None))
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_every_projection_reads_transposed_rows_and_a_tied_table_is_transposed(tied):
    cfg, _ = demo_model(64)
    cfg = dataclasses.replace(cfg, tie_embeddings=tied)
    for rows, batch in ((1, 1), (7, 1), (1, 3)):
        g = build_step(cfg, rows, batch=batch)
        roles = _roles(g)
        emb = "model.embed_tokens.weight"
        assert g.constants[emb].transposed == tied
        assert ("gather", None) in roles[emb] and (("matmul", True) in roles[emb]) == tied
        products = [n for n, r in roles.items() if ("matmul", True) in r]
        assert len(products) >= 7 * cfg.layers  # q, k, v, o, gate, up, down a layer
        assert all(g.constants[n].transposed for n in products)
        assert all(refusal(g, op) is None for op in g.ops)


def test_deepseeks_key_expansion_is_each_heads_inputs(tmp_path):
    """DeepSeek's absorbed attention multiplies the queries by each head's key expansion as its inputs (rows not
    transposed, head_matmul rows_out false) and the latent by the value expansion as its outputs (transposed)."""
    from test_batch import _hf_model

    cfg, _ = _hf_model("deepseek_v3", tmp_path)
    g = build_step(cfg, 1)
    heads = [op for op in g.ops if op.kind == "head_matmul"]
    assert {bool(op.a["rows_out"]) for op in heads} == {False, True}
    for op in heads:
        assert g.constants[op.ins[1]].transposed == bool(op.a["rows_out"])


def _tiny(transposed: bool, kind: str = "matmul"):
    cfg, w = demo_model(64)
    g = build_step(cfg, 1)
    name = "model.layers.0.self_attn.q_proj.weight"
    c = g.constants[name]
    g.constants[name] = dataclasses.replace(c, transposed=transposed)
    return g, w, name


def test_a_projection_over_rows_stored_as_its_inputs_is_refused_in_words():
    g, _, name = _tiny(False)
    op = next(op for op in g.ops if op.kind == "matmul" and op.ins[1] == name)
    why = refusal(g, op)
    assert why is not None and f"`{name}`" in why and f"`{op.out}`" in why and "set its `transposed` to true" in why
    with pytest.raises(UserError, match=r"reads constant `model\.layers\.0\.self_attn\.q_proj\.weight`"):
        g.validate()


def test_a_per_head_product_reads_its_rows_as_stored():
    from lanefuse.engine.ir import Graph, StepIO

    for rows_out, transposed in ((True, True), (False, False), (True, False), (False, True)):
        g = Graph(io=StepIO())
        g.tensor("x", (1, 2 * 32))
        shape = (2 * 64, 32) if rows_out else (2 * 32, 64)
        g.constant(Constant("wk", shape, "rows", transposed=transposed))
        g.add("head_matmul", ["x", "wk"], "y", heads=2, a=32, b=64, rows_out=rows_out)
        why = refusal(g, g.ops[0])
        assert (why is None) == (rows_out == transposed)
        if why:
            assert ("each head's outputs" if rows_out else "each head's inputs") in why


def test_a_step_yaml_keeps_transposed_and_one_that_drops_it_is_refused(tmp_path):
    cfg, w = demo_model(64)
    g = build_step(dataclasses.replace(cfg, tie_embeddings=True), 1)
    text = to_yaml(g)
    back = from_yaml(text, "step.yaml")
    assert back.constants == g.constants  # transposed round-trips (the tied table's too)
    name = "model.layers.1.mlp.down_proj.weight"
    assert back.constants[name].transposed
    bad = text.replace("transposed: true", "transposed: false", 1)
    assert bad != text
    with pytest.raises(UserError, match="is stored not transposed"):
        from_yaml(bad, "step.yaml")


def test_the_command_refuses_such_a_step_in_one_line(tmp_path, capsys):
    """A projection's matrix kept (n, k) as a Linear stores it but said `transposed: false` (stored (k, n)): the
    activation's width names the mistake; a q8_0 matrix stored (k, n) cannot be read transposed. One line each."""
    from lanefuse.lane.cli.main import main

    cfg, _ = demo_model(64)
    text = to_yaml(build_step(cfg, 1))
    k = "model.layers.0.self_attn.k_proj.weight"
    line = f"  {k}: {{shape: [64, 256], transposed: true}}"
    assert line in text
    cases = {"linear": (line.replace("true", "false"), "has 256 values a row, its columns' count"),
             "q8_0": (f"  {k}: {{shape: [256, 64], format: q8_0, transposed: false}}", "a q8_0 matrix cannot be "
                                                                                      "read transposed")}
    for name, (said, why) in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text.replace(line, said))
        assert main(["plan", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0] and why in err[0] and f"{name}.yaml:" in err[0], err
        assert f"reads constant `{k}`" in err[0]


def test_the_reference_and_the_plan_of_a_tied_model_agree():
    """A tied model's table, transposed for its head, is gathered as before: the reference interpreter and the fused
    plan give the same logits (nothing reads the flag but the check)."""
    from lanefuse.engine.front.weights import Weights
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    cfg, w = demo_model(64)
    tied = dataclasses.replace(cfg, tie_embeddings=True)
    arrays = {n: w.get(n) for n in w.store.names() if n != "lm_head.weight"}
    wt = Weights.from_dict(arrays, tied)
    g = build_step(tied, 3)
    env = {n: np.zeros(s, np.float32) for n, s in tied.carried().items()}
    env.update(token=np.array([1, 5, 9], np.int32), pos=np.array([0], np.int32))
    ref = evaluate(g, wt, {k: v.copy() for k, v in env.items()})
    got = NumpyRunner(plan(g), wt, exact=True).step({k: v.copy() for k, v in env.items()})
    assert np.array_equal(got["logits"], np.asarray(ref["logits"]).reshape(got["logits"].shape))


def test_a_step_yaml_that_does_not_say_takes_its_products_orientation():
    """A hand-written step YAML may leave `transposed` out: a constant every product reads as its outputs is
    transposed (a tied table, gathered too), one no product multiplies by is not; one that says false is checked."""
    base = """\
io: {token: token, position: pos, caches: [], logits: logits, next: next}
tensors:
  token: i32[1]
  pos: i32[1]
constants:
  emb: {shape: [7, 4]}
  w: {shape: [4], kind: values}
  h: {shape: [7, 4]}
ops:
  - {op: gather, out: x, ins: [emb, token]}
  - {op: rmsnorm, out: n, ins: [x, w], eps: 1e-6}
  - {op: matmul, out: logits, ins: [n, HEAD]}
  - {op: argmax, out: next, ins: [logits]}
"""
    tied = from_yaml(base.replace("HEAD", "emb"), "step.yaml")
    assert tied.constants["emb"].transposed and not tied.constants["h"].transposed
    apart = from_yaml(base.replace("HEAD", "h"), "step.yaml")
    assert apart.constants["h"].transposed and not apart.constants["emb"].transposed
    assert from_yaml(to_yaml(apart), "again.yaml").constants == apart.constants
    said = base.replace("HEAD", "h").replace("h: {shape: [7, 4]}", "h: {shape: [7, 4], transposed: false}")
    with pytest.raises(UserError, match=r"step.yaml:12: op `matmul` -> `logits` reads constant `h` \[7, 4\], "
                                        r"declared `transposed: false`.* it is `transposed: true`"):
        from_yaml(said, "step.yaml")  # (n, k) said stored (k, n): the width of `n` tells
    stored = said.replace("[7, 4], transposed: false", "[4, 7], transposed: false")
    read = from_yaml(stored, "step.yaml")  # stored (k, n) as it says: read transposed, held (n, k)
    assert read.constants["h"].shape == (7, 4) and read.constants["h"].transposed
    assert read.meta["read_transposed"] == ["h"] and to_yaml(read).count("h: {shape: [4, 7], transposed: false}") == 1


def _stored_the_other_way(cfg, w, names):
    """Demo step `cfg`'s decode step YAML with `names` declared stored (k, n), `transposed: false`, and its weights
    stored so: the step as read, and its weights as it reads them."""
    from lanefuse.engine.front.weights import Weights
    from lanefuse.engine.orientation import as_read

    g = build_step(cfg, 1)
    text = to_yaml(g)
    for n in names:
        rows, cols = g.constants[n].shape
        line = f"  {n}: {{shape: [{rows}, {cols}], transposed: true}}"
        assert line in text
        text = text.replace(line, f"  {n}: {{shape: [{cols}, {rows}], transposed: false}}")
    read = from_yaml(text, "stored.yaml")
    arrays = {n: w.get(n) for n in w.store.names()}
    arrays.update({n: np.ascontiguousarray(arrays[n].T) for n in names})
    return g, text, read, as_read(read, Weights.from_dict(arrays, cfg))


def _decode(cfg, run, steps=4):
    """test_issue40_rows' greedy decode, 4 steps unless told."""
    return decode_steps(cfg, run, steps)


def test_matrices_stored_as_their_inputs_rows_give_the_same_tokens():
    """Layer 0's seven products and the LM head stored (k, n) (square and not), `transposed: false`: read transposed
    as loaded, the step is the Linear-stored model's (constants equal, text printed as stored), and the reference over
    the stored weights and the fused plan (numpy backend) give the untransposed model's tokens and logits to the bit."""
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    cfg, w = demo_model(64)
    g0 = build_step(cfg, 1)
    names = [n for n, c in g0.constants.items() if c.transposed and ".layers.0." in n] + ["lm_head.weight"]
    assert len(names) == 8
    g, text, read, wt = _stored_the_other_way(cfg, w, names)
    assert read.meta["read_transposed"] == names and read.constants == g.constants
    assert to_yaml(read) == text and from_yaml(to_yaml(read), "again.yaml") == read
    assert wt.store.base.info(names[1])[0] == (256, 64) and wt.shape(names[1]) == (64, 256)
    toks, logits = _decode(cfg, lambda e: evaluate(g, w, e))
    got = _decode(cfg, lambda e: evaluate(read, wt, e))
    p = plan(read)
    fused = _decode(cfg, NumpyRunner(p, wt, exact=True).step)
    assert got[0] == toks and fused[0] == toks
    assert all(np.array_equal(a, b) and np.array_equal(a, c) for a, b, c in zip(logits, got[1], fused[1]))
    fast = _decode(cfg, NumpyRunner(p, wt, exact=False).step)  # the fast twins' decoded and stacked matrices
    assert fast[0] == toks and all(np.allclose(a, f, rtol=0, atol=1e-5 * np.abs(a).max())
                                   for a, f in zip(logits, fast[1]))


def test_a_stored_matrix_is_served_transposed_to_the_bit_in_every_plain_format():
    from lanefuse.engine.front.weights import Weights, f32_to_bf16
    from lanefuse.engine.orientation import TransposedStore

    v = np.random.default_rng(0).standard_normal((6, 10)).astype(np.float32)
    for arr in (v, v.astype(np.float16), f32_to_bf16(v)):
        st = TransposedStore(Weights.from_dict({"w": arr, "b": v}).store, ["w"])
        got, fmt = st.raw("w")
        assert got.shape == (10, 6) and got.dtype == arr.dtype and np.array_equal(got, arr.T)
        assert st.info("w")[0] == (10, 6) and st.raw("b")[0] is not None and st.info("b")[0] == (6, 10)


def test_weights_that_do_not_hold_the_stored_shape_are_refused_and_random_ones_are_stored_so():
    """`weights: {demo: true}` holds each projection (n, k): a step saying its k projection is stored (k, n) is
    refused in one line naming it; `{random: SEED}` draws the declared stored (k, n) and serves its transpose."""
    from lanefuse.engine.front.stepweights import random_weights, step_weights

    cfg, w = demo_model(64)
    k = "model.layers.0.self_attn.k_proj.weight"
    _, text, read, _ = _stored_the_other_way(cfg, w, [k])
    read.meta["weights"] = {"demo": True}
    with pytest.raises(UserError, match=r"constant `model\.layers\.0\.self_attn\.k_proj\.weight`: the step "
                                        r"declares it stored \[256, 64\] .* the weights hold `.*` as \[64, 256\]"):
        step_weights(read)
    both = dataclasses.replace(read, constants={**read.constants, "k_again": Constant("k_again", (64, 256), "rows",
                                                                                     source=k)})
    with pytest.raises(UserError, match=r"constants `.*k_proj\.weight` and `k_again` read the same stored tensor"):
        random_weights(both, 3)
    rw = random_weights(read, 3)
    assert rw.store.base.info(k)[0] == (256, 64) and rw.get(k).shape == (64, 256)
    assert np.array_equal(rw.get(k), rw.store.base.raw(k)[0].T)


def test_a_mixtures_router_stored_as_its_inputs_rows_is_read_transposed():
    """An expert mixture's router stored (d, experts), `transposed: false` (a Qwen3-MoE decode step's, every layer):
    read transposed as loaded, the reference over the stored weights and the fused plan give the Linear-stored
    step's logits to the bit."""
    from lanefuse.engine.front.families.mixtures import MoeConfig
    from lanefuse.engine.front.model import ModelConfig
    from lanefuse.engine.front.stepweights import random_weights
    from lanefuse.engine.front.weights import Weights
    from lanefuse.engine.orientation import as_read
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    cfg = ModelConfig("Qwen3MoeForCausalLM", 32, 2, 4, 2, 8, 40, 64, qk_norm=True, max_len=32,
                      moe=MoeConfig(experts=8, k=2, inter=37, norm_topk=True, sparse=(0, 1)))
    g = build_step(cfg, 1)
    w = Weights(random_weights(g, 0).store, cfg)
    routers = [op.ins[1] for op in g.ops if op.kind == "moe"]
    assert len(routers) == 2 and all(g.constants[n].shape == (8, 32) and g.constants[n].transposed for n in routers)
    text = to_yaml(g)
    for n in routers:
        text = text.replace(f"  {n}: {{shape: [8, 32], transposed: true}}", f"  {n}: {{shape: [32, 8], "
                                                                           f"transposed: false}}")
    read = from_yaml(text, "moe.yaml")
    assert read.meta["read_transposed"] == routers and read.constants == g.constants
    arrays = {n: w.get(n) for n in w.store.names()}
    arrays.update({n: np.ascontiguousarray(arrays[n].T) for n in routers})
    wt = as_read(read, Weights.from_dict(arrays, cfg))
    toks, logits = _decode(cfg, lambda e: evaluate(g, w, e), steps=3)
    got = _decode(cfg, lambda e: evaluate(read, wt, e), steps=3)
    fused = _decode(cfg, NumpyRunner(plan(read), wt, exact=True).step, steps=3)
    assert got[0] == toks and fused[0] == toks
    assert all(np.array_equal(a, b) for a, b in zip(logits, got[1]))
    assert all(np.allclose(a, c, rtol=0, atol=1e-5 * np.abs(a).max()) for a, c in zip(logits, fused[1]))


def test_the_device_runner_uploads_the_stored_matrices_transposed(fake_cupy):
    """The CuPy runner (a stand-in cupy, each launch its numpy twin: tests/test_cupy_runner_mock.py) uploads a matrix
    stored (k, n) as the step reads it: the Linear-stored model's tokens and logits on the numpy runner, to the bit."""
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    cfg, w = demo_model(64)
    names = ["model.layers.1.self_attn.k_proj.weight", "model.layers.2.mlp.down_proj.weight", "lm_head.weight"]
    g, _, read, wt = _stored_the_other_way(cfg, w, names)
    want = _decode(cfg, NumpyRunner(plan(g), w).step)
    got = _decode(cfg, CupyRunner(plan(read), wt, DeviceState(), graph=False).step)
    assert got[0] == want[0] and all(np.array_equal(a, b) for a, b in zip(want[1], got[1]))
