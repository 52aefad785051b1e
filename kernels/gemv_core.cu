// The GEMV's body, shared by gemv, gemv_glu, gemm_parts and fold: x · wᵀ over checkpoint rows w (n, k) in
// f32/f16/bf16 or a block format (its values decoded in the loop from the quantized bytes), a warp per output (PW = 4:
// four outputs a warp), each warp holding an accumulator per row of a slab of GR rows of x (grid.y the slabs);
// vectorized four-value loads where k and the pointers allow. Split-K (grid.z > 1):
// each z sums its k chunk into the partials.
#define GR 8
#define WARPS 4
// The GEMV kernels' bounds: 128 threads, at least 3 blocks a SM, so ptxas may take up to 168 registers a thread and
// spills none (at its default for 128 threads it capped some at 56-96 and spilled: fold_parts_rope_1 140 bytes).
#define GEMV_BOUNDS __launch_bounds__(128, 3)

// Under programmatic dependent launch (kernels/pdl.py; PDL_PREFETCH a no-op otherwise), before the kernel's
// PDL_ENTER: lane 0 of each warp asks L2 for the first GEMV_PREFETCH bytes of each of the warp's PW rows in its k
// chunk, so that HBM streams the weights while the launch before drains (weights are read-only: no launch writes
// them, so reading them early cannot see another order) and the warp's first load rounds hit L2. 4 KB a row: two of
// gemv_tile16's 2 KB rounds, ~12 MB over the first wave of a 4096-wide bf16 product, well inside the H200's 50 MB L2.
// The bytes of value i of a row in each format (fmt as in prelude.cu; an unknown one: nothing prefetched).
#define GEMV_PREFETCH 4096
__device__ __forceinline__ i64 format_bytes(int fmt, i64 i) {
    switch (fmt) {
        case 0: return 4 * i;
        case 1: case 2: return 2 * i;
        case 3: return (i >> 5) * 34;
        case 4: return (i >> 5) * 18;
        case 5: return (i >> 8) * 144;
        case 6: return (i >> 8) * 210;
        case 7: return (i >> 5) * 17;
        default: return -1;
    }
}

// Rows j0..j0+pw-1 (those below n) of w, values k0..k1 of each: at most GEMV_PREFETCH bytes of each into L2, from the
// 16-byte boundary at or below the chunk's start (inside w: device allocations are 256-byte aligned) to the one at or
// below its end.
__device__ __forceinline__ void prefetch_rows(int fmt, const void* w, i64 k, i64 n, i64 j0, int pw, i64 k0, i64 k1) {
    if (w == nullptr || (threadIdx.x & 31) != 0 || format_bytes(fmt, k) < 0) return;
    const i64 rb = format_bytes(fmt, k), o0 = format_bytes(fmt, k0), len = min(format_bytes(fmt, k1) - o0,
                                                                             (i64)GEMV_PREFETCH);
    for (int p = 0; p < pw && j0 + p < n; p++) {
        unsigned long long s = (unsigned long long)w + (j0 + p) * rb + o0, e = (s + len) & ~15ull;
        s &= ~15ull;
        if (e > s) PDL_PREFETCH((const void*)s, e - s);
    }
}

// A GEMV kernel's prefetch (gemv_body's warp-to-rows map: block bx, WARPS warps of PW outputs; grid.z the k chunks
// of a split); w2 a second matrix over the same rows (the GLU's up), or null.
template <int PW>
__device__ __forceinline__ void gemv_prefetch(int fmt, const void* w, const void* w2, i64 k, i64 n, i64 split,
                                              i64 bx) {
    i64 j0 = (bx * WARPS + (threadIdx.x >> 5)) * PW;
    i64 kc = split > 1 ? ((k + split - 1) / split + 3) / 4 * 4 : k, k0 = (i64)blockIdx.z * kc, k1 = min(k, k0 + kc);
    prefetch_rows(fmt, w, k, n, j0, PW, k0, k1);
    prefetch_rows(fmt, w2, k, n, j0, PW, k0, k1);
}

// Dense rows (FMT 0 f32, 1 f16, 2 bf16) 16 bytes a lane a load (4 or 8 values), the loop unrolled so each lane keeps
// several loads of every output row in flight: the decode GEMV is a stream of the matrix, and HBM is only kept busy
// with tens of KB in flight a SM (2026-12-04 on an H200: 8-byte loads, one at a time, reached 6-16% of DRAM). NR the
// rows of x the accumulators are kept for (1: a decode step; GR: a slab), nr <= NR of them used.
template <int FMT>
__device__ __forceinline__ void unpack16(const uint4& v, float (&f)[FMT == 0 ? 4 : 8]) {
    if (FMT == 0) {
        f[0] = __uint_as_float(v.x), f[1] = __uint_as_float(v.y), f[2] = __uint_as_float(v.z), f[3] = __uint_as_float(v.w);
    } else {
        unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int e = 0; e < 4; e++) {
            f[2 * e] = FMT == 1 ? f16f(u[e]) : bf16f(u[e]);
            f[2 * e + 1] = FMT == 1 ? f16f(u[e] >> 16) : bf16f(u[e] >> 16);
        }
    }
}

// VW values of a row of x from p (16-byte aligned) into registers, a float4 at a time: gemv_tile16's and
// gemv_slab_cp's x loads (plain loads: the chain reads x its own blocks wrote, chain.cu)
template <int VW>
__device__ __forceinline__ void x_values(const float* p, float (&xv)[VW]) {
#pragma unroll
    for (int q = 0; q < VW; q += 4) {
        float4 t = *(const float4*)(p + q);
        xv[q] = t.x, xv[q + 1] = t.y, xv[q + 2] = t.z, xv[q + 3] = t.w;
    }
}

