"""A GGUF file (llama.cpp's format) read with the `gguf` package's memory-mapped reader: the `ModelConfig` from its
metadata (every key checked, each refusal naming the file and the key), and a weight store that serves each tensor
under the Hugging Face name the step graph uses (gguf_names.py), held raw as the file holds it — block formats
as (rows, bytes a row) uint8 — with llama's permuted q/k rows put back in transformers' order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from lanefuse.engine.errors import UserError, clip
from lanefuse.engine.front.family import Family, for_gguf
from lanefuse.engine.front.gguf_names import ROPE_FREQS, Names, hf_names, permuted_by, read_as_row
from lanefuse.engine.front.gguf_shapes import vocab_size
from lanefuse.engine.front.hfconfig import MAX_LAYERS, Reader
from lanefuse.engine.front.model import ModelConfig
from lanefuse.engine.formats.layout import BLOCK_FORMATS

# GGML tensor type name -> lanefuse format (formats.md); any other type is refused at load, naming the tensor
FORMATS = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_K": "q4_k",
           "Q6_K": "q6_k", "MXFP4": "mxfp4", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q5_K": "q5_k",
           "Q3_K": "q3_k", "Q2_K": "q2_k", "IQ4_NL": "iq4_nl", "IQ4_XS": "iq4_xs"}
# (ggml's MXFP4 holds its fp4 pairs otherwise: GGUFStore repacks it)


def shown(text: Any, width: int = 40) -> str:
    """A name from the file echoed in a message: itself where printable, else its repr; cut to `width`
    (engine/errors.py `clip`)."""
    return clip(text, width)


class _Array:
    """A metadata array left in the file (a token list: read only where the tokenizer needs it)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        return f"<an array of {self.n}>"


def _reader_class():
    """gguf.GGUFReader holding its memory map as a plain ndarray view (the same mapped pages): slicing a np.memmap
    finalizes a memmap object per slice, and the reader slices a few times for every token of the vocabulary (half
    its time on a 32000-token file, measured)."""
    from gguf import GGUFReader

    class Reader(GGUFReader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):
            self._map = value  # the np.memmap: kept, so the mapping lives as long as the reader
            self._data = value.view(np.ndarray)

    return Reader


def open_reader(path: str | Path):
    """`gguf.GGUFReader` over `path` (memory-mapped, read-only); a file it cannot read is one line naming it."""
    GGUFReader = _reader_class()

    from lanefuse.engine.userfile import regular

    p = Path(path)
    size = regular(p, "a GGUF file")  # a FIFO would block the memory map's open for ever
    try:
        reader = GGUFReader(p, "r")
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError, MemoryError) as e:
        why = clip(e, 160) if str(e) else type(e).__name__
        raise UserError(f"{p}: not a GGUF file the gguf package can read ({size} bytes: {why}); truncated, or not "
                        f"GGUF") from None
    except OSError as e:
        raise UserError(f"{p}: cannot read ({e.strerror or e})") from None
    check_layout(p, reader)
    return reader


def check_layout(path: Path, reader) -> None:
    """Every tensor's data where llama.cpp would read it: its offset (from the data section's start) a multiple of
    the file's alignment (`general.alignment`, 32 where absent), and no two tensors' bytes overlapping (llama.cpp
    refuses both; read as they are, they would be other numbers). The first wrong tensor is named."""
    align = int(reader.alignment)
    spans = []
    for t in reader.tensors:
        rel = int(t.data_offset) - int(reader.data_offset)
        if rel % align:
            raise UserError(f"{path}: tensor `{shown(t.name, 80)}` starts at data offset {rel}, not a multiple of the "
                            f"file's alignment {align} (`general.alignment`); the file is corrupt")
        if int(t.n_bytes):
            spans.append((rel, rel + int(t.n_bytes), t.name))
    spans.sort()
    for (a0, a1, a), (b0, b1, b) in zip(spans, spans[1:]):
        if b0 < a1:
            raise UserError(f"{path}: tensors `{shown(a, 80)}` (data bytes {a0}..{a1}) and `{shown(b, 80)}` "
                            f"(from {b0}) overlap; each tensor's data must have bytes of its own: the file is corrupt")


