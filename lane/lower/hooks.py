"""The link hooks: the few classes whose launch is built from a variable number of members (products in parts,
rotations in parts, convolutions in parts, a product with its heads' epilogue, a result placed in a table's rows)
or whose launches depend on the step's shape (a latent attention: absorbed, or expanded for a wide chunk),
so their fields cannot be one fixed mapping of pattern variables. rules/README.md lists them. A hook takes the fused
op's scope (its placements; the strided reads it takes, through `scope.take_read`) and returns its launches, or a
Refusal."""

from __future__ import annotations

from lanefuse.engine.ir import Op
from lanefuse.engine.placement import arg, row_write
from lanefuse.engine.refusal import Refusal
from lanefuse.kernels import (Absorb, Attention, Chain, ConvParts, Dst, Fold, GemmPart, GemmParts, Gemv, HeadGemv,
                              Rope, RopeParts, RopeSide)
from lanefuse.kernels.conv_parts import ConvPart
from lanefuse.lane.lower.buffers import WORDS
from lanefuse.lane.lower.fill import Scope, evaluate
from lanefuse.lane.lower.table import Choice


def _leaves(op: Op) -> dict[str, Op]:
    return {leaf.out: leaf for leaf in op.leaves()}


def _chain(op: Op, t: str) -> dict[str, Op]:
    """The member that computes `t`: its product, bias, head norm and rotation, or each head's own product of it (a
    query's absorption), and the quantize of its normed rows (the q8 numerics), found walking back from `t`."""
    leaves = _leaves(op)
    found: dict[str, Op] = {}
    cur = t
    while cur in leaves:
        leaf = leaves[cur]
        w = row_write(leaf)
        if w is not None:  # a row placed in a table: its producer's chain
            cur = w.src
            continue
        role = {"matmul": "product", "add": "bias", "rmsnorm": "norm", "rope": "rope", "head_matmul": "absorb",
                "quantize": "quant"}.get(leaf.kind)
        if role is None or role in found:
            break
        found[role] = leaf
        if role == "product":
            break
        cur = leaf.ins[0]  # the member's own operand: x of a norm or rotation, a of a bias (the product)
    return found


def _product_out(ch: dict[str, Op]) -> str:
    return (ch.get("bias") or ch["product"]).out


def _side(ch: dict[str, Op], scope: Scope) -> RopeSide:
    rope = ch["rope"]
    norm = ch.get("norm")
    first = norm if norm is not None else rope
    return RopeSide(x=arg(first, "x"), y=scope.dst(rope.out), heads=rope.a["heads"], part=scope.take_read(first, 0),
                    norm=(arg(norm, "w"), float(norm.a["eps"])) if norm is not None else None)


def _tables(rope: Op) -> tuple[str | None, ...]:
    """What rotations in one launch share: their cos and sin tables and their position."""
    return tuple(arg(rope, n) for n in ("cos", "sin", "pos"))


def _rope_parts(sides: list[RopeSide], rope: Op, link) -> RopeParts:
    a = rope.a
    return RopeParts(sides=tuple(sides), cos=arg(rope, "cos"), sin=arg(rope, "sin"), pos=arg(rope, "pos"),
                     rows=link.g.shape(arg(rope, "x"))[0], hd=a["hd"], rot=a["rot"])


def _members(op: Op) -> list[str]:
    """The tensors the members of a merged op compute, in the rule's order (its outputs: `out`, then `keeps`)."""
    return list(op.outs)


