// Shared device helpers every kernel source starts with: checkpoint formats decoded without headers (bf16 as the top
// half of an f32, f16 through cvt), a launch's destination (Dst) as scalar parameters, and warp/block reductions.
typedef unsigned short u16;
typedef long long i64;

#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float bf16f(unsigned b) { return __uint_as_float((b & 0xffffu) << 16); }
__device__ __forceinline__ float f16f(unsigned h) {
    float f;
    unsigned short s = (unsigned short)(h & 0xffffu);
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
}

// fmt: 0 f32, 1 f16, 2 bf16 (a launch's argument: one uniform branch, one kernel for every format).
__device__ __forceinline__ float wget(int fmt, const void* w, i64 i) {
    if (fmt == 0) return ((const float*)w)[i];
    if (fmt == 1) return f16f(((const u16*)w)[i]);
    return bf16f(((const u16*)w)[i]);
}

// Four values from i (a multiple of 4, the row aligned as the arena and cudaMalloc align it).
__device__ __forceinline__ float4 wget4(int fmt, const void* w, i64 i) {
    if (fmt == 0) return *(const float4*)((const float*)w + i);
    uint2 v = *(const uint2*)((const u16*)w + i);
    if (fmt == 1) return make_float4(f16f(v.x), f16f(v.x >> 16), f16f(v.y), f16f(v.y >> 16));
    return make_float4(bf16f(v.x), bf16f(v.x >> 16), bf16f(v.y), bf16f(v.y >> 16));
}

// Where a result lands: value e at base + e, or (uwidth > 0) at base + (e / uwidth) * upitch + uoff + e % uwidth,
// base the starting row (read from *rowp on the device when set, else `row`) times pitch.
struct Dst {
    float* y;
    const int* rowp;
    i64 row, pitch, upitch, uoff, uwidth;
};
#define DST_PARAMS(p) float *p##_y, const int *p##_rowp, i64 p##_row, i64 p##_pitch, i64 p##_upitch, i64 p##_uoff, i64 p##_uwidth
#define DST(p) Dst{p##_y, p##_rowp, p##_row, p##_pitch, p##_upitch, p##_uoff, p##_uwidth}

__device__ __forceinline__ i64 dst_at(const Dst& d, i64 e) {
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

__device__ __forceinline__ float act_apply(int a, float x) {
    if (a == 0) return x / (1.f + expf(-x));  // silu
    if (a == 1) return 1.f / (1.f + expf(-x));  // sigmoid
    if (a == 3) return 0.5f * x * (1.f + erff(x * 0.7071067811865476f));  // gelu_erf (exact)
    return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));  // gelu (tanh)
}
