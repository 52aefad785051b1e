// Shared device helpers every kernel source starts with: checkpoint formats decoded without headers (bf16 as the top
// half of an f32, f16 through cvt, GGUF's blocks in place), a launch's destination (Dst) as scalar parameters, and
// warp/block reductions.
typedef unsigned short u16;
typedef long long i64;

#define NEG_INF (-__int_as_float(0x7f800000))

// Programmatic dependent launch (sm_90; kernels/pdl.py launches with it when LANEFUSE_PDL is on): every kernel starts
// with PDL_ENTER() in every block, before it reads anything an earlier launch wrote and before any return, so its
// grid completes only after the one before it did (the order stays the stream's, transitively); a GEMV may first
// prefetch its weights (read-only) into L2 with PDL_PREFETCH. Launched without the attribute, or below sm_90, these
// are no-ops. tests/test_kernel_lint.py checks every __global__ body starts so.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#define PDL_LAUNCH() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
// bytes [p, p + n) of global memory into L2 (n a multiple of 16, p 16-byte aligned): one bulk prefetch (TMA unit)
#define PDL_PREFETCH(p, n) \
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"((unsigned)(n)) : "memory")
#else
#define PDL_WAIT()
#define PDL_LAUNCH()
#define PDL_PREFETCH(p, n)
#endif
#define PDL_ENTER() do { PDL_WAIT(); PDL_LAUNCH(); } while (0)

// cp.async (sm_80+): 16 bytes global -> shared without a register, a thread's copies in commit groups it waits on.
// The tensor-core GEMM's stages (gemm_tc.cu) and the GEMV slab's ring of weight steps (gemv_core.cu gemv_slab_cp).
// A thread reads what its own copies wrote once its wait lets their group complete.
// emu: begin cp_ptx (tests/cuda_host/emu.h defines these for the host emulator, lane by lane)
__device__ __forceinline__ unsigned tc_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
// 16 bytes global -> shared, asynchronously; `bytes` (16 or 0) read, the rest of the 16 zero-filled.
__device__ __forceinline__ void tc_cp16(void* s, const void* g, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(tc_smem(s)), "l"(g), "r"(bytes));
}
__device__ __forceinline__ void tc_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void tc_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// Until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void tc_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
// emu: end cp_ptx

__device__ __forceinline__ float bf16f(unsigned b) { return __uint_as_float((b & 0xffffu) << 16); }
__device__ __forceinline__ float f16f(unsigned h) {
    float f;
    unsigned short s = (unsigned short)(h & 0xffffu);
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
}


// -- block formats: from here to "end of block formats", tests/test_blocks.py also compiles as host C++ ----------
// GGUF's block formats (and MXFP4 below), read in place (kernels/blocks.py holds the numpy twin): value i of rows that hold whole
// blocks is value i % QB of block i / QB. Each value is decoded by the f32 operations of gguf's reference in its
// order, rounded one at a time (__fmul_rn / __fsub_rn: no fused multiply-add), so it equals gguf.quants.dequantize
// to the bit. A block's f16 scales lie at even offsets (34, 18, 144, 210 bytes a block): two-byte loads.
typedef unsigned char u8;
__device__ __forceinline__ float h16(const u8* p) { return f16f(*(const u16*)p); }

__device__ __forceinline__ float q8_0_get(const u8* w, i64 i) {  // d (f16), 32 int8
    const u8* b = w + (i >> 5) * 34;
    return __fmul_rn((float)(signed char)b[2 + (i & 31)], h16(b));
}

__device__ __forceinline__ float q4_0_get(const u8* w, i64 i) {  // d, 16 bytes: value j the low nibble of byte j,
    const u8* b = w + (i >> 5) * 18;                              // value 16 + j its high nibble; minus 8
    int j = (int)(i & 31);
    unsigned q = b[2 + (j & 15)];
    q = j < 16 ? (q & 15u) : (q >> 4);
    return __fmul_rn(h16(b), (float)((int)q - 8));
}

