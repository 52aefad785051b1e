"""A step graph as a step YAML and back: `to_yaml(g)` prints a readable document (one line per tensor, constant and
op) and `from_yaml(text)` parses it to an equal graph. Op results whose shape the op infers are not printed; errors
cite the file, line and op. A `weights:` entry (demo / checkpoint / random) says what the step runs with. A checkpoint
constant's `transposed` (engine/orientation.py): true, its rows a product's outputs, (n, k) as a Linear stores them;
false, as stored: under a `matmul` (or a mixture's router) alone, a matrix stored (k, n), read transposed as it is
loaded and printed back as stored; left out, the orientation its products read it in."""

from __future__ import annotations

import re
from typing import Any

import yaml

from lanefuse.engine.errors import UserError, did_you_mean
from lanefuse.engine.ir import Access, Constant, Dst, Graph, Op, RowSel, StepIO, Tensor, attrs_of
from lanefuse.engine.opdefs import OPS, infer
from lanefuse.engine.orientation import READ_TRANSPOSED, READERS, read_transposed, settle
from lanefuse.engine.yamlsafe import load_text, short

TOP_KEYS = ("meta", "weights", "io", "tensors", "constants", "ops")
OP_KEYS = ("op", "out", "ins", "layer", "access", "dst", "class", "rule", "keeps", "binds", "parts", "attrs")
IO_KEYS = ("token", "position", "caches", "logits", "next", "states")
CONST_KEYS = ("shape", "kind", "format", "transposed", "source")
TENSOR_RE = re.compile(r"^\s*(f32|i32)\s*\[\s*([0-9,\s]*)\]\s*$")


# -- printing -------------------------------------------------------------------------------------------------------

def _flow(x: Any) -> str:
    s = yaml.safe_dump(x, default_flow_style=True, width=10 ** 9, sort_keys=False).strip()
    return s[:-3].strip() if s.endswith("\n...") or s.endswith("...") else s


def _tensor_text(t: Tensor) -> str:
    return f"{t.dtype}[{', '.join(str(d) for d in t.shape)}]"


def _access_data(a: Access | None):
    return None if a is None else [a.pitch, a.offset, a.width]


def _rowsel_data(r: RowSel) -> dict:
    d: dict[str, Any] = {}
    if r.param is not None:
        d["param"] = r.param
    if r.fixed is not None:
        d["fixed"] = r.fixed
    return d


def _op_data(op: Op) -> dict[str, Any]:
    d: dict[str, Any] = {"op": op.kind, "out": op.out, "ins": list(op.ins)}
    if op.layer != -1:
        d["layer"] = op.layer
    if op.cls is not None:
        d["class"] = op.cls
    if op.rule is not None:
        d["rule"] = op.rule
    if op.keeps:
        d["keeps"] = list(op.keeps)
    if op.access:
        d["access"] = [_access_data(a) for a in op.access]
    if op.dst is not None:
        dst: dict[str, Any] = {"table": op.dst.table}
        if op.dst.row is not None:
            dst["row"] = _rowsel_data(op.dst.row)
        if op.dst.unit is not None:
            dst["unit"] = _access_data(op.dst.unit)
        d["dst"] = dst
    if op.binds:
        d["binds"] = dict(op.binds)
    attrs = dict(op.attrs)
    if any(k in OP_KEYS for k in attrs):
        d["attrs"] = attrs  # a name that would read as a key of the op itself
    else:
        d.update(attrs)
    return d


def _op_lines(op: Op, indent: str) -> list[str]:
    d = _op_data(op)
    if not op.parts:
        return [f"{indent}- {_flow(d)}"]
    lines = [f"{indent}- op: {_flow(d['op'])}"]
    for k, v in d.items():
        if k != "op":
            lines.append(f"{indent}  {k}: {_flow(v)}")
    lines.append(f"{indent}  parts:")
    for p in op.parts:
        lines.extend(_op_lines(p, indent + "    "))
    return lines


