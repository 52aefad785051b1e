// Attention of row r (position pos + r) over cache rows lo..pos+r (lo: the window's first, else 0), GQA (query head
// h reads key/value head h / group), scale, a soft cap on the scaled logits (softcap > 0: l = softcap·tanh(l/softcap),
// Gemma 2), sinks (a per-head logit in the softmax's denominator). A block takes
// `per_block` heads of one row and one split of the keys; its four warps stride the split's keys with an online
// softmax each (flash-decoding), then combine in shared memory. One split writes the output; more write their
// (max, sum, weighted values) partials and attention_combine merges them with the sink. Row j's keys start at
// j * kstride + koff of kc, its values at j * vstride + voff of vc (parts of every row of wider tables). A batch
// (slot > 0): grid row y is sequence r = seq0 + y, at position posp[r], over its own slot of the caches (rows from
// r * slot); the partials stay indexed by the grid's row. With `gate` (attn_output_gate) each output value is
// multiplied by act(gate) of its place as it is stored. With `qw` (attn_output_quant) the output's quantized form
// (quant.cu's blocks of 32, heads of whole blocks) is written by the launch that writes the output: once the block's
// heads (the combine's head) are stored, a warp a block of 32 reads them back through L2 and quantizes it; where the
// launch writes the quantized form alone (out null) each warp quantizes the 32 values it holds, one block. With
// qwords 3 (the q8k form, llama.cpp's q8_K: K-quant rows) a block's heads, or the combine's, hold whole blocks of 256
// (the launch's heads_a_block), which a warp each quantizes from the output stored (quant.cu's quant_k_block).
// Heads up to MAXD = 256 values, MAXPB = 4 heads a block (attention_split); wider heads, up to 640 values (a latent
// attention's absorbed head: DeepSeek-V3's 512 + 64), one head a block (attention_split_wide); heads up to 64 values,
// 8 a block (attention_split_narrow: a q8k block of 256 output values over heads of 32).
// Split (tail > 0: a latent attention's queries and keys in two parts): a head's first own = hd - tail query values
// are its unit's in q ((r * heads + h) * own), the rest its unit's in qtail ((r * heads + h) * tail); a key's first own
// values are its group's in kc (j * kstride + koff + kvh * own), the rest row j's of ktail (j * tail), every group's
// alike (the rotated key the heads share): each part read in place, no joined copy of the query or the cache.
#define AW 4

