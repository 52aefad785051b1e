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
    """The predicted µs of one collective of `kind` whose payload is `nbytes` a rank, over `ranks` ranks (the
    launch kind's own formula, kernels/collective.py)."""
    from lanefuse.kernels.collective import link_time_us

    return link_time_us(kind, nbytes, ranks, k.link_gbps, k.link_us)
