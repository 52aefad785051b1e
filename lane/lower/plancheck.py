"""A saved plan read back and checked before it runs: every record typed by its dataclass's fields (no unknown record
or field, ints that are ints), every buffer inside its home, the arena (aligned, inside its bytes, no two arrays live
at once overlapping, every lifetime covering its launches), each launch's own check and its reach into every tensor
it names. The first bad field is named; `planfile.load` adds the path."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Union, get_args, get_origin

from lanefuse.engine.errors import UserError, did_you_mean
from lanefuse.engine.ir import DTYPES  # f32, i32, and q8 / q8x2: a quantized activation's bytes

WHERE = ("arena", "io", "table", "scratch")


class Bad(UserError):
    """A plan's first bad field: where (a path into the record) and what is wrong there."""

    def __init__(self, where: str, what: str):
        super().__init__(f"{where}: {what}" if where else what)


def _show(x) -> str:
    r = repr(x)
    return r if len(r) <= 40 else r[:37] + "..."


# -- the typed decoding ------------------------------------------------------------------------------------------

class Decoder:
    """JSON to the plan's records, each value checked against its field's type."""

    def __init__(self, classes: dict[str, type]):
        from lanefuse.kernels import Launch

        self.classes = classes
        self.Launch = Launch
        self._hints: dict[type, dict[str, object]] = {}

    def hints(self, cls: type) -> dict[str, object]:
        h = self._hints.get(cls)
        if h is None:
            h = self._hints[cls] = typing.get_type_hints(cls)
        return h

    def record(self, x, want: type, where: str):
        if not isinstance(x, dict):
            raise Bad(where, f"expected a {want.__name__} record, got {_show(x)}")
        t = x.get("_t")
        if not isinstance(t, str):
            raise Bad(where, f"a record with no `_t` naming its kind (expected a {want.__name__})")
        cls = self.classes.get(t)
        if cls is None:
            hint = did_you_mean(t, [n for n, c in self.classes.items() if issubclass(c, want)])
            raise Bad(where, f"the plan names a launch or record `{t}` this lanefuse does not know{hint}")
        if not issubclass(cls, want):
            raise Bad(where, f"a {t} where a {want.__name__} goes")
        if issubclass(cls, self.Launch):
            where = f"{where} ({cls.census})" if where else cls.census
        fs = dataclasses.fields(cls)
        known = {f.name for f in fs}
        for k in x:
            if k != "_t" and k not in known:
                raise Bad(_at(where, k), f"a {t} has no field `{k}`{did_you_mean(k, known)}")
        hints = self.hints(cls)
        kw = {}
        for f in fs:
            if f.name not in x:
                raise Bad(where, f"the {t} has no `{f.name}`")
            kw[f.name] = self.value(x[f.name], hints[f.name], _at(where, f.name))
        if cls.__name__ == "Part" and kw["width"] < 1:
            raise Bad(_at(where, "width"), f"a part {kw['width']} values wide")
        try:
            return cls(**kw)
        except (TypeError, ValueError, UserError) as e:
            raise Bad(where, str(e)) from None

    def value(self, x, t, where: str):
        origin = get_origin(t)
        if origin in (Union, types.UnionType):
            args = get_args(t)
            if x is None and type(None) in args:
                return None
            others = [a for a in args if a is not type(None)]
            if len(others) == 1:
                return self.value(x, others[0], where)
            for a in others:  # str | int: the one the value is
                if a in (int, str, float, bool) and _is(x, a):
                    return x
            raise Bad(where, f"expected {_name(t)}, got {_show(x)}")
        if t is object:  # a Launched's launch, named by its place: `launches[3] (norm)`
            return self.record(x, self.Launch, where.removesuffix(".launch"))
        if t in (int, float, str, bool):
            if not _is(x, t):
                raise Bad(where, f"expected {_name(t)}, got {_show(x)}")
            return x
        if origin is tuple or origin is list:
            if not isinstance(x, list):
                raise Bad(where, f"expected a list, got {_show(x)}")
            args = get_args(t)
            if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
                if len(x) != len(args):
                    raise Bad(where, f"expected {len(args)} values, got {len(x)}")
                return tuple(self.value(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(x, args)))
            return tuple(self.value(v, args[0], f"{where}[{i}]") for i, v in enumerate(x))
        if origin is dict:
            if not isinstance(x, dict):
                raise Bad(where, f"expected a mapping, got {_show(x)}")
            _, vt = get_args(t)
            return {k: self.value(v, vt, f"{where}[{k!r}]") for k, v in x.items()}
        if t is list:  # the plan's counters: (launch, tag, bytes)
            if not isinstance(x, list):
                raise Bad(where, f"expected a list, got {_show(x)}")
            return tuple(self.value(v, tuple[int, str, int], f"{where}[{i}]") for i, v in enumerate(x))
        if t is dict:  # the plan's source: {"kind": ..., "path": ...}
            if not isinstance(x, dict) or not all(isinstance(v, str) for v in x.values()):
                raise Bad(where, f"expected a mapping of strings, got {_show(x)}")
            return dict(x)
        if isinstance(t, type):
            return self.record(x, t, where)
        raise Bad(where, f"a field of a type the plan reader does not know ({t})")  # a field added unread


