"""The e-graph: the one module that imports egglog. A step graph loads in bulk (one TSV per op kind, read with
egglog's `input`), each rule of the table compiles to its own ruleset of egglog rules, saturation runs the rules not
held back within an e-node budget and a match limit, an audit checks that no e-class holds two tensors of the step
graph, and a snapshot decodes `freeze()` into Python e-classes and e-nodes."""

from __future__ import annotations

import atexit
import csv
import functools
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from egglog import bindings

from lanefuse.engine.errors import UserError
from lanefuse.engine.guards import GUARDS, JOINT
from lanefuse.engine.ir import Graph
from lanefuse.engine.opdefs import OPS, full_attrs
from lanefuse.engine.pattern import Arg
from lanefuse.engine.rules import Rule, RuleTable, Variant, lifted_layout

FACTS = ("SingleReader", "Values", "Rows", "StepNext", "Unrotated")
# What ends the walk of `Unrotated`: the ops whose result is no longer the product's values (another product, an
# attention, a mixture)
PRODUCTS = ("matmul", "head_matmul", "attention", "moe")


class ENode(NamedTuple):
    fn: str  # the constructor: Leaf, proj, a lifted kind's (`matmul`, `attention_5`, `matmul_x`), a variant's `F..`
    children: tuple[int, ...]  # the e-classes of its tensor arguments, in order
    prims: tuple  # its other arguments (attributes, constants, names), in order
    cls: int


@dataclass
class Snapshot:
    """The saturated e-graph as Python data: e-classes (ids) of e-nodes, and the step tensor each class holds."""

    classes: dict[int, list[ENode]]
    names: dict[int, str]  # e-class -> the step graph's tensor in it (bundle classes have none)
    by_name: dict[str, int]

    @property
    def n_nodes(self) -> int:
        return sum(len(v) for v in self.classes.values())


@dataclass
class SatReport:
    iterations: int = 0
    stop: str = ""
    matches: dict[str, int] = field(default_factory=dict)  # rule name -> matches over all iterations
    # each iteration: its stage (a stage compiles the variants that match through fused ops made before it), the
    # matches per rule in it (rules that matched only) and the e-graph's e-nodes after it
    steps: list[dict] = field(default_factory=list)


def _var(name: str) -> str:
    return "v_" + "".join(c if c.isalnum() else "_" + format(ord(c), "x") + "_" for c in name)


def _lit(v) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        r = repr(v)
        if r in ("inf", "-inf", "nan"):
            raise UserError(f"attribute value {r} cannot enter the e-graph")
        return r if ("." in r or "e" in r) else r + ".0"
    s = str(v)
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _arg_text(a: Arg) -> str:
    return _var(a.var) if a.var is not None else _lit(a.lit)


def _joined_keys(guards) -> list:
    """The guards with `same_layer` and `same_depth` (or `same_cols`) over the same tensors as one guard on their
    joint key (`same_layer_depth`, `same_layer_cols`): egglog 13 plans a join on two separate keys as the cross
    product of the ops first (norm_pair: 78 ms a saturation at DeepSeek-V3's 61 layers, 3.6 ms on the joint key)."""
    guards = list(guards)
    for other, joint in (("same_depth", "same_layer_depth"), ("same_cols", "same_layer_cols")):
        layer = [(i, g) for i, g in enumerate(guards) if g[0] == "same_layer"]
        for i, (_, args) in layer:
            j = next((j for j, g in enumerate(guards) if g[0] == other and set(map(_arg_text, g[1]))
                      == set(map(_arg_text, args))), None)
            if j is not None:
                guards[i] = (joint, args)
                del guards[j]
                break
    return guards


