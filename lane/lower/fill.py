"""The lane table's field language: how an op's inputs, attributes and pattern bindings fill a launch's fields.

A field's value is a literal (number, true/false, null), a name (an op input, an attribute, a rule's pattern
variable, `out`), or one call from a closed set of named functions (`FUNCS`): `rows(t)`, `cols(t)`, `format(w)`,
`dst(t)`, `into(t)`, `part(t)`, `norm(w, eps)`, ... A nested mapping with a `launch:` key is a launch of its own (the
parts of a fold)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from lanefuse.engine.errors import UserError, did_you_mean
from lanefuse.kernels.common import Dst, Part

_CALL = re.compile(r"^([a-z_][a-z0-9_]*)\((.*)\)$")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


@dataclass
class Scope:
    """What a field expression may read: names -> tensor names or attribute values; the graph; placements."""

    names: dict[str, Any]
    g: Any  # the optimized Graph
    placed: dict[str, Dst] = field(default_factory=dict)  # tensor -> where a row write absorbed into this op puts it
    access: dict[str, Part] = field(default_factory=dict)  # tensor -> the part of every unit this op reads of it
    where: str = ""  # for messages: the lane table entry
    leaves: tuple = ()  # a fused op's lifted parts, in order


def _tensor(s: Scope, v) -> str:
    if not isinstance(v, str):
        raise UserError(f"{s.where}: expected a tensor, got {v!r}")
    return v


def _shape(s: Scope, t: str) -> tuple[int, ...]:
    return s.g.shape(t)


def _rows(s, t):
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
    c = s.g.constants.get(_tensor(s, t))
    if c is None:
        return None
    return c.format if c.kind == "rows" else "f32"


def _is_values(s, t):
    c = s.g.constants.get(_tensor(s, t))
    return c is not None and c.kind == "values"


def _dst(s, t):
    """Where the op writes tensor t: the table row a row write absorbed into this op names, or t's own buffer."""
    t = _tensor(s, t)
    return s.placed.get(t) or Dst(t)


def _into(s, t):
    """Like dst, but None for the own buffer (a norm's `into`)."""
    return s.placed.get(_tensor(s, t))


def _part(s, t):
    return s.access.get(_tensor(s, t)) if isinstance(t, str) else None


def _norm(s, w, eps):
    return None if w is None else (_tensor(s, w), float(eps))


def _is_rows(s, t):
    c = s.g.constants.get(t) if isinstance(t, str) else None
    return c is not None and c.kind == "rows"


def _is_computed(s, t):
    return isinstance(t, str) and t not in s.g.constants


def _bcast(s, b, a):
    """b's length when it is one row broadcast over a's rows; 0 when b has a's size."""
    sb, sa = _shape(s, _tensor(s, b)), _shape(s, _tensor(s, a))
    if sb == sa:
        return 0
    return sb[-1]


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


def _mul(s, a, b):
    return a * b


def _div(s, a, b):
    return a // b


FUNCS: dict[str, Callable] = {
    "rows": _rows, "cols": _cols, "size": _size, "format": _format, "is_values": _is_values, "dst": _dst,
    "into": _into, "part": _part, "norm": _norm, "pos": _pos, "token": _token, "mul": _mul, "div": _div,
    "is_computed": _is_computed, "is_rows": _is_rows, "leaf": _leaf, "bcast": _bcast, "advance": _advance,
}


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


def evaluate(expr: Any, s: Scope) -> Any:
    """The value of one field expression in scope `s`."""
    if expr is None or isinstance(expr, (bool, int, float)):
        return expr
    if isinstance(expr, list):
        return tuple(evaluate(e, s) for e in expr)
    if not isinstance(expr, str):
        raise UserError(f"{s.where}: cannot read field expression {expr!r}")
    e = expr.strip()
    m = _CALL.match(e)
    if m:
        fn = FUNCS.get(m.group(1))
        if fn is None:
            hint = did_you_mean(m.group(1), FUNCS)
            raise UserError(f"{s.where}: unknown field function `{m.group(1)}`{hint}; known: {', '.join(sorted(FUNCS))}")
        args = [evaluate(a, s) for a in _split_args(m.group(2))]
        return fn(s, *args)
    if e.startswith("'") and e.endswith("'"):
        return e[1:-1]
    if e.endswith("?") and _NAME.match(e[:-1]):
        return s.names.get(e[:-1])  # an optional input or variable: None where the op has none
    if _NAME.match(e):
        if e not in s.names:
            raise UserError(f"{s.where}: `{e}` names no input, attribute or pattern variable here "
                            f"(have: {', '.join(sorted(s.names))})")
        return s.names[e]
    try:
        return int(e)
    except ValueError:
        try:
            return float(e)
        except ValueError:
            raise UserError(f"{s.where}: cannot read field expression {expr!r}") from None


def check_expr(expr: Any, where: str) -> None:
    """Parse-only check of a field expression: the functions it calls exist."""
    if isinstance(expr, str):
        m = _CALL.match(expr.strip())
        if m:
            if m.group(1) not in FUNCS:
                raise UserError(f"{where}: unknown field function `{m.group(1)}`; known: {', '.join(sorted(FUNCS))}")
            for a in _split_args(m.group(2)):
                check_expr(a, where)