template <int FMT, int PW, int NR>
__device__ __forceinline__ void gemv_tile16(const float* __restrict__ x, const void* __restrict__ w, i64 k, i64 j0,
                                            i64 n, i64 r0, i64 k0, i64 k1, int nr, float (&acc)[PW][NR]) {
    constexpr int VW = FMT == 0 ? 4 : 8, ES = FMT == 0 ? 4 : 2;  // values a 16-byte load, bytes a value
    int lane = threadIdx.x & 31;
    const char* wr[PW];
#pragma unroll
    for (int p = 0; p < PW; p++) wr[p] = (const char*)w + (j0 + p < n ? (j0 + p) * k : 0) * ES;
#pragma unroll 4
    for (i64 i = k0 + VW * lane; i < k1; i += 32 * VW) {
        float wf[PW][VW];
#pragma unroll
        for (int p = 0; p < PW; p++) {
            uint4 v = j0 + p < n ? __ldcs((const uint4*)(wr[p] + i * ES)) : make_uint4(0u, 0u, 0u, 0u);
            unpack16<FMT>(v, wf[p]);
        }
#pragma unroll
        for (int r = 0; r < NR; r++) {
            if (r < nr) {
                float xv[VW];
                x_values<VW>(x + (r0 + r) * k + i, xv);
#pragma unroll
                for (int p = 0; p < PW; p++)
#pragma unroll
                    for (int e = 0; e < VW; e++) acc[p][r] += wf[p][e] * xv[e];
            }
        }
    }
}

// Block-format rows (q8_0, q4_0, q6_k) for one or two rows of x: the quantized bytes read in place a few lanes a
// block (consecutive lanes consecutive bytes of the row: a warp step reads a run of whole blocks), the loop
// unrolled so each lane keeps several blocks' loads in flight, each value decoded in registers to the bit qget gives
// (the small integer to f32 by its bits: 2^23 + t is the float whose low mantissa bits are t, exact, one ALU op
// where the int-to-float conversion runs at a quarter of the FP32 rate), x read as float4 (each lane's values run
// consecutively, so a warp's x loads are whole 128-byte lines). k, the chunk's ends: whole blocks.
__device__ __forceinline__ float magic23(unsigned t) { return __uint_as_float(0x4B000000u | t); }  // 2^23 + t, t < 2^23

// A lane's eight decoded values of each of PW rows of w against x: four at xr, four at xr + gap, in each of the NR rows
// of x (k apart); row 0 always there (nr >= 1), a row past nr reads zeros, no branch.
template <int PW, int NR>
__device__ __forceinline__ void dot8_rows(const float* xr, i64 k, int gap, int nr, const float (&wf)[PW][8],
                                          float (&acc)[PW][NR]) {
#pragma unroll
    for (int r = 0; r < NR; r++) {
        const float* xq = xr + r * k;
        float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
        float4 a = r == 0 || r < nr ? *(const float4*)xq : z, c = r == 0 || r < nr ? *(const float4*)(xq + gap) : z;
        float xv[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
#pragma unroll
        for (int p = 0; p < PW; p++)
#pragma unroll
            for (int e = 0; e < 8; e++) acc[p][r] += wf[p][e] * xv[e];
    }
}

// The 32-value block formats read four lanes a block: a lane's 2-byte words (word 0 the block's f16 d, then its own
// quant words) decoded into eight values, a warp eight blocks a step. A format says its block's bytes, its words a
// lane and where they lie, the steps an iteration unrolls at one output a warp, where the lane's eight values lie in
// the block (four at XOFF·s, four GAP on) and how they decode.
//
// q8_0 (34-byte blocks: d, 32 int8): eight values a lane (four 2-byte loads of quants, the block's d), 272 bytes a
// warp step. int8 q as (q ^ 0x80) = q + 128 in magic23, less 2^23 + 128: exact.
struct BlockQ8_0 {
    static constexpr int BYTES = 34, WORDS = 5, UNROLL = 8, XOFF = 8, GAP = 4, QW = 8;  // QW: quant words a block
    // eight values d·q: the four int8 of word lo, then the four of hi
    __device__ static void eight(unsigned lo, unsigned hi, float d, float (&wf)[8]) {
        lo ^= 0x80808080u, hi ^= 0x80808080u;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            wf[e] = __fmul_rn(__fsub_rn(magic23((lo >> (8 * e)) & 255u), 8388736.f), d);
            wf[4 + e] = __fmul_rn(__fsub_rn(magic23((hi >> (8 * e)) & 255u), 8388736.f), d);
        }
    }
    // values 8h..8h+7 of a block whose quant words (4 bytes each, value 4i.. in word i) and d are q, d
    __device__ static void decode_eighth(const unsigned (&q)[QW], float d, int h, float (&wf)[8]) {
        eight(q[2 * h], q[2 * h + 1], d, wf);
    }
    __device__ static int word(int s, int u) { return u ? 4 * s + u : 0; }
    __device__ static void decode(const unsigned (&raw)[WORDS], float (&wf)[8]) {
        eight(raw[1] | (raw[2] << 16), raw[3] | (raw[4] << 16), f16f(raw[0]), wf);
    }
};

// q4_0 (18-byte blocks: d, 16 bytes, value j the low nibble of byte j, 16 + j its high): lane s bytes 4s..4s+3 (two
// 2-byte loads, and d) for values 4s.. and 16 + 4s.., 144 bytes a warp step. q - 8 as magic23(q) less 2^23 + 8: exact.
struct BlockQ4_0 {
    static constexpr int BYTES = 18, WORDS = 3, UNROLL = 16, XOFF = 4, GAP = 16, QW = 4;
    // eight values d·(q - 8): the four nibbles of word a at shift sa, then those of b at sb
    __device__ static void eight(unsigned a, int sa, unsigned b, int sb, float d, float (&wf)[8]) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            wf[e] = __fmul_rn(d, __fsub_rn(magic23((a >> (8 * e + sa)) & 15u), 8388616.f));
            wf[4 + e] = __fmul_rn(d, __fsub_rn(magic23((b >> (8 * e + sb)) & 15u), 8388616.f));
        }
    }
    // values 8h..8h+7: the low nibbles of words 2h, 2h + 1 (h < 2), else the high nibbles of words 2h - 4, 2h - 3
    __device__ static void decode_eighth(const unsigned (&q)[QW], float d, int h, float (&wf)[8]) {
        int sh = h < 2 ? 0 : 4;
        eight(q[(2 * h) & 3], sh, q[(2 * h + 1) & 3], sh, d, wf);
    }
    __device__ static int word(int s, int u) { return u ? 2 * s + u : 0; }
    __device__ static void decode(const unsigned (&raw)[WORDS], float (&wf)[8]) {
        unsigned v = raw[1] | (raw[2] << 16);
        eight(v, 0, v, 4, f16f(raw[0]), wf);
    }
};

