"""The CUDA host emulator's Python side: a kernel module (prelude.cu and the .cu files its stems name, unmodified but
for each inline-PTX `asm` swapped for emu.h's function of it) built by g++ against emu.h as a shared library, one
exported entry a kernel, loaded with ctypes; a stand-in `cupy` (numpy arrays at 256-byte aligned addresses, as
cudaMalloc aligns them) and `EmuEnv`, the real DeviceEnv whose `function(stems, name)` returns a callable taking
CuPy RawKernel's (grid, block, args): each launch kind's own `cuda()` (its argument packing, grids, scratch, tables)
runs unmodified against the emulated kernels. Every argument is checked against the kernel's parameter list (count,
scalar types as CuPy would pass them, pointee against the array's dtype) before the launch."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import types
import weakref
from pathlib import Path

import numpy as np
from lanefuse.engine import flags

HERE = Path(__file__).parent
EMU_H = HERE / "emu.h"
FLAGS = ("-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off",
         "-fno-strict-aliasing", "-fsanitize=alignment,bounds", "-fsanitize-undefined-trap-on-error", "-w")

_ASM = re.compile(r'asm(?:\s+volatile)?\s*\(\s*"([^"]*)"\s*:\s*"=[a-z]"\s*\((\w+)\)\s*:\s*"[a-z]"\s*\(([^()]*)\)\s*\)\s*;')
# A source's `// emu: begin NAME` .. `// emu: end NAME` region (PTX wrappers whose asm the one-output swap cannot
# express: mma.sync, ldmatrix, cp.async) is dropped; emu.h defines the same functions for the host.
_REGION = re.compile(r"^// emu: begin (\w+).*?^// emu: end \1[^\n]*$", re.S | re.M)
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(')
# A device-only branch (`#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= N` .. `#else` .. `#endif`: prelude.cu's
# programmatic-dependent-launch macros) is compiled for the host as its `#else` branch.
_DEVICE_ONLY = re.compile(r"^#if defined\(__CUDA_ARCH__\) && __CUDA_ARCH__ >= \d+\n.*?^#else\n(.*?)^#endif[^\n]*$",
                          re.S | re.M)


def compiler() -> str | None:
    return shutil.which("g++")


def host_source(stems: tuple[str, ...]) -> str:
    """The module's CUDA source with each `asm("op a, b;" : "=c"(out) : "c"(in));` as `out = emu_asm_op(in);`, each
    `emu: begin` region dropped (emu.h holds its functions)."""
    from lanefuse.kernels.compile import source

    def swap(m):
        op = m.group(1).split()[0].rstrip(";").replace(".", "_")
        return f"{m.group(2)} = emu_asm_{op}({m.group(3)});"

    src = _ASM.sub(swap, _REGION.sub("", source(stems)))
    left = re.search(r"\basm\b.*", _DEVICE_ONLY.sub(r"\1", src))  # g++'s preprocessor takes the #else
    if left:
        raise RuntimeError(f"inline PTX the emulator does not know: {left.group(0)}")
    return src


def kernel_names(src: str, cxx: str) -> list[str]:
    """The module's kernels: `extern "C" __global__` functions after the preprocessor (macros make most of them)."""
    pre = subprocess.run([cxx, "-E", "-P", "-x", "c++", "-D__launch_bounds__(...)=", "-"], input=src,
                         capture_output=True, text=True, check=True).stdout
    return sorted(set(_KERNEL.findall(pre)))


def cache_dir() -> Path:
    d = Path(flags.read("LANEFUSE_EMU_CACHE") or Path(tempfile.gettempdir()) / f"lanefuse-emu-{os.getuid()}")
    d.mkdir(parents=True, exist_ok=True)
    return d


