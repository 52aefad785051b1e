// Several products of one activation in one launch (merged_qkv): part p (11 descriptor words: its weight, bias
// (0: none), outputs n, first output block, Dst) takes the output blocks from its first; each runs the GEMV body.
#define GP 11

template <int PW>
__device__ __forceinline__ void parts_body(int fmt, const float* x, const i64* t, i64 nparts, i64 k, i64 m) {
    int p = 0;
    while (p + 1 < nparts && (i64)blockIdx.x >= t[(p + 1) * GP + 3]) p++;
    const i64* d = t + p * GP;
    Dst y = dst_from(d + 4);
    gemv_body<PW>(fmt, x, (const void*)d[0], (const float*)d[1], y, nullptr, k, d[2], m, 1, blockIdx.x - d[3]);
}

#define PARTS_KERNEL(NAME, PW)                                                                          \
    extern "C" __global__ void GEMV_BOUNDS NAME(const float* x, const i64* t, i64 nparts, i64 fmt, \
                                                           i64 k, i64 m) { PDL_ENTER();                      \
        parts_body<PW>((int)fmt, x, t, nparts, k, m);                                                        \
    }
PARTS_KERNEL(gemm_parts_1, 1)
PARTS_KERNEL(gemm_parts_4, 4)

// The same over a quantized activation (gemv_q8.cu's body: a warp an output, QWARPS outputs a block).
extern "C" __global__ void __launch_bounds__(128) gemm_parts_q8(const signed char* xw, const signed char* xl,
                                                                const float* xs, const i64* t, i64 nparts, i64 fmt,
                                                                i64 k, i64 m) { PDL_ENTER();
    int p = 0;
    while (p + 1 < nparts && (i64)blockIdx.x >= t[(p + 1) * GP + 3]) p++;
    const i64* d = t + p * GP;
    q8_body((int)fmt, QX{xw, xl, xs}, (const void*)d[0], (const float*)d[1], dst_from(d + 4), k, d[2], m,
            blockIdx.x - d[3]);
}
