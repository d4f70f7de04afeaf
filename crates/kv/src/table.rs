//! `BlockTable`: one sequence's list of physical blocks, and where each of its tokens lives.
//!
//! Design: vLLM's per-request block table (a dense list of block ids handed to the paged
//! attention kernel) plus the two counters block-wise eviction needs, from the
//! PagedEviction spec (`shared/spec/paged-eviction.md`): the number of tokens actually
//! stored, and the absolute position of the next token, which keeps counting after blocks
//! are evicted.
//!
//! Addressing. With `B = block_size_tokens`, stored token `i` (0-based, counting only
//! tokens still in the cache) lives in slot `(block_ids[i / B], i % B)`. Every block except
//! the last is full, so `block_ids.len() == ceil(num_stored_tokens / B)` and the table is
//! dense: the attention kernel needs only `block_ids` and `num_stored_tokens`.
//!
//! Ownership. The table holds one pool reference per entry. It cannot release them on
//! drop (it has no pool), so callers must end every table with `free_all`; the manager
//! does, and `KvCacheManager::check_invariants` counts references to catch leaks.
//!
//! Pruning. Besides whole-block eviction (`remove_block`), a table can be compacted to a
//! chosen subset of its tokens or truncated (`compact`, `truncate`, in `table/compact.rs`),
//! which PagedEviction-style prefill pruning needs.

use std::ops::Range;

use crate::block::BlockId;
use crate::pool::BlockPool;

mod compact;
pub use compact::TokenMove;

/// Where one token's K/V is written: a block and an offset inside it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Slot {
    pub block_id: BlockId,
    pub offset_tokens: u32,
}

impl Slot {
    /// The slot as one index into storage laid out as `[num_blocks][block_size_tokens]`
    /// (vLLM's `slot_mapping` entry).
    pub fn flat_index(&self, block_size_tokens: u32) -> u64 {
        self.block_id.0 as u64 * block_size_tokens as u64 + self.offset_tokens as u64
    }
}

/// The tokens one `append_tokens` call made room for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct AppendedTokens {
    /// Stored index of the first new token; the new tokens are stored indices
    /// `first_stored_index .. first_stored_index + num_tokens`.
    pub first_stored_index: u32,
    /// Absolute (RoPE) position of the first new token; the rest follow consecutively.
    pub first_position: u64,
    pub num_tokens: u32,
}

impl AppendedTokens {
    pub fn stored_range(&self) -> Range<u32> {
        self.first_stored_index..self.first_stored_index + self.num_tokens
    }
}

/// A copy the caller must perform on the physical K/V storage before the next step: the
/// first `num_tokens` slots of block `src` into block `dst` (copy-on-write after a fork).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct BlockCopy {
    pub src: BlockId,
    pub dst: BlockId,
    pub num_tokens: u32,
}

#[derive(Debug)]
pub struct BlockTable {
    block_size_tokens: u32,
    block_ids: Vec<BlockId>,
    /// Tokens whose K/V is in the cache; at most `block_ids.len() * block_size_tokens`.
    num_stored_tokens: u32,
    /// Absolute position of the next token: every token this sequence ever appended, or
    /// adopted from the prefix cache. Eviction lowers `num_stored_tokens` but not this, so
    /// new tokens keep their true RoPE positions. A `u64` because it is never bounded by the
    /// pool's capacity.
    next_position: u64,
    /// The RoPE position of each stored token, once they differ from the stored indices
    /// (after eviction, pruning, or a compressed context placed with its original
    /// positions); `None` while stored token `i` is at position `i` (NOTE 13). Sliding-
    /// window attention needs them; the table keeps them in step with every change of its
    /// tokens, so no caller does.
    positions: Option<Vec<u32>>,
}

impl BlockTable {
    /// An empty table for a pool with `block_size_tokens` tokens per block.
    pub fn new(block_size_tokens: u32) -> Self {
        assert!(
            block_size_tokens > 0,
            "BlockTable::new: block_size_tokens must be positive"
        );
        BlockTable {
            block_size_tokens,
            block_ids: Vec::new(),
            num_stored_tokens: 0,
            next_position: 0,
            positions: None,
        }
    }

