// Folds run as one launch. A GEMV and then a norm (gemv_norm_epilogue): every block runs its outputs of the product;
// the last block to arrive (an arrival counter it resets to zero) runs the norm over every row, reading through L2.
__device__ __forceinline__ void fold_tail(unsigned* counter, i64 rows, const NormArgs& a) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x * gridDim.y * gridDim.z - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (i64 r = 0; r < rows; r++) norm_row(a, r);
    if (threadIdx.x == 0) *counter = 0u;
}

#define FOLD_KERNEL(NAME, PW)                                                                                 \
    extern "C" __global__ void GEMV_BOUNDS                                                         \
        NAME(const float* x, const void* w, i64 fmt, const float* bias, DST_PARAMS(y), i64 k, i64 n, i64 m,  \
             unsigned* counter, i64 rows, NORM_PARAMS) {                                      \
        gemv_prefetch<PW>((int)fmt, w, nullptr, k, n, 1, blockIdx.x);                          \
        PDL_ENTER();                                                                          \
        gemv_body<PW>((int)fmt, x, w, bias, DST(y), nullptr, k, n, m, 1, blockIdx.x);                         \
        fold_tail(counter, rows, NORM_ARGS);                                                                  \
    }
FOLD_KERNEL(fold_gemv_norm_1, 1)
FOLD_KERNEL(fold_gemv_norm_4, 4)

// The same over a quantized activation (gemv_q8.cu's body).
extern "C" __global__ void __launch_bounds__(128)
    fold_gemv_norm_q8(const signed char* xw, const signed char* xl, const float* xs, const void* w, i64 fmt,
                      const float* bias, DST_PARAMS(y), i64 k, i64 n, i64 m, unsigned* counter, i64 rows,
                      NORM_PARAMS) { PDL_ENTER();
    q8_body((int)fmt, QX{xw, xl, xs}, w, bias, DST(y), k, n, m, blockIdx.x);
    fold_tail(counter, rows, NORM_ARGS);
}

// A GEMV and then the arg-max of each row of its result (head_argmax: the LM head and the step's next token, with its
// advance) in one launch. Every block runs its outputs of the product, reads them back (a warp a row, a lane an output)
// and folds each row's best into the row's 64-bit key with one atomicMax: am_key orders the value in the high word and
// the complement of the index in the low, so the larger value wins and, among equal values, the smaller index —
// numpy's argmax, a NaN above every number (the first NaN wins) and -0 equal to +0. The last block to arrive (an
// arrival counter) writes each row's index and the advance as argmax_rows does (argmax.cu), and leaves the keys and
// the counter zero (a key is never zero: the lowest value's high word is ~bits(-inf) > 0).
__device__ __forceinline__ unsigned long long am_key(float v, i64 i) {
    unsigned u;
    if (v != v) u = 0xFFFFFFFFu;
    else {
        u = __float_as_uint(v == 0.f ? 0.f : v);
        u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    }
    return ((unsigned long long)u << 32) | (unsigned long long)(0xFFFFFFFFu - (unsigned)i);
}

// The block's outputs j0..j0+nj-1 (nj <= 32) of rows r0..r0+nr-1 of the product y (n outputs a row, m rows).
__device__ __forceinline__ void argmax_tail(const Dst& y, i64 n, i64 m, i64 j0, int nj, i64 r0, int nr,
                                            unsigned long long* keys, unsigned* counter, int* out, int* token,
                                            int* position, i64 step, i64 batch) {
    __shared__ int last;
    __syncthreads();  // every warp's outputs stored: a block's own stores are visible to it past the barrier
    int lane = threadIdx.x & 31;
    for (i64 r = r0 + (threadIdx.x >> 5); r < min(m, r0 + nr); r += blockDim.x >> 5) {
        i64 j = j0 + lane;
        unsigned long long b = lane < nj && j < n ? am_key(y.y[dst_at(y, r * n + j)], j) : 0ull;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            unsigned long long c = __shfl_xor_sync(0xFFFFFFFFu, b, o);
            b = c > b ? c : b;
        }
        if (lane == 0 && b) atomicMax(keys + r, b);
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x * gridDim.y * gridDim.z - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (i64 r = threadIdx.x; r < m; r += blockDim.x) {
        unsigned long long b = __ldcg(keys + r);
        int idx = (int)(0xFFFFFFFFu - (unsigned)(b & 0xFFFFFFFFull));
        out[r] = idx;
        if (token && batch) {  // a batch: every row's token and position, each row a sequence of its own
            token[r] = idx;
            position[r] += (int)step;
        }
        keys[r] = 0ull;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (token && !batch) {
            token[0] = out[m - 1];
            position[0] += (int)step;
        }
        *counter = 0u;
    }
}

