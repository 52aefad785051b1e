"""The fusion rule table: loading the YAML (the shared `rules/*.yaml` and a user's `--rules DIR` / LANEFUSE_RULES
dirs), validating each entry with its file:line, and expanding each rule into its concrete variants (one per choice of
alternative kinds, and per producing rule where a pattern names a fused class) for the e-graph to compile. The classes
(`classes.yaml`) are read here too, each with its contract: the variables every rule of it binds."""

from __future__ import annotations

import functools
import itertools
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from lanefuse.engine import flags, yamlsafe
from lanefuse.engine.errors import UserError, clip, did_you_mean
from lanefuse.engine.guards import GUARDS
from lanefuse.engine.opdefs import OPS
from lanefuse.engine.pattern import Arg, Item, PatternError, parse_call, parse_item
from lanefuse.engine.yamlsafe import short

RULE_KEYS = ("name", "class", "why", "match", "out", "keeps", "guards", "with", "absorb")
CLASS_KEYS = ("class", "joins", "launch", "vars")
_VAR = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*\??$")  # a contract's variable; `v?`: optional (some rules bind it)
COMMUTATIVE = ("add", "mul")  # their two inputs may match either way round; the compiler expands both orders
MAX_VARIANTS = 512  # a rule whose alternatives expand past this is refused (split it)
# The queries (variants × commutative orders) a rule may compile to: each costs egglog a join to compile and to run,
# and chained adds double them per add (14: 16k queries, 52 s and 2.4 GB). The shared table's largest (merged_qkv) has 50.
MAX_QUERIES = 256
# ... and all the rules of a table together (the shared table's come to 275): egglog compiles and runs every one each
# iteration, and many rule files at their own cap each reached egglog's memory cap and aborted it
MAX_TABLE_QUERIES = 2048
MAX_NAME = 80  # characters of a rule's or a class's name (a stable key, cited in every message about it)
_TYPES = {int: "i64", float: "f64", str: "String", bool: "i64"}


# -- YAML with line numbers -----------------------------------------------------------------------------------------
class _LineLoader(yamlsafe.SAFE):
    """The safe loader, recording each mapping's first line under the key `__line__`."""


def _construct_mapping(loader, node, deep=False):
    m = yaml.SafeLoader.construct_mapping(loader, node, deep=True)
    m["__line__"] = node.start_mark.line + 1
    return m


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _load_yaml(path: Path) -> Any:
    """A table file's data (each mapping with its `__line__`), read safely (engine/yamlsafe.py): not UTF-8, bad
    syntax or an alias bomb is an error citing the file and line."""
    return yamlsafe.load_file(path, short_path(path), _LineLoader)


# -- the table ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    name: str
    cls: str
    why: str
    items: tuple[Item, ...]
    out: str
    keeps: tuple[str, ...]
    guards: tuple[tuple[str, tuple[Arg, ...]], ...]
    consts: tuple[tuple[str, Any], ...]
    absorb: str | None
    file: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.name} @ {self.file}:{self.line}"

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.out,) + self.keeps

    @property
    def multi(self) -> bool:
        return bool(self.keeps)


@dataclass(frozen=True)
class Param:
    """One argument of a fused e-node: a `child` tensor, an `attr` value, a `const` of the rule's `with`, or the
    `name` of a tensor the op computes inside (so the fused op can name it)."""

    name: str
    type: str  # T | i64 | f64 | String
    role: str  # child | attr | const | name


@dataclass(frozen=True)
class Atom:
    var: str  # the tensor this atom's e-node computes
    ctor: str  # an egglog constructor: a lifted kind's, or a fused variant's
    args: tuple[Arg, ...]
    kind: str = ""  # the lifted op kind, for a lifted atom ("" for a fused variant's)


@dataclass(frozen=True)
class Variant:
    """One concrete form of a rule: its fused e-node's constructor and layout, and the queries (commutative orders)
    that make it."""

    rule: str
    ctor: str
    params: tuple[Param, ...]
    queries: tuple[tuple[Atom, ...], ...]
    types: tuple[tuple[str, str], ...]
    via: tuple[str, ...]  # the rules whose fused classes this variant matches through

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)


