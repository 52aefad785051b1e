"""The constants a plan reads, as both backends load them from the checkpoint: f32 values, or checkpoint rows as
stored (f32, f16 as float16, bf16 as uint16) with their format — the kernels decode rows themselves."""

from __future__ import annotations

import numpy as np


def host_constant(c, weights) -> tuple[np.ndarray, str]:
    """Constant `c` (a plan's `Constant`) from `weights`, flat, with its format."""
    src = c.source or c.name
    if c.kind == "values":
        return np.asarray(weights.get(src), dtype=np.float32).reshape(-1), "f32"
    raw, fmt = weights.raw(src)
    return np.asarray(raw).reshape(-1), fmt
