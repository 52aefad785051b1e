"""Against llama.cpp itself (llama-cpp-python): the tokenizer built from a GGUF file's metadata gives llama.cpp's token
ids (byte-level BPE under each pre-tokenizer lanefuse builds, and SentencePiece), and llama.cpp decoding the GGUF files
the tests write (so their conventions — names, metadata, llama's permuted q/k rows — are llama.cpp's) agrees with
transformers and with lanefuse's fused plan on them."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
llama_cpp = pytest.importorskip("llama_cpp")

import gguf_files as gf  # noqa: E402
from hf_ref import fused_step, hf_greedy, scaled_error  # noqa: E402
from lanefuse.engine.front.load import load_model  # noqa: E402
from lanefuse.engine.front.gguf import open_reader  # noqa: E402
from lanefuse.engine.front.gguf_vocab import tokenizer_from_gguf  # noqa: E402
from lanefuse.lane.run.generate import generate  # noqa: E402
from test_gguf import EXTRA, PROMPT, SHAPES, VOCAB  # noqa: E402

pytestmark = [pytest.mark.llamacpp, pytest.mark.hf]

N = 12
STRINGS = gf.SENTENCES + EXTRA + ["<s>a control token first", "zzqx unseen words", "a\u00a0no-break space"]


def _llama(path, **kw):
    return llama_cpp.Llama(str(path), verbose=False, **kw)


def _small_llama():
    return gf.tiny_model("llama", **dict(SHAPES["llama"], num_hidden_layers=1))


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-2", "default"])
def test_bpe_tokenizer_equals_llama_cpp(pre, tmp_path):
    _, tokens, merges, types = gf.bpe_tokenizer(VOCAB, pre)
    path = gf.write_gguf(_small_llama(), tmp_path / "t.gguf", "f32", tokenizer=(tokens, merges, types), pre=pre,
                         bos=1)
    ref = _llama(path, vocab_only=True)
    mine = tokenizer_from_gguf(open_reader(path), str(path))
    for s in STRINGS:
        assert mine.encode(s).ids == ref.tokenize(s.encode(), add_bos=True, special=True), s


def test_sentencepiece_tokenizer_equals_llama_cpp(tmp_path):
    vocab = gf.spm_vocab()
    model = gf.tiny_model("llama", **dict(SHAPES["llama"], num_hidden_layers=1, vocab_size=len(vocab[0])))
    path = gf.write_spm(model, tmp_path / "spm.gguf", vocab)
    ref = _llama(path, vocab_only=True)
    mine = tokenizer_from_gguf(open_reader(path), str(path))
    for s in STRINGS:
        ids = mine.encode(s).ids
        assert ids == ref.tokenize(s.encode(), add_bos=True, special=True), s
        assert mine.decode(ids) == s.replace("<s>", ""), s  # the prefix space it adds is taken off again


# f16 files: llama.cpp's CPU f16 products round the activations to f16 (measured here: 5e-4 of the logits' scale)
TOL = {"f32": 1e-4, "f16": 2e-3}


@pytest.mark.parametrize("fmt", ["f32", "f16"])
@pytest.mark.parametrize("arch", list(SHAPES))
def test_llama_cpp_agrees_with_transformers_and_lanefuse(arch, fmt, tmp_path):
    model = gf.tiny_model(arch, **SHAPES[arch])
    _, *vocab = gf.bpe_tokenizer(model.config.vocab_size, "qwen2")  # llama.cpp loads no model without one
    path = gf.write_gguf(model, tmp_path / f"{arch}-{fmt}.gguf", fmt, tokenizer=vocab)
    gf.check_llama_cpp(path, gf.reference(model, fmt), PROMPT, N, f"{arch} {fmt}", TOL[fmt])


QUANT = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
         "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}


@pytest.mark.parametrize("ftype", list(QUANT))
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_files_quantized_by_llama_cpp(arch, ftype, tmp_path):
    """llama.cpp's own quantizer (llama_model_quantize; Q4_K_M mixes q4_k and q6_k tensors, Q4_0 keeps output.weight
    in q6_k): lanefuse's fused plan on its file equals transformers on the file's weights decoded by gguf."""
    import gguf

    from test_gguf import K_SHAPE

    kw = dict(K_SHAPE, **({"head_dim": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
                          if arch == "qwen3" else {}))
    model = gf.tiny_model(arch, **kw)
    _, *vocab = gf.bpe_tokenizer(model.config.vocab_size, "qwen2")
    src = gf.write_gguf(model, tmp_path / "f32.gguf", "f32", tokenizer=vocab)
    dst = tmp_path / f"{ftype}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANT[ftype])
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), llama_cpp.byref(params)) == 0
    held = {t.tensor_type.name.lower() for t in gguf.GGUFReader(dst).tensors}
    want, want_logits = hf_greedy(gf.reference_from_file(model, dst), PROMPT, N)
    cfg, weights = load_model(dst)
    got = generate(cfg, weights, PROMPT, N, step_fn=fused_step(weights), chunk=4)
    rel = scaled_error(got.logits, want_logits)
    print(f"\nllama.cpp-quantized {arch} {ftype} ({', '.join(sorted(held))}): fused plan vs transformers {rel:.2e}")
    assert got.generated_ids == want and rel < 1e-4
    assert {f for _, f in cfg.formats} == held  # each tensor read in the format the file holds it in


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k", "q6_k"])
def test_llama_cpp_reads_the_block_files_written_here(fmt):
    """llama.cpp on the tests' block-format llama files (q/k rows permuted, blocks from gguf's and formats/blocks.py's
    quantizers): its logits of the prompt within 5% of transformers' on the decoded weights — it quantizes the
    activations as well (q8_0 blocks, q8_K for K-quants: measured 0.7-2.1%), so only a loose bound; a misread tensor
    or row order is far off."""
    import tempfile
    from pathlib import Path

    from test_gguf import K_SHAPE

    model = gf.tiny_model("llama", **K_SHAPE)
    _, *vocab = gf.bpe_tokenizer(model.config.vocab_size, "qwen2")
    with tempfile.TemporaryDirectory() as d:
        path = gf.write_gguf(model, Path(d) / f"{fmt}.gguf", fmt, tokenizer=vocab)
        _, want = hf_greedy(gf.reference(model, fmt), PROMPT, 1)
        _, got = gf.llama_cpp_greedy(path, PROMPT, 1)
    rel = scaled_error(got, want)
    print(f"\nllama.cpp on {fmt}: the prompt's logits within {rel:.2e} of transformers' scale")
    assert rel < 5e-2
