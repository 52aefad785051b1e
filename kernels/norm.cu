// RMSNorm of a row (or of each of `heads` equal parts of it), a block a row: s = x (+ add, itself normed first under
// `pre`), written to `sum` when set, then y = s / rms(s) (· w) landing where the Dst says, and quantized (quant.cu's
// blocks) where the launch writes its quantized form too — from the values in registers where it writes that form
// alone (y null: a warp's 32 values one block). Reads go through L2
// (__ldcg) so a fold's last block sees what the other blocks of its launch wrote.
struct NormArgs {
    const float* x;
    i64 xpitch, xoff;  // row r of x at r * xpitch + xoff (a part of every unit), else xpitch = cols
    const float* add;
    const float* prew;
    float preeps;
    int pre;
    float* sum;
    const float* w;
    float eps;
    i64 cols, heads;
    Dst y;
    signed char *qw, *ql;  // the result's quantized form (qw null: none): words, low words (null: one word), scales
    float* qs;
    int qwords;  // its words a value: 1, 2, or 3 for llama.cpp's q8_K (blocks of 256; ql its int16 sums of 16 words)
};

// A norm's parameters, their names prefixed by p (empty: NORM_PARAMS; chain.cu's o phase takes a second set, o_).
#define NORM_PARAMS_OF(p)                                                                                         \
    const float *p##nx, i64 p##xpitch, i64 p##xoff, const float *p##add, const float *p##prew, float p##preeps,    \
        i64 p##pre, float *p##sum, const float *p##nw, float p##eps, i64 p##cols, i64 p##heads, DST_PARAMS(p##ny), \
        signed char *p##qw, signed char *p##ql, float *p##qs, i64 p##qwords
