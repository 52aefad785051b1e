"""Programmatic dependent launch (issue 34 item 4): a kernel launched through the driver's cuLaunchKernelEx with the
PROGRAMMATIC_STREAM_SERIALIZATION attribute may be scheduled while the launch before it on the stream still runs (its
blocks get resident as the earlier grid's last blocks pass their PDL_ENTER), and waits in its own PDL_ENTER
(`griddepcontrol.wait`, kernels/prelude.cu) until that grid has completed and its writes are visible. What it does
before the wait is only read-only work on its weights (a GEMV's L2 prefetch), so the numbers stay the stream order's.
Under stream capture the attribute becomes a programmatic edge of the CUDA graph.

CuPy's RawKernel cannot pass launch attributes, so this module calls libcuda through ctypes (no extra package: the
device machine has the driver, not cuda-python). The arguments are packed as CuPy packs them for a RawKernel: a device
array as its address (8 bytes), a numpy scalar as its own bytes, a Python int / float / bool as int64 / float64 / bool.

Used by kernels/cupy_env.py's DeviceEnv when LANEFUSE_PDL is on (engine/flags.py); off by default until the device
measures that it pays (bench/gpu_decode.py runs the bf16 plan both ways)."""

from __future__ import annotations

import ctypes

import numpy as np

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # cuda.h, CUlaunchAttributeID


class LaunchAttribute(ctypes.Structure):
    """cuda.h's CUlaunchAttribute: an enum id, padding to 8 bytes, a 64-byte value union (here its int member)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_pad", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def arg_bytes(x) -> bytes:
    """One kernel argument's bytes, as CuPy's RawKernel passes it."""
    data = getattr(x, "data", None)
    if data is not None and hasattr(data, "ptr") and not isinstance(x, np.generic):
        return np.uint64(int(data.ptr)).tobytes()  # a device array: its address
    if isinstance(x, np.generic):
        return x.tobytes()
    if isinstance(x, (bool, np.bool_)):
        return np.bool_(x).tobytes()
    if isinstance(x, int):
        return np.int64(x).tobytes()
    if isinstance(x, float):
        return np.float64(x).tobytes()
    raise TypeError(f"a kernel argument of type {type(x).__name__} cannot be passed to a launch")


def _dims(d) -> tuple[int, int, int]:
    d = tuple(int(v) for v in (d if isinstance(d, (tuple, list)) else (d,)))
    return (d + (1, 1, 1))[:3]


class Launcher:
    """cuLaunchKernelEx with programmatic stream serialization; `lib` a loaded libcuda (a stand-in in the CPU
    tests)."""

    def __init__(self, lib=None):
        self.lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
        self.fn = self.lib.cuLaunchKernelEx
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                            ctypes.c_void_p]

    def __call__(self, func: int, grid, block, args, stream: int, shared_mem: int = 0) -> None:
        """Launch CUfunction `func` (CuPy's Function.ptr) on CUstream `stream` (0: the legacy default stream)."""
        bufs = [ctypes.create_string_buffer(arg_bytes(a)) for a in args]
        params = (ctypes.c_void_p * max(len(bufs), 1))(*[ctypes.cast(b, ctypes.c_void_p) for b in bufs])
        attr = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        (gx, gy, gz), (bx, by, bz) = _dims(grid), _dims(block)
        cfg = LaunchConfig(gx, gy, gz, bx, by, bz, int(shared_mem), ctypes.c_void_p(int(stream) or None),
                           ctypes.pointer(attr), 1)
        rc = self.fn(ctypes.byref(cfg), ctypes.c_void_p(int(func)), params, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc} ({_error_name(self.lib, rc)})")


def _error_name(lib, rc: int) -> str:
    try:
        s = ctypes.c_char_p()
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuGetErrorName(rc, ctypes.byref(s))
        return (s.value or b"?").decode()
    except (AttributeError, OSError):
        return "?"


_LAUNCHER: Launcher | None = None


def launcher() -> Launcher:
    global _LAUNCHER
    if _LAUNCHER is None:
        _LAUNCHER = Launcher()
    return _LAUNCHER
