// A prompt chunk's attention on the tensor cores (attention_tc.py), flash-attention style: row r of the chunk (at
// position pos + r) attends cache rows lo(r)..pos + r (lo 0, or the last `window`), each scaled logit soft-capped when
// `softcap` > 0, per-head sinks, the output times act(gate) when gated. Built with gemm_tc.cu (its mma.sync m16n8k16,
// ldmatrix and bf16_rn), under the bf16 numerics: q, k, the probabilities p and v rounded to bf16 (to nearest, ties
// to even), every sum in f32.
//
// A block: one key/value head and 64 "slots", slot i of the chunk being row i / group and head kvh·group + i % group
// (the group's query heads share each key and value tile); four warps, each 16 slots, q's fragments held in
// registers. The block's keys from lo of its first row to its last row's position, ATC_BN at a time: k as rows
// (keys x D) and v transposed (D x keys) rounded into shared memory through registers (the caches are f32); each warp
// S = q·kᵀ (16 x ATC_BN, f32), logits scaled, capped and masked (causal, the window), the online softmax (running
// max m, base = m or 0 while every logit so far is masked; the accumulators scaled by exp(m_old - base)), p =
// exp(l - base) rounded to bf16 and summed (the row's total of the rounded p) and multiplied by v on the tensor cores
// (S's accumulator fragments are the A fragments of p·v). A warp skips a tile none of its slots attends. D (64 or
// 128) bounds hd and vd: both padded with zeros to D in shared memory.

#define ATC_BM 64  // slots a block
#define ATC_BN 64  // keys a tile
#define ATC_THREADS 128

// One tile of keys j0..j0+ATC_BN (zeros from jhi on, and past hd / vd) from the f32 caches into shared memory, rounded
// to bf16: k as rows ks[key][d], v transposed vt[d][key]. A value pair at a time (any pitch and offset).
template <int D>
__device__ __forceinline__ void atc_load_tile(u16 (*ks)[D + 8], u16 (*vt)[ATC_BN + 8], const float* kb, const float* vb,
                                              i64 j0, i64 jhi, i64 hd, i64 vd, i64 kpitch, i64 vpitch) {
    for (int i = threadIdx.x; i < ATC_BN * (D / 2); i += ATC_THREADS) {
        int jj = i / (D / 2), d = 2 * (i % (D / 2));
        i64 j = j0 + jj;
        float a = 0.f, b = 0.f, c = 0.f, e = 0.f;
        if (j < jhi) {
            const float* kr = kb + j * kpitch;
            const float* vr = vb + j * vpitch;
            if (d < hd) a = kr[d];
            if (d + 1 < hd) b = kr[d + 1];
            if (d < vd) c = vr[d];
            if (d + 1 < vd) e = vr[d + 1];
        }
        *(unsigned*)&ks[jj][d] = bf16x2(a, b);
        vt[d][jj] = (u16)bf16_rn(c);
        vt[d + 1][jj] = (u16)bf16_rn(e);
    }
}

// The same tile through 16-byte loads (hd, vd, the pitches and the rows' starts whole four-value words, 16-byte
// aligned), the same bits. Keys: a warp's 32 lanes four consecutive values each of one key's row (512 contiguous
// bytes at D = 128), stored as 8 bytes into ks. Values: lane l takes keys 2p, 2p + 1 (p = l / 2 of its half-tile)
// at four values 4(2c + l % 2), stored as bf16 pairs of the two keys into vt's four rows: a warp's 32 stores land in
// 32 distinct banks (rows 4 apart are 16 banks apart at ATC_BN + 8 values a row), its loads two full 32-byte sectors
// a key row.
template <int D>
__device__ __forceinline__ void atc_load_tile4(u16 (*ks)[D + 8], u16 (*vt)[ATC_BN + 8], const float* kb,
                                               const float* vb, i64 j0, i64 jhi, i64 hd, i64 vd, i64 kpitch,
                                               i64 vpitch) {
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int i = threadIdx.x; i < ATC_BN * (D / 4); i += ATC_THREADS) {
        int jj = i / (D / 4), d = 4 * (i % (D / 4));
        i64 j = j0 + jj;
        float4 f = j < jhi && d < hd ? *(const float4*)(kb + j * kpitch + d) : zero;
        *(uint2*)&ks[jj][d] = make_uint2(bf16x2(f.x, f.y), bf16x2(f.z, f.w));
    }
