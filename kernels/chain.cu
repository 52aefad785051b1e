// Launches in a chain: phases of one launch, each over what the phases before wrote (chain.py). The grid is every
// phase's blocks together; each block takes a TICKET (an atomicAdd on a counter) as it starts, and its ticket, not
// its blockIdx, says which phase and which of that phase's blocks it runs: the first g0 tickets phase 0, the next g1
// phase 1, and so on. A block of a later phase waits (a spin on the arrivals counter, an acquire load and __nanosleep)
// until every block of the phases before has stored its outputs and arrived, and each of their tails has run. It only
// ever waits on blocks that took earlier tickets, and a block that took a ticket is running: no deadlock on any GPU,
// however many blocks are resident, and no cooperative launch. (By blockIdx the same wait could deadlock: nothing runs
// block 0 before block g0.) Before it waits, a block asks L2 for the first bytes of its own weight rows (gemv_prefetch:
// read-only, so reading them early sees no other order; in fold_attn_o_glu_down a phase's rows whole where they fit
// CHAIN_PREFETCH_PHASE, and an attention block its keys and values before the position), so a phase boundary costs a
// poll where the launches paid a launch, and the rows stream while the phase before runs its tail. The ticket is
// taken after PDL_ENTER; before it, under PDL, the first g0 blocks ask L2 for phase 0's rows of their blockIdx (a
// hint: blocks start about in that order).
//
// Memory order. The writer: every thread's stores, __threadfence, the block's barrier, then one atomicAdd on the
// arrivals (fold_tail's arrival). The reader: thread 0 polls the arrivals with ld.acquire.gpu until they reach the
// phase's count, a __threadfence, then the block's barrier; the block's threads then read the earlier phases'
// outputs. The x loads of gemv_tile are plain (ld.global, not ld.global.nc: the chain's PTX was read, nvcc 13 sm_90)
// and no block of this launch reads an earlier phase's outputs before its wait, so no SM holds a stale line of them.
//
// Counters (chain.py's Scratch, zero before the launch): [0] the tickets, [1] the arrivals (each phase's blocks in
// turn; after a middle phase's blocks, one more for its tail: a fold's norm run by that phase's last block to arrive,
// which the next phase reads). The last block of the last phase to arrive (arrivals gridDim.x - 1 plus the middle
// tails) runs the fold's norm over every row and leaves both zero: every block has taken its ticket and none waits any
// more, so a CUDA graph replays the launch as it is.
//
// One generic body over a pack of phases (a ticket's phase found at run time, each phase's code inlined under its
// branch) was tried first: nvcc 13 sm_90 spilled it (fold_glu_down_4 2 B, fold_o_glu_down_4 24 B, both at 168
// registers), so each chain has a body of its own over the shared phase bodies (chain_glu, chain_gemv, norm_row,
// chain_wait).
// The wait (chain_wait, chain_acquire) is prelude.cu's: moe.cu's routed mixture waits the same way.

// gemv_body's and glu_body's work for output block bx: R 0 at one or two rows of x through their AR 1 / 2
// accumulators and at 3..GR (a batch's sequences, a chunk's rows) through the slab's GR at four outputs a warp
// (gemv_slab_cp's ring of f32/f16/bf16 rows: chain.py's check takes no other slab; at one output a warp a slab traps,
// the staged tiles of block rows beside the chain's phases being more than its registers); R 2 one row, else two (as
// before the slab), R GR the slab only, its o and down tails two rows at a time (norm_rows_tail<2>, the folds' own; a
// row at a time in the others): fold_attn_o_glu_down_4 and _slab, the whole module, nvcc 13 sm_90, 168
// registers, no stack, no spill each, where beside its attention and q/k/v phases the three paths in one kernel
// spilled 8 / 8 B, and R 2 trapping past two rows (m == 2 tested) 16 / 104 B. The glu_down and o_glu_down kernels take
// R 0: all three paths, no spill.
template <int PW, int R = 0>
__device__ __forceinline__ void chain_glu(int fmt, const float* x, const void* wg, const void* wu, const float* bg,
                                          const float* bu, float* h, i64 k, i64 f, i64 m, int a, i64 bx) {
    i64 j0 = (bx * WARPS + (threadIdx.x >> 5)) * PW;
    if (j0 >= f) return;
    if constexpr (R == GR) glu_rows<PW, GR>(fmt, x, wg, wu, bg, bu, h, k, f, m, a, j0);
    else if (m == 1) glu_rows<PW, 1>(fmt, x, wg, wu, bg, bu, h, k, f, m, a, j0);
    else if (R == 2 || m == 2) glu_rows<PW, 2>(fmt, x, wg, wu, bg, bu, h, k, f, m, a, j0);
    else if constexpr (PW >= 4) glu_rows<PW, GR>(fmt, x, wg, wu, bg, bu, h, k, f, m, a, j0);
    else __trap();
}