    /// A table that starts with full blocks adopted from the prefix cache. The caller has
    /// already taken one reference per block (`BlockPool::lookup_cached`); the table now
    /// owns those references. The blocks hold tokens `0 .. block_ids.len() * B`.
    pub fn from_cached_blocks(block_size_tokens: u32, block_ids: Vec<BlockId>) -> Self {
        let mut table = BlockTable::new(block_size_tokens);
        let num_tokens = block_ids.len() as u64 * block_size_tokens as u64;
        table.num_stored_tokens = u32::try_from(num_tokens)
            .expect("BlockTable: cached prefix exceeds the u32 token limit");
        table.next_position = num_tokens;
        table.block_ids = block_ids;
        table
    }

    pub fn block_size_tokens(&self) -> u32 {
        self.block_size_tokens
    }

    /// The dense list handed to the attention kernel.
    pub fn block_ids(&self) -> &[BlockId] {
        &self.block_ids
    }

    pub fn num_blocks(&self) -> usize {
        self.block_ids.len()
    }

    /// Blocks holding exactly `block_size_tokens` tokens: all of them, or all but the last.
    pub fn num_full_blocks(&self) -> usize {
        (self.num_stored_tokens / self.block_size_tokens) as usize
    }

    pub fn num_stored_tokens(&self) -> u32 {
        self.num_stored_tokens
    }

    pub fn next_position(&self) -> u64 {
        self.next_position
    }

    /// The RoPE positions of the stored tokens, when they differ from the stored indices
    /// (`None`: stored token `i` is at position `i`).
    pub fn positions(&self) -> Option<&[u32]> {
        self.positions.as_deref()
    }

    /// The RoPE position of stored token `stored_index`.
    pub fn position_of(&self, stored_index: u32) -> u64 {
        match &self.positions {
            Some(p) => p[stored_index as usize] as u64,
            None => stored_index as u64,
        }
    }

    /// Declares the stored tokens' positions and the next token's: a context written with
    /// its tokens' original positions (a compressed copy keeps fewer tokens than it stood
    /// for). `positions` must hold one strictly increasing position per stored token, all
    /// below `next_position`.
    ///
    /// Panics if they do not.
    pub fn set_positions(&mut self, positions: Vec<u32>, next_position: u64) {
        assert_eq!(
            positions.len(),
            self.num_stored_tokens as usize,
            "BlockTable::set_positions: {} positions for {} stored tokens",
            positions.len(),
            self.num_stored_tokens
        );
        assert!(
            positions.windows(2).all(|w| w[0] < w[1]),
            "BlockTable::set_positions: positions are not strictly increasing"
        );
        assert!(
            positions.last().is_none_or(|&p| (p as u64) < next_position)
                && next_position >= self.num_stored_tokens as u64,
            "BlockTable::set_positions: next position {next_position} is not after the stored tokens"
        );
        self.next_position = next_position;
        self.positions = Some(positions);
        self.normalize_positions();
    }

    /// Keeps the positions of the stored tokens listed in `kept` (old stored indices, in
    /// their new order), after the table has been compacted or truncated to them.
    pub(crate) fn keep_positions(&mut self, kept: impl Iterator<Item = u32>) {
        let old = self.positions.take();
        let new = kept
            .map(|i| old.as_ref().map_or(i, |p| p[i as usize]))
            .collect();
        self.positions = Some(new);
        self.normalize_positions();
    }

    /// Back to `None` when the positions are the stored indices again and nothing is missing
    /// before the next position.
    fn normalize_positions(&mut self) {
        let identity = self.positions.as_ref().is_some_and(|p| {
            p.len() as u64 == self.next_position
                && p.iter().enumerate().all(|(i, &x)| x as usize == i)
        });
        if identity {
            self.positions = None;
        }
    }

