// Expert mixtures (moe.py). Scratch: choices (rows, k) i32, weights (rows, k) f32 then each row's shared-expert
// scale (rows) f32, hidden (rows, k+1, F) f32 — choice c's act(gate)·up of its expert, slot k the shared expert's —
// F = max(f, sf); over sorted rows also parts (rows, k+1, d): each choice's down product before its weight.
// A rank's part of a mixture (moe.py lo, local; expert parallelism): its nl experts lo..lo+nl-1 held (wgu, wd, bgu,
// bd theirs alone), every row routed over all E; `choices` keeps each choice's slot among those held, -1 for another
// rank's expert (which adds nothing); nl = E, lo = 0: the whole mixture.
// Weights are read a value at a time (any width), a warp an output: the experts' gate/up rows in format `fmt`, their
// down rows in `fd` (a llama.cpp Q4_K_M file keeps ffn_down_exps in q6_k beside q4_k gate/up experts); the shared
// expert's rows in `fs`, its gate score row in `fsg` (f32 in a GGUF file, as llama.cpp keeps ffn_gate_inp_shexp). gpt-oss's mixture (act 4, the clamped GLU) also
// reads the experts' biases: gate/up bgu (E·2f) added before the GLU, down bd (E·d) before the weighing; its router
// bias br (E) is added to the logits, and it routes top-k first (`topk_first`: the softmax over the k chosen logits).
// Under the q8 numerics (`qw` int8 words a value, 0: f32) the shared expert's gate and up products (and its gate
// score's, with `qgate`) read the input row quantized as quant.cu quantizes it, into the block's shared memory, and its
// down product its GLU quantized by the up kernel's epilogue into hw/hl/hs; each product gemv_q8.cu's block sums.
#define MOE_WARPS 8
#define MOE_TILE 64
#define MOE_MAXE 4096
#define MOE_MAXK 32
#define MOE_MAXG 64
#define MOE_MAXQ 8192  // a quantized input row in shared memory (moe.py MAX_QUANT_ROW)
#define MOE_CLAMPED 4  // act: gpt-oss's clamped GLU, (min(max(u, -l), l) + 1)·g·sigmoid(alpha·g), g = min(g, l)

#define MOE_COMMON const float *x, i64 rows, i64 d, i64 f, i64 E, i64 k, i64 fmt, i64 fd, i64 act, int *choices, \
    float *weights, float *hidden, const float *bgu, const float *bd, float limit, float alpha, i64 pw, i64 lo, i64 nl
#define MOE_ROUTE const void *wr, i64 fr, i64 norm, const float *br, i64 topk_first, i64 grouped, i64 groups, \
    i64 tgroups, float rscale
#define MOE_ROUTE_ARGS wr, (int)fr, d, E, k, (int)norm, br, (int)topk_first, (int)grouped, groups, tgroups, rscale
#define MOE_SHARED const void *sg, const void *su, const void *sd, const void *sgate, i64 sf, i64 fs, i64 fsg, \
    i64 qw, i64 qgate, signed char *hw, signed char *hl, float *hs
#define MOE_FIN const float *add, float *sum, const float *nw, float eps, DST_PARAMS(out), signed char *yqw, \
    signed char *yql, float *yqs, i64 yqwords

// Global expert e's slot among the nl held from lo, or -1 (another rank's).
__device__ __forceinline__ int moe_slot(int e, i64 lo, i64 nl) { return e >= lo && e < lo + nl ? (int)(e - lo) : -1; }

__device__ __forceinline__ float moe_dot(const float* x, int fm, const void* w, i64 row, i64 n) {
    float s = 0.f;
    for (i64 j = threadIdx.x & 31; j < n; j += 32) s += x[j] * wget(fm, w, row * n + j);
    return warp_sum(s);
}

// PW dots of a warp at once (`per_warp`, moe.py): x (n values) with rows row0 + q·MOE_WARPS of w, q < cnt, every row's
// load of a lane issued before its products; each sum in moe_dot's order (a lane's values, then warp_sum): the same
// bits as PW dots one after another.
template <int PW>
__device__ __forceinline__ void moe_dots(const float* x, int fm, const void* w, i64 row0, i64 cnt, i64 n,
                                         float (&s)[PW]) {
#pragma unroll
    for (int q = 0; q < PW; q++) s[q] = 0.f;
    for (i64 j = threadIdx.x & 31; j < n; j += 32) {
        float xv = x[j], wv[PW];
#pragma unroll
        for (int q = 0; q < PW; q++) wv[q] = q < cnt ? wget(fm, w, (row0 + q * MOE_WARPS) * n + j) : 0.f;
#pragma unroll
        for (int q = 0; q < PW; q++) s[q] += xv * wv[q];
    }
#pragma unroll
    for (int q = 0; q < PW; q++) s[q] = warp_sum(s[q]);
}

