// Causal depthwise convolutions (of channels xoff.. of each row of x, xpitch wide) over a step's rows after their
// ring (the ring holds the taps-1 inputs before the step, oldest first), a thread a channel:
// y[r] = sum_j w[c, j] * xx[r + j] with xx the ring's rows then x's, SiLU where asked, and (l2) each head of blockDim.x channels scaled to unit length, x / sqrt(sum(x^2) + eps) (a block a
// head: block_sum); then each thread rewrites its channel of the ring with the last taps-1 inputs (a row's source
// lies past it, so it is read before it is written). In a batch (seqs) a block row (grid y) is a sequence's: row
// seq0 + blockIdx.y of x and y, after its own slot of the ring (taps-1 rows a sequence), one row (conv_seq).
__device__ __forceinline__ void conv_block(const float* x, i64 xpitch, i64 xoff, const float* w, float* ring, float* y,
                                           i64 chan, i64 taps, i64 rows, int silu, int l2, float eps, i64 c) {
    bool on = c < chan;
    for (i64 r = 0; r < rows; r++) {
        float acc = 0.f;
        if (on)
            for (i64 j = 0; j < taps; j++) {
                i64 t = r + j - (taps - 1);
                float v = t < 0 ? ring[(taps - 1 + t) * chan + c] : x[t * xpitch + xoff + c];
                acc += w[c * taps + j] * v;
            }
        if (silu) acc = acc / (1.f + expf(-acc));
        if (l2) acc *= rsqrtf(block_sum(on ? acc * acc : 0.f) + eps);
        if (on) y[r * chan + c] = acc;
    }
    if (on)
        for (i64 t = 0; t < taps - 1; t++) {
            i64 s = rows + t - (taps - 1);
            ring[t * chan + c] = s < 0 ? ring[(taps - 1 + s) * chan + c] : x[s * xpitch + xoff + c];
        }
}

// conv_block over a batch's sequence (seqs): its row of x and y and its slot of the ring; else over the step's rows.
__device__ __forceinline__ void conv_seq(const float* x, i64 xpitch, i64 xoff, const float* w, float* ring, float* y,
                                         i64 chan, i64 taps, i64 rows, int silu, int l2, float eps, i64 c, i64 seqs,
                                         i64 seq0) {
    if (seqs) {
        i64 s = seq0 + blockIdx.y;
        x += s * xpitch;
        ring += s * (taps - 1) * chan;
        y += s * chan;
        rows = 1;
    }
    conv_block(x, xpitch, xoff, w, ring, y, chan, taps, rows, silu, l2, eps, c);
}

extern "C" __global__ void conv(const float* x, i64 xpitch, i64 xoff, const float* w, float* ring, float* y, i64 chan,
                                i64 taps, i64 rows, i64 silu, i64 l2, float eps, i64 seqs, i64 seq0) { PDL_ENTER();
    conv_seq(x, xpitch, xoff, w, ring, y, chan, taps, rows, (int)silu, (int)l2, eps,
             (i64)blockIdx.x * blockDim.x + threadIdx.x, seqs, seq0);
}
