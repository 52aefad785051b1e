"""A GGUF file whose tensor data is not where llama.cpp would read it (issue 36): a tensor's offset not a multiple of
`general.alignment`, or two tensors' bytes overlapping, is refused in one line naming the tensor, never read as
other numbers; a file given as a FIFO or a folder is refused, not waited on; the file-level sizes (an expert count, a
state width) are checked before anything is allocated. The files are written here with the gguf package alone (no
torch): a tiny llama of random weights, its tensor offsets then edited in place."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from lanefuse.engine.errors import UserError  # noqa: E402
from lanefuse.engine.front.load import load_model  # noqa: E402

HIDDEN, LAYERS, HEADS, KV, INTER, VOCAB = 32, 2, 4, 2, 48, 64


def write_llama(path: Path, alignment: int | None = None, keys=None, arch: str = "llama", experts: int = 0) -> Path:
    """A tiny llama GGUF file (f32, seeded), `keys` {name: value} set as uint32/uint64/float32/string metadata after
    the usual ones (overriding them); with `experts`, each layer's feed-forward a mixture of that many (Mixtral's
    tensors: the router ffn_gate_inp and the stacked ffn_*_exps; the metadata's expert keys come from `keys`)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    base = {f"{arch}.context_length": 128, f"{arch}.embedding_length": HIDDEN, f"{arch}.block_count": LAYERS,
            f"{arch}.feed_forward_length": INTER, f"{arch}.attention.head_count": HEADS,
            f"{arch}.attention.head_count_kv": KV, f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
            f"{arch}.rope.freq_base": 10000.0, f"{arch}.vocab_size": VOCAB}
    for k, v in {**base, **(keys or {})}.items():
        if isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        else:
            w.add_uint64(k, v) if v >= 2 ** 32 else w.add_uint32(k, v)
    hd = HIDDEN // HEADS

    def put(name, *shape):
        a = rng.standard_normal(shape).astype(np.float32) * (0.2 if len(shape) > 1 else 0.05)
        w.add_tensor(name, a + (1.0 if len(shape) == 1 else 0.0))

    put("token_embd.weight", VOCAB, HIDDEN)
    for i in range(LAYERS):
        put(f"blk.{i}.attn_norm.weight", HIDDEN)
        put(f"blk.{i}.attn_q.weight", HEADS * hd, HIDDEN)
        put(f"blk.{i}.attn_k.weight", KV * hd, HIDDEN)
        put(f"blk.{i}.attn_v.weight", KV * hd, HIDDEN)
        put(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * hd)
        put(f"blk.{i}.ffn_norm.weight", HIDDEN)
        if experts:
            put(f"blk.{i}.ffn_gate_inp.weight", experts, HIDDEN)
            put(f"blk.{i}.ffn_gate_exps.weight", experts, INTER, HIDDEN)
            put(f"blk.{i}.ffn_up_exps.weight", experts, INTER, HIDDEN)
            put(f"blk.{i}.ffn_down_exps.weight", experts, HIDDEN, INTER)
            continue
        put(f"blk.{i}.ffn_gate.weight", INTER, HIDDEN)
        put(f"blk.{i}.ffn_up.weight", INTER, HIDDEN)
        put(f"blk.{i}.ffn_down.weight", HIDDEN, INTER)
    put("output_norm.weight", HIDDEN)
    put("output.weight", VOCAB, HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _set_offset(path: Path, name: str, offset_of) -> None:
    """Tensor `name`'s data offset (from the data section's start) set to `offset_of(offsets)`, `offsets` every
    tensor's, in place in the file's tensor infos."""
    r = gguf.GGUFReader(path, "r+")
    offsets = {t.name: int(t.data_offset) - int(r.data_offset) for t in r.tensors}
    t = next(t for t in r.tensors if t.name == name)
    t.field.parts[-1][0] = offset_of(offsets)
    r.data.flush()
    del r


def test_the_file_as_written_loads(tmp_path):
    cfg, w = load_model(write_llama(tmp_path / "m.gguf"))
    assert cfg.layers == LAYERS and cfg.hidden == HIDDEN
    assert w.get("model.layers.1.mlp.down_proj.weight").shape == (HIDDEN, INTER)


@pytest.mark.parametrize("alignment", [None, 64])
def test_an_overlapping_tensor_is_refused_naming_both(tmp_path, alignment):
    p = write_llama(tmp_path / "m.gguf", alignment)
    _set_offset(p, "output.weight", lambda o: o["token_embd.weight"])  # the head read from the embedding's bytes
    with pytest.raises(UserError, match=r"overlap") as e:
        load_model(p)
    assert "`token_embd.weight`" in str(e.value) and "`output.weight`" in str(e.value)


def test_a_partial_overlap_is_refused(tmp_path):
    p = write_llama(tmp_path / "m.gguf")
    _set_offset(p, "blk.0.attn_q.weight", lambda o: o["blk.0.attn_q.weight"] + 32)  # into attn_k's first bytes
    with pytest.raises(UserError, match=r"`blk.0.attn_q.weight` .* and `blk.0.attn_k.weight` .* overlap"):
        load_model(p)


@pytest.mark.parametrize("alignment,shift", [(None, 4), (None, 16), (64, 32)])
def test_a_misaligned_tensor_is_refused_naming_it(tmp_path, alignment, shift):
    """The last tensor moved by `shift` bytes into padding appended to the file: inside it, overlapping nothing,
    only off the alignment."""
    p = write_llama(tmp_path / "m.gguf", alignment)
    with open(p, "ab") as f:
        f.write(bytes(256))
    last = max(gguf.GGUFReader(p).tensors, key=lambda t: int(t.data_offset)).name
    _set_offset(p, last, lambda o: o[last] + shift)
    with pytest.raises(UserError, match=rf"tensor `{last}` starts at data offset \d+, not a multiple of the file's "
                                        rf"alignment {alignment or 32}"):
        load_model(p)


def _cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "lanefuse.lane.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def test_the_command_refuses_an_overlap_in_one_line(tmp_path):
    p = write_llama(tmp_path / "m.gguf")
    _set_offset(p, "output.weight", lambda o: o["token_embd.weight"])
    r = _cli("run", p, "--tokens", "2", "--prompt-ids", "1")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "overlap" in r.stderr and "`output.weight`" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("where", ["m.gguf", "folder/config.json", "step.yaml"])
def test_a_fifo_given_as_a_model_file_is_refused_not_waited_on(tmp_path, where):
    p = tmp_path / where
    p.parent.mkdir(exist_ok=True)
    os.mkfifo(p)
    model = p.parent if where.startswith("folder/") else p
    r = _cli("plan", model, timeout=30)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("lanefuse: error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "FIFO" in r.stderr or "expected a checkpoint folder" in r.stderr, r.stderr
