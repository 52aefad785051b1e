"""Every kernel source compiles as CuPy will compile it at run time — NVRTC through cuda-python with CuPy's options —
and with nvcc, for sm_80 and sm_90, with no error and no warning. Skips only where neither compiler is present."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from lanefuse.kernels import KINDS
from lanefuse.kernels.compile import ARCHS, OPTIONS, source

STEMS = sorted({k.stem for k in KINDS.values() if isinstance(k.stem, tuple) and k.stem})


def include_dirs() -> list[str]:
    """Where cuda_fp16.h / cuda_bf16.h live: the nvidia-cuda-nvrtc wheel's include dir when it holds them, else the
    toolkit's (the kernels include no header, so none is needed; passed as CuPy passes its include path)."""
    dirs = []
    try:
        import nvidia.cu13 as cu

        for p in cu.__path__:
            inc = Path(p) / "include"
            if inc.is_dir():
                dirs.append(str(inc))
    except ImportError:
        pass
    for root in (os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda_fp16.h").exists():
            dirs.append(str(Path(root) / "include"))
    return dirs


def nvrtc():
    try:
        from cuda.bindings import nvrtc as n
    except ImportError:
        return None
    return n


NVCC = shutil.which("nvcc")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stems", STEMS, ids=["+".join(s) for s in STEMS])
def test_nvrtc(stems, arch):
    n = nvrtc()
    if n is None:
        pytest.skip("cuda-python's NVRTC bindings are not installed")
    src = source(stems).encode()
    err, prog = n.nvrtcCreateProgram(src, b"kernel.cu", 0, [], [])
    assert err == n.nvrtcResult.NVRTC_SUCCESS
    opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in OPTIONS)]
    opts += [f"-I{d}".encode() for d in include_dirs()]
    (res,) = n.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = n.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    n.nvrtcGetProgramLog(prog, log)
    text = log.rstrip(b"\x00 \n").decode(errors="replace")
    n.nvrtcDestroyProgram(prog)
    assert res == n.nvrtcResult.NVRTC_SUCCESS, text
    assert not text, f"NVRTC warnings for {stems} on {arch}:\n{text}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stems", STEMS, ids=["+".join(s) for s in STEMS])
def test_nvcc(stems, arch):
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    with tempfile.TemporaryDirectory() as d:
        cu = Path(d) / "kernel.cu"
        cu.write_text(source(stems))
        r = subprocess.run([NVCC, f"-arch={arch}", "-cubin", "-std=c++17", "-Werror", "all-warnings",
                            "-o", str(Path(d) / "kernel.cubin"), str(cu)], capture_output=True, text=True)
    out = (r.stdout + r.stderr).strip()
    assert r.returncode == 0, out
    assert not out, f"nvcc warnings for {stems} on {arch}:\n{out}"


def test_some_compiler_or_skip():
    if nvrtc() is None and NVCC is None:
        pytest.skip("neither NVRTC (cuda-python) nor nvcc is present: the kernel sources were not compiled")
