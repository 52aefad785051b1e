"""`gemv_glu`: the gate and up products of one activation and their GLU in one launch (gemv_gate_up_glu):
out (m, n) = act(x·wgᵀ + bg) · (x·wuᵀ + bu), both weights checkpoint rows (n, k) of one format (a block format decoded
in the kernel). Over a quantized activation (`words`, the q8 numerics) both products are gemv_q8.cu's int8 block sums
of the same words, a warp an output. With `quant` (gemv_gate_up_glu.quant) the GLU's quantized form is written too:
over a quantized activation (gemv_glu_q8_quant) a block computes 32 consecutive outputs, holds their GLU in shared
memory and quantizes it from there, so where only the down projection reads the GLU (`f32` false) no f32 array of it
exists at all; over an f32 activation the last block to arrive at each block of 32 outputs (256 for the q8k form,
llama.cpp's q8_K, a down projection over K-quant rows) quantizes it (an arrival counter a block of outputs and a slab
of rows), the f32 values kept in the launch's scratch where `f32` is false."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from lanefuse.engine.formats import ggml
from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import (ACTS, FORMAT_CODE, GEMV_ROWS, Q8K, Launch, Scratch, act, decode, format_refusal,
                                     names, operand, qblock, reach, weight_bytes)
from lanefuse.kernels.elementwise import act_code
from lanefuse.kernels.gemv import (activation_at, activation_bytes, bound_product, gemv_check, gemv_grid, loop_rate,
                                   products, q8_check, q8_code, rows_a_warp, rows_at, slab_loop_us)
from lanefuse.kernels.q8dot import q8_exact
from lanefuse.kernels.quant import QuantEpilogue


def act_in_place(name: str, x: np.ndarray, t: np.ndarray) -> None:
    """x = act(x) in f32, `t` (as large as x) a temporary; exp overflowing to inf gives the activation's limit."""
    with np.errstate(over="ignore"):
        if name == "gelu":
            np.multiply(x, x, out=t)
            np.multiply(t, x, out=t)
            t *= 0.044715
            t += x
            t *= 0.7978845608028654
            np.tanh(t, out=t)
            t += 1.0
            t *= 0.5
            np.multiply(x, t, out=x)
            return
        if name == "gelu_erf":
            from lanefuse.engine.interp import erf

            np.multiply(x, 0.5 * (1.0 + erf(x * 0.7071067811865476)), out=x)
            return
        np.negative(x, out=t)
        np.exp(t, out=t)
        t += 1.0
        if name == "silu":
            np.divide(x, t, out=x)
        elif name == "sigmoid":
            np.reciprocal(t, out=x)
        else:
            raise ValueError(f"unknown activation `{name}` (expected one of {', '.join(ACTS)})")


@dataclass(frozen=True)
class GateUp(Launch):
    """The fields a gate and up product and its GLU leads with (GemvGlu; GemmTcGlu, kernels/gemm_tc.py, on the tensor
    cores): out (m, n) = act(x·wgᵀ) · (x·wuᵀ), wg and wu checkpoint rows (n, k) in `format`."""

    x: str
    wg: str
    wu: str
    format: str
    out: str
    k: int
    n: int
    m: int
    act: str = "silu"