template <class B, int PW, int NR>
__device__ __forceinline__ void gemv_tile_b32(const float* __restrict__ x, const void* __restrict__ w, i64 k, i64 j0,
                                              i64 n, i64 r0, i64 k0, i64 k1, int nr, float (&acc)[PW][NR]) {
    int lane = threadIdx.x & 31, s = lane & 3;
    const u8* wr[PW];
#pragma unroll
    for (int p = 0; p < PW; p++) wr[p] = (const u8*)w + (j0 + p < n ? j0 + p : 0) * (k >> 5) * B::BYTES;
#pragma unroll(B::UNROLL / PW)
    for (i64 b = (k0 >> 5) + (lane >> 2); b < (k1 >> 5); b += 8) {
        unsigned raw[PW][B::WORDS];  // every row's loads first (a row past n reads zeros: d = 0), then the decode
#pragma unroll
        for (int p = 0; p < PW; p++) {
            const u16* blk = (const u16*)(wr[p] + b * B::BYTES);
#pragma unroll
            for (int u = 0; u < B::WORDS; u++) raw[p][u] = j0 + p < n ? (unsigned)__ldcs(blk + B::word(s, u)) : 0u;
        }
        float wf[PW][8];
#pragma unroll
        for (int p = 0; p < PW; p++) B::decode(raw[p], wf[p]);
        dot8_rows<PW, NR>(x + r0 * k + b * 32 + B::XOFF * s, k, B::GAP, nr, wf, acc);
    }
}

// Block-format rows through 16-byte loads. q8_0's 34- and q4_0's 18-byte blocks put the quants two bytes off a word in
// every other block, so gemv_tile_b32 reads them two bytes a load: a lane's loads in flight hold two bytes a register,
// and the SASS keeps 78 bytes a lane in flight (gemv_4 over q8_0 at 168 registers; bf16's 16-byte loads 256): a third
// of what streams HBM at its rate (bench/launch_model.py). Where a row is whole 16-byte words a warp reads a stage of
// each of its rows as 16-byte loads, every load of the stage issued before any is used (q8_0: 136 words a row, 4-5 a
// lane: 320 bytes a lane in flight at four rows a warp), stores them in its own slice of shared memory, and then each
// lane takes whole 32-value pieces from there (a q8_0 / q4_0 block, a q4_k / q6_k sub-block), each value decoded to
// the bits the format's other tiles give, the eight values 8h.. against x as float4 (dot8_rows). A format's stage:
//   q8_0: STAGE_BLOCKS blocks, q4_0: Q40_STAGE (k a multiple of 256: a run of 8 blocks is 272 or 144 bytes, whole
//   words; q4_0's 18-byte blocks twice as many a stage, the same words in flight as q8_0's);
//   q4_k: Q4K_STAGE super-blocks of 144 bytes (nine words each: any row of whole super-blocks);
//   q6_k: Q6K_STAGE super-blocks of 210 bytes (k and the chunk's ends multiples of 2048: a run of 8 is 105 words).
#define STAGE_BLOCKS 64
#define Q40_STAGE 128
#define Q4K_STAGE 16
#define Q6K_STAGE 8
#define STAGE_WORDS 144  // 16-byte words a row a stage at the widest (q4_k's 16 super-blocks, q4_0's 128 blocks; q8_0 136, q6_k 105)

// The one staging buffer of a kernel (a template's __shared__ would be one a format): WARPS warps x 4 rows x
// STAGE_WORDS words, 36,864 bytes.
__device__ __forceinline__ uint4* stage_buffer() {
    __shared__ uint4 buf[WARPS * 4 * STAGE_WORDS];
    return buf;
}

// The slab's dense tile (f32/f16/bf16 rows at 3..GR rows of x, gemv_tile's AR = GR): gemv_tile16's 16-byte loads, a
// lane's values of a step (VW, 32·VW a warp) against NR rows of x, acc[PW][NR] kept. The weights of the steps ahead
// wait in a ring of shared memory, not registers: each lane copies its own 16 bytes of each of the warp's PW rows a
// step by cp.async into the warp's slice of the kernel's staging buffer (stage_buffer: SLAB_STAGES(PW) steps of PW
// rows x 32 lanes x 16 bytes), one commit group a step, SLAB_STAGES - 1 steps in flight through the sums — 6 KB a warp
// at four outputs a warp, 7.5 KB at one, where a ring of registers held 4 and 2 KB (SLAB_DEPTH 2 and 4: its buffers
// beside the 32 accumulators and the step's values were what 168 registers allowed; nvcc's unroll of gemv_tile16 at
// NR = GR spilled). A step: wait for its group, read it from the ring, refill the slot the step before used with the
// step S - 1 on (its values summed an iteration ago), then its values meet x's NR rows (float4 loads, L1 hits: the
// block's warps read the same x) in gemv_tile16's order of sums: the same bits as the register ring gave. A lane's
// step past k1 is neither copied nor summed; a row past n is zero-filled (cp.async of 0 bytes). Each lane reads only
// what its own copies wrote: no barrier.
// Step t of a lane's slab (its 16 bytes of each of PW rows, STEP_BYTES on from step t - 1's) into slot t % S of its
// ring, one commit group (empty where the step lies past the chunk: `in` false); a row at or past `pn` zero-filled.
template <int PW, int S, int STEP_BYTES>
__device__ __forceinline__ void slab_issue(uint4* ring, const char* src, i64 rk, int pn, int t, bool in) {
    if (in) {
#pragma unroll
        for (int p = 0; p < PW; p++)
            tc_cp16(ring + ((t % S) * PW + p) * 32, src + (p < pn ? p * rk : 0) + (i64)t * STEP_BYTES, p < pn ? 16 : 0);
    }
    tc_commit();
}

