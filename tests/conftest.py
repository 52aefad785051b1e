"""The repository's root off `sys.path` for the tests: `python -m pytest` puts the working folder first, where our
`kernels/` folder would shadow the `kernels` package transformers (5.x) imports. lanefuse itself is imported as the
installed `lanefuse.*`, never through the root.

Two hooks for a newcomer's first run: an `hf`-marked test that stops at a missing torch/transformers is a skip (the
marker's meaning), not a failure; and the run ends with a few lines that say why the skipped tests skipped, grouped
by what they need and how to get it. A third for CI: a pytest-xdist worker that dies (a fault in native code, an abort)
leaves its fatal traceback (faulthandler's, and the host CUDA emulator's last words) in a file the controller prints
at the end, where a CI log's tail shows it. A fourth runs a `forked` test (one that emulates a mutated kernel) in a child
process, so that what the mutation writes out of bounds never reaches the worker."""

from __future__ import annotations

import faulthandler
import os
import re
import shutil
import signal
import sys
import tempfile
import traceback
import warnings
from collections import Counter

import pytest

# Under pytest-xdist, each worker's BLAS/OpenMP pools sized to its share of the cores (torch on a tiny model took 4.9 s
# a greedy run on 2 threads of a 2-core machine that two workers share, 0.025 s on 1): set before torch or numpy's BLAS
# start their pools, and never over what the user set.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _WORKERS:
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, str(max(1, (os.cpu_count() or 1) // _WORKERS)))

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

HF_PACKAGES = ("torch", "transformers", "tokenizers", "accelerate")  # pyproject's `hf` extra

# what a skip needs, by the words of its reason: (pattern, what it needs and how to get it); first match wins
NEEDS = (
    (r"LANEFUSE_PLANS|gpu_prepare", "saved plans for the GPU suite (bench/gpu_suite.sh prepare PLANDIR)"),
    (r"CUDA device|CuPy|cupy", "a CUDA device (cupy: pip install -e '.[gpu]')"),
    (r"\btorch\b|transformers|tokenizers|accelerate", "torch + transformers (pip install -e '.[test,hf]')"),
    (r"llama_cpp|llama-cpp", "llama-cpp-python (pip install llama-cpp-python)"),
    (r"chromium|playwright", "a browser (apt-get install chromium; pip install playwright)"),
    (r"nvcc|NVRTC|cuda-python", "nvcc on PATH or NVRTC (pip install -e '.[nvrtc]')"),
    (r"g\+\+|C\+\+ compiler|C preprocessor", "a C++ compiler (g++) for the host CUDA emulator"),
    (r"egglog", "egglog (pip install -e .)"),
    (r"LANEFUSE_EMU_FULL|at their sizes", "LANEFUSE_EMU_FULL=1 (the emulator's full-size replays, ~10 min)"),
)


def _module_missing(excinfo) -> str | None:
    """The hf package an import stopped at, or None."""
    e = excinfo.value if excinfo is not None else None
    if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in HF_PACKAGES:
        return e.name.split(".")[0]
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    out = yield
    rep = out.get_result()
    if rep.failed and call.when in ("setup", "call") and item.get_closest_marker("hf") is not None:
        missing = _module_missing(call.excinfo)
        if missing:
            rep.outcome = "skipped"
            rep.longrepr = (str(item.path), item.location[1] or 0,
                            f"Skipped: could not import {missing!r}: an hf test needs the hf extra")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A `forked` test's body runs in a child process of its own: a mutated kernel run by the host CUDA emulator may
    write out of bounds before it faults, and the emulator's recovery from the fault (a longjmp out of the block) leaves
    the heap as the mutation left it; a worker went on to die in an unrelated test (CI, 2026-12-06: a segfault in
    numpy's allocator two tests later). The child reports its outcome through a pipe: a failure with its traceback, a
    skip as a skip; a child that dies of a signal is a failure that names it. The parent's memory never meets the
    mutation."""
    if pyfuncitem.get_closest_marker("forked") is None or not hasattr(os, "fork"):
        return None
    args = {a: pyfuncitem.funcargs[a] for a in pyfuncitem._fixtureinfo.argnames}
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    with warnings.catch_warnings():  # Python 3.12's warning about fork in a threaded process (xdist's reader thread)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: the test's body, its outcome down the pipe, then out without pytest's teardown
        code = 0
        try:
            os.close(r)
            faulthandler.disable()  # a death here is the child's, reported by the parent: not a worker crash
            os.environ.pop("LANEFUSE_CRASH_LOG", None)
            try:
                pyfuncitem.obj(**args)
                msg = ""
            except pytest.skip.Exception as e:
                code, msg = 2, str(e)
            except BaseException:  # noqa: BLE001 - every outcome goes to the parent
                code, msg = 1, traceback.format_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            with os.fdopen(w, "wb") as f:
                f.write(msg.encode(errors="replace"))
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        msg = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        pytest.fail(f"the test's child process died of {signal.Signals(sig).name}", pytrace=False)
    code = os.WEXITSTATUS(status)
    if code == 2:
        pytest.skip(msg)
    if code:
        pytest.fail(f"in the test's child process:\n{msg}", pytrace=False)
    return True


def skip_reason(rep) -> str:
    """A skip report's reason, without pytest's `Skipped: ` prefix."""
    lr = rep.longrepr
    text = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    return text[len("Skipped: "):] if text.startswith("Skipped: ") else text


def group_skips(reasons: list[str]) -> list[tuple[int, str]]:
    """(count, what) for each need, most first; a reason no need names is its own group, in its own words (cut)."""
    groups: Counter = Counter()
    for r in reasons:
        need = next((what for pat, what in NEEDS if re.search(pat, r)), None)
        groups[need or "do not apply here: " + (r if len(r) <= 70 else r[:67] + "...")] += 1
    return sorted(((n, what) for what, n in groups.items()), key=lambda t: (-t[0], t[1]))


def skip_summary(reasons: list[str], most: int = 8) -> list[str]:
    """A few lines saying why `len(reasons)` tests skipped: the `most` largest groups, the rest counted in one line."""
    if not reasons:
        return []
    groups = group_skips(reasons)
    lines = [f"{len(reasons)} skipped, by what they need:"]
    lines += [f"  {n:6d}  {what}" for n, what in groups[:most]]
    rest = groups[most:]
    if rest:
        lines.append(f"  {sum(n for n, _ in rest):6d}  {len(rest)} other reasons (pytest -rs lists each)")
    return lines


def _crash_dir(config) -> str:
    """This run's folder of worker crash files, named by the controller's process (a worker's parent)."""
    run = os.getppid() if hasattr(config, "workerinput") else os.getpid()
    return os.path.join(tempfile.gettempdir(), f"lanefuse-crash-{os.getuid()}-{run}")


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """In an xdist worker: faulthandler (and the emulator's fatal messages: LANEFUSE_CRASH_LOG) into this worker's own
    file."""
    if not hasattr(config, "workerinput"):
        return
    d = _crash_dir(config)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"{config.workerinput.get('workerid', 'gw')}.log")
    f = open(path, "a")  # noqa: SIM115 - open for the worker's life (appending: the emulator's words go first)
    config._lanefuse_crash_file = f
    os.environ["LANEFUSE_CRASH_LOG"] = path
    faulthandler.enable(file=f, all_threads=True)


def crashed_workers(config) -> list[str]:
    """The lines to print for each worker whose crash file holds something (a worker that ended well removed its)."""
    d = _crash_dir(config)
    lines: list[str] = []
    if not os.path.isdir(d):
        return lines
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name), errors="replace") as f:
            text = f.read().strip()
        if text:
            lines.append(f"worker {name[:-4]} (its fatal traceback, innermost first):")
            lines += ["    " + line for line in text.splitlines()[:40]]
    return lines


def pytest_unconfigure(config):
    f = getattr(config, "_lanefuse_crash_file", None)
    if f is not None:  # this worker ended well: nothing to say
        faulthandler.disable()
        f.close()
        os.remove(f.name)
    elif not hasattr(config, "workerinput"):
        shutil.rmtree(_crash_dir(config), ignore_errors=True)
        # the compiles the workers shared (tests/test_kernels_compile.py run_dir)
        shutil.rmtree(os.path.join(tempfile.gettempdir(), f"lanefuse-run-{os.getuid()}-{os.getpid()}"),
                      ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
    crashed = crashed_workers(terminalreporter.config)
    if crashed:
        terminalreporter.write_sep("-", "workers that crashed")
        for line in crashed:
            terminalreporter.write_line(line)
    reasons = [skip_reason(r) for r in terminalreporter.stats.get("skipped", [])]
    lines = skip_summary(reasons)
    if lines:
        terminalreporter.write_sep("-", "why tests skipped")
        for line in lines:
            terminalreporter.write_line(line)


# The suite's longest single items: the chain module's compiles (its kernels inline the attention and three products
# in every format; nvcc's ptxas took over 5 minutes of one core here, NVRTC's full sm_90 compile ~4.5). Where they came
# in collection order (test_kernels_compile, near the end of a run) one worker compiled for minutes while the others had
# nothing left: a tail the run waited on. Here nvcc's goes first, so the first worker starts it at once, and NVRTC's
# first in the second worker's first batch (xdist's load scheduling hands each worker a quarter of its share of the
# items, in order, to begin with); xdist hands out the rest meanwhile. The same order in every worker (xdist's rule).
SLOW_FIRST = ("test_kernels_compile.py::test_nvcc[", "test_kernels_compile.py::test_nvrtc[")


def _slow_first(item) -> bool:
    nid = item.nodeid
    return any(s in nid for s in SLOW_FIRST) and "+chain" in nid and "sm_80" not in nid


# Items that read the chain module's NVRTC PTX (its kernels' parameter lists) wait for that compile: early in the run
# one sat on its lock for minutes (test_batch_launch_arguments_match_the_kernels, 234 s in the clean-clone run at
# bb66519, a worker idle), so they go last, when the compile is long done.
PTX_READERS_LAST = ("test_batch.py::test_batch_launch_arguments_match_the_kernels",)


def pytest_collection_modifyitems(session, config, items):
    last = [i for i in items if any(i.nodeid.endswith(s) for s in PTX_READERS_LAST)]
    if last:
        items[:] = [i for i in items if i not in last] + last
    slow = sorted((i for i in items if _slow_first(i)), key=lambda i: "test_nvrtc[" in i.nodeid)  # nvcc's first
    if not slow:
        return
    rest = [i for i in items if not _slow_first(i)]
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    at = (len(items) // workers) // 4 if workers > 1 else 1  # where the second worker's first batch begins
    items[:] = slow[:1] + rest[:at - 1] + slow[1:] + rest[at - 1:]
