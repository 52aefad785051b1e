"""GGUF files: tiny Llama / Qwen2 / Qwen3 models written with the gguf package as llama.cpp's converter writes them,
loaded by the front and run (the reference interpreter and the fused plan on the numpy backend), against transformers
on the same weights decoded by gguf.quants.dequantize: same greedy tokens, logits within 1e-4 of their scale. Then
the store (memory-mapped, llama's q/k rows put back), the config's refusals, the command, and the tokenizer."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

import gguf  # noqa: E402

import gguf_files as gf  # noqa: E402
from hf_ref import fused_step, hf_greedy, scaled_error  # noqa: E402
from lanefuse.engine.errors import UserError  # noqa: E402
from lanefuse.engine.front.load import load_model  # noqa: E402
from lanefuse.lane.run.generate import generate  # noqa: E402

pytestmark = pytest.mark.hf

PROMPT = [3, 17, 5, 42, 8, 11]
N = 16
TOL = 1e-4
VOCAB = 400

SHAPES = {  # awkward sizes where the formats allow: rows of 32-value blocks; K-quants below need 256
    "llama": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, vocab_size=VOCAB, rope_theta=500.0, rms_norm_eps=1e-5),
    "qwen2": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=160, vocab_size=VOCAB + 3, rope_theta=1e6),
    "qwen3": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                  intermediate_size=96, vocab_size=VOCAB - 7),
}
K_SHAPE = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=512, vocab_size=VOCAB)
FORMATS = ["f32", "f16", "q8_0", "q4_0"]
K_FORMATS = ["q4_k", "q6_k"]


def _needs_blocks(fmt: str) -> None:
    """The block formats run once the kernels read them (engine/formats/blocks.py, the `blocks` helper's part)."""
    if fmt in ("q8_0", "q4_0", "q4_k", "q6_k"):
        from lanefuse.engine import ir

        if fmt not in ir.FORMATS:
            pytest.skip(f"the kernels do not read {fmt} yet (engine/formats/blocks.py)")


def _parity(model, path, fmt, out_fmt=None, fused=True):
    ref = gf.reference(model, fmt, out_fmt)
    want, want_logits = hf_greedy(ref, PROMPT, N)
    cfg, weights = load_model(path)
    got = generate(cfg, weights, PROMPT, N, chunk=4)
    rel = scaled_error(got.logits, want_logits)
    print(f"\nGGUF parity {path.name}: reference interpreter {rel:.2e}", end="")
    assert got.generated_ids == want
    assert rel < TOL
    assert len(set(want)) > 4  # a varied run: a wrong weight shows
    if fused:
        got = generate(cfg, weights, PROMPT, N, step_fn=fused_step(weights), chunk=4)
        rel = scaled_error(got.logits, want_logits)
        print(f", fused plan {rel:.2e}", end="")
        assert got.generated_ids == want
        assert rel < TOL
    return cfg, weights


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", list(SHAPES))
def test_gguf_parity_with_transformers(arch, fmt, tmp_path):
    _needs_blocks(fmt)
    model = gf.tiny_model(arch, **SHAPES[arch])
    path = gf.write_gguf(model, tmp_path / f"{arch}-{fmt}.gguf", fmt)
    cfg, _ = _parity(model, path, fmt)
    assert cfg.arch == type(model).__name__
    assert cfg.fmt("model.layers.1.mlp.down_proj.weight") == fmt and cfg.fmt("model.norm.weight") == "f32"


@pytest.mark.parametrize("fmt", K_FORMATS)
@pytest.mark.parametrize("arch", list(SHAPES))
def test_gguf_parity_k_quants(arch, fmt, tmp_path):
    _needs_blocks(fmt)
    pytest.importorskip("lanefuse.engine.formats.blocks")
    kw = dict(K_SHAPE, **({"head_dim": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
                          if arch == "qwen3" else {}))
    model = gf.tiny_model(arch, **kw)
    # as llama.cpp's Q4_K_M keeps it: output.weight in q6_k
    path = gf.write_gguf(model, tmp_path / f"{arch}-{fmt}.gguf", fmt, out_fmt="q6_k")
    _parity(model, path, fmt, out_fmt="q6_k")


PHI3_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, vocab_size=VOCAB, sliding_window=5, partial_rotary_factor=0.5, pad_token_id=0)


@pytest.mark.parametrize("fmt", ["f32", "q8_0", "q4_0"])
def test_gguf_phi3_fused_projections_and_window(fmt, tmp_path):
    """A phi3 file (attn_qkv and ffn_up fused, as llama.cpp's converter writes Phi-3) against transformers on its
    weights: q, k, v and gate, up read in parts of the fused rows (a block format's rows whole blocks), every layer's
    window of 5 from `phi3.attention.sliding_window` (6 + 16 positions), half of each head rotated."""
    _needs_blocks(fmt)
    model = gf.tiny_model("phi3", **PHI3_SHAPE)
    path = gf.write_gguf(model, tmp_path / f"phi3-{fmt}.gguf", fmt)
    assert {"blk.0.attn_qkv.weight", "blk.1.ffn_up.weight"} <= {t.name for t in gguf.GGUFReader(path).tensors}
    cfg, weights = _parity(model, path, fmt)
    assert cfg.arch == "Phi3ForCausalLM" and cfg.window == 5 and cfg.rot == 8
    assert cfg.fmt("model.layers.0.self_attn.k_proj.weight") == fmt


def test_gguf_phi3_longrope_is_refused(tmp_path):
    from lanefuse.engine.front.gguf import config_from_gguf, metadata, open_reader

    model = gf.tiny_model("phi3", **PHI3_SHAPE)
    path = gf.write_gguf(model, tmp_path / "phi3.gguf", "f32")
    meta = metadata(open_reader(path))
    tensors = {t.name: (tuple(int(d) for d in t.shape[::-1]), "f32") for t in gguf.GGUFReader(path).tensors}
    with pytest.raises(UserError, match=r"tensor `rope_factors_long.weight`: LongRoPE scaling \(Phi-3's 128k "
                                        r"variants\) is not supported"):
        config_from_gguf(meta, {**tensors, "rope_factors_long.weight": ((4,), "f32")}, "phi3.gguf")
    with pytest.raises(UserError, match=r"`phi3.rope.scaling.attn_factor`: LongRoPE"):
        config_from_gguf({**meta, "phi3.rope.scaling.attn_factor": 1.19}, tensors, "phi3.gguf")


def test_gguf_tied_embedding_and_bf16(tmp_path):
    model = gf.tiny_model("qwen2", seed=5, **dict(SHAPES["qwen2"], tie_word_embeddings=True))
    path = gf.write_gguf(model, tmp_path / "tied.gguf", "bf16")
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(path).tensors}
    cfg, weights = load_model(path)
    assert cfg.tie_embeddings and cfg.fmt("model.embed_tokens.weight") == "bf16"
    arr, fmt = weights.raw("model.embed_tokens.weight")
    assert fmt == "bf16" and arr.dtype == np.uint16 and arr.shape == (SHAPES["qwen2"]["vocab_size"], 64)
    _parity(model, path, "bf16", fused=False)


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    """llama3 scaling as the converter stores it (a rope_freqs.weight tensor of factors) against transformers."""
    import math

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    kw = dict(SHAPES["llama"], rope_scaling=scaling, rope_theta=10000.0)
    model = gf.tiny_model("llama", **kw)
    dim = 16
    freqs = 1.0 / (10000.0 ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    lo, hi = 16 / 1.0, 16 / 4.0
    factors = []
    for f in freqs:  # convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors
        wl = 2 * math.pi / f
        if wl < hi:
            factors.append(1.0)
        elif wl > lo:
            factors.append(8.0)
        else:
            s = (16 / wl - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - s) / 8.0 + s))
    path = gf.write_gguf(model, tmp_path / "llama3.gguf", "f32", rope_freqs=np.array(factors))
    cfg, _ = _parity(model, path, "f32", fused=False)
    assert dict(cfg.rope_scaling)["rope_type"] == "freq_factors"