#define SLAB_STAGES(PW) ((PW) >= 4 ? 4 : 16)
template <int FMT, int PW, int NR, int S>
__device__ __forceinline__ void gemv_slab_cp(const float* __restrict__ x, const void* __restrict__ w, i64 k, i64 j0,
                                             i64 n, i64 r0, i64 k0, i64 k1, int nr, float (&acc)[PW][NR]) {
    constexpr int VW = FMT == 0 ? 4 : 8, ES = FMT == 0 ? 4 : 2;  // values a 16-byte load, bytes a value
    constexpr i64 STEP = 32 * VW;                                // values a warp step
    static_assert(S * PW * 32 <= 4 * STAGE_WORDS, "the ring fits the warp's slice of the staging buffer");
    const int lane = threadIdx.x & 31;
    uint4* ring = stage_buffer() + (threadIdx.x >> 5) * 4 * STAGE_WORDS + lane;  // step slot s, row p: [(s·PW + p)·32]
    const i64 i0 = k0 + VW * lane, rk = k * ES;  // the lane's first value; a row's bytes
    const char* src = (const char*)w + j0 * rk + i0 * ES;  // row j0's bytes of the lane's first step
    const int pn = (int)min((i64)PW, n - j0);  // the warp's rows below n (rows past: zero-filled, nothing read)
    const float* xr = x + r0 * k;
#pragma unroll
    for (int t = 0; t < S - 1; t++) slab_issue<PW, S, STEP * ES>(ring, src, rk, pn, t, i0 + (i64)t * STEP < k1);
#pragma unroll 1
    for (int t = 0; i0 + (i64)t * STEP < k1; t++) {
        const i64 is = i0 + (i64)t * STEP;
        tc_wait<S - 2>();  // step t's group complete (steps t + 1 .. t + S - 2 may still be in flight)
        uint4 v[PW];
#pragma unroll
        for (int p = 0; p < PW; p++) v[p] = ring[((t % S) * PW + p) * 32];
        slab_issue<PW, S, STEP * ES>(ring, src, rk, pn, t + S - 1, is + (S - 1) * STEP < k1);  // into step t - 1's slot
        float wf[PW][VW];
#pragma unroll
        for (int p = 0; p < PW; p++) unpack16<FMT>(v[p], wf[p]);
#pragma unroll
        for (int r = 0; r < NR; r++) {
            if (r < nr) {
                float xv[VW];
                x_values<VW>(xr + r * k + is, xv);
#pragma unroll
                for (int p = 0; p < PW; p++)
#pragma unroll
                    for (int e = 0; e < VW; e++) acc[p][r] += wf[p][e] * xv[e];
            }
        }
    }
    tc_wait_all();  // (nothing left in flight past k1: the ring free for the kernel's next tile)
}

// Block c of a stage row (16-byte aligned words) as d and QW quant words: nine (q8_0) or five (q4_0) words from the
// word at or below its start; a block starting two bytes into a word has d in that word's high half and its quants
// word-aligned, else d in the low half and each quant word straddling two.
template <class B>
__device__ __forceinline__ void staged_block(const uint4* row, int c, float& d, unsigned (&q)[B::QW]) {
    const int* wp = (const int*)row + ((c * B::BYTES) >> 2);  // (unsigned pointers are the arrival counters')
    unsigned wv[B::QW + 1];
#pragma unroll
    for (int t = 0; t <= B::QW; t++) wv[t] = (unsigned)wp[t];
    bool two = (c * B::BYTES) & 2;
    d = f16f(two ? wv[0] >> 16 : wv[0]);
#pragma unroll
    for (int t = 0; t < B::QW; t++) q[t] = two ? wv[t + 1] : __funnelshift_r(wv[t], wv[t + 1], 16);
}

// The staged tile's view of a format: BYTES a unit (block or super-block) of VALS values, STAGE units a stage, and a
// Piece — a lane's 32 values c of the stage row, read from shared memory (piece) and decoded eight at a time
// (eighth: values 8h..8h+7).
template <class B>
struct Staged32 {  // q8_0 / q4_0: a piece a block
    static constexpr int BYTES = B::BYTES, VALS = 32, STAGE = B::BYTES == 18 ? Q40_STAGE : STAGE_BLOCKS;
    struct Piece {
        float d;
        unsigned q[B::QW];
    };
    __device__ static void piece(const uint4* row, int c, Piece& s) { staged_block<B>(row, c, s.d, s.q); }
    __device__ static void eighth(const Piece& s, int h, float (&wf)[8]) { B::decode_eighth(s.q, s.d, h, wf); }
};

// q4_k (144-byte super-blocks, 16-byte aligned: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles:
// sub-block 2c in the low nibbles of bytes 32c.., 2c + 1 in the high). Sub-block j's 6-bit scale and min from a
// super-block's head (j a run-time value: lanes of one warp differ).
__device__ __forceinline__ void q4_k_scale(const uint4& h, int j, unsigned& sc, unsigned& mn) {
    int jl = 8 * (j & 3);
    unsigned lsc = (h.y >> jl) & 63u, lmn = (h.z >> jl) & 63u;
    unsigned hsc = ((h.w >> jl) & 15u) | (((h.y >> (jl + 6)) & 3u) << 4);
    unsigned hmn = ((h.w >> (jl + 4)) & 15u) | (((h.z >> (jl + 6)) & 3u) << 4);
    sc = j < 4 ? lsc : hsc;
    mn = j < 4 ? lmn : hmn;
}

