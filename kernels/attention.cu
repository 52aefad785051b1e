// Attention of row r (position pos + r) over cache rows lo..pos+r (lo: the window's first, else 0), GQA (query head
// h reads key/value head h / group), scale, a soft cap on the scaled logits (softcap > 0: l = softcap·tanh(l/softcap),
// Gemma 2), sinks (a per-head logit in the softmax's denominator). A block takes
// `per_block` heads of one row and one split of the keys; its four warps take the split's keys in tiles of KT keys
// (every key and value row of a tile loaded, 16 bytes a lane, before any is used), an online softmax each
// (flash-decoding), then combine in shared memory. One split writes the output; more write their
// (max, sum, weighted values) partials, and the last split block of those heads to arrive merges them with the sink
// (attention_merge: one launch, no combine pass). Row j's keys start at
// j * kstride + koff of kc, its values at j * vstride + voff of vc (parts of every row of wider tables). A batch
// (slot > 0): grid row y is sequence r = seq0 + y, at position posp[r], over its own slot of the caches (rows from
// r * slot); the partials stay indexed by the grid's row. With `gate` (attn_output_gate) each output value is
// multiplied by act(gate) of its place as it is stored. With `qw` (attn_output_quant) the output's quantized form
// (quant.cu's blocks of 32, heads of whole blocks) is written by the launch that writes the output: once the block's
// heads (the merging block's) are stored, a warp a block of 32 reads them back through L2 and quantizes it; where the
// launch writes the quantized form alone (out null) each warp quantizes the 32 values it holds, one block. With
// qwords 3 (the q8k form, llama.cpp's q8_K: K-quant rows) a block's heads (the merge's too) hold whole blocks of 256
// (the launch's heads_a_block), which a warp each quantizes from the output stored (quant.cu's quant_k_block).
// Heads up to 128 values, 4 a block, 8 keys a tile (attention_split_128); up to MAXD = 256 values, MAXPB = 4 heads a
// block, 4 keys a tile (attention_split); wider heads, up to 640 values (a latent
// attention's absorbed head: DeepSeek-V3's 512 + 64), one head a block (attention_split_wide); heads up to 64 values,
// 8 a block (attention_split_narrow: a q8k block of 256 output values over heads of 32). Shared rows (`shared` > 1,
// attention_rows_128: a chunk's rows, no batch): a block's slots are `shared` consecutive rows times its heads, all of
// one key/value head; the rows' keys (the first row's window start to the last row's position) split as one row's
// are, each tile loaded once for every slot, each slot masking the keys its row does not attend.
// Split (tail > 0: a latent attention's queries and keys in two parts): a head's first own = hd - tail query values
// are its unit's in q ((r * heads + h) * own), the rest its unit's in qtail ((r * heads + h) * tail); a key's first own
// values are its group's in kc (j * kstride + koff + kvh * own), the rest row j's of ktail (j * tail), every group's
// alike (the rotated key the heads share): each part read in place, no joined copy of the query or the cache.
#define AW 4

// Values i..i+3 of a row whose first `own` values are at a, the rest (up to n) at b (b[0]: value own); zero past n.
// VEC (every row, offset and part a multiple of 4 floats, the tables 16-byte aligned): one 16-byte load; else four.
template <bool VEC>
__device__ __forceinline__ void attn_ld4(float (&d)[4], const float* a, const float* b, i64 own, i64 n, i64 i) {
    if (VEC) {
        float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
        if (i < n) t = __ldg((const float4*)(i < own ? a + i : b + (i - own)));
        d[0] = t.x, d[1] = t.y, d[2] = t.z, d[3] = t.w;
    } else {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            i64 c = i + e;
            d[e] = c < n ? __ldg(c < own ? a + c : b + (c - own)) : 0.f;
        }
    }
}

