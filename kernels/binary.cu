// out = a op (act(b) when gated, else b); b of a's size, one row of `row` values broadcast over a's rows, or one
// value every `each` values of a. With `qw` (glu_act_mul_quant, elementwise_quant) the result's quantized form too
// (quant.cu's blocks): n is whole blocks and a warp's 32 values one block (the grid strides by whole warps), so each
// warp quantizes the values it just computed (out null: that form alone).
extern "C" __global__ void binary(const float* a, const float* b, float* out, i64 n, i64 row, i64 op, i64 gate,
                                  i64 each, signed char* qw, signed char* ql, float* qs) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float bv = b[each ? i / each : (row ? i % row : i)];
        if (gate >= 0) bv = act_apply((int)gate, bv);
        float av = a[i];
        float y = op == 0 ? av + bv : (op == 1 ? av * bv : av - bv);
        if (out) out[i] = y;
        if (qw) quant_block(y, qw, ql, qs, i >> 5, threadIdx.x & 31);
    }
}
