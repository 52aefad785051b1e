// Two RMSNorms in one launch (norm_pair.py): blocks 0..arows-1 norm row blockIdx.x of the first (norm.cu's norm_row
// with its arguments), the rest row blockIdx.x - arows of the second; each norm its own rows, width, weight, eps and
// destination (the second's may be a cache row).
#define NORM_PARAMS_B                                                                                             \
    const float *bx, i64 bxpitch, i64 bxoff, const float *badd, const float *bprew, float bpreeps, i64 bpre,      \
        float *bsum, const float *bw, float beps, i64 bcols, i64 bheads, DST_PARAMS(by), signed char *bqw,         \
        signed char *bql, float *bqs, i64 bqwords
#define NORM_ARGS_B                                                                                            \
    NormArgs{bx, bxpitch, bxoff, badd, bprew, bpreeps, (int)bpre, bsum, bw, beps, bcols, bheads, DST(by), bqw, bql, \
             bqs, (int)bqwords}

extern "C" __global__ void __launch_bounds__(1024) norm_pair_rows(NORM_PARAMS, NORM_PARAMS_B, i64 arows) { PDL_ENTER();
    if ((i64)blockIdx.x < arows) {
        NormArgs a = NORM_ARGS;
        norm_row<NORM_VBATCH_WIDE>(a, blockIdx.x);
    } else {
        NormArgs b = NORM_ARGS_B;
        norm_row<NORM_VBATCH_WIDE>(b, (i64)blockIdx.x - arows);
    }
}