// The keys: a warp takes KT consecutive keys at a time (tiles AW * KT keys apart), every key's and value's loads of the
// tile issued before any is used (KT rows of keys and of values in flight a warp); a lane holds values
// c * 128 + 4 * lane .. + 3 of each chunk c of 128 (NC chunks: MAXD values). The heads of a block that read one
// key/value head share each tile's loads (GQA: K and V read once a block); a block whose heads span several key/value
// heads walks its keys once for each. Each tile: the logits of its keys (a warp sum a key and head), then one online
// softmax step (its maximum, one correction of the running sums).
template <int MAXD, int MAXPB, int KT, bool VEC, bool ROWS, int NC = (MAXD + 127) / 128>
__device__ __forceinline__ void attention_keys(float (&m)[MAXPB], float (&s)[MAXPB], float (&acc)[MAXPB][NC][4],
                                               const float (&qv)[MAXPB][NC][4], const float* kc, const float* vc,
                                               const float* ktail, i64 h0, i64 group, i64 per_block, i64 hd, i64 vd,
                                               i64 own, i64 tail, i64 kstride, i64 koff, i64 vstride, i64 voff, i64 js,
                                               i64 je, float scale, float softcap, int lane, int warp, i64 nslots,
                                               i64 p0, i64 window) {
    for (i64 hb = 0, he; hb < (ROWS ? nslots : per_block); hb = he) {  // the block's slots hb..he read kv head kvh
        i64 kvh = (h0 + (ROWS ? 0 : hb)) / group;
        he = ROWS ? nslots : min(per_block, (kvh + 1) * group - h0);  // shared rows: one kv head (the check's)
        const float* kb = kc + koff + kvh * own;
        const float* vb = vc + voff + kvh * vd;
        for (i64 j0 = js + (i64)warp * KT; j0 < je; j0 += AW * KT) {
            float kr[KT][NC][4], vr[KT][NC][4];
#pragma unroll
            for (int t = 0; t < KT; t++) {
                i64 j = j0 + t;
                bool in = j < je;  // past the split: zeros, no load (its weight is zero)
#pragma unroll
                for (int c = 0; c < NC; c++) {
                    i64 i = c * 128 + 4 * lane;
                    attn_ld4<VEC>(kr[t][c], kb + j * kstride, ktail + j * tail, own, in ? hd : 0, i);
                    attn_ld4<VEC>(vr[t][c], vb + j * vstride, vb, vd, in ? vd : 0, i);
                }
            }
#pragma unroll
            for (int hh = 0; hh < MAXPB; hh++) {
                if (hh >= hb && hh < he) {
                    // the tile's keys t in [tlo, thi) the slot's row attends (shared rows: each its own position)
                    int ro = ROWS ? hh / (int)per_block : 0, thi = ROWS ? (int)min(je - j0, p0 + ro + 1 - j0) : KT;
                    int tlo = ROWS && window > 0 ? (int)(p0 + ro - window + 1 - j0) : -1;
                    float l[KT], mt = NEG_INF;
#pragma unroll
                    for (int t = 0; t < KT; t++) {
                        float d = 0.f;
#pragma unroll
                        for (int c = 0; c < NC; c++)
#pragma unroll
                            for (int e = 0; e < 4; e++) d += qv[hh][c][e] * kr[t][c][e];
                        l[t] = warp_sum(d) * scale;
                        if (softcap > 0.f) l[t] = softcap * tanhf(l[t] / softcap);
                        if (ROWS ? t >= thi || t < tlo : j0 + t >= je) l[t] = NEG_INF;
                        mt = fmaxf(mt, l[t]);
                    }
                    if (ROWS && mt == NEG_INF) continue;  // a shared row's tile past its position (or its window)
                    float mn = fmaxf(m[hh], mt), corr = expf(m[hh] - mn), sum = 0.f;
#pragma unroll
                    for (int c = 0; c < NC; c++)
#pragma unroll
                        for (int e = 0; e < 4; e++) acc[hh][c][e] *= corr;
#pragma unroll
                    for (int t = 0; t < KT; t++) {
                        float w = expf(l[t] - mn);
                        sum += w;
#pragma unroll
                        for (int c = 0; c < NC; c++)
#pragma unroll
                            for (int e = 0; e < 4; e++) acc[hh][c][e] += w * vr[t][c][e];
                    }
                    s[hh] = s[hh] * corr + sum;
                    m[hh] = mn;
                }
            }
        }
    }
}

