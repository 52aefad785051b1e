"""Each tensor's buffer: its home (a free view's or a table row's home is the tensor it is part of: engine/placement.py
says which tensors live inside another), its lifetime over the launches, and the arena placement of every array
computed and read within the step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lanefuse.engine.ir import Graph
from lanefuse.engine.placement import home_of
from lanefuse.kernels.quant import quant_layout
from lanefuse.lane.lower.arena import Arena, Live, place

WORDS = {"q8": 1, "q8x2": 2, "q8k": 3}  # a quantized activation's dtype -> its launches' `words` (q8k: 3)


def array_bytes(size: int, dtype: str) -> int:
    """The bytes of a tensor of `size` elements' array: 4 a value, or its quantized form (the int8 words, the low
    words under two words, a scale a block, each part aligned: kernels/quant.py)."""
    if dtype in WORDS:
        return quant_layout(size, WORDS[dtype])[2]
    return 4 * size


@dataclass(frozen=True)
class Buffer:
    """One tensor's storage: `home` is the tensor whose array holds it, `offset` its first element there; `where`
    is arena (step-local), io (a step input or output), table (a cache) or scratch."""

    name: str
    home: str
    offset: int  # elements into home
    size: int  # elements
    dtype: str
    where: str


def buffers(g: Graph, al: dict[str, tuple[str, int]]) -> dict[str, Buffer]:
    io_in, io_out, tables = set(g.io.inputs), set(g.io.outputs), set(g.io.tables)
    out: dict[str, Buffer] = {}
    for name, t in g.tensors.items():
        home, off = home_of(name, al)
        if home in tables:
            where = "table"
        elif home in io_in or home in io_out:
            where = "io"
        else:
            where = "arena"
        out[name] = Buffer(name, home, off, t.size, t.dtype, where)
    return out


class NotWritten(Exception):
    """An arena array read where no launch before has written the part read: `name` (the array read, as the launch
    names it), `home` (the array it lies in), `launch` (its index) and what is missing."""

    def __init__(self, name: str, home: str, launch: int, census: str, missing: str):
        self.name, self.home, self.launch, self.census, self.missing = name, home, launch, census, missing
        of = f" (a part of `{home}`)" if home != name else ""
        super().__init__(f"launch {launch} ({census}) reads `{name}`{of} where no launch before it has written "
                         f"{missing}: a step-local array must be written whole before it is read")


def _dst_of(l, name: str):
    """The destination records inside launch `l` that write `name` (kernels/common.py `Dst`)."""
    import dataclasses

    from lanefuse.kernels.common import Dst

    out, todo = [], [l]
    while todo:
        x = todo.pop()
        if isinstance(x, Dst):
            if x.buf == name:
                out.append(x)
            continue
        for f in dataclasses.fields(x):
            v = getattr(x, f.name)
            for e in (v if isinstance(v, tuple) else (v,)):
                if dataclasses.is_dataclass(e) and not isinstance(e, type):
                    todo.append(e)
    return out


class _Written:
    """What the launches so far have written of each arena array (by home): whole, or the elements written."""

    def __init__(self, bufs: dict[str, Buffer]):
        self.bufs = bufs
        self.whole: set[str] = set()
        self.parts: dict[str, np.ndarray] = {}  # home -> a bool mask of its elements, made at its first part write

    def write(self, name: str, at: np.ndarray | None) -> None:
        """`name` written: all of it (`at` None) or the flat elements `at` of its home."""
        b = self.bufs[name]
        h, n = b.home, self.bufs[b.home].size
        if h in self.whole:
            return
        if at is None:
            if b.offset == 0 and b.size >= n:
                self.whole.add(h)
                self.parts.pop(h, None)
                return
            at = np.arange(b.offset, b.offset + b.size, dtype=np.int64)
        m = self.parts.get(h)
        if m is None:
            m = self.parts[h] = np.zeros(n, dtype=bool)
        m[at[(at >= 0) & (at < n)]] = True
        if m.all():
            self.whole.add(h)
            del self.parts[h]

    def missing(self, name: str) -> str | None:
        """What is not written yet of the part `name` of its home, in words; None when all of it is."""
        b = self.bufs[name]
        h = b.home
        if h in self.whole:
            return None
        m = self.parts.get(h)
        if m is None:
            return "any of it"
        part = m[b.offset: b.offset + b.size]
        if part.all():
            return None
        return f"{int((~part).sum())} of its {b.size} values (the first at {int(np.flatnonzero(~part)[0])})"


def _written_at(l, name: str, b: Buffer):
    """The elements of `name`'s home launch `l` writes of `name`: None for all of `name` (from its offset), else
    the flat indices (a destination that places the result in a part of every unit, or from a fixed row)."""
    idx = []
    for d in _dst_of(l, name):
        if d.row is None and d.unit is None and not d.slot:
            return None
        if isinstance(d.row, str) or d.slot:
            return np.zeros(0, dtype=np.int64)  # rows a parameter names: not known when planning
        base = int(d.row or 0) * d.pitch
        if d.unit is not None:
            u = d.unit
            units = (b.size - base - u.offset + u.pitch - u.width) // u.pitch if u.pitch else 0
            idx.append(b.offset + base + u.indices(max(units, 0)))
        else:
            return np.arange(b.offset + base, b.offset + b.size, dtype=np.int64)
    return np.concatenate(idx) if idx else None


def walk(launches, bufs: dict[str, Buffer]) -> dict[str, int]:
    """Each arena array's first write (by home): the launch from which its lifetime runs. Raises NotWritten at the
    first launch that reads a part of an arena array no launch before it has written: every step-local array is
    written whole (by one launch, or part by part) before any launch reads it, so nothing a step reads of it was left
    by another array sharing its bytes, by an earlier step or by another form sharing the arena."""
    written = _Written(bufs)
    first: dict[str, int] = {}
    for i, top in enumerate(launches):
        runs = bool(top.kernels())  # a view runs nothing: it writes nothing
        for l in steps_of(top):
            for name in l.reads():
                b = bufs.get(name)
                if b is None or b.where != "arena":
                    continue
                miss = written.missing(name)
                if miss is not None:
                    raise NotWritten(name, b.home, i, top.census, miss)
            if not runs:
                continue
            for name in l.writes():
                b = bufs.get(name)
                if b is None or b.where != "arena":
                    continue
                written.write(name, _written_at(l, name, b))
                first.setdefault(b.home, i)
    return first


def steps_of(l):
    """Launch `l` as the launches it runs in turn: a fold's `first` then its `then`, a pair's `a` then its `b`, a
    chain's phases (each of those as its own); any other launch itself."""
    import dataclasses

    from lanefuse.kernels.common import Launch

    subs = [s for f in dataclasses.fields(l) for v in [getattr(l, f.name)]
            for s in (v if isinstance(v, tuple) else (v,)) if isinstance(s, Launch)]  # a chain's phases: a tuple
    if not subs:
        yield l
        return
    for sub in subs:
        yield from steps_of(sub)


