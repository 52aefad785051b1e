"""Tables that pipe: on a terminal, rich's boxed tables at the terminal's width; into a pipe or a file, plain rows
at their full width, never wrapped at 80 columns (grep, less, CI logs and copy-paste see whole names)."""

from __future__ import annotations

import sys

WIDE = 100_000  # a pipe's width: wide enough that no line wraps; tables keep their natural width


def tty(stream=None) -> bool:
    s = stream or sys.stdout
    return hasattr(s, "isatty") and s.isatty()


def console(stream=None):
    from rich.console import Console

    return Console(file=stream, width=None if tty(stream) else WIDE, highlight=False)


def table(title: str | None = None, stream=None, **kw):
    """A rich Table: boxed on a terminal, plain rows (no box, no wrapping) elsewhere."""
    from rich.table import Table

    if not tty(stream):
        kw.setdefault("box", None)
    return Table(title=title, header_style="bold", **kw)
