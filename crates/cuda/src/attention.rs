//! Host-side planning of paged attention (`kernels/attention.cu`): which thread block
//! computes which sequence, KV head, tile of query tokens and split of the keys.
//!
//! Decode steps have one query token per sequence, so without splitting a batch-1 step
//! would run `n_kv_heads` thread blocks on a GPU of 132 multiprocessors. When the tiles of
//! a call number fewer than two per multiprocessor, each sequence's keys are split into
//! ranges of whole blocks (flash-decoding) and `attn_combine` merges the partial softmaxes.
//! Prefill-sized calls have tiles enough and use one split. The plan depends only on the
//! call's shapes, never on the data.

use pk_model::SeqForward;

use crate::CudaError;

/// Upper bound on splits per sequence; bounds the partials buffer.
pub const MAX_SPLITS: usize = 64;

/// Query-row warps per thread block at most (a tile of tokens × the GQA group).
const MAX_ROWS_PER_BLOCK: usize = 16;

/// Everything the attention kernels read besides Q and the pool, as i32 arrays.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AttnPlan {
    /// Per sequence: table_offset, stored_start, n_queries, row_offset, n_splits, keys_per_split.
    pub seqs: Vec<i32>,
    /// Per thread block: seq, kv_head, first query token of the tile, split.
    pub items: Vec<i32>,
    /// Per query row: its sequence's split count.
    pub row_splits: Vec<i32>,
    /// Every sequence's block table, concatenated.
    pub tables: Vec<i32>,
    pub max_splits: usize,
    pub tile_tokens: usize,
    pub threads_per_block: u32,
}

/// Plans one attention call over `seqs` (rows in order, as the forward pass lays them out).
/// `target_blocks` is how many thread blocks keep the GPU busy (two per multiprocessor).
pub fn plan(
    seqs: &[SeqForward],
    n_heads: usize,
    n_kv_heads: usize,
    block_size: usize,
    target_blocks: usize,
) -> Result<AttnPlan, CudaError> {
    let group = n_heads.checked_div(n_kv_heads).unwrap_or(0);
    // One warp per query head of the group, and `paged_attention` is compiled with
    // __launch_bounds__(512): a group of more than 16 heads cannot be launched.
    if group == 0 || group > MAX_ROWS_PER_BLOCK || group * n_kv_heads != n_heads {
        return Err(CudaError::Unsupported(format!(
            "{n_heads} query heads over {n_kv_heads} KV heads"
        )));
    }
    let tile_tokens = (MAX_ROWS_PER_BLOCK / group).max(1);
    let tiles: usize = seqs
        .iter()
        .map(|s| n_kv_heads * s.tokens.len().div_ceil(tile_tokens))
        .sum();
    let want_splits = if tiles >= target_blocks {
        1
    } else {
        target_blocks.div_ceil(tiles.max(1))
    };
    let mut p = AttnPlan {
        tile_tokens,
        threads_per_block: (32 * tile_tokens * group) as u32,
        max_splits: 1,
        ..Default::default()
    };
    let mut row = 0usize;
    for (si, s) in seqs.iter().enumerate() {
        let n_q = s.tokens.len();
        let visible = s.stored_start + n_q;
        if n_q > 0 && visible.div_ceil(block_size) > s.block_table.len() {
            return Err(CudaError::Unsupported(format!(
                "sequence {si}: block table of {} blocks covers fewer than its {visible} stored tokens",
                s.block_table.len()
            )));
        }
        // At least two blocks per split, so that a split is worth its share of the combine.
        let splits = want_splits
            .min(visible.div_ceil(2 * block_size))
            .clamp(1, MAX_SPLITS);
        let keys_per_split = visible.div_ceil(splits).div_ceil(block_size).max(1) * block_size;
        let splits = visible.div_ceil(keys_per_split).max(1);
        p.max_splits = p.max_splits.max(splits);
        p.seqs.extend([
            p.tables.len() as i32,
            s.stored_start as i32,
            n_q as i32,
            row as i32,
            splits as i32,
            keys_per_split as i32,
        ]);
        p.tables.extend(s.block_table.iter().map(|&b| b as i32));
        for kv_head in 0..n_kv_heads {
            for t0 in (0..n_q).step_by(tile_tokens) {
                for split in 0..splits {
                    p.items
                        .extend([si as i32, kv_head as i32, t0 as i32, split as i32]);
                }
            }
        }
        p.row_splits.extend(std::iter::repeat_n(splits as i32, n_q));
        row += n_q;
    }
    Ok(p)
}

