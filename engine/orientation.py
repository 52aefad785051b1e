"""What a checkpoint constant's `transposed` says, and the check that every product reads its rows that way. The seed's
link (seed 002) reads it before every launch over checkpoint rows: `transposed` rows are the outputs of the product
that reads them, (n, k) — how Hugging Face's `Linear` stores a projection, and what `matmul` and an expert mixture's
router multiply by; rows not transposed are each a row a step takes whole (a token's embedding) or, for a per-head
product, each head's inputs (DeepSeek's absorbed key expansion, (heads·a, b): `head_matmul` with rows_out false). A
gather takes a table's rows either way: a tied embedding is transposed, its rows the head's outputs as well. A
checkpoint that stores a product's matrix the other way round is transposed by its front as it is read (GPT-OSS's
experts, DeepSeek GGUF's `attn_k_b`), or refused here, naming the constant and the op. A step YAML says so itself: a
`matmul`'s (or a mixture router's) matrix declared `transposed: false`, stored (k, n) as GPT-2's Conv1D stores it, is
read transposed as it is loaded (`read_transposed`, `as_read`): the step holds it (n, k), transposed, and the weight
store serves the stored matrix's transpose, once; a block format, whose blocks run along the stored rows, cannot be
and is refused in one line."""

from __future__ import annotations

import dataclasses

import numpy as np

from lanefuse.engine.errors import UserError

# g.meta key: the constants a step YAML declares stored (k, n), `transposed: false` under a product, read transposed
READ_TRANSPOSED = "read_transposed"
READERS = ("matmul", "moe")  # the ops whose second input is a matrix of the product's outputs, (n, k) or (experts, d)
PLAIN = ("f32", "f16", "bf16")  # formats whose stored matrix transposes value by value


def wants(g, op) -> tuple[str, bool] | None:
    """(the constant, whether its rows must be transposed) where `op` multiplies by checkpoint rows; else None."""
    if op.fused or len(op.ins) < 2:
        return None
    if op.kind == "matmul":
        want = True
    elif op.kind == "head_matmul":
        want = bool(op.a["rows_out"])
    elif op.kind == "moe":
        want = True  # the router: (experts, d), a row an expert's score
    else:
        return None
    c = g.constants.get(op.ins[1])
    if c is None or c.kind != "rows":
        return None
    return c.name, want


def refusal(g, op) -> str | None:
    """Why `op` cannot read its checkpoint rows as they are stored, in words; None where it can."""
    w = wants(g, op)
    if w is None:
        return None
    name, want = w
    c = g.constants[name]
    if c.transposed == want:
        return None
    role = ("each head's outputs" if op.kind == "head_matmul" else "the product's outputs, (n, k) as a Linear stores "
            "them") if want else "each head's inputs"
    have = "transposed: its rows are a product's outputs" if c.transposed else \
        "not transposed: its rows are a product's inputs or a table's rows"
    return (f"op `{op.kind}` -> `{op.out}` reads constant `{name}` {list(c.shape)} as {role}, but `{name}` is stored "
            f"{have}; set its `transposed` to {str(want).lower()} if its rows are {role}, or store the matrix the "
            f"other way round")


def check(g) -> None:
    """Every op multiplying by checkpoint rows reads them as they are stored (`transposed`); the first that does not
    is a user error naming the op and the constant."""
    for op in g.ops:
        why = refusal(g, op)
        if why is not None:
            raise UserError(why)


def settle(g, unsaid) -> None:
    """The constants `unsaid` (a step YAML's that do not say `transposed`) take the orientation their products read
    them in: transposed where every op multiplying by them reads their rows as its outputs (a tied table, gathered
    too, among them); as they are (not transposed) where none multiplies by them or their readers disagree (then
    `check` names the first that cannot read them)."""
    want: dict[str, set[bool]] = {}
    for op in g.ops:
        w = wants(g, op)
        if w is not None and w[0] in unsaid:
            want.setdefault(w[0], set()).add(w[1])
    for name, ws in want.items():
        if ws == {True}:
            g.constants[name] = dataclasses.replace(g.constants[name], transposed=True)


