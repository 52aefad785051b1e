"""The lane's shim: what can run (support per class from the lane's table, and each launch's own preconditions) and
what it costs — the price of each e-node the engine's extraction weighs: its launches' fixed overhead plus bytes moved
over bandwidth (flops over peak where those dominate); a class run as its parts costs its parts; a refusal is never
chosen."""

from __future__ import annotations

from dataclasses import dataclass, field

from lanefuse.engine.ir import Graph, Op
from lanefuse.engine.refusal import Refusal
from lanefuse.lane.lower.knobs import Knobs
from lanefuse.lane.lower.link import Link, where_of
from lanefuse.lane.lower.table import LaneTable


def weight_format(k) -> str | None:
    """The checkpoint format of the rows a kernel launch streams (a fold's: its product's), if it streams any."""
    for x in (k, getattr(k, "first", None)):
        f = getattr(x, "format", None)
        if isinstance(f, str):
            return f
    return None


def kind_cost(k, costs: dict):
    """The lane's `costs:` entry for kernel launch `k`: its kind over its rows' format (`fold@q8_0`), else its kind's,
    else any kind's over its rows' format (`default@q8_0`), else the table's `default`."""
    f = weight_format(k)
    return (costs.get(f"{k.census}@{f}") if f else None) or costs.get(k.census) or \
        (costs.get(f"default@{f}") if f else None) or costs.get("default")


def launch_us(l, knobs: Knobs, costs: dict | None = None) -> float:
    """One linked launch's estimated time: for each kernel it makes, the launch gap (knob launch_us; a tensor-core
    product one for each of its `device_launches`, and its cuBLAS calls' `call_us`) + its kind's fixed time +
    max(bytes / its share of the bandwidth, flops / peak), the peak the tensor cores' for a kernel on them (a
    tensor-core product's own `rate`: its tiles' waves, kernels/gemm_tc.py); a view costs nothing. A kind's fixed time and share come from the lane table's `costs:` (issue 34 item 5:
    fitted per kind and rows' format, rules/lanes/cuda.yaml; kind_cost), else 0 and the whole bandwidth."""
    total = 0.0
    own = getattr(l, "link_us", None)  # a collective: no kernel of its own, its link's time (kernels/collective.py)
    if own is not None:
        total += own(knobs)
    for k in l.kernels():
        c = kind_cost(k, costs) if costs else None
        mem = k.bytes() / (knobs.hbm_gbps * (c.bandwidth if c else 1.0) * 1e3)
        rate = getattr(k, "rate", None)  # a tensor-core product's own (kernels/gemm_tc.py, gemm_blas.py)
        peak = rate(knobs) if rate else knobs.tflops_tc if getattr(k, "tensor_cores", False) else knobs.tflops_f32
        comp = k.flops() / (peak * 1e6)
        gaps = getattr(k, "device_launches", None)  # a tensor-core product's kernels and cuBLAS calls (gemm_tc.py)
        own = k.call_us(knobs) if gaps else 0.0
        total += knobs.launch_us * (gaps() if gaps else 1) + own + (c.fixed_us * knobs.fixed_scale if c else 0.0) + \
            max(mem, comp)
    return total


@dataclass
class Shim:
    g: Graph
    table: LaneTable
    knobs: Knobs = field(default_factory=Knobs)
    held_steps: frozenset[str] = frozenset()

    def __post_init__(self):
        self.link = Link(self.g, self.table, self.held_steps, knobs=self.knobs)
        self._cache: dict = {}
        self._sigs: dict = {"\0tables": frozenset(self.g.io.tables)}

    def support(self, cls: str):
        return self.table.support(cls)

    def launches(self, op: Op) -> list | Refusal:
        """`op`'s launches with the schedule's settings, or why the lane cannot run it."""
        linked = self.link.op(op)
        if isinstance(linked, Refusal):
            return linked
        tuned = [x.launch.tune(self.knobs, self.held_steps) for x in linked]
        if "sequences" in self.held_steps:  # a batch's launches one a sequence
            tuned = [k for l in tuned for k in l.apart()]
        return tuned

    def cost(self, op: Op, g: Graph | None = None) -> float | Refusal:
        """The engine's cost function: microseconds, or a Refusal with the reason."""
        key = _key(op, self.g, self._sigs)
        hit = self._cache.get(key)
        if hit is not None:
            return Refusal(hit.reason, where_of(op)) if isinstance(hit, Refusal) else hit
        launches = self.launches(op)
        if isinstance(launches, Refusal):
            self._cache[key] = Refusal(launches.reason)  # ops of one shape share the reason, not the names
            return Refusal(launches.reason, where_of(op))
        v = sum(launch_us(l, self.knobs, self.table.costs) for l in launches)
        if not op.fused and op.kind == "argmax" and op.out == self.g.io.next:
            v += self.knobs.launch_us  # without its advance, the token and position take a launch of their own
        self._cache[key] = v
        return v

    __call__ = cost


def _sig(g: Graph, name: str, tables: frozenset):
    c = g.constants.get(name)
    if c is not None:
        return ("c", c.shape, c.kind, c.format)
    t = g.tensors.get(name)
    return ("t", t.shape, t.dtype, name in tables) if t is not None else ("?", name)


_NAME = ("name",)  # where a bound value is a tensor name (a tuple: tuple values never enter a key)


def _shape(o: Op, memo: dict) -> tuple[int, list[str]]:
    """An op's structure without its names (interned as a small number, so keys hash cheaply), and the names it
    touches in a fixed order; a part's are kept (the parts of every fused op are the step graph's own ops, shared by
    every alternative that computes them)."""
    hit = memo.get(id(o))
    if hit is not None and hit[0] is o:
        return hit[1], hit[2]
    names = []
    binds = []
    for a, v in o.binds:
        if isinstance(v, tuple):
            continue
        if isinstance(v, str):
            names.append(v)
            v = _NAME
        binds.append((a, v))
    names += o.ins
    names.append(o.out)
    names += o.keeps
    parts = []
    for p in o.parts:
        ps, pn = _shape(p, memo)
        parts.append(ps)
        names += pn
    struct = (o.kind, o.cls, o.rule, o.attrs, o.access, len(o.ins), len(o.keeps), o.dst is not None, tuple(binds),
              tuple(parts))  # an access names no tensor: the part of every unit read is what the launch can take
    interned = memo.setdefault("\0structs", {})
    sid = interned.setdefault(struct, len(interned))
    memo[id(o)] = (o, sid, names)
    return sid, names


def _key(op: Op, g: Graph, sigs: dict):
    """Ops of one shape cost the same (every layer's): the key keeps the structure and shapes, not the names — each
    name as its place among the op's distinct names (which inputs are the same tensor matters) and their
    signatures."""
    struct, names = _shape(op, sigs.setdefault("\0ops", {}))
    distinct = dict.fromkeys(names)  # in order of first use: a name's place is its index here
    place = {x: i for i, x in enumerate(distinct)}
    pattern = tuple(map(place.__getitem__, names))
    shapes = list(map(sigs.get, distinct))
    if None in shapes:  # a name not seen before: its signature interned
        interned = sigs.setdefault("\0sigs", {})
        for i, x in enumerate(distinct):
            if shapes[i] is None:
                shapes[i] = sigs[x] = interned.setdefault(_sig(g, x, sigs["\0tables"]), len(interned))
    return struct, pattern, tuple(shapes)
