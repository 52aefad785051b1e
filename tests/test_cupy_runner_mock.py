"""The CuPy runner's wiring, checked on the CPU: a stand-in `cupy` backed by numpy (arrays, streams, graph capture
that records launches and replays them), each launch's `cuda` replaced by its numpy twin. What this checks is the
runner's own work — the arena's device views at their offsets, aliases, the caches shared by a model's decode and
prefill runners, the warm-up before capture and the position it puts back, the device-side advance — not the kernels
(tests/test_kernels_gpu.py does that on a device)."""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import ClassVar

import numpy as np
import pytest

from lanefuse.engine.front.demo import demo_model
from lanefuse.lane.run.generate import generate
from lanefuse.engine.front.model import build_step
from lanefuse.kernels.common import Launch
from lanefuse.lane.lower.plan import plan
from lanefuse.lane.run.numpy_runner import NumpyRunner


class _Arr(np.ndarray):
    def get(self):
        return np.asarray(self).copy()

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])


_CAPTURE: list | None = None
_CURRENT: list = []  # the streams entered (`with stream:`), innermost last: CuPy's current stream


class _Graph:
    def __init__(self, launches):
        self.launches = launches

    def launch(self, stream=None):
        for l, denv in self.launches:
            l.numpy(denv)


class _Stream:
    def __init__(self, non_blocking=False):
        pass

    def __enter__(self):
        _CURRENT.append(self)
        return self

    def __exit__(self, *a):
        _CURRENT.pop()
        return False

    def synchronize(self):
        pass

    def begin_capture(self):
        global _CAPTURE
        _CAPTURE = []

    def end_capture(self):
        global _CAPTURE
        g, _CAPTURE = _Graph(_CAPTURE), None
        return g


def _fake_cupy():
    cp = types.ModuleType("cupy")
    for n in ("float32", "int32", "uint8", "uint16", "float16", "int64", "uint32", "int8"):
        setattr(cp, n, getattr(np, n))
    cp.zeros = lambda n, dtype=np.float32: np.zeros(n, dtype).view(_Arr)
    cp.asarray = lambda a, dtype=None: np.array(a, dtype=dtype).view(_Arr)
    cp.asnumpy = lambda a, stream=None: np.asarray(a).copy()
    cp.cuda = types.SimpleNamespace(Stream=_Stream, Device=lambda *a: types.SimpleNamespace(synchronize=lambda: None),
                                    device=types.SimpleNamespace(get_cublas_handle=lambda: _HANDLE),
                                    get_current_stream=lambda: _CURRENT[-1] if _CURRENT else None)
    return cp


_HANDLE = 0x5EED  # the stand-in cuBLAS handle


def _memory(ptr: int, dtype, count: int) -> np.ndarray:
    """`count` values of `dtype` at device (here: host) address `ptr`, a writable view."""
    import ctypes

    dt = np.dtype(dtype)
    return np.frombuffer((ctypes.c_char * (count * dt.itemsize)).from_address(int(ptr)), dtype=dt)


def fake_cublas(calls: list):
    """A stand-in `cupy_backends.cuda.libs.cublas`: gemmEx records each call (its arguments, CuPy's current stream
    and whether a capture is on) into `calls`, then computes it on the memory its pointers address, column-major as
    cuBLAS reads it (op(A) m x k, op(B) k x n, C m x n at its leading dimensions): bf16 (14) or f32 (0) operands,
    their products summed exactly and rounded once to f32, then C = that (+ C, beta 1) in f32."""
    mod = types.ModuleType("cupy_backends.cuda.libs.cublas")
    types_ = {14: np.uint16, 0: np.float32}

    def values(ptr, t, rows, cols, ld, trans):  # op(X) (rows x cols) of X stored column-major, ld apart
        r, c = np.arange(rows)[:, None], np.arange(cols)[None, :]
        idx = c + r * ld if trans else r + c * ld
        raw = _memory(ptr, types_[t], int(idx.max()) + 1)[idx]
        return (raw.astype(np.uint32) << 16).view(np.float32) if t == 14 else raw

    def gemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
               computeType, algo):
        import ctypes

        calls.append(dict(handle=handle, transa=transa, transb=transb, m=m, n=n, k=k, A=A, Atype=Atype, lda=lda,
                          B=B, Btype=Btype, ldb=ldb, C=C, Ctype=Ctype, ldc=ldc, computeType=computeType, algo=algo,
                          alpha=ctypes.c_float.from_address(alpha).value,
                          beta=ctypes.c_float.from_address(beta).value,
                          stream=_CURRENT[-1] if _CURRENT else None, capturing=_CAPTURE is not None))
        assert Ctype == 0 and lda >= (k if transa else m) and ldb >= (n if transb else k) and ldc >= m
        a = values(A, Atype, m, k, lda, transa).astype(np.float64)
        b = values(B, Btype, k, n, ldb, transb).astype(np.float64)
        acc = (a @ b).astype(np.float32) * np.float32(calls[-1]["alpha"])
        r, c = np.arange(m)[:, None], np.arange(n)[None, :]
        idx = r + c * ldc
        out = _memory(C, np.float32, int(idx.max()) + 1)
        out[idx] = acc + np.float32(calls[-1]["beta"]) * out[idx] if calls[-1]["beta"] else acc

    mod.gemmEx = gemmEx
    return mod