    /// Where stored token `stored_index` lives. Panics if the token is not stored.
    pub fn slot(&self, stored_index: u32) -> Slot {
        assert!(
            stored_index < self.num_stored_tokens,
            "BlockTable::slot: token {stored_index} is not stored (num_stored_tokens = {})",
            self.num_stored_tokens
        );
        Slot {
            block_id: self.block_ids[(stored_index / self.block_size_tokens) as usize],
            offset_tokens: stored_index % self.block_size_tokens,
        }
    }

    /// Slots of a range of stored tokens, in order.
    pub fn slots(&self, stored_range: Range<u32>) -> impl Iterator<Item = Slot> + '_ {
        stored_range.map(move |stored_index| self.slot(stored_index))
    }

    /// New blocks `append_tokens(num_new_tokens)` would allocate. Lets a scheduler check
    /// the budget before committing. `u64` because a huge request can need more blocks
    /// than any pool has.
    pub fn num_new_blocks_needed(&self, num_new_tokens: u32) -> u64 {
        let num_tokens_after = self.num_stored_tokens as u64 + num_new_tokens as u64;
        let num_blocks_after = num_tokens_after.div_ceil(self.block_size_tokens as u64);
        num_blocks_after - self.block_ids.len() as u64
    }

    /// Makes room for `num_new_tokens` more tokens, filling the partial last block first and
    /// then allocating fresh blocks. All or nothing: on `None` (not enough free blocks) the
    /// table and the pool are unchanged.
    #[must_use = "allocation can fail; check for None"]
    pub fn append_tokens(
        &mut self,
        num_new_tokens: u32,
        pool: &mut BlockPool,
    ) -> Option<AppendedTokens> {
        debug_assert_eq!(
            pool.block_size_tokens(),
            self.block_size_tokens,
            "BlockTable: pool block size differs"
        );
        let num_new_blocks = u32::try_from(self.num_new_blocks_needed(num_new_tokens)).ok()?;
        let new_block_ids = pool.allocate_n(num_new_blocks)?;
        self.block_ids.extend(new_block_ids);
        let appended = AppendedTokens {
            first_stored_index: self.num_stored_tokens,
            first_position: self.next_position,
            num_tokens: num_new_tokens,
        };
        if let Some(p) = self.positions.as_mut() {
            let first = self.next_position;
            p.extend((first..first + num_new_tokens as u64).map(|x| x as u32));
        }
        // Cannot overflow: the blocks were allocated, and the pool's capacity fits a u32.
        self.num_stored_tokens += num_new_tokens;
        self.next_position += num_new_tokens as u64;
        Some(appended)
    }

    /// Evicts the full block at `index`: releases its reference and shifts later entries
    /// left, so the table stays dense. Stored tokens drop by one block; `next_position`
    /// does not change. Returns the removed block's id.
    ///
    /// Panics if `index` is out of range or names the partial last block: a partial block
    /// is still being written, and removing it would leave a hole before the write cursor.
    //
    // Per-block metadata kept outside the table (an eviction policy's block scores) must be
    // removed at the same index too (`EvictionPolicy::on_block_removed`), so it stays
    // parallel to `block_ids`.
    pub fn remove_block(&mut self, index: usize, pool: &mut BlockPool) -> BlockId {
        assert!(
            index < self.block_ids.len(),
            "BlockTable::remove_block: index {index} out of range ({} blocks)",
            self.block_ids.len()
        );
        assert!(
            index < self.num_full_blocks(),
            "BlockTable::remove_block: block {index} is the partial last block ({} of {} tokens)",
            self.num_stored_tokens % self.block_size_tokens,
            self.block_size_tokens
        );
        let block_id = self.block_ids.remove(index);
        pool.decref(block_id);
        let bs = self.block_size_tokens as usize;
        let n = self.num_stored_tokens;
        self.positions
            .get_or_insert_with(|| (0..n).collect())
            .drain(index * bs..(index + 1) * bs);
        self.num_stored_tokens -= self.block_size_tokens;
        block_id
    }

    /// Releases every block and resets the table to empty (as `new`), so a preempted
    /// sequence can be recomputed from position 0.
    ///
    /// Blocks are released last to first, as in vLLM: the free queue then evicts a
    /// sequence's tail blocks before its head blocks, and head blocks are the ones other
    /// prompts are most likely to share through the prefix cache.
    pub fn free_all(&mut self, pool: &mut BlockPool) {
        for &block_id in self.block_ids.iter().rev() {
            pool.decref(block_id);
        }
        self.block_ids.clear();
        self.num_stored_tokens = 0;
        self.next_position = 0;
        self.positions = None;
    }

    /// A child table with the same tokens (beam search, parallel sampling).
    ///
    /// Full blocks are shared by reference count: they are never written again. A partial
    /// last block will be written by both sequences, so the child gets a fresh block and
    /// the returned `BlockCopy` tells the caller to copy the parent's tokens into it. On
    /// `None` (no free block for that copy) nothing has changed.
    #[must_use = "a dropped child table leaks its references"]
    pub fn fork(&self, pool: &mut BlockPool) -> Option<(BlockTable, Option<BlockCopy>)> {
        let num_full_blocks = self.num_full_blocks();
        let num_partial_tokens = self.num_stored_tokens % self.block_size_tokens;
        // Allocate first: it is the only step that can fail, so no undo is needed.
        let copy = if num_partial_tokens > 0 {
            let dst = pool.allocate()?;
            Some(BlockCopy {
                src: self.block_ids[num_full_blocks],
                dst,
                num_tokens: num_partial_tokens,
            })
        } else {
            None
        };
        let mut child_block_ids = Vec::with_capacity(self.block_ids.len());
        for &block_id in &self.block_ids[..num_full_blocks] {
            pool.incref(block_id);
            child_block_ids.push(block_id);
        }
        if let Some(copy) = copy {
            child_block_ids.push(copy.dst);
        }
        let child = BlockTable {
            block_size_tokens: self.block_size_tokens,
            block_ids: child_block_ids,
            num_stored_tokens: self.num_stored_tokens,
            next_position: self.next_position,
            positions: self.positions.clone(),
        };
        Some((child, copy))
    }

    /// Panics unless the table is dense (see the module header) and its counters agree.
    pub fn check_invariants(&self) {
        let num_blocks_expected = self.num_stored_tokens.div_ceil(self.block_size_tokens) as usize;
        assert_eq!(
            self.block_ids.len(),
            num_blocks_expected,
            "table: {} blocks for {} stored tokens of block size {} (all blocks but the last must be full, none empty)",
            self.block_ids.len(),
            self.num_stored_tokens,
            self.block_size_tokens
        );
        assert!(
            self.next_position >= self.num_stored_tokens as u64,
            "table: next_position {} is below num_stored_tokens {}",
            self.next_position,
            self.num_stored_tokens
        );
        match &self.positions {
            None => assert_eq!(
                self.next_position, self.num_stored_tokens as u64,
                "table: tokens are missing before the next position but no positions are kept"
            ),
            Some(p) => {
                assert_eq!(
                    p.len(),
                    self.num_stored_tokens as usize,
                    "table: {} positions for {} stored tokens",
                    p.len(),
                    self.num_stored_tokens
                );
                assert!(
                    p.windows(2).all(|w| w[0] < w[1]),
                    "table: positions are not strictly increasing"
                );
                assert!(
                    p.last().is_none_or(|&x| (x as u64) < self.next_position),
                    "table: a stored position is not below the next position"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(raw: &[u32]) -> Vec<BlockId> {
        raw.iter().copied().map(BlockId).collect()
    }

    /// A table holding `num_tokens` tokens, appended in one call on a fresh pool.
    fn table_with(pool: &mut BlockPool, num_tokens: u32) -> BlockTable {
        let mut table = BlockTable::new(pool.block_size_tokens());
        table
            .append_tokens(num_tokens, pool)
            .expect("test pool too small");
        table
    }

    #[test]
    fn append_fills_partial_block_before_allocating() {
        let mut pool = BlockPool::new(8, 4);
        let mut table = BlockTable::new(4);
        let first = table.append_tokens(6, &mut pool).unwrap();
        assert_eq!(
            first,
            AppendedTokens {
                first_stored_index: 0,
                first_position: 0,
                num_tokens: 6
            }
        );
        assert_eq!(table.block_ids(), ids(&[0, 1]));
        // Two tokens fit in block 1; the third needs block 2.
        assert_eq!(table.num_new_blocks_needed(2), 0);
        assert_eq!(table.num_new_blocks_needed(3), 1);
        let second = table.append_tokens(2, &mut pool).unwrap();
        assert_eq!(
            second,
            AppendedTokens {
                first_stored_index: 6,
                first_position: 6,
                num_tokens: 2
            }
        );
        assert_eq!(table.block_ids(), ids(&[0, 1]));
        table.append_tokens(1, &mut pool).unwrap();
        assert_eq!(table.block_ids(), ids(&[0, 1, 2]));
        assert_eq!(table.num_stored_tokens(), 9);
        assert_eq!(table.append_tokens(0, &mut pool).unwrap().num_tokens, 0);
        assert_eq!(
            table.block_ids(),
            ids(&[0, 1, 2]),
            "appending nothing allocates nothing"
        );
        table.check_invariants();
    }

    #[test]
    fn slot_of_stored_token() {
        let mut pool = BlockPool::new(8, 4);
        let table = table_with(&mut pool, 6);
        assert_eq!(
            table.slot(0),
            Slot {
                block_id: BlockId(0),
                offset_tokens: 0
            }
        );
        assert_eq!(
            table.slot(5),
            Slot {
                block_id: BlockId(1),
                offset_tokens: 1
            }
        );
        assert_eq!(table.slot(5).flat_index(4), 5);
        let slots: Vec<Slot> = table.slots(3..5).collect();
        assert_eq!(
            slots,
            vec![
                Slot {
                    block_id: BlockId(0),
                    offset_tokens: 3
                },
                Slot {
                    block_id: BlockId(1),
                    offset_tokens: 0
                },
            ]
        );
    }

    #[test]
    #[should_panic(expected = "token 6 is not stored")]
    fn slot_past_the_end_panics() {
        let mut pool = BlockPool::new(8, 4);
        table_with(&mut pool, 6).slot(6);
    }

    #[test]
    fn failed_append_changes_nothing() {
        let mut pool = BlockPool::new(3, 4);
        let mut table = table_with(&mut pool, 5);
        assert_eq!(pool.num_free_blocks(), 1);
        // 5 + 8 = 13 tokens need 4 blocks; only 3 exist.
        assert_eq!(table.append_tokens(8, &mut pool), None);
        assert_eq!(table.block_ids(), ids(&[0, 1]));
        assert_eq!(table.num_stored_tokens(), 5);
        assert_eq!(table.next_position(), 5);
        assert_eq!(pool.num_free_blocks(), 1);
        assert_eq!(pool.free_queue_order(), ids(&[2]));
        // A request larger than any pool fails as a value too.
        assert_eq!(table.append_tokens(u32::MAX, &mut pool), None);
        pool.check_invariants();
        table.check_invariants();
    }

    #[test]
    fn remove_block_shifts_later_entries_left() {
        let mut pool = BlockPool::new(8, 4);
        let mut table = table_with(&mut pool, 14);
        assert_eq!(table.block_ids(), ids(&[0, 1, 2, 3]));
        assert_eq!(table.remove_block(1, &mut pool), BlockId(1));
        assert_eq!(table.block_ids(), ids(&[0, 2, 3]));
        assert_eq!(table.num_stored_tokens(), 10);
        assert_eq!(
            table.next_position(),
            14,
            "eviction does not move the position"
        );
        assert_eq!(
            table.slot(4),
            Slot {
                block_id: BlockId(2),
                offset_tokens: 0
            }
        );
        assert_eq!(pool.free_queue_order(), ids(&[4, 5, 6, 7, 1]));
        // New tokens continue at their absolute position, in the partial block.
        let appended = table.append_tokens(3, &mut pool).unwrap();
        assert_eq!(
            appended,
            AppendedTokens {
                first_stored_index: 10,
                first_position: 14,
                num_tokens: 3
            }
        );
        assert_eq!(table.block_ids(), ids(&[0, 2, 3, 4]));
        assert_eq!(table.next_position(), 17);
        table.check_invariants();
        pool.check_invariants();
    }

    #[test]
    fn remove_full_last_block_is_allowed() {
        let mut pool = BlockPool::new(4, 4);
        let mut table = table_with(&mut pool, 8);
        assert_eq!(table.remove_block(1, &mut pool), BlockId(1));
        assert_eq!(table.block_ids(), ids(&[0]));
        assert_eq!(table.num_stored_tokens(), 4);
        table.check_invariants();
    }

    #[test]
    #[should_panic(expected = "is the partial last block (2 of 4 tokens)")]
    fn remove_partial_last_block_panics() {
        let mut pool = BlockPool::new(4, 4);
        let mut table = table_with(&mut pool, 6);
        table.remove_block(1, &mut pool);
    }

    #[test]
    #[should_panic(expected = "index 2 out of range (2 blocks)")]
    fn remove_out_of_range_panics() {
        let mut pool = BlockPool::new(4, 4);
        let mut table = table_with(&mut pool, 8);
        table.remove_block(2, &mut pool);
    }

    #[test]
    fn free_all_releases_last_block_first() {
        let mut pool = BlockPool::new(5, 4);
        let mut table = table_with(&mut pool, 10);
        table.free_all(&mut pool);
        assert_eq!(pool.free_queue_order(), ids(&[3, 4, 2, 1, 0]));
        assert!(table.block_ids().is_empty());
        assert_eq!(table.num_stored_tokens(), 0);
        assert_eq!(table.next_position(), 0);
        table.check_invariants();
        pool.check_invariants();
    }

    #[test]
    fn fork_shares_full_blocks_and_copies_partial_block() {
        let mut pool = BlockPool::new(8, 4);
        let parent = table_with(&mut pool, 10);
        assert_eq!(parent.block_ids(), ids(&[0, 1, 2]));
        let (child, copy) = parent.fork(&mut pool).unwrap();
        assert_eq!(
            copy,
            Some(BlockCopy {
                src: BlockId(2),
                dst: BlockId(3),
                num_tokens: 2
            })
        );
        assert_eq!(child.block_ids(), ids(&[0, 1, 3]));
        assert_eq!(child.num_stored_tokens(), 10);
        assert_eq!(child.next_position(), 10);
        assert_eq!(pool.ref_count(BlockId(0)), 2);
        assert_eq!(pool.ref_count(BlockId(1)), 2);
        assert_eq!(
            pool.ref_count(BlockId(2)),
            1,
            "the partial block is never shared"
        );
        assert_eq!(pool.ref_count(BlockId(3)), 1);
        child.check_invariants();
        pool.check_invariants();
    }

    #[test]
    fn fork_of_full_table_copies_nothing() {
        let mut pool = BlockPool::new(4, 4);
        let parent = table_with(&mut pool, 8);
        let (child, copy) = parent.fork(&mut pool).unwrap();
        assert_eq!(copy, None);
        assert_eq!(child.block_ids(), parent.block_ids());
        assert_eq!(pool.num_free_blocks(), 2);
    }

    #[test]
    fn failed_fork_changes_nothing() {
        let mut pool = BlockPool::new(2, 4);
        let parent = table_with(&mut pool, 6);
        assert!(parent.fork(&mut pool).is_none());
        assert_eq!(pool.ref_count(BlockId(0)), 1);
        assert_eq!(pool.ref_count(BlockId(1)), 1);
        pool.check_invariants();
    }

    #[test]
    fn adopted_cached_blocks_are_full() {
        let table = BlockTable::from_cached_blocks(4, ids(&[5, 2]));
        assert_eq!(table.num_stored_tokens(), 8);
        assert_eq!(table.next_position(), 8);
        assert_eq!(table.num_full_blocks(), 2);
        table.check_invariants();
    }
}
