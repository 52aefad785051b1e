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

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            """rich ends the process with exit 1 when the reader of stdout goes away; `lanefuse plan | head -5`
            ends quietly with 0, as `git log | head` does (main() catches this)."""
            self.quiet = True
            raise BrokenPipeError

    return _Console(file=stream, width=None if tty(stream) else WIDE, highlight=False)


def table(title: str | None = None, stream=None, **kw):
    """A rich Table: boxed on a terminal, plain rows (no box, no wrapping) elsewhere."""
    from rich.table import Table

    if not tty(stream):
        kw.setdefault("box", None)
    return Table(title=title, header_style="bold", **kw)
