// The GEMV of a quantized activation (the q8 numerics): y = x · wᵀ (+ bias) where x is int8 blocks of 32 with an f32
// scale a block (and, under two words, a low int8 word of the residual in steps of d/254). Under one word the scale
// held is the unrounded d32 and the block's d is f16(d32), as llama.cpp's q8_0 / q8_1 store it. A warp per output, an
// accumulator per row of a slab of GR rows, each lane a block at a time. Over rows of 32-value blocks (q8_0, q4_0,
// q5_0, iq4_nl, q4_1, q5_1) the block is eight __dp4a of the activation's words against the weights' integers (q4_0's
// nibbles less 8, q5_0's values less 16, iq4_nl's levels), the int32 sum times the two scales, and for q4_1 / q5_1
// (llama.cpp's q8_1 pairing) the block's min m times q8_1's s: f16(d32 * the sum of its words) under one word (the
// f32 product rounded, as quantize_row_q8_1 stores it), d times the sum of q + low/254 under two; over K-quant
// rows each value is decoded (wget) and multiplied by the word, the block's sum times the activation's scale. A q8k
// activation (llama.cpp's q8_K, fmt | 16: K-quant and iq4_xs rows under q8) is summed a 256-value super-block at a
// time by q8k_tile.
#define QGR 8
#define QWARPS 4

__device__ __forceinline__ float q8_half(float d) {  // d rounded to f16 (to nearest, ties to even), as a float
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(d));
    return f16f(h);
}

__device__ __forceinline__ int pack4(const signed char* p) {  // four int8 at any alignment as one int
    return (int)(u8)p[0] | ((int)(u8)p[1] << 8) | ((int)(u8)p[2] << 16) | ((int)(u8)p[3] << 24);
}

// Is fmt a format of 32-value blocks whose values are d times integers (plus a min m): wblock_ints reads it.
__device__ __forceinline__ bool int_blocks(int fmt) {
    return fmt == 3 || fmt == 4 || (fmt >= 8 && fmt <= 10) || fmt == 14;
}

// The weights' integers of block `b` of row j of q4_1 (8), q5_0 (9), q5_1 (10) or iq4_nl (14) rows as eight packed
// int8 words (value 4t + e in byte e of word t), the block's f16 scale, its min at *mn (q4_1, q5_1; else 0).
__device__ __forceinline__ float wblock_ints_more(int fmt, const u8* w, i64 row_blocks, i64 j, i64 b, int (&q)[8],
                                                  float* mn) {
    int bb = fmt == 8 ? 20 : fmt == 9 ? 22 : fmt == 10 ? 24 : 18;
    const u8* p = w + (j * row_blocks + b) * bb;
    const u8* hb = p + (fmt == 9 ? 2 : 4);  // q5_0 / q5_1: the fifth bits, then the nibbles
    const u8* nb = fmt == 8 ? p + 4 : fmt == 14 ? p + 2 : hb + 4;
    *mn = (fmt == 8 || fmt == 10) ? h16(p + 2) : 0.f;
#pragma unroll
    for (int t = 0; t < 8; t++) {
        int v = 0;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int i = 4 * t + e, qi = (int)nib32(nb, i);
            if (fmt == 14) qi = iq4_level((unsigned)qi);
            else if (fmt != 8) qi |= (int)(((unsigned)hb[i >> 3] >> (i & 7) & 1u) << 4);
            if (fmt == 9) qi -= 16;
            v |= (qi & 255) << (8 * e);
        }
        q[t] = v;
    }
    return h16(p);
}

// The weights' integers of block `b` of row j as eight packed int8 words (q8_0, q4_0; the others by
// wblock_ints_more), and the block's f16 scale; its min at *mn (q4_1, q5_1; else 0).
__device__ __forceinline__ float wblock_ints(int fmt, const u8* w, i64 row_blocks, i64 j, i64 b, int (&q)[8],
                                             float* mn) {
    *mn = 0.f;
    if (fmt >= 8) return wblock_ints_more(fmt, w, row_blocks, j, b, q, mn);
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

// Values 16g..16g+15 of a q5_k (11), q3_k (12), q2_k (13) or iq4_xs (15) super-block p as four packed int8 words
// (value 4c + e in byte e of word c), the integer scale and min (0 where the format has none) of those 16.
__device__ __forceinline__ void kq_group(int fmt, const u8* p, int g, int (&q)[4], int& sc, int& mn) {
    mn = 0;
    if (fmt == 11) k4_scale_min(p + 4, g >> 1, sc, mn);
    else if (fmt == 12) sc = k3_scale(p + 96, g);
    else if (fmt == 13) sc = p[g] & 15, mn = p[g] >> 4;
    else sc = xs_scale(p, g >> 1);
#pragma unroll
    for (int c = 0; c < 4; c++) {
        int v = 0;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int i = 16 * g + 4 * c + e, qi;  // value i of the super-block
            if (fmt == 11) {
                int j = i >> 5, l = i & 31;
                unsigned u = p[48 + (j >> 1) * 32 + l];
                qi = (int)(((j & 1) ? (u >> 4) : (u & 15u)) | ((p[16 + l] >> j & 1u) << 4));
            } else if (fmt == 12) {
                qi = q3_int(p, i);
            } else if (fmt == 13) {
                qi = (p[16 + 32 * (i >> 7) + (i & 31)] >> (2 * ((i >> 5) & 3))) & 3;
            } else {
                qi = iq4_level(nib32(p + 8 + 16 * (i >> 5), i & 31));
            }
            v |= (qi & 255) << (8 * e);
        }
        q[c] = v;
    }
}

