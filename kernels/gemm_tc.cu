// The tensor-core GEMM (gemm_tc.py): y (m, n) = x (m, k) · wᵀ (+ bias (n,)) (+ add (m, n)), w checkpoint rows (n, k),
// under the bf16 numerics: x and w rounded to bf16 (to nearest, ties to even), their products summed in f32 by
// mma.sync m16n8k16 (sm_80+). gemm_tc_round first writes x as bf16 rows of kp = k rounded up to 8 values (zeros past
// k) into scratch, once for every tile that reads it; a block then computes a BM x TC_BN tile of y (BM 128, or 64 for
// a product of at most 64 rows), k in steps of TC_BK through shared-memory stages. bf16 rows of whole 16-byte chunks
// go global -> shared by cp.async, TC_STAGES stages (the tensor cores multiply step t while steps t + 1 and t + 2 are
// on their way); at 128 rows (gemm_tc_cp, _parts_cp, _split_cp) four warps of 64 x 64 (128 threads: 8 ldmatrix.x4
// feed 32 mma a k16 step, where eight warps of 64 x 32 took 6 for 16: in bench/gemm_model.py's model shared memory's
// bandwidth and the copies' latency, not the tensor cores, bounded those); at 64 rows (the *_cp_64 kernels) eight
// warps of 32 x 32. Any other format (f32, f16, a block format: gemm_tc_any*) is decoded into registers, rounded to
// bf16 and stored after the step's products, two stages (x still by cp.async), eight warps of BM/2 x 32. A tile row
// is TC_BK values (64 bytes, four 16-byte chunks) with its chunks swizzled (tc_sw), so ldmatrix's eight rows at one
// chunk and cp.async's writes each hit eight distinct 16-byte bank groups with no padding: the three stages of a
// 128 x 128 tile fill the 48 KB of static shared memory exactly.

#define TC_BN 128  // a block's outputs; its rows are 32·MI (128, or 64 for a product of at most 64 rows)
#define TC_BK 32
#define TC_STAGES 3  // shared-memory stages of gemm_tc_cp*: cp.async keeps TC_STAGES - 1 k steps in flight
#define TC_THREADS 256  // eight warps (gemm_tc_any*, gemm_tc_*_64); gemm_tc_cp and its parts / split: 128

// The threads of a block whose warps each take NJ fragments of 8 outputs (two warps down the tile's rows).
#define tc_threads(NJ) (2 * (TC_BN / (8 * (NJ))) * 32)

// emu: begin tc_ptx (tests/cuda_host/emu.h defines these for the host emulator, lane by lane)
// Four 8x8 b16 matrices: lanes 8j..8j+7 give the rows of matrix j; lane l receives into r[j] row l/4 of matrix j,
// its values 2(l%4) and 2(l%4)+1.
__device__ __forceinline__ void tc_ldsm4(unsigned (&r)[4], const void* s) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(tc_smem(s)));
}
// c (16x8 f32) += a (16x16 bf16, row) · b (16x8 bf16, col), the PTX ISA's fragments: with g = lane/4, t = lane%4,
// a[0] row g cols 2t,2t+1; a[1] row g+8; a[2] row g cols 2t+8,+9; a[3] row g+8 cols 2t+8,+9; b0 k 2t,2t+1 of
// column g, b1 k 2t+8,+9; c[0..1] row g cols 2t,2t+1, c[2..3] row g+8. The lower-numbered value in the low half.
__device__ __forceinline__ void tc_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// emu: end tc_ptx

// f32 to bf16 bits, to nearest, ties to even (a NaN stays a quiet NaN): kernels/gemm_tc.py's bf16_round.
__device__ __forceinline__ unsigned bf16_rn(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) | 0x40u) & 0xffffu;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ unsigned bf16x2(float lo, float hi) { return bf16_rn(lo) | (bf16_rn(hi) << 16); }

