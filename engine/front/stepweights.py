"""The weights a step YAML runs with, from its `weights:` entry: `{demo: true}` (the built-in demo model),
`{checkpoint: PATH}` (a checkpoint folder, relative to the YAML's folder) or `{random: SEED}` (seeded values for each
constant the step declares)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lanefuse.engine.errors import UserError, did_you_mean
from lanefuse.engine.ir import Graph
from lanefuse.engine.formats.layout import BLOCK_FORMATS, F16_SCALES
from lanefuse.engine.front.weights import Weights, f32_to_bf16

KINDS = ("demo", "checkpoint", "random")


def _max_len(g: Graph, default: int = 256) -> int:
    c = g.constants.get("rope.cos")
    return c.shape[0] if c is not None else default


MAX_RANDOM_VALUES = 1 << 28  # the values a step YAML's `weights: {random: SEED}` makes for its constants, at most


def random_weights(g: Graph, seed: int) -> Weights:
    """Seeded values for every constant of `g`: rows of variance 1/width, value vectors near 1, rotary tables; a matrix
    the step reads transposed (engine/orientation.py) stored (k, n) and served as the step reads it."""
    from lanefuse.engine.orientation import as_read

    return as_read(g, _random_stored(g, seed))


def _random_stored(g: Graph, seed: int) -> Weights:
    """`random_weights` as stored: a matrix the step reads transposed as (k, n)."""
    from lanefuse.engine.orientation import stored_shape

    rng = np.random.default_rng(seed)
    arrays = {}
    for name, c in g.constants.items():
        src = c.source or name
        shape = stored_shape(g, name)
        if src in ("rope.cos", "rope.sin") and len(c.shape) == 2:
            half = c.shape[1]
            ang = np.arange(c.shape[0])[:, None] * (10000.0 ** (-np.arange(half) / max(half, 1)))[None, :]
            arrays[src] = (np.cos(ang) if src == "rope.cos" else np.sin(ang)).astype(np.float32)
        elif c.kind == "values":
            arrays[src] = (1.0 + 0.1 * rng.standard_normal(c.shape)).astype(np.float32)
        elif c.format in BLOCK_FORMATS:
            arrays[src] = (random_blocks(rng, c.shape, c.format, name), c.format)
        else:
            v = (rng.standard_normal(shape) / np.sqrt(c.shape[-1])).astype(np.float32)
            arrays[src] = (f32_to_bf16(v), "bf16") if c.format == "bf16" else \
                (v.astype(np.float16), "f16") if c.format == "f16" else v
    return Weights.from_dict(arrays)


# a block format's values as random bytes give (for its f16 scale d = 1) about this standard deviation
_SPREAD = {"q8_0": 74.0, "q4_0": 4.6, "q4_k": 260.0, "q6_k": 1370.0, "q4_1": 4.6, "q5_0": 9.2, "q5_1": 9.2,
           "q5_k": 530.0, "q3_k": 43.0, "q2_k": 14.0, "iq4_nl": 67.0, "iq4_xs": 1250.0}
# the second f16 scale (a min: q4_k's dmin, q4_1's m, ...) as a multiple of d that centers the values on zero
_MIN_CENTER = {"q4_k": 7.5, "q5_k": 15.5, "q2_k": 1.5, "q4_1": -7.5, "q5_1": -15.5}


def random_blocks(rng, shape: tuple[int, ...], fmt: str, name: str = "") -> np.ndarray:
    """Rows (rows, cols) of random `fmt` blocks, stored (uint8 (rows, row bytes)): random value and sub-scale bytes,
    each block's f16 scale set so the values have a spread of about 1/sqrt(cols) (q4_k's min offsetting its
    levels' mean)."""
    vb, bb = BLOCK_FORMATS[fmt]
    rows, cols = shape
    if cols % vb:
        raise UserError(f"constant `{name}`: {fmt} rows of {cols} values; a {fmt} row must be whole blocks of {vb} "
                        f"values (shape {list(shape)})")
    raw = rng.integers(0, 256, size=(rows * (cols // vb), bb), dtype=np.uint8)
    if fmt == "mxfp4":  # random fp4 codes (a spread of about 2.9) under one e8m0 scale near 1/sqrt(cols)/2.9
        raw[:, 0] = 127 + int(np.round(np.log2(1.0 / np.sqrt(cols) / 2.9)))
        return raw.reshape(rows, -1)
    d = np.float16(1.0 / np.sqrt(cols) / _SPREAD[fmt])
    scales = [(F16_SCALES[fmt][0], d)] + ([(F16_SCALES[fmt][1], np.float16(float(d) * _MIN_CENTER[fmt]))]
                                          if fmt in _MIN_CENTER else [])
    for at, v in scales:
        raw[:, at: at + 2] = np.frombuffer(v.tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def step_weights(g: Graph, base: str | Path = ".") -> Weights:
    """The weights `g.meta["weights"]` names, as the step reads them (a matrix it declares stored (k, n) served
    transposed: engine/orientation.as_read); `base` is the folder a relative checkpoint path starts from."""
    from lanefuse.engine.orientation import as_read

    return as_read(g, _named_weights(g, base))


def _named_weights(g: Graph, base: str | Path) -> Weights:
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
        from lanefuse.engine.front.demo import demo_model

        return demo_model(_max_len(g))[1]
    if kind == "checkpoint":
        from lanefuse.engine.front.load import load_model

        path = Path(str(value))
        return load_model(path if path.is_absolute() else Path(base) / path, max_len=_max_len(g))[1]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UserError(f"`weights: {{random: {str(value)[:40]}}}` needs a non-negative integer seed")
    import math

    total = sum(math.prod(c.shape) for c in g.constants.values())
    if total > MAX_RANDOM_VALUES:  # before anything is drawn: each constant is made whole (in f64, then cast)
        big = max(g.constants.values(), key=lambda c: math.prod(c.shape))
        raise UserError(f"`weights: {{random: {value}}}`: the step's constants hold {total:,} values (`{big.name}` "
                        f"alone {big.shape}); random weights are made for at most {MAX_RANDOM_VALUES:,} (1 GiB of "
                        f"f32): give a checkpoint, or smaller shapes")
    return _random_stored(g, value)
