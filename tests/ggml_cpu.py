"""llama.cpp's own CPU functions, called through ctypes from the libggml-cpu that llama-cpp-python ships: its
quantize_row_q8_0 / q8_1 / q8_K, ggml_vec_dot_<format>_<activation> and ggml_vec_swiglu_f32, the oracles that
engine/formats/ggml.py restates bit for bit. `lib()` is None where llama-cpp-python is not installed."""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import numpy as np

VEC_DOT_TYPE = {"q8_0": "q8_0", "q4_0": "q8_0", "q5_0": "q8_0", "iq4_nl": "q8_0", "q4_1": "q8_1", "q5_1": "q8_1",
                "q2_k": "q8_K", "q3_k": "q8_K", "q4_k": "q8_K", "q5_k": "q8_K", "q6_k": "q8_K", "iq4_xs": "q8_K"}
FORM_BYTES = {"q8_0": (32, 34), "q8_1": (32, 36), "q8_K": (256, 292)}  # values and bytes of a block of each form


@lru_cache(maxsize=1)
def lib():
    try:
        import llama_cpp
    except ImportError:
        return None
    found = sorted((Path(llama_cpp.__file__).parent / "lib").glob("libggml-cpu.so*"))
    if not found:
        return None
    so = ctypes.CDLL(str(found[0]))
    if hasattr(so, "ggml_cpu_init"):
        so.ggml_cpu_init()
    return so


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def quantize_rows(x: np.ndarray, form: str) -> np.ndarray:
    """Rows x (R, k) f32 in llama.cpp's activation form `form` (q8_0, q8_1, q8_K): (R, bytes a row) uint8."""
    r, k = x.shape
    vb, bb = FORM_BYTES[form]
    out = np.zeros((r, k // vb * bb), np.uint8)
    fn = getattr(lib(), "quantize_row_" + form)
    for i in range(r):
        row = np.ascontiguousarray(x[i], dtype=np.float32)
        fn(_ptr(row), _ptr(out[i]), ctypes.c_int64(k))
    return out


def vec_dot(fmt: str, raw: np.ndarray, xq: np.ndarray, k: int) -> np.ndarray:
    """ggml_vec_dot_<fmt>_<its activation form> of every row of `xq` (quantize_rows) with every row of `raw` (n, bytes
    a row) of `fmt`: (R, n) f32."""
    ggml_fmt = fmt.replace("_k", "_K")
    fn = getattr(lib(), f"ggml_vec_dot_{ggml_fmt}_{VEC_DOT_TYPE[fmt]}")
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    out = np.zeros((xq.shape[0], raw.shape[0]), np.float32)
    s = np.zeros(1, np.float32)
    for i in range(xq.shape[0]):
        for j in range(raw.shape[0]):
            fn(ctypes.c_int(k), _ptr(s), ctypes.c_size_t(0), _ptr(raw[j]), ctypes.c_size_t(0), _ptr(xq[i]),
               ctypes.c_size_t(0), ctypes.c_int(1))
            out[i, j] = s[0]
    return out


def swiglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """ggml_vec_swiglu_f32: silu(g)·u of flat f32 arrays."""
    g, u = np.ascontiguousarray(g, np.float32).reshape(-1), np.ascontiguousarray(u, np.float32).reshape(-1)
    y = np.zeros_like(g)
    lib().ggml_vec_swiglu_f32(ctypes.c_int(g.size), _ptr(y), _ptr(g), _ptr(u))
    return y
