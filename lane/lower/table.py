"""A lane's table (rules/lanes/NAME.yaml): each lifted op kind's launch and each fused class's support — native (its
launch and how the fused op's pattern variables fill its fields, or a named link hook), decompose, or refuse with
a reason. A table may start from another (`base:`) and change some entries. A field reads only what its op has:
a lifted op's inputs and attributes, a class's contract (its `vars:` in classes.yaml); checked when the table loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lanefuse.engine.errors import UserError, clip, did_you_mean
from lanefuse.engine.opdefs import OPS
from lanefuse.engine.rules import contract, load_classes, rule_dirs, short_path
from lanefuse.engine.yamlsafe import load_file, load_text, read_text, short
from lanefuse.kernels import KINDS
from lanefuse.lane.lower.fill import check_expr, names_read

SUPPORTS = ("native", "decompose", "refuse")
ALWAYS = ("out", "kind")  # every op's scope holds its result and its kind (a fused op's: its class)


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
    """A class's lane entry. A native class links by its one choice, or (`choices:`) by the first of several whose
    `if:` holds (gemv_quant: the per-head product's launch where `y.heads?` is bound, else the GEMV's)."""

    cls: str
    support: str
    choices: tuple[Choice, ...] = ()
    reason: str = ""
    why: str = ""
    where: str = ""

    @property
    def choice(self) -> Choice | None:
        """The entry's first choice (its only one, for most classes)."""
        return self.choices[0] if self.choices else None


@dataclass(frozen=True)
class KindCost:
    """What one kernel launch of a kind costs on the lane's chip beyond the knobs' launch gap (rules/lanes/*.yaml
    `costs:`): `fixed_us` its own fixed time (ramp-up, drain, a fold's serial epilogue), `bandwidth` the share of the
    chip's HBM bandwidth (knob hbm_gbps) its bytes stream at."""

    fixed_us: float
    bandwidth: float


@dataclass
class LaneTable:
    name: str
    why: str
    ops: dict[str, list[Choice]]
    classes: dict[str, ClassEntry]
    schedule: dict[str, str]  # the lane's schedule steps a plan can hold back: name -> why
    source: str
    gated: dict[str, tuple[str, ...]] = field(default_factory=dict)  # step -> classes it runs as parts when held
    holds: dict[str, tuple[str, ...]] = field(default_factory=dict)  # step -> lifted ops whose rules it holds
    costs: dict[str, KindCost] = field(default_factory=dict)  # kernel launch kind (census) -> its cost on the chip

    def support(self, cls: str) -> ClassEntry:
        e = self.classes.get(cls)
        if e is None:
            return ClassEntry(cls, "refuse", reason=f"the {self.name} lane's table says nothing of class `{cls}`")
        return e

    def linked(self) -> set[str]:
        return {c for c, e in self.classes.items() if e.support != "refuse"}


def lane_dirs(extra=()) -> list[Path]:
    """The `lanes/` folders, the shared one first, then each user folder's (LANEFUSE_RULES, then `extra`)."""
    return [Path(d) / "lanes" for d in rule_dirs(extra) if (Path(d) / "lanes").is_dir()]


def lane_stacks(extra=()) -> dict[str, list[Path]]:
    """Each lane name's tables, bottom up: the shared one (if any), then the user folders' in order. The top one is
    the lane; a table's `base:` naming its own lane means the one below it."""
    out: dict[str, list[Path]] = {}
    for d in lane_dirs(extra):
        for p in sorted(d.glob("*.yaml")):
            out.setdefault(p.stem, []).append(p)
    return out


def known_lanes(extra=()) -> dict[str, Path]:
    return {name: stack[-1] for name, stack in lane_stacks(extra).items()}


