"""The GPU tests' own host-side code, run on the CPU: a stand-in `cupy` backed by numpy (test_cupy_runner_mock's), the
real `DeviceEnv`, and each launch's `cuda` run for real up to the kernel call — its arguments recorded and checked
against the kernel's parameters in the PTX (as test_kernels_compile checks its samples) — then its numpy twin run on
the device env in the kernel's place. What this checks is the tests' and the device env's side of things (shapes,
dtypes, buffer sizes, quantized forms held on both sides, the Env interface the tests read the results through), not
the kernels' values: the H200's first run failed 23 tests on such bugs before any kernel ran (gpu-runs/2026-12-04)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from parametrized import cases

import test_gdn_kernels
import test_kernels_gpu
import test_quant_gpu
from test_cupy_runner_mock import _fake_cupy


# the GPU tests whose host side runs here (the mixtures' are left to their own file's work: slow twins)
TESTS = [(test_gdn_kernels, "test_gpu_delta"), (test_kernels_gpu, "test_norm"),
         (test_kernels_gpu, "test_fold_gemv_argmax")] + [
    (test_quant_gpu, n) for n in ("test_quant_kernel_equals_its_twin", "test_gemv_q8_kernel_equals_its_twin",
                                  "test_fold_q8_kernels_equal_their_twins", "test_norm_quantizing_in_its_epilogue",
                                  "test_fold_gemv_argmax_q8_kernel_equals_its_twin",
                                  "test_delta_quantizing_in_its_epilogue",
                                  "test_quantizing_epilogues_equal_the_quant_kernel",
                                  "test_gemv_glu_q8k_quant_equals_the_quant_kernel",
                                  "test_head_gemv_quantizing_tail_equals_the_quant_kernel",
                                  "test_products_row_norm_quantizing_in_its_epilogue",
                                  "test_gemv_quantizing_tail_equals_the_quant_kernel",
                                  "test_set_row_quant_equals_its_twin")]
CASES = [pytest.param(mod, name, kw, id=f"{name}[{'-'.join(str(v) for v in kw.values())}]")
         for mod, name in TESTS for kw in cases(getattr(mod, name))]


@pytest.fixture
def device_on_cpu(monkeypatch):
    """The stand-in cupy; kernel calls recorded (through DeviceEnv.function, as the kernels would be called); each
    launch's cuda building its arguments for real, then its twin computing (once, at the outermost launch)."""
    from lanefuse.kernels import KINDS
    from lanefuse.kernels import cupy_env
    from lanefuse.kernels.cupy_env import DeviceEnv

    cp = _fake_cupy()
    cp.int16 = np.int16  # the q8k form's sums of 16
    monkeypatch.setitem(sys.modules, "cupy", cp)
    calls: list[tuple] = []

    def function(stems, name):
        return lambda grid, block, args, **kw: calls.append((tuple(stems), name, grid, block, tuple(args)))

    monkeypatch.setattr(cupy_env, "function", function)
    depth = [0]

    def twin_after(real):
        def cuda(self, denv):
            depth[0] += 1
            try:
                real(self, denv)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                self.numpy(denv)
        return cuda

    for k in KINDS.values():
        monkeypatch.setattr(k, "cuda", twin_after(k.cuda))
    # the stand-in's element 0 is a numpy scalar (no .get()): the parameter read from the array itself
    monkeypatch.setattr(DeviceEnv, "param", lambda self, name: int(np.asarray(self.array(name))[0]))
    return calls


@pytest.mark.parametrize("mod,name,kw", CASES)
def test_the_gpu_tests_host_side(device_on_cpu, mod, name, kw):
    from test_kernels_compile import NVCC, arg_kind, nvrtc, ptx_params

    getattr(mod, name)(**kw)
    assert device_on_cpu, "no kernel was called"
    if nvrtc() is None and NVCC is None:
        return
    for stems, fn, grid, block, args in device_on_cpu:  # each call's arguments as its kernel's parameters take them
        params = ptx_params(stems).get(fn)
        assert params is not None, f"no kernel `{fn}` in {stems}"
        want = ["f32" if p == "f32" else "b64" if p in ("u64", "b64", "s64") else p for p in params]
        assert [arg_kind(a) for a in args] == want, (fn, [arg_kind(a) for a in args], params)


def test_a_device_array_the_kernels_would_misread_is_refused(device_on_cpu):
    """A float64 array (numpy's float32 array over a float64 scalar) or an f32 weight held as float64: the kernels
    would read their bytes as f32 words (test_gpu_delta's q and k: the state all inf and NaN)."""
    from lanefuse.kernels.cupy_env import DeviceEnv

    with pytest.raises(TypeError, match="float64"):
        DeviceEnv(0, {}, {"q": np.ones(4, np.float32) / np.sqrt(2)}, {})
    with pytest.raises(TypeError, match="int64"):
        DeviceEnv(0, {}, {"t": np.array([999, 0, 17])}, {})
    with pytest.raises(TypeError, match="f32"):
        DeviceEnv(0, {}, {}, {"w": (np.ones(4, np.float32) * np.sqrt(2), "f32")})
    DeviceEnv(0, {}, {"x": np.ones(4, np.float32), "pos": np.array([1], np.int32)},
              {"w": (np.ones(4, np.uint16), "bf16")})


def test_the_device_env_hands_out_quantized_forms_as_the_host_env_does(device_on_cpu):
    """DeviceEnv.quant and HostEnv.quant agree on the interface: words, low words (None under one word; q8x2's low
    words, the q8k form's sums of 16) and scales; a kernel given None is given a null pointer."""
    from lanefuse.kernels.cupy_env import NULL, DeviceEnv
    from lanefuse.kernels.quant import quant_layout

    for words, low in ((1, None), (2, np.int8), (3, np.int16)):
        n = 512
        total = quant_layout(n, words)[2]
        dev = DeviceEnv(total, {"xq": (0, total, "u8")}, {}, {}, quantized={"xq": (n, words)})
        w, lo, sc = dev.quant("xq")
        assert w.dtype == np.int8 and w.size == n and sc.dtype == np.float32
        assert (lo is None) if low is None else lo.dtype == low
        dev.function(("quant",), "quant")((1, 1, 1), (32, 1, 1), (w, lo, sc))
    assert all(isinstance(c[4][1], (np.ndarray, np.uint64)) for c in device_on_cpu)
    assert device_on_cpu[0][4][1] is NULL
