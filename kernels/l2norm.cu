// Each unit (a head of a row) scaled to unit length, a block a unit: y = x / sqrt(sum(x^2) + eps).
extern "C" __global__ void l2norm(const float* x, float* y, i64 cols, float eps) { PDL_ENTER();
    const float* xr = x + (i64)blockIdx.x * cols;
    float ss = 0.f;
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) ss += xr[c] * xr[c];
    float inv = rsqrtf(block_sum(ss) + eps);
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) y[(i64)blockIdx.x * cols + c] = xr[c] * inv;
}
