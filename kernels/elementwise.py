"""What the elementwise kinds share: their grid (a grid-stride loop of 256-thread blocks), the activation codes, and
`Elementwise`, the base that derives a kind's reads, writes, grid and launch from what it declares."""

from __future__ import annotations

from typing import ClassVar

from lanefuse.kernels.common import ACTS, Dst, Launch, names

THREADS = 256


def grid(n: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    return ((max(1, min(4096, -(-n // THREADS))), 1, 1), (THREADS, 1, 1))


def act_code(name: str | None) -> int:
    """An activation as act_apply (prelude.cu) numbers it; -1 for none."""
    return -1 if name is None else ACTS.index(name)


class Elementwise(Launch):
    """A kind whose kernel walks `elements()` values with the elementwise grid. It reads the tensors its `inputs`
    fields name (None and numbers skipped) and the parameters of its output's Dst, and writes the one tensor its
    `output` field names (a name or a Dst); its kernel is the function named like its census in its stem's source,
    passed `args(denv)`. A kind declares those and keeps its fields, numpy twin, check, bytes and flops."""

    inputs: ClassVar[tuple[str, ...]] = ()  # the fields naming what the launch reads, in order
    output: ClassVar[str] = ""  # the field naming what it writes

    def elements(self) -> int:
        """The values the grid walks."""
        raise NotImplementedError

    def args(self, denv) -> tuple:
        """The kernel's arguments after grid and block, in its .cu signature's order."""
        raise NotImplementedError

    def reads(self):
        out = getattr(self, self.output)
        return names(*(getattr(self, f) for f in self.inputs), *(out.params() if isinstance(out, Dst) else ()))

    def writes(self):
        out = getattr(self, self.output)
        return (out.buf if isinstance(out, Dst) else out,)

    def grid_block(self):
        return grid(self.elements())

    def cuda(self, denv):
        g, b = self.grid_block()
        denv.function(self.stem, self.census)(g, b, self.args(denv))
