// Folds run as one launch. A GEMV and then a norm (gemv_norm_epilogue): every block runs its outputs of the product;
// the last block to arrive (an arrival counter it resets to zero) runs the norm over every row, two at a time where
// they read four values a load (norm_rows_tail), reading through L2.
template <int R = 2>
__device__ __forceinline__ void fold_tail(unsigned* counter, i64 rows, const NormArgs& a) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x * gridDim.y * gridDim.z - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    norm_rows_tail<R>(a, rows);
    if (threadIdx.x == 0) *counter = 0u;
}

#define FOLD_KERNEL(NAME, PW)                                                                                 \
    extern "C" __global__ void GEMV_BOUNDS                                                         \
        NAME(const float* x, const void* w, i64 fmt, const float* bias, DST_PARAMS(y), i64 k, i64 n, i64 m,  \
             unsigned* counter, i64 rows, NORM_PARAMS) {                                      \
        gemv_prefetch<PW>((int)fmt, w, nullptr, k, n, 1, blockIdx.x);                          \
        PDL_ENTER();                                                                          \
        gemv_body<PW>((int)fmt, x, w, bias, DST(y), nullptr, k, n, m, 1, blockIdx.x);                         \
        fold_tail(counter, rows, NORM_ARGS);                                                                  \
    }
FOLD_KERNEL(fold_gemv_norm_1, 1)
FOLD_KERNEL(fold_gemv_norm_4, 4)

// The same over a quantized activation (gemv_q8.cu's body).
extern "C" __global__ void __launch_bounds__(128)
    fold_gemv_norm_q8(const signed char* xw, const signed char* xl, const float* xs, const void* w, i64 fmt,
                      const float* bias, DST_PARAMS(y), i64 k, i64 n, i64 m, unsigned* counter, i64 rows,
                      NORM_PARAMS) { PDL_ENTER();
    q8_body((int)fmt, QX{xw, xl, xs}, w, bias, DST(y), k, n, m, blockIdx.x);
    fold_tail<1>(counter, rows, NORM_ARGS);
}

// A GEMV and then the arg-max of each row of its result (head_argmax: the LM head and the step's next token, with its
// advance) in one launch. Every block runs its outputs of the product, reads them back (a warp a row, a lane an output)
// and folds each row's best into the row's 64-bit key with one atomicMax: am_key orders the value in the high word and
// the complement of the index in the low, so the larger value wins and, among equal values, the smaller index —
// numpy's argmax, a NaN above every number (the first NaN wins) and -0 equal to +0. The last block to arrive (an
// arrival counter) writes each row's index and the advance as argmax_rows does (argmax.cu), and leaves the keys and
// the counter zero (a key is never zero: the lowest value's high word is ~bits(-inf) > 0).
__device__ __forceinline__ unsigned long long am_key(float v, i64 i) {
    unsigned u;
    if (v != v) u = 0xFFFFFFFFu;
    else {
        u = __float_as_uint(v == 0.f ? 0.f : v);
        u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    }
    return ((unsigned long long)u << 32) | (unsigned long long)(0xFFFFFFFFu - (unsigned)i);
}

// The block's outputs j0..j0+nj-1 (nj <= 32) of rows r0..r0+nr-1 of the product y (n outputs a row, m rows).
__device__ __forceinline__ void argmax_tail(const Dst& y, i64 n, i64 m, i64 j0, int nj, i64 r0, int nr,
                                            unsigned long long* keys, unsigned* counter, int* out, int* token,
                                            int* position, i64 step, i64 batch) {
    __shared__ int last;
    __syncthreads();  // every warp's outputs stored: a block's own stores are visible to it past the barrier
    int lane = threadIdx.x & 31;
    for (i64 r = r0 + (threadIdx.x >> 5); r < min(m, r0 + nr); r += blockDim.x >> 5) {
        i64 j = j0 + lane;
        unsigned long long b = lane < nj && j < n ? am_key(y.y[dst_at(y, r * n + j)], j) : 0ull;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            unsigned long long c = __shfl_xor_sync(0xFFFFFFFFu, b, o);
            b = c > b ? c : b;
        }
        if (lane == 0 && b) atomicMax(keys + r, b);
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x * gridDim.y * gridDim.z - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (i64 r = threadIdx.x; r < m; r += blockDim.x) {
        unsigned long long b = __ldcg(keys + r);
        int idx = (int)(0xFFFFFFFFu - (unsigned)(b & 0xFFFFFFFFull));
        out[r] = idx;
        if (token && batch) {  // a batch: every row's token and position, each row a sequence of its own
            token[r] = idx;
            position[r] += (int)step;
        }
        keys[r] = 0ull;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (token && !batch) {
            token[0] = out[m - 1];
            position[0] += (int)step;
        }
        *counter = 0u;
    }
}

