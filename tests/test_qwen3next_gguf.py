"""Qwen3-Next GGUF files (llama.cpp's `qwen3next`): tiny transformers-made models (a mixture with the shared expert in
every layer, as llama.cpp's qwen3next has; key heads fewer than value heads; A_log, dt_bias, the convolution and every
norm perturbed) written as llama.cpp's converter writes them (tests/gguf_files.py's write_qwen3next: ssm_* tensors,
-exp(A_log), norms held as 1 + w, in_proj_qkvz as attn_qkv + attn_gate or as the older ssm_in), in every format the
dense products read; the reference interpreter and the fused plan give the same greedy tokens as transformers on the
file's weights decoded by gguf, logits within 1e-4 of their scale; and llama.cpp itself agrees on the f32 file."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import gguf_files as gf  # noqa: E402
from hf_ref import fused_step, hf_greedy, margins_ok, scaled_error  # noqa: E402
from lanefuse.engine.errors import UserError  # noqa: E402
from lanefuse.engine.front.load import load_model  # noqa: E402
from lanefuse.lane.run.generate import generate  # noqa: E402
from test_engine import in_blocks  # noqa: E402
from test_gguf import _needs_blocks, _rewrite  # noqa: E402

pytestmark = pytest.mark.hf

TOL = 1e-4
PROMPT = [3, 17, 5, 42, 8, 11, 60, 2, 29]  # three prefill chunks of 4: the state crosses two boundaries
N = 12
# rows of 32-value blocks everywhere (hidden 32, experts of 32, the shared expert 64, attention 4 x 16, values 4 x 32)
SHAPE = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=37, vocab_size=97, linear_conv_kernel_dim=4, linear_key_head_dim=32,
             linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=6,
             num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
             max_position_embeddings=128, norm_topk_prob=True,
             layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
# the K-quants need 256-value rows: hidden 256, experts of 256 (the rest falls back to q8_0 as llama.cpp's quantizer)
K_SHAPE = dict(SHAPE, hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256,
               num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])


def tiny(seed: int = 1, **over):
    cfg = transformers.Qwen3NextConfig(**{**SHAPE, **over})
    torch.manual_seed(zlib.crc32(f"qwen3next-gguf{seed}".encode()))
    model = transformers.Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("linear_attn.norm.weight"):  # the gated norm scales by w
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in pname:  # the zero-centred norms scale by 1 + w
                p.copy_(0.2 * torch.randn_like(p))
            elif pname.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.05, 2.0).log())
            elif pname.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif pname.endswith("mlp.gate.weight"):  # the router: decisive choices
                p.copy_(3 * torch.randn_like(p) / p.shape[-1] ** 0.5)
            elif "embed_tokens" in pname:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model


def _parity(model, path, fmt, out_fmt=None):
    ref = gf.reference(model, fmt, out_fmt)
    want, want_logits = hf_greedy(ref, PROMPT, N)
    assert len(set(want)) > 4 and margins_ok(want_logits, 10 * TOL)
    cfg, weights = load_model(path)
    assert cfg.arch == "Qwen3NextForCausalLM" and cfg.hk < cfg.hv and cfg.norm_offset == 0.0
    for how, step in (("reference interpreter", None), ("fused plan", fused_step(weights))):
        got = generate(cfg, weights, PROMPT, N, step_fn=step, chunk=4)
        rel = scaled_error(got.logits, want_logits)
        print(f"\nQwen3-Next GGUF {path.name}: {how} {rel:.2e}", end="")
        assert got.generated_ids == want, how
        assert rel < TOL, how
    return cfg, weights


@pytest.mark.parametrize("fmt", ["f32", "f16", "q8_0", "q4_0"])
def test_qwen3next_gguf_parity_with_transformers(fmt, tmp_path):
    _needs_blocks(fmt)
    model = tiny()
    path = gf.write_qwen3next(model, tmp_path / f"qwen3next-{fmt}.gguf", fmt)
    cfg, _ = _parity(model, path, fmt)
    assert cfg.layer_types == tuple(SHAPE["layer_types"]) and (cfg.taps, cfg.hk, cfg.hv, cfg.dk, cfg.dv) == \
        (4, 2, 4, 32, 32)
    assert cfg.moe.sparse == (0, 1, 2, 3) and cfg.moe.shared_inter == 64 and cfg.rot == 4
    assert cfg.fmt("model.layers.0.linear_attn.in_proj_qkvz.split.weight") == fmt
    assert cfg.fmt("model.layers.0.linear_attn.out_proj.weight") == fmt


def test_the_older_converters_ssm_in(tmp_path):
    """ssm_in: in_proj_qkvz as transformers stores it (each key-head group's q, k, v, z), q8_0."""
    _needs_blocks("q8_0")
    model = tiny(2)
    path = gf.write_qwen3next(model, tmp_path / "legacy.gguf", "q8_0", legacy=True)
    assert "blk.0.ssm_in.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    _parity(model, path, "q8_0")


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_qwen3next_gguf_k_quants(fmt, tmp_path):
    _needs_blocks(fmt)
    model = tiny(4, **{k: v for k, v in K_SHAPE.items() if k not in SHAPE or K_SHAPE[k] != SHAPE[k]})
    path = gf.write_qwen3next(model, tmp_path / f"k-{fmt}.gguf", fmt, out_fmt="q6_k")
    cfg, _ = _parity(model, path, fmt, out_fmt="q6_k")
    assert cfg.fmt("model.layers.0.mlp.experts.gate_up_proj") == fmt


def test_the_file_holds_what_the_converter_writes(tmp_path):
    """The conventions, read back: -exp(A_log), 1 + w norms (the delta net's own as w), conv (channels, taps)."""
    model = tiny()
    r = gguf.GGUFReader(gf.write_qwen3next(model, tmp_path / "m.gguf", "f32"))
    t = {x.name: np.array(x.data) for x in r.tensors}
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    p = "model.layers.0."
    assert np.allclose(t["blk.0.ssm_a"], -np.exp(sd[p + "linear_attn.A_log"]))
    assert np.array_equal(t["blk.0.attn_norm.weight"], sd[p + "input_layernorm.weight"] + 1)
    assert np.array_equal(t["blk.0.ssm_norm.weight"], sd[p + "linear_attn.norm.weight"])
    assert t["blk.0.ssm_conv1d.weight"].shape == (2 * 64 + 128, 4)
    cfg, weights = load_model(tmp_path / "m.gguf")
    a_log = weights.get(p + "linear_attn.A_log")
    assert np.allclose(a_log, sd[p + "linear_attn.A_log"], atol=1e-6)


def test_refusals_name_the_file_and_tensor(tmp_path):
    model = tiny()
    src = gf.write_qwen3next(model, tmp_path / "m.gguf", "f32")
    dst = tmp_path / "bad.gguf"
    _rewrite(src, dst, drop_tensors=("blk.2.ssm_ba.weight",))
    with pytest.raises(UserError, match=r"bad.gguf: the checkpoint has no tensor `blk.2.ssm_ba.weight`"):
        load_model(dst)
    _rewrite(src, dst, drop_keys=("qwen3next.ssm.group_count",))
    with pytest.raises(UserError, match="missing `qwen3next.ssm.group_count`|qwen3next.ssm.group_count"):
        load_model(dst)
    _rewrite(src, dst, drop_keys=("qwen3next.expert_count",))
    with pytest.raises(UserError, match="qwen3next.expert_count"):
        load_model(dst)
    a = np.array(next(x for x in gguf.GGUFReader(src).tensors if x.name == "blk.0.ssm_a").data)
    _rewrite(src, dst, drop_tensors=("blk.0.ssm_a",), add_tensors={"blk.0.ssm_a": (np.abs(a), None)})
    cfg, weights = load_model(dst)
    with pytest.raises(UserError, match="blk.0.ssm_a.*not negative"):
        weights.get("model.layers.0.linear_attn.A_log")


@pytest.mark.llamacpp
def test_llama_cpp_agrees_on_a_qwen3next_file(tmp_path):
    """llama.cpp decoding the f32 file written here: the same tokens as transformers and lanefuse's fused plan."""
    pytest.importorskip("llama_cpp")
    model = tiny(vocab_size=300)  # a byte-level BPE's 256 bytes and two specials
    _, *vocab = gf.bpe_tokenizer(model.config.vocab_size, "qwen2")
    path = gf.write_qwen3next(model, tmp_path / "qwen3next.gguf", "f32", tokenizer=vocab)
    gf.check_llama_cpp(path, gf.reference(model, "f32"), PROMPT, N, "qwen3next f32")


# -- the q8 numerics: the delta rule's output quantized in its epilogue (gdn_output_quant) ---------------------------

def _env(g, rows, pos, rng):
    env = {"token": rng.integers(0, 97, rows).astype(np.int32), "pos": np.array([pos], np.int32)}
    for name in g.io.tables:  # KV caches zero, the rings and recurrent states carried from an earlier step
        env[name] = (0.3 * rng.standard_normal(g.tensors[name].shape)).astype(np.float32) if pos else \
            np.zeros(g.tensors[name].shape, np.float32)
    return env


@pytest.mark.parametrize("numerics", ["q8", "q8x2"])
def test_q8_delta_output_quantized_in_its_epilogue(numerics, tmp_path):
    """A q8_0 file's decode step and a prefill chunk of 3 rows under q8/q8x2: each delta launch writes its output's
    quantized form for the out product (no Quant launch of its own); held, the delta writes f32 alone and a Quant
    launch quantizes it. Both plans, run by the exact twins in their arenas, give the same logits bit for bit, equal
    to the interpreter of the quantized step graph (q8x2: within one step of a low word, d/254 of a block's largest
    value, 3e-5 of the logits' scale measured: the twins' f32 sums and the interpreter's round otherwise, and a value
    that close to a half rounds to the other word)."""
    pytest.importorskip("egglog")
    from lanefuse.engine.interp import evaluate
    from lanefuse.engine.formats.quantize import with_numerics
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    _needs_blocks("q8_0")
    cfg, w = load_model(gf.write_qwen3next(tiny(), tmp_path / "q8.gguf", "q8_0"))
    words = {"q8": 1, "q8x2": 2}[numerics]
    for rows, pos in ((1, 5), (3, 0)):
        g = cfg.build_step(rows)
        gq = with_numerics(g, numerics)
        want = evaluate(gq, w, _env(gq, rows, pos, np.random.default_rng(rows)))
        got = []
        for held in ((), ("gdn_output_quant",)):
            p = plan(g, numerics=numerics, held=list(held))
            deltas = [x.launch for x in p.launches if x.launch.census == "delta"]
            assert len(deltas) == 2
            from_delta = [x.launch for x in p.launches if x.launch.census == "quant" and x.launch.x.endswith(".delta")]
            if held:
                assert all(d.quant is None for d in deltas) and len(from_delta) == 2
            else:
                assert all(d.quant and d.quant.startswith(d.out + ".") and d.words == words for d in deltas)
                assert not from_delta
            got.append(NumpyRunner(p, w, exact=True).step(_env(g, rows, pos, np.random.default_rng(rows)), lifted=g))
        assert np.array_equal(got[0]["logits"], got[1]["logits"])
        err = np.abs(got[0]["logits"] - want["logits"]).max() / np.abs(want["logits"]).max()
        assert err <= (1e-6 if words == 1 else 1e-4), (rows, err)
        assert np.array_equal(got[0]["next"], want["next"])


def test_q8_census_of_a_qwen3next_file(tmp_path):
    """Under q8 a delta-net decode layer's token mixer stays five launches (its output quantized by the delta launch
    itself); a gated attention layer's gains one Quant (its gated output: attn_output_gate.quant is refused, the
    file's attention heads of 16 values not whole 32-value blocks; test_q8_shared_expert_runs_inside_the_mixture's
    all-q8 shape has heads of 32, whose attention quantizes its gated product)."""
    pytest.importorskip("egglog")
    from lanefuse.lane.lower.plan import plan

    _needs_blocks("q8_0")
    cfg, _ = load_model(gf.write_qwen3next(tiny(), tmp_path / "q8.gguf", "q8_0"))
    p = plan(cfg.build_step(1), numerics="q8")
    layer = {i: [k.census for x in p.launches if x.layer == i for k in x.launch.kernels()] for i in (0, 1)}
    mixer = layer[0][:layer[0].index("delta") + 2]
    assert mixer == ["fold", "gemm_parts", "conv_parts", "gates", "delta", "fold"], layer[0]
    assert "quant" in layer[1][:layer[1].index("attention") + 2], layer[1]


# -- the q8 numerics: the shared expert inside the mixture's launches (shared_expert_fusion.quant) --------------------

def _all_q8_shape():
    """A tiny Qwen3-Next shape with every matrix q8_0 (the shared expert's gate score row too, as the bench's
    80B-A3B shape has it; a GGUF file keeps that row f32) and attention heads of 32, seeded random weights."""
    from lanefuse.engine.front.hfconfig import config_from_hf
    from lanefuse.engine.front.stepweights import random_weights

    c = {"architectures": ["Qwen3NextForCausalLM"], **SHAPE, "head_dim": 32}  # attention heads of whole blocks
    cfg = in_blocks(config_from_hf(c, "Qwen3-Next q8 test config", max_len=16), "q8_0")
    return cfg, random_weights(cfg.build_step(1), 5)


def _layers(p, n: int) -> list[list[str]]:
    return [[k.census for x in p.launches if x.layer == i for k in x.launch.kernels()] for i in range(n)]


@pytest.mark.parametrize("numerics", ["q8", "q8x2"])
@pytest.mark.parametrize("source", ["gguf", "all_q8"])
def test_q8_shared_expert_runs_inside_the_mixture(numerics, source, tmp_path):
    """Under q8/q8x2 the shared expert (its products reading the input quantized, its down product its GLU quantized)
    stays inside the mixture's two launches, which quantize both themselves (shared_expert_fusion.quant; its gate
    score read quantized where its row is block-quantized, f32 where a GGUF file keeps it f32: .quant_f32_gate), and
    the mixture's last launch quantizes the next norm (moe_deferred_finalize.shared_quant): each layer of both types
    has the f32 plan's launches (the gated attention quantizing its product as it stores it: attn_output_gate.quant;
    in the file's heads of 16 values, not whole blocks, a Quant launch does). Held `fuse_quant`, the Quant, GEMV, Binary and Norm
    launches of the parts give the same logits bit for bit (the exact twins in their arenas), equal to the
    interpreter of the quantized step graph; a decode step and a chunk of 3 rows (the rows grouped by expert)."""
    pytest.importorskip("egglog")
    from lanefuse.engine.interp import evaluate
    from lanefuse.engine.formats.quantize import with_numerics
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    if source == "gguf":
        _needs_blocks("q8_0")
        cfg, w = load_model(gf.write_qwen3next(tiny(), tmp_path / "q8.gguf", "q8_0"))
    else:
        cfg, w = _all_q8_shape()
    words = {"q8": 1, "q8x2": 2}[numerics]
    f32 = plan(cfg.build_step(1), numerics="f32")
    for rows, pos in ((1, 5), (3, 0)):
        g = cfg.build_step(rows)
        p = plan(g, numerics=numerics)
        moes = [x.launch for x in p.launches if x.launch.census == "moe"]
        assert len(moes) == cfg.layers and all(m.qwords == words and m.sg for m in moes)
        assert all(bool(m.qgate) == (source == "all_q8") for m in moes)
        if rows == 1:
            assert p.fusions.get("moe_deferred_finalize.shared_quant") == cfg.layers
            assert all(m.quant and m.quant_words == words for m in moes)
            got_layers, want_layers = _layers(p, cfg.layers), _layers(f32, cfg.layers)
            for i, (a, b) in enumerate(zip(got_layers, want_layers)):
                assert [k for k in a if k != "quant"] == b, (i, a, b)
            assert {k: v for k, v in p.census.items() if k != "quant"} == f32.census
            gated = [x.launch for x in p.launches if x.launch.census == "attention"]
            if source == "gguf":  # heads of 16: the gated output quantized by a Quant launch
                assert p.census["quant"] == len(cfg.attention_layers) and not any(a.quant for a in gated)
            else:
                assert "quant" not in p.census and p.census == f32.census
                assert p.fusions.get("attn_output_gate.quant") == len(cfg.attention_layers)
                assert all(a.gate and a.quant and a.quant.startswith(a.out + ".") and a.words == words and
                           not a.f32 for a in gated)
        held = plan(g, numerics=numerics, held=("fuse_quant",))
        assert not any(getattr(x.launch, "qwords", 0) for x in held.launches)
        assert held.census["quant"] > p.census.get("quant", 0) + cfg.layers
        gq = with_numerics(g, numerics)
        env = _env(gq, rows, pos, np.random.default_rng(rows))
        want = evaluate(gq, w, env)
        a, b = (NumpyRunner(q, w, exact=True).step(_env(g, rows, pos, np.random.default_rng(rows)), lifted=g)
                for q in (p, held))
        assert np.array_equal(a["logits"], b["logits"]) and np.array_equal(a["next"], b["next"])
        err = np.abs(a["logits"] - want["logits"]).max() / np.abs(want["logits"]).max()
        assert err <= (1e-6 if words == 1 else 1e-4), (rows, err)
        assert np.array_equal(a["next"], want["next"])
        fast = NumpyRunner(p, w, exact=False).step(_env(g, rows, pos, np.random.default_rng(rows)))
        assert np.abs(fast["logits"] - want["logits"]).max() <= 1e-3 * np.abs(want["logits"]).max()


def _all_k_shape(fmt: str):
    """A tiny Qwen3-Next shape whose matrices of 256-value rows are all in a K-quant format (the rest f32): hidden 256,
    attention heads of 64, value heads of 64 (a q8k block spans four of either), experts and the shared expert of
    256; seeded random weights."""
    from lanefuse.engine.front.hfconfig import config_from_hf
    from lanefuse.engine.front.stepweights import random_weights

    c = {"architectures": ["Qwen3NextForCausalLM"], **K_SHAPE, "head_dim": 64, "linear_value_head_dim": 64,
         "intermediate_size": 256}
    cfg = in_blocks(config_from_hf(c, "Qwen3-Next q8k test config", max_len=16), fmt)
    return cfg, random_weights(cfg.build_step(1), 6)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_q8_on_k_quant_rows_keeps_the_f32_launches(fmt):
    """Under q8 every product over K-quant rows reads llama.cpp's q8_K form (blocks of 256), and every producer writes
    it in its epilogue: the norms, the gated attention (heads of 64, four a block), the delta rule (the last of a
    block's four heads to arrive quantizes it), the shared expert inside the mixture's launches (its input row and its
    GLU quantized into their shared memory, gemv_q8.cu's q8k_tile) and the mixture's finalize: each layer has the f32
    plan's launches, no Quant launch. Held `fuse_quant`, the parts' launches give the same logits bit for bit (the exact
    twins in their arenas: the norm before the mixture, quantized by the shared expert inside it, the shared expert's
    SiLU and the finalize's norm all llama.cpp's, as the held plan's Norm, Binary and Quant launches compute them), and
    the interpreter of the quantized graph's within 1e-6; decode and a chunk of 3 rows."""
    pytest.importorskip("egglog")
    from lanefuse.engine.interp import evaluate
    from lanefuse.engine.formats.quantize import with_numerics
    from lanefuse.lane.lower.plan import plan
    from lanefuse.lane.run.numpy_runner import NumpyRunner

    cfg, w = _all_k_shape(fmt)
    for rows, pos in ((1, 5), (3, 0)):
        g = cfg.build_step(rows)
        p, f32 = plan(g, numerics="q8"), plan(g)
        assert "quant" not in p.census and p.census == f32.census, (p.census, f32.census)
        moes = [x.launch for x in p.launches if x.launch.census == "moe"]
        assert len(moes) == cfg.layers and all(m.qwords == 3 and m.sg for m in moes)
        assert all(m.quant_words == 3 for m in moes if m.quant) and sum(bool(m.quant) for m in moes) >= 1
        deltas = [x.launch for x in p.launches if x.launch.census == "delta"]
        assert deltas and all(d.quant and d.words == 3 for d in deltas)
        gated = [x.launch for x in p.launches if x.launch.census == "attention"]
        assert gated and all(a.gate and a.quant and a.words == 3 and a.f32 for a in gated)
        held = plan(g, numerics="q8", held=("fuse_quant",))
        assert held.census["quant"] > 2 * cfg.layers
        gq = with_numerics(g, "q8")
        assert {op.a["words"] for op in gq.ops if op.kind == "quantize"} == {3}
        want = evaluate(gq, w, _env(gq, rows, pos, np.random.default_rng(rows)))
        a, b = (NumpyRunner(q, w, exact=True, check=True).step(_env(g, rows, pos, np.random.default_rng(rows)),
                                                               lifted=g) for q in (p, held))
        assert np.array_equal(a["logits"], b["logits"]) and np.array_equal(a["next"], b["next"])
        err = np.abs(a["logits"] - want["logits"]).max() / np.abs(want["logits"]).max()
        assert err <= 1e-6 and np.array_equal(a["next"], want["next"]), (rows, err)
