// out = a op (act(b) when gated, else b); b of a's size, one row of `row` values broadcast over a's rows, or one
// value every `each` values of a. With `qw` (glu_act_mul_quant, elementwise_quant) the result's quantized form too
// (quant.cu's blocks): n is whole blocks and a warp's 32 values one block (the grid strides by whole warps), so each
// warp quantizes the values it just computed (out null: that form alone); the q8k form a block of 256 at a time.
__device__ __forceinline__ float binary_at(const float* a, const float* b, i64 i, i64 row, i64 op, i64 gate, i64 each) {
    float bv = b[each ? i / each : (row ? i % row : i)];
    if (gate >= 0) bv = act_apply((int)gate, bv);
    float av = a[i];
    return op == 0 ? av + bv : (op == 1 ? av * bv : av - bv);
}

// qwords 3 (llama.cpp's q8_K, for products over K-quant rows): a block of 256 threads a block of 256 values at a time,
// staged in shared memory, then a warp quantizes them (quant.cu's quant_k_vals).
extern "C" __global__ void binary(const float* a, const float* b, float* out, i64 n, i64 row, i64 op, i64 gate,
                                  i64 each, signed char* qw, signed char* ql, float* qs, i64 qwords) { PDL_ENTER();
    if (qw && qwords == 3) {
        __shared__ float stage[256];
        for (i64 base = (i64)blockIdx.x * 256; base < n; base += (i64)gridDim.x * 256) {
            float y = binary_at(a, b, base + threadIdx.x, row, op, gate, each);
            if (out) out[base + threadIdx.x] = y;
            stage[threadIdx.x] = y;
            __syncthreads();
            if (threadIdx.x < 32)
                quant_k_vals(stage, qw + base, (short*)ql + (base >> 4), qs + (base >> 8), (int)threadIdx.x);
            __syncthreads();  // the stage read before the next block's values land in it
        }
        return;
    }
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float y = binary_at(a, b, i, row, op, gate, each);
        if (out) out[i] = y;
        if (qw) quant_block(y, qw, ql, qs, i >> 5, threadIdx.x & 31);
    }
}
