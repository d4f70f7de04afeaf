// Paged grouped-query attention over the device KV pool, reading K/V through block tables.
//
// The same two kernels serve prefill and decode (as on the CPU, one code path):
// `paged_attention` computes, for one work item (a sequence, a KV head, a tile of query
// tokens and one split of the keys), an online-softmax partial result per query row and
// head (running max m, running sum l, unnormalised weighted values acc); `attn_combine`
// merges each row's partials over its splits and normalises. Decode steps split a long
// context over many thread blocks (flash-decoding: split-K, then combine); prefill tiles
// query tokens so that each K/V block staged in shared memory serves a tile × the GQA group.
// The host plans the items (attention.rs); a sequence's visible keys are stored indices
// 0..stored_start + t + 1 for its t-th new token, so evicted blocks need no special case:
// the block table is compacted and stored_start counts what is left.
//
// Sequence descriptor (6 ints): table_offset, stored_start, n_queries, row_offset,
// n_splits, keys_per_split (a multiple of block_size).
// Work item (4 ints): seq, kv_head, first query token of the tile, split.
// Threads: one warp per (token, head) row of the tile: 32 * tile_tokens * group.
// Queries: row r's heads start at q + r * q_row_stride (the fused QKV GEMM's output).
// Partials: [split][row][head][head_dim + 2] floats (acc, then m, then l).

#define PK_MAX_PER_LANE 8  // head_dim up to 256

// At most 16 row warps (attention.rs, MAX_ROWS_PER_BLOCK): the bound keeps registers within
// what a 512-thread block may use.
extern "C" __global__ void __launch_bounds__(512) paged_attention(
    const float* __restrict__ q, int q_row_stride, const u16* __restrict__ k_pool, const u16* __restrict__ v_pool,
    const int* __restrict__ block_tables, const int* __restrict__ seqs, const int* __restrict__ items,
    float* __restrict__ partial, int n_heads, int n_kv_heads, int head_dim, int block_size,
    int tile_tokens, int n_rows_total, float scale) {
    PK_DYNAMIC_SHARED(float, smem);
    float* ks = smem;                            // [block_size][head_dim] of one KV head
    float* vs = smem + block_size * head_dim;    // the same for V

    const int* it = items + 4 * blockIdx.x;
    const int si = it[0], kv_head = it[1], t0 = it[2], split = it[3];
    const int* sd = seqs + 6 * si;
    const int table_offset = sd[0], stored_start = sd[1], n_queries = sd[2], row_offset = sd[3];
    const int keys_per_split = sd[5];

    const int group = n_heads / n_kv_heads;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = t0 + warp / group, g = warp % group;
    const int t_end = min(t0 + tile_tokens, n_queries);
    const bool active = t < t_end;
    const int head = kv_head * group + g;
    const int row = row_offset + t;
    const int n_visible = active ? stored_start + t + 1 : 0;

    // Keys of this split that any row of the tile can see (the tile's last token sees most).
    const int k_begin = split * keys_per_split;
    const int k_end = min(k_begin + keys_per_split, stored_start + t_end);
    const int per_lane = head_dim >> 5;

    float qv[PK_MAX_PER_LANE], acc[PK_MAX_PER_LANE];
#pragma unroll
    for (int i = 0; i < PK_MAX_PER_LANE; i++) {
        qv[i] = (active && i < per_lane) ? q[(size_t)row * q_row_stride + head * head_dim + lane + 32 * i] * scale : 0.0f;
        acc[i] = 0.0f;
    }
    float m = PK_NEG_INF, l = 0.0f;

    const size_t head_elems = (size_t)block_size * head_dim;
    for (int kb = k_begin; kb < k_end; kb += block_size) {
        const int block = block_tables[table_offset + kb / block_size];
        const u16* kp = k_pool + ((size_t)block * n_kv_heads + kv_head) * head_elems;
        const u16* vp = v_pool + ((size_t)block * n_kv_heads + kv_head) * head_elems;
        const int n_in = min(block_size, k_end - kb);
        __syncthreads();  // every warp is done with the previous block
        for (int i = threadIdx.x; i < n_in * head_dim; i += blockDim.x) {
            ks[i] = f16_to_f32(kp[i]);
            vs[i] = f16_to_f32(vp[i]);
        }
        __syncthreads();
        // The same count on every lane of a warp, so the shuffles in warp_sum are uniform.
        const int n_mine = min(n_in, n_visible - kb);
        for (int j = 0; j < n_mine; j++) {
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < PK_MAX_PER_LANE; i++) {
                if (i < per_lane) s += qv[i] * ks[j * head_dim + lane + 32 * i];
            }
            s = warp_sum(s);
            const float m_new = fmaxf(m, s);
            const float corr = expf(m - m_new);
            const float p = expf(s - m_new);
            l = l * corr + p;
#pragma unroll
            for (int i = 0; i < PK_MAX_PER_LANE; i++) {
                if (i < per_lane) acc[i] = acc[i] * corr + p * vs[j * head_dim + lane + 32 * i];
            }
            m = m_new;
        }
    }
    if (active) {
        float* out = partial + (((size_t)split * n_rows_total + row) * n_heads + head) * (head_dim + 2);
#pragma unroll
        for (int i = 0; i < PK_MAX_PER_LANE; i++) {
            if (i < per_lane) out[lane + 32 * i] = acc[i];
        }
        if (lane == 0) {
            out[head_dim] = m;
            out[head_dim + 1] = l;
        }
    }
}

// out[row][head] = merge of the row's n_splits partials, normalised, as act_t (the input of
// the output projection). One block of head_dim threads per (row, head). Split 0 always
// holds key 0, which every row sees, so the merged maximum is finite.
extern "C" __global__ void attn_combine(const float* __restrict__ partial, const int* __restrict__ row_splits,
                                       act_t* __restrict__ out, int n_heads, int head_dim, int n_rows_total) {
    const int row = blockIdx.x / n_heads, head = blockIdx.x % n_heads;
    const int n_splits = row_splits[row];
    const size_t stride = (size_t)n_rows_total * n_heads * (head_dim + 2);
    const float* p0 = partial + ((size_t)row * n_heads + head) * (head_dim + 2);
    float m_max = PK_NEG_INF;
    for (int s = 0; s < n_splits; s++) {
        m_max = fmaxf(m_max, p0[s * stride + head_dim]);
    }
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float l = 0.0f, a = 0.0f;
        for (int s = 0; s < n_splits; s++) {
            const float* p = p0 + s * stride;
            const float m = p[head_dim];
            const float w = (m == PK_NEG_INF) ? 0.0f : expf(m - m_max);
            l += w * p[head_dim + 1];
            a += w * p[d];
        }
        out[(size_t)row * n_heads * head_dim + head * head_dim + d] = f32_to_act(a / l);
    }
}