def gemm_parts(link, op: Op, scope: Scope, members: list[str] | None = None) -> list | Refusal:
    """The products of one activation as one GEMV in parts; members whose heads are rotated take their rotations
    in the same launch's epilogue (a fold of the parts and a rotation in parts), and members whose rows are normed
    (a norm of one head) their norm, as a side of its own shape: one head of the part's width, no rotation. The
    members are the op's results, or `members` (qkv_chain: what the attention reads)."""
    parts, sides, rope, x, fmt, seen = [], [], None, None, None, set()
    for t in members if members is not None else _members(op):
        ch = _chain(op, t)
        if "product" not in ch or ch["product"].out in seen:  # a normed row's f32 member after its quantized one
            continue
        p = ch["product"]
        seen.add(p.out)
        w = arg(p, "w")
        c = link.g.constants.get(w)
        if c is None or c.kind != "rows":
            return Refusal("products in parts by a matrix that is not checkpoint rows", f"`{op.cls}` -> `{t}`")
        if x is None:
            x, fmt = arg(p, "x"), c.format
        if arg(p, "x") != x or c.format != fmt:
            return Refusal("products in parts of different activations or checkpoint formats", f"`{op.cls}` -> `{t}`")
        out = _product_out(ch)
        bias = arg(ch["bias"], "b") if "bias" in ch else None
        n = link.g.shape(w)[0]
        if "quant" in ch and ("norm" not in ch or "rope" in ch or "absorb" in ch):
            return Refusal("products in parts quantizing in their epilogue what is not a row norm of a part",
                           f"`{op.cls}` -> `{t}`")
        if "absorb" in ch:  # each head of the part times its own matrix in the epilogue (a side of no rotation)
            ab = ch["absorb"]
            fa = _rows_format(link, arg(ab, "w"))
            if "rope" in ch or "norm" in ch or fa is None or arg(ab, "x") != out:
                return Refusal("products in parts whose heads are taken by their own matrices after a norm or a "
                               "rotation, or by a matrix that is not checkpoint rows", f"`{op.cls}` -> `{t}`")
            y = Dst(out)
            sides.append(RopeSide(x=out, y=scope.dst(ab.out), heads=ab.a["heads"], hd=ab.a["a"], rot=0,
                                  absorb=Absorb(arg(ab, "w"), fa, ab.a["b"], bool(ab.a["rows_out"]))))
        elif "rope" in ch:
            y = Dst(out)
            sides.append(_side(ch, scope))
            rope = ch["rope"]
        elif "norm" in ch:  # the part's rows normed in the epilogue (a side of one head of the part's width, unrotated)
            nm = ch["norm"]
            if nm.a.get("heads", 1) != 1:
                return Refusal("products in parts whose heads are normed without a rotation", f"`{op.cls}` -> `{t}`")
            y = Dst(out)
            qz = ch.get("quant")  # its rows quantized as they are stored, for the projections that read them
            sides.append(RopeSide(x=arg(nm, "x"), y=scope.dst(nm.out), heads=1, part=scope.take_read(nm, 0),
                                  norm=(arg(nm, "w"), float(nm.a["eps"])), hd=n, rot=0,
                                  quant=qz.out if qz else None, words=WORDS.get(link.g.dtype(qz.out), 0) if qz else 0))
        else:
            y = scope.dst(out)
        parts.append(GemmPart(w=w, y=y, n=n, bias=bias))
    if not parts:
        return Refusal("a merged product with no products", f"`{op.cls}` -> `{op.out}`")
    if sides and rope is None:
        return Refusal("products in parts normed or absorbed in their epilogue with no rotation beside (the epilogue "
                       "takes the rotation's tables)", f"`{op.cls}` -> `{op.out}`")
    k = link.g.shape(x)[1]
    m = link.g.shape(x)[0]
    gp = GemmParts(x=x, format=fmt, k=k, m=m, parts=tuple(parts), words=WORDS.get(link.g.dtype(x), 0))
    if not sides:
        return [gp]
    return [Fold(first=gp, then=_rope_parts(sides, rope, link))]


def gemm_tc_parts(link, op: Op, scope: Scope) -> list | Refusal:
    """The products of one activation as one tensor-core GEMM in parts (knob tc_rows: kernels/gemm_tc.py), each
    member a product and its bias alone (a member's rotation, norm or quantize is left to merged forms the
    GEMV-based hook takes, which the lane refuses over this many rows: extraction takes the plain ones)."""
    from lanefuse.kernels import GemmTcParts

    parts, x, fmt, seen = [], None, None, set()
    for t in _members(op):
        ch = _chain(op, t)
        if "product" not in ch or ch["product"].out in seen:
            continue
        if set(ch) - {"product", "bias"}:
            return Refusal("products in parts on the tensor cores with a rotation, norm or quantize of their own",
                           f"`{op.cls}` -> `{t}`")
        p = ch["product"]
        seen.add(p.out)
        w = arg(p, "w")
        c = link.g.constants.get(w)
        if c is None or c.kind != "rows":
            return Refusal("products in parts by a matrix that is not checkpoint rows", f"`{op.cls}` -> `{t}`")
        if x is None:
            x, fmt = arg(p, "x"), c.format
        if arg(p, "x") != x or c.format != fmt:
            return Refusal("products in parts of different activations or checkpoint formats", f"`{op.cls}` -> `{t}`")
        bias = arg(ch["bias"], "b") if "bias" in ch else None
        parts.append(GemmPart(w=w, y=scope.dst(_product_out(ch)), n=link.g.shape(w)[0], bias=bias))
    if not parts:
        return Refusal("a merged product with no products", f"`{op.cls}` -> `{op.out}`")
    return [GemmTcParts(x=x, format=fmt, k=link.g.shape(x)[1], m=link.g.shape(x)[0], parts=tuple(parts))]