# ---- the store ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_q8(tmp_path_factory):
    model = gf.tiny_model("llama", **SHAPES["llama"])
    return model, gf.write_gguf(model, tmp_path_factory.mktemp("g") / "llama-q8_0.gguf", "q8_0")


def test_llama_q_and_k_rows_come_back_in_transformers_order(llama_q8):
    """The file holds q/k rows permuted for llama.cpp's adjacent pairs; the store serves transformers' rows, the
    quantized bytes moved a row at a time (the blocks untouched)."""
    model, path = llama_q8
    _, weights = load_model(path)
    sd = model.state_dict()
    for part in ("q", "k", "v"):
        name = f"model.layers.1.self_attn.{part}_proj.weight"
        arr, fmt = weights.raw(name)
        assert fmt == "q8_0" and arr.dtype == np.uint8 and arr.shape == (sd[name].shape[0], 64 // 32 * 34)
        assert np.array_equal(arr, gf.encode(sd[name].numpy(), "q8_0"))
        assert weights.shape(name) == tuple(sd[name].shape)
        np.testing.assert_array_equal(weights.get(name), gf.decoded(sd[name].numpy(), "q8_0"))


def test_tensors_are_read_in_place(llama_q8):
    """Memory-mapped: a tensor the store serves is a view of the file's map, not a copy."""
    _, path = llama_q8
    _, weights = load_model(path)
    store = weights.store
    arr, _ = weights.raw("model.layers.0.mlp.down_proj.weight")
    assert np.shares_memory(arr, store.reader.data)
    assert store.where("model.layers.0.mlp.down_proj.weight") == "llama-q8_0.gguf:blk.0.ffn_down.weight"


def _rewrite(src, dst, drop_keys=(), set_keys=None, drop_tensors=(), add_tensors=None, arch=None):
    """A copy of GGUF file `src` with metadata keys dropped or set and tensors dropped or added."""
    r = gguf.GGUFReader(src)
    arch = arch or r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    set_keys = dict(set_keys or {})
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key in drop_keys or key == "general.architecture" or key in set_keys:
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(key, f.contents())
        else:
            w.add_key_value(key, f.contents(), vt)
    for key, (value, vt) in set_keys.items():
        w.add_key_value(key, value, vt)
    for t in r.tensors:
        if t.name in drop_tensors:
            continue
        raw = None if t.tensor_type.name in ("F32", "F16") else t.tensor_type
        w.add_tensor(t.name, np.array(t.data), raw_dtype=raw)
    for name, (data, raw) in (add_tensors or {}).items():
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


U32, F32, STR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING


@pytest.mark.parametrize("edit, said", [
    (dict(drop_keys=("llama.block_count",)), "missing `llama.block_count` (a positive integer)"),
    (dict(drop_keys=("llama.attention.layer_norm_rms_epsilon",)),
     "missing `llama.attention.layer_norm_rms_epsilon`"),
    (dict(set_keys={"llama.attention.head_count_kv": (3, U32)}),
     "`llama.attention.head_count_kv` 3 does not divide `llama.attention.head_count` 4"),
    (dict(set_keys={"llama.attention.layer_norm_rms_epsilon": (-1.0, F32)}),
     "`llama.attention.layer_norm_rms_epsilon` is -1.0; expected a positive number"),
    (dict(set_keys={"llama.rope.scaling.type": ("yarn", STR)}), "`llama.rope.scaling.type` is 'yarn'"),
    (dict(set_keys={"llama.block_count": (3, U32)}), "no tensor `blk.2.attn_norm.weight`"),
    (dict(set_keys={"llama.feed_forward_length": (97, U32)}),
     "tensor `blk.0.ffn_gate.weight` has shape (96, 64), expected (97, 64) (from the file's metadata)"),
    (dict(set_keys={"llama.rope.dimension_count": (7, U32)}), "`llama.rope.dimension_count` is 7"),
    (dict(set_keys={"llama.expert_count": (8, U32)}), "missing `llama.expert_used_count`"),  # read as Mixtral
    (dict(set_keys={"qwen2.expert_count": (8, U32)}, arch="qwen2"), "`qwen2.expert_count` is 8: an expert mixture"),
    (dict(arch="falcon"), "`general.architecture` is `falcon`, which lanefuse does not read (supported: deepseek: "
                          "deepseek2; gemma: gemma2, gemma3; gptoss: gpt-oss; llama: llama, phi3; mixtures: qwen3moe, "
                          "qwen2moe; qwen: qwen2, qwen3; qwen3next: qwen3next)"),
    (dict(drop_tensors=("blk.1.ffn_down.weight",)), "no tensor `blk.1.ffn_down.weight` (expected shape (64, 96))"),
    (dict(add_tensors={"blk.0.attn_q.bias": (np.zeros(64, np.float32), None)}),
     "tensor `blk.0.attn_q.bias` is not one lanefuse reads in a 2-layer LlamaForCausalLM"),
    (None, "tensor `blk.0.ffn_up.weight` is iq2_xxs, a format lanefuse does not read"),
])
def test_a_broken_file_is_one_line_naming_it(llama_q8, tmp_path, edit, said):
    _, path = llama_q8
    if edit is None:  # a format lanefuse does not read (iq2_xxs: rows of 256 values, 66 bytes each)
        model = gf.tiny_model("llama", **dict(SHAPES["llama"], hidden_size=256))
        path = gf.write_gguf(model, tmp_path / "k.gguf", "f32")
        edit = dict(drop_tensors=("blk.0.ffn_up.weight",),
                    add_tensors={"blk.0.ffn_up.weight": (np.zeros((96, 66), np.uint8),
                                                         gguf.GGMLQuantizationType.IQ2_XXS)})
    bad = _rewrite(path, tmp_path / "bad.gguf", **edit)
    with pytest.raises(UserError) as e:
        load_model(bad)
    msg = str(e.value)
    assert str(bad) in msg and said in msg and "\n" not in msg, msg


def test_truncated_and_foreign_files(llama_q8, tmp_path):
    _, path = llama_q8
    data = path.read_bytes()
    for name, blob in (("cut.gguf", data[: len(data) // 2]), ("head.gguf", data[:40]), ("text.gguf", b"hello\n"),
                       ("empty.gguf", b"")):
        p = tmp_path / name
        p.write_bytes(blob)
        with pytest.raises(UserError) as e:
            load_model(p)
        assert str(e.value).startswith(f"{p}: not a GGUF file the gguf package can read"), str(e.value)


# ---- the command ----------------------------------------------------------------------------------------------------

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def qwen2_file(tmp_path_factory):
    tok, tokens, merges, types = gf.bpe_tokenizer(VOCAB, "qwen2")
    model = gf.tiny_model("qwen2", **dict(SHAPES["qwen2"], vocab_size=VOCAB))
    d = tmp_path_factory.mktemp("q")
    return tok, model, gf.write_gguf(model, d / "qwen2-f16.gguf", "f16", tokenizer=(tokens, merges, types), eos=0)


def test_run_plan_check_a_gguf_file_and_its_folder(qwen2_file, tmp_path):
    import json

    tok, model, path = qwen2_file
    r = _cli("run", str(path), "--prompt", "The quick brown fox", "--tokens", "6", "--json", str(tmp_path / "o.json"))
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "o.json").read_text())
    assert out["prompt_ids"] == tok.encode("The quick brown fox").ids
    want, _ = hf_greedy(gf.reference(model, "f16"), out["prompt_ids"], 6)
    assert out["generated_ids"] == want
    assert "text: " in r.stdout
    for cmd in (("plan", str(path.parent)), ("check", str(path))):
        c = _cli(*cmd)
        assert c.returncode == 0, c.stderr
    e = subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", "explore", str(path)], input="quit\n",
                       capture_output=True, text=True, timeout=300)
    assert e.returncode == 0 and f"lanefuse explore: {path.name}, 2 layers" in e.stdout, e.stderr
    (path.parent / "other.gguf").write_bytes(path.read_bytes())
    try:
        c = _cli("plan", str(path.parent))
        assert c.returncode == 2 and c.stderr.strip() == (
            f"lanefuse: error: {path.parent}: holds 2 GGUF files (other.gguf, qwen2-f16.gguf); give the one to use "
            f"as MODEL")
    finally:
        (path.parent / "other.gguf").unlink()
    c = _cli("plan", str(path), "--weights-format", "bf16")
    assert c.returncode == 2 and len(c.stderr.strip().splitlines()) == 1 and "GGUF file" in c.stderr


