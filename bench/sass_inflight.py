"""The weight bytes a lane keeps in flight in a kernel's loops, read off its SASS: what the launch model's "KB in
flight a SM" assumes of a loop, checked against what ptxas actually scheduled (issue 34 item 6). No device needed:
the module is built with nvcc for sm_90 and disassembled with cuobjdump.

A load is in flight from its issue until the first instruction that reads a register it writes; the most bytes of
streaming loads (`__ldcs`: LDG.E.EF) outstanding at once over a loop body, walked twice (a loop's loads may be used
in its next iteration), is the figure. A loop is a backward branch's span; `--stores` keeps the loops that store to
shared memory (gemv_tile_staged's).

    python bench/sass_inflight.py gemv_4 gemv_1 [--stems gemv_core,gemv] [--cuobjdump PATH] [--stores]

What it found (nvcc 13, sm_90): gemv_4 over q8_0 rows kept 78 bytes a lane in flight with gemv_tile_b32's 2-byte loads
(168 registers), a decode kernel of q8_0 alone at 40 registers 10-14 (more warps a SM, fewer bytes a warp: no gain),
and gemv_tile_staged 320 (q8_0) and 192 (q4_0) bytes a lane, the whole stage. q4_k / q6_k rows (gemv_4, four rows a
warp): 128 / 84 bytes a lane with gemv_tile_q4_k's 16-byte loads and gemv_tile_q6_k's 2-byte ones (8 and 42 loads a
loop), 320 / 256 through gemv_tile_staged (20 and 16 loads a loop: stages of 16 and 8 super-blocks); gemv_1 64 / 52
then 80 / 64.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def sass(cubin: str, fn: str, cuobjdump: str) -> list[tuple[int, str]]:
    """(address, instruction) of kernel `fn` in `cubin`."""
    t = subprocess.run([cuobjdump, "-sass", "-fun", fn, cubin], capture_output=True, text=True, check=True).stdout
    out = []
    for line in t.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def loops(ins: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """Each backward branch's span of instructions."""
    spans = []
    for a, t in ins:
        m = re.search(r"BRA.*0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a:
            lo = int(m.group(1), 16)
            spans.append([x for x in ins if lo <= x[0] <= a])
    return spans


def _regs(s: str) -> list[int]:
    return [int(x) for x in re.findall(r"\bR(\d+)\b", s)]


def load_bytes(op: str) -> int:
    return 16 if ".128" in op else 8 if ".64" in op else 2 if (".U16" in op or ".S16" in op) else \
        1 if (".U8" in op or ".S8" in op) else 4


def inflight(body: list[tuple[int, str]]) -> float:
    """The most streaming-load bytes a lane has outstanding over the body, walked twice."""
    best, pend = 0.0, {}
    for _ in range(2):
        for _, t in body:
            tt = re.sub(r"^@!?P\w+\s+", "", t)
            op = tt.split()[0]
            parts = [p.strip() for p in tt[len(op):].split(",")]
            reads = {r for p in (parts if op.startswith("ST") else parts[1:]) for r in _regs(p)}
            for r in [r for r in pend if r in reads]:
                del pend[r]
            if op.startswith("LDG") and ".EF" in op:
                w = load_bytes(op)
                d = _regs(parts[0])
                if d:
                    n = max(1, w // 4)
                    for i in range(n):
                        pend[d[0] + i] = w / n
            best = max(best, sum(pend.values()))
    return best


def report(cubin: str, fn: str, cuobjdump: str, stores: bool = False) -> list[tuple[int, int, float]]:
    """(instructions, streaming loads, bytes a lane in flight) of each loop of `fn`, smallest first."""
    rows = []
    for body in loops(sass(cubin, fn, cuobjdump)):
        if stores and not any("STS" in t for _, t in body):
            continue
        loads = sum("LDG" in t and ".EF" in t for _, t in body)
        if loads:
            rows.append((len(body), loads, inflight(body)))
    return sorted(set(rows))


def build(stems: tuple[str, ...], nvcc: str, out: Path) -> Path:
    from lanefuse.kernels.compile import source

    cu = out / "kernel.cu"
    cu.write_text(source(stems))
    cubin = out / "kernel.cubin"
    subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-std=c++17", "-o", str(cubin), str(cu)], check=True,
                   capture_output=True)
    return cubin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernels", nargs="+")
    ap.add_argument("--stems", default="gemv_core,gemv", help="the module's .cu stems (after prelude), comma-separated")
    ap.add_argument("--cubin", default=None, help="a cubin already built (else the module is built with nvcc)")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump"))
    ap.add_argument("--stores", action="store_true", help="only loops that store to shared memory")
    a = ap.parse_args()
    if not a.cuobjdump:
        sys.exit("sass_inflight: no cuobjdump (pass --cuobjdump PATH; pip's nvidia-cuda-cuobjdump has one)")
    with tempfile.TemporaryDirectory() as d:
        cubin = a.cubin
        if cubin is None:
            nvcc = shutil.which("nvcc")
            if nvcc is None:
                sys.exit("sass_inflight: no nvcc on PATH")
            cubin = str(build(tuple(a.stems.split(",")), nvcc, Path(d)))
        for fn in a.kernels:
            print(f"{fn}: loops (instructions, streaming loads, bytes a lane in flight): "
                  f"{report(cubin, fn, a.cuobjdump, a.stores)}")


if __name__ == "__main__":
    main()