def _at(where: str, field: str) -> str:
    return f"{where}.{field}" if where else field


def _is(x, t) -> bool:
    if t is int:
        return type(x) is int
    if t is float:
        return type(x) in (int, float) and math.isfinite(x)
    return type(x) is t


def _name(t) -> str:
    if get_origin(t) in (Union, types.UnionType):
        return " or ".join(_name(a) for a in get_args(t))
    return {int: "an integer", float: "a finite number", str: "a string", bool: "true or false",
            type(None): "null"}.get(t, getattr(t, "__name__", str(t)))


# -- the checks --------------------------------------------------------------------------------------------------

def check(p) -> None:
    """The decoded plan `p` checked whole; the first bad field raises `Bad`."""
    _names(p)
    _buffers(p)
    _launches(p)
    _outputs(p)
    _arena(p)


def _outputs(p) -> None:
    """Some launch writes each output of the step: a plan that computes no logits (or no next token) never runs."""
    home = {n: b.home for n, b in p.buffers.items()}
    written = {home.get(w, w) for x in p.launches for w in x.launch.writes()}
    for n, what in ((p.io.logits, "logits"), (p.io.next, "next token")):
        if home.get(n, n) not in written:
            raise Bad("launches", f"no launch writes `{n}`: a plan that computes no {what} is never run")


def _names(p) -> None:
    for field, table in (("tensors", p.tensors), ("constants", p.constants), ("buffers", p.buffers)):
        for k, v in table.items():
            if v.name != k:
                raise Bad(f"{field}[{k!r}].name", f"`{v.name}` filed under `{k}`")
    for k, t in p.tensors.items():
        if not t.shape or any(d < 1 for d in t.shape):
            raise Bad(f"tensors[{k!r}].shape", f"{list(t.shape)}: every dimension at least 1")
        if t.dtype not in DTYPES:
            raise Bad(f"tensors[{k!r}].dtype", f"`{t.dtype}` (one of {', '.join(DTYPES)})")
    from lanefuse.kernels.common import FORMATS

    for k, c in p.constants.items():
        if not c.shape or any(d < 1 for d in c.shape):
            raise Bad(f"constants[{k!r}].shape", f"{list(c.shape)}: every dimension at least 1")
        if c.kind not in ("rows", "values"):
            raise Bad(f"constants[{k!r}].kind", f"`{c.kind}` (rows or values)")
        if c.format not in FORMATS:
            raise Bad(f"constants[{k!r}].format", f"`{c.format}` (one of {', '.join(FORMATS)})")
        if k in p.tensors:
            raise Bad(f"constants[{k!r}]", "a constant that is also a tensor of the step")
    io = p.io
    for n in (*io.inputs, *io.outputs):
        if n not in p.tensors:
            raise Bad("io", f"`{n}` is not a tensor of the plan")
    if p.rows < 1:
        raise Bad("rows", f"{p.rows} (a step has at least 1 row)")
    if io.caches and p.tensors[io.caches[0][0]].shape[0] < p.rows:
        raise Bad("rows", f"a step of {p.rows} rows over a cache of {p.tensors[io.caches[0][0]].shape[0]}")