// The merge (splits > 1): the last split block of a block's heads to arrive (an arrival counter a row and block of
// heads, which it resets to zero: the arena's counter contract) merges those `cpb` heads' partials, reading them
// through L2, a head to each group of AW / cpb warps (a warp a head at cpb >= AW, heads taken in turn): no block
// barrier until the quantized form. A warp of a head: its lanes read the maxima and sums of CW splits at a time (a
// round: 4 splits a lane), the warp's maximum (the sink in it), each split's weight exp(M_z - M) into the warp's shared
// row, the sum (the sink in the denominator); then the values (the group's warps split them, 32 consecutive a warp a
// step) MV a lane at a time, each value's sum over the splits in the splits' order, MZ splits' loads in flight; the
// output (times act(gate)) and its quantized form, whole blocks of the block's heads. Which block arrives last does
// not change a bit: every partial is read, in the splits' order.
#define CW 128
#define MV 4   // values a lane a pass
#define MZ 12  // splits a round: MZ x MV loads in flight a lane (16: ptxas spills at 168 registers)
// A (row, head, split)'s partial: its maximum at 0, its sum at 1, its vd weighted values from PART_V on, the stride
// vd rounded up to four floats plus PART_V (part_stride): every split's values start 16-byte aligned (the staged
// merge's cp.async; the arena aligns `part` to 256 bytes).
#define PART_V 4
__device__ __forceinline__ i64 part_stride(i64 vd) { return (vd + 3) / 4 * 4 + PART_V; }

// Splits z0..z0+n-1 of a head's partials (pp) into the warp's stage wb: the warp's nvl segments of 32 values each
// (sub's: values sub x 32 + 32 x wph x e ..), a segment 8 chunks of 16 bytes (past vd: fewer bytes, zero-filled),
// segment zz x nvl + e at wb + 32 (zz x nvl + e); one commit group.
__device__ __forceinline__ void merge_issue(float* wb, const float* pp, i64 st, i64 vd, i64 z0, i64 n, i64 nvl,
                                            int sub, int wph, int lane) {
    for (i64 t = lane; t < n * nvl * 8; t += 32) {
        const i64 seg = t >> 3, c = t & 7, zz = seg / nvl, e = seg % nvl, i0 = sub * 32 + 32 * wph * e + 4 * c;
        const i64 bytes = 4 * max((i64)0, min(vd - i0, (i64)4));
        tc_cp16(wb + 32 * seg + 4 * c, bytes ? pp + (z0 + zz) * st + PART_V + i0 : pp, (int)bytes);
    }
    tc_commit();
}

