// Embedding rows: out row r = the table's row index[r], decoded from its format, times scale. A block a row.
template <int FMT>
__device__ __forceinline__ void gather_row(const void* table, const int* index, float* out, i64 cols, float scale) {
    i64 r = blockIdx.x, t = index[r];
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) out[r * cols + c] = wget<FMT>(table, t * cols + c) * scale;
}
extern "C" __global__ void gather_f32(const void* t, const int* i, float* o, i64 cols, float s) { gather_row<0>(t, i, o, cols, s); }
extern "C" __global__ void gather_f16(const void* t, const int* i, float* o, i64 cols, float s) { gather_row<1>(t, i, o, cols, s); }
extern "C" __global__ void gather_bf16(const void* t, const int* i, float* o, i64 cols, float s) { gather_row<2>(t, i, o, cols, s); }
