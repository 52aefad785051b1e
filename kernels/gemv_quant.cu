// A GEMV quantizing its output (gemv_quant: a product another projection reads quantized): gemv_core.cu's body (or
// gemv_q8.cu's over a quantized activation) storing y (its own buffer), then quant.cu's slab_quant_tail: the last block
// to store each block of 32 outputs (256: llama.cpp's q8_K) of a slab's rows quantizes them from the values stored.
// The bodies return from themselves only, so every thread reaches the tail's barriers.
#define GEMV_QUANT_KERNEL(NAME, PW)                                                                                  \
    extern "C" __global__ void GEMV_BOUNDS NAME(const float* x, const void* w, i64 fmt, const float* bias, \
                                                           float* y, i64 k, i64 n, i64 m, float cap,                 \
                                                           unsigned* counters, signed char* qw, signed char* ql,     \
                                                           float* qs, i64 qwords) { PDL_ENTER();                     \
        gemv_body<PW>((int)fmt, x, w, bias, Dst{y, nullptr, 0, 0, 0, 0, 0}, nullptr, k, n, m, 1, blockIdx.x, cap);  \
        slab_quant_tail(y, n, m, WARPS * PW, GR, counters, qw, ql, qs, qwords);                                     \
    }
GEMV_QUANT_KERNEL(gemv_quant_1, 1)
GEMV_QUANT_KERNEL(gemv_quant_4, 4)

extern "C" __global__ void __launch_bounds__(128) gemv_q8_quant(const signed char* xw, const signed char* xl,
                                                                const float* xs, const void* w, i64 fmt,
                                                                const float* bias, float* y, i64 k, i64 n, i64 m,
                                                                float cap, unsigned* counters, signed char* qw,
                                                                signed char* ql, float* qs, i64 qwords) { PDL_ENTER();
    q8_body((int)fmt, QX{xw, xl, xs}, w, bias, Dst{y, nullptr, 0, 0, 0, 0, 0}, k, n, m, blockIdx.x, cap);
    slab_quant_tail(y, n, m, QWARPS, QGR, counters, qw, ql, qs, qwords);
}
