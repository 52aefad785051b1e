"""`conv`: a causal depthwise convolution of `chan` channels (x's values xoff.. of each row of `xpitch`) over a step's
`rows` after its ring (the last taps-1 inputs, a table rewritten in place), with SiLU (`silu`, conv_bias_silu) and
each head of `l2` channels scaled to unit length (conv_silu_l2norm). A thread a channel, a block a head (conv.cu)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import Launch, names, reach

MAX_TAPS = 16  # the kernel loops over taps; a longer convolution is no model's
BLOCK = 256  # threads a block where no head width sets it


def convolve(x: np.ndarray, w: np.ndarray, ring: np.ndarray, taps: int, silu: bool, l2: int, eps: float
             ) -> np.ndarray:
    """The exact twin's values, in f64: x (rows, chan), w (chan, taps), ring (taps-1, chan), rewritten in place."""
    xx = np.concatenate([ring.astype(np.float64), x.astype(np.float64)])
    r = x.shape[0]
    y = sum(w[:, j].astype(np.float64) * xx[j:j + r] for j in range(taps))
    if silu:
        y = y / (1.0 + np.exp(-y))
    if l2:
        yh = y.reshape(r, -1, l2)
        y = (yh / np.sqrt(np.sum(yh * yh, axis=-1, keepdims=True) + eps)).reshape(r, -1)
    ring[:] = xx[r:].astype(np.float32)
    return np.asarray(y).astype(np.float32)


def read_rows(x: np.ndarray, rows: int, pitch: int, off: int, width: int) -> np.ndarray:
    """Values off..off+width of each of `rows` rows `pitch` wide of flat x, as (rows, width)."""
    return x[: rows * pitch].reshape(rows, pitch)[:, off:off + width] if rows * pitch <= x.size else \
        x[(np.arange(rows)[:, None] * pitch + off + np.arange(width)[None, :])]


def conv_refusal(chan: int, taps: int, l2: int) -> Refusal | None:
    if not 2 <= taps <= MAX_TAPS:
        return Refusal(f"a convolution of {taps} taps (2 to {MAX_TAPS})")
    if l2 and (l2 % 32 or l2 > 1024 or chan % l2):
        return Refusal(f"an L2-normed head of {l2} channels (a multiple of 32, at most 1024, dividing {chan})")
    return None


@dataclass(frozen=True)
class Conv(Launch):
    x: str
    w: str
    ring: str
    y: str
    chan: int
    taps: int
    rows: int
    silu: bool = False
    l2: int = 0  # the channels of a head scaled to unit length (0: none)
    eps: float = 1e-6
    xpitch: int = 0  # x's row width (0: chan, x the channels alone)
    xoff: int = 0  # where the channels start in each row of x

    census: ClassVar[str] = "conv"
    stem: ClassVar[tuple[str, ...]] = ("conv",)

    def reads(self):
        return names(self.x, self.w, self.ring)

    def writes(self):
        return names(self.y, self.ring)

    @property
    def pitch(self) -> int:
        return self.xpitch or self.chan

    def check(self):
        if self.xoff < 0 or self.xoff + self.chan > self.pitch:
            last = self.xoff + self.chan - 1
            return Refusal(f"a convolution of channels {self.xoff}..{last} of rows of {self.pitch}")
        return conv_refusal(self.chan, self.taps, self.l2)

    def extents(self, top, tokens):
        c = self.chan
        return reach((self.x, (self.rows - 1) * self.pitch + self.xoff + c), (self.w, c * self.taps),
                     (self.ring, (self.taps - 1) * c), (self.y, self.rows * c))

    def weights(self):
        return {self.w: "f32"}

    def bytes(self):
        c = self.chan
        return 4 * (2 * self.rows * c + c * self.taps + 2 * (self.taps - 1) * c)

    def flops(self):
        return 2 * self.rows * self.chan * self.taps

    def numpy(self, env):
        c, r, t = self.chan, self.rows, self.taps
        ring = env.array(self.ring)[: (t - 1) * c].reshape(t - 1, c)
        w = np.asarray(env.weight(self.w)[0]).reshape(-1)[: c * t].reshape(c, t)
        x = read_rows(env.array(self.x), r, self.pitch, self.xoff, c)
        env.array(self.y)[: r * c] = convolve(x, w, ring, t, self.silu, self.l2, self.eps).reshape(-1)

    def batched(self, pos: str, slot: int):
        """A batch step's: refused (its kernel runs one sequence's carried state; the reference interpreter runs a
        batch's, a slot a sequence)."""
        return Refusal("a gated delta net's carried state over a batch's sequences (this lane's kernels run one "
                       "sequence's rings and states; decode one sequence at a time)")

    def grid_block(self):
        b = self.l2 or BLOCK
        return ((-(-self.chan // b), 1, 1), (b, 1, 1))

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import f32, i64

        g, b = self.grid_block()
        denv.function(self.stem, "conv")(g, b, (
            denv.array(self.x), i64(self.pitch), i64(self.xoff), denv.opt(self.w), denv.array(self.ring),
            denv.array(self.y), i64(self.chan), i64(self.taps), i64(self.rows), i64(int(self.silu)),
            i64(int(self.l2 > 0)), f32(self.eps)))