def head_epilogue(link, op: Op, scope: Scope) -> list | Refusal:
    """One product whose heads are normed and rotated in its epilogue: a fold of the GEMV and the rotation."""
    ch = _chain(op, op.out)
    if "product" not in ch or "rope" not in ch:
        return Refusal("a head epilogue without its product and rotation", f"`{op.cls}` -> `{op.out}`")
    p = ch["product"]
    x, w = arg(p, "x"), arg(p, "w")
    c = link.g.constants.get(w)
    if c is None or c.kind != "rows":
        return Refusal("a head epilogue on a product by a matrix that is not checkpoint rows", f"-> `{op.out}`")
    out = _product_out(ch)
    g = link.g
    gemv = Gemv(x=x, w=w, format=c.format, y=Dst(out), k=g.shape(x)[1], n=g.shape(w)[0], m=g.shape(x)[0],
                bias=arg(ch["bias"], "b") if "bias" in ch else None, words=WORDS.get(g.dtype(x), 0))
    side = _side(ch, scope)
    rope = ch["rope"]
    a = rope.a
    r = Rope(x=out, cos=arg(rope, "cos"), sin=arg(rope, "sin"), pos=arg(rope, "pos"), y=side.y, rows=g.shape(out)[0],
             heads=a["heads"], hd=a["hd"], rot=a["rot"], norm=side.norm, part=side.part)
    return [Fold(first=gemv, then=r)]


def rope_parts(link, op: Op, scope: Scope) -> list | Refusal:
    """A layer's rotations (each with its head norm or not) in one launch."""
    sides, rope = [], None
    for t in _members(op):
        ch = _chain(op, t)
        if "rope" not in ch:
            continue
        if rope is not None and (_tables(ch["rope"]) != _tables(rope) or ch["rope"].a["hd"] != rope.a["hd"]
                                 or ch["rope"].a["rot"] != rope.a["rot"]):
            return Refusal("rotations in one launch over different tables, positions or head widths",
                          f"`{op.cls}` -> `{t}`")
        rope = ch["rope"]
        sides.append(_side(ch, scope))
    if rope is None:
        return Refusal("a launch of rotations with no rotation", f"`{op.cls}` -> `{op.out}`")
    return [_rope_parts(sides, rope, link)]


def into_row(link, op: Op, scope: Scope) -> list | Refusal:
    """The producer's own launch, its result written straight into the table's rows: the row write is no launch."""
    producer = [p for p in op.parts if row_write(p) is None]
    out = []
    for p in producer:
        got = link.op(p, scope.placed)
        if isinstance(got, Refusal):
            return got
        scope.take_all(p)  # its own link took or refused its strided reads
        out.extend(x.launch for x in got)
    return out


def conv_parts(link, op: Op, scope: Scope) -> list | Refusal:
    """A layer's convolutions as one launch: each member's causal_conv, and the SiLU and L2 norm after it (normed
    members share one head width, the launch's block)."""
    leaves = op.leaves()
    reader = {leaf.ins[0]: leaf for leaf in leaves if leaf.kind in ("silu", "l2norm")}
    parts, block, eps, taps, silu = [], 0, 1e-6, None, None
    for c in (leaf for leaf in leaves if leaf.kind == "causal_conv"):
        act = reader.get(c.out)
        norm = reader.get(act.out) if act is not None else None
        if taps is not None and (c.a["taps"] != taps or (act is not None) != silu):
            return Refusal("convolutions in parts of different widths or epilogues", f"`{op.cls}` -> `{c.out}`")
        taps, silu = c.a["taps"], act is not None
        y = (norm or act or c).out
        chan = link.g.shape(arg(c, "w"))[0]
        if norm is not None:
            hd = chan // norm.a["heads"]
            if block and hd != block:
                return Refusal("L2-normed convolutions in parts of different head widths", f"`{op.cls}` -> `{y}`")
            block, eps = hd, float(norm.a["eps"])
        if y in scope.placed:
            return Refusal("a convolution in parts whose result is placed in a table", f"`{op.cls}` -> `{y}`")
        parts.append(ConvPart(x=arg(c, "x"), w=arg(c, "w"), ring=arg(c, "ring"), y=y, chan=chan, l2=norm is not None,
                              xpitch=link.g.shape(arg(c, "x"))[1], xoff=c.a.get("start", 0)))
    if not parts:
        return Refusal("convolutions in parts with no convolutions", f"`{op.cls}` -> `{op.out}`")
    rows = link.g.shape(parts[0].x)[0]
    return [ConvParts(parts=tuple(parts), taps=taps, rows=rows, silu=bool(silu), block=block, eps=eps)]