def _choice(e: Any, where: str) -> Choice:
    if not isinstance(e, dict):
        raise UserError(f"{where}: expected a mapping with `launch:` and `fields:`, a `hook:`, or `refuse:`")
    unknown = set(e) - {"if", "launch", "fields", "hook", "refuse", "support", "why", "reason", "choices"}
    if unknown:
        raise UserError(f"{where}: unknown key(s) {short(', '.join(sorted(map(str, unknown))))}")
    for k in ("launch", "hook", "refuse", "why", "reason"):
        if e.get(k) is not None and not isinstance(e[k], str):
            raise UserError(f"{where}: `{k}:` must be a string, got {short(e[k])}")
    if not isinstance(e.get("fields") or {}, dict):
        raise UserError(f"{where}: `fields:` must be a mapping of field: expression, got {short(e['fields'])}")
    launch = e.get("launch")
    if launch is not None and launch not in KINDS:
        hint = did_you_mean(str(launch), KINDS)
        raise UserError(f"{where}: unknown launch kind `{launch}`{hint}; kinds: {', '.join(sorted(KINDS))}")
    fields = e.get("fields") or {}
    _check_fields(fields, launch, where)
    if launch is None and e.get("hook") is None and e.get("refuse") is None:
        raise UserError(f"{where}: say `launch:` (with `fields:`), `hook:` or `refuse:`")
    return Choice(e.get("if"), launch, fields, e.get("hook"), e.get("refuse"))


def _class_choices(e: dict, where: str) -> tuple[Choice, ...]:
    """A native class's ways to link: its entry itself, or its `choices:` (a list, each with `if:` but the last),
    taken in order."""
    if "choices" not in e:
        return (_choice(e, where),)
    listed = e["choices"]
    if {"launch", "fields", "hook", "refuse", "if"} & set(e):
        raise UserError(f"{where}: say either `choices:` or one `launch:` / `hook:`, not both")
    if not isinstance(listed, list) or not listed:
        raise UserError(f"{where}: `choices:` must be a non-empty list of entries (`if:`, `launch:` and `fields:`), "
                        f"got {short(listed)}")
    chs = []
    for k, c in enumerate(listed):
        if isinstance(c, dict) and ({"support", "choices"} & set(c)):
            raise UserError(f"{where}: choices[{k}]: `support:` and `choices:` belong to the class's entry")
        chs.append(_choice(c, f"{where}: choices[{k}]"))
    if chs[-1].when is not None:
        raise UserError(f"{where}: the last of `choices:` has an `if:`; end the list with an entry taken otherwise "
                        f"(a `refuse:` where nothing else applies)")
    return tuple(chs)


def is_launches(v) -> bool:
    """Whether a field's value is a list of launches run in turn (a chain's `phases:`), each `{launch:, fields:}`."""
    return isinstance(v, list) and bool(v) and all(isinstance(e, dict) and "launch" in e for e in v)


def _check_fields(fields: dict, launch: str | None, where: str) -> None:
    import dataclasses

    if launch is None:
        return
    names = {f.name for f in dataclasses.fields(KINDS[launch])}
    for k, v in fields.items():
        if k not in names:
            hint = did_you_mean(k, names)
            raise UserError(f"{where}: launch `{launch}` has no field `{k}`{hint}")
        if is_launches(v):
            for i, e in enumerate(v):
                _choice(e, f"{where}.{k}[{i}]")
        elif isinstance(v, dict) and "launch" in v:
            _choice(v, f"{where}.{k}")
        else:
            check_expr(v, f"{where}.{k}")


_CACHE: dict = {}


def load_lane(name: str = "cuda", extra=()) -> LaneTable:
    """The lane table `name` (a user folder's `lanes/` may add or override tables, and its classes.yaml add classes);
    read once per file state."""
    dirs = rule_dirs(extra)
    stacks = lane_stacks(extra)
    files = [p for st in stacks.values() for p in st] + [Path(d) / "classes.yaml" for d in dirs]
    key = (name, tuple((str(p), st.st_mtime_ns, st.st_size) for p in files if p.exists() for st in [p.stat()]))
    if key in _CACHE:
        return _CACHE[key]
    if name not in stacks:
        hint = did_you_mean(name, stacks)
        raise UserError(f"unknown lane `{name}`{hint}; lanes: {', '.join(sorted(stacks))}")
    _CACHE[key] = _load(stacks[name][-1], stacks, load_classes(dirs), set())
    return _CACHE[key]


def _base(path: Path, base: str, stacks: dict[str, list[Path]]) -> Path:
    """The table a `base: NAME` entry of `path` starts from: the top table of that name, or, where NAME is the
    table's own lane, the one below it (a user's cuda.yaml with `base: cuda` starts from the shared one)."""
    stack = stacks.get(base)
    if not stack:
        raise UserError(f"{short_path(path)}: base lane `{base}` is not known{did_you_mean(base, stacks)} "
                        f"(lanes: {', '.join(sorted(stacks))})")
    if base != path.stem:
        return stack[-1]
    mine = [i for i, p in enumerate(stack) if p.resolve() == path.resolve()]
    if not mine or mine[0] == 0:
        raise UserError(f"{short_path(path)}: `base: {base}` names this table itself, and no `{base}` table lies "
                        f"below it; name another lane")
    return stack[mine[0] - 1]


