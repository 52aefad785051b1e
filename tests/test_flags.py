"""Flags are declared once (engine/flags.py): no other module reads a LANEFUSE_ variable from the environment, and the
README lists every flag."""

from __future__ import annotations

import re
from pathlib import Path

from lanefuse.engine import flags

ROOT = Path(__file__).resolve().parents[1]


def test_only_the_flags_module_reads_lanefuse_variables():
    read = re.compile(r"(os\.environ(\.get)?\s*[\[(]\s*|os\.getenv\(\s*)[\"']LANEFUSE_")
    bad = []
    for top in ("engine", "kernels", "lane", "bench"):
        for p in (ROOT / top).rglob("*.py"):
            if p.name == "flags.py" and p.parent.name == "engine":
                continue
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
                if read.search(line):
                    bad.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "read engine.flags instead:\n" + "\n".join(bad)


def test_the_readme_lists_every_flag():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for name, default, what in flags.table():
        assert f"| `{name}` | {default} | {what} |" in text, f"README's flag table lacks {name} as declared"


def test_reading_a_flag():
    assert flags.read("LANEFUSE_CHECK", {}) == 0 and flags.read("LANEFUSE_CHECK", {"LANEFUSE_CHECK": "2"}) == 2
    assert flags.read("LANEFUSE_DEBUG", {"LANEFUSE_DEBUG": "x"}) == 0  # not a number: the default
    sep = __import__("os").pathsep
    assert flags.read("LANEFUSE_RULES", {"LANEFUSE_RULES": f"a{sep}{sep}b"}) == ["a", "b"]
