"""`transposed` (issue 40, seed 002): a checkpoint constant's rows are the outputs of the product that reads them,
(n, k) as a Hugging Face `Linear` stores a projection — or, not transposed, each a row a step takes whole or a
per-head product's inputs. Every front declares it so and every step graph is checked to read its rows as they are
stored (engine/orientation.py, in Graph.validate): a step YAML whose projection's matrix says otherwise is refused in
one line naming the op and the constant."""

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
    from lanefuse.lane.cli.main import main

    cfg, _ = demo_model(64)
    text = to_yaml(build_step(cfg, 1))
    path = tmp_path / "step.yaml"
    path.write_text(text.replace("transposed: true", "transposed: false", 1))
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0] and "transposed" in err[0] and "step.yaml" in err[0]


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
    with pytest.raises(UserError, match=r"step.yaml: op `matmul` -> `logits` reads constant `h`"):
        from_yaml(said, "step.yaml")
