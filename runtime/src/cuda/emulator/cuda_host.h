// kiln's host runtime for generated CUDA C: the built-ins a kernel uses, mapped onto host threads,
// so that the emulated CUDA device (kiln_runtime::cuda::emulator) and the kernel tests can compile
// every generated kernel with the system C++ compiler and launch it with its grid and block on
// host memory.
//
// On x86-64 a block's threads are fibers on the calling thread (a small context switch below):
// each runs until it waits at __syncthreads (resumed when every live thread of the block waits
// there) or at a warp shuffle (resumed when every live lane of its warp does); blocks run one
// after another (so __shared__ arrays, mapped to function statics, are the block's own).
// Elsewhere a block runs as blockDim host threads at once with real barriers. Kernels that never
// synchronise run their threads one after another (`launch_serial`). What it cannot see: timing, memory coalescing, bank conflicts, occupancy,
// register pressure, and races that this schedule happens to order (blocks never overlap here).
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
    unsigned x, y, z;
};

struct alignas(16) float4 {
    float x, y, z, w;
};

inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

struct alignas(8) uint2 {
    unsigned x, y;
};

inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }

namespace kiln_host {
struct Warp {
    std::unique_ptr<std::barrier<>> bar;
    unsigned char slot[32][8];
    // A tensor-core instruction's fragments, every lane's at once (`kiln_mma_half`).
    unsigned frag[32][6];
};
inline dim3 grid_dim, block_dim;
inline thread_local dim3 thread_idx, block_idx;
inline thread_local std::barrier<>* block_barrier;
inline thread_local Warp* warp;
inline thread_local unsigned lane;
}  // namespace kiln_host

#define threadIdx (kiln_host::thread_idx)
#define blockIdx (kiln_host::block_idx)
#define blockDim (kiln_host::block_dim)
#define gridDim (kiln_host::grid_dim)

#if defined(__x86_64__)
#define KILN_HOST_FIBERS 1
#include <cstdio>
#include <cstdlib>
// kiln_host_switch(save, to): saves the callee-saved registers, MXCSR and the x87 control word on
// the current stack, stores its pointer in *save, and resumes the stack `to` saved the same way.
// kiln_host_entry starts a fiber: its stack is prepared with the fiber in r12.
asm(R"(
    .text
    .p2align 4
    .globl kiln_host_switch
    .hidden kiln_host_switch
    .type kiln_host_switch, @function
kiln_host_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size kiln_host_switch, .-kiln_host_switch
    .globl kiln_host_entry
    .hidden kiln_host_entry
    .type kiln_host_entry, @function
kiln_host_entry:
    movq %r12, %rdi
    call kiln_host_fiber_main
    ud2
    .size kiln_host_entry, .-kiln_host_entry
)");
extern "C" void kiln_host_switch(void** save, void* to);
extern "C" void kiln_host_entry();

namespace kiln_host {
enum State : int { READY, WAIT_BLOCK, WAIT_WARP, DONE };
struct Fiber {
    void* sp;
    State state;
    unsigned tid;
};
inline thread_local void* scheduler_sp;
inline thread_local Fiber* current;
inline thread_local void (*fiber_body)(void**);
inline thread_local void** fiber_args;
inline void wait(State s) {
    current->state = s;
    kiln_host_switch(&current->sp, scheduler_sp);
}
}  // namespace kiln_host

// Defined once per translation unit (each unit is a library of its own); called from kiln_host_entry.
extern "C" __attribute__((used, visibility("hidden"))) void kiln_host_fiber_main(kiln_host::Fiber* f) {
    kiln_host::fiber_body(kiln_host::fiber_args);
    f->state = kiln_host::DONE;
    kiln_host_switch(&f->sp, kiln_host::scheduler_sp);
    std::abort();  // a finished fiber is never resumed
}

inline void __syncthreads() { kiln_host::wait(kiln_host::WAIT_BLOCK); }

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int d) {
    static_assert(sizeof(T) <= 8, "a shuffled value fits a slot");
    kiln_host::Warp* w = kiln_host::warp;
    std::memcpy(w->slot[kiln_host::lane], &v, sizeof(T));
    kiln_host::wait(kiln_host::WAIT_WARP);
    T r;
    std::memcpy(&r, w->slot[(kiln_host::lane ^ (unsigned)d) & 31u], sizeof(T));
    kiln_host::wait(kiln_host::WAIT_WARP);
    return r;
}
#else
inline void __syncthreads() { kiln_host::block_barrier->arrive_and_wait(); }

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int d) {
    static_assert(sizeof(T) <= 8, "a shuffled value fits a slot");
    kiln_host::Warp* w = kiln_host::warp;
    std::memcpy(w->slot[kiln_host::lane], &v, sizeof(T));
    w->bar->arrive_and_wait();
    T r;
    std::memcpy(&r, w->slot[(kiln_host::lane ^ (unsigned)d) & 31u], sizeof(T));
    w->bar->arrive_and_wait();
    return r;
}
#endif

