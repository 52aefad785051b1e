"""What a collective op means: the step graphs of R ranks run side by side, and a collective op (`all_reduce`,
`all_gather`, `all_argmax`) meets across them — each rank gives its payload, and every rank gets the one result
(`meet`). The reference interpreter of R ranks (engine/ranks.py) runs each rank's graph in a thread of its own with
an in-process communicator (`LocalComm`); a real one (torch.distributed's gloo, NCCL: lane/run/ranks.py) serves the
same interface, `Comm.exchange(op, payload) -> [payload of each rank]`. (engine/ranks.evaluate_ranks is the
interpreter of R ranks over these.)"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np

from lanefuse.engine.errors import UserError

F32, F64 = np.float32, np.float64

COLLECTIVES = ("all_reduce", "all_gather", "all_argmax")


def payload(kind: str, x: np.ndarray, offset: int = 0) -> np.ndarray:
    """What one rank sends into collective `kind`: its value (all_reduce, all_gather; f32), or for `all_argmax` each
    row's largest value and its index in the whole row (`offset` + the first local index of it): (R, 2) f64, two
    values a row whatever the width of the rank's part."""
    x = np.asarray(x)
    if kind != "all_argmax":
        return np.asarray(x, dtype=F32)
    i = np.argmax(x, axis=-1)  # the first of equal maxima
    v = np.take_along_axis(np.asarray(x, dtype=F64), i[:, None], axis=-1)[:, 0]
    return np.stack([v, (i + offset).astype(F64)], axis=-1)


def combine(kind: str, parts: list[np.ndarray]) -> np.ndarray:
    """Every rank's payload (in rank order) into the collective's result, the same on every rank: all_reduce the sum
    (in f64, rank 0 first, rounded to f32 once), all_gather the parts side by side ((R, n) each -> (R, ranks·n)),
    all_argmax each row's index of the largest value (the lowest index of equal ones: np.argmax of the whole row)."""
    if kind == "all_reduce":
        acc = np.zeros(parts[0].shape, dtype=F64)
        for p in parts:
            acc += np.asarray(p, dtype=F64)
        return acc.astype(F32)
    if kind == "all_gather":
        return np.concatenate([np.asarray(p, dtype=F32) for p in parts], axis=-1)
    if kind == "all_argmax":
        v = np.stack([p[:, 0] for p in parts], axis=1)  # (R, ranks)
        idx = np.stack([p[:, 1] for p in parts], axis=1)
        best = v.max(axis=1, keepdims=True)
        idx = np.where(v == best, idx, np.inf)  # among equal maxima the lowest index (a rank's parts are in order)
        return idx.min(axis=1).astype(np.int32)
    raise ValueError(f"not a collective: {kind}")


class Comm(Protocol):
    rank: int
    ranks: int

    def exchange(self, kind: str, x: np.ndarray) -> list[np.ndarray]:
        """Every rank's payload of this collective, in rank order (each rank calls it with its own, in the same
        order of collectives)."""


def meet(comm: Comm, op, x: np.ndarray) -> np.ndarray:
    """Collective op `op` of this rank, its input `x`, through `comm` (checked: the op's ranks are the comm's)."""
    a = op.a
    return meet_values(comm, op.kind, x, a.get("ranks", 1), a.get("offset", 0), f"op `{op.kind}` -> `{op.out}`")


def meet_values(comm: Comm | None, kind: str, x: np.ndarray, ranks: int, offset: int = 0, what: str = "") -> np.ndarray:
    """Collective `kind` over `ranks` ranks of this rank's `x` through `comm` (None: one rank alone)."""
    if comm is None:
        return alone(kind, x, ranks, offset)
    if ranks != comm.ranks:
        raise UserError(f"{what or kind} is over {ranks} ranks; this run has {comm.ranks}")
    exchange = getattr(comm, kind, None)  # a communicator's own form of the collective (a library all-reduce)
    if exchange is not None:
        return exchange(payload(kind, x, offset))
    return combine(kind, comm.exchange(kind, payload(kind, x, offset)))


def alone(kind: str, x: np.ndarray, ranks: int = 1, offset: int = 0, **a: Any) -> np.ndarray:
    """A collective op run without a communicator: one rank, the others none (over more ranks, refused: the ranks
    must run together, engine/ranks.evaluate_ranks or lane/run/ranks.py)."""
    if ranks != 1:
        raise UserError(f"a `{kind}` over {ranks} ranks runs only with its ranks (lanefuse run --ranks {ranks}; "
                        f"engine/ranks.evaluate_ranks)")
    return combine(kind, [payload(kind, x, offset)])


class LocalComm:
    """The in-process communicator of engine/ranks.evaluate_ranks: rank threads meet at a barrier; each collective's payloads
    are kept by rank until all have arrived. `timeout` seconds bound each wait (a rank that failed breaks the barrier
    for the others: every rank ends, none hangs)."""

    def __init__(self, ranks: int, timeout: float = 120.0):
        self.ranks = ranks
        self.timeout = timeout
        self.barrier = threading.Barrier(ranks, timeout=timeout)
        self.slots: list[Any] = [None] * ranks

    def at(self, rank: int) -> "_RankView":
        return _RankView(self, rank)


class _RankView:
    def __init__(self, group: LocalComm, rank: int):
        self.group, self.rank, self.ranks = group, rank, group.ranks

    def exchange(self, kind: str, x: np.ndarray) -> list[np.ndarray]:
        g = self.group
        g.slots[self.rank] = (kind, np.array(x))
        g.barrier.wait()
        got = list(g.slots)
        g.barrier.wait()  # every rank has read the slots before any writes the next collective's
        kinds = {k for k, _ in got}
        if len(kinds) != 1:
            raise UserError(f"ranks disagree on the collective they meet in: {sorted(kinds)}")
        return [v for _, v in got]

    def abort(self) -> None:
        self.group.barrier.abort()