#define ARGMAX_PARAMS unsigned long long *keys, unsigned *counter, int *out, int *token, int *position, i64 step, i64 batch
#define ARGMAX_ARGS keys, counter, out, token, position, step, batch
#define FOLD_ARGMAX_KERNEL(NAME, PW)                                                                          \
    extern "C" __global__ void GEMV_BOUNDS NAME(const float* x, const void* w, i64 fmt, const float* bias,   \
                                                DST_PARAMS(y), i64 k, i64 n, i64 m, ARGMAX_PARAMS) {        \
        gemv_prefetch<PW>((int)fmt, w, nullptr, k, n, 1, blockIdx.x);                                       \
        PDL_ENTER();                                                                                        \
        gemv_body<PW>((int)fmt, x, w, bias, DST(y), nullptr, k, n, m, 1, blockIdx.x);                       \
        argmax_tail(DST(y), n, m, (i64)blockIdx.x * WARPS * PW, WARPS * PW, (i64)blockIdx.y * GR, GR,        \
                    ARGMAX_ARGS);                                                                           \
    }
FOLD_ARGMAX_KERNEL(fold_gemv_argmax_1, 1)
FOLD_ARGMAX_KERNEL(fold_gemv_argmax_4, 4)

extern "C" __global__ void __launch_bounds__(128)
    fold_gemv_argmax_q8(const signed char* xw, const signed char* xl, const float* xs, const void* w, i64 fmt,
                        const float* bias, DST_PARAMS(y), i64 k, i64 n, i64 m, ARGMAX_PARAMS) { PDL_ENTER();
    q8_body((int)fmt, QX{xw, xl, xs}, w, bias, DST(y), k, n, m, blockIdx.x);
    argmax_tail(DST(y), n, m, (i64)blockIdx.x * QWARPS, QWARPS, (i64)blockIdx.y * QGR, QGR, ARGMAX_ARGS);
}

// Products in parts and then their heads' epilogue: parts_rope.cu (parts_rope_body; the chain module runs the same
// phase, chain.cu).
#define PARTS_ROPE_KERNEL(NAME, PW)                                                                           \
    extern "C" __global__ void GEMV_BOUNDS                                                         \
        NAME(const float* x, const i64* t, i64 nparts, i64 fmt, i64 k, i64 m, unsigned* counters,            \
             const float* cos, const float* sin, const int* posp, i64 slot) {                \
        parts_prefetch<PW>((int)fmt, t, nparts, k);                                           \
        PDL_ENTER();                                                                          \
        parts_rope_body<PW>((int)fmt, x, QX{nullptr, nullptr, nullptr}, t, nparts, k, m, counters, cos, sin,   \
                            posp, slot);                                                                      \
    }
PARTS_ROPE_KERNEL(fold_parts_rope_1, 1)
PARTS_ROPE_KERNEL(fold_parts_rope_4, 4)

extern "C" __global__ void __launch_bounds__(128)
    fold_parts_rope_q8(const signed char* xw, const signed char* xl, const float* xs, const i64* t, i64 nparts,
                       i64 fmt, i64 k, i64 m, unsigned* counters, const float* cos, const float* sin, const int* posp,
                       i64 slot) { PDL_ENTER();
    parts_rope_body<0>((int)fmt, nullptr, QX{xw, xl, xs}, t, nparts, k, m, counters, cos, sin, posp, slot);
}

// An embedding gather and then a norm of the gathered rows (embed_norm), a block a row: the row gathered (decoded
// from its format, times scale) and kept in `out`, then normed from there as norm_rows does (rows of the norm's cols).
extern "C" __global__ void __launch_bounds__(1024) fold_gather_norm(const void* table, i64 fmt, const int* index,
                                                                   float* out, float scale, NORM_PARAMS) { PDL_ENTER();
    i64 r = blockIdx.x, row = index[r];
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x)
        out[r * cols + c] = wget((int)fmt, table, row * cols + c) * scale;
    __syncthreads();  // the row written is seen by every thread of the block (norm_row reads it through L2)
    NormArgs a = NORM_ARGS;
    norm_row<NORM_VBATCH_WIDE>(a, r);
}
