"""`gemm_blas`, `gemm_blas_parts`, `gemm_blas_glu`: the tensor-core products of many rows (gemm_tc.py's GemmTc,
GemmTcParts, GemmTcGlu: their fields, twins and numerics) with the product itself run by cuBLAS (CuPy's binding of
cublasGemmEx) where the lane's `cublas` schedule step prices it cheaper than gemm_tc's own kernel (issue 35: "a
well-kept library is welcome where it is the fastest"); held, the plan is gemm_tc's.

What runs on the device, in the stream CuPy holds current (the runner's, captured into its CUDA graph):
1. gemm_tc_round (gemm_tc.cu): x rounded to bf16 into scratch, rows of kp(k) values (zeros past k), as gemm_tc does;
2. cublasGemmEx per product: y (m, n) row-major is yᵀ (n, m) column-major = w · xᵀ, so the call is transa = T,
   transb = N, cuBLAS's (m, n, k) = (n, m, k), A = w (bf16 checkpoint rows (n, k): column-major k x n, lda = k),
   B = the rounded x (column-major kp x m, ldb = kp), C = y (f32, ldc = n, or the pitch of the rows it lands in),
   Atype = Btype = CUDA_R_16BF, Ctype = CUDA_R_32F, computeType CUBLAS_COMPUTE_32F (f32 accumulation: the tensor
   cores' bf16 products summed in f32), algo CUBLAS_GEMM_DEFAULT, alpha 1 and beta 0 (or 1: the residual added in
   place, y = x·wᵀ + y) as host scalars (captured by value into the graph);
3. the epilogue where cuBLAS's beta cannot be it (a bias, rows added from another array, a destination that is not
   rows of one pitch from a fixed address: a table's row at a position parameter, a batch's slots): the product into
   scratch, then gemm_tc_combine (gemm_tc.cu, one part) adds the bias, then the added rows, and writes the Dst — the
   order of GemmTc's epilogue; the GLU: the up product into out, the gate's into scratch, then binary.cu's gated mul
   in place (out = out · act(gate): Binary's `mul` with a gate, gemm_tc_glu's twin).

The workspace: cuBLAS's own default workspace of CuPy's handle for the device (CuPy's gemmEx sets the handle's stream
to the current stream on every call, and cublasSetStream resets any workspace cublasSetWorkspace gave back to that
default, so a workspace of ours could not be kept through this binding). The runner's warm-up step runs every launch
before capture, so the handle and its workspace exist before a graph is captured; a captured graph keeps using them,
which needs the handle to outlive the graph (CuPy keeps it for the process).

The numerics are gemm_tc's: bf16 operands (w as stored, x rounded to nearest even), products exact in f32, summed in
f32 in cuBLAS's order (its tiles, its k split if it takes one: not ours), so the exact twin (gemm_tc.tc_products,
summed exactly, rounded once) bounds it by gemm_tc.tc_bound — at most k + 1 f32 roundings of a partial sum no larger
than Σ|x̂ ŵ|, doubled — as it bounds gemm_tc; a k split's partial sums added in f32 are among those roundings. The
epilogue then adds in f32 the bias and the rows: where the twin adds them to its own rounded sum, the results differ by
at most the product's bound plus one f32 rounding of the result (half an ulp of |y|) for each addition (tests:
`blas_bound`).

Which products it takes: bf16 checkpoint rows (the only format cuBLAS reads as it is stored: f16, f32 and the block
formats would need a converted copy of the weights; they keep gemm_tc, which decodes a tile at a time). k of any
length runs (lda = k), but the lane prefers it only at k a multiple of 8 (16-byte rows: the aligned kernels whose rate
the price assumes). The price: the lane's (knob tflops_blas, an ASSUMED rate, see lane/lower/knobs.py)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np

from lanefuse.engine.refusal import Refusal
from lanefuse.kernels.common import Dst, Scratch
from lanefuse.kernels.gemm_tc import BLAS_FORMS, GemmTc, GemmTcGlu, GemmTcParts, kp, tc_bound

# cuBLAS's and CUDA's enumerations (cublas_api.h, library_types.h)
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
INT_MAX = 2**31 - 1  # the legacy API's dimensions and leading dimensions are ints
TFLOPS_BLAS = 692.0  # lane/lower/knobs.py's default of knob tflops_blas (where a chip protocol lacks it)
BLAS_FORMATS = ("bf16",)

_ALPHA = np.ones(1, np.float32)  # host scalars: cuBLAS's default pointer mode reads them when the call is made
_BETA = {False: np.zeros(1, np.float32), True: np.ones(1, np.float32)}


def blas_bound(x: np.ndarray, w: np.ndarray, y: np.ndarray, adds: int) -> np.ndarray:
    """How far the device's y may lie from the exact twin's y: the product's bound (gemm_tc.tc_bound), plus half an
    ulp of the result for each of the epilogue's `adds` f32 additions (bias, added rows) made to sums that differ."""
    return tc_bound(x, w) + adds * 2.0**-24 * np.abs(y.astype(np.float64))


