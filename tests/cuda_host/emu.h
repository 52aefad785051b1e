// A host emulator of the CUDA the kernels use, so that g++ compiles kernels/*.cu unmodified (after
// tests/cuda_host/emu.py swaps each inline-PTX `asm` for a call below) and runs their launches on the CPU.
//
// A block runs as blockDim cooperative fibers (ucontext) on one OS thread, blocks one after another; a fiber runs until
// it reaches a barrier: __syncthreads (every live thread of the block; exited threads do not count, as on sm_70+) or
// a warp operation (__shfl*_sync, __ballot_sync, __syncwarp...: every lane its mask names, each with the same mask).
// Whatever CUDA leaves undefined or deadlocked is an error here, reported with the block and thread: a deadlock (no
// fiber can run), lanes of one warp disagreeing on a mask, a mask naming an exited lane (or a lane exiting while its
// warp waits for it), a misaligned vector load (-fsanitize=alignment traps), an index past a declared array's bound
// (-fsanitize=bounds traps before the access: a `__shared__` tile's stage past the ring would otherwise write into
// the heap), a fault (SIGSEGV/SIGBUS). `__shared__` is `static thread_local` (each variable once, the blocks run one
// at a time). Floating point is IEEE single, no contraction (-ffp-contract=off): the device's fused multiply-adds
// round differently, within the tests' tolerances.
#pragma once

#include <math.h>

#include <atomic>
#include <csetjmp>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <sys/mman.h>
#include <tuple>
#include <type_traits>
#include <ucontext.h>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static thread_local
#define __constant__ static

struct uint3 {
    unsigned x = 0, y = 0, z = 0;
};
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

inline thread_local uint3 threadIdx, blockIdx;
inline thread_local dim3 blockDim, gridDim;
constexpr int warpSize = 32;

// -- vector types (CUDA's alignments: a misaligned load of one traps under -fsanitize=alignment) ----------------------
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) int2 { int x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

namespace emu {
[[noreturn]] void fail(const std::string& what);

template <class T>
inline const T* aligned(const T* p, const char* op) {
    if ((uintptr_t)p % alignof(T))
        fail(std::string(op) + ": misaligned address " + std::to_string((uintptr_t)p) + " for a " +
             std::to_string(sizeof(T)) + "-byte load (alignment " + std::to_string(alignof(T)) + ")");
    return p;
}
}  // namespace emu

// -- loads with cache hints: plain loads ------------------------------------------------------------------------------
template <class T> inline T __ldg(const T* p) { return *emu::aligned(p, "__ldg"); }
template <class T> inline T __ldcg(const T* p) { return *emu::aligned(p, "__ldcg"); }
template <class T> inline T __ldca(const T* p) { return *emu::aligned(p, "__ldca"); }
template <class T> inline T __ldcs(const T* p) { return *emu::aligned(p, "__ldcs"); }
template <class T> inline T __ldlu(const T* p) { return *emu::aligned(p, "__ldlu"); }
template <class T> inline T __ldcv(const T* p) { return *emu::aligned(p, "__ldcv"); }
template <class T> inline void __stcs(T* p, T v) { *const_cast<T*>(emu::aligned((const T*)p, "__stcs")) = v; }
template <class T> inline void __stcg(T* p, T v) { *const_cast<T*>(emu::aligned((const T*)p, "__stcg")) = v; }
template <class T> inline void __stwt(T* p, T v) { *const_cast<T*>(emu::aligned((const T*)p, "__stwt")) = v; }

// -- bit casts, rounding-mode arithmetic, math ------------------------------------------------------------------------
template <class To, class From>
inline To emu_bits(From v) {
    static_assert(sizeof(To) == sizeof(From));
    To t;
    std::memcpy(&t, &v, sizeof t);
    return t;
}
inline float __int_as_float(int v) { return emu_bits<float>(v); }
inline int __float_as_int(float v) { return emu_bits<int>(v); }
inline float __uint_as_float(unsigned v) { return emu_bits<float>(v); }
inline unsigned __float_as_uint(float v) { return emu_bits<unsigned>(v); }
inline double __longlong_as_double(long long v) { return emu_bits<double>(v); }
inline long long __double_as_longlong(double v) { return emu_bits<long long>(v); }

inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float a) { return a < 0.f ? 0.f : a > 1.f ? 1.f : a; }
inline int __float2int_rn(float a) { return (int)nearbyintf(a); }  // the default mode: to nearest, ties to even
inline int __float2int_rz(float a) { return (int)a; }
inline int __float2int_rd(float a) { return (int)floorf(a); }
inline int __float2int_ru(float a) { return (int)ceilf(a); }
inline float rsqrtf(float a) { return 1.0f / sqrtf(a); }
inline float __expf(float a) { return expf(a); }
inline float __logf(float a) { return logf(a); }
inline float __sinf(float a) { return sinf(a); }
inline float __cosf(float a) { return cosf(a); }
inline float __powf(float a, float b) { return powf(a, b); }
inline float __tanhf(float a) { return tanhf(a); }