@functools.lru_cache(maxsize=None)
def lifted_layout(kind: str, n_ins: int) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The egglog constructor of a lifted op of `kind` with `n_ins` inputs, and its (argument, type) list: the
    inputs, then every attribute in the op table's order."""
    d = OPS[kind]
    ctor = kind if n_ins == len(d.required) else f"{kind}_{n_ins}"
    args = tuple((n, "T") for n in d.names[:n_ins]) + tuple((a, _TYPES[t]) for a, t in d.attrs.items())
    return ctor, args


@dataclass
class RuleTable:
    rules: list[Rule]
    classes: dict[str, dict]
    variants: dict[str, list[Variant]] = field(default_factory=dict)
    dirs: tuple[str, ...] = ()
    warnings: list[str] = field(default_factory=list)  # what loads but is likely a mistake (a pattern that never joins)

    def __post_init__(self):
        self.by_name = {r.name: r for r in self.rules}

    def rule(self, name: str) -> Rule:
        r = self.by_name.get(name)
        if r is None:
            raise UserError(f"unknown rule `{name}`{did_you_mean(name, self.by_name)}; known: {', '.join(self.names)}")
        return r

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rules]

    def makers(self, cls: str) -> list[Rule]:
        return [r for r in self.rules if r.cls == cls]

    def depends_on(self, name: str) -> list[str]:
        """The rules whose classes `name`'s patterns match through."""
        return sorted({v for var in self.variants[name] for v in var.via})

    def dependents(self, name: str) -> dict[str, str]:
        """The rules that match through `name`'s class: `fully` when every variant goes through it, else `partly`."""
        out = {}
        for r in self.rules:
            vs = self.variants[r.name]
            through = [v for v in vs if name in v.via]
            if through:
                out[r.name] = "fully" if len(through) == len(vs) else "partly"
        return out

    def check_held(self, held) -> dict[str, dict[str, str]]:
        """Validate held rule names; for each, which other rules it disables and how."""
        out = {}
        for h in sorted(held):
            self.rule(h)
            out[h] = self.dependents(h)
        return out

    def active_variants(self, held) -> list[Variant]:
        held = set(held)
        return [v for r in self.rules if r.name not in held for v in self.variants[r.name]
                if not held.intersection(v.via)]


# -- loading --------------------------------------------------------------------------------------------------------
def _builtin_dir() -> Path:
    return Path(str(resources.files("lanefuse.rules")))


def user_dirs(extra=()) -> list[str]:
    dirs = flags.read("LANEFUSE_RULES")  # os.pathsep-separated, like PATH
    return dirs + [str(d) for d in extra]


def rule_dirs(extra=(), builtin: bool = True) -> list[str]:
    """The folders the tables load from, in order: the shared one, then LANEFUSE_RULES's, then `extra` (--rules); a
    folder named twice counts once, and a user folder that does not exist is an error."""
    dirs = ([str(_builtin_dir())] if builtin else []) + user_dirs(extra)
    dirs = list({str(Path(d).resolve()): d for d in dirs}.values())
    for d in dirs[1 if builtin else 0:]:
        if not Path(d).is_dir():
            raise UserError(f"rules dir `{d}` does not exist (from --rules or LANEFUSE_RULES)")
    return dirs