// The staged merge (STAGE > 0 floats of shared memory a warp, the caller's `stage`: chain.cu hands it its GEMV
// phases' staging buffer, idle in an attention block): a warp's value loads go global -> shared by cp.async (no
// register holds them), every split's whole row of the warp's values at once where they fit (STAGE / (32 x values a
// lane) splits a batch: 18 at heads of 128 values, a warp a head), the first batch issued beside the maxima' loads.
// Qwen3-8B's 33 splits: the arrival, the maxima with the first 18 splits' values, the other 15: three dependent L2
// rounds where the register batches of MZ took five. The sums as the register path's: each value's over the splits in
// their order, the same bits.
// wzs: AW x CW floats of shared memory, the body's per-warp sums (wacc) once they are read: the merge runs after the
// block's barrier that follows their last read (one block of shared memory less: the chained kernel's phases together
// stay under the 48 KB a block may hold statically).
template <int STAGE = 0>
__device__ __forceinline__ void attention_merge(const float* part, const float* sinks, float* out, i64 heads, i64 vd,
                                                i64 splits, i64 seq0, i64 r, i64 h0, i64 cpb, const float* gate,
                                                i64 gact, signed char* qw, signed char* ql, float* qscale,
                                                i64 qwords, float* wzs, float* stage = nullptr) {
    float* wz = wzs + (threadIdx.x >> 5) * CW;
    i64 st = part_stride(vd);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int wph = cpb >= AW ? 1 : AW / (int)cpb, ng = AW / wph, sub = warp % wph;  // warps a head, heads at once
    i64 nvl = (vd + 32 * wph - 1) / (32 * wph);  // values a lane
    static_assert(STAGE == 0 || STAGE >= 32 * MV, "a staged batch holds a split's values (nvl <= MV: one pass)");
    float* wb = stage + (STAGE > 0 ? warp * STAGE : 0);
    const i64 nb = STAGE > 0 ? min((i64)CW, (i64)STAGE / (32 * nvl)) : 0;  // splits a staged batch
    for (i64 hh = warp / wph; hh < cpb; hh += ng) {
        i64 h = h0 + hh;
        const float* pp = part + (r * heads + h) * splits * st;
        if constexpr (STAGE > 0) {  // the first batch's values in flight beside the maxima (the warp's stage free)
            __syncwarp();
            merge_issue(wb, pp, st, vd, 0, min(nb, splits), nvl, sub, wph, lane);
        }
        float mv[CW / 32], sv[CW / 32], M = sinks ? sinks[h] : NEG_INF;
#pragma unroll
        for (int u = 0; u < CW / 32; u++) {  // the first CW splits' maxima and sums: one round
            i64 z = u * 32 + lane;
            mv[u] = z < splits ? __ldcg(pp + z * st) : NEG_INF;
            sv[u] = z < splits ? __ldcg(pp + z * st + 1) : 0.f;
            M = fmaxf(M, mv[u]);
        }
        for (i64 z0 = CW; z0 < splits; z0 += CW)
#pragma unroll
            for (int u = 0; u < CW / 32; u++) {
                i64 z = z0 + u * 32 + lane;
                if (z < splits) M = fmaxf(M, __ldcg(pp + z * st));
            }
        M = warp_max(M);
        float S = 0.f;
        for (i64 g = 0; g < nvl; g += MV) {
            float A[MV];
#pragma unroll
            for (int e = 0; e < MV; e++) A[e] = 0.f;
            for (i64 z0 = 0; z0 < splits; z0 += CW) {
                i64 nz = min((i64)CW, splits - z0);
                if (g == 0 || splits > CW) {  // the chunk's weights (a split past every key: weight 0), the sum once
                    __syncwarp();
#pragma unroll
                    for (int u = 0; u < CW / 32; u++) {
                        i64 t = u * 32 + lane;
                        if (t < nz) {
                            float mz = z0 ? __ldcg(pp + (z0 + t) * st) : mv[u];
                            float wt = mz != NEG_INF ? expf(mz - M) : 0.f;
                            wz[t] = wt;
                            if (g == 0 && mz != NEG_INF) S += (z0 ? __ldcg(pp + (z0 + t) * st + 1) : sv[u]) * wt;
                        }
                    }
                    __syncwarp();
                }
                if constexpr (STAGE > 0) {  // the staged batches, each a round (one pass: nvl <= MV)
                    for (i64 zb = 0; zb < nz; zb += nb) {
                        const i64 n = min(nb, nz - zb);
                        if (z0 + zb > 0) {  // (the batch before read by every lane)
                            __syncwarp();
                            merge_issue(wb, pp, st, vd, z0 + zb, n, nvl, sub, wph, lane);
                        }
                        tc_wait_all();
                        __syncwarp();
                        for (i64 zz = 0; zz < n; zz++)
#pragma unroll
                            for (int e = 0; e < MV; e++)
                                if (e < nvl) A[e] += wb[32 * (zz * nvl + e) + lane] * wz[zb + zz];
                    }
                    continue;
                }
                const float* pa = pp + z0 * st + PART_V + sub * 32 + lane;
                for (i64 z = 0; z < nz; z += MZ) {
                    float a[MZ][MV];
#pragma unroll
                    for (int u = 0; u < MZ; u++)
#pragma unroll
                        for (int e = 0; e < MV; e++) {
                            i64 i = sub * 32 + lane + 32 * wph * (g + e);
                            a[u][e] = z + u < nz && g + e < nvl && i < vd ?
                                __ldcg(pa + (z + u) * st + 32 * wph * (g + e)) : 0.f;
                        }
#pragma unroll
                    for (int u = 0; u < MZ; u++)
                        if (z + u < nz)
#pragma unroll
                            for (int e = 0; e < MV; e++) A[e] += a[u][e] * wz[z + u];
                }
            }
            if (g == 0) S = warp_sum(S) + (sinks ? expf(sinks[h] - M) : 0.f);
#pragma unroll
            for (int e = 0; e < MV; e++) {
                i64 i = sub * 32 + lane + 32 * wph * (g + e);
                if (g + e < nvl && i < vd) {  // a warp's 32 values one block of 32 where it quantizes (vd % 32 == 0)
                    i64 o = ((seq0 + r) * heads + h) * vd + i;
                    float y = gate ? A[e] / S * act_apply((int)gact, gate[o]) : A[e] / S;
                    if (out) out[o] = y;
                    else quant_block(y, qw, ql, qscale, o >> 5, lane);  // the quantized form alone
                }
            }
        }
    }
    if (qw && out) {  // heads h0.. of row seq0 + r, cpb * vd values: whole blocks
        __syncthreads();
        if (qwords == 3) {
            i64 b0 = ((seq0 + r) * heads + h0) * vd >> 8;
            for (i64 b = warp; b < cpb * vd >> 8; b += AW) quant_k_block(out, qw, (short*)ql, qscale, b0 + b, lane);
        } else {
            i64 b0 = ((seq0 + r) * heads + h0) * vd >> 5;
            for (i64 b = warp; b < cpb * vd >> 5; b += AW)
                quant_block(__ldcg(out + (b0 + b) * 32 + lane), qw, ql, qscale, b0 + b, lane);
        }
    }
}

