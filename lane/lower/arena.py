"""The step-local arena: every array a step computes and reads within the step, placed by its lifetime (first launch
that writes it to last launch that touches it) at the lowest ALIGN-aligned offset clear of every array live beside
it, largest first; a launch's scratch placed for that launch alone."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from lanefuse.kernels import ALIGN


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Live:
    """An array to place: `bytes` live from launch `first` to launch `last` (inclusive). `launch` is set for a
    launch's scratch (then first == last == launch)."""

    name: str
    bytes: int
    first: int
    last: int
    scratch_of: int | None = None


@dataclass(frozen=True)
class Placed:
    name: str
    offset: int
    bytes: int
    first: int
    last: int
    scratch_of: int | None = None


@dataclass
class Arena:
    arrays: list[Placed] = field(default_factory=list)
    bytes: int = 0
    lower_bound: int = 0
    order: str = "largest"  # the placement order that gave the fewest bytes

    def offset(self, name: str) -> int:
        for p in self.arrays:
            if p.name == name:
                return p.offset
        raise KeyError(name)

    def by_name(self) -> dict[str, Placed]:
        return {p.name: p for p in self.arrays}

    @property
    def ratio(self) -> float:
        return self.bytes / self.lower_bound if self.lower_bound else 1.0

    def to_json(self) -> dict:
        return {"bytes": self.bytes, "lower_bound": self.lower_bound, "ratio": round(self.ratio, 4),
                "arrays": [{"name": p.name, "offset": p.offset, "bytes": p.bytes, "first": p.first, "last": p.last,
                            "scratch": p.scratch_of is not None} for p in self.arrays]}


def lower_bound(items: list[Live]) -> int:
    """The peak, over launches, of the aligned bytes live at once."""
    events: dict[int, int] = {}
    for it in items:
        events[it.first] = events.get(it.first, 0) + aligned(it.bytes)
        events[it.last + 1] = events.get(it.last + 1, 0) - aligned(it.bytes)
    peak = cur = 0
    for t in sorted(events):
        cur += events[t]
        peak = max(peak, cur)
    return peak


def _first_fit(items: list[Live]) -> list[Placed]:
    placed: list[Placed] = []
    alive: dict[int, list[int]] = {}  # launch -> the placed arrays (indices) live at it: lifetimes are a few launches
    odd: list[int] = []  # placed arrays with an empty lifetime (first > last), tested against every later one
    for it in items:
        size = aligned(it.bytes)
        # the intervals already taken by arrays alive at the same time, by offset
        if it.first <= it.last:
            near = {k for t in range(it.first, it.last + 1) for k in alive.get(t, ())}.union(odd)
        else:  # an empty lifetime: the plain overlap test, as for any other
            near = range(len(placed))
        busy = sorted((p.offset, p.offset + aligned(p.bytes)) for p in map(placed.__getitem__, near)
                      if p.first <= it.last and it.first <= p.last)
        off = 0
        for lo, hi in busy:
            if off + size <= lo:
                break
            off = max(off, hi)
        for t in range(it.first, it.last + 1):
            alive.setdefault(t, []).append(len(placed))
        if it.first > it.last:
            odd.append(len(placed))
        placed.append(Placed(it.name, off, it.bytes, it.first, it.last, it.scratch_of))
    return placed


ORDERS = {
    "largest": lambda it: (-aligned(it.bytes), it.first, it.name),
    "largest_latest": lambda it: (-aligned(it.bytes), -it.last, it.name),
    "longest": lambda it: (-(it.last - it.first), -aligned(it.bytes), it.name),
    "earliest": lambda it: (it.first, -aligned(it.bytes), it.name),
}


SHUFFLES = 16  # seeded shuffled first-fit orders tried where no order above reaches the lower bound


