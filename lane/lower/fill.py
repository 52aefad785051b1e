"""The lane table's field language: how an op's inputs, attributes and pattern bindings fill a launch's fields.

A field's value is a literal (number, true/false, null), a name (an op input, an attribute, a rule's pattern
variable, `out`), or one call from a closed set of named functions (`FUNCS`): `rows(t)`, `cols(t)`, `format(w)`,
`dst(t)`, `into(t)`, `part(x)`, `norm(w, eps)`, ... A nested mapping with a `launch:` key is a launch of its own (the
parts of a fold).

An op's input read as a part of every unit of a wider tensor (its access) is taken by a field through `part(x)`,
`pitch(x)` or `offset(x)` — by the input's name, so two inputs of one tensor (keys and values in one cache row) stay
apart; the link refuses an op whose fields leave a strided read untaken (`Scope.untaken`)."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from lanefuse.engine.errors import UserError, did_you_mean
from lanefuse.kernels.common import Dst, Part
from lanefuse.lane.lower.buffers import WORDS

_CALL = re.compile(r"^([a-z_][a-z0-9_]*)\((.*)\)$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


@dataclass(frozen=True)
class Strided:
    """One input an op reads as a part of every unit of a wider tensor: the lifted op (its result) and the input's
    place among its inputs, the input's name in its kind's definition, the tensor, the part."""

    op: str
    index: int
    input: str
    tensor: str
    part: Part

    def __str__(self) -> str:
        p = self.part
        of = f" of `{self.tensor}`" if self.tensor != self.input else ""
        return f"`{self.input}` ({p.width} of every {p.pitch} values from {p.offset}{of})"


@dataclass
class Scope:
    """What a field expression may read: names -> tensor names or attribute values; the graph; placements; the
    op's strided reads, and which of them the fields took."""

    names: dict[str, Any]
    g: Any  # the optimized Graph
    placed: dict[str, Dst] = field(default_factory=dict)  # tensor -> where a row write absorbed into this op puts it
    strided: tuple[Strided, ...] = ()  # every input the op reads as a part of every unit of a wider tensor
    via: dict[str, tuple[int, ...]] = field(default_factory=dict)  # a name -> the strided reads it stands for
    where: str = ""  # for messages: the lane table entry
    leaves: tuple = ()  # a fused op's lifted parts, in order
    taken: set[int] = field(default_factory=set)  # the strided reads a field took (by place in `strided`)
    wrote: set[str] = field(default_factory=set)  # the tensors a field placed (`dst`, `into`)
    copied: Callable[[], frozenset[str]] = frozenset  # the graph's views taken as copies (worked out once a graph)
    knobs: Any = None  # the lane's knobs (lane/lower/knobs.py) where the link has them

    def take(self, name: str) -> Part | None:
        """The part of every unit the op reads through `name` (an input's name, a pattern variable), or None where
        it reads it whole; the reads it stands for count as taken."""
        if name in self.names:
            ks = self.via.get(name, ())
        else:  # an expression giving a tensor: every read of that tensor
            t = evaluate(name, self)
            ks = tuple(k for k, r in enumerate(self.strided) if r.tensor == t)
        if not ks:
            return None
        part = self.strided[ks[0]].part
        self.taken.update(k for k in ks if self.strided[k].part == part)  # a tensor read in two ways stays untaken
        return part

    def take_read(self, leaf, i: int) -> Part | None:
        """The part lifted op `leaf` reads its input `i` through, taken (a hook's own field)."""
        for k, r in enumerate(self.strided):
            if r.op == leaf.out and r.index == i:
                self.taken.add(k)
                return r.part
        return None

    def take_all(self, op) -> None:
        """Every strided read of `op`'s lifted ops taken (a part the link linked, and checked, on its own)."""
        outs = {leaf.out for leaf in op.leaves()}
        self.taken.update(k for k, r in enumerate(self.strided) if r.op in outs)

    def untaken(self) -> list[Strided]:
        return [r for k, r in enumerate(self.strided) if k not in self.taken]

    def dst(self, t: str) -> Dst:
        """Where the op writes tensor t: a placement's destination, or t's own buffer."""
        self.wrote.add(t)
        return self.placed.get(t) or Dst(t)


def _tensor(s: Scope, v) -> str:
    if not isinstance(v, str):
        raise UserError(f"{s.where}: expected a tensor, got {v!r}")
    return v


def _shape(s: Scope, t: str) -> tuple[int, ...]:
    return s.g.shape(t)


def _rows(s, t):
    if t is None:  # an optional variable the rule did not bind (`rows(sg?)`)
        return 0
    sh = _shape(s, _tensor(s, t))
    return sh[0] if len(sh) == 2 else 1


def _cols(s, t):
    return _shape(s, _tensor(s, t))[-1]