template <int PW, int R = 0>
__device__ __forceinline__ void chain_gemv(int fmt, const float* x, const void* w, const float* bias, const Dst& d,
                                           i64 k, i64 n, i64 m, i64 bx) {
    i64 j0 = (bx * WARPS + (threadIdx.x >> 5)) * PW;
    if (j0 >= n) return;
    if constexpr (R == GR) gemv_rows<PW, GR>(fmt, x, w, bias, d, nullptr, k, n, m, 1, j0, 0.f);
    else if (m == 1) gemv_rows<PW, 1>(fmt, x, w, bias, d, nullptr, k, n, m, 1, j0, 0.f);
    else if (R == 2 || m == 2) gemv_rows<PW, 2>(fmt, x, w, bias, d, nullptr, k, n, m, 1, j0, 0.f);
    else if constexpr (PW >= 4) gemv_rows<PW, GR>(fmt, x, w, bias, d, nullptr, k, n, m, 1, j0, 0.f);
    else __trap();
}

// Before PDL_ENTER (under PDL, while the launch before drains): phase 0's rows of block blockIdx.x into L2, for its
// g0 blocks (w2: the GLU's up rows, or null). A hint only (the weights are read-only; which block runs which rows is
// its ticket's, taken after PDL_ENTER): blocks start about in blockIdx order, so most ask for the rows their ticket
// gives them.
template <int PW>
__device__ __forceinline__ void chain_prefetch(int fmt, const void* w, const void* w2, i64 k, i64 n, i64 g0) {
    if ((i64)blockIdx.x < g0) gemv_prefetch<PW>(fmt, w, w2, k, n, 1, blockIdx.x);
}

// fold_glu_down: phase 1 the gate/up GLU (gemv_glu's product) into h (m x f), phase 2 the down product of h (m x n,
// k = f) through the fold's Dst and then, by its last block, the norm over its rows (fold_gemv_norm's tail). g1: the
// first phase's blocks (gridDim.x = g1 + the second's, one slab of rows). counters[0] the tickets, [1] the arrivals:
// phase 1's blocks arrive uncounted (the wait counts them), phase 2's as fold_tail's do, the last one gated.
template <int PW>
__device__ __forceinline__ void glu_down_body(const float* x, const void* wg, const void* wu, int fmt, const float* bg,
                                              const float* bu, float* h, i64 k, i64 f, int a, const void* wd,
                                              int fmtd, const float* bd, const Dst& y, i64 n, i64 m,
                                              unsigned* counters, i64 g1, i64 rows, const NormArgs& na) {
    __shared__ unsigned ticket;
    __shared__ int last;
    if (threadIdx.x == 0) ticket = atomicAdd(counters, 1u);  // the block's place in the chain (reset by the last)
    __syncthreads();
    const unsigned t = ticket;
    if (t < (unsigned)g1) {  // phase 1: GLU block t
        chain_glu<PW>(fmt, x, wg, wu, bg, bu, h, k, f, m, a, t);
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(counters + 1, 1u);  // an arrival the wait counts (reset by the last)
        return;
    }
    const i64 bx = (i64)t - g1;  // phase 2: down block bx, its rows asked of L2 before the wait
    gemv_prefetch<PW>(fmtd, wd, nullptr, f, n, 1, bx);
    chain_wait(counters + 1, (unsigned)g1);
    chain_gemv<PW>(fmtd, h, wd, bd, y, f, n, m, bx);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counters + 1, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (i64 r = 0; r < rows; r++) norm_row(na, r);
    if (threadIdx.x == 0) {
        counters[0] = 0u;
        counters[1] = 0u;
    }
}

