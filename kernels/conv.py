"""`conv`: a causal depthwise convolution of `chan` channels (x's values xoff.. of each row of `xpitch`) over a step's
`rows` after its ring (the last taps-1 inputs, a table rewritten in place), with SiLU (`silu`, conv_bias_silu) and
each head of `l2` channels scaled to unit length (conv_silu_l2norm). A thread a channel, a block a head (conv.cu).
In a batch step (`seqs`) each row is a sequence of its own: row s (from `seq0`) after its own slot of the ring, rows
s·(taps-1) on (the reference interpreter's `causal_conv` over a batch's ring); a block row (grid y) a sequence."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import MAX_GRID_Y, Launch, names, reach

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


def convolve_rows(x: np.ndarray, w: np.ndarray, ring: np.ndarray, taps: int, silu: bool, l2: int, eps: float,
                  seqs: bool, seq0: int) -> np.ndarray:
    """`convolve` over a step's rows (seqs False), or over a batch's: row i sequence seq0 + i's, after its own slot of
    the ring (flat ring, rewritten in place)."""
    c, t = w.shape[0], taps - 1
    if not seqs:
        return convolve(x, w, ring[: t * c].reshape(t, c), taps, silu, l2, eps)
    out = [convolve(x[i:i + 1], w, ring[(seq0 + i) * t * c:(seq0 + i + 1) * t * c].reshape(t, c), taps, silu, l2, eps)
           for i in range(x.shape[0])]
    return np.concatenate(out) if out else np.zeros((0, c), np.float32)


def seq_rows(env, name: str, seqs: bool, seq0: int, rows: int, pitch: int, off: int, width: int) -> np.ndarray:
    """read_rows of `rows` rows from the step's first (seqs False) or a batch launch's from its first sequence."""
    first = seq0 if seqs else 0
    return read_rows(env.array(name)[first * pitch:], rows, pitch, off, width)


def seqs_apart(l):
    """A batch launch (`seqs`) as one launch a sequence (the `sequences` step held): one row each from `seq0`."""
    from dataclasses import replace

    if not l.seqs or l.rows == 1:
        return (l,)
    return tuple(replace(l, seq0=l.seq0 + s, rows=1) for s in range(l.rows))


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
    seqs: bool = False  # a batch's: each row a sequence of its own, over its slot of the ring (taps-1 rows a sequence)
    seq0: int = 0  # a batch launch's first sequence (the `sequences` step held: one launch a sequence)

    census: ClassVar[str] = "conv"
    stem: ClassVar[tuple[str, ...]] = ("conv",)
    steps: ClassVar[tuple[str, ...]] = ("sequences",)  # a batch apart, one launch a sequence (`apart`)

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
        if self.seqs and self.rows > MAX_GRID_Y:
            return Refusal(f"a convolution over a batch of {self.rows} sequences (at most {MAX_GRID_Y}, a block row each)")
        return conv_refusal(self.chan, self.taps, self.l2)

    def extents(self, top, tokens):
        c, n = self.chan, self.seq0 + self.rows if self.seqs else self.rows  # the rows (a batch's: sequences) reached
        return reach((self.x, (n - 1) * self.pitch + self.xoff + c), (self.w, c * self.taps),
                     (self.ring, (self.taps - 1) * c * (n if self.seqs else 1)), (self.y, n * c))

    def weights(self):
        return {self.w: "f32"}

    def bytes(self):
        c = self.chan
        return 4 * (2 * self.rows * c + c * self.taps + 2 * (self.taps - 1) * c)

    def flops(self):
        return 2 * self.rows * self.chan * self.taps

    def numpy(self, env):
        c, r, t = self.chan, self.rows, self.taps
        w = np.asarray(env.weight(self.w)[0]).reshape(-1)[: c * t].reshape(c, t)
        x = seq_rows(env, self.x, self.seqs, self.seq0, r, self.pitch, self.xoff, c)
        y = convolve_rows(x, w, env.array(self.ring), t, self.silu, self.l2, self.eps, self.seqs, self.seq0)
        first = self.seq0 * c if self.seqs else 0
        env.array(self.y)[first: first + r * c] = y.reshape(-1)

    def batched(self, pos: str, slot: int):
        """A batch step's: each row a sequence of its own, over its own slot of the ring (the step's rows are its
        sequences)."""
        return replace(self, seqs=True)

    def apart(self):
        return seqs_apart(self)

    def grid_block(self):
        b = self.l2 or BLOCK
        return ((-(-self.chan // b), self.rows if self.seqs else 1, 1), (b, 1, 1))

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import f32, i64

        g, b = self.grid_block()
        denv.function(self.stem, "conv")(g, b, (
            denv.array(self.x), i64(self.pitch), i64(self.xoff), denv.opt(self.w), denv.array(self.ring),
            denv.array(self.y), i64(self.chan), i64(self.taps), i64(self.rows), i64(int(self.silu)),
            i64(int(self.l2 > 0)), f32(self.eps), i64(int(self.seqs)), i64(self.seq0)))