def _size(s, t):
    n = 1
    for d in _shape(s, _tensor(s, t)):
        n *= d
    return n


def _format(s, t):
    if t is None:  # an optional variable the rule did not bind (`format(sg?)`)
        return None
    c = s.g.constants.get(_tensor(s, t))
    if c is None:
        return None
    return c.format if c.kind == "rows" else "f32"


def _words(s, t):
    """The int8 words a value of quantized activation t (q8 1, q8x2 2); 0 for an f32 tensor or none (null)."""
    return 0 if t is None else WORDS.get(s.g.dtype(_tensor(s, t)), 0)


def _stored(s, t, q=None):
    """Whether the op stores tensor t's f32 values: always where it quantizes nothing (q null); else only where an op
    other than this one reads t (a view of t included) or t is a step output. Where only the projections read t,
    through its quantized form q, the op writes q alone (the seed's only_projections), unless q is the q8k form,
    which its producer's epilogue quantizes from the stored values."""
    if q is None or _words(s, q) == 3:  # the q8_K form is quantized from the stored row (a warp a block of 256)
        return True
    t = _tensor(s, t)
    return t in s.g.io.outputs or any(t in op.ins for op in s.g.ops)


def _is_values(s, t):
    c = s.g.constants.get(_tensor(s, t))
    return c is not None and c.kind == "values"


def _dst(s, t):
    """Where the op writes tensor t: the table row a row write absorbed into this op names, or t's own buffer."""
    return s.dst(_tensor(s, t))


def _into(s, t):
    """Like dst, but None for the own buffer (a norm's `into`)."""
    t = _tensor(s, t)
    s.wrote.add(t)
    return s.placed.get(t)


def _part(s, name):
    """The part of every unit the op reads its input `name` as; None where it reads it whole."""
    return s.take(name)


def _pitch(s, name):
    """The pitch of the units the op reads its input `name` from (0 where it reads it whole)."""
    p = s.take(name)
    return 0 if p is None else p.pitch


def _offset(s, name):
    """Where in each unit the op's input `name` starts (0 where it reads it whole)."""
    p = s.take(name)
    return 0 if p is None else p.offset


def _copied(s, t):
    """Whether view t is taken as a copy: its tensor is written in place after it and before its last reader."""
    return _tensor(s, t) in s.copied()


def _norm(s, w, eps):
    return None if w is None else (_tensor(s, w), float(eps))


def _gate(s, t, act):
    """What an attention's output is gated by: (the gate tensor, its activation), or null where the rule binds none."""
    return None if t is None else (_tensor(s, t), str(act))


def _prenorm(s, w, eps):
    """The norm a norm launch takes of its added operand first (the sandwich), or null where the rule binds none."""
    from lanefuse.kernels.norm import PreNorm

    return None if w is None else PreNorm(_tensor(s, w), float(eps))


def _is_rows(s, t):
    c = s.g.constants.get(t) if isinstance(t, str) else None
    return c is not None and c.kind == "rows"


def _is_computed(s, t):
    return isinstance(t, str) and t not in s.g.constants


def _bcast(s, b, a):
    """b's length when it is one row broadcast over a's rows; 0 when b has a's size."""
    sb, sa = _shape(s, _tensor(s, b)), _shape(s, _tensor(s, a))
    if sb == sa or _each(s, b, a):
        return 0
    return sb[-1]


def _each(s, b, a):
    """a's row width when b is one value a row of a ((R, 1) against (R, n)); 0 otherwise."""
    sb, sa = _shape(s, _tensor(s, b)), _shape(s, _tensor(s, a))
    return sa[-1] if len(sb) == 2 and len(sa) == 2 and sb == (sa[0], 1) and sa[-1] != 1 else 0


def _leaf(s, kind, nth=0):
    """The output of the fused op's nth lifted part of `kind` (an intermediate its rule does not bind)."""
    found = [p.out for p in s.leaves if p.kind == kind]
    if len(found) <= nth:
        raise UserError(f"{s.where}: the fused op has no part `{kind}` #{nth}")
    return found[nth]


def _advance(s):
    from lanefuse.kernels import Advance

    return Advance(s.g.io.token, s.g.io.position)


def _pos(s):
    return s.g.io.position


def _token(s):
    return s.g.io.token


def _tensor_cores(s, x):
    """Whether a product of activation x runs on the tensor cores: the `tc_rows` knob set, x of at least that many rows
    (and kernels/gemm_tc.py's MIN_ROWS) and f32 (not a quantized activation)."""
    from lanefuse.kernels.gemm_tc import MIN_ROWS

    k = s.knobs
    if k is None or not getattr(k, "tc_rows", 0) or _words(s, x):
        return False
    return _rows(s, x) >= max(k.tc_rows, MIN_ROWS)


