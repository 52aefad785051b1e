// Embedding rows: out row r = the table's row index[r], decoded from its format, times scale. A block a row.
extern "C" __global__ void gather(const void* table, i64 fmt, const int* index, float* out, i64 cols, float scale) {
    PDL_ENTER();
    i64 r = blockIdx.x, t = index[r];
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) out[r * cols + c] = wget((int)fmt, table, t * cols + c) * scale;
}