#define FOLD_GLU_DOWN_KERNEL(NAME, PW)                                                                                \
    extern "C" __global__ void GEMV_BOUNDS NAME(const float* x, const void* wg, const void* wu, i64 fmt,              \
                                                const float* bg, const float* bu, float* h, i64 k, i64 f, i64 a,      \
                                                const void* wd, i64 fmtd, const float* bd, DST_PARAMS(y), i64 n,      \
                                                i64 m, unsigned* counters, i64 g1, i64 rows, NORM_PARAMS) {           \
        chain_prefetch<PW>((int)fmt, wg, wu, k, f, g1);                                                              \
        PDL_ENTER();                                                                                                  \
        glu_down_body<PW>(x, wg, wu, (int)fmt, bg, bu, h, k, f, (int)a, wd, (int)fmtd, bd, DST(y), n, m, counters,   \
                          g1, rows, NORM_ARGS);                                                                       \
    }
FOLD_GLU_DOWN_KERNEL(fold_glu_down_1, 1)
FOLD_GLU_DOWN_KERNEL(fold_glu_down_4, 4)

// fold_o_glu_down: a decode layer's o projection, MLP and next norm as three phases. Phase 0 (tickets 0..g0-1) the o
// product of the attention's output z (m x ko, no outputs) into its Dst, then, by its last block to arrive, the
// residual's add and the post-attention norm (fold_gemv_norm's tail, the o_ norm parameters) and the tail's arrival;
// phase 1 (the next g1) the GLU of that norm's output x, each block waiting for g0 + 1 arrivals (the o blocks' and
// the o tail's); phase 2 the down product and the next norm as fold_glu_down's, each block waiting for g0 + 1 + g1.
// Each later block asks L2 for its rows before it waits.
template <int PW>
__device__ __forceinline__ void o_glu_down_body(const float* z, const void* wo, int fmto, const float* bo,
                                                const Dst& o, i64 ko, i64 no, i64 orows, const NormArgs& ona,
                                                const float* x, const void* wg, const void* wu, int fmt,
                                                const float* bg, const float* bu, float* h, i64 k, i64 f, int a,
                                                const void* wd, int fmtd, const float* bd, const Dst& y, i64 n,
                                                i64 m, unsigned* counters, i64 g0, i64 g1, i64 rows,
                                                const NormArgs& na) {
    __shared__ unsigned ticket, prior;
    __shared__ int last;
    if (threadIdx.x == 0) ticket = atomicAdd(counters, 1u);  // the block's place in the chain (reset by the last)
    __syncthreads();
    const unsigned t = ticket;
    if (t < (unsigned)g0) {  // phase 0: o block t, then (its last block to arrive) the o tail and the tail's arrival
        chain_gemv<PW>(fmto, z, wo, bo, o, ko, no, m, t);
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) prior = atomicAdd(counters + 1, 1u);  // an arrival the GLU's wait counts
        __syncthreads();
        if (prior != (unsigned)g0 - 1u) return;
        __threadfence();
        for (i64 r = 0; r < orows; r++) norm_row(ona, r);
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(counters + 1, 1u);  // the o tail's arrival: the GLU reads the norm it wrote
        return;
    }
    if (t < (unsigned)(g0 + g1)) {  // phase 1: GLU block t - g0, after the o phase and its tail
        const i64 bx = (i64)t - g0;
        gemv_prefetch<PW>(fmt, wg, wu, k, f, 1, bx);
        chain_wait(counters + 1, (unsigned)g0 + 1u);
        chain_glu<PW>(fmt, x, wg, wu, bg, bu, h, k, f, m, a, bx);
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(counters + 1, 1u);  // an arrival the down phase's wait counts
        return;
    }
    const i64 bx = (i64)t - g0 - g1;  // phase 2: down block bx
    gemv_prefetch<PW>(fmtd, wd, nullptr, f, n, 1, bx);
    chain_wait(counters + 1, (unsigned)(g0 + 1 + g1));
    chain_gemv<PW>(fmtd, h, wd, bd, y, f, n, m, bx);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counters + 1, 1u) == gridDim.x;  // every block's arrival and the o tail's
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (i64 r = 0; r < rows; r++) norm_row(na, r);
    if (threadIdx.x == 0) {
        counters[0] = 0u;
        counters[1] = 0u;
    }
}