// __shfl_sync(mask, v, src): lane `src`'s v (every lane of the warp takes part, as kiln's
// kernels call it), through the same slots and waits as __shfl_xor_sync.
#if KILN_HOST_FIBERS
template <class T>
inline T __shfl_sync(unsigned, T v, int src) {
    static_assert(sizeof(T) <= 8, "a shuffled value fits a slot");
    kiln_host::Warp* w = kiln_host::warp;
    std::memcpy(w->slot[kiln_host::lane], &v, sizeof(T));
    kiln_host::wait(kiln_host::WAIT_WARP);
    T r;
    std::memcpy(&r, w->slot[(unsigned)src & 31u], sizeof(T));
    kiln_host::wait(kiln_host::WAIT_WARP);
    return r;
}
#else
template <class T>
inline T __shfl_sync(unsigned, T v, int src) {
    static_assert(sizeof(T) <= 8, "a shuffled value fits a slot");
    kiln_host::Warp* w = kiln_host::warp;
    std::memcpy(w->slot[kiln_host::lane], &v, sizeof(T));
    w->bar->arrive_and_wait();
    T r;
    std::memcpy(&r, w->slot[(unsigned)src & 31u], sizeof(T));
    w->bar->arrive_and_wait();
    return r;
}
#endif

// Waits until every live lane of this warp has reached a warp-wide exchange (as a shuffle does).
namespace kiln_host {
inline void warp_wait() {
#if KILN_HOST_FIBERS
    wait(WAIT_WARP);
#else
    warp->bar->arrive_and_wait();
#endif
}
}  // namespace kiln_host

inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// The TF32 tensor-core path's two device functions (on a GPU, PTX in the generated source):
// kiln_tf32 rounds to TF32 as cvt.rna.tf32.f32 does (nearest, ties away from zero, 10 mantissa
// bits kept; NaN and infinity as they are), and kiln_mma_tf32 is mma.sync.aligned.m16n8k8.row.col
// .f32.tf32.tf32.f32 with d += a·b: lane l holds a = A[g][t], A[g+8][t], A[g][t+4], A[g+8][t+4],
// b = B[t][g], B[t+4][g] and d = D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1] (g = l / 4,
// t = l % 4). Here every lane gathers its rows and columns through shuffles and adds the eight
// products in k order with fused multiply-adds; the tensor cores add in an order of their own,
// so the two agree to rounding, not bitwise.
inline float kiln_tf32(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
    return __uint_as_float(u);
}
inline void kiln_mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    const int l = (int)(kiln_host::lane & 31u), g = l / 4, t = l % 4;
    for (int k = 0; k < 8; ++k) {
        const int src = k % 4;
        // A[g][k] and A[g+8][k] are in lane 4g + k%4 (registers 0/1 for k < 4, 2/3 above).
        const float a_lo = __uint_as_float(__shfl_sync(0xffffffffu, a[k < 4 ? 0 : 2], 4 * g + src));
        const float a_hi = __uint_as_float(__shfl_sync(0xffffffffu, a[k < 4 ? 1 : 3], 4 * g + src));
        // B[k][n] is in lane 4n + k%4 (register 0 for k < 4, 1 above).
        const float b0 = __uint_as_float(__shfl_sync(0xffffffffu, b[k < 4 ? 0 : 1], 4 * (2 * t) + src));
        const float b1 = __uint_as_float(__shfl_sync(0xffffffffu, b[k < 4 ? 0 : 1], 4 * (2 * t + 1) + src));
        d[0] = std::fma(a_lo, b0, d[0]);
        d[1] = std::fma(a_lo, b1, d[1]);
        d[2] = std::fma(a_hi, b0, d[2]);
        d[3] = std::fma(a_hi, b1, d[3]);
    }
}

