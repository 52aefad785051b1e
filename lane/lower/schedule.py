"""The lane's schedule: how each linked launch runs — four rows a warp for a wide product (`rows_a_warp`), split-K
for a product too narrow to fill the chip (`split_k`), attention heads a block and splits with a combine pass
(`attn_splits`). Each step is named; a plan can hold it back like a rule."""

from __future__ import annotations

from lanefuse.lane.lower.knobs import Knobs

# The lane's own steps, held back like rules (`--hold rows_a_warp`).
STEPS = {
    "rows_a_warp": "four rows a warp for a product of at least `wide_rows` outputs",
    "split_k": "a product whose outputs fill too few blocks splits its k across blocks, then combines",
    "attn_splits": "a long attention split across blocks with a combine pass (flash-decoding); heads a block",
    "gemv_parts": "the products of one activation linked as one GEMV in parts (merged_qkv whole)",
}


def kernels_of(l) -> list:
    """The kernel launches a linked launch makes (its kind's `kernels()`): none for a view, two for a fold whose
    pair has no kernel of its own, one otherwise. The census and the launch counts count these."""
    return list(l.kernels())


def schedule_launch(l, k: Knobs, held=frozenset()):
    """One linked launch with the schedule's settings filled in: its kind's `tune` (the steps each kind honours are
    its `steps`)."""
    return l.tune(k, held)