def load_classes(dirs) -> dict[str, dict]:
    """The fused classes of the `classes.yaml` of each of `dirs`: name -> its entry (`joins`, `launch`, `vars`: the
    contract) with the `file` and `line` it is written at. A folder adds classes; it never redefines one."""
    classes: dict[str, dict] = {}
    for d in dirs:
        p = Path(d) / "classes.yaml"
        if not p.exists():
            continue
        fname = short_path(p)
        data = _load_yaml(p) or []
        if not isinstance(data, list):
            raise UserError(f"{fname}:1: expected a list of `- {{class: NAME, joins: ..., vars: [...]}}` entries")
        for e in data:
            line = e.pop("__line__", 1) if isinstance(e, dict) else 1
            at = f"{fname}:{line}"
            if not isinstance(e, dict) or "class" not in e:
                raise UserError(f"{at}: an entry without `class:`")
            name = e["class"]
            if not isinstance(name, str) or not name.strip():
                raise UserError(f"{at}: `class:` must be the class's name, a non-empty string, got {short(name)}")
            if len(name) > MAX_NAME or not name.isprintable():
                raise UserError(f"{at}: `class:` {clip(name)}: a class's name is at most {MAX_NAME} printable "
                                f"characters")
            for k in e:
                if k not in CLASS_KEYS:
                    raise UserError(f"{at}: class `{name}`: unknown key `{_cut(str(k))}`{did_you_mean(str(k), CLASS_KEYS)}; "
                                    f"a class has {', '.join(CLASS_KEYS)}")
            for k in ("joins", "launch"):
                if e.get(k) is not None and not isinstance(e[k], str):
                    raise UserError(f"{at}: class `{name}`: `{k}:` must be a string, got {short(e[k])}")
            if name in classes:
                first = classes[name]
                raise UserError(f"{at}: class `{name}` is defined twice (first at {first['file']}:{first['line']}); "
                                f"a folder adds classes of new names")
            vs = e.get("vars")
            if vs is None:
                raise UserError(f"{at}: class `{name}` has no `vars:`: list the variables every rule of it binds and "
                                f"its lane entries read, e.g. `vars: [x, w, y]` (`vars: []` for none)")
            if not isinstance(vs, list) or not all(isinstance(v, str) and _VAR.match(v) for v in vs):
                raise UserError(f"{at}: class `{name}`: `vars:` is a list of variable names, e.g. `[x, w, y]` "
                                f"(`v?` for one only some rules bind), got {short(vs)}")
            if len({v.rstrip("?") for v in vs}) != len(vs):
                raise UserError(f"{at}: class `{name}`: a variable is listed twice in `vars:`")
            classes[name] = {**e, "vars": tuple(vs), "file": fname, "line": line}
    return classes