#define NORM_ARGS_OF(p)                                                                                           \
    NormArgs{p##nx, p##xpitch, p##xoff, p##add, p##prew, p##preeps, (int)p##pre, p##sum, p##nw, p##eps, p##cols, \
             p##heads, DST(p##ny), p##qw, p##ql, p##qs, (int)p##qwords}
#define NORM_PARAMS NORM_PARAMS_OF()
#define NORM_ARGS NORM_ARGS_OF()

// The value a row's element i normalizes: x (+ add, itself normed first under `pre`), read through L2.
__device__ __forceinline__ float norm_in(const NormArgs& a, const float* xr, const float* ar, float pinv, i64 i) {
    float v = __ldcg(xr + i);
    if (ar) v += a.pre ? __ldcg(ar + i) * pinv * a.prew[i] : __ldcg(ar + i);
    return v;
}

// Each thread takes its elements c = threadIdx.x + j·blockDim.x in batches of NORM_BATCH, every load of a batch issued
// before the first is used: a fold's tail runs this in one block of 128 threads after the product, and one dependent
// L2 round trip an element (32 a pass for 4096 columns) cost ~42 µs a launch on an H200 (2026-12-04 ncu: the idle
// SMs' time at the end of fold_gemv_norm). Sums run in the same order as one element at a time.
#define NORM_BATCH 8
// Where every row, head, added operand and pre-norm weight lies on 16-byte words (norm_vec), four values a load:
// elements 4(threadIdx.x + j·blockDim.x)..+3, NORM_VBATCH loads of a batch issued first — a fold's tail over 4096
// columns a pass in one L2 round where NORM_BATCH scalar loads took four (bench/launch_model.py's norm tail: 3 rounds
// instead of 9). Each thread's sum runs over its values in order, four at a time.
#define NORM_VBATCH 8
// A block of 1024 threads (norm_rows, norm_pair_rows, fold_gather_norm: at most 64 registers, where even two float4 a
// batch spilled) keeps one value a thread: NORM_BATCH of them a batch already cover 8192 columns in one round.
#define NORM_VBATCH_WIDE 0

__device__ __forceinline__ bool aligned16(const void* p) { return ((unsigned long long)p & 15) == 0; }

// Whether row r's values may be read four at a time (the quantized form written alone keeps one value a thread: a
// warp's 32 one block).
__device__ __forceinline__ bool norm_vec(const NormArgs& a, const float* xr, const float* ar) {
    return a.y.y && ((a.cols / a.heads) & 3) == 0 && aligned16(xr) && (!ar || aligned16(ar)) &&
           (!a.pre || aligned16(a.prew));
}

// Elements i..i+3 of norm_in, each as norm_in computes it.
__device__ __forceinline__ float4 norm_in4(const NormArgs& a, const float* xr, const float* ar, float pinv, i64 i) {
    float4 v = __ldcg((const float4*)(xr + i));
    if (ar) {
        float4 b = __ldcg((const float4*)(ar + i));
        if (a.pre) {
            float4 pw = *(const float4*)(a.prew + i);
            v.x += b.x * pinv * pw.x, v.y += b.y * pinv * pw.y, v.z += b.z * pinv * pw.z, v.w += b.w * pinv * pw.w;
        } else {
            v.x += b.x, v.y += b.y, v.z += b.z, v.w += b.w;
        }
    }
    return v;
}

// The row's quantized form where the launch writes it beside the row (y set), read back from the row just stored.
__device__ __forceinline__ void norm_quant_epilogue(const NormArgs& a, i64 r) {
    if (a.qw && a.y.y && a.qwords == 3) {  // the q8_K form (quant.cu's quant_k_block): a warp a block of 256 values,
        __syncthreads();                       // read back from the row just stored (its own buffer: rows contiguous)
        i64 nb = a.cols >> 8;
        for (i64 b = threadIdx.x >> 5; b < nb; b += blockDim.x >> 5)
            quant_k_block(a.y.y, a.qw, (short*)a.ql, a.qs, r * nb + b, (int)(threadIdx.x & 31));
    } else if (a.qw && a.y.y) {  // the row's quantized form in the epilogue: a warp a block of 32, from the f32 values
        __syncthreads();         // just stored
        i64 nb = a.cols >> 5;
        int lane = threadIdx.x & 31;
        for (i64 b = threadIdx.x >> 5; b < nb; b += blockDim.x >> 5)
            quant_block(__ldcg(a.y.y + dst_at(a.y, r * a.cols + b * 32 + lane)), a.qw + r * a.cols,
                        a.ql ? a.ql + r * a.cols : nullptr, a.qs + r * nb, b, lane);
    }
}

#define F4_ZERO make_float4(0.f, 0.f, 0.f, 0.f)
__device__ __forceinline__ float sq4(const float4& v) { return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w; }

// A head's values c0, c0 + step, .. (below n; four a load, from element `base` on): every load of the batch issued
// before any is used, zeros past n.
template <int VB>
__device__ __forceinline__ void norm_load4(const NormArgs& a, const float* xr, const float* ar, float pinv, i64 base,
                                           i64 c0, i64 step, i64 n, float4 (&v)[VB]) {
#pragma unroll
    for (int u = 0; u < VB; u++)
        v[u] = c0 + u * step < n ? norm_in4(a, xr, ar, pinv, base + c0 + u * step) : F4_ZERO;
}

// Row r's head h written (its sum where kept, its normed values where the Dst says): values c0, c0 + step, ... of the
// head four a load, VB loads a batch.
template <int VB>
__device__ __forceinline__ void norm_write4(const NormArgs& a, i64 r, const float* xr, const float* ar, float pinv,
                                            float inv, i64 h, i64 hd) {
    const i64 step = 4 * blockDim.x, t4 = 4 * threadIdx.x;
    for (i64 c0 = t4; c0 < hd; c0 += VB * step) {
        float4 v[VB];
        norm_load4(a, xr, ar, pinv, h * hd, c0, step, hd, v);
#pragma unroll
        for (int u = 0; u < VB; u++) {
            i64 c = c0 + u * step;
            if (c >= hd) break;
            float e[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
            for (int q = 0; q < 4; q++) {
                i64 i = h * hd + c + q;
                if (a.sum) a.sum[r * a.cols + i] = e[q];
                a.y.y[dst_at(a.y, r * a.cols + i)] = e[q] * inv * (a.w ? a.w[c + q] : 1.f);
            }
        }
    }
}

// The R rows' sums of squares over n values from `base` (block-wide, every row's loads of a batch issued first): the
// added operand as it is (PRE: the pre-norm's pass over it) or the values norm_in4 gives.
template <int VB, int R, bool PRE>
__device__ __forceinline__ void rows_sum_squares(const NormArgs& a, const float* const (&xr)[R],
                                                 const float* const (&ar)[R], const float (&pinv)[R], i64 base, i64 n,
                                                 float (&ss)[R]) {
    const i64 step = 4 * blockDim.x;
#pragma unroll
    for (int j = 0; j < R; j++) ss[j] = 0.f;
    for (i64 c0 = 4 * threadIdx.x; c0 < n; c0 += VB * step) {
        float4 v[R][VB];
#pragma unroll
        for (int j = 0; j < R; j++) {
            if (PRE) {
#pragma unroll
                for (int u = 0; u < VB; u++)
                    v[j][u] = c0 + u * step < n ? __ldcg((const float4*)(ar[j] + c0 + u * step)) : F4_ZERO;
            } else {
                norm_load4(a, xr[j], ar[j], pinv[j], base, c0, step, n, v[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < R; j++)
#pragma unroll
            for (int u = 0; u < VB; u++) ss[j] += sq4(v[j][u]);
    }
    block_sums<R>(ss);
}

// The vectorized norm of R rows r0.. at once (norm_vec holds for each; norm_rows_tail's pairs): norm_row_vec's passes,
// every row's loads of a sum-of-squares pass issued before any is used, one block reduction for the R sums, then each
// row's write pass (a fold's tail over 2 rows of 4096 columns: 4 dependent L2 rounds where a row at a time took 6).
// Each row's sums run in norm_row_vec's order, so its values are the same bits. (norm_row_vec stays a function of its
// own: as this template at R 1, nvcc 13 spilled 4 B in chain.cu's fold_o_glu_down_4.)
template <int VB, int R>
__device__ __forceinline__ void norm_rows_vec(const NormArgs& a, i64 r0) {
    const float* xr[R];
    const float* ar[R];
    float pinv[R], ss[R];
#pragma unroll
    for (int j = 0; j < R; j++) {
        xr[j] = a.x + (r0 + j) * a.xpitch + a.xoff;
        ar[j] = a.add ? a.add + (r0 + j) * a.cols : nullptr;
        pinv[j] = 1.f;
    }
    if (a.add && a.pre) {
        rows_sum_squares<VB, R, true>(a, xr, ar, pinv, 0, a.cols, ss);
#pragma unroll
        for (int j = 0; j < R; j++) pinv[j] = rsqrtf(ss[j] / (float)a.cols + a.preeps);
    }
    i64 hd = a.cols / a.heads;
    for (i64 h = 0; h < a.heads; h++) {
        float inv[R];
        rows_sum_squares<VB, R, false>(a, xr, ar, pinv, h * hd, hd, ss);
#pragma unroll
        for (int j = 0; j < R; j++) inv[j] = rsqrtf(ss[j] / (float)hd + a.eps);
#pragma unroll
        for (int j = 0; j < R; j++)  // the write pass a row at a time (both rows' loads at once spilled: nvcc 13)
            norm_write4<VB>(a, r0 + j, xr[j], ar[j], pinv[j], inv[j], h, hd);
    }
}

// The vectorized norm_row (norm_vec holds): the same passes, four values a load, VB loads a batch.
template <int VB>
__device__ __forceinline__ void norm_row_vec(const NormArgs& a, i64 r, const float* xr, const float* ar) {
    const i64 step = 4 * blockDim.x, t4 = 4 * threadIdx.x;
    float pinv = 1.f;
    if (ar && a.pre) {
        float ss = 0.f;
        for (i64 c0 = t4; c0 < a.cols; c0 += VB * step) {
            float4 v[VB];
#pragma unroll
            for (int u = 0; u < VB; u++)
                v[u] = c0 + u * step < a.cols ? __ldcg((const float4*)(ar + c0 + u * step)) : F4_ZERO;
#pragma unroll
            for (int u = 0; u < VB; u++) ss += sq4(v[u]);
        }
        pinv = rsqrtf(block_sum(ss) / (float)a.cols + a.preeps);
    }
    i64 hd = a.cols / a.heads;
    for (i64 h = 0; h < a.heads; h++) {
        float ss = 0.f;
        for (i64 c0 = t4; c0 < hd; c0 += VB * step) {
            float4 v[VB];
            norm_load4(a, xr, ar, pinv, h * hd, c0, step, hd, v);
#pragma unroll
            for (int u = 0; u < VB; u++) ss += sq4(v[u]);
        }
        float inv = rsqrtf(block_sum(ss) / (float)hd + a.eps);
        norm_write4<VB>(a, r, xr, ar, pinv, inv, h, hd);
    }
}

// VB: the vector path's loads a batch (0: none; NORM_VBATCH_WIDE where a block of 1024 threads runs it).
template <int VB = NORM_VBATCH>
__device__ __forceinline__ void norm_row(const NormArgs& a, i64 r) {
    const float* xr = a.x + r * a.xpitch + a.xoff;
    const float* ar = a.add ? a.add + r * a.cols : nullptr;
    const i64 step = blockDim.x;
    if constexpr (VB > 0) {
        if (norm_vec(a, xr, ar)) {
            norm_row_vec<VB>(a, r, xr, ar);
            norm_quant_epilogue(a, r);
            return;
        }
    }
    float pinv = 1.f;
    if (ar && a.pre) {
        float ss = 0.f;
        for (i64 c0 = threadIdx.x; c0 < a.cols; c0 += NORM_BATCH * step) {
            float v[NORM_BATCH];
#pragma unroll
            for (int u = 0; u < NORM_BATCH; u++) v[u] = c0 + u * step < a.cols ? __ldcg(ar + c0 + u * step) : 0.f;
#pragma unroll
            for (int u = 0; u < NORM_BATCH; u++)
                if (c0 + u * step < a.cols) ss += v[u] * v[u];
        }
        pinv = rsqrtf(block_sum(ss) / (float)a.cols + a.preeps);
    }
    i64 hd = a.cols / a.heads;
    for (i64 h = 0; h < a.heads; h++) {
        float ss = 0.f;
        for (i64 c0 = threadIdx.x; c0 < hd; c0 += NORM_BATCH * step) {
            float v[NORM_BATCH];
#pragma unroll
            for (int u = 0; u < NORM_BATCH; u++) v[u] = c0 + u * step < hd ? norm_in(a, xr, ar, pinv, h * hd + c0 + u * step) : 0.f;
#pragma unroll
            for (int u = 0; u < NORM_BATCH; u++)
                if (c0 + u * step < hd) ss += v[u] * v[u];
        }
        float inv = rsqrtf(block_sum(ss) / (float)hd + a.eps);
        for (i64 c0 = threadIdx.x; c0 < hd; c0 += NORM_BATCH * step) {
            float v[NORM_BATCH];
#pragma unroll
            for (int u = 0; u < NORM_BATCH; u++) v[u] = c0 + u * step < hd ? norm_in(a, xr, ar, pinv, h * hd + c0 + u * step) : 0.f;
#pragma unroll
            for (int u = 0; u < NORM_BATCH; u++) {
                i64 c = c0 + u * step, i = h * hd + c;
                if (c >= hd) break;
                if (a.sum) a.sum[r * a.cols + i] = v[u];
                float o = v[u] * inv * (a.w ? a.w[c] : 1.f);
                if (a.y.y) a.y.y[dst_at(a.y, r * a.cols + i)] = o;
                else  // the quantized form alone (one head, whole blocks): a warp's 32 values are one block
                    quant_block(o, a.qw + r * a.cols, a.ql ? a.ql + r * a.cols : nullptr, a.qs + r * (a.cols >> 5),
                                i >> 5, (int)(threadIdx.x & 31));
            }
        }
    }
    norm_quant_epilogue(a, r);
}

// Rows 0..rows-1 of a fold's tail (one block): R (1 or 2) at a time where each reads four values a load
// (norm_rows_vec<VB, R>), the rest one at a time; the same values as norm_row a row at a time. R 2 takes ~64 more
// registers in the sum-of-squares pass: fold_gemv_norm_q8 (128 registers) spilled at 2, and chain.cu's kernels at
// four outputs a warp (16 and 8 bytes, nvcc 13): those keep a row at a time, but fold_attn_o_glu_down_slab (the slab of
// 3..8 rows alone in its kernel: 168 registers, no spill).
template <int R = 2, int VB = NORM_VBATCH>
__device__ __forceinline__ void norm_rows_tail(const NormArgs& a, i64 rows) {
    i64 r = 0;
    if constexpr (VB > 0 && R == 2) {
        for (; r + 1 < rows; r += 2) {
            const float* x0 = a.x + r * a.xpitch + a.xoff;
            if (!norm_vec(a, x0, a.add ? a.add + r * a.cols : nullptr) ||
                !norm_vec(a, x0 + a.xpitch, a.add ? a.add + (r + 1) * a.cols : nullptr))
                break;
            norm_rows_vec<VB, 2>(a, r);
            norm_quant_epilogue(a, r);
            norm_quant_epilogue(a, r + 1);
        }
    }
    for (; r < rows; r++) norm_row<VB>(a, r);
}

extern "C" __global__ void __launch_bounds__(1024) norm_rows(NORM_PARAMS) { PDL_ENTER();
    NormArgs a = NORM_ARGS;
    norm_row<NORM_VBATCH_WIDE>(a, blockIdx.x);
}
