"""llama.cpp's rope under --numerics q8 for the scaled ropes a GGUF file carries (issue 41): linear scaling
(`rope.scaling.type` linear, its factor: llama.cpp's freq_scale = 1.0f/factor) and llama3 scaling (the converter's
`rope_freqs.weight`, llama.cpp's freq_factors): engine/formats/ggml.llama_rope gives the model's rope cache as
ggml_rope_cache_init / rope_yarn compute it (theta/ff, then times freq_scale, in f32; libm cosf / sinf), so the
queries it rotates equal llama.cpp's roped queries to the bit, teacher-forced on llama.cpp's own unroped ones
(tests/llama_cpp_dump.py) at 40 positions; the same queries rotated as if unscaled do not."""

from __future__ import annotations

import numpy as np
import pytest

F32 = np.float32
SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=96, vocab_size=300,
             num_hidden_layers=1, tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5,
             max_position_embeddings=128)
ROWS = 40


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    import gguf_files as gf

    model = gf.tiny_model("llama", **SHAPE)
    _, *vocab = gf.bpe_tokenizer(SHAPE["vocab_size"], "qwen2")
    folder = tmp_path_factory.mktemp("rope")

    def get(kind: str):
        path = folder / f"{kind}.gguf"
        if path.exists():
            return path
        if kind == "freq_factors":  # llama3's: each pair's factor, 1 (high frequencies) .. 8 (low), smooth between
            ff = np.concatenate([np.ones(10), np.linspace(1, 8, 12), np.full(10, 8.0)]).astype(F32)
            return gf.write_gguf(model, path, "f32", tokenizer=vocab, rope_freqs=ff)
        plain = gf.write_gguf(model, folder / "plain.gguf", "f32", tokenizer=vocab)
        import gguf
        from test_gguf import _rewrite

        keys = {"llama.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING),
                "llama.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32)}
        return _rewrite(plain, path, set_keys=keys)

    return get


@pytest.mark.llamacpp
@pytest.mark.parametrize("kind", ["linear", "freq_factors"])
def test_scaled_rope_is_llama_cpps_to_the_bit(llama_file, kind):
    pytest.importorskip("llama_cpp")
    import llama_cpp_dump

    from lanefuse.engine.formats import ggml
    from lanefuse.engine.front.load import load_model

    path = llama_file(kind)
    cfg, _ = load_model(path)
    assert dict(cfg.rope_scaling).get("rope_type") == kind
    rope = ggml.llama_rope(cfg)
    assert rope is not None and rope.pairs
    prompt = [int(t) for t in np.random.default_rng(2).integers(10, SHAPE["vocab_size"] - 10, ROWS)]
    d, _ = llama_cpp_dump.dump(path, prompt, n_ctx=128)
    pre, want = d.first("Qcur-0").reshape(ROWS, 2, 64), d.last("Qcur-0").reshape(ROWS, 2, 64)

    def roped(c, s):  # the file's q rows are the converter's: each pair adjacent (llama.cpp's NORM rope)
        y0, y1 = ggml.rope(pre[..., 0::2], pre[..., 1::2], c[:ROWS, None, :], s[:ROWS, None, :])
        out = np.empty_like(pre)
        out[..., 0::2], out[..., 1::2] = y0, y1
        return out

    got = roped(rope.cos, rope.sin)
    assert np.array_equal(got, want), float(np.abs(got - want).max())
    plain = roped(*ggml.rope_tables(ROWS, 64, SHAPE["rope_theta"]))
    assert np.abs(plain - want).max() > 1e-3  # the scaling is what made the difference


def test_other_scalings_keep_lanefuses_rope():
    """A scaling llama_rope does not restate (YaRN, a config's own llama3 parameters) leaves the step's own rope:
    None."""
    from types import SimpleNamespace

    from lanefuse.engine.formats import ggml

    base = dict(arch="LlamaForCausalLM", rot=64, head_dim=64, max_len=16, rope_theta=10000.0)
    assert ggml.llama_rope(SimpleNamespace(**base, rope_scaling=())) is not None
    lin = ggml.llama_rope(SimpleNamespace(**base, rope_scaling=(("rope_type", "linear"), ("factor", 2.0))))
    assert lin is not None and np.array_equal(lin.cos[4], ggml.llama_rope(
        SimpleNamespace(**base, rope_scaling=())).cos[2])  # position 4 at half speed is position 2
    for sc in ((("rope_type", "yarn"), ("factor", 4.0)), (("rope_type", "llama3"), ("factor", 8.0))):
        assert ggml.llama_rope(SimpleNamespace(**base, rope_scaling=sc)) is None
    assert ggml.llama_rope(SimpleNamespace(**dict(base, rot=32), rope_scaling=())) is None  # partial rotary