#define ARGMAX_PARAMS unsigned long long *keys, unsigned *counter, int *out, int *token, int *position, i64 step, i64 batch
#define ARGMAX_ARGS keys, counter, out, token, position, step, batch
#define FOLD_ARGMAX_KERNEL(NAME, PW)                                                                          \
    extern "C" __global__ void GEMV_BOUNDS NAME(const float* x, const void* w, i64 fmt, const float* bias,   \
                                                DST_PARAMS(y), i64 k, i64 n, i64 m, ARGMAX_PARAMS) {        \
        gemv_prefetch<PW>((int)fmt, w, nullptr, k, n, 1, blockIdx.x);                                       \
        PDL_ENTER();                                                                                        \
        gemv_body<PW>((int)fmt, x, w, bias, DST(y), nullptr, k, n, m, 1, blockIdx.x);                       \
        argmax_tail(DST(y), n, m, (i64)blockIdx.x * WARPS * PW, WARPS * PW, (i64)blockIdx.y * GR, GR,        \
                    ARGMAX_ARGS);                                                                           \
    }
FOLD_ARGMAX_KERNEL(fold_gemv_argmax_1, 1)
FOLD_ARGMAX_KERNEL(fold_gemv_argmax_4, 4)

extern "C" __global__ void __launch_bounds__(128)
    fold_gemv_argmax_q8(const signed char* xw, const signed char* xl, const float* xs, const void* w, i64 fmt,
                        const float* bias, DST_PARAMS(y), i64 k, i64 n, i64 m, ARGMAX_PARAMS) { PDL_ENTER();
    q8_body((int)fmt, QX{xw, xl, xs}, w, bias, DST(y), k, n, m, blockIdx.x);
    argmax_tail(DST(y), n, m, (i64)blockIdx.x * QWARPS, QWARPS, (i64)blockIdx.y * QGR, QGR, ARGMAX_ARGS);
}

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
// where one value a lane a round took nine). The same arithmetic in the same order as a value at a time: a lane's
// squares summed in i's order (a value past the head adds +0 to a sum that is +0 or more), the same expressions. HV
// the chunk: HEAD_VALUES in the kernels over an f32 x; 1 (a value a round, as before) in fold_parts_rope_q8, whose
// 128 registers spilled 208 B with four (nvcc 13 sm_90).
#define HEAD_VALUES 4

