"""The cases a test function's parametrize marks make, as keyword dicts: the tests that replay other tests' cases
(on the stand-in cupy, on the host emulator) take them from here."""

from __future__ import annotations

import itertools


def cases(fn) -> list[dict]:
    """The keyword arguments of each case fn's parametrize marks make (their product)."""
    combos = [{}]
    for m in getattr(fn, "pytestmark", []):
        if m.name != "parametrize":
            continue
        names = [n.strip() for n in m.args[0].split(",")] if isinstance(m.args[0], str) else list(m.args[0])
        values = [v if len(names) > 1 else (v,) for v in m.args[1]]
        combos = [{**c, **dict(zip(names, v))} for c, v in itertools.product(combos, values)]
    return combos
