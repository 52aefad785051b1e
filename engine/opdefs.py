"""The lifted op kinds: each one's inputs, typed attributes and result shape, as one table (`OPS`). What each op
computes lives in the reference interpreter (`interp.py`); the rule table and the lanes name ops by these kinds and
their inputs by these names."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

from lanefuse.engine.errors import UserError, did_you_mean

Shape = tuple[int, ...]


@dataclass(frozen=True)
class OpDef:
    kind: str
    ins: tuple[str, ...]  # input names; a trailing `?` marks an optional input
    attrs: dict[str, type]  # attribute name -> int | float | str | bool
    defaults: dict[str, Any]
    doc: str

    @cached_property
    def required(self) -> tuple[str, ...]:
        return tuple(i for i in self.ins if not i.endswith("?"))

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(i.rstrip("?") for i in self.ins)

    @cached_property
    def position(self) -> dict[str, int]:
        """Input name -> its place among the op's inputs."""
        return {n: k for k, n in enumerate(self.names)}


def _d(kind, ins, attrs=None, defaults=None, doc=""):
    return OpDef(kind, tuple(ins), attrs or {}, defaults or {}, doc)


OPS: dict[str, OpDef] = {d.kind: d for d in [
    _d("gather", ["table", "index"], doc="rows of a constant table at the i32 indices: (V, d), (R,) -> (R, d)"),
    _d("rmsnorm", ["x", "w"], {"eps": float, "heads": int}, {"heads": 1},
       doc="RMSNorm over each row, or over each of `heads` equal parts of a row, times w: (R, n) -> (R, n)"),
    _d("matmul", ["x", "w"], doc="x times the transpose of checkpoint rows w (n, k): (R, k) -> (R, n)"),
    _d("add", ["a", "b"], doc="a + b, b of a's shape, one row broadcast over a's rows, or (R, 1): a value a row"),
    _d("mul", ["a", "b"], doc="a * b, b of a's shape, one row broadcast over a's rows, or (R, 1): a value a row"),
    _d("sub", ["a", "b"], doc="a - b, b of a's shape, one row broadcast over a's rows, or (R, 1): a value a row"),
    _d("rope", ["x", "cos", "sin", "pos"], {"heads": int, "hd": int, "rot": int},
       doc="rotate-half rotary embedding of the first `rot` values of each head; row r at position pos + r (a "
           "batch's pos, one a row: row s at pos[s])"),
    _d("set_row", ["table", "src", "pos"],
       doc="write src's rows into table rows pos.. in place: (L, c), (R, c), (1,) -> (L, c); a batch's pos (R,): "
           "row s into row s·L/R + pos[s] (sequence s's slot)"),
    _d("attention", ["q", "k", "v", "pos", "sinks?"],
       {"heads": int, "kv_heads": int, "hd": int, "vd": int, "scale": float, "window": int, "softcap": float},
       {"window": 0, "softcap": 0.0},
       doc="grouped-query attention of row r over cache rows 0..pos+r (the last `window` of them when set); a "
           "batch's pos (R,): row s over its slot's rows s·L/R .. s·L/R + pos[s]"),
    _d("silu", ["x"], doc="x * sigmoid(x)"),
    _d("sigmoid", ["x"], doc="1 / (1 + exp(-x))"),
    _d("gelu", ["x"], doc="GELU, tanh approximation (transformers' gelu_pytorch_tanh)"),
    _d("gelu_erf", ["x"], doc="GELU, exact: x * (1 + erf(x / sqrt 2)) / 2 (transformers' gelu)"),
    _d("swiglu", ["g", "u"], doc="silu(g) * u"),
    _d("argmax", ["x"], doc="the index of each row's largest value (first on ties): (R, n) -> i32 (R,)"),
    _d("scale", ["x"], {"factor": float}, doc="x * factor"),
    _d("softcap", ["x"], {"cap": float}, doc="cap * tanh(x / cap)"),
    _d("view", ["x"], {"row": int, "rows": int}, {"rows": 1},
       doc="rows row..row+rows-1 of a computed tensor, in place (no launch): (R, n) -> (rows, n)"),
    _d("quantize", ["x"], {"words": int}, {"words": 1},
       doc="an activation as int8 blocks of 32 values, one f32 scale a block (llama.cpp's q8_0 rounding: "
           "d = max|x|/127, q = round-half-away(x·(1/d))); words 2 (q8x2) adds a low int8 word of the residual "
           "x - d·q in steps of d/254; words 3 (q8k) is llama.cpp's q8_K, for products over K-quant rows: blocks of "
           "256, d = max/-127 of the value of largest |x|, q = round-half-even(x·(-127/max)), d kept f32, and the sums "
           "of each 16 words: (R, n) f32 -> (R, n) q8 | q8x2 | q8k, read only by products (engine/formats/quantize.py)"),
    _d("moe", ["x", "router", "gate_up", "down", "router_bias?", "gate_up_bias?", "down_bias?"],
       {"experts": int, "k": int, "inter": int, "norm_topk": bool, "act": str, "routing": str, "limit": float,
        "alpha": float, "groups": int, "topk_groups": int, "route_scale": float, "lo": int, "local": int},
       {"act": "silu", "routing": "softmax_topk", "limit": 0.0, "alpha": 1.702, "groups": 1, "topk_groups": 1,
        "route_scale": 1.0, "lo": 0, "local": 0},
       doc="an expert mixture of each row: router logits x·routerᵀ (E,), the k experts of the largest (routing "
           "softmax_topk: softmax over all E, then top-k, renormalized when norm_topk; equal probabilities: the "
           "lower expert first), each chosen expert's act(x·gᵀ)·(x·uᵀ) times its down rows, weighed and summed. "
           "The experts are stacked, one constant a role (engine/front/families/mixtures.py): gate_up (E·2f, d), expert e's gate rows "
           "at e·2f and its up rows at e·2f + f; down (E·d, f), expert e's rows at e·d: (R, d) -> (R, d). gpt-oss: routing "
           "topk_softmax (the k largest logits, then a softmax over them), biases added to the router logits (E,), "
           "the gate/up values (E·2f,) and the down values (E·d,), and act clamped_glu: g = min(gate, limit), "
           "u = clamp(up, -limit, limit), (u + 1)·g·sigmoid(alpha·g). DeepSeek-V3: routing sigmoid_group (the "
           "sigmoid of each logit; router_bias, the correction bias, added for the choice only; the experts in `groups` "
           "equal groups, the `topk_groups` groups of the largest sum of their top two kept, the k largest of those; "
           "the chosen sigmoids the weights, renormalized when norm_topk, times route_scale). A rank's part of the mixture "
           "(expert parallelism, engine/front/parallel.py): `local` > 0 experts lo..lo+local-1 held (gate_up "
           "(local·2f, d), down (local·d, f), their biases likewise; the router whole), each row routed over all E "
           "and only its chosen experts among those held weighed and summed: the ranks' parts sum to the mixture"),
    _d("l2norm", ["x"], {"heads": int, "eps": float}, {"heads": 1},
       doc="each of `heads` equal parts of a row scaled to unit length: x / sqrt(sum(x²) + eps): (R, n) -> (R, n)"),
    _d("causal_conv", ["x", "w", "ring"], {"taps": int, "start": int}, {"start": 0},
       doc="a causal depthwise convolution of C channels (x's values start..start+C of each row) over the step's rows "
           "after the ring's: with xx the ring's taps-1 rows (the inputs before the step, oldest first) then x's, "
           "y[r] = Σ_j w[:, j]·xx[r + j]; the ring is rewritten in place with xx's last taps-1 rows: (R, X), (C, taps), "
           "(taps-1, C) -> (R, C); a batch's ring (B·(taps-1), C) holds a slot a sequence, row s of B rows sequence "
           "s's"),
    _d("decay", ["a", "dt", "al"],
       doc="a gated delta net's forget gate, log scale: -exp(al)·softplus(a + dt) (softplus x past 20 is x), al and "
           "dt one value a head: (R, h), (h,), (h,) -> (R, h)"),
    _d("gated_delta", ["q", "k", "v", "z", "beta", "g", "state", "gn"],
       {"hk": int, "hv": int, "dk": int, "dv": int, "scale": float, "eps": float, "zoff": int}, {"zoff": 0},
       doc="the gated delta rule over the step's rows in order, value head h reading key head h // (hv / hk): its "
           "state S (dk, dv) decayed by exp(g), then S += k ⊗ beta·(v - Sᵀk), the output Sᵀ(q·scale); the state "
           "table (hv·dk, dv) rewritten in place; each output head RMS-normed (eps) times gn and silu(z): "
           "(R, hk·dk) q and k, (R, hv·dv) v, z's values zoff.. of each row, (R, hv) beta and g, (dv,) gn -> "
           "(R, hv·dv); a batch's state (B·hv·dk, dv) holds a slot a sequence, row s of B rows sequence s's"),
    _d("head_slice", ["x"], {"every": int, "start": int, "width": int},
       doc="from each group of `every` values of a row, the `width` from `start`: (R, n) -> (R, n / every · width)"),
    _d("join", ["a", "b"], {"heads": int},
       doc="each head's part of a, then its part of b: (R, heads·ha), (R, heads·hb) -> (R, heads·(ha + hb))"),
    _d("all_reduce", ["x"], {"ranks": int},
       doc="a collective (engine/collectives.py): the sum of every rank's x, on every rank: (R, n) -> (R, n)"),
    _d("all_gather", ["x"], {"ranks": int},
       doc="a collective: every rank's x side by side, rank 0's first, on every rank: (R, n) -> (R, ranks·n)"),
    _d("all_argmax", ["x"], {"ranks": int, "offset": int}, {"offset": 0},
       doc="a collective: the index of each row's largest value over every rank's part of the row (rank r's part "
           "starting at its `offset`; the lowest index of equal maxima), two values a row sent a rank, not the "
           "parts: (R, n) -> i32 (R,)"),
    _d("head_matmul", ["x", "w"], {"heads": int, "a": int, "b": int, "rows_out": bool},
       doc="each head's a values times its own matrix, to b values: (R, heads·a) -> (R, heads·b); w checkpoint rows, "
           "head h's at h·b (rows_out: (heads·b, a), y_h = x_h·W_hᵀ) or at h·a (not rows_out: (heads·a, b), "
           "y_h = x_h·W_h)"),
]}


