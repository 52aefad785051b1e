"""Each kernel's resources as ptxas reports them: every module the kinds build (prelude.cu plus the .cu files a kind's
stems name, as CuPy compiles it) compiled with `nvcc -cubin -arch=sm_90 -Xptxas -v`, no GPU needed. For each kernel:
registers a thread, stack frame, spill stores and loads, static shared memory, and the resident 128-thread blocks an
H200 SM holds (65536 registers, 64 warps, 32 blocks, 228 KB of shared memory an SM; registers taken 256 a warp, 1 KB
of shared memory reserved a block) and which limit binds. The ncu figures of 2026-12-04 agree: 96 registers give 5
blocks (fold_gemv_norm_4: 256 blocks = 0.39 waves on 132 SMs), 128 give 4 (gemv_glu_4), 40 give 12.

Prints a table and writes bench/results/kernel-resources.json (the launch model's input):

    python bench/kernel_resources.py [--arch sm_90] [--jobs N] [--rev COMMIT] [--out PATH]

tests/test_kernels_compile.py parses the same ptxas output with `ptxas_resources` and checks no kernel spills."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# an H200 SM (compute capability 9.0): the limits the occupancy calculator uses
SM = dict(regs=65536, warps=64, blocks=32, smem=228 * 1024, reg_unit=256, smem_reserved=1024, smem_unit=128)
NVCC_FLAGS = ("-cubin", "-std=c++17", "-Werror", "all-warnings", "-Xptxas", "-v")

_ENTRY = re.compile(r"ptxas info\s*: Compiling entry function '(\w+)' for '(\w+)'")
_PROPS = re.compile(r"ptxas info\s*: Function properties for (\w+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill "
                    r"stores, (\d+) bytes spill loads")
_USED = re.compile(r"ptxas info\s*: Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?"
                   r"(?:, (\d+) bytes cmem\[0\])?")


def ptxas_resources(out: str) -> dict[str, dict]:
    """{kernel: {registers, stack, spill_stores, spill_loads, smem, barriers}} from `nvcc -Xptxas -v` output: each
    entry function's "Function properties" and "Used N registers" lines (a non-inlined device function's properties
    are listed too, under its own (mangled) name, with no register line: kept with registers None)."""
    res: dict[str, dict] = {}
    for m in _PROPS.finditer(out):
        res[m.group(1)] = dict(registers=None, stack=int(m.group(2)), spill_stores=int(m.group(3)),
                               spill_loads=int(m.group(4)), smem=0, barriers=0)
    # a "Used" line follows its entry's "Compiling entry function" line (and its properties)
    entry = None
    for line in out.splitlines():
        e = _ENTRY.search(line)
        if e:
            entry = e.group(1)
            continue
        u = _USED.search(line)
        if u and entry is not None:
            r = res.setdefault(entry, dict(stack=0, spill_stores=0, spill_loads=0))
            r.update(registers=int(u.group(1)), barriers=int(u.group(2) or 0), smem=int(u.group(3) or 0))
            entry = None
    return res


def blocks_per_sm(registers: int, smem: int, threads: int = 128) -> tuple[int, str]:
    """(resident blocks of `threads` threads an SM holds, the limit that binds: registers, warps, blocks or smem)."""
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // SM["reg_unit"]) * SM["reg_unit"]
    limits = {"warps": SM["warps"] // warps, "blocks": SM["blocks"]}
    limits["registers"] = (SM["regs"] // per_warp) // warps if per_warp else SM["blocks"]
    alloc = -(-(smem + SM["smem_reserved"]) // SM["smem_unit"]) * SM["smem_unit"]
    limits["smem"] = SM["smem"] // alloc
    n = min(limits.values())
    return n, min(limits, key=lambda k: (limits[k], k != "registers"))  # ties named by registers first


def modules() -> list[tuple[str, ...]]:
    """The modules the kinds build: each kind's stems (kernels/__init__.py's registry), once."""
    from lanefuse.kernels import KINDS

    return sorted({k.stem for k in KINDS.values() if isinstance(k.stem, tuple) and k.stem})


def rev_source(stems: tuple[str, ...], rev: str) -> str:
    """The module's source as commit `rev` holds it (compile.source's order: the prelude, then the stems). A stem of
    device bodies only that the commit lacks is left out (parts_rope.cu: before the chain's q/k/v phase its bodies
    were fold.cu's), so an old commit's module is its own source, as it compiled then."""
    root = Path(__file__).resolve().parent.parent
    have = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}", "kernels/"], cwd=root, capture_output=True,
                          text=True, check=True).stdout.split()
    return "\n".join(subprocess.run(["git", "show", f"{rev}:kernels/{s}.cu"], cwd=root, capture_output=True, text=True,
                                    check=True).stdout for s in ("prelude",) + tuple(stems)
                     if s != "parts_rope" or f"kernels/{s}.cu" in have)


def nvcc_compile(stems: tuple[str, ...], arch: str = "sm_90", nvcc: str | None = None,
                 rev: str | None = None) -> tuple[int, str, float]:
    """(nvcc's exit status, its output (ptxas's report among it), seconds) compiling module `stems` to a cubin: the
    working tree's sources, or commit `rev`'s."""
    from lanefuse.kernels.compile import source

    nvcc = nvcc or shutil.which("nvcc")
    with tempfile.TemporaryDirectory() as d:
        cu = Path(d) / "kernel.cu"
        cu.write_text(source(stems) if rev is None else rev_source(stems, rev))
        t0 = time.perf_counter()
        r = subprocess.run([nvcc, f"-arch={arch}", *NVCC_FLAGS, "-o", str(Path(d) / "kernel.cubin"), str(cu)],
                           capture_output=True, text=True)
        return r.returncode, r.stdout + r.stderr, time.perf_counter() - t0


def table(arch: str = "sm_90", jobs: int | None = None, rev: str | None = None) -> tuple[list[dict], float]:
    """Every kernel of every module (a kernel in several modules reported once, from its first), and the wall time."""
    mods = modules()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as ex:
        outs = list(ex.map(lambda s: nvcc_compile(s, arch, rev=rev), mods))
    wall = time.perf_counter() - t0
    rows: dict[str, dict] = {}
    for stems, (rc, out, secs) in zip(mods, outs):
        if rc != 0:
            raise SystemExit(f"nvcc failed on {'+'.join(stems)}:\n{out}")
        for name, r in ptxas_resources(out).items():
            if r["registers"] is None or name in rows:
                continue
            n, limit = blocks_per_sm(r["registers"], r["smem"])
            rows[name] = dict(kernel=name, module="+".join(stems), **r, blocks_per_sm_128=n, limit=limit)
    return sorted(rows.values(), key=lambda r: r["kernel"]), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--rev", default=None, help="compile the kernel sources of this commit (default: the work tree)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "kernel-resources.json"))
    a = ap.parse_args()
    if shutil.which("nvcc") is None:
        sys.exit("nvcc is not on PATH")
    rows, wall = table(a.arch, a.jobs, a.rev)
    head = f"{'kernel':34} {'regs':>4} {'stack':>5} {'spill st/ld':>11} {'smem':>6} {'blocks/SM':>9}  limit   module"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['kernel']:34} {r['registers']:4d} {r['stack']:5d} {r['spill_stores']:5d}/{r['spill_loads']:<5d} "
              f"{r['smem']:6d} {r['blocks_per_sm_128']:9d}  {r['limit']:7} {r['module']}")
    nvcc_v = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    rev = a.rev and subprocess.run(["git", "rev-parse", "--short", a.rev], cwd=Path(__file__).resolve().parent.parent,
                                   capture_output=True, text=True).stdout.strip()
    doc = dict(arch=a.arch, nvcc=nvcc_v, sources=f"kernels/*.cu at {rev}" if rev else "the work tree's kernels/*.cu", flags=" ".join(NVCC_FLAGS), sm=SM, block_threads=128,
               note="registers a thread, stack frame and spill bytes, static shared memory bytes, as ptxas -v reports "
                    "them; blocks_per_sm_128: resident 128-thread blocks an SM holds, limit: which limit binds",
               kernels=rows)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\n{len(rows)} kernels in {len(modules())} modules, compiled in {wall:.1f} s; written to {a.out}")


if __name__ == "__main__":
    main()
