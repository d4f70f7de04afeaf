// Shared definitions for every pagekeeper CUDA kernel. The Rust side prepends this file to
// each kernel source before NVRTC compiles it.
//
// No headers are included, not even cuda_fp16.h: half and bfloat16 values travel as raw
// 16-bit words and are converted with PTX instructions or bit operations here, so that the
// sources compile with nothing but libnvrtc (the compile check runs on machines without a
// CUDA toolkit, and NVRTC's own header set differs between versions).
//
// `act_t` is the element type of GEMM operands (weights and the activations fed to cuBLAS):
// IEEE half by default, bfloat16 when the module is compiled with -DPK_ACT_BF16. The KV
// pool is always IEEE half, like the CPU store's default f16.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned char u8;
typedef unsigned long long u64;

#define PK_NEG_INF (__int_as_float(0xff800000))

#ifndef PK_HOST_EMU
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Dynamically sized shared memory of a kernel (the launch's shared_bytes).
#define PK_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#else
// The host emulator (crates/cuda/emu) supplies f16_to_f32, f32_to_f16 and shared memory.
#define PK_DYNAMIC_SHARED(type, name) type* name = (type*)pk_emu_dynamic_shared()
#endif

__device__ __forceinline__ float bf16_to_f32(u16 b) {
    return __uint_as_float(((u32)b) << 16);
}

// Round to nearest even, as `half::bf16::from_f32` does on the CPU; NaN stays NaN.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

#ifdef PK_ACT_BF16
typedef u16 act_t;
__device__ __forceinline__ float act_to_f32(act_t x) { return bf16_to_f32(x); }
__device__ __forceinline__ act_t f32_to_act(float x) { return f32_to_bf16(x); }
#else
typedef u16 act_t;
__device__ __forceinline__ float act_to_f32(act_t x) { return f16_to_f32(x); }
__device__ __forceinline__ act_t f32_to_act(float x) { return f32_to_f16(x); }
#endif

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

// Sum over the whole thread block; `scratch` holds at least 32 floats of shared memory.
// Every thread gets the total. Callers must reach it from every thread of the block.
__device__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    v = (lane < n_warps) ? scratch[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}