def contract(entry: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A class's contract, from its classes.yaml entry: (the variables every rule binds, the optional ones `v?`)."""
    vs = entry.get("vars", ())
    return tuple(v for v in vs if not v.endswith("?")), tuple(v[:-1] for v in vs if v.endswith("?"))


def load_table(extra_dirs=(), builtin: bool = True, contracts: bool = True) -> RuleTable:
    """The shared table plus the user's rule dirs (`extra_dirs`, then LANEFUSE_RULES, separated by os.pathsep). With
    `contracts`, a rule that does not bind its class's variables is an error (`contract_problems` lists them all)."""
    dirs = rule_dirs(extra_dirs, builtin)
    classes = load_classes(dirs)
    rules: list[Rule] = []
    seen: dict[str, Rule] = {}
    for d in dirs:
        for p in sorted(Path(d).glob("*.yaml")):
            if p.name == "classes.yaml":
                continue
            for r in _load_file(p, classes):
                if r.name in seen:
                    raise UserError(f"{r.file}:{r.line}: rule `{r.name}` is defined twice (first at "
                                    f"{seen[r.name].file}:{seen[r.name].line}); rename one")
                seen[r.name] = r
                rules.append(r)
    table = RuleTable(rules, classes, dirs=tuple(dirs))
    _expand_all(table)
    if contracts:
        problems = contract_problems(table)
        if problems:
            more = f" (and {len(problems) - 1} more; `lanefuse rules --check` lists them)" if len(problems) > 1 else ""
            raise UserError(problems[0] + more)
    return table


def short_path(path: Path) -> str:
    """A table file as errors cite it: `rules/...` for the shared tables, the path as given for a user's."""
    try:
        return str(Path(path).relative_to(_builtin_dir().parent))
    except ValueError:
        return str(path)


def _load_file(path: Path, classes: dict) -> list[Rule]:
    data = _load_yaml(path)
    fname = short_path(path)
    if data is None:
        return []
    if not isinstance(data, list):
        raise UserError(f"{fname}:1: a rules file is a list of `- name: ...` entries")
    return [_rule(e, fname, classes) for e in data]


def _rule(e: Any, fname: str, classes: dict) -> Rule:
    if not isinstance(e, dict):
        raise UserError(f"{fname}: an entry is not a mapping (`- name: ..., class: ..., match: ...`)")
    line = e.pop("__line__", 0)
    name = e.get("name")
    if isinstance(name, str) and (len(name) > MAX_NAME or not name.isprintable()):
        raise UserError(f"{fname}:{line}: `name:` {clip(name)}: a rule's name is a stable key of at most {MAX_NAME} "
                        f"printable characters, e.g. `my.add_norm`")
    at = f"{fname}:{line}" + (f" (rule `{name}`)" if isinstance(name, str) and name.strip() else "")
    for k in e:
        if k not in RULE_KEYS:
            raise UserError(f"{at}: unknown key `{_cut(str(k))}`{did_you_mean(str(k), RULE_KEYS)}; a rule has "
                            f"{', '.join(RULE_KEYS)}")
    for k in ("name", "class", "match"):
        if k not in e:
            raise UserError(f"{at}: missing `{k}:`")
    if not isinstance(name, str) or not name.strip():
        raise UserError(f"{at}: `name:` must be the rule's name, a non-empty string (a stable key such as "
                        f"`my.add_norm`), got {short(name)}")
    for k in ("class", "why"):
        if e.get(k) is not None and not isinstance(e[k], str):
            raise UserError(f"{at}: `{k}:` must be a string, got {short(e[k])}")
    if not e["class"]:
        raise UserError(f"{at}: `class:` is empty; name one of the classes of rules/classes.yaml")
    cls = e["class"]
    if cls not in classes:
        raise UserError(f"{at}: unknown class `{clip(cls)}`{did_you_mean(cls[:MAX_NAME], classes)}; the classes are "
                        f"listed in rules/classes.yaml")
    match = e["match"]
    if not isinstance(match, dict) or not [k for k in match if k != "__line__"]:
        raise UserError(f"{at}: `match:` is a mapping of `var: kind(args)` entries, one per op")
    items = []
    for var, text in match.items():
        if var == "__line__":
            continue
        if not isinstance(text, str):
            raise UserError(f"{at}: match `{_cut(str(var))}`: expected `kind(args)` text, e.g. `rmsnorm(s, w)`, got "
                            f"{short(text)}")
        try:
            items.append(parse_item(str(var), text))
        except PatternError as err:
            raise UserError(f"{at}: match `{var}`: {err}") from None
    vars_ = [i.var for i in items]
    if len(set(vars_)) != len(vars_):
        raise UserError(f"{at}: a pattern variable is defined twice")
    out = e.get("out", vars_[-1])
    if not isinstance(out, str):
        raise UserError(f"{at}: `out:` is one pattern variable ({', '.join(vars_)}), got {short(out)}")
    keeps_ = e.get("keeps") or []
    if not isinstance(keeps_, list) or not all(isinstance(k, str) for k in keeps_):
        raise UserError(f"{at}: `keeps:` is a list of pattern variables, e.g. `[s]`, got {short(keeps_)}")
    keeps = tuple(keeps_)
    for v in (out,) + keeps:
        if v not in vars_:
            raise UserError(f"{at}: output `{v}` is not a pattern variable{did_you_mean(v, vars_)} ({', '.join(vars_)})")
    absorb = e.get("absorb")
    if absorb is not None and not isinstance(absorb, str):
        raise UserError(f"{at}: `absorb:` is one pattern variable, got {short(absorb)}")
    if absorb is not None and absorb not in vars_:
        raise UserError(f"{at}: absorb `{absorb}` is not a pattern variable{did_you_mean(str(absorb), vars_)}")
    if absorb is not None and (absorb in (out,) + keeps):
        raise UserError(f"{at}: absorb `{absorb}` cannot also be an output")
    guards = []
    gs = e.get("guards") or []
    if not isinstance(gs, list) or not all(isinstance(g, str) for g in gs):
        raise UserError(f"{at}: `guards:` is a list of guards, one a line (`- single_reader(p)`), got {short(gs)}")
    for g in gs:
        try:
            gname, gargs = parse_call(g)
        except PatternError as err:
            hint = (" (a guard with commas inside a `[...]` list must be quoted, or listed one a line with `- `)"
                    if str(g).count("(") != str(g).count(")") else "")
            raise UserError(f"{at}: {err}{hint}") from None
        spec = GUARDS.get(gname)
        if spec is None or spec.internal:
            named = [n for n, g in GUARDS.items() if not g.internal]
            raise UserError(f"{at}: unknown guard `{gname}`{did_you_mean(gname, named)}; known: {', '.join(named)}")
        want = spec.args
        ok = len(gargs) == len(want) or (want[-1] == "..." and len(gargs) >= len(want) - 1)
        if not ok:
            raise UserError(f"{at}: guard `{gname}` takes ({', '.join(want)}), got {len(gargs)} arguments")
        guards.append((gname, gargs))
    consts = e.get("with") or {}
    if not isinstance(consts, dict):
        raise UserError(f"{at}: `with:` is a mapping of constant binds, e.g. {{act: silu}}")
    consts.pop("__line__", None)
    for k, v in consts.items():
        if not isinstance(k, str) or not isinstance(v, (str, int, float)):
            raise UserError(f"{at}: `with:` binds a name to a number, string or boolean, got {short(k)}: {short(v)}")
    return Rule(name, cls, e.get("why") or "", tuple(items), out, keeps, tuple(guards),
                tuple(consts.items()), absorb, fname, line)


# -- expansion into variants ----------------------------------------------------------------------------------------
def _expand_all(table: RuleTable) -> None:
    by_class: dict[str, list[Rule]] = {}
    for r in table.rules:
        by_class.setdefault(r.cls, []).append(r)
    # Rules in dependency order: a rule is expanded after every rule making a class its patterns name.
    state: dict[str, int] = {}
    order: list[Rule] = []

    def visit(r: Rule, stack: list[str]):
        if state.get(r.name) == 2:
            return
        if state.get(r.name) == 1:
            raise UserError(f"{r.file}:{r.line}: rules {' -> '.join(stack + [r.name])} match each other's classes "
                            f"in a cycle; one of them must match lifted ops")
        state[r.name] = 1
        for it in r.items:
            for k in it.kinds:
                if k in OPS:
                    continue
                if k not in table.classes:
                    known = list(OPS) + [c for c in by_class]
                    raise UserError(f"{r.file}:{r.line} (rule `{r.name}`): match `{it.var}`: unknown op or class "
                                    f"`{k}`{did_you_mean(k, known)}")
                if k not in by_class:
                    raise UserError(f"{r.file}:{r.line} (rule `{r.name}`): match `{it.var}` names class `{k}`, which "
                                    f"no rule makes")
                for dep in by_class[k]:
                    visit(dep, stack + [r.name])
        state[r.name] = 2
        order.append(r)

    for r in table.rules:
        visit(r, [])
    total = 0
    for idx, r in enumerate(order):
        table.variants[r.name] = _expand(r, table, by_class, idx)
        total += sum(len(v.queries) for v in table.variants[r.name])
        if total > MAX_TABLE_QUERIES:
            raise UserError(f"{r.file}:{r.line} (rule `{r.name}`): the table's rules expand to {total} queries with "
                            f"this one (at most {MAX_TABLE_QUERIES} in all, the shared table's about 275): load fewer "
                            f"rule folders at once, or split rules that chain commutative adds")
        w = _unjoined(r, table.variants[r.name])
        if w:
            table.warnings.append(w)


def _unjoined(rule: Rule, variants: list[Variant]) -> str | None:
    """A warning where the pattern's ops fall into groups that share no tensor variable (nor a `same_layer` guard):
    such a rule matches every op of one group with every op of the other (a one-letter slip, `rmsnorm(t, ...)` for
    `rmsnorm(s, ...)`), and its matches grow as their product."""
    if len(rule.items) < 2 or not variants:
        return None
    v = variants[0]
    types = dict(v.types)
    parent = {it.var: it.var for it in rule.items}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    owner: dict[str, str] = {}  # a tensor variable -> the first item naming it

    def join(item_var: str, var: str):
        if var in owner:
            parent[find(item_var)] = find(owner[var])
        else:
            owner[var] = item_var

    for atom in v.queries[0]:
        join(atom.var, atom.var)
        for a in atom.args:
            if a.var is not None and types.get(a.var) == "T" and not a.var.startswith(f"{atom.var}."):
                join(atom.var, a.var)
    for g, gargs in rule.guards:
        if g == "same_layer":
            vs = [a.var for a in gargs if a.var is not None and a.var in owner]
            for x in vs[1:]:
                parent[find(owner[x])] = find(owner[vs[0]])
    groups: dict[str, list[Item]] = {}
    for it in rule.items:
        groups.setdefault(find(it.var), []).append(it)
    if len(groups) < 2:
        return None
    parts = [" + ".join(f"`{it.var}: {_cut(it.text)}`" for it in g) for g in groups.values()]
    return (f"{rule.where}: its pattern's ops do not join: {' and '.join(parts)} share no variable, so it matches "
            f"every pair of them (in every layer); make one op read the other's result or a shared input (or add "
            f"`same_layer(...)`)")


class _Ctx:
    def __init__(self, rule: Rule):
        self.rule = rule
        self.types: dict[str, str] = {}
        self.at = f"{rule.file}:{rule.line} (rule `{rule.name}`)"

    def typed(self, var: str, t: str, where: str):
        old = self.types.get(var)
        if old is not None and old != t:
            raise UserError(f"{self.at}: `{var}` is used as {old} and as {t} ({where})")
        self.types[var] = t


def _cut(text: str, n: int = 80) -> str:
    """A pattern's text as a message cites it: at most `n` characters."""
    return text if len(text) <= n else text[:n - 3] + "..."


def _lit(a: Arg, t: str, at: str) -> Arg:
    v = a.lit
    if t == "T":
        raise UserError(f"{at}: a literal {short(v)} where a tensor is expected")
    if t == "f64" and isinstance(v, int) and not isinstance(v, bool):
        return Arg(lit=float(v))
    want = {"i64": int, "f64": float, "String": str}[t]
    if not isinstance(v, want) and not (t == "i64" and isinstance(v, bool)):
        raise UserError(f"{at}: literal {short(v)} is not {t}")
    return a


def _lifted_atom(it: Item, kind: str, ctx: _Ctx) -> tuple[Atom, list[list[Arg]]]:
    d = OPS[kind]
    at = f"{ctx.at}: match `{it.var}: {_cut(it.text)}`"
    n_ins = len(d.required)
    if len(it.pos) > len(d.names):
        raise UserError(f"{at}: `{kind}` takes inputs ({', '.join(d.ins)}), got {len(it.pos)}")
    n_ins = max(n_ins, len(it.pos), *(d.names.index(k) + 1 for k, _ in it.kw if k in d.names[:len(d.ins)]), 0)
    ctor, layout = lifted_layout(kind, n_ins)
    names = [n for n, _ in layout]
    given: dict[str, Arg] = {}
    for i, a in enumerate(it.pos):
        given[names[i]] = a
    for k, a in it.kw:
        if k not in names:
            raise UserError(f"{at}: `{kind}` has no input or attribute `{k}`{did_you_mean(k, names)} "
                            f"(inputs {', '.join(d.ins)}; attributes {', '.join(d.attrs) or 'none'})")
        if k in given:
            raise UserError(f"{at}: `{k}` given twice")
        given[k] = a
    args = []
    for n, t in layout:
        a = given.get(n)
        if a is None or a.var == "_":
            a = Arg(var=f"{it.var}.{n}")
        if a.var is not None:
            ctx.typed(a.var, t, at)
        else:
            a = _lit(a, t, at)
        args.append(a)
    orders = [list(args)]
    if kind in COMMUTATIVE and args[0] != args[1]:
        orders.append([args[1], args[0]] + args[2:])
    return Atom(it.var, ctor, tuple(args), kind), orders


def _class_atoms(it: Item, cls: str, table: RuleTable, by_class, ctx: _Ctx) -> list[tuple[Atom, list[list[Arg]], str]]:
    at = f"{ctx.at}: match `{it.var}: {_cut(it.text)}`"
    if it.pos:
        raise UserError(f"{at}: a fused class takes keyword arguments only (its rule's variables), e.g. "
                        f"`{cls}(x=p)`")
    out = []
    params_seen: set[str] = set()
    for r in by_class[cls]:
        if r.multi:
            raise UserError(f"{at}: class `{cls}` is made multi-output by `{r.where}`; a pattern can name only "
                            f"single-output classes")
        for v in table.variants[r.name]:
            names = {p.name for p in v.params if p.role != "name"}
            params_seen |= names
            if any(k not in names for k, _ in it.kw):
                continue
            kw = dict(it.kw)
            args = []
            for p in v.params:
                a = kw.get(p.name) if p.role != "name" else None
                if a is None or a.var == "_":
                    a = Arg(var=f"{it.var}.{p.name}")
                if a.var is not None:
                    ctx.typed(a.var, "name" if p.role == "name" else p.type, at)
                else:
                    a = _lit(a, p.type, at)
                args.append(a)
            out.append((Atom(it.var, v.ctor, tuple(args)), [args], r.name))
    if not out:
        bad = [k for k, _ in it.kw if k not in params_seen]
        raise UserError(f"{at}: no rule making `{cls}` has the variable(s) {', '.join(f'`{b}`' for b in bad)}"
                        f"{did_you_mean(bad[0], params_seen) if bad else ''}; its rules bind {', '.join(sorted(params_seen))}")
    return out


def _expand(rule: Rule, table: RuleTable, by_class, idx: int) -> list[Variant]:
    # Every item's alternatives: (atom, commutative orders, via rule or None).
    per_item = []
    for it in rule.items:
        alts = []
        for k in it.kinds:
            if k in OPS:
                ctx = _Ctx(rule)
                atom, orders = _lifted_atom(it, k, ctx)
                alts.append((atom, orders, None))
            else:
                alts.extend(_class_atoms(it, k, table, by_class, _Ctx(rule)))
        per_item.append(alts)
    n = 1
    for a in per_item:
        n *= len(a)
    if n > MAX_VARIANTS:
        raise UserError(f"{rule.file}:{rule.line} (rule `{rule.name}`): its alternatives expand to {n} variants "
                        f"(at most {MAX_VARIANTS}); split it into several rules")
    nq = 1  # every variant's commutative orders, summed over the variants
    for alts in per_item:
        nq *= sum(len(orders) for _, orders, _ in alts)
    if nq > MAX_QUERIES:
        n_comm = sum(1 for it in rule.items if any(k in COMMUTATIVE for k in it.kinds))
        raise UserError(f"{rule.file}:{rule.line} (rule `{rule.name}`): its {n} variant(s) and the two orders of its "
                        f"{n_comm} add/mul op(s) expand to {nq} queries (at most {MAX_QUERIES}); split it into "
                        f"several rules (a chain of adds as rules matching each other's class)")
    variants = []
    for k, combo in enumerate(itertools.product(*per_item)):
        ctx = _Ctx(rule)
        for it, (atom, _, via) in zip(rule.items, combo):
            # re-type in one context: a variable shared by items must agree
            if via is None:
                _lifted_atom(it, atom.kind, ctx)
            else:
                v = next(v for v in table.variants[via] if v.ctor == atom.ctor)
                for p, a in zip(v.params, atom.args):
                    if a.var is not None:
                        ctx.typed(a.var, "name" if p.role == "name" else p.type, ctx.at)
        variants.append(_variant(rule, combo, ctx, f"F{idx}_{k}"))
    return variants


def _variant(rule: Rule, combo, ctx: _Ctx, ctor: str) -> Variant:
    at = ctx.at
    produced = [it.var for it in rule.items if it.var != rule.absorb]
    for it in rule.items:
        ctx.typed(it.var, "T", at)
    seen: list[str] = []
    if rule.absorb:
        seen.append(rule.absorb)
    for it, (atom, _, _) in zip(rule.items, combo):
        if it.var == rule.absorb:
            continue
        for a in atom.args:
            if a.var is not None and a.var not in seen:
                seen.append(a.var)
    children = [v for v in seen if ctx.types[v] == "T" and v not in produced]
    attrs = [v for v in seen if ctx.types[v] in ("i64", "f64", "String") and ctx.types[v] != "name"]
    # The tensors a fused op computes inside are found from its parts (optimize.py), not carried in the e-node:
    # naming them in the query would cost a join per tensor.
    names: list[str] = []
    params = ([Param(v, "T", "child") for v in children] + [Param(v, ctx.types[v], "attr") for v in attrs]
              + [Param(k, _TYPES[type(val)], "const") for k, val in rule.consts]
              + [Param(v, "String", "name") for v in names])
    for g, gargs in rule.guards:
        for a in gargs:
            if a.var is not None and a.var not in ctx.types:
                raise UserError(f"{at}: guard `{g}` names `{a.var}`, which no pattern binds"
                                f"{did_you_mean(a.var, ctx.types)}")
    orders = [o for _, o, _ in combo]
    queries = []
    for choice in itertools.product(*orders):
        queries.append(tuple(Atom(atom.var, atom.ctor, tuple(args), atom.kind)
                             for (atom, _, _), args in zip(combo, choice)))
    via = tuple(sorted({v for _, _, v in combo if v}))
    return Variant(rule.name, ctor, tuple(params), tuple(queries), tuple(sorted(ctx.types.items())), via)


# -- class contracts ------------------------------------------------------------------------------------------------
def rule_binds(table: RuleTable, rule: Rule) -> set[str]:
    """The names every variant of `rule` binds, which a lane entry of its class can read: the pattern's variables
    no pattern op produces (its inputs and attribute variables, `eps=eps`, or `y.eps` for one left out), the
    constants of `with:`, and its results (`out`, `keeps`). An intermediate a pattern op produces is not bound."""
    sets = [{p.name for p in v.params if p.role != "name"} | set(rule.outputs) for v in table.variants[rule.name]]
    return set.intersection(*sets) if sets else set(rule.outputs)


def contract_problems(table: RuleTable) -> list[str]:
    """One line for each variable of a class's contract that a rule of the class does not bind."""
    out = []
    for r in table.rules:
        entry = table.classes[r.cls]
        need, _ = contract(entry)
        bound = rule_binds(table, r)
        produced = {it.var for it in r.items} - set(r.outputs)
        for v in need:
            if v in bound:
                continue
            if v in produced:
                hint = f"; `{v}` is computed inside the fused op, not bound: list it in `keeps:` to make it a result"
            else:
                hint = (f"; the rule binds {', '.join(sorted(bound))}{did_you_mean(v, bound)}: name the variable `{v}` "
                        f"in its pattern or `with:`")
            out.append(f"{r.where}: rule of class `{r.cls}` does not bind `{v}` (the class's contract: "
                       f"{', '.join(entry['vars'])}){hint}")
    return out


# -- listings for the command ---------------------------------------------------------------------------------------
def rules_listing(table: RuleTable) -> list[tuple[str, str, str, list[str]]]:
    """One row a rule: (name, class, file:line, the rules it matches through)."""
    return [(r.name, r.cls, f"{r.file}:{r.line}", table.depends_on(r.name)) for r in table.rules]


def check_rules_dir(path: str, lane_classes) -> list[str]:
    """Problems with a rules dir added to the shared table: load errors, and classes the dir's rules make that no
    lane links (`lane_classes`: every class some lane's table links)."""
    try:
        table = load_table([path], contracts=False)  # contract errors are `contract_problems`'s
    except UserError as e:
        return [str(e)]
    problems = []
    lane_classes = set(lane_classes)
    mine = str(Path(path).resolve())
    problems += [w for w in table.warnings if w.split(" @ ", 1)[0] in
                 {r.name for r in table.rules if str(Path(r.file).resolve()).startswith(mine)}]
    for r in table.rules:
        if str(Path(r.file).resolve()).startswith(mine) and r.cls not in lane_classes:
            problems.append(f"{r.where}: class `{r.cls}` is linked by no lane; add it to a lane's class table "
                            f"(native, decompose or refuse)")
    return problems
