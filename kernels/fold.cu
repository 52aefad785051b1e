// A GEMV and then a norm in one launch (gemv_norm_epilogue): every block runs its outputs of the product; the last
// block to arrive (an arrival counter it resets to zero) runs the norm over every row, reading through L2.
__device__ __forceinline__ void fold_tail(unsigned* counter, i64 rows, const NormArgs& a) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x * gridDim.y * gridDim.z - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (i64 r = 0; r < rows; r++) norm_row(a, r);
    if (threadIdx.x == 0) *counter = 0u;
}

#define FOLD_KERNEL(NAME, PW)                                                                                 \
    extern "C" __global__ void __launch_bounds__(128)                                                         \
        NAME(const float* x, const void* w, i64 fmt, const float* bias, DST_PARAMS(y), i64 k, i64 n, i64 m,  \
             unsigned* counter, i64 rows, NORM_PARAMS) {                                                      \
        gemv_body<PW>((int)fmt, x, w, bias, DST(y), nullptr, k, n, m, 1, blockIdx.x);                         \
        fold_tail(counter, rows, NORM_ARGS);                                                                  \
    }
FOLD_KERNEL(fold_gemv_norm_1, 1)
FOLD_KERNEL(fold_gemv_norm_4, 4)