// Row xr (d values) quantized into the block's shared memory (quant.cu's quant_block, a warp a block of 32; qw 3: the
// q8k form, quant_k_vals, a warp a block of 256, its sums of 16 words in l): what the shared expert's q8 products
// read. Every thread returns after it.
struct MoeQRow {
    __align__(16) signed char w[MOE_MAXQ];
    __align__(16) signed char l[MOE_MAXQ];
    float s[MOE_MAXQ / 32];
};

__device__ QX moe_quant_row(const float* xr, i64 d, i64 qw, MoeQRow& q) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (qw == 3) {
        for (i64 b = warp; b < d / 256; b += MOE_WARPS)
            quant_k_vals(xr + b * 256, q.w + b * 256, (short*)q.l + b * 16, q.s + b, lane);
    } else {
        for (i64 b = warp; b < d / 32; b += MOE_WARPS)
            quant_block(xr[b * 32 + lane], q.w, qw == 2 ? q.l : nullptr, q.s, b, lane);
    }
    __syncthreads();
    return QX{q.w, qw >= 2 ? q.l : nullptr, q.s};
}

// A shared-expert row format as gemv_q8.cu's q8_tile takes it: flagged (16) where the activation is the q8k form.
__device__ __forceinline__ int moe_qf(i64 fm, i64 qw) { return (int)(qw == 3 ? fm | 16 : fm); }

// One output (row `row` of w) of a quantized activation of n values, a warp: gemv_q8.cu's block sums.
__device__ __forceinline__ float moe_qdot(const QX& x, int fm, const void* w, i64 row, i64 n) {
    float acc[QGR];
    q8_tile(fm, x, w, n, 1, row, 0, acc);
    return acc[0];
}

// The shared expert's GLU values j0.. (a tile of MOE_TILE, whole 32-value blocks) of row r, already in h, quantized
// into hw/hl/hs (a warp a block) for its down product. Called by every thread of the block. (The q8k form's blocks of
// 256 span four tiles: the down kernels quantize the whole GLU row into their own shared memory instead.)
__device__ void moe_quant_glu(const float* h, i64 r, i64 sf, i64 j0, i64 qw, signed char* hw, signed char* hl,
                              float* hs) {
    __syncthreads();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    i64 b = (j0 >> 5) + warp;
    if (warp < MOE_TILE / 32 && b * 32 < sf)
        quant_block(h[b * 32 + lane], hw + r * sf, qw == 2 ? hl + r * sf : nullptr, hs + r * (sf / 32), b, lane);
}

// The shared expert's down product, output i of row r: over its GLU f32, or quantized (`qw`).
__device__ __forceinline__ float moe_shared_down(const float* h, i64 i, i64 sf, int fs, const void* sd, i64 qw,
                                                 const QX& hx) {
    if (!qw) return moe_dot(h, fs, sd, i, sf);
    return moe_qdot(hx, moe_qf(fs, qw), sd, i, sf);
}

// Row r's shared-expert GLU quantized for its down product: in hw/hl/hs (the up kernel's epilogue), or (qw 3) into
// the calling block's shared memory from the GLU row h (every thread calls it).
__device__ __forceinline__ QX moe_shared_glu(const float* h, i64 r, i64 sf, i64 qw, signed char* hw, signed char* hl,
                                             float* hs, MoeQRow& q) {
    if (qw == 3) {
        __syncthreads();  // a row quantized before is read by every warp
        return moe_quant_row(h, sf, 3, q);
    }
    return QX{hw + r * sf, qw == 2 ? hl + r * sf : nullptr, hs + r * (sf / 32)};
}

// Router logits e0..e1-1 of row xr into lg (lane 0 of the warp that sums each; the router bias `br` added where
// given and not grouped): a warp a logit, or (pw 4) four of the warp's at once (moe_dots: the same bits).
__device__ __forceinline__ void moe_logits(const float* xr, const void* wr, int fr, i64 d, i64 e0, i64 e1,
                                           const float* br, int grouped, i64 pw, float* lg) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (pw == 4)
        for (i64 e = e0 + warp; e < e1; e += 4 * MOE_WARPS) {
            i64 cnt = min((i64)4, (e1 - e + MOE_WARPS - 1) / MOE_WARPS);
            float s[4];
            moe_dots<4>(xr, fr, wr, e, cnt, d, s);
#pragma unroll
            for (int q = 0; q < 4; q++) {
                i64 eq = e + q * MOE_WARPS;
                if (q < cnt && lane == 0) lg[eq] = br && !grouped ? s[q] + br[eq] : s[q];
            }
        }
    else
        for (i64 e = e0 + warp; e < e1; e += MOE_WARPS) {
            float s = moe_dot(xr, fr, wr, e, d);
            if (lane == 0) lg[e] = br && !grouped ? s + br[e] : s;
        }
}