// x (m, k) f32 -> xb (m, kp) bf16 bits, zeros past k: a thread a pair of values.
extern "C" __global__ void gemm_tc_round(const float* x, unsigned char* xb, i64 m, i64 k, i64 kp) {
    PDL_ENTER();
    i64 pairs = m * (kp >> 1);
    for (i64 p = (i64)blockIdx.x * blockDim.x + threadIdx.x; p < pairs; p += (i64)gridDim.x * blockDim.x) {
        i64 r = p / (kp >> 1), c = 2 * (p % (kp >> 1));
        const float* row = x + r * k;
        u16* out = (u16*)xb + 2 * p;
        out[0] = (u16)bf16_rn(c < k ? row[c] : 0.f);
        out[1] = (u16)bf16_rn(c + 1 < k ? row[c + 1] : 0.f);
    }
}

// w (n, k) checkpoint rows in a block format -> wb (n, k) bf16 bits, decoded once for cuBLAS's bf16 product
// (kernels/gemm_deq.py: a prefill chunk's block-format rows): a thread eight consecutive values, one 16-byte store.
// i a multiple of 8 lies in one block and one sub-block (one scale) of every block format (blocks of 32 or 256
// values, sub-blocks of 16 or 32), so qget4 decodes four at a time as every reader does (gguf's order of operations,
// to the bit), then bf16_rn; count (n·k) a multiple of 8, wb 16-byte aligned.
extern "C" __global__ void gemm_tc_dequant(const void* w, i64 fmt, unsigned char* wb, i64 count) {
    PDL_ENTER();
    for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < (count >> 3); g += (i64)gridDim.x * blockDim.x) {
        i64 i = g << 3;
        float4 a = qget4((int)fmt, w, i), b = qget4((int)fmt, w, i + 4);
        *(uint4*)((u16*)wb + i) = make_uint4(bf16x2(a.x, a.y), bf16x2(a.z, a.w), bf16x2(b.x, b.y), bf16x2(b.z, b.w));
    }
}

// Where chunk c (0..3: values 8c..8c+7) of tile row r lies in its 64-byte shared-memory row: c ^ ((r / 2) % 4).
// ldmatrix reads one chunk of eight consecutive rows (r0 a multiple of 8): their (r % 2, (r / 2) % 4) are the eight
// pairs, so the rows' 16 bytes fall at (r % 2)·64 + 16·(c ^ ((r / 2) % 4)) of distinct 128-byte bank lines' halves:
// eight distinct 16-byte bank groups, no conflict (a row of 64 bytes unswizzled would put rows r and r + 2 on one).
__device__ __forceinline__ int tc_sw(int r, int c) { return c ^ ((r >> 1) & 3); }

// The tile of rows r0.. (R of them, a multiple of 64; `rows` in all) and k0..k0+TC_BK of bf16 rows `pitch` values
// apart (whole 16-byte chunks, zeros past the rows) into s (swizzled) by T threads: 4R/T cp.async a thread; a chunk
// past the rows or the pitch is zero-filled.
template <int R, int T>
__device__ __forceinline__ void tc_copy_tile(u16 (*s)[TC_BK], const u16* g, i64 r0, i64 rows, i64 k0, i64 pitch) {
#pragma unroll
    for (int i = 0; i < R * 4 / T; i++) {
        int c = threadIdx.x + i * T, r = c >> 2, kc = (c & 3) * 8;
        bool ok = r0 + r < rows && k0 + kc < pitch;
        tc_cp16(&s[r][8 * tc_sw(r, c & 3)], ok ? (const void*)(g + (r0 + r) * pitch + k0 + kc) : (const void*)g,
                ok ? 16 : 0);
    }
}

// The weight row tile row r of w's tile holds (row) and its matrix: w's row n0 + r; or, GLU (gemm_tc_glu*: a block
// 64 outputs of the gate's and the up's products), tile rows 16j..16j+7 the gate's (w's) rows n0 + 8j.., 16j+8..16j+15
// the up's (wu's) same rows — so a warp's fragments 2i and 2i + 1 (8 outputs each) hold the gate and the up of the
// same eight outputs, in the same thread.
template <bool GLU>
__device__ __forceinline__ const void* tc_wrow(const void* w, const void* wu, i64 n0, int r, i64& row) {
    if (!GLU) {
        row = n0 + r;
        return w;
    }
    row = n0 + (r >> 4) * 8 + (r & 7);
    return (r >> 3) & 1 ? wu : w;
}

