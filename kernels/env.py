"""The Env protocol the numpy twins read and write through, and `HostEnv`, a dict-backed Env for tests and for a runner
that keeps its own arrays. A backend's Env hands out views: a write through one lands where the launch placed it."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Env(Protocol):
    stream: bool  # the fast twins decode each launch's rows as it runs (not once): nothing of them is bound ahead

    def array(self, name: str) -> np.ndarray:
        """The flat f32 (or i32) array backing tensor `name`, writable: an arena view, a cache table, a step input."""

    def weight(self, name: str) -> tuple[np.ndarray, str]:
        """Constant `name`: checkpoint rows as stored (f32, f16 as float16, bf16 as uint16, a block format as uint8
        bytes of whole blocks) and their format, or f32 values and "f32"."""

    def param(self, name: str) -> int:
        """The value of i32 parameter `name` (e.g. the position `pos`)."""

    def matrix(self, name: str) -> np.ndarray:
        """Constant `name` as flat f32 values, decoded once (the fast twins read weights through this)."""

    def stacked(self, names: tuple[str, ...]) -> np.ndarray:
        """Constants `names` (rows of one width) as one flat f32 matrix, their rows in turn, decoded once."""

    def columns(self, names: tuple[str, ...], k: int) -> np.ndarray:
        """That matrix of rows of `k` values stored transposed, (k, n) flat, decoded once (not asked of an env that
        streams its weights)."""

    def temp(self, count: int) -> np.ndarray:
        """`count` f32 values a fast twin may use as a temporary for the length of its launch."""


class HostEnv:
    """An Env over dicts of flat numpy arrays; `param` reads element 0 of an i32 array of the same name."""

    stream = False

    def __init__(self, arrays: dict[str, np.ndarray] | None = None,
                 weights: dict[str, tuple[np.ndarray, str]] | None = None,
                 quantized: dict[str, tuple[np.ndarray, np.ndarray | None, np.ndarray]] | None = None):
        self.arrays = {k: np.ascontiguousarray(v).reshape(-1) for k, v in (arrays or {}).items()}
        self.weights = dict(weights or {})
        self.quantized = dict(quantized or {})  # a quantized form: its int8 words, low words (or None), scales

    def quant(self, name: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        if name not in self.quantized:
            raise KeyError(f"no quantized form `{name}` in this env (have: {', '.join(sorted(self.quantized))})")
        return self.quantized[name]

    def array(self, name: str) -> np.ndarray:
        if name not in self.arrays:
            raise KeyError(f"no array `{name}` in this env (have: {', '.join(sorted(self.arrays))})")
        return self.arrays[name]

    def weight(self, name: str) -> tuple[np.ndarray, str]:
        if name not in self.weights:
            raise KeyError(f"no weight `{name}` in this env (have: {', '.join(sorted(self.weights))})")
        return self.weights[name]

    def param(self, name: str) -> int:
        return int(self.array(name)[0])

    def matrix(self, name: str) -> np.ndarray:
        from lanefuse.kernels.common import decode

        raw, fmt = self.weight(name)
        return decode(raw, fmt).reshape(-1)

    def stacked(self, names: tuple[str, ...]) -> np.ndarray:
        return np.concatenate([self.matrix(n) for n in names])

    def columns(self, names: tuple[str, ...], k: int) -> np.ndarray:
        return np.ascontiguousarray(self.stacked(names).reshape(-1, k).T).reshape(-1)

    def temp(self, count: int) -> np.ndarray:
        return np.empty(count, dtype=np.float32)
