"""The first run's words: an `hf` test stopped by a missing torch skips (it does not fail), a test without the marker
still fails on it, and the run ends with a few lines grouping the skips by what they need."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import group_skips, skip_summary

HERE = Path(__file__).parent


def test_skips_group_by_what_they_need():
    reasons = (["no CUDA device"] * 5 + ["no CUDA device (or CuPy) here"] * 2
               + ["could not import 'torch': No module named 'torch'"] * 3
               + ["could not import 'transformers': No module named 'transformers'"]
               + ["playwright is missing"] + ["split leaves a chunk empty"] * 2)
    groups = dict((what, n) for n, what in group_skips(reasons))
    assert groups["a CUDA device (cupy: pip install -e '.[gpu]')"] == 7
    assert groups["torch + transformers (pip install -e '.[test,hf]')"] == 4
    assert groups["do not apply here: split leaves a chunk empty"] == 2
    lines = skip_summary(reasons)
    assert lines[0] == "14 skipped, by what they need:" and lines[1].split()[0] == "7"
    assert skip_summary([]) == []


def test_many_reasons_stay_a_few_lines():
    lines = skip_summary([f"case {i} does not apply " + "x" * 200 for i in range(50)], most=8)
    assert len(lines) == 10 and "42 other reasons" in lines[-1]
    assert max(map(len, lines)) < 100


def test_a_missing_torch_skips_an_hf_test_and_fails_any_other(tmp_path):
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_t.py").write_text(
        "import pytest\n\n"
        "def _no_torch():\n"
        "    raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n\n"
        "@pytest.mark.hf\n"
        "def test_hf():\n    _no_torch()\n\n"
        "def test_plain():\n    _no_torch()\n\n"
        "@pytest.mark.hf\n"
        "def test_hf_other_error():\n    raise ModuleNotFoundError('x', name='numpyy')\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-v", "-o", "addopts=",
                        "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    out = r.stdout
    assert "2 failed, 1 skipped" in out, out
    assert "test_t.py::test_plain FAILED" in out and "test_t.py::test_hf_other_error FAILED" in out, out
    assert "test_t.py::test_hf SKIPPED" in out, out
    assert "could not import 'torch'" in out
    assert "1 skipped, by what they need:" in out and "torch + transformers" in out
