"""`delta`: the gated delta rule over a step's rows in order with its gated output norm (the lifted `gated_delta`):
a block a value head, a thread a value column of the head's (dk, dv) state, the state table rewritten in place
(delta.cu); and the output's quantized form (`quant`, the q8 numerics: `gdn_output_quant`) written in the epilogue,
a warp a block of 32 of a head's columns; over K-quant rows the q8k form (llama.cpp's q8_K), a block of 256 spanning
256 / dv heads, quantized after the rows by the last of their blocks to arrive (an arrival counter a row's block). In a
batch step (`seqs`) each row is a sequence of its own over its own slot of the state (hv·dk rows a sequence: the
reference interpreter's `gated_delta` over a batch's state), a block row (grid y) a sequence (delta.cu's delta_seqs
entries)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import MAX_GRID_Y, Q8K, QBLOCK_K, Launch, Scratch, names, reach
from lanefuse.kernels.conv import read_rows, seqs_apart
from lanefuse.kernels.quant import QuantEpilogue

MAX_DK = 128  # a key head's values a thread holds in registers (delta.cu: an entry a width of 32, 64, 96, 128)
MAX_DV = 256  # a value head's columns, a thread each (delta.cu's launch bounds: registers enough for MAX_DK)


@dataclass(frozen=True)
class Delta(QuantEpilogue, Launch):
    q: str
    k: str
    v: str
    z: str
    beta: str
    g: str
    state: str
    gn: str
    out: str
    hk: int
    hv: int
    dk: int
    dv: int
    rows: int
    scale: float
    eps: float
    zpitch: int = 0  # z's row width (0: hv·dv, z the gates alone)
    zoff: int = 0  # where the gates start in each row of z
    quant: str | None = None  # the output's quantized form, written in the epilogue (the q8 numerics)
    words: int = 0  # its int8 words a value (q8 1, q8x2 2, the q8k form 3: a block of 256 over the heads it spans,
    # quantized by the last of their blocks to store its row, an arrival counter a row's block)
    seqs: bool = False  # a batch's: each row a sequence of its own, over its slot of the state (hv·dk rows a sequence)
    seq0: int = 0  # a batch launch's first sequence (the `sequences` step held: one launch a sequence)

    census: ClassVar[str] = "delta"
    stem: ClassVar[tuple[str, ...]] = ("quant", "delta")
    steps: ClassVar[tuple[str, ...]] = ("sequences",)  # a batch apart, one launch a sequence (`apart`)

    @property
    def first(self) -> int:
        """The first row this launch runs: a batch launch's first sequence's, else the step's first."""
        return self.seq0 if self.seqs else 0

    @property
    def zp(self) -> int:
        return self.zpitch or self.hv * self.dv

    def reads(self):
        return names(self.q, self.k, self.v, self.z, self.beta, self.g, self.state, self.gn)

    def writes(self):
        return names(self.out, self.state, self.quant)

    def check(self):
        if self.quant is not None:
            why = self.epilogue_refusal(self.hv * self.dv, "a delta-rule output row")
            if why:
                return why
            if self.words == Q8K and QBLOCK_K % self.dv:
                return Refusal(f"a delta-rule output quantized as q8k (blocks of {QBLOCK_K}) over value heads of "
                               f"{self.dv} (a block spans whole heads)")
        if self.zoff < 0 or self.zoff + self.hv * self.dv > self.zp:
            return Refusal(f"gates z from value {self.zoff} of rows of {self.zp}")
        if self.hk < 1 or self.hv % self.hk:
            return Refusal(f"{self.hv} value heads that do not group over {self.hk} key heads")
        if self.dk % 32 or self.dk > MAX_DK:
            return Refusal(f"a delta-rule key head of {self.dk} (a multiple of 32, at most {MAX_DK})")
        if self.dv % 32 or self.dv > MAX_DV:
            return Refusal(f"a delta-rule value head of {self.dv} (a multiple of 32, at most {MAX_DV})")
        if self.seqs and self.rows > MAX_GRID_Y:
            return Refusal(f"a delta rule over a batch of {self.rows} sequences (at most {MAX_GRID_Y}, a block row "
                           f"each)")
        return None

    def extents(self, top, tokens):
        r, kd, vd = self.first + self.rows, self.hk * self.dk, self.hv * self.dv  # rows reached (a batch's from 0)
        slots = r if self.seqs else 1
        return reach((self.q, r * kd), (self.k, r * kd), (self.v, r * vd), (self.z, (r - 1) * self.zp + self.zoff + vd),
                     (self.beta, r * self.hv),
                     (self.g, r * self.hv), (self.state, slots * self.hv * self.dk * self.dv), (self.gn, self.dv),
                     (self.out, r * vd), (self.quant, r * vd))

    def weights(self):
        return {self.gn: "f32"}

    def bytes(self):
        r, kd, vd = self.rows, self.hk * self.dk, self.hv * self.dv
        return (4 * (2 * r * kd + 3 * r * vd + 2 * r * self.hv + 2 * self.hv * self.dk * self.dv + self.dv)
                + self.epilogue_bytes(r * vd))

    def flops(self):
        return 6 * self.rows * self.hv * self.dk * self.dv

    def numpy(self, env):
        r, hk, hv, dk, dv, r0 = self.rows, self.hk, self.hv, self.dk, self.dv, self.first
        f64 = np.float64
        q = env.array(self.q)[r0 * hk * dk:(r0 + r) * hk * dk].reshape(r, hk, dk).astype(f64) * np.float32(self.scale)
        k = env.array(self.k)[r0 * hk * dk:(r0 + r) * hk * dk].reshape(r, hk, dk).astype(f64)
        v = env.array(self.v)[r0 * hv * dv:(r0 + r) * hv * dv].reshape(r, hv, dv).astype(f64)
        z = read_rows(env.array(self.z)[r0 * self.zp:], r, self.zp, self.zoff, hv * dv).reshape(r, hv, dv).astype(f64)
        b = env.array(self.beta)[r0 * hv:(r0 + r) * hv].reshape(r, hv).astype(f64)
        g = env.array(self.g)[r0 * hv:(r0 + r) * hv].reshape(r, hv).astype(f64)
        kk = np.repeat(k, hv // hk, axis=1)  # (R, hv, dk): value head h reads key head h // (hv / hk)
        qq = np.repeat(q, hv // hk, axis=1)
        o = np.zeros((r, hv, dv))
        n = hv * dk * dv
        # (the state's start, the rows run over it in order): the step's rows over its one state, or a batch's row i
        # over its sequence's own slot
        runs = [((r0 + i) * n, [i]) for i in range(r)] if self.seqs else [(0, range(r))]
        for at, mine in runs:
            st = env.array(self.state)[at: at + n]
            S = st.reshape(hv, dk, dv).astype(f64)
            for i in mine:
                S *= np.exp(g[i])[:, None, None]
                kv = np.einsum("hkd,hk->hd", S, kk[i])
                S += kk[i][:, :, None] * ((v[i] - kv) * b[i][:, None])[:, None, :]
                o[i] = np.einsum("hkd,hk->hd", S, qq[i])
            st[:] = S.reshape(-1).astype(np.float32)
        gn = np.asarray(env.weight(self.gn)[0]).reshape(-1)[:dv].astype(f64)
        y = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + self.eps) * gn * (z / (1.0 + np.exp(-z)))
        out = env.array(self.out)[r0 * hv * dv:(r0 + r) * hv * dv]
        out[:] = y.reshape(-1).astype(np.float32)
        # the quantized form from the f32 values stored, as the kernel quantizes them
        self.epilogue_write(env, out.reshape(r, hv * dv), start=r0 * hv * dv)

    def batched(self, pos: str, slot: int):
        """A batch step's: each row a sequence of its own, over its own slot of the state."""
        return replace(self, seqs=True)

    def apart(self):
        return seqs_apart(self)

    def scratch(self):
        if self.quant is None or self.words != Q8K:
            return ()
        n = self.first + self.rows  # a batch launch's rows index the batch's counters
        return (Scratch("arrivals", "i32", 4 * n * (self.hv * self.dv // QBLOCK_K), counter=True),)

    def grid_block(self):
        return ((self.hv, self.rows if self.seqs else 1, 1), (self.dv, 1, 1))

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import NULL, f32, i64

        g, b = self.grid_block()
        sc = self.scratch()
        entry = f"delta_seqs_{self.dk}" if self.seqs else f"delta_{self.dk}"  # a batch's: its own entry
        denv.function(self.stem, entry)(g, b, (
            denv.array(self.q), denv.array(self.k), denv.array(self.v), denv.array(self.z), i64(self.zp),
            i64(self.zoff), denv.array(self.beta),
            denv.array(self.g), denv.array(self.state), denv.opt(self.gn), denv.array(self.out), i64(self.hk),
            i64(self.hv), i64(self.dv), i64(self.rows), f32(self.scale), f32(self.eps),
            *self.epilogue_ptrs(denv), denv.scratch(self, sc[0]) if sc else NULL, i64(self.epilogue_words),
            i64(self.seq0)))
