// kiln's host runtime for generated CUDA C: the built-ins a kernel uses, mapped onto host threads,
// so that the tests can compile every generated kernel with the system C++ compiler, launch it
// with its grid and block on small inputs, and compare it with the CPU kernel.
//
// A block runs as blockDim host threads at once (so __syncthreads and warp shuffles synchronise
// real threads), blocks one after another on the same threads (so __shared__ arrays, mapped to
// function statics, are the block's own). What it cannot see: timing, memory coalescing, bank conflicts, occupancy,
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

struct dim3 {
    unsigned x, y, z;
};

struct alignas(16) float4 {
    float x, y, z, w;
};

inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

namespace kiln_host {
struct Warp {
    std::unique_ptr<std::barrier<>> bar;
    unsigned char slot[32][8];
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

template <class T>
inline T atomicAdd(T* p, T v) {
    return std::atomic_ref<T>(*p).fetch_add(v);
}

namespace kiln_host {
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
