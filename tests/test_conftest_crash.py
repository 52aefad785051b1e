"""tests/conftest.py's crash report: a pytest-xdist worker that dies in native code (here a read of address 0 through
ctypes: a SIGSEGV no Python handler catches) is named at the end of the run with its fatal traceback, where a CI log's
tail shows it; a run whose workers end well says nothing of it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

CONFTEST = Path(__file__).with_name("conftest.py")


def test_a_crashed_worker_is_named_with_its_traceback(tmp_path):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_die.py").write_text(
        "import ctypes, os\n\n"
        "def test_lives():\n    assert os.environ['LANEFUSE_CRASH_LOG'].endswith('.log')\n\n"
        "def test_dies():\n    ctypes.string_at(0)\n")
    p = subprocess.run([sys.executable, "-m", "pytest", "test_die.py", "-n", "1", "-p", "no:cacheprovider", "-q"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout[-2000:]
    tail = p.stdout[p.stdout.index("workers that crashed"):]
    assert "worker gw0 (its fatal traceback, innermost first):" in tail
    assert "Fatal Python error: Segmentation fault" in tail
    assert 'test_die.py", line 7 in test_dies' in tail
    assert "1 failed, 1 passed" in p.stdout


def test_a_run_that_ends_well_says_nothing(tmp_path):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_fine.py").write_text("def test_fine():\n    pass\n")
    p = subprocess.run([sys.executable, "-m", "pytest", "test_fine.py", "-n", "1", "-p", "no:cacheprovider", "-q"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:]
    assert "workers that crashed" not in p.stdout
