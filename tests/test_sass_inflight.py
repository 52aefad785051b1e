"""bench/sass_inflight.py's reading of a SASS loop, on hand-written SASS (no nvcc or cuobjdump needed): a streaming
load is in flight until an instruction reads a register it wrote, 16-byte loads count 16 bytes, plain loads (x, not
the weights) none, a loop's loads used in its next iteration count across the back edge."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import sass_inflight as si  # noqa: E402


def body(*ins: str):
    return [(16 * i, t) for i, t in enumerate(ins)]


def test_every_load_of_a_stage_before_its_first_use():
    b = body("LDG.E.128.EF R4, desc[UR4][R2.64]", "LDG.E.128.EF R8, desc[UR4][R2.64+0x200]",
             "LDG.E.128 R12, desc[UR4][R20.64]",  # x: not a streaming load
             "STS.128 [R30], R4", "STS.128 [R30+0x10], R8", "FFMA R40, R12, R13, R40")
    assert si.inflight(b) == 32.0


def test_a_load_used_at_once_keeps_little_in_flight():
    b = body("LDG.E.U16.EF R4, desc[UR4][R2.64]", "I2F.S16 R5, R4", "LDG.E.U16.EF R6, desc[UR4][R2.64+0x2]",
             "I2F.S16 R7, R6", "FFMA R40, R5, R7, R40")
    assert si.inflight(b) == 2.0


def test_loads_used_in_the_next_iteration_count_across_the_back_edge():
    b = body("FFMA R40, R4, R5, R40", "FFMA R41, R8, R9, R41", "LDG.E.64.EF R4, desc[UR4][R2.64]",
             "LDG.E.64.EF R8, desc[UR4][R2.64+0x100]", "BRA 0x0")
    assert si.inflight(b) == 16.0


def test_loops_are_backward_branches():
    ins = body("MOV R1, R2", "LDG.E.EF R4, desc[UR4][R2.64]", "FADD R5, R4, R5", "@P0 BRA 0x10", "EXIT")
    (loop,) = si.loops(ins)
    assert [a for a, _ in loop] == [16, 32, 48]