# ---- the tokenizer --------------------------------------------------------------------------------------------------

EXTRA = ["", " ", "hello world", "  two  spaces  ", "tabs\tand\nnew\n\nlines", "3333333 digits 12345",
         "don't I'LL WE'VE", "<|endoftext|>after a control token", "ünïcödé 🦙 中文 mixed"]


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-2", "default"])
def test_tokenizer_from_the_metadata_equals_the_trained_one(pre, tmp_path):
    from lanefuse.engine.front.gguf import open_reader
    from lanefuse.engine.front.gguf_vocab import tokenizer_from_gguf

    tok, tokens, merges, types = gf.bpe_tokenizer(VOCAB, pre)
    model = gf.tiny_model("llama", **SHAPES["llama"])
    path = gf.write_gguf(model, tmp_path / "t.gguf", "f32", tokenizer=(tokens, merges, types), pre=pre, bos=1,
                         add_bos=False)
    got = tokenizer_from_gguf(open_reader(path), str(path))
    for s in gf.SENTENCES + EXTRA:
        assert got.encode(s).ids == tok.encode(s).ids, s
        assert got.decode(got.encode(s).ids) == tok.decode(tok.encode(s).ids), s


def test_tokenizer_adds_bos_where_the_file_says(tmp_path):
    from lanefuse.engine.front.gguf import open_reader
    from lanefuse.engine.front.gguf_vocab import tokenizer_from_gguf

    tok, tokens, merges, types = gf.bpe_tokenizer(VOCAB, "llama-bpe")
    model = gf.tiny_model("llama", **SHAPES["llama"])
    path = gf.write_gguf(model, tmp_path / "b.gguf", "f32", tokenizer=(tokens, merges, types), pre="llama-bpe",
                         bos=1)  # no add_bos_token key: llama-bpe's default is to add it (llama.cpp)
    got = tokenizer_from_gguf(open_reader(path), str(path))
    assert got.encode("hello").ids == [1] + tok.encode("hello").ids
    bad = _rewrite(path, tmp_path / "bad.gguf", set_keys={"tokenizer.ggml.pre": ("gemma4", STR)})
    with pytest.raises(UserError, match="`tokenizer.ggml.pre` is `gemma4`"):
        tokenizer_from_gguf(open_reader(bad), str(bad))