// A piece: sub-block j = c % 8 of super-block c / 8 — the head word and the two nibble words 32(j / 2).. (three
// 16-byte shared loads), its nibbles shifted down. Its ds = d * sc and dm = dmin * mn as qget; a value
// fsub(fmul(ds, q), dm), the product one fma: ds * (2^23 + q) - ds * 2^23 is ds * q exactly (ds * 2^23 exact: a
// power-of-two scale), rounded once, the f32 __fmul_rn(ds, q) gives for a finite ds (the sign of a zero aside, where
// ds < 0 and q = 0: no sum sees it).
struct StagedQ4K {
    static constexpr int BYTES = 144, VALS = 256, STAGE = Q4K_STAGE;
    struct Piece {
        float ds, dm, nds;
        unsigned q[8];  // value 4i + e in byte e of q[i]
    };
    __device__ static void piece(const uint4* row, int c, Piece& s) {
        const uint4* sb = row + 9 * (c >> 3);
        const int j = c & 7, sh = 4 * (j & 1);
        uint4 h = sb[0], a = sb[1 + 2 * (j >> 1)], b = sb[2 + 2 * (j >> 1)];
        unsigned sc, mn;
        q4_k_scale(h, j, sc, mn);
        s.ds = __fmul_rn(f16f(h.x), __fsub_rn(magic23(sc), 8388608.f));
        s.dm = __fmul_rn(f16f(h.x >> 16), __fsub_rn(magic23(mn), 8388608.f));
        s.nds = -__fmul_rn(s.ds, 8388608.f);
        unsigned u[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 8; i++) s.q[i] = (u[i] >> sh) & 0x0F0F0F0Fu;
    }
    __device__ static void eighth(const Piece& s, int h, float (&wf)[8]) {
#pragma unroll
        for (int e = 0; e < 8; e++)
            wf[e] = __fsub_rn(__fmaf_rn(s.ds, magic23((s.q[2 * h + (e >> 2)] >> (8 * (e & 3))) & 15u), s.nds), s.dm);
    }
};

// q6_k (210-byte super-blocks: 128 bytes of low nibbles ql, 64 of high pairs qh, 16 int8 scales of 16 values, d).
// A piece: values 128u2 + 32u.. (u2 = j / 4, u = j % 4, j = c % 8) of super-block c / 8 — ql's run 2u2 + (u & 1)
// (high nibbles for u >= 2), qh's run u2 (bits 2u), the scales 8u2 + 2u and + 1 (values 0-15, 16-31): the runs are
// 2-byte aligned in the stage (a super-block starts 2 bytes into a word every other one), read as nine 4-byte words
// from the word at or below and shifted into place. Each value d·sc times (q - 32) as q6_k_get rounds it (q - 32 as
// magic23(q) less 2^23 + 32: exact).
template <int W>
__device__ __forceinline__ void shared_run(const uint4* row, int off, unsigned (&q)[W]) {  // W words from byte off
    const int* wp = (const int*)row + (off >> 2);
    const int sh = 8 * (off & 2);
    unsigned wv[W + 1];
#pragma unroll
    for (int t = 0; t <= W; t++) wv[t] = (unsigned)wp[t];
#pragma unroll
    for (int t = 0; t < W; t++) q[t] = __funnelshift_r(wv[t], wv[t + 1], sh);
}

struct StagedQ6K {
    static constexpr int BYTES = 210, VALS = 256, STAGE = Q6K_STAGE;
    struct Piece {
        float d0, d1;   // d·sc of values 0-15, 16-31
        unsigned q[8];  // value 4i + e's six bits in byte e of q[i]
    };
    __device__ static void piece(const uint4* row, int c, Piece& s) {
        const int o = 210 * (c >> 3), j = c & 7, u2 = j >> 2, u = j & 3;
        unsigned ql[8], qh[8];
        shared_run<8>(row, o + 64 * u2 + 32 * (u & 1), ql);
        shared_run<8>(row, o + 128 + 32 * u2, qh);
        const u16* hw = (const u16*)row;
        unsigned sc = hw[(o + 192 + 8 * u2 + 2 * u) >> 1];
        float d = f16f(hw[(o + 208) >> 1]);
        s.d0 = __fmul_rn(d, (float)(signed char)(sc & 255u));
        s.d1 = __fmul_rn(d, (float)(signed char)(sc >> 8));
        const int sl = u >= 2 ? 4 : 0, shh = 2 * u;
#pragma unroll
        for (int i = 0; i < 8; i++) s.q[i] = ((ql[i] >> sl) & 0x0F0F0F0Fu) | (((qh[i] >> shh) & 0x03030303u) << 4);
    }
    __device__ static void eighth(const Piece& s, int h, float (&wf)[8]) {
        const float d = h < 2 ? s.d0 : s.d1;
#pragma unroll
        for (int e = 0; e < 8; e++)
            wf[e] = __fmul_rn(d, __fsub_rn(magic23((s.q[2 * h + (e >> 2)] >> (8 * (e & 3))) & 63u), 8388640.f));
    }
};

// Eighth h (values 8h..8h+7) of each of the warp's pieces against NR rows of x. A slab's h is a run-time value (its
// loop not unrolled: four eighths of eight rows of x would not fit in 168 registers beside the pieces), each eighth
// decoded under its own constant h (the pieces' words picked by constant indices: no local memory).
template <class S, int PW, int NR>
__device__ __forceinline__ void staged_eighth(const typename S::Piece (&pc)[PW], int h, const float* xb, i64 k, int nr,
                                              float (&acc)[PW][NR]) {
    float wf[PW][8];
#pragma unroll
    for (int H = 0; H < 4; H++)
        if (h == H)
#pragma unroll
            for (int p = 0; p < PW; p++) S::eighth(pc[p], H, wf[p]);
    dot8_rows<PW, NR>(xb + 8 * h, k, 4, nr, wf, acc);
}

