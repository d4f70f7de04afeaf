// Dequantisation of GGUF weight blocks into `act_t`, once at load time, exactly as
// pk-gguf's scalar reference (`dequant.rs`, itself ggml's `dequantize_row_*`) up to the
// final rounding to act_t. One thread per output element: load time is not a hot path,
// and this keeps every format a few lines. A tensor's rows are whole blocks, so a matrix is
// one flat run of blocks and `n` counts its elements.

__device__ __forceinline__ float le_f16(const u8* p) {
    return f16_to_f32((u16)(p[0] | (p[1] << 8)));
}

// Q4_0: 18 bytes per 32 values: f16 d, 16 bytes of nibbles; value = (q - 8) * d.
extern "C" __global__ void dequant_q4_0(const u8* __restrict__ src, act_t* __restrict__ dst, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const u8* b = src + (i / 32) * 18;
        const int j = (int)(i % 32);
        const int q = j < 16 ? (b[2 + j] & 0x0f) : (b[2 + j - 16] >> 4);
        dst[i] = f32_to_act((float)(q - 8) * le_f16(b));
    }
}

// Q4_1: 20 bytes per 32 values: f16 d, f16 m, 16 bytes of nibbles; value = q * d + m.
extern "C" __global__ void dequant_q4_1(const u8* __restrict__ src, act_t* __restrict__ dst, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const u8* b = src + (i / 32) * 20;
        const int j = (int)(i % 32);
        const int q = j < 16 ? (b[4 + j] & 0x0f) : (b[4 + j - 16] >> 4);
        dst[i] = f32_to_act((float)q * le_f16(b) + le_f16(b + 2));
    }
}

// Q8_0: 34 bytes per 32 values: f16 d, 32 signed bytes; value = q * d.
extern "C" __global__ void dequant_q8_0(const u8* __restrict__ src, act_t* __restrict__ dst, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const u8* b = src + (i / 32) * 34;
        const int j = (int)(i % 32);
        dst[i] = f32_to_act((float)(signed char)b[2 + j] * le_f16(b));
    }
}

// F16, BF16 and F32 element by element.
extern "C" __global__ void dequant_f16(const u16* __restrict__ src, act_t* __restrict__ dst, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        dst[i] = f32_to_act(f16_to_f32(src[i]));
    }
}

extern "C" __global__ void dequant_bf16(const u16* __restrict__ src, act_t* __restrict__ dst, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        dst[i] = f32_to_act(bf16_to_f32(src[i]));
    }
}

extern "C" __global__ void dequant_f32(const float* __restrict__ src, act_t* __restrict__ dst, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        dst[i] = f32_to_act(src[i]);
    }
}