// The choice over a row's E logits (in shared memory, `taken` all zero), by thread 0 into ch/wt: the k largest (equal
// logits: the lower expert first), softmax weights, renormalized over the chosen when `norm`; with `topk_first` the
// softmax over the k chosen logits alone. `grouped` (sigmoid_group, DeepSeek-V3): sigmoid scores, `br` (may be null)
// the correction bias added for the choice only, the `tgroups` groups of the largest sum of their two best kept
// (equal sums: the lower group), the k best of those; the chosen scores the weights, renormalized over their sum +
// 1e-20 when `norm`, times `rscale`. The group scores and the chosen weights are indexed by data: in shared memory,
// not a stack frame.
__device__ __forceinline__ void moe_choose(float* logit, unsigned char* taken, i64 E, i64 k, int norm,
                                           const float* br, int topk_first, int grouped, i64 groups, i64 tgroups,
                                           float rscale, int* ch, float* wt) {
    __shared__ float gs[MOE_MAXG], p[MOE_MAXK];
    __shared__ unsigned char keep[MOE_MAXG];
    if (threadIdx.x == 0 && grouped) {
        // logit[e] becomes the sigmoid score; the choice score is score + bias, masked out of the groups not kept
        i64 per = E / groups;
        for (i64 e = 0; e < E; e++) logit[e] = 1.f / (1.f + expf(-logit[e]));
        for (i64 g = 0; g < groups; g++) {
            float b1 = NEG_INF, b2 = NEG_INF;
            for (i64 e = g * per; e < (g + 1) * per; e++) {
                float c = logit[e] + (br ? br[e] : 0.f);
                if (c > b1) { b2 = b1; b1 = c; } else if (c > b2) b2 = c;
            }
            gs[g] = per > 1 ? b1 + b2 : b1;
            keep[g] = 0;
        }
        for (i64 t = 0; t < tgroups; t++) {
            i64 best = -1;
            for (i64 g = 0; g < groups; g++)
                if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
            keep[best] = 1;
        }
        float tot = 0.f;
        for (i64 c = 0; c < k; c++) {
            i64 best = -1;
            float bc = NEG_INF;
            for (i64 e = 0; e < E; e++) {
                if (taken[e] || !keep[e / per]) continue;
                float v = logit[e] + (br ? br[e] : 0.f);
                if (best < 0 || v > bc) { best = e; bc = v; }
            }
            taken[best] = 1;
            ch[c] = (int)best;
            wt[c] = logit[best];
            tot += logit[best];
        }
        for (i64 c = 0; c < k; c++) wt[c] = (norm ? wt[c] / (tot + 1e-20f) : wt[c]) * rscale;
    } else if (threadIdx.x == 0) {
        float m = NEG_INF;
        for (i64 e = 0; e < E; e++) m = fmaxf(m, logit[e]);
        float z = 0.f;
        for (i64 e = 0; e < E; e++) z += expf(logit[e] - m);
        float tot = 0.f;
        for (i64 c = 0; c < k; c++) {
            i64 best = -1;
            for (i64 e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || logit[e] > logit[best])) best = e;
            taken[best] = 1;
            ch[c] = (int)best;
            p[c] = topk_first ? expf(logit[best] - logit[ch[0]]) : expf(logit[best] - m) / z;
            tot += p[c];
        }
        for (i64 c = 0; c < k; c++) wt[c] = norm || topk_first ? p[c] / tot : p[c];
    }
}

// Row r's routing into ch/wt (thread 0 writes): its E logits (moe_logits) in shared memory, then moe_choose. Every
// thread returns after it.
__device__ void moe_route_row(const float* xr, const void* wr, int fr, i64 d, i64 E, i64 k, int norm,
                              const float* br, int topk_first, int grouped, i64 groups, i64 tgroups, float rscale,
                              int* ch, float* wt, i64 pw) {
    __shared__ float logit[MOE_MAXE];
    __shared__ unsigned char taken[MOE_MAXE];
    moe_logits(xr, wr, fr, d, 0, E, br, grouped, pw, logit);
    for (i64 e = threadIdx.x; e < E; e += blockDim.x) taken[e] = 0;
    __syncthreads();
    moe_choose(logit, taken, E, k, norm, br, topk_first, grouped, groups, tgroups, rscale, ch, wt);
    __syncthreads();
}

// One GLU value of gate g and up u: act(g)·u, or gpt-oss's clamped form.
__device__ __forceinline__ float moe_act(int act, float g, float u, float limit, float alpha) {
    if (act != MOE_CLAMPED) return act_apply(act, g) * u;
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
    return (u + 1.f) * g / (1.f + expf(-alpha * g));
}

