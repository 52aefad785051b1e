"""The lane's schedule: how each linked launch runs — four rows a warp for a wide product (`rows_a_warp`), split-K
for a product too narrow to fill the chip (`split_k`), attention heads a block and splits with a combine pass
(`attn_splits`) — and the Schedule a plan returns. Each step is named; a plan can hold it back like a rule."""

from __future__ import annotations

from dataclasses import dataclass, field

from lanefuse.engine.ir import Constant, StepIO, Tensor
from lanefuse.lane.lower.arena import Arena
from lanefuse.lane.lower.buffers import Buffer
from lanefuse.lane.lower.knobs import Knobs

# The lane's own steps, held back like rules (`--hold rows_a_warp`).
STEPS = {
    "rows_a_warp": "four rows a warp for a product of at least `wide_rows` outputs",
    "split_k": "a product whose outputs fill too few blocks splits its k across blocks, then combines",
    "attn_splits": "a long attention split across blocks with a combine pass (flash-decoding); heads a block",
    "gemv_parts": "the products of one activation linked as one GEMV in parts (merged_qkv whole)",
}


def kernels_of(l) -> list:
    """The kernel launches a linked launch makes (its kind's `kernels()`): none for a view, two for a fold whose
    pair has no kernel of its own, one otherwise. The census and the launch counts count these."""
    return list(l.kernels())


def schedule_launch(l, k: Knobs, held=frozenset()):
    """One linked launch with the schedule's settings filled in: its kind's `tune` (the steps each kind honours are
    its `steps`)."""
    return l.tune(k, held)


@dataclass
class Launched:
    """One launch of the schedule: the launch, the lifted ops it computes (their outputs), its layer, and the class
    and rule of the fused op it came from."""

    launch: object
    ops: tuple[str, ...]
    layer: int
    cls: str | None
    rule: str | None
    cost_us: float


@dataclass
class Schedule:
    """A step lowered: its launches in order, its buffers and arena, the fusions that fired, the census."""

    model: str
    rows: int
    lane: str
    numerics: str
    knobs: Knobs
    held: tuple[str, ...]
    launches: list[Launched]
    buffers: dict[str, Buffer]
    arena: Arena
    counters: list
    fusions: dict[str, int]
    census: dict[str, int]
    cost_us: float
    layers: int
    io: StepIO
    tensors: dict[str, Tensor] = field(default_factory=dict)
    constants: dict[str, Constant] = field(default_factory=dict)
    source: dict = field(default_factory=dict)  # how to open the model again: {"kind": "demo"} or a path
    timings: dict = field(default_factory=dict)

    def per_layer(self) -> dict[int, int]:
        """Kernel launches by layer (-1: the step's head and tail outside every layer)."""
        out: dict[int, int] = {}
        for l in self.launches:
            out[l.layer] = out.get(l.layer, 0) + len(kernels_of(l.launch))
        return out

    def check_position(self, pos: int) -> None:
        """A step's rows must land inside the caches: the kernels do not check it on the device."""
        from lanefuse.engine.errors import UserError

        if not self.io.caches:
            return
        length = self.tensors[self.io.caches[0][0]].shape[0]
        if pos < 0 or pos + self.rows > length:
            raise UserError(f"a step of {self.rows} row(s) at position {pos} runs past the KV cache of {length} rows")

    @property
    def n_launches(self) -> int:
        return sum(len(kernels_of(l.launch)) for l in self.launches)
