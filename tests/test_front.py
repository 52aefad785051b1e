"""The front and the weight store: checkpoint folders written with numpy (f32, f16, bf16, sharded, tied) load into the
config and weights the step reads; config.json of transformers 4.x and 5.x read alike; each mistake is one clear
UserError; a step YAML's `weights:` entry resolves."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from lanefuse.engine.front.demo import random_arrays
from lanefuse.engine.errors import UserError
from lanefuse.engine.front.load import load_model
from lanefuse.lane.run.generate import generate
from lanefuse.engine.front.hfconfig import config_from_hf
from lanefuse.engine.front.model import ModelConfig, build_step
from lanefuse.engine.front.stepweights import step_weights
from lanefuse.engine.front.weights import Weights, bf16_to_f32, f32_to_bf16, inv_freq

HF = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 48, "vocab_size": 50, "rms_norm_eps": 1e-5,
      "max_position_embeddings": 64, "tie_word_embeddings": False, "rope_theta": 10000.0, "hidden_act": "silu"}


def _save_bf16(path, arrays: dict[str, np.ndarray]) -> None:
    """A safetensors file of bf16 tensors, written by hand (numpy has no bf16)."""
    header, blobs, off = {}, [], 0
    for name, a in arrays.items():
        b = f32_to_bf16(a).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def write_checkpoint(folder, config: dict, fmt: str = "f32", shards: int = 1, drop=(), reshape=None, seed=0):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    cfg = config_from_hf(config)
    arrays = random_arrays(cfg, seed)
    for n in drop:
        arrays.pop(n)
    for n, shape in (reshape or {}).items():
        arrays[n] = np.zeros(shape, dtype=np.float32)
    names = list(arrays)
    parts = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for i, part in enumerate(parts):
        fname = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        sub = {n: arrays[n] for n in part}
        if fmt == "bf16":
            _save_bf16(folder / fname, sub)
        else:
            save_file({n: a.astype(np.float16 if fmt == "f16" else np.float32) for n, a in sub.items()},
                      str(folder / fname))
        weight_map.update({n: fname for n in part})
    if shards > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return arrays


def test_load_f32_and_generate_like_memory(tmp_path):
    arrays = write_checkpoint(tmp_path / "m", HF)
    cfg, w = load_model(tmp_path / "m")
    assert cfg.arch == "LlamaForCausalLM" and cfg.hidden == 32 and cfg.kv_heads == 2 and cfg.max_len == 64
    assert cfg.fmt("model.layers.1.mlp.up_proj.weight") == "f32"
    np.testing.assert_array_equal(w.get("model.layers.0.self_attn.q_proj.weight"),
                                  arrays["model.layers.0.self_attn.q_proj.weight"])
    mem = Weights.from_dict(arrays, cfg)
    a = generate(cfg, w, [1, 2, 3], 5)
    b = generate(cfg, mem, [1, 2, 3], 5)
    assert a.generated_ids == b.generated_ids
    assert w.shape("rope.cos") == (64, 4) and "rope.sin" in w.names()


def test_load_f16(tmp_path):
    arrays = write_checkpoint(tmp_path / "m", HF, fmt="f16")
    cfg, w = load_model(tmp_path / "m")
    name = "model.layers.0.mlp.down_proj.weight"
    raw, fmt = w.raw(name)
    assert fmt == "f16" and raw.dtype == np.float16 and cfg.fmt(name) == "f16"
    np.testing.assert_array_equal(w.get(name), arrays[name].astype(np.float16).astype(np.float32))


def test_load_bf16_without_torch(tmp_path):
    arrays = write_checkpoint(tmp_path / "m", HF, fmt="bf16")
    cfg, w = load_model(tmp_path / "m")
    name = "model.embed_tokens.weight"
    raw, fmt = w.raw(name)
    assert fmt == "bf16" and raw.dtype == np.uint16 and cfg.fmt(name) == "bf16"
    want = bf16_to_f32(f32_to_bf16(arrays[name]))
    np.testing.assert_array_equal(w.get(name), want)
    assert np.abs(want - arrays[name]).max() <= np.abs(arrays[name]).max() * 2 ** -8


def test_bf16_rounds_to_nearest_even():
    x = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5, 1.0 + 2 ** -7], dtype=np.float32)
    got = bf16_to_f32(f32_to_bf16(x))  # halfway cases go to the even mantissa
    assert list(got) == [1.0, 1.0, 1.0 + 2 ** -6, -2.5, 1.0 + 2 ** -7]


def test_load_sharded(tmp_path):
    arrays = write_checkpoint(tmp_path / "m", HF, shards=3)
    cfg, w = load_model(tmp_path / "m")
    assert len({w.store.where(n) for n in arrays}) == 3
    np.testing.assert_array_equal(w.get("lm_head.weight"), arrays["lm_head.weight"])


def test_tied_embeddings(tmp_path):
    write_checkpoint(tmp_path / "m", {**HF, "tie_word_embeddings": True})
    cfg, w = load_model(tmp_path / "m")
    assert cfg.tie_embeddings and "lm_head.weight" not in w.names()
    assert generate(cfg, w, [4], 3).generated_ids


@pytest.mark.parametrize("make,expect", [
    (lambda p: p / "nowhere", r"nowhere: no such file or folder"),
    (lambda p: (p / "empty").mkdir() or p / "empty", r"empty: no config.json in this folder"),
    (lambda p: (p / "f.txt").write_text("x") and p / "f.txt", r"f.txt: expected a checkpoint folder"),
])
def test_path_errors(tmp_path, make, expect):
    with pytest.raises(UserError, match=expect):
        load_model(make(tmp_path))


def test_unsupported_architecture_lists_the_supported(tmp_path):
    write_checkpoint(tmp_path / "m", HF)
    (tmp_path / "m" / "config.json").write_text(json.dumps({**HF, "architectures": ["FalconForCausalLM"]}))
    with pytest.raises(UserError) as e:  # one line: each family (engine/front/families/) and what it reads
        load_model(tmp_path / "m")
    assert str(e.value).endswith(
        "architecture `FalconForCausalLM` is not supported (supported: deepseek: DeepseekV3ForCausalLM; gemma: "
        "Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration; gptoss: GptOssForCausalLM; llama: "
        "LlamaForCausalLM, MistralForCausalLM, Phi3ForCausalLM; mixtures: Qwen3MoeForCausalLM, MixtralForCausalLM, "
        "Qwen2MoeForCausalLM; olmo2: Olmo2ForCausalLM; qwen: Qwen2ForCausalLM, Qwen3ForCausalLM; qwen3next: Qwen3NextForCausalLM)")
    assert "\n" not in str(e.value)


def test_missing_tensor_is_named_with_its_shape(tmp_path):
    write_checkpoint(tmp_path / "m", HF, drop=["model.layers.1.self_attn.k_proj.weight"])
    with pytest.raises(UserError, match=r"no tensor `model.layers.1.self_attn.k_proj.weight` "
                                        r"\(expected shape \(16, 32\)\)"):
        load_model(tmp_path / "m")


def test_misshaped_tensor_names_both_shapes(tmp_path):
    write_checkpoint(tmp_path / "m", HF, reshape={"model.norm.weight": (31,)})
    with pytest.raises(UserError, match=r"tensor `model.norm.weight` has shape \(31,\), expected \(32,\)"):
        load_model(tmp_path / "m")


def test_unsupported_dtype_is_named(tmp_path):
    write_checkpoint(tmp_path / "m", HF)
    save_file({"model.norm.weight": np.ones(32)}, str(tmp_path / "m" / "model.safetensors"))  # f64, the rest gone
    with pytest.raises(UserError, match=r"model.norm.weight|has no tensor"):
        load_model(tmp_path / "m")
    with pytest.raises(UserError, match=r"tensor `model.norm.weight` in model.safetensors is F64"):
        Weights.from_folder(tmp_path / "m").get("model.norm.weight")


def test_bad_config_json(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="config.json: not readable JSON"):
        load_model(tmp_path / "m")


@pytest.mark.parametrize("change,expect", [
    ({"hidden_act": "relu"}, r"hidden_act `relu` is not supported for Llama \(only silu, gelu, gelu_pytorch_tanh, "),
    ({"architectures": ["MistralForCausalLM"], "hidden_act": "gelu"},
     r"hidden_act `gelu` is not supported for Mistral"),
    ({"architectures": ["Qwen2ForCausalLM"], "mlp_bias": True}, "mlp_bias is not supported for Qwen2"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type `yarn` is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 4.0}}, "llama3 rope scaling lacks low_freq_factor"),
    ({"num_hidden_layers": None}, "missing `num_hidden_layers`"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 4, "max_window_layers": -1},
     r"`max_window_layers` is -1; expected a layer count \(0 or more\)"),
    ({"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True, "sliding_window": 4,
      "layer_types": ["sliding_attention"]}, r"`layer_types` is \['sliding_attention'\]; expected a list of 2 layer"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 4,
      "layer_types": ["sliding", "full_attention"]}, r"`layer_types\[0\]` is 'sliding'; expected sliding_attention or"),
])
def test_config_refusals(change, expect):
    with pytest.raises(UserError, match=expect):
        config_from_hf({**HF, **change})


LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_config_4x_and_5x_read_alike():
    v4 = {**HF, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3}}
    v4_old = {**HF, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3}}
    v5 = {k: v for k, v in HF.items() if k != "rope_theta"}
    v5["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}
    a, b, c = config_from_hf(v4), config_from_hf(v4_old), config_from_hf(v5)
    assert a == b == c
    assert a.rope_theta == 500000.0 and dict(a.rope_scaling)["factor"] == 8.0


def test_qwen_sliding_windows_as_transformers_reads_them():
    """use_sliding_window: the layers `layer_types` names slide (5.x writes it), else transformers' default for the
    family (4.x configs): Qwen2 and Qwen3 from max_window_layers on (28 when absent; 0: every layer), Qwen2-MoE its
    even layers before it, Qwen3-MoE every layer; without the flag, or with a null window, no layer slides."""
    win = {"use_sliding_window": True, "sliding_window": 5}
    six = {**HF, "num_hidden_layers": 6}

    def slides(arch, **kw):
        c = config_from_hf({**six, "architectures": [arch], **kw})
        return c.window, [i for i in range(c.layers) if c.window and c.sliding(i)]

    assert slides("Qwen2ForCausalLM", **win, max_window_layers=2) == (5, [2, 3, 4, 5])
    assert slides("Qwen3ForCausalLM", **win, max_window_layers=0) == (5, [0, 1, 2, 3, 4, 5])
    assert slides("Qwen3ForCausalLM", **win) == (0, [])  # max_window_layers 28: no layer of six
    assert slides("Qwen2ForCausalLM", **win, layer_types=["full_attention", "sliding_attention"] * 3) == (5, [1, 3, 5])
    assert slides("Qwen2ForCausalLM", sliding_window=5, max_window_layers=0) == (0, [])
    assert slides("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=None, max_window_layers=0) == (0, [])
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    assert slides("Qwen2MoeForCausalLM", **win, **moe, shared_expert_intermediate_size=8,
                  max_window_layers=4) == (5, [0, 2])
    assert slides("Qwen3MoeForCausalLM", **win, **moe, max_window_layers=2) == (5, [0, 1, 2, 3, 4, 5])
    assert slides("MistralForCausalLM", sliding_window=5) == (5, [0, 1, 2, 3, 4, 5])


def test_qwen_shapes():
    q2 = config_from_hf({**HF, "architectures": ["Qwen2ForCausalLM"]})
    q3 = config_from_hf({**HF, "architectures": ["Qwen3ForCausalLM"], "head_dim": 16})
    assert q2.qkv_bias and not q2.qk_norm and q3.qk_norm and q3.head_dim == 16
    assert q3.weight_names()["model.layers.0.self_attn.q_proj.weight"] == (64, 32)


def test_llama3_inv_freq_regimes():
    cfg = config_from_hf({**HF, "rope_scaling": {"rope_type": "llama3", **LLAMA3}})
    base = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    got = inv_freq(cfg)
    wavelen = 2 * np.pi / base
    hi, lo = wavelen < 16, wavelen > 64  # original 64 / high_freq_factor 4, / low_freq_factor 1
    assert hi.any() and lo.any() and (~hi & ~lo).any()
    np.testing.assert_array_equal(got[hi], base[hi])  # high frequencies unchanged
    np.testing.assert_allclose(got[lo], base[lo] / 8.0)  # low frequencies divided by the factor
    mid = ~hi & ~lo
    assert np.all(got[mid] < base[mid]) and np.all(got[mid] > base[mid] / 8.0)  # smoothed between


@pytest.mark.hf
def test_llama3_inv_freq_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, rope_theta=10000.0,
                                  rope_scaling={"rope_type": "llama3", **LLAMA3})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    cfg = config_from_hf({**HF, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
                          "rope_scaling": {"rope_type": "llama3", **LLAMA3}})
    np.testing.assert_allclose(inv_freq(cfg), want.double().numpy(), rtol=1e-6)


def test_step_weights(tmp_path):
    g = build_step(ModelConfig("Qwen3ForCausalLM", 256, 4, 8, 2, 32, 512, 512, qk_norm=True, name="demo"), 1)
    g.meta["weights"] = {"demo": True}
    assert step_weights(g).get("model.norm.weight").shape == (256,)
    g.meta["weights"] = {"random": 3}
    w = step_weights(g)
    assert w.get("lm_head.weight").shape == (512, 256) and w.get("rope.cos").shape == (256, 16)
    g.meta["weights"] = {"demos": True}
    with pytest.raises(UserError, match=r"unknown weights source `demos` \(did you mean `demo`\?\)"):
        step_weights(g)
    g.meta.pop("weights")
    with pytest.raises(UserError, match="the step names no weights"):
        step_weights(g)


def test_step_weights_checkpoint_relative_to_the_yaml(tmp_path):
    write_checkpoint(tmp_path / "ckpt", HF)
    cfg, _ = load_model(tmp_path / "ckpt")
    g = build_step(cfg, 1)
    g.meta["weights"] = {"checkpoint": "ckpt"}
    w = step_weights(g, tmp_path)
    assert w.get("rope.cos").shape == g.constants["rope.cos"].shape


PHI3 = {**HF, "architectures": ["Phi3ForCausalLM"], "sliding_window": 7}


def _phi3_fused(folder, arrays: dict[str, np.ndarray], drop=(), reshape=None) -> None:
    """A Phi-3 checkpoint of `arrays` (Llama's names) as Phi-3 stores it: each layer's q, k, v rows in one qkv_proj,
    its gate and up rows in one gate_up_proj."""
    out = dict(arrays)
    for i in range(PHI3["num_hidden_layers"]):
        p = f"model.layers.{i}."
        qkv = [out.pop(p + f"self_attn.{r}_proj.weight") for r in "qkv"]
        gu = [out.pop(p + f"mlp.{r}_proj.weight") for r in ("gate", "up")]
        out[p + "self_attn.qkv_proj.weight"] = np.concatenate(qkv)
        out[p + "mlp.gate_up_proj.weight"] = np.concatenate(gu)
    for n in drop:
        out.pop(n)
    for n, shape in (reshape or {}).items():
        out[n] = np.zeros(shape, np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(PHI3))
    save_file(out, str(folder / "model.safetensors"))


def test_phi3_reads_its_fused_projections_in_parts(tmp_path):
    """Phi-3's qkv_proj and gate_up_proj are served as Llama's q/k/v and gate/up rows; the same tokens as the same
    weights held apart (which a Phi-3 checkpoint may also do); every layer's window from `sliding_window`."""
    cfg = config_from_hf(PHI3)
    arrays = random_arrays(cfg, 3)
    write_checkpoint(tmp_path / "apart", PHI3, seed=3)
    _phi3_fused(tmp_path / "fused", arrays)
    (c1, w1), (c2, w2) = load_model(tmp_path / "apart"), load_model(tmp_path / "fused")
    assert c1.window == c2.window == 7 and type(c2).__name__ == "Phi3Config"
    for n in ("model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        assert np.array_equal(w2.get(n), arrays[n])
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]  # past the window
    assert generate(c1, w1, prompt, 6, chunk=4).generated_ids == generate(c2, w2, prompt, 6, chunk=4).generated_ids


def test_phi3_refusals_name_the_tensor_or_key(tmp_path):
    arrays = random_arrays(config_from_hf(PHI3), 0)
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    _phi3_fused(tmp_path / "a", arrays, drop=[qkv])
    with pytest.raises(UserError, match=rf"the checkpoint has no tensor `{qkv}` \(expected shape \(64, 32\); nor its "
                                        r"parts `self_attn.q_proj.weight`"):
        load_model(tmp_path / "a")
    _phi3_fused(tmp_path / "b", arrays, reshape={"model.layers.0.mlp.gate_up_proj.weight": (90, 32)})
    with pytest.raises(UserError, match=r"tensor `model.layers.0.mlp.gate_up_proj.weight` has shape \(90, 32\), "
                                        r"expected \(96, 32\)"):
        load_model(tmp_path / "b")
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4, "factor": 32.0,
                "original_max_position_embeddings": 4096}
    with pytest.raises(UserError, match=r"^config.json: rope type `longrope` is not supported"):
        config_from_hf({**PHI3, "rope_scaling": longrope})
