"""A spinner for work that turns out slow: on a terminal, once a piece of work (a plan of a large model, a rule that
matches widely) has taken a couple of seconds, stderr says what is going on until it ends. Quick work shows nothing,
and nothing is written where stderr is not a terminal."""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager

AFTER_S = 2.0  # seconds of work before the spinner shows


@contextmanager
def spinner(what: str, after: float = AFTER_S, stream=None):
    """Show `what` with a spinner on `stream` (stderr) once the block has run `after` seconds, until it ends."""
    stream = stream or sys.stderr
    if not stream.isatty():
        yield
        return
    from rich.console import Console

    status = Console(file=stream).status(what)
    lock = threading.Lock()
    state = {"shown": False, "done": False}

    def show():
        with lock:
            if not state["done"]:  # a timer that fires as the work ends shows nothing
                status.start()
                state["shown"] = True

    timer = threading.Timer(after, show)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        with lock:
            state["done"] = True
            if state["shown"]:
                status.stop()
