"""GGUF files written by llama.cpp's own converter (convert_hf_to_gguf.py from the llama.cpp source tree that
$LANEFUSE_LLAMACPP_SRC names; skipped without one) from tiny transformers checkpoints: lanefuse reads their conventions
(names, metadata, llama's permuted q/k rows) and matches transformers on them; and tests/gguf_files.py's writer, which
the other GGUF tests use, writes the same tensors byte for byte and the same metadata."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import gguf_files as gf  # noqa: E402
from hf_ref import fused_step, hf_greedy, scaled_error  # noqa: E402
from lanefuse.engine import flags  # noqa: E402
from lanefuse.engine.front.load import load_model  # noqa: E402
from lanefuse.lane.run.generate import generate  # noqa: E402
from test_gguf import PROMPT, SHAPES, VOCAB, _needs_blocks  # noqa: E402

pytestmark = pytest.mark.hf

SRC = flags.read("LANEFUSE_LLAMACPP_SRC")
if not SRC or not (Path(SRC) / "convert_hf_to_gguf.py").is_file():
    pytest.skip("set LANEFUSE_LLAMACPP_SRC to a llama.cpp source tree holding convert_hf_to_gguf.py",
                allow_module_level=True)

# The converter names a BPE pre-tokenizer by hashing a tokenization of a test text against released models'; the
# tokenizer trained here is none of them, so the pre-tokenizer it was trained with is named to it. Its SentencePiece
# readers are passed over (the vocabulary is byte-level BPE; the sentencepiece package is not needed).
WRAPPER = """
import runpy, sys
src, pre = sys.argv[1], sys.argv[2]
sys.path.insert(0, src)
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[3:]
import conversion.base as base
def _no(self, *a, **k):
    raise FileNotFoundError("not a SentencePiece vocabulary")
for cls in vars(base).values():
    if isinstance(cls, type) and hasattr(cls, "get_vocab_base_pre"):
        cls.get_vocab_base_pre = lambda self, tokenizer: pre
base.TextModel._set_vocab_sentencepiece = _no
base.TextModel._set_vocab_llama_hf = _no
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""
PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}


def _checkpoint(arch: str, folder: Path):
    from transformers import PreTrainedTokenizerFast

    model = gf.tiny_model(arch, **dict(SHAPES[arch], vocab_size=VOCAB))
    model.save_pretrained(folder)
    tok, *vocab = gf.bpe_tokenizer(VOCAB, PRE[arch])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                            eos_token="<|endoftext|>").save_pretrained(folder)
    return model, vocab


def _convert(folder: Path, out: Path, outtype: str, pre: str) -> Path:
    r = subprocess.run([sys.executable, "-c", WRAPPER, SRC, pre, str(folder), "--outfile", str(out), "--outtype",
                        outtype], capture_output=True, text=True, timeout=300, cwd=folder)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.fixture(scope="module", params=list(SHAPES))
def converted(request, tmp_path_factory):
    arch = request.param
    d = tmp_path_factory.mktemp(arch)
    model, vocab = _checkpoint(arch, d / "hf")
    files = {t: _convert(d / "hf", d / f"{arch}-{t}.gguf", t, PRE[arch]) for t in ("f32", "f16", "q8_0")}
    return arch, model, vocab, files


@pytest.mark.parametrize("fmt", ["f32", "f16", "q8_0"])
def test_converter_files_match_transformers(converted, fmt):
    _needs_blocks(fmt)
    arch, model, _, files = converted
    want, want_logits = hf_greedy(gf.reference(model, fmt), PROMPT, 12)
    cfg, weights = load_model(files[fmt])
    got = generate(cfg, weights, PROMPT, 12, step_fn=fused_step(weights), chunk=4)
    rel = scaled_error(got.logits, want_logits)
    print(f"\nconverter {arch} {fmt}: {rel:.2e}")
    assert got.generated_ids == want and rel < 1e-4


def test_the_test_writer_writes_what_the_converter_writes(converted, tmp_path):
    arch, model, vocab, files = converted
    conv = gguf.GGUFReader(files["f32"])
    mine = gguf.GGUFReader(gf.write_gguf(model, tmp_path / "mine.gguf", "f32", tokenizer=vocab, pre=PRE[arch],
                                         bos=1))
    a, b = {t.name: t for t in conv.tensors}, {t.name: t for t in mine.tensors}
    assert set(a) == set(b)
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type, name
        assert np.array_equal(np.asarray(a[name].data), np.asarray(b[name].data)), name
    skip = {"general.name", "general.type", "general.size_label", "general.file_type"}
    ka = {k for k in conv.fields if not k.startswith("GGUF.")} - skip
    kb = {k for k in mine.fields if not k.startswith("GGUF.")} - skip
    assert ka <= kb | {"tokenizer.ggml.add_bos_token", "tokenizer.ggml.padding_token_id"}, ka - kb
    for k in ka & kb:
        assert conv.fields[k].contents() == mine.fields[k].contents(), k