def compile_variant(v: Variant, rule: Rule, label: str) -> list[str]:
    """The egglog rules of one variant (one per commutative order of its query)."""
    out = []
    types = dict(v.types)
    guards = _joined_keys(rule.guards)  # the same for every query
    for qi, query in enumerate(v.queries):
        n = [0]

        def fresh() -> str:
            n[0] += 1
            return f"g_{n[0]}"

        atoms = []
        for a in query:
            atoms.append(f"(= {_var(a.var)} ({a.ctor} {' '.join(_arg_text(x) for x in a.args)}))")
        for p in v.params:
            if p.role == "name" and types.get(p.name) != "name":
                atoms.append(f"(Orig {_var(p.name)} {_var(p.name + '#name')} {fresh()})")
        lead = []
        for gname, gargs in guards:
            guard = GUARDS[gname]
            (lead if guard.lead else atoms).extend(guard.compile([_arg_text(a) for a in gargs], fresh))
        atoms = lead + atoms
        args = []
        consts = dict(rule.consts)
        for p in v.params:
            if p.role == "const":
                args.append(_lit(consts[p.name]))
            elif p.role == "name" and types.get(p.name) != "name":
                args.append(_var(p.name + "#name"))
            else:
                args.append(_var(p.name))
        node = f"({v.ctor} {' '.join(args)})"
        if len(rule.outputs) == 1:
            actions = [f"(union {_var(rule.outputs[0])} {node})"]
        else:
            actions = [f"(let b_ {node})"] + [f"(union {_var(o)} (proj b_ {i}))" for i, o in enumerate(rule.outputs)]
        out.append(f"(rule ({' '.join(atoms)}) ({' '.join(actions)}) :ruleset {label} :name \"{v.ctor}.{qi}\")")
    return out


@functools.lru_cache(maxsize=4096)
def _compiled(v: Variant, rule: Rule, label: str) -> tuple[str, ...]:
    """compile_variant's text, once a variant of a table: every plan() builds a new e-graph over the same rules."""
    return tuple(compile_variant(v, rule, label))


# egglog's e-graph is bound to the thread that made it: dropped on another it is leaked with a RuntimeError printed as
# unraisable. Python's cyclic collector runs on whichever thread allocates when it is due, so a wrapper left in a cycle
# (a traceback's frames holding a Session, as a refused plan leaves them) was collected on the explorer's engine thread
# (CI, 2026-12-06). Such an e-graph waits here for its own thread, which drops it when it next makes one (or at exit);
# one whose thread has ended is let go: egglog leaks it, as it would anyway, without the line.
_ORPHANS: dict[threading.Thread, list] = {}
_ORPHANS_LOCK = threading.Lock()
_LEAKED = "is unsendable, but is being dropped on another thread"


def _let_go(egs: list) -> None:
    """Drop e-graphs whose thread has ended: egglog leaks each (nothing else can free it) and says so as unraisable;
    that line, expected here, is not printed."""
    old = sys.unraisablehook
    sys.unraisablehook = lambda u: None if _LEAKED in str(u.exc_value) else old(u)
    try:
        egs.clear()
    finally:
        sys.unraisablehook = old


def _drop_orphans() -> None:
    """On this thread: drop the e-graphs that waited for it, and let go of those whose thread has ended."""
    me = threading.current_thread()
    with _ORPHANS_LOCK:
        mine = _ORPHANS.pop(me, [])
        gone = [eg for t in [t for t in _ORPHANS if not t.is_alive()] for eg in _ORPHANS.pop(t)]
    mine.clear()
    _let_go(gone)


atexit.register(_drop_orphans)


