// The gate products and the gates in one launch (gdn_gate_projections): a warp a (row, head), the dots of x's row
// with wb's and wa's row h (checkpoint rows in `fmt` and `fmta`, wget), then beta = sigmoid(x.wb) and
// decay = -exp(al[h]) * softplus(x.wa + dt[h]) (decay.cu's softplus).
extern "C" __global__ void gate_proj(const float* x, const void* wb, const void* wa, i64 fmt, i64 fmta,
                                     const float* dt, const float* al, float* beta, float* dec, i64 k, i64 heads,
                                     i64 rows) { PDL_ENTER();
    i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= rows * heads) return;
    i64 r = warp / heads, h = warp % heads;
    float sb = 0.f, sa = 0.f;
    for (i64 c = lane; c < k; c += 32) {
        float xv = x[r * k + c];
        sb += xv * wget((int)fmt, wb, h * k + c);
        sa += xv * wget((int)fmta, wa, h * k + c);
    }
    sb = warp_sum(sb);
    sa = warp_sum(sa);
    if (lane == 0) {
        beta[r * heads + h] = 1.f / (1.f + expf(-sb));
        dec[r * heads + h] = -expf(al[h]) * softplus(sa + dt[h]);
    }
}