def build(stems: tuple[str, ...]) -> tuple[Path, list[str]]:
    """The shared library of module `stems` and its kernels' names (built once, cached by the hash of its source,
    emu.h and the flags)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no g++ to build the emulated kernels")
    src = host_source(tuple(stems))
    key = hashlib.sha256("\0".join((EMU_H.read_text(), src, " ".join(FLAGS), cxx)).encode()).hexdigest()[:20]
    d = cache_dir()
    base = d / f"{'_'.join(stems)}-{key}"
    so, listed = base.with_suffix(".so"), base.with_suffix(".kernels")
    if so.exists() and listed.exists():
        return so, listed.read_text().split()
    names = kernel_names(src, cxx)
    text = (f'#include "{EMU_H}"\n#line 1 "{"+".join(("prelude",) + tuple(stems))}.cu"\n' + src + "\n"
            + "".join(f"EMU_EXPORT({n})\n" for n in names))
    cpp = base.with_suffix(f".{os.getpid()}.cpp")  # each process its own files, renamed into place (atomic):
    cpp.write_text(text)                             # parallel sessions share the cache
    tmp = base.with_suffix(f".{os.getpid()}.tmp")
    p = subprocess.run([cxx, *FLAGS, "-o", str(tmp), str(cpp)], capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"g++ failed on {cpp}:\n{p.stderr[-6000:]}")
    lt = base.with_suffix(f".{os.getpid()}.lst")
    lt.write_text(" ".join(names))
    os.replace(lt, listed)
    os.replace(tmp, so)
    os.replace(cpp, base.with_suffix(".cpp"))  # kept beside the library: what g++ compiled, for a look
    return so, names


# -- arguments as CuPy passes them -------------------------------------------------------------------------------------

_POINTEE = {"pf": ("f4",), "pi": ("i4", "u4"), "pI": ("u4", "i4"), "pl": ("i8", "u8"), "pb": None,
            "pB": None, "ph": ("i2", "u2"), "pH": ("u2", "i2"), "pv": None}  # char*: any bytes (a q8k form's
# int16 sums go through signed char* parameters, cast back in the kernel)


def _slot(code: str, a, i: int, kernel: str) -> int:
    """Argument `a` for parameter `code` as the 8 bytes of its slot (a little-endian integer)."""
    where = f"{kernel}: argument {i} ({code})"
    if code.startswith("p"):
        if a is None:
            return 0
        if isinstance(a, np.ndarray):
            want = _POINTEE.get(code)
            if want is not None and a.dtype.str[1:] not in want:
                raise TypeError(f"{where}: an array of {a.dtype} for a pointer to {code[1]} ({'/'.join(want)})")
            return a.__array_interface__["data"][0]
        if isinstance(a, np.uint64):  # a null pointer (cupy_env.NULL) or an address
            return int(a)
        raise TypeError(f"{where}: {type(a).__name__} {a!r} for a pointer")
    if code == "l":
        if isinstance(a, (np.int64, int)) and not isinstance(a, bool):  # CuPy passes a Python int as int64
            return int(a) & 0xFFFFFFFFFFFFFFFF
        raise TypeError(f"{where}: {type(a).__name__} {a!r} for an i64 (CuPy would pass its own bytes)")
    if code == "f":
        if isinstance(a, np.float32):
            return struct.unpack("<I", struct.pack("<f", float(a)))[0]
        raise TypeError(f"{where}: {type(a).__name__} {a!r} for a float (CuPy passes a Python float as a double)")
    if code in ("i", "I"):
        if isinstance(a, (np.int32, np.uint32)):
            return int(a) & 0xFFFFFFFF
        raise TypeError(f"{where}: {type(a).__name__} {a!r} for a 32-bit integer")
    raise TypeError(f"{where}: a parameter type the emulator does not know")


class Kernel:
    def __init__(self, lib, name: str):
        self.name = name
        self.fn = getattr(lib, f"emu_{name}")
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint),
                            ctypes.POINTER(ctypes.c_void_p), ctypes.c_ulonglong, ctypes.c_ulonglong]
        sig = getattr(lib, f"emu_sig_{name}")
        sig.restype = ctypes.c_char_p
        self.params = sig().decode().split()
        self.err = lib.emu_error
        self.err.restype = ctypes.c_char_p
        self.launches = 0

    def __call__(self, grid, block, args, flags: int = 0, seed: int = 0):
        args = tuple(args)
        if len(args) != len(self.params):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.params)} parameters "
                            f"({' '.join(self.params)})")
        slots = (ctypes.c_uint64 * max(len(args), 1))(*[_slot(c, a, i, self.name)
                                                       for i, (c, a) in enumerate(zip(self.params, args))])
        ptrs = (ctypes.c_void_p * max(len(args), 1))(
            *[ctypes.addressof(slots) + 8 * i for i in range(len(args))])
        g = (tuple(grid) + (1, 1, 1))[:3]
        b = (tuple(block) + (1, 1, 1))[:3]
        rc = self.fn((ctypes.c_uint * 3)(*map(int, g)), (ctypes.c_uint * 3)(*map(int, b)), ptrs, flags, seed)
        self.launches += 1
        if rc:
            raise RuntimeError(f"emulated {self.name} grid {g} block {b}: {self.err().decode()}")


class Module:
    def __init__(self, so: Path, names: list[str]):
        self.so, self.names = so, names
        self.lib = ctypes.CDLL(str(self.so))
        self.kernels = {n: Kernel(self.lib, n) for n in self.names}

    def function(self, name: str) -> Kernel:
        if name not in self.kernels:
            raise KeyError(f"no kernel `{name}` in this module (have: {', '.join(self.names)})")
        return self.kernels[name]


_MODULES: dict[Path, Module] = {}


def module(stems: tuple[str, ...]) -> Module:
    """The loaded module of `stems` as their sources read now (a changed source: another library)."""
    so, names = build(tuple(stems))
    m = _MODULES.get(so)
    if m is None:
        m = _MODULES[so] = Module(so, names)
    return m


# -- the stand-in cupy -------------------------------------------------------------------------------------------------

ALIGN = 256  # cudaMalloc's alignment (at least)
REDZONE = 256  # bytes of 0xff each side of an allocation (a float read there is NaN), checked after every launch
_GUARDED: list[tuple[weakref.ref, int, int]] = []


class Arr(np.ndarray):
    """A numpy array standing for a CuPy one: `.data.ptr` its address, `.get()` a host copy."""

    def get(self):
        return np.asarray(self).copy()

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])


def _alloc(n: int, dtype) -> Arr:
    """n zeros of `dtype` at an ALIGN-aligned address, REDZONE bytes of 0xff (NaN as f32, -1 as ints) each side."""
    dt = np.dtype(dtype)
    nbytes = n * dt.itemsize
    raw = np.full(nbytes + 2 * REDZONE + ALIGN, 0xFF, np.uint8)
    off = REDZONE + -(raw.__array_interface__["data"][0] + REDZONE) % ALIGN
    raw[off:off + nbytes] = 0
    _GUARDED.append((weakref.ref(raw), off, nbytes))
    return raw[off:off + nbytes].view(dt).view(Arr)


def redzone_breaches() -> list[str]:
    """The allocations whose red zones a launch wrote into (a store out of bounds), each as words."""
    bad, live = [], []
    for ref, off, nbytes in _GUARDED:
        raw = ref()
        if raw is None:
            continue
        live.append((ref, off, nbytes))
        for name, zone, at in (("before", raw[:off], 0), ("past", raw[off + nbytes:], off + nbytes)):
            hit = np.flatnonzero(zone != 0xFF)
            if hit.size:
                bad.append(f"an allocation of {nbytes} bytes at {raw.__array_interface__['data'][0] + off:#x}: "
                           f"{hit.size} bytes written {name} its end (first at byte {int(at + hit[0] - off)} of it)")
                raw[:off] = 0xFF
                raw[off + nbytes:] = 0xFF
    _GUARDED[:] = live
    return bad


def fake_cupy() -> types.ModuleType:
    cp = types.ModuleType("cupy")
    for n in ("float32", "int32", "uint8", "uint16", "float16", "int64", "uint32", "int8", "int16", "uint64"):
        setattr(cp, n, getattr(np, n))
    cp.ndarray = Arr

    def zeros(shape, dtype=np.float32):
        n = int(np.prod(shape))
        return _alloc(n, dtype).reshape(shape)

    def asarray(a, dtype=None):
        a = np.asarray(a, dtype=dtype)
        out = _alloc(a.size, a.dtype).reshape(a.shape)
        out[...] = a
        return out

    cp.zeros = zeros
    cp.asarray = asarray
    cp.asnumpy = lambda a, stream=None: np.asarray(a).copy()
    cp.cuda = types.SimpleNamespace(Device=lambda *a: types.SimpleNamespace(synchronize=lambda: None,
                                                                           compute_capability="90"))
    return cp


def emu_env_class():
    """EmuEnv: kernels/cupy_env.py's DeviceEnv (under the stand-in cupy) whose kernels are the emulated ones. `flags`
    (bit 0: the blocks in reverse order) and `seed` (nonzero: the threads of a block run in a shuffled order between
    barriers) apply to every launch; `calls` records (kernel, grid, block) of each."""
    from lanefuse.kernels.cupy_env import NULL, DeviceEnv

    class EmuEnv(DeviceEnv):
        flags = 0
        seed = 0

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.calls: list[tuple[str, tuple, tuple]] = []

        def param(self, name: str) -> int:
            return int(np.asarray(self.array(name))[0])

        def function(self, stems, name):
            k = module(tuple(stems)).function(name)

            def call(grid, block, args, *a, **kw):
                self.calls.append((name, tuple(grid), tuple(block)))
                k(grid, block, tuple(NULL if x is None else x for x in args), self.flags, self.seed)
                bad = redzone_breaches()
                if bad:
                    raise RuntimeError(f"emulated {name} grid {tuple(grid)}: stores out of bounds: {'; '.join(bad)}")

            return call

    return EmuEnv


def install(monkeypatch=None):
    """The stand-in cupy in sys.modules (through `monkeypatch` when given, undone after the test)."""
    cp = fake_cupy()
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, "cupy", cp)
    else:
        sys.modules["cupy"] = cp
    return cp


@contextlib.contextmanager
def emulating(modules, jobs: int = 2):
    """For a with-block (a module fixture's body): every module of `modules` built, `jobs` at a time (cached across
    sessions by their sources' hash), the stand-in cupy in sys.modules and lanefuse's DeviceEnv the emulating one;
    yields that DeviceEnv class. Both undone after."""
    import pytest
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(jobs) as ex:
        list(ex.map(build, modules))
    from lanefuse.kernels import cupy_env

    with pytest.MonkeyPatch.context() as mp:
        install(mp)
        env = emu_env_class()
        mp.setattr(cupy_env, "DeviceEnv", env)
        yield env
