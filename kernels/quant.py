"""`quant`: an activation quantized to int8 blocks of QBLOCK values with one f32 scale a block (llama.cpp's q8_0
rounding, engine/formats/quantize.py), one word a value (q8) or two (q8x2: a low int8 word of the residual) — for an activation
no producer quantizes in its epilogue. A quantized array's bytes (`quant_layout`): its int8 words, then its low words
under two words (under the q8k form, llama.cpp's q8_K for K-quant rows: its int16 sums of 16 words), then a scale a
block, each part ALIGN-aligned. A launch that writes the q8k form says so to `quant_check` (`k_form`); one that does
not is refused it in words, and its quantize stays a Quant launch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from lanefuse.engine.formats.quantize import quantize
from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import (Q8K, QBLOCK, QSUM, Launch, qblock, quant_layout,  # noqa: F401  (quant_layout:
                                     reach)  # its home here)


def quant_check(n: int, words: int, what: str = "an activation", k_form: bool = False) -> Refusal | None:
    """Why `what` of n values cannot be quantized to `words` (q8 1, q8x2 2, q8k 3 where `k_form`: the Quant launch)."""
    if words == Q8K and not k_form:
        return Refusal(f"{what} quantized as llama.cpp's q8_K (blocks of 256, for K-quant rows): only the Quant "
                       f"launch writes that form")
    if words not in (1, 2, Q8K):
        return Refusal(f"{what} quantized to {words} words a value (q8 takes one, q8x2 two)")
    bl = qblock(words)
    if n < 1 or n % bl:
        return Refusal(f"{what} of {n} values quantized in blocks of {bl} (a whole number of blocks is needed)")
    return None


def quant_write(env, name: str, values: np.ndarray, words: int, start: int = 0) -> None:
    """Quantize `values` (rows, n) f32 into tensor `name`'s quantized form (env.quant), from its value `start` on (a
    whole number of blocks: a batch launch's rows from its first sequence's)."""
    q = quantize(np.asarray(values, dtype=np.float32).reshape(1, -1), words)
    w, low, scales = env.quant(name)
    b = start // qblock(words)
    w[start: start + q.words.size] = q.words.reshape(-1)
    if words == 2:
        low[start: start + q.low.size] = q.low.reshape(-1)
    if words == Q8K:  # the sums of 16 words stand where q8x2's low words do
        low[start // QSUM: start // QSUM + q.sums.size] = q.sums.reshape(-1)
    scales[b: b + q.scales.size] = q.scales.reshape(-1)


def quant_bytes(n: int, words: int) -> int:
    """The bytes a launch writes of the quantized form of n values (words, then a scale a block; the q8k form's
    sums of 16 words too); 0 for none."""
    if words == Q8K:
        return n + 2 * (n // QSUM) + 4 * (n // qblock(words))
    return words * n + 4 * (n // QBLOCK) if words else 0


class QuantEpilogue:
    """What a launch kind that quantizes its result in its epilogue (the q8 numerics) shares: its refusal, bytes,
    twin's write, the kernel's arguments and the names it writes. The kind declares the fields, where they stand in
    its field order (a launch's repr, its saved plan and the plan digests list the fields in that order): `quant`,
    the tensor whose quantized form it writes (None: none); the form's int8 words a value, in the field
    `words_field` names (`words`, or `quant_words` where `words` is the activation's); and, where the f32 result
    may go unwritten (only projections read it, through the form), `f32`."""

    words_field: ClassVar[str] = "words"
    k_form: ClassVar[bool] = True  # whether the kernel writes the q8k form (llama.cpp's q8_K, blocks of 256)

    @property
    def epilogue_words(self) -> int:
        """The quantized form's words a value; 0 where the launch writes none."""
        return getattr(self, self.words_field) if self.quant is not None else 0

    @property
    def stores_f32(self) -> bool:
        """Whether the launch writes its f32 result (a kind with no `f32` field always does)."""
        return getattr(self, "f32", True)

    def stored(self, name: str | None) -> str | None:
        """`name`, the f32 result's buffer, where the launch writes it; None where only the quantized form is."""
        return name if self.stores_f32 else None

    def written_refusal(self, who: str, result: str) -> Refusal | None:
        """Why a launch of `who` (in words) that writes neither its `result` nor its quantized form cannot run."""
        if not self.stores_f32 and self.quant is None:
            return Refusal(f"{who} that writes neither its {result} nor its quantized form")
        return None

    def epilogue_refusal(self, n: int, what: str) -> Refusal | None:
        """Why the result's rows of n values (`what`, in words) cannot be quantized as the fields ask; None when they
        can, or when no form is written."""
        if self.quant is None:
            return None
        return quant_check(n, getattr(self, self.words_field), what, k_form=self.k_form)

    def epilogue_bytes(self, n: int) -> int:
        """The bytes the epilogue writes of the quantized form of n values; 0 for none."""
        return quant_bytes(n, self.epilogue_words)

    def epilogue_write(self, env, values: np.ndarray, start: int = 0) -> None:
        """The twin's epilogue: `values` (rows, n) f32 into the quantized form from value `start` on, if one is
        written."""
        if self.quant is not None:
            quant_write(env, self.quant, values, self.epilogue_words, start=start)

    def epilogue_ptrs(self, denv) -> tuple:
        """The kernel's three pointers of the form (words, low words or the q8k form's sums, scales); null ones where
        it writes none."""
        from lanefuse.kernels.cupy_env import NULL

        return denv.quant(self.quant) if self.quant is not None else (NULL, NULL, NULL)

    def epilogue_args(self, denv) -> tuple:
        """The kernel's arguments of the epilogue: its three pointers and the form's words (0: none)."""
        from lanefuse.kernels.cupy_env import i64

        return (*self.epilogue_ptrs(denv), i64(self.epilogue_words))

    def epilogue_addresses(self, denv) -> tuple[int, int, int, int]:
        """The form as the four words a launch's descriptor table holds: its three device addresses (0: a part it
        lacks) and its words a value; zeros where it writes none."""
        if self.quant is None:
            return (0, 0, 0, 0)
        return (*denv.quant_addresses(self.quant), self.epilogue_words)


@dataclass(frozen=True)
class Quant(Launch):
    """y (the quantized form of x's first n values) = quantize(x): a warp a block of QBLOCK values (a q8k form: a
    warp a block of 256, eight values a lane)."""

    x: str
    y: str
    n: int
    words: int = 1

    census: ClassVar[str] = "quant"
    stem: ClassVar[tuple[str, ...]] = ("quant",)

    def reads(self):
        return (self.x,)

    def writes(self):
        return (self.y,)

    def check(self):
        return quant_check(self.n, self.words, k_form=True)

    def extents(self, top, tokens):
        return reach((self.x, self.n))

    def bytes(self):
        return 4 * self.n + quant_bytes(self.n, self.words)

    def flops(self):
        return 4 * self.n

    def numpy(self, env):
        quant_write(env, self.y, env.array(self.x)[: self.n], self.words)

    def grid_block(self):
        warps = 4
        return ((-(-(self.n // qblock(self.words)) // warps), 1, 1), (32 * warps, 1, 1))

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import i64

        grid, block = self.grid_block()
        words, low, scales = denv.quant(self.y)
        f = denv.function(self.stem, "quant")
        f(grid, block, (denv.array(self.x), words, low, scales, i64(self.n), i64(self.words)))
