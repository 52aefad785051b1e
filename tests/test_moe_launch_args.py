"""The Moe launch's host side without a GPU: `Moe.cuda` run against a numpy stand-in for the device env that records
each kernel launch instead of running it. Each launch's arguments are checked against the kernel's parameter list in
moe.cu (the macros expanded: their number, i64 / float / pointer in order, a pointer's element type against the array
handed to it), its grid against the values it must cover, and each weight's stored dtype against its format. The moe
GPU tests' own inputs go through the same dry run: on 2026-12-04 every one of their 112 failures was a router row
(and a gate score row) labelled f32 but held as float64 (numpy 2: a float32 array over np.sqrt's float64 scalar),
whose bytes the kernels read as f32 words while the numpy twin decoded it by value."""

from __future__ import annotations

import itertools
import re
from importlib import resources

import numpy as np
import pytest

from lanefuse.kernels import Dst, Moe
from lanefuse.kernels.common import encode
from lanefuse.kernels.cupy_env import DeviceEnv
from lanefuse.kernels.moe import TILE, WARPS
from lanefuse.kernels.quant import quant_layout


def _cu(stem: str) -> str:
    return resources.files("lanefuse.kernels").joinpath(f"{stem}.cu").read_text()


def _macros(src: str) -> dict[str, tuple[list[str], str]]:
    """#define NAME body or NAME(params) body, line continuations joined."""
    out = {}
    for m in re.finditer(r"^#define (\w+)(\(([^)]*)\))? ((?:[^\n]*\\\n)*[^\n]*)", src, re.M):
        params = [p.strip() for p in m.group(3).split(",")] if m.group(2) else []
        out[m.group(1)] = (params, re.sub(r"\\\n", " ", m.group(4)).split("//")[0])
    return out


def _expand(text: str, macros) -> str:
    for _ in range(4):
        for name, (params, body) in macros.items():
            if params:
                def sub(m, params=params, body=body):
                    b = body
                    for p, a in zip(params, (a.strip() for a in m.group(1).split(","))):
                        b = re.sub(rf"\b{p}\b", a, b.replace(f"{p}##", a))
                    return b
                text = re.sub(rf"\b{name}\(([^()]*)\)", sub, text)
            else:
                text = re.sub(rf"\b{name}\b", lambda _, body=body: body, text)
    return text


def signatures() -> dict[str, list[str]]:
    """moe.cu's kernels: name -> each parameter's type ("i64", "float", or "T*" for a pointer to T)."""
    src = _cu("moe")
    macros = {**_macros(_cu("prelude")), **_macros(src)}
    out = {}
    for m in re.finditer(r'extern "C" __global__ void __launch_bounds__\(\d+(?:, \d+)?\)\s*(\w+)'
                         r'\(([^)]*(?:\([^)]*\)[^)]*)*)\)',
                         src):
        types = []
        for p in _expand(m.group(2), macros).split(","):
            p = " ".join(p.replace("*", " * ").split())
            if "*" in p:
                types.append(p[:p.index("*")].replace("const", "").strip() + "*")
            else:
                types.append(p.rsplit(" ", 1)[0])
        out[m.group(1)] = types
    return out


POINTEE = {"float*": (np.float32,), "int*": (np.int32,), "unsigned*": (np.uint32, np.int32),
           "signed char*": (np.int8, np.int16)}  # int16: the q8k form's sums of 16, cast back by the kernel


def stored_as(dtype, fmt: str) -> bool:
    """Whether a weight held as `dtype` is what the kernels read as format `fmt` (its bytes: f32 rows float32 words,
    f16 / bf16 two-byte words, a block format's bytes)."""
    dt = np.dtype(dtype)
    return dt == np.float32 if fmt == "f32" else dt.itemsize == 2 if fmt in ("f16", "bf16") else dt.itemsize == 1