__device__ __forceinline__ float q4_k_get(const u8* w, i64 i) {  // d, dmin, 12 bytes of 6-bit scales and mins (8 sub-
    const u8* b = w + (i >> 8) * 144;                             // blocks of 32), 128 bytes of nibbles
    int v = (int)(i & 255), j = v >> 5, l = v & 31;
    const u8* s = b + 4;
    int sc, mn;
    if (j < 4) {
        sc = s[j] & 63;
        mn = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    unsigned q = b[16 + (j >> 1) * 32 + l];
    q = (j & 1) ? (q >> 4) : (q & 15u);
    float ds = __fmul_rn(h16(b), (float)sc), dm = __fmul_rn(h16(b + 2), (float)mn);
    return __fsub_rn(__fmul_rn(ds, (float)q), dm);
}

__device__ __forceinline__ float q6_k_get(const u8* w, i64 i) {  // 128 bytes of low nibbles, 64 of high pairs, 16
    const u8* b = w + (i >> 8) * 210;                             // int8 scales (sub-blocks of 16), d
    int v = (int)(i & 255), h = v >> 7, t = (v >> 5) & 3, l = v & 31;
    unsigned lo = b[64 * h + 32 * (t & 1) + l];
    lo = t >= 2 ? (lo >> 4) : (lo & 15u);
    unsigned hi = (b[128 + 32 * h + l] >> (2 * t)) & 3u;
    float d = __fmul_rn(h16(b + 208), (float)(signed char)b[192 + (v >> 4)]);
    return __fmul_rn(d, (float)((int)(lo | (hi << 4)) - 32));
}

// q4_1 (d, m, 16 bytes of q4_0's nibbles): d·q + m. q5_0 / q5_1 (d[, m], 4 bytes whose bit j is value j's fifth,
// 16 bytes of nibbles): d·(q - 16) / d·q + m. The fifth bits read a byte at a time (the 22-byte blocks leave them
// 2-byte aligned only).
__device__ __forceinline__ unsigned nib32(const u8* qs, int j) {  // value j of 16 bytes of q4_0-ordered nibbles
    unsigned q = qs[j & 15];
    return j < 16 ? (q & 15u) : (q >> 4);
}

__device__ __forceinline__ float q4_1_get(const u8* w, i64 i) {
    const u8* b = w + (i >> 5) * 20;
    return __fadd_rn(__fmul_rn(h16(b), (float)nib32(b + 4, (int)(i & 31))), h16(b + 2));
}

__device__ __forceinline__ unsigned q5_int(const u8* h, int j) {  // h: the 4 bytes of fifth bits, then the nibbles
    return nib32(h + 4, j) | (((unsigned)h[j >> 3] >> (j & 7) & 1u) << 4);
}

__device__ __forceinline__ float q5_0_get(const u8* w, i64 i) {
    const u8* b = w + (i >> 5) * 22;
    return __fmul_rn(h16(b), (float)((int)q5_int(b + 2, (int)(i & 31)) - 16));
}

__device__ __forceinline__ float q5_1_get(const u8* w, i64 i) {
    const u8* b = w + (i >> 5) * 24;
    return __fadd_rn(__fmul_rn(h16(b), (float)q5_int(b + 4, (int)(i & 31))), h16(b + 2));
}

// iq4_nl (d, 16 bytes of q4_0's nibbles, each a level of ggml's kvalues_iq4nl): d·level.
__device__ __forceinline__ int iq4_level(unsigned q) {  // the levels as bytes of four words (no local array)
    unsigned lo = q & 8u ? ((q & 4u) ? 0x71594535u : 0x26190D01u) : ((q & 4u) ? 0xF6EADDCFu : 0xBFAD9881u);
    return (int)(signed char)(lo >> (8 * (q & 3u)));
}

__device__ __forceinline__ float iq4_nl_get(const u8* w, i64 i) {
    const u8* b = w + (i >> 5) * 18;
    return __fmul_rn(h16(b), (float)iq4_level(nib32(b + 2, (int)(i & 31))));
}

// q4_k's (and q5_k's) 6-bit scale and min of sub-block j (ggml's get_scale_min_k4), s its 12 scale bytes.
__device__ __forceinline__ void k4_scale_min(const u8* s, int j, int& sc, int& mn) {
    if (j < 4) {
        sc = s[j] & 63;
        mn = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// q5_k (d, dmin, q4_k's 12 scale bytes, 32 bytes whose byte l bit j is the fifth bit of sub-block j's value l, 128
// bytes of q4_k's nibbles): (d·sc)·q - dmin·mn.
__device__ __forceinline__ float q5_k_get(const u8* w, i64 i) {
    const u8* b = w + (i >> 8) * 176;
    int v = (int)(i & 255), j = v >> 5, l = v & 31, sc, mn;
    k4_scale_min(b + 4, j, sc, mn);
    unsigned q = b[48 + (j >> 1) * 32 + l];
    q = ((j & 1) ? (q >> 4) : (q & 15u)) | ((b[16 + l] >> j & 1u) << 4);
    float ds = __fmul_rn(h16(b), (float)sc), dm = __fmul_rn(h16(b + 2), (float)mn);
    return __fsub_rn(__fmul_rn(ds, (float)q), dm);
}

// q2_k (16 scale bytes, a sub-block of 16 each: the low nibble its scale, the high its min; 64 bytes of 2-bit values,
// value 128h + 32t + l bits 2t of byte 32h + l; d, dmin): (d·sc)·q - dmin·mn.
__device__ __forceinline__ float q2_k_get(const u8* w, i64 i) {
    const u8* b = w + (i >> 8) * 84;
    int v = (int)(i & 255), s = b[v >> 4];
    unsigned q = (b[16 + 32 * (v >> 7) + (v & 31)] >> (2 * ((v >> 5) & 3))) & 3u;
    float dl = __fmul_rn(h16(b + 80), (float)(s & 15)), ml = __fmul_rn(h16(b + 82), (float)(s >> 4));
    return __fsub_rn(__fmul_rn(dl, (float)q), ml);
}

// q3_k's signed 6-bit scale of sub-block g (of 16), s its 12 scale bytes: the low four bits a nibble of byte g % 8,
// the high two bits 2(g / 4) of byte 8 + g % 4, less 32.
__device__ __forceinline__ int k3_scale(const u8* s, int g) {
    int lo = g < 8 ? (s[g] & 15) : (s[g - 8] >> 4);
    return (lo | (((s[8 + (g & 3)] >> (2 * (g >> 2))) & 3) << 4)) - 32;
}

// q3_k (32 bytes of high bits: value v's bit v / 32 of byte v % 32, 64 bytes of q2_k's 2-bit values, 12 scale bytes,
// d): the low bits, less 4 where the high bit is clear; (d·sc)·q.
__device__ __forceinline__ int q3_int(const u8* b, int v) {
    int q = (b[32 + 32 * (v >> 7) + (v & 31)] >> (2 * ((v >> 5) & 3))) & 3;
    return q - ((b[v & 31] >> (v >> 5) & 1) ? 0 : 4);
}

__device__ __forceinline__ float q3_k_get(const u8* w, i64 i) {
    const u8* b = w + (i >> 8) * 110;
    int v = (int)(i & 255);
    float dl = __fmul_rn(h16(b + 108), (float)k3_scale(b + 96, v >> 4));
    return __fmul_rn(dl, (float)q3_int(b, v));
}

// iq4_xs (d, a uint16 of the sub-blocks' (of 32) high scale bits 2j, 4 bytes of their low nibbles, 128 bytes of
// iq4_nl's nibbles, 16 a sub-block): (d·(ls - 32))·level.
__device__ __forceinline__ int xs_scale(const u8* b, int j) {
    int lo = (b[4 + (j >> 1)] >> (4 * (j & 1))) & 15, hi = ((b[2] | (b[3] << 8)) >> (2 * j)) & 3;
    return (lo | (hi << 4)) - 32;
}

__device__ __forceinline__ float iq4_xs_get(const u8* w, i64 i) {
    const u8* b = w + (i >> 8) * 136;
    int v = (int)(i & 255), j = v >> 5;
    float dl = __fmul_rn(h16(b), (float)xs_scale(b, j));
    return __fmul_rn(dl, (float)iq4_level(nib32(b + 8 + 16 * j, v & 31)));
}

// MXFP4 (gpt-oss's experts, kernels/blocks.py): a block of 17 bytes, the e8m0 scale s then 16 bytes, byte j holding
// value 2j in its low nibble and 2j + 1 in its high; fp4 e2m1 (sign 8, exponent 2 bits, mantissa 1) times 2^(s - 127)
// by ldexpf (exact), as transformers decodes it.
__device__ __forceinline__ float fp4f(unsigned q) {
    unsigned e = (q >> 1) & 3u, m = q & 1u;
    float v = e == 0 ? 0.5f * (float)m : (float)(2u + m) * (float)(1u << (e - 1)) * 0.5f;
    return (q & 8u) ? -v : v;
}

__device__ __forceinline__ float mxfp4_get(const u8* w, i64 i) {
    const u8* b = w + (i >> 5) * 17;
    int j = (int)(i & 31);
    unsigned q = b[1 + (j >> 1)];
    return ldexpf(fp4f((j & 1) ? (q >> 4) : (q & 15u)), (int)b[0] - 127);
}

// The formats past the first five, a call (not inlined: inlined in every reader, its eight decodings pushed
// gemm_parts_4 from 168 registers into a 368-byte spill on sm_90; called, no reader's registers or stack change).
__device__ __noinline__ float qget_more(int fmt, const u8* b, i64 i) {
    switch (fmt) {
        case 8: return q4_1_get(b, i);
        case 9: return q5_0_get(b, i);
        case 10: return q5_1_get(b, i);
        case 11: return q5_k_get(b, i);
        case 12: return q3_k_get(b, i);
        case 13: return q2_k_get(b, i);
        case 14: return iq4_nl_get(b, i);
        default: return iq4_xs_get(b, i);
    }
}

// Values i..i+3 of the formats past the first five (i a multiple of 4: one block, one sub-block of 16, one scale),
// the block's scales decoded once for the four, each value as qget_more decodes it; a call, as qget_more.
__device__ __noinline__ float4 qget4_more(int fmt, const u8* w, i64 i) {
    float r[4];
    if (fmt == 8 || fmt == 9 || fmt == 10 || fmt == 14) {  // 32-value blocks: d (and m)
        int bb = fmt == 8 ? 20 : fmt == 9 ? 22 : fmt == 10 ? 24 : 18, j = (int)(i & 31);
        const u8* b = w + (i >> 5) * bb;
        float d = h16(b), m = (fmt == 8 || fmt == 10) ? h16(b + 2) : 0.f;
        for (int e = 0; e < 4; e++) {
            if (fmt == 8) r[e] = __fadd_rn(__fmul_rn(d, (float)nib32(b + 4, j + e)), m);
            else if (fmt == 9) r[e] = __fmul_rn(d, (float)((int)q5_int(b + 2, j + e) - 16));
            else if (fmt == 10) r[e] = __fadd_rn(__fmul_rn(d, (float)q5_int(b + 4, j + e)), m);
            else r[e] = __fmul_rn(d, (float)iq4_level(nib32(b + 2, j + e)));
        }
    } else if (fmt == 11) {  // q5_k: the sub-block of 32's (d·sc) and dmin·mn
        const u8* b = w + (i >> 8) * 176;
        int v = (int)(i & 255), j = v >> 5, l = v & 31, sc, mn;
        k4_scale_min(b + 4, j, sc, mn);
        float ds = __fmul_rn(h16(b), (float)sc), dm = __fmul_rn(h16(b + 2), (float)mn);
        for (int e = 0; e < 4; e++) {
            unsigned q = b[48 + (j >> 1) * 32 + l + e];
            q = ((j & 1) ? (q >> 4) : (q & 15u)) | ((b[16 + l + e] >> j & 1u) << 4);
            r[e] = __fsub_rn(__fmul_rn(ds, (float)q), dm);
        }
    } else if (fmt == 12) {  // q3_k: the sub-block of 16's d·(sc - 32)
        const u8* b = w + (i >> 8) * 110;
        int v = (int)(i & 255);
        float dl = __fmul_rn(h16(b + 108), (float)k3_scale(b + 96, v >> 4));
        for (int e = 0; e < 4; e++) r[e] = __fmul_rn(dl, (float)q3_int(b, v + e));
    } else if (fmt == 13) {  // q2_k: the sub-block of 16's d·sc and dmin·mn
        const u8* b = w + (i >> 8) * 84;
        int v = (int)(i & 255), s = b[v >> 4];
        float dl = __fmul_rn(h16(b + 80), (float)(s & 15)), ml = __fmul_rn(h16(b + 82), (float)(s >> 4));
        const u8* q = b + 16 + 32 * (v >> 7) + (v & 31);
        int sh = 2 * ((v >> 5) & 3);
        for (int e = 0; e < 4; e++) r[e] = __fsub_rn(__fmul_rn(dl, (float)((q[e] >> sh) & 3u)), ml);
    } else {  // iq4_xs: the sub-block of 32's d·(ls - 32)
        const u8* b = w + (i >> 8) * 136;
        int v = (int)(i & 255), j = v >> 5;
        float dl = __fmul_rn(h16(b), (float)xs_scale(b, j));
        for (int e = 0; e < 4; e++) r[e] = __fmul_rn(dl, (float)iq4_level(nib32(b + 8 + 16 * j, (v & 31) + e)));
    }
    return make_float4(r[0], r[1], r[2], r[3]);
}

// fmt 3 q8_0, 4 q4_0, 5 q4_k, 6 q6_k, 7 mxfp4, 8 q4_1, 9 q5_0, 10 q5_1, 11 q5_k, 12 q3_k, 13 q2_k, 14 iq4_nl,
// 15 iq4_xs (kernels/common.py's FORMAT_CODE)
__device__ __forceinline__ float qget(int fmt, const void* w, i64 i) {
    const u8* b = (const u8*)w;
    if (fmt == 3) return q8_0_get(b, i);
    if (fmt == 4) return q4_0_get(b, i);
    if (fmt == 5) return q4_k_get(b, i);
    if (fmt == 7) return mxfp4_get(b, i);
    if (fmt >= 8) return qget_more(fmt, b, i);
    return q6_k_get(b, i);
}

// Values i..i+3 (i a multiple of 4: one block, one sub-block, one scale): the block's scales decoded once for the
// four, each value as qget decodes it.
__device__ __forceinline__ float4 qget4(int fmt, const void* w, i64 i) {
    const u8* b;
    if (fmt == 3) {
        b = (const u8*)w + (i >> 5) * 34;
        const u8* q = b + 2 + (i & 31);
        float d = h16(b);
        return make_float4(__fmul_rn((float)(signed char)q[0], d), __fmul_rn((float)(signed char)q[1], d),
                           __fmul_rn((float)(signed char)q[2], d), __fmul_rn((float)(signed char)q[3], d));
    }
    if (fmt == 4) {
        b = (const u8*)w + (i >> 5) * 18;
        int j = (int)(i & 31), sh = j < 16 ? 0 : 4;
        const u8* q = b + 2 + (j & 15);
        float d = h16(b);
        return make_float4(__fmul_rn(d, (float)((int)((q[0] >> sh) & 15u) - 8)),
                           __fmul_rn(d, (float)((int)((q[1] >> sh) & 15u) - 8)),
                           __fmul_rn(d, (float)((int)((q[2] >> sh) & 15u) - 8)),
                           __fmul_rn(d, (float)((int)((q[3] >> sh) & 15u) - 8)));
    }
    if (fmt == 5) {
        b = (const u8*)w + (i >> 8) * 144;
        int v = (int)(i & 255), j = v >> 5, l = v & 31, sh = (j & 1) ? 4 : 0;
        const u8* s = b + 4;
        int sc = j < 4 ? (s[j] & 63) : ((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
        int mn = j < 4 ? (s[j + 4] & 63) : ((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
        float ds = __fmul_rn(h16(b), (float)sc), dm = __fmul_rn(h16(b + 2), (float)mn);
        const u8* q = b + 16 + (j >> 1) * 32 + l;
        return make_float4(__fsub_rn(__fmul_rn(ds, (float)((q[0] >> sh) & 15u)), dm),
                           __fsub_rn(__fmul_rn(ds, (float)((q[1] >> sh) & 15u)), dm),
                           __fsub_rn(__fmul_rn(ds, (float)((q[2] >> sh) & 15u)), dm),
                           __fsub_rn(__fmul_rn(ds, (float)((q[3] >> sh) & 15u)), dm));
    }
    if (fmt == 7) {
        b = (const u8*)w + (i >> 5) * 17;
        const u8* q = b + 1 + ((i & 31) >> 1);
        int e = (int)b[0] - 127;
        return make_float4(ldexpf(fp4f(q[0] & 15u), e), ldexpf(fp4f(q[0] >> 4), e), ldexpf(fp4f(q[1] & 15u), e),
                           ldexpf(fp4f(q[1] >> 4), e));
    }
    if (fmt >= 8) return qget4_more(fmt, (const u8*)w, i);
    b = (const u8*)w + (i >> 8) * 210;
    int v = (int)(i & 255), h = v >> 7, t = (v >> 5) & 3, l = v & 31, sl = t >= 2 ? 4 : 0, shh = 2 * t;
    const u8* lo = b + 64 * h + 32 * (t & 1) + l;
    const u8* hi = b + 128 + 32 * h + l;
    float d = __fmul_rn(h16(b + 208), (float)(signed char)b[192 + (v >> 4)]);
#define Q6(k) __fmul_rn(d, (float)((int)(((lo[k] >> sl) & 15u) | (((hi[k] >> shh) & 3u) << 4)) - 32))
    float4 r = make_float4(Q6(0), Q6(1), Q6(2), Q6(3));
#undef Q6
    return r;
}
// -- end of block formats ---------------------------------------------------------------------------------------------

// fmt: 0 f32, 1 f16, 2 bf16, 3.. the block formats (a launch's argument: one uniform branch, one kernel for every
// format).
__device__ __forceinline__ float wget(int fmt, const void* w, i64 i) {
    if (fmt == 0) return ((const float*)w)[i];
    if (fmt == 1) return f16f(((const u16*)w)[i]);
    if (fmt == 2) return bf16f(((const u16*)w)[i]);
    return qget(fmt, w, i);
}

// Four values from i (a multiple of 4, the row aligned as the arena and cudaMalloc align it; a block format's four
// lie in one block, whose scales the four share).
__device__ __forceinline__ float4 wget4(int fmt, const void* w, i64 i) {
    if (fmt == 0) return *(const float4*)((const float*)w + i);
    if (fmt >= 3) return qget4(fmt, w, i);
    uint2 v = *(const uint2*)((const u16*)w + i);
    if (fmt == 1) return make_float4(f16f(v.x), f16f(v.x >> 16), f16f(v.y), f16f(v.y >> 16));
    return make_float4(bf16f(v.x), bf16f(v.x >> 16), bf16f(v.y), bf16f(v.y >> 16));
}

// Where a result lands: value e at base + e, or (uwidth > 0) at base + (e / uwidth) * upitch + uoff + e % uwidth,
// base the starting row (read from *rowp on the device when set, else `row`) times pitch. A batch's (rowp set and
// row < 0): result row r lands in the table's row r * -row + rowp[r], its sequence's slot at its position.
struct Dst {
    float* y;
    const int* rowp;
    i64 row, pitch, upitch, uoff, uwidth;
};
#define DST_PARAMS(p) float *p##_y, const int *p##_rowp, i64 p##_row, i64 p##_pitch, i64 p##_upitch, i64 p##_uoff, i64 p##_uwidth
#define DST(p) Dst{p##_y, p##_rowp, p##_row, p##_pitch, p##_upitch, p##_uoff, p##_uwidth}

__device__ __forceinline__ i64 dst_at(const Dst& d, i64 e) {
    if (d.rowp && d.row < 0) {  // a batch's: result row r (pitch values) into row r * slot + rowp[r], slot = -row
        i64 r = e / d.pitch;
        return (r * -d.row + (i64)d.rowp[r]) * d.pitch + e % d.pitch;
    }
    i64 base = (d.rowp ? (i64)d.rowp[0] : d.row) * d.pitch;
    if (d.uwidth > 0) return base + (e / d.uwidth) * d.upitch + d.uoff + e % d.uwidth;
    return base + e;
}

// A Dst from 7 words of a descriptor table (pointers as their bits).
__device__ __forceinline__ Dst dst_from(const i64* t) {
    return Dst{(float*)t[0], (const int*)t[1], t[2], t[3], t[4], t[5], t[6]};
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The sum of v over the block (at most 1024 threads, a multiple of 32), returned to every thread.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    float t = 0.f;
    for (int i = 0; i < nw; i++) t += part[i];
    return t;
}

// block_sum of R values at once: each summed in block_sum's order (the same bits), one pair of barriers for the R.
template <int R>
__device__ __forceinline__ void block_sums(float (&v)[R]) {
    if constexpr (R == 1) {
        v[0] = block_sum(v[0]);
    } else {
        __shared__ float part[R][32];
        int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
        for (int j = 0; j < R; j++) v[j] = warp_sum(v[j]);
        __syncthreads();
        if (lane == 0)
#pragma unroll
            for (int j = 0; j < R; j++) part[j][warp] = v[j];
        __syncthreads();
#pragma unroll
        for (int j = 0; j < R; j++) {
            float t = 0.f;
            for (int i = 0; i < nw; i++) t += part[j][i];
            v[j] = t;
        }
    }
}

__device__ __forceinline__ float act_apply(int a, float x) {
    if (a == 0) return x / (1.f + expf(-x));  // silu
    if (a == 1) return 1.f / (1.f + expf(-x));  // sigmoid
    if (a == 3) return 0.5f * x * (1.f + erff(x * 0.7071067811865476f));  // gelu_erf (exact)
    return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));  // gelu (tanh)
}

// -- ticket-ordered phases of one launch (chain.cu, moe.cu's router_split): a block of a later phase waits on the
// arrivals of the phase before, whose blocks took earlier tickets (so are running: no co-residency needed). The
// writer: its stores, __threadfence, the block's barrier, one atomicAdd on the arrivals.
#define CHAIN_SLEEP_NS 64
#define CHAIN_SPIN_BOUND 4096  // the host emulator's polls before it gives up (it runs blocks one after another)

__device__ __forceinline__ unsigned chain_acquire(const unsigned* c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
    return v;
#else
    return *(const volatile unsigned*)c;
#endif
}

// Until the arrivals `c` reach `count` (every block of the phase before arrived). On the device a spin with a sleep;
// under the host emulator (blocks one after another) a wait not met at once is never met: a bounded poll, then a trap
// (an error naming the block, not a hang).
__device__ __forceinline__ void chain_wait(const unsigned* c, unsigned count) {
    if (threadIdx.x == 0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
        while (chain_acquire(c) < count) __nanosleep(CHAIN_SLEEP_NS);
#else
        for (int i = 0; chain_acquire(c) < count; i++)
            if (i >= CHAIN_SPIN_BOUND) __trap();
#endif
        __threadfence();
    }
    __syncthreads();
}