// Hidden values j0.. of one slot: act(x·gᵀ + bg)·(x·uᵀ + bu), gate row `gr` and up row `ur` of `w` (a warp a value;
// pw 4: four of the warp's values at once, moe_dots), the biases of those rows where `b` is given.
__device__ __forceinline__ void moe_glu(const float* xr, int fm, const void* w, const float* b, i64 gr, i64 ur,
                                        i64 d, i64 j0, i64 n, int act, float limit, float alpha, float* h, i64 pw) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (pw == 4) {
        for (i64 j = j0 + warp; j < j0 + MOE_TILE && j < n; j += 4 * MOE_WARPS) {
            i64 cnt = min((i64)4, (min(j0 + MOE_TILE, n) - j + MOE_WARPS - 1) / MOE_WARPS);
            float g[4], u[4];
            moe_dots<4>(xr, fm, w, gr + j, cnt, d, g);
            moe_dots<4>(xr, fm, w, ur + j, cnt, d, u);
#pragma unroll
            for (int q = 0; q < 4; q++)
                if (q < cnt && lane == 0) {
                    i64 jq = j + q * MOE_WARPS;
                    h[jq] = moe_act(act, b ? g[q] + b[gr + jq] : g[q], b ? u[q] + b[ur + jq] : u[q], limit, alpha);
                }
        }
        return;
    }
    for (i64 j = j0 + warp; j < j0 + MOE_TILE && j < n; j += MOE_WARPS) {
        float g = moe_dot(xr, fm, w, gr + j, d), u = moe_dot(xr, fm, w, ur + j, d);
        if (b) {
            g += b[gr + j];
            u += b[ur + j];
        }
        if (lane == 0) h[j] = moe_act(act, g, u, limit, alpha);
    }
}

// Tile bx of the shared expert's hidden values of row r into its slot (k) of `hidden`, and by tile 0 the row's shared
// scale (the sigmoid of its gate score) into weights[rows·k + r]. Called by every thread of the block.
__device__ __forceinline__ void moe_shared_tile(const float* x, i64 r, i64 bx, i64 rows, i64 d, i64 k, i64 F,
                                                i64 act, float* weights, float* hidden, const void* sg, const void* su,
                                                const void* sgate, i64 sf, i64 fs, i64 fsg, i64 qw, i64 qgate,
                                                signed char* hw, signed char* hl, float* hs) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* xr = x + r * d;
    float* h = hidden + (r * (k + 1) + k) * F;
    __shared__ MoeQRow qrow;
    QX xq = qw ? moe_quant_row(xr, d, qw, qrow) : QX{nullptr, nullptr, nullptr};
    for (i64 j = bx * MOE_TILE + warp; j < (bx + 1) * MOE_TILE && j < sf; j += MOE_WARPS) {
        float g = qw ? moe_qdot(xq, moe_qf(fs, qw), sg, j, d) : moe_dot(xr, (int)fs, sg, j, d);
        float u = qw ? moe_qdot(xq, moe_qf(fs, qw), su, j, d) : moe_dot(xr, (int)fs, su, j, d);
        if (lane == 0) h[j] = act_apply((int)act, g) * u;
    }
    if (bx == 0 && warp == 0) {  // no gate score (DeepSeek's shared experts): unscaled
        float s = !sgate ? 0.f : qw && qgate ? moe_qdot(xq, moe_qf(fsg, qw), sgate, 0, d)
                                             : moe_dot(xr, (int)fsg, sgate, 0, d);
        if (lane == 0) weights[rows * k + r] = sgate ? 1.f / (1.f + expf(-s)) : 1.f;
    }
    if (qw == 1 || qw == 2) moe_quant_glu(h, r, sf, bx * MOE_TILE, qw, hw, hl, hs);
}

#define MOE_SHARED_TILE_ARGS x, r, bx, rows, d, k, F, act, weights, hidden, sg, su, sgate, sf, fs, fsg, qw, qgate, hw, \
    hl, hs