def _rows_format(link, w: str) -> str | None:
    c = link.g.constants.get(w)
    return c.format if c is not None and c.kind == "rows" else None


def latent(link, op: Op, scope: Scope) -> list | Refusal:
    """A latent attention (002's `latent`): absorbed, three launches — each head's unrotated query times its key
    expansion (HeadGemv), the Split attention over the latent cache (the keys' first part and the values, read in
    place) and the shared rotated key table, the output times each head's value expansion (HeadGemv). The lane
    entry's `expand_rows` is the widest chunk that runs absorbed; a wider one runs expanded (`_expanded`)."""
    b = op.b
    by = {leaf.out: leaf for leaf in op.leaves()}
    given = b.get("ql") is not None  # the query comes absorbed (mla.absorbed: its product's epilogue absorbed it)
    absorb = None if given else next((l for l in by.values() if l.kind == "head_matmul" and arg(l, "x") == b["qn"]),
                                     None)
    attn = next((l for l in by.values() if l.kind == "attention"), None)
    if (absorb is None and not given) or attn is None or (absorb is not None and absorb.a["rows_out"]) \
            or not by[b["y"]].a["rows_out"]:
        return Refusal("a latent attention whose query absorption reads each head's input rows and whose expansion "
                       "each head's output rows", f"`{op.cls}` -> `{op.out}`")
    g = link.g
    fk, fv = None if given else _rows_format(link, b["wk"]), _rows_format(link, b["wv"])
    if (fk is None and not given) or fv is None:
        return Refusal("a latent attention whose key or value expansion is not checkpoint rows",
                       f"`{op.cls}` -> `{op.out}`")
    ql = b["ql"] if given else absorb.out
    rows, h, lora, rope = g.shape(ql)[0], b["heads"], b["lora"], g.shape(b["kr"])[1]
    wide = evaluate(link.table.support(op.cls).choice.fields.get("expand_rows", 0), scope)
    if rows > wide:
        if b.get("q"):
            return Refusal(f"an expanded latent attention quantizing its output (a chunk of {rows} rows: the "
                           f"expanded form's attention writes f32 only)", f"`{op.cls}` -> `{op.out}`")
        if given:
            return Refusal(f"a latent attention whose query arrives absorbed, over a chunk of {rows} rows (wider "
                           f"than the lane's expand_rows, {wide}: it runs expanded, from the unabsorbed query)",
                           f"`{op.cls}` -> `{op.out}`")
        return _expanded(link, op, scope, attn, fk, fv)
    a = attn.out
    absorbing = [] if given else [HeadGemv(b["qn"], b["wk"], fk, Dst(ql), rows, h, b["nope"], lora, rows_out=False)]
    return absorbing + [
        Attention(ql, b["lc"], b["lc"], b["pos"], a, h, h, b["hd"], lora, g.shape(b["lc"])[0], rows, b["scale"],
                  softcap=b["a.softcap"], qtail=b["qr"], ktail=b["kr"], tail=rope),
        HeadGemv(a, b["wv"], fv, scope.dst(b["y"]), rows, h, lora, b["vd"], rows_out=True, quant=b.get("q"),
                 words=WORDS.get(g.dtype(b["q"]), 0) if b.get("q") else 0)]