template <class S, int PW, int NR>
__device__ __forceinline__ void gemv_tile_staged(const float* __restrict__ x, const void* __restrict__ w, i64 k, i64 j0,
                                                 i64 n, i64 r0, i64 k0, i64 k1, int nr, float (&acc)[PW][NR]) {
    static_assert(PW <= 4, "the staging buffer holds four rows a warp");
    constexpr int SV = S::STAGE * S::BYTES / 16, PL = (SV + 31) / 32;  // words a row a stage; a lane's loads
    static_assert(SV <= STAGE_WORDS && S::STAGE * S::BYTES % 16 == 0, "a stage is whole words of the buffer");
    constexpr int PIECES = S::VALS / 32;  // 32-value pieces a unit
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint4* st = stage_buffer() + warp * 4 * STAGE_WORDS;
    const i64 rw = k / S::VALS * S::BYTES / 16;  // words a row
    const uint4* w0 = (const uint4*)w + j0 * rw;  // the warp's first row (a row past n is never read)
    for (i64 b0 = k0 / S::VALS; b0 < k1 / S::VALS; b0 += S::STAGE) {
        const int nb = (int)min((i64)S::STAGE, k1 / S::VALS - b0), nv = nb * S::BYTES / 16;  // whole words
        const i64 v0 = b0 * S::BYTES / 16;
        uint4 v[PW][PL];  // every load of the stage first (a row past n, a word past the stage: zeros, no load)
#pragma unroll
        for (int p = 0; p < PW; p++)
#pragma unroll
            for (int u = 0; u < PL; u++) {
                int i = lane + 32 * u;
                v[p][u] = i < nv && j0 + p < n ? __ldcs(w0 + p * rw + v0 + i) : make_uint4(0u, 0u, 0u, 0u);
            }
        __syncwarp();  // the warp's lanes done with the last stage's words
#pragma unroll
        for (int p = 0; p < PW; p++)
#pragma unroll
            for (int u = 0; u < PL; u++)
                if (lane + 32 * u < SV) st[p * STAGE_WORDS + lane + 32 * u] = v[p][u];
        __syncwarp();
#pragma unroll 1
        for (int c = lane; c < nb * PIECES; c += 32) {  // a lane a piece
            typename S::Piece pc[PW];
#pragma unroll
            for (int p = 0; p < PW; p++) S::piece(st + p * STAGE_WORDS, c, pc[p]);
            const float* xb = x + r0 * k + b0 * S::VALS + 32 * c;
            if constexpr (NR <= 2) {
#pragma unroll
                for (int h = 0; h < 4; h++) staged_eighth<S, PW, NR>(pc, h, xb, k, nr, acc);
            } else {
#pragma unroll 1
                for (int h = 0; h < 4; h++) staged_eighth<S, PW, NR>(pc, h, xb, k, nr, acc);
            }
        }
    }
}

// q6_k rows not staged (210-byte super-blocks, rows 2-byte aligned where k is not a multiple of 2048: 128 bytes of low
// nibbles ql, 64 of high pairs qh, 16 int8 scales of 16 values, d): eight lanes a super-block, lane t the values 128h + 32u + 4t.. (h < 2, u < 4) — the four
// bytes 4t.. of ql's four 32-byte runs and of qh's two, as 2-byte loads, and the scale of each (h, u) — a warp four
// super-blocks (840 bytes) a step. Each value d·sc times (q - 32), rounded as q6_k_get rounds it.
__device__ __forceinline__ unsigned ld2x16(const u8* p) {  // four bytes at a 2-byte aligned address
    return (unsigned)__ldcs((const u16*)p) | ((unsigned)__ldcs((const u16*)(p + 2)) << 16);
}

template <int PW, int NR>
__device__ __forceinline__ void gemv_tile_q6_k(const float* __restrict__ x, const void* __restrict__ w, i64 k, i64 j0,
                                               i64 n, i64 r0, i64 k0, i64 k1, int nr, float (&acc)[PW][NR]) {
    int lane = threadIdx.x & 31, t = lane & 7;
    constexpr int PH = PW < 2 ? PW : 2;  // rows a pass over k (their loads in flight at once)
#pragma unroll
    for (int p0 = 0; p0 < PW; p0 += PH) {
        const u8* wr[PH];
#pragma unroll
        for (int p = 0; p < PH; p++) wr[p] = (const u8*)w + (j0 + p0 + p < n ? j0 + p0 + p : 0) * (k >> 8) * 210;
#pragma unroll(PH >= 2 ? 1 : PW == 1 ? 4 : 2)
        for (i64 b = (k0 >> 8) + (lane >> 3); b < (k1 >> 8); b += 4) {
            unsigned ql[PH][4], qh[PH][2], sc[PH][8], dh[PH];  // every row's loads first (a row past n: zeros)
#pragma unroll
            for (int p = 0; p < PH; p++) {
                const u8* sb = wr[p] + b * 210;
                bool in = j0 + p0 + p < n;
#pragma unroll
                for (int c = 0; c < 4; c++) ql[p][c] = in ? ld2x16(sb + 32 * c + 4 * t) : 0u;
#pragma unroll
                for (int h = 0; h < 2; h++) qh[p][h] = in ? ld2x16(sb + 128 + 32 * h + 4 * t) : 0u;
#pragma unroll
                for (int c = 0; c < 8; c++) sc[p][c] = in ? (unsigned)__ldcs((const u16*)(sb + 192 + 2 * c)) : 0u;
                dh[p] = in ? (unsigned)__ldcs((const u16*)(sb + 208)) : 0u;
            }
            const float* xr = x + r0 * k + b * 256 + 4 * t;
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int u = 0; u < 4; u++) {  // values 128h + 32u + 4t..: ql run 2h + (u & 1), high nibbles for u >= 2
                    float4 xv[NR];
#pragma unroll
                    for (int r = 0; r < NR; r++)
                        xv[r] = r == 0 || r < nr ? *(const float4*)(xr + r * k + 128 * h + 32 * u)
                                                 : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
                    for (int p = 0; p < PH; p++) {
                        // scale 8h + 2u + (t >> 2): byte t >> 2 of the pair at 192 + 8h + 2u
                        signed char s = (signed char)((sc[p][4 * h + u] >> (8 * (t >> 2))) & 255u);
                        float d = __fmul_rn(f16f(dh[p]), (float)s);
                        unsigned lo = ql[p][2 * h + (u & 1)], hi = qh[p][h];
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            unsigned l4 = (lo >> (8 * e + (u >= 2 ? 4 : 0))) & 15u, h2 = (hi >> (8 * e + 2 * u)) & 3u;
                            float wv = __fmul_rn(d, (float)((int)(l4 | (h2 << 4)) - 32));
#pragma unroll
                            for (int r = 0; r < NR; r++)
                                acc[p0 + p][r] += wv * (e == 0 ? xv[r].x : e == 1 ? xv[r].y
                                                        : e == 2 ? xv[r].z : xv[r].w);
                        }
                    }
                }
        }
    }
}