// The work of block (bx, by, bz) of a grid gx blocks wide (the arrival counter of its heads: by * gx + bx): the
// standalone kernels pass their blockIdx and gridDim.x; a chain (chain.cu fold_attn_o_glu_down) its ticket's place,
// and its staging buffer as the merge's `stage` (STAGE floats a warp).
template <int MAXD, int MAXPB, int KT, bool ROWS, int STAGE = 0>
__device__ __forceinline__ void attention_body(
    const float* q, const float* kc, const float* vc, const int* posp, const float* sinks, float* out, float* part,
    i64 heads, i64 group, i64 hd, i64 vd, i64 window, i64 per_block, i64 splits, i64 kstride, i64 koff, i64 vstride,
    i64 voff, float scale, float softcap, i64 slot, i64 seq0, const float* gate, i64 gact, signed char* qw,
    signed char* ql, float* qscale, const float* qtail, const float* ktail, i64 tail, i64 qwords, unsigned* counters,
    i64 rows, i64 shared, i64 bx, i64 by, i64 bz, i64 gx, float* stage = nullptr) {
    constexpr int NC = (MAXD + 127) / 128;
    __shared__ float qs[MAXPB][MAXD];
    __shared__ float wm[AW][MAXPB], wsum[AW][MAXPB];
    __shared__ float wacc[AW][MAXPB][MAXD];  // the merge's weights too, once read (attention_merge's wzs)
    static_assert(MAXPB * MAXD >= CW, "the merge's weights fit the per-warp sums' shared memory");
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // shared rows (`shared` > 1): the block's slots are rows ry.. (up to `shared` of them) times its heads, slot s
    // row ry + s / per_block, head h0 + s % per_block; each tile of keys and values loaded once for all of them
    i64 h0 = bx * per_block, ry = by * (ROWS ? shared : 1), r = seq0 + ry, z = bz;
    i64 nslots = ROWS ? min(shared, rows - ry) * per_block : per_block, nrows = ROWS ? nslots / per_block : 1;
    if (slot > 0) {
        kc += r * slot * kstride;
        vc += r * slot * vstride;
        if (ktail) ktail += r * slot * tail;
    }
    i64 own = hd - tail;
    for (i64 i = threadIdx.x; i < nslots * hd; i += blockDim.x) {
        i64 sl = i / hd, u = (r + (ROWS ? sl / per_block : 0)) * heads + h0 + (ROWS ? sl % per_block : sl), c = i % hd;
        qs[sl][c] = c < own ? q[u * own + c] : qtail[u * tail + c - own];
    }
    __syncthreads();
    i64 p = slot > 0 ? (i64)posp[r] : (posp ? (i64)posp[0] : 0) + r;  // the first row's (a slot's: p + its row)
    i64 lo = window > 0 ? max((i64)0, p - window + 1) : 0;
    i64 cnt = p + nrows - lo, chunk = (cnt + splits - 1) / splits;  // the rows' keys, split
    i64 js = lo + z * chunk, je = min(p + nrows, js + chunk);
    bool vec = ((kstride | koff | own | vstride | voff | vd | tail) & 3) == 0 &&
               (((unsigned long long)kc | (unsigned long long)vc | (unsigned long long)ktail) & 15) == 0;
    float m[MAXPB], s[MAXPB], acc[MAXPB][NC][4], qv[MAXPB][NC][4];
#pragma unroll
    for (int hh = 0; hh < MAXPB; hh++) {
        m[hh] = NEG_INF;
        s[hh] = 0.f;
#pragma unroll
        for (int c = 0; c < NC; c++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                i64 i = c * 128 + 4 * lane + e;
                acc[hh][c][e] = 0.f;
                qv[hh][c][e] = hh < nslots && i < hd ? qs[hh][i] : 0.f;
            }
    }
    if (vec)
        attention_keys<MAXD, MAXPB, KT, true, ROWS>(m, s, acc, qv, kc, vc, ktail, h0, group, per_block, hd, vd, own,
                                                    tail, kstride, koff, vstride, voff, js, je, scale, softcap, lane,
                                                    warp, nslots, p, window);
    else  // rows at any offset: four loads a lane a row, half the keys a tile
        attention_keys<MAXD, MAXPB, (KT > 1 ? KT / 2 : 1), false, ROWS>(m, s, acc, qv, kc, vc, ktail, h0, group,
                                                                        per_block, hd, vd, own, tail, kstride, koff,
                                                                        vstride, voff, js, je, scale, softcap, lane,
                                                                        warp, nslots, p, window);
#pragma unroll
    for (int hh = 0; hh < MAXPB; hh++) {
        if (hh < nslots) {
            if (lane == 0) {
                wm[warp][hh] = m[hh];
                wsum[warp][hh] = s[hh];
            }
#pragma unroll
            for (int c = 0; c < NC; c++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    i64 i = c * 128 + 4 * lane + e;
                    if (i < vd) wacc[warp][hh][i] = acc[hh][c][e];
                }
        }
    }
    __syncthreads();
    for (i64 e = threadIdx.x; e < nslots * vd; e += blockDim.x) {
        int hh = (int)(e / vd);
        i64 i = e % vd, h = h0 + (ROWS ? hh % per_block : hh), rr = ry + (ROWS ? hh / per_block : 0), rs = seq0 + rr;
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
            i64 o = (rs * heads + h) * vd + i;
            float y = gate ? A / S * act_apply((int)gact, gate[o]) : A / S;
            if (out) out[o] = y;
            else quant_block(y, qw, ql, qscale, o >> 5, lane);  // the quantized form alone: a warp's 32 one block
        } else {
            float* pp = part + ((rr * heads + h) * splits + z) * part_stride(vd);
            if (i == 0) {
                pp[0] = M;
                pp[1] = S;
            }
            pp[PART_V + i] = A;
        }
    }
    if (splits > 1) {  // the last split of these heads to arrive merges their partials (its counter back to zero)
        __shared__ int last;
        unsigned* c = counters + by * gx + bx;
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) last = atomicAdd(c, 1u) == (unsigned)splits - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();
        if (ROWS)  // the block's rows, one after another
            for (i64 rr = ry; rr < ry + nrows; rr++)
                attention_merge<STAGE>(part, sinks, out, heads, vd, splits, seq0, rr, h0, per_block, gate, gact, qw,
                                       ql, qscale, qwords, &wacc[0][0][0], stage);
        else
            attention_merge<STAGE>(part, sinks, out, heads, vd, splits, seq0, ry, h0, per_block, gate, gact, qw, ql,
                                   qscale, qwords, &wacc[0][0][0], stage);
        if (threadIdx.x == 0) *c = 0u;
        return;
    }
    if (qw && out) {  // the block's heads, per_block * vd values from (r * heads + h0) * vd: whole blocks (each row's)
        __syncthreads();
        if (qwords == 3) {
            i64 b0 = (r * heads + h0) * vd >> 8, nb = per_block * vd >> 8, rb = heads * vd >> 8;
            for (i64 b = warp; b < nb * nrows; b += AW)
                quant_k_block(out, qw, (short*)ql, qscale, b0 + b / nb * rb + b % nb, lane);
        } else {
            i64 b0 = (r * heads + h0) * vd >> 5, nb = per_block * vd >> 5, rb = heads * vd >> 5;
            for (i64 b = warp; b < nb * nrows; b += AW) {
                i64 bb = b0 + b / nb * rb + b % nb;
                quant_block(__ldcg(out + bb * 32 + lane), qw, ql, qscale, bb, lane);
            }
        }
    }
}