inline int __dp4a(int a, int b, int c) {
    for (int e = 0; e < 4; e++) c += (int)(signed char)(a >> (8 * e)) * (int)(signed char)(b >> (8 * e));
    return c;
}
inline unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
    for (int e = 0; e < 4; e++) c += ((a >> (8 * e)) & 255u) * ((b >> (8 * e)) & 255u);
    return c;
}
// the high word hi and the low word lo as one 64-bit value, shifted right by shift & 31, its low 32 bits (CUDA's)
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
    return (unsigned)((((unsigned long long)hi << 32) | lo) >> (shift & 31));
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __clz(int v) { return v ? __builtin_clz((unsigned)v) : 32; }

// CUDA's min/max: overloads on every arithmetic type, the usual conversions between two
template <class A, class B, class = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
inline std::common_type_t<A, B> min(A a, B b) {
    using C = std::common_type_t<A, B>;
    return (C)a < (C)b ? (C)a : (C)b;
}
template <class A, class B, class = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
inline std::common_type_t<A, B> max(A a, B b) {
    using C = std::common_type_t<A, B>;
    return (C)a > (C)b ? (C)a : (C)b;
}

// The inline PTX the kernels hold (emu.py turns `asm("op" : "=c"(out) : "c"(in))` into `out = emu_asm_<op>(in)`):
// cvt.f32.f16 (IEEE half to float, exact) and cvt.rn.f16.f32 (float to half, to nearest even).
inline float emu_asm_cvt_f32_f16(unsigned short h) {
    unsigned s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? ldexpf((float)m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexpf((float)(m + 1024), (int)e - 25);
    return s ? -v : v;
}
inline unsigned short emu_asm_cvt_rn_f16_f32(float f) {
    unsigned u = __float_as_uint(f), s = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (unsigned short)(s | 0x7fffu);  // NaN (the canonical one cvt gives)
    if (a >= 0x477ff000u) return (unsigned short)(s | 0x7c00u);  // rounds to inf (65520 and above), inf
    if (a < 0x38800000u) {                                       // below the smallest normal: a subnormal or zero
        float v = __uint_as_float(a) * 16777216.0f;              // in units of 2^-24: exact (a power of two scale)
        return (unsigned short)(s | (unsigned)nearbyintf(v));
    }
    unsigned mant = a & 0x7fffffu, exp = (a >> 23) - 112;  // rebias 127 -> 15
    unsigned h = (exp << 10) | (mant >> 13), rest = mant & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;  // carries into the exponent as it should
    return (unsigned short)(s | h);
}

// -- atomics and fences ------------------------------------------------------------------------------------------------
template <class T>
inline T emu_atomic_add(T* p, T v) {
    return std::atomic_ref<T>(*p).fetch_add(v);
}
inline int atomicAdd(int* p, int v) { return emu_atomic_add(p, v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return emu_atomic_add(p, v); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { return emu_atomic_add(p, v); }
inline float atomicAdd(float* p, float v) { return emu_atomic_add(p, v); }
inline int atomicSub(int* p, int v) { return std::atomic_ref<int>(*p).fetch_sub(v); }
inline unsigned atomicSub(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_sub(v); }
inline int atomicExch(int* p, int v) { return std::atomic_ref<int>(*p).exchange(v); }
inline unsigned atomicExch(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).exchange(v); }
inline float atomicExch(float* p, float v) { return std::atomic_ref<float>(*p).exchange(v); }
template <class T>
inline T emu_atomic_cas(T* p, T cmp, T v) {
    std::atomic_ref<T>(*p).compare_exchange_strong(cmp, v);
    return cmp;  // the old value either way
}
inline int atomicCAS(int* p, int c, int v) { return emu_atomic_cas(p, c, v); }
inline unsigned atomicCAS(unsigned* p, unsigned c, unsigned v) { return emu_atomic_cas(p, c, v); }
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long c, unsigned long long v) {
    return emu_atomic_cas(p, c, v);
}
template <class T, class F>
inline T emu_atomic_update(T* p, F f) {
    std::atomic_ref<T> a(*p);
    T old = a.load();
    while (!a.compare_exchange_weak(old, f(old))) {
    }
    return old;
}
inline int atomicMax(int* p, int v) { return emu_atomic_update(p, [v](int o) { return o > v ? o : v; }); }
inline unsigned atomicMax(unsigned* p, unsigned v) {
    return emu_atomic_update(p, [v](unsigned o) { return o > v ? o : v; });
}
inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
    return emu_atomic_update(p, [v](unsigned long long o) { return o > v ? o : v; });
}
inline int atomicMin(int* p, int v) { return emu_atomic_update(p, [v](int o) { return o < v ? o : v; }); }
inline unsigned atomicMin(unsigned* p, unsigned v) {
    return emu_atomic_update(p, [v](unsigned o) { return o < v ? o : v; });
}
inline unsigned atomicInc(unsigned* p, unsigned lim) {
    return emu_atomic_update(p, [lim](unsigned o) { return o >= lim ? 0u : o + 1u; });
}
inline unsigned atomicDec(unsigned* p, unsigned lim) {
    return emu_atomic_update(p, [lim](unsigned o) { return (o == 0u || o > lim) ? lim : o - 1u; });
}
inline int atomicOr(int* p, int v) { return std::atomic_ref<int>(*p).fetch_or(v); }
inline unsigned atomicOr(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_or(v); }
inline int atomicAnd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_and(v); }
inline unsigned atomicAnd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_and(v); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// -- the fibers of a block ---------------------------------------------------------------------------------------------
namespace emu {
enum State { RUN, BAR, WARP, DONE };

struct CpAsync {  // a cp.async in flight: its 16 bytes read at issue, written to shared memory when waited for
    void* dst;
    unsigned char data[16];
    int group;  // its commit group (1, 2, ...), 0 until committed
};

struct Fiber {
    ucontext_t ctx;
    char* stack = nullptr;
    uint3 idx;
    int tid = 0;
    State state = RUN;
    std::vector<CpAsync> cp;  // this thread's cp.async not yet waited for, in issue order
    int cp_groups = 0;        // groups committed
};

struct Warp {
    unsigned live = 0;     // lanes not exited
    unsigned arrived = 0;  // lanes waiting at the pending operation
    unsigned mask = 0;     // its mask
    unsigned gen = 0;      // operations completed
    unsigned long long slots[2][32];
};

constexpr size_t STACK = 256 * 1024;  // a fiber's stack, a guard page below it

struct Sched {
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    ucontext_t main;
    Fiber* cur = nullptr;
    int live = 0, bar_arrived = 0, nthreads = 0;
    bool aborted = false;
    std::string error;
    void (*body)(void*) = nullptr;
    void* arg = nullptr;
    sigjmp_buf jump;
    bool in_launch = false;
    unsigned long long seed = 0;
    char* altstack = nullptr;
};
inline thread_local Sched S;

inline std::string where() {
    std::string s = "block (" + std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," +
                    std::to_string(blockIdx.z) + ")";
    if (S.cur)
        s += " thread " + std::to_string(S.cur->tid) + " (warp " + std::to_string(S.cur->tid >> 5) + " lane " +
             std::to_string(S.cur->tid & 31) + ")";
    return s;
}

// Before an abort: the message on stderr and, under pytest-xdist (tests/conftest.py), appended to the worker's crash
// file, which the controller prints at the end (a worker's stderr is captured, and lost with it).
inline void last_words(const char* what) {
    std::fprintf(stderr, "emu: %s\n", what);
    if (const char* p = std::getenv("LANEFUSE_CRASH_LOG"))
        if (FILE* f = std::fopen(p, "a")) {
            std::fprintf(f, "emu: %s\n", what);
            std::fclose(f);
        }
}

// The launch stops at the first error: the fiber hands control back and is never resumed.
[[noreturn]] inline void fail(const std::string& what) {
    if (S.error.empty()) S.error = what + " [" + where() + "]";
    S.aborted = true;
    if (S.cur) swapcontext(&S.cur->ctx, &S.main);
    last_words(S.error.c_str());
    std::abort();  // not in a fiber: nowhere to return to
}

inline void yield() {
    Fiber* f = S.cur;
    swapcontext(&f->ctx, &S.main);
    if (S.aborted) swapcontext(&f->ctx, &S.main);  // never resumed past an abort
}

inline void release_bar() {
    S.bar_arrived = 0;
    for (auto& f : S.fibers)
        if (f.state == BAR) f.state = RUN;
}

inline void syncthreads() {
    if (++S.bar_arrived == S.live) {
        release_bar();
        return;
    }
    S.cur->state = BAR;
    yield();
}

// Every lane of `mask` deposits `bits`; returns the operation's 32 slots once all of them have.
inline const unsigned long long* warp_exchange(unsigned mask, unsigned long long bits, const char* op) {
    int lane = S.cur->tid & 31;
    Warp& w = S.warps[S.cur->tid >> 5];
    char hex[160];
    if (!(mask >> lane & 1u)) {
        std::snprintf(hex, sizeof hex, "mask 0x%08x", mask);
        fail(std::string(op) + ": called by a lane outside its " + hex);
    }
    if (mask & ~w.live) {
        std::snprintf(hex, sizeof hex, "mask 0x%08x names exited lanes 0x%08x", mask, mask & ~w.live);
        fail(std::string(op) + ": " + hex);
    }
    if (w.arrived == 0) {
        w.mask = mask;
    } else if (w.mask != mask) {
        std::snprintf(hex, sizeof hex, "mask 0x%08x while lanes 0x%08x wait with mask 0x%08x", mask, w.arrived, w.mask);
        fail(std::string(op) + ": " + hex);
    }
    int buf = w.gen & 1;
    w.slots[buf][lane] = bits;
    w.arrived |= 1u << lane;
    if (w.arrived == mask) {
        w.arrived = 0;
        w.gen++;
        int base = S.cur->tid & ~31;
        for (int l = 0; l < 32; l++)
            if ((mask >> l & 1u) && S.fibers[base + l].state == WARP) S.fibers[base + l].state = RUN;
    } else {
        S.cur->state = WARP;
        yield();
    }
    return w.slots[buf];
}

template <class T>
inline unsigned long long to_slot(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
    unsigned long long b = 0;
    std::memcpy(&b, &v, sizeof v);
    return b;
}
template <class T>
inline T from_slot(unsigned long long b) {
    T v;
    std::memcpy(&v, &b, sizeof v);
    return v;
}

inline void thread_exit() {
    Fiber* f = S.cur;
    f->state = DONE;
    S.live--;
    Warp& w = S.warps[f->tid >> 5];
    w.live &= ~(1u << (f->tid & 31));
    if (w.arrived && (w.mask >> (f->tid & 31) & 1u)) {
        char hex[160];
        std::snprintf(hex, sizeof hex, "the lane exited while lanes 0x%08x of its warp wait at a warp operation "
                      "with mask 0x%08x", w.arrived, w.mask);
        fail(hex);
    }
    if (S.bar_arrived && S.bar_arrived == S.live) release_bar();  // exited threads are not waited for
}

inline void entry() {
    S.body(S.arg);
    thread_exit();
    swapcontext(&S.cur->ctx, &S.main);
}

inline void ensure_fibers(int n) {
    while ((int)S.fibers.size() < n) S.fibers.emplace_back();
    for (int i = 0; i < n; i++) {
        Fiber& f = S.fibers[i];
        if (!f.stack) {
            void* p = mmap(nullptr, STACK + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (p == MAP_FAILED) {
                last_words("no memory for a fiber stack (mmap failed)");
                std::abort();
            }
            mprotect(p, 4096, PROT_NONE);  // the guard page: an overflow faults
            f.stack = (char*)p + 4096;
        }
    }
}

inline unsigned long long next_rand() {
    S.seed ^= S.seed << 13, S.seed ^= S.seed >> 7, S.seed ^= S.seed << 17;
    return S.seed;
}

// One block: its threads from the start to the end, a fiber each; false on an error (S.error).
inline bool run_block() {
    int n = S.nthreads;
    S.live = n, S.bar_arrived = 0;
    S.warps.assign((n + 31) / 32, Warp{});
    for (int t = 0; t < n; t++) S.warps[t >> 5].live |= 1u << (t & 31);
    for (int t = 0; t < n; t++) {
        Fiber& f = S.fibers[t];
        f.tid = t;
        f.cp.clear(), f.cp_groups = 0;
        f.idx = uint3{t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y)};
        f.state = RUN;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack;
        f.ctx.uc_stack.ss_size = STACK;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, entry, 0);
    }
    std::vector<int> order(n);
    for (int t = 0; t < n; t++) order[t] = t;
    int done = 0;
    while (done < n) {
        if (S.seed)  // a shuffled order each round: what a missing barrier leaves to chance shows up
            for (int i = n - 1; i > 0; i--) std::swap(order[i], order[next_rand() % (i + 1)]);
        bool ran = false;
        for (int t : order) {
            Fiber& f = S.fibers[t];
            if (f.state != RUN) continue;
            ran = true;
            S.cur = &f;
            threadIdx = f.idx;
            swapcontext(&S.main, &f.ctx);
            S.cur = nullptr;
            if (S.aborted) return false;
        }
        done = 0;
        for (int t = 0; t < n; t++) done += S.fibers[t].state == DONE;
        if (done < n && !ran) {
            std::string s = "deadlock: no thread can go on;";
            int bar = 0;
            for (int t = 0; t < n; t++) bar += S.fibers[t].state == BAR;
            s += " " + std::to_string(bar) + " of " + std::to_string(S.live) + " live threads wait at __syncthreads;";
            for (size_t w = 0; w < S.warps.size(); w++)
                if (S.warps[w].arrived) {
                    char b[128];
                    std::snprintf(b, sizeof b, " warp %zu: lanes 0x%08x wait at a warp operation of mask 0x%08x "
                                  "(live 0x%08x);", w, S.warps[w].arrived, S.warps[w].mask, S.warps[w].live);
                    s += b;
                }
            S.error = s + " [block (" + std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) + "," +
                      std::to_string(blockIdx.z) + ")]";
            return false;
        }
    }
    return true;
}

