// y's group g = x's `width` values from g * every + from.
extern "C" __global__ void slice(const float* x, float* y, i64 groups, i64 every, i64 from, i64 width) { PDL_ENTER();
    i64 n = groups * width;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = x[(i / width) * every + from + i % width];
}