def test_a_block_scale_that_is_not_finite_is_refused_when_read(llama_q8, tmp_path):
    _, path = llama_q8
    r = gguf.GGUFReader(path)
    t = next(t for t in r.tensors if t.name == "blk.1.ffn_up.weight")
    data = np.array(t.data)
    data[5, 34 + 1] = 0x7C  # row 5's second block: its f16 scale's exponent bits all set (inf)
    bad = _rewrite(path, tmp_path / "nan.gguf", drop_tensors=(t.name,), add_tensors={t.name: (data, t.tensor_type)})
    _, weights = load_model(bad)  # the file's pages are read as they are used: the scale is seen when read
    with pytest.raises(UserError) as e:
        weights.raw("model.layers.1.mlp.up_proj.weight")
    assert str(e.value).startswith(f"{bad}: tensor `blk.1.ffn_up.weight` holds 1 q8_0 block(s) whose scale is NaN "
                                   f"or inf"), str(e.value)
    c = _cli("run", str(bad), "--prompt-ids", "1,2", "--tokens", "2")
    err = [ln for ln in c.stderr.splitlines() if ln.startswith("lanefuse: error:")]
    assert c.returncode == 2 and len(err) == 1 and "blk.1.ffn_up.weight" in err[0] and "Traceback" not in c.stderr


