"""`gate_proj`: a gated delta net's two gate products and its gates in one launch (gdn_gate_projections): `parts`
warps a (row, head) (seed 002's GateProj `parts`; the schedule's `split_k`) take the dots of x's row with wb's and wa's
row over their parts of k, added in the block in part order, then beta = sigmoid(x·wb) and decay =
-exp(al) · softplus(x·wa + dt) (gate_proj.cu). A decode step's few (row, head) units fill few warps of the chip, each a
dot of the whole width: in parts, each warp's dependent loads a part's."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import FORMAT_CODE, Launch, decode, format_refusal, names, reach, weight_bytes
from lanefuse.kernels.decay import forget

PARTS = (1, 2, 4)  # warps a (row, head): the warps of one block of four
MIN_PART = 128  # values of k a part keeps at least (four loads a lane)


@dataclass(frozen=True)
class GateProj(Launch):
    x: str
    wb: str
    wa: str
    format: str
    dt: str
    al: str
    beta: str
    decay: str
    k: int
    heads: int
    rows: int
    format_a: str | None = None  # wa's format where it differs from wb's (None: the same)
    parts: int = 1  # warps a (row, head), each a part of k (1, 2 or 4: the warps of one block)

    census: ClassVar[str] = "gate_proj"
    stem: ClassVar[tuple[str, ...]] = ("decay", "gate_proj")
    steps: ClassVar[tuple[str, ...]] = ("split_k",)

    def reads(self):
        return names(self.x, self.wb, self.wa, self.dt, self.al)

    def writes(self):
        return names(self.beta, self.decay)

    @property
    def fmt_a(self) -> str:
        return self.format_a or self.format

    def check(self):
        if self.parts not in PARTS:
            return Refusal(f"gate products in {self.parts} parts a (row, head) (the kernel takes "
                           f"{', '.join(map(str, PARTS))}: warps of one block)")
        return format_refusal(self.format, self.k, "a gate product") or format_refusal(self.fmt_a, self.k,
                                                                                        "a gate product")

    def tune(self, knobs, held=frozenset()):
        """`split_k`: the most parts (of PARTS) whose blocks still fit the chip once over (knobs.sms) and whose parts
        keep at least MIN_PART values of k each; one where held."""
        parts = 1
        if "split_k" not in held:
            for p in PARTS[::-1]:
                if -(-self.rows * self.heads * p // 4) <= knobs.sms and self.k >= MIN_PART * p:
                    parts = p
                    break
        return replace(self, parts=parts)

    def rounds(self) -> int:
        """A lane's loads in its warp's dot (the latency the parts cut): a part's values over 32 lanes."""
        return -(-(-(-self.k // self.parts)) // 32)

    def extents(self, top, tokens):
        n = self.rows * self.heads
        return reach((self.x, self.rows * self.k), (self.wb, self.heads * self.k), (self.wa, self.heads * self.k),
                     (self.dt, self.heads), (self.al, self.heads), (self.beta, n), (self.decay, n))

    def weights(self):
        return {self.wb: self.format, self.wa: self.fmt_a, self.dt: "f32", self.al: "f32"}

    def checkpoint_bytes(self):
        return weight_bytes(self.format, self.heads, self.k) + weight_bytes(self.fmt_a, self.heads, self.k)

    def bytes(self):
        return self.checkpoint_bytes() + 4 * self.rows * self.k + 8 * self.rows * self.heads + 8 * self.heads

    def flops(self):
        return 4 * self.rows * self.heads * self.k

    def numpy(self, env):
        """Each dot in f64 as the parts' sums (any parts: the same f64 sum to rounding), the gates from it."""
        r, h, k = self.rows, self.heads, self.k
        x = env.array(self.x)[: r * k].reshape(r, k).astype(np.float64)
        wb = decode(env.weight(self.wb)[0], self.format).reshape(-1)[: h * k].reshape(h, k).astype(np.float64)
        wa = decode(env.weight(self.wa)[0], self.fmt_a).reshape(-1)[: h * k].reshape(h, k).astype(np.float64)
        env.array(self.beta)[: r * h] = (1.0 / (1.0 + np.exp(-(x @ wb.T)))).reshape(-1).astype(np.float32)
        dt = np.asarray(env.weight(self.dt)[0]).reshape(-1)[:h]
        al = np.asarray(env.weight(self.al)[0]).reshape(-1)[:h]
        env.array(self.decay)[: r * h] = forget(x @ wa.T, dt, al).reshape(-1).astype(np.float32)

    def grid_block(self):
        warps = self.rows * self.heads * self.parts
        return ((-(-warps // 4), 1, 1), (128, 1, 1))

    def cuda(self, denv):
        from lanefuse.kernels.cupy_env import i64

        g, b = self.grid_block()
        denv.function(self.stem, "gate_proj")(g, b, (
            denv.array(self.x), denv.weight(self.wb)[0], denv.weight(self.wa)[0], i64(FORMAT_CODE[self.format]),
            i64(FORMAT_CODE[self.fmt_a]),
            denv.opt(self.dt), denv.opt(self.al), denv.array(self.beta), denv.array(self.decay), i64(self.k),
            i64(self.heads), i64(self.rows), i64(self.parts)))
