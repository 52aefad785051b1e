"""Qwen3-Next: tiny transformers-made models (random seeded weights; A_log, dt_bias, the convolution and every norm
perturbed so each matters; key heads fewer than value heads; MoE layers with the sigmoid-gated shared expert beside
dense ones), saved with save_pretrained, loaded by the front and run by the reference interpreter: the same greedy
tokens as transformers over prompts of several prefill chunks and long decodes, logits within 1e-4 of their scale,
f32 and bf16 checkpoints. The front's refusals, and the carried state across chunks."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from lanefuse.engine.errors import UserError
from lanefuse.engine.front.hfconfig import config_from_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_ref import fused_step, hf_greedy, margins_ok, scaled_error  # noqa: E402
from lanefuse.engine.front.load import load_model  # noqa: E402
from lanefuse.lane.run.generate import generate  # noqa: E402

TOL = 1e-4
PROMPT = [3, 17, 5, 42, 8, 11, 60, 2, 29, 71, 14]  # three prefill chunks of 4 (the state crosses two boundaries)
N_TOKENS = 24

BASE = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=37, vocab_size=97, linear_conv_kernel_dim=4, linear_key_head_dim=32,
            linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=6,
            num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=20,
            decoder_sparse_step=2, max_position_embeddings=128,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])

CASES = {
    "f32": (BASE, "float32"),
    "bf16": (BASE, "bfloat16"),
    # value heads of 16 (the interpreter runs any width; the lane's Delta launch wants multiples of 32), no experts
    "dense_odd_f32": (dict(BASE, linear_value_head_dim=16, linear_key_head_dim=16, num_experts=0,
                           linear_conv_kernel_dim=3, layer_types=None, full_attention_interval=2,
                           tie_word_embeddings=True), "float32"),
}


def build(name: str, tmp_path, salt: int = 0):
    kw, dtype = CASES[name]
    cfg = transformers.Qwen3NextConfig(**kw)
    torch.manual_seed(zlib.crc32(name.encode()) + salt)
    model = transformers.Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("linear_attn.norm.weight"):  # the gated norm scales by w
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in pname:  # the zero-centred norms scale by 1 + w
                p.copy_(0.2 * torch.randn_like(p))
            elif pname.endswith("A_log"):  # slow and fast forgetting heads, so the state carries across chunks
                p.copy_(torch.empty_like(p).uniform_(0.05, 2.0).log())
            elif pname.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif "conv1d" in pname:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
            elif "embed_tokens" in pname:
                p.copy_(torch.randn_like(p) * (0.3 if cfg.tie_word_embeddings else 1.0))
            elif p.dim() == 3:  # experts (E, out, in)
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    folder = tmp_path / name
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    ref = transformers.Qwen3NextForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, ref


_rel = scaled_error


@pytest.mark.parametrize("name", list(CASES))
def test_reference_equals_transformers(name, tmp_path):
    folder, ref = build(name, tmp_path)
    want_tokens, want_logits = hf_greedy(ref, PROMPT, N_TOKENS)
    cfg, weights = load_model(folder)
    assert cfg.arch == "Qwen3NextForCausalLM"
    assert cfg.hk < cfg.hv
    got = generate(cfg, weights, PROMPT, N_TOKENS, chunk=4)
    rel = _rel(got.logits, want_logits)
    print(f"\nQwen3-Next parity {name}: max |diff| / max |logits| = {rel:.2e}")
    assert got.generated_ids == want_tokens
    assert rel < TOL
    assert len(set(want_tokens)) > 4  # not one repeated token
    assert margins_ok(want_logits, 10 * TOL)  # greedy choices are not ties


def test_chunking_does_not_change_the_run(tmp_path):
    """The carried state (rings and recurrent states) crosses chunk boundaries: chunks of 1, 3 and 11 rows agree."""
    folder, _ = build("f32", tmp_path)
    cfg, weights = load_model(folder)
    runs = [generate(cfg, weights, PROMPT, 6, chunk=c) for c in (1, 3, 11)]
    for r in runs[1:]:
        assert r.generated_ids == runs[0].generated_ids
        assert _rel(r.logits, runs[0].logits) < 1e-5


def test_each_perturbed_weight_matters(tmp_path):
    """A_log, dt_bias, the convolution and the gated norm each change the logits (the test weights make them count)."""
    folder, _ = build("f32", tmp_path)
    cfg, weights = load_model(folder)
    base = generate(cfg, weights, PROMPT[:5], 1, chunk=5).logits[0]
    for name in ("model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.dt_bias",
                 "model.layers.0.linear_attn.conv1d.k.weight", "model.layers.0.linear_attn.norm.weight"):
        w = weights.with_config(cfg)
        w.get(name)
        w._f32[name] = w._f32[name] * 0.5
        other = generate(cfg, w, PROMPT[:5], 1, chunk=5).logits[0]
        assert np.abs(other - base).max() > 1e-3 * np.abs(base).max(), name


def _cfg(**over):
    c = json.loads(transformers.Qwen3NextConfig(**BASE).to_json_string())
    c["architectures"] = ["Qwen3NextForCausalLM"]
    c.update(over)
    return {k: v for k, v in c.items() if v is not None or k in over}


def test_config_reads_4x_and_5x_layouts():
    five = config_from_hf(_cfg())
    assert five.layer_types == tuple(BASE["layer_types"]) and five.rot == 4 and five.moe.shared_inter == 20
    assert five.moe.sparse == (1, 3) and five.hk == 2 and five.hv == 4
    four = _cfg(rope_parameters=None, rope_theta=10000.0, partial_rotary_factor=0.25, layer_types=None,
                full_attention_interval=2)
    c4 = config_from_hf(four)
    assert c4.layer_types == ("linear_attention", "full_attention") * 2 and c4.rot == 4
    bare = {"architectures": ["Qwen3NextForCausalLM"]}  # transformers' defaults: the 80B-A3B shape
    c = config_from_hf(bare)
    assert (c.layers, c.moe.experts, c.moe.k, c.hk, c.hv, c.dk, c.rot) == (48, 512, 10, 16, 32, 128, 64)
    assert c.layer_types.count("full_attention") == 12


@pytest.mark.parametrize("over, msg", [
    ({"hidden_act": "gelu"}, "hidden_act `gelu` is not supported for Qwen3-Next"),
    ({"attention_bias": True}, "attention_bias is not supported for Qwen3-Next"),
    ({"linear_num_key_heads": 3}, "`linear_num_key_heads` 3 does not divide `linear_num_value_heads` 4"),
    ({"linear_conv_kernel_dim": 1}, "`linear_conv_kernel_dim` is 1; expected at least 2"),
    ({"layer_types": ["linear_attention"]}, "`layer_types` is .*expected a list of 4 layer types"),
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention", "full_attention"]},
     r"`layer_types\[1\]` is 'sliding_attention'"),
    ({"linear_key_head_dim": 0}, "`linear_key_head_dim` is 0; expected a positive integer"),
])
def test_config_refusals(over, msg):
    with pytest.raises(UserError, match=msg):
        config_from_hf(_cfg(**over), "config.json")


def test_missing_fused_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    folder, _ = build("dense_odd_f32", tmp_path)
    t = load_file(folder / "model.safetensors")
    t.pop("model.layers.0.linear_attn.in_proj_ba.weight")
    save_file(t, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"no tensor `model.layers.0.linear_attn.in_proj_ba.weight` \(expected shape "
                                        r"\(8, 32\)\)"):
        load_model(folder)


# -- the fused plan ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["f32", "bf16"])
def test_fused_plan_equals_transformers(name, tmp_path):
    """The fused plan, run by the numpy backend inside its arena (rings and states carried as tables between steps),
    against transformers itself."""
    folder, ref = build(name, tmp_path)
    want_tokens, want_logits = hf_greedy(ref, PROMPT, N_TOKENS)
    cfg, weights = load_model(folder)
    got = generate(cfg, weights, PROMPT, N_TOKENS, step_fn=fused_step(weights), chunk=4)
    rel = _rel(got.logits, want_logits)
    print(f"\nQwen3-Next parity (fused plan) {name}: max |diff| / max |logits| = {rel:.2e}")
    assert got.generated_ids == want_tokens
    assert rel < TOL


def test_the_lane_refuses_a_delta_head_not_a_multiple_of_32(tmp_path):
    from lanefuse.lane.lower.plan import plan

    folder, _ = build("dense_odd_f32", tmp_path)
    cfg, _ = load_model(folder)
    with pytest.raises(UserError, match="a delta-rule key head of 16 \\(a multiple of 32"):
        plan(cfg.build_step(1))


# each layer type's decode layer, launch by launch, as the cuda lane plans the tiny model's decode step (layer 0: delta
# net, dense FFN; 1: gated attention, experts; 3: delta net, experts). A layer opens with the fold of the previous
# layer's last product (layer 0's: the embedding), the residual add and its own norm. The delta net's token mixer is
# five launches: its qkvz, b and a products in parts, the three convolutions of qkvz's parts in parts (SiLU, q's and
# k's L2 norms), both gates, the delta rule with its gated norm, the out product's fold with the add and next norm.
# The gated attention: its query, gate, k and v products in parts, the q/k norms and rotations in parts (k into its
# cache row), the attention storing its output gated, the o product's fold.
# layer 0's out product's fold and its dense MLP: one chained launch (o_glu_down_norm: the out fold, the GLU and the
# down fold), counted in layer 1 (whose norm it writes last); layer 2's likewise in layer 3
GOLDEN_LAYERS = {
    0: ["fold", "gemm_parts", "conv_parts", "gates", "delta"],
    1: ["chain", "gemm_parts", "rope_parts", "attention", "fold"],
    3: ["chain", "gemm_parts", "conv_parts", "gates", "delta", "fold", "moe", "moe"],
}


def test_census_of_each_layer_type():
    from lanefuse.lane.lower.plan import plan

    cfg = config_from_hf(_cfg())
    s = plan(cfg.build_step(1))
    got = {i: [k.census for x in s.launches if x.layer == i for k in x.launch.kernels()] for i in (0, 1, 3)}
    assert got == GOLDEN_LAYERS
    gated = next(x.launch for x in s.launches if x.launch.census == "attention")
    assert gated.gate == ("L1.q_gate", "sigmoid")  # attn_output_gate: the attention stores its output gated


# -- batches: a slot of the KV caches, the rings and the recurrent states a sequence -----------------------------------

@pytest.mark.parametrize("name", ["f32", "bf16"])
def test_a_batch_gives_each_sequence_its_tokens_alone(name, tmp_path):
    """The batch decode step over 2 slots and 3 prompts of different lengths, each prefilled alone in chunks of 4
    (the third takes a slot the first leaves, its rings and states zeroed): each sequence the tokens and logits it
    gets alone — by the reference interpreter's batch step, the fused plan's (exact twins: the convolutions and the
    delta rule over every sequence's slot in one launch each), and the fast twins with each sequence apart."""
    from lanefuse.lane.run.batch import generate_batch

    from test_batch import fused, same_as_alone

    folder, _ = build(name, tmp_path)
    cfg, weights = load_model(folder)
    prompts = [PROMPT[:3], PROMPT, PROMPT[2:9]]
    got = generate_batch(cfg, weights, prompts, 9, slots=2, eos=(), chunk=4)
    alone = [generate(cfg, weights, p, 9, chunk=4) for p in prompts]
    for a, r in zip(alone, got):
        assert r.generated_ids == a.generated_ids
        assert _rel(r.logits, a.logits) < 1e-6
    same_as_alone(cfg, weights, prompts, 9, 2, step_fn=fused(cfg, weights, exact=True), alone=alone)
    same_as_alone(cfg, weights, prompts, 9, 2, step_fn=fused(cfg, weights, exact=False, held=("sequences",)),
                  alone=alone)
    g = cfg.build_step(1, batch=3)
    assert g.tensors["ds0"].shape == (3 * cfg.hv * cfg.dk, cfg.dv) and g.tensors["cq0"].shape == (3 * 3, 64)
    assert g.tensors["kc1"].shape == (3 * cfg.max_len, cfg.kv_heads * cfg.head_dim)


def test_the_lane_plans_a_batch_of_qwen3next():
    """A batch of 5 takes as many launches a layer as one sequence, of the same kinds (the convolutions and the delta
    rule over every sequence's slot of the rings and states, a block row a sequence); held apart (`sequences`), each
    sequence's convolutions and delta rule a launch of their own."""
    pytest.importorskip("egglog")
    from lanefuse.lane.lower.plan import plan

    cfg = config_from_hf(_cfg())
    # (the dense MLPs and their next norms chained launches at a batch of 5 as at one sequence: the chain's products
    # on the slab, kernels/chain.py)
    one, five, apart = plan(cfg.build_step(1)), plan(cfg.build_step(1, batch=5)), None
    assert five.per_layer() == one.per_layer() and five.census == one.census
    for x in five.launches:
        if x.launch.census in ("conv_parts", "delta"):
            assert x.launch.seqs and x.launch.rows == 5
    apart = plan(cfg.build_step(1, batch=5), held=["sequences"])
    linear = sum(cfg.linear(i) for i in range(cfg.layers))
    assert apart.census["conv_parts"] == 5 * linear and apart.census["delta"] == 5 * linear
