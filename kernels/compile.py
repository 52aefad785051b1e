"""Kernel sources and their compiled modules: a kind's source is prelude.cu followed by the .cu files its stems name;
CuPy compiles it with NVRTC under `OPTIONS`, one module per (source, arch), cached. CuPy is imported only here, lazily."""

from __future__ import annotations

import hashlib
from functools import lru_cache
from importlib import resources
from pathlib import Path

OPTIONS = ("-std=c++17",)  # CuPy adds --gpu-architecture itself
ARCHS = ("sm_80", "sm_90")


@lru_cache(maxsize=None)
def cu_text(stem: str) -> str:
    return resources.files("lanefuse.kernels").joinpath(f"{stem}.cu").read_text()


def source(stems: tuple[str, ...]) -> str:
    """The full source of a module built from `stems` (each a .cu beside this file), the prelude first."""
    return "\n".join(cu_text(s) for s in ("prelude",) + tuple(stems))


def cache_key(src: str, arch: str) -> str:
    return hashlib.sha256((arch + "\0" + " ".join(OPTIONS) + "\0" + src).encode()).hexdigest()[:24]


def cubin_file(src: str, arch: str) -> str:
    """The file name a module's cubin built ahead of time is kept under (kernels/prebuilt.py): its run-time cache key,
    so a cubin of an older source or another arch is never taken for this one."""
    return f"{cache_key(src, arch)}.cubin"


def find_cubin(src: str, arch: str, folder) -> Path | None:
    """The cubin of module source `src` for `arch` built ahead of time into `folder`, if it is there."""
    if not folder:
        return None
    p = Path(folder) / cubin_file(src, arch)
    return p if p.is_file() else None


_MODULES: dict[str, object] = {}


def module(stems: tuple[str, ...]):
    """The CuPy RawModule of `stems` for the current device's arch: the cubin `LANEFUSE_CUBINS` holds for this source
    and arch (kernels/prebuilt.py), else compiled once a process (CuPy also keeps its own on-disk cache keyed by
    source and options)."""
    import cupy

    dev = cupy.cuda.Device()
    arch = "sm_" + dev.compute_capability
    src = source(stems)
    key = cache_key(src, arch)
    m = _MODULES.get(key)
    if m is None:
        from lanefuse.engine import flags

        cubin = find_cubin(src, arch, flags.read("LANEFUSE_CUBINS"))  # built ahead of time (lanefuse kernels --build)
        m = (cupy.RawModule(path=str(cubin)) if cubin is not None
             else cupy.RawModule(code=src, options=OPTIONS, name_expressions=None))
        _MODULES[key] = m
    return m


def function(stems: tuple[str, ...], name: str):
    return module(stems).get_function(name)
