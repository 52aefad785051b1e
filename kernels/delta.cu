// The gated delta rule with its gated output norm, a block a value head and a thread a value column j (dv at most
// 256) of the head's (DK, dv) state column, held in registers: for each row in order, S *= exp(g);
// S += k (beta (v - S^T k)); o = S^T (q scale); the head's o RMS-normed (block_sum) times gn and silu(z). The state
// is read at the start and written back at the end (in place). q and k rows staged in shared memory; z's values
// start at zoff of each row of zpitch. Where qw is set (the q8 numerics), each output row's quantized form too
// (quant.cu's blocks): a warp holds 32 of a head's columns, one block of the row (dv a multiple of 32); with qwords 3
// the q8k form (llama.cpp's q8_K, blocks of 256 over the 256 / dv heads each spans): the last of those heads' blocks
// to store its row (an arrival counter a row's block, reset by it) quantizes the block from the stored row, a warp
// (quant.cu's quant_k_block_l2: the values read through L2 into shared memory).
// The key width DK is a compile-time constant, one entry a width (delta_32 .. delta_128): every loop over the state
// column unrolls whole with no bound to test, so the column stays in registers (a runtime bound kept the array in
// local memory: 1.6 kB of spill stores at 128, measured with -Xptxas -v).
// A batch's entry (delta_seqs_32 .. delta_seqs_128: SEQS) runs a sequence a block row (grid y): row seq0 + blockIdx.y
// alone, over its own slot of the state (hv·DK rows of dv a sequence), the rows' indices the batch's (its quantized
// form's and arrival counters' too). An entry of its own: a runtime choice in one body (a row base, or pointers moved
// to the row) took delta_64 from 128 to 244 registers and spilled the column at 96 and 128 (ptxas -v, sm_90).
#define DELTA_PARAMS                                                                                            \
    const float *q, const float *k, const float *v, const float *z, i64 zpitch, i64 zoff, const float *beta,    \
        const float *g, float *st, const float *gn, float *out, i64 hk, i64 hv, i64 dv, i64 rows, float scale, \
        float eps, signed char *qw, signed char *ql, float *qsc, unsigned *arrivals, i64 qwords, i64 seq0
#define DELTA_ARGS q, k, v, z, zpitch, zoff, beta, g, st, gn, out, hk, hv, dv, rows, scale, eps, qw, ql, qsc, arrivals, \
    qwords, seq0

template <int DK, bool SEQS>
__device__ __forceinline__ void delta_body(DELTA_PARAMS) {
    __shared__ float qs[DK], ks[DK];
    i64 h = blockIdx.x, j = threadIdx.x, kh = h / (hv / hk);
    // the rows this block runs: the step's in order, or (SEQS) a batch's sequence's one row over its own state,
    // the state table's heads from s·hv
    const i64 r0 = SEQS ? seq0 + blockIdx.y : 0, r1 = SEQS ? r0 + 1 : rows, sh = SEQS ? r0 * hv + h : h;
    float S[DK];
#pragma unroll
    for (int i = 0; i < DK; i++) S[i] = st[(sh * DK + i) * dv + j];
    for (i64 r = r0; r < r1; r++) {
        __syncthreads();
        for (i64 i = j; i < DK; i += blockDim.x) {
            qs[i] = q[(r * hk + kh) * DK + i] * scale;
            ks[i] = k[(r * hk + kh) * DK + i];
        }
        __syncthreads();
        // one pass reads the decayed column against k and q (and k against q); o = (S + k d)^T q from them, so
        // the update's pass reads k alone, again from shared memory (volatile: not 2·DK values held in registers)
        float e = expf(g[r * hv + h]), b = beta[r * hv + h], kv = 0.f, sq = 0.f, kq = 0.f;
#pragma unroll
        for (int i = 0; i < DK; i++) {
            S[i] *= e;
            kv += S[i] * ks[i];
            sq += S[i] * qs[i];
            kq += ks[i] * qs[i];
        }
        float d = (v[(r * hv + h) * dv + j] - kv) * b, o = sq + d * kq;
        const volatile float* kr = ks;
#pragma unroll
        for (int i = 0; i < DK; i++) S[i] += kr[i] * d;
        float inv = rsqrtf(block_sum(o * o) / (float)dv + eps);
        float zz = z[r * zpitch + zoff + h * dv + j];
        float y = o * inv * gn[j] * (zz / (1.f + expf(-zz)));
        out[(r * hv + h) * dv + j] = y;
        if (qw && qwords != 3) {
            i64 n = hv * dv;
            quant_block(y, qw + r * n, ql ? ql + r * n : nullptr, qsc + r * (n >> 5), (h * dv + j) >> 5,
                        (int)(j & 31));
        }
    }
#pragma unroll
    for (int i = 0; i < DK; i++) st[(sh * DK + i) * dv + j] = S[i];
    if (qw && qwords == 3) {  // after the rows (the state column's registers free): each row's q8k blocks
        __shared__ int last;
        __shared__ float blk[256];
        i64 n = hv * dv, b = h * dv >> 8;
        __threadfence();
        for (i64 r = r0; r < r1; r++) {
            __syncthreads();
            if (j == 0) last = atomicAdd(arrivals + r * (n >> 8) + b, 1u) == (unsigned)(256 / dv) - 1u;
            __syncthreads();
            if (!last) continue;
            __threadfence();  // the last of the block's heads to arrive: its 256 values, other blocks' among them
            quant_k_block_l2(out + r * n, blk, qw + r * n, (short*)ql + r * (n >> 4), qsc + r * (n >> 8), b);
            if (j == 0) arrivals[r * (n >> 8) + b] = 0u;
        }
    }
}

#define DELTA_ENTRY(DK)                                                               \
    extern "C" __global__ void __launch_bounds__(256) delta_##DK(DELTA_PARAMS) {      \
        PDL_ENTER();                                                                   \
        delta_body<DK, false>(DELTA_ARGS);                                             \
    }                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) delta_seqs_##DK(DELTA_PARAMS) { \
        PDL_ENTER();                                                                   \
        delta_body<DK, true>(DELTA_ARGS);                                              \
    }
DELTA_ENTRY(32)
DELTA_ENTRY(64)
DELTA_ENTRY(96)
DELTA_ENTRY(128)
