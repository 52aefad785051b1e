"""The kernel library: every launch kind defined once, in a module of its own (its fields, numpy twin, CUDA source and
launch, grid, cost, tuning), and `KINDS`, found from those modules: a kind is a `Launch` subclass with a census name.
CuPy is imported only when a launch runs on the device."""

from __future__ import annotations

import importlib
import pkgutil

from lanefuse.kernels.argmax import Advance
from lanefuse.kernels.common import ALIGN, GEMV_ROWS, MAX_HEAD, QBLOCK, Dst, Launch, Part, Scratch
from lanefuse.kernels.env import Env, HostEnv
from lanefuse.kernels.gemm_parts import GemmPart
from lanefuse.kernels.norm import PreNorm
from lanefuse.kernels.rope import Absorb, RopeSide

DEVICE = ("compile", "cupy_env")  # the device side, imported when a launch runs there


def find_kinds() -> dict[str, type[Launch]]:
    """Every launch kind in this package's modules by its census name; a census two kinds claim is an error."""
    kinds: dict[str, type[Launch]] = {}
    for m in pkgutil.iter_modules(__path__):
        if m.name in DEVICE:
            continue
        mod = importlib.import_module(f"{__name__}.{m.name}")
        for v in vars(mod).values():
            if not (isinstance(v, type) and issubclass(v, Launch) and v.__module__ == mod.__name__ and v.census):
                continue
            if v.census in kinds:
                raise TypeError(f"launch kinds {kinds[v.census].__qualname__} ({kinds[v.census].__module__}) and "
                                f"{v.__qualname__} ({mod.__name__}) both have census `{v.census}`; rename one")
            kinds[v.census] = v
    return dict(sorted(kinds.items()))


KINDS: dict[str, type[Launch]] = find_kinds()
globals().update({k.__name__: k for k in KINDS.values()})  # each kind importable from here: `from ... import Gemv`


def honoured_steps() -> frozenset[str]:
    """The lane's schedule steps some kind's `tune` honours (the lane table's `schedule:` lists them, with the steps
    it takes itself)."""
    return frozenset(s for k in KINDS.values() for s in k.steps)


__all__ = ["KINDS", "ALIGN", "GEMV_ROWS", "MAX_HEAD", "QBLOCK", "Launch", "Part", "Dst", "Scratch", "Env", "HostEnv",
           "Absorb", "Advance", "PreNorm", "RopeSide", "GemmPart", "find_kinds", "honoured_steps",
           *(k.__name__ for k in KINDS.values())]
