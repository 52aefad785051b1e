"""The step-graph IR: tensors, constants, the step's carried I/O, ops with typed attributes, each input's access and
each result's destination. A graph prints to a step YAML and parses back equal (`to_yaml` / `from_yaml`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from lanefuse.engine.errors import UserError

MAX_CHUNK = 4096  # the largest prefill chunk a step graph is built for (`run` cuts a prompt by the lane's knob
# chunk_rows, up to this: the tensor cores want chunks of 2048 rows; numpy's BLAS GEMM gains from them too)
MAX_BATCH = 256  # the most sequences a batch step decodes
DTYPES = ("f32", "i32", "q8", "q8x2", "q8k")  # q8/q8x2: a quantized activation (engine/formats/quantize.py), read only by
# the products over block-quantized rows
FORMATS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q6_k", "mxfp4", "q4_1", "q5_0", "q5_1", "q5_k", "q3_k",
           "q2_k", "iq4_nl", "iq4_xs")  # checkpoint row formats (GGUF's blocks,
# then MXFP4: gpt-oss's experts)


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: str = "f32"

    @cached_property
    def size(self) -> int:
        return numel(self.shape)


@dataclass(frozen=True)
class Constant:
    """A constant: checkpoint rows in a format (`kind="rows"`, stored as `shape`, `transposed` when the stored rows
    are the outputs of a product, as HF `Linear` stores them), or f32 values (`kind="values"`). `source` names where
    the values come from in the model's weight store."""

    name: str
    shape: tuple[int, ...]
    kind: str = "rows"  # rows | values
    format: str = "f32"  # one of FORMATS (rows only)
    transposed: bool = False
    source: str = ""

    @property
    def dtype(self) -> str:
        return "f32"

    @cached_property
    def size(self) -> int:
        return numel(self.shape)


@dataclass(frozen=True)
class Access:
    """A strided part of every unit of a wider tensor: unit u's `width` values start at `u*pitch + offset`."""

    pitch: int
    offset: int
    width: int


@dataclass(frozen=True)
class RowSel:
    """Which row of a table a write starts at: the row an i32 parameter names (0-based position), or a fixed row."""

    param: str | None = None
    fixed: int | None = None


@dataclass(frozen=True)
class Dst:
    """Where an op writes its result: rows of `table` from `row` on (and, where `unit` is set, a part of every unit
    of it). `None` as an op's dst means its own buffer."""

    table: str
    row: RowSel | None = None
    unit: Access | None = None


Attrs = tuple[tuple[str, Any], ...]


def attrs_of(d: dict[str, Any]) -> Attrs:
    return tuple(sorted(d.items()))


@dataclass(frozen=True)
class Op:
    """One op. A lifted op has a `kind` from `opdefs.OPS`; a fused op has `kind == "fused"`, its class in `cls`, the
    rule that made it in `rule`, the lifted ops it joins in `parts` (in order), the tensors it also writes in
    `keeps`, and the pattern variables its rule bound in `binds` (variable -> tensor name or attribute value)."""

    kind: str
    ins: tuple[str, ...]
    out: str
    attrs: Attrs = ()
    access: tuple[Access | None, ...] = ()
    dst: Dst | None = None
    layer: int = -1
    cls: str | None = None
    rule: str | None = None
    parts: tuple["Op", ...] = ()
    keeps: tuple[str, ...] = ()
    binds: Attrs = ()

    @property
    def a(self) -> dict[str, Any]:
        return dict(self.attrs)

    @property
    def b(self) -> dict[str, Any]:
        return dict(self.binds)

    @property
    def outs(self) -> tuple[str, ...]:
        if not self.keeps:
            return (self.out,)
        return (self.out,) + tuple([k for k in self.keeps if k != self.out])

    def acc(self, i: int) -> Access | None:
        return self.access[i] if i < len(self.access) else None

    @property
    def fused(self) -> bool:
        return self.kind == "fused"

    def leaves(self) -> tuple["Op", ...]:
        """The lifted ops this op computes, in order (worked out once: an op never changes)."""
        hit = self.__dict__.get("_leaves")
        if hit is not None:
            return hit
        if not self.fused:
            out: tuple[Op, ...] = (self,)
        else:
            found: list[Op] = []
            stack = list(self.parts[::-1])
            while stack:  # depth first, parts in order
                p = stack.pop()
                if p.kind == "fused":
                    stack.extend(p.parts[::-1])
                else:
                    found.append(p)
            out = tuple(found)
        self.__dict__["_leaves"] = out
        return out


@dataclass(frozen=True)
class StepIO:
    """The names a step carries: the token ids it reads (i32, one a row), the position of its first row (i32, (1,)),
    the KV-cache tables (pairs of key and value tables, written in place a row at a time), the carried states (tables
    an op rewrites in place each step: a gated delta net's convolution rings and recurrent states), the logits and
    the next token (i32, (1,)) it produces."""

    token: str = "token"
    position: str = "pos"
    caches: tuple[tuple[str, str], ...] = ()
    logits: str = "logits"
    next: str = "next"
    states: tuple[str, ...] = ()

    @cached_property
    def inputs(self) -> tuple[str, ...]:
        names = [self.token, self.position]
        for k, v in self.caches:
            names += [k, v]
        return tuple(names) + self.states

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.logits, self.next)

    @cached_property
    def tables(self) -> tuple[str, ...]:
        return tuple(n for kv in self.caches for n in kv) + self.states

    @cached_property
    def table_set(self) -> frozenset[str]:
        return frozenset(self.tables)