def _expanded(link, op, scope, attn, fk, fv):
    """A wide chunk's latent attention expanded (002's `latent`), three launches: the key half (every cached latent
    times each head's key expansion: what the query's absorption did), the value half (times each head's value
    expansion: what the output's did), then the Split attention of each head's unrotated query over its own expanded
    keys and values beside the rotated query and the shared rotated key, into the fused op's result. The expanded
    keys and values are step-local arrays of their own (`<attention>.keys` (L, H·nope), `<attention>.values`
    (L, H·v)), registered in the graph linked when the op is one of its ops (the optimized graph being lowered; not
    the step graph while extraction prices it, which stays as the user built it)."""
    from lanefuse.engine.ir import Tensor

    b, g = op.b, link.g
    h, nope, lora, vd = b["heads"], b["nope"], b["lora"], b["vd"]
    L, rows, rope = g.shape(b["lc"])[0], g.shape(b["qn"])[0], g.shape(b["kr"])[1]
    out = scope.dst(b["y"])
    if out != Dst(b["y"]):
        return Refusal("an expanded latent attention whose result is placed in another tensor",
                       f"`{op.cls}` -> `{op.out}`")
    kx, vx = attn.out + ".keys", attn.out + ".values"
    lowering = any(o is op for o in g.ops)
    for name, cols in ((kx, h * nope), (vx, h * vd)):
        if lowering and name not in g.tensors:
            g.tensors[name] = Tensor(name, (L, cols))
    return [_half(link, b["lc"], b["wk"], fk, kx, L, lora, h * nope, b["pos"], rows),
            _half(link, b["lc"], b["wv"], fv, vx, L, lora, h * vd, b["pos"], rows),
            Attention(b["qn"], kx, vx, b["pos"], b["y"], h, 1, nope + rope, vd, L, rows, b["scale"],
                      softcap=b["a.softcap"], qtail=b["qr"], ktail=b["kr"], tail=rope)]


def _half(link, lc: str, w: str, fmt: str, y: str, L: int, lora: int, n: int, pos: str, rows: int):
    """One expanded half, y (L, n) = lc (L, lora) · wᵀ (w n checkpoint rows of lora values: every head's expansion
    stacked): a GEMM on the tensor cores (GemmTc over every cache row, the bf16 numerics) where the lane's knob
    `tc_rows` takes a product of L rows and the kernel reads the rows' format; else HeadGemv, a warp an output, over
    the cache's filled rows only (its position's and the chunk's: the attention reads no other). The GEMM computes
    the unfilled rows too (it has no `upto`), which no one reads; at DeepSeek-V3's shape it is priced far below the
    warp-an-output loop's L passes over the 16 MiB matrix (bench/deepseek_figures.py --expand)."""
    from lanefuse.kernels.gemm_tc import MIN_ROWS, TC_FORMATS, GemmTc

    k = link.knobs
    if k is not None and getattr(k, "tc_rows", 0) and L >= max(k.tc_rows, MIN_ROWS) and fmt in TC_FORMATS:
        return GemmTc(lc, w, fmt, Dst(y), lora, n, L)
    return HeadGemv(lc, w, fmt, Dst(y), L, 1, lora, n, rows_out=True, upto=pos, extra=rows)


def qkv_chain(link, op: Op, scope: Scope) -> list | Refusal:
    """A decode layer from its q/k/v products to its next norm as one chained launch: the entry's own `launch: chain`
    fields make the attention, o, GLU and down phases (attn_o_glu_down_norm's four), and the q/k/v products with their
    heads' epilogue before them are gemm_parts' fold over what the attention reads (its query, and the rows its key
    and value caches' row writes take, written straight into those rows)."""
    ch = next(c for c in link.table.support(op.cls).choices if c.hook == "qkv_chain")
    rest = link.build(Choice(None, ch.launch, ch.fields), scope)
    if isinstance(rest, Refusal):
        return rest
    att = rest.attention if isinstance(rest, Chain) else None
    if att is None:
        return Refusal("a q/k/v chain whose entry's fields make no chain with an attention", f"`{op.cls}`")
    got = gemm_parts(link, op, scope, members=[att.q, att.kc, att.vc])
    if isinstance(got, Refusal):
        return got
    if len(got) != 1 or not isinstance(got[0], Fold):
        return Refusal("q/k/v products with no heads' rotation before the attention", f"`{op.cls}` -> `{op.out}`")
    return [Chain((got[0], *rest.phases))]


HOOKS = {"qkv_chain": qkv_chain, "latent": latent, "gemm_parts": gemm_parts, "gemm_tc_parts": gemm_tc_parts, "conv_parts": conv_parts, "head_epilogue": head_epilogue, "rope_parts": rope_parts,
         "into_row": into_row}
