// The gate and up products of one activation and their GLU in one launch: out = act(x·wgᵀ + bg) · (x·wuᵀ + bu),
// the GEMV's warp per output (or four), slabs of GR rows.
template <int PW>
__device__ __forceinline__ void glu_body(int fmt, const float* x, const void* wg, const void* wu, const float* bg,
                                         const float* bu, float* out, i64 k, i64 n, i64 m, int a) {
    i64 j0 = ((i64)blockIdx.x * WARPS + (threadIdx.x >> 5)) * PW;
    if (j0 >= n) return;
    i64 r0 = (i64)blockIdx.y * GR;
    float ga[PW][GR], ua[PW][GR];
    gemv_tile<PW>(fmt, x, wg, k, m, j0, n, r0, 0, k, ga);
    gemv_tile<PW>(fmt, x, wu, k, m, j0, n, r0, 0, k, ua);
    if ((threadIdx.x & 31) != 0) return;
#pragma unroll
    for (int p = 0; p < PW; p++)
#pragma unroll
        for (int r = 0; r < GR; r++) {
            i64 j = j0 + p, row = r0 + r;
            if (j < n && row < m)
                out[row * n + j] = act_apply(a, ga[p][r] + (bg ? bg[j] : 0.f)) * (ua[p][r] + (bu ? bu[j] : 0.f));
        }
}

#define GLU_KERNEL(NAME, PW)                                                                                \
    extern "C" __global__ void __launch_bounds__(128) NAME(const float* x, const void* wg, const void* wu,      \
                                                           i64 fmt, const float* bg, const float* bu, float* out, \
                                                           i64 k, i64 n, i64 m, i64 a) {                         \
        glu_body<PW>((int)fmt, x, wg, wu, bg, bu, out, k, n, m, (int)a);                                         \
    }
GLU_KERNEL(gemv_glu_1, 1)
GLU_KERNEL(gemv_glu_4, 4)

// The same over a quantized activation (gemv_q8.cu's tile: a warp an output, both products from the same words).
extern "C" __global__ void __launch_bounds__(128) gemv_glu_q8(const signed char* xw, const signed char* xl,
                                                              const float* xs, const void* wg, const void* wu, i64 fmt,
                                                              const float* bg, const float* bu, float* out, i64 k,
                                                              i64 n, i64 m, i64 a) {
    i64 j = (i64)blockIdx.x * QWARPS + (threadIdx.x >> 5);
    if (j >= n) return;
    i64 r0 = (i64)blockIdx.y * QGR;
    QX x{xw, xl, xs};
    float ga[QGR], ua[QGR];
    q8_tile((int)fmt, x, wg, k, m, j, r0, ga);
    q8_tile((int)fmt, x, wu, k, m, j, r0, ua);
    if ((threadIdx.x & 31) != 0) return;
    int nr = (int)min((i64)QGR, m - r0);
    for (int r = 0; r < nr; r++)
        out[(r0 + r) * n + j] = act_apply((int)a, ga[r] + (bg ? bg[j] : 0.f)) * (ua[r] + (bu ? bu[j] : 0.f));
}
