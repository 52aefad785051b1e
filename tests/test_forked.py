"""tests/conftest.py's `forked` marker: the test's body runs in a child process, and its outcome comes back whole — a
pass, an assertion's failure with its traceback, a skip as a skip, a child that dies of a signal as a failure naming
the signal — while nothing the body does to memory reaches the process that runs the suite."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")

BODY = '''
import os, signal
import pytest

STATE = []

@pytest.mark.forked
def test_passes():
    STATE.append(1)  # the child's memory only
    assert sum(range(4)) == 6

def test_the_parent_never_saw_the_child_write():
    assert STATE == []

@pytest.mark.forked
def test_fails():
    assert 2 + 2 == 5, "arithmetic went wrong"

@pytest.mark.forked
def test_skips():
    pytest.skip("nothing to do here")

@pytest.mark.forked
def test_dies():
    os.kill(os.getpid(), signal.SIGSEGV)

@pytest.mark.forked
@pytest.mark.parametrize("n", [1, 2])
def test_takes_its_fixtures(tmp_path, n):
    assert tmp_path.is_dir() and n in (1, 2)
'''


def test_forked_outcomes(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f'''
        import importlib.util
        spec = importlib.util.spec_from_file_location("lanefuse_conftest", {str(CONFTEST)!r})
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        pytest_pyfunc_call = mod.pytest_pyfunc_call

        def pytest_configure(config):
            config.addinivalue_line("markers", "forked: in a child process")
    '''))
    (tmp_path / "test_body.py").write_text(BODY)
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-q", "-p", "no:randomly",
                        str(tmp_path / "test_body.py")], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    out = p.stdout
    assert p.returncode == 1, out
    assert "PASSED test_body.py::test_passes" in out
    assert "PASSED test_body.py::test_the_parent_never_saw_the_child_write" in out
    assert "PASSED test_body.py::test_takes_its_fixtures[1]" in out and "test_takes_its_fixtures[2]" in out
    assert "SKIPPED [1]" in out and "nothing to do here" in out, out
    assert "FAILED test_body.py::test_fails" in out and "arithmetic went wrong" in out
    assert "FAILED test_body.py::test_dies" in out and "died of SIGSEGV" in out
    assert "2 failed, 4 passed, 1 skipped" in out, out
