"""egglog's e-graph belongs to the thread that made it (dropped on another, egglog leaks it and prints a RuntimeError
as unraisable). engine/egraph.py's EGraph hands one that a collection on another thread lets go back to its own thread,
which drops it when it next makes an e-graph (one whose thread has ended is let go quietly): a Session left in a reference cycle (a refused plan's traceback) and
collected on the explorer's engine thread or any other raises nothing."""

from __future__ import annotations

import gc
import sys
import threading
import warnings

import pytest

pytest.importorskip("egglog", reason="the engine needs egglog")

from lanefuse.engine import egraph
from lanefuse.engine.front.demo import demo_model
from lanefuse.engine.front.model import build_step
from lanefuse.engine.optimize import Session
from lanefuse.engine.rules import load_table


def _unraisable():
    seen = []
    old = sys.unraisablehook
    sys.unraisablehook = lambda u: seen.append(f"{u.exc_type.__name__}: {u.exc_value}")
    return seen, old


def test_an_egraph_collected_on_another_thread_goes_back_to_its_own():
    cfg, _ = demo_model()
    g = build_step(cfg, 1)
    table = load_table(())
    box = {}

    def make():
        s = Session(g, table)
        s.cycle = s  # a cycle: only the collector frees it
        box["id"] = id(s.eg.eg)

    gc.collect()
    seen, old = _unraisable()
    try:
        t = threading.Thread(target=make)
        t.start()
        t.join()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            gc.collect()  # the Session's cycle collected here, on the main thread
        assert seen == []
        assert t not in egraph._ORPHANS  # its thread has ended: let go (egglog leaks it), nothing printed

        def made_here():
            s = Session(g, table)
            s.cycle = s
            box["here"] = id(s.eg.eg)

        made_here()
        done = threading.Event()

        def collect_elsewhere():
            gc.collect()
            done.set()

        threading.Thread(target=collect_elsewhere).start()
        done.wait(30)
        assert seen == []
        assert box["here"] in [id(e) for e in egraph._ORPHANS.get(threading.current_thread(), [])]
        Session(g, table)  # the main thread's next e-graph drops what waited for it
        assert threading.current_thread() not in egraph._ORPHANS
        assert seen == []
    finally:
        sys.unraisablehook = old