// Any format four values a lane a step (a block format's four share one block's scales: qget4), or one at a time where
// k or the pointers are not aligned for that.
template <int PW, int NR>
__device__ __forceinline__ void gemv_tile_any(int fmt, const float* __restrict__ x, const void* __restrict__ w, i64 k,
                                              i64 j0, i64 n, i64 r0, i64 k0, i64 k1, int nr, bool vec,
                                              float (&acc)[PW][NR]) {
    int lane = threadIdx.x & 31;
    if (vec) {
        for (i64 i = k0 + 4 * lane; i < k1; i += 128) {
            float4 wv[PW];
#pragma unroll
            for (int p = 0; p < PW; p++)
                wv[p] = (j0 + p < n) ? wget4(fmt, w, (j0 + p) * k + i) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int r = 0; r < NR; r++) {
                if (r < nr) {
                    float4 xv = *(const float4*)(x + (r0 + r) * k + i);
#pragma unroll
                    for (int p = 0; p < PW; p++)
                        acc[p][r] += wv[p].x * xv.x + wv[p].y * xv.y + wv[p].z * xv.z + wv[p].w * xv.w;
                }
            }
        }
    } else {
        for (i64 i = k0 + lane; i < k1; i += 32) {
            float wv[PW];
#pragma unroll
            for (int p = 0; p < PW; p++) wv[p] = (j0 + p < n) ? wget(fmt, w, (j0 + p) * k + i) : 0.f;
#pragma unroll
            for (int r = 0; r < NR; r++) {
                if (r < nr) {
                    float xv = x[(r0 + r) * k + i];
#pragma unroll
                    for (int p = 0; p < PW; p++) acc[p][r] += wv[p] * xv;
                }
            }
        }
    }
}

// The warp's PW outputs j0.. over rows r0..r0+AR-1 of x (those below m) and k0..k1 of k, summed over the warp into
// every lane's acc; AR the rows the caller keeps accumulators for (1, 2 or a slab of GR: gemv_rows picks it from the
// rows left, so a decode step carries one accumulator an output, not GR). The format is dispatched once, outside the
// loop (one uniform branch): f32/f16/bf16 rows stream 16 bytes a lane a load, at one or two rows of x by
// gemv_tile16, at a slab of 3..GR by gemv_slab_cp (SLAB; without it, as block formats at a slab, gemv_tile_any).
template <int PW, int AR, bool SLAB = true>
__device__ __forceinline__ void gemv_tile(int fmt, const float* __restrict__ x, const void* __restrict__ w, i64 k, i64 m,
                                          i64 j0, i64 n, i64 r0, i64 k0, i64 k1, float (&acc)[PW][AR]) {
#pragma unroll
    for (int p = 0; p < PW; p++)
#pragma unroll
        for (int r = 0; r < AR; r++) acc[p][r] = 0.f;
    int nr = (int)min((i64)AR, m - r0);
    unsigned long long wa = (unsigned long long)w, xa = (unsigned long long)x;
    // four-value loads (a block format's four in one block): k and the chunk start whole words, x 16-byte aligned
    bool vec = ((k | k0) & 3) == 0 && (xa & 15) == 0 && (fmt >= 3 || (wa & (fmt == 0 ? 15 : 7)) == 0);
    if constexpr (AR <= 2) {
        // 16-byte loads: k, the chunk's ends and every row start whole 16-byte words of the matrix and of x
        bool wide = fmt <= 2 && ((k | k0 | k1) & (fmt == 0 ? 3 : 7)) == 0 && (xa & 15) == 0 && (wa & 15) == 0;
        // q8_0, q4_0 read in place: k and the chunk's ends whole blocks, x 16-byte aligned, the rows 2-byte aligned
        bool blocks = fmt >= 3 && fmt <= 4 && ((k | k0 | k1) & 31) == 0 && (xa & 15) == 0 && (wa & 1) == 0;
        // staged (gemv_tile_staged): x and w 16-byte aligned, k and the chunk's ends whole runs of words — q8_0 / q4_0
        // 8 blocks (256 values), q4_k a super-block (256), q6_k 8 super-blocks (2048)
        bool st = (xa & 15) == 0 && (wa & 15) == 0 && ((k | k0 | k1) & (fmt == 6 ? 2047 : 255)) == 0;
        if (wide && fmt == 0) gemv_tile16<0, PW, AR>(x, w, k, j0, n, r0, k0, k1, nr, acc);
        else if (wide && fmt == 1) gemv_tile16<1, PW, AR>(x, w, k, j0, n, r0, k0, k1, nr, acc);
        else if (wide) gemv_tile16<2, PW, AR>(x, w, k, j0, n, r0, k0, k1, nr, acc);
        else if (st && fmt == 3) gemv_tile_staged<Staged32<BlockQ8_0>, PW, AR>(x, w, k, j0, n, r0, k0, k1, nr, acc);
        else if (st && fmt == 4) gemv_tile_staged<Staged32<BlockQ4_0>, PW, AR>(x, w, k, j0, n, r0, k0, k1, nr, acc);
        else if (st && fmt == 5) gemv_tile_staged<StagedQ4K, PW, AR>(x, w, k, j0, n, r0, k0, k1, nr, acc);
        else if (st && fmt == 6) gemv_tile_staged<StagedQ6K, PW, AR>(x, w, k, j0, n, r0, k0, k1, nr, acc);
        else if (blocks && fmt == 3) gemv_tile_b32<BlockQ8_0, PW, AR>(x, w, k, j0, n, r0, k0, k1, nr, acc);
        else if (blocks && fmt == 4) gemv_tile_b32<BlockQ4_0, PW, AR>(x, w, k, j0, n, r0, k0, k1, nr, acc);
        // q6_k rows not staged (2-byte aligned rows: k not a multiple of 2048), at one or two rows of x and one output
        // a warp, or one row of x at four (at two rows and four outputs its x and words pushed gemm_parts_4 past 168
        // registers)
        else if (fmt == 6 && ((k | k0 | k1) & 255) == 0 && (xa & 15) == 0 && (wa & 1) == 0 && (AR == 1 || PW == 1))
            gemv_tile_q6_k<PW, AR>(x, w, k, j0, n, r0, k0, k1, nr, acc);
        else gemv_tile_any<PW, AR>(fmt, x, w, k, j0, n, r0, k0, k1, nr, vec, acc);
    } else if constexpr (SLAB) {
        // the slab: f32/f16/bf16 rows on 16-byte loads (gemv_slab_cp) where k, the chunk's ends and the pointers allow;
        // block-format rows through the staged tile on the same conditions as at one or two rows (each piece decoded
        // once for the slab's rows)
        bool wide = fmt <= 2 && ((k | k0 | k1) & (fmt == 0 ? 3 : 7)) == 0 && (xa & 15) == 0 && (wa & 15) == 0;
        bool st = (xa & 15) == 0 && (wa & 15) == 0 && ((k | k0 | k1) & (fmt == 6 ? 2047 : 255)) == 0;
        if (wide && fmt == 0) gemv_slab_cp<0, PW, AR, SLAB_STAGES(PW)>(x, w, k, j0, n, r0, k0, k1, nr, acc);
        else if (wide && fmt == 1) gemv_slab_cp<1, PW, AR, SLAB_STAGES(PW)>(x, w, k, j0, n, r0, k0, k1, nr, acc);
        else if (wide) gemv_slab_cp<2, PW, AR, SLAB_STAGES(PW)>(x, w, k, j0, n, r0, k0, k1, nr, acc);
        else if constexpr (PW == 1) {  // (four outputs a warp spilled: 40-196 B alone, to 2900 B in kernels, nvcc 13)
            if (st && fmt == 3) gemv_tile_staged<Staged32<BlockQ8_0>, 1, AR>(x, w, k, j0, n, r0, k0, k1, nr, acc);
            else if (st && fmt == 4) gemv_tile_staged<Staged32<BlockQ4_0>, 1, AR>(x, w, k, j0, n, r0, k0, k1, nr, acc);
            else if (st && fmt == 5) gemv_tile_staged<StagedQ4K, 1, AR>(x, w, k, j0, n, r0, k0, k1, nr, acc);
            else if (st && fmt == 6) gemv_tile_staged<StagedQ6K, 1, AR>(x, w, k, j0, n, r0, k0, k1, nr, acc);
            else gemv_tile_any<PW, AR>(fmt, x, w, k, j0, n, r0, k0, k1, nr, vec, acc);
        } else {
            gemv_tile_any<PW, AR>(fmt, x, w, k, j0, n, r0, k0, k1, nr, vec, acc);
        }
    } else {
        gemv_tile_any<PW, AR>(fmt, x, w, k, j0, n, r0, k0, k1, nr, vec, acc);
    }
#pragma unroll
    for (int p = 0; p < PW; p++)
#pragma unroll
        for (int r = 0; r < AR; r++)
            if (r < nr) acc[p][r] = warp_sum(acc[p][r]);  // nr is the warp's own: every lane shuffles together
}