@dataclass
class Graph:
    """One step: every tensor (step inputs and op results), the constants, the carried I/O, the ops in order, and
    free-form metadata (the model it was built from: architecture, layers, rows, weight source)."""

    tensors: dict[str, Tensor] = field(default_factory=dict)
    constants: dict[str, Constant] = field(default_factory=dict)
    io: StepIO = field(default_factory=StepIO)
    ops: list[Op] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    # -- building -----------------------------------------------------------------------------------------------
    def tensor(self, name: str, shape: tuple[int, ...], dtype: str = "f32") -> str:
        if name in self.tensors or name in self.constants:
            raise UserError(f"tensor `{name}` is declared twice")
        if dtype not in DTYPES:
            raise UserError(f"tensor `{name}`: unknown dtype `{dtype}` (expected one of {', '.join(DTYPES)})")
        self.tensors[name] = Tensor(name, tuple(int(d) for d in shape), dtype)
        return name

    def constant(self, c: Constant) -> str:
        if c.name in self.tensors or c.name in self.constants:
            raise UserError(f"constant `{c.name}` is declared twice")
        if c.kind not in ("rows", "values"):
            raise UserError(f"constant `{c.name}`: kind `{c.kind}` is neither `rows` nor `values`")
        if c.kind == "rows" and len(c.shape) != 2:
            raise UserError(f"constant `{c.name}`: checkpoint rows are a matrix, not shape {c.shape} "
                            f"(declare a vector as `kind: values`)")
        if c.kind == "rows" and c.format not in FORMATS:
            raise UserError(f"constant `{c.name}`: unknown format `{c.format}` (expected one of {', '.join(FORMATS)})")
        self.constants[c.name] = c
        return c.name

    def add(self, kind: str, ins: list[str] | tuple[str, ...], out: str, layer: int = -1, access=(), dst=None,
            **attrs: Any) -> str:
        """Append a lifted op, inferring and declaring its result's shape (validated against the op's signature)."""
        from lanefuse.engine.opdefs import infer

        op = Op(kind, tuple(ins), out, attrs_of(attrs), tuple(access), dst, layer)
        shape, dtype = infer(self, op)
        if out in self.tensors:
            t = self.tensors[out]
            if t.shape != shape or t.dtype != dtype:
                raise UserError(f"op `{kind}` -> `{out}`: result shape {shape} {dtype} but `{out}` is declared "
                                f"{t.shape} {t.dtype}")
        else:
            self.tensor(out, shape, dtype)
        self.ops.append(op)
        return out

    # -- queries ------------------------------------------------------------------------------------------------
    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.tensors:
            return self.tensors[name].shape
        if name in self.constants:
            return self.constants[name].shape
        raise UserError(f"unknown tensor `{name}`")

    def dtype(self, name: str) -> str:
        if name in self.tensors:
            return self.tensors[name].dtype
        if name in self.constants:
            return "f32"
        raise UserError(f"unknown tensor `{name}`")

    def readers(self) -> dict[str, list[Op]]:
        r: dict[str, list[Op]] = {}
        for op in self.ops:
            for i in op.ins:
                r.setdefault(i, []).append(op)
        return r

    @property
    def layers(self) -> int:
        return int(self.meta.get("layers", 1 + max((op.layer for op in self.ops), default=-1)))

    def validate(self) -> None:
        """Re-infer every op's result shape and check the step's I/O; a mismatch names the op and both shapes."""
        from lanefuse.engine.opdefs import infer

        defined = set(self.io.inputs) | set(self.constants)
        for n in self.io.inputs:
            if n not in self.tensors:
                raise UserError(f"step input `{n}` is not declared as a tensor")
        for op in self.ops:
            for i in op.ins:
                if i not in defined:
                    raise UserError(f"op `{op.kind}` -> `{op.out}` reads `{i}`, which nothing before it defines")
            if not op.fused:
                shape, dtype = infer(self, op)
                t = self.tensors.get(op.out)
                if t is None:
                    raise UserError(f"op `{op.kind}` -> `{op.out}`: result is not declared")
                if t.shape != shape or t.dtype != dtype:
                    raise UserError(f"op `{op.kind}` -> `{op.out}`: infers {shape} {dtype}, declared {t.shape} {t.dtype}")
            defined.update(op.outs)
        for n in self.io.outputs:
            if n not in defined:
                raise UserError(f"step output `{n}` is produced by no op")
        from lanefuse.engine.orientation import check

        check(self)  # every product reads its checkpoint rows as they are stored (`transposed`)

    def replace_ops(self, ops: list[Op]) -> "Graph":
        return replace(self, ops=list(ops), tensors=dict(self.tensors))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Graph):
            return NotImplemented
        return (self.tensors == other.tensors and self.constants == other.constants and self.io == other.io
                and self.ops == other.ops and self.meta == other.meta)
