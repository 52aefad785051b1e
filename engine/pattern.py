"""One pattern entry of a rule, parsed from its text: `kind(arg, name=arg)`, where `kind` may list alternatives
(`matmul|gemm_bias`) and each arg is a variable, `_`, or a literal (int, float, quoted string)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_HEAD = re.compile(r"^\s*([A-Za-z_][\w.]*(?:\s*\|\s*[A-Za-z_][\w.]*)*)\s*\((.*)\)\s*$", re.S)
_IDENT = re.compile(r"^[A-Za-z_][\w.]*$")
_KW = re.compile(r"^([A-Za-z_]\w*)\s*=\s*(.+)$", re.S)


@dataclass(frozen=True)
class Arg:
    """A variable (`var`) or a literal value (`lit`); `_` is a variable no other entry can name."""

    var: str | None = None
    lit: Any = None

    def __str__(self) -> str:
        return self.var if self.var is not None else repr(self.lit)


@dataclass(frozen=True)
class Item:
    """`var: kinds(pos..., kw=...)` — the op (or fused class) that produces `var`."""

    var: str
    kinds: tuple[str, ...]
    pos: tuple[Arg, ...]
    kw: tuple[tuple[str, Arg], ...]
    text: str


class PatternError(ValueError):
    pass


def _cut(text, n: int = 80) -> str:
    """A pattern's text as a message cites it: at most `n` characters (the file may hold any size of string)."""
    text = str(text)
    return text if len(text) <= n else text[:n - 3] + "..."


def _arg(text: str) -> Arg:
    t = text.strip()
    if _IDENT.match(t):
        if t in ("true", "false"):
            return Arg(lit=t == "true")
        return Arg(var=t)
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "\"'":
        return Arg(lit=t[1:-1])
    try:
        return Arg(lit=int(t))
    except ValueError:
        pass
    try:
        return Arg(lit=float(t))
    except ValueError:
        raise PatternError(f"`{_cut(t)}` is neither a variable nor a literal") from None


def _split(body: str) -> list[str]:
    parts, depth, quote, cur = [], 0, None, []
    for ch in body:
        if quote:
            cur.append(ch)
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
            cur.append(ch)
        elif ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            depth += ch == "("
            depth -= ch == ")"
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return parts


def parse_item(var: str, text: str) -> Item:
    if not _IDENT.match(var) or "." in var:
        raise PatternError(f"pattern variable `{_cut(var)}` is not a name (letters, digits, `_`)")
    m = _HEAD.match(str(text))
    if not m:
        raise PatternError(f"`{_cut(text)}` is not `kind(args)`; write e.g. `rmsnorm(s, w, eps=eps)`")
    kinds = tuple(k.strip() for k in m.group(1).split("|"))
    pos: list[Arg] = []
    kw: list[tuple[str, Arg]] = []
    for piece in _split(m.group(2)):
        km = _KW.match(piece.strip())
        if km:
            if any(k == km.group(1) for k, _ in kw):
                raise PatternError(f"`{km.group(1)}=` is given twice in `{_cut(text)}`")
            kw.append((km.group(1), _arg(km.group(2))))
        else:
            if kw:
                raise PatternError(f"a positional argument after a keyword one in `{_cut(text)}`")
            pos.append(_arg(piece))
    return Item(var, kinds, tuple(pos), tuple(kw), str(text))


def parse_call(text: str) -> tuple[str, tuple[Arg, ...]]:
    """A guard's text, `name(arg, ...)`."""
    m = _HEAD.match(str(text))
    if not m or "|" in m.group(1):
        raise PatternError(f"guard `{_cut(text)}` is not `name(args)`; write e.g. `single_reader(s)`")
    return m.group(1).strip(), tuple(_arg(p) for p in _split(m.group(2)))
