"""The kernel modules' cubins for the GPU machine (bench/gpu_suite.sh): `pack` builds every module for sm_90 into a
cache folder kept between runs (`lanefuse kernels --build`: nvcc here, no GPU needed; a module already built is not
built again) and writes the current sources' cubins xz-compressed into PLANDIR/cubins, to travel with the plans;
`unpack` on the GPU machine writes them back for LANEFUSE_CUBINS. CuPy would otherwise compile each module in every
test process at its first launch, the chain module ~7 minutes of ptxas alone (longer than a device call may run).
All 33 modules: 43.4 MiB of cubins, 5.1 MiB xz-compressed (2026-12-06; nvcc 13, 16 CPU-minutes to build here).

    python bench/gpu_cubins.py pack PLANDIR [--cache DIR]     python bench/gpu_cubins.py unpack PLANDIR DIR
"""

from __future__ import annotations

import argparse
import lzma
import os
import sys
from pathlib import Path


def pack(plans: Path, cache: Path, arch: str) -> int:
    from lanefuse.kernels.prebuilt import cubin_name, modules
    from lanefuse.lane.cli.main import main

    rc = main(["kernels", "--build", str(cache), "--arch", arch])
    if rc:
        return rc
    out = plans / "cubins"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.cubin.xz"):
        old.unlink()
    raw = packed = 0
    for stems in modules():
        name = cubin_name(stems, arch)
        blob = (cache / name).read_bytes()
        dst = out / (name + ".xz")
        dst.write_bytes(lzma.compress(blob, preset=6))
        raw += len(blob)
        packed += dst.stat().st_size
    print(f"cubins: {len(modules())} modules for {arch}, {raw / 2**20:.1f} MiB, {packed / 2**20:.1f} MiB xz-compressed "
          f"in {out}")
    return 0


def unpack(plans: Path, dst: Path) -> int:
    dst.mkdir(parents=True, exist_ok=True)
    n = 0
    for p in (plans / "cubins").glob("*.cubin.xz"):
        (dst / p.name[:-3]).write_bytes(lzma.decompress(p.read_bytes()))
        n += 1
    print(f"{n} cubins unpacked into {dst}")
    return 0 if n else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("plans", type=Path)
    p.add_argument("--cache", type=Path,
                   default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lanefuse-cubins")
    p.add_argument("--arch", default="sm_90")
    p = sub.add_parser("unpack")
    p.add_argument("plans", type=Path)
    p.add_argument("dst", type=Path)
    a = ap.parse_args()
    return pack(a.plans, a.cache, a.arch) if a.cmd == "pack" else unpack(a.plans, a.dst)


if __name__ == "__main__":
    sys.exit(main())
