"""`gemm_parts`: several products of one activation in one launch (merged_qkv, gemv_parts): each part its weight
(checkpoint rows (n, k), one format for all, a block format decoded in the kernel), bias, n and destination. Folded
with a rotation in parts (fold.py), the same blocks also run each rotated head's norm and rotation. Over a quantized
activation (`words`, the q8 numerics) each part is gemv_q8.cu's product: a warp an output, int8 block sums."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import (FORMAT_CODE, GEMV_ROWS, Dst, Launch, decode, dst_at, format_refusal,
                                     names, operand, reach, weight_bytes)
from lanefuse.kernels.gemv import (WARPS, activation_at, activation_bytes, bound_product, gemv_bind, gemv_check,
                                   gemv_numpy, loop_rate, q8_check, q8_code, rows_a_warp, rows_at, slab_loop_us)
from lanefuse.kernels.q8dot import q8_exact


@dataclass(frozen=True)
class GemmPart:
    w: str
    y: Dst
    n: int
    bias: str | None = None


class InParts:
    """What the products of one activation in parts share (GemmParts; GemmTcParts on the tensor cores), each
    declaring x, format, k, m and `parts` among its fields and its parts' blocks of outputs (`blocks`): what they read,
    write and reach, their weights, rows' bytes and flops, and the descriptor table the kernels take (each part's
    weight, bias, n, first block and Dst)."""

    def outputs(self) -> int:
        """Every part's outputs (a row)."""
        return sum(p.n for p in self.parts)

    def reads(self):
        return names(self.x, *(v for p in self.parts for v in (p.w, p.bias, *p.y.params())))

    def writes(self):
        return names(*(p.y.buf for p in self.parts))

    def extents(self, top, tokens):
        return reach((self.x, self.m * self.k), *(v for p in self.parts for v in (
            (p.w, p.n * self.k), (p.bias, p.n), (p.y.buf, p.y.extent(self.m * p.n, top)))))

    def weights(self):
        out: dict[str, str | None] = {p.bias: None for p in self.parts if p.bias}
        return {**out, **{p.w: self.format for p in self.parts}}

    def checkpoint_bytes(self):
        return weight_bytes(self.format, self.outputs(), self.k)

    def flops(self):
        return 2 * self.m * self.k * self.outputs()

    def table(self, denv) -> list[int]:
        words, first = [], 0
        for p, nb in zip(self.parts, self.blocks()):
            words += [denv.ptr(p.w), denv.ptr(p.bias), p.n, first, *denv.dst_words(p.y)]
            first += nb
        return words


@dataclass(frozen=True)
class GemmParts(InParts, Launch):
    x: str
    format: str
    k: int
    m: int
    parts: tuple[GemmPart, ...]
    per_warp: int = 1
    words: int = 0  # > 0: x is a quantized activation of that many int8 words a value (q8 1, q8x2 2)

    census: ClassVar[str] = "gemm_parts"
    stem: ClassVar[tuple[str, ...]] = ("gemv_core", "gemv_q8", "gemm_parts")
    steps: ClassVar[tuple[str, ...]] = ("rows_a_warp",)

    def blocks(self) -> list[int]:
        """Each part's output blocks (WARPS·per_warp outputs a block)."""
        return [-(-p.n // (WARPS * self.per_warp)) for p in self.parts]

    def check(self):
        if not self.parts:
            return Refusal("a product in no parts")
        why = format_refusal(self.format, self.k, "a product in parts") or q8_check(self.words, self.format, self.k, 1)
        if why:
            return why
        if self.words and self.per_warp != 1:
            return Refusal(f"products in parts of a quantized activation {self.per_warp} outputs a warp (gemv_q8 "
                           f"takes one)")
        for p in self.parts:
            why = gemv_check(self.k, p.n, self.m, self.per_warp, 1)
            if why:
                return why
        return None

    def loop_us(self, knobs, ring: bool = True) -> float:
        """The loop's µs at a slab (gemv.slab_loop_us over the parts' output blocks; over a quantized activation:
        0); ring False: in a kernel built without the slab's ring (fold_parts_rope_1)."""
        return 0.0 if self.words else slab_loop_us(self.format, self.k, sum(self.blocks()) * WARPS * self.per_warp,
                                                    self.m, self.per_warp, 1, 1, knobs, ring)

    def rate(self, knobs) -> float:
        return loop_rate(self.flops(), self.loop_us(knobs), knobs)

    def tune(self, knobs, held=frozenset()):
        if self.words:
            return replace(self, per_warp=1)  # gemv_q8's body: a warp an output
        return replace(self, per_warp=rows_a_warp(sum(p.n for p in self.parts), knobs, held, self.format, self.m,
                                                  self.k))

    def bytes(self):
        return self.checkpoint_bytes() + activation_bytes(self.m * self.k, self.words) + 4 * self.m * self.outputs()

    def numpy(self, env):
        for p in self.parts:
            raw, fmt = env.weight(p.w)
            if self.words:
                acc = q8_exact(*env.quant(self.x), raw, fmt, self.m, p.n, self.k)
                if p.bias is not None:
                    acc = (acc + operand(env, p.bias)[: p.n][None, :]).astype(np.float32)
                p.y.write(env, acc)
                continue
            gemv_numpy(env, self.x, decode(raw, fmt), p.bias, p.y, self.k, p.n, self.m, 1)

    def fast(self, env):
        self.bind_fast(env)()

    def bind_fast(self, env):
        """One f32 BLAS product over the parts' weights stacked (decoded once) into a temporary (m, Σn), each part
        then added its bias and copied to its destination: views resolved once."""
        m, k = self.m, self.k
        if len(self.parts) == 1:
            p = self.parts[0]
            return gemv_bind(env, self.x, p.w, p.bias, p.y, k, p.n, m, words=self.words)
        total = sum(p.n for p in self.parts)
        acc = env.temp(m * total).reshape(m, total)
        product = bound_product(activation_at(env, self.x, m, k, self.words),
                                rows_at(env, tuple(p.w for p in self.parts), total, k), acc)
        outs, at = [], 0
        for p in self.parts:
            outs.append((acc[:, at: at + p.n], operand(env, p.bias)[: p.n] if p.bias is not None else None,
                         dst_at(p.y, env, m, p.n), p.y))
            at += p.n

        def call():
            product()
            for y, bias, view, d in outs:
                if bias is not None:
                    np.add(y, bias, out=y)
                if view is None:
                    d.write(env, y)
                else:
                    np.copyto(view(), y)

        return call

    def fast_temp(self):
        if len(self.parts) == 1:
            return self.m * self.parts[0].n if not self.parts[0].y.contiguous else 0
        return self.m * sum(p.n for p in self.parts)

    def grid_block(self):
        return ((sum(self.blocks()), -(-self.m // GEMV_ROWS), 1), (32 * WARPS, 1, 1))

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import i64

        g, b = self.grid_block()
        t = denv.table(self.key(), self.table(denv))
        if self.words:
            denv.function(self.stem, "gemm_parts_q8")(g, b, (
                *denv.quant(self.x), t, i64(len(self.parts)), i64(q8_code(self.format, self.words)), i64(self.k),
                i64(self.m)))
            return
        denv.function(self.stem, f"gemm_parts_{self.per_warp}")(g, b, (
            denv.array(self.x), t, i64(len(self.parts)), i64(FORMAT_CODE[self.format]), i64(self.k), i64(self.m)))
