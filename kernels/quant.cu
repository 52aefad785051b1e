// An activation to int8 blocks of 32 values, one scale a block, as llama.cpp's CPU build quantizes it (its x86 SIMD
// quantize_row_q8_0 / q8_1 in ggml-cpu/arch/x86/quants.c, not the scalar _ref): a warp a block, lane i its value i.
// amax = max|x|, d = amax / 127, id = 127 / amax (not 1/d: the two differ by an f32 ulp for some amax), q = x * id
// rounded to nearest, halves to even (_mm256_round_ps(_MM_ROUND_NEAREST); rintf here, not roundf); the scale kept is
// d itself, f32, under both forms: under one word the products (gemv_q8.cu's q8_tile) round it to f16 for the
// block's d (the value block_q8_0 / block_q8_1 hold) and take q8_1's s = f16(d * sum q) from it for q4_1 / q5_1 rows;
// under two words the low word of the residual, rintf((x - q*d) * (id*254)) clipped to +-127. The products and the
// residual are rounded as numpy rounds them (no fused multiply-add), so the words equal the twin's
// (engine/quantize.quantize).

__device__ __forceinline__ void quant_block(float x, signed char* words, signed char* low, float* scales, i64 b,
                                            int lane) {
    float a = fabsf(x);
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    float d = __fdiv_rn(a, 127.0f);
    float id = d != 0.0f ? __fdiv_rn(127.0f, a) : 0.0f;  // 0 where d underflows, as before
    float q = rintf(__fmul_rn(x, id));
    words[b * 32 + lane] = (signed char)q;
    if (low) {
        float r = __fsub_rn(x, __fmul_rn(q, d));
        float l = rintf(__fmul_rn(r, __fmul_rn(id, 254.0f)));
        low[b * 32 + lane] = (signed char)fminf(fmaxf(l, -127.0f), 127.0f);
    }
    if (lane == 0) __stcg(scales + b, d);  // past L1: a later launch reads it (a plain store: moe_up_sorted
                                           // spilled 40 B at 80 registers, nvcc 13.0 sm_90)
}