// A row at a time. Grid (tiles of F, k + shared, rows): every block routes its row (the same sums, the same
// choices), block (0, 0) keeps them for moe_down; block (x, c) computes its tile of slot c's hidden values.
extern "C" __global__ void __launch_bounds__(256)
    moe_up(MOE_COMMON, MOE_ROUTE, const void* wgu, MOE_SHARED) { PDL_ENTER();
    i64 r = blockIdx.z, c = blockIdx.y, bx = blockIdx.x, F = f > sf ? f : sf;
    if (c == k) {  // the shared expert; block 0 also its gate score
        moe_shared_tile(MOE_SHARED_TILE_ARGS);
        return;
    }
    const float* xr = x + r * d;
    __shared__ int ch[MOE_MAXK];
    __shared__ float wt[MOE_MAXK];
    moe_route_row(xr, MOE_ROUTE_ARGS, ch, wt, pw);
    if (bx == 0 && c == 0 && threadIdx.x < k) {
        choices[r * k + threadIdx.x] = moe_slot(ch[threadIdx.x], lo, nl);
        weights[r * k + threadIdx.x] = wt[threadIdx.x];
    }
    i64 e = ch[c] - lo;  // its slot among the experts held; another rank's: nothing to compute
    if (e < 0 || e >= nl) return;
    moe_glu(xr, (int)fmt, wgu, bgu, e * 2 * f, e * 2 * f + f, d, bx * MOE_TILE, f, (int)act, limit, alpha,
            hidden + (r * (k + 1) + c) * F, pw);
}

// Phase 0 of moe_up_split: block `part` of row r's rs router blocks, its logits part·per.. (per = ceil(E / rs)) into
// `logits` (rows, E), then an arrival on the row's counter counters[2 + r]; the last of the rs to arrive reads the
// row's E logits back, chooses (moe_choose: the sums and choices of moe_route_row), writes choices/weights, sets the
// row's counter back to zero and its flag counters[2 + rows + r] to 1 (after a fence: what the row's choice blocks
// wait for; the launch's last block sets it back to zero).
__device__ __forceinline__ void moe_router_part(const float* xr, const void* wr, int fr, i64 d, i64 E, i64 k, int norm,
                                                const float* br, int topk_first, int grouped, i64 groups,
                                                i64 tgroups, float rscale, i64 r, i64 part, i64 rs, i64 rows, i64 pw,
                                                i64 lo, i64 nl, float* logits, unsigned* counters, int* choices,
                                                float* weights) {
    i64 per = (E + rs - 1) / rs, e0 = part * per;
    moe_logits(xr, wr, fr, d, e0, min(E, e0 + per), br, grouped, pw, logits + r * E);
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counters + 2 + r, 1u) == (unsigned)rs - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    __shared__ float logit[MOE_MAXE];
    __shared__ unsigned char taken[MOE_MAXE];
    __shared__ int ch[MOE_MAXK];
    __shared__ float wt[MOE_MAXK];
    for (i64 e = threadIdx.x; e < E; e += blockDim.x) {
        logit[e] = __ldcg(logits + r * E + e);
        taken[e] = 0;
    }
    __syncthreads();
    moe_choose(logit, taken, E, k, norm, br, topk_first, grouped, groups, tgroups, rscale, ch, wt);
    __syncthreads();
    if (threadIdx.x < k) {
        choices[r * k + threadIdx.x] = moe_slot(ch[threadIdx.x], lo, nl);
        weights[r * k + threadIdx.x] = wt[threadIdx.x];
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        counters[2 + r] = 0u;  // every router block of the row has arrived: none touches it again this launch
        *(volatile unsigned*)(counters + 2 + rows + r) = 1u;  // the row routed (its stores fenced before)
    }
}

// A row at a time, the routing as phase 0 of the launch (`router_split` rs > 1, moe.py): each row's router logits and
// its choice computed once, where moe_up's every block computes them all. Grid (rows·rs + rows·tiles·(k + shared)),
// a block's work its TICKET's (counters[0], an atomicAdd as it starts; chain.cu's order): tickets 0..rows·rs-1 the
// router blocks (moe_router_part, rs a row); then the shared expert's tiles (no wait); then each choice's tiles, row by
// row, each waiting (chain_wait) until its row's flag counters[2 + rows + r] is set (its choice written) and reading
// its expert from `choices`. A block waits only on blocks that took earlier tickets, which are running: no
// co-residency needed. Every block past phase 0 arrives at counters[1]; the last to arrive leaves every counter zero
// (none waits any more: a CUDA graph replays the launch as it is). Bounds (256, 1): at (256) ptxas gave it 80
// registers and a 68 B spill; at (256, 1) 96 and none (nvcc 13, sm_90).
extern "C" __global__ void __launch_bounds__(256, 1)
    moe_up_split(MOE_COMMON, MOE_ROUTE, const void* wgu, MOE_SHARED, float* logits, unsigned* counters, i64 rs) {
    PDL_ENTER();
    __shared__ unsigned ticket;
    __shared__ int last;
    if (threadIdx.x == 0) ticket = atomicAdd(counters, 1u);  // the block's place in the launch (reset by the last)
    __syncthreads();
    const i64 t = ticket, routers = rows * rs;
    if (t < routers) {  // phase 0: router block t % rs of row t / rs
        i64 r = t / rs;
        moe_router_part(x + r * d, wr, (int)fr, d, E, k, (int)norm, br, (int)topk_first, (int)grouped, groups,
                        tgroups, rscale, r, t % rs, rs, rows, pw, lo, nl, logits, counters, choices, weights);
        return;
    }
    i64 F = f > sf ? f : sf, tiles = (F + MOE_TILE - 1) / MOE_TILE, u = t - routers;
    i64 slot = u / (rows * tiles), r = u / tiles % rows, bx = u % tiles;
    i64 c = sg ? (slot == 0 ? k : slot - 1) : slot;  // the shared expert's tiles first: they wait on nothing
    if (c == k) {
        moe_shared_tile(MOE_SHARED_TILE_ARGS);
    } else {
        chain_wait(counters + 2 + rows + r, 1u);
        int e = __ldcg(choices + r * k + c);  // its slot among the experts held; another rank's (-1): nothing
        if (e >= 0)
            moe_glu(x + r * d, (int)fmt, wgu, bgu, e * 2 * f, e * 2 * f + f, d, bx * MOE_TILE, f, (int)act, limit,
                    alpha, hidden + (r * (k + 1) + c) * F, pw);
    }
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counters + 1, 1u) == gridDim.x - (unsigned)routers - 1;
    __syncthreads();
    if (!last) return;
    if (threadIdx.x == 0) {
        counters[0] = 0u;
        counters[1] = 0u;
        for (i64 q = 0; q < rows; q++) counters[2 + rows + q] = 0u;  // the rows' flags (their arrivals are zero)
    }
}

