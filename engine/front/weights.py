"""The weight store: a model's tensors by checkpoint name, as stored (`raw`) or dequantized to f32 (`get`), from a
safetensors checkpoint folder (read lazily, memory-mapped) or an in-memory dict, plus the value tables the config
generates (`rope.cos`, `rope.sin`; a family's config may add its own: `cfg.generated()` / `cfg.generate()`)."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from lanefuse.engine.errors import UserError, did_you_mean
from lanefuse.engine.formats.layout import BLOCK_FORMATS, F16_SCALES
from lanefuse.engine.jsonfile import read_json

ST_FORMATS = {"F32": ("f32", np.float32), "F16": ("f16", np.float16), "BF16": ("bf16", np.uint16)}
GENERATED = ("rope.cos", "rope.sin")


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 stored as uint16: its bits are the high half of an f32."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """f32 to bf16 bits (uint16), rounding to nearest even (as torch does)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def dequantize(arr: np.ndarray, fmt: str) -> np.ndarray:
    """Stored values as f32: bf16 bits, a block format by gguf's own reference (`gguf.quants.dequantize`), giving the
    logical shape (rows, cols) for (rows, row bytes)."""
    if fmt == "bf16":
        return bf16_to_f32(arr)
    if fmt == "mxfp4":  # not a GGUF type: transformers' decoding (engine/formats/mxfp4.py)
        from lanefuse.engine.formats.mxfp4 import mxfp4_blocks

        a = np.ascontiguousarray(arr, dtype=np.uint8)
        return mxfp4_blocks(a.reshape(-1, 17)).reshape(*a.shape[:-1], -1)
    if fmt in BLOCK_FORMATS:
        from gguf import GGMLQuantizationType, quants

        return quants.dequantize(np.asarray(arr, dtype=np.uint8), GGMLQuantizationType[fmt.upper()]).astype(
            np.float32, copy=False)
    return np.asarray(arr, dtype=np.float32)


def block_shape(name: str, shape: tuple[int, ...], fmt: str) -> tuple[int, ...]:
    """The logical (rows, cols) of a block-format tensor stored as uint8 `shape` (rows, row bytes); a UserError naming
    the tensor when the bytes are not rows of whole blocks."""
    vb, bb = BLOCK_FORMATS[fmt]
    if len(shape) != 2 or shape[1] % bb:
        raise UserError(f"tensor `{name}`: {fmt} rows are stored as uint8 (rows, a multiple of {bb} bytes), not "
                        f"{list(shape)}")
    return (shape[0], shape[1] // bb * vb)


def check_blocks(arr: np.ndarray, fmt: str, where: str) -> None:
    """Refuse a block-format tensor whose f16 scales hold NaN or inf (every exponent bit set): its decoded values
    would be NaN or inf, as a dense tensor holding them is refused."""
    bb = BLOCK_FORMATS[fmt][1]
    b = np.asarray(arr, dtype=np.uint8).reshape(-1, bb)
    if fmt == "mxfp4":
        bad = b[:, 0] == 0xFF  # e8m0's NaN
        if bad.any():
            raise UserError(f"{where} holds {int(bad.sum())} mxfp4 block(s) whose scale is NaN (e8m0 255), the first "
                            f"block {int(np.argmax(bad))}; the weights are broken")
        return
    for o in F16_SCALES[fmt]:
        bad = (b[:, o + 1] & 0x7C) == 0x7C  # the high byte of a little-endian f16: its five exponent bits
        if bad.any():
            raise UserError(f"{where} holds {int(bad.sum())} {fmt} block(s) whose scale is NaN or inf, the first "
                            f"block {int(np.argmax(bad))}; the weights are broken")


# -- the rotary tables ----------------------------------------------------------------------------------------------

def inv_freq(cfg) -> np.ndarray:
    """The rotary inverse frequencies of (rot/2,) as transformers computes them (default, linear, llama3), in f64;
    `freq_factors` (a GGUF file's rope_freqs.weight, llama3 scaling as llama.cpp holds it) divides each one."""
    dim = cfg.rot
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    sc = dict(cfg.rope_scaling)
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "freq_factors":
        return inv / np.asarray(sc["freq_factors"], dtype=np.float64)
    if kind == "llama3":
        factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        lo_wavelen, hi_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > lo_wavelen, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < hi_wavelen) & ~(wavelen > lo_wavelen)
        return np.where(medium, smoothed, scaled)
    if kind == "yarn":  # transformers' _compute_yarn_parameters
        base, factor, old = cfg.rope_theta, float(sc["factor"]), float(sc["original_max_position_embeddings"])

        def dim_of(rotations: float) -> float:
            return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = dim_of(float(sc["beta_fast"])), dim_of(float(sc["beta_slow"]))
        if sc.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
        extra = 1.0 - ramp  # the share of each frequency kept as it is (extrapolated)
        return inv / factor * (1.0 - extra) + inv * extra
    raise UserError(f"rope scaling `{kind}` is not supported (supported: default, linear, llama3, yarn)")