inline void on_signal(int sig, siginfo_t* info, void*) {
    char b[256];
    std::snprintf(b, sizeof b, "%s at %p", sig == SIGILL ? "a trap (a misaligned access under "
                  "-fsanitize=alignment, an index past an array's bound under -fsanitize=bounds, or __trap; the "
                  "address is the instruction's)" : sig == SIGSEGV ? "an invalid memory access (SIGSEGV)" :
                  sig == SIGBUS ? "a bus error" : "an arithmetic fault (SIGFPE)", info->si_addr);
    if (S.error.empty()) S.error = std::string(b) + " [" + where() + "]";
    S.aborted = true;
    siglongjmp(S.jump, 1);
}

// The whole grid, blocks in order (x fastest; flags & 1: the reverse order); 0, or 1 with S.error set.
inline int run_grid(const unsigned* grid, const unsigned* block, unsigned long long flags, unsigned long long seed) {
    S.error.clear();
    S.aborted = false;
    S.seed = seed;
    gridDim = dim3{grid[0], grid[1], grid[2]};
    blockDim = dim3{block[0], block[1], block[2]};
    S.nthreads = (int)(block[0] * block[1] * block[2]);
    if (S.nthreads < 1 || S.nthreads > 1024 || !grid[0] || !grid[1] || !grid[2]) {
        S.error = "a launch of grid (" + std::to_string(grid[0]) + "," + std::to_string(grid[1]) + "," +
                  std::to_string(grid[2]) + ") blocks of " + std::to_string(S.nthreads) + " threads";
        return 1;
    }
    ensure_fibers(S.nthreads);
    if (!S.altstack) S.altstack = (char*)std::malloc(1 << 16);
    stack_t ss{}, old_ss{};
    ss.ss_sp = S.altstack, ss.ss_size = 1 << 16, ss.ss_flags = 0;
    sigaltstack(&ss, &old_ss);
    struct sigaction sa {}, old[4];
    sa.sa_sigaction = on_signal;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    const int sigs[4] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE};
    for (int i = 0; i < 4; i++) sigaction(sigs[i], &sa, &old[i]);
    int rc = 0;
    if (sigsetjmp(S.jump, 1) == 0) {
        unsigned long long nb = (unsigned long long)grid[0] * grid[1] * grid[2];
        for (unsigned long long b = 0; b < nb && !rc; b++) {
            unsigned long long i = (flags & 1) ? nb - 1 - b : b;
            blockIdx = uint3{(unsigned)(i % grid[0]), (unsigned)(i / grid[0] % grid[1]),
                             (unsigned)(i / grid[0] / grid[1])};
            if (!run_block()) rc = 1;
        }
    } else {
        rc = 1;
    }
    S.cur = nullptr;
    for (int i = 0; i < 4; i++) sigaction(sigs[i], &old[i], nullptr);
    sigaltstack(&old_ss, nullptr);
    return rc;
}

