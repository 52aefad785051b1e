"""The device Env the CUDA side of every launch runs against: one device allocation for the step's arena with each
placed array a view at its offset, the arrays a step carries (caches, token, position, logits) on the device, the
weights uploaded once, scratch and arrival counters, and small descriptor tables. CuPy is imported lazily."""

from __future__ import annotations

import numpy as np

from lanefuse.engine import flags
from lanefuse.kernels.common import Dst, Launch, Scratch
from lanefuse.kernels.compile import function

NULL = np.uint64(0)


def i64(v) -> np.int64:
    return np.int64(int(v))


def f32(v) -> np.float32:
    return np.float32(v)


class DeviceEnv:
    """`arena_bytes` bytes on the device; `placed` {name: (offset, nbytes, dtype "f32"|"i32")} views into it;
    `arrays` {name: numpy array} held apart (caches, step inputs and outputs), uploaded now; `weights` {name: (numpy
    raw, format)} uploaded once; `scratch` {(launch key, tag): offset} a launch's scratch placed in the arena (any
    other scratch gets a buffer of its own; counters always do, zeroed once)."""

    pdl = False

    def __init__(self, arena_bytes: int, placed: dict[str, tuple[int, int, str]] | None = None,
                 arrays: dict[str, np.ndarray] | None = None,
                 weights: dict[str, tuple[np.ndarray, str]] | None = None,
                 scratch: dict[tuple[str, str], int] | None = None,
                 quantized: dict[str, tuple[int, int]] | None = None, arena=None):
        import cupy

        self.cp = cupy
        # `arena`: a device byte buffer of at least `arena_bytes` the plan's forms share (lane/run/cupy_runner.py)
        if arena is not None and arena.size < arena_bytes:
            raise ValueError(f"a shared arena of {arena.size} bytes for a plan of {arena_bytes}")
        self.arena = arena if arena is not None else cupy.zeros(max(int(arena_bytes), 1), dtype=cupy.uint8)
        self.views: dict[str, object] = {}
        for name, (offset, nbytes, dtype) in (placed or {}).items():
            self.views[name] = self.arena[offset:offset + nbytes].view(np.dtype(_np_dtype(dtype)))
        for name, a in (arrays or {}).items():
            self.views[name] = cupy.asarray(np.ascontiguousarray(_word_array(name, a)).reshape(-1))
        self.weights = {n: (cupy.asarray(np.ascontiguousarray(_f32_weight(n, raw, fmt))).reshape(-1), fmt)
                        for n, (raw, fmt) in (weights or {}).items()}
        self.scratch_at = dict(scratch or {})
        self.quantized = dict(quantized or {})  # a quantized form's name -> (values, words): its bytes in `placed`;
        # a row of one read quantized (a view into it): (values, words, the form's values, its first value there)
        self._scratch: dict[tuple[str, str], object] = {}
        self._tables: dict[str, object] = {}
        # every kernel through cuLaunchKernelEx with programmatic stream serialization (kernels/pdl.py): LANEFUSE_PDL=1
        # on a device of compute capability 9.0 or above (below, griddepcontrol does not exist: the flag is ignored)
        self.pdl = bool(flags.read("LANEFUSE_PDL")) and self.pdl_able

    @property
    def pdl_able(self) -> bool:
        """Whether this device has programmatic dependent launch (compute capability 9.0 or above)."""
        return int(self.cp.cuda.Device().compute_capability) >= 90

    # -- the Env protocol, on the device ---------------------------------------------------------------------------
    def array(self, name: str):
        if name not in self.views:
            raise KeyError(f"no device array `{name}` (have: {', '.join(sorted(self.views))})")
        return self.views[name]

    def weight(self, name: str):
        if name not in self.weights:
            raise KeyError(f"no device weight `{name}` (have: {', '.join(sorted(self.weights))})")
        return self.weights[name]

    def param(self, name: str) -> int:
        """The parameter's value on the host (a device sync: for tests and the host side only)."""
        return int(self.array(name)[0].get())

    # -- what the launches' cuda() use -----------------------------------------------------------------------------
    def ptr(self, name: str | None) -> int:
        """The device address of an array or weight (0 for None)."""
        if name is None:
            return 0
        a = self.views.get(name)
        if a is None:
            a = self.weight(name)[0]
        return int(a.data.ptr)

    def opt(self, name: str | None):
        """A kernel argument for an optional array: the array, or a null pointer."""
        if name is None:
            return NULL
        return self.array(name) if name in self.views else self.weight(name)[0]

    def quant(self, name: str) -> tuple:
        """Tensor `name`'s quantized form (a byte view of its array): its words, low words (None under one word, as
        HostEnv.quant gives them: `function`'s kernels take a None argument as a null pointer) and scales
        (kernels/quant.py's layout)."""
        from lanefuse.kernels.common import Q8K, QSUM, qblock, quant_parts_at

        if name not in self.quantized:
            raise KeyError(f"`{name}` has no quantized form on the device")
        n, words, *home = self.quantized[name]  # a row read quantized: (its home's values, its first value there)
        a = self.array(name)
        at, lo, sc = quant_parts_at(n, words, *home)
        low = (a[lo:lo + n].view(self.cp.int8) if words == 2 else
               a[lo:lo + 2 * (n // QSUM)].view(self.cp.int16) if words == Q8K else None)  # q8k: its sums of 16
        return a[at:at + n].view(self.cp.int8), low, a[sc:sc + 4 * (n // qblock(words))].view(self.cp.float32)

    def quant_addresses(self, name: str) -> tuple[int, int, int]:
        """Tensor `name`'s quantized form as the three device addresses a launch's descriptor table holds (its words,
        low words or sums (0: none), scales)."""
        return tuple(0 if a is None or isinstance(a, np.uint64) else int(a.data.ptr) for a in self.quant(name))

    def dst_words(self, d: Dst) -> tuple[int, ...]:
        """A Dst as the seven words the kernels take (pointers as their integer addresses)."""
        rowp = self.ptr(d.row) if isinstance(d.row, str) else 0
        fixed = -d.slot if d.slot else int(d.row) if isinstance(d.row, int) else 0  # a batch's: -slot (prelude.cu)
        u = d.unit
        return (self.ptr(d.buf), rowp, fixed, d.pitch, u.pitch if u else 0, u.offset if u else 0, u.width if u else 0)

    def dst(self, d: Dst) -> tuple:
        w = self.dst_words(d)
        return (np.uint64(w[0]), np.uint64(w[1])) + tuple(i64(x) for x in w[2:])

    def scratch(self, launch: Launch, s: Scratch):
        key = (launch.key(), s.tag)
        a = self._scratch.get(key)
        if a is None:
            dt = np.dtype(_np_dtype(s.dtype))
            n = max(s.nbytes // dt.itemsize, 1)
            if key in self.scratch_at and not s.counter:
                off = self.scratch_at[key]
                a = self.arena[off:off + n * dt.itemsize].view(dt)
            else:
                a = self.cp.zeros(n, dtype=dt)
            self._scratch[key] = a
        return a

    def table(self, key: str, words: list[int]):
        """A small int64 descriptor table on the device, uploaded once per key (pointers are stable)."""
        t = self._tables.get(key)
        if t is None:
            t = self.cp.asarray(np.array([int(w) for w in words], dtype=np.int64))
            self._tables[key] = t
        return t

    def function(self, stems: tuple[str, ...], name: str):
        """Kernel `name` of the module `stems` build; a None among its arguments is passed as a null pointer (CuPy
        itself would pass a null address of the argument, not a null value)."""
        f = function(stems, name)
        if self.pdl:  # programmatic dependent launch (kernels/pdl.py), on the current stream
            from lanefuse.kernels.pdl import launcher

            launch = launcher()

            def call(grid, block, args, shared_mem=0):
                launch(f.ptr, grid, block, tuple(NULL if x is None else x for x in args),
                       self.cp.cuda.get_current_stream().ptr, shared_mem)

            return call

        def call(grid, block, args, *a, **kw):
            return f(grid, block, tuple(NULL if x is None else x for x in args), *a, **kw)

        return call

    def blas(self):
        """cuBLAS through CuPy's binding and CuPy's handle for this device (kernels/gemm_blas.py): its gemmEx sets the
        handle's stream to CuPy's current stream on every call."""
        from cupy_backends.cuda.libs import cublas

        return cublas, self.cp.cuda.device.get_cublas_handle()

    def host(self, name: str) -> np.ndarray:
        return self.cp.asnumpy(self.array(name))


def _np_dtype(dtype: str):
    return {"f32": np.float32, "i32": np.int32, "u8": np.uint8}[dtype]


def _word_array(name: str, a) -> np.ndarray:
    """Array `a`, refused where the kernels would misread it: they read f32 and i32 words, so a float64 (or f16)
    array's bytes would be read as garbage f32 values, an int64 one's as pairs of i32 (HostEnv's twins, reading values,
    would take either)."""
    a = np.asarray(a)
    if (a.dtype.kind == "f" and a.dtype != np.float32) or (a.dtype.kind in "iu" and a.dtype.itemsize > 4):
        raise TypeError(f"device array `{name}` is {a.dtype}: the kernels read f32 / i32 words (make it float32 or "
                        f"int32)")
    return a


def _f32_weight(name: str, raw, fmt: str) -> np.ndarray:
    """Weight `raw` in format `fmt`, refused where it claims "f32" but holds other values (the kernels read its bytes
    as f32)."""
    raw = np.asarray(raw)
    if fmt == "f32" and raw.dtype != np.float32:
        raise TypeError(f"device weight `{name}` in format f32 is {raw.dtype} (make it float32)")
    return raw
