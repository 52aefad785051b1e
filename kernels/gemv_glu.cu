// The gate and up products of one activation and their GLU in one launch: out = act(x·wgᵀ + bg) · (x·wuᵀ + bu),
// the GEMV's warp per output (or four), slabs of GR rows. With `qw` (gemv_gate_up_glu.quant) the GLU's quantized form
// (quant.cu's slab_quant_tail: the last block to store each block of 32 outputs, or of 256 for llama.cpp's q8_K,
// quantizes it in each row of its slab).

// A lane's own output of the warp's PW x AR (lane p·AR + r: output j0 + p, row r0 + r) from sums every lane holds
// (gemv_tile's warp_sum), by selects: no indexed register array (a stack frame).
template <int PW, int AR>
__device__ __forceinline__ float own_sum(const float (&acc)[PW][AR], int lane) {
    float v = 0.f;
#pragma unroll
    for (int p = 0; p < PW; p++)
#pragma unroll
        for (int r = 0; r < AR; r++) v = lane == p * AR + r ? acc[p][r] : v;
    return v;
}

// At one or two rows of x (the chain's too) lane 0 stores the warp's outputs. In a slab (AR = GR) the gate's sums
// are kept one a lane (own_sum) through the up's tile, so its PW x GR accumulators are not live beside the up's loop
// (at four outputs a warp: 32 registers; beside gemv_slab16's ring ptxas spilled them into a 56 B stack at 168
// registers), and each lane stores its own output.
template <int PW, int AR>
__device__ __forceinline__ void glu_rows(int fmt, const float* x, const void* wg, const void* wu, const float* bg,
                                         const float* bu, float* out, i64 k, i64 n, i64 m, int a, i64 j0) {
    i64 r0 = (i64)blockIdx.y * GR;
    if constexpr (AR <= 2) {
        float ga[PW][AR], ua[PW][AR];
        gemv_tile<PW, AR>(fmt, x, wg, k, m, j0, n, r0, 0, k, ga);
        gemv_tile<PW, AR>(fmt, x, wu, k, m, j0, n, r0, 0, k, ua);
        if ((threadIdx.x & 31) != 0) return;
#pragma unroll
        for (int p = 0; p < PW; p++)
#pragma unroll
            for (int r = 0; r < AR; r++) {
                i64 j = j0 + p, row = r0 + r;
                if (j < n && row < m)
                    out[row * n + j] = act_apply(a, ga[p][r] + (bg ? bg[j] : 0.f)) * (ua[p][r] + (bu ? bu[j] : 0.f));
            }
    } else {
        static_assert(PW * AR <= 32, "an output a lane");
        const int lane = threadIdx.x & 31;
        float g;
        {
            float ga[PW][AR];
            gemv_tile<PW, AR>(fmt, x, wg, k, m, j0, n, r0, 0, k, ga);
            g = own_sum<PW, AR>(ga, lane);
        }
        float ua[PW][AR];
        gemv_tile<PW, AR>(fmt, x, wu, k, m, j0, n, r0, 0, k, ua);
        const float u = own_sum<PW, AR>(ua, lane);
        const i64 j = j0 + lane / AR, row = r0 + lane % AR;
        if (lane < PW * AR && j < n && row < m)
            out[row * n + j] = act_apply(a, g + (bg ? bg[j] : 0.f)) * (u + (bu ? bu[j] : 0.f));
    }
}

// Accumulators for one row, two or a slab of GR, as many as the slab holds (gemv_body's choice).
template <int PW>
__device__ __forceinline__ void glu_body(int fmt, const float* x, const void* wg, const void* wu, const float* bg,
                                         const float* bu, float* out, i64 k, i64 n, i64 m, int a) {
    i64 j0 = ((i64)blockIdx.x * WARPS + (threadIdx.x >> 5)) * PW;
    if (j0 >= n) return;
    i64 left = m - (i64)blockIdx.y * GR;
    if (left == 1) glu_rows<PW, 1>(fmt, x, wg, wu, bg, bu, out, k, n, m, a, j0);
    else if (left == 2) glu_rows<PW, 2>(fmt, x, wg, wu, bg, bu, out, k, n, m, a, j0);
    else glu_rows<PW, GR>(fmt, x, wg, wu, bg, bu, out, k, n, m, a, j0);
}

#define GLU_KERNEL(NAME, PW)                                                                                \
    extern "C" __global__ void GEMV_BOUNDS NAME(const float* x, const void* wg, const void* wu,      \
                                                           i64 fmt, const float* bg, const float* bu, float* out, \
                                                           i64 k, i64 n, i64 m, i64 a, unsigned* counters,       \
                                                           signed char* qw, signed char* ql, float* qs,          \
                                                           i64 qwords) {                                          \
        gemv_prefetch<PW>((int)fmt, wg, wu, k, n, 1, blockIdx.x);                                                \
        PDL_ENTER();                                                                                             \
        glu_body<PW>((int)fmt, x, wg, wu, bg, bu, out, k, n, m, (int)a);                                         \
        if (qw) slab_quant_tail(out, n, m, WARPS * PW, GR, counters, qw, ql, qs, qwords);                        \
    }
