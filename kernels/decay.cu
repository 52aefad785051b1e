// A gated delta net's forget gate: y = -exp(al[h]) * softplus(a + dt[h]), h = i % heads (softplus x past 20 is x).
__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

extern "C" __global__ void decay(const float* a, const float* dt, const float* al, float* y, i64 n, i64 heads) {
    PDL_ENTER();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 h = i % heads;
        y[i] = -expf(al[h]) * softplus(a[i] + dt[h]);
    }
}
