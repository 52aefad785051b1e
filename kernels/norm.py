"""`norm`: RMSNorm over each row (or each of `heads` parts of it), with the residual add (`add`, writing the sum to
`sum`), a sandwich pre-norm of the added operand (`pre`), x read as a part of every unit (`part`), and the result
landing in a Dst (`into`), and its quantized form (`quant`, the q8 numerics) written in the epilogue — beside the
result, or instead of it (`f32` false: only projections read it, through the quantized form). A block a row
(norm.cu)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from lanefuse.engine.formats import ggml
from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import (Q8K, Dst, Launch, Part, RmsScale, at_call, dst_at, read_part, read_part_at,
                                     names, reach, rms)
from lanefuse.kernels.quant import QuantEpilogue


def quantized_next(env, buf: str) -> bool:
    """Whether the plan `env` runs (an ArenaEnv's `s`) quantizes buffer `buf` to llama.cpp's q8_0 / q8_K form by a
    Quant launch (`fuse_quant` held) or by a launch that reads it f32 and quantizes it itself (a mixture's shared
    expert, `Moe.qwords`): then its norm computes as llama.cpp's too, as the fused norm that writes the form itself
    and the reference interpreter (interp.ggml_ops) do."""
    s = getattr(env, "s", None)
    if s is None:
        return False
    return any(getattr(x.launch, "x", None) == buf and (
        getattr(x.launch, "census", "") == "quant" and getattr(x.launch, "words", 0) in ggml.WORDS
        or getattr(x.launch, "qwords", 0) in ggml.WORDS)  # a mixture's shared expert quantizing its input itself
        for x in s.launches)


@dataclass(frozen=True)
class PreNorm:
    """The norm the launch takes of its added operand before adding it: that operand's own norm weight and eps."""

    w: str
    eps: float


@dataclass(frozen=True)
class Norm(QuantEpilogue, Launch):
    """out (rows, cols) = rmsnorm(x (+ add)) · w, per head when heads > 1 (w then (cols/heads,))."""

    x: str
    w: str | None
    out: str
    rows: int
    cols: int
    eps: float
    heads: int = 1
    part: Part | None = None
    add: str | None = None
    sum: str | None = None
    pre: PreNorm | None = None
    into: Dst | None = None
    quant: str | None = None  # the result's quantized form, written in the epilogue (the q8 numerics)
    words: int = 0  # its int8 words a value (q8 1, q8x2 2, q8k 3: llama.cpp's q8_K, blocks of 256, f32 stored too)
    f32: bool = True  # false: the quantized form alone is written (the f32 result is read by nothing else)

    census: ClassVar[str] = "norm"
    stem: ClassVar[tuple[str, ...]] = ("quant", "norm")

    def dst(self) -> Dst:
        return self.into if self.into is not None else Dst(self.out)

    def reads(self):
        return names(self.x, self.add, self.w, self.pre.w if self.pre else None,
                     *(self.dst().params() if self.f32 else ()))

    def writes(self):
        return names(self.stored(self.dst().buf), self.sum, self.quant)

    def check(self):
        if not self.f32 and (self.quant is None or self.heads != 1 or self.into is not None):
            return Refusal("a norm writing its quantized form alone needs one: its rows whole (one head) in its own "
                           "buffer")
        if self.quant is not None:
            why = self.epilogue_refusal(self.cols, "a normed row")
            if why:
                return why
            if self.words == Q8K and (not self.f32 or self.into is not None):
                return Refusal("a normed row quantized as llama.cpp's q8_K (blocks of 256) but not stored whole in "
                               "its own buffer (the epilogue reads each block back from the stored row)")
        if self.heads < 1 or self.cols % self.heads:
            return Refusal(f"{self.heads} heads that do not divide a row of {self.cols}")
        if self.pre is not None and self.add is None:
            return Refusal("a pre-norm with no added operand")
        if self.part is not None and self.part.width != self.cols:
            return Refusal(f"x read as parts {self.part.width} wide for rows of {self.cols}")
        return None

    def extents(self, top, tokens):
        n, d = self.rows * self.cols, self.dst()
        x = self.part.extent(self.rows) if self.part is not None else n
        return reach((self.x, x), (self.add, n), (self.sum, n), (self.w, self.cols // max(self.heads, 1)),
                     (self.pre.w if self.pre else None, self.cols), (self.stored(d.buf), d.extent(n, top)),
                     (self.quant, n))

    def weights(self):
        return {w: "f32" for w in (self.w, self.pre.w if self.pre else None) if w is not None}

    def bytes(self):
        n = self.rows * self.cols
        return (4 * (n * (1 + self.f32 + (self.add is not None) + (self.sum is not None)) + self.cols)
                + self.epilogue_bytes(n))

    def flops(self):
        return 4 * self.rows * self.cols

    def numpy(self, env):
        r, c = self.rows, self.cols
        s = read_part(env, self.x, self.part, r, c).astype(np.float32)
        if self.add is not None:
            a = env.array(self.add)[: r * c].reshape(r, c).astype(np.float32)
            if self.pre is not None:
                a = (a * rms(a, self.pre.eps) * env.weight(self.pre.w)[0][:c]).astype(np.float32)
            s = (s + a).astype(np.float32)
        if self.sum is not None:
            env.array(self.sum)[: r * c] = s.reshape(-1)
        hd = c // self.heads
        sh = s.reshape(r, self.heads, hd)
        if self.w is not None and (self.quant is not None and self.words in ggml.WORDS or
                                   self.f32 and quantized_next(env, self.dst().buf)):
            # llama.cpp's q8_0 / q8_K form of it (the q8 numerics): normed as llama.cpp norms (formats/ggml.py)
            y = ggml.rmsnorm(sh, np.asarray(env.weight(self.w)[0], dtype=np.float32)[:hd], self.eps)
        else:
            y = sh * rms(sh, self.eps)
            if self.w is not None:
                y = y * np.asarray(env.weight(self.w)[0], dtype=np.float64)[:hd]
        if self.f32:
            self.dst().write(env, y)
        if self.quant is not None:  # from the f32 values stored, as the kernel reads them back
            self.epilogue_write(env, np.asarray(y, dtype=np.float32).reshape(r, c))

    def fast(self, env):
        self.bind_fast(env)()

    def bind_fast(self, env):
        """In f32, written in place, with the views resolved once: the added operand normed first under a pre-norm
        (into a temporary), the sum into `sum` (or a temporary), each head's mean square, the scaled values into the
        destination's view (or a temporary where it is parts of units, or the quantized form alone is stored), then
        the quantized form."""
        r, c, hd, heads = self.rows, self.cols, self.cols // self.heads, self.heads
        d = self.dst()
        view = dst_at(d, env, r, c) if self.f32 else None
        x = read_part_at(env, self.x, self.part, r, c)
        t = env.temp(self.fast_temp())
        add = env.array(self.add)[: r * c].reshape(r, c) if self.add is not None else None
        pre = self.pre if add is not None else None
        pa = t[2 * r * c: 3 * r * c].reshape(r, c) if pre is not None else None
        pw = env.weight(pre.w)[0] if pre is not None else None
        into = (env.array(self.sum)[: r * c].reshape(r, c) if self.sum is not None else
                t[: r * c].reshape(r, c) if add is not None else None)
        yt = t[r * c: 2 * r * c].reshape(r, c)  # the result where it has no view of its own
        norm = RmsScale(r, heads, hd, env.weight(self.w)[0] if self.w is not None else None, self.eps)
        pnorm = RmsScale(r, 1, c, pw, pre.eps) if pre is not None else None
        f32, quant, quantize = self.f32, self.quant, self.epilogue_write

        def call():
            s = at_call(x)
            a = add
            if pnorm is not None:
                pnorm(a.reshape(r, 1, c), pa.reshape(r, 1, c))
                a = pa
            if into is not None:
                if a is not None:
                    np.add(s, a, out=into)
                else:
                    np.copyto(into, s)
                s = into
            y = view() if view is not None else yt
            norm(s.reshape(r, heads, hd), y.reshape(r, heads, hd))
            if view is None and f32:
                d.write(env, y)
            if quant is not None:
                quantize(env, y)

        return call

    def fast_temp(self):
        return (3 if self.pre is not None else 2) * self.rows * self.cols

    def grid_block(self):
        return ((self.rows, 1, 1), (threads(self.cols // self.heads), 1, 1))

    def args(self, denv) -> tuple:
        """The kernel's NORM_PARAMS (norm.cu), shared with the fold that runs this norm in its last block."""
        from lanefuse.kernels.cupy_env import NULL, f32, i64

        p = self.part
        return (denv.array(self.x), i64(p.pitch if p else self.cols), i64(p.offset if p else 0),
                denv.opt(self.add), denv.opt(self.pre.w if self.pre else None),
                f32(self.pre.eps if self.pre else 0.0), i64(self.pre is not None), denv.opt(self.sum),
                denv.opt(self.w), f32(self.eps), i64(self.cols), i64(self.heads),
                *(denv.dst(self.dst()) if self.f32 else (NULL, NULL) + (i64(0),) * 5),
                *self.epilogue_args(denv))

    def cuda(self, denv):
        grid, block = self.grid_block()
        denv.function(self.stem, "norm_rows")(grid, block, self.args(denv))


def threads(width: int) -> int:
    """Threads a block for a row of `width` values: the power of two at or past it, 64 to 1024."""
    t = 64
    while t < width and t < 1024:
        t *= 2
    return t
