"""The link hooks: the few classes whose launch is built from a variable number of members (products in parts,
rotations in parts, a product with its heads' epilogue, a result placed in a table's rows), so their fields cannot
be one fixed mapping of pattern variables. rules/README.md lists them. A hook returns its launches, or a Refusal."""

from __future__ import annotations

from lanefuse.engine.ir import Op
from lanefuse.engine.refusal import Refusal
from lanefuse.kernels import Dst, Fold, GemmPart, GemmParts, Gemv, Rope, RopeParts, RopeSide
from lanefuse.lane.lower.placement import to_part


def _leaves(op: Op) -> dict[str, Op]:
    return {leaf.out: leaf for leaf in op.leaves()}


def _chain(op: Op, t: str) -> dict[str, Op]:
    """The member that computes `t`: its product, bias, head norm and rotation, found walking back from `t`."""
    leaves = _leaves(op)
    found: dict[str, Op] = {}
    cur = t
    while cur in leaves:
        leaf = leaves[cur]
        if leaf.kind == "set_row":
            cur = leaf.ins[1]
            continue
        role = {"matmul": "product", "add": "bias", "rmsnorm": "norm", "rope": "rope"}.get(leaf.kind)
        if role is None or role in found:
            break
        found[role] = leaf
        if role == "product":
            break
        cur = leaf.ins[0]
    return found


def _product_out(ch: dict[str, Op]) -> str:
    return (ch.get("bias") or ch["product"]).out


def _side(link, ch: dict[str, Op], placed: dict) -> RopeSide:
    rope = ch["rope"]
    norm = ch.get("norm")
    x = norm.ins[0] if norm is not None else rope.ins[0]
    first = norm if norm is not None else rope
    return RopeSide(x=x, y=placed.get(rope.out) or Dst(rope.out), heads=rope.a["heads"], part=to_part(first.acc(0)),
                    norm=(norm.ins[1], float(norm.a["eps"])) if norm is not None else None)


def _rope_parts(sides: list[RopeSide], rope: Op, link) -> RopeParts:
    a = rope.a
    return RopeParts(sides=tuple(sides), cos=rope.ins[1], sin=rope.ins[2], pos=rope.ins[3],
                     rows=link.g.shape(rope.ins[0])[0], hd=a["hd"], rot=a["rot"])


def _members(op: Op) -> list[str]:
    """The tensors the members of a merged op compute, in the rule's order (its outputs: `out`, then `keeps`)."""
    return list(op.outs)


def gemm_parts(link, op: Op, placed: dict) -> list | Refusal:
    """The products of one activation as one GEMV in parts; members whose heads are rotated take their rotations
    in the same launch's epilogue (a fold of the parts and a rotation in parts)."""
    parts, sides, rope, x, fmt = [], [], None, None, None
    for t in _members(op):
        ch = _chain(op, t)
        if "product" not in ch:
            continue
        p = ch["product"]
        w = p.ins[1]
        c = link.g.constants.get(w)
        if c is None or c.kind != "rows":
            return Refusal("products in parts by a matrix that is not checkpoint rows", f"`{op.cls}` -> `{t}`")
        if x is None:
            x, fmt = p.ins[0], c.format
        if p.ins[0] != x or c.format != fmt:
            return Refusal("products in parts of different activations or checkpoint formats", f"`{op.cls}` -> `{t}`")
        out = _product_out(ch)
        bias = ch["bias"].ins[1] if "bias" in ch else None
        if "rope" in ch:
            y = Dst(out)
            sides.append(_side(link, ch, placed))
            rope = ch["rope"]
        else:
            y = placed.get(out) or Dst(out)
        parts.append(GemmPart(w=w, y=y, n=link.g.shape(w)[0], bias=bias))
    if not parts:
        return Refusal("a merged product with no products", f"`{op.cls}` -> `{op.out}`")
    k = link.g.shape(x)[1]
    m = link.g.shape(x)[0]
    gp = GemmParts(x=x, format=fmt, k=k, m=m, parts=tuple(parts))
    if not sides:
        return [gp]
    return [Fold(first=gp, then=_rope_parts(sides, rope, link))]


def head_epilogue(link, op: Op, placed: dict) -> list | Refusal:
    """One product whose heads are normed and rotated in its epilogue: a fold of the GEMV and the rotation."""
    ch = _chain(op, op.out)
    if "product" not in ch or "rope" not in ch:
        return Refusal("a head epilogue without its product and rotation", f"`{op.cls}` -> `{op.out}`")
    p = ch["product"]
    c = link.g.constants.get(p.ins[1])
    if c is None or c.kind != "rows":
        return Refusal("a head epilogue on a product by a matrix that is not checkpoint rows", f"-> `{op.out}`")
    out = _product_out(ch)
    g = link.g
    gemv = Gemv(x=p.ins[0], w=p.ins[1], format=c.format, y=Dst(out), k=g.shape(p.ins[0])[1], n=g.shape(p.ins[1])[0],
                m=g.shape(p.ins[0])[0], bias=ch["bias"].ins[1] if "bias" in ch else None)
    side = _side(link, ch, placed)
    rope = ch["rope"]
    a = rope.a
    r = Rope(x=out, cos=rope.ins[1], sin=rope.ins[2], pos=rope.ins[3], y=side.y, rows=g.shape(out)[0],
             heads=a["heads"], hd=a["hd"], rot=a["rot"], norm=side.norm)
    return [Fold(first=gemv, then=r)]


def rope_parts(link, op: Op, placed: dict) -> list | Refusal:
    """A layer's rotations (each with its head norm or not) in one launch."""
    sides, rope = [], None
    for t in _members(op):
        ch = _chain(op, t)
        if "rope" not in ch:
            continue
        if rope is not None and (ch["rope"].ins[1:4] != rope.ins[1:4] or ch["rope"].a["hd"] != rope.a["hd"]
                                 or ch["rope"].a["rot"] != rope.a["rot"]):
            return Refusal("rotations in one launch over different tables, positions or head widths",
                          f"`{op.cls}` -> `{t}`")
        rope = ch["rope"]
        sides.append(_side(link, ch, placed))
    if rope is None:
        return Refusal("a launch of rotations with no rotation", f"`{op.cls}` -> `{op.out}`")
    return [_rope_parts(sides, rope, link)]


def into_row(link, op: Op, placed: dict) -> list | Refusal:
    """The producer's own launch, its result written straight into the table's rows: the row write is no launch."""
    producer = [p for p in op.parts if not (not p.fused and p.kind == "set_row")]
    out = []
    for p in producer:
        got = link.op(p, placed)
        if isinstance(got, Refusal):
            return got
        out.extend(x.launch for x in got)
    return out


HOOKS = {"gemm_parts": gemm_parts, "head_epilogue": head_epilogue, "rope_parts": rope_parts, "into_row": into_row}