def metadata(reader) -> dict[str, Any]:
    """The file's key/value metadata as Python values; arrays longer than 64 (token lists) as `_Array`."""
    from gguf import GGUFValueType

    out: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if f.types and f.types[0] == GGUFValueType.ARRAY:
            out[key] = _Array(len(f.data)) if len(f.data) > 64 else f.contents()
        elif f.types and f.types[0] == GGUFValueType.FLOAT32:
            out[key] = float(str(np.float32(f.contents())))  # 1e-06, not 9.99999997e-07: the value the writer meant
        else:
            out[key] = f.contents()
    return out


# -- the config -----------------------------------------------------------------------------------------------------

def family_of(meta: dict[str, Any], where: str) -> tuple[str, type[Family], Names]:
    """The file's `general.architecture`, the family that reads it (engine/front/family.py) and its tensor names."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise UserError(f"{where}: missing `general.architecture` (a GGUF model file names its architecture)"
                        if arch is None else f"{where}: `general.architecture` is {arch!r}; expected a name")
    fam = for_gguf(arch, where)
    return arch, fam, fam.names(arch, meta)


def _arch_reader(meta: dict[str, Any], arch: str, where: str) -> Reader:
    """Typed reads of the `{arch}.*` keys, each named in full in a refusal."""
    n = len(arch) + 1
    return Reader({k[n:]: v for k, v in meta.items() if k.startswith(arch + ".")}, where, f"{arch}.")


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, tuple[tuple[int, ...], str]], where: str,
                     max_len: int = 512, name: str = "model", freq_factors: np.ndarray | None = None) -> ModelConfig:
    """The model's shape from the metadata; `tensors`: GGUF name -> (logical shape, format), for the tied head and the
    vocabulary where the metadata leaves them out; `freq_factors`: rope_freqs.weight's values, where the file has it."""
    arch, family, fam = family_of(meta, where)
    r = _arch_reader(meta, arch, where)
    if not family.dense_gguf:  # its own keys (DeepSeek-V3's latent attention)
        return family.read_gguf(meta, tensors, r, arch, where, max_len, name)
    return family.from_gguf(dense_config(meta, tensors, r, arch, fam, where, max_len, name, freq_factors), r, arch,
                            where, meta, tensors)


def dense_config(meta: dict[str, Any], tensors: dict[str, tuple[tuple[int, ...], str]], r: Reader, arch: str,
                 fam: Names, where: str, max_len: int, name: str, freq_factors: np.ndarray | None) -> ModelConfig:
    """Any dense decoder's (and mixture's) shape from the `{arch}.*` keys `r` reads (`fam`: the file's tensor
    names); a family's own keys are read over it (Family.from_gguf)."""
    if meta.get(f"{arch}.expert_count") and fam.moe is None:
        raise UserError(f"{where}: `{arch}.expert_count` is {meta[f'{arch}.expert_count']!r}: an expert mixture, "
                        f"which lanefuse's {arch} does not read")
    layers = r.size("block_count")
    if layers > MAX_LAYERS:
        raise UserError(f"{where}: `{arch}.block_count` is {layers}; expected at most {MAX_LAYERS}")
    moe = _experts(r, fam, arch, where, layers) if fam.moe else None
    inter = r.size("feed_forward_length", moe.inter) if moe else r.size("feed_forward_length")
    hidden, heads = r.size("embedding_length"), r.size("attention.head_count")
    kv = r.size("attention.head_count_kv", heads)
    if heads % kv:
        raise UserError(f"{where}: `{arch}.attention.head_count_kv` {kv} does not divide "
                        f"`{arch}.attention.head_count` {heads}")
    if r.has("attention.key_length"):
        head_dim = r.size("attention.key_length")
    elif hidden % heads:
        raise UserError(f"{where}: `{arch}.attention.head_count` {heads} does not divide `{arch}.embedding_length` "
                        f"{hidden}, and there is no `{arch}.attention.key_length`")
    else:
        head_dim = hidden // heads
    vd = r.size("attention.value_length", head_dim)
    if vd != head_dim:
        raise UserError(f"{where}: `{arch}.attention.value_length` {vd} differs from the key length {head_dim}; "
                        f"lanefuse's attention reads values as wide as keys")
    if not r.has("attention.layer_norm_rms_epsilon"):
        raise UserError(f"{where}: missing `{arch}.attention.layer_norm_rms_epsilon` (a positive number)")
    eps = r.number("attention.layer_norm_rms_epsilon", 1e-6)
    theta = r.number("rope.freq_base", 10000.0)
    rot = r.size("rope.dimension_count", head_dim)
    if rot > head_dim or rot % 2 or rot < 2:
        raise UserError(f"{where}: `{arch}.rope.dimension_count` is {rot}; expected an even number from 2 to the "
                        f"head width {head_dim}")
    partial = rot / head_dim
    if int(head_dim * partial) != rot:  # the config keeps a factor; it must give back the width
        raise UserError(f"{where}: a rotary width of {rot} out of {head_dim} is not expressible")
    # gpt-oss's YaRN: the family's own reading (engine/front/families/gptoss.py), below
    scaling = () if fam.moe == "gptoss" else _rope_scaling(meta, r, arch, where, rot, freq_factors)
    if not r.has("context_length"):
        raise UserError(f"{where}: missing `{arch}.context_length` (a positive integer)")
    ctx = r.size("context_length")
    vocab = vocab_size(meta, tensors, r, where)
    return ModelConfig(
        arch=fam.hf_arch, hidden=hidden, layers=layers, heads=heads, kv_heads=kv, head_dim=head_dim, inter=inter,
        vocab=vocab, eps=eps, rope_theta=theta, rope_scaling=scaling, partial_rotary=partial,
        tie_embeddings="output.weight" not in tensors,
        qkv_bias=any(k.endswith("bias") for k in fam.layer), qk_norm=any("q_norm" in k for k in fam.layer),
        max_len=min(max_len, ctx), name=name, moe=moe,
    )


