"""`swiglu`: out = silu(g) · u over n values.

Why it exists (seed 002's link: `TensorOpSpec::SwiGlu` -> `Launch::SwiGlu`): the seed's front lifts a SwiGLU FFN as
one `swiglu` op, and a step YAML written in that lifted form runs it. This project's fronts build the same FFN as
`silu` and `mul` (glu_act_mul and the chains fuse that form), so no front reaches this launch: a `swiglu` op runs in
the gate and up products' launch (gemv_gate_up_glu.swiglu), and here only where that rule is held.
tests/test_issue40_rows.py plans it from the demo decoder's step with its FFN lifted so, against the reference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from lanefuse.kernels.common import act, reach
from lanefuse.kernels.elementwise import Elementwise


@dataclass(frozen=True)
class SwiGlu(Elementwise):
    g: str
    u: str
    out: str
    n: int

    census: ClassVar[str] = "swiglu"
    stem: ClassVar[tuple[str, ...]] = ("swiglu",)
    inputs: ClassVar[tuple[str, ...]] = ("g", "u")
    output: ClassVar[str] = "out"

    def elements(self):
        return self.n

    def extents(self, top, tokens):
        return reach((self.g, self.n), (self.u, self.n), (self.out, self.n))

    def bytes(self):
        return 12 * self.n

    def flops(self):
        return 5 * self.n

    def numpy(self, env):
        g = act("silu", env.array(self.g)[: self.n].astype(np.float32)).astype(np.float32)
        env.array(self.out)[: self.n] = g * env.array(self.u)[: self.n].astype(np.float32)

    def args(self, denv):
        from lanefuse.kernels.cupy_env import i64

        return (denv.array(self.g), denv.array(self.u), denv.array(self.out), i64(self.n))