def _buffers(p) -> None:
    for name in p.tensors:
        if name not in p.buffers:
            raise Bad(f"buffers[{name!r}]", "a tensor of the step with no buffer")
    for k, b in p.buffers.items():
        at = f"buffers[{k!r}]"
        t = p.tensors.get(k)
        if t is None:
            raise Bad(at, f"a buffer of `{k}`, which is not a tensor of the plan")
        if b.size != t.size:
            raise Bad(f"{at}.size", f"{b.size} elements but `{k}` holds {t.size}")
        if b.dtype != t.dtype:
            raise Bad(f"{at}.dtype", f"`{b.dtype}` but `{k}` is {t.dtype}")
        if b.where not in WHERE:
            raise Bad(f"{at}.where", f"`{b.where}` (one of {', '.join(WHERE)})")
        h = p.buffers.get(b.home)
        if h is None:
            raise Bad(f"{at}.home", f"`{b.home}` is not a buffer of the plan")
        if h.home != h.name:
            raise Bad(f"{at}.home", f"`{b.home}` lives inside `{h.home}` itself (a home is its own home)")
        if b.where != h.where or b.dtype != h.dtype:
            raise Bad(f"{at}.where", f"{b.where} {b.dtype} inside `{b.home}`, which is {h.where} {h.dtype}")
        if b.offset < 0 or b.offset + b.size > h.size:
            raise Bad(f"{at}.offset", f"elements {b.offset}..{b.offset + b.size} past `{b.home}`'s {h.size}")
    io = p.io
    for n in (*io.inputs, *io.outputs):
        b = p.buffers[n]
        want = "table" if n in io.tables else "io"
        if b.where != want or b.home != n:
            raise Bad(f"buffers[{n!r}].where", f"the step's `{n}` must be a {want} buffer of its own")


def _launches(p) -> None:
    io = p.io
    top = p.tensors[io.caches[0][0]].shape[0] - p.rows if io.caches else 0
    if io.caches and p.batch > 1:  # a batch's: the last row of a sequence's slot
        top = p.tensors[io.caches[0][0]].shape[0] // p.batch - 1
    tokens = p.tensors[io.logits].shape[-1]
    for i, x in enumerate(p.launches):
        l = x.launch
        at = f"launches[{i}] ({l.census})"
        why = l.check()
        if why is not None:
            raise Bad(at, f"refused: {getattr(why, 'reason', why)}")
        ws = l.weights()
        named = set(l.reads()) | set(l.writes())
        for n in l.writes():
            if n not in p.buffers:
                raise Bad(at, f"writes `{n}`, which is not an array of the plan{did_you_mean(n, p.buffers)}")
            # the inputs a step advances for the next: its token and position, a sampled step's parameter words
            # (lane/run/sampling.py SampledIO.params: the draw's index moves on)
            advanced = (io.token, io.position, *getattr(io, "params", ()))
            if n in io.inputs and n not in io.tables and n not in advanced:
                raise Bad(at, f"writes the step's input `{n}`")
        for n in named:
            c = p.constants.get(n)
            if n in ws:
                fmt = ws[n]
                if c is None:
                    if fmt is None and n in p.buffers:
                        continue
                    raise Bad(at, f"reads `{n}` as a weight, but it is not a constant of the plan"
                                  f"{did_you_mean(n, p.constants)}")
                have = "f32" if c.kind == "values" else c.format
                if have != (fmt or "f32"):
                    raise Bad(at, f"reads `{n}` as {fmt or 'f32'} values but the plan holds it as {have}")
            elif n not in p.buffers:
                what = "a constant (an array goes there)" if c is not None else "not a tensor of the plan"
                raise Bad(at, f"names `{n}`, which is {what}{did_you_mean(n, p.buffers) if c is None else ''}")
        # a fold's pair each on its own, before the fold's merged reach (which would name the pair's first field on a
        # buffer both touch): one's full reach hides no other's
        for pre, sub in reversed(list(_launch_records(l))):
            for n, need in sub.extents(top, tokens).items():
                if n not in named:
                    raise Bad(at, f"reaches `{n}`, which it does not read or write")
                have = p.buffers[n].size if n in p.buffers else p.constants[n].size
                if need > have:
                    raise Bad(f"{at}{pre}.{_field(sub, n)}", f"{need} values of `{n}` reached but it holds {have}")
                if need != have and not _in_part(p, sub, n):  # sizes that disagree with the tensor: wrong numbers
                    did = "written" if n in sub.writes() else "read"
                    raise Bad(f"{at}{pre}.{_field(sub, n)}", f"{need} values {did} but `{n}` holds {have}")


