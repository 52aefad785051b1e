// Each (row, head) unit of the result: a's `ha` values, then b's `hb`; landing where the Dst says.
extern "C" __global__ void join(const float* a, const float* b, DST_PARAMS(y), i64 units, i64 ha, i64 hb) { PDL_ENTER();
    Dst d = DST(y);
    i64 w = ha + hb, n = units * w;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 u = i / w, c = i % w;
        d.y[dst_at(d, i)] = c < ha ? a[u * ha + c] : b[u * hb + c - ha];
    }
}
