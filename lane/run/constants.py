"""The constants a plan reads, as both backends load them from the checkpoint: f32 values, or checkpoint rows as
stored (f32, f16 as float16, bf16 as uint16, a block format as uint8 blocks) with their format — the exact twins decode rows themselves; or, for the
fast twins, decoded to f32 once (the weight store's cache, shared by every plan of the model)."""

from __future__ import annotations

import weakref

import numpy as np

from lanefuse.engine.formats.blocks import INTO


def host_constant(c, weights) -> tuple[np.ndarray, str]:
    """Constant `c` (a plan's `Constant`) from `weights`, flat, with its format."""
    src = c.source or c.name
    if c.kind == "values":
        return np.asarray(weights.get(src), dtype=np.float32).reshape(-1), "f32"
    raw, fmt = weights.raw(src)
    return np.asarray(raw).reshape(-1), fmt


def host_matrix(c, weights) -> np.ndarray:
    """Constant `c` as f32 values, flat, decoded once: f32 rows are the stored values themselves; f16 and bf16 rows
    cost 4 bytes a value in memory (twice the checkpoint) for an f32 BLAS product with no conversion a step."""
    return weights.get(c.source or c.name).reshape(-1)


_STACKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # weights -> {names: stacked rows}, as they live


def host_stacked(cs, weights, columns: bool = False) -> np.ndarray:
    """Constants `cs` (checkpoint rows of one width) as one f32 matrix, flat, their rows one after the other:
    decoded once from the stored rows, straight into it (no copy of each kept beside it), and shared by every plan of
    the same weights — one BLAS product for products in parts (q, k, v; gate and up). `columns`: the matrix stored
    transposed instead, (k, n) (the layout `rows_at` takes for a tall product)."""
    names = tuple(c.source or c.name for c in cs)
    key = names + (("columns",) if columns else ())
    built = _STACKS.setdefault(weights, {})
    out = built.get(key)
    if out is None:
        from lanefuse.kernels.common import decode

        k = cs[0].shape[-1]
        out = np.empty(sum(c.size for c in cs), dtype=np.float32)
        at, cols = 0, out.reshape(k, -1)
        for c, n in zip(cs, names):
            raw, fmt = weights.raw(n)  # one at a time: the stored rows of one constant in memory at once
            rows = decode(np.asarray(raw), fmt).reshape(-1, k)
            if columns:
                cols[:, at: at + rows.shape[0]] = rows.T
                at += rows.shape[0]
            else:
                out[at: at + c.size] = rows.reshape(-1)
                at += c.size
        built[key] = out
    return out


def decoded_bytes(p) -> int:
    """The f32 bytes the fast twins' decoded weights of plan `p` take: every checkpoint-rows constant not stored as
    f32 (f16, bf16 and the block formats), decoded once and held beside its stored bytes."""
    return sum(4 * c.size for c in p.constants.values() if c.kind == "rows" and c.format != "f32")


def memory_bytes() -> int | None:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


DECODE_MEMORY = 0.5  # the fast twins decode weights to f32 once while that takes at most this share of memory


def decode_once(p, budget: int | None = None) -> bool:
    """Whether the fast twins may hold plan `p`'s weights decoded to f32 (`budget` bytes, default DECODE_MEMORY of
    the machine's memory); else each launch decodes the rows it multiplies as it runs (memory bounded by one
    constant, at the price of the decoding every step)."""
    if budget is None:
        mem = memory_bytes()
        if mem is None:
            return True
        budget = int(DECODE_MEMORY * mem)
    return decoded_bytes(p) <= budget


IN_PLACE = ("bf16", "f16") + INTO  # the formats `decode` writes into an array given with no array of the values made


def streamed_bytes(p) -> int:
    """The f32 values the streamed fast twins decode for one launch of plan `p` at the most: the launch's IN_PLACE
    constants together (each decoded into its own part of one buffer, reused launch after launch)."""
    def need(x) -> int:
        cs = [p.constants.get(n) for n in x.launch.weights()]
        return sum(c.size for c in cs if c is not None and c.kind == "rows" and c.format in IN_PLACE)

    return max((need(x) for x in p.launches), default=0)


def streamed_stacked(cs, weights, out: np.ndarray | None = None) -> np.ndarray:
    """Constants `cs` (checkpoint rows of one width) decoded to f32 for this launch only, their rows in turn (flat;
    not kept): into `out` (as many values) where given, else into arrays made for the launch."""
    from lanefuse.kernels.common import decode

    if out is None:
        parts = [np.asarray(decode(np.asarray(weights.raw(c.source or c.name)[0]), c.format), dtype=np.float32)
                 for c in cs]
        return parts[0].reshape(-1) if len(parts) == 1 else np.concatenate([a.reshape(-1) for a in parts])
    at = 0
    for c in cs:
        raw, fmt = weights.raw(c.source or c.name)
        decode(raw, fmt, out[at: at + c.size])
        at += c.size
    return out


def check_constants(p, weights) -> None:
    """Each constant of plan `p` against the checkpoint's: its shape (a values constant: its size) and, for checkpoint
    rows, its format. A saved plan is checked so before it runs; the first mismatch is a UserError."""
    from lanefuse.engine.errors import UserError

    shape_of, format_of = getattr(weights, "shape", None), getattr(weights, "format", None)
    if shape_of is None:
        return
    for name, c in p.constants.items():
        src = c.source or c.name
        have = tuple(int(d) for d in shape_of(src))
        same = int(np.prod(have)) == c.size if c.kind == "values" else have == tuple(c.shape)
        if not same:
            raise UserError(f"constants[{name!r}].shape: {list(c.shape)} but the checkpoint's `{src}` is {list(have)}")
        if c.kind == "rows" and format_of is not None and format_of(src) != c.format:
            raise UserError(f"constants[{name!r}].format: {c.format} but the checkpoint holds `{src}` as "
                            f"{format_of(src)}")