class DryEnv(DeviceEnv):
    """DeviceEnv over numpy arrays (no CuPy): every launch recorded as (kernel, grid, block, args), none run."""

    def __init__(self, arrays, weights, quantized=None):
        self.cp = np
        self.views = {n: np.ascontiguousarray(a).reshape(-1) for n, a in arrays.items()}
        self.weights = {n: (np.ascontiguousarray(raw).reshape(-1), fmt) for n, (raw, fmt) in weights.items()}
        self.scratch_at, self._scratch, self._tables = {}, {}, {}
        self.quantized = dict(quantized or {})
        self.launched = []

    def ptr(self, name):
        if name is None:
            return 0
        a = self.views.get(name)
        return int((a if a is not None else self.weight(name)[0]).ctypes.data)

    def function(self, stems, name):
        return lambda grid, block, args: self.launched.append((name, grid, block, args))


def dry_run(launch: Moe, arrays, weights, quantized=None) -> list:
    """`launch.cuda` on a DryEnv: each recorded launch checked against moe.cu's signature and its grid."""
    assert launch.check() is None, launch.check()
    for name, fmt in launch.weights().items():
        held = np.asarray(weights[name][0]).dtype
        assert stored_as(held, fmt), f"weight `{name}` in format {fmt} held as {held}: the kernels read its bytes"
    for name, a in arrays.items():
        assert np.asarray(a).dtype in (np.float32, np.int32), f"array `{name}` is {np.asarray(a).dtype}"
    env = DryEnv(arrays, weights, quantized)
    for name, (n, words) in (quantized or {}).items():
        env.views[name] = np.zeros(quant_layout(n, words)[2], np.uint8)
    launch.cuda(env)
    sigs = signatures()
    m, F = launch, max(launch.f, launch.sf)
    up, down, sh = -(-F // TILE), -(-m.d // TILE), int(m.shared)
    want_grid = {"moe_up": (up, m.k + sh, m.rows), "moe_down": (down, m.rows, 1), "moe_route": (m.rows, 1, 1),
                 "moe_up_sorted": (up, m.experts + sh, 1), "moe_down_sorted": (down, m.experts + sh, 1),
                 "moe_finish": (m.rows, 1, 1),  # the split's: each row's router blocks, then every slot's tiles
                 "moe_up_split": (m.rows * (m.router_split + up * (m.k + sh)), 1, 1)}
    names = [n for n, *_ in env.launched]
    assert names == (["moe_route", "moe_up_sorted", "moe_down_sorted", "moe_finish"] if m.sort else
                     ["moe_up_split" if m.router_split > 1 else "moe_up", "moe_down"])
    for name, grid, block, args in env.launched:
        assert tuple(grid) == want_grid[name], name
        assert grid[0] * TILE >= (F if "up" in name else m.d) or name in ("moe_route", "moe_finish")
        assert max(grid[1], grid[2]) <= 65535 and block == (32 * WARPS, 1, 1)
        types = sigs[name]
        assert len(args) == len(types), f"{name}: {len(args)} arguments for {len(types)} parameters"
        for i, (t, a) in enumerate(zip(types, args)):
            where = f"{name} argument {i} ({t})"
            if t == "i64":
                assert isinstance(a, np.int64), where
            elif t == "float":
                assert isinstance(a, np.float32), where
            else:
                assert a is None or isinstance(a, (np.ndarray, np.uint64)), where  # None: a null pointer
                if isinstance(a, np.ndarray) and t in POINTEE:
                    assert a.dtype in POINTEE[t], f"{where}: {a.dtype}"
    return env.launched


def test_the_signatures_parse():
    s = signatures()
    assert set(s) == {"moe_up", "moe_down", "moe_route", "moe_up_sorted", "moe_down_sorted", "moe_finish",
                      "moe_up_split"}
    assert s["moe_up_split"][-3:] == ["float*", "unsigned*", "i64"]  # the logits, the counters, router_split
    assert s["moe_up"][:3] == ["float*", "i64", "i64"] and s["moe_down"][-1] == "i64"


def test_stored_as():
    assert stored_as(np.float32, "f32") and stored_as(np.uint16, "bf16") and stored_as(np.float16, "f16")
    assert stored_as(np.uint8, "q4_k") and not stored_as(np.float64, "f32") and not stored_as(np.float32, "bf16")


def _small(rows=3, fmt="f32", wr_dtype=np.float32, **kw):
    g = np.random.default_rng(rows)
    d, f, E, k = 64, 40, 8, 2
    r = lambda *s: g.standard_normal(s).astype(np.float32)  # noqa: E731
    arrays = {"x": r(rows, d), "y": np.zeros(rows * d, np.float32), "a": r(rows, d),
              "s": np.zeros(rows * d, np.float32)}
    weights = {"wr": (r(E, d).astype(wr_dtype), "f32"), "wgu": (encode(r(E * 2 * f, d), fmt), fmt),
               "wd": (encode(r(E * d, f), fmt), fmt), "nw": (r(d), "f32")}
    return Moe("x", "wr", "wgu", "wd", Dst("y"), d, f, E, k, rows, fmt, norm_topk=True, **kw), arrays, weights


@pytest.mark.parametrize("sort,split", [(False, 1), (True, 1), (False, 3)])
@pytest.mark.parametrize("fin", [{}, {"add": "a"}, {"add": "a", "sum": "s", "nw": "nw", "eps": 1e-6}])
def test_moe_launches_pack_their_arguments_as_moe_cu_takes_them(sort, split, fin):
    launched = dry_run(*_small(sort=sort, router_split=split, **fin))
    assert len(launched) == (4 if sort else 2)


def test_an_f32_router_held_as_float64_is_caught():
    """The 2026-12-04 failures' cause, as the GPU tests made it: `r32(...) * 3 / np.sqrt(d)` is float64 (numpy 2)."""
    g = np.random.default_rng(0)
    assert (g.standard_normal((2, 2)).astype(np.float32) * 3 / np.sqrt(4)).dtype == np.float64
    with pytest.raises(AssertionError, match="wr.*float64"):
        dry_run(*_small(wr_dtype=np.float64))


# -- the moe GPU tests' own inputs, dry-run ---------------------------------------------------------------------------

GPU_TESTS = [("test_kernels_gpu", "test_moe"), ("test_kernels_gpu", "test_moe_gptoss"),
             ("test_kernels_gpu", "test_moe_block_formats"), ("test_kernels_gpu", "test_moe_grouped_sigmoid"),
             ("test_quant_gpu", "test_moe_shared_expert_quantized"),
             ("test_quant_gpu", "test_moe_shared_expert_quantized_q8k"),
             ("test_quant_gpu", "test_moe_finalize_quantizing_q8k")]


def _some_cases(fn) -> list[dict]:
    """Parameter sets of a parametrized test in which every value of every parametrize mark appears (not the whole
    product: the wide shapes' weights take a while to make)."""
    marks = [m for m in fn.pytestmark if m.name == "parametrize"]
    cols = []
    for m in marks:
        names = [a.strip() for a in m.args[0].split(",")]
        cols.append([dict(zip(names, v if len(names) > 1 else (v,))) for v in m.args[1]])
    n = max(len(c) for c in cols)
    return [dict(itertools.chain.from_iterable(c[i % len(c)].items() for c in cols)) for i in range(n)]


@pytest.mark.parametrize("module,name", GPU_TESTS)
def test_the_moe_gpu_tests_inputs_dry_run(module, name, monkeypatch):
    """Each moe GPU test's launches and inputs through `dry_run` in place of the device (every shape its loop makes):
    the weights as the kernels would read them, the arguments as moe.cu takes them."""
    mod = pytest.importorskip(module)
    seen = []

    def both(launch, arrays, weights, tol=1e-4, placed=False):  # its result unused: the loop goes on
        seen.append(dry_run(launch, arrays, weights))

    def on_both(m, arrays, weights, words):  # its result used after: stop there
        seen.append(dry_run(m, arrays, weights, {"xq": (m.rows * m.d, words)} if m.quant else None))
        raise _Done

    monkeypatch.setattr(mod, "both", both, raising=False)
    monkeypatch.setattr(mod, "_moe_on_both", on_both, raising=False)
    for case in _some_cases(getattr(mod, name)):
        try:
            getattr(mod, name)(**case)
        except _Done:
            pass
    assert seen


class _Done(Exception):
    """Raised by the stand-in for the device comparison: what a GPU test does after it is not checked here."""
