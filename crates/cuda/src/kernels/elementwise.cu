// Row-wise and element-wise kernels of the Llama forward pass. Each mirrors a CPU function
// in pk-model (named beside it) and keeps its order of operations where that is cheap, so
// that the two agree to rounding.

// out[r] = x[rows[r]] * w / sqrt(mean(x[rows[r]]^2) + eps), as `kernels::ops::rmsnorm`.
// `rows` may be null (row r reads row r). One block per output row.
extern "C" __global__ void rmsnorm(const float* __restrict__ x, const float* __restrict__ w,
                                   act_t* __restrict__ out, const int* __restrict__ rows,
                                   int d, float eps) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    const float* xr = x + (size_t)(rows ? rows[r] : r) * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        ss += xr[i] * xr[i];
    }
    ss = block_sum(ss, scratch);
    const float scale = 1.0f / sqrtf(ss / (float)d + eps);
    act_t* o = out + (size_t)r * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        o[i] = f32_to_act(xr[i] * scale * w[i]);
    }
}

// Rotates every head of row r of `x` (f32, `n_heads * head_dim` values starting at
// x + r * row_stride) by the angles of positions[r], as `Llama::rope`: pairs (2i, 2i+1)
// when neox == 0, (i, i + head_dim/2) otherwise; angle = position * inv_freq[i] in f32.
extern "C" __global__ void rope(float* __restrict__ x, int row_stride, const int* __restrict__ positions,
                                const float* __restrict__ inv_freq, int n_heads, int head_dim,
                                int neox) {
    const int r = blockIdx.x;
    const int half_dim = head_dim / 2;
    const float pos = (float)positions[r];
    float* xr = x + (size_t)r * row_stride;
    for (int idx = threadIdx.x; idx < n_heads * half_dim; idx += blockDim.x) {
        const int head = idx / half_dim, i = idx % half_dim;
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        const int a = neox ? i : 2 * i;
        const int b = neox ? i + half_dim : 2 * i + 1;
        float* h = xr + head * head_dim;
        const float x0 = h[a], x1 = h[b];
        h[a] = x0 * c - x1 * s;
        h[b] = x0 * s + x1 * c;
    }
}

// out[r][i] = silu(gate) * up = gate / (1 + exp(-gate)) * up, as `silu_mul_in_place`, where
// row r of `gate_up` holds d_ff gate values then d_ff up values (one fused GEMM makes both).
extern "C" __global__ void swiglu(const float* __restrict__ gate_up, act_t* __restrict__ out,
                                  int n_rows, int d_ff) {
    const long long n = (long long)n_rows * d_ff;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / d_ff, c = i % d_ff;
        const float g = gate_up[r * 2 * d_ff + c];
        const float u = gate_up[r * 2 * d_ff + d_ff + c];
        out[i] = f32_to_act(g / (1.0f + expf(-g)) * u);
    }
}

// x[r] = table[tokens[r]] in f32. One block per row.
extern "C" __global__ void embed(const act_t* __restrict__ table, const int* __restrict__ tokens,
                                 float* __restrict__ x, int d) {
    const int r = blockIdx.x;
    const act_t* src = table + (size_t)tokens[r] * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        x[(size_t)r * d + i] = act_to_f32(src[i]);
    }
}

// Index of the largest value of each row (the lowest index among equal maxima), for greedy
// decoding without copying logits to the host. One block of 1024 threads per row.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int vocab,
                                       int* __restrict__ out) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float v = PK_NEG_INF;
    int at = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        if (row[i] > v) {
            v = row[i];
            at = i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, at, o);
        if (ov > v || (ov == v && oi < at)) {
            v = ov;
            at = oi;
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        best_v[warp] = v;
        best_i[warp] = at;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)((blockDim.x + 31) >> 5); w++) {
            if (best_v[w] > v || (best_v[w] == v && best_i[w] < at)) {
                v = best_v[w];
                at = best_i[w];
            }
        }
        out[blockIdx.x] = at;
    }
}