GLU_KERNEL(gemv_glu_1, 1)
GLU_KERNEL(gemv_glu_4, 4)

// The same over a quantized activation (gemv_q8.cu's tile: a warp an output, both products from the same words),
// the GLU not quantized (gemv_glu_q8_quant below quantizes it).
extern "C" __global__ void __launch_bounds__(128) gemv_glu_q8(const signed char* xw, const signed char* xl,
                                                              const float* xs, const void* wg, const void* wu, i64 fmt,
                                                              const float* bg, const float* bu, float* out, i64 k,
                                                              i64 n, i64 m, i64 a) { PDL_ENTER();
    i64 j = (i64)blockIdx.x * QWARPS + (threadIdx.x >> 5);
    if (j >= n) return;
    i64 r0 = (i64)blockIdx.y * QGR;
    QX x{xw, xl, xs};
    float ga[QGR], ua[QGR];
    q8_tile((int)fmt, x, wg, k, m, j, r0, ga);
    q8_tile((int)fmt, x, wu, k, m, j, r0, ua);
    int nr = (int)min((i64)QGR, m - r0);
    if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int r = 0; r < QGR; r++)  // unrolled, the accumulators stay in registers (indexed by r < nr: a stack frame)
            if (r < nr)
                out[(r0 + r) * n + j] = act_apply((int)a, ga[r] + (bg ? bg[j] : 0.f)) * (ua[r] + (bu ? bu[j] : 0.f));
}

// The same with `qw` (the GLU quantized for the down projection): a block of GLU_QW warps takes QB consecutive
// outputs (QB / GLU_QW a warp, in turn) for a slab of QGR rows, keeps their GLU values in shared memory (and stores
// them to `out` where it is not null: the f32 GLU is read elsewhere too) and quantizes each row's block from there, a
// warp a row: no scratch array, no arrival counter. QB 32: quant.cu's q8_0 blocks (one word, or two: `ql` the low
// words); QB 256: llama.cpp's q8_K (`ql` the int16 sums of 16 words), for a down projection over K-quant rows. n is
// whole blocks of QB (the launch's check).
#define GLU_QW 8
template <int QB>
__device__ __forceinline__ void glu_q8_quant_body(const signed char* xw, const signed char* xl, const float* xs,
                                                  const void* wg, const void* wu, i64 fmt, const float* bg,
                                                  const float* bu, float* out, i64 k, i64 n, i64 m, i64 a,
                                                  signed char* qw, signed char* ql, float* qs) {
    __shared__ float glu[QGR][QB];
    i64 b = blockIdx.x, r0 = (i64)blockIdx.y * QGR, nb = n / QB;
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int nr = (int)min((i64)QGR, m - r0);
    QX x{xw, xl, xs};
    for (int t = 0; t < QB / GLU_QW; t++) {
        int c = w * (QB / GLU_QW) + t;
        i64 j = b * QB + c;
        float ga[QGR], ua[QGR];
        q8_tile((int)fmt, x, wg, k, m, j, r0, ga);
        q8_tile((int)fmt, x, wu, k, m, j, r0, ua);
        if (lane == 0)
            for (int r = 0; r < nr; r++) {
                float v = act_apply((int)a, ga[r] + (bg ? bg[j] : 0.f)) * (ua[r] + (bu ? bu[j] : 0.f));
                glu[r][c] = v;
                if (out) out[(r0 + r) * n + j] = v;
            }
    }
    __syncthreads();
    for (int r = w; r < nr; r += GLU_QW) {
        i64 row = r0 + r;
        if (QB == 256)
            quant_k_vals(glu[r], qw + row * n + b * 256, (short*)ql + row * (n >> 4) + b * 16, qs + row * nb + b, lane);
        else
            quant_block(glu[r][lane], qw + row * n, ql ? ql + row * n : nullptr, qs + row * nb, b, lane);
    }
}

#define GLU_Q8_QUANT_KERNEL(NAME, QB)                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * GLU_QW, 2)                                                  \
        NAME(const signed char* xw, const signed char* xl, const float* xs, const void* wg, const void* wu,     \
             i64 fmt, const float* bg, const float* bu, float* out, i64 k, i64 n, i64 m, i64 a, signed char* qw, \
             signed char* ql, float* qs) { PDL_ENTER();                                                          \
        glu_q8_quant_body<QB>(xw, xl, xs, wg, wu, fmt, bg, bu, out, k, n, m, a, qw, ql, qs);                    \
    }
GLU_Q8_QUANT_KERNEL(gemv_glu_q8_quant, 32)
GLU_Q8_QUANT_KERNEL(gemv_glu_q8k_quant, 256)