#pragma unroll 4
    for (int i = threadIdx.x; i < (ATC_BN / 2) * (D / 4); i += ATC_THREADS) {
        int lo = i & 31, hi = i >> 5;
        int jj = 2 * (16 * (hi & 1) + (lo >> 1)), d = 4 * (2 * (hi >> 1) + (lo & 1));
        i64 j = j0 + jj;
        float4 a = j < jhi && d < vd ? *(const float4*)(vb + j * vpitch + d) : zero;
        float4 b = j + 1 < jhi && d < vd ? *(const float4*)(vb + (j + 1) * vpitch + d) : zero;
        *(unsigned*)&vt[d][jj] = bf16x2(a.x, b.x);
        *(unsigned*)&vt[d + 1][jj] = bf16x2(a.y, b.y);
        *(unsigned*)&vt[d + 2][jj] = bf16x2(a.z, b.z);
        *(unsigned*)&vt[d + 3][jj] = bf16x2(a.w, b.w);
    }
}

template <int D>
__device__ __forceinline__ void attention_tc_body(const float* q, const float* kc, const float* vc, const int* posp,
                                                  const float* sinks, float* out, const float* gate, int gact,
                                                  i64 heads, i64 group, i64 hd, i64 vd, i64 rows, i64 window,
                                                  i64 kpitch, i64 koff, i64 vpitch, i64 voff, float scale,
                                                  float softcap) {
    alignas(16) __shared__ u16 ks[ATC_BM][D + 8];      // q's tile, then each tile of keys (a row 16 bytes past D)
    alignas(16) __shared__ u16 vt[D][ATC_BN + 8];      // each tile of values, transposed
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    i64 kvh = blockIdx.y, slots = rows * group, s0 = (i64)blockIdx.x * ATC_BM;
    i64 p0 = posp ? (i64)posp[0] : 0;
    // q's tile: slot s, values d, d + 1 (zeros past hd and the slots)
    for (int i = threadIdx.x; i < ATC_BM * (D / 2); i += ATC_THREADS) {
        int s = i / (D / 2), d = 2 * (i % (D / 2));
        i64 sl = s0 + s;
        float a = 0.f, b = 0.f;
        if (sl < slots) {
            const float* qr = q + ((sl / group) * heads + kvh * group + sl % group) * hd;
            if (d < hd) a = qr[d];
            if (d + 1 < hd) b = qr[d + 1];
        }
        *(unsigned*)&ks[s][d] = bf16x2(a, b);
    }
    __syncthreads();
    unsigned qa[D / 16][4];
#pragma unroll
    for (int kd = 0; kd < D / 16; kd++) tc_ldsm4(qa[kd], &ks[warp * 16 + (lane & 15)][kd * 16 + (lane >> 4) * 8]);
    // the rows of this thread's two slots (g, g + 8 of its warp's 16), their positions and first keys
    i64 rpos[2], rlo[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        i64 sl = s0 + warp * 16 + g + 8 * h;
        rpos[h] = sl < slots ? p0 + sl / group : -1;  // -1: no slot (every key masked)
        rlo[h] = window > 0 ? max((i64)0, rpos[h] - window + 1) : 0;
    }
    // the warp's keys and the block's
    i64 wfirst = s0 + warp * 16, wlast = min(slots - 1, wfirst + 15);
    i64 whi = wfirst < slots ? p0 + wlast / group : -1, wlo = window > 0 ? max((i64)0, p0 + wfirst / group - window + 1) : 0;
    i64 blast = min(slots - 1, s0 + ATC_BM - 1);
    i64 jlo = window > 0 ? max((i64)0, p0 + s0 / group - window + 1) : 0, jhi = p0 + blast / group + 1;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f}, o[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[j][e] = 0.f;
    const float* kb = kc + koff + kvh * hd;
    const float* vb = vc + voff + kvh * vd;
    // 16-byte loads where every key's and value's row starts 16-byte aligned (heads, pitches and offsets whole
    // four-value words: a model's caches); else a value at a time
    bool v4 = ((hd | vd | kpitch | vpitch | koff | voff) & 3) == 0 && ((size_t)kc & 15) == 0 && ((size_t)vc & 15) == 0;
    for (i64 j0 = jlo; j0 < jhi; j0 += ATC_BN) {
        __syncthreads();  // every warp done with the last tile (and with q's)
        if (v4)
            atc_load_tile4<D>(ks, vt, kb, vb, j0, jhi, hd, vd, kpitch, vpitch);
        else
            atc_load_tile<D>(ks, vt, kb, vb, j0, jhi, hd, vd, kpitch, vpitch);
        __syncthreads();
        if (j0 > whi || j0 + ATC_BN <= wlo) continue;  // no slot of this warp attends these keys
        float sc[ATC_BN / 8][4];
#pragma unroll
        for (int j = 0; j < ATC_BN / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) sc[j][e] = 0.f;
#pragma unroll
        for (int kd = 0; kd < D / 16; kd++)
#pragma unroll
            for (int jp = 0; jp < ATC_BN / 16; jp++) {
                unsigned b[4];
                tc_ldsm4(b, &ks[jp * 16 + (lane & 7) + ((lane >> 4) << 3)][kd * 16 + ((lane >> 3) & 1) * 8]);
                tc_mma(sc[2 * jp], qa[kd], b[0], b[1]);
                tc_mma(sc[2 * jp + 1], qa[kd], b[2], b[3]);
            }
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int j = 0; j < ATC_BN / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int h = e >> 1;
                i64 key = j0 + j * 8 + 2 * t + (e & 1);
                float v = sc[j][e] * scale;
                if (softcap > 0.f) v = softcap * tanhf(v / softcap);
                v = key <= rpos[h] && key >= rlo[h] ? v : NEG_INF;
                sc[j][e] = v;
                mx[h] = fmaxf(mx[h], v);
            }
        float corr[2], base[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            float mn = fmaxf(m[h], mx[h]);
            base[h] = mn == NEG_INF ? 0.f : mn;
            corr[h] = expf(m[h] - base[h]);  // m = -inf: 0 (nothing summed yet)
            m[h] = mn;
            l[h] *= corr[h];
        }
#pragma unroll
        for (int j = 0; j < D / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[j][e] *= corr[e >> 1];
#pragma unroll
        for (int kb16 = 0; kb16 < ATC_BN / 16; kb16++) {
            unsigned pa[4];
#pragma unroll
            for (int u = 0; u < 2; u++)
#pragma unroll
                for (int h = 0; h < 2; h++) {  // pa[2u + h]: keys 16·kb16 + 8u + 2t, +1 of row g + 8h
                    float* s = sc[2 * kb16 + u];
                    unsigned bits = bf16x2(expf(s[2 * h] - base[h]), expf(s[2 * h + 1] - base[h]));
                    l[h] += __uint_as_float(bits << 16) + __uint_as_float(bits & 0xffff0000u);
                    pa[2 * u + h] = bits;
                }
#pragma unroll
            for (int dp = 0; dp < D / 16; dp++) {
                unsigned b[4];
                tc_ldsm4(b, &vt[dp * 16 + (lane & 7) + ((lane >> 4) << 3)][kb16 * 16 + ((lane >> 3) & 1) * 8]);
                tc_mma(o[2 * dp], pa, b[0], b[1]);
                tc_mma(o[2 * dp + 1], pa, b[2], b[3]);
            }
        }
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        i64 sl = s0 + warp * 16 + g + 8 * h;
        if (sl >= slots) continue;
        i64 r = sl / group, head = kvh * group + sl % group;
        float f = 1.f, total = l[h];
        if (sinks) {
            float sk = sinks[head], mf = fmaxf(m[h], sk);
            f = expf(m[h] - mf);
            total = total * f + expf(sk - mf);
        }
        float* orow = out + (r * heads + head) * vd;
        const float* grow = gate ? gate + (r * heads + head) * vd : nullptr;
#pragma unroll
        for (int j = 0; j < D / 8; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                i64 d = j * 8 + 2 * t + e;
                if (d < vd) {
                    float y = o[j][2 * h + e] * f / total;
                    if (grow) y *= act_apply(gact, grow[d]);
                    orow[d] = y;
                }
            }
    }
}

#define ATTENTION_TC_KERNEL(NAME, D)                                                                                  \
    extern "C" __global__ void __launch_bounds__(ATC_THREADS) NAME(                                                   \
        const float* q, const float* kc, const float* vc, const int* pos, const float* sinks, float* out,             \
        const float* gate, i64 gact, i64 heads, i64 group, i64 hd, i64 vd, i64 rows, i64 window, i64 kpitch,         \
        i64 koff, i64 vpitch, i64 voff, float scale, float softcap) {                                                 \
        PDL_ENTER();                                                                                                  \
        attention_tc_body<D>(q, kc, vc, pos, sinks, out, gate, (int)gact, heads, group, hd, vd, rows, window, kpitch, \
                             koff, vpitch, voff, scale, softcap);                                                     \
    }
ATTENTION_TC_KERNEL(attention_tc_64, 64)    // heads of at most 64 values (keys and values)
ATTENTION_TC_KERNEL(attention_tc_128, 128)  // at most 128