def _declare_outs(sim: Graph, op: Op, on_infer) -> None:
    """Declare in `sim` the result of each lifted op in `op` (itself or its parts) not yet declared, as inferred;
    `on_infer(op, inferred or None)` may declare it itself instead (returning True)."""
    if op.fused:
        for p in op.parts:
            _declare_outs(sim, p, on_infer)
        return
    if op.out in sim.tensors or op.out in sim.constants:
        return
    try:
        got = infer(sim, op)
    except UserError as e:
        got = e
    if on_infer(op, got):
        return
    if isinstance(got, UserError):
        raise got
    sim.tensor(op.out, got[0], got[1])


def _leaf_outs(ops) -> set[str]:
    return {leaf.out for op in ops for leaf in op.leaves()}


def to_yaml(g: Graph) -> str:
    """The step YAML of `g`: parses back (`from_yaml`) to a graph equal to `g`."""
    # which tensors must be printed: those no op infers to exactly their declared shape
    leaf = _leaf_outs(g.ops)
    explicit = {n for n in g.tensors if n not in leaf}
    sim = Graph(constants=dict(g.constants))
    for n in explicit:
        sim.tensors[n] = g.tensors[n]

    def on_infer(op: Op, got) -> bool:
        want = g.tensors.get(op.out)
        if want is None:
            return True  # undeclared in g: leave it undeclared
        if isinstance(got, UserError) or (want.shape, want.dtype) != got:
            explicit.add(op.out)
            sim.tensors[op.out] = want
            return True
        return False

    for op in g.ops:
        _declare_outs(sim, op, on_infer)

    meta = {k: v for k, v in g.meta.items() if k not in ("weights", READ_TRANSPOSED)}
    head = ", ".join(f"{k} {v}" for k, v in meta.items() if isinstance(v, (str, int, float)))
    out = [f"# lanefuse step{': ' + head if head else ''}"]
    if meta:
        out.append(f"meta: {_flow(meta)}")
    if "weights" in g.meta:
        out.append(f"weights: {_flow(g.meta['weights'])}")
    io = g.io
    out.append("io:")
    out.append(f"  token: {_flow(io.token)}")
    out.append(f"  position: {_flow(io.position)}")
    out.append(f"  caches: {_flow([list(kv) for kv in io.caches])}")
    out.append(f"  logits: {_flow(io.logits)}")
    out.append(f"  next: {_flow(io.next)}")
    if io.states:
        out.append(f"  states: {_flow(list(io.states))}")
    names = [n for n in g.tensors if n in explicit]
    out.append("tensors:" + ("" if names else " {}"))
    for n in names:
        out.append(f"  {_flow(n)}: {_tensor_text(g.tensors[n])}")
    out.append("constants:" + ("" if g.constants else " {}"))
    flipped = set(g.meta.get(READ_TRANSPOSED, ()))  # printed as stored, (k, n) not transposed: read so again
    for n, c in g.constants.items():
        d: dict[str, Any] = {"shape": list(reversed(c.shape)) if n in flipped else list(c.shape)}
        if c.kind != "rows":
            d["kind"] = c.kind
        if c.format != "f32":
            d["format"] = c.format
        if n in flipped:
            d["transposed"] = False
        elif c.transposed:
            d["transposed"] = True
        if c.source != n:
            d["source"] = c.source
        out.append(f"  {_flow(n)}: {_flow(d)}")
    out.append("ops:" + ("" if g.ops else " []"))
    for op in g.ops:
        out.extend(_op_lines(op, "  "))
    return "\n".join(out) + "\n"


# -- parsing --------------------------------------------------------------------------------------------------------

