"""The weights a step YAML runs with, from its `weights:` entry: `{demo: true}` (the built-in demo model),
`{checkpoint: PATH}` (a checkpoint folder, relative to the YAML's folder) or `{random: SEED}` (seeded values for each
constant the step declares)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lanefuse.engine.errors import UserError, did_you_mean
from lanefuse.engine.ir import Graph
from lanefuse.engine.weights import Weights

KINDS = ("demo", "checkpoint", "random")


def _max_len(g: Graph, default: int = 256) -> int:
    c = g.constants.get("rope.cos")
    return c.shape[0] if c is not None else default


def random_weights(g: Graph, seed: int) -> Weights:
    """Seeded values for every constant of `g`: rows of variance 1/width, value vectors near 1, rotary tables."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, c in g.constants.items():
        src = c.source or name
        if src in ("rope.cos", "rope.sin") and len(c.shape) == 2:
            half = c.shape[1]
            ang = np.arange(c.shape[0])[:, None] * (10000.0 ** (-np.arange(half) / max(half, 1)))[None, :]
            arrays[src] = (np.cos(ang) if src == "rope.cos" else np.sin(ang)).astype(np.float32)
        elif c.kind == "values":
            arrays[src] = (1.0 + 0.1 * rng.standard_normal(c.shape)).astype(np.float32)
        else:
            arrays[src] = (rng.standard_normal(c.shape) / np.sqrt(c.shape[-1])).astype(np.float32)
    return Weights.from_dict(arrays)


def step_weights(g: Graph, base: str | Path = ".") -> Weights:
    """The weights `g.meta["weights"]` names; `base` is the folder a relative checkpoint path starts from."""
    spec = g.meta.get("weights")
    if not spec:
        raise UserError("the step names no weights: add `weights: {demo: true}`, `{checkpoint: PATH}` or "
                        "`{random: SEED}`")
    if not isinstance(spec, dict) or len(spec) != 1:
        raise UserError(f"`weights: {spec}` must name one of {', '.join(KINDS)}")
    (kind, value), = spec.items()
    if kind not in KINDS:
        hint = did_you_mean(str(kind), KINDS)
        raise UserError(f"unknown weights source `{kind}`{hint}; expected one of {', '.join(KINDS)}")
    if kind == "demo":
        from lanefuse.engine.demo import demo_model

        return demo_model(_max_len(g))[1]
    if kind == "checkpoint":
        from lanefuse.engine.front import load_model

        path = Path(str(value))
        return load_model(path if path.is_absolute() else Path(base) / path, max_len=_max_len(g))[1]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UserError(f"`weights: {{random: {str(value)[:40]}}}` needs a non-negative integer seed")
    return random_weights(g, value)
