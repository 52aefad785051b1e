"""GGUF gpt-oss files (issue 19): llama.cpp's `gpt-oss` arch as its converter writes it — the q/k/v/o biases, the
attention sinks (`attn_sinks.weight`), the norm before the mixture (`post_attention_norm`), the biased router
(`ffn_gate_inp`), gate and up experts split from the checkpoint's interleaved tensor and down transposed to rows (out,
in), their biases (`ffn_*_exps.bias`), the window and YaRN in the metadata; experts in f32, q8_0 and ggml's MXFP4 —
read by the front (GGUFStore repacks ggml's MXFP4 nibble order, GptOssGGUFStore stacks gate and up) and run by the
reference interpreter and the fused plan: the same tokens as transformers on the file's weights decoded by gguf, and
as llama.cpp itself on an f32 file."""

from __future__ import annotations

import copy
import zlib

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import gguf_files as gf  # noqa: E402
from hf_ref import hf_greedy, margins_ok, scaled_error  # noqa: E402
from lanefuse.engine.errors import UserError  # noqa: E402
from lanefuse.engine.front.load import load_model  # noqa: E402
from test_gguf import U32, VOCAB, _rewrite  # noqa: E402

pytestmark = pytest.mark.hf

PROMPT = [3, 17, 5, 42, 8, 11, 29, 2, 51, 13, 7, 33, 19, 40, 23, 9]  # longer than the window
N = 8
TOL = 1e-4
WINDOW = 5
# rows of whole 32-value blocks (hidden 64, experts of 96) for q8_0 and MXFP4; 8 experts top-2; the ends of YaRN's
# ramp rounded out (`truncate`), as ggml rounds them (ends at 2.02 and 4.35 of the 8 frequencies, with YaRN's
# original context of 4096: rounding moves them); llama.cpp's clamp (7) and alpha for gpt-oss
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
             num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=256,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"], swiglu_limit=7.0,
             rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": True, "original_max_position_embeddings": 4096, "rope_theta": 150000.0})