def _experts(r: Reader, fam: Names, arch: str, where: str, layers: int):
    """The mixture every layer of a qwen3moe / qwen2moe file holds (families/mixtures.py's MoeConfig), as llama.cpp reads
    its keys: softmax routing, the chosen weights renormalized where the family (or `expert_weights_norm`) says."""
    from lanefuse.engine.front.families.mixtures import MoeConfig

    experts, k = r.size("expert_count"), r.size("expert_used_count")
    if k > experts:
        raise UserError(f"{where}: `{arch}.expert_used_count` {k} is more than `{arch}.expert_count` {experts}")
    if fam.moe == "gptoss":  # llama.cpp's gpt-oss: top-k of the biased logits, a softmax over the chosen (its own)
        if r.has("expert_gating_func") and r.size("expert_gating_func") != 3:  # SOFTMAX_WEIGHT
            raise UserError(f"{where}: `{arch}.expert_gating_func` is {r.c['expert_gating_func']!r}; lanefuse's "
                            f"{arch} weighs the chosen experts by a softmax over their logits (3)")
        return MoeConfig(experts, k, r.size("expert_feed_forward_length"), False, tuple(range(layers)),
                         spelling="gptoss")
    if r.has("expert_gating_func") and r.size("expert_gating_func") != 1:  # gguf.ExpertGatingFuncType.SOFTMAX
        raise UserError(f"{where}: `{arch}.expert_gating_func` is {r.c['expert_gating_func']!r}; lanefuse's {arch} "
                        f"routes by a softmax (1)")
    if r.has("expert_weights_scale") and r.number("expert_weights_scale", 1.0) != 1.0:
        raise UserError(f"{where}: `{arch}.expert_weights_scale` is {r.c['expert_weights_scale']!r}; lanefuse's "
                        f"{arch} weighs its experts unscaled (1)")
    norm = r.flag("expert_weights_norm") if r.has("expert_weights_norm") else fam.moe == "normed"
    shared = r.size("expert_shared_feed_forward_length") if "ffn_gate_shexp.weight" in fam.layer else 0
    # llama's mixture (Mixtral) gives its experts' width as the layer's feed_forward_length
    inter = r.size("expert_feed_forward_length", r.size("feed_forward_length") if fam.experts_ffn else None)
    return MoeConfig(experts, k, inter, norm, tuple(range(layers)), shared)