// A kernel's parameters as the driver packs them: every argument a pointer to its value (CUDA's convention), and a
// signature string the Python side checks its arguments against: p<pointee> for a pointer, l i64, f float, i int,
// I unsigned.
template <class T>
std::string type_code() {
    using U = std::remove_cv_t<T>;
    if constexpr (std::is_pointer_v<U>) {
        using P = std::remove_cv_t<std::remove_pointer_t<U>>;
        if constexpr (std::is_void_v<P>) return "pv";
        else if constexpr (std::is_same_v<P, float>) return "pf";
        else if constexpr (std::is_same_v<P, int>) return "pi";
        else if constexpr (std::is_same_v<P, unsigned>) return "pI";
        else if constexpr (std::is_same_v<P, long long>) return "pl";
        else if constexpr (std::is_same_v<P, signed char>) return "pb";
        else if constexpr (std::is_same_v<P, unsigned char>) return "pB";
        else if constexpr (std::is_same_v<P, short>) return "ph";
        else if constexpr (std::is_same_v<P, unsigned short>) return "pH";
        else return "p?";
    } else if constexpr (std::is_same_v<U, long long>) return "l";
    else if constexpr (std::is_same_v<U, float>) return "f";
    else if constexpr (std::is_same_v<U, int>) return "i";
    else if constexpr (std::is_same_v<U, unsigned>) return "I";
    else return "?";
}