// w's tile (TC_BN rows, tc_wrow's) of bf16 rows `pitch` values apart from k0 into s, as tc_copy_tile copies x's.
template <int T, bool GLU>
__device__ __forceinline__ void tc_copy_w(u16 (*s)[TC_BK], const void* w, const void* wu, i64 n0, i64 n, i64 k0,
                                          i64 pitch) {
#pragma unroll
    for (int i = 0; i < TC_BN * 4 / T; i++) {
        int c = threadIdx.x + i * T, r = c >> 2, kc = (c & 3) * 8;
        i64 row;
        const u16* g = (const u16*)tc_wrow<GLU>(w, wu, n0, r, row);
        bool ok = row < n && k0 + kc < pitch;
        tc_cp16(&s[r][8 * tc_sw(r, c & 3)], ok ? (const void*)(g + row * pitch + k0 + kc) : (const void*)g,
                ok ? 16 : 0);
    }
}

// Value i of w: dense rows (f32, f16, bf16) read as they are, a block format's value decoded by its own getter
// (prelude.cu: gguf's order of operations, to the bit).
__device__ __forceinline__ float tc_get(int fmt, const void* w, i64 i) {
    const u8* b = (const u8*)w;
    if (fmt == 0) return ((const float*)w)[i];
    if (fmt == 1) return f16f(((const u16*)w)[i]);
    if (fmt == 2) return bf16f(((const u16*)w)[i]);
    if (fmt == 3) return q8_0_get(b, i);
    if (fmt == 4) return q4_0_get(b, i);
    if (fmt == 5) return q4_k_get(b, i);
    if (fmt == 6) return q6_k_get(b, i);
    return mxfp4_get(b, i);
}

// Four dense values from i (a multiple of 4 in rows of whole four-value words, 16- or 8-byte aligned).
__device__ __forceinline__ float4 tc_dense4(int fmt, const void* w, i64 i) {
    if (fmt == 0) return *(const float4*)((const float*)w + i);
    uint2 v = *(const uint2*)((const u16*)w + i);
    if (fmt == 1) return make_float4(f16f(v.x), f16f(v.x >> 16), f16f(v.y), f16f(v.y >> 16));
    return make_float4(bf16f(v.x), bf16f(v.x >> 16), bf16f(v.y), bf16f(v.y >> 16));
}

// Sixteen values of tile row t/2's weight row (tc_wrow's) from k0 + 16(t%2), decoded, rounded to bf16, as eight
// words; zeros past the rows and k. Dense rows of whole four-value words four at a time; a block format (whose rows
// hold whole blocks of 32 or 256) a value at a time, within one block.
template <bool GLU>
__device__ __forceinline__ void tc_load_w(unsigned (&v)[8], int fmt, const void* w0, const void* wu, i64 n0, i64 n,
                                          i64 k0, i64 k) {
    i64 r, c0 = k0 + (threadIdx.x & 1) * 16;
    const void* w = tc_wrow<GLU>(w0, wu, n0, threadIdx.x >> 1, r);
    bool row = r < n;
    if (fmt <= 2 && (k & 3) == 0) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            i64 c = c0 + 4 * q;
            float4 f = row && c < k ? tc_dense4(fmt, w, r * k + c) : make_float4(0.f, 0.f, 0.f, 0.f);
            v[2 * q] = bf16x2(f.x, f.y);
            v[2 * q + 1] = bf16x2(f.z, f.w);
        }
        return;
    }
#pragma unroll
    for (int q = 0; q < 8; q++) {
        i64 c = c0 + 2 * q;
        v[q] = bf16x2(row && c < k ? tc_get(fmt, w, r * k + c) : 0.f, row && c + 1 < k ? tc_get(fmt, w, r * k + c + 1) : 0.f);
    }
}

// tc_load_w's sixteen values into their row's chunks 2(t%2) and 2(t%2) + 1 (swizzled as tc_copy_tile's).
__device__ __forceinline__ void tc_store_w(u16 (*s)[TC_BK], const unsigned (&v)[8]) {
    int r = threadIdx.x >> 1, c = (threadIdx.x & 1) * 2;
    *(uint4*)&s[r][8 * tc_sw(r, c)] = make_uint4(v[0], v[1], v[2], v[3]);
    *(uint4*)&s[r][8 * tc_sw(r, c + 1)] = make_uint4(v[4], v[5], v[6], v[7]);
}

