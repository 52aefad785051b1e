"""`conv_parts`: several causal convolutions of one step as one launch (conv_parts: a gated delta net's q, k and v
convolutions, each with its ring and SiLU, q's and k's heads L2-normed): each part takes the blocks from its first
(conv_parts.cu, over conv.cu's body); normed parts share one head width, the block. In a batch step (`seqs`) each
row is a sequence of its own over its own slot of each ring (conv.py's `seqs`), a block row a sequence."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import MAX_GRID_Y, Launch, names, reach
from lanefuse.kernels.conv import BLOCK, conv_refusal, convolve_rows, seq_rows, seqs_apart

import numpy as np


@dataclass(frozen=True)
class ConvPart:
    """One convolution of the launch: its input (channels xoff.. of each row of xpitch; 0: chan), weights, ring and
    output, its channels, whether its heads are L2-normed (each head the launch's block wide)."""

    x: str
    w: str
    ring: str
    y: str
    chan: int
    l2: bool = False
    xpitch: int = 0
    xoff: int = 0

    @property
    def pitch(self) -> int:
        return self.xpitch or self.chan


@dataclass(frozen=True)
class ConvParts(Launch):
    parts: tuple[ConvPart, ...]
    taps: int
    rows: int
    silu: bool = True
    block: int = 0  # the normed parts' head width, the threads a block (0: none normed, BLOCK)
    eps: float = 1e-6
    seqs: bool = False  # a batch's: each row a sequence of its own, over its slot of each ring (taps-1 rows a sequence)
    seq0: int = 0  # a batch launch's first sequence (the `sequences` step held: one launch a sequence)

    census: ClassVar[str] = "conv_parts"
    stem: ClassVar[tuple[str, ...]] = ("conv", "conv_parts")
    steps: ClassVar[tuple[str, ...]] = ("sequences",)  # a batch apart, one launch a sequence (`apart`)

    @property
    def threads(self) -> int:
        return self.block or BLOCK

    def reads(self):
        return names(*(n for p in self.parts for n in (p.x, p.w, p.ring)))

    def writes(self):
        return names(*(n for p in self.parts for n in (p.y, p.ring)))

    def check(self):
        if not self.parts:
            return Refusal("a launch of no convolutions")
        if any(p.l2 for p in self.parts) and not self.block:
            return Refusal("L2-normed convolutions in parts with no head width")
        if self.seqs and self.rows > MAX_GRID_Y:
            return Refusal(f"convolutions over a batch of {self.rows} sequences (at most {MAX_GRID_Y}, a block row each)")
        for p in self.parts:
            if p.xoff < 0 or p.xoff + p.chan > p.pitch:
                return Refusal(f"a convolution of channels {p.xoff}..{p.xoff + p.chan - 1} of rows of {p.pitch}")
            why = conv_refusal(p.chan, self.taps, self.block if p.l2 else 0)
            if why:
                return why
        return None

    def extents(self, top, tokens):
        out: dict[str, int] = {}
        n = self.seq0 + self.rows if self.seqs else self.rows  # the rows (a batch's: sequences) reached
        for p in self.parts:
            c = p.chan
            for k, v in reach((p.x, (n - 1) * p.pitch + p.xoff + c), (p.w, c * self.taps),
                              (p.ring, (self.taps - 1) * c * (n if self.seqs else 1)), (p.y, n * c)).items():
                out[k] = max(out.get(k, 0), v)
        return out

    def weights(self):
        return {p.w: "f32" for p in self.parts}

    def bytes(self):
        return sum(4 * (2 * self.rows * p.chan + p.chan * self.taps + 2 * (self.taps - 1) * p.chan)
                   for p in self.parts)

    def flops(self):
        return sum(2 * self.rows * p.chan * self.taps for p in self.parts)

    def numpy(self, env):
        r, t = self.rows, self.taps
        for p in self.parts:
            c = p.chan
            w = np.asarray(env.weight(p.w)[0]).reshape(-1)[: c * t].reshape(c, t)
            x = seq_rows(env, p.x, self.seqs, self.seq0, r, p.pitch, p.xoff, c)
            y = convolve_rows(x, w, env.array(p.ring), t, self.silu, self.block if p.l2 else 0, self.eps, self.seqs,
                              self.seq0)
            first = self.seq0 * c if self.seqs else 0
            env.array(p.y)[first: first + r * c] = y.reshape(-1)

    def firsts(self) -> list[int]:
        out, at = [], 0
        for p in self.parts:
            out.append(at)
            at += -(-p.chan // self.threads)
        return out + [at]

    def batched(self, pos: str, slot: int):
        """A batch step's: each row a sequence of its own, over its own slot of each ring."""
        return replace(self, seqs=True)

    def apart(self):
        return seqs_apart(self)

    def grid_block(self):
        return ((self.firsts()[-1], self.rows if self.seqs else 1, 1), (self.threads, 1, 1))

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import f32, i64

        words = []
        for p, first in zip(self.parts, self.firsts()):
            words += [denv.ptr(p.x), denv.ptr(p.w), denv.ptr(p.ring), denv.ptr(p.y), p.chan, first, int(p.l2), p.pitch,
                      p.xoff]
        t = denv.table(self.key(), words)
        g, b = self.grid_block()
        denv.function(self.stem, "conv_parts")(g, b, (t, i64(len(self.parts)), i64(self.taps), i64(self.rows),
                                                      i64(int(self.silu)), f32(self.eps), i64(int(self.seqs)),
                                                      i64(self.seq0)))