template <class... A>
std::string signature(void (*)(A...)) {
    std::string s;
    ((s += type_code<A>() + " "), ...);
    return s;
}

template <class... A>
struct Call {
    void (*k)(A...);
    std::tuple<std::remove_cv_t<A>...> args;
    static void run(void* p) {
        auto* c = (Call*)p;
        std::apply(c->k, c->args);
    }
};

template <class... A, size_t... I>
int launch_packed(void (*k)(A...), void** args, const unsigned* grid, const unsigned* block,
                  unsigned long long flags, unsigned long long seed, std::index_sequence<I...>) {
    Call<A...> c{k, std::tuple<std::remove_cv_t<A>...>(*(std::remove_cv_t<A>*)args[I]...)};
    S.body = &Call<A...>::run;
    S.arg = &c;
    return run_grid(grid, block, flags, seed);
}

template <class... A>
int launch(void (*k)(A...), void** args, const unsigned* grid, const unsigned* block, unsigned long long flags,
           unsigned long long seed) {
    return launch_packed(k, args, grid, block, flags, seed, std::index_sequence_for<A...>{});
}
}  // namespace emu

inline void __syncthreads() { emu::syncthreads(); }
// A kernel's own trap (chain.cu's bounded wait under the emulator): the launch fails there, naming the block.
[[noreturn]] inline void __trap() { emu::fail("__trap: the kernel trapped (a wait never met, a check failed)"); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { emu::warp_exchange(mask, 0, "__syncwarp"); }

template <class T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    int lane = emu::S.cur->tid & 31;
    const unsigned long long* s = emu::warp_exchange(mask, emu::to_slot(v), "__shfl_sync");
    int base = lane & ~(width - 1);
    return emu::from_slot<T>(s[base + (src & (width - 1))]);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lm, int width = 32) {
    int lane = emu::S.cur->tid & 31;
    const unsigned long long* s = emu::warp_exchange(mask, emu::to_slot(v), "__shfl_xor_sync");
    int src = lane ^ lm;
    if (src >= ((lane & ~(width - 1)) + width)) src = lane;
    return emu::from_slot<T>(s[src]);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
    int lane = emu::S.cur->tid & 31;
    const unsigned long long* s = emu::warp_exchange(mask, emu::to_slot(v), "__shfl_down_sync");
    int src = (int)((lane & (width - 1)) + d) < width ? lane + (int)d : lane;
    return emu::from_slot<T>(s[src]);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
    int lane = emu::S.cur->tid & 31;
    const unsigned long long* s = emu::warp_exchange(mask, emu::to_slot(v), "__shfl_up_sync");
    int src = (lane & (width - 1)) >= (int)d ? lane - (int)d : lane;
    return emu::from_slot<T>(s[src]);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
    const unsigned long long* s = emu::warp_exchange(mask, pred != 0, "__ballot_sync");
    unsigned b = 0;
    for (int l = 0; l < 32; l++)
        if ((mask >> l & 1u) && s[l]) b |= 1u << l;
    return b;
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) == mask; }
inline unsigned __activemask() { return emu::S.warps[emu::S.cur->tid >> 5].live; }

