"""What a collective costs on the lane's link (knobs link_gbps, link_us): a ring's bytes over the link plus a fixed
latency. PREDICTIONS of the model below, never measured here: ring all-reduce sends 2·(R-1)/R of its bytes a rank,
a ring all-gather (R-1)/R of the gathered bytes (NCCL's bus-bandwidth formulas)."""

from __future__ import annotations

from lanefuse.lane.lower.knobs import Knobs


def payload_bytes(kind: str, shape: tuple[int, ...], ranks: int) -> int:
    """The bytes one rank's payload of collective `kind` over an input of `shape` holds: all_reduce and all_gather
    its f32 values; all_argmax two f64 values a row (the row's largest value and its index)."""
    rows = shape[0]
    if kind == "all_argmax":
        return 16 * rows
    n = 1
    for d in shape:
        n *= d
    return 4 * n


def collective_us(kind: str, nbytes: int, ranks: int, k: Knobs) -> float:
    """The predicted µs of one collective of `kind` whose payload is `nbytes` a rank, over `ranks` ranks."""
    if ranks <= 1:
        return 0.0
    share = 2.0 * (ranks - 1) / ranks if kind == "all_reduce" else float(ranks - 1)
    return k.link_us + share * nbytes / (k.link_gbps * 1e3)  # GB/s = 1e3 bytes a µs