// A product's output soft-capped in its epilogue (cap > 0: cap * tanh(v / cap), Gemma's final logits), else as is.
__device__ __forceinline__ float capped(float v, float cap) { return cap > 0.f ? cap * tanhf(v / cap) : v; }

// The k chunk split z of `split` sums: whole four-value words, so every chunk starts aligned.
__device__ __forceinline__ i64 gemv_chunk(i64 k, i64 split) { return ((k + split - 1) / split + 3) / 4 * 4; }

template <int PW, int AR, bool SLAB = true>
__device__ __forceinline__ void gemv_rows(int fmt, const float* x, const void* w, const float* bias, const Dst& d,
                                          float* part, i64 k, i64 n, i64 m, i64 split, i64 j0, float cap) {
    i64 r0 = (i64)blockIdx.y * GR;
    i64 kc = gemv_chunk(k, split);
    i64 k0 = (i64)blockIdx.z * kc, k1 = min(k, k0 + kc);
    float acc[PW][AR];
    gemv_tile<PW, AR, SLAB>(fmt, x, w, k, m, j0, n, r0, k0, k1, acc);
    if ((threadIdx.x & 31) != 0) return;
#pragma unroll
    for (int p = 0; p < PW; p++)
#pragma unroll
        for (int r = 0; r < AR; r++) {
            i64 j = j0 + p, row = r0 + r;
            if (j < n && row < m) {
                if (split == 1) d.y[dst_at(d, row * n + j)] = capped(acc[p][r] + (bias ? bias[j] : 0.f), cap);
                else part[((i64)blockIdx.z * m + row) * n + j] = acc[p][r];
            }
        }
}

// The warp's outputs j0.. of output block `bx` (blocks of WARPS*PW outputs), rows of slab blockIdx.y: accumulators
// for one row, two or the slab's GR, as many as the slab holds. SLAB false: a slab as gemv_tile_any (fold_parts_rope_1:
// beside its heads' epilogue the slab's tiles spilled it, 16 / 44 B at 168 registers, nvcc 13).
template <int PW, bool SLAB = true>
__device__ __forceinline__ void gemv_body(int fmt, const float* x, const void* w, const float* bias, const Dst& d, float* part,
                                          i64 k, i64 n, i64 m, i64 split, i64 bx, float cap = 0.f) {
    i64 j0 = (bx * WARPS + (threadIdx.x >> 5)) * PW;
    if (j0 >= n) return;
    i64 left = m - (i64)blockIdx.y * GR;
    if (left == 1) gemv_rows<PW, 1>(fmt, x, w, bias, d, part, k, n, m, split, j0, cap);
    else if (left == 2) gemv_rows<PW, 2>(fmt, x, w, bias, d, part, k, n, m, split, j0, cap);
    else gemv_rows<PW, GR, SLAB>(fmt, x, w, bias, d, part, k, n, m, split, j0, cap);
}
