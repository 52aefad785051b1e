// The GEMV of a quantized activation (the q8 numerics): y = x · wᵀ (+ bias) where x is int8 blocks of 32 with an f32
// scale a block (and, under two words, a low int8 word of the residual in steps of d/254). A warp per output, an
// accumulator per row of a slab of GR rows, each lane a block at a time. Over q8_0 and q4_0 rows the block is eight
// __dp4a of the activation's words against the weights' integers (q4_0's nibbles less 8), the int32 sum times the two
// scales; over q4_k and q6_k rows each value is decoded (wget) and multiplied by the word, the block's sum times the
// activation's scale.
#define QGR 8
#define QWARPS 4

__device__ __forceinline__ int pack4(const signed char* p) {  // four int8 at any alignment as one int
    return (int)(u8)p[0] | ((int)(u8)p[1] << 8) | ((int)(u8)p[2] << 16) | ((int)(u8)p[3] << 24);
}

// The weights' integers of block `b` of row j as eight packed int8 words (q8_0, q4_0), and the block's f16 scale.
__device__ __forceinline__ float wblock_ints(int fmt, const u8* w, i64 row_blocks, i64 j, i64 b, int (&q)[8]) {
    if (fmt == 3) {
        const u8* p = w + (j * row_blocks + b) * 34;
#pragma unroll
        for (int t = 0; t < 8; t++) q[t] = pack4((const signed char*)p + 2 + 4 * t);
        return h16(p);
    }
    const u8* p = w + (j * row_blocks + b) * 18;
#pragma unroll
    for (int t = 0; t < 4; t++) {  // values 4t..4t+3: low nibbles of bytes 4t..; values 16+4t..: their high nibbles
        int lo = 0, hi = 0;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            unsigned v = p[2 + 4 * t + e];
            lo |= ((int)(v & 15u) - 8 & 255) << (8 * e);
            hi |= ((int)(v >> 4) - 8 & 255) << (8 * e);
        }
        q[t] = lo;
        q[t + 4] = hi;
    }
    return h16(p);
}

// A quantized activation: its int8 words, its low words (nullptr under one word), a scale a block of 32.
struct QX {
    const signed char* w;
    const signed char* l;
    const float* s;
};

// Output j of rows r0.. (a slab of QGR) of x · wᵀ, x quantized, warp-summed into acc (every lane holds the sums).
__device__ __forceinline__ void q8_tile(int fmt, const QX& x, const void* w, i64 k, i64 m, i64 j, i64 r0,
                                        float (&acc)[QGR]) {
    int lane = threadIdx.x & 31;
    int nr = (int)min((i64)QGR, m - r0);
    i64 nb = k >> 5;
#pragma unroll
    for (int r = 0; r < QGR; r++) acc[r] = 0.f;
    for (i64 b = lane; b < nb; b += 32) {
        if (fmt == 3 || fmt == 4) {
            int q[8];
            float dw = wblock_ints(fmt, (const u8*)w, nb, j, b, q);
#pragma unroll
            for (int r = 0; r < QGR; r++) {
                if (r < nr) {
                    const int* xv = (const int*)(x.w + (r0 + r) * k + b * 32);
                    int s = 0;
#pragma unroll
                    for (int t = 0; t < 8; t++) s = __dp4a(xv[t], q[t], s);
                    float v = (float)s;
                    if (x.l) {
                        const int* lv = (const int*)(x.l + (r0 + r) * k + b * 32);
                        int sl = 0;
#pragma unroll
                        for (int t = 0; t < 8; t++) sl = __dp4a(lv[t], q[t], sl);
                        v += (float)sl / 254.f;
                    }
                    acc[r] += dw * x.s[(r0 + r) * nb + b] * v;
                }
            }
        } else {
            float wv[32];
#pragma unroll
            for (int t = 0; t < 32; t++) wv[t] = wget(fmt, w, j * k + b * 32 + t);
#pragma unroll
            for (int r = 0; r < QGR; r++) {
                if (r < nr) {
                    const signed char* xv = x.w + (r0 + r) * k + b * 32;
                    float v = 0.f;
#pragma unroll
                    for (int t = 0; t < 32; t++) v += (float)xv[t] * wv[t];
                    if (x.l) {
                        const signed char* lv = x.l + (r0 + r) * k + b * 32;
                        float vl = 0.f;
#pragma unroll
                        for (int t = 0; t < 32; t++) vl += (float)lv[t] * wv[t];
                        v += vl / 254.f;
                    }
                    acc[r] += x.s[(r0 + r) * nb + b] * v;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < QGR; r++) acc[r] = warp_sum(acc[r]);
}

// The warp's output of output block `bx` (QWARPS outputs a block), rows of slab blockIdx.y, written through d: the
// body gemv_q8, gemm_parts_q8 and the folds' q8 kernels share.
__device__ __forceinline__ void q8_body(int fmt, const QX& x, const void* w, const float* bias, const Dst& d, i64 k,
                                        i64 n, i64 m, i64 bx, float cap = 0.f) {
    i64 j = bx * QWARPS + (threadIdx.x >> 5);
    if (j >= n) return;
    i64 r0 = (i64)blockIdx.y * QGR;
    float acc[QGR];
    q8_tile(fmt, x, w, k, m, j, r0, acc);
    if ((threadIdx.x & 31) != 0) return;
    int nr = (int)min((i64)QGR, m - r0);
    for (int r = 0; r < nr; r++) d.y[dst_at(d, (r0 + r) * n + j)] = capped(acc[r] + (bias ? bias[j] : 0.f), cap);
}

extern "C" __global__ void __launch_bounds__(128) gemv_q8(const signed char* xw, const signed char* xl, const float* xs,
                                                          const void* w, i64 fmt, const float* bias, DST_PARAMS(y),
                                                          i64 k, i64 n, i64 m, float cap) {
    q8_body((int)fmt, QX{xw, xl, xs}, w, bias, DST(y), k, n, m, blockIdx.x, cap);
}
