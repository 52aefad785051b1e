"""gpt-oss (`GptOssForCausalLM`, issue 19): the front (q/k/v/o biases, attention sinks, the sliding layers' window,
YaRN, the biased router routed top-k then softmax, the experts' interleaved gate/up tensor and the clamped GLU) against
transformers on tiny models, f32 and bf16, prompts longer than the window; the fused plan where the lane links it;
refusals in one line."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from hf_ref import fused_step, hf_greedy, margins_ok, scaled_error
from lanefuse.engine.errors import UserError

TOL = 1e-4
PROMPT = [3, 17, 5, 42, 8, 11, 29, 2, 51, 13, 7, 33, 19, 40, 23, 9, 61, 14, 70, 88]  # 20: chunks of 8, 8 and 4
N_TOKENS = 10
WINDOW = 5  # far shorter than the prompt: the sliding layers' window matters
SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
             max_position_embeddings=256, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             swiglu_limit=1.5,  # low enough that the clamps bite on these scales
             rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 150000.0})


def build(dtype: str, folder, **kw):
    """A transformers-made tiny gpt-oss saved with save_pretrained in `dtype`, and transformers' model of the saved
    weights in f32 (eager attention and experts)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GptOssConfig(**{**SMALL, **kw})
    torch.manual_seed(zlib.crc32(dtype.encode()))
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():  # scales that keep the residual alive and the routing decisive; every 1-D weight perturbed
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif pname.endswith("sinks"):
                p.copy_(1.0 + torch.randn_like(p))  # sinks that take a real share of each softmax
            elif p.dim() == 1 or pname.endswith("_bias") or pname.endswith("router.bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif "embed_tokens" in pname:
                p.copy_(torch.randn_like(p))
            elif pname.endswith("router.weight"):
                p.copy_(3 * torch.randn_like(p) / p.shape[-1] ** 0.5)
            elif pname.endswith("experts.gate_up_proj") or pname.endswith("experts.down_proj"):
                p.copy_(2 * torch.randn_like(p) / p.shape[-2] ** 0.5)  # stored (E, in, out)
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    return transformers.GptOssForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                          experts_implementation="eager").eval()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gptoss") / request.param
    ref = build(request.param, folder)
    want, logits = hf_greedy(ref, PROMPT, N_TOKENS)
    return folder, ref, want, logits


@pytest.mark.hf
@pytest.mark.parametrize("chunk", [1, 8])
def test_hf_parity_reference(model, chunk):
    """The reference interpreter of the lifted graph against transformers: decode steps (chunk 1) and prefill chunks
    of 8 then decode; the same greedy tokens, logits within 1e-4 of their scale."""
    from lanefuse.engine.front.load import load_model
    from lanefuse.lane.run.generate import generate

    folder, ref, want, want_logits = model
    assert len(set(want)) > 3 and margins_ok(want_logits)
    cfg, weights = load_model(folder)
    assert cfg.arch == "GptOssForCausalLM" and cfg.window == WINDOW and cfg.moe.k == 2
    got = generate(cfg, weights, PROMPT, N_TOKENS, chunk=chunk)
    rel = scaled_error(got.logits, want_logits)
    print(f"\nHF parity gpt-oss {folder.name} chunk {chunk} reference: max |diff| / max |logits| = {rel:.2e}")
    assert got.generated_ids == want
    assert rel < TOL


@pytest.mark.hf
@pytest.mark.parametrize("chunk", [1, 8])
def test_hf_parity_fused_plan(model, chunk):
    """The fused plan run in the numpy arena (exact twins) against transformers, decode and chunks of 8."""
    from lanefuse.engine.front.load import load_model
    from lanefuse.lane.run.generate import generate

    folder, ref, want, want_logits = model
    cfg, weights = load_model(folder)
    fused = fused_step(weights)

    got = generate(cfg, weights, PROMPT, N_TOKENS, chunk=chunk, step_fn=fused)
    rel = scaled_error(got.logits, want_logits)
    print(f"\nHF parity gpt-oss {folder.name} chunk {chunk} fused: max |diff| / max |logits| = {rel:.2e}")
    assert got.generated_ids == want
    assert rel < TOL


