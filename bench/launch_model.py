"""A model of every launch of a decode plan, run without a device (issue 34 item 6): each launch's own `cuda()` runs
against a recording stand-in of the device env (no GPU, no weights: tiny stub arrays with fake addresses), so the
kernels, grids, blocks and arguments are the ones the CuPy runner would launch; ptxas (nvcc -Xptxas -v, on the CPU)
gives each kernel's registers and shared memory, hence its resident blocks a SM on an H200; a per-family function of
the kernel's loop structure gives the bytes a warp keeps in flight; Little's law turns that into a bandwidth.

THE MODEL (µs; H200: S = 132 SMs, B_peak the copy bandwidth 4.25 TB/s; L, t0 and the tails fitted, see
bench/launch_model_calibration.json):

    per-SM throughput   X = min(warps_SM x inflight_warp / L, B_peak / S)
    a wave              t_wave = max over SMs of bytes_SM / X   (blocks_SM = ceil(blocks_in_wave / S): a partial last
                        wave runs on fewer SMs or with fewer warps, at the same time a block when latency-bound)
    a launch            t = t0 + sum of waves t_wave + t_tail(kind)    (t_tail: a fold's last-block epilogue)

In the latency regime a wave takes rounds x L (rounds: the dependent load rounds a warp makes, bytes_warp /
inflight_warp); at the cap it takes bytes_SM x S / B_peak. The structure is read off each commit's sources (features()):
  fold_gemv_norm's tail: norm_row's dependent rounds (passes x ceil(cols / (128 threads x NORM_BATCH)), a block_sum a
    round) x L_l2 (the L2 round: 4a43cc2's measured 42.2 µs tail over its 65 rounds);
  attention_split*: ceil(ceil(keys / splits) / 4) keys a warp, in rounds of one key (4a43cc2) or a tile of KT keys
    (5715e40: KT x (hd + vd) x 4 bytes in flight a warp), a round L + heads x attn_head_us, in the waves above;
  attention_combine: combine_c0 + its dependent L2 rounds x L_l2 + bytes / B_peak (4a43cc2's: 3 serial loops);
  q8_0 rows at 1-2 rows of x (b780f05's gemv_tile_q8_0): 272 bytes a warp step a row, 8 steps a warp in flight.
Small kernels (norms, gathers, arg-max): t0 + t_fixed(kind) + bytes / B_peak.

Every figure this prints is a PREDICTION from a model calibrated on the 2026-12-04 Nsight Compute figures of the
kernels at 4a43cc2, not a measurement.

    python bench/launch_model.py [--formats bf16,q8_0,...] [--plan FILE] [--batch B] [--pos P] [--rev COMMIT]
                                 [--compare OLD] [--all] [--json FILE] [--fit]

--rev: the kernels' structure and resources as commit COMMIT's sources hold them (e.g. 4a43cc2: the kernels that ran
on 2026-12-04); --compare OLD: the old and the work tree's side by side; --fit: refit the calibration from the
2026-12-04 figures and rewrite the calibration file."""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lanefuse.engine import flags

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CALIBRATION = HERE / "launch_model_calibration.json"
CACHE = Path(flags.read("LANEFUSE_MODEL_CACHE") or Path.home() / ".cache" / "lanefuse-launch-model")
OLD_REV = "4a43cc2"
FORMATS = ("bf16", "q8_0", "q4_0", "q4_k", "q6_k")
MEASURED_TOKEN_US = {"bf16": 27667.0, "q8_0": 31669.0, "q4_0": 30597.3, "q4_k": 31625.9}  # gpu_decode.log, graph on
# cuBLAS's bf16 GEMV on the same H200 the same day (gpu-runs/2026-12-04/cublas-gemv.log: torch x @ w.t(), 50 launches
# back to back on a stream, CUDA events; µs a launch): a cross-check of t0, the fixed cost of a launch that streams
CUBLAS_GEMV_US = {(6144, 4096): 15.8, (4096, 4096): 19.1, (24576, 4096): 49.1, (4096, 12288): 30.0,
                  (151936, 4096): 284.9}
CUBLAS_OUTLIER = (4096, 4096)  # 1.76 TB/s where the four others run 3.2-4.4: cuBLAS's own kernel choice, left out


def cublas_anchor() -> tuple[float, float]:
    """(fixed µs a launch, TB/s) of a least-squares line through cuBLAS's measured GEMV times against their bf16
    bytes (CUBLAS_OUTLIER left out): what a launch that streams at the copy bandwidth costs beyond its bytes on this
    H200, back to back on a stream without PDL. Measured 2026-12-04: about 5.3 µs, against the model's t0 of 10.3
    (fitted on the 4a43cc2 kernels, in the latency regime)."""
    pts = [(n * k * 2 / 1e6, us) for (n, k), us in CUBLAS_GEMV_US.items() if (n, k) != CUBLAS_OUTLIER]
    (c, slope), *_ = np.linalg.lstsq(np.array([[1.0, mb] for mb, _ in pts]), np.array([us for _, us in pts]),
                                     rcond=None)
    return float(c), 1.0 / float(slope)


def at_t0(ks: list, cal: dict, t0: float) -> float:
    """The token's µs with every launch's fixed cost t0 (the calibration's) replaced by `t0` (the combine pays none)."""
    return sum(k.us - ((cal["t0_us"] - t0) if k.family != "attention_combine" else 0.0) for k in ks)

# bytes a value of each checkpoint format in HBM (a block format's scales included)
VALUE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_k": 144 / 256,
               "q6_k": 210 / 256, "mxfp4": 17 / 32}


# -- a recording stand-in for the device env --------------------------------------------------------------------------

class Stub(np.ndarray):
    """A tiny numpy array standing in for a device array: `.data.ptr` a fake, 256-aligned device address."""

    data = property(lambda self: _Ptr(self.addr))

    def __array_finalize__(self, obj):
        self.addr = getattr(obj, "addr", 0)


_Ptr = collections.namedtuple("_Ptr", "ptr")
Call = collections.namedtuple("Call", "stems name grid block args")  # a kernel launch the plan made: module, kernel, geometry


def recording_env():
    """A DeviceEnv (kernels/cupy_env.py) that allocates nothing and runs nothing: array / weight / quant / scratch /
    table hand out stubs; `function(stems, name)` returns a recorder of (stems, name, grid, block, args)."""
    from lanefuse.kernels.cupy_env import NULL, DeviceEnv

    class RecordingEnv(DeviceEnv):
        def __init__(self, formats: dict[str, str] | None = None):
            self.cp = np
            self.formats = dict(formats or {})
            self.calls: list[Call] = []
            self._stubs: dict[str, Stub] = {}
            self._next = 1 << 32

        def _stub(self, key: str, dtype=np.float32) -> Stub:
            s = self._stubs.get(key)
            if s is None:
                s = np.zeros(16, dtype=dtype).view(Stub)
                s.addr = self._next
                self._next += 1 << 20
                self._stubs[key] = s
            return s

        def array(self, name):
            return self._stub("a:" + name)

        def weight(self, name):
            fmt = self.formats.get(name, "f32")
            return self._stub("w:" + name, np.float32 if fmt == "f32" else np.uint16 if fmt in ("f16", "bf16")
                              else np.uint8), fmt

        def ptr(self, name):
            return 0 if name is None else int(self._stub("a:" + name).addr)

        def opt(self, name):
            return NULL if name is None else self.array(name)

        def quant(self, name):
            return (self._stub("qw:" + name, np.int8), self._stub("ql:" + name, np.int8),
                    self._stub("qs:" + name, np.float32))

        def quant_addresses(self, name):
            return tuple(int(a.addr) for a in self.quant(name))

        def scratch(self, launch, s):
            return self._stub(f"s:{launch.key()}:{s.tag}", np.uint32 if s.counter else np.float32)

        def table(self, key, words):
            return self._stub("t:" + key, np.int64)

        def function(self, stems, name):
            def call(grid, block, args, *a, **kw):
                self.calls.append(Call(tuple(stems), name, tuple(grid), tuple(block), tuple(args)))
            return call

    return RecordingEnv


@dataclass
class Kernel:
    """One recorded kernel launch and what the model makes of it."""
    index: int  # the plan launch it belongs to
    kind: str  # the plan launch's kind (census)
    launch: object  # the kernel-level Launch object whose cuda() made it
    call: Call
    regs: int = 0
    smem: int = 0
    spill: int = 0
    bpsm: int = 1
    limit: str = ""
    family: str = ""
    bytes: float = 0.0  # bytes from HBM the model streams
    inflight_warp: float = 0.0
    rounds: float = 0.0  # dependent load rounds a warp makes (latency regime: t = rounds x L)
    tail: float = 0.0
    fixed: float = 0.0
    us: float = 0.0
    waves: float = 0.0
    warps_sm: float = 0.0
    tbps: float = 0.0
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def blocks(self) -> int:
        g = self.call.grid
        return int(g[0] * g[1] * g[2])

    @property
    def threads(self) -> int:
        b = self.call.block
        return int(b[0] * b[1] * b[2])


def plan_kernels(s, retune=None, combine: bool = False) -> list[Kernel]:
    """Every kernel launch of plan `s`: each launch's kernels() run through its cuda() on the recording env (each
    kernel-level launch first through `retune`, if given: an older commit's tuning of it). `combine`: sources before
    attention_merge, where a split attention was two launches: its attention_combine (a block the heads of one q8k
    block, one head otherwise) recorded after it."""
    from lanefuse.kernels.attention import Attention

    formats = {n: (c.format if c.kind == "rows" else "f32") for n, c in s.constants.items()}
    Env = recording_env()
    out = []
    for i, x in enumerate(s.launches):
        for l in x.launch.kernels():
            if retune is not None:
                l = retune(l)
            env = Env(formats)
            l.cuda(env)
            calls = list(env.calls)
            if combine and isinstance(l, Attention) and l.splits > 1 and \
                    not any(c.name == "attention_combine" for c in calls):
                calls.append(Call(calls[0].stems, "attention_combine", (l.heads // l.kheads, l.rows, 1), (128, 1, 1),
                                  ()))
            for c in calls:
                out.append(Kernel(i, l.census, l, c))
    return out


# -- kernel resources (ptxas), cached by source hash --------------------------------------------------------------------

def _source(stems: tuple, rev: str | None) -> str:
    sys.path.insert(0, str(HERE))
    import kernel_resources as kr
    from lanefuse.kernels.compile import source

    return source(stems) if rev is None else kr.rev_source(stems, rev)


def resources(stems: tuple, rev: str | None = None) -> dict[str, dict]:
    """{kernel: ptxas resources} of module `stems` (the work tree's sources, or commit `rev`'s), compiled with nvcc
    for sm_90 once a source: cached under ~/.cache/lanefuse-launch-model by the source's hash. Without nvcc, the
    committed bench/results/kernel-resources.json (the work tree's kernels) stands in."""
    sys.path.insert(0, str(HERE))
    import kernel_resources as kr

    src = _source(stems, rev)
    h = hashlib.sha256(("sm_90\n" + " ".join(kr.NVCC_FLAGS) + "\n" + src).encode()).hexdigest()[:20]
    f = CACHE / f"{h}.json"
    if f.exists():
        return json.loads(f.read_text())
    if shutil.which("nvcc") is None:
        doc = json.loads((HERE / "results" / "kernel-resources.json").read_text())
        return {r["kernel"]: r for r in doc["kernels"]}
    rc, text, _ = kr.nvcc_compile(stems, rev=rev)
    if rc != 0:
        raise SystemExit(f"nvcc failed on {'+'.join(stems)}:\n{text[-3000:]}")
    res = {k: v for k, v in kr.ptxas_resources(text).items() if v.get("registers") is not None}
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(res))
    tmp.replace(f)
    return res