def lifetimes(launches, bufs: dict[str, Buffer]) -> list[Live]:
    """Each arena array's lifetime: from the launch that first writes it (whole, or the first of the launches that
    write it part by part) to the last launch that touches it, through any alias; and each launch's scratch, live
    for that launch. Raises NotWritten where a launch reads a part of one before any launch writes it (`walk`)."""
    first = walk(launches, bufs)
    last: dict[str, int] = {}
    size: dict[str, int] = {}
    for i, l in enumerate(launches):
        for name in list(l.reads()) + list(l.writes()):
            b = bufs.get(name)
            if b is None or b.where != "arena":
                continue
            h = b.home
            last[h] = i
            hb = bufs[h]
            size[h] = array_bytes(hb.size, hb.dtype)
    items = [Live(h, size[h], first.get(h, last[h]), last[h]) for h in sorted(last)]
    for i, l in enumerate(launches):
        for s in l.scratch():
            if not s.counter:
                items.append(Live(f"#{i}.{s.tag}", s.nbytes, i, i, scratch_of=i))
    return items


def counters(launches) -> list[tuple[int, str, int]]:
    """The arrival counters: (launch, tag, bytes), each in a zeroed buffer of its own that its launch leaves zero."""
    return [(i, s.tag, s.nbytes) for i, l in enumerate(launches) for s in l.scratch() if s.counter]


def arena_for(launches, bufs: dict[str, Buffer]) -> Arena:
    return place(lifetimes(launches, bufs))


def tables_of(bufs: dict[str, Buffer]) -> dict[str, int]:
    """The persistent arrays a step reads and updates — its KV caches and carried states — {name: bytes}."""
    return {b.name: array_bytes(b.size, b.dtype) for b in bufs.values() if b.where == "table" and b.home == b.name}


def forms_of(plans: dict) -> "object":
    """Plans `plans` {label: Plan} — a model's forms — in one arena (lane/lower/arena.py `share`)."""
    from lanefuse.lane.lower.arena import share

    return share({label: (p.arena, tables_of(p.buffers)) for label, p in plans.items()})