def _load(path: Path, stacks: dict[str, list[Path]], known: dict[str, dict], seen: set[Path]) -> LaneTable:
    if path.resolve() in seen:
        raise UserError(f"{short_path(path)}: the lane tables' `base:` entries form a cycle")
    seen.add(path.resolve())
    doc = load_file(path)  # not UTF-8, bad syntax or an alias bomb: a UserError citing the file and line
    if not isinstance(doc, dict) or "lane" not in doc:
        raise UserError(f"{path}: a lane table is a mapping with `lane:`, `ops:` and `classes:`")
    for k in ("lane", "base", "why"):
        if doc.get(k) is not None and not isinstance(doc[k], str):
            raise UserError(f"{path}:{_line(path, k)}: `{k}:` must be a string, got {short(doc[k])}")
    for k in ("ops", "classes", "schedule", "costs"):
        if doc.get(k) is not None and not isinstance(doc[k], dict):
            raise UserError(f"{path}:{_line(path, k)}: `{k}:` must be a mapping (name: entry), got {short(doc[k])}")
    base = _load(_base(path, str(doc["base"]), stacks), stacks, known, seen) if doc.get("base") else None
    ops: dict[str, list[Choice]] = dict(base.ops) if base else {}
    for kind, entries in (doc.get("ops") or {}).items():
        where = f"{path.name}: ops.{kind}"
        if kind not in OPS:
            hint = did_you_mean(kind, OPS)
            raise UserError(f"{where}: unknown op kind `{kind}`{hint}")
        entries = entries if isinstance(entries, list) else [entries]
        ops[kind] = [_choice(e, where) for e in entries]
        d = OPS[kind]
        for ch in ops[kind]:
            _check_reads(ch, set(d.names) | set(d.attrs), set(), path, ("ops", kind),
                         f"`{kind}`'s inputs and attributes (engine/opdefs.py)")
    classes: dict[str, ClassEntry] = dict(base.classes) if base else {}
    for cls, e in (doc.get("classes") or {}).items():
        where = f"{path.name}: classes.{cls}"
        if cls not in known:
            hint = did_you_mean(cls, known)
            raise UserError(f"{where}: unknown class `{cls}`{hint} (the classes are listed in rules/classes.yaml "
                            f"and a user folder's classes.yaml)")
        if not isinstance(e, dict) or e.get("support") not in SUPPORTS:
            raise UserError(f"{where}: `support:` must be one of {', '.join(SUPPORTS)}")
        sup = e["support"]
        if sup == "refuse" and not e.get("reason"):
            raise UserError(f"{where}: a refused class needs a `reason:` in the user's words")
        for k in ("reason", "why"):
            if e.get(k) is not None and not isinstance(e[k], str):
                raise UserError(f"{where}: `{k}:` must be a string, got {short(e[k])}")
        chs = _class_choices(e, where) if sup == "native" else ()
        c = known[cls]
        need, optional = contract(c)
        for ch in chs:
            _check_reads(ch, set(need), set(optional), path, ("classes", cls),
                         f"class `{cls}`'s contract ({', '.join(c['vars']) or 'no variables'}; "
                         f"{c['file']}:{c['line']})")
        classes[cls] = ClassEntry(cls, sup, chs, e.get("reason", ""), e.get("why", ""), where)
    sched = dict(base.schedule) if base else {}
    gated = dict(base.gated) if base else {}
    holds = dict(base.holds) if base else {}
    for step, e in (doc.get("schedule") or {}).items():
        if isinstance(e, dict):
            kinds = e.get("holds") or []
            if not isinstance(kinds, list) or not all(isinstance(k, str) and k in OPS for k in kinds):
                raise UserError(f"{path.name}: schedule.{step}: `holds:` must be a list of lifted op kinds (the rules "
                                f"matching one are held with the step), got {short(kinds)}")
            holds[step] = tuple(kinds)
            dec = e.get("decompose") or []
            if not isinstance(dec, list) or not all(isinstance(c, str) for c in dec):
                raise UserError(f"{path.name}: schedule.{step}: `decompose:` must be a list of class names, got "
                                f"{short(dec)}")
            for cls in dec:
                if cls not in known:
                    raise UserError(f"{path.name}: schedule.{step}: unknown class `{cls}`{did_you_mean(cls, known)}")
            sched[step] = str(e.get("why", ""))
            gated[step] = tuple(e.get("decompose") or ())
        else:
            sched[step] = str(e)
    costs = dict(base.costs) if base else {}
    costs.update(_costs(doc.get("costs") or {}, path))
    return LaneTable(str(doc["lane"]), str(doc.get("why", "")), ops, classes, sched, str(path), gated, holds, costs)


