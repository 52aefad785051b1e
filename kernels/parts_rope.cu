// Products in parts and their heads' epilogue, the bodies only (no kernel here): fold.cu's fold_parts_rope runs them
// as a launch, chain.cu's fold_attn_o_glu_down as its q/k/v phase. A module takes this file before either.

// Products in parts (or one GEMV) and then their heads' norm and rotation (qkv_head_epilogue) in one launch. Every
// block runs its outputs of the product exactly as gemm_parts does, the raw product written to its part's Dst. A block
// of a rotated part then arrives at each head its outputs touch (a counter a head and a slab of rows); the last block
// of a head to arrive runs that head's epilogue over the slab's rows, reading the raw product back through L2: a warp a
// row, the per-head RMS norm (optional), the rotation (rope.cu's arithmetic) at position pos + row (a batch, slot >
// 0: row r at posp[r], each row a sequence's own), written to the side's Dst. The grid stays the GEMV's, so a wide head never serializes its outputs in one block. A part is PR
// words: gemm_parts' 11 (weight, bias (0: none), n, first block, Dst), then its side's heads (0: no epilogue), first
// counter, norm weight (0: none), eps (f32 bits), Dst (7 words), head width and rotated width (each side its own: a
// side of one head the part's width and no rotation is a row norm, DeepSeek-V3's q_a and latent norms), then an
// absorbing side's matrix (0: none), its format, its outputs a head and whether its rows are the outputs' (rows_out),
// then a row norm's quantized form (the q8 numerics; 0: none): its words, low words (q8k: int16 sums of 16), scales and
// its words a value (quant.cu's blocks: 32 from the values in registers, a lane's value i of block i / 32; the q8k
// form's blocks of 256 read back by the warp from the row it stored).
#define PR 32

// The part block `b` falls in (its words), for a table of nparts parts.
__device__ __forceinline__ const i64* part_of(const i64* t, i64 nparts, i64 b) {
    int p = 0;
    while (p + 1 < nparts && b >= t[(p + 1) * PR + 3]) p++;
    return t + p * PR;
}

// An absorbing side (head_gemv.cu's arithmetic over one head): head h of rows r0..r0+nr-1 (its hd raw values a row
// in y) times the head's own matrix, b outputs a head written through the side's Dst. rows_out: W (heads*b, hd), a
// warp an output, its lanes along the row; else W (heads*hd, b), the lanes along 32 outputs, a row of W a step.
__device__ __forceinline__ void absorb_epilogue(const Dst& y, i64 n, const i64* s, i64 h, i64 r0, i64 nr) {
    i64 heads = s[0], hd = s[11], b = s[15];
    const void* w = (const void*)s[13];
    int fmt = (int)s[14];
    Dst o = dst_from(s + 4);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (i64 r = r0; r < r0 + nr; r++) {
        i64 at = r * n + h * hd;
        if (s[16]) {
            for (i64 j = warp; j < b; j += WARPS) {
                float acc = 0.f;
                for (i64 i = lane; i < hd; i += 32) acc += __ldcg(y.y + dst_at(y, at + i)) * wget(fmt, w, (h * b + j) * hd + i);
                acc = warp_sum(acc);
                if (lane == 0) o.y[dst_at(o, (r * heads + h) * b + j)] = acc;
            }
        } else {
            for (i64 j = (i64)warp * 32 + lane; j - lane < b; j += WARPS * 32) {
                float acc = 0.f;
                if (j < b)
                    for (i64 i = 0; i < hd; i++) acc += __ldcg(y.y + dst_at(y, at + i)) * wget(fmt, w, (h * hd + i) * b + j);
                if (j < b) o.y[dst_at(o, (r * heads + h) * b + j)] = acc;
            }
        }
    }
}

// Head h of rows r0..r0+nr-1 of a part of n outputs a row (raw product in y), s its side's words. A warp a row; a
// lane's values of the head (i = lane, lane + 32, ...) in chunks of HEAD_VALUES, every load of a chunk issued before
// any is used: the sum of squares one L2 round a chunk, then each value with its rotation partner (i +- half), their
// norm weights and the position's cos and sin in one more (a head of up to 128 values: two rounds and the warp sum,
// where one value a lane a round took nine; a head of one chunk, one round: head_epilogue's ONE). The same arithmetic
// in the same order as a value at a time: a lane's squares summed in i's order (a value past the head adds +0 to a sum
// that is +0 or more), the same expressions. HV
// the chunk: HEAD_VALUES in the kernels over an f32 x; 1 (a value a round, as before) in fold_parts_rope_q8, whose
// 128 registers spilled 208 B with four (nvcc 13 sm_90).
#define HEAD_VALUES 4

