"""What a checkpoint constant's `transposed` says, and the check that every product reads its rows that way. The seed's
link (seed 002) reads it before every launch over checkpoint rows: `transposed` rows are the outputs of the product
that reads them, (n, k) — how Hugging Face's `Linear` stores a projection, and what `matmul` and an expert mixture's
router multiply by; rows not transposed are each a row a step takes whole (a token's embedding) or, for a per-head
product, each head's inputs (DeepSeek's absorbed key expansion, (heads·a, b): `head_matmul` with rows_out false). A
gather takes a table's rows either way: a tied embedding is transposed, its rows the head's outputs as well. A
checkpoint that stores a product's matrix the other way round is transposed by its front as it is read (GPT-OSS's
experts, DeepSeek GGUF's `attn_k_b`), or refused here, naming the constant and the op."""

from __future__ import annotations

from lanefuse.engine.errors import UserError


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
    import dataclasses

    want: dict[str, set[bool]] = {}
    for op in g.ops:
        w = wants(g, op)
        if w is not None and w[0] in unsaid:
            want.setdefault(w[0], set()).add(w[1])
    for name, ws in want.items():
        if ws == {True}:
            g.constants[name] = dataclasses.replace(g.constants[name], transposed=True)
