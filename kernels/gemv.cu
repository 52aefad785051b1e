// The GEMV kernels: y = x · wᵀ (+ bias), soft-capped where cap > 0, for each format and 1 or 4 outputs a warp;
// split-K partials summed in order with the bias (and the cap) by gemv_combine.
#define GEMV_KERNEL(NAME, PW)                                                                                   \
    extern "C" __global__ void GEMV_BOUNDS NAME(const float* x, const void* w, i64 fmt, const float* bias, \
                                                           DST_PARAMS(y), float* part, i64 k, i64 n, i64 m,         \
                                                           i64 split, float cap) {                                  \
        gemv_prefetch<PW>((int)fmt, w, nullptr, k, n, split, blockIdx.x);                                  \
        PDL_ENTER();                                                                                        \
        gemv_body<PW>((int)fmt, x, w, bias, DST(y), part, k, n, m, split, blockIdx.x, cap);                         \
    }
GEMV_KERNEL(gemv_1, 1)
GEMV_KERNEL(gemv_4, 4)
extern "C" __global__ void gemv_combine(const float* part, const float* bias, DST_PARAMS(y), i64 n, i64 m, i64 split,
                                        float cap) { PDL_ENTER();
    Dst d = DST(y);
    i64 total = m * n;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (i64)gridDim.x * blockDim.x) {
        float s = 0.f;
        for (i64 z = 0; z < split; z++) s += part[z * total + e];
        if (bias) s += bias[e % n];
        d.y[dst_at(d, e)] = capped(s, cap);
    }
}