def tiny_gptoss(seed: int = 0):
    """A transformers gpt-oss, f32, eager; scales that keep the residual alive, the routing decisive and the GLU's
    clamp (7) biting on some values."""
    import torch
    import transformers

    cfg = transformers.GptOssConfig(**SHAPE)
    cfg._attn_implementation = "eager"
    torch.manual_seed(zlib.crc32(f"gptoss-gguf{seed}".encode()))
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif pname.endswith("sinks"):
                p.copy_(1.0 + torch.randn_like(p))
            elif p.dim() == 1 or pname.endswith("_bias") or pname.endswith("router.bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif "embed_tokens" in pname:
                p.copy_(torch.randn_like(p))
            elif pname.endswith("router.weight"):
                p.copy_(3 * torch.randn_like(p) / p.shape[-1] ** 0.5)
            elif pname.endswith("experts.gate_up_proj") or pname.endswith("experts.down_proj"):
                p.copy_(6 * torch.randn_like(p) / p.shape[-2] ** 0.5)  # stored (E, in, out); some |gate| > 7
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model


def _experts_of(model):
    """Each layer's experts as the converter writes them: gate, up (E, f, d) and down (E, d, f) rows (out, in), and
    their biases (E, f), (E, f), (E, d) (transformers' gate_up interleaves gate at 2j, up at 2j + 1)."""
    out = []
    for layer in model.model.layers:
        e = layer.mlp.experts
        gu = e.gate_up_proj.detach().float().numpy().transpose(0, 2, 1)  # (E, 2f, d)
        gub = e.gate_up_proj_bias.detach().float().numpy()
        out.append({"gate": gu[:, 0::2], "up": gu[:, 1::2], "down": e.down_proj.detach().float().numpy()
                    .transpose(0, 2, 1), "gate_b": gub[:, 0::2], "up_b": gub[:, 1::2],
                    "down_b": e.down_proj_bias.detach().float().numpy()})
    return out


def write_gptoss_gguf(model, path, fmt: str = "f32", experts: str | None = None, tokenizer=None):
    """`model` as llama.cpp's convert_hf_to_gguf.py writes a gpt-oss (conversion/gpt_oss.py): its 2-D weights in
    `fmt` (the router f32), the experts in `experts` (default `fmt`), 1-D tensors f32."""
    c = model.config
    experts = experts or fmt
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    gf.add_shape_keys(w, path, c, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.head_dim)
    rope = c.rope_parameters
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.intermediate_size)
    w.add_sliding_window(c.sliding_window)
    w.add_file_type(gf.FILE_TYPES[experts if experts == "mxfp4" else fmt])
    if tokenizer is not None:
        gf.add_tokenizer(w, tokenizer)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    def dense(name, a):
        gf.add_rows(w, name, a, fmt)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    dense("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    dense("output.weight", sd["lm_head.weight"])
    for i, ex in enumerate(_experts_of(model)):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(b + "post_attention_norm.weight", sd[p + "post_attention_layernorm.weight"])
        for hf, g in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
            dense(b + g + ".weight", sd[p + f"self_attn.{hf}.weight"])
            w.add_tensor(b + g + ".bias", sd[p + f"self_attn.{hf}.bias"])
        w.add_tensor(b + "attn_sinks.weight", sd[p + "self_attn.sinks"])
        w.add_tensor(b + "ffn_gate_inp.weight", sd[p + "mlp.router.weight"])  # f32, as llama.cpp keeps the router
        w.add_tensor(b + "ffn_gate_inp.bias", sd[p + "mlp.router.bias"])
        for role in ("gate", "up", "down"):
            gf.add_rows(w, b + f"ffn_{role}_exps.weight", ex[role], experts)
            w.add_tensor(b + f"ffn_{role}_exps.bias", ex[role + "_b"])
    return gf.finish(w, path)


def reference(model, fmt: str = "f32", experts: str | None = None):
    """A copy of `model` whose weights are what a file of it holds, decoded by gguf (f32)."""
    import torch

    experts = experts or fmt
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.ndim == 2 and not name.endswith(("router.weight", "_bias")):  # (the experts' biases (E, n): f32)
                p.copy_(torch.from_numpy(gf.decoded(p.detach().numpy(), fmt)))
        for layer, ex in zip(ref.model.layers, _experts_of(model)):
            e = layer.mlp.experts
            gate, up, down = (gf.decoded(ex[r].reshape(-1, ex[r].shape[-1]), experts).reshape(ex[r].shape)
                              for r in ("gate", "up", "down"))
            gu = np.empty((gate.shape[0], 2 * gate.shape[1], gate.shape[2]), np.float32)
            gu[:, 0::2], gu[:, 1::2] = gate, up
            e.gate_up_proj.copy_(torch.from_numpy(gu.transpose(0, 2, 1).copy()))
            e.down_proj.copy_(torch.from_numpy(down.transpose(0, 2, 1).copy()))
    return ref.eval()


@pytest.fixture(scope="module")
def tiny():
    return tiny_gptoss(4)  # seed 4: every file's greedy steps decided by 0.8% of the logits' scale or more


@pytest.mark.parametrize("fmt,experts", [("f32", "f32"), ("q8_0", "q8_0"), ("f32", "mxfp4"), ("q8_0", "mxfp4")])
def test_gguf_gptoss_parity_with_transformers(tiny, fmt, experts, tmp_path):
    """The reference interpreter and the fused plan (decode steps after chunks of 4) against transformers on the
    file's weights: the same greedy tokens, logits within 1e-4 of their scale."""
    path = write_gptoss_gguf(tiny, tmp_path / f"gptoss-{fmt}-{experts}.gguf", fmt, experts)
    want, want_logits = hf_greedy(reference(tiny, fmt, experts), PROMPT, N)
    assert len(set(want)) > 3 and margins_ok(want_logits)
    cfg, weights = load_model(path)
    assert cfg.arch == "GptOssForCausalLM" and cfg.window == WINDOW and cfg.moe.k == 2 and cfg.moe.experts == 8
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert dict(cfg.rope_scaling)["truncate"] is True and dict(cfg.rope_scaling)["factor"] == 8.0
    assert cfg.fmt("model.layers.1.mlp.experts.gate_up_proj.rows") == experts
    assert cfg.fmt("model.layers.1.mlp.experts.down_proj.rows") == experts
    gf.check_plans(cfg, weights, want, want_logits, PROMPT, N, f"gpt-oss {fmt}/{experts}", TOL)


def test_the_window_the_clamp_the_sinks_and_yarn_matter(tiny, tmp_path):
    """The parity above is not blind to what the file's reading decides: without the window, the clamp, the sinks,
    or with YaRN's ramp ends left unrounded (transformers' truncate false), the logits leave transformers'."""
    import dataclasses

    from lanefuse.engine.front.weights import Weights
    from lanefuse.lane.run.generate import generate

    path = write_gptoss_gguf(tiny, tmp_path / "m.gguf", "f32", "mxfp4")
    _, want_logits = hf_greedy(reference(tiny, "f32", "mxfp4"), PROMPT, 2)
    cfg, weights = load_model(path)
    sc = dict(cfg.rope_scaling)

    class NoSinks:  # the store, its sinks -inf: no share of any softmax
        def __init__(self, base):
            self.base = base

        def __getattr__(self, k):
            return getattr(self.base, k)

        def raw(self, name):
            a, f = self.base.raw(name)
            return (np.full_like(a, -np.inf), f) if name.endswith("sinks") else (a, f)

    for bad, store in ((dataclasses.replace(cfg, window=0), weights.store),
                       (dataclasses.replace(cfg, swiglu_limit=1e6), weights.store),
                       (dataclasses.replace(cfg, rope_scaling=tuple({**sc, "truncate": False}.items())), weights.store),
                       (cfg, NoSinks(weights.store))):
        got = generate(bad, Weights(store, bad), PROMPT, 2, chunk=4)
        rel = scaled_error(got.logits, want_logits)
        assert rel > 4 * TOL, rel  # YaRN's unrounded ends: 8.7e-4 here


def test_ggml_mxfp4_is_repacked_to_the_same_values():
    """Every ggml MXFP4 code and a spread of scales: GGUFStore's repacking decodes (kernels' mxfp4) to gguf's own
    dequantization exactly (its code 8 is +0 where transformers' table says -0: equal in every product)."""
    from lanefuse.engine.front.gguf import mxfp4_from_ggml
    from lanefuse.engine.front.weights import dequantize

    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, (300, 17), dtype=np.uint8)
    blocks[:, 0] = rng.integers(0, 250, 300)  # e8m0 255 (NaN) is refused at load; past 250, gguf's doubled codes overflow
    blocks[:16, 1:] = np.arange(256, dtype=np.uint8).reshape(16, 16)  # every pair of codes
    want = gguf.quants.dequantize(blocks.reshape(1, -1), gguf.GGMLQuantizationType.MXFP4).reshape(-1)
    got = dequantize(mxfp4_from_ggml(blocks).reshape(1, -1), "mxfp4").reshape(-1)
    assert got.dtype == np.float32 and np.array_equal(want, got)