def _rope_scaling(meta, r: Reader, arch: str, where: str, rot: int,
                  freq_factors: np.ndarray | None) -> tuple[tuple[str, Any], ...]:
    kind = r.text("rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise UserError(f"{where}: `{arch}.rope.scaling.type` is {kind!r}; supported: none, linear (llama3 "
                        f"scaling is the rope_freqs.weight tensor)")
    factor = r.number("rope.scaling.factor", 1.0) if kind == "linear" else 1.0
    if freq_factors is not None:
        if kind == "linear" and factor != 1.0:
            raise UserError(f"{where}: linear rope scaling and a `{ROPE_FREQS}` tensor together are not supported")
        ff = np.asarray(freq_factors, dtype=np.float64).reshape(-1)
        if ff.size != rot // 2:
            raise UserError(f"{where}: tensor `{ROPE_FREQS}` holds {ff.size} values; the rotation of "
                            f"{rot} dimensions needs {rot // 2}")
        if not (np.isfinite(ff).all() and (ff > 0).all()):
            raise UserError(f"{where}: tensor `{ROPE_FREQS}` holds a value that is not a positive finite number")
        return (("rope_type", "freq_factors"), ("freq_factors", tuple(float(x) for x in ff)))
    if kind == "linear" and factor != 1.0:
        return (("rope_type", "linear"), ("factor", factor))
    return ()


# -- the store ------------------------------------------------------------------------------------------------------

def row_permutation(rows: int, heads: int) -> np.ndarray:
    """The order of a llama GGUF q/k tensor's rows that gives transformers' rows: the converter stored
    hf.reshape(heads, 2, hd/2, cols).swapaxes(1, 2), each head's two halves interleaved for adjacent pairs."""
    hd = rows // heads
    # stored row k holds hf row stored[k]
    stored = np.arange(rows).reshape(heads, 2, hd // 2).swapaxes(1, 2).reshape(-1)
    return np.argsort(stored)  # hf row r is stored row argsort[r]


class GGUFStore:
    """A GGUF file's tensors under their HF names: `info` the logical (rows, cols) and format, `raw` the file's bytes
    in place (memory-mapped; llama's q/k rows reordered into a copy, kept), `where` the file and the GGUF name."""

    def __init__(self, path: Path, reader, family: Names, layers: int, heads: int, kv_heads: int):
        self.path = path
        self.reader = reader
        known = hf_names(family, layers)
        self._file_names = {h: g for g, h in known.items()}
        # hf name -> gguf name, reader tensor, format, logical shape, heads its rows are permuted by (0: none)
        self.entries: dict[str, tuple[str, Any, str, tuple[int, ...], int]] = {}
        self.extra: dict[str, Any] = {}  # tensors read for the config (rope_freqs.weight)
        for t in reader.tensors:
            shape, fmt = tensor_info(path, t)
            if t.name == ROPE_FREQS:
                self.extra[t.name] = t
                continue
            hf = known.get(t.name)
            if hf is None:
                raise UserError(f"{path}: tensor `{shown(t.name, 80)}` is not one lanefuse reads in a {layers}-layer "
                                f"{family.hf_arch} (a bias, an expert or a layer the metadata does not count?)")
            if read_as_row(family, t.name) and len(shape) == 1:
                shape = (1, shape[0])
            by = permuted_by(family, t.name)
            n = (heads if by == "heads" else kv_heads) if by else 0
            if n and (len(shape) != 2 or shape[0] % (2 * n)):
                raise UserError(f"{path}: tensor `{shown(t.name, 80)}` of shape {shape} does not split into {n} heads of "
                                f"two halves")
            self.entries[hf] = (t.name, t, fmt, shape, n)
        self._permuted: dict[str, np.ndarray] = {}  # also ggml MXFP4 tensors repacked (`mxfp4_from_ggml`)
        self._checked: set[str] = set()

    def names(self) -> list[str]:
        return list(self.entries)

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        _, _, fmt, shape, _ = self.entries[name]
        return shape, fmt

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        gname, t, fmt, shape, heads = self.entries[name]
        if heads or fmt == "mxfp4":
            arr = self._permuted.get(name)
            if arr is None:
                arr = _data(t, fmt, shape)
                arr = arr[row_permutation(shape[0], heads)] if heads else arr
                arr = mxfp4_from_ggml(arr) if fmt == "mxfp4" else arr
                self._permuted[name] = arr
        else:
            arr = _data(t, fmt, shape)
        if name not in self._checked:  # read once: NaN or inf values, or block scales, refused
            from lanefuse.engine.front.weights import check_blocks, check_finite

            (check_blocks if fmt in BLOCK_FORMATS else check_finite)(arr, fmt, f"{self.path}: tensor `{gname}`")
            self._checked.add(name)
        return arr, fmt

    def where(self, name: str) -> str:
        return f"{self.path.name}:{self.file_name(name)}"

    def file_name(self, name: str) -> str:
        """The GGUF name of HF name `name`."""
        return self._file_names.get(name, name)


def mxfp4_from_ggml(arr: np.ndarray) -> np.ndarray:
    """ggml's MXFP4 blocks (byte 0 the e8m0 scale; byte 1 + j values j (low nibble) and j + 16 (high)) as `mxfp4`
    rows (engine/formats/mxfp4.py: byte 1 + j values 2j and 2j + 1); the scale bytes, and what they mean, unchanged."""
    b = np.asarray(arr, np.uint8).reshape(-1, 17)
    q = b[:, 1:]
    v = np.concatenate([q & 0x0F, q >> 4], axis=1)  # (blocks, 32): the values' 4-bit codes in order
    out = np.empty_like(b)
    out[:, 0] = b[:, 0]
    out[:, 1:] = v[:, 0::2] | (v[:, 1::2] << 4)
    return out.reshape(arr.shape)


def tensor_info(path: Path, t) -> tuple[tuple[int, ...], str]:
    """A reader tensor's logical shape (numpy order: (rows, cols)) and format; a type lanefuse does not read, a row
    that does not fill its blocks, or more than two dimensions is refused, naming the tensor."""
    from gguf import GGML_QUANT_SIZES

    kind = t.tensor_type.name
    fmt = FORMATS.get(kind)
    if fmt is None:
        raise UserError(f"{path}: tensor `{shown(t.name, 80)}` is {kind.lower()}, a format lanefuse does not read (it reads "
                        f"{', '.join(FORMATS.values())}); requantize the file, e.g. llama-quantize to q4_k or q8_0")
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if len(shape) == 3 and t.name.endswith(("_exps.weight", "attn_k_b.weight", "attn_v_b.weight")):
        # an expert mixture's (E, rows, cols), deepseek2's per-head expansions (H, rows, cols): the rows stacked
        shape = (shape[0] * shape[1], shape[2])
    if len(shape) > 2 or not shape:
        raise UserError(f"{path}: tensor `{shown(t.name, 80)}` has {len(shape)} dimensions {shape}; expected 1 or 2"
                        + (" (3 for an expert mixture's `_exps` tensors)" if len(shape) == 3 else ""))
    per, _ = GGML_QUANT_SIZES[t.tensor_type]
    if shape[-1] % per:
        raise UserError(f"{path}: tensor `{shown(t.name, 80)}` ({fmt}) has rows of {shape[-1]} values, not a whole number of "
                        f"its {per}-value blocks")
    return shape, fmt


def _data(t, fmt: str, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor's bytes as formats.md holds them (a view of the memory map): f32/f16 as themselves, bf16 as uint16
    bits, a block format as (rows, bytes a row) uint8."""
    d = t.data
    if fmt == "bf16":
        return d.view(np.uint16).reshape(shape)
    if fmt in BLOCK_FORMATS:
        return d.reshape(shape[:-1] + (-1,)) if len(shape) == 2 else d.reshape(-1)
    return d.reshape(shape)


def load_gguf(path: str | Path, max_len: int = 512):
    """The model in GGUF file `path`: its config (KV caches of `max_len` rows, at most its context length) and a
    store of its tensors under HF names (not yet checked against the config: the front does that)."""
    p = Path(path)
    reader = open_reader(p)
    where = str(p)
    meta = metadata(reader)
    _, _, fam = family_of(meta, where)
    tensors = {t.name: tensor_info(p, t) for t in reader.tensors}
    factors = None
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            from lanefuse.engine.front.weights import dequantize

            shape, fmt = tensors[t.name]
            factors = dequantize(_data(t, fmt, shape), fmt)
    cfg = config_from_gguf(meta, tensors, where, max_len=max_len, name=p.stem, freq_factors=factors)
    return cfg, GGUFStore(p, reader, fam, cfg.layers, cfg.heads, cfg.kv_heads)


def find_gguf(folder: Path) -> Path | None:
    """The one .gguf file in `folder` (None where there is none); several are refused, named."""
    found = sorted(f for f in folder.iterdir() if f.name.endswith(".gguf") and f.is_file())
    if len(found) > 1:
        shown = ", ".join(f.name for f in found[:4]) + (", ..." if len(found) > 4 else "")
        raise UserError(f"{folder}: holds {len(found)} GGUF files ({shown}); give the one to use as MODEL")
    return found[0] if found else None