#define FOLD_O_GLU_DOWN_KERNEL(NAME, PW)                                                                              \
    extern "C" __global__ void GEMV_BOUNDS NAME(const float* z, const void* wo, i64 fmto, const float* bo,            \
                                                DST_PARAMS(o), i64 ko, i64 no, i64 orows, NORM_PARAMS_OF(o_),         \
                                                const float* x, const void* wg, const void* wu, i64 fmt,              \
                                                const float* bg, const float* bu, float* h, i64 k, i64 f, i64 a,      \
                                                const void* wd, i64 fmtd, const float* bd, DST_PARAMS(y), i64 n,      \
                                                i64 m, unsigned* counters, i64 g0, i64 g1, i64 rows, NORM_PARAMS) {   \
        chain_prefetch<PW>((int)fmto, wo, nullptr, ko, no, g0);                                                      \
        PDL_ENTER();                                                                                                  \
        o_glu_down_body<PW>(z, wo, (int)fmto, bo, DST(o), ko, no, orows, NORM_ARGS_OF(o_), x, wg, wu, (int)fmt, bg,  \
                            bu, h, k, f, (int)a, wd, (int)fmtd, bd, DST(y), n, m, counters, g0, g1, rows, NORM_ARGS); \
    }
FOLD_O_GLU_DOWN_KERNEL(fold_o_glu_down_1, 1)
FOLD_O_GLU_DOWN_KERNEL(fold_o_glu_down_4, 4)

// A product phase's rows into L2 before its wait (issue 34), bounded by the phase's rows. A phase whose rows (w and w2
// together) fit CHAIN_PREFETCH_PHASE bytes asks for its block's rows whole (prefetch_rows, a GEMV_PREFETCH chunk of
// whole 256-value blocks at a time); a wider one for each row's first GEMV_PREFETCH bytes (gemv_prefetch, as a launch
// asks before PDL_ENTER). A Qwen3-8B layer at 3 blocks a SM (396 slots), PW 4: the o rows (4096 x 4096) are 32 MiB in
// bf16, 17 MiB in q8_0, asked whole; the GLU's gate and up (192 MiB in bf16) and the down's (96 MiB) 4 KB a row. At
// the attention's end the slots hold the 256 o blocks (their 32 MiB) and 140 GLU blocks (16 rows x 2 x 4 KB each,
// 18 MiB): about 50 MiB of lines asked for, beside the attention's 4.2 MB of keys and values at position 512, inside
// the H200's 60 MB L2 (KERNEL-NOTES), and the phases' own weight loads are __ldcs (evict-first), so the stream of the
// phase before is what L2 lets go first. A hint only: the weights are read-only.
#define CHAIN_PREFETCH_PHASE (32ll << 20)
template <int PW>
__device__ __forceinline__ void chain_rows_prefetch(int fmt, const void* w, const void* w2, i64 k, i64 n, i64 bx) {
    const i64 rb = format_bytes(fmt, k), blk = format_bytes(fmt, 256);
    if (rb <= 0 || blk <= 0 || rb * n * (w2 ? 2 : 1) > CHAIN_PREFETCH_PHASE) {
        gemv_prefetch<PW>(fmt, w, w2, k, n, 1, bx);
        return;
    }
    const i64 j0 = (bx * WARPS + (threadIdx.x >> 5)) * PW, step = max((i64)GEMV_PREFETCH / blk, (i64)1) * 256;
    for (i64 k0 = 0; k0 < k; k0 += step) {
        prefetch_rows(fmt, w, k, n, j0, PW, k0, min(k, k0 + step));
        prefetch_rows(fmt, w2, k, n, j0, PW, k0, min(k, k0 + step));
    }
}