// The half tensor-core path's device functions (`gemm/half_mma.rs`): kiln_pair reads two
// halves as one 32-bit register (the lower address in the lower half), and kiln_mma_bf16 and
// kiln_mma_f16 are mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 with
// d += a·b: lane l (g = l / 4, t = l % 4) holds in a[0..3] A[g][k], A[g+8][k] for k = 2t, 2t+1,
// then for k = 2t+8, 2t+9; in b[0..1] B[k][g] for k = 2t, 2t+1, then 2t+8, 2t+9; and
// d = D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]. Here every lane gathers its rows and
// columns from the warp's exchange and adds the sixteen products in k order (each exact in f32).
inline unsigned kiln_pair(const unsigned short* p) {
    unsigned u;
    std::memcpy(&u, p, 4);
    return u;
}
inline float kiln_host_half(unsigned bits, bool f16) {
    const unsigned h = bits & 0xffffu;
    if (!f16) return __uint_as_float(h << 16);
    const unsigned s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1fu) return __uint_as_float(s | 0x7f800000u | (m << 13));
    if (e == 0u) return __uint_as_float(s | __float_as_uint((float)m * (1.0f / 16777216.0f)));
    return __uint_as_float(s | ((e + 112u) << 23) | (m << 13));
}
inline void kiln_mma_half(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], bool f16) {
    const int l = (int)(kiln_host::lane & 31u), g = l / 4, t = l % 4;
    // Every lane's registers into the warp's exchange, read once all have written, kept until
    // all have read (two waits, where shuffles would take 128).
    unsigned (&frag)[32][6] = kiln_host::warp->frag;
    for (int r = 0; r < 4; ++r) frag[l][r] = a[r];
    frag[l][4] = b[0];
    frag[l][5] = b[1];
    kiln_host::warp_wait();
    unsigned av[16][2], bv[16][2];
    for (int k = 0; k < 16; ++k) {
        const int src = (k % 8) / 2, hi = k >= 8;
        // A[g][k] and A[g+8][k] are in lane 4g + (k%8)/2, registers 0/1 (k < 8) or 2/3.
        av[k][0] = frag[4 * g + src][hi ? 2 : 0];
        av[k][1] = frag[4 * g + src][hi ? 3 : 1];
        // B[k][n] is in lane 4n + (k%8)/2, register 0 (k < 8) or 1.
        bv[k][0] = frag[4 * (2 * t) + src][4 + hi];
        bv[k][1] = frag[4 * (2 * t + 1) + src][4 + hi];
    }
    kiln_host::warp_wait();
    for (int k = 0; k < 16; ++k) {
        const int shift = (k % 2) * 16;
        const unsigned a_lo = av[k][0], a_hi = av[k][1], b0 = bv[k][0], b1 = bv[k][1];
        const float x0 = kiln_host_half(a_lo >> shift, f16), x1 = kiln_host_half(a_hi >> shift, f16);
        const float y0 = kiln_host_half(b0 >> shift, f16), y1 = kiln_host_half(b1 >> shift, f16);
        d[0] = std::fma(x0, y0, d[0]);
        d[1] = std::fma(x0, y1, d[1]);
        d[2] = std::fma(x1, y0, d[2]);
        d[3] = std::fma(x1, y1, d[3]);
    }
}
inline void kiln_mma_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) { kiln_mma_half(d, a, b, false); }
inline void kiln_mma_f16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) { kiln_mma_half(d, a, b, true); }

inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline int __float_as_int(float f) {
    int i;
    std::memcpy(&i, &f, 4);
    return i;
}
// Compiled with -ffp-contract=off: a product is rounded before any sum, as __fmul_rn promises.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }

template <class T>
inline T atomicAdd(T* p, T v) {
    return std::atomic_ref<T>(*p).fetch_add(v);
}

