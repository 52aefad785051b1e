"""The kernel library: every launch kind defined once (its fields, numpy twin, CUDA source and launch, grid, cost),
registered here by its census name. CuPy is imported only when a launch runs on the device."""

from lanefuse.kernels.argmax import Advance, ArgMax
from lanefuse.kernels.attention import Attention
from lanefuse.kernels.binary import Binary
from lanefuse.kernels.common import (ALIGN, GEMV_ROWS, MAX_HEAD, QBLOCK, Dst, Launch, Part, Scratch)
from lanefuse.kernels.env import Env, HostEnv
from lanefuse.kernels.fold import Fold
from lanefuse.kernels.gather import Gather
from lanefuse.kernels.gemm_parts import GemmPart, GemmParts
from lanefuse.kernels.gemv import Gemv, GemvF32
from lanefuse.kernels.gemv_glu import GemvGlu
from lanefuse.kernels.join import Join
from lanefuse.kernels.norm import Norm, PreNorm
from lanefuse.kernels.quant import Quant
from lanefuse.kernels.rope import Rope, RopeParts, RopeSide
from lanefuse.kernels.scale import Scale
from lanefuse.kernels.set_row import SetRow
from lanefuse.kernels.slice import Slice
from lanefuse.kernels.swiglu import SwiGlu
from lanefuse.kernels.unary import Unary
from lanefuse.kernels.view import View

KINDS: dict[str, type[Launch]] = {k.census: k for k in (
    Gemv, GemvF32, Norm, Rope, RopeParts, Attention, Binary, SwiGlu, GemvGlu, GemmParts, Gather, SetRow, ArgMax,
    Slice, Join, Unary, Scale, Fold, Quant, View)}


def honoured_steps() -> frozenset[str]:
    """The lane's schedule steps some kind's `tune` honours (the lane table's `schedule:` lists them, with the steps
    it takes itself)."""
    return frozenset(s for k in KINDS.values() for s in k.steps)

__all__ = ["KINDS", "ALIGN", "GEMV_ROWS", "MAX_HEAD", "QBLOCK", "Launch", "Part", "Dst", "Scratch",
           "Env", "HostEnv", "Advance", "PreNorm", "RopeSide", "GemmPart", "honoured_steps", *(k.__name__ for k in KINDS.values())]
