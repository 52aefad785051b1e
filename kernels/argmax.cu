// Arg-max of each row as numpy's argmax: the first index on ties, and a NaN is the largest value (the first NaN wins).
// Grid (blocks, rows), each block the max of its chunk into the block maxima; the last block to arrive (an arrival
// counter it resets to zero) picks each row's and, on an advance, writes the last row's token into the token buffer
// and adds `step` to the position (a batch: each row's token and each sequence's position).
#define AB 256

// Whether (v, i) beats (b, bi): NaN above every number, then the larger value, then the smaller index.
__device__ __forceinline__ bool am_better(float v, i64 i, float b, i64 bi) {
    bool vn = v != v, bn = b != b;
    if (vn != bn) return vn;
    return v > b || ((vn || v == b) && i < bi);
}

extern "C" __global__ void __launch_bounds__(AB) argmax_rows(const float* x, int* out, float* bv, int* bi,
                                                             unsigned* counter, i64 n, i64 rows, int* token,
                                                             int* position, i64 step, i64 batch) { PDL_ENTER();
    __shared__ float sv[AB];
    __shared__ i64 si[AB];
    __shared__ int last;
    i64 r = blockIdx.y, nb = gridDim.x, per = (n + nb - 1) / nb;
    i64 a = (i64)blockIdx.x * per, b = min(n, a + per);
    float best = NEG_INF;
    i64 bix = n;
    for (i64 i = a + threadIdx.x; i < b; i += AB) {
        float v = x[r * n + i];
        if (am_better(v, i, best, bix)) {
            best = v;
            bix = i;
        }
    }
    sv[threadIdx.x] = best;
    si[threadIdx.x] = bix;
    __syncthreads();
    for (int o = AB / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) {
            float v = sv[threadIdx.x + o];
            i64 j = si[threadIdx.x + o];
            if (am_better(v, j, sv[threadIdx.x], si[threadIdx.x])) {
                sv[threadIdx.x] = v;
                si[threadIdx.x] = j;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        bv[r * nb + blockIdx.x] = sv[0];
        bi[r * nb + blockIdx.x] = (int)si[0];
        __threadfence();
        last = atomicAdd(counter, 1u) == (unsigned)(nb * rows - 1);
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (i64 rr = threadIdx.x; rr < rows; rr += AB) {
        float m = NEG_INF;
        int mi = (int)n;
        for (i64 k = 0; k < nb; k++) {
            float v = __ldcg(bv + rr * nb + k);
            int j = __ldcg(bi + rr * nb + k);
            if (am_better(v, j, m, mi)) {
                m = v;
                mi = j;
            }
        }
        out[rr] = mi < n ? mi : 0;
    }
    __syncthreads();
    if (token && batch) {  // a batch: every row's token and position, each row a sequence of its own
        for (i64 rr = threadIdx.x; rr < rows; rr += AB) {
            token[rr] = out[rr];
            position[rr] += (int)step;
        }
    }
    if (threadIdx.x == 0) {
        if (token && !batch) {
            token[0] = out[rows - 1];
            position[0] += (int)step;
        }
        *counter = 0u;
    }
}
