"""Programmatic dependent launch (kernels/pdl.py, prelude.cu's PDL_ENTER), checked without a device.

The kernels' side: every `__global__` body in kernels/*.cu starts with PDL_ENTER() (griddepcontrol.wait, then
launch_dependents) in every block, at most after a weight prefetch (read-only, named `*prefetch*`): a kernel launched
with the attribute then reads nothing an earlier launch wrote before that launch completed, and completes only after
it did, so the stream's order holds transitively; nothing else in the sources uses griddepcontrol.

The launcher's side: the ctypes structures have cuda.h's layout (a C program built against cuda.h prints it, where
cuda.h is on this machine), and a stand-in libcuda built here (a C cuLaunchKernelEx that records what it was given)
receives the grid, block, stream, the PROGRAMMATIC_STREAM_SERIALIZATION attribute and every argument's bytes as CuPy's
RawKernel would pack them."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from lanefuse.kernels import pdl
from test_kernel_lint import strip_comments

CUDA_H = next((p for p in (Path("/usr/local/cuda/include/cuda.h"),
                           *sorted(Path("/usr/local").glob("cuda-*/include/cuda.h"))) if p.exists()), None)
CC = shutil.which("gcc") or shutil.which("cc")


def kernel_sources() -> dict[str, str]:
    d = resources.files("lanefuse.kernels")
    return {f.name: f.read_text() for f in d.iterdir() if f.name.endswith(".cu")}


def global_bodies(src: str):
    """(kernel name, the body's text from its opening brace) of every __global__ function in `src` (comments
    stripped, macro continuations joined)."""
    out = []
    for m in re.finditer(r"\b__global__\b", src):
        i = m.end()
        head = re.match(r"\s*void\s+(?:__launch_bounds__\s*\([^)]*\)\s*|GEMV_BOUNDS\s+)?(\w+(?:##\w+)?)\s*\(", src[i:])
        assert head, f"cannot read the kernel declared at ...{src[i:i + 80]!r}"
        j, depth = i + head.end() - 1, 0
        for j in range(j, len(src)):
            depth += {"(": 1, ")": -1}.get(src[j], 0)
            if depth == 0:
                break
        k = src.index("{", j)
        out.append((head.group(1), src[k + 1:]))
    return out


ENTRY = re.compile(r"\s*(?:\w*prefetch\w*(?:<[^;{}]*>)?\([^;{}]*\);\s*)?PDL_ENTER\(\);")


def test_every_kernel_enters_through_pdl_enter_first():
    bad, n = [], 0
    for name, src in kernel_sources().items():
        if name == "prelude.cu":
            continue
        for kernel, body in global_bodies(strip_comments(src)):
            n += 1
            if not ENTRY.match(body.replace("\\\n", " ")):
                bad.append(f"{name}: {kernel}: {body[:60].strip()!r}")
    assert n >= 40, n
    assert not bad, "kernels whose body does not start with PDL_ENTER():\n" + "\n".join(bad)


def test_the_lint_fails_a_kernel_that_reads_before_it_waits():
    src = 'extern "C" __global__ void GEMV_BOUNDS k(const float* x, float* y) { y[0] = x[0]; PDL_ENTER(); }'
    (name, body), = global_bodies(src)
    assert name == "k" and not ENTRY.match(body)
    ok = 'extern "C" __global__ void __launch_bounds__(128, 3) k(const float* w) { w_prefetch<4>(w, 8); PDL_ENTER(); }'
    (_, body), = global_bodies(ok)
    assert ENTRY.match(body)


def test_griddepcontrol_only_in_the_prelude():
    for name, src in kernel_sources().items():
        if name != "prelude.cu":
            assert "griddepcontrol" not in src, name


def test_pdl_macros_are_guarded_to_sm90():
    p = kernel_sources()["prelude.cu"]
    guard = p.index("#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900")
    assert guard < p.index("griddepcontrol.wait") < p.index("#else", guard) < p.index("#define PDL_WAIT()\n")


# -- the launcher ------------------------------------------------------------------------------------------------------

LAYOUT_C = r"""
#include <stdio.h>
#include <stddef.h>
#include <cuda.h>
int main(void) {
    printf("%zu %zu %zu %zu %zu %zu %zu %d\n", sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, sharedMemBytes),
           offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs),
           sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value),
           (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
    return 0;
}
"""


@pytest.mark.skipif(CUDA_H is None or CC is None, reason="needs cuda.h and a C compiler")
def test_ctypes_structures_have_cuda_h_layout(tmp_path):
    (tmp_path / "l.c").write_text(LAYOUT_C)
    subprocess.run([CC, "-I", str(CUDA_H.parent), "-o", str(tmp_path / "l"), str(tmp_path / "l.c")], check=True)
    got = [int(v) for v in subprocess.run([str(tmp_path / "l")], capture_output=True, text=True,
                                          check=True).stdout.split()]
    C, A = pdl.LaunchConfig, pdl.LaunchAttribute
    assert got == [ctypes.sizeof(C), C.sharedMemBytes.offset, C.hStream.offset, C.attrs.offset, C.numAttrs.offset,
                   ctypes.sizeof(A), A.value.offset, pdl.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION]


FAKE_C = r"""
#include <string.h>
typedef struct { int id; char pad[4]; int value; char vpad[60]; } Attr;
typedef struct { unsigned gx, gy, gz, bx, by, bz, smem; void* stream; Attr* attrs; unsigned nattrs; } Config;
static unsigned long long seen[16];
static unsigned char params[4096];
static int sizes[64], nsizes;
void set_sizes(int n, const int* s) { nsizes = n; memcpy(sizes, s, n * sizeof(int)); }
unsigned long long got(int i) { return seen[i]; }
unsigned char* got_params(void) { return params; }
int cuLaunchKernelEx(const Config* c, void* f, void** kp, void** extra) {
    seen[0] = c->gx; seen[1] = c->gy; seen[2] = c->gz; seen[3] = c->bx; seen[4] = c->by; seen[5] = c->bz;
    seen[6] = c->smem; seen[7] = (unsigned long long)c->stream; seen[8] = c->nattrs;
    seen[9] = c->nattrs ? c->attrs[0].id : 99; seen[10] = c->nattrs ? c->attrs[0].value : 99;
    seen[11] = (unsigned long long)f; seen[12] = (unsigned long long)extra;
    int at = 0;
    for (int i = 0; i < nsizes; i++) { memcpy(params + at, kp[i], sizes[i]); at += sizes[i]; }
    return seen[0] == 777 ? 1 : 0;  /* grid x 777: a failed launch */
}
"""


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory):
    if CC is None:
        pytest.skip("needs a C compiler")
    d = tmp_path_factory.mktemp("fakecuda")
    (d / "f.c").write_text(FAKE_C)
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(d / "libfake.so"), str(d / "f.c")], check=True)
    lib = ctypes.CDLL(str(d / "libfake.so"))
    lib.got.restype = ctypes.c_ulonglong
    lib.got_params.restype = ctypes.POINTER(ctypes.c_ubyte)
    return lib


class _Mem:
    def __init__(self, ptr):
        self.ptr = ptr


class DeviceArray:
    """What the launcher sees of a cupy.ndarray: `.data.ptr`."""

    def __init__(self, ptr):
        self.data = _Mem(ptr)


def test_launch_passes_config_attribute_and_argument_bytes(fake_cuda):
    args = (DeviceArray(0xDEAD0000), np.uint64(0), np.int64(-5), np.float32(1.5), np.int32(7), 3, 2.5, True)
    want = b"".join(pdl.arg_bytes(a) for a in args)
    assert want == (np.uint64(0xDEAD0000).tobytes() + bytes(8) + np.int64(-5).tobytes() + np.float32(1.5).tobytes()
                    + np.int32(7).tobytes() + np.int64(3).tobytes() + np.float64(2.5).tobytes() + b"\x01")
    sizes = [len(pdl.arg_bytes(a)) for a in args]
    fake_cuda.set_sizes(len(sizes), (ctypes.c_int * len(sizes))(*sizes))
    pdl.Launcher(fake_cuda)(0x1234, (9, 2), (128,), args, stream=0xABC, shared_mem=48)
    seen = [fake_cuda.got(i) for i in range(13)]
    assert seen == [9, 2, 1, 128, 1, 1, 48, 0xABC, 1, pdl.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1,
                    0x1234, 0]
    assert bytes(fake_cuda.got_params()[:len(want)]) == want


def test_launch_error_is_raised_with_its_code(fake_cuda):
    fake_cuda.set_sizes(0, (ctypes.c_int * 1)())
    with pytest.raises(RuntimeError, match="CUresult 1"):
        pdl.Launcher(fake_cuda)(1, 777, 32, (), stream=0)


def test_a_host_array_is_refused_as_an_argument():
    with pytest.raises(TypeError, match="ndarray"):
        pdl.arg_bytes(np.zeros(3, np.float32))
