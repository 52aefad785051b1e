"""`collective`: a collective op of a rank's step (engine/collectives.py: all_reduce, all_gather, all_argmax) as a
launch. No CUDA source of its own (`library`): on the CPU the numpy twin meets the other ranks through the
communicator the runner gives its env (`env.comm`: lane/run/ranks.py; without one, one rank alone); NCCL in a device
plan is not built yet (refused in words at run time). One launch in the census, no HBM bytes: its price beyond the
launch gap is its link's (`link_us`; lane/lower/shim.py adds it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from lanefuse.engine.errors import UserError
from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import Launch, reach, rms

OPS = ("all_reduce", "all_gather", "all_argmax")


def link_time_us(op: str, nbytes: int, ranks: int, gbps: float, fixed_us: float) -> float:
    """A collective's predicted µs: a fixed latency plus a ring's bytes a rank over the link (NCCL's bus-bandwidth
    formulas: all-reduce 2·(R-1)/R of its payload, all-gather and the arg-max's gather (R-1) payloads)."""
    if ranks <= 1:
        return 0.0
    share = 2.0 * (ranks - 1) / ranks if op == "all_reduce" else float(ranks - 1)
    return fixed_us + share * nbytes / (gbps * 1e3)  # GB/s = 1e3 bytes a µs


@dataclass(frozen=True)
class Collective(Launch):
    op: str  # all_reduce | all_gather | all_argmax
    x: str  # (rows, cols) f32
    out: str  # all_reduce (rows, cols); all_gather (rows, ranks·cols); all_argmax i32 (rows,)
    rows: int
    cols: int
    ranks: int
    offset: int = 0  # all_argmax: where this rank's part of the row starts
    add: str | None = None  # all_reduce_add_norm (rules/collectives.yaml): the residual added to the sum (rows, cols),
    sum: str | None = None  # ... where the residual sum is written,
    w: str | None = None  # ... and the RMSNorm's weight (cols,): `out` is then the sum's norm (the reduced row itself
    eps: float = 0.0  # is not kept: TensorRT-LLM's fused all-reduce + residual + RMSNorm)

    census: ClassVar[str] = "collective"
    library: ClassVar[str] = "the ranks' communicator (gloo on the CPU, NCCL on GPUs)"  # runs no source of ours

    def reads(self):
        return tuple(n for n in (self.x, self.add, self.w) if n is not None)

    def writes(self):
        return tuple(n for n in (self.out, self.sum) if n is not None)

    def weights(self):
        return {self.w: "f32"} if self.w is not None else {}

    def check(self):
        if self.op not in OPS:
            return Refusal(f"a collective `{self.op}` (known: {', '.join(OPS)})")
        if self.add is not None and (self.op != "all_reduce" or self.w is None):
            return Refusal(f"a {self.op} with a residual add and a norm (only an all-reduce's sum, with the norm's "
                           f"weight)")
        return None

    def kernels(self):
        return (self,)  # one launch: the communicator's call (a kernel of the collective library's, not this one's)

    def out_size(self) -> int:
        return {"all_reduce": self.rows * self.cols, "all_gather": self.rows * self.cols * self.ranks,
                "all_argmax": self.rows}[self.op]

    def extents(self, top, tokens):
        n = self.rows * self.cols
        return reach((self.x, n), (self.out, self.out_size()), (self.add, n), (self.sum, n), (self.w, self.cols))

    def bytes(self):
        return 0

    def payload_bytes(self) -> int:
        return 16 * self.rows if self.op == "all_argmax" else 4 * self.rows * self.cols

    def link_us(self, knobs) -> float:
        """Its predicted µs on the chip's link (knobs link_gbps, link_us)."""
        return link_time_us(self.op, self.payload_bytes(), self.ranks, knobs.link_gbps, knobs.link_us)

    def numpy(self, env):
        from lanefuse.engine.collectives import meet_values

        x = np.asarray(env.array(self.x)[: self.rows * self.cols], dtype=np.float32).reshape(self.rows, self.cols)
        y = meet_values(getattr(env, "comm", None), self.op, x, self.ranks, self.offset,
                        f"the {self.op} launch -> `{self.out}`")
        if self.add is not None:  # the residual add and the norm, as the Norm launch's twin computes them
            n = self.rows * self.cols
            s = (np.asarray(y, np.float32) + env.array(self.add)[:n].reshape(self.rows, self.cols)).astype(np.float32)
            if self.sum is not None:
                env.array(self.sum)[:n] = s.reshape(-1)
            y = s * rms(s, self.eps) * np.asarray(env.weight(self.w)[0], dtype=np.float64)[: self.cols]
        env.array(self.out)[: self.out_size()] = np.asarray(y, dtype=env.array(self.out).dtype).reshape(-1)

    def grid_block(self):
        return ((0, 0, 0), (0, 0, 0))

    def cuda(self, denv):
        raise UserError(f"a {self.op} launch on the device: NCCL inside a plan is not built yet (run --ranks R runs "
                        f"the ranks on the CPU)")
