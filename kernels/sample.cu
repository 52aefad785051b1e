// Sampling as the step's closing launch (kernels/sample.py holds the numpy twin and the definitions): one block a row
// of logits, each token drawn from transformers' temperature / top-k / top-p / min-p with Philox4x64-10 keyed by the
// seed, so the twin and this kernel draw the same token to the bit. Nothing here rounds differently from numpy: the
// scores are one correctly rounded division, the weights an exp of our own from __fmul_rn / __fsub_rn / __fadd_rn
// (no contraction) scaled to integers (2^40 the top), every sum, count and threshold over integers or exact
// comparisons (radix selects over the keys' bits, no sort), so no reduction order can change a bit.
// Parameters (i32 words): temperature (f32 bits), top-k, top-p (f32 bits), min-p (f32 bits), seed low, seed high, then
// (sequence, token index) a sequence: a batch's row r its pair r, a single sequence's one row pair 0. The advance
// writes the token and moves the position on as the arg-max's does, and adds 1 to the token index drawn from, so a
// replayed CUDA graph draws each step's token from its own counter.
#define SB 1024
#define SP_WORDS 6
typedef unsigned long long u64;

__device__ __forceinline__ u64 sp_mulhi(u64 a, u64 b) {  // the high 64 bits of a·b, from 32-bit halves
    u64 al = a & 0xffffffffull, ah = a >> 32, bl = b & 0xffffffffull, bh = b >> 32;
    u64 ll = al * bl, lh = al * bh, hl = ah * bl, hh = ah * bh;
    u64 mid = (ll >> 32) + (lh & 0xffffffffull) + (hl & 0xffffffffull);
    return hh + (lh >> 32) + (hl >> 32) + (mid >> 32);
}

// Philox4x64-10 (Salmon et al.; numpy's np.random.Philox): the first word of the block at counter (c0, c1, 0, 0)
__device__ u64 sp_philox(u64 c0, u64 c1, u64 k0, u64 k1) {
    u64 c2 = 0, c3 = 0;
    for (int r = 0; r < 10; r++) {
        u64 h0 = sp_mulhi(0xD2E7470EE14C6C93ull, c0), l0 = 0xD2E7470EE14C6C93ull * c0;
        u64 h1 = sp_mulhi(0xCA5A826395121157ull, c2), l1 = 0xCA5A826395121157ull * c2;
        u64 n0 = h1 ^ c1 ^ k0, n2 = h0 ^ c3 ^ k1;
        c0 = n0;
        c1 = l1;
        c2 = n2;
        c3 = l0;
        k0 += 0x9E3779B97F4A7C15ull;
        k1 += 0xBB67AE8584CAA73Bull;
    }
    return c0;
}

// A logit's score: x / temperature, one rounding; NaN and ±inf as -inf; -0 as +0 (equal values, one key)
__device__ __forceinline__ float sp_score(float x, float t) {
    float s = __fdiv_rn(x, t);
    if (!(s > NEG_INF && s < -NEG_INF)) s = NEG_INF;
    return __fadd_rn(s, 0.0f);
}

// The f32 bits as an unsigned key in the values' order
__device__ __forceinline__ unsigned sp_key(float s) {
    unsigned u = __float_as_uint(s);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// e^d for d <= 0: 2^n · p(r), n = rint(d·log2 e), r = d - n·ln2 (two parts), p Taylor's to degree 7 by Horner;
// each operation rounded alone. Below -28 (e^-28 < 2^-40: a weight of 0) and for -inf: 0. e^0 is 1 exactly.
__device__ __forceinline__ float sp_exp(float d) {
    if (!(d >= -28.0f)) return 0.0f;
    float n = rintf(__fmul_rn(d, 1.44269504f));
    float r = __fsub_rn(d, __fmul_rn(n, 0.693359375f));
    r = __fsub_rn(r, __fmul_rn(n, -2.12194440e-4f));
    float p = 1.98412698e-4f;
    p = __fadd_rn(__fmul_rn(p, r), 1.38888889e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 8.33333333e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 4.16666667e-2f);
    p = __fadd_rn(__fmul_rn(p, r), 1.66666667e-1f);
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    return __fmul_rn(p, __int_as_float((127 + (int)n) << 23));
}

// A token's weight: floor(e^(s - m) · 2^40), 0 where top-k removed it (key below kth)
__device__ __forceinline__ u64 sp_weight(float s, float m, unsigned kth) {
    if (sp_key(s) < kth) return 0ull;
    return (u64)__fmul_rn(sp_exp(__fsub_rn(s, m)), 1099511627776.0f);
}

__device__ __forceinline__ u64 sp_block_sum(u64 v, u64* red) {  // every thread gets the block's sum (exact)
    red[threadIdx.x] = v;
    __syncthreads();
    for (int o = SB / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
        __syncthreads();
    }
    u64 s = red[0];
    __syncthreads();
    return s;
}

__device__ __forceinline__ u64 sp_block_max(u64 v, u64* red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int o = SB / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) red[threadIdx.x] = max(red[threadIdx.x], red[threadIdx.x + o]);
        __syncthreads();
    }
    u64 s = red[0];
    __syncthreads();
    return s;
}