class _Where:
    """Where a part of the document is: the source file and, per top-level key and op index, its line."""

    def __init__(self, root, source: str):
        self.source = source
        self.keys: dict[str, int] = {}
        self.ops: list[int] = []
        self.entries: dict[tuple[str, str], int] = {}
        if not isinstance(root, yaml.MappingNode):
            return
        for k, v in root.value:
            if not isinstance(k, yaml.ScalarNode):
                continue
            self.keys[str(k.value)] = k.start_mark.line + 1
            if k.value == "ops" and isinstance(v, yaml.SequenceNode):
                self.ops = [item.start_mark.line + 1 for item in v.value]
            if k.value in ("tensors", "constants") and isinstance(v, yaml.MappingNode):
                for kk, _ in v.value:
                    if isinstance(kk, yaml.ScalarNode):
                        self.entries[(k.value, str(kk.value))] = kk.start_mark.line + 1

    def at(self, line: int | None) -> str:
        return f"{self.source}:{line}" if line else self.source

    def key(self, k: str) -> str:
        return self.at(self.keys.get(k))

    def op(self, i: int) -> str:
        return self.at(self.ops[i] if i < len(self.ops) else None)




def _cut(x: Any, n: int = 80) -> str:
    """A name or key from the document as a message cites it: at most `n` characters."""
    t = str(x)
    return t if len(t) <= n else t[:n - 3] + "..."


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise UserError(f"{what} must be an integer, got {short(v)}")
    return v


def _access(v: Any, what: str) -> Access | None:
    if v is None:
        return None
    if not isinstance(v, list) or len(v) != 3:
        raise UserError(f"{what} must be [pitch, offset, width] or null, got {short(v)}")
    return Access(*(_int(x, what) for x in v))


def _rowsel(v: Any, what: str) -> RowSel:
    if not isinstance(v, dict) or set(v) - {"param", "fixed"}:
        raise UserError(f"{what} must be {{param: NAME}} or {{fixed: ROW}}, got {short(v)}")
    fixed = v.get("fixed")
    return RowSel(param=v.get("param"), fixed=None if fixed is None else _int(fixed, what))


def _parse_op(d: Any, where: str) -> Op:
    if not isinstance(d, dict):
        raise UserError(f"{where}: an op must be a mapping with `op`, `out`, `ins`, got {short(d)}")
    kind, out = d.get("op"), d.get("out")
    if not isinstance(kind, str) or not isinstance(out, str):
        raise UserError(f"{where}: an op needs `op: KIND` and `out: NAME`")
    me = f"{where}: op `{_cut(kind)}` -> `{_cut(out)}`"
    if kind != "fused" and kind not in OPS:
        raise UserError(f"{me}: unknown op kind{did_you_mean(kind, OPS)}; known: {', '.join(sorted(OPS))}, fused")
    ins = d.get("ins", [])
    if not isinstance(ins, list) or not all(isinstance(i, str) for i in ins):
        raise UserError(f"{me}: `ins` must be a list of tensor names")
    attrs = dict(d.get("attrs") or {})
    known = OPS[kind].attrs if kind in OPS else {}
    for k, v in d.items():
        if k in OP_KEYS:
            continue
        if kind in OPS and k not in known:
            raise UserError(f"{me}: unknown key `{_cut(k)}`{did_you_mean(k, list(OP_KEYS) + list(known))}")
        if known.get(k) is float and isinstance(v, str):
            try:
                v = float(v)  # YAML 1.1 reads `1e-6` (no dot) as a string
            except ValueError:
                pass
        attrs[k] = v
    for k, v in attrs.items():
        if not isinstance(v, (int, float, str, bool)):
            raise UserError(f"{me}: attribute `{k}` must be a number, string or boolean, got {short(v)}")
    access = tuple(_access(a, f"{me}: access") for a in (d.get("access") or []))
    dst = None
    if d.get("dst") is not None:
        dd = d["dst"]
        if not isinstance(dd, dict) or not isinstance(dd.get("table"), str) or set(dd) - {"table", "row", "unit"}:
            raise UserError(f"{me}: `dst` must be {{table: NAME, row: {{param|fixed}}, unit: [pitch, offset, width]}}")
        dst = Dst(dd["table"], None if dd.get("row") is None else _rowsel(dd["row"], f"{me}: dst row"),
                  _access(dd.get("unit"), f"{me}: dst unit"))
    layer = _int(d.get("layer", -1), f"{me}: layer")
    keeps = d.get("keeps") or []
    binds = d.get("binds") or {}
    if not isinstance(keeps, list) or not isinstance(binds, dict):
        raise UserError(f"{me}: `keeps` must be a list of names and `binds` a mapping")
    parts = d.get("parts") or []
    if kind == "fused" and not parts:
        raise UserError(f"{me}: a fused op lists its `parts`")
    if kind != "fused" and (parts or "class" in d):
        raise UserError(f"{me}: only a fused op has `parts` and a `class`")
    return Op(kind, tuple(ins), out, attrs_of(attrs), access, dst, layer, d.get("class"), d.get("rule"),
              tuple(_parse_op(p, where) for p in parts), tuple(keeps), attrs_of(binds))