// A block of 256 values as llama.cpp's q8_K (ggml's quantize_row_q8_K_ref; the form products over q4_k / q6_k rows
// read under q8): a warp a block, lane i its values 8i..8i+7. max is the first value of the largest |x| (each lane
// its first, then the smaller place on a tie), iscale = -127/max, q = min(127, rint(iscale * x)) (ggml's
// nearest_int rounds halves to even, as rint does), the scale 1/iscale kept f32, and the sum of each 16 words
// (lanes 2g and 2g+1) as an int16.
// One block of 256 values at xb (any memory: global, or a block's shared values), its words at wb, its 16 sums at
// sb, its scale at *sc.
__device__ __forceinline__ void quant_k_vals(const float* xb0, signed char* wb, short* sb, float* sc, int lane) {
    const float* xb = xb0 + lane * 8;
    float v[8], a = 0.0f, mx = 0.0f;
    int at = lane * 8;
#pragma unroll
    for (int e = 0; e < 8; e++) {
        v[e] = xb[e];
        if (fabsf(v[e]) > a) { a = fabsf(v[e]); mx = v[e]; at = lane * 8 + e; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float a2 = __shfl_xor_sync(0xffffffffu, a, o), m2 = __shfl_xor_sync(0xffffffffu, mx, o);
        int at2 = __shfl_xor_sync(0xffffffffu, at, o);
        if (a2 > a || (a2 == a && at2 < at)) { a = a2; mx = m2; at = at2; }
    }
    float iscale = a != 0.0f ? __fdiv_rn(-127.0f, mx) : 0.0f;
    int sum = 0;
#pragma unroll
    for (int e = 0; e < 8; e++) {
        int q = min(127, __float2int_rn(__fmul_rn(iscale, v[e])));
        wb[lane * 8 + e] = (signed char)q;
        sum += q;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if ((lane & 1) == 0) sb[lane >> 1] = (short)sum;
    if (lane == 0) *sc = a != 0.0f ? __fdiv_rn(1.0f, iscale) : 0.0f;
}

// Block b of a flat activation x: its words, sums and scale at their places in the q8k form's parts.
__device__ __forceinline__ void quant_k_block(const float* x, signed char* words, short* sums, float* scales, i64 b,
                                              int lane) {
    quant_k_vals(x + b * 256, words + b * 256, sums + b * 16, scales + b, lane);
}

// Block b of x, its 256 values stored by other blocks of the launch too, quantized by the calling block: the values
// read through L2 into `stage` (the block's shared memory), then a warp quantizes them. Every thread calls it.
__device__ __forceinline__ void quant_k_block_l2(const float* x, float* stage, signed char* words, short* sums,
                                                 float* scales, i64 b) {
    for (i64 i = threadIdx.x; i < 256; i += blockDim.x) stage[i] = __ldcg(x + b * 256 + i);
    __syncthreads();
    if (threadIdx.x < 32) quant_k_vals(stage, words + b * 256, sums + b * 16, scales + b, (int)threadIdx.x);
}

// nwords 3: the q8k form, `low` its int16 sums of 16 words (kernels/quant.py's layout).
extern "C" __global__ void quant(const float* x, signed char* words, signed char* low, float* scales, i64 n,
                                 i64 nwords) { PDL_ENTER();
    int lane = threadIdx.x & 31;
    i64 b = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (nwords == 3) {
        if (b * 256 < n) quant_k_block(x, words, (short*)low, scales, b, lane);
        return;
    }
    if (b * 32 >= n) return;
    quant_block(x[b * 32 + lane], words, nwords == 2 ? low : nullptr, scales, b, lane);
}

// The quantizing tail of a launch whose grid is blocks of `per` outputs (x) by slabs of `slab` rows (y), each block
// having stored its outputs of a flat (m, n) f32 result `out` (n whole blocks of QB values: 32, or 256 for llama.cpp's
// q8_K, qwords 3, `ql` its int16 sums of 16 words; `per` dividing QB): every block arrives at the block of QB outputs
// its own lie in (a counter a block of outputs and a slab); the last of the QB / per to arrive quantizes it in each
// row of the slab, reading the f32 values stored back through L2 (a warp a row's block of 32; a block of 256 staged
// in shared memory, then a warp quantizes it), and resets its counter. Every thread of the block calls it (gemv_glu,
// gemv_quant).
__device__ __forceinline__ void slab_quant_tail(const float* out, i64 n, i64 m, i64 per, i64 slab, unsigned* counters,
                                                signed char* qw, signed char* ql, float* qs, i64 qwords) {
    __shared__ int last;
    __shared__ float stage[256];
    const i64 qb = qwords == 3 ? 256 : 32;
    __threadfence();
    __syncthreads();
    i64 b = (i64)blockIdx.x * per / qb, r0 = (i64)blockIdx.y * slab, nb = n / qb;
    unsigned* c = counters + b * gridDim.y + blockIdx.y;
    if (threadIdx.x == 0) last = atomicAdd(c, 1u) == (unsigned)(qb / per) - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (qwords == 3) {
        for (i64 r = r0; r < min(m, r0 + slab); r++) {
            quant_k_block_l2(out + r * n, stage, qw + r * n, (short*)ql + r * (n >> 4), qs + r * nb, b);
            __syncthreads();  // the stage read by warp 0 before the next row's values land in it
        }
    } else {
        int lane = threadIdx.x & 31;
        for (i64 r = r0 + (threadIdx.x >> 5); r < min(m, r0 + slab); r += blockDim.x >> 5)
            quant_block(__ldcg(out + r * n + b * 32 + lane), qw + r * n, ql ? ql + r * n : nullptr, qs + r * nb, b,
                        lane);
    }
    if (threadIdx.x == 0) *c = 0u;
}
