"""Reading a user's YAML file safely, for every table loader (rules, classes, lanes, step YAMLs, plan specs): its bytes
decoded as UTF-8 (a bad byte is an error naming the file and line), anchors and aliases allowed but what aliases add
to the document capped before it is built (an alias bomb is refused, not expanded), and `short()` to echo any value
of it in a message at a bounded length."""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any

import yaml

from lanefuse.engine.errors import UserError
from lanefuse.engine.userfile import read_capped

SAFE = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # yaml's safe loader, in C where libyaml is present
MAX_ALIAS_NODES = 100_000  # the nodes aliases may add to a document, expanded (the shared lane tables add a few dozen)

_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60
_short.maxlist = _short.maxtuple = _short.maxdict = _short.maxset = 6
_short.maxlevel = 3


def short(v: Any) -> str:
    """`v` as an error message may echo it: a repr cut to a few dozen characters (a value read from a user's file
    may be any size)."""
    return _short.repr(v)


def read_text(path, source: str | None = None, what: str = "", cap: int | None = None, pipes: bool = False) -> str:
    """The text of `path` as UTF-8, at most `cap` bytes of it (engine/userfile.py: a regular file unless `pipes`);
    an unreadable file, a larger one or a byte that is not UTF-8 is a `UserError` naming `source` (the path as given
    by default) and, for a bad byte, its line."""
    source = str(path) if source is None else source
    from lanefuse.engine import userfile

    data = read_capped(path, userfile.MAX_YAML if cap is None else cap, what or "a YAML file", pipes=pipes,
                       source=source)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise UserError(f"{source}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); save the "
                        f"file as UTF-8") from None


def _children(node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for kv in node.value for n in kv]
    return []


def _check_aliases(root, source: str) -> None:
    """Refuse a document whose aliases, expanded, would add more than MAX_ALIAS_NODES nodes, or that contains itself.
    The node tree shares an aliased node; its expanded size is worked out once per node, without expanding it."""
    size: dict[int, int] = {}
    state: dict[int, int] = {}  # 1: being visited (its subtree is on the stack), 2: done
    unique = 0
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        k = id(node)
        if done:
            size[k] = 1 + sum(size[id(c)] for c in _children(node))
            state[k] = 2
            if size[k] - unique > MAX_ALIAS_NODES:
                line = node.start_mark.line + 1
                raise UserError(f"{source}:{line}: its aliases (`*name`) expand the document past "
                                f"{MAX_ALIAS_NODES:,} more nodes; write the values out or use fewer aliases")
            continue
        st = state.get(k)
        if st == 2:
            continue
        if st == 1:
            raise UserError(f"{source}:{node.start_mark.line + 1}: an alias (`*name`) refers to a value that contains "
                            f"it (a recursive document); write the value out")
        state[k] = 1
        unique += 1
        stack.append((node, True))
        for c in _children(node):
            if state.get(id(c)) != 2:
                stack.append((c, False))


def load_text(text: str, source: str, loader=SAFE, what: str = "") -> tuple[Any, Any]:
    """The document's node tree (for line numbers) and its data, parsed once by a safe `loader` (a SafeLoader class,
    which may add constructors); bad syntax, an unknown tag or an alias bomb is a `UserError` citing `source` and the
    line. `what` names the file's kind in the message (`the plan file`)."""
    ld = loader(text)
    try:
        try:
            root = ld.get_single_node()
            if root is None:
                return None, None
            if "&" in text:  # no anchor, no alias (an alias to no anchor is a syntax error)
                _check_aliases(root, source)
            return root, ld.construct_document(root)
        finally:
            ld.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{where}: not valid YAML{' in ' + what if what else ''}: {problem}; fix the syntax "
                        f"there") from None
    except RecursionError:
        raise UserError(f"{source}: the YAML is nested too deep; flatten it") from None


def load_file(path, source: str | None = None, loader=SAFE, what: str = "") -> Any:
    """The data of the YAML file `path` (see `load_text`), errors citing `source` (the path by default)."""
    source = str(path) if source is None else source
    return load_text(read_text(path, source, what), source, loader, what)[1]