def kernel_file(name: str, rev: str | None) -> str:
    """kernels/`name` as the work tree (rev None) or commit `rev` holds it."""
    if rev is None:
        return (ROOT / "kernels" / name).read_text()
    return subprocess.run(["git", "show", f"{rev}:kernels/{name}"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout


def gemv_core_source(rev: str | None) -> str:
    return kernel_file("gemv_core.cu", rev)


def features(rev: str | None) -> dict:
    """What the model needs of the kernels' structure at `rev` (read from the sources, not assumed by date):
    norm_batch: norm_row's elements a thread a batch (a0b938a: NORM_BATCH 8; before, 1: a dependent L2 round an
    element); norm_pairs: a fold's tail two rows at a time (norm_rows_tail; before, a row at a time); attn_tiles:
    {kernel: keys a warp a tile} (5715e40's ATTENTION_KERNEL(name, D, PB, KT); before, none: a key and head at a
    time); combine_cw: attention_combine's splits a chunk (5715e40: CW 128, the block's reductions; 0: three serial
    loops a thread); new_splits: attention.py's split choice (BLOCKS_AN_SM: 2 x sms blocks,
    attn_split_min 64, at most 128; before: sms blocks, 256, 32); block_tiles: the block formats with a tile of their
    own in gemv_core.cu (gemv_tile_q8_0 at b780f05; since, a `struct BlockQ8_0` of gemv_tile_b32, and gemv_tile_q4_k);
    staged: gemv_tile_staged's blocks a row a stage (STAGE_BLOCKS; 0: no staged tile): q8_0 / q4_0 rows of whole
    16-byte words read as 16-byte loads through shared memory; q4k_wide: gemv_tile_q4_k's 16-byte loads (Q4K_STEPS:
    one step of four super-blocks in flight at four rows a warp, four at one); staged_k: {format: super-blocks a row
    a stage} of the k-quants staged as q8_0 is (Q4K_STAGE, Q6K_STAGE; none before) and q4_0's own stage where it has
    one (Q40_STAGE; before, STAGE_BLOCKS as q8_0's); head_values: fold.cu's head
    epilogue's values a lane a round of loads in the kernels over an f32 x (HEAD_VALUES, fold.cu's, parts_rope.cu's
    since the chain's q/k/v phase; before it, 1)."""
    norm, att, core = kernel_file("norm.cu", rev), kernel_file("attention.cu", rev), gemv_core_source(rev)
    try:  # (since the q/k/v phase joined the chain, the head epilogue lives in parts_rope.cu)
        prope = kernel_file("parts_rope.cu", rev)
    except subprocess.CalledProcessError:
        prope = ""
    hv = re.search(r"#define HEAD_VALUES (\d+)", fold := kernel_file("fold.cu", rev)) or \
        re.search(r"#define HEAD_VALUES (\d+)", prope)
    apy = kernel_file("attention.py", rev)
    try:  # (no chain.cu before 2026-12-05)
        chain_cu = kernel_file("chain.cu", rev)  # its attention phase (and its merge's stage: attention_merge<STAGE>)
        chain_att = re.search(r"attention_body<\d+, \d+, (\d+), false(, CHAIN_MERGE_STAGE)?>", chain_cu)
    except subprocess.CalledProcessError:
        chain_cu, chain_att = "", None
    m = re.search(r"#define NORM_BATCH (\d+)", norm)
    mv = re.search(r"#define NORM_VBATCH (\d+)", norm)
    cw = re.search(r"#define CW (\d+)", att)
    return dict(
        norm_batch=int(m.group(1)) if m else 1,
        norm_vbatch=int(mv.group(1)) if mv else 0,
        norm_pairs="norm_rows_vec<VB, 2>" in norm,  # fold_gemv_norm_1/_4's tail two rows at a time, but where fold.cu
        # gives a kernel fold_tail<1> (a row at a time: fold_gemv_norm_q8, which pairs spilled)
        tail_one={m.group(1) for m in re.finditer(r"(fold_gemv_norm\w*)\((?:(?!\n}).)*?fold_tail<1>", fold, re.S)},
        attn_tiles={**{n: int(kt) for n, d, pb, kt in  # (a fifth argument since the shared-row kernel: ROWS)
                       re.findall(r"^ATTENTION_KERNEL\((\w+), (\d+), (\d+), (\d+)(?:, \w+)?\)", att, re.M)},
                    # the chained attention phase's (chain.cu fold_attn_o_glu_down: attention_body<D, PB, KT, false>)
                    **{"attention_chain": int(m.group(1)) for m in [chain_att] if m}},
        combine_cw=int(cw.group(1)) if cw else 0,
        attn_merge="attention_merge(" in att,
        attn_mv=int(mv_.group(1)) if (mv_ := re.search(r"#define MV (\d+)", att)) else 4,
        attn_mz=int(mz_.group(1)) if (mz_ := re.search(r"#define MZ (\d+)", att)) else 8,
        attn_stage=int(re.search(r"#define CHAIN_MERGE_STAGE (\d+)", chain_cu)[1]) if chain_att and chain_att[2] else 0,
        new_splits="BLOCKS_AN_SM" in apy,
        wide="gemv_tile16" in core,
        # a dense slab's 16-byte steps a row a lane in flight by outputs a warp: all but the one being summed of
        # gemv_slab_cp's SLAB_STAGES in shared memory, gemv_slab16's SLAB_DEPTH registers before it, none before that
        slab_depth=next(({4: int(m.group(1)) - less, 1: int(m.group(2)) - less} for name, less in (
            ("SLAB_STAGES", 1), ("SLAB_DEPTH", 0))
            if (m := re.search(rf"#define {name}\(PW\) \(\(PW\) >= 4 \? (\d+) : (\d+)\)", core))), {}),
        block_tiles=sorted(f for f in VALUE_BYTES
                           if re.search(rf"void gemv_tile_{f}\(|struct Block{f.upper()} ", core)),
        staged=int(m.group(1)) if (m := re.search(r"#define STAGE_BLOCKS (\d+)", core)) else 0,
        q4k_wide="Q4K_STEPS" in core,
        slab_staged="gemv_tile_staged<StagedQ4K, 1, AR>" in core,  # a slab of block rows staged at one output a warp
        head_values=int(hv.group(1)) if hv else 1,
        rope_one="parts_epilogue<HEAD_VALUES, false, false, true>" in chain_cu and "ONE && hd <= 32 * HV" in prope,
        parts_rope_slab=bool(hv) and "gemv_body<(PW > 0 ? PW : 1), (PW >= 4)>" in hv.string,
        staged_k={f: int(m.group(1)) for f, d in (("q4_k", "Q4K_STAGE"), ("q6_k", "Q6K_STAGE"), ("q4_0", "Q40_STAGE"))
                  if (m := re.search(rf"#define {d} (\d+)", core))})


def old_splits(l, sms: int = 132):
    """An Attention launch with 4a43cc2's split choice (attention.py before 5715e40: splits until the blocks fill the
    chip once, each split at least 256 positions of the cache, at most 32): the plans are built by the work tree's
    Python, whose choice changed with the kernel."""
    from dataclasses import replace
    from lanefuse.kernels.attention import Attention, span

    if not isinstance(l, Attention):
        return l
    (gx, gy, _), _ = l.grid_block()
    blocks = gx * gy
    splits = 1
    if blocks < sms:
        splits = max(1, min(-(-sms // blocks), span(l.len, l.window) // 256, 32))
    return replace(l, splits=splits) if l.splits > 1 or splits > 1 else l


# -- per-family structure: bytes a warp keeps in flight, dependent rounds a warp makes ----------------------------------

GEMV_F32X = re.compile(r"^(gemv|fold_gemv_norm|fold_gemv_argmax|fold_parts_rope|gemm_parts|gemv_glu)_(1|4)$")
UNROLL16 = 4  # gemv_tile16's `#pragma unroll 4`: four 16-byte loads a row a lane in flight
L1_BYTES_CLK = 128  # an H200 SM's L1 / shared memory: 128 bytes a clock (the 16-byte tiles' x, read by every warp)
FMA_CLK = 128  # an H200 SM's FP32 lanes: 128 FMAs a clock


def gemv_shape(k: Kernel):
    """(format, k, n (outputs), m (rows), per_warp, tiles (2: gate and up)) of a GEMV-family kernel's launch."""
    l = k.launch
    first = getattr(l, "first", None)
    g = first if first is not None and hasattr(first, "k") else l
    n = getattr(g, "n", None)
    if n is None and hasattr(g, "parts"):
        n = sum(p.n for p in g.parts)
    tiles = 2 if k.call.name.startswith("gemv_glu") else 1
    return g.format, int(g.k), int(n), int(g.m), int(getattr(g, "per_warp", 1) or 1), tiles


def chunk_ends(k: Kernel, kk: int) -> tuple[int, ...]:
    """k and the ends of a split-K launch's chunks (gemv_chunk: whole four-value words), which a staged tile needs
    whole runs of words."""
    first = getattr(k.launch, "first", None)
    split = int(getattr(first if first is not None and hasattr(first, "k") else k.launch, "split", 1) or 1)
    kc = ((kk + split - 1) // split + 3) // 4 * 4
    return (kk,) + tuple(min(kk, z * kc) for z in range(1, split))


# gemv_tile_<fmt> (gemv_core.cu): values and bytes a warp step a row, the steps a loop iteration unrolls (8 / per_warp:
# every row's loads of the iteration issued first), and the share of them the SASS issues before the first use
# (cuobjdump -sass of b780f05's gemv_1 / gemv_4: 30 and 39 of 40 LDG.E.EF.U16); a43dc2e's q4_0 (four lanes an 18-byte
# block, 144 bytes a warp step, unrolled 16 / per_warp) and q4_k (eight lanes a 144-byte super-block, 576 bytes a warp
# step, unrolled 4 / per_warp): shares from the most weight bytes a lane keeps outstanding in the SASS over the nominal
BLOCK_TILES = {"q8_0": dict(vals=256, bytes=272, unroll=8, sass_share={1: 0.75, 2: 1.0, 4: 1.0}),
               "q4_0": dict(vals=256, bytes=144, unroll=16, sass_share={1: 0.58, 2: 1.0, 4: 1.0}),
               "q4_k": dict(vals=1024, bytes=576, unroll=4, sass_share={1: 0.72, 2: 1.0, 4: 0.89}),
               # gemv_tile_q6_k (eight lanes a 210-byte super-block, 2-byte loads; four a warp step, 840 bytes,
               # unrolled as q4_k's): q4_k's SASS shares taken, not read off its own SASS
               "q6_k": dict(vals=1024, bytes=840, unroll=4, sass_share={1: 0.72, 2: 1.0, 4: 0.89})}


# gemv_tile_staged (gemv_core.cu, q8_0 / q4_0 rows of k a multiple of 256 at 1-2 rows of x): a stage of STAGE_BLOCKS
# blocks of each of the warp's rows as 16-byte loads, every one issued before the first is used (the SASS: 320 / 192
# bytes a lane in flight at gemv_4 for q8_0 / q4_0), decoded from shared memory: a stage in flight a warp, a round a
# stage; q4_k and q6_k in stages of Q4K_STAGE / Q6K_STAGE super-blocks (staged_k). A format's unit (values, bytes) and
# the multiple of k (and the chunk's ends) its rows stage at (q6_k's 210-byte super-blocks: whole words in runs of 8).
STAGED_UNITS = {"q8_0": (32, 34, 256), "q4_0": (32, 18, 256), "q4_k": (256, 144, 256), "q6_k": (256, 210, 2048)}


def gemv_structure(k: Kernel, wide: bool, block_tiles=(), staged: int = 0, q4k_wide: bool = False,
                   staged_k: dict | None = None, slab_depth: dict | None = None, slab_staged: bool = False):
    """Bytes in flight a warp and its dependent load rounds, for gemv_core.cu's loops at one kernel of the family.
    wide (the work tree since d081dec): f32/f16/bf16 rows at 1-2 rows of x take gemv_tile16 (16 bytes a lane a load,
    unrolled 4: 4 loads a row a lane in flight); slab_depth ({per_warp: steps}, the work tree since gemv_slab16):
    the same rows at 3-8 rows of x (a slab) take the slab's ring (gemv_slab_cp's in shared memory, gemv_slab16's of
    registers before it), that many 16-byte steps a row a lane in flight
    (every slab of a launch of more than 8 rows priced so: its remainder slab of 1-2 rows streams as gemv_tile16;
    fold_parts_rope's products, built without it, as gemv_tile_any);
    otherwise (block formats at > 2 rows, and everything at 4a43cc2) gemv_tile_any's four values a lane a step, one
    step in flight. The 16-byte tiles' x: every warp reads its slab's rows of x from L1 (l1_bytes: time_us' floor).
    slab_staged: a slab of block rows at one output a warp takes the staged tile too, its x from L1 as the slab16's."""
    fmt, kk, n, m, pw, tiles = gemv_shape(k)
    vb = VALUE_BYTES.get(fmt, 4.0)
    rows_x = min(m, 8)
    vw = 4 if fmt == "f32" else 8
    dense16 = fmt in ("f32", "f16", "bf16") and all(e % vw == 0 for e in chunk_ends(k, kk))
    # (no slab in fold_parts_rope_1: parts_rope.cu's gemv_body<PW, PW >= 4>; nor in _4 before the ring in shared memory)
    bare = k.call.name.startswith("fold_parts_rope") and not (pw >= 4 and k.extra.get("parts_rope_slab"))
    depth = 0 if bare else (slab_depth or {}).get(4 if pw >= 4 else 1, 0)
    if wide and dense16 and (m <= 2 or depth):
        steps = math.ceil(kk / (32 * vw))  # 16-byte loads a lane a row
        d = UNROLL16 if m <= 2 else depth
        inflight_row = 32 * 16 * min(d, steps)
        rounds = math.ceil(steps / d)
        loop = "tile16 x4" if m <= 2 else f"slab x{d}"
        # each warp's x: its slab's rows over k, 4 bytes a value, once a tile (a GLU's two), every slab of the launch
        k.extra["l1_bytes"] = math.ceil(n / pw) * kk * m * 4 * tiles
    elif (st := {"q8_0": staged, "q4_0": staged, **(staged_k or {})}.get(fmt, 0)) and \
            (m <= 2 or (slab_staged and pw == 1 and not k.call.name.startswith("fold_parts_rope"))) and \
            all(e % STAGED_UNITS[fmt][2] == 0 for e in chunk_ends(k, kk)):
        units = kk // STAGED_UNITS[fmt][0]  # blocks or super-blocks a row
        steps = math.ceil(units / st)
        inflight_row = min(units, st) * STAGED_UNITS[fmt][1]
        rounds = steps
        loop = f"{fmt} staged"
        if m > 2:
            k.extra["l1_bytes"] = math.ceil(n / pw) * kk * m * 4 * tiles
    elif fmt in block_tiles and fmt in BLOCK_TILES and m <= 2 and \
            not (fmt in ("q4_k", "q6_k") and m == 2 and pw == 4):
        # a block format's own tile (gemv_tile_q8_0 since b780f05): a warp step reads a run of whole blocks of a row
        # (q8_0: four lanes a 34-byte block, 8 blocks = 272 bytes), unrolled 8 / per_warp ways, every row's loads of
        # an iteration before the decode: per_warp x (8 / per_warp) steps in flight a warp (the SASS' share of them)
        bt = BLOCK_TILES[fmt]
        steps = math.ceil(kk / bt["vals"])
        u = max(1, bt["unroll"] // pw)
        share = bt["sass_share"].get(pw, 1.0)
        if fmt == "q4_k" and q4k_wide:  # Q4K_STEPS, every load of a step issued first
            u, share = (1 if pw >= 4 else 4), 1.0
        inflight_row = bt["bytes"] * min(u, steps) * share
        rounds = math.ceil(steps / u)
        loop = f"{fmt} x{u}"
    else:
        steps = math.ceil(kk / 128)  # four values a lane a step
        inflight_row = 128 * vb
        rounds = steps
        loop = "4-value x1"
    k.family = "gemv"
    k.inflight_warp = pw * inflight_row
    k.rounds = rounds * tiles
    k.extra.update(fmt=fmt, k=kk, n=n, m=m, per_warp=pw, tiles=tiles, loop=loop, rows_x=rows_x)
    k.bytes = float(k.launch.checkpoint_bytes() or k.launch.bytes())


def q8_structure(k: Kernel):
    """gemv_q8.cu's quantized-activation GEMVs: a warp an output, each lane a block of 32 at a time (one block in
    flight a lane)."""
    fmt, kk, n, m, pw, tiles = gemv_shape(k)
    vb = VALUE_BYTES.get(fmt, 1.0)
    k.family = "gemv_q8"
    k.inflight_warp = 32 * 32 * vb
    k.rounds = math.ceil(kk / (32 * 32)) * tiles
    k.extra.update(fmt=fmt, k=kk, n=n, m=m, tiles=tiles, loop="block a lane x1")
    k.bytes = float(k.launch.checkpoint_bytes() or k.launch.bytes())


def attention_keys(a, pos: int) -> int:
    """Keys row 0 attends at position `pos` (its window's, capped by the cache's rows)."""
    keys = min(pos + 1, a.len) if a.len else pos + 1
    return min(keys, a.window) if a.window else keys


def attention_structure(k: Kernel, pos: int, feats: dict):
    """attention_split*: a split's keys over AW = 4 warps. 4a43cc2: a warp a key at a time, a head at a time (K row,
    warp sum, exp, V row): one dependent memory round a key (the block's other heads of that key/value head hit L1),
    then each head's chain. Since 5715e40: a tile of KT keys' K and V rows loaded before any is used (KT x (hd + vd)
    x 4 bytes in flight a warp, halved off the 16-byte path), one online-softmax step a tile and head: one round a
    tile. A round: L_us (the GEMV's dependent HBM round) + the block's heads of that key/value head x attn_head_us
    (a head's warp sum, exps and correction; fitted so 4a43cc2's kernel gives its measured 32.9 µs at 512). A block
    spanning several key/value heads walks its keys once for each.
    attention_combine: see combine_rounds. Shared rows (`shared`, issue 40 item 4): a block's rows walk their keys once
    (bytes: ceil(rows / shared) passes over the rows' span), a round's heads its slots (rows x heads)."""
    a = k.launch
    hb = a.heads_a_block if hasattr(a, "heads_a_block") else a.per_block
    keys = attention_keys(a, pos)
    if k.call.name.startswith("attention_combine"):
        k.family = "attention_combine"
        k.bytes = float(a.heads * a.rows * a.splits * (a.vd + 2) * 4)
        cpb = max(1, k.blocks and a.heads * a.rows // k.blocks)
        k.rounds = combine_rounds(a.splits, a.vd, k.threads, cpb, feats["combine_cw"])
        k.extra.update(splits=a.splits, loop="block x8" if feats["combine_cw"] else "3 serial")
        return
    chunk = math.ceil(keys / a.splits)
    steps = math.ceil(chunk / 4)  # AW = 4 warps stride the split's keys
    walks = max(1, math.ceil(hb / a.group)) if a.group < hb else 1
    kt = feats["attn_tiles"].get(k.call.name, feats["attn_tiles"].get("attention_split")) if feats["attn_tiles"] \
        else None
    vec = all(v % 4 == 0 for v in (a.kstride, a.koff, a.vstride, a.voff, a.vd, a.tail, a.hd - a.tail))
    k.family = "attention"
    if kt is None:  # 4a43cc2: a key at a time
        k.rounds = steps * walks
        k.inflight_warp = (a.hd + a.vd) * 4  # a K row and a V row a step
        loop = "key x1"
    else:
        kt = kt if vec else max(1, kt // 2)
        k.rounds = math.ceil(steps / kt) * walks
        k.inflight_warp = min(kt, steps) * (a.hd + a.vd) * 4
        loop = f"tile {kt}"
    kv_heads = a.heads // a.group
    shared = getattr(a, "shared", 1)  # shared rows (issue 40 item 4): a block's rows take each tile once, its slots
    # (rows x heads) a round's heads
    k.bytes = float(math.ceil(a.rows / shared) * (keys + shared - 1) * kv_heads * (a.hd + a.vd) * 4)
    k.extra.update(keys=keys, splits=a.splits, keys_a_warp=steps, heads_a_block=hb, loop=loop,
                   heads_round=hb * shared / walks, shared=shared)
    if feats.get("attn_merge") and a.splits > 1:  # the last split block of its heads merges them (no combine launch)
        k.extra["merge_rounds"] = merge_rounds(a.splits, a.vd, hb, feats["combine_cw"], feats["attn_mv"],
                                               a.quant is not None and a.f32, feats["attn_mz"],
                                               stage=feats["attn_stage"] if k.call.name == "attention_chain" else 0)


def merge_rounds(splits: int, vd: int, cpb: int, cw: int, mv: int, quant: bool, mz: int = 16, aw: int = 4,
                 stage: int = 0) -> float:
    """attention_merge's dependent L2 rounds in the last split block of a row's heads to arrive (attention.cu): the
    arrival (its fence and atomic: a round), then a head to each group of aw / cpb warps (a warp a head at cpb >= aw,
    heads in turn): the first cw splits' maxima and sums (a round, kept in registers), each further chunk's maxima (a
    round each); each pass of mv values a lane: each further chunk's weights (a round each), the value
    loads mz splits at a time (ceil(nz / mz) rounds); where the output is quantized beside it, the read back (a
    round). Staged (`stage` floats a warp of shared memory: chain.cu's): batches of stage / (32 x values a lane) splits
    a round by cp.async, the first beside the first chunk's maxima."""
    wph = 1 if cpb >= aw else aw // cpb
    turns = math.ceil(cpb / (aw // wph))
    chunks = [min(cw, splits - z0) for z0 in range(0, splits, cw)]
    passes = math.ceil(math.ceil(vd / (32 * wph)) / mv)
    nb = min(cw, stage // (32 * math.ceil(vd / (32 * wph)))) if stage else 0
    head = 2 * len(chunks) - 2 + sum(math.ceil(nz / nb) for nz in chunks) if stage else \
        1 + (len(chunks) - 1) * (1 + passes) + passes * sum(math.ceil(nz / mz) for nz in chunks)
    return float(1 + turns * head + (1 if quant else 0))


def combine_rounds(splits: int, vd: int, threads: int, cpb: int, cw: int) -> float:
    """attention_combine's dependent L2 rounds (the partials just written: L2), a block's heads one after another.
    4a43cc2 (cw 0): three loops a thread over the splits (their maxima, their sums, each value's weighted sum), the
    loads of each loop issued 4 at a time (nvcc's unroll of a loop of unknown count; assumed, not read off the SASS):
    3 x ceil(splits / 4) rounds a value a thread. Since 5715e40: the maxima and sums a thread a split (ceil(splits /
    threads) rounds each, then a block reduction: a round each), each chunk of cw splits' weights (a round, a
    barrier), each value's loads 8 at a time (floor(nz / 8) rounds, one more for a remainder)."""
    nv = math.ceil(vd / threads)
    if not cw:
        return float(cpb * (2 * math.ceil(splits / 4) + nv * math.ceil(splits / 4)))
    r = 2 * (math.ceil(splits / threads) + 1)
    for z0 in range(0, splits, cw):
        nz = min(cw, splits - z0)
        r += nv * (math.ceil(nz / threads) + 1 + nz // 8 + (1 if nz % 8 else 0))
    return float(cpb * r)


def structure(k: Kernel, feats: dict, pos: int):
    name = k.call.name
    if GEMV_F32X.match(name):
        gemv_structure(k, feats["wide"], feats["block_tiles"], feats["staged"], feats["q4k_wide"], feats["staged_k"],
                       feats["slab_depth"], feats.get("slab_staged", False))
    elif name.startswith(("gemv_q8", "fold_gemv_norm_q8", "fold_gemv_argmax_q8", "fold_parts_rope_q8", "gemm_parts_q8",
                          "gemv_glu_q8")):
        q8_structure(k)
    elif name.startswith("attention"):
        attention_structure(k, pos, feats)
    elif name in ("moe_up", "moe_up_split"):
        moe_up_structure(k)
    else:
        k.family = "small"
        try:
            k.bytes = float(k.launch.bytes())
        except Exception:
            k.bytes = 0.0


# moe.cu's moe_dot / moe_dots: a lane reads one value of a row a step (a value of x beside it), `per_warp` rows at once;
# ASSUMED, not read in the SASS (no cuobjdump here): nvcc unrolls the runtime-bound loop 4 ways, every load of the 4
# steps issued first. No device has run a mixture's kernels at a real shape.
MOE_UNROLL = 4


def moe_up_structure(k: Kernel):
    """A mixture a row at a time, its up kernel (moe_up; moe_up_split under `router_split`, kernels/moe.py), as the
    GEMV family's wave model takes it: the bytes of its share (kernels/moe.py _shares: the router's rows once, the
    chosen experts' gate/up rows), a warp's bytes in flight (per_warp rows x 32 lanes x MOE_UNROLL values), and the
    dependent rounds on a block's path, each a dot of d values (ceil(d / (32 x MOE_UNROLL)) rounds):
      moe_up: the row's E router logits, router_rounds() dots a warp (every block computes them all), then its tile's
        gate and up values: ceil(TILE / (WARPS x per_warp)) x 2 dots;
      moe_up_split: one router dot (phase 0: router_split blocks of one round a row), then the same tile, and the phase
        boundary (the chosen blocks' poll, CHAIN_POLL_US as kernels/chain.cu's: ASSUMED) in its tail.
    The top-k's serial loop (thread 0, E x k steps) is on the path either way and is not counted in either. Every figure
    is a PREDICTION."""
    from lanefuse.kernels.moe import TILE, WARPS

    m = k.launch
    pw = m.per_warp
    dot = math.ceil(m.d / (32 * MOE_UNROLL))
    route = m.router_rounds() if k.call.name == "moe_up" else 1
    glu = math.ceil(TILE / (WARPS * pw)) * 2
    k.family = "gemv"
    k.inflight_warp = pw * 32 * MOE_UNROLL * VALUE_BYTES.get(m.format, 4.0)
    k.rounds = (route + glu) * dot
    k.bytes = float(m.bytes())
    k.extra.update(fmt=m.format, k=m.d, n=m.f, m=m.rows, per_warp=pw, tiles=1, loop="moe_dot", experts=m.experts,
                   router_split=m.router_split, router_rounds=route * dot, glu_rounds=glu * dot)


# -- the time model --------------------------------------------------------------------------------------------------

def norm_tail_rounds(nm, threads: int, batch: int, vbatch: int = 0, pairs: bool = False) -> int:
    """norm_row's dependent L2 rounds (one block of `threads` over each row, rows one after another): the added
    operand's own norm (pre: a pass and a block_sum), then a head at a time its sum-of-squares pass, a block_sum, its
    write pass; a pass ceil(hd / (threads x batch)) rounds (a0b938a: batch 8, every load of a batch issued first;
    before: 1, an element's loads (x, add) one round). Each block_sum counted as a round. pairs (norm.cu's
    norm_rows_tail<2>: the vector path two rows at a time): a pair's pre pass and each head's sum-of-squares pass one
    pass for both rows, one block_sums for both, the write pass a row at a time."""
    heads = max(1, int(getattr(nm, "heads", 1) or 1))
    hd = nm.cols // heads
    per = lambda n: math.ceil(n / (threads * batch))
    vec = bool(vbatch) and hd % 4 == 0 and getattr(nm, "y", "y") is not None
    if vec:  # norm_row_vec: four values a load (the arena's rows 16-byte aligned where cols are words)
        per = lambda n: math.ceil(n / (threads * 4 * vbatch))
    pre = (per(nm.cols) + 1) if (nm.add and nm.pre) else 0
    r = pre + heads * (2 * per(hd) + 1)
    if not (pairs and vec):
        return nm.rows * r
    return nm.rows // 2 * (pre + heads * (3 * per(hd) + 1)) + nm.rows % 2 * r


def tail_us(k: Kernel, cal: dict) -> float:
    """The serial epilogue of a fold: fold_gemv_norm's last block normalizes every row alone (norm_tail_rounds x
    L_l2_us, the L2 round fitted on 4a43cc2's measured 42.2 µs tail), fold_parts_rope's last block of each head
    rotates it (in parallel over heads)."""
    if k.call.name.startswith("fold_gemv_norm"):
        k.extra["tail_rounds"] = norm_tail_rounds(k.launch.then, k.threads, k.extra.get("norm_batch", 1),
                                                  k.extra.get("norm_vbatch", 0), k.extra.get("norm_pairs", False))
        return cal["L_l2_us"] * k.extra["tail_rounds"]
    if k.call.name.startswith("fold_parts_rope"):  # each head's last block: rope_tail_rounds, a round fitted
        hv = 1 if k.call.name.endswith("_q8") else k.extra.get("head_values", 1)
        k.extra["tail_rounds"] = rope_tail_rounds(k.launch.then, hv, k.extra.get("rope_one", False))
        per_round = cal["tail_rope_us"] / ROPE_ROUNDS_MEASURED
        return per_round * k.extra["tail_rounds"] * max(1, math.ceil(k.extra.get("m", 1) / 4))
    if k.call.name.startswith("fold_gemv_argmax"):  # the block's key (its read back, the atomic max: a round each),
        k.extra["tail_rounds"] = 3                  # the arrival; the last block's keys read, its index and advance
        return cal["L_l2_us"] * k.extra["tail_rounds"]
    if k.family == "attention" and k.extra.get("merge_rounds"):  # the last split block's merge (attention_merge)
        return cal["L_l2_us"] * k.extra["merge_rounds"]
    if k.call.name == "moe_up_split":  # the chosen blocks' wait on phase 0 (the routing): a poll, as chain.cu's
        return CHAIN_POLL_US
    return 0.0


# fold_parts_rope_4's tail as ncu measured it (tail_rope_us, kernels at 4a43cc2) was Qwen3-8B's q and k heads of 128
# values with their norms at one value a lane a round: rope_tail_rounds of that shape, 10; a round tail_rope_us / 10
ROPE_ROUNDS_MEASURED = 10


ROPE_NORM_FEATS = ("norm_batch", "norm_vbatch", "head_values")  # the tails' rounds, off the sources


def rope_tail_rounds(then, hv: int, one: bool = False) -> int:
    """The dependent L2 rounds of fold.cu's head epilogue (the slowest side's; a warp a row, the heads' epilogues in
    parallel, each by the last of its blocks to arrive): the arrival (an atomic's round trip), then with a norm the
    sum of squares' rounds (a chunk of hv values a lane a round: ceil(hd / 32hv)) and the warp sum, then the outputs'
    (each chunk's values, partners, norm weights, cos and sin one round). 4a43cc2: hv 1 (a norm-and-rotate head of 128
    values ten rounds); HEAD_VALUES 4 since 2026-12-05: four; `one` (the chain's q/k/v phase, parts_rope.cu's ONE: a
    normed head's one chunk loaded once): three."""
    from lanefuse.kernels.fold import as_rope_parts
    from lanefuse.kernels.rope import side_shape

    rp = as_rope_parts(then)
    if rp is None:
        return ROPE_ROUNDS_MEASURED
    worst = 0
    for sd in rp.sides:
        if sd.absorb is not None:  # absorb_epilogue (a head's own product): charged as the measured tail, unmodelled
            worst = max(worst, ROPE_ROUNDS_MEASURED)
            continue
        hd = side_shape(sd, rp.hd, rp.rot)[0]
        per = math.ceil(hd / (32 * max(1, hv)))
        normed = sd.norm is not None
        worst = max(worst, 1 + ((per + 1) if normed else 0) + (0 if one and normed and per == 1 else per))
    return worst


def time_us(k: Kernel, cal: dict, S: int = 132) -> float:
    """The launch's µs: t0 + its waves (Little's law, capped at B_peak / S a SM) + its tail; see the module's doc."""
    B = cal["B_peak_TBps"] * 1e6 / S  # bytes a µs a SM
    t0 = cal["t0_us"]
    warps_block = max(1, k.threads // 32)
    per_wave = S * k.bpsm
    nb = k.blocks
    k.waves = nb / per_wave
    k.warps_sm = min(nb, per_wave) / S * warps_block
    if k.family in ("gemv", "gemv_q8", "attention"):
        L = (cal["L_us"] + k.extra["heads_round"] * cal["attn_head_us"]) if k.family == "attention" else \
            cal["L_us"] * cal["format_factor"].get(  # the staged tile's decode from shared memory: as the
                k.extra.get("fmt") if k.extra.get("loop") in ("4-value x1", f"{k.extra.get('fmt')} staged")
                else "dense16", 1.0)  # 4-value loop's (fitted there), a conservative charge on each round
        bytes_block = k.bytes / nb
        total, left = 0.0, nb
        while left > 0:
            w = min(left, per_wave)
            blocks_sm = math.ceil(w / S)
            inflight_sm = blocks_sm * warps_block * k.inflight_warp
            X = min(inflight_sm / L, B)
            # a warp's rounds bound the wave below: rounds x L when latency-bound
            total += max(blocks_sm * bytes_block / X, k.rounds * L * (inflight_sm / L <= B))
            left -= w
        # the 16-byte tiles' floors, ASSUMED (no device has run a slab): x's rows read from L1 by every warp at
        # L1_BYTES_CLK a SM, and the sums' FMAs at the SMs' FP32 rate (FMA_CLK lanes a SM a clock)
        ghz = cal.get("ncu_sm_freq_ghz", 1.975)
        if k.extra.get("l1_bytes"):
            fl = k.launch.flops() if hasattr(k.launch, "flops") else 0
            total = max(total, k.extra["l1_bytes"] / (S * L1_BYTES_CLK * ghz * 1e3), fl / 2 / (S * FMA_CLK * ghz * 1e3))
        k.tail = tail_us(k, cal)
        k.fixed = t0
        us = t0 + total + k.tail
    elif k.family == "attention_combine":
        k.fixed = cal["combine_c0_us"]
        us = k.fixed + k.rounds * cal["L_l2_us"] + k.bytes / (B * S)
    else:
        kind = k.call.name
        k.fixed = cal["fixed_us"].get(kind, cal["fixed_us"]["small"])
        us = t0 + k.fixed + k.bytes / (B * S)
    k.us = us
    k.tbps = k.bytes / us / 1e6 if us > 0 else 0.0
    return us


# kernels/chain.cu's chained launches (fold_glu_down: the GLU and the down product's fold; fold_o_glu_down: the o
# product's fold before those two), phases of one launch, tickets ordering them: each boundary between phases is a
# poll, not a launch. ASSUMED, not measured: the phase's last fence and arrival (an L2 round; after a fold phase, its
# norm tail first, which the phase's own price holds), a waiting block's acquire load seeing it (an L2 round), its
# __nanosleep(64) granularity and its barrier: 2 x L_l2 (0.65 µs fitted) + 0.2 µs, rounded up to 1.5 µs.
CHAIN_POLL_US = 1.5  # (no device has run a chained launch)


# kernels/chain.cu's chain_rows_prefetch: a product phase whose weight rows (gate and up together) fit this many bytes
# asks L2 for its rows whole before its wait, a wider one for each row's first PDL_PREFETCH_ROW bytes
CHAIN_PREFETCH_PHASE = 32 << 20


def chain_prefetch_bytes(p: Kernel, resident: int, warps: int, pw: int, pos: int) -> float:
    """The bytes a chain's later phase p asks L2 for before its wait (fold_attn_o_glu_down), by its `resident` blocks
    of `warps` warps of `pw` rows: an attention phase (after a q/k/v phase: its blocks' attn_prefetch) the keys and
    values before the position, pos / (pos + 1) of its KV stream; a product phase its rows whole where the phase's
    rows fit CHAIN_PREFETCH_PHASE, else each row's first PDL_PREFETCH_ROW bytes (gate and up both for the GLU)."""
    if p.family == "attention":
        return p.bytes * pos / (pos + 1) * min(1.0, resident / max(1, p.blocks))
    mats = 2 if p.call.name.startswith("gemv_glu") else 1
    rb = VALUE_BYTES.get(p.extra["fmt"], 4.0) * p.extra["k"]
    row = rb if rb * p.extra["n"] * mats <= CHAIN_PREFETCH_PHASE else min(rb, PDL_PREFETCH_ROW)
    return min(p.bytes, resident * warps * pw * mats * row)


def pdl_prefetch_bytes(phases: list[Kernel], asks: list[int], resident: int, warps: int, pw: int) -> float:
    """The bytes a chained launch's first wave asks L2 for before PDL_ENTER: the blocks of blockIdx below `resident`
    (the grid's first wave) that fall in a phase of `asks` (the phases' blocks in ticket order), each its warps' pw rows'
    first PDL_PREFETCH_ROW bytes (gate and up both for a GLU)."""
    total, start = 0.0, 0
    for i, p in enumerate(phases):
        end = start + p.blocks
        if i in asks:
            mats = 2 if p.call.name.startswith("gemv_glu") else 1
            row = min(VALUE_BYTES.get(p.extra["fmt"], 4.0) * p.extra["k"], PDL_PREFETCH_ROW)
            total += min(p.bytes, max(0, min(resident, end) - start) * warps * pw * mats * row)
        start = end
    return total


def chain_time(k: Kernel, feats: dict, cal: dict, pos: int, S: int = 132) -> None:
    """A chained launch (fold_glu_down_PW, fold_o_glu_down_PW) priced as its phases, each as the launch it replaces
    (gemv_glu_PW over the GLU's blocks, fold_gemv_norm_PW over a product's and its norm tail) with the chained kernel's
    registers and blocks a SM, less a t0 for every phase but the first (one launch), plus CHAIN_POLL_US (ASSUMED) at
    each boundary; the blocks of a later phase resident at its boundary asked L2 for their rows before they waited
    (chain_prefetch_bytes: what chain.cu asks for), which streams while HBM would idle: up to min(those bytes /
    B_peak, the phase before's serial tail + the poll, the phase's waves) hidden at each boundary. ASSUMED, as
    with_pdl assumes of a launch's tail: HBM idles in the tail of the phase before (its one block's norm, its heads'
    rotations, its merge) and in the poll, and the lines asked for stay in L2 until the phase reads them."""
    c = k.launch
    pw = c.glu.per_warp
    phases = []
    for launch, blocks in zip(c.phases, c.blocks_of()):
        # an attention phase as attention_split_128 at the chain's own tile (attention_chain); a q/k/v phase as
        # fold_parts_rope_PW, its heads' tail in (fold_attn_o_glu_down_slab: products on the slab, norm tails paired)
        name = "attention_chain" if launch.census == "attention" else f"gemv_glu_{pw}" \
            if launch.census == "gemv_glu" else f"fold_parts_rope_{pw}" if launch is c.qkv else f"fold_gemv_norm_{pw}"
        p = Kernel(k.index, launch.census, launch, Call(k.call.stems, name, (blocks, 1, 1), k.call.block, ()))
        p.regs, p.smem, p.spill, p.bpsm, p.limit = k.regs, k.smem, k.spill, k.bpsm, k.limit
        p.extra.update({x: k.extra[x] for x in ROPE_NORM_FEATS}, rope_one=feats["rope_one"],  # (rows one at a time)
                       parts_rope_slab=k.call.name.endswith("_slab"), norm_pairs=k.call.name.endswith("_slab"))
        structure(p, feats, pos)
        time_us(p, cal, S)
        phases.append(p)
    hidden, hides = 0.0, []
    for before, p in zip(phases, phases[1:]):
        pre = chain_prefetch_bytes(p, min(p.blocks, S * k.bpsm), k.threads // 32, pw, pos)
        hides.append(min(pre / (cal["B_peak_TBps"] * 1e6), before.tail + CHAIN_POLL_US, p.us - p.fixed - p.tail))
        hidden += hides[-1]
    att = [p for p in phases if p.family == "attention"]
    first, last = next(p for p in phases if p.family != "attention"), phases[-1]
    bounds = len(phases) - 1
    k.family = "gemv"
    k.inflight_warp, k.rounds = first.inflight_warp, sum(p.rounds for p in phases)
    k.bytes = sum(p.bytes for p in phases)
    k.waves = sum(p.waves for p in phases)
    k.warps_sm = first.warps_sm
    k.fixed, k.tail = cal["t0_us"], last.tail
    k.us = sum(p.us for p in phases) - bounds * cal["t0_us"] + bounds * CHAIN_POLL_US - hidden
    k.tbps = k.bytes / k.us / 1e6
    k.extra.update(fmt=first.extra["fmt"], k=first.extra["k"], n=first.extra["n"], m=first.extra["m"], per_warp=pw,
                   tiles=len(phases) - len(att), loop=first.extra["loop"],
                   phases=tuple(f"attn{p.extra['splits']}" if p.family == "attention" else (p.extra["n"], p.extra["k"])
                                for p in phases), poll_us=CHAIN_POLL_US,
                   chain_hidden_us=hidden, chain_hides_us=tuple(hides), phase_us=tuple(p.us for p in phases),
                   phase_tail_us=tuple(p.tail for p in phases))
    # under PDL, before PDL_ENTER (chain.cu chain_prefetch, chain_prefetch_after): the first wave blocks whose blockIdx
    # falls in phase 0 (fold_glu_down, fold_o_glu_down), or the q/k/v or o phase (fold_attn_o_glu_down), ask L2 for its
    # first PDL_PREFETCH_ROW bytes of their rows; with_pdl credits these, not every phase's row for every block
    asks = [phases.index(p) for p in phases if p is not att[0]][:2] if att else [0]
    if att and c.qkv is None:
        asks = asks[:1]
    k.extra["pdl_prefetch_bytes"] = pdl_prefetch_bytes(phases, asks, S * k.bpsm, k.threads // 32, pw)
    if att:  # the attention phase's share beyond a launch's t0 (breakdown files it under attention); its record
        k.extra["attention_us"] = sum(p.us - p.fixed for p in att)
        k.extra["attention_phase"] = att[0]


def model(s, rev: str | None, cal: dict, pos: int = 512) -> list[Kernel]:
    """Every kernel of plan `s` with its resources (the sources of `rev`, or the work tree's) and predicted µs."""
    from lanefuse.kernels.compile import source  # noqa: F401  (the package must import)
    import kernel_resources as kr

    feats = features(rev)
    ks = plan_kernels(s, None if feats["new_splits"] else old_splits, combine=not feats["attn_merge"])
    res_by_stems: dict[tuple, dict] = {}
    for k in ks:
        if k.call.stems not in res_by_stems:
            res_by_stems[k.call.stems] = resources(k.call.stems, rev)
        have = res_by_stems[k.call.stems]
        r = have.get(k.call.name)
        if r is None:  # a kernel the plan's launch names that these sources lack (attention_split_128 at 4a43cc2)
            base = re.sub(r"_\d+$", "", k.call.name)
            r = have.get(base)
            k.note = f"resources of {base}" if r else ""
        if r is None:
            k.note = "no ptxas record"
            r = dict(registers=32, smem=0, spill_stores=0)
        k.regs, k.smem, k.spill = int(r["registers"]), int(r.get("smem", 0)), int(r.get("spill_stores", 0))
        k.bpsm, k.limit = kr.blocks_per_sm(k.regs, k.smem, k.threads)
        k.extra.update({f: feats[f] for f in ROPE_NORM_FEATS + ("parts_rope_slab",)},
                       norm_pairs=feats["norm_pairs"] and k.call.name not in feats["tail_one"])
        if k.call.name.startswith(("fold_glu_down", "fold_o_glu_down", "fold_attn_o_glu_down")):
            chain_time(k, feats, cal, pos)
            continue
        structure(k, feats, pos)
        time_us(k, cal)
    return ks


def geometries(k: Kernel, cal: dict, S: int = 132) -> list[dict]:
    """What the model predicts for a GEMV-family launch of one or two rows at each geometry the GEMV kernels take:
    outputs a warp (`rows_a_warp`: 1 or 4) times splits of k (`split_k`: 1-4; every block's loop over its chunk, the
    same bytes a warp in flight, its rounds over the chunk) — the blocks a SM as ptxas gives the kernel now (every
    GEMV kernel is bound to 3 a SM: 165-168 registers at either width). A split adds its partials (written and read
    back: 8 bytes an output a split) and, done by the last split of each output block to arrive as the fold's
    epilogue would be, two L2 rounds (the arrival and the partials' read) before the fold's own tail. Rows: dicts of
    per_warp, split, blocks, waves, us; the launch's own geometry marked `now`."""
    import copy

    if k.family != "gemv" or k.extra.get("m", 1) > 2 or "phases" in k.extra:  # (a chained launch: not priced)
        return []
    pw, n = k.extra["per_warp"], k.extra["n"]
    first = getattr(k.launch, "first", None)
    split_now = int(getattr(first if first is not None and hasattr(first, "k") else k.launch, "split", 1) or 1)
    out = []
    for pw2 in (1, 4):
        for split in (1, 2, 3, 4):
            c = copy.copy(k)
            c.extra = dict(k.extra)
            c.call = Call(k.call.stems, k.call.name, (-(-n // (4 * pw2)), k.call.grid[1], split), k.call.block,
                          k.call.args)
            c.inflight_warp = k.inflight_warp / pw * pw2
            c.rounds = max(1, math.ceil(k.rounds * split_now / split))
            c.bytes = k.bytes + (8.0 * k.extra.get("m", 1) * n * split if split > 1 else 0.0)
            us = time_us(c, cal, S) + (2 * cal["L_l2_us"] if split > 1 else 0.0)
            out.append(dict(per_warp=pw2, split=split, blocks=c.blocks, waves=round(c.waves, 2), us=round(us, 1),
                            now=(pw2 == pw and split == split_now)))
    return out


def print_geometries(ks: list[Kernel], cal: dict) -> None:
    seen = set()
    print("\nthe GEMV family's geometries as the model prices them (PREDICTED µs a launch; * the plan's own):")
    for k in ks:
        key = kind_of(k)
        if key in seen or k.family != "gemv":
            continue
        seen.add(key)
        rows = geometries(k, cal)
        if not rows:
            continue
        best = min(rows, key=lambda r: r["us"])
        print(f"  {key:36} " + "  ".join(f"{'*' if r['now'] else ' '}pw{r['per_warp']}/s{r['split']} {r['blocks']:5d}b "
                                         f"{r['waves']:5.2f}w {r['us']:6.1f}" for r in rows)
              + f"  best pw{best['per_warp']}/s{best['split']}")


PDL_PREFETCH_ROW = 4096  # gemv_core.cu's GEMV_PREFETCH: bytes of each row a warp asks L2 for before PDL_ENTER
T0_PDL_US = 4.0  # ASSUMED, not measured: a launch's fixed cost left when it is scheduled during its predecessor


def with_pdl(ks: list[Kernel], cal: dict, S: int = 132) -> list[Kernel]:
    """The same launches under programmatic dependent launch (LANEFUSE_PDL=1), an UNCALIBRATED model: each launch's
    fixed cost t0 becomes t0_pdl (ASSUMED: T0_PDL_US, or the calibration's "t0_pdl_us" once a device measured it),
    and a GEMV-family launch's first-wave L2 prefetch (PDL_PREFETCH_ROW bytes a row of each resident warp; a chained
    launch's pdl_prefetch_bytes, what its first wave asks for before PDL_ENTER) streams
    while the launch before it runs its serial tail and its fixed part (HBM idle there): up to min(prefetched bytes /
    B_peak, that tail + t0_pdl) of its waves is hidden. Returns new Kernel records (the input ones untouched)."""
    import copy

    t0, tp = cal["t0_us"], cal.get("t0_pdl_us", T0_PDL_US)
    B = cal["B_peak_TBps"] * 1e6
    out, prev = [], None
    for k in ks:
        k = copy.copy(k)
        k.extra = dict(k.extra)
        if k.family != "attention_combine":  # every launch but the combine pays t0 (time_us)
            k.us -= t0 - tp
            if k.family in ("gemv", "gemv_q8", "attention"):  # their `fixed` is t0; a small kernel's is its own
                k.fixed -= t0 - tp
        if k.family == "gemv" and prev is not None:
            resident = min(k.blocks, S * k.bpsm)
            pre = min(k.bytes, k.extra["pdl_prefetch_bytes"] if "pdl_prefetch_bytes" in k.extra else
                      resident * (k.threads // 32) * k.extra.get("per_warp", 1) * k.extra.get("tiles", 1)
                      * PDL_PREFETCH_ROW)
            waves = k.us - k.fixed - k.tail
            hidden = min(pre / B, prev.tail + tp, waves)  # HBM idle under the previous launch: its tail, its fixed
            k.us -= hidden
            k.extra["pdl_hidden_us"] = hidden
        k.tbps = k.bytes / k.us / 1e6 if k.us > 0 else 0.0
        out.append(k)
        prev = k
    return out


def launch_points(ks: list[Kernel]) -> list[tuple[str, float, float]]:
    """(census kind, @ its rows' format where it streams rows; bytes the lane's cost model counts; predicted µs) of
    each kernel-level launch of a modelled plan (a launch of two CUDA kernels, split attention and its combine, one
    point: the lane prices it as one)."""
    from lanefuse.lane.lower.shim import weight_format

    acc: dict[tuple, list] = {}
    for k in ks:
        key = (k.index, id(k.launch))
        if key not in acc:
            f = weight_format(k.launch)
            acc[key] = [k.launch.census + (f"@{f}" if f else ""), float(k.launch.bytes()), 0.0]
        acc[key][2] += k.us
    return [tuple(v) for v in acc.values()]


ROWS_KINDS = ("fold", "gemv", "gemv_glu", "gemm_parts", "head_gemv", "gemv_f32")  # the GEMV family: weight rows


def fit_lane(points: list[tuple[str, float, float]], gap_us: float, hbm_gbps: float,
             fixed_one: float = 8.0) -> dict[str, dict]:
    """Each kind's `costs:` entry (rules/lanes/cuda.yaml) fitted to the model's points by least squares, us = gap +
    fixed + bytes / (hbm x share): fixed >= 0, share in (0, 1]; the GEMV family's kinds one entry a rows' format
    (`default@q8_0`: what a product over those rows costs, whichever kernel). A kind seen at one size only cannot
    tell the two apart: its fixed is `fixed_one` (the calibration's t0 less the gap) and its share what is left, or, where that
    leaves nothing, share 1 and fixed the rest."""
    by: dict[str, list] = collections.defaultdict(list)
    for kind, b, us in points:
        base, _, fmt = kind.partition("@")
        if base in ROWS_KINDS and fmt:  # every product of a format one entry: the kinds a plan does not choose
            kind = f"default@{fmt}"  # (gemm_parts, head_gemv, ...) must not look cheaper than the ones it does
        by[kind].append((b, us - gap_us))
    out = {}
    for kind, pts in sorted(by.items()):
        x = np.array([b / (hbm_gbps * 1e3) for b, _ in pts])  # µs at the whole bandwidth
        y = np.array([u for _, u in pts])
        share, fixed = 1.0, float(np.mean(y - x))
        xm, ym = float(np.mean(x)), float(np.mean(y))
        if len(set(np.round(x, 3))) == 1 and xm >= 2.0 and ym - fixed_one > xm:
            # (a kernel of a few µs of bytes: its time is its fixed part, at the whole bandwidth)
            share, fixed = xm / (ym - fixed_one), fixed_one
        elif len(set(np.round(x, 3))) > 1:
            slope, icpt = np.polyfit(x, y, 1)
            if slope > 1.0:  # slower than the bandwidth: its share
                share, fixed = 1.0 / float(slope), float(icpt)
        if fixed < 0:
            fixed = 0.0
            share = min(1.0, float(np.sum(x * x) / max(np.sum(x * y), 1e-12)))
        out[kind] = dict(fixed_us=round(max(fixed, 0.0), 2), bandwidth=round(min(max(share, 0.01), 1.0), 3))
    return out


def predict_plans(folder: str, cal: dict, pos: int = 512) -> dict:
    """bench/launch_model.py's prediction for every saved Qwen3-8B decode plan in `folder` (bench/gpu_suite.sh
    prepare): per plan launch (its kernels summed) and per token, plain and under PDL; written beside the plans as
    launch-model.json for bench/gpu_decode.py to print beside what the device measures."""
    from lanefuse.lane.lower.planfile import load

    doc = dict(note="PREDICTIONS of bench/launch_model.py (calibrated on the 2026-12-04 H200 figures; PDL's t0 "
                    "ASSUMED), not measurements", position=pos, plans={})
    for f in sorted(Path(folder).glob("qwen3-8b*-decode.json")):
        s = load(str(f))
        ks = model(s, None, cal, pos)
        per: dict[str, float] = collections.defaultdict(float)
        for k in ks:
            per[str(k.index)] += k.us
        doc["plans"][f.stem] = dict(us=round(sum(k.us for k in ks), 1),
                                    us_pdl=round(sum(k.us for k in with_pdl(ks, cal)), 1),
                                    launches={i: round(v, 2) for i, v in per.items()})
        print(f"{f.stem}: {doc['plans'][f.stem]['us']:.0f} µs a token predicted "
              f"({doc['plans'][f.stem]['us_pdl']:.0f} with PDL, assumed t0_pdl)")
    (Path(folder) / "launch-model.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def lane_vs_model(s, ks: list[Kernel]) -> dict[str, tuple[int, float, float]]:
    """Per kernel kind of plan `s`: (launches, the lane's estimate µs (rules/lanes/cuda.yaml costs, the default
    knobs), the model's predicted µs)."""
    from lanefuse.lane.lower.knobs import Knobs
    from lanefuse.lane.lower.shim import launch_us
    from lanefuse.lane.lower.table import load_lane

    costs, knobs = load_lane("cuda").costs, Knobs()
    seen, out = set(), collections.defaultdict(lambda: [0, 0.0, 0.0])
    for k in ks:
        key = (k.index, id(k.launch))
        row = out[k.launch.census]
        row[2] += k.us
        if key not in seen:
            seen.add(key)
            row[0] += 1
            row[1] += launch_us(k.launch, knobs, costs)
    return {kind: tuple(v) for kind, v in out.items()}


def lane_fit(formats: list[str], positions: list[int], cal: dict, rev: str | None = None) -> dict:
    """--fit-lane: the costs fitted over the plans of `formats` at each position, and the lane's estimate against the
    model per kind (issue 34 item 5: within 25%)."""
    from lanefuse.lane.lower.knobs import Knobs

    knobs, pts, runs = Knobs(), [], []
    for fmt in formats:
        s = qwen3_plan(fmt)
        for pos in positions:
            ks = model(s, rev, cal, pos)
            pts += launch_points(ks)
            runs.append((fmt, pos, s, ks))
    fitted = fit_lane(pts, knobs.launch_us, knobs.hbm_gbps, round(cal["t0_us"] - knobs.launch_us, 2))
    print(f"costs:   # fitted by bench/launch_model.py --fit-lane ({', '.join(formats)} at {positions}); PREDICTIONS")
    # no `default` for the kinds no plan here runs (norms, rotations, mixtures...): uncalibrated, they keep the gap
    # alone (a guess for them would move the engine's choices on no evidence)
    for dense in ("f32", "f16"):  # the 16-byte loads of bf16 rows
        if "default@bf16" in fitted:
            fitted.setdefault(f"default@{dense}", dict(fitted["default@bf16"]))
    for kind, e in fitted.items():
        print(f"  {kind}: {{fixed_us: {e['fixed_us']}, bandwidth: {e['bandwidth']}}}")
    for fmt, pos, s, ks in runs:
        print(f"\nthe lane's estimate (rules/lanes/cuda.yaml) against the model, {fmt} at {pos}, per kind:")
        for kind, (n, lane, pred) in sorted(lane_vs_model(s, ks).items(), key=lambda kv: -kv[1][2]):
            print(f"  {kind:12} {n:4d} launches  lane {lane:9.1f} µs  model {pred:9.1f} µs  "
                  f"{100 * (lane / pred - 1):+6.1f}%")
    return fitted


def token_bytes(s, pos: int) -> int:
    sys.path.insert(0, str(HERE))
    from gpu_decode import token_bytes as tb

    return tb(s, pos)


# -- plans ----------------------------------------------------------------------------------------------------------

# the rules a plan of the 2026-12-04 run did not have (their kernels were not written): the calibration's plans hold
# them, so its kernels are the ones measured (head_argmax: the LM head and the arg-max ran as two launches;
# glu_down_norm, o_glu_down_norm: the o product's fold, the GLU and the down product's fold ran as three launches)
MEASURED_PLAN_HOLDS = ("head_argmax", "glu_down_norm", "o_glu_down_norm", "attn_o_glu_down_norm",
                       "qkv_attn_o_glu_down_norm")
# the rules that make a chained launch (kernels/chain.py): held, a plan's o fold, GLU and down fold are three launches
CHAIN_HOLDS = ("qkv_attn_o_glu_down_norm", "attn_o_glu_down_norm", "o_glu_down_norm", "glu_down_norm")
# the three-phase rule held: a layer's o fold one launch, its GLU and down fold the two-phase chained launch
TWO_PHASE_HOLDS = ("qkv_attn_o_glu_down_norm", "attn_o_glu_down_norm", "o_glu_down_norm")
# the four-phase rule held: a layer's attention a launch of its own before the three-phase chain (fold_o_glu_down)
THREE_PHASE_HOLDS = ("qkv_attn_o_glu_down_norm", "attn_o_glu_down_norm")
# the five-phase rule held: a layer's q/k/v fold a launch of its own before the four-phase chain (two a layer)
FOUR_PHASE_HOLDS = ("qkv_attn_o_glu_down_norm",)


def qwen3_plan(fmt: str, batch: int = 1, held: tuple[str, ...] = ()):
    sys.path.insert(0, str(HERE))
    from lane_figures import qwen3_8b
    from lanefuse.engine.front.model import build_step
    from lanefuse.lane.lower.plan import plan

    cfg = qwen3_8b(36) if fmt == "bf16" else qwen3_8b(36, fmt)
    if batch > 1:
        import dataclasses
        cfg = dataclasses.replace(cfg, max_len=1024)
        return plan(build_step(cfg, 1, batch=batch), held=list(held))
    return plan(build_step(cfg, 1), held=list(held))


# -- calibration ------------------------------------------------------------------------------------------------------

def load_calibration() -> dict:
    return json.loads(CALIBRATION.read_text())


def _measured_kernels(s, cal: dict, rev: str) -> list[tuple[dict, Kernel]]:
    """The 2026-12-04 measurements matched to the kernels of the bf16 plan at `rev` (first layer's, by name and
    shape)."""
    ks = model(s, rev, cal)
    out = []
    for m in cal["measured"]:
        for k in ks:
            if re.sub(r"_128$", "", k.call.name) == m["kernel"] and all(k.extra.get(a) == b for a, b in m.get("match", {}).items()):
                out.append((m, k))
                break
        else:
            raise SystemExit(f"no kernel of the plan matches measurement {m}")
    return out


def fit(cal: dict, rev: str = OLD_REV) -> dict:
    """L and t0 by least squares over the GEMV-family measurements (ncu durations, less each fold's tail measured by
    ncu as elapsed - SM-active cycles), L_attn from attention_split at position 512; the block formats' factor on L
    from the per-token figures (the plan's GEMV loops scaled so the model's token time over bf16's is the measured
    ratio)."""
    s = qwen3_plan("bf16", held=MEASURED_PLAN_HOLDS)
    cal = json.loads(json.dumps(cal))
    ff = cal["ncu_sm_freq_ghz"]
    for m in cal["measured"]:
        if "elapsed_cycles" in m:
            m["idle_us"] = (m["elapsed_cycles"] - m["sm_active_cycles"]) / (ff * 1e3)
    tails = {k: [m["idle_us"] for m in cal["measured"] if m["kernel"] == k] for k in ("fold_gemv_norm_4",
                                                                                         "fold_parts_rope_4")}
    cal["tail_norm_us"] = round(float(np.mean(tails["fold_gemv_norm_4"])), 2)
    cal["tail_rope_us"] = round(float(np.mean(tails["fold_parts_rope_4"])), 2)
    for key, v in (("L_l2_us", 0.64), ("attn_head_us", 0.12), ("combine_c0_us", 1.7)):
        cal.setdefault(key, v)
    # the fold norm tail's L2 round: the measured tail over the rounds rev's norm_row makes (4096 columns, 128 threads)
    fold = next(k for m, k in _measured_kernels(s, cal, rev) if k.call.name.startswith("fold_gemv_norm"))
    cal["L_l2_us"] = round(cal["tail_norm_us"] / fold.extra["tail_rounds"], 4)
    cal["L_l2_note"] = (f"tail_norm_us over norm_row's {fold.extra['tail_rounds']} dependent rounds at {rev} (rows "
                        f"{fold.launch.then.rows}, cols {fold.launch.then.cols}, {fold.threads} threads, a block_sum "
                        f"a round)")
    pairs = _measured_kernels(s, cal, rev)
    # GEMV family: us - tail = t0 + rounds_eff x L (latency regime at 4a43cc2: every one of them far under the cap)
    A, y = [], []
    for m, k in pairs:
        if k.family == "gemv":
            waves = math.ceil(k.blocks / (132 * k.bpsm))
            A.append([1.0, waves * k.rounds])
            y.append(m["us"] - k.tail)
    (t0, L), *_ = np.linalg.lstsq(np.array(A), np.array(y), rcond=None)
    cal["t0_us"], cal["L_us"] = round(float(t0), 3), round(float(L), 4)
    for m, k in pairs:
        if k.family == "attention":
            hr = k.extra["heads_round"]
            cal["L_attn_us"] = round((m["us"] - t0) / (k.rounds * hr), 4)  # a key and head (4a43cc2's loop), kept
            cal["attn_head_us"] = round(((m["us"] - t0) / k.rounds - L) / hr, 4)
        elif k.family == "attention_combine":
            cal["fixed_us"]["attention_combine"] = m["us"]
            # as before (fixed_us = the measured µs, plus the partials' bytes at B_peak): 4a43cc2's figure unchanged
            cal["combine_c0_us"] = round(m["us"] - k.rounds * cal["L_l2_us"], 3)
        elif k.family == "small":
            cal["fixed_us"][k.call.name] = round(m["us"] - t0, 2)
    # block formats: the token ratio to bf16
    cal["format_factor"] = {"dense16": 1.0}
    base = sum(k.us for k in model(s, rev, cal))
    for fmt, meas in MEASURED_TOKEN_US.items():
        if fmt == "bf16":
            continue
        sf = qwen3_plan(fmt, held=MEASURED_PLAN_HOLDS)
        cal["format_factor"][fmt] = 1.0
        ks = model(sf, rev, cal)
        loop = sum(k.us - k.fixed - k.tail for k in ks if k.family == "gemv")
        rest = sum(k.us for k in ks) - loop
        want = meas / MEASURED_TOKEN_US["bf16"] * base
        cal["format_factor"][fmt] = round(float((want - rest) / loop), 4)
    cal["format_factor"].setdefault("q6_k", cal["format_factor"].get("q4_k", 1.0))
    cal["format_factor_note"] = ("q8_0, q4_0, q4_k fitted from the per-token figures (one figure, one factor: no "
                                 "residual); q6_k unmeasured, q4_k's taken")
    cal["fitted_on"] = f"kernels at {rev}, bf16 plan, position 512"
    return cal


def residuals(cal: dict, rev: str = OLD_REV) -> list[tuple[str, float, float]]:
    s = qwen3_plan("bf16", held=MEASURED_PLAN_HOLDS)
    return [(m["label"], m["us"], k.us) for m, k in _measured_kernels(s, cal, rev)]


# -- output ------------------------------------------------------------------------------------------------------------

def kind_of(k: Kernel) -> str:
    e = k.extra
    if "phases" in e:  # a chained launch: each phase's outputs x k
        return f"{k.call.name} " + "+".join(p if isinstance(p, str) else f"{p[0]}x{p[1]}" for p in e["phases"])
    if k.family in ("gemv", "gemv_q8"):
        return f"{k.call.name} {e['n']}x{e['k']}"
    return k.call.name


def summarize(ks: list[Kernel]) -> list[dict]:
    groups: dict[str, list[Kernel]] = collections.OrderedDict()
    for k in ks:
        groups.setdefault(kind_of(k), []).append(k)
    rows = []
    for name, g in groups.items():
        k = g[0]
        rows.append(dict(kind=name, count=len(g), grid=list(k.call.grid), block=list(k.call.block), regs=k.regs,
                         spill=k.spill, blocks_sm=k.bpsm, waves=round(k.waves, 2), warps_sm=round(k.warps_sm, 1),
                         kb_inflight_sm=round(math.ceil(min(k.blocks, 132 * k.bpsm) / 132) * (k.threads // 32)
                                              * k.inflight_warp / 1024, 1),
                         loop=k.extra.get("loop", ""), mb=round(k.bytes / 1e6, 2), tbps=round(k.tbps, 2),
                         us=round(k.us, 1), tail_us=round(k.tail, 1), total_us=round(sum(x.us for x in g), 1)))
    return rows


def breakdown(ks: list[Kernel]) -> dict:
    """Where a token's predicted µs go: every launch's fixed cost (t0, a small kernel's or the combine's fixed part),
    the products' waves (GEMV family, less t0 and tails), the folds' serial tails, attention (the split kernels'
    waves and the combine's rounds and bytes, less fixed costs), the small kernels' bytes."""
    b = collections.OrderedDict((x, 0.0) for x in ("launch fixed", "products", "tails", "attention", "small"))
    for k in ks:
        small = k.family not in ("gemv", "gemv_q8", "attention", "attention_combine")
        b["launch fixed"] += (k.us - k.bytes / 4.25e6) if small else k.fixed
        if k.family in ("gemv", "gemv_q8"):
            att = k.extra.get("attention_us", 0.0)  # a chained attention phase's (fold_attn_o_glu_down)
            b["products"] += k.us - k.fixed - k.tail - att
            b["tails"] += k.tail
            b["attention"] += att
        elif k.family in ("attention", "attention_combine"):
            b["attention"] += k.us - k.fixed
        else:
            b["small"] += k.bytes / 4.25e6
    return b


def attention_stream(k: Kernel, cal: dict) -> str:
    """An attention launch's KV stream (issue 34 item 2: >= 70% of the bandwidth at position 4096): its cache bytes
    over its waves (its µs less t0 and the merge's tail), beside the launch's whole µs."""
    waves = k.us - k.fixed - k.tail
    bw = k.bytes / waves / 1e6 if waves > 0 else 0.0
    return (f"  {k.call.name}: {k.extra.get('splits', 1)} splits x {k.blocks // max(1, k.extra.get('splits', 1))} "
            f"blocks, KV {k.bytes / 1e6:.2f} MB streamed in {waves:.1f} µs of waves: {bw:.2f} TB/s "
            f"({100 * bw / cal['B_peak_TBps']:.0f}% of {cal['B_peak_TBps']}); launch {k.us:.1f} µs = t0 {k.fixed:.1f} "
            f"+ waves + merge {k.tail:.1f} ({k.extra.get('merge_rounds', 0):.0f} L2 rounds)")


def print_breakdown(ks: list[Kernel], title: str) -> dict:
    b = breakdown(ks)
    tot = sum(b.values())
    print(title)
    for name, v in b.items():
        print(f"  {name:14} {v:9.0f} µs  {100 * v / tot:5.1f}%")
    return {k: round(v, 1) for k, v in b.items()}


def print_table(rows: list[dict], title: str) -> None:
    print(title)
    head = (f"  {'kernel kind':36} {'n':>3} {'grid':>13} {'regs':>4} {'sp':>3} {'b/SM':>4} {'waves':>6} "
            f"{'warps/SM':>8} {'KB fl/SM':>8} {'loop':10} {'MB':>8} {'TB/s':>5} {'µs':>7} {'tail':>5} {'Σµs':>8}")
    print(head)
    for r in rows:
        g = "x".join(map(str, r["grid"]))
        print(f"  {r['kind']:36} {r['count']:3d} {g:>13} {r['regs']:4d} {r['spill']:3d} {r['blocks_sm']:4d} "
              f"{r['waves']:6.2f} {r['warps_sm']:8.1f} {r['kb_inflight_sm']:8.1f} {r['loop']:10} {r['mb']:8.2f} "
              f"{r['tbps']:5.2f} {r['us']:7.1f} {r['tail_us']:5.1f} {r['total_us']:8.1f}")


def rev_label(rev: str | None) -> str:
    """A commit's short hash (HEAD resolved), or 'work tree'."""
    if rev is None:
        return "work tree"
    r = subprocess.run(["git", "rev-parse", "--short=7", rev], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() or rev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--plan", help="a saved plan (lane/lower/planfile.py) instead of the Qwen3-8B steps")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--pos", type=int, action="append",
                    help="the position attention reads up to (default 512); given again (--pos 512 --pos 4096), each "
                         "further position a row of --pos-formats' plans")
    ap.add_argument("--pos-formats", default="bf16", help="the plans modelled at the further positions (default bf16)")
    ap.add_argument("--rev", default=None, help="model the kernels of this commit (default: the work tree)")
    ap.add_argument("--compare", default=OLD_REV, help="also model the kernels of this commit ('' for none)")
    ap.add_argument("--all", action="store_true", help="every kernel launch, not only each kind")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--fit", action="store_true", help="refit the calibration and rewrite its file")
    ap.add_argument("--geometry", action="store_true", help="also price every GEMV kind at the other geometries "
                    "(outputs a warp x splits of k) the kernels take")
    ap.add_argument("--unchained", action="store_true", help="also model each plan with the chained launch's rules "
                    f"held ({', '.join(CHAIN_HOLDS)}: the o fold, the GLU and the down fold three launches), labelled "
                    "`unchained`: the before of the chain")
    ap.add_argument("--two-phase", action="store_true", help="also model each plan with the three- and four-phase "
                    "chains' rules "
                    f"held ({', '.join(TWO_PHASE_HOLDS)}: the o product's fold a launch of its own before the two-phase "
                    "chain), labelled `two-phase`: the before of the three-phase chain")
    ap.add_argument("--three-phase", action="store_true", help="also model each plan with the four-phase chain's rule "
                    f"held ({', '.join(THREE_PHASE_HOLDS)}: the attention a launch of its own before the three-phase "
                    "chain), labelled `three-phase`: the before of the four-phase chain")
    ap.add_argument("--four-phase", action="store_true", help="also model each plan with the five-phase chain's rule "
                    f"held ({', '.join(FOUR_PHASE_HOLDS)}: the q/k/v fold a launch of its own before the four-phase "
                    "chain), labelled `four-phase`: the before of the five-phase chain")
    ap.add_argument("--pdl", action="store_true", help="also model each plan under programmatic dependent launch "
                    f"(an assumed t0 of {T0_PDL_US} µs a launch and the GEMVs' L2 prefetch; not calibrated)")
    ap.add_argument("--fit-lane", action="store_true", help="fit the lane's per-kind costs (rules/lanes/cuda.yaml "
                    "`costs:`) to this model's predictions for the Qwen3-8B plans, print them beside the lane's, and "
                    "stop")
    ap.add_argument("--predict-plans", metavar="DIR", help="write DIR/launch-model.json: the prediction for every "
                    "saved qwen3-8b*-decode.json there (bench/gpu_suite.sh prepare), and stop")
    a = ap.parse_args()
    positions = a.pos or [512]
    sys.path.insert(0, str(HERE))
    cal = load_calibration()
    if a.predict_plans:
        predict_plans(a.predict_plans, cal, (a.pos or [512])[0])
        return
    if a.fit_lane:
        lane_fit(a.formats.split(","), positions, cal, a.rev)
        return
    if a.fit:
        cal = fit(cal)
        CALIBRATION.write_text(json.dumps(cal, indent=1) + "\n")
        print(f"calibration written to {CALIBRATION.relative_to(ROOT)}")
    print("PREDICTIONS from a model calibrated on the 2026-12-04 H200 ncu figures (kernels at 4a43cc2), not "
          "measurements.")
    print(f"model: L = {cal['L_us']} µs a dependent load round, t0 = {cal['t0_us']} µs a launch; fold tails: norm "
          f"norm_row's rounds x L_l2 = {cal['L_l2_us']} µs ({cal['tail_norm_us']} µs at 4a43cc2), rope "
          f"{cal['tail_rope_us']} µs; attention a round L + heads x {cal['attn_head_us']} µs; combine "
          f"{cal['combine_c0_us']} µs + rounds x L_l2; B_peak = {cal['B_peak_TBps']} TB/s; block-format factor on L "
          f"(4-value loop) {cal['format_factor']}")
    c0, cbw = cublas_anchor()
    print(f"cross-check of t0: cuBLAS's bf16 GEMV on the same H200 (cublas-gemv.log, 4 shapes) costs {c0:.1f} µs a "
          f"launch beyond its bytes at {cbw:.2f} TB/s, back to back without PDL: a launch that streams need not pay "
          f"the model's t0 of {cal['t0_us']} µs (fitted on the 4a43cc2 kernels)")
    print("\ncalibration residuals (kernels at 4a43cc2, bf16 plan; measured 2026-12-04):")
    for label, meas, pred in residuals(cal):
        print(f"  {label:44} measured {meas:7.1f} µs  model {pred:7.1f} µs  {100 * (pred / meas - 1):+6.1f}%")
    revs = [a.rev] + ([a.compare] if a.compare and a.compare != a.rev else [])
    runs = ([(Path(a.plan).stem, positions[0])] if a.plan else
            [(f, positions[0]) for f in a.formats.split(",")] +
            [(f, p) for p in positions[1:] for f in a.pos_formats.split(",")])
    doc = dict(note="PREDICTIONS (bench/launch_model.py), calibrated on 2026-12-04 ncu figures; not measurements",
               calibration=cal, positions=positions, batch=a.batch, plans={})
    summary = []
    plans: dict[str, object] = {}
    for name, pos in runs:
        if a.plan:
            from lanefuse.lane.lower.planfile import load
            s = load(a.plan)
        else:
            s = plans.get(name) or qwen3_plan(name, a.batch)
            plans[name] = s
        tb = token_bytes(s, pos)
        floor = tb / 4.25e6
        key = name if pos == positions[0] else f"{name}@{pos}"
        doc["plans"][key] = dict(position=pos, token_bytes=tb, floor_us=floor, launches=s.n_launches, revs={})
        variants = [(rev, ()) for rev in revs]
        if a.four_phase and not a.plan:
            variants.insert(0, (a.rev, FOUR_PHASE_HOLDS))
        if a.three_phase and not a.plan:
            variants.insert(0, (a.rev, THREE_PHASE_HOLDS))
        if a.two_phase and not a.plan:
            variants.insert(0, (a.rev, TWO_PHASE_HOLDS))
        if a.unchained and not a.plan:
            variants.insert(0, (a.rev, CHAIN_HOLDS))
        for rev, held in variants:
            sv = qwen3_plan(name, a.batch, held=held) if held else s
            ks = model(sv, rev, cal, pos)
            tot = sum(k.us for k in ks)
            label = {CHAIN_HOLDS: "unchained", TWO_PHASE_HOLDS: "two-phase", THREE_PHASE_HOLDS: "three-phase",
                     FOUR_PHASE_HOLDS: "four-phase"}.get(held) or rev_label(rev)
            rows = summarize(ks)
            print_table(rows, f"\n{name} (batch {a.batch}, position {pos}), kernels of {label}: {len(ks)} kernel "
                              f"launches, {tot:.0f} µs a token predicted, floor {floor:.0f} µs ({tb / 1e9:.2f} GB at "
                              f"4.25 TB/s): x{tot / floor:.2f}")
            att = [k for k in ks if k.family == "attention"] or \
                [k.extra["attention_phase"] for k in ks if "attention_phase" in k.extra]
            if att:  # the first layer's attention (a chain's attention phase where the chain runs it)
                print(attention_stream(att[0], cal))
            bd = print_breakdown(ks, f"  where the predicted {tot:.0f} µs go ({name}, position {pos}, {label}):")
            if a.geometry and rev == a.rev:
                print_geometries(ks, cal)
            if a.all:
                for k in ks:
                    print(f"    #{k.index:3d} {k.call.name:24} grid {k.call.grid} regs {k.regs} b/SM {k.bpsm} "
                          f"waves {k.waves:.2f} MB {k.bytes / 1e6:.2f} {k.us:.1f} µs")
            doc["plans"][key]["revs"][label] = dict(us=tot, x_floor=tot / floor, breakdown=bd, kinds=rows)
            if a.all:
                doc["plans"][key]["revs"][label]["launches"] = [dict(index=k.index, kernel=k.call.name, grid=list(k.call.grid), block=list(k.call.block),
                               regs=k.regs, blocks_sm=k.bpsm, waves=k.waves, bytes=k.bytes, us=k.us) for k in ks]
            summary.append((name, pos, label, tot, tot / floor, floor, bd))
            if rev == a.rev:  # the same launches at cuBLAS's fixed cost a launch (no PDL): the t0 sensitivity
                tc = at_t0(ks, cal, c0)
                print(f"  at cuBLAS's fixed cost a launch ({c0:.1f} µs, no PDL; not this model's calibration): "
                      f"{tc:.0f} µs a token, x{tc / floor:.2f}")
                doc["plans"][key]["revs"][label + " at cuBLAS t0"] = dict(us=tc, x_floor=tc / floor)
            if a.pdl and rev == a.rev:  # the kernels modelled, not the --compare ones (no PDL there)
                kp = with_pdl(ks, cal)
                tp = sum(k.us for k in kp)
                bdp = print_breakdown(kp, f"  under PDL (t0 {cal.get('t0_pdl_us', T0_PDL_US)} µs a launch ASSUMED, "
                                          f"prefetch hiding {sum(k.extra.get('pdl_hidden_us', 0) for k in kp):.0f} "
                                          f"µs): {tp:.0f} µs a token predicted, x{tp / floor:.2f}")
                doc["plans"][key]["revs"][label + " + PDL"] = dict(us=tp, x_floor=tp / floor, breakdown=bdp)
                summary.append((name, pos, label + "+PDL", tp, tp / floor, floor, bdp))
    print("\nµs a token (PREDICTED), x the floor (token bytes / 4.25 TB/s), beside the measured 2026-12-04 figure:")
    print(f"  {'plan':8} {'pos':>5} {'kernels':10} {'µs/token':>10} {'x floor':>8} {'floor µs':>9} {'measured':>9}")
    for name, pos, label, tot, xf, floor, bd in summary:
        meas = MEASURED_TOKEN_US.get(name) if (label == OLD_REV and a.batch == 1 and not a.plan and pos == 512) \
            else None
        print(f"  {name:8} {pos:5d} {label:10} {tot:10.0f} {xf:8.2f} {floor:9.0f} {meas if meas else '':>9}")
    print("\nwhere a token's predicted µs go (launch fixed: t0 / fixed parts of every launch; products: the GEMV "
          "family's waves; tails: the folds' last-block epilogues; attention: split + combine beyond t0; small: the "
          "small kernels' bytes):")
    print(f"  {'plan':8} {'pos':>5} {'kernels':10} " + " ".join(f"{x:>13}" for x in summary[0][6]))
    for name, pos, label, tot, xf, floor, bd in summary:
        print(f"  {name:8} {pos:5d} {label:10} " + " ".join(f"{v:8.0f} {100 * v / tot:3.0f}%" for v in bd.values()))
    doc["summary"] = [dict(plan=n, position=p, kernels=l, us=t, x_floor=x, floor_us=f, breakdown=b)
                      for n, p, l, t, x, f, b in summary]
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