// The block's tile: outputs from TC_BN·tile, rows from BM·blockIdx.y, BM = 32·MI; tc_threads(NJ) threads, each warp
// MI fragments of 16 rows by NJ of 8 outputs (warps two down the rows, TC_BN / 8NJ across). CP: w is bf16 rows of
// whole 16-byte chunks (k a multiple of 8), copied as x is, TC_STAGES stages; else decoded through registers (eight
// warps: NJ 4), two stages.
template <bool CP, int MI, int NJ, bool GLU = false>
__device__ __forceinline__ void gemm_tc_body(const unsigned char* xb, const void* w, int fmt, const float* bias,
                                             const float* add, Dst y, i64 k, i64 n, i64 m, i64 tile,
                                             i64 ksplit = 1, float* part = nullptr, const void* wu = nullptr,
                                             int gact = 0, float* glu = nullptr) {
    constexpr int BM = 32 * MI, S = CP ? TC_STAGES : 2, T = tc_threads(NJ);
    static_assert(CP || NJ == 4, "the decoded formats' tc_load_w takes two threads a row of w's tile: eight warps");
    alignas(128) __shared__ u16 xs[S][BM][TC_BK];
    alignas(128) __shared__ u16 ws[S][TC_BN][TC_BK];
    const u16* xg = (const u16*)xb;
    i64 kp = (k + 7) / 8 * 8, n0 = tile * (GLU ? TC_BN / 2 : TC_BN), m0 = (i64)blockIdx.y * BM;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wm = (warp & 1) * 16 * MI, wn = (warp >> 1) * 8 * NJ;
    int tiles = (int)((kp + TC_BK - 1) / TC_BK);
    // a k-split (the `tail`): this block's k steps [t0, t1) of the ksplit parts' (blockIdx.z), its sums into `part`
    int per = (int)((tiles + ksplit - 1) / ksplit), t0 = ksplit > 1 ? (int)blockIdx.z * per : 0;
    if (ksplit > 1) tiles = min(tiles, t0 + per);
    float acc[MI][NJ][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;
    unsigned wv[8];
    // the first S - 1 steps into stages 0..S-2, a commit group each (empty past the last step)
#pragma unroll
    for (int s = 0; s < S - 1; s++) {
        if (t0 + s < tiles) {
            i64 k1 = (i64)(t0 + s) * TC_BK;
            tc_copy_tile<BM, T>(xs[s], xg, m0, m, k1, kp);
            if (CP) {
                tc_copy_w<T, GLU>(ws[s], w, wu, n0, n, k1, k);
            } else {
                tc_load_w<GLU>(wv, fmt, w, wu, n0, n, k1, k);
                tc_store_w(ws[s], wv);
            }
        }
        tc_commit();
    }
    int b = 0, bn = S - 1;  // the stage step t is in; the stage step t + S - 1 goes to
    for (int t = t0; t < tiles; t++) {
        tc_wait<S - 2>();  // this thread's copies of step t landed (groups of t + 1 .. t + S - 2 may be in flight)
        __syncthreads();   // ... every thread's; and every warp done with stage bn (step t - 1's)
        bool next = t + S - 1 < tiles;
        if (next) {
            i64 k1 = (i64)(t + S - 1) * TC_BK;
            tc_copy_tile<BM, T>(xs[bn], xg, m0, m, k1, kp);
            if (CP)
                tc_copy_w<T, GLU>(ws[bn], w, wu, n0, n, k1, k);
            else
                tc_load_w<GLU>(wv, fmt, w, wu, n0, n, k1, k);
        }
        tc_commit();
#pragma unroll
        for (int kk = 0; kk < TC_BK / 8; kk += 2) {  // kk: the 16-byte chunk of the k16 step
            unsigned a[MI][4], bf[NJ / 2][4];
#pragma unroll
            for (int i = 0; i < MI; i++) {
                int r = wm + i * 16 + (lane & 15);
                tc_ldsm4(a[i], &xs[b][r][8 * tc_sw(r, kk + (lane >> 4))]);
            }
#pragma unroll
            for (int j = 0; j < NJ / 2; j++) {
                int r = wn + j * 16 + (lane & 7) + ((lane >> 4) << 3);
                tc_ldsm4(bf[j], &ws[b][r][8 * tc_sw(r, kk + ((lane >> 3) & 1))]);
            }
#pragma unroll
            for (int i = 0; i < MI; i++)
#pragma unroll
                for (int j = 0; j < NJ; j++) tc_mma(acc[i][j], a[i], bf[j >> 1][(j & 1) * 2], bf[j >> 1][(j & 1) * 2 + 1]);
        }
        if (!CP && next) tc_store_w(ws[bn], wv);
        b = b + 1 == S ? 0 : b + 1;
        bn = bn + 1 == S ? 0 : bn + 1;
    }
    int g = lane >> 2, q = lane & 3;
    if (GLU) {  // fragments 2j (the gate) and 2j + 1 (the up) of the same eight outputs: up · act(gate)
#pragma unroll
        for (int i = 0; i < MI; i++)
#pragma unroll
            for (int j = 0; j < NJ; j += 2)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    i64 r = m0 + wm + i * 16 + g + (e >> 1) * 8, c = n0 + ((wn + 8 * j) >> 4) * 8 + 2 * q + (e & 1);
                    if (r < m && c < n) glu[r * n + c] = acc[i][j + 1][e] * act_apply(gact, acc[i][j][e]);
                }
    } else {
#pragma unroll
        for (int i = 0; i < MI; i++)
#pragma unroll
            for (int j = 0; j < NJ; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    i64 r = m0 + wm + i * 16 + g + (e >> 1) * 8, c = n0 + wn + j * 8 + 2 * q + (e & 1);
                    if (r < m && c < n && part) {
                        part[((i64)blockIdx.z * m + r) * n + c] = acc[i][j][e];
                    } else if (r < m && c < n) {
                        float v = acc[i][j][e];
                        if (bias) v += bias[c];
                        if (add) v += add[r * n + c];
                        y.y[dst_at(y, r * n + c)] = v;
                    }
                }
    }
}

