// out = silu(g) * u.
extern "C" __global__ void swiglu(const float* g, const float* u, float* out, i64 n) { PDL_ENTER();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = act_apply(0, g[i]) * u[i];
}
