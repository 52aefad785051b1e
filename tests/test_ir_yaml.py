"""The step YAML round trip: any step graph prints to text that parses back equal (a property over random configs,
chunk sizes, attributes, placements and fused ops), and a malformed step YAML is an error citing file, line, op."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lanefuse.engine.errors import UserError
from lanefuse.engine.ir import Access, Dst, Graph, Op, RowSel, attrs_of
from lanefuse.engine.front.model import ModelConfig, build_step
from lanefuse.engine.stepyaml import from_yaml, to_yaml


@st.composite
def configs(draw) -> ModelConfig:
    arch = draw(st.sampled_from(["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]))
    kv = draw(st.integers(1, 2))
    heads = kv * draw(st.integers(1, 3))
    hd = draw(st.sampled_from([4, 6, 8]))
    hidden = heads * hd if arch != "Qwen3ForCausalLM" else draw(st.sampled_from([8, 12, 16]))
    return ModelConfig(
        arch=arch, hidden=hidden, layers=draw(st.integers(1, 2)), heads=heads, kv_heads=kv, head_dim=hd,
        inter=draw(st.sampled_from([8, 24])), vocab=draw(st.integers(5, 40)), eps=draw(st.sampled_from([1e-6, 1e-5])),
        partial_rotary=draw(st.sampled_from([1.0, 0.5])), tie_embeddings=draw(st.booleans()),
        qkv_bias=arch == "Qwen2ForCausalLM", qk_norm=arch == "Qwen3ForCausalLM", max_len=16,
        formats=(("model.embed_tokens.weight", draw(st.sampled_from(["f32", "f16", "bf16"]))),),
    )


floats = st.floats(allow_nan=False, allow_infinity=False)
texts = st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=12)


def _mutate(draw, g: Graph) -> Graph:
    """Random attributes, placements, a fused op and metadata on a valid step graph (it stays valid)."""
    ops = list(g.ops)
    for i, op in enumerate(ops):
        a = op.a
        if op.kind == "rmsnorm" and draw(st.booleans()):
            a["eps"] = draw(st.floats(1e-12, 1.0))
        if op.kind == "attention":
            a.update(scale=draw(floats), window=draw(st.integers(0, 9)), softcap=draw(st.sampled_from([0.0, 30.0])))
        acc = op.access
        if op.kind == "matmul" and draw(st.booleans()):
            k = g.shape(op.ins[0])[1]
            acc = (Access(k, 0, k),)
        dst = op.dst
        if op.kind == "rope" and draw(st.booleans()):
            dst = Dst(draw(st.sampled_from(["kc0", "vc0"])), draw(st.sampled_from([RowSel("pos"), RowSel(fixed=3),
                                                                                    None])),
                      draw(st.sampled_from([None, Access(8, 0, 4)])))
        ops[i] = dataclasses.replace(op, attrs=attrs_of(a), access=acc, dst=dst)
    # a fused add + norm (the residual add and the next layer's norm) keeping the sum
    for i in range(len(ops) - 1):
        a, b = ops[i], ops[i + 1]
        if a.kind == "add" and b.kind == "rmsnorm" and b.ins[0] == a.out and draw(st.booleans()):
            f = Op("fused", a.ins + b.ins[1:], b.out, (), (), None, a.layer, "add_norm", "add_norm", (a, b), (a.out,),
                   attrs_of({"s": a.out, "eps": b.a["eps"]}))
            ops[i:i + 2] = [f]
            break
    g = g.replace_ops(ops)
    g.meta = dict(g.meta)
    g.meta["weights"] = draw(st.sampled_from([{"demo": True}, {"checkpoint": "ckpt/tiny"}, {"random": 7}]))
    g.meta["note"] = draw(texts)
    return g


@st.composite
def graphs(draw) -> Graph:
    cfg = draw(configs())
    g = build_step(cfg, draw(st.integers(1, 4)))
    return _mutate(draw, g)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs())
def test_round_trip(g):
    text = to_yaml(g)
    back = from_yaml(text, "random.yaml")
    assert back == g
    assert to_yaml(back) == text


def test_round_trip_keeps_an_explicitly_declared_result():
    g = build_step(ModelConfig("LlamaForCausalLM", 8, 1, 2, 1, 4, 8, 11, max_len=8), 1)
    g.tensor("spare", (3, 2))  # declared, produced by nothing
    assert from_yaml(to_yaml(g)) == g


def test_printed_step_is_readable():
    g = build_step(ModelConfig("Qwen3ForCausalLM", 16, 1, 2, 1, 8, 16, 20, qk_norm=True, max_len=8), 2)
    text = to_yaml(g)
    assert "- {op: rmsnorm, out: L0.q_norm, ins: [L0.q, model.layers.0.self_attn.q_norm.weight], layer: 0" in text
    assert "token: i32[2]" in text
    assert "L0.q:" not in text  # inferred results are not declared again


BASE = """\
io: {token: token, position: pos, caches: [], logits: logits, next: next}
weights: {demo: true}
tensors:
  token: i32[1]
  pos: i32[1]
