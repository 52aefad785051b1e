// The gate products and the gates in one launch (gdn_gate_projections): `parts` warps a (row, head) (1, 2 or 4: the
// warps of one block), each the dots of x's row with wb's and wa's row h over its part of k (checkpoint rows in `fmt`
// and `fmta`, wget), the parts' sums added in the block's shared memory in part order by the unit's first warp; then
// beta = sigmoid(x.wb) and decay = -exp(al[h]) * softplus(x.wa + dt[h]) (decay.cu's softplus).
extern "C" __global__ void __launch_bounds__(128) gate_proj(const float* x, const void* wb, const void* wa, i64 fmt,
                                                            i64 fmta, const float* dt, const float* al, float* beta,
                                                            float* dec, i64 k, i64 heads, i64 rows, i64 parts) {
    PDL_ENTER();
    __shared__ float pb[4], pa[4];
    i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5, u = warp / parts, part = warp % parts;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    bool in = u < rows * heads;  // no return before the barrier: every warp of the block reaches it
    i64 r = u / heads, h = u % heads, ck = (k + parts - 1) / parts, c1 = min(k, (part + 1) * ck);
    float sb = 0.f, sa = 0.f;
    if (in)
        for (i64 c = part * ck + lane; c < c1; c += 32) {
            float xv = x[r * k + c];
            sb += xv * wget((int)fmt, wb, h * k + c);
            sa += xv * wget((int)fmta, wa, h * k + c);
        }
    sb = warp_sum(sb);
    sa = warp_sum(sa);
    if (parts > 1) {
        if (lane == 0) pb[w] = sb, pa[w] = sa;
        __syncthreads();
        if (part) return;
        sb = sa = 0.f;
        for (int p = 0; p < (int)parts; p++) sb += pb[w + p], sa += pa[w + p];
    }
    if (in && lane == 0) {
        beta[r * heads + h] = 1.f / (1.f + expf(-sb));
        dec[r * heads + h] = -expf(al[h]) * softplus(sa + dt[h]);
    }
}