BLAS_CALL_US = 2.3  # lane/lower/knobs.py's default of knob blas_call_us (where a chip protocol lacks it)
BLAS_TILE = 128  # the rows and outputs of a tile of cuBLAS's kernel as its price counts them (an assumption)


def blas_fill(m: int, n: int, sms: int) -> float:
    """The share of the SMs a cuBLAS product of m rows and n outputs keeps busy over its waves (the price's
    assumption: tiles of BLAS_TILE x BLAS_TILE, one an SM at a time, no split of k: a product of fewer tiles than
    SMs is priced at their share)."""
    tiles = -(-m // BLAS_TILE) * -(-n // BLAS_TILE)
    return tiles / (-(-tiles // sms) * sms)


def blas_rate(m: int, ns, k: int, knobs) -> float:
    """TFLOP/s the lane takes cuBLAS's calls of m rows and ns outputs each (one after another) to reach together:
    knob tflops_blas (an assumed rate, lane/lower/knobs.py) at each call's `blas_fill`."""
    peak = getattr(knobs, "tflops_blas", TFLOPS_BLAS)
    return sum(ns) / sum(n / blas_fill(m, n, knobs.sms) for n in ns) * peak


def price_us(l, knobs) -> float:
    """The lane's price of one product launch (lane/lower/shim.py launch_us without the table's fixed costs, which
    are the rows' format's for both kinds): a gap for each of its device launches, then its bytes over HBM or its
    flops at its kind's rate, whichever is longer."""
    return knobs.launch_us * l.device_launches() + l.call_us(knobs) + max(l.bytes() / (knobs.hbm_gbps * 1e3),
                                                       l.flops() / (l.rate(knobs) * 1e6))


def prefer(tc, knobs, held=frozenset()):
    """The `cublas` schedule step: the cuBLAS form of tensor-core product `tc` where it can run it, its rows are of
    whole 16-byte chunks, and the lane prices it below `tc` (a tie keeps gemm_tc); else `tc`. Rows in a block format
    take the decoded form (kernels/gemm_deq.py: the rows decoded to bf16 in scratch, then cuBLAS) unless `dequant` is
    held."""
    cls = BLAS_OF.get(type(tc)) if tc.format in BLAS_FORMATS else DECODED_OF.get(type(tc))
    if cls is None or tc.k % 8 or (tc.format not in BLAS_FORMATS and "dequant" in held):
        return tc
    b = cls(**{f.name: getattr(tc, f.name) for f in fields(tc) if f.name != "ksplit"})
    if b.check() is not None:
        return tc
    return b if price_us(b, knobs) < price_us(tc, knobs) else tc


def blas_gemm(denv, w, xb, c, c_at: int, ldc: int, n: int, m: int, k: int, beta: bool) -> None:
    """c[c_at + r·ldc + j] (= or +=) Σ_t w[j, t] · xb[r, t] for r < m, j < n: one cublasGemmEx (module note)."""
    cublas, handle = denv.blas()
    cublas.gemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, _ALPHA.ctypes.data, int(w.data.ptr), CUDA_R_16BF, k,
                  int(xb.data.ptr), CUDA_R_16BF, kp(k), _BETA[bool(beta)].ctypes.data, int(c.data.ptr) + 4 * c_at,
                  CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)


def blas_refusal(fmt: str, m: int, n: int, k: int) -> Refusal | None:
    if fmt not in BLAS_FORMATS:
        return Refusal(f"rows in {fmt} through cuBLAS (it reads {', '.join(BLAS_FORMATS)} rows as they are stored; "
                       f"gemm_tc decodes the others a tile at a time)")
    if max(m, n, kp(k)) > INT_MAX:
        return Refusal(f"a cuBLAS product of {m} rows, {n} outputs, k {k} (its dimensions are ints)")
    return None


class BlasProduct:
    """What the cuBLAS forms share: the lane prices their flops at knob tflops_blas; no tail split (cuBLAS picks its
    own); census names of their own."""

    steps: ClassVar[tuple[str, ...]] = ()

    def tune(self, knobs, held=frozenset()):
        return self

    def rows_of(self, denv, w: str, owner):
        """The bf16 rows (n, k) cuBLAS reads for checkpoint matrix `w`: the weight as stored (kernels/gemm_deq.py's
        forms: decoded into `owner`'s scratch first)."""
        return denv.weight(w)[0]

    def rate(self, knobs) -> float:
        """The lane's rate of its products: `blas_rate` (knob tflops_blas at each call's fill of the SMs)."""
        return blas_rate(self.m, self.outputs_each(), self.k, knobs)

    def epilogues(self) -> int:
        """Its launches beside x's rounding and the cuBLAS calls (gemm_tc_combine; the GLU's gated mul)."""
        return 0

    def device_launches(self) -> int:
        """x rounded, each cuBLAS call, each epilogue launch (kernels/gemm_deq.py's: each matrix's decode too)."""
        return 1 + len(self.outputs_each()) + self.epilogues()

    def call_us(self, knobs) -> float:
        """The cuBLAS calls' fixed cost beyond their launch gaps (knob blas_call_us each: bench/gemm_model.py's
        BLAS_LAUNCH_US over its LAUNCH_US)."""
        return getattr(knobs, "blas_call_us", BLAS_CALL_US) * len(self.outputs_each())


@dataclass(frozen=True)
class GemmBlas(BlasProduct, GemmTc):
    """GemmTc's product (y = x · wᵀ (+ bias) (+ add), bf16 rows) through cuBLAS: x rounded into scratch, one
    cublasGemmEx into y (beta 1: the residual added in place), or into scratch and gemm_tc_combine's epilogue."""

    census: ClassVar[str] = "gemm_blas"

    def outputs_each(self) -> list[int]:
        return [self.n]

    def epilogues(self) -> int:
        return int(self.direct() is None)

    def check(self):
        if self.ksplit != 1:
            return Refusal(f"a cuBLAS product in {self.ksplit} parts along k (cuBLAS splits k itself)")
        return GemmTc.check(self) or blas_refusal(self.format, self.m, self.n, self.k)

    def direct(self) -> tuple[int, int] | None:
        """Where cuBLAS writes y itself: (its first value's index in y's buffer, the values from a row to the next),
        or None where the epilogue is a launch of its own (a bias, rows added from another array, a row at a position
        parameter, a batch's slots, parts of units narrower than a row)."""
        d = self.y
        if self.bias is not None or d.slot or isinstance(d.row, str):
            return None
        if self.add is not None and not (self.add == d.buf and d == Dst(d.buf)):
            return None
        base = 0 if d.row is None else int(d.row) * d.pitch
        if d.unit is None:
            return base, self.n
        if d.unit.width == self.n:
            return base + d.unit.offset, d.unit.pitch
        return None

    def scratch(self):
        xb = self.rounded_x()
        return (xb,) if self.direct() is not None else (xb, Scratch("product", "f32", 4 * self.m * self.n))

    def bytes(self):
        return GemmTc.bytes(self) + (0 if self.direct() is not None else 8 * self.m * self.n)  # written, read back

    def product(self, denv, xb, owner, tag: str) -> None:
        """The product of the rounded x `xb` into y, by cuBLAS, then its epilogue; scratch `tag` of `owner`."""
        from lanefuse.kernels.cupy_env import NULL, i64

        w = self.rows_of(denv, self.w, owner)
        at = self.direct()
        if at is not None:
            blas_gemm(denv, w, xb, denv.array(self.y.buf), at[0], at[1], self.n, self.m, self.k, self.add is not None)
            return
        m, n = self.m, self.n
        p = denv.scratch(owner, Scratch(tag, "f32", 4 * m * n))
        blas_gemm(denv, w, xb, p, 0, n, n, m, self.k, False)
        c = denv.function(self.stem, "gemm_tc_combine")
        c((min(4096, -(-m * n // 256)),), (256,), (p, i64(1), denv.opt(self.bias),
                                                  denv.array(self.add) if self.add else NULL, *denv.dst(self.y),
                                                  i64(n), i64(m)))

    def cuda(self, denv):
        self.product(denv, self.round_x(denv), self, "product")


@dataclass(frozen=True)
class GemmBlasParts(BlasProduct, GemmTcParts):
    """GemmTcParts's products of one activation (q, k and v) through cuBLAS: x rounded once, then each part as
    GemmBlas's product (its own call, its epilogue where it has one)."""

    census: ClassVar[str] = "gemm_blas_parts"

    def outputs_each(self) -> list[int]:
        return [p.n for p in self.parts]

    def epilogues(self) -> int:
        return sum(self.one(p).direct() is None for p in self.parts)

    def one(self, p) -> GemmBlas:
        return GemmBlas(self.x, p.w, self.format, p.y, self.k, p.n, self.m, bias=p.bias)

    def scratch(self):
        return (self.rounded_x(), *(Scratch(f"product{i}", "f32", 4 * self.m * p.n) for i, p in enumerate(self.parts)
                                    if self.one(p).direct() is None))

    def bytes(self):
        return GemmTcParts.bytes(self) + sum(8 * self.m * p.n + 4 * p.n * (p.bias is not None)
                                             for p in self.parts if self.one(p).direct() is None)

    def cuda(self, denv):
        xb = self.round_x(denv)
        for i, p in enumerate(self.parts):
            self.one(p).product(denv, xb, self, f"product{i}")


@dataclass(frozen=True)
class GemmBlasGlu(BlasProduct, GemmTcGlu):
    """GemmTcGlu's gate and up products and their GLU, the products through cuBLAS: the up product into out, the
    gate's into scratch, then binary.cu's gated mul in place (out · act(gate), the twin's order)."""

    census: ClassVar[str] = "gemm_blas_glu"

    def outputs_each(self) -> list[int]:
        return [self.n, self.n]

    def epilogues(self) -> int:
        return 1

    def check(self):
        return GemmTcGlu.check(self) or blas_refusal(self.format, self.m, self.n, self.k)

    def scratch(self):
        return (self.rounded_x(), Scratch("gate", "f32", 4 * self.m * self.n))

    def bytes(self):  # + the gate written, then both read and out written again by the GLU
        return GemmTcGlu.bytes(self) + 16 * self.m * self.n

    def cuda(self, denv):
        from lanefuse.kernels.binary import OPS, Binary
        from lanefuse.kernels.cupy_env import NULL, i64
        from lanefuse.kernels.elementwise import act_code, grid

        m, n, k = self.m, self.n, self.k
        xb = self.round_x(denv)
        out, gate = denv.array(self.out), denv.scratch(self, self.scratch()[1])
        blas_gemm(denv, self.rows_of(denv, self.wu, self), xb, out, 0, n, n, m, k, False)
        blas_gemm(denv, self.rows_of(denv, self.wg, self), xb, gate, 0, n, n, m, k, False)
        g, b = grid(m * n)
        denv.function(Binary.stem, "binary")(g, b, (out, gate, out, i64(m * n), i64(0), i64(OPS.index("mul")),
                                                    i64(act_code(self.act)), i64(0), NULL, NULL, NULL, i64(0)))


BLAS_OF = {GemmTc: GemmBlas, GemmTcParts: GemmBlasParts, GemmTcGlu: GemmBlasGlu}
DECODED_OF: dict = {}  # the same for rows in a block format: kernels/gemm_deq.py's forms (it registers them here)
BLAS_FORMS[:] = [prefer]  # gemm_tc's `cublas` step (its tune) asks this module's choice