// An attention phase's keys and values into L2 before its wait: attention_body's rows for block (bx, by, bz) (ROWS
// false, no tail: its heads' kv heads, row by's position p, split bz's keys), the keys before p only (p's own key and
// value the q/k/v phase writes in this launch; the earlier ones a launch before wrote, whole at PDL_ENTER). A thread a
// row of a kv head, one bulk prefetch of its hd (key) or vd (value) floats. A hint: L2 is where the SMs' loads meet,
// and the attention's own loads come after its wait.
__device__ __forceinline__ void attn_prefetch(const float* kc, const float* vc, const int* posp, i64 heads, i64 group,
                                              i64 hd, i64 vd, i64 window, i64 per_block, i64 splits, i64 kstride,
                                              i64 koff, i64 vstride, i64 voff, i64 slot, i64 seq0, i64 bx, i64 by,
                                              i64 bz) {
    const i64 r = seq0 + by, h0 = bx * per_block;
    if (slot > 0) {
        kc += r * slot * kstride;
        vc += r * slot * vstride;
    }
    const i64 p = slot > 0 ? (i64)posp[r] : (posp ? (i64)posp[0] : 0) + r;
    const i64 lo = window > 0 ? max((i64)0, p - window + 1) : 0, chunk = (p + 1 - lo + splits - 1) / splits;
    const i64 js = lo + bz * chunk, je = min(p, js + chunk), kv0 = h0 / group;
    const i64 nh = (min(h0 + per_block, heads) - 1) / group - kv0 + 1, items = 2 * nh * (je - js);
    for (i64 i = threadIdx.x; i < items; i += blockDim.x) {
        const i64 j = js + i / (2 * nh), h = kv0 + i % (2 * nh) / 2;
        const bool v = i & 1;
        unsigned long long s = (unsigned long long)(v ? vc + voff + h * vd + j * vstride : kc + koff + h * hd +
                                                                                         j * kstride),
                           e = (s + 4 * (v ? vd : hd)) & ~15ull;
        s &= ~15ull;
        if (e > s) PDL_PREFETCH((const void*)s, e - s);
    }
}

// fold_attn_o_glu_down: a decode layer's attention, o projection, MLP and next norm as one launch: fold_o_glu_down's
// three phases after the attention's, and (gq > 0: qkv_attn_o_glu_down_norm) the layer's q/k/v products before the
// attention. Phase Q (tickets 0..gq-1) the products in parts of one activation xq with their heads' epilogue
// (parts_rope.cu: fold_parts_rope's blocks, one slab of rows, a block's part and place found from its ticket in the
// descriptor table tq; the heads' arrival counters head_arrivals): each block stores its outputs (the value rows
// straight into their cache rows), the last block of a head to arrive norms and rotates it (the key rows written into
// their cache rows), then the block arrives. Phase A (the next ga, ga = gx x m x splits) the split attention's blocks
// (attention.cu attention_body of heads up to 128 values, 4 a block, 8 keys a tile: attention_split_128's), block (bx,
// by, bz) of ticket gq + bx + gx (by + m bz), each waiting for the gq arrivals first (a phase counter: q, k and v of
// every head whole, its epilogue's included, since each block arrives after the epilogues it ran); over several splits
// the last split block of a row's heads to arrive merges their partials (its own arrival counter, `arrivals`), so once
// the ga blocks have arrived the output z is whole. Each arrives after its work (a merging block after its merge); it
// asks L2 for its keys and values before the position before it waits (attn_prefetch). The o phase (the next g0)
// asks L2 for its rows (whole where the phase's fit CHAIN_PREFETCH_PHASE: chain_rows_prefetch, as the GLU and the
// down blocks ask for theirs), waits for gq + ga arrivals and runs fold_o_glu_down's phase 0 and tail;
// the GLU waits for gq + ga + g0 + 1, the down phase for gq + ga + g0 + 1 + g1. Without the q/k/v phase (gq 0) the
// attention blocks never wait (they read the caches and q the launch before wrote). The phases' ends are arguments
// (chain.py's ends: gq, ea = gq + ga, eo = ea + g0, eg = eo + g1), not computed here: a kernel parameter stays in the
// constant bank, where a sum computed before the product phases' loops held a register through them (nvcc 13 sm_90: ga
// computed, 20 / 196 B spilled; the ends summed here with gq, the same 20 / 196 B; as arguments, 4 / 4 B).
// The attention phase's merge stages its value loads in the block's GEMV staging buffer (attention.cu
// attention_merge's STAGE: idle in an attention block, which runs no product): a warp's slice, CHAIN_MERGE_STAGE
// floats.
#define CHAIN_MERGE_STAGE 2304
static_assert(CHAIN_MERGE_STAGE == 4 * STAGE_WORDS * 4 && WARPS == AW,
              "the merge's stage is a warp's slice of stage_buffer (4 rows x STAGE_WORDS 16-byte words)");