@pytest.fixture
def fake_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())

    def cuda(self, denv):  # record under capture, else run the numpy twin on the device env
        if _CAPTURE is not None:
            _CAPTURE.append((self, denv))
        else:
            self.numpy(denv)

    from lanefuse.kernels import KINDS
    from lanefuse.kernels.cupy_env import DeviceEnv

    for k in KINDS.values():
        monkeypatch.setattr(k, "cuda", cuda)
    monkeypatch.setattr(Launch, "cuda", cuda, raising=False)
    monkeypatch.setattr(DeviceEnv, "param", lambda self, name: int(np.asarray(self.array(name))[0]))
    quant = DeviceEnv.quant  # the twins take a one-word form's low words as None (the kernels a null pointer)
    monkeypatch.setattr(DeviceEnv, "quant", lambda self, name: tuple(
        None if isinstance(v, np.uint64) else v for v in quant(self, name)))


@pytest.mark.parametrize("graph", [True, False])
def test_cupy_runner_matches_numpy_runner(fake_cupy, graph):
    from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState

    cfg, w = demo_model()
    plans = {r: plan(build_step(cfg, r)) for r in (1, 4)}
    state = DeviceState()
    gpu = {r: CupyRunner(s, w, state, graph=graph) for r, s in plans.items()}
    cpu = {r: NumpyRunner(s, w) for r, s in plans.items()}
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    a = generate(cfg, w, prompt, 10, step_fn=lambda g, env: gpu[g.meta["rows"]].step(env), chunk=4)
    b = generate(cfg, w, prompt, 10, step_fn=lambda g, env: cpu[g.meta["rows"]].step(env), chunk=4)
    assert a.generated_ids == b.generated_ids
    assert max(float(np.max(np.abs(x - y))) for x, y in zip(a.logits, b.logits)) == 0.0


def test_device_decode_loop_advances_on_the_device(fake_cupy):
    """After one step, `decode` replays with the token and position the arg-max advanced: the same tokens as
    stepping from the host."""
    from lanefuse.lane.run.generate import new_caches
    from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState

    cfg, w = demo_model()
    s = plan(build_step(cfg, 1))
    env = new_caches(cfg)
    env["token"], env["pos"] = np.array([7], np.int32), np.array([0], np.int32)
    r = CupyRunner(s, w, DeviceState())
    toks = [int(r.step(env)["next"][0])] + r.decode(6)
    ref = generate(cfg, w, [7], 7)  # the reference interpreter, prompt [7]
    assert toks == ref.generated_ids


@pytest.mark.parametrize("numerics", ["q8", "q8x2"])
def test_cupy_runner_matches_numpy_runner_under_q8(fake_cupy, numerics):
    """A q8 / q8x2 plan whose producers write quantized forms alone (no f32 array in the arena for them): the device
    env's quantized views at their arena offsets give the numpy runner's tokens and logits exactly."""
    import sys as _sys

    from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState

    _sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_quant import q8_model

    cfg, w = q8_model("q8_0")
    plans = {r: plan(build_step(cfg, r), numerics=numerics) for r in (1, 4)}
    assert any(not getattr(x.launch, "f32", True) for x in plans[1].launches)
    state = DeviceState()
    gpu = {r: CupyRunner(s, w, state) for r, s in plans.items()}
    cpu = {r: NumpyRunner(s, w) for r, s in plans.items()}
    prompt = [3, 1, 4, 1, 5]
    a = generate(cfg, w, prompt, 6, step_fn=lambda g, env: gpu[g.meta["rows"]].step(env), chunk=4)
    b = generate(cfg, w, prompt, 6, step_fn=lambda g, env: cpu[g.meta["rows"]].step(env), chunk=4)
    assert a.generated_ids == b.generated_ids
    assert max(float(np.max(np.abs(x - y))) for x, y in zip(a.logits, b.logits)) == 0.0


