// Each head's own product (head_gemv.py): y[r, h, j] = sum_i x[r, h, i] * W(h, i, j), W head h's rows of w —
// rows_out: (b, a) at h*b, W(h, i, j) = w[(h*b + j)*a + i]; else (a, b) at h*a, W(h, i, j) = w[(h*a + i)*b + j].
// A warp an output; the weights read a value at a time (any width, any format wget decodes). With `qw`
// (gemv_quant.heads) the output's quantized form too (quant.cu's blocks; rows of whole blocks): every block arrives
// at the block of 32 outputs its own lie in, and the last of the 32 / warps-a-block to arrive quantizes it, reading
// the stored values back through L2, and resets its counter; with qwords 3 (the q8k form, llama.cpp's q8_K: K-quant
// o rows) at the block of 256 outputs, the last of 256 / warps-a-block reading its values through L2 into shared
// memory and quantizing them a warp (quant.cu's quant_k_block_l2).
extern "C" __global__ void __launch_bounds__(128) head_gemv(const float* x, const void* w, i64 fmt, DST_PARAMS(y),
                                                              i64 m, i64 heads, i64 a, i64 b, i64 rows_out,
                                                              unsigned* counters, signed char* qw, signed char* ql,
                                                              float* qs, i64 qwords) {
    Dst d = DST(y);
    i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    i64 total = m * heads * b;
    if (warp < total) {  // no return before the quantizing tail: every thread reaches its barriers
        i64 j = warp % b, h = (warp / b) % heads, r = warp / (b * heads);
        const float* xr = x + (r * heads + h) * a;
        float s = 0.f;
        for (i64 i = lane; i < a; i += 32)
            s += xr[i] * wget((int)fmt, w, rows_out ? (h * b + j) * a + i : (h * a + i) * b + j);
        s = warp_sum(s);
        if (lane == 0) d.y[dst_at(d, warp)] = s;
    }
    if (!qw) return;
    __shared__ int last;
    __threadfence();
    __syncthreads();
    i64 per = blockDim.x >> 5, span = qwords == 3 ? 256 : 32, blk = (i64)blockIdx.x * per / span;
    if (threadIdx.x == 0) last = atomicAdd(counters + blk, 1u) == (unsigned)(span / per) - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (qwords == 3) {  // the output plain in its own buffer (head_gemv.py's check): values blk * 256 on
        __shared__ float stage[256];
        quant_k_block_l2(d.y, stage, qw, (short*)ql, qs, blk);
    } else if (threadIdx.x < 32) {
        quant_block(__ldcg(d.y + dst_at(d, blk * 32 + lane)), qw, ql, qs, blk, (int)lane);
    }
    if (threadIdx.x == 0) counters[blk] = 0u;
}