def rope_tables(cfg) -> dict[str, np.ndarray]:
    """`rope.cos` / `rope.sin`: (max_len, rot/2) f32, computed in f64 at positions 0..max_len-1."""
    ang = np.arange(cfg.max_len, dtype=np.float64)[:, None] * inv_freq(cfg)[None, :]
    m = float(dict(cfg.rope_scaling).get("attention_factor", 1.0))  # YaRN's: transformers scales cos and sin by it
    return {"rope.cos": (m * np.cos(ang)).astype(np.float32), "rope.sin": (m * np.sin(ang)).astype(np.float32)}


# -- backends: where the stored tensors come from -------------------------------------------------------------------

class DictStore:
    """Tensors held in memory: name -> array (float32 f32, float16 f16, uint16 bf16 bits), or name -> (array, format)
    — a block format's array its uint8 rows of blocks (rows, row bytes), whose logical shape `info` gives."""

    def __init__(self, arrays: dict[str, Any]):
        self.arrays: dict[str, tuple[np.ndarray, str]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name, v in arrays.items():
            arr, fmt = v if isinstance(v, tuple) else (v, None)
            arr = np.asarray(arr)
            if fmt is None:
                fmt = {np.dtype(np.float16): "f16", np.dtype(np.uint16): "bf16"}.get(arr.dtype, "f32")
                if fmt == "f32":
                    arr = arr.astype(np.float32, copy=False)
            shape = tuple(arr.shape)
            if fmt in BLOCK_FORMATS:
                if arr.dtype != np.uint8:
                    raise UserError(f"tensor `{name}`: {fmt} rows are stored as uint8 blocks, not {arr.dtype}")
                shape = block_shape(name, shape, fmt)
                arr = np.ascontiguousarray(arr)
                check_blocks(arr, fmt, f"tensor `{name}`")
            self.arrays[name] = (arr, fmt)
            self.shapes[name] = shape

    def names(self) -> list[str]:
        return list(self.arrays)

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        return self.shapes[name], self.arrays[name][1]

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        return self.arrays[name]

    def where(self, name: str) -> str:
        return "memory"


class PartsStore:
    """A weight store over another (`base`, weights.py's backends) that also serves tensors made of rows of the
    stored ones, what a family's checkpoint holds fused and its step reads in parts: `parts` name -> ((stored tensor,
    its rows taken in order: indices, or a slice), ...) joined, and the shape served. Rows in the stored format (a
    block format's rows are whole blocks, so rows of it taken apart are still that format): one slice of a tensor is a
    view of it (a memory-mapped file's stays mapped), anything else a copy made when read."""

    def __init__(self, base, parts: dict[str, tuple[tuple[tuple[str, np.ndarray | slice], ...], tuple[int, ...]]],
                 where: str):
        self.base, self.where_, self.parts = base, where, parts  # where_: where() is a method

    def names(self) -> list[str]:
        return list(dict.fromkeys(list(self.base.names()) + list(self.parts)))

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        if name not in self.parts:
            return self.base.info(name)
        pieces, shape = self.parts[name]
        return shape, self.base.info(pieces[0][0])[1]

    def rows(self, name: str) -> tuple[np.ndarray, str]:
        """Part `name`'s rows joined, one row a stored row (a block format's as its bytes), and their format."""
        pieces, _ = self.parts[name]
        got, fmt = [], "f32"
        for src, idx in pieces:
            arr, fmt = self.base.raw(src)
            a = np.asarray(arr)
            got.append(a.reshape(a.shape[0], -1)[idx])
        return np.ascontiguousarray(np.concatenate(got) if len(got) > 1 else got[0]), fmt

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        if name not in self.parts:
            return self.base.raw(name)
        rows, fmt = self.rows(name)
        return (rows if fmt in BLOCK_FORMATS else rows.reshape(self.parts[name][1])), fmt

    def where(self, name: str) -> str:
        part = self.parts.get(name)
        return self.base.where(part[0][0][0] if part else name)

    def file_name(self, name: str) -> str:
        """The name the file holds `name` under (a part's first stored tensor; a GGUF store's own name)."""
        part = self.parts.get(name)
        inner = part[0][0][0] if part else name
        return self.base.file_name(inner) if hasattr(self.base, "file_name") else inner


class SafetensorsStore:
    """A checkpoint folder's safetensors files (one, or shards named by model.safetensors.index.json): headers read
    up front, tensors read on demand (f32/f16 through safetensors, bf16 memory-mapped as uint16)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        paths = [self.folder / f for f in _index_files(index)] if index.exists() else \
            sorted(self.folder.glob("*.safetensors"))
        if not paths:
            raise UserError(f"{self.folder} holds no .safetensors files")
        self.entries: dict[str, tuple[Path, str, tuple[int, ...], int]] = {}  # name -> file, dtype, shape, byte offset
        self._open: dict[Path, Any] = {}
        for p in paths:
            if not p.is_file():
                raise UserError(f"{p} is named by {index.name} but is not a file" if index.exists() else
                                f"{p} is not a file")
            for name, (dt, shape, off) in _header(p).items():
                if name in self.entries:
                    raise UserError(f"{self.folder}: tensor `{name}` is in both {self.entries[name][0].name} and "
                                    f"{p.name}")
                self.entries[name] = (p, dt, shape, off)
            self._open[p] = _library_open(p)
        self._checked: set[str] = set()

    def names(self) -> list[str]:
        return list(self.entries)

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        p, dt, shape, _ = self.entries[name]
        if dt not in ST_FORMATS:
            raise UserError(f"tensor `{name}` in {p.name} is {dt}; supported: {', '.join(ST_FORMATS)}")
        return shape, ST_FORMATS[dt][0]

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        p, dt, shape, off = self.entries[name]
        shape_, fmt = self.info(name)
        if fmt == "bf16":
            n = math.prod(shape)
            arr = (np.memmap(p, dtype=np.uint16, mode="r", offset=off, shape=(n,)) if n else
                   np.zeros(0, np.uint16)).reshape(shape)
        else:
            arr = self._open[p].get_tensor(name)
        if name not in self._checked:
            check_finite(arr, fmt, f"{p}: tensor `{name}`")
            self._checked.add(name)
        return arr, fmt

    def where(self, name: str) -> str:
        return self.entries[name][0].name

    def u8(self, name: str) -> np.ndarray | None:
        """A U8 tensor's bytes at its shape (MXFP4 blocks and scales, which families/gptoss.py reads); None for a tensor
        of another dtype."""
        p, dt, _, _ = self.entries[name]
        return self._open[p].get_tensor(name) if dt == "U8" else None


def _index_files(index: Path) -> list[str]:
    """The shard files a model.safetensors.index.json names, each a plain path inside the index's folder."""
    doc = read_json(index, "a safetensors index is JSON")
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise UserError(f"{index}: expected a `weight_map` of tensor name -> shard file name")
    files = sorted(set(wmap.values()))
    for f in files:
        # lexically inside the folder: no absolute path, no `..` (symlinked shards, as the hub cache keeps, are fine)
        norm = os.path.normpath(f)
        if os.path.isabs(f) or norm == ".." or norm.startswith(".." + os.sep) or not f:
            raise UserError(f"{index}: shard `{f[:80]}` lies outside the checkpoint folder; shards must be files "
                            f"inside it")
    return files


def _library_open(path: Path):
    """The safetensors library's own reading of the file (it checks the header again, the spans contiguous)."""
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="numpy")
    except Exception as e:  # SafetensorError: the library's refusal, in its words
        raise UserError(f"{path}: the safetensors library refuses the file ({str(e)[:200]})") from None