def _shape_text(text: Any, what: str) -> tuple[tuple[int, ...], str]:
    m = TENSOR_RE.match(text) if isinstance(text, str) else None
    if not m:
        raise UserError(f"{what}: expected `f32[d0, d1]` or `i32[d0]`, got {short(text)}")
    dims = tuple(int(x) for x in m.group(2).replace(",", " ").split())
    return dims, m.group(1)


def _read_by_products(ops, names: set[str]) -> set[str]:
    """Those of `names` that only products (READERS, as their matrix) read: a matrix stored (k, n) they read
    transposed. One another op reads as well (a gather, a per-head product) is left as it says, for the check."""
    readers: dict[str, set[bool]] = {}
    for op in ops:
        for leaf in op.leaves():
            for k, n in enumerate(leaf.ins):
                if n in names:
                    readers.setdefault(n, set()).add(leaf.kind in READERS and k == 1)
    return {n for n, r in readers.items() if r == {True}}


def from_yaml(text: str, source: str = "<file>") -> Graph:
    """The graph a step YAML describes; a mistake is a `UserError` citing `source`, the line and the op."""
    try:
        return _from_yaml(text, source)
    except RecursionError:  # fused ops nested hundreds deep in `parts`
        raise UserError(f"{source}: the step's ops are nested too deep (`parts` inside `parts`); flatten them") from None