#define GEMM_TC_KERNEL(NAME, CP, MI, NJ, THREADS)                                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(const unsigned char* xb, const void* w, i64 fmt,        \
                                                                  const float* bias, const float* add,                 \
                                                                  DST_PARAMS(y), i64 k, i64 n, i64 m) {                \
        PDL_ENTER();                                                                                                   \
        static_assert(tc_threads(NJ) == THREADS, "a block's threads are its warps'");                                  \
        gemm_tc_body<CP, MI, NJ>(xb, w, (int)fmt, bias, add, DST(y), k, n, m, blockIdx.x);                             \
    }
GEMM_TC_KERNEL(gemm_tc_cp, true, 4, 8, 128)  // four warps of 64 x 64
GEMM_TC_KERNEL(gemm_tc_any, false, 4, 4, 256)
GEMM_TC_KERNEL(gemm_tc_cp_64, true, 2, 4, 256)  // products of at most 64 rows (batches): tiles of 64 rows
GEMM_TC_KERNEL(gemm_tc_any_64, false, 2, 4, 256)

// The `tail` split along k (seed 000): a product whose tiles fill less than one wave of the SMs runs each tile as
// ksplit blocks (grid z), block z the k steps [z·per, (z + 1)·per) (per = ceil(steps / ksplit)), its f32 sums into
// part (ksplit, m, n); gemm_tc_combine then adds the parts in order z = 0, 1, ... (the same bits every launch), the
// bias and the added rows, into y.
#define GEMM_TC_SPLIT_KERNEL(NAME, CP, MI, NJ, THREADS)                                                                \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(const unsigned char* xb, const void* w, i64 fmt,        \
                                                                  float* part, i64 ksplit, i64 k, i64 n, i64 m) {      \
        PDL_ENTER();                                                                                                   \
        static_assert(tc_threads(NJ) == THREADS, "a block's threads are its warps'");                                  \
        gemm_tc_body<CP, MI, NJ>(xb, w, (int)fmt, nullptr, nullptr, Dst{}, k, n, m, blockIdx.x, ksplit, part);         \
    }