def check_finite(arr: np.ndarray, fmt: str, where: str) -> None:
    """Refuse a stored tensor holding NaN or inf (bf16: the exponent bits all ones; a block format: its f16 scales,
    `check_blocks`)."""
    if fmt in BLOCK_FORMATS:
        check_blocks(arr, fmt, where)
        return
    bad = ((np.asarray(arr).view(np.uint16) & 0x7F80) == 0x7F80) if fmt == "bf16" else ~np.isfinite(arr)
    if bad.any():
        count, first = int(bad.sum()), np.unravel_index(int(np.argmax(bad)), bad.shape)
        raise UserError(f"{where} holds {count} non-finite value(s) (NaN or inf), the first at index "
                        f"{tuple(int(i) for i in first)}; the weights are broken")


# bytes an element of each safetensors dtype takes (the format's own list), to check each tensor's span
ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
MAX_HEADER = 100_000_000  # the safetensors library's own cap


def _header(path: Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """A safetensors file's tensors: name -> (dtype, shape, absolute byte offset of its data), every span checked:
    a known dtype, end - start = elements x itemsize, inside the file, no two overlapping."""
    from lanefuse.engine.userfile import regular

    size = regular(path, "a safetensors file")  # a FIFO would block the open for ever
    try:
        with open(path, "rb") as f:
            lead = f.read(8)
            if len(lead) < 8:
                raise UserError(f"{path}: not a safetensors file ({size} bytes, shorter than its 8-byte header size)")
            n = struct.unpack("<Q", lead)[0]
            if n > MAX_HEADER or 8 + n > size:
                raise UserError(f"{path}: not a safetensors file (its header claims {n} bytes; the file holds "
                                f"{size}): truncated or not safetensors")
            raw = f.read(n)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        head = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a safetensors file (its header is not UTF-8 text)") from None
    except ValueError as e:
        raise UserError(f"{path}: not a safetensors file (its header is not JSON: {e})") from None
    if not isinstance(head, dict):
        raise UserError(f"{path}: not a safetensors file (its header is not a JSON object)")
    data = size - 8 - n  # bytes after the header
    out, spans = {}, []
    for name, e in head.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor `{str(name)[:80]}`"
        if not isinstance(e, dict):
            raise UserError(f"{where}: its header entry is not a mapping of dtype, shape, data_offsets")
        dt, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if dt not in ST_ITEMSIZE:
            raise UserError(f"{where}: unknown dtype {str(dt)[:20]!r} (safetensors dtypes: {', '.join(ST_ITEMSIZE)})")
        if (not isinstance(shape, list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise UserError(f"{where}: shape {str(shape)[:40]} is not a list of non-negative integers")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs)):
            raise UserError(f"{where}: data_offsets {str(offs)[:40]} is not a pair of non-negative integers")
        start, end = offs
        want = math.prod(shape) * ST_ITEMSIZE[dt]
        if end - start != want:
            raise UserError(f"{where}: data_offsets [{start}, {end}] span {end - start} bytes; its {dt} shape "
                            f"{tuple(shape)} needs {want}")
        if end > data:
            raise UserError(f"{where}: data_offsets [{start}, {end}] run past the end of the file ({data} bytes of "
                            f"data after the header): the file is truncated or its offsets are wrong")
        out[name] = (dt, tuple(shape), 8 + n + start)
        if end > start:
            spans.append((start, end, name))
    spans.sort()
    for (s0, e0, a), (s1, e1, b) in zip(spans, spans[1:]):
        if s1 < e0:
            raise UserError(f"{path}: tensors `{a}` [{s0}, {e0}] and `{b}` [{s1}, {e1}] overlap in the file")
    return out


# -- the store ------------------------------------------------------------------------------------------------------

class Weights:
    """A model's weights by name: `raw(name)` the stored bits and their format, `get(name)` f32 (cached), `names()`.
    With a config, also the generated tables `rope.cos` / `rope.sin`."""

    def __init__(self, store, cfg=None):
        self.store = store
        self.cfg = cfg
        self._f32: dict[str, np.ndarray] = {}
        self._gen: dict[str, tuple[int, ...]] | None = None

    @classmethod
    def from_dict(cls, arrays: dict[str, Any], cfg=None) -> "Weights":
        return cls(DictStore(arrays), cfg)

    @classmethod
    def from_folder(cls, folder: str | Path, cfg=None) -> "Weights":
        return cls(SafetensorsStore(folder), cfg)

    def with_config(self, cfg) -> "Weights":
        return Weights(self.store, cfg)

    def generated(self) -> dict[str, tuple[int, ...]]:
        """name -> shape of each f32 table the config generates: the rotary tables, and whatever a family's config
        adds (`cfg.generated()`: Gemma's second rotary pair and its norms' 1 + w)."""
        if self.cfg is None:
            return {}
        if self._gen is None:
            own = getattr(self.cfg, "generated", None)
            self._gen = own() if own is not None else {n: (self.cfg.max_len, self.cfg.rot // 2) for n in GENERATED}
        return self._gen

    def names(self) -> list[str]:
        return self.store.names() + list(self.generated())

    def __contains__(self, name: str) -> bool:
        return name in self.generated() or name in self.store.names()

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.generated():
            return self.generated()[name]
        self._known(name)
        return self.store.info(name)[0]

    def format(self, name: str) -> str:
        if name in self.generated():
            return "f32"
        self._known(name)
        return self.store.info(name)[1]

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        if name in self.generated():
            return self.get(name), "f32"
        self._known(name)
        return self.store.raw(name)

    def get(self, name: str) -> np.ndarray:
        if name not in self._f32:
            if name in self.generated():
                own = getattr(self.cfg, "generate", None)
                self._f32.update(own(name, self) if own is not None else rope_tables(self.cfg))
            else:
                arr, fmt = self.raw(name)
                self._f32[name] = np.ascontiguousarray(dequantize(arr, fmt))
        return self._f32[name]

    def _known(self, name: str) -> None:
        if name not in self.store.names():
            hint = did_you_mean(name, self.store.names())
            raise UserError(f"no weight `{name}`{hint}")
