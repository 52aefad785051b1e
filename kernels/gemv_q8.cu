// The GEMV of a quantized activation (the q8 numerics): y = x · wᵀ (+ bias) where x is int8 blocks of 32 with an f32
// scale a block (and, under two words, a low int8 word of the residual in steps of d/254). A warp per output, an
// accumulator per row of a slab of GR rows, each lane a block at a time. Over q8_0 and q4_0 rows the block is eight
// __dp4a of the activation's words against the weights' integers (q4_0's nibbles less 8), the int32 sum times the two
// scales; over q4_k and q6_k rows each value is decoded (wget) and multiplied by the word, the block's sum times the
// activation's scale. A q8k activation (llama.cpp's q8_K, fmt | 16: q4_k and q6_k rows under q8) is summed a
// 256-value super-block at a time by q8k_tile.
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

// Output j of rows r0.. of x · wᵀ, x a q8k form (x.l its int16 sums of 16 words), w q4_k (fmt 5) or q6_k rows: each
// lane a super-block at a time, as llama.cpp's vec_dot_q4_K_q8_K / q6_K_q8_K sum it: the int32 sum I of __dp4a of
// the words against the weights' integers, each sub-block's times its integer scale; for q4_k the int32 sum M of the
// sub-blocks' mins times the sums of 32 words; the term (d·dx)·I - (dmin·dx)·M in f32, unfused (the twin's rounding).
__device__ __forceinline__ void q8k_tile(int fmt, const QX& x, const void* w, i64 k, i64 m, i64 j, i64 r0,
                                         float (&acc)[QGR]) {
    int lane = threadIdx.x & 31;
    int nr = (int)min((i64)QGR, m - r0);
    i64 nb = k >> 8;
    const short* xsum = (const short*)x.l;
#pragma unroll
    for (int r = 0; r < QGR; r++) acc[r] = 0.f;
    for (i64 b = lane; b < nb; b += 32) {
        int i1[QGR], i2[QGR];
#pragma unroll
        for (int r = 0; r < QGR; r++) i1[r] = i2[r] = 0;
        float d, dmin = 0.f;
        if (fmt == 5) {
            const u8* p = (const u8*)w + (j * nb + b) * 144;
            const u8* s = p + 4;
            d = h16(p);
            dmin = h16(p + 2);
            for (int sb = 0; sb < 8; sb++) {
                int sc = sb < 4 ? (s[sb] & 63) : ((s[sb + 4] & 15) | ((s[sb - 4] >> 6) << 4));
                int mn = sb < 4 ? (s[sb + 4] & 63) : ((s[sb + 4] >> 4) | ((s[sb] >> 6) << 4));
                const u8* qs = p + 16 + (sb >> 1) * 32;
                int sh = (sb & 1) * 4, q[8];
#pragma unroll
                for (int t = 0; t < 8; t++) {
                    int v = 0;
#pragma unroll
                    for (int e = 0; e < 4; e++) v |= (int)((qs[4 * t + e] >> sh) & 15u) << (8 * e);
                    q[t] = v;
                }
#pragma unroll
                for (int r = 0; r < QGR; r++) {
                    if (r < nr) {
                        const int* xv = (const int*)(x.w + (r0 + r) * k + b * 256 + sb * 32);
                        int a = 0;
#pragma unroll
                        for (int t = 0; t < 8; t++) a = __dp4a(xv[t], q[t], a);
                        const short* bs = xsum + ((r0 + r) * k + b * 256) / 16;
                        i1[r] += sc * a;
                        i2[r] += mn * ((int)bs[2 * sb] + (int)bs[2 * sb + 1]);
                    }
                }
            }
        } else {
            const u8* p = (const u8*)w + (j * nb + b) * 210;
            d = h16(p + 208);
            for (int g = 0; g < 16; g++) {  // values 16g..16g+15: v = 128h + 32t + l
                int h = g >> 3, t = (g >> 1) & 3, l0 = (g & 1) * 16, sl = t >= 2 ? 4 : 0;
                const u8* lo = p + 64 * h + 32 * (t & 1) + l0;
                const u8* hi = p + 128 + 32 * h + l0;
                int sc = (int)(signed char)p[192 + g], q[4];
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    int v = 0;
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        int i = 4 * c + e;
                        int qv = (int)(((lo[i] >> sl) & 15u) | (((hi[i] >> (2 * t)) & 3u) << 4)) - 32;
                        v |= (qv & 255) << (8 * e);
                    }
                    q[c] = v;
                }
#pragma unroll
                for (int r = 0; r < QGR; r++) {
                    if (r < nr) {
                        const int* xv = (const int*)(x.w + (r0 + r) * k + b * 256 + g * 16);
                        int a = 0;
#pragma unroll
                        for (int c = 0; c < 4; c++) a = __dp4a(xv[c], q[c], a);
                        i1[r] += sc * a;
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < QGR; r++) {
            if (r < nr) {
                float dx = x.s[(r0 + r) * nb + b];
                float tm = __fmul_rn(__fmul_rn(d, dx), (float)i1[r]);
                if (fmt == 5) tm = __fsub_rn(tm, __fmul_rn(__fmul_rn(dmin, dx), (float)i2[r]));
                acc[r] += tm;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < QGR; r++) acc[r] = warp_sum(acc[r]);
}

// Output j of rows r0.. (a slab of QGR) of x · wᵀ, x quantized, warp-summed into acc (every lane holds the sums).
__device__ __forceinline__ void q8_tile(int fmt, const QX& x, const void* w, i64 k, i64 m, i64 j, i64 r0,
                                        float (&acc)[QGR]) {
    if (fmt & 16) {
        q8k_tile(fmt & 15, x, w, k, m, j, r0, acc);
        return;
    }
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
                                                          i64 k, i64 n, i64 m, float cap) { PDL_ENTER();
    q8_body((int)fmt, QX{xw, xl, xs}, w, bias, DST(y), k, n, m, blockIdx.x, cap);
}
