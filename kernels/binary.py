"""`binary`: out = a op b for op add/mul/sub, b of a's size, one row broadcast over a's rows or one value a row of
`each` values (a shared expert's gate), optionally gated:
a op act(b) (glu_act_mul: act(g)·u with a = u, b = g); and its result's quantized form written as it is stored
(`quant`, glu_act_mul_quant / elementwise_quant: the q8 numerics), a warp a block of 32 (the q8k form: a block of 256
threads a block of 256 values, staged in shared memory), beside the result or instead of it (`f32` false: only
projections read it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from lanefuse.engine.formats import ggml
from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import ACTS, Q8K, act, names, operand, reach
from lanefuse.kernels.elementwise import Elementwise, act_code
from lanefuse.kernels.norm import quantized_next
from lanefuse.kernels.quant import QuantEpilogue

OPS = ("add", "mul", "sub")


@dataclass(frozen=True)
class Binary(QuantEpilogue, Elementwise):
    op: str
    a: str
    b: str
    out: str
    n: int
    row: int = 0  # b's length when it is one row broadcast over a's rows; 0: b has a's size
    gate: str | None = None  # the activation applied to b first
    each: int = 0  # a's row width when b is one value a row of a (b (R, 1)); 0: not
    quant: str | None = None  # the result's quantized form, written as it is stored (the q8 numerics)
    words: int = 0  # its int8 words a value (q8 1, q8x2 2, q8k 3: llama.cpp's q8_K, a block of 256 threads a block)
    f32: bool = True  # false: the quantized form alone is written (the f32 result is read by nothing else)

    census: ClassVar[str] = "binary"
    stem: ClassVar[tuple[str, ...]] = ("quant", "binary")
    inputs: ClassVar[tuple[str, ...]] = ("a", "b")
    output: ClassVar[str] = "out"

    def elements(self):
        return self.n

    def writes(self):
        return names(self.stored(self.out), self.quant)

    def check(self):
        why = (self.written_refusal("an elementwise op", "result")
               or self.epilogue_refusal(self.n, "an elementwise result"))
        if why:
            return why
        if self.op not in OPS:
            return Refusal(f"an elementwise `{self.op}` (the kernel adds, multiplies, subtracts)")
        if self.gate is not None and self.gate not in ACTS:
            return Refusal(f"a gate activation `{self.gate}` (one of {', '.join(ACTS)})")
        if self.row and self.n % self.row:
            return Refusal(f"a row of {self.row} broadcast over {self.n} values")
        if self.each and (self.row or self.n % self.each):
            return Refusal(f"one value every {self.each} broadcast over {self.n} values")
        return None

    def extents(self, top, tokens):
        return reach((self.a, self.n), (self.b, self.row or (self.n // self.each if self.each else self.n)),
                     (self.stored(self.out), self.n), (self.quant, self.n))

    def weights(self):
        return {self.b: None}

    def bytes(self):
        return (4 * ((1 + self.f32) * self.n + (self.row or (self.n // self.each if self.each else self.n)))
                + self.epilogue_bytes(self.n))

    def flops(self):
        return self.n * (1 + 4 * (self.gate is not None))

    def numpy(self, env):
        a = env.array(self.a)[: self.n].astype(np.float32)
        if self.each:
            b = np.repeat(operand(env, self.b)[: self.n // self.each], self.each)
        elif self.row:
            b = np.tile(operand(env, self.b)[: self.row], self.n // self.row)
        else:
            b = operand(env, self.b)[: self.n]
        b = b.astype(np.float32)
        if self.gate == "silu" and self.op == "mul" and (self.quant is not None and self.words in ggml.WORDS or
                                                         self.f32 and quantized_next(env, self.out)):
            b = ggml.silu(b)  # a GLU quantized to llama.cpp's form next (the q8 numerics): its SiLU (formats/ggml.py)
        elif self.gate is not None:
            b = act(self.gate, b).astype(np.float32)
        y = {"add": a + b, "mul": a * b, "sub": a - b}[self.op]
        if self.f32:
            env.array(self.out)[: self.n] = y
        self.epilogue_write(env, y)

    def args(self, denv):
        from lanefuse.kernels.cupy_env import NULL, i64

        return (denv.array(self.a), denv.opt(self.b), denv.array(self.out) if self.f32 else NULL, i64(self.n),
                i64(self.row),
                i64(OPS.index(self.op)), i64(act_code(self.gate)), i64(self.each), *self.epilogue_args(denv))

    def grid_block(self):
        if self.quant is not None and self.words == Q8K:  # a block of 256 threads a q8_K block of values
            return (max(1, min(4096, self.n // 256)), 1, 1), (256, 1, 1)
        return super().grid_block()