// Writes each new token's K and V (f32, `n_kv_heads * head_dim` values at k + r * row_stride
// and v + r * row_stride) into the paged pool as f16 at physical slot
// slots[r] = block * block_size + slot. Pool layout per layer: [block][kv_head][slot][head_dim]
// for K and V alike.
extern "C" __global__ void kv_write(const float* __restrict__ k, const float* __restrict__ v, int row_stride,
                                   u16* __restrict__ k_pool, u16* __restrict__ v_pool,
                                   const int* __restrict__ slots, int n_kv_heads, int head_dim,
                                   int block_size) {
    const int r = blockIdx.x;
    const int slot = slots[r];
    const int block = slot / block_size, in_block = slot % block_size;
    const int kv_dim = n_kv_heads * head_dim;
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        const int h = i / head_dim, d = i % head_dim;
        const size_t dst = (((size_t)block * n_kv_heads + h) * block_size + in_block) * head_dim + d;
        k_pool[dst] = f32_to_f16(k[(size_t)r * row_stride + i]);
        v_pool[dst] = f32_to_f16(v[(size_t)r * row_stride + i]);
    }
}

// The decode-step fusion of `rope` on Q, `rope` on K and `kv_write`: row r of `qkv` holds
// n_heads Q heads, then n_kv_heads K heads, then n_kv_heads V heads (the fused QKV GEMM's
// output). Q is rotated in place; K is rotated and, with V, written to the pool at slots[r]
// as f16. One launch instead of three per layer (a decode step is launch-bound at small
// batches); tested against the three kernels it replaces.
extern "C" __global__ void rope_kv_write(float* __restrict__ qkv, int row_stride, const int* __restrict__ positions,
                                        const float* __restrict__ inv_freq, int n_heads, int n_kv_heads,
                                        int head_dim, int neox, u16* __restrict__ k_pool,
                                        u16* __restrict__ v_pool, const int* __restrict__ slots,
                                        int block_size) {
    const int r = blockIdx.x;
    const int half_dim = head_dim / 2;
    const float pos = (float)positions[r];
    float* row = qkv + (size_t)r * row_stride;
    const int slot = slots[r];
    const int block = slot / block_size, in_block = slot % block_size;
    for (int idx = threadIdx.x; idx < (n_heads + n_kv_heads) * half_dim; idx += blockDim.x) {
        const int head = idx / half_dim, i = idx % half_dim;
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        const int a = neox ? i : 2 * i;
        const int b = neox ? i + half_dim : 2 * i + 1;
        float* h = row + head * head_dim;  // K heads follow the Q heads
        const float x0 = h[a], x1 = h[b];
        const float y0 = x0 * c - x1 * s, y1 = x0 * s + x1 * c;
        h[a] = y0;
        h[b] = y1;
        if (head >= n_heads) {
            const size_t base = (((size_t)block * n_kv_heads + (head - n_heads)) * block_size + in_block) * head_dim;
            k_pool[base + a] = f32_to_f16(y0);
            k_pool[base + b] = f32_to_f16(y1);
        }
    }
    const float* v = row + (n_heads + n_kv_heads) * head_dim;
    for (int i = threadIdx.x; i < n_kv_heads * head_dim; i += blockDim.x) {
        const int h = i / head_dim, d = i % head_dim;
        v_pool[(((size_t)block * n_kv_heads + h) * block_size + in_block) * head_dim + d] = f32_to_f16(v[i]);
    }
}

// Uniform values in [-scale, scale) from a hash of (seed, index): random weights made on
// the device, so that a model of Llama-3.1-8B's shape never exists on the host.
extern "C" __global__ void random_fill(act_t* __restrict__ dst, long long n, u64 seed, float scale) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        // splitmix64 of the index, keyed by the seed.
        u64 z = (u64)i + seed * 0x9e3779b97f4a7c15ull;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        const float u = (float)(z >> 40) * (1.0f / 16777216.0f);
        dst[i] = f32_to_act((2.0f * u - 1.0f) * scale);
    }
}
