// The gated delta rule with its gated output norm, a block a value head and a thread a value column j (dv at most
// 256) of the head's (dk, dv) state, held in registers (dk at most MAX_DK): for each row in order, S *= exp(g);
// S += k (beta (v - S^T k)); o = S^T (q scale); the head's o RMS-normed (block_sum) times gn and silu(z). The state
// is read at the start and written back at the end (in place). q and k rows staged in shared memory; z's values
// start at zoff of each row of zpitch.
#define MAX_DK 128

extern "C" __global__ void __launch_bounds__(256) delta(const float* q, const float* k, const float* v, const float* z,
                                                        i64 zpitch, i64 zoff, const float* beta, const float* g,
                                                        float* st, const float* gn, float* out, i64 hk, i64 hv,
                                                        i64 dk, i64 dv, i64 rows, float scale, float eps) {
    __shared__ float qs[MAX_DK], ks[MAX_DK];
    i64 h = blockIdx.x, j = threadIdx.x, kh = h / (hv / hk);
    float S[MAX_DK];
#pragma unroll
    for (int i = 0; i < MAX_DK; i++) S[i] = i < dk ? st[(h * dk + i) * dv + j] : 0.f;
    for (i64 r = 0; r < rows; r++) {
        __syncthreads();
        for (i64 i = j; i < dk; i += blockDim.x) {
            qs[i] = q[(r * hk + kh) * dk + i] * scale;
            ks[i] = k[(r * hk + kh) * dk + i];
        }
        __syncthreads();
        float e = expf(g[r * hv + h]), b = beta[r * hv + h], kv = 0.f, o = 0.f;
#pragma unroll
        for (int i = 0; i < MAX_DK; i++)
            if (i < dk) {
                S[i] *= e;
                kv += S[i] * ks[i];
            }
        float d = (v[(r * hv + h) * dv + j] - kv) * b;
#pragma unroll
        for (int i = 0; i < MAX_DK; i++)
            if (i < dk) {
                S[i] += ks[i] * d;
                o += S[i] * qs[i];
            }
        float inv = rsqrtf(block_sum(o * o) / (float)dv + eps);
        float zz = z[r * zpitch + zoff + h * dv + j];
        out[(r * hv + h) * dv + j] = o * inv * gn[j] * (zz / (1.f + expf(-zz)));
    }
#pragma unroll
    for (int i = 0; i < MAX_DK; i++)
        if (i < dk) st[(h * dk + i) * dv + j] = S[i];
}