def _costs(doc: dict, path: Path) -> dict[str, KindCost]:
    """A table's `costs:` (kind: {fixed_us: µs >= 0, bandwidth: a share in (0, 1]}), each kind a launch kind's census
    name, or `kind@format` for its launches over rows of that checkpoint format, or `default` for every kind it does
    not name."""
    import math

    from lanefuse.engine.ir import FORMATS

    kinds = {getattr(c, "census", "") or n for n, c in KINDS.items()}
    out = {}
    for kind, e in doc.items():
        where = f"{path.name}:{_line(path, 'costs')}: costs.{clip(str(kind))}"
        base, _, fmt = str(kind).partition("@")
        if base not in kinds and base != "default":
            raise UserError(f"{where}: unknown launch kind `{clip(base)}`{did_you_mean(base, kinds)}")
        if fmt and fmt not in FORMATS:
            raise UserError(f"{where}: unknown rows format `{clip(fmt)}`{did_you_mean(fmt, FORMATS)}")
        if not isinstance(e, dict) or set(e) != {"fixed_us", "bandwidth"}:
            raise UserError(f"{where}: expected {{fixed_us: µs, bandwidth: a share of hbm_gbps}}, got {short(e)}")
        f, b = e["fixed_us"], e["bandwidth"]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (f, b)) or \
                f < 0 or not 0 < b <= 1:
            raise UserError(f"{where}: fixed_us must be a number >= 0 and bandwidth a share in (0, 1], got "
                            f"{short(f)} and {short(b)}")
        out[str(kind)] = KindCost(float(f), float(b))
    return out


# -- what a field reads ---------------------------------------------------------------------------------------------
def _reads(ch: Choice) -> list[tuple[str, str, bool]]:
    """(where in the entry, name, optional) for every name the choice's `if` and fields read, nested launches too."""
    out = [("if", n, o) for n, o in names_read(ch.when)]

    def walk(fields: dict, at: str):
        for k, v in fields.items():
            if is_launches(v):
                for i, e in enumerate(v):
                    walk(e.get("fields") or {}, f"{at}{k}[{i}].")
            elif isinstance(v, dict) and "launch" in v:
                walk(v.get("fields") or {}, f"{at}{k}.")
            else:
                out.extend((f"{at}{k}", n, o) for n, o in names_read(v))

    walk(ch.fields, "")
    return out


def _check_reads(ch: Choice, need: set[str], optional: set[str], path: Path, keys: tuple[str, str], what: str):
    """Every name the choice reads is `out`, `kind`, or one of `need`; an optional one (`optional`) only as `v?`."""
    for field_at, name, opt in _reads(ch):
        if name in ALWAYS or name in need or (opt and name in optional):
            continue
        at = f"{short_path(path)}:{_line(path, *keys)}: {'.'.join(keys)}"
        what_field = "its `if:`" if field_at == "if" else f"field `{field_at}`"
        if name in optional:
            raise UserError(f"{at}: {what_field} reads `{name}`, which {what} marks optional: read it as `{name}?`")
        hint = did_you_mean(name, need | optional)
        fix = ("add it to the class's `vars:` if every rule of the class binds it (`v?` if only some do), or read the "
               "fused op's parts (`leaf(kind)`)" if keys[0] == "classes" else "read one of those")
        raise UserError(f"{at}: {what_field} reads `{name}`, which is not in {what}{hint}; {fix}")


def _line(path: Path, *keys: str) -> int:
    """The line of the entry `keys` (a path of mapping keys) in the YAML file `path`, for an error to cite."""
    node, line = load_text(read_text(path), str(path))[0], 1
    for k in keys:
        if not isinstance(node, yaml.MappingNode):
            break
        hit = next(((kn, vn) for kn, vn in node.value if isinstance(kn, yaml.ScalarNode) and kn.value == k), None)
        if hit is None:
            break
        line, node = hit[0].start_mark.line + 1, hit[1]
    return line
