// An activation to int8 blocks of 32 values, one scale a block (llama.cpp's quantize_row_q8_0_ref): a warp a block,
// lane i its value i. d = max|x| / 127, q = roundf(x * (1/d)); under one word the scale kept is d rounded to f16 (the
// value llama.cpp's block_q8_0 holds and multiplies by), under two words d itself, and the low word of the residual,
// roundf((x - q*d) * (254/d)) clipped to +-127. The products and the residual are rounded as numpy rounds them (no
// fused multiply-add), so the words equal the twin's.
__device__ __forceinline__ float f16_round(float d) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(d));
    return f16f(h);
}

__device__ __forceinline__ void quant_block(float x, signed char* words, signed char* low, float* scales, i64 b,
                                            int lane) {
    float a = fabsf(x);
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    float d = __fdiv_rn(a, 127.0f);
    float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    float q = roundf(__fmul_rn(x, id));
    words[b * 32 + lane] = (signed char)q;
    if (low) {
        float r = __fsub_rn(x, __fmul_rn(q, d));
        float l = roundf(__fmul_rn(r, __fmul_rn(id, 254.0f)));
        low[b * 32 + lane] = (signed char)fminf(fmaxf(l, -127.0f), 127.0f);
    }
    if (lane == 0) scales[b] = low ? d : f16_round(d);
}

extern "C" __global__ void quant(const float* x, signed char* words, signed char* low, float* scales, i64 n,
                                 i64 nwords) {
    int lane = threadIdx.x & 31;
    i64 b = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b * 32 >= n) return;
    quant_block(x[b * 32 + lane], words, nwords == 2 ? low : nullptr, scales, b, lane);
}