def read_transposed(g, op, name: str) -> None:
    """Lifted op `op` (a READERS op) multiplies by constant `name`, which its step YAML declares stored not
    transposed, (k, n): read it transposed as it is loaded — the step holds it (n, k), `transposed`, and records it
    in g.meta[READ_TRANSPOSED] for the weight store (`as_read`). A UserError, in words, where it cannot be: a block
    format, or a shape the product's activation does not fit as (k, n) that it does fit as a Linear's (n, k)."""
    c = g.constants[name]
    if name in g.meta.get(READ_TRANSPOSED, ()):
        return
    k, n = c.shape
    me = f"op `{op.kind}` -> `{op.out}` reads constant `{name}` {list(c.shape)}"
    if c.format not in PLAIN:
        raise UserError(f"{me}, declared `transposed: false` (stored (k, n): its rows the product's inputs); a "
                        f"{c.format} matrix cannot be read transposed (its blocks run along its stored rows): store it "
                        f"(n, k) with `transposed: true`, as a Linear does, or in {', '.join(PLAIN)}")
    x = op.ins[0]
    acc = op.acc(0)
    cols = acc.width if acc is not None else (g.shape(x)[-1] if x in g.tensors or x in g.constants else None)
    if cols is not None and cols != k and cols == n:
        raise UserError(f"{me}, declared `transposed: false` (stored (k, n): its rows the product's inputs), but `{x}`"
                        f" has {cols} values a row, its columns' count: stored (n, k) as a Linear stores it, it is "
                        f"`transposed: true`")
    g.constants[name] = dataclasses.replace(c, shape=(n, k), transposed=True)
    g.meta[READ_TRANSPOSED] = list(g.meta.get(READ_TRANSPOSED, ())) + [name]


def stored_shape(g, name: str) -> tuple[int, ...]:
    """Constant `name`'s shape as its weight store holds it: (k, n) for one read transposed, else its own."""
    c = g.constants[name]
    return tuple(reversed(c.shape)) if name in g.meta.get(READ_TRANSPOSED, ()) else c.shape


class TransposedStore:
    """A weight store over another that serves some of its matrices transposed (f32, f16, bf16: stored (k, n), served
    (n, k)), each made once, when first read; every other tensor as the base store serves it."""

    def __init__(self, base, names):
        self.base, self.flipped = base, frozenset(names)
        self._made: dict[str, tuple[np.ndarray, str]] = {}

    def names(self) -> list[str]:
        return self.base.names()

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        shape, fmt = self.base.info(name)
        return (tuple(reversed(shape)) if name in self.flipped else shape), fmt

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        if name not in self.flipped:
            return self.base.raw(name)
        if name not in self._made:
            arr, fmt = self.base.raw(name)
            k, n = self.base.info(name)[0]
            self._made[name] = np.ascontiguousarray(np.asarray(arr).reshape(k, n).T), fmt
        return self._made[name]

    def __getattr__(self, attr):  # where(), file_name(), u8(): the base store's
        return getattr(self.base, attr)


def as_read(g, weights):
    """`weights` as step `g` reads them: each constant g.meta[READ_TRANSPOSED] names served transposed (its stored
    (k, n) as the (n, k) the step holds); `weights` itself where there is none. A stored matrix of another shape is a
    UserError naming the constant."""
    names = g.meta.get(READ_TRANSPOSED, ())
    if not names:
        return weights
    sources = {g.constants[n].source or n: n for n in names}
    for name, c in g.constants.items():  # a stored tensor is served one way: every constant of it read transposed
        if (c.source or name) in sources and name not in names:
            raise UserError(f"constants `{sources[c.source or name]}` and `{name}` read the same stored tensor "
                            f"`{c.source or name}`, the first transposed (`transposed: false` under a product) and the "
                            f"second as stored; give them one orientation")
    for name in names:
        c = g.constants[name]
        src = c.source or name
        have = tuple(weights.shape(src))
        if have != tuple(reversed(c.shape)):
            raise UserError(f"constant `{name}`: the step declares it stored {list(reversed(c.shape))} (`transposed: "
                            f"false`: its rows the product's inputs), but the weights hold `{src}` as {list(have)}")
    return type(weights)(TransposedStore(weights.store, sources), weights.cfg)  # its class: the front's, not imported