namespace kiln_host {
#if KILN_HOST_FIBERS
// Runs `body` for every thread of every block of `grid` x `block`: a block's threads are fibers
// on this thread (stacks kept per host thread), scheduled until every one has returned.
inline void launch(dim3 grid, dim3 block, void (*body)(void**), void** args) {
    constexpr std::size_t STACK = 128 * 1024;
    static thread_local std::vector<std::unique_ptr<char[]>> stacks;
    grid_dim = grid;
    block_dim = block;
    fiber_body = body;
    fiber_args = args;
    const unsigned n = block.x * block.y * block.z;
    const unsigned blocks = grid.x * grid.y * grid.z;
    const unsigned nwarps = (n + 31) / 32;
    while (stacks.size() < n) stacks.emplace_back(new char[STACK]);
    std::vector<Fiber> fibers(n);
    std::vector<Warp> warps(nwarps);
    for (unsigned b = 0; b < blocks; ++b) {
        block_idx = dim3{b % grid.x, (b / grid.x) % grid.y, b / (grid.x * grid.y)};
        for (unsigned t = 0; t < n; ++t) {
            // The stack as kiln_host_switch leaves it: MXCSR and control word, r15..rbp, then
            // the return address kiln_host_entry (with the fiber in r12).
            auto top = (reinterpret_cast<std::uintptr_t>(stacks[t].get()) + STACK) & ~std::uintptr_t(15);
            auto* w = reinterpret_cast<std::uint64_t*>(top);
            w[-1] = reinterpret_cast<std::uint64_t>(&kiln_host_entry);
            w[-2] = 0;                                       // rbp
            w[-3] = 0;                                       // rbx
            w[-4] = reinterpret_cast<std::uint64_t>(&fibers[t]);  // r12
            w[-5] = 0;                                       // r13
            w[-6] = 0;                                       // r14
            w[-7] = 0;                                       // r15
            w[-8] = 0x1F80ull | (0x037Full << 32);           // MXCSR, x87 control word
            fibers[t] = Fiber{&w[-8], READY, t};
        }
        unsigned done = 0;
        while (done < n) {
            for (unsigned t = 0; t < n; ++t) {
                if (fibers[t].state != READY) continue;
                thread_idx = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
                warp = &warps[t / 32];
                lane = t % 32;
                current = &fibers[t];
                kiln_host_switch(&scheduler_sp, fibers[t].sp);
                if (fibers[t].state == DONE) ++done;
            }
            // Release every warp whose live lanes all wait at a shuffle, else the block once
            // every live thread waits at __syncthreads.
            bool released = false;
            for (unsigned w = 0; w < nwarps; ++w) {
                const unsigned lo = w * 32, hi = lo + 32 < n ? lo + 32 : n;
                bool all = true, any = false;
                for (unsigned t = lo; t < hi; ++t) {
                    if (fibers[t].state == DONE) continue;
                    any = true;
                    all = all && fibers[t].state == WAIT_WARP;
                }
                if (any && all) {
                    for (unsigned t = lo; t < hi; ++t)
                        if (fibers[t].state == WAIT_WARP) fibers[t].state = READY;
                    released = true;
                }
            }
            if (released || done == n) continue;
            bool all = true;
            for (unsigned t = 0; t < n; ++t) all = all && (fibers[t].state == DONE || fibers[t].state == WAIT_BLOCK);
            if (!all) {
                std::fprintf(stderr, "kiln host CUDA: threads of a block wait at different barriers (a deadlock on a GPU)\n");
                std::abort();
            }
            for (unsigned t = 0; t < n; ++t)
                if (fibers[t].state == WAIT_BLOCK) fibers[t].state = READY;
        }
    }
}
#else
// Runs `body` for every thread of every block of `grid` x `block`: blockDim host threads, each
// running its thread of every block in turn; a barrier between blocks (whose completion makes
// the next block's barriers) keeps one block's __shared__ statics from the next.
inline void launch(dim3 grid, dim3 block, void (*body)(void**), void** args) {
    grid_dim = grid;
    block_dim = block;
    const unsigned n = block.x * block.y * block.z;
    const unsigned blocks = grid.x * grid.y * grid.z;
    std::unique_ptr<std::barrier<>> bar;
    std::vector<Warp> warps((n + 31) / 32);
    auto fresh = [&]() noexcept {
        bar = std::make_unique<std::barrier<>>((std::ptrdiff_t)n);
        for (unsigned w = 0; w < warps.size(); ++w) {
            const unsigned size = (w + 1) * 32 <= n ? 32 : n - w * 32;
            warps[w].bar = std::make_unique<std::barrier<>>((std::ptrdiff_t)size);
        }
    };
    fresh();
    std::barrier block_end((std::ptrdiff_t)n, fresh);
    std::vector<std::thread> threads;
    threads.reserve(n);
    for (unsigned t = 0; t < n; ++t) {
        threads.emplace_back([&, t] {
            thread_idx = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            warp = &warps[t / 32];
            lane = t % 32;
            for (unsigned b = 0; b < blocks; ++b) {
                block_idx = dim3{b % grid.x, (b / grid.x) % grid.y, b / (grid.x * grid.y)};
                block_barrier = bar.get();
                body(args);
                // A thread that is done no longer holds the others at a barrier.
                warp->bar->arrive_and_drop();
                block_barrier->arrive_and_drop();
                block_end.arrive_and_wait();
            }
        });
    }
    for (auto& th : threads) th.join();
}
#endif

// For kernels that never synchronise a block (no __syncthreads, no warp shuffle): every thread of
// every block in turn on the calling thread. With no barrier in the kernel, one thread running to
// completion before the next starts is a schedule CUDA allows.
inline void launch_serial(dim3 grid, dim3 block, void (*body)(void**), void** args) {
    grid_dim = grid;
    block_dim = block;
    const unsigned n = block.x * block.y * block.z;
    const unsigned blocks = grid.x * grid.y * grid.z;
    for (unsigned b = 0; b < blocks; ++b) {
        block_idx = dim3{b % grid.x, (b / grid.x) % grid.y, b / (grid.x * grid.y)};
        for (unsigned t = 0; t < n; ++t) {
            thread_idx = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            lane = t % 32;
            body(args);
        }
    }
}

template <class... P, std::size_t... I>
void call(void (*f)(P...), void** args, std::index_sequence<I...>) {
    f(static_cast<P>(args[I])...);
}

// Calls kernel `f` with its pointer parameters taken from `args`, in order.
template <class... P>
void call(void (*f)(P...), void** args) {
    call(f, args, std::index_sequence_for<P...>{});
}
}  // namespace kiln_host