// A chunk of a lane's values of a head (i = c0 + lane + 32j, j < HV): each value, its rotation partner (i +- half),
// their norm weights and the position's cos and sin, every load issued before any is used (zeros past the head and
// past the rotated part).
template <int HV>
__device__ __forceinline__ void head_chunk(const Dst& y, i64 at, i64 c0, i64 hd, i64 half, i64 rot, const float* nw,
                                           const float* cos, const float* sin, i64 p, int lane, float (&v)[HV],
                                           float (&u)[HV], float (&wv)[HV], float (&wu)[HV], float (&cs)[HV],
                                           float (&sn)[HV]) {
#pragma unroll
    for (int j = 0; j < HV; j++) {
        i64 i = c0 + lane + 32 * j, q = i < half ? i : i - half;  // q: the pair's place in the tables
        i64 pi = i < half ? i + half : i - half;  // the partner
        bool in = i < hd, turn = in && i < rot;
        v[j] = in ? __ldcg(y.y + dst_at(y, at + i)) : 0.f;
        u[j] = turn ? __ldcg(y.y + dst_at(y, at + pi)) : 0.f;
        wv[j] = nw && in ? nw[i] : 0.f;
        wu[j] = nw && turn ? nw[pi] : 0.f;
        cs[j] = turn ? cos[p * half + q] : 0.f;
        sn[j] = turn ? sin[p * half + q] : 0.f;
    }
}

// ONE (chain.cu's q/k/v phase): a head of one chunk (hd <= 32 HV: Qwen3's 128 at HEAD_VALUES 4) loads its chunk
// once, the norm's squares summed from the values the rotation then uses (the arrival, one round of loads and the warp
// sum, where the squares' round and the chunk's took two); the same values in the same order, the same bits. Not in
// fold_parts_rope_4, which it spilled (nvcc 13 sm_90, a run-time choice there: 8 / 8 B), nor as a branch of its own
// beside the two-pass code (the chain's kernels then 56 / 60 B and more).
template <int HV, bool ONE>
__device__ __forceinline__ void head_epilogue(const Dst& y, i64 n, const i64* s, i64 h, i64 r0, i64 nr,
                                              const float* cos, const float* sin, i64 pos, const int* posp,
                                              i64 slot) {
    i64 heads = s[0], hd = s[11], rot = s[12], half = rot / 2;  // rot 0: normed only
    const float* nw = (const float*)s[2];
    float eps = __int_as_float((int)s[3]);
    Dst o = dst_from(s + 4);
    signed char *qw = (signed char*)s[17], *ql = (signed char*)s[18];  // a row norm's quantized form (0: none)
    float* qs = (float*)s[19];
    int lane = threadIdx.x & 31;
    const bool one = ONE && hd <= 32 * HV;
    for (i64 r = r0 + (threadIdx.x >> 5); r < r0 + nr; r += WARPS) {
        i64 at = r * n + h * hd, p = slot > 0 ? (i64)posp[r] : pos + r;  // a batch: row r a sequence's own
        float inv = 1.f;
        float v[HV], u[HV], wv[HV], wu[HV], cs[HV], sn[HV];
        if (nw) {
            float ss = 0.f;
            for (i64 c0 = 0; c0 < hd; c0 += 32 * HV) {
                if (one) {  // the chunk's loads once: the squares from its values
                    head_chunk<HV>(y, at, c0, hd, half, rot, nw, cos, sin, p, lane, v, u, wv, wu, cs, sn);
                } else {
#pragma unroll
                    for (int j = 0; j < HV; j++) {
                        i64 i = c0 + lane + 32 * j;
                        v[j] = i < hd ? __ldcg(y.y + dst_at(y, at + i)) : 0.f;
                    }
                }
#pragma unroll
                for (int j = 0; j < HV; j++) ss += v[j] * v[j];
            }
            inv = rsqrtf(warp_sum(ss) / (float)hd + eps);
        }
        for (i64 c0 = 0; c0 < hd; c0 += 32 * HV) {
            // every load of the chunk first, then the arithmetic: a value's product placed after its own load held the
            // next value's loads back (the SASS)
            if (!(one && nw)) head_chunk<HV>(y, at, c0, hd, half, rot, nw, cos, sin, p, lane, v, u, wv, wu, cs, sn);
#pragma unroll
            for (int j = 0; j < HV; j++) {  // a normed value: v * inv * nw[i]
                if (nw) v[j] = v[j] * inv * wv[j], u[j] = u[j] * inv * wu[j];
            }
#pragma unroll
            for (int j = 0; j < HV; j++) {
                i64 i = c0 + lane + 32 * j;
                if (i >= hd) break;  // uniform where hd is whole 32s (every quantized row)
                float out = v[j];
                if (i < half) out = v[j] * cs[j] - u[j] * sn[j];
                else if (i < rot) out = v[j] * cs[j] + u[j] * sn[j];
                o.y[dst_at(o, (r * heads + h) * hd + i)] = out;
                if (qw && s[20] != 3)  // a row normed whole (one head, whole blocks of 32): lane i holds value i of a block
                    quant_block(out, qw + r * hd, ql ? ql + r * hd : nullptr, qs + r * (hd >> 5), i >> 5, lane);
            }
        }
        if (qw && s[20] == 3) {  // q8_K: the row's blocks of 256 read back from the row the warp just stored
            __syncwarp();
            const float* row = o.y + dst_at(o, r * hd);
            for (i64 b = 0; b < (hd >> 8); b++)
                quant_k_block(row, qw + r * hd, (short*)ql + r * (hd >> 4), qs + r * (hd >> 8), b, lane);
        }
    }
}