def _from_yaml(text: str, source: str) -> Graph:
    root, doc = load_text(text, source)  # bad syntax or an alias bomb: a UserError citing the line
    w = _Where(root, source)
    if not isinstance(doc, dict):
        raise UserError(f"{source}: a step YAML is a mapping with {', '.join(TOP_KEYS)}")
    for k in doc:
        if k not in TOP_KEYS:
            raise UserError(f"{w.key(str(k))}: unknown key `{_cut(k)}`{did_you_mean(str(k), TOP_KEYS)}")
    for k in ("io", "ops"):
        if k not in doc:
            raise UserError(f"{source}: missing `{k}`")
    meta = doc.get("meta") or {}
    if not isinstance(meta, dict):
        raise UserError(f"{w.key('meta')}: `meta` must be a mapping")
    meta = {k: v for k, v in meta.items() if k != READ_TRANSPOSED}  # what the constants say, worked out again
    if "weights" in doc:
        if not isinstance(doc["weights"], dict):
            raise UserError(f"{w.key('weights')}: `weights` must be a mapping ({{demo: true}}, {{checkpoint: PATH}} "
                            f"or {{random: SEED}})")
        meta = {**meta, "weights": doc["weights"]}

    io = doc["io"]
    if not isinstance(io, dict):
        raise UserError(f"{w.key('io')}: `io` must be a mapping of {', '.join(IO_KEYS)}")
    for k in io:
        if k not in IO_KEYS:
            raise UserError(f"{w.key('io')}: unknown io key `{_cut(k)}`{did_you_mean(str(k), IO_KEYS)}")
    for k in ("token", "position", "logits", "next"):
        if k in io and not isinstance(io[k], (str, int)):
            raise UserError(f"{w.key('io')}: io `{k}` must be a tensor name, got {short(io[k])}")
    caches = io.get("caches") or []
    if not isinstance(caches, list) or not all(isinstance(c, list) and len(c) == 2
                                               and all(isinstance(x, (str, int)) for x in c) for c in caches):
        raise UserError(f"{w.key('io')}: io `caches` must be a list of [key table, value table] pairs")
    states = io.get("states") or []
    if not isinstance(states, list) or not all(isinstance(x, (str, int)) for x in states):
        raise UserError(f"{w.key('io')}: io `states` must be a list of table names (the carried states)")
    step_io = StepIO(**{k: str(io[k]) for k in ("token", "position", "logits", "next") if k in io},
                     caches=tuple((str(a), str(b)) for a, b in caches), states=tuple(str(x) for x in states))
    g = Graph(io=step_io, meta=meta)

    consts = doc.get("constants") or {}
    unsaid = set()  # constants that do not say `transposed`: their products' orientation (engine/orientation.py)
    said_inputs = set()  # rows that say `transposed: false`: read transposed where only products read them
    if not isinstance(consts, dict):
        raise UserError(f"{w.key('constants')}: `constants` must be a mapping of name -> {{shape: [...]}}")
    for name, c in consts.items():
        at = f"{w.at(w.entries.get(('constants', str(name))))}: constant `{_cut(name)}`"
        if not isinstance(c, dict) or "shape" not in c:
            raise UserError(f"{at}: expected {{shape: [...], kind, format, transposed, source}}")
        for k in c:
            if k not in CONST_KEYS:
                raise UserError(f"{at}: unknown key `{_cut(k)}`{did_you_mean(str(k), CONST_KEYS)}")
        if not isinstance(c["shape"], list):
            raise UserError(f"{at}: `shape` must be a list of sizes")
        shape = tuple(_int(x, f"{at}: shape") for x in c["shape"])
        if c.get("kind", "rows") not in ("rows", "values"):
            raise UserError(f"{at}: kind `{_cut(c['kind'])}` is not rows or values")
        for k in ("format", "source"):
            if k in c and not isinstance(c[k], str):
                raise UserError(f"{at}: `{k}` must be a string, got {short(c[k])}")
        if "transposed" not in c:
            unsaid.add(str(name))
        elif c["transposed"] is False and c.get("kind", "rows") == "rows":
            said_inputs.add(str(name))
        try:
            g.constant(Constant(str(name), shape, c.get("kind", "rows"), str(c.get("format", "f32")),
                                bool(c.get("transposed", False)), str(c.get("source", name))))
        except UserError as e:
            raise UserError(f"{at}: {e}") from None

    tensors = doc.get("tensors") or {}
    if not isinstance(tensors, dict):
        raise UserError(f"{w.key('tensors')}: `tensors` must be a mapping of name -> f32[dims]")
    for name, t in tensors.items():
        at = f"{w.at(w.entries.get(('tensors', str(name))))}: tensor `{_cut(name)}`"
        shape, dtype = _shape_text(t, at)
        try:
            g.tensor(str(name), shape, dtype)
        except UserError as e:
            raise UserError(f"{at}: {e}") from None

    ops = doc["ops"] or []
    if not isinstance(ops, list):
        raise UserError(f"{w.key('ops')}: `ops` must be a list")
    parsed = [_parse_op(d, w.op(i)) for i, d in enumerate(ops)]
    flip = _read_by_products(parsed, said_inputs)
    for i, op in enumerate(parsed):
        try:
            for leaf in op.leaves():
                if leaf.kind in READERS and len(leaf.ins) > 1 and leaf.ins[1] in flip:
                    read_transposed(g, leaf, leaf.ins[1])  # stored (k, n): the step holds it (n, k)
            _declare_outs(g, op, lambda o, got: False)
        except UserError as e:
            msg = str(e) if str(e).startswith("op `") else f"op `{op.kind}` -> `{op.out}`: {e}"
            raise UserError(f"{w.op(i)}: {msg}") from None
        g.ops.append(op)
    settle(g, unsaid)
    try:
        g.validate()
    except UserError as e:
        raise UserError(f"{source}: {e}") from None
    return g