def _launch_records(l, pre: str = ""):
    """(path, launch) for launch `l` and every launch among its fields (a fold's first and then), `l` first."""
    from lanefuse.kernels import Launch

    yield pre, l
    for f in dataclasses.fields(l):
        v = getattr(l, f.name)
        if isinstance(v, Launch):
            yield from _launch_records(v, f"{pre}.{f.name}")
        elif isinstance(v, tuple):  # a chain's phases
            for i, e in enumerate(v):
                if isinstance(e, Launch):
                    yield from _launch_records(e, f"{pre}.{f.name}[{i}]")


def _records(x):
    """Every record inside record `x`, itself first."""
    yield x
    for f in dataclasses.fields(x):
        v = getattr(x, f.name)
        for e in (v if isinstance(v, tuple) else (v,)):
            if dataclasses.is_dataclass(e) and not isinstance(e, type):
                yield from _records(e)


def _in_part(p, l, name: str) -> bool:
    """Whether launch `l` may reach only a part of `name` by design: a cache table or a step input, a values constant
    (the rope tables hold every position), a destination that places the result (rows of a table, parts of units),
    a read of a part of every unit, a column part of every row that fits the tensor's rows (`_column_parts`), or a
    field the kind declares `partial` (a slice's source, a view's). Everything else a launch reaches it reaches
    whole."""
    from lanefuse.kernels.common import Dst

    b, c = p.buffers.get(name), p.constants.get(name)
    if (b is not None and (b.where == "table" or name in p.io.inputs)) or (c is not None and c.kind == "values"):
        return True
    cols = _column_parts(p, l, name)
    if cols is not None:
        return cols
    if getattr(l, "slot", 0) and getattr(l, "rows", getattr(l, "count", p.batch)) < p.batch:
        return True  # one sequence of a batch apart (`sequences` held): its own rows only
    for r in _records(l):
        if isinstance(r, Dst) and r.buf == name and (r.row is not None or r.unit is not None):
            return True
        if getattr(r, "part", None) is not None and getattr(r, "x", None) == name:
            return True
        if any(getattr(r, f, None) == name for f in getattr(r, "partial", ())):
            return True
    return False


def _column_parts(p, l, name: str) -> bool | None:
    """Launch `l`'s reads of `name` as column parts — channels `xoff`..`xoff + chan` of each of the launch's `rows`
    rows of `xpitch` values (a convolution of a part of a wider product's rows: conv_parts' q, k and v of `qkvz`, its
    z unread) — each against `name`: True when every one lies inside a row and the rows are the tensor's own (`rows`
    rows of `xpitch` exactly, so the stride steps from row to row of it); False when one does not (a pitch or an
    offset that reads other values than the part: wrong numbers); None when `l` reads no column part of `name`."""
    parts = [(r, rows) for r, rows in _records_rows(l, getattr(l, "rows", None))
             if getattr(r, "x", None) == name and getattr(r, "xpitch", 0)]
    if not parts:
        return None
    b = p.buffers.get(name)
    t = p.tensors.get(name)
    if b is None or t is None:
        return False
    for r, rows in parts:
        pitch, off, width = r.xpitch, getattr(r, "xoff", 0), getattr(r, "chan", None)
        if not isinstance(rows, int) or not isinstance(width, int):
            return False
        if off < 0 or width < 1 or off + width > pitch or rows * pitch != b.size or t.shape[-1] != pitch:
            return False
    return True