extern "C" __global__ void __launch_bounds__(SB, 1) sample_rows(const float* x, int* out, int* params, i64 n, i64 rows,
                                                             int* token, int* position, i64 step, i64 batch,
                                                             int* stats) { PDL_ENTER();
    __shared__ u64 red[SB];
    __shared__ u64 hist[256];
    __shared__ u64 pick[2];
    const i64 r = blockIdx.y;
    const float* xr = x + r * n;
    const int* pair = params + SP_WORDS + 2 * (batch ? r : 0);
    const float temp = __int_as_float(params[0]), top_p = __int_as_float(params[2]), min_p = __int_as_float(params[3]);
    const i64 top_k = params[1];
    const u64 seed = (u64)(unsigned)params[4] | ((u64)(unsigned)params[5] << 32);
    const u64 seq = (u64)(unsigned)pair[0], index = (u64)(unsigned)pair[1];

    // the largest score (as its key: the same order)
    u64 mk = 0;
    for (i64 i = threadIdx.x; i < n; i += SB) mk = max(mk, (u64)sp_key(sp_score(xr[i], temp)));
    mk = sp_block_max(mk, red);
    const unsigned mkey = (unsigned)mk;
    const float m = __uint_as_float((mkey & 0x80000000u) ? (mkey & 0x7fffffffu) : ~mkey);

    // top-k: the k-th largest score's key (ties with it kept), by a radix select over the keys' bytes
    unsigned kth = 0;
    if (top_k > 0 && top_k < n) {
        unsigned want = 0, mask = 0;
        u64 left = (u64)top_k;
        for (int sh = 24; sh >= 0; sh -= 8) {
            for (int b = threadIdx.x; b < 256; b += SB) hist[b] = 0;
            __syncthreads();
            u64 acc = 0;  // a run of one bin counted in a register, added once (most keys share the top byte)
            int cur = 0;
            for (i64 i = threadIdx.x; i < n; i += SB) {
                unsigned k = sp_key(sp_score(xr[i], temp));
                if ((k & mask) != want) continue;
                int b = (int)((k >> sh) & 255u);
                if (b != cur && acc) {
                    atomicAdd(hist + cur, acc);
                    acc = 0;
                }
                cur = b;
                acc += 1ull;
            }
            if (acc) atomicAdd(hist + cur, acc);
            __syncthreads();
            if (threadIdx.x == 0) {
                u64 acc = 0;
                int b = 255;
                for (; b > 0; b--) {
                    if (acc + hist[b] >= left) break;
                    acc += hist[b];
                }
                pick[0] = (u64)b;
                pick[1] = left - acc;
            }
            __syncthreads();
            want |= (unsigned)pick[0] << sh;
            mask |= 255u << sh;
            left = pick[1];
            __syncthreads();
        }
        kth = want;
    }

    // top-p: over the weights' total, the smallest weight u whose ascending cumulative mass passes (1 - p)·total (the
    // tokens below it dropped, a tie group whole), a radix select over the weights' bytes with each bin's mass
    u64 u = 0, total = 0;
    if (top_p < 1.0f) {
        for (i64 i = threadIdx.x; i < n; i += SB) total += sp_weight(sp_score(xr[i], temp), m, kth);
        total = sp_block_sum(total, red);
    }
    if (top_p < 1.0f && total > 0) {
        u64 limit = (u64)floor((double)__fsub_rn(1.0f, top_p) * (double)total);  // one double product: nothing to fuse
        if (limit >= total) limit = total - 1;
        u64 want = 0, mask = 0, below = 0;
        for (int sh = 40; sh >= 0; sh -= 8) {
            for (int b = threadIdx.x; b < 256; b += SB) hist[b] = 0;
            __syncthreads();
            u64 acc = 0;  // as above: a run of one bin's mass in a register
            int cur = 0;
            for (i64 i = threadIdx.x; i < n; i += SB) {
                u64 w = sp_weight(sp_score(xr[i], temp), m, kth);
                if ((w & mask) != want) continue;
                int b = (int)((w >> sh) & 255ull);
                if (b != cur && acc) {
                    atomicAdd(hist + cur, acc);
                    acc = 0;
                }
                cur = b;
                acc += w;
            }
            if (acc) atomicAdd(hist + cur, acc);
            __syncthreads();
            if (threadIdx.x == 0) {
                u64 acc = below;
                int b = 0;
                for (; b < 255; b++) {
                    if (acc + hist[b] > limit) break;
                    acc += hist[b];
                }
                pick[0] = (u64)b;
                pick[1] = acc;
            }
            __syncthreads();
            want |= pick[0] << sh;
            mask |= 255ull << sh;
            below = pick[1];
            __syncthreads();
        }
        u = want;
    }
    // min-p: a weight of at least min-p of the top's (2^40), rounded up
    const u64 floor_w = (u64)ceil((double)min_p * 1099511627776.0);  // exact (a power of two)
    const u64 cut = max(max(u, floor_w), 1ull);

    // the kept tokens' weights in id order, a contiguous run a thread: the token is the first whose cumulative kept
    // weight passes the draw's target, floor(bits · kept total / 2^64)
    const i64 per = (n + SB - 1) / SB, a = min(n, (i64)threadIdx.x * per), e = min(n, a + per);
    u64 mine = 0, cnt = 0;
    for (i64 i = a; i < e; i++) {
        u64 w = sp_weight(sp_score(xr[i], temp), m, kth);
        if (w >= cut) {
            mine += w;
            cnt++;
        }
    }
    const u64 kept = sp_block_sum(cnt, red);
    red[threadIdx.x] = mine;
    __syncthreads();
    for (int o = 1; o < SB; o <<= 1) {  // inclusive scan (Hillis-Steele): read, wait, add, wait
        u64 add = threadIdx.x >= o ? red[threadIdx.x - o] : 0ull;
        __syncthreads();
        red[threadIdx.x] += add;
        __syncthreads();
    }
    const u64 sum = red[SB - 1];
    const u64 bits = sp_philox(index + 1, seq, seed, 0);
    const u64 target = sp_mulhi(bits, sum);
    if (threadIdx.x == 0) pick[0] = 0;  // no kept weight (every score -inf): token 0
    __syncthreads();
    const u64 hi = red[threadIdx.x], lo = hi - mine;
    if (sum > 0 && lo <= target && target < hi) {
        u64 acc = lo;
        for (i64 i = a; i < e; i++) {
            u64 w = sp_weight(sp_score(xr[i], temp), m, kth);
            if (w >= cut) {
                acc += w;
                if (acc > target) {
                    pick[0] = (u64)i;
                    break;
                }
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const int tok = (int)pick[0];
        out[r] = tok;
        if (stats) {
            int* s = stats + 8 * r;
            s[0] = (int)kept;
            s[1] = (int)(unsigned)bits;
            s[2] = (int)(unsigned)(bits >> 32);
            s[3] = (int)(unsigned)sum;
            s[4] = (int)(unsigned)(sum >> 32);
            s[5] = (int)kth;
            s[6] = (int)(unsigned)cut;
            s[7] = (int)(unsigned)(cut >> 32);
        }
        if (token && batch) {  // a batch: each row's sequence its own token, position and counter
            token[r] = tok;
            position[r] += (int)step;
            params[SP_WORDS + 2 * r + 1] += 1;
        } else if (token && r == rows - 1) {
            token[0] = tok;
            position[0] += (int)step;
            params[SP_WORDS + 1] += 1;
        }
    }
}
