"""`conv_parts`: several causal convolutions of one step as one launch (conv_parts: a gated delta net's q, k and v
convolutions, each with its ring and SiLU, q's and k's heads L2-normed): each part takes the blocks from its first
(conv_parts.cu, over conv.cu's body); normed parts share one head width, the block."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import Launch, names, reach
from lanefuse.kernels.conv import BLOCK, conv_refusal, convolve, read_rows

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

    census: ClassVar[str] = "conv_parts"
    stem: ClassVar[tuple[str, ...]] = ("conv", "conv_parts")

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
        for p in self.parts:
            if p.xoff < 0 or p.xoff + p.chan > p.pitch:
                return Refusal(f"a convolution of channels {p.xoff}..{p.xoff + p.chan - 1} of rows of {p.pitch}")
            why = conv_refusal(p.chan, self.taps, self.block if p.l2 else 0)
            if why:
                return why
        return None

    def extents(self, top, tokens):
        out: dict[str, int] = {}
        for p in self.parts:
            c = p.chan
            for k, v in reach((p.x, (self.rows - 1) * p.pitch + p.xoff + c), (p.w, c * self.taps),
                              (p.ring, (self.taps - 1) * c), (p.y, self.rows * c)).items():
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
            ring = env.array(p.ring)[: (t - 1) * c].reshape(t - 1, c)
            w = np.asarray(env.weight(p.w)[0]).reshape(-1)[: c * t].reshape(c, t)
            x = read_rows(env.array(p.x), r, p.pitch, p.xoff, c)
            y = convolve(x, w, ring, t, self.silu, self.block if p.l2 else 0, self.eps)
            env.array(p.y)[: r * c] = y.reshape(-1)

    def firsts(self) -> list[int]:
        out, at = [], 0
        for p in self.parts:
            out.append(at)
            at += -(-p.chan // self.threads)
        return out + [at]

    def batched(self, pos: str, slot: int):
        """A batch step's: refused (its kernel runs one sequence's carried state; the reference interpreter runs a
        batch's, a slot a sequence)."""
        return Refusal("a gated delta net's carried state over a batch's sequences (this lane's kernels run one "
                       "sequence's rings and states; decode one sequence at a time)")

    def grid_block(self):
        return ((self.firsts()[-1], 1, 1), (self.threads, 1, 1))

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import f32, i64

        words = []
        for p, first in zip(self.parts, self.firsts()):
            words += [denv.ptr(p.x), denv.ptr(p.w), denv.ptr(p.ring), denv.ptr(p.y), p.chan, first, int(p.l2), p.pitch,
                      p.xoff]
        t = denv.table(self.key(), words)
        g, b = self.grid_block()
        denv.function(self.stem, "conv_parts")(g, b, (t, i64(len(self.parts)), i64(self.taps), i64(self.rows),
                                                      i64(int(self.silu)), f32(self.eps)))