def _records_rows(x, rows):
    """(record, the rows it runs over) for every record inside `x`, itself first: a record's own `rows`, else its
    launch's."""
    rows = getattr(x, "rows", rows)
    yield x, rows
    for f in dataclasses.fields(x):
        v = getattr(x, f.name)
        for e in (v if isinstance(v, tuple) else (v,)):
            if dataclasses.is_dataclass(e) and not isinstance(e, type):
                yield from _records_rows(e, rows)


def _field(l, name: str) -> str:
    """The first field of launch `l` naming `name` (its path), or the launch's sizes."""
    for f in dataclasses.fields(l):
        v = getattr(l, f.name)
        if v == name:
            return f.name
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            sub = _field(v, name)
            if sub:
                return f"{f.name}.{sub}"
        if isinstance(v, tuple):
            for j, e in enumerate(v):
                if e == name:
                    return f"{f.name}[{j}]"
                if dataclasses.is_dataclass(e) and not isinstance(e, type):
                    sub = _field(e, name)
                    if sub:
                        return f"{f.name}[{j}].{sub}"
    return ""


def _arena(p) -> None:
    from lanefuse.kernels import ALIGN
    from lanefuse.lane.lower.arena import aligned
    from lanefuse.lane.lower.buffers import NotWritten, lifetimes

    a = p.arena
    placed = a.by_name()
    if len(placed) != len(a.arrays):
        raise Bad("arena.arrays", "an array placed twice")
    n = len(p.launches)
    for j, q in enumerate(a.arrays):
        at = f"arena.arrays[{j}] ({q.name})"
        if q.offset < 0 or q.offset % ALIGN:
            raise Bad(f"{at}.offset", f"{q.offset} is not a multiple of {ALIGN} (the arena's alignment)")
        if q.bytes < 0 or q.offset + q.bytes > a.bytes:
            raise Bad(f"{at}.offset", f"bytes {q.offset}..{q.offset + q.bytes} past the arena's {a.bytes}")
        if not 0 <= q.first <= q.last < n:
            raise Bad(f"{at}.first", f"a lifetime {q.first}..{q.last} outside the plan's {n} launches")
    try:
        lives = lifetimes([x.launch for x in p.launches], p.buffers)
    except NotWritten as e:
        raise Bad(f"launches[{e.launch}]", str(e)) from None
    for live in lives:
        q = placed.get(live.name)
        if q is None:
            raise Bad("arena.arrays", f"`{live.name}` is not placed (launches {live.first}..{live.last} use it)")
        if q.bytes < live.bytes:
            raise Bad(f"arena.arrays[{a.arrays.index(q)}] ({q.name}).bytes", f"{q.bytes} for {live.bytes} bytes")
        if q.first > live.first or q.last < live.last:
            raise Bad(f"arena.arrays[{a.arrays.index(q)}] ({q.name}).last",
                      f"a lifetime {q.first}..{q.last} but launches {live.first}..{live.last} use it")
    if not 0 <= a.lower_bound <= a.bytes:
        raise Bad("arena.lower_bound", f"{a.lower_bound} for an arena of {a.bytes} bytes")
    if a.bytes > sum(aligned(q.bytes) for q in a.arrays):
        raise Bad("arena.bytes", f"{a.bytes}: more than all its arrays side by side")
    # no two arrays live at one launch overlapping: at each launch, the live arrays by offset, each clear of the next
    alive: dict[int, list] = {}
    for q in a.arrays:
        for t in range(q.first, q.last + 1):
            alive.setdefault(t, []).append(q)
    for t, qs in alive.items():
        qs.sort(key=lambda q: (q.offset, q.offset + q.bytes))
        end, prev = -1, None
        for q in qs:
            if q.bytes and prev is not None and q.offset < end:
                raise Bad(f"arena.arrays[{a.arrays.index(q)}] ({q.name}).offset",
                          f"bytes {q.offset}..{q.offset + q.bytes} overlap `{prev.name}` "
                          f"({prev.offset}..{prev.offset + prev.bytes}), both live at launch {t}")
            if q.bytes and q.offset + q.bytes > end:
                end, prev = q.offset + q.bytes, q