def opdef(kind: str) -> OpDef:
    d = OPS.get(kind)
    if d is None:
        hint = did_you_mean(kind, OPS)
        raise UserError(f"unknown op kind `{kind}`{hint}; known: {', '.join(sorted(OPS))}")
    return d


def _rows_cols(s: Shape) -> tuple[int, int]:
    if len(s) != 2:
        raise ValueError(f"expected a 2-D tensor, got {s}")
    return s[0], s[1]


def _same(shapes, attrs):
    return shapes[0], "f32"


def _broadcast(shapes, attrs):
    a, b = shapes[0], shapes[1]
    if b == a or (len(b) == 2 and len(a) == 2 and b[0] == 1 and b[1] == a[1]) or (len(b) == 1 and b[0] == a[-1]):
        return a, "f32"
    if len(b) == 2 and len(a) == 2 and b == (a[0], 1):  # one value a row (a shared expert's gate)
        return a, "f32"
    raise ValueError(f"{b} neither matches {a} nor broadcasts as one row or one value a row")


def _gather(shapes, attrs):
    v, d = _rows_cols(shapes[0])
    if len(shapes[1]) != 1:
        raise ValueError(f"index must be 1-D, got {shapes[1]}")
    return (shapes[1][0], d), "f32"


def _rmsnorm(shapes, attrs):
    r, n = _rows_cols(shapes[0])
    h = attrs["heads"]
    if h < 1 or n % h:
        raise ValueError(f"{h} heads do not divide a row of {n}")
    if shapes[1] != (n // h,):
        raise ValueError(f"weight {shapes[1]} is not ({n // h},)")
    return (r, n), "f32"


def _matmul(shapes, attrs):
    r, k = _rows_cols(shapes[0])
    n, k2 = _rows_cols(shapes[1])
    if k != k2:
        raise ValueError(f"x {shapes[0]} and w {shapes[1]} disagree on k")
    return (r, n), "f32"


def _rope(shapes, attrs):
    r, n = _rows_cols(shapes[0])
    h, hd, rot = attrs["heads"], attrs["hd"], attrs["rot"]
    if h * hd != n:
        raise ValueError(f"{h} heads of {hd} are not a row of {n}")
    if rot % 2 or rot > hd or rot < 2:
        raise ValueError(f"rotary width {rot} is not even and within the head ({hd})")
    if shapes[1] != shapes[2] or len(shapes[1]) != 2 or shapes[1][1] != rot // 2:
        raise ValueError(f"cos {shapes[1]} / sin {shapes[2]} are not (positions, {rot // 2})")
    _positions(shapes[3], r)
    return (r, n), "f32"


def _positions(pos: Shape, rows: int, table: int | None = None) -> None:
    """`pos` is one position (1,) (row r at pos + r), or a batch's, one a row ((rows,): row s, a sequence of its
    own, at pos[s]; its cache rows the slot of table/rows rows from s·table/rows)."""
    if pos == (1,):
        return
    if len(pos) != 1 or pos[0] != rows:
        raise ValueError(f"pos {pos} is neither (1,) nor a batch's ({rows},), one a row")
    if table is not None and table % rows:
        raise ValueError(f"a table of {table} rows does not hold {rows} sequences' equal slots")


def _set_row(shapes, attrs):
    (l, c), (r, c2) = _rows_cols(shapes[0]), _rows_cols(shapes[1])
    if c != c2 or r > l:
        raise ValueError(f"rows {shapes[1]} do not fit table {shapes[0]}")
    _positions(shapes[2], r, l)
    return (l, c), "f32"


def _attention(shapes, attrs):
    r, nq = _rows_cols(shapes[0])
    lk, nk = _rows_cols(shapes[1])
    lv, nv = _rows_cols(shapes[2])
    h, kv, hd, vd = attrs["heads"], attrs["kv_heads"], attrs["hd"], attrs["vd"]
    if nq != h * hd:
        raise ValueError(f"q {shapes[0]} is not {h} heads of {hd}")
    if nk != kv * hd or nv != kv * vd or lk != lv:
        raise ValueError(f"k {shapes[1]} / v {shapes[2]} are not {kv} heads of {hd} / {vd} over one length")
    if kv < 1 or h % kv:
        raise ValueError(f"{h} query heads do not group over {kv} key/value heads")
    _positions(shapes[3], r, lk)
    if len(shapes) > 4 and shapes[4] != (h,):
        raise ValueError(f"sinks {shapes[4]} is not ({h},)")
    return (r, h * vd), "f32"


def _swiglu(shapes, attrs):
    if shapes[0] != shapes[1]:
        raise ValueError(f"g {shapes[0]} and u {shapes[1]} differ")
    return shapes[0], "f32"


def _argmax(shapes, attrs):
    r, _ = _rows_cols(shapes[0])
    return (r,), "i32"


def _view(shapes, attrs):
    r, n = _rows_cols(shapes[0])
    row, rows = attrs["row"], attrs.get("rows", 1)
    if rows < 1:
        raise ValueError(f"a view of {rows} rows")
    if not 0 <= row or row + rows > r:
        raise ValueError(f"rows {row}..{row + rows - 1} outside {r} rows" if rows > 1 else
                         f"row {row} outside {r} rows")
    return (rows, n), "f32"


QBLOCK = 32  # the values of a quantized activation that share one scale
QBLOCK_K = 256  # ... under the q8k form (llama.cpp's q8_K, the activation of a product over K-quant rows)
QSUM = 16  # ... and its words a sum (its int16 sums of 16 words)
QFORMS = {1: "q8", 2: "q8x2", 3: "q8k"}  # a quantize's words -> the dtype of its result


def _quantize(shapes, attrs):
    r, n = _rows_cols(shapes[0])
    if attrs["words"] not in QFORMS:
        raise ValueError(f"words {attrs['words']}: a quantized activation is one int8 word a value (q8), two (q8x2) "
                         f"or llama.cpp's q8_K (3: q8k)")
    block = QBLOCK_K if attrs["words"] == 3 else QBLOCK
    if n % block:
        raise ValueError(f"a row of {n} values is not a whole number of {block}-value blocks")
    return (r, n), QFORMS[attrs["words"]]


ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_group")  # softmax over every expert, then the k largest
# (Qwen-MoE, Mixtral); the k largest logits, then a softmax over them (gpt-oss); sigmoid scores chosen in groups with
# a correction bias (DeepSeek-V3)


def _moe(shapes, attrs):
    r, d = _rows_cols(shapes[0])
    e, k, f = attrs["experts"], attrs["k"], attrs["inter"]
    if e < 1 or not 1 <= k <= e:
        raise ValueError(f"top-{k} of {e} experts")
    if f < 1:
        raise ValueError(f"experts of width {f}")
    if attrs["routing"] not in ROUTINGS:
        raise ValueError(f"routing `{attrs['routing']}` (known: {', '.join(ROUTINGS)})")
    n, t = attrs["groups"], attrs["topk_groups"]
    if n < 1 or e % n or not 1 <= t <= n:
        raise ValueError(f"{t} of {n} expert groups over {e} experts")
    if n > 1 and (attrs["routing"] != "sigmoid_group" or e // n < 2 or t * (e // n) < k):
        raise ValueError(f"the top {k} of {t} of {n} groups of {e // n} experts (groups: sigmoid_group routing, "
                         f"groups of at least 2, enough experts in the groups kept)")
    lo, n = attrs["lo"], attrs["local"] or e  # a rank's part: its experts lo..lo+n-1 of the e
    if attrs["local"] < 0 or lo < 0 or lo + n > e:
        raise ValueError(f"experts {lo}..{lo + n - 1} of {e}")
    want = {"router": (e, d), "gate_up": (n * 2 * f, d), "down": (n * d, f), "router_bias": (e,),
            "gate_up_bias": (n * 2 * f,), "down_bias": (n * d,)}
    for name, s in zip(("router", "gate_up", "down", "router_bias", "gate_up_bias", "down_bias"), shapes[1:]):
        if s != want[name]:
            raise ValueError(f"{name} {s} is not {want[name]} ({e} experts of {f} over {d})")
    return (r, d), "f32"


def _l2norm(shapes, attrs):
    r, n = _rows_cols(shapes[0])
    h = attrs["heads"]
    if h < 1 or n % h:
        raise ValueError(f"{h} heads do not divide a row of {n}")
    return (r, n), "f32"


def _causal_conv(shapes, attrs):
    r, x = _rows_cols(shapes[0])
    t, start = attrs["taps"], attrs["start"]
    if t < 2:
        raise ValueError(f"a convolution of {t} taps (at least 2)")
    c, t2 = _rows_cols(shapes[1])
    if t2 != t or start < 0 or start + c > x:
        raise ValueError(f"weights {shapes[1]} are not (C, {t}) of channels {start}..{start}+C within a row of {x}")
    rr, rc = _rows_cols(shapes[2])
    seqs = rr // (t - 1)
    if rc != c or rr % (t - 1) or seqs < 1 or (seqs > 1 and seqs != r):
        raise ValueError(f"ring {shapes[2]} is not ({t - 1}, {c}): the last {t - 1} inputs (a batch's: a slot of "
                         f"{t - 1} rows for each of its {r} rows)")
    return (r, c), "f32"


def _decay(shapes, attrs):
    r, h = _rows_cols(shapes[0])
    if shapes[1] != (h,) or shapes[2] != (h,):
        raise ValueError(f"dt {shapes[1]} / al {shapes[2]} are not ({h},)")
    return (r, h), "f32"


def _gated_delta(shapes, attrs):
    hk, hv, dk, dv = attrs["hk"], attrs["hv"], attrs["dk"], attrs["dv"]
    if min(hk, hv, dk, dv) < 1 or hv % hk:
        raise ValueError(f"{hv} value heads do not group over {hk} key heads")
    r, _ = _rows_cols(shapes[0])
    zr, zc = _rows_cols(shapes[3])
    if zr != r or attrs["zoff"] < 0 or attrs["zoff"] + hv * dv > zc:
        raise ValueError(f"z {shapes[3]} does not hold {hv}·{dv} values from {attrs['zoff']} of each of {r} rows")
    seqs = r if shapes[6][0] == r * hv * dk and r > 1 else 1  # a batch's state: a slot a sequence, one row each
    want = {"q": (r, hk * dk), "k": (r, hk * dk), "v": (r, hv * dv), "z": shapes[3], "beta": (r, hv),
            "g": (r, hv), "state": (seqs * hv * dk, dv), "gn": (dv,)}
    for name, s in zip(want, shapes):
        if s != want[name]:
            raise ValueError(f"{name} {s} is not {want[name]} ({hk} key heads of {dk}, {hv} value heads of {dv})")
    return (r, hv * dv), "f32"


def _head_slice(shapes, attrs):
    r, n = _rows_cols(shapes[0])
    every, start, width = attrs["every"], attrs["start"], attrs["width"]
    if every < 1 or n % every or width < 1 or start < 0 or start + width > every:
        raise ValueError(f"values {start}..{start + width - 1} of each {every} of a row of {n}")
    return (r, n // every * width), "f32"


def _join(shapes, attrs):
    (r, na), (r2, nb) = _rows_cols(shapes[0]), _rows_cols(shapes[1])
    h = attrs["heads"]
    if r != r2 or h < 1 or na % h or nb % h:
        raise ValueError(f"{shapes[0]} and {shapes[1]} are not {h} heads over the same rows")
    return (r, na + nb), "f32"


def _head_matmul(shapes, attrs):
    r, n = _rows_cols(shapes[0])
    h, a, b = attrs["heads"], attrs["a"], attrs["b"]
    if n == a and h > 1 and r % h == 0:  # read in parts (an access: a unit a row's head, e.g. each head's unrotated
        r //= h                          # query values inside a wider row of every head's query)
    elif n != h * a:
        raise ValueError(f"x {shapes[0]} is not {h} heads of {a}")
    want = (h * b, a) if attrs["rows_out"] else (h * a, b)
    if shapes[1] != want:
        raise ValueError(f"w {shapes[1]} is not {want} ({h} heads from {a} to {b})")
    return (r, h * b), "f32"


def _ranks(attrs):
    if attrs["ranks"] < 1:
        raise ValueError(f"a collective over {attrs['ranks']} ranks")


def _all_reduce(shapes, attrs):
    _ranks(attrs)
    _rows_cols(shapes[0])
    return shapes[0], "f32"


def _all_gather(shapes, attrs):
    _ranks(attrs)
    r, n = _rows_cols(shapes[0])
    return (r, n * attrs["ranks"]), "f32"


def _all_argmax(shapes, attrs):
    _ranks(attrs)
    if attrs["offset"] < 0:
        raise ValueError(f"a part of the row from {attrs['offset']}")
    r, _ = _rows_cols(shapes[0])
    return (r,), "i32"


INFER: dict[str, Callable] = {
    "gather": _gather, "rmsnorm": _rmsnorm, "matmul": _matmul, "add": _broadcast, "mul": _broadcast,
    "sub": _broadcast, "rope": _rope, "set_row": _set_row, "attention": _attention, "silu": _same,
    "sigmoid": _same, "gelu": _same, "gelu_erf": _same, "swiglu": _swiglu, "argmax": _argmax, "scale": _same,
    "softcap": _same, "view": _view, "moe": _moe, "quantize": _quantize, "l2norm": _l2norm,
    "causal_conv": _causal_conv, "decay": _decay, "gated_delta": _gated_delta, "head_slice": _head_slice,
    "join": _join, "head_matmul": _head_matmul,
    "all_reduce": _all_reduce, "all_gather": _all_gather, "all_argmax": _all_argmax,
}

QUANTIZED = ("q8", "q8x2", "q8k")


def full_attrs(op) -> dict[str, Any]:
    d = opdef(op.kind)
    a = dict(d.defaults)
    a.update(op.a)
    return a


def check_attrs(op) -> dict[str, Any]:
    d = opdef(op.kind)
    a = full_attrs(op)
    for k, t in d.attrs.items():
        if k not in a:
            raise UserError(f"op `{op.kind}` -> `{op.out}`: missing attribute `{k}` ({t.__name__})")
        v = a[k]
        if t is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
            a[k] = v
        if not isinstance(v, t) or (t is int and isinstance(v, bool)):
            raise UserError(f"op `{op.kind}` -> `{op.out}`: attribute `{k}` is {v!r}, expected {t.__name__}")
    for k in a:
        if k not in d.attrs:
            hint = did_you_mean(k, d.attrs)
            raise UserError(f"op `{op.kind}` -> `{op.out}`: unknown attribute `{k}`{hint}")
    return a


def infer(g, op) -> tuple[Shape, str]:
    """The result shape and dtype of lifted op `op` in graph `g`; a mismatch names the op and the shapes."""
    d = opdef(op.kind)
    n_req, n_all = len(d.required), len(d.ins)
    if not n_req <= len(op.ins) <= n_all:
        raise UserError(f"op `{op.kind}` -> `{op.out}` takes inputs ({', '.join(d.ins)}), got {len(op.ins)}")
    a = check_attrs(op)
    shapes = []
    for i, name in enumerate(op.ins):
        acc = op.acc(i)
        s = g.shape(name)
        if acc is not None:
            total = 1
            for x in s:
                total *= x
            units = total // acc.pitch if acc.pitch else 0
            if acc.pitch <= 0 or total % acc.pitch or acc.offset + acc.width > acc.pitch:
                raise UserError(f"op `{op.kind}` -> `{op.out}`: access {acc} does not fit `{name}` {s}")
            s = (units, acc.width)
        shapes.append(s)
    for i, name in enumerate(op.ins):
        if g.dtype(name) in QUANTIZED and not (op.kind in ("matmul", "view") and i == 0):
            raise UserError(f"op `{op.kind}` -> `{op.out}` reads `{name}`, a quantized activation "
                            f"({g.dtype(name)}): only a product's activation (or a row of it) is read quantized")
        if op.kind == "quantize" and g.dtype(name) != "f32":
            raise UserError(f"op `quantize` -> `{op.out}` reads `{name}` ({g.dtype(name)}): it quantizes f32 values")
    want_i32 = {"gather": [1], "rope": [3], "set_row": [2], "attention": [3]}.get(op.kind, [])
    for i in want_i32:
        if g.dtype(op.ins[i]) != "i32":
            raise UserError(f"op `{op.kind}` -> `{op.out}`: input `{op.ins[i]}` must be i32")
    try:
        shape, dtype = INFER[op.kind](shapes, a)
        if op.kind == "view" and g.dtype(op.ins[0]) in QUANTIZED:  # a row of a quantized form: a view into it
            form = g.dtype(op.ins[0])
            block = QBLOCK_K if form == "q8k" else QBLOCK
            if (a["row"] * shapes[0][-1]) % block:
                raise ValueError(f"row {a['row']} of a {form} activation starts inside a block of {block} values (a "
                                 f"row of its quantized form must start on a whole block)")
            return shape, form
        return shape, dtype
    except ValueError as e:
        ins = ", ".join(f"{n} {s}" for n, s in zip(op.ins, shapes))
        raise UserError(f"op `{op.kind}` -> `{op.out}`: shape mismatch: {e} (inputs: {ins})") from None
