// Each head's own product (head_gemv.py): y[r, h, j] = sum_i x[r, h, i] * W(h, i, j), W head h's rows of w —
// rows_out: (b, a) at h*b, W(h, i, j) = w[(h*b + j)*a + i]; else (a, b) at h*a, W(h, i, j) = w[(h*a + i)*b + j].
// A warp an output; the weights read a value at a time (any width, any format wget decodes). With `qw`
// (gemv_quant.heads) the output's quantized form too (rows of whole blocks): quant.cu's slab_quant_tail over the flat
// output as one row, the last block to store each 32 outputs (256 under the q8k form, llama.cpp's q8_K: K-quant o
// rows) quantizing them. With `upto` (a position; never with `qw`) only the rows below min(m, upto[0] + extra): the
// filled rows of a cache a chunk's expanded latent attention reads. Head h of row r reads its a values of x at
// (r*heads + h)*xpitch + xoff (head_gemv.py `part`; whole: xpitch a, xoff 0).
// head_gemv_rows: HEAD_ROWS rows of x a warp (head_gemv.py ROWS_A_WARP; never with `qw`, whose tail counts a block's
// outputs as consecutive), each value of w read once for the warp's rows where head_gemv re-reads the heads' whole
// matrices every row (a chunk's expanded halves, its output expansion); each output's sum in the same order as
// head_gemv's. A kernel of its own: its accumulators take 56 registers (9 blocks a SM) where head_gemv's 32 keep 16
// (a decode step's single row). nvcc 13 -arch=sm_90 -Xptxas -v: no spill and no stack frame in either (the
// group's rows through an array of row pointers, the last filled row again past the group's end: a row test in
// the loop kept an 8 B stack frame).
#define HEAD_ROWS 8

extern "C" __global__ void __launch_bounds__(128) head_gemv(const float* x, const void* w, i64 fmt, DST_PARAMS(y),
                                                              i64 m, i64 heads, i64 a, i64 b, i64 rows_out,
                                                              unsigned* counters, signed char* qw, signed char* ql,
                                                              float* qs, i64 qwords, const int* upto, i64 extra,
                                                              i64 xpitch, i64 xoff) {
    PDL_ENTER();
    Dst d = DST(y);
    i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    i64 total = m * heads * b, filled = upto ? min(m, max((i64)0, (i64)upto[0] + extra)) : m;
    if (warp < filled * heads * b) {  // no return before the quantizing tail: every thread reaches its barriers
        i64 j = warp % b, h = (warp / b) % heads, r = warp / (b * heads);
        const float* xr = x + (r * heads + h) * xpitch + xoff;
        float s = 0.f;
        for (i64 i = lane; i < a; i += 32)
            s += xr[i] * wget((int)fmt, w, rows_out ? (h * b + j) * a + i : (h * a + i) * b + j);
        s = warp_sum(s);
        if (lane == 0) d.y[dst_at(d, warp)] = s;
    }
    if (qw) slab_quant_tail(d.y, total, 1, blockDim.x >> 5, 1, counters, qw, ql, qs, qwords);  // y plain (check)
}

extern "C" __global__ void __launch_bounds__(128) head_gemv_rows(const float* x, const void* w, i64 fmt,
                                                                   DST_PARAMS(y), i64 m, i64 heads, i64 a, i64 b,
                                                                   i64 rows_out, const int* upto, i64 extra,
                                                                   i64 xpitch, i64 xoff) {
    PDL_ENTER();
    const i64 rw = HEAD_ROWS;
    Dst d = DST(y);
    i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    i64 filled = upto ? min(m, max((i64)0, (i64)upto[0] + extra)) : m;
    if (warp < (filled + rw - 1) / rw * heads * b) {
        i64 j = warp % b, h = (warp / b) % heads, r0 = warp / (b * heads) * rw;
        i64 nr = min(rw, filled - r0);
        const float* xr = x + (r0 * heads + h) * xpitch + xoff;
        i64 step = heads * xpitch;  // from a row of x to the next
        float s[HEAD_ROWS];
#pragma unroll
        for (int t = 0; t < HEAD_ROWS; t++) s[t] = 0.f;
        const float* xt[HEAD_ROWS];  // row t of the group, the last filled one again past it (its sums not stored)
#pragma unroll
        for (int t = 0; t < HEAD_ROWS; t++) xt[t] = xr + min((i64)t, nr - 1) * step;
        for (i64 i = lane; i < a; i += 32) {
            float v = wget((int)fmt, w, rows_out ? (h * b + j) * a + i : (h * a + i) * b + j);
#pragma unroll
            for (int t = 0; t < HEAD_ROWS; t++) s[t] += xt[t][i] * v;
        }
#pragma unroll
        for (int t = 0; t < HEAD_ROWS; t++) {
            float u = warp_sum(s[t]);
            if (lane == 0 && t < nr) d.y[dst_at(d, ((r0 + t) * heads + h) * b + j)] = u;
        }
    }
}
