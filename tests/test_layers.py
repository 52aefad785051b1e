"""The rooms and their one-way imports: `cli` stands on `explore` and `run`, both on `lower`, which stands on `engine`
and `kernels`; `run` and `explore` do not import each other, `engine` imports nothing of `kernels` or `lane`, and
`kernels` nothing of `lane`. The front (`engine.front`: the readers and the model families) stands on the engine's
core; nothing in the core, `kernels` or `lower` imports it (only `run`, `explore` and `cli` do). Every module's imports (top-level and inside functions) are parsed; a circle among
modules or an arrow pointing up fails, naming the file and line."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"engine": "engine", "kernels": "kernels", "lane": "lane", "rules": "rules"}

# room -> the rooms it may import (itself included)
ALLOWED = {
    "engine": {"engine"},
    "engine.front": {"engine.front", "engine"},
    "kernels": {"kernels", "engine"},
    "lane.lower": {"lane.lower", "engine", "kernels"},
    "lane.run": {"lane.run", "lane.lower", "engine.front", "engine", "kernels"},
    "lane.explore": {"lane.explore", "lane.lower", "engine.front", "engine", "kernels"},
    "lane.cli": {"lane.cli", "lane.explore", "lane.run", "lane.lower", "engine.front", "engine", "kernels"},
    "lane": {"lane"},
    "rules": set(),  # data only
}


def _modules() -> dict[str, Path]:
    out = {}
    for top in PACKAGES:
        for p in sorted((ROOT / top).rglob("*.py")):
            rel = p.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


# a core module that may import the front, and why (none: engine/front/parallel.py, the rank steps of issue 38, is
# the front's own since it splits a model's config and weights)
CORE_ON_FRONT: dict[str, str] = {}


def _room(mod: str) -> str:
    parts = mod.split(".")
    if parts[0] == "lane" and len(parts) > 1:
        return "lane." + parts[1]
    if parts[:2] == ["engine", "front"]:
        return "engine.front"
    return parts[0]


def _imports(path: Path, mods: dict[str, Path]) -> list[tuple[str, int]]:
    """The project modules `path` imports, with the line of each import."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lanefuse."):
            base = node.module[len("lanefuse."):]
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name[len("lanefuse."):] for a in node.names if a.name.startswith("lanefuse.")]
        for n in names:
            while n and n not in mods:
                n = n.rpartition(".")[0]
            if n:
                out.append((n, node.lineno))
    return out


def test_rooms_import_downward_only():
    mods = _modules()
    bad = []
    for mod, path in mods.items():
        here = _room(mod)
        for dep, line in _imports(path, mods):
            if _room(dep) not in ALLOWED[here] and not (mod in CORE_ON_FRONT and _room(dep) == "engine.front"):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {here} imports {dep} ({_room(dep)})")
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


def test_no_import_circles():
    mods = _modules()
    graph = {m: {d for d, _ in _imports(p, mods) if d != m} for m, p in mods.items()}
    # a package's __init__ importing its own modules is how a package exports them, not a circle
    for m in graph:
        graph[m] = {d for d in graph[m] if not (d.startswith(m + ".") and mods[m].name == "__init__.py")}
    state: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                circles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_every_module_is_in_a_room():
    for mod in _modules():
        assert _room(mod) in ALLOWED, f"{mod} lives outside the rooms {sorted(ALLOWED)}"


def test_the_front_is_imported_by_no_core_module_kernel_or_lowering():
    """The room the model families live in (engine/front/): the engine's core (IR, interpreter, rules, extraction,
    formats), `kernels` and `lane.lower` never import it, save CORE_ON_FRONT, each with its reason."""
    mods = _modules()
    bad = [f"{path.relative_to(ROOT)}:{line}: {mod} imports {dep}" for mod, path in mods.items()
           if _room(mod) in ("engine", "kernels", "lane.lower") and mod not in CORE_ON_FRONT
           for dep, line in _imports(path, mods) if _room(dep) == "engine.front"]
    assert not bad, "the front imported from below it:\n" + "\n".join(bad)
    assert all(m in mods for m in CORE_ON_FRONT), "an exception names a module that is gone"