def test_gguf_gptoss_census(tiny, tmp_path):
    """A file's decode step plans to five kernels a layer (the mixture's two among them), as the checkpoint's does."""
    pytest.importorskip("egglog")
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan

    cfg, _ = load_model(write_gptoss_gguf(tiny, tmp_path / "m.gguf", "q8_0", "mxfp4"))
    s = plan(build_step(cfg, 1))
    kinds = [k.census for x in s.launches if x.layer == 1 for k in x.launch.kernels()]
    assert sorted(kinds) == sorted(["fold", "attention", "fold", "moe", "moe"]), kinds
    assert s.fusions.get("moe_deferred_finalize.biased") == 3 and s.fusions.get("gemv_norm_epilogue.bias") == 3


def test_lanefuse_plan_and_run_a_gptoss_file(tiny, tmp_path):
    """The command on a file: `lanefuse plan` prints its plan, `lanefuse run` decodes a prompt with its tokenizer (the
    store serving the experts over the file's finds the file's reader)."""
    import subprocess
    import sys

    _, *vocab = gf.bpe_tokenizer(tiny.config.vocab_size, "qwen2")
    path = write_gptoss_gguf(tiny, tmp_path / "cli.gguf", "q8_0", "mxfp4", tokenizer=vocab)
    for args in (["plan", str(path)], ["run", str(path), "--prompt", "The quick brown fox", "--tokens", "3"]):
        r = subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", *args], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        assert "Traceback" not in r.stderr and r.stdout


def test_gguf_gptoss_refusals_are_one_line(tiny, tmp_path):
    src = write_gptoss_gguf(tiny, tmp_path / "m.gguf", "f32")
    dst = tmp_path / "bad.gguf"
    _rewrite(src, dst, drop_tensors=("blk.1.ffn_up_exps.bias",))
    with pytest.raises(UserError, match=r"no tensor `blk.1.ffn_up_exps.bias`.*layer 1's experts"):
        load_model(dst)
    _rewrite(src, dst, set_keys={"gpt-oss.expert_feed_forward_length": (64, U32)})
    with pytest.raises(UserError, match="ffn_gate_exps.weight` has shape"):
        load_model(dst)
    _rewrite(src, dst, set_keys={"gpt-oss.expert_gating_func": (1, U32)})
    with pytest.raises(UserError, match="expert_gating_func` is 1"):
        load_model(dst)
    _rewrite(src, dst, drop_keys=("gpt-oss.rope.scaling.original_context_length",))
    with pytest.raises(UserError, match="missing `gpt-oss.rope.scaling.original_context_length`"):
        load_model(dst)


@pytest.mark.llamacpp
def test_llama_cpp_agrees_on_a_gptoss_file(tiny, tmp_path):
    """llama.cpp decoding the f32 file written here: the same tokens as transformers and lanefuse's fused plan,
    logits within 1e-4 of their scale (so the names, the sinks, the window, YaRN and the routing are llama.cpp's)."""
    pytest.importorskip("llama_cpp")
    _, *vocab = gf.bpe_tokenizer(tiny.config.vocab_size, "qwen2")
    path = write_gptoss_gguf(tiny, tmp_path / "gptoss.gguf", "f32", tokenizer=vocab)
    gf.check_llama_cpp(path, reference(tiny), PROMPT, N, "gpt-oss f32")
