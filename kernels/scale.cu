// y = x * factor.
extern "C" __global__ void scale(const float* x, float* y, i64 n, float factor) { PDL_ENTER();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = x[i] * factor;
}
