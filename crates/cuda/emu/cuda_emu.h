// A minimal host emulator of the CUDA execution model, so that pagekeeper's kernels
// (crates/cuda/src/kernels/*.cu, unchanged) run on a CPU and their logic (indexing, block
// tables, split-K merging, barriers) can be tested on machines without a GPU.
//
// Each thread block runs as blockDim.x OS threads at once, blocks one after another.
// __syncthreads is a barrier of the block's threads; __shfl_xor_sync exchanges values among
// the 32 threads of a warp through a per-warp buffer between two warp barriers. Static
// __shared__ arrays become function statics (blocks never overlap, so one copy serves);
// dynamic shared memory is a per-block buffer. What this cannot show: speed, coalescing,
// and anything that depends on warps running in lockstep (the kernels rely on none).

#pragma once

#include <immintrin.h>

#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define PK_HOST_EMU 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(n)

struct Dim3 {
    unsigned x = 0, y = 0, z = 0;
};
inline thread_local Dim3 threadIdx, blockIdx;
inline Dim3 blockDim, gridDim;

struct EmuBlock {
    std::unique_ptr<std::barrier<>> block_barrier;
    std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
    std::vector<std::array<uint64_t, 32>> warp_slots;
    std::vector<unsigned char> dynamic_shared;
};
inline EmuBlock* g_block = nullptr;

inline void* pk_emu_dynamic_shared() { return g_block->dynamic_shared.data(); }

inline void __syncthreads() { g_block->block_barrier->arrive_and_wait(); }

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
    static_assert(sizeof(T) <= 8, "one slot per lane");
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    auto& slots = g_block->warp_slots[warp];
    std::memcpy(&slots[lane], &v, sizeof(T));
    g_block->warp_barriers[warp]->arrive_and_wait();
    T out;
    std::memcpy(&out, &slots[lane ^ (unsigned)lane_mask], sizeof(T));
    g_block->warp_barriers[warp]->arrive_and_wait();
    return out;
}

inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

// IEEE half conversions with round-to-nearest-even, as the device's cvt.rn.f16.f32.
inline float f16_to_f32(unsigned short h) { return _cvtsh_ss(h); }
inline unsigned short f32_to_f16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

// Runs `kernel(args...)` over `grid` blocks of `block` threads with `shared_bytes` of
// dynamic shared memory. `block` must be a multiple of 32 (every launch here is).
template <class... P, class... A>
void emu_launch(void (*kernel)(P...), unsigned grid, unsigned block, size_t shared_bytes, A... args) {
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    for (unsigned b = 0; b < grid; b++) {
        EmuBlock ctx;
        ctx.block_barrier = std::make_unique<std::barrier<>>(block);
        for (unsigned w = 0; w < block / 32; w++) {
            ctx.warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
        }
        ctx.warp_slots.resize(block / 32);
        ctx.dynamic_shared.assign(shared_bytes + 16, 0xcd);  // poison: reads before writes show
        g_block = &ctx;
        std::vector<std::thread> threads;
        threads.reserve(block);
        for (unsigned t = 0; t < block; t++) {
            threads.emplace_back([&, t] {
                threadIdx = {t, 0, 0};
                blockIdx = {b, 0, 0};
                kernel(static_cast<P>(args)...);
            });
        }
        for (auto& th : threads) th.join();
        g_block = nullptr;
    }
}