// The mixture's value i of row r: its choices' down products (plus their biases `bd` where given) weighed in choice
// order, then the shared expert's.
__device__ __forceinline__ float moe_value(i64 r, i64 i, i64 d, i64 f, i64 k, i64 fd, const int* choices,
                                           const float* weights, const float* hidden, const void* wd, const float* bd,
                                           const void* sd, i64 sf, i64 fs, i64 rows, i64 qw, const QX& hx) {
    i64 F = f > sf ? f : sf;
    float acc = 0.f;
    for (i64 c = 0; c < k; c++) {
        i64 e = choices[r * k + c];
        if (e < 0) continue;  // another rank's expert
        float v = moe_dot(hidden + (r * (k + 1) + c) * F, (int)fd, wd, e * d + i, f);
        acc += weights[r * k + c] * (bd ? v + bd[e * d + i] : v);
    }
    if (sd) acc += weights[rows * k + r] * moe_shared_down(hidden + (r * (k + 1) + k) * F, i, sf, (int)fs, sd, qw, hx);
    return acc;
}

// Values i + q·MOE_WARPS (q < cnt) of row r at once (pw 4): each as moe_value sums it, its choices' down products
// four rows at a time (moe_dots: the same bits).
__device__ __forceinline__ void moe_values4(i64 r, i64 i, i64 cnt, i64 d, i64 f, i64 k, i64 fd, const int* choices,
                                            const float* weights, const float* hidden, const void* wd, const float* bd,
                                            const void* sd, i64 sf, i64 fs, i64 rows, i64 qw, const QX& hx,
                                            float (&acc)[4]) {
    i64 F = f > sf ? f : sf;
#pragma unroll
    for (int q = 0; q < 4; q++) acc[q] = 0.f;
    for (i64 c = 0; c < k; c++) {
        i64 e = choices[r * k + c];
        if (e < 0) continue;  // another rank's expert
        float v[4], wc = weights[r * k + c];
        moe_dots<4>(hidden + (r * (k + 1) + c) * F, (int)fd, wd, e * d + i, cnt, f, v);
#pragma unroll
        for (int q = 0; q < 4; q++) acc[q] += wc * (bd ? v[q] + bd[e * d + i + q * MOE_WARPS] : v[q]);
    }
    if (sd)
#pragma unroll
        for (int q = 0; q < 4; q++)
            if (q < cnt)
                acc[q] += weights[rows * k + r] *
                          moe_shared_down(hidden + (r * (k + 1) + k) * F, i + q * MOE_WARPS, sf, (int)fs, sd, qw, hx);
}