impl AttnPlan {
    pub fn n_items(&self) -> usize {
        self.items.len() / 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq<'a>(tokens: &'a [u32], stored_start: usize, table: &'a [u32]) -> SeqForward<'a> {
        SeqForward {
            tokens,
            start_position: stored_start,
            stored_start,
            block_table: table,
            logits_from: 0,
            stored_positions: &[],
            window_tables: &[],
            head_first_keys: &[],
        }
    }

    /// Every row's visible keys are covered by exactly one split of its sequence, and every
    /// (row, head) pair is produced by exactly one item per split.
    fn check_coverage(p: &AttnPlan, seqs: &[SeqForward], n_heads: usize, n_kv_heads: usize) {
        let group = n_heads / n_kv_heads;
        for (si, s) in seqs.iter().enumerate() {
            let d = &p.seqs[6 * si..6 * si + 6];
            let (splits, kps) = (d[4] as usize, d[5] as usize);
            let visible = s.stored_start + s.tokens.len();
            assert!(
                splits * kps >= visible && (splits - 1) * kps < visible,
                "splits {splits} × {kps} vs {visible} keys"
            );
            let mut seen = vec![0usize; s.tokens.len() * n_heads * splits];
            for it in p.items.chunks_exact(4).filter(|it| it[0] as usize == si) {
                let (kvh, t0, split) = (it[1] as usize, it[2] as usize, it[3] as usize);
                for t in t0..(t0 + p.tile_tokens).min(s.tokens.len()) {
                    for g in 0..group {
                        seen[(t * n_heads + kvh * group + g) * splits + split] += 1;
                    }
                }
            }
            assert!(
                seen.iter().all(|&c| c == 1),
                "sequence {si}: some (row, head, split) computed {:?} times",
                seen.iter().max()
            );
        }
    }

    #[test]
    fn batch1_decode_splits_a_long_context_and_prefill_does_not() {
        let table: Vec<u32> = (0..200).collect();
        let one = [7u32];
        let d = [seq(&one, 2047, &table)];
        let p = plan(&d, 32, 8, 16, 264).unwrap();
        assert!(
            p.max_splits > 1,
            "batch-1 decode at 2048 keys should split: {p:?}"
        );
        assert_eq!(p.n_items(), 8 * p.max_splits);
        check_coverage(&p, &d, 32, 8);

        let prompt: Vec<u32> = (0..2048).collect();
        let pre = [seq(&prompt, 0, &table)];
        let p = plan(&pre, 32, 8, 16, 264).unwrap();
        assert_eq!(p.max_splits, 1);
        assert_eq!(p.tile_tokens, 4);
        assert_eq!(p.threads_per_block, 32 * 16);
        check_coverage(&p, &pre, 32, 8);
    }

    #[test]
    fn mixed_batches_cover_every_row_once() {
        let table: Vec<u32> = (0..64).rev().collect();
        let (a, b, c) = ([1u32; 1], [2u32; 37], [3u32; 5]);
        let seqs = [
            seq(&a, 300, &table),
            seq(&b, 100, &table),
            seq(&c, 0, &table),
        ];
        for target in [1, 24, 264, 10_000] {
            let p = plan(&seqs, 9, 3, 16, target).unwrap();
            check_coverage(&p, &seqs, 9, 3);
            assert_eq!(p.row_splits.len(), 43);
            assert!(p.max_splits <= MAX_SPLITS);
        }
    }

    /// Groups the kernel cannot launch (more than 16 warps of 32 threads exceed its
    /// __launch_bounds__(512)) or heads that do not split evenly are refused, and every
    /// accepted group launches at most 512 threads.
    #[test]
    fn head_groups_beyond_the_launch_bound_are_refused() {
        let table = [0u32];
        let one = [1u32];
        let s = [seq(&one, 0, &table)];
        for (h, kvh) in [(32, 1), (17, 1), (24, 1), (12, 5), (8, 0)] {
            assert!(plan(&s, h, kvh, 16, 264).is_err(), "{h} heads over {kvh}");
        }
        for group in 1..=16 {
            let p = plan(&s, group * 2, 2, 16, 264).unwrap();
            assert!(
                p.threads_per_block <= 512 && p.threads_per_block.is_multiple_of(32),
                "group {group}: {} threads",
                p.threads_per_block
            );
        }
    }

    #[test]
    fn a_short_block_table_is_an_error() {
        let table = [0u32, 1];
        let one = [1u32];
        assert!(plan(&[seq(&one, 32, &table)], 32, 8, 16, 264).is_err());
        assert!(plan(&[seq(&one, 31, &table)], 32, 8, 16, 264).is_ok());
    }
}
