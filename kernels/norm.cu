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

#define NORM_PARAMS                                                                                               \
    const float *nx, i64 xpitch, i64 xoff, const float *add, const float *prew, float preeps, i64 pre, float *sum, \
        const float *nw, float eps, i64 cols, i64 heads, DST_PARAMS(ny), signed char *qw, signed char *ql, float *qs, \
        i64 qwords
#define NORM_ARGS \
    NormArgs{nx, xpitch, xoff, add, prew, preeps, (int)pre, sum, nw, eps, cols, heads, DST(ny), qw, ql, qs, (int)qwords}

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

__device__ __forceinline__ void norm_row(const NormArgs& a, i64 r) {
    const float* xr = a.x + r * a.xpitch + a.xoff;
    const float* ar = a.add ? a.add + r * a.cols : nullptr;
    const i64 step = blockDim.x;
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

extern "C" __global__ void __launch_bounds__(1024) norm_rows(NORM_PARAMS) { PDL_ENTER();
    NormArgs a = NORM_ARGS;
    norm_row(a, blockIdx.x);
}
