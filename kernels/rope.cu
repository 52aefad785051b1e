// Rotary embedding (HF rotate_half over the first `rot` values of each head), a block a (row, head) of every side of
// a launch: the head optionally RMS-normed first (per-head weight), row r at position pos + r, cos/sin tables
// (positions, rot/2). A side is 14 words of a descriptor table: x, x's row pitch, x's offset in a row, the norm's
// weight (0: none), its eps (f32 bits), heads a row, the side's first unit, its Dst (7 words). A batch (slot > 0):
// row r of the launch is sequence s = seq0 + r, at position posp[s], its values the result's from (s * heads) * hd on
// (a batch's Dst puts row s in its sequence's slot of the table: dst_at).
#define RS 14
#define MAXHD 1024

extern "C" __global__ void __launch_bounds__(128) rope_parts(const i64* t, i64 nsides, const float* cos,
                                                              const float* sin, const int* posp, i64 hd, i64 rot,
                                                              i64 slot, i64 seq0) { PDL_ENTER();
    __shared__ float v[MAXHD];
    i64 u = blockIdx.x;
    int s = 0;
    while (s + 1 < nsides && u >= t[(s + 1) * RS + 6]) s++;
    const i64* d = t + s * RS;
    u -= d[6];
    i64 heads = d[5], r = u / heads, h = u % heads, sq = seq0 + r;
    const float* xr = (const float*)d[0] + sq * d[1] + d[2] + h * hd;
    const float* nw = (const float*)d[3];
    if (nw) {
        float ss = 0.f;
        for (i64 i = threadIdx.x; i < hd; i += blockDim.x) ss += xr[i] * xr[i];
        float inv = rsqrtf(block_sum(ss) / (float)hd + __int_as_float((int)d[4]));
        for (i64 i = threadIdx.x; i < hd; i += blockDim.x) v[i] = xr[i] * inv * nw[i];
    } else {
        for (i64 i = threadIdx.x; i < hd; i += blockDim.x) v[i] = xr[i];
    }
    __syncthreads();
    i64 half = rot / 2, p = slot > 0 ? (i64)posp[sq] : (posp ? (i64)posp[0] : 0) + r;
    Dst y = dst_from(d + 7);
    for (i64 i = threadIdx.x; i < hd; i += blockDim.x) {
        float o = v[i];
        if (i < half) o = v[i] * cos[p * half + i] - v[i + half] * sin[p * half + i];
        else if (i < rot) o = v[i] * cos[p * half + i - half] + v[i - half] * sin[p * half + i - half];
        y.y[dst_at(y, (seq0 * heads + u) * hd + i)] = o;
    }
}