template <int PW, int R>
__device__ __forceinline__ void attn_o_glu_down_body(
    const float* q, const float* kc, const float* vc, const int* posp, const float* sinks, float* z, float* part,
    i64 heads, i64 group, i64 hd, i64 vd, i64 window, i64 per_block, i64 splits, i64 kstride, i64 koff, i64 vstride,
    i64 voff, float scale, float softcap, i64 slot, i64 seq0, unsigned* arrivals, i64 gx, i64 ea, const void* wo,
    int fmto,
    const float* bo, const Dst& o, i64 ko, i64 no, i64 orows, const NormArgs& ona, const float* x, const void* wg,
    const void* wu, int fmt, const float* bg, const float* bu, float* h, i64 k, i64 f, int a, const void* wd, int fmtd,
    const float* bd, const Dst& y, i64 n, i64 m, unsigned* counters, i64 eo, i64 eg, i64 rows, const NormArgs& na,
    const float* xq, const i64* tq, i64 nparts, int fmtq, i64 kq, unsigned* head_arrivals, const float* cos,
    const float* sin, i64 gq) {
    __shared__ unsigned ticket, prior;
    __shared__ int last;
    if (threadIdx.x == 0) ticket = atomicAdd(counters, 1u);  // the block's place in the chain (reset by the last)
    __syncthreads();
    const unsigned t = ticket;
    if (t < (unsigned)gq) {  // phase Q: q/k/v block t (its part's block bx), its heads' epilogue, then its arrival
        const i64* d = part_of(tq, nparts, t);
        const i64 bx = (i64)t - d[3];
        chain_gemv<PW, R>(fmtq, xq, (const void*)d[0], (const float*)d[1], dst_from(d + 4), kq, d[2], m, bx);
        parts_epilogue<HEAD_VALUES, false, false, true>(d, dst_from(d + 4), d[2], WARPS * PW, bx, m, head_arrivals,
                                                        cos, sin, posp, slot);  // (a head of one chunk: one round)
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(counters + 1, 1u);  // an arrival the attention's wait counts
        return;
    }
    if (t < (unsigned)ea) {  // phase A: attention block (bx, by, bz), then its arrival (a merging block's:
        // merged)
        const unsigned gxu = (unsigned)gx, gxy = gxu * (unsigned)m, ta = t - (unsigned)gq;  // 32-bit divisions
        const i64 bx = ta % gxu, by = ta % gxy / gxu, bz = ta / gxy;
        if (gq) {  // its keys and values before p asked of L2, then q, k and v rotated and in their cache rows
            attn_prefetch(kc, vc, posp, heads, group, hd, vd, window, per_block, splits, kstride, koff, vstride,
                          voff, slot, seq0, bx, by, bz);
            chain_wait(counters + 1, (unsigned)gq);
        }
        attention_body<128, 4, 8, false, CHAIN_MERGE_STAGE>(
            q, kc, vc, posp, sinks, z, part, heads, group, hd, vd, window, per_block, splits, kstride, koff, vstride,
            voff, scale, softcap, slot, seq0, nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0, arrivals,
            m, 1, bx, by, bz, gx, (float*)stage_buffer());
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(counters + 1, 1u);  // an arrival the o phase's wait counts
        return;
    }
    if (t < (unsigned)eo) {  // phase 0: o block t - ea after the attention, then (its last block) the o tail
        const i64 bx = (i64)t - ea;
        chain_rows_prefetch<PW>(fmto, wo, nullptr, ko, no, bx);  // whole rows where the o phase's fit
        chain_wait(counters + 1, (unsigned)ea);
        chain_gemv<PW, R>(fmto, z, wo, bo, o, ko, no, m, bx);
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) prior = atomicAdd(counters + 1, 1u);  // an arrival the GLU's wait counts
        __syncthreads();
        if (prior != (unsigned)eo - 1u) return;
        __threadfence();
        norm_rows_tail<R == GR ? 2 : 1>(ona, orows);  // (the slab's two rows at a time)
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(counters + 1, 1u);  // the o tail's arrival: the GLU reads the norm it wrote
        return;
    }
    if (t < (unsigned)eg) {  // phase 1: GLU block, after the o phase and its tail
        const i64 bx = (i64)t - eo;
        chain_rows_prefetch<PW>(fmt, wg, wu, k, f, bx);
        chain_wait(counters + 1, (unsigned)eo + 1u);
        chain_glu<PW, R>(fmt, x, wg, wu, bg, bu, h, k, f, m, a, bx);
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(counters + 1, 1u);  // an arrival the down phase's wait counts
        return;
    }
    const i64 bx = (i64)t - eg;  // phase 2: down block bx
    chain_rows_prefetch<PW>(fmtd, wd, nullptr, f, n, bx);
    chain_wait(counters + 1, (unsigned)eg + 1u);
    chain_gemv<PW, R>(fmtd, h, wd, bd, y, f, n, m, bx);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counters + 1, 1u) == gridDim.x;  // every block's arrival and the o tail's
    __syncthreads();
    if (!last) return;
    __threadfence();
    norm_rows_tail<R == GR ? 2 : 1>(na, rows);
    if (threadIdx.x == 0) {
        counters[0] = 0u;
        counters[1] = 0u;
    }
}