template <int HV>
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
    for (i64 r = r0 + (threadIdx.x >> 5); r < r0 + nr; r += WARPS) {
        i64 at = r * n + h * hd, p = slot > 0 ? (i64)posp[r] : pos + r;  // a batch: row r a sequence's own
        float inv = 1.f;
        if (nw) {
            float ss = 0.f;
            for (i64 c0 = 0; c0 < hd; c0 += 32 * HV) {
                float v[HV];
#pragma unroll
                for (int j = 0; j < HV; j++) {
                    i64 i = c0 + lane + 32 * j;
                    v[j] = i < hd ? __ldcg(y.y + dst_at(y, at + i)) : 0.f;
                }
#pragma unroll
                for (int j = 0; j < HV; j++) ss += v[j] * v[j];
            }
            inv = rsqrtf(warp_sum(ss) / (float)hd + eps);
        }
        for (i64 c0 = 0; c0 < hd; c0 += 32 * HV) {
            // every load of the chunk first (a value, its partner, their norm weights, cos, sin), then the arithmetic:
            // a value's product placed after its own load held the next value's loads back (the SASS)
            float v[HV], u[HV], wv[HV], wu[HV], cs[HV], sn[HV];
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
    int p = 0;
    while (p + 1 < nparts && (i64)blockIdx.x >= t[(p + 1) * PR + 3]) p++;
    const i64* d = t + p * PR;
    gemv_prefetch<PW>(fmt, (const void*)d[0], nullptr, k, d[2], 1, blockIdx.x - d[3]);
}

// PW 0: the activation quantized (qx, gemv_q8.cu's body: a warp an output), else f32 x with PW outputs a warp.
template <int PW>
__device__ __forceinline__ void parts_rope_body(int fmt, const float* x, const QX& qx, const i64* t, i64 nparts,
                                                i64 k, i64 m, unsigned* counters, const float* cos, const float* sin,
                                                const int* posp, i64 slot) {
    __shared__ int last;
    int p = 0;
    while (p + 1 < nparts && (i64)blockIdx.x >= t[(p + 1) * PR + 3]) p++;
    const i64* d = t + p * PR;
    Dst y = dst_from(d + 4);
    i64 n = d[2], bx = blockIdx.x - d[3];
    if (PW == 0) q8_body(fmt, qx, (const void*)d[0], (const float*)d[1], y, k, n, m, bx);
    else gemv_body<(PW > 0 ? PW : 1)>(fmt, x, (const void*)d[0], (const float*)d[1], y, nullptr, k, n, m, 1, bx);
    const i64* s = d + 11;
    if (s[0] == 0) return;  // a part with no epilogue: a plain GEMV block
    const i64 hd = s[11], per = WARPS * (PW > 0 ? PW : 1);
    i64 j0 = bx * per, j1 = min(n, j0 + per);
    i64 r0 = (i64)blockIdx.y * GR, nr = min((i64)GR, m - r0);
    i64 pos = posp ? (i64)posp[0] : 0;
    __threadfence();
    for (i64 h = j0 / hd; h <= (j1 - 1) / hd; h++) {
        __syncthreads();  // every write of the product fenced; `last` read by all before it is set again
        unsigned* c = counters + (s[1] + h) * gridDim.y + blockIdx.y;
        unsigned blocks = (unsigned)(((h + 1) * hd - 1) / per - (h * hd) / per + 1);  // blocks touching head h
        if (threadIdx.x == 0) last = atomicAdd(c, 1u) == blocks - 1;
        __syncthreads();
        if (!last) continue;
        __threadfence();
        if (s[13]) absorb_epilogue(y, n, s, h, r0, nr);
        else head_epilogue<PW == 0 ? 1 : HEAD_VALUES>(y, n, s, h, r0, nr, cos, sin, pos, posp, slot);
        if (threadIdx.x == 0) *c = 0u;
    }
}

#define PARTS_ROPE_KERNEL(NAME, PW)                                                                           \
    extern "C" __global__ void GEMV_BOUNDS                                                         \
        NAME(const float* x, const i64* t, i64 nparts, i64 fmt, i64 k, i64 m, unsigned* counters,            \
             const float* cos, const float* sin, const int* posp, i64 slot) {                \
        parts_prefetch<PW>((int)fmt, t, nparts, k);                                           \
        PDL_ENTER();                                                                          \
        parts_rope_body<PW>((int)fmt, x, QX{nullptr, nullptr, nullptr}, t, nparts, k, m, counters, cos, sin,   \
                            posp, slot);                                                                      \
    }
PARTS_ROPE_KERNEL(fold_parts_rope_1, 1)
PARTS_ROPE_KERNEL(fold_parts_rope_4, 4)

extern "C" __global__ void __launch_bounds__(128)
    fold_parts_rope_q8(const signed char* xw, const signed char* xl, const float* xs, const i64* t, i64 nparts,
                       i64 fmt, i64 k, i64 m, unsigned* counters, const float* cos, const float* sin, const int* posp,
                       i64 slot) { PDL_ENTER();
    parts_rope_body<0>((int)fmt, nullptr, QX{xw, xl, xs}, t, nparts, k, m, counters, cos, sin, posp, slot);
}

// An embedding gather and then a norm of the gathered rows (embed_norm), a block a row: the row gathered (decoded
// from its format, times scale) and kept in `out`, then normed from there as norm_rows does (rows of the norm's cols).
extern "C" __global__ void __launch_bounds__(1024) fold_gather_norm(const void* table, i64 fmt, const int* index,
                                                                   float* out, float scale, NORM_PARAMS) { PDL_ENTER();
    i64 r = blockIdx.x, row = index[r];
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x)
        out[r * cols + c] = wget((int)fmt, table, row * cols + c) * scale;
    __syncthreads();  // the row written is seen by every thread of the block (norm_row reads it through L2)
    NormArgs a = NORM_ARGS;
    norm_row<NORM_VBATCH_WIDE>(a, r);
}
