"""The weight store: a model's tensors by checkpoint name, as stored (`raw`) or dequantized to f32 (`get`), from a
safetensors checkpoint folder (read lazily, memory-mapped) or an in-memory dict, plus the value tables the config
generates (`rope.cos`, `rope.sin`)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np

from lanefuse.engine.errors import UserError, did_you_mean

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
    if fmt == "bf16":
        return bf16_to_f32(arr)
    return np.asarray(arr, dtype=np.float32)


# -- the rotary tables ----------------------------------------------------------------------------------------------

def inv_freq(cfg) -> np.ndarray:
    """The rotary inverse frequencies of (rot/2,) as transformers computes them (default, linear, llama3), in f64."""
    dim = cfg.rot
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    sc = dict(cfg.rope_scaling)
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(sc["factor"])
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
    raise UserError(f"rope scaling `{kind}` is not supported (supported: default, linear, llama3)")


def rope_tables(cfg) -> dict[str, np.ndarray]:
    """`rope.cos` / `rope.sin`: (max_len, rot/2) f32, computed in f64 at positions 0..max_len-1."""
    ang = np.arange(cfg.max_len, dtype=np.float64)[:, None] * inv_freq(cfg)[None, :]
    return {"rope.cos": np.cos(ang).astype(np.float32), "rope.sin": np.sin(ang).astype(np.float32)}


# -- backends: where the stored tensors come from -------------------------------------------------------------------

class DictStore:
    """Tensors held in memory: name -> array (float32 f32, float16 f16, uint16 bf16 bits), or name -> (array, format)."""

    def __init__(self, arrays: dict[str, Any]):
        self.arrays: dict[str, tuple[np.ndarray, str]] = {}
        for name, v in arrays.items():
            arr, fmt = v if isinstance(v, tuple) else (v, None)
            arr = np.asarray(arr)
            if fmt is None:
                fmt = {np.dtype(np.float16): "f16", np.dtype(np.uint16): "bf16"}.get(arr.dtype, "f32")
                if fmt == "f32":
                    arr = arr.astype(np.float32, copy=False)
            self.arrays[name] = (arr, fmt)

    def names(self) -> list[str]:
        return list(self.arrays)

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        arr, fmt = self.arrays[name]
        return tuple(arr.shape), fmt

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        return self.arrays[name]

    def where(self, name: str) -> str:
        return "memory"


class SafetensorsStore:
    """A checkpoint folder's safetensors files (one, or shards named by model.safetensors.index.json): headers read
    up front, tensors read on demand (f32/f16 through safetensors, bf16 memory-mapped as uint16)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, AttributeError) as e:
                raise UserError(f"{index}: not a safetensors index ({e})") from None
            paths = [self.folder / f for f in files]
        else:
            paths = sorted(self.folder.glob("*.safetensors"))
        if not paths:
            raise UserError(f"{self.folder} holds no .safetensors files")
        self.entries: dict[str, tuple[Path, str, tuple[int, ...], int]] = {}  # name -> file, dtype, shape, byte offset
        for p in paths:
            if not p.exists():
                raise UserError(f"{p} is named by the index but does not exist")
            for name, (dt, shape, off) in _header(p).items():
                self.entries[name] = (p, dt, shape, off)
        self._open: dict[Path, Any] = {}

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
            n = int(np.prod(shape)) if shape else 1
            arr = np.memmap(p, dtype=np.uint16, mode="r", offset=off, shape=(n,)).reshape(shape)
            return arr, fmt
        if p not in self._open:
            from safetensors import safe_open

            self._open[p] = safe_open(str(p), framework="numpy")
        return self._open[p].get_tensor(name), fmt

    def where(self, name: str) -> str:
        return self.entries[name][0].name


def _header(path: Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """A safetensors file's tensors: name -> (dtype, shape, absolute byte offset of its data)."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if n > 100_000_000:
                raise ValueError("header too large")
            head = json.loads(f.read(n))
        out = {}
        for name, e in head.items():
            if name == "__metadata__":
                continue
            out[name] = (e["dtype"], tuple(int(d) for d in e["shape"]), 8 + n + int(e["data_offsets"][0]))
        return out
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise UserError(f"{path}: not a readable safetensors file ({e})") from None


# -- the store ------------------------------------------------------------------------------------------------------

class Weights:
    """A model's weights by name: `raw(name)` the stored bits and their format, `get(name)` f32 (cached), `names()`.
    With a config, also the generated tables `rope.cos` / `rope.sin`."""

    def __init__(self, store, cfg=None):
        self.store = store
        self.cfg = cfg
        self._f32: dict[str, np.ndarray] = {}

    @classmethod
    def from_dict(cls, arrays: dict[str, Any], cfg=None) -> "Weights":
        return cls(DictStore(arrays), cfg)

    @classmethod
    def from_folder(cls, folder: str | Path, cfg=None) -> "Weights":
        return cls(SafetensorsStore(folder), cfg)

    def with_config(self, cfg) -> "Weights":
        return Weights(self.store, cfg)

    def names(self) -> list[str]:
        return self.store.names() + (list(GENERATED) if self.cfg is not None else [])

    def __contains__(self, name: str) -> bool:
        return name in self.names()

    def shape(self, name: str) -> tuple[int, ...]:
        if name in GENERATED and self.cfg is not None:
            return (self.cfg.max_len, self.cfg.rot // 2)
        self._known(name)
        return self.store.info(name)[0]

    def format(self, name: str) -> str:
        if name in GENERATED and self.cfg is not None:
            return "f32"
        self._known(name)
        return self.store.info(name)[1]

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        if name in GENERATED and self.cfg is not None:
            return self.get(name), "f32"
        self._known(name)
        return self.store.raw(name)

    def get(self, name: str) -> np.ndarray:
        if name not in self._f32:
            if name in GENERATED and self.cfg is not None:
                self._f32.update(rope_tables(self.cfg))
            else:
                arr, fmt = self.raw(name)
                self._f32[name] = np.ascontiguousarray(dequantize(arr, fmt))
        return self._f32[name]

    def _known(self, name: str) -> None:
        if name not in self.store.names():
            hint = did_you_mean(name, self.store.names())
            raise UserError(f"no weight `{name}`{hint}")