# -- the warm-up before capture runs the step once: what the step updates in place is put back ----------------------

@dataclasses.dataclass(frozen=True)
class _Count(Launch):
    """A state carried from step to step that no rewrite leaves as it was: each step reads it and adds 1 in place
    (as a convolution ring shifts, as a delta rule's state decays and takes the step's outer product)."""

    state: str
    census: ClassVar[str] = "count"

    def reads(self):
        return (self.state,)

    def writes(self):
        return (self.state,)

    def numpy(self, env):
        env.array(self.state)[:] += 1


def _counting(s):
    """Plan `s` with a carried state `steps` (a table of the step, declared among its states) its first launch
    counts the steps in."""
    from lanefuse.engine.ir import Tensor
    from lanefuse.lane.lower.buffers import Buffer
    from lanefuse.lane.lower.plan import Launched

    return dataclasses.replace(
        s, launches=[Launched(_Count("steps"), (), -1, None, None, 0.0), *s.launches],
        buffers={**s.buffers, "steps": Buffer("steps", "steps", 0, 1, "f32", "table")},
        tensors={**s.tensors, "steps": Tensor("steps", (1,))},
        io=dataclasses.replace(s.io, states=(*s.io.states, "steps")))


@pytest.mark.parametrize("graph", [True, False])
@pytest.mark.parametrize("first", ["step", "decode"])
def test_the_warm_up_does_not_advance_a_carried_state(fake_cupy, graph, first):
    """Any state a step reads and updates in place is updated once a step, the first (the one warmed up and captured)
    included, whether the host steps it or the device decodes from its own token and position; the token and
    position the warm-up's arg-max advanced are put back too (the tokens of the reference)."""
    from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState, carried
    from lanefuse.lane.run.generate import new_caches

    cfg, w = demo_model()
    s = _counting(plan(build_step(cfg, 1)))
    assert set(carried(s)) == {"steps", s.io.token, s.io.position}  # the KV caches: rows a step rewrites alike
    r = CupyRunner(s, w, DeviceState(), graph=graph)
    env = new_caches(cfg)
    env["token"], env["pos"] = np.array([7], np.int32), np.array([0], np.int32)
    if first == "step":
        toks = [int(r.step(env)["next"][0])]
    else:  # the first replay from the device's token and position, as the host left them
        with r._stream:
            r.env.views["token"][:] = 7
        toks = []
    assert float(r.env.views["steps"][0]) == len(toks)
    toks += r.decode(6)
    assert float(r.env.views["steps"][0]) == len(toks)
    assert toks == generate(cfg, w, [7], 7).generated_ids[:len(toks)]


def test_qwen3_next_states_under_a_graph_are_the_numpy_runners(fake_cupy, tmp_path):
    """Qwen3-Next's convolution rings and delta-rule states, and its KV cache, after each step under a CUDA graph
    (warm-up, capture, replays; prefill and decode runners sharing them): equal to the numpy runner's, value for
    value, and so are the logits."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import sys as _sys

    _sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_qwen3next import build

    from lanefuse.engine.front.load import load_model
    from lanefuse.lane.run.cupy_runner import CupyRunner, DeviceState, carried
    from lanefuse.lane.run.generate import new_caches

    cfg, w = load_model(build("f32", tmp_path)[0])
    plans = {r: plan(cfg.build_step(r)) for r in (1, 4)}
    assert set(plans[1].io.states) <= set(carried(plans[1]))
    state = DeviceState()
    gpu = {r: CupyRunner(s, w, state, graph=True) for r, s in plans.items()}
    cpu = {r: NumpyRunner(s, w) for r, s in plans.items()}
    tables = new_caches(cfg)
    host = {n: np.array(v, copy=True) for n, v in tables.items()}
    feed = [3, 17, 5, 42, 8, 11, 60]
    pos, tok = 0, None
    for step in range(10):
        rows = 4 if pos + 4 <= len(feed) else 1
        ids = feed[pos: pos + rows] if pos < len(feed) else [tok]
        env = {**tables, "token": np.array(ids, np.int32), "pos": np.array([pos], np.int32)}
        a = gpu[rows].step(env)
        b = cpu[rows].step({**host, "token": env["token"], "pos": env["pos"]})
        assert np.array_equal(a["logits"], b["logits"]), f"step {step}"
        for n in plans[1].io.tables:
            assert np.array_equal(np.asarray(state.tables[n]), np.asarray(host[n]).reshape(-1)), (step, n)
        pos, tok = pos + rows, int(b["next"][0])
