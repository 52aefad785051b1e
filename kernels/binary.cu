// out = a op (act(b) when gated, else b); b of a's size, one row of `row` values broadcast over a's rows, or one
// value every `each` values of a.
extern "C" __global__ void binary(const float* a, const float* b, float* out, i64 n, i64 row, i64 op, i64 gate,
                                  i64 each) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float bv = b[each ? i / each : (row ? i % row : i)];
        if (gate >= 0) bv = act_apply((int)gate, bv);
        float av = a[i];
        out[i] = op == 0 ? av + bv : (op == 1 ? av * bv : av - bv);
    }
}