# ---- properties -----------------------------------------------------------------------------------------------------

from hypothesis import HealthCheck, example, given, settings, strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(heads=st.integers(1, 9), half=st.integers(1, 40), cols=st.integers(1, 4))
def test_the_row_order_undoes_the_converters_permutation(heads, half, cols):
    from lanefuse.engine.front.gguf import row_permutation

    w = np.arange(heads * 2 * half * cols).reshape(heads * 2 * half, cols)
    assert np.array_equal(gf.permute(w, heads)[row_permutation(len(w), heads)], w)
    assert np.array_equal(gf.unpermute(gf.permute(w, heads), heads), w)


KEYS = ["general.architecture", "llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
        "llama.attention.head_count", "llama.attention.head_count_kv", "llama.attention.key_length",
        "llama.attention.value_length", "llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base",
        "llama.rope.dimension_count", "llama.rope.scaling.type", "llama.rope.scaling.factor", "llama.context_length",
        "llama.vocab_size", "llama.expert_count", "tokenizer.ggml.tokens"]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.integers(-2 ** 62, 2 ** 62),
                   st.sampled_from([0, 1, 2, 16, 32, 64, 96, 128, 400, 4096]),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                   st.sampled_from(["llama", "qwen2", "qwen3", "linear", "yarn", "none"]),
                   st.lists(st.integers(0, 9), max_size=3))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.sampled_from(KEYS), VALUES), min_size=1, max_size=3))