class EGraph:
    """One step graph in egglog with every rule of a table compiled, ready to saturate under a held set."""

    def __init__(self, g: Graph, table: RuleTable, eager: bool = False):
        t0 = time.perf_counter()
        _drop_orphans()
        self.g, self.table = g, table
        self._thread = threading.current_thread()
        self.eg = bindings.EGraph()
        self.variant_of: dict[str, Variant] = {}
        self.rule_of: dict[str, Rule] = {}  # variant constructor -> its rule
        self.rule_label: dict[str, str] = {}
        self._combined = 0
        self._depth = 0  # push depth
        self._pending: list[str] = []  # variants compiled inside a push, compiled again at the next push
        self.loaded_nodes = 0
        self.lifted: dict[str, tuple] = {}
        for kind, d in OPS.items():
            for n in range(len(d.required), len(d.ins) + 1):
                ctor, layout = lifted_layout(kind, n)
                self.lifted[ctor] = (kind, n, layout, False)
                self.lifted[ctor + "_x"] = (kind, n, layout, True)  # a strided read or a placed result: never matched
        for i, r in enumerate(table.rules):
            self.rule_label[r.name] = f"R{i}_"
            for v in table.variants[r.name]:
                self.variant_of[v.ctor] = v
                self.rule_of[v.ctor] = r
        self.compiled: set[str] = set()  # the variants whose constructor and rules egglog has, outside any push
        self._rows: dict[str, list[list]] = {}
        with tempfile.TemporaryDirectory(prefix="lanefuse-eg-") as tmp:
            load = self._load(Path(tmp))
            prog = self._declarations(self.lifted if eager else self._rows) + load
            # the variants over lifted ops alone; the others compile once what they match exists (see `saturate`)
            # (`eager`: every variant now, as a test compares)
            base = [c for c, v in self.variant_of.items() if eager or any(all(a.ctor in self._rows for a in q)
                                                                            for q in v.queries)]
            # One command at a time: a long program parses and runs in time quadratic in its length (egglog 13).
            # The rules compile before the graph loads: a command run over a loaded database costs more.
            cut = prog.index("(ruleset load_)")
            for cmd in prog[:cut]:
                self._run(cmd)
            self.program_lines = prog[:cut]
            self._add(base)
            for cmd in prog[cut:]:
                self._run(cmd)
            self.program_lines += prog[cut:]
        self.load_seconds = time.perf_counter() - t0

    @property
    def program(self) -> str:
        """The egglog program run so far outside any push: declarations, the graph's load, the compiled rules."""
        return "\n".join(self.program_lines)

    # -- program text ---------------------------------------------------------------------------------------------
    def _declarations(self, lifted) -> list[str]:
        lines = ["(sort T)", "(constructor Leaf (String) T)", "(constructor N (String) T)",
                 "(constructor proj (T i64) T)", "(relation Orig (T String i64))", "(relation Layer (T i64))",
                 "(relation Cols (T i64))", "(relation Depth (T i64))", "(relation LayerDepth (T i64))",
                 "(relation LayerCols (T i64))"] + [f"(relation {f} (T))" for f in FACTS]
        for ctor in lifted:  # the lifted constructors the graph uses
            kind, n, layout, special = self.lifted[ctor]
            lines.append(f"(constructor {ctor} ({' '.join(t for _, t in layout)}{' i64' if special else ''}) T)")
        lines += [f"(ruleset {label})" for label in self.rule_label.values()]
        return lines

    def _add(self, ctors: list[str]) -> None:
        """Declare these variants' constructors and compile their rules, each into its rule's ruleset. Outside a push
        they are kept (`compiled`, `program`); inside one they are gone at the pop, so the next push adds them again."""
        lines = [f"(constructor {c} ({' '.join(p.type for p in self.variant_of[c].params)}) T)" for c in ctors]
        for c in ctors:
            r, v = self.rule_of[c], self.variant_of[c]
            lines += [text for text, q in zip(_compiled(v, r, self.rule_label[r.name]), v.queries) if self._may_match(q)]
        for cmd in lines:
            self._run(cmd)
        if self._depth:
            self._pending += ctors
        else:
            self.program_lines += lines
            self.compiled.update(ctors)

    def _may_match(self, query) -> bool:
        """Whether a query (one commutative order of a variant) can match this graph: each lifted op it names must
        have a node in the graph reading, at every input the query binds to another lifted op's result, a tensor
        that op's kind produced. The lifted e-nodes are the graph's ops, each in its result's e-class (rules add only
        fused nodes and projections, and merge no two tensors: `_audit`), so an order no op of the graph reads its
        inputs in (an add's `a + o` where the graph has `o + a`) never matches: not compiled, its join never run.
        A Qwen3 layer's five-phase chain has 8 orders (three adds and a mul), of which one matches."""
        made = {a.var: a.ctor for a in query if a.ctor in self.lifted}
        for a in query:
            info = self.lifted.get(a.ctor)
            if info is None:
                continue
            need = [(i, made[x.var]) for i, x in enumerate(a.args[:info[1]]) if x.var is not None and x.var in made]
            if need and not any(all(sig[i] == c for i, c in need) for sig in self._reads.get(a.ctor, ())):
                return False
        return True

    def _load(self, tmp: Path) -> list[str]:
        g = self.g
        rows: dict[str, list[list]] = {}
        index: dict[str, int] = {}

        def idx(n: str):
            if n not in index:
                index[n] = len(index)

        readers: dict[str, set[int]] = {}
        for k, op in enumerate(g.ops):
            if op.fused:
                raise UserError(f"op `{op.out}` is already fused; optimize takes a graph of lifted ops")
            for i in op.ins:
                idx(i)
                readers.setdefault(i, set()).add(k)
            idx(op.out)
        for n in list(g.io.inputs) + list(g.constants):
            idx(n)
        produced = {op.out for op in g.ops}
        leaves = [n for n in index if n not in produced]
        attrs = self._attrs = {}  # an op's attributes as its e-node holds them
        self._ops: list[tuple[str, str, tuple[str, ...]]] = []  # each op's constructor, result and inputs
        self._leaves = leaves
        names: dict[str, list[str]] = {}  # constructor -> its attributes' names
        for k, op in enumerate(g.ops):
            n = len(op.ins)
            ctor, layout = lifted_layout(op.kind, n)
            if ctor not in names:
                names[ctor] = [name for name, _ in layout[n:]]
            a = full_attrs(op)
            special = op.dst is not None or any(x is not None for x in op.access)
            row = [op.out, *op.ins, *[int(x) if isinstance(x, bool) else x for x in map(a.__getitem__, names[ctor])]]
            if special:
                ctor += "_x"
                row.append(k)
            rows.setdefault(ctor, []).append(row)
            attrs[op.out] = tuple(row[1 + n:])
            self._ops.append((ctor, op.out, op.ins))
        self._rows = rows
        made = {out: ctor for ctor, out, _ in self._ops}
        reads: dict[str, set[tuple]] = {}  # constructor -> the constructors its nodes' inputs are made by (None: a leaf)
        for ctor, _, ins in self._ops:
            reads.setdefault(ctor, set()).add(tuple([made.get(i) for i in ins]))
        self._reads = reads
        layer = {op.out: op.layer for op in g.ops}
        depth: dict[str, int] = {}  # the longest chain of ops from the step's inputs (same_depth: neither reads the other)
        for op in g.ops:
            depth[op.out] = 1 + max((depth.get(i, 0) for i in op.ins), default=0)
        shapes = {**{n: t.shape for n, t in g.tensors.items()}, **{n: c.shape for n, c in g.constants.items()}}
        orig = [[n, i, layer.get(n, -1), (shapes.get(n) or g.shape(n) or (1,))[-1], depth.get(n, 0)]
                for n, i in index.items()]
        rotated: dict[str, bool] = {}  # whether a rotation is computed from the tensor before the next product
        for op in reversed(g.ops):
            rotated[op.out] = any(g.ops[k].kind == "rope" or (g.ops[k].kind not in PRODUCTS
                                                               and rotated[g.ops[k].out])
                                  for k in readers.get(op.out, ()))
        facts = {
            "SingleReader": [[n] for n, r in readers.items() if len(r) == 1],
            "Unrotated": [[op.out] for op in g.ops if op.kind == "matmul" and not rotated[op.out]],
            "Values": [[n] for n, c in g.constants.items() if c.kind == "values"],
            "Rows": [[n] for n, c in g.constants.items() if c.kind == "rows"],
            "StepNext": [[g.io.next]] if g.io.next in index else [],
        }
        lines = ["(relation in_leaf (String))", "(relation in_orig (String i64 i64 i64 i64))"]
        lines += [f"(relation in_{f} (String))" for f in FACTS]
        files = {"in_leaf": [[n] for n in leaves], "in_orig": orig}
        files.update({f"in_{f}": v for f, v in facts.items()})
        loads = ["(rule ((in_leaf s)) ((union (N s) (Leaf s))) :ruleset load_)",
                 "(rule ((in_orig s i l c d)) ((Orig (N s) s i) (Layer (N s) l) (Cols (N s) c) (Depth (N s) d) "
                 f"(LayerDepth (N s) (+ (* l {JOINT}) d)) (LayerCols (N s) (+ (* l {JOINT}) c))) "
                 ":ruleset load_)"]
        loads += [f"(rule ((in_{f} s)) (({f} (N s))) :ruleset load_)" for f in FACTS]
        for ctor, rs in rows.items():
            kind, n, layout, special = self.lifted[ctor]
            types = ["String"] * (1 + n) + [t for _, t in layout[n:]] + (["i64"] if special else [])
            lines.append(f"(relation in_{ctor} ({' '.join(types)}))")
            files[f"in_{ctor}"] = rs
            vs = [f"a{i}" for i in range(len(types))]
            args = [f"(N {vs[1 + i]})" for i in range(n)] + vs[1 + n:]
            loads.append(f"(rule ((in_{ctor} {' '.join(vs)})) ((union (N {vs[0]}) ({ctor} {' '.join(args)}))) "
                         f":ruleset load_)")
        for name, rs in files.items():
            p = tmp / f"{name}.tsv"
            with open(p, "w", newline="") as f:  # csv writes a float as its repr, as egglog reads it back
                csv.writer(f, delimiter="\t", quoting=csv.QUOTE_NONE, lineterminator="\n").writerows(rs)
            lines.append(f'(input {name} "{p}")')
        self.loaded_nodes = len(g.ops) + len(leaves)
        return lines + ["(ruleset load_)"] + loads + ["(run load_ 1)"]

    def _run(self, text: str):
        try:
            return self.eg.run_program(*self.eg.parse_program(text))
        except bindings.EggSmolError as e:  # a compiled rule egglog refuses is an engine bug, said with the text
            raise RuntimeError(f"egglog refused the program: {e}\n--- program ---\n{text[:4000]}") from None

    # -- saturation -----------------------------------------------------------------------------------------------
    def __del__(self):
        thread = self.__dict__.get("_thread")
        if "eg" not in self.__dict__ or thread is None or thread is threading.current_thread():
            return
        egs = [self.__dict__.pop("eg")]  # the only reference left: whoever clears the list drops it
        if not thread.is_alive():
            _let_go(egs)
            return
        with _ORPHANS_LOCK:
            _ORPHANS.setdefault(thread, []).extend(egs)

    def push(self):
        if self._depth == 0 and self._pending:  # what an earlier saturation compiled inside its push, kept for good
            todo, self._pending = [c for c in dict.fromkeys(self._pending) if c not in self.compiled], []
            self._add(todo)
        self._run("(push)")
        self._depth += 1

    def pop(self):
        self._run("(pop)")
        self._depth -= 1

    def saturate(self, held=frozenset(), max_iters: int = 12, node_budget: int | None = None,
                 match_limit: int = 100_000) -> SatReport:
        """Run the rules not held back until nothing changes. A variant that matches through other rules' fused
        constructors is compiled only once such a constructor exists in the e-graph (a rule that matched), then
        the rules run again: stages, each to its fixed point. `max_iters` bounds the iterations of each stage."""
        rep = SatReport(matches={r.name: 0 for r in self.table.rules})
        active = [r for r in self.table.rules if r.name not in held]
        budget = node_budget or max(20_000, 40 * self.loaded_nodes)
        if not active:
            rep.stop = "no rules"
            return rep
        names = {r.name for r in active}
        cands = [c for c, r in self.rule_of.items() if r.name in names]
        have = set(self._rows)  # the constructors present: the graph's, and every variant that matched
        compiled = set(self.compiled)
        labels = " ".join(self.rule_label[r.name] for r in active)
        added = 0
        first = self._combined + 1  # this saturation's first stage (the count runs on across saturations)
        while True:
            todo = [c for c in cands if c not in compiled
                    and any(all(a.ctor in have for a in q) for q in self.variant_of[c].queries)]
            if todo:
                self._add(todo)
                compiled.update(todo)
            elif rep.stop:
                break
            self._combined += 1
            name = f"P{self._combined}_"
            self._run(f"(unstable-combined-ruleset {name} {labels})")
            for it in range(max_iters):
                out = self._run(f"(run {name} 1)")
                report = out[-1].report
                rep.iterations += 1
                last: dict[str, int] = {}
                # the run report's fields as egglog 13 and 14 both name them
                for label, m in (getattr(report, "num_matches_per_rule", None) or {}).items():
                    ctor = label.rsplit(".", 1)[0]
                    r = self.rule_of.get(ctor)
                    if r is None or r.name not in names:
                        continue
                    if m:
                        have.add(ctor)
                    last[r.name] = last.get(r.name, 0) + m
                for rn, m in last.items():
                    rep.matches[rn] += m
                    added += m * (1 + len(self.table.by_name[rn].outputs))
                rep.steps.append({"stage": self._combined - first + 1, "matches": {k: v for k, v in last.items() if v},
                                  "enodes": self._enodes()})
                worst = max(last.items(), key=lambda kv: kv[1], default=("", 0))
                if worst[1] > match_limit:
                    r = self.table.by_name[worst[0]]
                    raise UserError(f"rule `{r.where}` matched {worst[1]} times in one iteration (limit "
                                    f"{match_limit}); its pattern is too loose: join its ops on a shared input or "
                                    f"layer, add guards, or hold it (--hold {r.name})")
                if self.loaded_nodes + added > budget:
                    n = self.snapshot().n_nodes
                    if n > budget:
                        r = self.table.by_name[worst[0]]
                        raise UserError(f"the e-graph grew to {n} e-nodes after {rep.iterations} iterations "
                                        f"(budget {budget}); the likely cause is rule `{r.where}` ({worst[1]} "
                                        f"matches in the last iteration): add guards to it or hold it "
                                        f"(--hold {r.name})")
                if not getattr(report, "updated", True):
                    rep.stop = "saturated"
                    break
            else:
                rep.stop = f"iteration limit ({max_iters})"
                break
        return rep

    def _enodes(self) -> int:
        """The e-graph's e-nodes now (as `Snapshot.n_nodes` counts them: the loaded graph, fused nodes and
        projections), from egglog's function sizes: a fraction of a millisecond, no snapshot."""
        out = self._run("(print-size)")[-1]
        sizes = getattr(out, "sizes", None) or []
        return self.loaded_nodes + sum(n for name, n in sizes if name in self.variant_of or name == "proj")

    # -- snapshot -------------------------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """Decode `freeze()`. An e-class value reads as its id through `value_to_i64` (egglog 13 and 14 alike)."""
        eg = self.eg
        frozen = eg.freeze()
        to_i = eg.value_to_i64
        conv = {"i64": to_i, "f64": eg.value_to_f64, "String": eg.value_to_string}
        classes: dict[int, list[ENode]] = {}
        merged: dict[int, set[str]] = {}  # e-class -> the step tensors in it (one, unless a rule is unsound)
        names: dict[int, str] = {}
        by_name: dict[str, int] = {}
        fns = frozen.functions
        for row in fns["N"].rows:
            c, nm = to_i(row.output), eg.value_to_string(row.inputs[0])
            merged.setdefault(c, set()).add(nm)
            names[c] = nm
            by_name[nm] = c
        # the inputs' and the graph's ops' e-nodes are as loaded (rules only add fused nodes and projections): each
        # is rebuilt from the graph over the classes its tensors now are in, not read back row by row
        for nm in self._leaves:
            c = by_name[nm]
            classes.setdefault(c, []).append(ENode("Leaf", (), (nm,), c))
        attrs = self._attrs
        for fname, out, ins in self._ops:
            c = by_name[out]
            classes.setdefault(c, []).append(ENode(fname, tuple([by_name[i] for i in ins]), attrs[out], c))
        for fname, fn in fns.items():
            if fn.output_sort != "T" or fname == "N" or fname == "Leaf" or fname in self.lifted:
                continue
            sorts = fn.input_sorts
            tpos = [i for i, s in enumerate(sorts) if s == "T"]
            kinds = [(i, conv[s]) for i, s in enumerate(sorts) if s != "T"]
            for row in fn.rows:
                c, ins = to_i(row.output), row.inputs
                classes.setdefault(c, []).append(ENode(fname, tuple([to_i(ins[i]) for i in tpos]),
                                                       tuple([f(ins[i]) for i, f in kinds]), c))
        snap = Snapshot(classes, names, by_name)
        self._audit(snap, merged)
        return snap

    def _audit(self, snap: Snapshot, merged: dict[int, set[str]]) -> None:
        """No e-class may hold two tensors of the step graph: a rule that merged them is wrong. Two of one op over the
        same inputs merge as they load, by no rule: said so, with any rule that put a node beside them."""
        ops = {out: (fname, ins) for fname, out, ins in self._ops}
        for c, nms in merged.items():
            if len(nms) < 2:
                continue
            rules = sorted({self.variant_of[n.fn].rule for n in snap.classes.get(c, []) if n.fn in self.variant_of})
            culprits = ", ".join(f"`{self.table.by_name[r].where}`" for r in rules) or "unknown"
            same: dict[tuple, list[str]] = {}  # one op over the same inputs twice: merged as it loads, by no rule
            for n in sorted(nms & ops.keys()):
                fname, ins = ops[n]
                same.setdefault((fname, tuple(snap.by_name[i] for i in ins), self._attrs[n]), []).append(n)
            twice = next((v for v in same.values() if len(v) > 1), None)
            if twice:
                ins = ", ".join(f"`{i}`" for i in ops[twice[0]][1])
                also = f"; rules with a node in their e-class: {culprits}" if rules else ""
                raise UserError(f"tensors {', '.join(f'`{n}`' for n in twice)} are one op over the same inputs "
                                f"({ins}) computed twice: a step graph computes a value once (keep `{twice[0]}` "
                                f"and read it where {', '.join(f'`{n}`' for n in twice[1:])} is read){also}")
            raise UserError(f"unsound rule: tensors {', '.join(f'`{n}`' for n in sorted(nms))} ended up in one "
                            f"e-class; made by {culprits}; fix or hold that rule")