// Before PDL_ENTER: the q/k/v phase's rows of the blocks whose index is its tickets' (parts_prefetch: the descriptor
// table is uploaded once, never written by a launch) and the o phase's into L2 (a hint, as chain_prefetch); the
// attention's caches are not asked for (this position's key and value are written by the q/k/v phase or the launch
// before).
template <int PW>
__device__ __forceinline__ void chain_prefetch_after(int fmt, const void* w, i64 k, i64 n, i64 ea, i64 eo, int fmtq,
                                                     const i64* tq, i64 nparts, i64 kq, i64 gq) {
    if ((i64)blockIdx.x < gq) parts_prefetch<PW>(fmtq, tq, nparts, kq);
    else if ((i64)blockIdx.x >= ea && (i64)blockIdx.x < eo)
        gemv_prefetch<PW>(fmt, w, nullptr, k, n, 1, (i64)blockIdx.x - ea);
}

#define FOLD_ATTN_O_GLU_DOWN_KERNEL(NAME, PW, R)                                                                      \
    extern "C" __global__ void GEMV_BOUNDS NAME(                                                                      \
        const float* q, const float* kc, const float* vc, const int* posp, const float* sinks, float* z, float* part, \
        i64 aheads, i64 group, i64 hd, i64 vd, i64 window, i64 per_block, i64 splits, i64 kstride, i64 koff,          \
        i64 vstride, i64 voff, float scale, float softcap, i64 slot, i64 seq0, unsigned* arrivals, i64 gx, i64 ea,    \
        const void* wo, i64 fmto, const float* bo, DST_PARAMS(o), i64 ko, i64 no, i64 orows, NORM_PARAMS_OF(o_),      \
        const float* x, const void* wg, const void* wu, i64 fmt, const float* bg, const float* bu, float* h, i64 k,   \
        i64 f, i64 a, const void* wd, i64 fmtd, const float* bd, DST_PARAMS(y), i64 n, i64 m, unsigned* counters,     \
        i64 eo, i64 eg, i64 rows, NORM_PARAMS, const float* xq, const i64* tq, i64 nparts, i64 fmtq, i64 kq,          \
        unsigned* head_arrivals, const float* cos, const float* sin, i64 gq) {                                        \
        chain_prefetch_after<PW>((int)fmto, wo, ko, no, ea, eo, (int)fmtq, tq, nparts, kq, gq);                       \
        PDL_ENTER();                                                                                                  \
        attn_o_glu_down_body<PW, R>(q, kc, vc, posp, sinks, z, part, aheads, group, hd, vd, window, per_block,        \
                                    splits, kstride, koff, vstride, voff, scale, softcap, slot, seq0, arrivals, gx,   \
                                    ea, wo, (int)fmto, bo, DST(o), ko, no, orows, NORM_ARGS_OF(o_), x, wg, wu,        \
                                    (int)fmt, bg, bu, h, k, f, (int)a, wd, (int)fmtd, bd, DST(y), n, m, counters,     \
                                    eo, eg, rows, NORM_ARGS, xq, tq, nparts, (int)fmtq, kq, head_arrivals, cos,       \
                                    sin, gq);                                                                         \
    }
FOLD_ATTN_O_GLU_DOWN_KERNEL(fold_attn_o_glu_down_1, 1, 2)
FOLD_ATTN_O_GLU_DOWN_KERNEL(fold_attn_o_glu_down_4, 4, 2)
FOLD_ATTN_O_GLU_DOWN_KERNEL(fold_attn_o_glu_down_slab, 4, GR)  // 3..GR rows of f32/f16/bf16 rows (chain.py)