def place(items: list[Live]) -> Arena:
    """Place `items`: largest first at the lowest aligned offset clear of every array live beside it; where another
    first-fit order (largest ending latest first, longest lifetime, earliest start) spans fewer bytes, that one is
    kept; where none reaches the lower bound, up to SHUFFLES seeded shuffles of the order. Measured: a q8x2 decode
    step whose quantized forms (768 and 1,280 B beside 1,024 B f32 rows) left largest-first 15% over the bound, at 2
    layers and 36; largest ending latest first met it at 36, a shuffle at 2. Deterministic."""
    names = [it.name for it in items]
    if len(set(names)) != len(names):
        raise ValueError("an array placed twice in the arena")
    best: tuple[int, str, list[Placed]] | None = None
    bound = lower_bound(items)
    for order, key in ORDERS.items():
        placed = _first_fit(sorted(items, key=key))
        span = max((p.offset + aligned(p.bytes) for p in placed), default=0)
        if best is None or span < best[0]:
            best = (span, order, placed)
        if best[0] <= bound:  # no order spans fewer bytes than the bound: the first to reach it is kept
            break
    assert best is not None
    rng = random.Random(0)
    order = sorted(items, key=ORDERS["largest"])
    for k in range(SHUFFLES if best[0] > bound else 0):
        rng.shuffle(order)
        placed = _first_fit(order)
        span = max((p.offset + aligned(p.bytes) for p in placed), default=0)
        if span < best[0]:
            best = (span, f"shuffle {k}", placed)
        if best[0] <= bound:
            break
    span, order, placed = best
    placed.sort(key=lambda p: (p.offset, p.first, p.name))
    return Arena(placed, span, bound, order)


def check(arena: Arena) -> None:
    """The arena's invariants: aligned offsets, no two arrays live at once overlapping, bytes >= the lower bound."""
    arr = arena.arrays
    for p in arr:
        assert p.offset % ALIGN == 0, f"{p.name} at {p.offset} is not aligned"
        assert p.offset + p.bytes <= arena.bytes, f"{p.name} runs past the arena"
    for i, p in enumerate(arr):
        for q in arr[i + 1:]:
            if p.first <= q.last and q.first <= p.last:
                assert p.offset + p.bytes <= q.offset or q.offset + q.bytes <= p.offset, \
                    f"{p.name} and {q.name} overlap while both live"
    assert arena.bytes >= arena.lower_bound


@dataclass(frozen=True)
class Forms:
    """A model's forms (its decode step, each prefill chunk width, a batch's step) in one arena, one form running at
    a time (seed 003): the persistent arrays every form reads and updates — the KV caches and carried states, the
    same tables for every form — placed once at `tables` {name: (offset, bytes)}, the same offsets for every form;
    from `base` each form's step-local arena overlaid on the others', so the arena's `bytes` are `base` and the
    largest form's. `own` {form: its arena's bytes}: what each form allocates when it has an arena of its own."""

    tables: dict[str, tuple[int, int]]
    base: int
    own: dict[str, int]
    bytes: int

    @property
    def apart(self) -> int:
        """The bytes of the forms' arenas each on its own (the tables once, as every form shares them already)."""
        return self.base + sum(aligned(n) for n in self.own.values())

    def offset(self, form: str, placed_offset: int) -> int:
        """Where an array of `form` placed at `placed_offset` in its own arena lies in the shared one."""
        if form not in self.own:
            raise KeyError(form)
        return self.base + placed_offset

    def to_json(self) -> dict:
        return {"bytes": self.bytes, "apart": self.apart, "base": self.base, "forms": dict(self.own),
                "tables": {n: {"offset": o, "bytes": b} for n, (o, b) in self.tables.items()}}


def place_tables(tables: dict[str, int]) -> tuple[dict[str, tuple[int, int]], int]:
    """The persistent arrays `tables` {name: bytes} (KV caches, carried states) side by side from offset 0, in name
    order, each at an aligned offset: {name: (offset, bytes)}, and the first aligned offset past them (where the
    forms' step-local arrays start). Every runner places a model's tables so: the numpy runner in its arena buffer,
    the CuPy runner in its device allocation."""
    at: dict[str, tuple[int, int]] = {}
    off = 0
    for name in sorted(tables):
        at[name] = (off, int(tables[name]))
        off += aligned(int(tables[name]))
    return at, off


def share(forms: dict[str, tuple[Arena, dict[str, int]]]) -> Forms:
    """The forms `forms` {label: (its arena, its tables {name: bytes})} in one arena: each table placed once (every
    form that has it must hold the same bytes of it: a form whose cache differs is another model's, refused), in
    name order from 0; the forms' step-local arrays overlaid from the first aligned offset past them."""
    tables: dict[str, int] = {}
    for label, (_, ts) in forms.items():
        for name, n in ts.items():
            if tables.setdefault(name, n) != n:
                raise ValueError(f"form {label}: table `{name}` of {n} bytes, another form's holds {tables[name]}")
    at, off = place_tables(tables)
    own = {label: a.bytes for label, (a, _) in forms.items()}
    return Forms(at, off, own, off + max((aligned(n) for n in own.values()), default=0))