template <int MAXD, int MAXPB>
__device__ __forceinline__ void attention_body(
    const float* q, const float* kc, const float* vc, const int* posp, const float* sinks, float* out, float* part,
    i64 heads, i64 group, i64 hd, i64 vd, i64 window, i64 per_block, i64 splits, i64 kstride, i64 koff, i64 vstride,
    i64 voff, float scale, float softcap, i64 slot, i64 seq0, const float* gate, i64 gact, signed char* qw,
    signed char* ql, float* qscale, const float* qtail, const float* ktail, i64 tail, i64 qwords) {
    constexpr int VPL = MAXD / 32;
    __shared__ float qs[MAXPB][MAXD];
    __shared__ float wm[AW][MAXPB], wsum[AW][MAXPB];
    __shared__ float wacc[AW][MAXPB][MAXD];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    i64 h0 = (i64)blockIdx.x * per_block, ry = blockIdx.y, r = seq0 + ry, z = blockIdx.z;
    if (slot > 0) {
        kc += r * slot * kstride;
        vc += r * slot * vstride;
        if (ktail) ktail += r * slot * tail;
    }
    i64 own = hd - tail;
    for (i64 i = threadIdx.x; i < per_block * hd; i += blockDim.x) {
        i64 u = r * heads + h0 + i / hd, c = i % hd;
        qs[i / hd][c] = c < own ? q[u * own + c] : qtail[u * tail + c - own];
    }
    __syncthreads();
    i64 p = slot > 0 ? (i64)posp[r] : (posp ? (i64)posp[0] : 0) + r;
    i64 lo = window > 0 ? max((i64)0, p - window + 1) : 0;
    i64 cnt = p - lo + 1, chunk = (cnt + splits - 1) / splits;
    i64 js = lo + z * chunk, je = min(p + 1, js + chunk);
    float m[MAXPB], s[MAXPB], acc[MAXPB][VPL];
#pragma unroll
    for (int hh = 0; hh < MAXPB; hh++) {
        m[hh] = NEG_INF;
        s[hh] = 0.f;
#pragma unroll
        for (int t = 0; t < VPL; t++) acc[hh][t] = 0.f;
    }
    for (i64 j = js + warp; j < je; j += AW) {
#pragma unroll
        for (int hh = 0; hh < MAXPB; hh++) {
            if (hh < per_block) {
                i64 kvh = (h0 + hh) / group;
                const float* kr = kc + j * kstride + koff + kvh * own;
                float d = 0.f;
                for (i64 i = lane; i < own; i += 32) d += qs[hh][i] * kr[i];
                if (tail > 0) {
                    const float* kt = ktail + j * tail;
                    for (i64 i = lane; i < tail; i += 32) d += qs[hh][own + i] * kt[i];
                }
                float l = warp_sum(d) * scale;
                if (softcap > 0.f) l = softcap * tanhf(l / softcap);
                float mn = fmaxf(m[hh], l);
                float corr = expf(m[hh] - mn), e = expf(l - mn);
                s[hh] = s[hh] * corr + e;
                const float* vr = vc + j * vstride + voff + kvh * vd;
#pragma unroll
                for (int t = 0; t < VPL; t++) {
                    i64 i = lane + 32 * t;
                    if (i < vd) acc[hh][t] = acc[hh][t] * corr + e * vr[i];
                }
                m[hh] = mn;
            }
        }
    }
#pragma unroll
    for (int hh = 0; hh < MAXPB; hh++) {
        if (hh < per_block) {
            if (lane == 0) {
                wm[warp][hh] = m[hh];
                wsum[warp][hh] = s[hh];
            }
#pragma unroll
            for (int t = 0; t < VPL; t++) {
                i64 i = lane + 32 * t;
                if (i < vd) wacc[warp][hh][i] = acc[hh][t];
            }
        }
    }
    __syncthreads();
    for (i64 e = threadIdx.x; e < per_block * vd; e += blockDim.x) {
        int hh = (int)(e / vd);
        i64 i = e % vd, h = h0 + hh;
        float M = NEG_INF;
        for (int w = 0; w < AW; w++) M = fmaxf(M, wm[w][hh]);
        float S = 0.f, A = 0.f;
        for (int w = 0; w < AW; w++) {
            if (wm[w][hh] != NEG_INF) {
                float f = expf(wm[w][hh] - M);
                S += wsum[w][hh] * f;
                A += wacc[w][hh][i] * f;
            }
        }
        if (splits == 1) {
            if (sinks) {
                float sk = sinks[h], mf = fmaxf(M, sk), f = expf(M - mf);
                S = S * f + expf(sk - mf);
                A = A * f;
            }
            i64 o = (r * heads + h) * vd + i;
            float y = gate ? A / S * act_apply((int)gact, gate[o]) : A / S;
            if (out) out[o] = y;
            else quant_block(y, qw, ql, qscale, o >> 5, lane);  // the quantized form alone: a warp's 32 one block
        } else {
            float* pp = part + ((ry * heads + h) * splits + z) * (vd + 2);
            if (i == 0) {
                pp[0] = M;
                pp[1] = S;
            }
            pp[2 + i] = A;
        }
    }
    if (splits == 1 && qw && out) {  // the block's heads, per_block * vd values from (r * heads + h0) * vd: whole blocks
        __syncthreads();
        if (qwords == 3) {
            i64 b0 = (r * heads + h0) * vd >> 8, nb = per_block * vd >> 8;
            for (i64 b = warp; b < nb; b += AW) quant_k_block(out, qw, (short*)ql, qscale, b0 + b, lane);
        } else {
            i64 b0 = (r * heads + h0) * vd >> 5, nb = per_block * vd >> 5;
            for (i64 b = warp; b < nb; b += AW)
                quant_block(__ldcg(out + (b0 + b) * 32 + lane), qw, ql, qscale, b0 + b, lane);
        }
    }
}