def _tensor_core_attention(s, q, hd, vd):
    """Whether a chunk's attention over queries q runs on the tensor cores (attention_tc): the `tc_attn_rows` knob
    set, q of at least that many rows (and 16), heads of at most 128 values, q f32 (not quantized)."""
    from lanefuse.kernels.attention_tc import MAX_D, MIN_ROWS

    k = s.knobs
    if k is None or not getattr(k, "tc_attn_rows", 0) or _words(s, q) or max(hd, vd) > MAX_D:
        return False
    return _rows(s, q) >= max(k.tc_attn_rows, MIN_ROWS)


def _mul(s, a, b):
    return a * b


def _div(s, a, b):
    return a // b


FUNCS: dict[str, Callable] = {
    "rows": _rows, "cols": _cols, "size": _size, "format": _format, "is_values": _is_values, "dst": _dst,
    "into": _into, "part": _part, "pitch": _pitch, "offset": _offset, "norm": _norm, "gate": _gate, "prenorm": _prenorm, "pos": _pos,
    "token": _token, "mul": _mul, "div": _div, "is_computed": _is_computed, "is_rows": _is_rows, "leaf": _leaf,
    "bcast": _bcast, "each": _each,
    "advance": _advance, "copied": _copied, "words": _words, "stored": _stored, "tensor_cores": _tensor_cores,
    "tensor_core_attention": _tensor_core_attention,
}
READS = ("part", "pitch", "offset")  # functions of an input's read, given the input's name, not its tensor


def _split_args(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


@functools.lru_cache(maxsize=4096)
def _parse(e: str) -> tuple:
    """A field expression's form, parsed once a text (every launch of every plan evaluates the same few hundred):
    ("call", function, its argument texts), ("str", s), ("opt", name), ("name", name), ("num", value) or ("bad",)."""
    e = e.strip()
    m = _CALL.match(e)
    if m:
        return "call", m.group(1), tuple(_split_args(m.group(2)))
    if e.startswith("'") and e.endswith("'"):
        return "str", e[1:-1]
    if e.endswith("?") and _NAME.match(e[:-1]):
        return "opt", e[:-1]
    if _NAME.match(e):
        return "name", e
    try:
        return "num", int(e)
    except ValueError:
        try:
            return "num", float(e)
        except ValueError:
            return ("bad",)


def evaluate(expr: Any, s: Scope) -> Any:
    """The value of one field expression in scope `s`."""
    if expr is None or isinstance(expr, (bool, int, float)):
        return expr
    if isinstance(expr, list):
        return tuple(evaluate(e, s) for e in expr)
    if not isinstance(expr, str):
        raise UserError(f"{s.where}: cannot read field expression {expr!r}")
    form = _parse(expr)
    how = form[0]
    if how == "call":
        name, raw = form[1], form[2]
        fn = FUNCS.get(name)
        if fn is None:
            hint = did_you_mean(name, FUNCS)
            raise UserError(f"{s.where}: unknown field function `{name}`{hint}; known: {', '.join(sorted(FUNCS))}")
        if name in READS:
            if len(raw) != 1:
                raise UserError(f"{s.where}: `{name}` takes one input, got {expr!r}")
            evaluate(raw[0], s)  # an unknown name is the usual error
            return fn(s, raw[0])
        args = [evaluate(a, s) for a in raw]
        return fn(s, *args)
    if how == "str" or how == "num":
        return form[1]
    if how == "opt":
        return s.names.get(form[1])  # an optional input or variable: None where the op has none
    if how == "name":
        e = form[1]
        if e not in s.names:
            raise UserError(f"{s.where}: `{e}` names no input, attribute or pattern variable here "
                            f"(have: {', '.join(sorted(s.names))})")
        return s.names[e]
    raise UserError(f"{s.where}: cannot read field expression {expr!r}")


def check_expr(expr: Any, where: str) -> None:
    """Parse-only check of a field expression: the functions it calls exist."""
    if isinstance(expr, str):
        m = _CALL.match(expr.strip())
        if m:
            if m.group(1) not in FUNCS:
                raise UserError(f"{where}: unknown field function `{m.group(1)}`; known: {', '.join(sorted(FUNCS))}")
            for a in _split_args(m.group(2)):
                check_expr(a, where)


def names_read(expr: Any) -> list[tuple[str, bool]]:
    """The names a field expression reads, each with whether it is optional (`v?`); a quoted string, a number and a
    function's own name are no names."""
    if isinstance(expr, list):
        return [n for e in expr for n in names_read(e)]
    if not isinstance(expr, str):
        return []
    e = expr.strip()
    m = _CALL.match(e)
    if m:
        return [n for a in _split_args(m.group(2)) for n in names_read(a)]
    if e.endswith("?") and _NAME.match(e[:-1]):
        return [(e[:-1], True)]
    if _NAME.match(e):
        return [(e, False)]
    return []