@pytest.mark.hf
def test_the_window_the_clamp_and_yarn_matter(model):
    """The parity above is not blind to them: without the window, the clamp or YaRN's attention factor the
    reference leaves transformers' logits."""
    import dataclasses

    from lanefuse.engine.front.load import load_model
    from lanefuse.engine.front.weights import Weights
    from lanefuse.lane.run.generate import generate

    folder, ref, want, want_logits = model
    cfg, weights = load_model(folder)
    sc = dict(cfg.rope_scaling)
    for bad in (dataclasses.replace(cfg, window=0), dataclasses.replace(cfg, swiglu_limit=1e6),
                dataclasses.replace(cfg, rope_scaling=tuple({**sc, "attention_factor": 1.0}.items()))):
        got = generate(bad, Weights(weights.store, bad), PROMPT, 3, chunk=8)
        rel = scaled_error(got.logits, want_logits)
        assert rel > 100 * TOL


def tiny_cfg(layers=4, experts=8, k=2):
    from lanefuse.engine.front.hfconfig import config_from_hf

    c = {**SMALL, "architectures": ["GptOssForCausalLM"], "num_hidden_layers": layers, "num_local_experts": experts,
         "num_experts_per_tok": k, "layer_types": ["sliding_attention", "full_attention"] * (layers // 2)}
    return config_from_hf(c, "config.json", max_len=64)


def test_census_golden_of_a_gptoss_decode_layer():
    """Five kernels a decode layer: q/k/v with their biases, rotated and cached (a fold); the attention with its
    sinks; the o product with its bias, the residual add and the norm (a fold: gemv_norm_epilogue.bias); the
    mixture's two kernels, its weighed sum added to the residual and normed for the next layer by the last block of
    the row (moe_deferred_finalize.biased)."""
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan

    s = plan(build_step(tiny_cfg(), 1))
    for layer in (1, 2):
        kinds = [k.census for l in s.launches if l.layer == layer for k in l.launch.kernels()]
        assert sorted(kinds) == sorted(["fold", "attention", "fold", "moe", "moe"]), kinds
    assert s.census == {"attention": 4, "fold": 10, "moe": 8}, s.census
    assert s.fusions.get("moe_deferred_finalize.biased") == 4 and s.fusions.get("gemv_norm_epilogue.bias") == 4


@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("fmt", ["f32", "bf16"])
def test_plan_against_the_reference(rows, fmt):
    """The plan in its arena (exact twins) against the reference, from random caches at position 3."""
    s = plan_against_reference(rows, fmt)
    assert s.fusions.get("moe_deferred_finalize.biased")


def test_a_chunk_sorted_by_expert():
    """Where launches are nearly free the chunk's rows are grouped by expert (moe_token_sort.biased)."""
    from lanefuse.lane.lower.knobs import Knobs

    s = plan_against_reference(12, "f32", knobs=Knobs(launch_us=0.01, fixed_scale=0.001))
    assert s.fusions.get("moe_token_sort.biased"), s.fusions
    assert any(getattr(l.launch, "sort", False) for l in s.launches)


def plan_against_reference(rows, fmt, **opts):
    from lanefuse.engine.interp import evaluate
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.generate import new_caches
    from lanefuse.lane.run.numpy_runner import NumpyRunner
    from lanefuse.engine.front.weights import Weights
    from lanefuse.kernels.common import encode

    cfg = tiny_cfg()
    g = build_step(cfg, rows)
    r = np.random.default_rng(rows)
    arrays = {}
    for name, shape in cfg.weight_names().items():
        a = (r.standard_normal(shape) / (np.sqrt(shape[-1]) if len(shape) == 2 else 3)).astype(np.float32)
        arrays[name] = (encode(a, fmt), fmt) if len(shape) == 2 and fmt != "f32" else a
    formats = tuple((n, fmt) for n, s in cfg.weight_names().items() if len(s) == 2)
    import dataclasses

    cfg = dataclasses.replace(cfg, formats=formats)
    g = build_step(cfg, rows)
    weights = Weights.from_dict(arrays, cfg)
    s = plan(g, **opts)
    caches = {k: r.standard_normal(v.shape).astype(np.float32) for k, v in new_caches(cfg).items()}
    inputs = {"token": r.integers(0, cfg.vocab, rows).astype(np.int32), "pos": np.array([3], np.int32)}
    ref = evaluate(g, weights, {**inputs, **{k: v.copy() for k, v in caches.items()}})
    mine = {k: v.copy() for k, v in caches.items()}
    got = NumpyRunner(s, weights).step({**inputs, **mine})
    assert float(np.abs(got["logits"] - ref["logits"]).max()) <= TOL * float(np.abs(ref["logits"]).max())
    for k in mine:
        np.testing.assert_allclose(mine[k], ref[k], rtol=1e-5, atol=1e-5)
    return s


@pytest.mark.parametrize("rows", [1, 12])
def test_the_fast_runner_against_the_reference(rows):
    """The fast twins (f32 BLAS, rows grouped by expert) against the exact ones on the gpt-oss mixture."""
    from lanefuse.kernels import Dst, HostEnv, Moe
    from lanefuse.engine.interp import OP_IMPL

    r = np.random.default_rng(7)
    d, f, E, k = 32, 37, 8, 2
    x = r.standard_normal((rows, d)).astype(np.float32)
    wr = (3 * r.standard_normal((E, d)) / np.sqrt(d)).astype(np.float32)
    wgu = (2 * r.standard_normal((E * 2 * f, d)) / np.sqrt(d)).astype(np.float32)
    wd = (r.standard_normal((E * d, f)) / np.sqrt(f)).astype(np.float32)
    br, bgu, bd = [(0.3 * r.standard_normal(n)).astype(np.float32) for n in (E, E * 2 * f, E * d)]
    ref = OP_IMPL["moe"](x, wr, wgu, wd, br, bgu, bd, experts=E, k=k, inter=f, norm_topk=False,
                         act="clamped_glu", routing="topk_softmax", limit=1.5, alpha=1.702)
    weights = {n: (a, "f32") for n, a in dict(wr=wr, wgu=wgu, wd=wd, br=br, bgu=bgu, bd=bd).items()}
    m = Moe("x", "wr", "wgu", "wd", Dst("y"), d, f, E, k, rows, "f32", act="clamped_glu", routing="topk_softmax",
            br="br", bgu="bgu", bd="bd", limit=1.5, alpha=1.702)
    assert m.check() is None
    for twin in ("numpy", "fast"):
        env = HostEnv({"x": x.reshape(-1), "y": np.zeros(rows * d, np.float32)}, weights)
        getattr(m, twin)(env)
        np.testing.assert_allclose(env.array("y").reshape(rows, d), ref, rtol=TOL, atol=TOL * np.abs(ref).max())
    assert "biases" in Moe("x", "wr", "wgu", "wd", Dst("y"), d, f, E, k, rows, "f32", act="clamped_glu",
                           routing="topk_softmax").check().reason


def test_plan_is_one_op_whatever_the_expert_count():
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan

    a, b = plan(build_step(tiny_cfg(experts=8), 1)), plan(build_step(tiny_cfg(experts=128, k=4), 1))
    assert a.census == b.census


def test_config_refusals_are_one_line():
    from lanefuse.engine.front.hfconfig import config_from_hf

    base = {**SMALL, "architectures": ["GptOssForCausalLM"]}
    for bad, word in (({"attention_bias": False}, "attention_bias"), ({"layer_types": ["full_attention"]}, "layer_types"),
                      ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
                      ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
                      ({"rope_parameters": {**SMALL["rope_parameters"], "truncate": "no"}}, "truncate"),
                      ({"num_key_value_heads": 3}, "num_key_value_heads")):
        with pytest.raises(UserError) as e:
            config_from_hf({**base, **bad}, "config.json")
        assert word in str(e.value) and "\n" not in str(e.value)


@pytest.mark.hf
def test_mxfp4_and_missing_experts_are_refused_in_words(tmp_path):
    from safetensors.numpy import load_file, save_file

    from lanefuse.engine.front.load import load_model

    build("float32", tmp_path / "m")
    t = load_file(str(tmp_path / "m" / "model.safetensors"))
    p = "model.layers.1.mlp.experts."
    for change, word in ((lambda t: t.pop(p + "down_proj_bias"), "down_proj_bias"),
                         (lambda t: t.update({p + "gate_up_proj_blocks": np.zeros((8, 74, 1, 16), np.uint8)}),
                          "MXFP4")):
        u = dict(t)
        change(u)
        save_file(u, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(UserError) as e:
            load_model(tmp_path / "m")
        assert word in str(e.value) and "\n" not in str(e.value)
