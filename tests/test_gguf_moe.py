"""GGUF expert mixtures (issue 19): llama.cpp's `qwen3moe` and `qwen2moe` files — the router `ffn_gate_inp`, each
role's experts in one 3-D tensor (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`), Qwen2-MoE's shared expert
(`ffn_*_shexp`, its gate score `ffn_gate_inp_shexp` a 1-D tensor) — written here as llama.cpp's converter writes them,
in every format the dense products read; read in place (gate and up stacked once into the `moe` op's rows) and run by
the reference interpreter and the fused plan (the Moe launch decoding the blocks): the same tokens as transformers on
the file's weights decoded by gguf, and as llama.cpp itself on f32 files."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

import gguf_files as gf  # noqa: E402
from lanefuse.engine.errors import UserError  # noqa: E402
from lanefuse.engine.front.load import load_model  # noqa: E402
from hf_ref import fused_step, hf_greedy, scaled_error  # noqa: E402
from test_gguf import PROMPT, U32, VOCAB, _parity, _rewrite  # noqa: E402

pytestmark = pytest.mark.hf

# awkward where the blocks allow: 32-value rows (hidden 64, experts of 96), 8 experts top-2; K-quants need 256
SHAPES = {
    "qwen3moe": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                     intermediate_size=160, moe_intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                     norm_topk_prob=True, vocab_size=VOCAB - 7),
    "qwen2moe": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=160, moe_intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                     shared_expert_intermediate_size=64, norm_topk_prob=False, vocab_size=VOCAB + 3),
}
K_SHAPE = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
               intermediate_size=256, moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2,
               vocab_size=VOCAB)


def _model(arch, **kw):
    return gf.tiny_model(arch, **{**SHAPES[arch], **kw})


@pytest.mark.parametrize("fmt", ["f32", "f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("arch", list(SHAPES))
def test_gguf_mixture_parity_with_transformers(arch, fmt, tmp_path):
    model = _model(arch)
    path = gf.write_gguf(model, tmp_path / f"{arch}-{fmt}.gguf", fmt)
    cfg, weights = _parity(model, path, fmt)
    assert cfg.arch == type(model).__name__ and cfg.moe.experts == 8 and cfg.moe.k == 2
    assert cfg.moe.norm_topk == (arch == "qwen3moe") and cfg.moe.shared_inter == (64 if arch == "qwen2moe" else 0)
    assert cfg.fmt("model.layers.1.mlp.experts.gate_up_proj") == fmt
    assert cfg.fmt("model.layers.1.mlp.gate.weight") == "f32"  # the router kept f32, as llama.cpp keeps it


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
@pytest.mark.parametrize("arch", list(SHAPES))
def test_gguf_mixture_k_quants(arch, fmt, tmp_path):
    """K-quant experts (and a Q4_K_M-like file: gate/up in q4_k, down in q6_k, output in q6_k)."""
    kw = dict(K_SHAPE, norm_topk_prob=arch == "qwen3moe",
              **({"shared_expert_intermediate_size": 256} if arch == "qwen2moe" else {}))
    model = gf.tiny_model(arch, **kw)
    path = gf.write_gguf(model, tmp_path / f"{arch}-{fmt}.gguf", fmt, out_fmt="q6_k")
    _parity(model, path, fmt, out_fmt="q6_k")


def test_q4_k_m_like_mixture_down_experts_in_q6_k(tmp_path):
    """llama.cpp's Q4_K_M keeps ffn_down_exps in q6_k beside q4_k gate/up experts: the Moe launch reads each role in
    its own format."""
    model = gf.tiny_model("qwen3moe", **dict(K_SHAPE, norm_topk_prob=True))
    src = gf.write_gguf(model, tmp_path / "q4_k.gguf", "q4_k", out_fmt="q6_k")
    q6 = gf.write_gguf(model, tmp_path / "q6_k.gguf", "q6_k")
    import gguf
    import torch

    downs = {t.name: t for t in gguf.GGUFReader(q6).tensors if t.name.endswith("ffn_down_exps.weight")}
    dst = tmp_path / "q4_k_m.gguf"
    _rewrite(src, dst, drop_tensors=tuple(downs), add_tensors={n: (np.array(t.data), t.tensor_type)
                                                                 for n, t in downs.items()})
    ref = gf.reference(model, "q4_k", out_fmt="q6_k")
    down = gf.reference(model, "q6_k")
    with torch.no_grad():  # the down experts as the q6_k file holds them
        for (name, p), (_, q) in zip(ref.named_parameters(), down.named_parameters()):
            if name.endswith("experts.down_proj"):
                p.copy_(q)
    want, want_logits = hf_greedy(ref, PROMPT, 8)
    cfg, weights = load_model(dst)
    assert cfg.fmt("model.layers.0.mlp.experts.down_proj") == "q6_k"
    assert cfg.fmt("model.layers.0.mlp.experts.gate_up_proj") == "q4_k"
    from lanefuse.lane.run.generate import generate

    got = generate(cfg, weights, PROMPT, 8, step_fn=fused_step(weights), chunk=4)
    assert got.generated_ids == want and scaled_error(got.logits, want_logits) < 1e-4


def test_a_mixture_file_missing_or_misshapen_experts_is_one_line(tmp_path):
    model = _model("qwen3moe")
    src = gf.write_gguf(model, tmp_path / "m.gguf", "q8_0")
    dst = tmp_path / "bad.gguf"
    _rewrite(src, dst, drop_tensors=("blk.1.ffn_up_exps.weight",))
    with pytest.raises(UserError, match="up_proj.stacked|ffn_up_exps|layer 1's experts"):
        load_model(dst)
    _rewrite(src, dst, set_keys={"qwen3moe.expert_count": (6, U32)})
    with pytest.raises(UserError, match="shape"):
        load_model(dst)
    _rewrite(src, dst, set_keys={"qwen3moe.expert_used_count": (9, U32)})
    with pytest.raises(UserError, match="expert_used_count` 9 is more than"):
        load_model(dst)
    _rewrite(src, dst, drop_keys=("qwen3moe.expert_feed_forward_length",))
    with pytest.raises(UserError, match="missing `qwen3moe.expert_feed_forward_length`"):
        load_model(dst)


def test_mixture_census_and_bytes(tmp_path):
    """A q8_0 qwen3moe file's fused decode step: five launches a layer (the mixture's two among them), and the plan
    reads only the chosen experts' rows."""
    pytest.importorskip("egglog")
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan

    model = _model("qwen3moe")
    cfg, _ = load_model(gf.write_gguf(model, tmp_path / "m.gguf", "q8_0"))
    p = plan(build_step(cfg, 1))
    kinds = [x.launch.census for x in p.launches if x.layer == 1]
    assert len(kinds) == 5 and kinds.count("moe") == 2, kinds


