"""`chain`: launches that run as the phases of one launch (chain.cu), each phase over what the phases before wrote.
Two chains have a kernel: the gate/up GLU, then the down product folded with the residual and the next norm
(`glu_down_norm`: gemv_gate_up_glu then gemv_norm_epilogue, a layer's MLP in one launch where it took two); and the o
projection folded with the residual and the post-attention norm before those two (`o_glu_down_norm`: a decode layer's
o product, MLP and next norm in one launch where it took two, three before the first chain). Every block takes a
ticket as it starts; the first tickets run phase 0, the next phase 1, and so on, each block of a later phase waiting
until every block of the phases before has arrived and their tails (a fold's norm) have run (it only waits on blocks
that took earlier tickets, which are running: no deadlock, no cooperative launch). The numpy twin is the phases'
twins in order: exactly what the phases compute. Where the kernel does not serve the phases (a quantized activation
or GLU, a split or capped product, more than two rows (but a slab of up to eight over f32/f16/bf16 rows at four
outputs a warp: a batch's sequences), a norm not the fold's, phases of another order) the chain is
refused, in one line, and the plan keeps the launches it had.
A third chain runs the layer's attention before those three (`attn_o_glu_down_norm`: a decode layer's attention to
its next norm in one launch): the split attention's blocks first (attention.cu's body, its last split block of a row's
heads merging their partials), the o phase waiting for all of them; the attention is refused where the chained kernel
does not serve it (heads wider than 128 values, more than 4 a block, shared rows, a gate, a quantized
output, split heads).
A fourth runs the layer's q/k/v products before those four (`qkv_attn_o_glu_down_norm`: a decode layer from its q/k/v
products to its next norm in one launch): fold_parts_rope's blocks first (the products in parts, each head's norm
and rotation by the last block of the head to arrive, the key and value rows written into their cache rows), the
attention's blocks waiting for all of them (a phase counter), then the four phases above. Refused where the chained
kernel does not serve the q/k/v fold (a quantized activation, an absorbing side or a quantized row norm, rows or a
position not the attention's), the plan then keeping the fold and the four-phase chain."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.attention import Attention
from lanefuse.kernels.common import DENSE, FORMAT_CODE, GEMV_ROWS, Launch, Scratch, names
from lanefuse.kernels.elementwise import act_code
from lanefuse.kernels.fold import Fold, Sequenced, as_parts, as_rope_parts
from lanefuse.kernels.gemv import Gemv
from lanefuse.kernels.gemv_glu import GemvGlu

CHAIN_ROWS = 2  # the rows of x the chained kernel takes at any format (a decode step, or two): gemv_rows' AR 1 / 2
CHAIN_SLAB = GEMV_ROWS  # at four outputs a warp over dense rows: a slab of up to GR (chain.cu's gemv_slab_cp ring)
SLAB_FORMATS = frozenset(DENSE)  # f32, f16, bf16


def blocks(n: int, per_warp: int) -> int:
    """A phase's blocks: gemv_body's blocks of four warps of `per_warp` outputs over n outputs."""
    return -(-n // (4 * per_warp))


def attention_blocks(a: Attention) -> int:
    """An attention phase's blocks: its launch's grid (heads a block, rows, splits) in one row of tickets."""
    (x, y, z), _ = a.grid_block()
    return x * y * z


def _fold_of_gemv(l: Launch) -> bool:
    return isinstance(l, Fold) and isinstance(l.first, Gemv)


# The chains chain.cu has a kernel for, by their phases' kinds: a kernel name's stem a chain
KERNELS = {("gemv_glu", "fold"): "fold_glu_down", ("fold", "gemv_glu", "fold"): "fold_o_glu_down",
           ("attention", "fold", "gemv_glu", "fold"): "fold_attn_o_glu_down",
           ("fold", "attention", "fold", "gemv_glu", "fold"): "fold_attn_o_glu_down"}  # the q/k/v phase's (gq > 0)
ATTN_HEAD = 128  # the widest head the chained attention holds (attention_split_128's body: 4 heads a block)
ATTN_PER_BLOCK = 4


@dataclass(frozen=True)
class Chain(Sequenced, Launch):
    phases: tuple[Launch, ...]  # in order: (GemvGlu, Fold(Gemv, Norm)), an o Fold(Gemv, Norm) before those, an
    # Attention before that, and the q/k/v Fold(GemmParts, RopeParts) before that

    census: ClassVar[str] = "chain"
    stem: ClassVar[tuple[str, ...]] = ("quant", "gemv_core", "gemv_q8", "gemv_glu", "norm", "attention", "parts_rope",
                                       "chain")

    def apart(self) -> tuple[Launch, ...]:
        """Held `sequences`: a chain whose attention phase runs a batch's sequences (its slot set) as its phases'
        own launches, each apart by its own kind; any other chain as it is (it reads no sequence's position)."""
        att = self.attention
        if att is None or not att.slot:
            return (self,)
        return tuple(k for p in self.phases for k in p.apart())

    def sequence(self):
        return self.phases

    def kinds(self) -> tuple[str, ...]:
        return tuple(p.census for p in self.phases)

    @property
    def glu(self) -> GemvGlu:
        return self.phases[-2]  # type: ignore[return-value]

    @property
    def down(self) -> Fold:
        return self.phases[-1]  # type: ignore[return-value]

    @property
    def attention(self) -> Attention | None:
        return self.phases[-4] if len(self.phases) >= 4 else None  # type: ignore[return-value]

    @property
    def qkv(self) -> Fold | None:
        """The q/k/v products with their heads' epilogue (a fold of products in parts and a rotation), the first of
        five phases; None in a shorter chain."""
        return self.phases[0] if len(self.phases) == 5 else None  # type: ignore[return-value]

    def products(self) -> list[Fold]:
        """The product phases folded with their norm (o, down): every Fold but the q/k/v one."""
        return [p for p in self.phases if isinstance(p, Fold) and p is not self.qkv]

    def check(self) -> Refusal | None:
        """Why the phases are not one chained launch (the plan then keeps its launches), in one line; None if they
        are."""
        kinds = self.kinds()
        if kinds not in KERNELS or not all(_fold_of_gemv(p) for p in self.products()):
            return Refusal(f"no chained kernel runs a {' then a '.join(kinds)}")
        glu, fold = self.glu, self.down
        down = fold.first
        folds = self.products()
        why = glu.check() or next((w for w in (p.check() for p in folds) if w), None)
        if why:
            return why
        if any(p.form()[0] != "gemv_norm" for p in folds):
            return Refusal("a chain whose product phase is not a product folded with its norm")
        if glu.words or glu.quant is not None or any(p.first.words or p.first.quant is not None for p in folds):
            return Refusal("a chain over quantized activations (the q8 numerics): its phases run as launches of "
                           "their own")
        if not glu.f32:
            return Refusal("a chain whose GLU is not stored in f32 (the down phase reads it)")
        if down.x != glu.out or down.k != glu.n or down.m != glu.m:
            return Refusal(f"a chain whose down product reads `{down.x}` ({down.m}x{down.k}), not the GLU `{glu.out}` "
                           f"({glu.m}x{glu.n})")
        if len(self.phases) >= 3:
            o: Fold = self.phases[-3]  # type: ignore[assignment]
            nm = o.then
            if nm.quant is not None or not nm.f32 or nm.into is not None or nm.part is not None or nm.heads != 1 \
                    or nm.out != glu.x or nm.rows != glu.m or nm.cols != glu.k \
                    or o.first.m != glu.m:
                return Refusal(f"a chain whose GLU reads `{glu.x}`, not the o product's norm `{nm.out}` as it lies")
        if glu.m > CHAIN_ROWS and (glu.m > CHAIN_SLAB or not self.formats() <= SLAB_FORMATS):
            return Refusal(f"a chain of {glu.m} rows over {'/'.join(sorted(self.formats()))} rows (the chained kernel "
                           f"takes at most {CHAIN_ROWS} rows, or a slab of up to {CHAIN_SLAB} over f32/f16/bf16 rows)")
        if any(p.first.split != 1 or p.first.cap for p in folds):
            return Refusal("a chain whose product is split or capped")
        if any(p.first.per_warp != glu.per_warp for p in folds):
            return Refusal(f"a chain of {glu.per_warp} and {folds[-1].first.per_warp} outputs a warp (the kernel "
                           f"takes one)")
        if self.attention is not None:
            return self.attention_refusal() or (self.qkv_refusal() if self.qkv is not None else None)
        return None

    def formats(self) -> frozenset[str]:
        """The formats of every product phase's weight rows (the GLU's gate and up, the q/k/v phase's parts)."""
        glu, qkv = self.glu, self.qkv
        return frozenset({glu.format, glu.format_u or glu.format, *(p.first.format for p in self.products()),
                          *([qkv.first.format] if qkv is not None else [])})

    def attention_refusal(self) -> Refusal | None:
        """Why the attention phase cannot run before the o phase in one launch, in one line; None if it can."""
        att: Attention = self.attention  # type: ignore[assignment]
        og: Gemv = self.phases[-3].first  # type: ignore[attr-defined]
        why = att.check()
        if why:
            return why
        if max(att.hd, att.vd) > ATTN_HEAD or att.heads_a_block > ATTN_PER_BLOCK:
            return Refusal(f"a chained attention of heads of {max(att.hd, att.vd)} values, {att.heads_a_block} a "
                           f"block (the chained kernel holds heads of up to {ATTN_HEAD}, {ATTN_PER_BLOCK} a block)")
        if att.shared != 1 or att.seq0:
            return Refusal("a chained attention over shared rows, or a batch's sequences from one past the first (the "
                           "chained kernel takes the split attention's blocks of every row)")
        if att.gate is not None or att.quant is not None or not att.f32 or att.tail:
            return Refusal("a chained attention gated, quantizing its output or in split heads (attention's own "
                           "launch does those)")
        if og.x != att.out or og.k != att.heads * att.vd or att.rows != og.m:
            return Refusal(f"a chain whose o product reads `{og.x}` ({og.m}x{og.k}), not the attention's output "
                           f"`{att.out}` ({att.rows}x{att.heads * att.vd})")
        return None

    def qkv_refusal(self) -> Refusal | None:
        """Why the q/k/v fold cannot run before the attention in one launch, in one line; None if it can."""
        q: Fold = self.qkv  # type: ignore[assignment]
        att: Attention = self.attention  # type: ignore[assignment]
        form, why = q.form()
        if form != "parts_rope":
            return why or Refusal(f"a chain whose first phase is a {q.first.census} then a {q.then.census}, not "
                                  f"products in parts with their heads' rotation in one kernel")
        gp, rp = as_parts(q.first), as_rope_parts(q.then)
        why = q.check()
        if why:
            return why
        if gp.words:
            return Refusal("a chained q/k/v phase over a quantized activation (the q8 numerics): fold_parts_rope_q8 "
                           "runs it apart")
        if any(s.absorb is not None or s.quant is not None for s in rp.sides):
            return Refusal("a chained q/k/v phase with a side absorbing its heads or quantizing a row norm (the "
                           "products' own fold runs those)")
        if gp.m != att.rows or rp.pos != att.pos or rp.slot != att.slot:
            return Refusal(f"a chained q/k/v phase of {gp.m} rows at `{rp.pos}` before an attention of {att.rows} "
                           f"at `{att.pos}` (one position and its rows for both)")
        if att.q not in q.writes():  # (its caches are the tables the phase writes rows of, by names of their own)
            return Refusal(f"a chain whose attention reads `{att.q}`, which its q/k/v phase does not write")
        if gp.per_warp != self.glu.per_warp:
            return Refusal(f"a chain of {self.glu.per_warp} and {gp.per_warp} outputs a warp (the kernel takes one)")
        return None

    def reads(self):
        return names(*(n for p in self.phases for n in p.reads()))

    def writes(self):
        return names(*(n for p in self.phases for n in p.writes()))

    def scratch(self):
        """The tickets and the arrivals, left zero by the last block; an attention phase's partials and its arrival
        counters (its merging blocks leave them zero); a q/k/v phase's arrivals a head (each head's last block leaves
        its own zero; a kernel argument of their own: as the tickets' words 2.., the pointer computed in the kernel
        made nvcc 13 spill fold_attn_o_glu_down_4 20 / 196 B)."""
        att, qkv = self.attention, self.qkv
        return (Scratch("tickets", "i32", 8, counter=True), *(att.scratch() if att is not None else ()),
                *(Scratch("qkv." + s.tag, s.dtype, s.nbytes, s.counter) for s in (qkv.scratch() if qkv else ())))

    def tune(self, knobs, held=frozenset()):
        """Each phase tuned as its own launch (a product takes no split-K: its last block norms it; an attention no
        shared rows), then every
        product at the GLU's outputs a warp (one kernel template; the twin's bits are the same at either)."""
        # an attention phase of one block a (row, heads) (the chained kernel's: `shared_rows` held for it)
        phases = tuple(p.tune(knobs, held | {"shared_rows"} if isinstance(p, Attention) else held)
                       for p in self.phases)
        glu = next((p for p in phases if isinstance(p, GemvGlu)), None)
        if glu is not None and glu.m > CHAIN_ROWS:  # a slab: four outputs a warp (chain.cu's only slab)
            glu = replace(glu, per_warp=4)
            phases = tuple(glu if isinstance(p, GemvGlu) else p for p in phases)
        if glu is not None:  # the q/k/v fold's products in parts too (its first phase)
            phases = tuple(replace(p, first=replace(p.first, split=1, per_warp=glu.per_warp)) if _fold_of_gemv(p)
                           else replace(p, first=replace(p.first, per_warp=glu.per_warp))
                           if i == 0 and len(phases) == 5 and isinstance(p, Fold) and p.form()[0] == "parts_rope"
                           else p for i, p in enumerate(phases))
        return replace(self, phases=phases)

    def blocks_of(self) -> tuple[int, ...]:
        """Each phase's blocks (the grid is their sum, in x)."""
        pw = self.glu.per_warp
        return tuple(attention_blocks(p) if isinstance(p, Attention) else
                     sum(as_parts(p.first).blocks()) if p is self.qkv else
                     blocks(p.n if isinstance(p, GemvGlu) else p.first.n, pw) for p in self.phases)

    def grid_block(self):
        return ((sum(self.blocks_of()), 1, 1), (128, 1, 1))

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import i64

        glu, fold = self.glu, self.down
        down: Gemv = fold.first  # type: ignore[assignment]
        nm = fold.then
        grid, block = self.grid_block()
        counters = denv.scratch(self, self.scratch()[0])
        g = self.blocks_of()
        head = ()
        if len(self.phases) >= 3:
            o: Fold = self.phases[-3]  # type: ignore[assignment]
            og: Gemv = o.first  # type: ignore[assignment]
            head = (denv.array(og.x), denv.weight(og.w)[0], i64(FORMAT_CODE[og.format]), denv.opt(og.bias),
                    *denv.dst(og.y), i64(og.k), i64(og.n), i64(o.then.rows), *o.then.args(denv))
        tail = ()
        if self.attention is not None:  # the phases' ends (ticket counts), the q/k/v phase's arguments after the norm's
            gq, ga, g0, g1 = (0, *g[:3]) if self.qkv is None else g[:4]
            head = (*self.attention_args(denv, gq + ga), *head[1:])  # the attention writes the o product's x
            g = (gq + ga + g0, gq + ga + g0 + g1, 0)
            tail = self.qkv_args(denv, gq)
        denv.function(self.stem, self.kernel_name())(grid, block, (
            *head, denv.array(glu.x), denv.weight(glu.wg)[0], denv.weight(glu.wu)[0], i64(FORMAT_CODE[glu.format]),
            denv.opt(glu.bg), denv.opt(glu.bu), denv.array(glu.out), i64(glu.k), i64(glu.n), i64(act_code(glu.act)),
            denv.weight(down.w)[0], i64(FORMAT_CODE[down.format]), denv.opt(down.bias), *denv.dst(down.y),
            i64(down.n), i64(glu.m), counters, *(i64(x) for x in g[:-1]), i64(nm.rows), *nm.args(denv), *tail))

    def kernel_name(self) -> str:
        """chain.cu's kernel: its stem at the GLU's outputs a warp; a chain with an attention phase over more than
        CHAIN_ROWS rows the slab's own (fold_attn_o_glu_down_slab: the three row paths in one kernel spilled it)."""
        stem, glu = KERNELS[self.kinds()], self.glu
        if glu.m > CHAIN_ROWS and glu.per_warp != 4:  # (the lowering tunes a chain first: tune sets four)
            raise ValueError(f"a chain of {glu.m} rows at {glu.per_warp} outputs a warp: chain.cu's slab takes four")
        return f"{stem}_slab" if self.attention is not None and glu.m > CHAIN_ROWS else f"{stem}_{glu.per_warp}"

    def qkv_args(self, denv, gq: int):
        """The q/k/v phase's arguments (fold_attn_o_glu_down's last): fold_parts_rope's (its descriptor table, its
        arrivals a head, the rotation's tables) and its blocks gq; a chain without one passes nulls and gq 0."""
        from lanefuse.kernels.cupy_env import NULL, i64

        q = self.qkv
        if q is None:
            return (NULL, NULL, i64(0), i64(0), i64(0), NULL, NULL, NULL, i64(0))
        gp, rp = as_parts(q.first), as_rope_parts(q.then)
        arrivals = denv.scratch(self, self.scratch()[-1])
        t = denv.table(q.key(), q.table(denv, gp, rp))
        return (denv.array(gp.x), t, i64(len(gp.parts)), i64(FORMAT_CODE[gp.format]), i64(gp.k), arrivals,
                denv.weight(rp.cos)[0], denv.weight(rp.sin)[0], i64(gq))

    def attention_args(self, denv, ea: int):
        """The attention phase's arguments (fold_attn_o_glu_down's first): attention.cu's body's, those the chain
        refuses (gate, quantized form, tail, shared rows) left out; ea the attention phase's last ticket + 1."""
        from lanefuse.kernels.cupy_env import NULL, f32, i64

        a: Attention = self.attention  # type: ignore[assignment]
        part, acounters = (denv.scratch(self, s) for s in a.scratch()) if a.splits > 1 else (NULL, NULL)
        return (denv.array(a.q), denv.array(a.kc), denv.array(a.vc), denv.array(a.pos), denv.opt(a.sinks),
                denv.array(a.out), part, i64(a.heads), i64(a.group), i64(a.hd), i64(a.vd), i64(a.window),
                i64(a.heads_a_block), i64(a.splits), i64(a.kpitch), i64(a.koff), i64(a.vpitch), i64(a.voff),
                f32(a.scale), f32(a.softcap), i64(a.slot), i64(a.seq0), acounters, i64(a.heads // a.heads_a_block),
                i64(ea))
