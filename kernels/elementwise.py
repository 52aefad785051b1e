"""What the elementwise kinds share: their grid (a grid-stride loop of 256-thread blocks) and the activation codes."""

from __future__ import annotations

from lanefuse.kernels.common import ACTS

THREADS = 256


def grid(n: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    return ((max(1, min(4096, -(-n // THREADS))), 1, 1), (THREADS, 1, 1))


def act_code(name: str | None) -> int:
    """An activation as act_apply (prelude.cu) numbers it; -1 for none."""
    return -1 if name is None else ACTS.index(name)