#define ATTENTION_KERNEL(NAME, D, PB, KT, ROWS)                                                                       \
    extern "C" __global__ void __launch_bounds__(128, 3) NAME(                                                        \
        const float* q, const float* kc, const float* vc, const int* posp, const float* sinks, float* out,            \
        float* part, i64 heads, i64 group, i64 hd, i64 vd, i64 window, i64 per_block, i64 splits, i64 kstride,        \
        i64 koff, i64 vstride, i64 voff, float scale, float softcap, i64 slot, i64 seq0, const float* gate,           \
        i64 gact, signed char* qw, signed char* ql, float* qscale, const float* qtail, const float* ktail,            \
        i64 tail, i64 qwords, unsigned* counters, i64 rows, i64 shared) { PDL_ENTER();                                \
        attention_body<D, PB, KT, ROWS>(q, kc, vc, posp, sinks, out, part, heads, group, hd, vd, window, per_block,  \
                                        splits, kstride, koff, vstride, voff, scale, softcap, slot, seq0, gate, gact, \
                                        qw, ql, qscale, qtail, ktail, tail, qwords, counters, rows, shared,           \
                                        blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x);                               \
    }
// Keys a warp a tile: KT rows of keys and of values in flight a warp (128-value heads: 8 KB a warp, 32 KB a block).
// Three blocks an SM (at most 168 registers; sm_90: 149-168, no spill): a split grid of 2-3 blocks an SM all resident.
ATTENTION_KERNEL(attention_split_128, 128, 4, 8, false)  // heads up to 128 values (the common head)
ATTENTION_KERNEL(attention_split, 256, 4, 4, false)
ATTENTION_KERNEL(attention_split_wide, 640, 1, 1, false)
ATTENTION_KERNEL(attention_split_narrow, 64, 8, 4, false)  // eight heads of up to 64: the q8k blocks of heads of 32
// Shared rows (a chunk's rows a block, attention.py `shared`): the block's four slots (row, head) of heads up to 128
// values take each tile once, each slot masking the keys past its own row's position (sm_90: 166 registers, no spill;
// eight slots of heads up to 64, as attention_split_narrow, spilled 8 B at 168 with tiles of 4 keys, 12 B with 2)
ATTENTION_KERNEL(attention_rows_128, 128, 4, 8, true)