@example(edits=[("llama.vocab_size", None), ("tokenizer.ggml.tokens", False)])  # a token list that is no list
@example(edits=[("llama.expert_count", 2)])  # read as Mixtral: a key it lacks named
def test_any_metadata_edit_loads_or_is_one_line(llama_q8, edits):
    """Random values (wrong types, out of range, absent) for the keys the config reads: the file loads, or the front
    says why in one line naming it — never another exception."""
    from unittest import mock

    import lanefuse.engine.front.gguf as G

    _, path = llama_q8
    real = G.metadata

    def edited(reader):
        meta = real(reader)
        for key, value in edits:
            if value is None:
                meta.pop(key, None)
            else:
                meta[key] = value
        return meta

    with mock.patch.object(G, "metadata", edited):
        try:
            cfg, _ = load_model(path)
        except UserError as e:
            assert str(path) in str(e) and "\n" not in str(e), str(e)
            return
    from lanefuse.engine.front.model import build_step

    build_step(cfg, 1)  # what loaded builds its step


def test_prompt_text_on_a_file_without_a_tokenizer(llama_q8):
    _, path = llama_q8
    c = _cli("run", str(path), "--prompt", "hello", "--tokens", "1")
    err = [ln for ln in c.stderr.splitlines() if ln.startswith("lanefuse: error:")]
    assert c.returncode == 2 and err == [f"lanefuse: error: {path}: the file holds no tokenizer "
                                         f"(`tokenizer.ggml.model`); give --prompt-ids"], c.stderr