// Output j of rows r0.. of x · wᵀ, x a q8k form (x.l its int16 sums of 16 words), w rows of a K-quant (q4_k fmt 5,
// q6_k 6, q5_k 11, q3_k 12, q2_k 13) or iq4_xs (15): each lane a super-block at a time, as llama.cpp's
// vec_dot_*_q8_K sum it: the int32 sum I of __dp4a of the words against the weights' integers, each sub-block's times
// its integer scale; for q4_k, q5_k, q2_k the int32 sum M of the sub-blocks' mins times the sums of their words; the
// term (d·dx)·I - (dmin·dx)·M in f32, unfused (the twin's rounding).
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
        } else if (fmt != 6) {  // q5_k, q3_k, q2_k, iq4_xs: 16 groups of 16 values
            int bb = fmt == 11 ? 176 : fmt == 12 ? 110 : fmt == 13 ? 84 : 136;
            const u8* p = (const u8*)w + (j * nb + b) * bb;
            d = h16(fmt == 12 ? p + 108 : fmt == 13 ? p + 80 : p);
            if (fmt == 11) dmin = h16(p + 2);
            if (fmt == 13) dmin = h16(p + 82);
            for (int g = 0; g < 16; g++) {
                int q[4], sc, mn;
                kq_group(fmt, p, g, q, sc, mn);
#pragma unroll
                for (int r = 0; r < QGR; r++) {
                    if (r < nr) {
                        const int* xv = (const int*)(x.w + (r0 + r) * k + b * 256 + g * 16);
                        int a = 0;
#pragma unroll
                        for (int c = 0; c < 4; c++) a = __dp4a(xv[c], q[c], a);
                        i1[r] += sc * a;
                        i2[r] += mn * (int)xsum[((r0 + r) * k + b * 256) / 16 + g];
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
                if (fmt == 5 || fmt == 11 || fmt == 13)
                    tm = __fsub_rn(tm, __fmul_rn(__fmul_rn(dmin, dx), (float)i2[r]));
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
        if (int_blocks(fmt)) {
            int q[8];
            float mw, dw = wblock_ints(fmt, (const u8*)w, nb, j, b, q, &mw);
#pragma unroll
            for (int r = 0; r < QGR; r++) {
                if (r < nr) {
                    const int* xv = (const int*)(x.w + (r0 + r) * k + b * 32);
                    int s = 0;
#pragma unroll
                    for (int t = 0; t < 8; t++) s = __dp4a(xv[t], q[t], s);
                    float v = (float)s, sq = 0.f;
                    if (mw != 0.f) {  // q4_1 / q5_1: the sum of the words (q8_1's s, over the scale)
                        int a = 0;
#pragma unroll
                        for (int t = 0; t < 8; t++) a = __dp4a(xv[t], 0x01010101, a);
                        sq = (float)a;
                    }
                    if (x.l) {
                        const int* lv = (const int*)(x.l + (r0 + r) * k + b * 32);
                        int sl = 0, al = 0;
#pragma unroll
                        for (int t = 0; t < 8; t++) sl = __dp4a(lv[t], q[t], sl);
                        v += (float)sl / 254.f;
                        if (mw != 0.f) {
#pragma unroll
                            for (int t = 0; t < 8; t++) al = __dp4a(lv[t], 0x01010101, al);
                            sq += (float)al / 254.f;
                        }
                    }
                    float xs = x.s[(r0 + r) * nb + b];  // one word: d = f16(d32), s = f16(d32 * sum q)
                    float mt = mw != 0.f ? mw * (x.l ? xs * sq : q8_half(__fmul_rn(xs, sq))) : 0.f;
                    acc[r] += dw * (x.l ? xs : q8_half(xs)) * v + mt;
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
                    float xs = x.s[(r0 + r) * nb + b];
                    acc[r] += (x.l ? xs : q8_half(xs)) * v;
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
