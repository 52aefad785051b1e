"""`attention`: grouped-query attention of each row over the rows of a key and a value cache table up to its
position (its last `window` when set), with a scale, its logits soft-capped (`softcap`: cap · tanh(l / cap), Gemma 2)
and per-head sinks; its output gated by act(gate) as it is stored (`gate`, attn_output_gate: Qwen3-Next), and its
quantized form written in the epilogue (`quant`, attn_output_quant: the q8 numerics' o projection), beside the output
or instead of it (`f32` false: only the projection reads it); over K-quant rows the q8k form (llama.cpp's q8_K, blocks
of 256 values), which a block writes from the output it stored, taking the heads one such block spans (`kheads`) at
least; `per_block` heads a block, the keys in `splits` chunks merged flash-decoding style by the last split block of
those heads to arrive, in the same launch (attention.cu's attention_merge). In a batch (`slot` set) each row is a
sequence of its own: row s (from `seq0`) at position pos[s] over its slot of the caches, rows s·slot on.
Shared rows (`shared` > 1, the seed's shared-row attention; step `shared_rows`): a chunk's `shared` consecutive rows
a block beside its heads, all of one key/value head, so each tile of keys and values is read once for all of them
(attention.cu attention_rows_128): the rows' keys, from the first row's window start to the last row's position, split
as one row's are, each row masking the keys past its own position or before its own window.
Split (`tail` > 0: a latent attention, 000's Split): each head's query and each key in two parts, read in place — the
query's first hd - tail values its (row, head)'s in q, the rest its (row, head)'s in `qtail`; a key's first part its
group's in kc, the rest its row's in `ktail`, one table every group shares (the rotated key part)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from lanefuse.engine.formats import ggml
from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import (ACTS, MAX_GRID_Y, MAX_HEAD, Q8K, QBLOCK_K, Launch, Scratch, act, batch_apart, names,
                                     reach)
from lanefuse.kernels.elementwise import act_code
from lanefuse.kernels.norm import quantized_next
from lanefuse.kernels.quant import QuantEpilogue

MAX_PER_BLOCK = 4  # heads a block holds
MAX_NARROW = (8, 64)  # the narrow kernel's heads a block, of at most 64 values (attention_split_narrow: the q8k blocks of
# heads of 32)
MAX_SPLITS = 128  # the most chunks the schedule splits an attention's keys into
BLOCKS_AN_SM = 2  # the blocks an attention's splits aim for, an SM each (two resident: 196 registers a thread)
MAX_WIDE = 640  # the widest head the wide kernel holds, one head a block (attention.cu attention_split_wide)
MAX_ROWS_HEAD = 128  # the widest head the shared-row kernel holds (attention.cu attention_rows_128)


def span(length: int, window: int) -> int:
    """The most positions one query of an attention over a cache of `length` rows attends: the cache, or its window."""
    return min(length, window) if window > 0 else length


def part_stride(vd: int) -> int:
    """A (row, head, split)'s partial in floats (attention.cu part_stride): its maximum, its sum, two unused, its vd
    weighted values, vd rounded up to four (each split's values 16-byte aligned: the staged merge's cp.async)."""
    return -(-vd // 4) * 4 + 4


def split_range(lo: int, p: int, splits: int, z: int) -> tuple[int, int]:
    """Keys [js, je) of split z for a query at p attending from lo (attention.cu's partition)."""
    cnt = p - lo + 1
    ch = -(-cnt // splits)
    js = lo + z * ch
    return js, min(p + 1, js + ch)


@dataclass(frozen=True)
class Attends(Launch):
    """The fields both attention kinds lead with (Attention, and AttentionTc, kernels/attention_tc.py: a chunk of one
    sequence on the tensor cores), in this order: q, the key and value tables, the position, the output, the heads,
    their grouping and widths, the cache's rows, the step's rows, the logits' scale, the window and the sinks."""

    q: str
    kc: str
    vc: str
    pos: str
    out: str
    heads: int
    group: int
    hd: int
    vd: int
    len: int
    rows: int
    scale: float
    window: int = 0
    sinks: str | None = None

    @property
    def kv(self) -> int:
        """The key/value heads."""
        return self.heads // self.group


@dataclass(frozen=True)
class Attention(QuantEpilogue, Attends):
    """out (rows, heads·vd): row r at position pos + r attends cache rows lo..pos+r of kc (keys of row j at
    j·kstride + koff + kvh·hd) and vc (values of row j at j·vstride + voff + kvh·vd), head h reading kv head
    h // group: keys and values may be parts of every row of wider tables (the two halves of one cache row)."""

    per_block: int = 1
    splits: int = 1
    kstride: int = 0  # 0: kv·hd (a key table of its own)
    koff: int = 0
    vstride: int = 0  # 0: kv·vd (a value table of its own)
    voff: int = 0
    gate: tuple[str, str] | None = None  # (gate tensor (rows, heads·vd), activation): the output times act(gate)
    softcap: float = 0.0  # > 0: each scaled logit l becomes softcap · tanh(l / softcap) before the softmax
    slot: int = 0  # a batch's cache rows a sequence (0: one sequence)
    seq0: int = 0  # a batch launch's first sequence (the `sequences` step held: one launch a sequence)
    quant: str | None = None  # the output's quantized form, written as it is stored (the q8 numerics)
    words: int = 0  # its int8 words a value (q8 1, q8x2 2, the q8k form 3)
    f32: bool = True  # false: the quantized form alone is written (the f32 output is read by nothing else)
    qtail: str | None = None  # Split: each (row, head)'s last `tail` query values, (rows, heads·tail)
    ktail: str | None = None  # Split: each key row's last `tail` values, one table the groups share, (len, tail)
    tail: int = 0  # Split: the width of the second part (0: queries and keys whole)
    shared: int = 1  # rows a block (> 1: shared rows, each tile of keys and values read once for them all)

    census: ClassVar[str] = "attention"
    stem: ClassVar[tuple[str, ...]] = ("quant", "attention")
    steps: ClassVar[tuple[str, ...]] = ("attn_splits", "shared_rows", "sequences")  # sequences: `apart`

    @property
    def wide(self) -> bool:
        """A head wider than MAX_HEAD: the wide kernel (one head a block)."""
        return self.hd > MAX_HEAD or self.vd > MAX_HEAD

    @property
    def kheads(self) -> int:
        """The heads one block of the output's q8k form spans (256 values): a block of the kernel (and its merge)
        takes a whole number of such blocks; 1 for any other form."""
        return max(1, QBLOCK_K // self.vd) if self.quant is not None and self.words == Q8K else 1

    @property
    def heads_a_block(self) -> int:
        """The heads a block of the kernel takes: `per_block`, at least the heads a q8k block spans (the least
        multiple of both)."""
        return math.lcm(self.per_block, self.kheads)

    @property
    def own(self) -> int:
        """A head's query and key values read from q and kc (all of them but a Split's tail)."""
        return self.hd - self.tail

    @property
    def kpitch(self) -> int:
        return self.kstride or self.kv * self.own

    @property
    def vpitch(self) -> int:
        return self.vstride or self.kv * self.vd

    def reads(self):
        return names(self.q, self.kc, self.vc, self.pos, self.sinks, self.gate[0] if self.gate else None, self.qtail,
                     self.ktail)

    def writes(self):
        return names(self.stored(self.out), self.quant)

    def scratch(self):
        """Split keys: each split's partials (max, sum, weighted values of each row and head), and an arrival counter a
        row and block of heads (the last split block to arrive merges them, attention.cu's attention_merge)."""
        if self.splits == 1:
            return ()
        return (Scratch("partials", "f32", 4 * self.rows * self.heads * self.splits * part_stride(self.vd)),
                Scratch("arrivals", "i32", 4 * self.rows * (self.heads // self.heads_a_block), counter=True))

    def check(self):
        why = (self.written_refusal("an attention", "output")
               or self.epilogue_refusal(self.heads * self.vd, "an attention's output row"))
        if why:
            return why
        if self.quant is not None:
            if self.words == Q8K:
                if not self.f32:
                    return Refusal("an attention writing its output's q8k form alone (a block quantizes the 256 "
                                   "values it stored: the output is stored too)")
                if QBLOCK_K % self.vd and self.vd % QBLOCK_K:
                    return Refusal(f"an attention quantizing heads of {self.vd} values as q8k (blocks of "
                                   f"{QBLOCK_K}: a head holds whole blocks, or a block whole heads)")
            elif self.vd % 32:
                return Refusal(f"an attention quantizing its output in heads of {self.vd} values (a block of 32 "
                               f"would span two heads, which two blocks write)")
        if self.gate is not None and self.gate[1] not in ACTS:
            return Refusal(f"an attention gated by `{self.gate[1]}` (one of {', '.join(ACTS)})")
        if self.tail and not (0 < self.tail < self.hd and self.qtail and self.ktail):
            return Refusal(f"a split attention's second part of {self.tail} of {self.hd} values without both its "
                           f"query part and its key table (or as wide as the head)")
        if not self.tail and (self.qtail or self.ktail):
            return Refusal("a second query or key part for an attention whose heads are not split (tail 0)")
        if self.group < 1 or self.heads % self.group:
            return Refusal("query heads that do not group evenly over the key/value heads")
        if self.hd > MAX_WIDE or self.vd > MAX_WIDE:
            return Refusal(f"a head wider than {MAX_WIDE} values (key {self.hd}, value {self.vd})")
        if self.wide and self.per_block != 1:
            return Refusal(f"{self.per_block} heads a block of a head wider than {MAX_HEAD} values (the wide kernel "
                           f"takes one)")
        if not 1 <= self.per_block <= MAX_PER_BLOCK or self.heads % self.per_block:
            return Refusal(f"{self.per_block} heads a block (1..{MAX_PER_BLOCK}, dividing {self.heads} heads)")
        hb = self.heads_a_block
        most = MAX_NARROW[0] if max(self.hd, self.vd) <= MAX_NARROW[1] else MAX_PER_BLOCK
        if hb != self.per_block and (hb > most or self.heads % hb or self.wide):
            return Refusal(f"{hb} heads a block, as the output's q8k blocks of {QBLOCK_K} values span heads of "
                           f"{self.vd} (at most {MAX_PER_BLOCK} heads a block, {MAX_NARROW[0]} of at most "
                           f"{MAX_NARROW[1]} values, dividing {self.heads} heads)")
        if self.splits < 1:
            return Refusal("an attention in no splits")
        if not self.softcap >= 0.0 or self.softcap == float("inf"):
            return Refusal(f"a soft cap of {self.softcap} on the attention's logits (a positive number, or 0: none)")
        if self.shared != 1:
            why = self.rows_refusal()
            if why:
                return why
        if self.rows > MAX_GRID_Y or self.splits > MAX_GRID_Y:
            return Refusal(f"an attention of {self.rows} rows in {self.splits} splits (a launch takes at most "
                           f"{MAX_GRID_Y} of each: rows and splits are its grid's y and z)")
        return None

    def rows_refusal(self) -> Refusal | None:
        """Why this launch's `shared` rows a block cannot run (attention_rows_128), or None."""
        hb = self.heads_a_block
        if self.shared < 1:
            return Refusal(f"an attention of {self.shared} rows a block")
        if self.slot:
            return Refusal("shared rows of a batch's sequences (each row its own slot of the caches)")
        if max(self.hd, self.vd) > MAX_ROWS_HEAD or self.tail:
            return Refusal(f"shared rows of heads of {max(self.hd, self.vd)} values or split heads (the shared-row "
                           f"kernel takes whole heads of at most {MAX_ROWS_HEAD})")
        if self.group % hb:
            return Refusal(f"shared rows of {hb} heads a block spanning key/value heads of {self.group} (a block "
                           f"reads one)")
        if self.shared * hb > MAX_PER_BLOCK:
            return Refusal(f"{self.shared} rows of {hb} heads a block (the shared-row kernel holds "
                           f"{MAX_PER_BLOCK} (row, head) slots)")
        return None

    @property
    def row_blocks(self) -> int:
        """The grid's rows of blocks: a block `shared` rows."""
        return -(-self.rows // self.shared)

    def block_rows(self, r: int) -> tuple[int, int]:
        """The first and last row of row r's block (r from seq0)."""
        first = self.seq0 + (r - self.seq0) // self.shared * self.shared
        return first, min(self.seq0 + self.rows, first + self.shared) - 1

    def batched(self, pos, slot):
        if self.pos != pos:
            return super().batched(pos, slot)
        return replace(self, slot=slot, len=slot, shared=1)  # a sequence attends its own slot's rows at most

    def apart(self):
        return batch_apart(self)

    def queries(self, env):
        """(row, position, first cache row) of each query row the launch takes: rows pos + r of one sequence, or a
        batch's sequences from seq0, each at its own position over its own slot."""
        if self.slot:
            pos = env.array(self.pos)
            return [(s, int(pos[s]), s * self.slot) for s in range(self.seq0, self.seq0 + self.rows)]
        p = env.param(self.pos)
        return [(r, p + r, 0) for r in range(self.rows)]

    def tune(self, knobs, held=frozenset()):
        """`attn_splits`: the most heads of one key/value head a block holds (its keys and values read once for
        them), and when the blocks do not fill the chip twice over (BLOCKS_AN_SM blocks an SM: every SM busy, a
        tile of keys and values in flight in each warp), the keys split until they do, each split at least
        `attn_split_min` of the positions the cache holds (the splits are fixed by the plan; each query divides the
        positions it attends among them). Then `shared_rows` (rows_tuned): a chunk's rows a block where that
        streams fewer bytes."""
        if "attn_splits" in held:
            return self.rows_tuned(replace(self, per_block=1, splits=1, shared=1), knobs, held, split=False)
        per_block = 1
        for c in range(1 if self.wide else min(MAX_PER_BLOCK, self.group), 0, -1):
            if self.group % c == 0 and self.heads % c == 0:
                per_block = c
                break
        kh = self.kheads  # the output's q8k blocks: whole in a block's heads (heads_a_block, their multiple)
        if per_block % kh and kh % per_block:
            per_block = 1
        return self.rows_tuned(replace(self, per_block=per_block, shared=1), knobs, held)

    def split_for(self, knobs) -> int:
        """`attn_splits`' count for this launch's blocks: the keys split until the blocks fill the chip twice over,
        each split at least `attn_split_min` positions."""
        blocks = (self.heads // self.heads_a_block) * self.row_blocks
        target = BLOCKS_AN_SM * knobs.sms
        if blocks >= target:
            return 1
        n = span(self.len, self.window)
        return max(1, min(-(-target // blocks), n // knobs.attn_split_min, MAX_SPLITS))

    def pass_bytes(self) -> int:
        """The bytes the blocks stream (the cost `shared_rows` weighs, at the most positions the cache holds): each
        block its key/value head's keys and values over its rows' span, once for all its slots; and over several
        splits the partials, written and read back by the merge."""
        n = span(self.len, self.window) + self.shared - 1
        kv = self.row_blocks * (self.heads // self.heads_a_block) * n * (self.own + self.tail + self.vd) * 4
        return kv + (8 * self.rows * self.heads * self.splits * (self.vd + 2) if self.splits > 1 else 0)

    def rows_tuned(self, a: Attention, knobs, held, split: bool = True) -> Attention:
        """`shared_rows`: of the rows a block the shared-row kernel holds (1, 2, 4 ...: its slots over the block's
        heads), the count whose blocks stream the fewest bytes (`pass_bytes`, the splits retuned for each), the
        fewer rows on a tie; 1 where held, for one row, a batch, or a launch the kernel refuses."""
        best = replace(a, splits=a.split_for(knobs) if split else 1)
        if "shared_rows" in held or a.rows < 2 or a.slot:
            return best
        s = 2
        while s <= min(a.rows, MAX_PER_BLOCK):
            c = replace(a, shared=s)
            if c.rows_refusal() is None:
                c = replace(c, splits=c.split_for(knobs) if split else 1)
                if c.pass_bytes() < best.pass_bytes():
                    best = c
            s *= 2
        return best

    def extents(self, top, tokens):
        n = self.seq0 + self.rows  # the rows of q and out reached
        j = top + self.rows - 1  # the last cache row a query attends
        if self.slot:
            j = (n - 1) * self.slot + top
        t = self.tail
        return reach((self.q, n * self.heads * self.own), (self.pos, n if self.slot else 1), (self.sinks, self.heads),
                     (self.kc, j * self.kpitch + self.koff + self.kv * self.own),
                     (self.qtail, n * self.heads * t), (self.ktail, (j + 1) * t),
                     (self.vc, j * self.vpitch + self.voff + self.kv * self.vd),
                     (self.stored(self.out), n * self.heads * self.vd), (self.quant, n * self.heads * self.vd),
                     (self.gate[0] if self.gate else None, n * self.heads * self.vd))

    def weights(self):
        return {self.sinks: "f32"} if self.sinks else {}

    def bytes(self):
        n = span(self.len, self.window)
        # a latent attention's values are its keys' first part (one read of the cache rows), its tail one table
        keys = self.kv * (max(self.own, self.vd) if (self.vc, self.voff) == (self.kc, self.koff) else self.own + self.vd)
        return (4 * (self.rows * self.heads * (self.hd + self.vd * self.f32) + n * (keys + self.tail))
                + self.epilogue_bytes(self.rows * self.heads * self.vd))

    def flops(self):
        return 2 * self.rows * self.heads * span(self.len, self.window) * (self.hd + self.vd)

    def numpy(self, env):
        vd, H, own, t = self.vd, self.heads, self.own, self.tail
        n = self.seq0 + self.rows
        q = env.array(self.q)[: n * H * own].reshape(n, H, own).astype(np.float64)
        if t:  # a Split query: each head's parts side by side
            qt = env.array(self.qtail)[: n * H * t].reshape(n, H, t).astype(np.float64)
            q = np.concatenate([q, qt], axis=2)
        kc, vc = env.array(self.kc), env.array(self.vc)
        kt = env.array(self.ktail) if t else None
        sinks = env.weight(self.sinks)[0] if self.sinks else None
        out = np.zeros((n, H, vd))
        kp, vp = self.kpitch, self.vpitch
        llama = ggml.plan_rope(env) if (not t and sinks is None and not self.window and not self.softcap and
                                        self.gate is None and (self.quant is not None and self.words in ggml.WORDS or
                                                               self.f32 and quantized_next(env, self.out))) else None
        for r, p, at in self.queries(env):
            if llama is not None:  # q8, llama.cpp's form next: attended as llama.cpp does (interp's too)
                j = at + np.arange(p + 1)
                g = (np.arange(H) // self.group)[:, None, None]  # each head's KV head: the heads attended at once
                out[r] = ggml.attend(q[r].astype(np.float32), kc[(j * kp + self.koff)[None, :, None] + g * own +
                                     np.arange(own)], vc[(j * vp + self.voff)[None, :, None] + g * vd + np.arange(vd)],
                                     self.scale, self.rows, llama.pairs)
                continue
            lo = max(0, p - self.window + 1) if self.window > 0 else 0
            first, last = self.block_rows(r)  # shared rows: the block's keys split, each row's own taken
            lo_b = max(0, p - (r - first) - self.window + 1) if self.window > 0 else 0
            for h in range(H):
                g = h // self.group
                ms, ss, accs = [], [], []
                for z in range(self.splits):
                    js, je = split_range(lo_b, p + last - r, self.splits, z)
                    js, je = max(js, lo), min(je, p + 1)
                    if je <= js:
                        continue
                    j = at + np.arange(js, je)
                    k = kc[(j * kp + self.koff + g * own)[:, None] + np.arange(own)].astype(np.float64)
                    if t:  # the key's second part: its row of the shared table
                        k = np.concatenate([k, kt[(j * t)[:, None] + np.arange(t)].astype(np.float64)], axis=1)
                    v = vc[(j * vp + self.voff + g * vd)[:, None] + np.arange(vd)].astype(np.float64)
                    logit = (k @ q[r, h]) * self.scale
                    if self.softcap > 0:
                        logit = self.softcap * np.tanh(logit / self.softcap)
                    m = logit.max()
                    e = np.exp(logit - m)
                    ms.append(m), ss.append(e.sum()), accs.append(e @ v)
                if sinks is not None:
                    ms.append(float(sinks[h])), ss.append(1.0), accs.append(np.zeros(vd))
                big = max(ms)
                f = np.exp(np.array(ms) - big)
                out[r, h] = (f @ np.array(accs)) / (f @ np.array(ss))
        if self.gate is not None:  # the kernel rounds A / S to f32, then multiplies by act(gate) in f32
            gate = env.array(self.gate[0])[: out.size].reshape(out.shape).astype(np.float32)
            out = out.astype(np.float32) * act(self.gate[1], gate).astype(np.float32)
        mine = out[self.seq0:].reshape(-1).astype(np.float32)
        if self.f32:
            env.array(self.out)[self.seq0 * H * vd: out.size] = mine
        self.epilogue_write(env, mine, start=self.seq0 * H * vd)  # this launch's rows, a batch's from seq0

    def fast(self, env):
        self.bind_fast(env)()

    def bind_fast(self, env):
        """In f32, all heads of a row at once (the splits change only the rounding), with the views resolved once:
        keys and values read as views of the cache tables; the logits of a row (heads · its positions) are its only
        temporaries. Each call finds the rows' positions (`queries`)."""
        vd, kv, grp, own, t = self.vd, self.kv, self.group, self.own, self.tail
        n = self.seq0 + self.rows
        q = env.array(self.q)[: n * self.heads * own].reshape(n, kv, grp, own)
        qt = env.array(self.qtail)[: n * self.heads * t].reshape(n, kv, grp, t) if t else None
        flat = env.array(self.out) if self.f32 else env.temp(self.fast_temp())
        out = flat[: n * self.heads * vd].reshape(n, kv, grp, vd)
        kc, vc = env.array(self.kc), env.array(self.vc)
        kp, vp = self.kpitch, self.vpitch
        keys = kc[: kc.size // kp * kp].reshape(-1, kp)[:, self.koff: self.koff + kv * own].reshape(-1, kv, own)
        kt = env.array(self.ktail)[: env.array(self.ktail).size // t * t].reshape(-1, t) if t else None
        vals = vc[: vc.size // vp * vp].reshape(-1, vp)[:, self.voff: self.voff + kv * vd].reshape(-1, kv, vd)
        sinks = env.weight(self.sinks)[0][: self.heads].reshape(kv, grp, 1) if self.sinks else None
        window, scale, cap = self.window, self.scale, self.softcap
        mine = flat[self.seq0 * self.heads * vd: n * self.heads * vd]  # this launch's rows (a batch's from seq0)
        gate = env.array(self.gate[0])[self.seq0 * self.heads * vd: n * self.heads * vd] if self.gate else None
        matmul, exp, inf = np.matmul, np.exp, np.inf

        def call():
            for r, p, at in self.queries(env):
                lo = at + (max(0, p - window + 1) if window > 0 else 0)
                p += at
                logit = matmul(q[r], keys[lo: p + 1].transpose(1, 2, 0))  # (kv, group, positions)
                if t:  # a Split's second parts: every group's queries against the one shared table
                    logit += matmul(qt[r], kt[lo: p + 1].T)
                logit *= scale
                if cap > 0:
                    logit /= cap
                    np.tanh(logit, out=logit)
                    logit *= cap
                top = logit.max(axis=-1, keepdims=True)
                if sinks is not None:
                    np.maximum(top, sinks, out=top)
                logit -= top
                exp(logit, out=logit)
                total = logit.sum(axis=-1, keepdims=True)
                if sinks is not None:
                    total += exp(sinks - top)
                matmul(logit, vals[lo: p + 1].transpose(1, 0, 2), out=out[r])
                out[r] /= total
                o = out[r]
                if not (o.max() < inf and o.min() > -inf):  # NaN fails both: f32 overflowed where f64 may not
                    exact_row(r, lo, p)

            if gate is not None:  # times act(gate)
                np.multiply(mine, act(self.gate[1], gate).astype(np.float32), out=mine)
            self.epilogue_write(env, mine, start=self.seq0 * self.heads * self.vd)  # as the kernel holds them

        def exact_row(r, lo, p):
            """Row r's heads (positions lo..p of the tables) again in f64, as the exact twin and the reference
            compute them: logits past f32's largest value, or a weighed sum of values past it, which the f32 path
            turns into inf - inf = NaN."""
            f64 = np.float64
            with np.errstate(over="ignore", invalid="ignore"):
                lg = np.einsum("kgo,tko->kgt", q[r].astype(f64), keys[lo: p + 1].astype(f64))
                if t:
                    lg += np.einsum("kgo,to->kgt", qt[r].astype(f64), kt[lo: p + 1].astype(f64))
                lg *= scale
                if cap > 0:
                    lg = cap * np.tanh(lg / cap)
                top = lg.max(axis=-1, keepdims=True)
                s64 = sinks.astype(f64) if sinks is not None else None
                if s64 is not None:
                    top = np.maximum(top, s64)
                e = np.exp(lg - top)
                den = e.sum(axis=-1, keepdims=True) + (np.exp(s64 - top) if s64 is not None else 0.0)
                out[r] = np.einsum("kgt,tkv->kgv", e / den, vals[lo: p + 1].astype(f64)).astype(np.float32)

        return call

    def fast_temp(self):
        return 0 if self.f32 else (self.seq0 + self.rows) * self.heads * self.vd

    def grid_block(self):
        return ((self.heads // self.heads_a_block, self.row_blocks, self.splits), (128, 1, 1))

    def cuda(self, denv):
        """One launch: a block the heads_a_block heads of one row and one split of the keys; over several splits the
        last split block of a row's heads to arrive merges their partials and writes the output (gated) and its
        quantized form (attention.cu's attention_merge: no combine launch)."""
        from lanefuse.kernels.cupy_env import NULL, f32, i64

        grid, block = self.grid_block()
        split = self.splits > 1
        part, counters = (denv.scratch(self, s) for s in self.scratch()) if split else (NULL, NULL)
        sinks = denv.opt(self.sinks)
        out = denv.array(self.out) if self.f32 else NULL
        gate = denv.array(self.gate[0]) if self.gate else NULL
        gact = i64(act_code(self.gate[1]) if self.gate else -1)
        qw, ql, qs = self.epilogue_ptrs(denv)
        qwords = i64(self.epilogue_words)
        kernel = "attention_rows_128" if self.shared > 1 else "attention_split_wide" if self.wide else \
            "attention_split_narrow" if self.heads_a_block > MAX_PER_BLOCK else \
            "attention_split_128" if max(self.hd, self.vd) <= 128 else "attention_split"
        denv.function(self.stem, kernel)(grid, block, (
            denv.array(self.q), denv.array(self.kc), denv.array(self.vc), denv.array(self.pos), sinks, out, part,
            i64(self.heads), i64(self.group), i64(self.hd), i64(self.vd), i64(self.window), i64(self.heads_a_block),
            i64(self.splits), i64(self.kpitch), i64(self.koff), i64(self.vpitch), i64(self.voff), f32(self.scale),
            f32(self.softcap), i64(self.slot), i64(self.seq0), gate, gact, qw, ql, qs, denv.opt(self.qtail),
            denv.opt(self.ktail), i64(self.tail), qwords, counters, i64(self.rows), i64(self.shared)))
