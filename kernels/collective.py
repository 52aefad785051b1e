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
from lanefuse.kernels.common import Launch, reach

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

    census: ClassVar[str] = "collective"
    library: ClassVar[str] = "the ranks' communicator (gloo on the CPU, NCCL on GPUs)"  # runs no source of ours

    def reads(self):
        return (self.x,)

    def writes(self):
        return (self.out,)

    def check(self):
        if self.op not in OPS:
            return Refusal(f"a collective `{self.op}` (known: {', '.join(OPS)})")
        return None

    def kernels(self):
        return (self,)  # one launch: the communicator's call (a kernel of the collective library's, not this one's)

    def out_size(self) -> int:
        return {"all_reduce": self.rows * self.cols, "all_gather": self.rows * self.cols * self.ranks,
                "all_argmax": self.rows}[self.op]

    def extents(self, top, tokens):
        return reach((self.x, self.rows * self.cols), (self.out, self.out_size()))

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
        env.array(self.out)[: self.out_size()] = np.asarray(y).reshape(-1)

    def grid_block(self):
        return ((0, 0, 0), (0, 0, 0))

    def cuda(self, denv):
        raise UserError(f"a {self.op} launch on the device: NCCL inside a plan is not built yet (run --ranks R runs "
                        f"the ranks on the CPU)")
