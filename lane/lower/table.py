"""A lane's table (rules/lanes/NAME.yaml): each lifted op kind's launch and each fused class's support — native (its
launch and how the fused op's pattern variables fill its fields, or a named link hook), decompose, or refuse with
a reason. A table may start from another (`base:`) and change some entries."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from lanefuse.engine.errors import UserError, did_you_mean
from lanefuse.engine.opdefs import OPS
from lanefuse.kernels import KINDS
from lanefuse.lane.lower.fill import check_expr

SUPPORTS = ("native", "decompose", "refuse")


@dataclass(frozen=True)
class Choice:
    """One way a lifted op or a native class links: `launch` with `fields`, or a `hook`, or a refusal; taken when
    its `when` expression holds (always where it has none)."""

    when: Any = None
    launch: str | None = None
    fields: dict = field(default_factory=dict)
    hook: str | None = None
    refuse: str | None = None


@dataclass(frozen=True)
class ClassEntry:
    cls: str
    support: str
    choice: Choice | None = None
    reason: str = ""
    why: str = ""
    where: str = ""


@dataclass
class LaneTable:
    name: str
    why: str
    ops: dict[str, list[Choice]]
    classes: dict[str, ClassEntry]
    schedule: dict[str, str]  # the lane's schedule steps a plan can hold back: name -> why
    source: str
    gated: dict[str, tuple[str, ...]] = field(default_factory=dict)  # step -> classes it runs as parts when held

    def support(self, cls: str) -> ClassEntry:
        e = self.classes.get(cls)
        if e is None:
            return ClassEntry(cls, "refuse", reason=f"the {self.name} lane's table says nothing of class `{cls}`")
        return e

    def linked(self) -> set[str]:
        return {c for c, e in self.classes.items() if e.support != "refuse"}


def lane_dirs(extra=()) -> list[Path]:
    import os

    dirs = [Path(str(resources.files("lanefuse.rules"))) / "lanes"]
    env = os.environ.get("LANEFUSE_RULES", "")
    for d in list(extra) + [p for p in env.split(os.pathsep) if p]:
        if (Path(d) / "lanes").is_dir():
            dirs.append(Path(d) / "lanes")
    return dirs


def known_lanes(extra=()) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for d in lane_dirs(extra):
        for p in sorted(d.glob("*.yaml")):
            out[p.stem] = p
    return out


def _choice(e: Any, where: str) -> Choice:
    if not isinstance(e, dict):
        raise UserError(f"{where}: expected a mapping with `launch:` and `fields:`, a `hook:`, or `refuse:`")
    unknown = set(e) - {"if", "launch", "fields", "hook", "refuse", "support", "why", "reason"}
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    launch = e.get("launch")
    if launch is not None and launch not in KINDS:
        hint = did_you_mean(str(launch), KINDS)
        raise UserError(f"{where}: unknown launch kind `{launch}`{hint}; kinds: {', '.join(sorted(KINDS))}")
    fields = e.get("fields") or {}
    _check_fields(fields, launch, where)
    if launch is None and e.get("hook") is None and e.get("refuse") is None:
        raise UserError(f"{where}: say `launch:` (with `fields:`), `hook:` or `refuse:`")
    return Choice(e.get("if"), launch, fields, e.get("hook"), e.get("refuse"))


def _check_fields(fields: dict, launch: str | None, where: str) -> None:
    import dataclasses

    if launch is None:
        return
    names = {f.name for f in dataclasses.fields(KINDS[launch])}
    for k, v in fields.items():
        if k not in names:
            hint = did_you_mean(k, names)
            raise UserError(f"{where}: launch `{launch}` has no field `{k}`{hint}")
        if isinstance(v, dict) and "launch" in v:
            _choice(v, f"{where}.{k}")
        else:
            check_expr(v, f"{where}.{k}")


_CACHE: dict = {}


def load_lane(name: str = "cuda", extra=()) -> LaneTable:
    """The lane table `name` (a user folder's `lanes/` may add or override tables); read once per file state."""
    lanes = known_lanes(extra)
    key = (name, tuple((str(p), p.stat().st_mtime_ns) for p in lanes.values()))
    if key in _CACHE:
        return _CACHE[key]
    _CACHE[key] = _load_named(name, lanes)
    return _CACHE[key]


def _load_named(name: str, lanes: dict[str, Path]) -> LaneTable:
    if name not in lanes:
        hint = did_you_mean(name, lanes)
        raise UserError(f"unknown lane `{name}`{hint}; lanes: {', '.join(sorted(lanes))}")
    return _load(lanes[name], lanes, set())


def _load(path: Path, lanes: dict[str, Path], seen: set[str]) -> LaneTable:
    if path.stem in seen:
        raise UserError(f"{path}: the lane tables' `base:` entries form a cycle")
    seen.add(path.stem)
    try:
        doc = yaml.load(path.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise UserError(f"{path}{line}: bad YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(doc, dict) or "lane" not in doc:
        raise UserError(f"{path}: a lane table is a mapping with `lane:`, `ops:` and `classes:`")
    known = _known_classes()
    base = None
    if doc.get("base"):
        if doc["base"] not in lanes:
            raise UserError(f"{path}: base lane `{doc['base']}` is not known ({', '.join(sorted(lanes))})")
        base = _load(lanes[doc["base"]], lanes, seen)
    ops: dict[str, list[Choice]] = dict(base.ops) if base else {}
    for kind, entries in (doc.get("ops") or {}).items():
        where = f"{path.name}: ops.{kind}"
        if kind not in OPS:
            hint = did_you_mean(kind, OPS)
            raise UserError(f"{where}: unknown op kind `{kind}`{hint}")
        entries = entries if isinstance(entries, list) else [entries]
        ops[kind] = [_choice(e, where) for e in entries]
    classes: dict[str, ClassEntry] = dict(base.classes) if base else {}
    for cls, e in (doc.get("classes") or {}).items():
        where = f"{path.name}: classes.{cls}"
        if cls not in known:
            hint = did_you_mean(cls, known)
            raise UserError(f"{where}: unknown class `{cls}`{hint} (the classes are listed in rules/classes.yaml)")
        if not isinstance(e, dict) or e.get("support") not in SUPPORTS:
            raise UserError(f"{where}: `support:` must be one of {', '.join(SUPPORTS)}")
        sup = e["support"]
        if sup == "refuse" and not e.get("reason"):
            raise UserError(f"{where}: a refused class needs a `reason:` in the user's words")
        ch = _choice(e, where) if sup == "native" else None
        classes[cls] = ClassEntry(cls, sup, ch, e.get("reason", ""), e.get("why", ""), where)
    sched = dict(base.schedule) if base else {}
    gated = dict(base.gated) if base else {}
    for step, e in (doc.get("schedule") or {}).items():
        if isinstance(e, dict):
            for cls in e.get("decompose") or []:
                if cls not in known:
                    raise UserError(f"{path.name}: schedule.{step}: unknown class `{cls}`{did_you_mean(cls, known)}")
            sched[step] = str(e.get("why", ""))
            gated[step] = tuple(e.get("decompose") or ())
        else:
            sched[step] = str(e)
    return LaneTable(str(doc["lane"]), str(doc.get("why", "")), ops, classes, sched, str(path), gated)


def _known_classes() -> set[str]:
    p = Path(str(resources.files("lanefuse.rules"))) / "classes.yaml"
    doc = yaml.load(p.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or []
    return {e["class"] for e in doc}
