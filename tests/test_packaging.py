"""The folders install under one namespace: `lanefuse.kernels` is ours, a bare `import kernels` is not, and the data
(rules, lane tables, kernel sources, web assets) ships with the package."""

import subprocess
import sys
from importlib import resources


def test_bare_kernels_is_not_ours(tmp_path):
    r = subprocess.run([sys.executable, "-c", "import kernels, sys; print(kernels.__file__)"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode != 0 or "lanefuse" not in r.stdout


def test_package_data_is_found():
    names = {p.name for p in resources.files("lanefuse.rules").iterdir()}
    assert {"classes.yaml", "norm.yaml", "README.md", "lanes"} <= names
    assert {"cuda.yaml", "conservative.yaml"} <= {p.name for p in (resources.files("lanefuse.rules") / "lanes").iterdir()}
    assert "index.html" in {p.name for p in (resources.files("lanefuse.lane.explore") / "web").iterdir()}
    assert "gemv.cu" in {p.name for p in resources.files("lanefuse.kernels").iterdir()}