// gemv_prefetch for the part block blockIdx.x falls in (the descriptor table is uploaded once and never written by
// a launch: read before PDL_ENTER like the weights).
template <int PW>
__device__ __forceinline__ void parts_prefetch(int fmt, const i64* t, i64 nparts, i64 k) {
    const i64* d = part_of(t, nparts, blockIdx.x);
    gemv_prefetch<PW>(fmt, (const void*)d[0], nullptr, k, d[2], 1, blockIdx.x - d[3]);
}

// The epilogue of block bx of a part (its words d; y and n its Dst and outputs), after the block stored its outputs
// of the product (`per` of them): it arrives at each head its outputs touch; the last to arrive at a head runs the head's epilogue
// (absorb_epilogue where ABSORB and the side absorbs, else head_epilogue) and leaves its counter zero. fold_parts_rope's
// blocks (GRID: the slab of rows blockIdx.y of gridDim.y, read here, not passed: passed in, the slab held registers
// through the product and fold_parts_rope_4 spilled 28 / 560 B, nvcc 13 sm_90) and the chained q/k/v phase's (chain.cu:
// one slab, its block from its ticket) run the same code.
template <int HV, bool ABSORB, bool GRID, bool ONE = false>
__device__ __forceinline__ void parts_epilogue(const i64* d, const Dst& y, i64 n, i64 per, i64 bx, i64 m,
                                               unsigned* counters, const float* cos, const float* sin,
                                               const int* posp, i64 slot) {
    __shared__ int last;
    const i64* s = d + 11;
    if (s[0] == 0) return;  // a part with no epilogue: a plain GEMV block
    const i64 hd = s[11];
    i64 j0 = bx * per, j1 = min(n, j0 + per);
    i64 r0 = GRID ? (i64)blockIdx.y * GR : 0, nr = min((i64)GR, m - r0);
    i64 pos = posp ? (i64)posp[0] : 0;
    __threadfence();
    for (i64 h = j0 / hd; h <= (j1 - 1) / hd; h++) {
        __syncthreads();  // every write of the product fenced; `last` read by all before it is set again
        unsigned* c = counters + (GRID ? (s[1] + h) * gridDim.y + blockIdx.y : s[1] + h);
        unsigned blocks = (unsigned)(((h + 1) * hd - 1) / per - (h * hd) / per + 1);  // blocks touching head h
        if (threadIdx.x == 0) last = atomicAdd(c, 1u) == blocks - 1;
        __syncthreads();
        if (!last) continue;
        __threadfence();
        if (ABSORB && s[13]) absorb_epilogue(y, n, s, h, r0, nr);
        else head_epilogue<HV, ONE>(y, n, s, h, r0, nr, cos, sin, pos, posp, slot);
        if (threadIdx.x == 0) *c = 0u;
    }
}

// PW 0: the activation quantized (qx, gemv_q8.cu's body: a warp an output), else f32 x with PW outputs a warp.
template <int PW>
__device__ __forceinline__ void parts_rope_body(int fmt, const float* x, const QX& qx, const i64* t, i64 nparts,
                                                i64 k, i64 m, unsigned* counters, const float* cos, const float* sin,
                                                const int* posp, i64 slot) {
    const i64* d = part_of(t, nparts, blockIdx.x);
    Dst y = dst_from(d + 4);
    i64 n = d[2], bx = blockIdx.x - d[3];
    if (PW == 0) q8_body(fmt, qx, (const void*)d[0], (const float*)d[1], y, k, n, m, bx);
    else  // (a slab of dense rows at one output a warp as gemv_tile_any: gemv_slab_cp beside the epilogue spilled
          // fold_parts_rope_1, 16 B stack, 16 / 44 B, nvcc 13; at four it takes the slab, no spill)
        gemv_body<(PW > 0 ? PW : 1), (PW >= 4)>(fmt, x, (const void*)d[0], (const float*)d[1], y, nullptr, k, n, m, 1, bx);
    parts_epilogue<PW == 0 ? 1 : HEAD_VALUES, true, true>(d, y, n, WARPS * (PW > 0 ? PW : 1), bx, m, counters, cos,
                                                           sin, posp, slot);
}
