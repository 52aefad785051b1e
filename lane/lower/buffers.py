"""Each tensor's buffer: its home (a free view's or a table row's home is the tensor it is part of: engine/placement.py
says which tensors live inside another), its lifetime over the launches, and the arena placement of every array
computed and read within the step."""

from __future__ import annotations

from dataclasses import dataclass

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


def lifetimes(launches, bufs: dict[str, Buffer]) -> list[Live]:
    """Each arena array's lifetime: from the first launch that touches its home (through any alias) to the last;
    and each launch's scratch, live for that launch."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    size: dict[str, int] = {}
    for i, l in enumerate(launches):
        for name in list(l.reads()) + list(l.writes()):
            b = bufs.get(name)
            if b is None or b.where != "arena":
                continue
            h = b.home
            first.setdefault(h, i)
            last[h] = i
            hb = bufs[h]
            size[h] = array_bytes(hb.size, hb.dtype)
    items = [Live(h, size[h], first[h], last[h]) for h in sorted(first)]
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
