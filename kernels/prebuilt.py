"""Kernel modules compiled ahead of time: every module the launch kinds name, built to a cubin for one arch (nvcc, or
NVRTC through cuda-python), kept in a folder under its run-time cache key, and loaded from there by kernels/compile.py
(find_cubin) where `LANEFUSE_CUBINS` names that folder, instead of compiled at run time.

Why: ptxas takes minutes on the decode modules (the chain module 286 s of nvcc's 419 s on one core here, nvcc 13,
2026-12-06), and CuPy compiles a module when a process first launches one of its kernels: a first run on a GPU, and
every process of a GPU test run, waited for it. Built once (in parallel, one process a module), on any machine with the
toolkit, no GPU needed."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from lanefuse.kernels.compile import OPTIONS, cubin_file, source

ARCH_CHOICES = ("sm_80", "sm_86", "sm_89", "sm_90")


def modules() -> list[tuple[str, ...]]:
    """Every module a launch kind compiles (its stems), sorted."""
    from lanefuse.kernels import KINDS

    return sorted({k.stem for k in KINDS.values() if isinstance(k.stem, tuple) and k.stem})


def module_name(stems: tuple[str, ...]) -> str:
    return "+".join(stems)


def cubin_name(stems: tuple[str, ...], arch: str) -> str:
    """The file a module's cubin for `arch` is kept under (compile.cubin_file of its source)."""
    return cubin_file(source(stems), arch)


@dataclass(frozen=True)
class Built:
    stems: tuple[str, ...]
    path: Path
    seconds: float  # 0 where the cubin was already there
    bytes: int
    error: str = ""  # the compiler's first lines where it failed


def compiler_available(name: str) -> bool:
    if name == "nvcc":
        return shutil.which("nvcc") is not None
    try:
        from cuda.bindings import nvrtc  # noqa: F401
    except ImportError:
        return False
    return True


def _nvcc(src: str, arch: str, out: Path) -> str:
    """Compile `src` with nvcc to `out`; the error text ('' when it compiled)."""
    with tempfile.TemporaryDirectory() as d:
        cu = Path(d) / "kernel.cu"
        cu.write_text(src)
        r = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", *OPTIONS, "-o", str(out), str(cu)],
                           capture_output=True, text=True)
    return "" if r.returncode == 0 else (r.stdout + r.stderr).strip() or f"nvcc exited {r.returncode}"


def _nvrtc(src: str, arch: str, out: Path) -> str:
    """Compile `src` with NVRTC (cuda-python's bindings), as CuPy does at run time, to a cubin at `out`."""
    from cuda.bindings import nvrtc as n

    err, prog = n.nvrtcCreateProgram(src.encode(), b"kernel.cu", 0, [], [])
    if err != n.nvrtcResult.NVRTC_SUCCESS:
        return f"nvrtcCreateProgram: {err}"
    try:
        opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in OPTIONS)]
        (res,) = n.nvrtcCompileProgram(prog, len(opts), opts)
        if res != n.nvrtcResult.NVRTC_SUCCESS:
            _, size = n.nvrtcGetProgramLogSize(prog)
            log = bytearray(size)  # NVRTC writes into it: never bytes (see tests/test_kernels_compile.py)
            n.nvrtcGetProgramLog(prog, log)
            return bytes(log).rstrip(b"\x00 \n").decode(errors="replace") or str(res)
        _, size = n.nvrtcGetCUBINSize(prog)
        buf = bytearray(size)
        n.nvrtcGetCUBIN(prog, buf)
        out.write_bytes(bytes(buf))
        return ""
    finally:
        n.nvrtcDestroyProgram(prog)


def build_one(stems: tuple[str, ...], arch: str, folder: Path, compiler: str, force: bool = False) -> Built:
    """One module's cubin in `folder` (written whole: a temporary file renamed, so a reader never sees half)."""
    src = source(stems)
    dst = folder / cubin_file(src, arch)
    if dst.is_file() and not force:
        return Built(stems, dst, 0.0, dst.stat().st_size)
    tmp = folder / f".{dst.name}.{os.getpid()}.{abs(hash(stems))}"
    t0 = time.perf_counter()
    try:
        error = (_nvcc if compiler == "nvcc" else _nvrtc)(src, arch, tmp)
        if not error:
            tmp.replace(dst)
    finally:
        tmp.unlink(missing_ok=True)
    took = time.perf_counter() - t0
    if error:
        return Built(stems, dst, took, 0, "\n".join(error.splitlines()[:3]))
    return Built(stems, dst, took, dst.stat().st_size)


def build(folder: Path, arch: str, compiler: str, jobs: int, only: list[tuple[str, ...]] | None = None,
          force: bool = False, progress=None) -> list[Built]:
    """Every module (or `only` those) built for `arch` into `folder`, `jobs` compiles at a time, the largest sources
    started first (the chain module alone is most of the time); `progress(built)` as each ends, in that order."""
    folder.mkdir(parents=True, exist_ok=True)
    todo = sorted(only if only is not None else modules(), key=lambda s: -len(source(s)))
    out: list[Built] = []
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for f in as_completed([pool.submit(build_one, s, arch, folder, compiler, force) for s in todo]):
            out.append(f.result())
            if progress is not None:
                progress(out[-1])
    return out
