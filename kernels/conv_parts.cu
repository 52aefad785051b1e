// Several causal convolutions in one launch (conv_parts): part p (9 descriptor words: x, w, ring, y, channels, its
// first block, whether its heads are L2-normed, x's row pitch and offset) takes the blocks from its first; each runs
// conv_block (conv.cu); in a batch (seqs) a block row a sequence (conv_seq).
#define CP 9

extern "C" __global__ void conv_parts(const i64* t, i64 nparts, i64 taps, i64 rows, i64 silu, float eps, i64 seqs,
                                      i64 seq0) { PDL_ENTER();
    int p = 0;
    while (p + 1 < nparts && (i64)blockIdx.x >= t[(p + 1) * CP + 5]) p++;
    const i64* d = t + p * CP;
    conv_seq((const float*)d[0], d[7], d[8], (const float*)d[1], (float*)d[2], (float*)d[3], d[4], taps, rows,
             (int)silu, (int)d[6], eps, ((i64)blockIdx.x - d[5]) * blockDim.x + threadIdx.x, seqs, seq0);
}
