// Bulk moves of stored tokens between a staging buffer and the paged pool: the device half
// of restoring a context or a tier's chunk (`kv_scatter`) and of reading one out
// (`kv_gather`); transfer.rs stages the bytes through pinned host buffers.
//
// Staging layout: [layer][K, then V][kv_head][token][head_dim], over `n_layers` layers from
// the one whose K and V bases `k_pool` and `v_pool` point at (`layer_stride_pairs` apart),
// and `n` tokens whose stored indices start at `first`. Stored token t lives at slot
// t % block_size of block table[t / block_size], pool layout per layer
// [block][kv_head][slot][head_dim], as `kv_write` writes it. Values move as 32-bit pairs of
// f16 (head_dim is even and every row starts at an even element), untouched: a restored
// row is the stored row bit for bit.

__device__ __forceinline__ size_t kv_transfer_pool_at(long long e, int n, int n_kv_heads, int hp, int block_size,
                                                      const int* table, int first, long long layer_stride_pairs,
                                                      int* side) {
    long long r = e / hp;
    const int d = (int)(e % hp);
    const int i = (int)(r % n);
    r /= n;
    const int h = (int)(r % n_kv_heads);
    r /= n_kv_heads;
    *side = (int)(r % 2);
    const long long l = r / 2;
    const int t = first + i;
    return (size_t)(l * layer_stride_pairs) +
           (((size_t)table[t / block_size] * n_kv_heads + h) * block_size + t % block_size) * hp + d;
}

extern "C" __global__ void kv_scatter(const u32* __restrict__ staging, u32* __restrict__ k_pool,
                                      u32* __restrict__ v_pool, long long layer_stride_pairs, int n_layers,
                                      const int* __restrict__ table, int first, int n, int n_kv_heads,
                                      int head_dim, int block_size) {
    const int hp = head_dim / 2;
    const long long total = (long long)n_layers * 2 * n_kv_heads * n * hp;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (long long)gridDim.x * blockDim.x) {
        int side;
        const size_t at = kv_transfer_pool_at(e, n, n_kv_heads, hp, block_size, table, first, layer_stride_pairs, &side);
        (side ? v_pool : k_pool)[at] = staging[e];
    }
}

extern "C" __global__ void kv_gather(u32* __restrict__ staging, const u32* __restrict__ k_pool,
                                     const u32* __restrict__ v_pool, long long layer_stride_pairs, int n_layers,
                                     const int* __restrict__ table, int first, int n, int n_kv_heads,
                                     int head_dim, int block_size) {
    const int hp = head_dim / 2;
    const long long total = (long long)n_layers * 2 * n_kv_heads * n * hp;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (long long)gridDim.x * blockDim.x) {
        int side;
        const size_t at = kv_transfer_pool_at(e, n, n_kv_heads, hp, block_size, table, first, layer_stride_pairs, &side);
        staging[e] = (side ? v_pool : k_pool)[at];
    }
}