GEMM_TC_SPLIT_KERNEL(gemm_tc_split_cp, true, 4, 8, 128)
GEMM_TC_SPLIT_KERNEL(gemm_tc_split_any, false, 4, 4, 256)
GEMM_TC_SPLIT_KERNEL(gemm_tc_split_cp_64, true, 2, 4, 256)
GEMM_TC_SPLIT_KERNEL(gemm_tc_split_any_64, false, 2, 4, 256)

extern "C" __global__ void gemm_tc_combine(const float* part, i64 ksplit, const float* bias, const float* add,
                                           DST_PARAMS(y), i64 n, i64 m) {
    PDL_ENTER();
    Dst d = DST(y);
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < m * n; i += (i64)gridDim.x * blockDim.x) {
        float v = part[i];
        for (i64 z = 1; z < ksplit; z++) v += part[z * m * n + i];
        if (bias) v += bias[i % n];
        if (add) v += add[i];
        d.y[dst_at(d, i)] = v;
    }
}

// Several products of one activation in one launch (q, k and v; gate and up): part p (11 descriptor words, as
// gemm_parts.cu's: its weight, bias (0: none), outputs n, first tile of outputs, Dst) takes the tiles from its first,
// ceil(n / TC_BN) of them; x rounded once for all.
#define TC_GP 11
#define GEMM_TC_PARTS_KERNEL(NAME, CP, MI, NJ, THREADS)                                                                \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(const unsigned char* xb, const i64* t,                  \
                                                                  i64 nparts, i64 fmt, i64 k, i64 m) {                 \
        PDL_ENTER();                                                                                                   \
        int p = 0;                                                                                                     \
        while (p + 1 < nparts && (i64)blockIdx.x >= t[(p + 1) * TC_GP + 3]) p++;                                       \
        const i64* d = t + p * TC_GP;                                                                                  \
        static_assert(tc_threads(NJ) == THREADS, "a block's threads are its warps'");                                  \
        gemm_tc_body<CP, MI, NJ>(xb, (const void*)d[0], (int)fmt, (const float*)d[1], nullptr, dst_from(d + 4), k,     \
                             d[2], m, (i64)blockIdx.x - d[3]);                                                         \
    }
GEMM_TC_PARTS_KERNEL(gemm_tc_parts_cp, true, 4, 8, 128)
GEMM_TC_PARTS_KERNEL(gemm_tc_parts_any, false, 4, 4, 256)
GEMM_TC_PARTS_KERNEL(gemm_tc_parts_cp_64, true, 2, 4, 256)
GEMM_TC_PARTS_KERNEL(gemm_tc_parts_any_64, false, 2, 4, 256)

// The gate and up products of one activation and their GLU (rules/lanes/cuda.yaml gemv_gate_up_glu on the tensor
// cores): out (m, n) = (x · wuᵀ) · act(x · wgᵀ), each product as gemm_tc's (bf16 operands, f32 sums), a block 64
// outputs of both (tc_wrow), ceil(n / 64) blocks across; the two (m, n) products never leave the registers.
#define GEMM_TC_GLU_KERNEL(NAME, CP, MI, NJ, THREADS)                                                                  \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(const unsigned char* xb, const void* wg,                \
                                                                      const void* wu, i64 fmt, i64 gact,               \
                                                                      float* out, i64 k, i64 n, i64 m) {               \
        PDL_ENTER();                                                                                                   \
        static_assert(tc_threads(NJ) == THREADS, "a block's threads are its warps'");                                  \
        gemm_tc_body<CP, MI, NJ, true>(xb, wg, (int)fmt, nullptr, nullptr, Dst{}, k, n, m, blockIdx.x, 1,              \
                                       nullptr, wu, (int)gact, out);                                                   \
    }
GEMM_TC_GLU_KERNEL(gemm_tc_glu_cp, true, 4, 8, 128)
GEMM_TC_GLU_KERNEL(gemm_tc_glu_any, false, 4, 4, 256)
GEMM_TC_GLU_KERNEL(gemm_tc_glu_cp_64, true, 2, 4, 256)
GEMM_TC_GLU_KERNEL(gemm_tc_glu_any_64, false, 2, 4, 256)
