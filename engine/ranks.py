"""The reference interpreter of R ranks: each rank's step graph run by engine/interp.evaluate in a thread of its own,
the ranks' collectives meeting through an in-process communicator (engine/collectives.LocalComm)."""

from __future__ import annotations

import threading
from typing import Any

from lanefuse.engine.collectives import LocalComm
from lanefuse.engine.errors import UserError
from lanefuse.engine.interp import evaluate


def evaluate_ranks(graphs: list, weights: list, envs: list[dict]) -> list[dict]:
    """The reference interpreter of R ranks: rank r's graph `graphs[r]` over its weights and step inputs, each in a
    thread of its own; a collective meets across them (`combine`). Returns each rank's values (engine/interp.evaluate's).
    A rank's error ends every rank and is raised (the first rank's that failed)."""
    n = len(graphs)
    if not n == len(weights) == len(envs):
        raise ValueError("one graph, one weight store and one environment a rank")
    group = LocalComm(n)
    out: list[Any] = [None] * n
    errors: list[tuple[int, BaseException]] = []

    def run(r: int) -> None:
        view = group.at(r)
        try:
            out[r] = evaluate(graphs[r], weights[r], envs[r], comm=view)
        except threading.BrokenBarrierError:
            pass  # another rank failed first: its error is the one raised
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            errors.append((r, e))
            view.abort()

    if n == 1:
        return [evaluate(graphs[0], weights[0], envs[0], comm=group.at(0))]
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0][1]
    if any(o is None for o in out):
        raise UserError("a rank ended without its result (a collective timed out)")
    return out