constants:
  emb: {shape: [7, 4]}
  w: {shape: [4], kind: values}
ops:
  - {op: gather, out: x, ins: [emb, token]}
  - {op: rmsnorm, out: n, ins: [x, w], eps: 1e-6}
  - {op: matmul, out: logits, ins: [n, emb]}
  - {op: argmax, out: next, ins: [logits]}
"""


def test_a_hand_written_step_parses():
    g = from_yaml(BASE, "step.yaml")
    assert g.meta["weights"] == {"demo": True}
    assert g.tensors["logits"].shape == (1, 7) and g.tensors["next"].dtype == "i32"
    assert g.ops[1].a["eps"] == 1e-6  # `1e-6` without a dot is a string to YAML 1.1; the float attribute takes it


@pytest.mark.parametrize("old,new,expect", [
    ("op: rmsnorm", "op: rmsnrom", r"step.yaml:11: op `rmsnrom` -> `n`: unknown op kind \(did you mean `rmsnorm`\?\)"),
    ("eps: 1e-6", "esp: 1e-6", r"step.yaml:11: op `rmsnorm` -> `n`: unknown key `esp` \(did you mean `eps`\?\)"),
    ("ins: [n, emb]", "ins: [nn, emb]", r"step.yaml:12: op `matmul` -> `logits`: unknown tensor `nn`"),
    ("token: i32[1]\n", "token: int[1]\n", r"step.yaml:4: tensor `token`: expected `f32\[d0, d1\]`"),
    ("emb: {shape: [7, 4]}", "emb: {shape: [7, 5]}", r"step.yaml:11: op `rmsnorm` -> `n`: shape mismatch: weight \(4,\) is not \(5,\)"),
    ("weights:", "weigths:", r"step.yaml:2: unknown key `weigths` \(did you mean `weights`\?\)"),
    ("  - {op: argmax", "  - {op: argmax, ins: [", r"step.yaml:\d+: not valid YAML"),
    ("emb: {shape: [7, 4]}", "emb: {shape: [7, 4], kind: rowz}", r"step.yaml:7: constant `emb`: kind `rowz`"),
    ("ins: [logits]}", "ins: [logits], rows: 2}", r"step.yaml:13: op `argmax` -> `next`: unknown key `rows`"),
])
def test_errors_cite_file_line_and_op(old, new, expect):
    assert old in BASE
    with pytest.raises(UserError, match=expect):
        from_yaml(BASE.replace(old, new, 1), "step.yaml")


def test_an_op_reading_a_later_result_is_an_error():
    text = BASE.replace("ins: [x, w]", "ins: [logits, w]")
    with pytest.raises(UserError, match="step.yaml"):
        from_yaml(text, "step.yaml")


def test_not_a_mapping():
    with pytest.raises(UserError, match="x.yaml: a step YAML is a mapping"):
        from_yaml("- 1\n- 2\n", "x.yaml")