// Row r's finalize over its sums (already in `sum`): the RMS norm times nw into out, by the calling block; where yqw
// is given, the normed row's quantized form too (a warp a block of 32, from the values just stored: quant.cu; with
// yqwords 3 the q8k form, llama.cpp's q8_K, a warp a block of 256 read back from the row stored whole in its buffer,
// quant.cu's quant_k_block, its sums of 16 words in yql).
__device__ void moe_norm_row(i64 r, i64 d, const float* sum, const float* nw, float eps, const Dst& o,
                             signed char* yqw, signed char* yql, float* yqs, i64 yqwords) {
    float ss = 0.f;
    for (i64 i = threadIdx.x; i < d; i += blockDim.x) {
        float v = __ldcg(sum + r * d + i);
        ss += v * v;
    }
    float inv = rsqrtf(block_sum(ss) / (float)d + eps);
    for (i64 i = threadIdx.x; i < d; i += blockDim.x) o.y[dst_at(o, r * d + i)] = __ldcg(sum + r * d + i) * inv * nw[i];
    if (!yqw) return;
    __syncthreads();
    int lane = threadIdx.x & 31;
    if (yqwords == 3) {
        for (i64 b = threadIdx.x >> 5; b < (d >> 8); b += blockDim.x >> 5)
            quant_k_block(o.y + r * d, yqw + r * d, (short*)yql + r * (d >> 4), yqs + r * (d >> 8), b, lane);
        return;
    }
    for (i64 b = threadIdx.x >> 5; b < (d >> 5); b += blockDim.x >> 5)
        quant_block(__ldcg(o.y + dst_at(o, r * d + b * 32 + lane)), yqw + r * d, yql ? yql + r * d : nullptr,
                    yqs + r * (d >> 5), b, lane);
}