// -- the tensor-core PTX (kernels/gemm_tc.cu's `emu: begin tc_ptx` region, which emu.py drops), lane by lane --------
// cp.async as a deferred copy: its bytes (zero-filled past `bytes`) read at issue and written to shared memory only
// when a cp.async.wait_group lets its commit group complete (so a read of a stage before its wait sees the stage's
// old bytes, and a wait for too few groups is caught by the values); ldmatrix and mma.sync as warp operations: every
// lane's operands exchanged, then each lane computes its own fragment by the PTX ISA's layouts.
inline void tc_cp16(void* s, const void* g, int bytes) {
    if ((uintptr_t)s % 16 || (bytes && (uintptr_t)g % 16)) emu::fail("cp.async: a misaligned 16-byte copy");
    emu::CpAsync c{s, {}, 0};
    std::memcpy(c.data, g, (size_t)bytes);
    std::memset(c.data + bytes, 0, (size_t)(16 - bytes));
    emu::S.cur->cp.push_back(c);
}
inline void tc_commit() {
    emu::Fiber& f = *emu::S.cur;
    f.cp_groups++;
    for (emu::CpAsync& c : f.cp)
        if (!c.group) c.group = f.cp_groups;
}
template <int N>
inline void tc_wait() {  // every committed group but the newest N complete
    emu::Fiber& f = *emu::S.cur;
    std::vector<emu::CpAsync> left;
    for (emu::CpAsync& c : f.cp) {
        if (c.group && c.group <= f.cp_groups - N)
            std::memcpy(c.dst, c.data, 16);
        else
            left.push_back(c);
    }
    f.cp.swap(left);
}
inline void tc_wait_all() { tc_wait<0>(); }

