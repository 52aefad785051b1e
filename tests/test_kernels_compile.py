"""Every kernel source compiles as CuPy will compile it at run time — NVRTC through cuda-python with CuPy's options —
for sm_90 (to its PTX) and sm_80 (its front end: FULL_ARCH says why), and with nvcc for sm_90, with no error and no
warning; and on sm_90 (the H200) ptxas reports no spill and no stack frame in any kernel, the exceptions listed below.
Skips only where neither compiler is present.

nvcc compiles each module once per session for each arch (`-cubin -Xptxas -v`: the warnings check and the resource
check read the same compile), its output shared through pytest's base temporary folder by every xdist worker."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from lanefuse.kernels.compile import ARCHS, OPTIONS, source
from lanefuse.kernels.prebuilt import module_name, modules

STEMS = modules()  # every module a launch kind compiles (what `lanefuse kernels --build` builds)


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


_NVRTC: dict[tuple, tuple] = {}


def run_dir() -> Path:
    """A folder every xdist worker of this run shares (named by the controller's process, a worker's parent; removed
    when the run ends: tests/conftest.py), where one worker's compile is every worker's."""
    run = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
    d = Path(tempfile.gettempdir()) / f"lanefuse-run-{os.getuid()}-{run}" / "compiles"
    d.mkdir(parents=True, exist_ok=True)
    return d


def shared_result(cache: Path | None, key: str, compute) -> tuple:
    """compute()'s result (a JSON-able tuple), computed once a run: a worker that finds another computing the same key
    waits on its lock and reads the result it left."""
    if cache is None:
        return tuple(compute())
    done = cache / f"{key}.json"
    try:
        import fcntl

        lock = open(cache / f"{key}.lock", "w")  # noqa: SIM115 - held until the result is written
        fcntl.flock(lock, fcntl.LOCK_EX)
    except ImportError:  # no POSIX locks: each worker computes for itself
        lock = None
    try:
        if done.exists():
            return tuple(json.loads(done.read_text()))
        got = tuple(compute())
        tmp = done.with_suffix(f".{os.getpid()}")
        tmp.write_text(json.dumps(got))
        tmp.replace(done)
        return got
    finally:
        if lock is not None:
            lock.close()


# The arch the kernels are built for and measured on (the H200): NVRTC compiles for its virtual arch compute_90 in
# full (front end, NVVM's optimizer and code generation: the PTX the argument checks read), and stops at the PTX:
# ptxas for sm_90 runs once, in nvcc's compile below (its registers, spills and warnings), not twice. ptxas was two
# thirds of a module's compile: the chain module 286 s of nvcc's 419 s (cicc 133 s; nvcc 13 -time, 2026-12-06), and
# NVRTC through sm_90 ran the same ptxas again (448 s there against nvcc's 396 s at the last stop). The other archs compile through NVRTC's front end
# only (-dlto: parsed, templates instantiated, each arch's __CUDA_ARCH__ branches and the headers' arch guards checked,
# every error and warning the front end gives; NVVM IR out, not optimized into PTX): the full sm_80 compile repeated
# the optimizer's minutes for the same code (the chain module 273 s for sm_90 here, under load, against 0.7 s through
# the front end) and checked nothing more that a kernel's source decides (NVRTC runs no ptxas: an instruction sm_80
# lacks in an asm() passes either way).
FULL_ARCH = "sm_90"


def nvrtc_compile(stems, arch) -> tuple[bool, str, str]:
    """(compiled, log, PTX) of the module `stems` on `arch` as CuPy compiles it, once a run (the workers share it:
    run_dir): the PTX the argument checks of several test files read comes from the same compile (NVRTC keeps it
    beside the cubin). The chain module takes NVRTC ~2 minutes here: once, not once a reader. FULL_ARCH compiles to
    its virtual arch's PTX (no ptxas: nvcc's compile runs it); another arch: its front end only, no PTX."""
    key = (tuple(stems), arch)
    if key in _NVRTC:
        return _NVRTC[key]
    n = nvrtc()
    src = source(stems)
    virtual = arch.replace("sm_", "compute_") if arch == FULL_ARCH else arch
    opts = [f"--gpu-architecture={virtual}", *OPTIONS, *(f"-I{d}" for d in include_dirs()),
            *(() if arch == FULL_ARCH else ("-dlto",))]
    _, major, minor = n.nvrtcVersion()
    digest = hashlib.sha256("\0".join(["nvrtc", f"{major}.{minor}", *opts, src]).encode()).hexdigest()[:24]

    def compile_it():
        err, prog = n.nvrtcCreateProgram(src.encode(), b"kernel.cu", 0, [], [])
        assert err == n.nvrtcResult.NVRTC_SUCCESS
        raw = [o.encode() for o in opts]
        (res,) = n.nvrtcCompileProgram(prog, len(raw), raw)
        _, size = n.nvrtcGetProgramLogSize(prog)
        # NVRTC writes into the buffer: a bytearray, never bytes (`b" " * 1` is CPython's one cached b" ", which
        # NVRTC's empty log overwrote with a NUL for the whole process: every later b" " padding became b"\x00")
        log = bytearray(size)
        n.nvrtcGetProgramLog(prog, log)
        ptx = ""
        if res == n.nvrtcResult.NVRTC_SUCCESS and arch == FULL_ARCH:
            _, size = n.nvrtcGetPTXSize(prog)
            buf = bytearray(size)
            n.nvrtcGetPTX(prog, buf)
            ptx = bytes(buf).rstrip(b"\x00").decode(errors="replace")
        n.nvrtcDestroyProgram(prog)
        return (res == n.nvrtcResult.NVRTC_SUCCESS, bytes(log).rstrip(b"\x00 \n").decode(errors="replace"), ptx)

    _NVRTC[key] = shared_result(run_dir(), digest, compile_it)
    return _NVRTC[key]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stems", STEMS, ids=[module_name(s) for s in STEMS])
def test_nvrtc(stems, arch):
    if nvrtc() is None:
        pytest.skip("cuda-python's NVRTC bindings are not installed")
    ok, text, _ = nvrtc_compile(stems, arch)
    assert ok, text
    assert not text, f"NVRTC warnings for {stems} on {arch}:\n{text}"


def _bench():
    """bench/kernel_resources.py (ptxas's report parsed, the blocks an SM holds), loaded from the checkout."""
    spec = importlib.util.spec_from_file_location("kernel_resources",
                                                  Path(__file__).resolve().parent.parent / "bench" / "kernel_resources.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


KR = _bench()
_NVCC: dict[str, tuple[int, str]] = {}


@pytest.fixture(scope="session")
def nvcc_cache(tmp_path_factory) -> Path:
    """Where nvcc's results are kept for the session: pytest's base temporary folder, the one all xdist workers of a
    run share (each worker's own is a folder in it)."""
    base = tmp_path_factory.getbasetemp()
    d = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "nvcc-builds"
    d.mkdir(parents=True, exist_ok=True)
    return d


def nvcc_build(stems, arch, cache: Path | None) -> tuple[int, str]:
    """(exit status, output) of `nvcc -cubin -Xptxas -v` on the module `stems` for `arch`: compiled once a run (a
    worker that finds another compiling it waits on the lock and reads its result)."""
    src = source(stems)
    flags = [f"-arch={arch}", *KR.NVCC_FLAGS]
    key = hashlib.sha256("\0".join([NVCC, *flags, src]).encode()).hexdigest()[:24]
    if key in _NVCC:
        return _NVCC[key]

    def compile_it():
        with tempfile.TemporaryDirectory() as d:
            cu = Path(d) / "kernel.cu"
            cu.write_text(src)
            r = subprocess.run([NVCC, *flags, "-o", str(Path(d) / "kernel.cubin"), str(cu)], capture_output=True,
                               text=True)
        return (r.returncode, r.stdout + r.stderr)

    _NVCC[key] = shared_result(cache, key, compile_it)
    return _NVCC[key]


def ptxas_report(line: str) -> bool:
    """A line of ptxas's -v report (not a warning)."""
    return line.startswith("ptxas info") or re.match(r"\s+\d+ bytes stack frame, \d+ bytes spill stores", line) is not None


# nvcc for the H200's arch only: NVRTC (above) is how the kernels are compiled at run time and covers sm_80 too; an
# nvcc compile of sm_80 doubled the suite's slowest compiles (the chain module ~150 s an arch here) for no check the
# NVRTC one does not make.
NVCC_ARCHS = ("sm_90",)


@pytest.mark.parametrize("arch", NVCC_ARCHS)
@pytest.mark.parametrize("stems", STEMS, ids=[module_name(s) for s in STEMS])
def test_nvcc(stems, arch, nvcc_cache):
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    rc, out = nvcc_build(stems, arch, nvcc_cache)
    assert rc == 0, out
    said = "\n".join(line for line in out.splitlines() if line.strip() and not ptxas_report(line))
    assert not said, f"nvcc warnings for {stems} on {arch}:\n{said}"
    assert KR.ptxas_resources(out), f"no ptxas report for {stems} on {arch}:\n{out}"


def test_every_kernel_source_is_in_a_module():
    """Every .cu file beside kernels/compile.py is compiled above: some kind's module names it (the prelude opens
    every module)."""
    from importlib import resources

    here = resources.files("lanefuse.kernels")
    files = {p.name[:-3] for p in here.iterdir() if p.name.endswith(".cu")}
    assert files - {"prelude"} <= {s for stems in STEMS for s in stems}, files - {s for st in STEMS for s in st}


# -- registers and local memory on the H200 (sm_90), from ptxas's report of the compiles above -----------------------

# A stack frame a kernel needs, with no spill: a local array its code indexes by data (each a reason).
STACK_ALLOWED = {
    # the router's top-k: group scores and flags (gs[MOE_MAXG], keep[]) and the chosen weights (p[MOE_MAXK]) picked by
    # data-dependent indices; one block a row, run once a step, off the weight stream
    "moe_route": "the router's top-k arrays indexed by data",
}

# Kernels that spill or keep a stack frame at the sources' commit: true violations, each an xfail(strict) below, so
# the day one is fixed its entry must go (2026-12-04, nvcc 13.0 sm_90; the 2026-12-04 H200 run measured
# fold_parts_rope_4 at 96 registers, 12% of DRAM throughput). (module, what ptxas said)
FOLD_STEMS = ("gemv_core", "gemv_q8", "quant", "norm", "parts_rope", "fold")  # Fold.stem
KNOWN_SPILLS = {
    # (moe_down and moe_down_sorted spilled at 64 registers until PDL_ENTER's griddepcontrol.wait began each kernel:
    # ptxas then gave them 100 / 109 registers and no spill, no stack)
    # (moe_up: 80 registers, a 448 B stack — the router's top-k arrays, 56/240 B spill at 64 before that — until the
    # top-k's group scores and chosen weights moved to shared memory (moe.cu moe_choose, issue 40's router_split):
    # ptxas then gave it 80 registers and no stack; moe_route 103, moe_up_split 96, neither a stack, nvcc 13)
    # (moe_up_sorted: 80 registers, 24 B stack, 40 B spill until quant_block rounded as llama.cpp's x86 quantize does
    # (rintf, 127/amax; issue 41): ptxas then gave it 111 registers and no spill, no stack)
    # no spill, a 32 B stack frame in every product over a quantized activation: most likely gemv_q8.cu's int q[8]
    # (32 B, filled through a reference by wblock_ints under a run-time format) kept in local memory (not confirmed
    # in the SASS: no cuobjdump here)
    "gemv_q8": (("gemv_core", "gemv_q8", "gemm_parts"), "128 registers, 32 B stack"),
    # (gemm_parts_4: 167 registers, 16 B stack, 16/368 B spill — the saved registers of gemv_tile_any's call to
    # qget4_more, __noinline__, for the new block formats q4_1 .. iq4_xs — until q4_k and q6_k rows took
    # gemv_tile_staged and gemv_tile_q4_k went: ptxas then gave it 168 registers and no spill, no stack, nvcc 13)
    "gemm_parts_q8": (("gemv_core", "gemv_q8", "gemm_parts"), "128 registers, 32 B stack"),
    # since gemv_tile_staged and gemv_tile_q4_k's 16-byte loads (80 and 32 registers of loads in flight at four rows
    # a warp) the gate's sums live through the up's tile: a 64-bit and a 32-bit value stored once each (STL.64 / STL)
    # and reloaded five times in all: 7 local accesses in the whole kernel (cuobjdump -sass, nvcc 13); the same
    # (168 registers, 16 B stack, 12 / 20 B spill stores / loads) since q4_k / q6_k rows took gemv_tile_staged; 8 B
    # stack, 4 / 4 B since the slab's GLU keeps the gate's sums one a lane (gemv_glu.cu own_sum, nvcc 13); 16 B stack,
    # 12 / 20 B again since the dense slab's ring moved to shared memory (gemv_slab_cp) — and as much with no dense
    # slab in the kernel at all (tried: the slab's dispatch removed), so not the slab's loop
    "gemv_glu_4": (("quant", "gemv_core", "gemv_q8", "gemv_glu"), "168 registers, 16 B stack, 12 / 20 B spill"),
    "fold_gemv_norm_q8": (FOLD_STEMS, "128 registers, 32 B stack"),
    "fold_parts_rope_q8": (FOLD_STEMS, "128 registers, 32 B stack"),
    # the LM head over a quantized activation with its arg-max (head_argmax): gemv_q8.cu's body, its int q[8] as above
    "fold_gemv_argmax_q8": (FOLD_STEMS, "128 registers, 32 B stack"),
    "gemv_q8_quant": (("quant", "gemv_core", "gemv", "gemv_q8", "gemv_quant"), "128 registers, 32 B stack"),
    "gemv_glu_q8_quant": (("quant", "gemv_core", "gemv_q8", "gemv_glu"), "80 registers, 64 B stack"),
    "gemv_glu_q8k_quant": (("quant", "gemv_core", "gemv_q8", "gemv_glu"), "80 registers, 64 B stack"),
    # (fold_attn_o_glu_down_4, the four- and five-phase chain, issue 34: 168 registers, 8 B stack, one 4-byte value
    # stored once and loaded once (4 / 4 B) — tried without change: the attention phase with 4 keys a tile or
    # __noinline__, the o blocks without their L2 prefetch, the merge counter reset before the merge; the ends computed
    # in the kernel 20 / 196 B — until each waiting phase asked L2 for its own rows before its wait (the attention its
    # keys and values, the o rows whole where they fit; chain.cu attn_prefetch, chain_rows_prefetch): ptxas then gave
    # it 168 registers and no spill, no stack, 47384 B smem, nvcc 13 sm_90, the whole module. Not explained: a module
    # trimmed to the chain's two kernels gave 20 / 196 B before the change and none after)
}


def resource_problems(res: dict[str, dict], skip=()) -> list[str]:
    """What ptxas's report says is wrong: a spill anywhere, a stack frame outside STACK_ALLOWED (kernels in `skip`
    and device functions without a register line aside)."""
    bad = []
    for name, r in sorted(res.items()):
        if name in skip or r.get("registers") is None:
            continue
        if r["spill_stores"] or r["spill_loads"]:
            bad.append(f"{name}: {r['spill_stores']} B spill stores, {r['spill_loads']} B spill loads "
                       f"({r['registers']} registers)")
        elif r["stack"] and name not in STACK_ALLOWED:
            bad.append(f"{name}: a {r['stack']} B stack frame (local memory; {r['registers']} registers)")
    return bad


def sm90_resources(stems, cache) -> dict[str, dict]:
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    rc, out = nvcc_build(stems, "sm_90", cache)
    assert rc == 0, out
    return KR.ptxas_resources(out)


@pytest.mark.parametrize("stems", STEMS, ids=[module_name(s) for s in STEMS])
def test_no_kernel_spills_or_keeps_a_stack_frame_on_sm90(stems, nvcc_cache):
    """Every kernel of the module: no register spilled, no local-memory stack frame (STACK_ALLOWED aside; the known
    violations are checked one by one below)."""
    res = sm90_resources(stems, nvcc_cache)
    assert res
    bad = resource_problems(res, skip=KNOWN_SPILLS)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("kernel", [pytest.param(k, marks=pytest.mark.xfail(strict=True, raises=AssertionError,
                                                                             reason=f"spills or keeps a stack frame "
                                                                                    f"on sm_90: {why}"))
                                    for k, (_, why) in KNOWN_SPILLS.items()])
def test_known_spills(kernel, nvcc_cache):
    stems, _ = KNOWN_SPILLS[kernel]
    res = sm90_resources(stems, nvcc_cache)
    if kernel not in res:
        raise LookupError(f"no kernel {kernel} in {stems}: take it out of KNOWN_SPILLS")
    bad = resource_problems({kernel: res[kernel]})
    assert not bad, bad


def test_resource_problems_reads_ptxas():
    out = ("ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
           "ptxas info    : Function properties for k\n    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill "
           "loads\nptxas info    : Used 255 registers, used 1 barriers, 1028 bytes smem, 400 bytes cmem[0]\n"
           "ptxas info    : Compiling entry function 'moe_route' for 'sm_90'\n"
           "ptxas info    : Function properties for moe_route\n    448 bytes stack frame, 0 bytes spill stores, "
           "0 bytes spill loads\nptxas info    : Used 64 registers, used 1 barriers\n")
    res = KR.ptxas_resources(out)
    assert res["k"] == dict(registers=255, stack=8, spill_stores=4, spill_loads=4, smem=1028, barriers=1)
    assert resource_problems(res) == ["k: 4 B spill stores, 4 B spill loads (255 registers)"]
    assert KR.blocks_per_sm(96, 0) == (5, "registers") and KR.blocks_per_sm(128, 0) == (4, "registers")
    assert KR.blocks_per_sm(40, 0) == (12, "registers") and KR.blocks_per_sm(24, 0) == (16, "warps")
    assert KR.blocks_per_sm(32, 100 * 1024) == (2, "smem")


@pytest.mark.parametrize("arch", ARCHS)
def test_the_delta_rules_state_column_stays_in_registers(arch, nvcc_cache):
    """delta.cu holds each thread's (DK,) column of the recurrent state in registers, an entry a key width: ptxas
    reports no stack frame and no spill for any of them (a runtime bound on the loops had kept it in local memory:
    1604 bytes of spill stores at 128, measured)."""
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    rc, out = nvcc_build(("quant", "delta"), arch, nvcc_cache)
    assert rc == 0, out
    got = dict(re.findall(r"Function properties for (delta_\d+)\s+(\d+ bytes stack frame, \d+ bytes spill stores, "
                          r"\d+ bytes spill loads)", out))
    assert sorted(got) == ["delta_128", "delta_32", "delta_64", "delta_96"], out
    for name, line in got.items():
        assert line == "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", (arch, name, line)


def test_some_compiler_or_skip():
    if nvrtc() is None and NVCC is None:
        pytest.skip("neither NVRTC (cuda-python) nor nvcc is present: the kernel sources were not compiled")


# -- every launch's arguments against its kernel's parameters (from NVRTC's PTX), no device needed -------------------

class RecordingEnv:
    """Stands in for DeviceEnv: arrays are host arrays, and each kernel call is recorded as (stems, name, args)."""

    def __init__(self):
        import numpy as np

        self.np = np
        self.calls = []
        self.views = {}

    def array(self, name):
        return self.np.zeros(4, self.np.float32)

    def weight(self, name):
        return self.np.zeros(4, self.np.float32), "f32"

    def opt(self, name):
        return self.np.uint64(0) if name is None else self.array(name)

    def quant_addresses(self, name):
        return 4096, 4096, 4096

    def ptr(self, name):
        return 0 if name is None else 4096

    def dst_words(self, d):
        from lanefuse.kernels.cupy_env import DeviceEnv

        return DeviceEnv.dst_words(self, d)

    def dst(self, d):
        from lanefuse.kernels.cupy_env import DeviceEnv

        return DeviceEnv.dst(self, d)

    def scratch(self, launch, s):
        return self.np.zeros(4, self.np.float32)

    def quant(self, name):  # a quantized form: its words, low words, scales
        return self.np.zeros(4, self.np.int8), self.np.zeros(4, self.np.int8), self.np.zeros(4, self.np.float32)

    def table(self, key, words):
        return self.np.array(words, self.np.int64)

    def function(self, stems, name):
        return lambda grid, block, args: self.calls.append((tuple(stems), name, grid, block, args))


def samples():
    from lanefuse.kernels import (Advance, ArgMax, Attention, Binary, Dst, Fold, Gather, GemmPart, GemmParts, Gemv,
                                  GemvF32, GemvGlu, Join, Norm, Part, PreNorm, Rope, RopeParts, RopeSide, Sample,
                                  Scale, SetRow, Slice, Softcap, SwiGlu, Unary)

    cache = Dst("kc", row="pos", pitch=8)
    return [
        Gemv("x", "w", "bf16", Dst("y"), 64, 8, 1, bias="b", per_warp=4), Gemv("x", "w", "f16", cache, 64, 8, 2, split=2),
        GemvF32("x", "w", Dst("y", unit=Part(10, 1, 8)), 16, 8, 1),
        Norm("x", "w", "y", 2, 8, 1e-6, part=Part(9, 1, 8), add="a", sum="s", pre=PreNorm("pw", 1e-6), into=cache),
        Rope("x", "cos", "sin", "pos", cache, 1, 1, 8, 8, norm=("n", 1e-6)),
        RopeParts((RopeSide("q", Dst("q2"), 2), RopeSide("k", cache, 1)), "cos", "sin", "pos", 1, 8, 4),
        Attention("q", "kc", "vc", "pos", "o", 4, 2, 8, 8, 16, 1, 0.3, sinks="sk"),
        Attention("q", "kc", "vc", "pos", "o", 4, 2, 8, 8, 16, 1, 0.3, splits=3, per_block=2),
        Binary("mul", "a", "b", "o", 8, row=4, gate="silu"), SwiGlu("g", "u", "o", 8), Unary("gelu", "x", "y", 8),
        Scale("x", "y", 8, 0.5), Slice("x", "y", 2, 8, 2, 3), Join("a", "b", cache, 1, 2, 2, 2),
        Gather("E", "t", "o", 8, format="f16", scale=2.0), SetRow("T", "src", "pos", 8, 1, 16),
        SetRow("T", "src", 3, 8, 1, 16), ArgMax("x", "o", 100, advance=Advance("tok", "pos")), ArgMax("x", "o", 100),
        Sample("x", "o", 100, "p", advance=Advance("tok", "pos")), Sample("x", "o", 100, "p", stats="st"),
        Sample("x", "o", 100, "p", 3, advance=Advance("tok", "pos", batch=True)),
        GemvGlu("x", "wg", "wu", "bf16", "o", 32, 8, 1, bg="bg", per_warp=4),
        GemmParts("x", "f32", 32, 1, (GemmPart("wq", Dst("q"), 8, bias="b"), GemmPart("wk", cache, 8))),
        Fold(Gemv("x", "w", "f32", Dst("o"), 32, 8, 1), Norm("r", "w2", "y", 1, 8, 1e-6, add="o", sum="s")),
        # Gemma: soft caps (attention logits, a product's epilogue, a tensor alone), the exact GELU, the sandwich fold
        Attention("q", "kc", "vc", "pos", "o", 4, 2, 8, 8, 16, 2, 0.3, window=5, softcap=50.0, splits=2),
        Gemv("x", "w", "bf16", Dst("y"), 64, 8, 1, cap=30.0), Gemv("x", "w", "f32", Dst("y"), 64, 8, 1, split=2, cap=3.0),
        Softcap("x", "y", 8, 30.0), Unary("gelu_erf", "x", "y", 8),
        Fold(Gemv("x", "w", "bf16", Dst("o"), 32, 8, 1),
             Norm("r", "w2", "y", 1, 8, 1e-6, add="o", sum="s", pre=PreNorm("pw", 1e-6))),
        *fused_folds(), *mixtures(), *delta_net(), *latent(), *quantizing(), *tensor_cores(),
    ]


def tensor_cores():
    """The tensor-core GEMM: bf16 rows of whole chunks (gemm_tc_cp), f32 rows into a cache row with a residual
    (gemm_tc_any); in parts, both ways; each at 64-row tiles (at most 64 rows) and 128-row ones; split along k (the
    tail); the gate and up products' GLU; the chunk attention on the tensor cores."""
    from lanefuse.kernels import Dst, GemmPart, GemmTc, GemmTcGlu, GemmTcParts
    from lanefuse.kernels.attention_tc import AttentionTc

    return [GemmTc("x", "w", "bf16", Dst("y"), 64, 40, 17, bias="b"),
            GemmTc("x", "w", "f32", Dst("kc", row="pos", pitch=8), 30, 8, 16, add="r"),
            GemmTc("x", "w", "bf16", Dst("y"), 64, 40, 130), GemmTc("x", "w", "f16", Dst("y"), 64, 40, 130, add="r"),
            GemmTcParts("x", "bf16", 64, 16, (GemmPart("wq", Dst("q"), 130, bias="b"), GemmPart("wk", Dst("k"), 8))),
            GemmTcParts("x", "q8_0", 64, 16, (GemmPart("wq", Dst("q"), 8),)),
            GemmTcParts("x", "bf16", 64, 130, (GemmPart("wq", Dst("q"), 8),)),
            GemmTcParts("x", "q8_0", 64, 130, (GemmPart("wq", Dst("q"), 8),)),
            # the tail: k in parts (gemm_tc_split_*), then gemm_tc_combine into a cache row with a residual
            GemmTc("x", "w", "f32", Dst("kc", row="pos", pitch=8), 130, 8, 16, add="r", bias="b", ksplit=3),
            GemmTc("x", "w", "bf16", Dst("y"), 64, 40, 130, ksplit=2),
            # the gate and up products' GLU in one launch: bf16 rows at 128-row tiles, f32 rows at 64-row ones
            GemmTcGlu("x", "wg", "wu", "bf16", "o", 64, 40, 130), GemmTcGlu("x", "wg", "wu", "f32", "o", 30, 40, 17),
            # the chunk attention: heads of 64 (attention_tc_64) with sinks, a window and a soft cap; of 128 gated
            AttentionTc("q", "kc", "vc", "pos", "o", 8, 4, 64, 64, 96, 20, 0.125, window=9, sinks="sk", softcap=30.0),
            AttentionTc("q", "kc", "vc", "pos", "o", 4, 4, 128, 128, 96, 20, 0.125, gate=("g", "silu"))]


def quantizing():
    """The q8 numerics' quantizing epilogues: the attention (one split, three: the merging block quantizes), the gated
    product (glu_act_mul_quant), the gate/up GEMV over an f32 activation (four outputs a warp) and a quantized one;
    and each writing its quantized form alone; the q8k form's Quant and products."""
    from lanefuse.kernels import (Attention, Binary, Dst, Fold, GemmPart, GemmParts, Gemv, GemvGlu, HeadGemv, Norm,
                                  RopeParts, RopeSide, SetRow)
    from lanefuse.kernels.quant import Quant

    return [Attention("q", "kc", "vc", "pos", "o", 4, 2, 32, 32, 16, 1, 0.3, per_block=2, quant="oq", words=1),
            Attention("q", "kc", "vc", "pos", "o", 4, 2, 32, 32, 16, 1, 0.3, splits=3, quant="oq", words=2),
            Binary("mul", "a", "b", "o", 64, gate="silu", quant="oq", words=1),
            GemvGlu("x", "wg", "wu", "bf16", "o", 32, 64, 1, per_warp=4, quant="oq", quant_words=1),
            GemvGlu("xq", "wg", "wu", "q8_0", "o", 64, 64, 3, words=2, quant="oq", quant_words=2),
            # the quantized form alone (only projections read the result): no f32 output
            Attention("q", "kc", "vc", "pos", "o", 4, 2, 32, 32, 16, 1, 0.3, splits=3, quant="oq", words=1, f32=False),
            Binary("mul", "a", "b", "o", 64, gate="silu", quant="oq", words=2, f32=False),
            Binary("add", "a", "b", "o", 512, quant="oq", words=3),  # the q8k form: a block of 256 threads a block
            GemvGlu("xq", "wg", "wu", "q8_0", "o", 64, 64, 3, words=1, quant="oq", quant_words=1, f32=False),
            # the q8k form (llama.cpp's q8_K) of K-quant rows: quant.cu's 256-value blocks, gemv_q8.cu's q8k_tile
            Quant("x", "xq", 512, 3), Gemv("xq", "w", "q4_k", Dst("y"), 256, 8, 2, words=3),
            GemvGlu("xq", "wg", "wu", "q6_k", "o", 256, 64, 3, words=3, quant="oq", quant_words=1, f32=False),
            GemvGlu("xq", "wg", "wu", "q4_k", "o", 256, 512, 3, words=3, quant="oq", quant_words=3),  # gemv_glu_q8k_quant
            # over an f32 activation: the arrival-counted tail at 256 (gate and up over bf16 rows, down over K-quant)
            GemvGlu("x", "wg", "wu", "bf16", "o", 96, 512, 3, per_warp=4, quant="oq", quant_words=3, f32=False),
            Norm("x", "w", "y", 2, 512, 1e-6, add="a", sum="s", quant="oq", words=3),  # norm.cu's q8k epilogue
            # the attention's q8k epilogue: heads of 128 two a block (one split) and two a merging block (three)
            Attention("q", "kc", "vc", "pos", "o", 4, 1, 128, 128, 16, 1, 0.3, quant="oq", words=3),
            Attention("q", "kc", "vc", "pos", "o", 8, 4, 64, 64, 16, 2, 0.3, splits=3, quant="oq", words=3),
            GemmParts("xq", "q4_k", 256, 1, (GemmPart("wq", Dst("q"), 8), GemmPart("wk", Dst("k"), 8)), words=3),
            Norm("x", "w", "y", 2, 64, 1e-6, add="a", sum="s", quant="oq", words=1, f32=False),
            HeadGemv("x", "w", "q8_0", Dst("o"), 2, 4, 32, 16, quant="oq", words=2),
            HeadGemv("x", "w", "q4_k", Dst("o"), 2, 8, 256, 32, quant="oq", words=3),  # the q8k form, blocks of 256
            # gemv_quant.cu: a product quantizing its output (over f32 and a quantized activation; the q8k form)
            Gemv("x", "w", "bf16", Dst("o"), 64, 64, 9, per_warp=4, quant="oq", quant_words=2),
            Gemv("xq", "w", "q8_0", Dst("o"), 64, 256, 3, words=1, quant="oq", quant_words=3),
            # set_row_quant: a row write quantizing its table (one sequence; a batch's slots)
            SetRow("T", "src", "pos", 64, 2, 16, quant="tq", words=1),
            SetRow("T", "src", "pos", 32, 3, 48, slot=16, quant="tq", words=2),
            # DeepSeek-V3's q_a norm in the first products' epilogue quantizing its row (q8x2; the q8k form)
            *(Fold(GemmParts("xq", "q8_0", 64, 2, (GemmPart("wqa", Dst("qa"), qa), GemmPart("wk", Dst("kp"), 8)),
                             words=1),
                   RopeParts((RopeSide("qa", Dst("qan"), 1, norm=("na", 1e-6), hd=qa, rot=0, quant="oq", words=w),
                              RopeSide("kp", Dst("kr", row="pos", pitch=8), 1)), "cos", "sin", "pos", 2, 8, 8))
              for qa, w in ((64, 2), (256, 3)))]


def delta_net():
    """The gated delta net's launches (a convolution with its SiLU and L2 norm, in parts, the delta rule, the gates
    alone, together and with their products) and the gated attention, one split and three."""
    from lanefuse.kernels import Attention, Conv, ConvParts, Decay, Delta, GateProj, Gates, L2Norm
    from lanefuse.kernels.conv_parts import ConvPart

    return [Conv("x", "w", "ring", "y", 64, 4, 2, silu=True, l2=32), Conv("x", "w", "ring", "y", 64, 3, 1),
            ConvParts((ConvPart("q", "wq", "rq", "yq", 64, True), ConvPart("v", "wv", "rv", "yv", 96)), 4, 3, block=32),
            Delta("q", "k", "v", "z", "b", "g", "S", "gn", "o", 2, 4, 32, 64, 3, 0.17, 1e-6),
            Delta("q", "k", "v", "z", "b", "g", "S", "gn", "o", 2, 4, 32, 64, 3, 0.17, 1e-6, quant="oq", words=2),
            # the q8k form: four heads of 64 a block of 256, the last of their blocks quantizing it
            Delta("q", "k", "v", "z", "b", "g", "S", "gn", "o", 2, 8, 32, 64, 3, 0.17, 1e-6, quant="oq", words=3),
            Decay("a", "dt", "al", "y", 8, 4), L2Norm("x", "y", 4, 32, 1e-6),
            Gates("b", "a", "dt", "al", "bt", "g", 8, 4),
            GateProj("x", "wb", "wa", "bf16", "dt", "al", "bt", "g", 64, 4, 2, format_a="f32"),
            Attention("q", "kc", "vc", "pos", "o", 4, 2, 8, 8, 16, 1, 0.3, gate=("gt", "sigmoid")),
            Attention("q", "kc", "vc", "pos", "o", 4, 2, 8, 8, 16, 2, 0.3, splits=3, gate=("gt", "sigmoid"))]


def latent():
    """DeepSeek-V3's pieces: the Split attention (absorbed, wide; expanded, narrow), the q_a and latent norms in one
    launch (the latent's read as a part, into its cache row), each head's product both layouts (bf16, f32), the mixture routed by grouped sigmoid
    scores with a correction bias and an ungated shared expert, a row at a time and over sorted rows."""
    from lanefuse.kernels import (Absorb, Dst, Fold, GemmPart, GemmParts, HeadGemv, Moe, Norm, NormPair, Part, RopeParts,
                                  RopeSide)

    grouped = dict(routing="sigmoid_group", br="cb", groups=4, topk_groups=2, route_scale=2.5, norm_topk=True,
                   sg="sg", su="su", sd="sd", sf=22, format_s="bf16")
    from lanefuse.kernels import Attention

    return [Attention("q", "kc", "vc", "pos", "o", 4, 4, 576, 512, 64, 1, 0.1, splits=2),
            # Split: the absorbed query and the latent cache read in place beside the rotated parts (wide, and narrow)
            Attention("ql", "lc", "lc", "pos", "o", 4, 4, 576, 512, 64, 1, 0.1, splits=2, qtail="qr", ktail="kr",
                      tail=64),
            Attention("qn", "kx", "vx", "pos", "o", 4, 1, 18, 12, 64, 6, 0.2, qtail="qr", ktail="kr", tail=8),
            NormPair(Norm("qa", "wa", "qn", 2, 24, 1e-6), Norm("lat", "wl", "ln", 2, 16, 1e-6, part=Part(40, 24, 16),
                                                                 into=Dst("lc", row="pos", pitch=16))),
            # the first product: q_a and the latent normed in its epilogue (the latent into its row), the key rotated
            Fold(GemmParts("x", "bf16", 32, 1, (GemmPart("wqa", Dst("qa"), 24), GemmPart("wl", Dst("lat"), 16),
                                                 GemmPart("wk", Dst("kp"), 8))),
                 RopeParts((RopeSide("qa", Dst("qan"), 1, norm=("na", 1e-6), hd=24, rot=0),
                            RopeSide("lat", Dst("lc", row="pos", pitch=16), 1, norm=("nl", 1e-6), hd=16, rot=0),
                            RopeSide("kp", Dst("kr", row="pos", pitch=8), 1)), "cos", "sin", "pos", 1, 8, 8)),
            # q_b's products: each head's unrotated part absorbed into latent space in the epilogue, the rest rotated
            Fold(GemmParts("x", "bf16", 32, 1, (GemmPart("wn", Dst("qn"), 40), GemmPart("wr", Dst("qp"), 32))),
                 RopeParts((RopeSide("qn", Dst("ql"), 4, hd=10, rot=0, absorb=Absorb("wk", "bf16", 16)),
                            RopeSide("qp", Dst("qr"), 4)), "cos", "sin", "pos", 1, 8, 8)),
            HeadGemv("q", "wk", "bf16", Dst("ql"), 1, 4, 10, 16, rows_out=False),
            HeadGemv("a", "wv", "f32", Dst("o"), 3, 4, 16, 12, rows_out=True),
            Moe("x", "wr", "wgu", "wd", Dst("y"), 32, 11, 8, 3, 1, "bf16", **grouped),
            Moe("x", "wr", "wgu", "wd", Dst("y"), 32, 11, 8, 3, 5, "bf16", sort=True, add="a", **grouped)]


def mixtures():
    """The expert mixture a row at a time and over sorted rows, plain, with a shared expert, finalized; gpt-oss's
    (router and expert biases, top-k then softmax, the clamped GLU) both ways, finalized."""
    from lanefuse.kernels import Dst, Moe

    shared = dict(sg="sg", su="su", sd="sd", sgate="sgt", sf=40, format_s="bf16")
    fin = dict(add="a", sum="s", nw="nw", eps=1e-6)
    gptoss = dict(act="clamped_glu", routing="topk_softmax", br="br", bgu="bgu", bd="bd", limit=7.0, alpha=1.702)
    return [Moe("x", "wr", "wgu", "wd", Dst("y"), 32, 37, 8, 2, 1, "bf16", format_r="f32", norm_topk=True),
            Moe("x", "wr", "wgu", "wd", Dst("y"), 32, 37, 8, 2, 1, "f16", **shared, **fin),
            Moe("x", "wr", "wgu", "wd", Dst("y"), 32, 37, 8, 2, 5, "f32", sort=True, **shared, **fin),
            Moe("x", "wr", "wgu", "wd", Dst("y"), 32, 37, 8, 2, 5, "bf16", sort=True, add="a"),
            Moe("x", "wr", "wgu", "wd", Dst("y"), 32, 37, 8, 2, 1, "bf16", **gptoss, **fin),
            Moe("x", "wr", "wgu", "wd", Dst("y"), 32, 37, 8, 2, 5, "f32", sort=True, **gptoss, add="a"),
            # a GGUF file's: gate/up experts in q4_k, down in q6_k, the shared expert in q8_0 with an f32 gate score
            Moe("x", "wr", "wgu", "wd", Dst("y"), 256, 256, 8, 2, 1, "q4_k", format_d="q6_k",
                **dict(shared, sf=256, format_s="q8_0", format_sgate="f32"), **fin),
            # the finalize quantizing the normed row: blocks of 32, and the q8k form (a row at a time and sorted)
            Moe("x", "wr", "wgu", "wd", Dst("y"), 256, 37, 8, 2, 1, "bf16", **fin, quant="yq", quant_words=1),
            Moe("x", "wr", "wgu", "wd", Dst("y"), 256, 37, 8, 2, 1, "bf16", **fin, quant="yq", quant_words=3),
            Moe("x", "wr", "wgu", "wd", Dst("y"), 512, 37, 8, 2, 5, "f32", sort=True, **fin, quant="yq", quant_words=3),
            # the shared expert over K-quant rows reading the q8k form (a row at a time with its finalize, and sorted)
            Moe("x", "wr", "wgu", "wd", Dst("y"), 256, 37, 8, 2, 1, "bf16", **dict(shared, sf=256, format_s="q4_k"),
                qwords=3, qgate=True, **fin, quant="yq", quant_words=3),
            Moe("x", "wr", "wgu", "wd", Dst("y"), 256, 37, 8, 2, 5, "bf16", sort=True, qwords=3,
                **dict(shared, sf=256, format_s="q6_k"), add="a")]


def fused_folds():
    """A fold of each fused form the lane makes, each one kernel: products in parts then their heads' norm and
    rotation (four outputs a warp and one), one product then its heads' epilogue, a gather then its norm."""
    from lanefuse.kernels import (Dst, Fold, Gather, GemmPart, GemmParts, Gemv, Norm, Rope, RopeParts,
                                  RopeSide)

    cache = Dst("kc", row="pos", pitch=8)
    parts = (GemmPart("wq", Dst("q"), 16, bias="bq"), GemmPart("wk", Dst("k"), 8), GemmPart("wv", cache, 8))
    sides = (RopeSide("q", Dst("qr"), 2, norm=("qn", 1e-6)), RopeSide("k", Dst("kr", row="pos", pitch=8), 1))
    return [
        Fold(GemmParts("x", "bf16", 32, 5, parts, per_warp=pw), RopeParts(sides, "cos", "sin", "pos", 5, 8, 8))
        for pw in (1, 4)
    ] + [
        Fold(Gemv("x", "w", "f16", Dst("q"), 32, 16, 1, per_warp=4),
             Rope("q", "cos", "sin", "pos", cache, 1, 2, 8, 4, norm=("qn", 1e-6))),
        Fold(Gather("E", "t", "e", 8, rows=2, format="bf16", scale=2.0), Norm("e", "nw", "y", 2, 8, 1e-6)),
    ]


def test_the_sample_folds_are_fused():
    for f in fused_folds():
        assert f.fused, f.form()


def nvcc_ptx(stems, arch) -> str:
    """The PTX nvcc makes of the module `stems` (where NVRTC's bindings are not installed)."""
    with tempfile.TemporaryDirectory() as d:
        cu = Path(d) / "kernel.cu"
        cu.write_text(source(stems))
        r = subprocess.run([NVCC, f"-arch={arch}", "-ptx", "-std=c++17", "-o", str(Path(d) / "kernel.ptx"), str(cu)],
                           capture_output=True, text=True)
        assert r.returncode == 0, (r.stdout + r.stderr).strip()
        return (Path(d) / "kernel.ptx").read_text()


def ptx_params(stems, arch=FULL_ARCH) -> dict[str, list[str]]:
    import re

    if nvrtc() is not None:
        ok, text, ptx = nvrtc_compile(stems, arch)
        assert ok, text
    else:
        ptx = nvcc_ptx(stems, arch)
    out = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)", ptx, re.S):
        out[m.group(1)] = re.findall(r"\.param\s+\.(\w+)", m.group(2))
    return out


def arg_kind(a) -> str:
    import numpy as np

    if isinstance(a, np.ndarray) or isinstance(a, (np.int64, np.uint64)):
        return "b64"
    if isinstance(a, np.float32):
        return "f32"
    return f"unexpected {type(a).__name__}"


def test_launch_arguments_match_the_kernels():
    if nvrtc() is None and NVCC is None:
        pytest.skip("neither NVRTC (cuda-python) nor nvcc is present: no PTX to read the kernels' parameters from")
    env = RecordingEnv()
    for launch in samples():
        assert launch.check() is None, (launch.census, launch.check())
        launch.cuda(env)
    entries: dict[tuple, dict] = {}
    for stems, name, grid, block, args in env.calls:
        if stems not in entries:
            entries[stems] = ptx_params(stems)
        params = entries[stems].get(name)
        assert params is not None, f"no kernel `{name}` in {stems} (have {sorted(entries[stems])})"
        want = ["f32" if p == "f32" else "b64" if p in ("u64", "b64", "s64") else p for p in params]
        got = [arg_kind(a) for a in args]
        assert got == want, f"{name}: passes {got}, kernel takes {params}"
        assert all(int(v) >= 1 for v in grid) and 32 <= block[0] <= 1024 and block[0] % 32 == 0, (name, grid, block)
