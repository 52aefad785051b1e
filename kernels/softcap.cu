// y = cap * tanh(x / cap).
extern "C" __global__ void softcap(const float* x, float* y, i64 n, float cap) { PDL_ENTER();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = cap * tanhf(x[i] / cap);
}