@pytest.mark.llamacpp
@pytest.mark.parametrize("arch", [*SHAPES, "mixtral"])
def test_llama_cpp_agrees_on_mixture_files(arch, tmp_path):
    """llama.cpp decoding the f32 mixture files written here: the same tokens as transformers and lanefuse's fused
    plan, logits within 1e-4 of their scale (so the names, shapes and the routing's conventions are llama.cpp's)."""
    pytest.importorskip("llama_cpp")
    from test_gguf_llamacpp import N

    model = gf.tiny_model("mixtral", **MIXTRAL) if arch == "mixtral" else _model(arch)
    _, *vocab = gf.bpe_tokenizer(model.config.vocab_size, "qwen2")
    path = gf.write_gguf(model, tmp_path / f"{arch}.gguf", "f32", tokenizer=vocab)
    gf.check_llama_cpp(path, gf.reference(model, "f32"), PROMPT, N, f"{arch} f32")


@pytest.mark.parametrize("arch", list(SHAPES))
def test_lanefuse_plan_on_a_mixture_file(arch, tmp_path):
    """`lanefuse plan` on a mixture file: the store serving its stacked experts over the file's finds the file's
    reader (it raised AttributeError before)."""
    import subprocess
    import sys

    path = gf.write_gguf(_model(arch), tmp_path / f"{arch}.gguf", "q8_0")
    r = subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", "plan", str(path)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "moe" in r.stdout and "Traceback" not in r.stderr


MIXTRAL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB)


@pytest.mark.parametrize("fmt", ["f32", "q8_0", "q4_0"])
def test_gguf_mixtral_as_llama_with_experts(fmt, tmp_path):
    """Mixtral as llama.cpp's converter writes it: `llama` with `llama.expert_count`, q and k rows permuted, the
    experts 3-D tensors as wide as `llama.feed_forward_length`; read as Mixtral (softmax routing, the chosen weights
    renormalized) against transformers on the file's weights."""
    model = gf.tiny_model("mixtral", **MIXTRAL)
    path = gf.write_gguf(model, tmp_path / f"mixtral-{fmt}.gguf", fmt)
    cfg, _ = _parity(model, path, fmt)
    assert cfg.arch == "MixtralForCausalLM" and cfg.moe.experts == 4 and cfg.moe.k == 2 and cfg.moe.norm_topk
    assert cfg.moe.inter == 96 and cfg.fmt("model.layers.1.mlp.experts.down_proj") == fmt