#define ATTENTION_KERNEL(NAME, D, PB)                                                                                 \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                          \
        const float* q, const float* kc, const float* vc, const int* posp, const float* sinks, float* out,           \
        float* part, i64 heads, i64 group, i64 hd, i64 vd, i64 window, i64 per_block, i64 splits, i64 kstride,       \
        i64 koff, i64 vstride, i64 voff, float scale, float softcap, i64 slot, i64 seq0, const float* gate,         \
        i64 gact, signed char* qw, signed char* ql, float* qscale, const float* qtail, const float* ktail,         \
        i64 tail, i64 qwords) {                                                                                      \
        attention_body<D, PB>(q, kc, vc, posp, sinks, out, part, heads, group, hd, vd, window, per_block, splits,    \
                              kstride, koff, vstride, voff, scale, softcap, slot, seq0, gate, gact, qw, ql, qscale,  \
                              qtail, ktail, tail, qwords);                                                           \
    }
ATTENTION_KERNEL(attention_split, 256, 4)
ATTENTION_KERNEL(attention_split_wide, 640, 1)
ATTENTION_KERNEL(attention_split_narrow, 64, 8)  // eight heads of up to 64: the q8k blocks of heads of 32

// The combine: a block `cpb` heads of one row (the heads of one q8k block; one head for any other form).
extern "C" __global__ void attention_combine(const float* part, const float* sinks, float* out, i64 heads, i64 vd,
                                             i64 splits, i64 seq0, const float* gate, i64 gact, signed char* qw,
                                             signed char* ql, float* qscale, i64 cpb, i64 qwords) {
    i64 r = blockIdx.y, h0 = (i64)blockIdx.x * cpb;
    for (i64 h = h0; h < h0 + cpb; h++) {
        const float* pp = part + (r * heads + h) * splits * (vd + 2);
        float M = sinks ? sinks[h] : NEG_INF;
        for (i64 z = 0; z < splits; z++) M = fmaxf(M, pp[z * (vd + 2)]);
        float S = sinks ? expf(sinks[h] - M) : 0.f;
        for (i64 z = 0; z < splits; z++) {
            float mz = pp[z * (vd + 2)];
            if (mz != NEG_INF) S += pp[z * (vd + 2) + 1] * expf(mz - M);
        }
        for (i64 i = threadIdx.x; i < vd; i += blockDim.x) {
            float A = 0.f;
            for (i64 z = 0; z < splits; z++) {
                float mz = pp[z * (vd + 2)];
                if (mz != NEG_INF) A += pp[z * (vd + 2) + 2 + i] * expf(mz - M);
            }
            i64 o = ((seq0 + r) * heads + h) * vd + i;
            float y = gate ? A / S * act_apply((int)gact, gate[o]) : A / S;
            if (out) out[o] = y;
            else quant_block(y, qw, ql, qscale, o >> 5, (int)(threadIdx.x & 31));  // the quantized form alone
        }
    }
    if (qw && out) {  // heads h0.. of row seq0 + r, cpb * vd values: whole blocks
        __syncthreads();
        int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
        if (qwords == 3) {
            i64 b0 = ((seq0 + r) * heads + h0) * vd >> 8;
            for (i64 b = warp; b < cpb * vd >> 8; b += nw) quant_k_block(out, qw, (short*)ql, qscale, b0 + b, lane);
        } else {
            i64 b0 = ((seq0 + r) * heads + h0) * vd >> 5;
            for (i64 b = warp; b < cpb * vd >> 5; b += nw)
                quant_block(__ldcg(out + (b0 + b) * 32 + lane), qw, ql, qscale, b0 + b, lane);
        }
    }
}