// Grid (tiles of d, rows): a warp an output, the residual `add` added where given; with nw, the sum written and the
// last block of the row to arrive (a counter a row, reset by it) norms the row.
extern "C" __global__ void __launch_bounds__(256)
    moe_down(MOE_COMMON, const void* wd, MOE_SHARED, unsigned* arrivals, MOE_FIN) { PDL_ENTER();
    i64 r = blockIdx.y, F = f > sf ? f : sf;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    Dst o = DST(out);
    __shared__ MoeQRow hq;
    QX hx = sd && qw ? moe_shared_glu(hidden + (r * (k + 1) + k) * F, r, sf, qw, hw, hl, hs, hq)
                     : QX{nullptr, nullptr, nullptr};
    i64 end = min((i64)(blockIdx.x + 1) * MOE_TILE, d);
    if (pw == 4)  // four of the warp's values at once
        for (i64 i = blockIdx.x * MOE_TILE + warp; i < end; i += 4 * MOE_WARPS) {
            i64 cnt = min((i64)4, (end - i + MOE_WARPS - 1) / MOE_WARPS);
            float v[4];
            moe_values4(r, i, cnt, d, f, k, fd, choices, weights, hidden, wd, bd, sd, sf, fs, rows, qw, hx, v);
#pragma unroll
            for (int q = 0; q < 4; q++) {
                i64 iq = i + q * MOE_WARPS;
                if (q >= cnt || lane != 0) continue;
                float y = add ? v[q] + add[r * d + iq] : v[q];
                if (nw) sum[r * d + iq] = y;
                else o.y[dst_at(o, r * d + iq)] = y;
            }
        }
    else
        for (i64 i = blockIdx.x * MOE_TILE + warp; i < end; i += MOE_WARPS) {
            float v = moe_value(r, i, d, f, k, fd, choices, weights, hidden, wd, bd, sd, sf, fs, rows, qw, hx);
            if (lane != 0) continue;
            if (add) v += add[r * d + i];
            if (nw) sum[r * d + i] = v;
            else o.y[dst_at(o, r * d + i)] = v;
        }
    if (!nw) return;
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(arrivals + r, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    moe_norm_row(r, d, sum, nw, eps, o, yqw, yql, yqs, yqwords);
    if (threadIdx.x == 0) arrivals[r] = 0u;
}

// Sorted rows. Grid (rows): each row routed, its shared-expert scale taken. Bounds (256, 1): once the top-k's arrays
// left its stack, ptxas gave it 64 registers and a 24 B spill at (256); at (256, 1) 103 and none (nvcc 13, sm_90).
extern "C" __global__ void __launch_bounds__(256, 1) moe_route(MOE_COMMON, MOE_ROUTE, MOE_SHARED) { PDL_ENTER();
    i64 r = blockIdx.x;
    __shared__ int ch[MOE_MAXK];
    __shared__ float wt[MOE_MAXK];
    moe_route_row(x + r * d, MOE_ROUTE_ARGS, ch, wt, 1);
    if (threadIdx.x < k) {
        choices[r * k + threadIdx.x] = moe_slot(ch[threadIdx.x], lo, nl);
        weights[r * k + threadIdx.x] = wt[threadIdx.x];
    }
    __shared__ MoeQRow qrow;
    QX xq = sg && qw && qgate && sgate ? moe_quant_row(x + r * d, d, qw, qrow) : QX{nullptr, nullptr, nullptr};
    if (sg && threadIdx.x < 32) {  // no gate score (DeepSeek's shared experts): unscaled
        float s = !sgate ? 0.f : xq.w ? moe_qdot(xq, moe_qf(fsg, qw), sgate, 0, d)
                                      : moe_dot(x + r * d, (int)fsg, sgate, 0, d);
        if (threadIdx.x == 0) weights[rows * k + r] = sgate ? 1.f / (1.f + expf(-s)) : 1.f;
    }
}

// Grid (tiles of F, nl + shared): block (x, e) computes its tile of the hidden values of every (row, choice) that
// chose expert e, its weight rows read once for the chunk (they stay in L1/L2 across the rows); slot nl the shared
// expert over every row.
extern "C" __global__ void __launch_bounds__(256) moe_up_sorted(MOE_COMMON, const void* wgu, MOE_SHARED) { PDL_ENTER();
    i64 e = blockIdx.y, F = f > sf ? f : sf, j0 = blockIdx.x * MOE_TILE;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __shared__ MoeQRow qrow;
    for (i64 r = 0; r < rows; r++) {
        const float* xr = x + r * d;
        if (e == nl) {
            __syncthreads();  // the previous row's quantized input read by every warp
            QX xq = qw ? moe_quant_row(xr, d, qw, qrow) : QX{nullptr, nullptr, nullptr};
            float* h = hidden + (r * (k + 1) + k) * F;
            for (i64 j = j0 + warp; j < j0 + MOE_TILE && j < sf; j += MOE_WARPS) {
                float g = qw ? moe_qdot(xq, moe_qf(fs, qw), sg, j, d) : moe_dot(xr, (int)fs, sg, j, d);
                float u = qw ? moe_qdot(xq, moe_qf(fs, qw), su, j, d) : moe_dot(xr, (int)fs, su, j, d);
                if (lane == 0) h[j] = act_apply((int)act, g) * u;
            }
            if (qw == 1 || qw == 2) moe_quant_glu(h, r, sf, j0, qw, hw, hl, hs);
            continue;
        }
        for (i64 c = 0; c < k; c++)
            if (choices[r * k + c] == e)
                moe_glu(xr, (int)fmt, wgu, bgu, e * 2 * f, e * 2 * f + f, d, j0, f, (int)act, limit, alpha,
                        hidden + (r * (k + 1) + c) * F, 1);  // a value a warp: four spilled at 80 registers
    }
}

// Grid (tiles of d, nl + shared): block (x, e) the down products of expert e's (row, choice) slots into parts.
extern "C" __global__ void __launch_bounds__(256)
    moe_down_sorted(MOE_COMMON, const void* wd, MOE_SHARED, float* parts) { PDL_ENTER();
    i64 e = blockIdx.y, F = f > sf ? f : sf, i0 = blockIdx.x * MOE_TILE;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __shared__ MoeQRow hq;
    for (i64 r = 0; r < rows; r++)
        for (i64 c = 0; c <= k; c++) {
            bool mine = c < k ? choices[r * k + c] == e : e == nl;
            if (!mine) continue;
            const float* h = hidden + (r * (k + 1) + c) * F;
            // the shared slot (the block's y is E: every thread of the block here alike)
            QX hx = c == k && qw ? moe_shared_glu(h, r, sf, qw, hw, hl, hs, hq) : QX{nullptr, nullptr, nullptr};
            for (i64 i = i0 + warp; i < i0 + MOE_TILE && i < d; i += MOE_WARPS) {
                float v = c < k ? moe_dot(h, (int)fd, wd, e * d + i, f)
                                : moe_shared_down(h, i, sf, (int)fs, sd, qw, hx);
                if (lane == 0) parts[(r * (k + 1) + c) * d + i] = c < k && bd ? v + bd[e * d + i] : v;
            }
        }
}

// Grid (rows): the weighed sum in choice order, the shared expert's scaled part, the residual, then the finalize.
extern "C" __global__ void __launch_bounds__(256) moe_finish(MOE_COMMON, MOE_SHARED, const float* parts, MOE_FIN) {
    PDL_ENTER();
    i64 r = blockIdx.x;
    Dst o = DST(out);
    for (i64 i = threadIdx.x; i < d; i += blockDim.x) {
        float v = 0.f;
        for (i64 c = 0; c < k; c++)  // the choices of another rank's experts have no part here
            if (choices[r * k + c] >= 0) v += weights[r * k + c] * parts[(r * (k + 1) + c) * d + i];
        if (sd) v += weights[rows * k + r] * parts[(r * (k + 1) + k) * d + i];
        if (add) v += add[r * d + i];
        if (nw) sum[r * d + i] = v;
        else o.y[dst_at(o, r * d + i)] = v;
    }
    if (!nw) return;
    __syncthreads();
    moe_norm_row(r, d, sum, nw, eps, o, yqw, yql, yqs, yqwords);
}
