// The GEMV's body, shared by gemv, gemv_glu, gemm_parts and fold: x · wᵀ over checkpoint rows w (n, k) in
// f32/f16/bf16 or a block format (its values decoded in the loop from the quantized bytes), a warp per output (PW = 4:
// four outputs a warp), each warp holding an accumulator per row of a slab of GR rows of x (grid.y the slabs);
// vectorized four-value loads where k and the pointers allow. Split-K (grid.z > 1):
// each z sums its k chunk into the partials.
#define GR 8
#define WARPS 4

template <int PW>
__device__ __forceinline__ void gemv_tile(int fmt, const float* __restrict__ x, const void* __restrict__ w, i64 k, i64 m,
                                          i64 j0, i64 n, i64 r0, i64 k0, i64 k1, float (&acc)[PW][GR]) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int p = 0; p < PW; p++)
#pragma unroll
        for (int r = 0; r < GR; r++) acc[p][r] = 0.f;
    int nr = (int)min((i64)GR, m - r0);
    unsigned long long wa = (unsigned long long)w, xa = (unsigned long long)x;
    bool vec = ((k | k0) & 3) == 0 && (xa & 15) == 0 && (fmt >= 3 || (wa & (fmt == 0 ? 15 : 7)) == 0);
    if (vec) {
        for (i64 i = k0 + 4 * lane; i < k1; i += 128) {
            float4 wv[PW];
#pragma unroll
            for (int p = 0; p < PW; p++)
                wv[p] = (j0 + p < n) ? wget4(fmt, w, (j0 + p) * k + i) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int r = 0; r < GR; r++) {
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
            for (int r = 0; r < GR; r++) {
                if (r < nr) {
                    float xv = x[(r0 + r) * k + i];
#pragma unroll
                    for (int p = 0; p < PW; p++) acc[p][r] += wv[p] * xv;
                }
            }
        }
    }
#pragma unroll
    for (int p = 0; p < PW; p++)
#pragma unroll
        for (int r = 0; r < GR; r++) acc[p][r] = warp_sum(acc[p][r]);
}

// A product's output soft-capped in its epilogue (cap > 0: cap * tanh(v / cap), Gemma's final logits), else as is.
__device__ __forceinline__ float capped(float v, float cap) { return cap > 0.f ? cap * tanhf(v / cap) : v; }

// The k chunk split z of `split` sums: whole four-value words, so every chunk starts aligned.
__device__ __forceinline__ i64 gemv_chunk(i64 k, i64 split) { return ((k + split - 1) / split + 3) / 4 * 4; }

// The warp's outputs j0.. of output block `bx` (blocks of WARPS*PW outputs), rows of slab blockIdx.y.
template <int PW>
__device__ __forceinline__ void gemv_body(int fmt, const float* x, const void* w, const float* bias, const Dst& d, float* part,
                                          i64 k, i64 n, i64 m, i64 split, i64 bx, float cap = 0.f) {
    i64 j0 = (bx * WARPS + (threadIdx.x >> 5)) * PW;
    if (j0 >= n) return;
    i64 r0 = (i64)blockIdx.y * GR;
    i64 kc = gemv_chunk(k, split);
    i64 k0 = (i64)blockIdx.z * kc, k1 = min(k, k0 + kc);
    float acc[PW][GR];
    gemv_tile<PW>(fmt, x, w, k, m, j0, n, r0, k0, k1, acc);
    if ((threadIdx.x & 31) != 0) return;
#pragma unroll
    for (int p = 0; p < PW; p++)
#pragma unroll
        for (int r = 0; r < GR; r++) {
            i64 j = j0 + p, row = r0 + r;
            if (j < n && row < m) {
                if (split == 1) d.y[dst_at(d, row * n + j)] = capped(acc[p][r] + (bias ? bias[j] : 0.f), cap);
                else part[((i64)blockIdx.z * m + row) * n + j] = acc[p][r];
            }
        }
}