@dataclass(frozen=True)
class GemvGlu(QuantEpilogue, GateUp):
    bg: str | None = None
    bu: str | None = None
    per_warp: int = 1
    format_u: str | None = None  # the up weights' format where the lane says it: the kernel reads both in `format`
    words: int = 0  # > 0: x is a quantized activation of that many int8 words a value (gemv_glu_q8: __dp4a)
    quant: str | None = None  # the GLU's quantized form, written in the epilogue (the q8 numerics)
    quant_words: int = 0  # its int8 words a value (q8 1, q8x2 2, q8k 3: llama.cpp's q8_K, blocks of 256)
    f32: bool = True  # false: the quantized form alone is written (over a f32 activation the f32 GLU is kept in
    # scratch for the last blocks; over a quantized one gemv_glu_q8_quant holds it in shared memory)

    census: ClassVar[str] = "gemv_glu"
    stem: ClassVar[tuple[str, ...]] = ("quant", "gemv_core", "gemv_q8", "gemv_glu")
    words_field: ClassVar[str] = "quant_words"  # the GLU's form (`words`: the activation's)
    steps: ClassVar[tuple[str, ...]] = ("rows_a_warp",)

    def reads(self):
        return names(self.x, self.wg, self.wu, self.bg, self.bu)

    def writes(self):
        return names(self.stored(self.out), self.quant)

    def scratch(self):
        if self.quant is None or self.words:  # gemv_glu_q8_quant: a block's 32 outputs in shared memory
            return ()
        counts = Scratch("arrivals", "i32", 4 * (self.n // qblock(self.quant_words)) * -(-self.m // GEMV_ROWS),
                         counter=True)
        return (counts,) if self.f32 else (counts, Scratch("glu", "f32", 4 * self.m * self.n))

    def check(self):
        why = (self.written_refusal("a gate and up GEMV", "GLU")
               or self.epilogue_refusal(self.n, "a gate and up GEMV's GLU row")
               or format_refusal(self.format, self.k, "the gate and up GEMV"))
        if why:
            return why
        if self.act not in ACTS:
            return Refusal(f"a gate activation `{self.act}`")
        why = q8_check(self.words, self.format, self.k, 1)
        if why:
            return why
        if self.words and self.per_warp != 1:
            return Refusal(f"a gate and up GEMV of a quantized activation {self.per_warp} outputs a warp (gemv_glu_q8 "
                           f"takes one)")
        if self.format_u is not None and self.format_u != self.format:
            return Refusal(f"gate and up weights in different formats ({self.format}, {self.format_u}): the kernel "
                           f"reads both in one")
        return gemv_check(self.k, self.n, self.m, self.per_warp, 1)

    def tune(self, knobs, held=frozenset()):
        if self.words:
            return replace(self, per_warp=1)  # gemv_q8's tile: a warp an output
        # the gate's and the up's outputs
        return replace(self, per_warp=rows_a_warp(2 * self.n, knobs, held, self.format, self.m, self.k))

    def extents(self, top, tokens):
        nk, n = self.n * self.k, self.n
        return reach((self.x, self.m * self.k), (self.wg, nk), (self.wu, nk), (self.bg, n), (self.bu, n),
                     (self.stored(self.out), self.m * n), (self.quant, self.m * n))

    def weights(self):
        return {self.wg: self.format, self.wu: self.format_u or self.format, **{b: None for b in (self.bg, self.bu) if b}}

    def checkpoint_bytes(self):
        return 2 * weight_bytes(self.format, self.n, self.k)

    def bytes(self):
        return (self.checkpoint_bytes() + activation_bytes(self.m * self.k, self.words) + 4 * self.m * self.n * self.f32
                + self.epilogue_bytes(self.m * self.n))

    def flops(self):
        return 4 * self.m * self.n * self.k

    def loop_us(self, knobs) -> float:
        """The loop's µs at a slab, two products a warp (gemv.slab_loop_us; over a quantized activation: 0)."""
        return 0.0 if self.words else slab_loop_us(self.format, self.k, self.n, self.m, self.per_warp, 1, 2, knobs)

    def rate(self, knobs) -> float:
        return loop_rate(self.flops(), self.loop_us(knobs), knobs)

    def numpy(self, env):
        x = None if self.words else env.array(self.x)[: self.m * self.k].reshape(self.m, self.k)

        def product(w: str, b: str | None) -> np.ndarray:
            raw, fmt = env.weight(w)
            if self.words:
                y = q8_exact(*env.quant(self.x), raw, fmt, self.m, self.n, self.k)
            else:
                y = products(x, decode(raw, fmt).reshape(self.n, self.k), 1)
            return y if b is None else (y + operand(env, b)[: self.n]).astype(np.float32)

        if self.words in ggml.WORDS and self.act == "silu":  # over llama.cpp's q8 forms: its SiLU (formats/ggml.py)
            y = ggml.swiglu(product(self.wg, self.bg), product(self.wu, self.bu)).reshape(-1)
        else:
            g = act(self.act, product(self.wg, self.bg)).astype(np.float32)
            y = (g * product(self.wu, self.bu)).reshape(-1)
        if self.f32:
            env.array(self.out)[: self.m * self.n] = y
        self.epilogue_write(env, y)  # from the f32 values, as the kernel's last blocks read them back

    def fast(self, env):
        self.bind_fast(env)()

    def bind_fast(self, env):
        """In f32: one BLAS product over the gate's and the up's weights stacked (decoded once) into a temporary
        (m, 2n), the gate's activation in place (`out` its scratch), then their product into `out`; views resolved
        once."""
        m, n, k = self.m, self.n, self.k
        t = env.temp(self.fast_temp())
        acc = t[: 2 * m * n].reshape(m, 2 * n)
        out = (env.array(self.out) if self.f32 else t[2 * m * n:])[: m * n].reshape(m, n)
        product = bound_product(activation_at(env, self.x, m, k, self.words),
                                rows_at(env, (self.wg, self.wu), 2 * n, k), acc)
        g, u, act = acc[:, :n], acc[:, n:], self.act
        bg = operand(env, self.bg)[:n] if self.bg is not None else None
        bu = operand(env, self.bu)[:n] if self.bu is not None else None

        def call():
            product()
            if bg is not None:
                np.add(g, bg, out=g)
            if bu is not None:
                np.add(u, bu, out=u)
            act_in_place(act, g, out)
            np.multiply(g, u, out=out)
            self.epilogue_write(env, out)

        return call

    def fast_temp(self):
        return (2 + (not self.f32)) * self.m * self.n

    def grid_block(self):
        if self.words and self.quant is not None:  # gemv_glu_q8(k)_quant: a block of 8 warps a block of 32 (256)
            return ((self.n // qblock(self.quant_words), -(-self.m // GEMV_ROWS), 1), (32 * 8, 1, 1))
        return gemv_grid(self.n, self.m, self.per_warp, 1)

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import NULL, i64

        g, b = self.grid_block()
        if self.words and self.quant is not None:
            name = "gemv_glu_q8k_quant" if self.quant_words == Q8K else "gemv_glu_q8_quant"
            denv.function(self.stem, name)(g, b, (
                *denv.quant(self.x), denv.weight(self.wg)[0], denv.weight(self.wu)[0],
                i64(q8_code(self.format, self.words)), denv.opt(self.bg), denv.opt(self.bu),
                denv.array(self.out) if self.f32 else NULL, i64(self.k), i64(self.n), i64(self.m),
                i64(act_code(self.act)), *self.epilogue_ptrs(denv)))
            return
        tail = (denv.scratch(self, self.scratch()[0]) if self.quant is not None else NULL, *self.epilogue_args(denv))
        out = denv.array(self.out) if self.f32 else denv.scratch(self, self.scratch()[1])
        if self.words:
            denv.function(self.stem, "gemv_glu_q8")(g, b, (
                *denv.quant(self.x), denv.weight(self.wg)[0], denv.weight(self.wu)[0],
                i64(q8_code(self.format, self.words)),
                denv.opt(self.bg), denv.opt(self.bu), out, i64(self.k), i64(self.n), i64(self.m),
                i64(act_code(self.act))))
            return
        denv.function(self.stem, f"gemv_glu_{self.per_warp}")(g, b, (
            denv.array(self.x), denv.weight(self.wg)[0], denv.weight(self.wu)[0], i64(FORMAT_CODE[self.format]),
            denv.opt(self.bg),
            denv.opt(self.bu), out, i64(self.k), i64(self.n), i64(self.m),
            i64(act_code(self.act)), *tail))