inline void tc_ldsm4(unsigned (&r)[4], const void* s) {  // lane l: r[j] = row l/4 of matrix j (lanes 8j.. its rows), values 2(l%4), +1
    if ((uintptr_t)s % 16) emu::fail("ldmatrix: a row address not 16-byte aligned");
    int lane = emu::S.cur->tid & 31;
    const unsigned long long* a = emu::warp_exchange(0xffffffffu, (unsigned long long)(uintptr_t)s, "ldmatrix");
    const unsigned* rows[4];
    for (int j = 0; j < 4; j++) rows[j] = (const unsigned*)(uintptr_t)a[8 * j + lane / 4];
    for (int j = 0; j < 4; j++) r[j] = rows[j][lane % 4];
}

inline float emu_bf16(unsigned bits) { return __uint_as_float((bits & 0xffffu) << 16); }

// c (16x8) += a (16x16) · b (16x8): lane L = 4g + t holds a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] =
// A[g][2t+8..], a[3] = A[g+8][2t+8..]; b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]; c[e] = C[g + 8(e/2)][2t + e%2].
// Each product exact in f32 (bf16 x bf16), summed into c in k order.
inline void tc_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    int lane = emu::S.cur->tid & 31;
    unsigned long long a01[32], a23[32], bb[32];
    const unsigned long long* x = emu::warp_exchange(0xffffffffu, a[0] | (unsigned long long)a[1] << 32, "mma.sync");
    std::memcpy(a01, x, sizeof a01);
    x = emu::warp_exchange(0xffffffffu, a[2] | (unsigned long long)a[3] << 32, "mma.sync");
    std::memcpy(a23, x, sizeof a23);
    x = emu::warp_exchange(0xffffffffu, b0 | (unsigned long long)b1 << 32, "mma.sync");
    std::memcpy(bb, x, sizeof bb);
    float A[16][16], B[16][8];
    for (int L = 0; L < 32; L++) {
        int g = L >> 2, t = L & 3;
        unsigned reg[4] = {(unsigned)a01[L], (unsigned)(a01[L] >> 32), (unsigned)a23[L], (unsigned)(a23[L] >> 32)};
        for (int q = 0; q < 4; q++)
            for (int h = 0; h < 2; h++) A[g + 8 * (q & 1)][2 * t + 8 * (q >> 1) + h] = emu_bf16(reg[q] >> (16 * h));
        unsigned br[2] = {(unsigned)bb[L], (unsigned)(bb[L] >> 32)};
        for (int q = 0; q < 2; q++)
            for (int h = 0; h < 2; h++) B[2 * t + 8 * q + h][g] = emu_bf16(br[q] >> (16 * h));
    }
    int g = lane >> 2, t = lane & 3;
    for (int e = 0; e < 4; e++) {
        int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        float s = c[e];
        for (int kk = 0; kk < 16; kk++) s += A[row][kk] * B[kk][col];
        c[e] = s;
    }
}

// The exported entry point of kernel NAME: emu_NAME(grid[3], block[3], args, flags, seed) -> 0 or 1 (emu_error()),
// and emu_sig_NAME() its signature string.
#define EMU_EXPORT(NAME)                                                                                      \
    extern "C" __attribute__((visibility("default"))) int emu_##NAME(const unsigned* grid, const unsigned* block, \
                                                                     void** args, unsigned long long flags,     \
                                                                     unsigned long long seed) {                 \
        return emu::launch(NAME, args, grid, block, flags, seed);                                              \
    }                                                                                                          \
    extern "C" __attribute__((visibility("default"))) const char* emu_sig_##NAME() {                           \
        static std::string s = emu::signature(NAME);                                                           \
        return s.c_str();                                                                                      \
    }

extern "C" __attribute__((visibility("default"))) const char* emu_error() { return emu::S.error.c_str(); }
