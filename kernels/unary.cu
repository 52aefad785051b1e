// y = act(x): silu, sigmoid, gelu (tanh) or gelu_erf.
extern "C" __global__ void unary(const float* x, float* y, i64 n, i64 a) { PDL_ENTER();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = act_apply((int)a, x[i]);
}
