//! Prefill compaction and truncation of a `BlockTable`: keep a chosen subset of the stored
//! tokens, densely and in order, and release the blocks that are no longer needed.
//!
//! Design: PagedEviction's prefill step (`shared/spec/paged-eviction.md`, "Write the kept
//! tokens, in their original order, densely into blocks"). The engine writes the whole
//! prompt, runs exact attention over it, asks a policy which tokens to keep, and then
//! copies the kept tokens' K/V left into a dense prefix of the table. This module only
//! says which copies to make; the K/V bytes live in another crate.
//!
//! In-place safety. Kept token `j` comes from stored index `keep[j] >= j`, so copying in
//! ascending `j` never overwrites a slot that a later copy still reads. Blocks that must
//! not be written are given a private replacement first (copy-on-write): a block shared
//! with another table (ref count > 1), or registered in the prefix cache, keeps its bytes,
//! because other sequences may read them or revive them by hash. That applies to every
//! new block that receives a moved token, and to the new partial last block, which decode
//! will write into next (NOTE 3: a partial block is private and uncached).

use crate::block::BlockId;
use crate::pool::BlockPool;
use crate::table::{BlockTable, Slot};

/// One K/V copy the caller must perform after `compact` or `truncate`: the token at stored
/// index `from_stored_index` of the old layout (slot `src`) becomes stored token
/// `to_stored_index` of the new layout (slot `dst`), in every layer.
///
/// Perform the moves in the order given, and before anything else allocates from the
/// pool: a source may sit in a block that the call already released, whose bytes stay
/// intact only until that block is reallocated.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct TokenMove {
    pub from_stored_index: u32,
    pub to_stored_index: u32,
    pub src: Slot,
    pub dst: Slot,
}

impl BlockTable {
    /// Keeps exactly the stored tokens listed in `keep` (strictly increasing stored
    /// indices), packed densely in that order, and releases the blocks past the new end.
    /// Returns the copies the caller must make (see `TokenMove`), in a safe order.
    ///
    /// `next_position` does not change: kept tokens keep the RoPE positions they were
    /// written with, and new tokens continue at the absolute position.
    ///
    /// `None` means no free block for a copy-on-write replacement (see the module header);
    /// then nothing has changed. With no shared or cached blocks it always succeeds.
    ///
    /// Panics if `keep` is not strictly increasing or names a token that is not stored.
    #[must_use = "allocation can fail, and the returned moves must be performed"]
    pub fn compact(&mut self, keep: &[u32], pool: &mut BlockPool) -> Option<Vec<TokenMove>> {
        for pair in keep.windows(2) {
            assert!(
                pair[0] < pair[1],
                "BlockTable::compact: keep list is not strictly increasing ({} then {})",
                pair[0],
                pair[1]
            );
        }
        if let Some(&last) = keep.last() {
            assert!(
                last < self.num_stored_tokens,
                "BlockTable::compact: token {last} is not stored (num_stored_tokens = {})",
                self.num_stored_tokens
            );
        }
        let moves = self.compact_with(keep.len() as u32, |to| keep[to as usize], false, pool)?;
        self.keep_positions(keep.iter().copied());
        Some(moves)
    }

    /// Keeps the first `new_num_stored_tokens` tokens and releases the blocks past them,
    /// last to first. `next_position` does not change (this is pruning, not a rollback).
    ///
    /// Usually returns no moves. If the new last block is partial and shared or cached,
    /// it is replaced by a private copy (returned as moves); `None` means no free block
    /// for that copy, and nothing has changed.
    ///
    /// Panics if `new_num_stored_tokens` exceeds the stored tokens.
    #[must_use = "allocation can fail, and the returned moves must be performed"]
    pub fn truncate(
        &mut self,
        new_num_stored_tokens: u32,
        pool: &mut BlockPool,
    ) -> Option<Vec<TokenMove>> {
        assert!(
            new_num_stored_tokens <= self.num_stored_tokens,
            "BlockTable::truncate: {new_num_stored_tokens} tokens requested, {} stored",
            self.num_stored_tokens
        );
        let moves = self.compact_with(new_num_stored_tokens, |to| to, false, pool)?;
        self.keep_positions(0..new_num_stored_tokens);
        Some(moves)
    }

    /// Per-unit compaction (eviction at `layer` or `head` granularity): each unit (a set of
    /// layers, or one KV head of one layer) keeps its own tokens, `keeps[u]`, all of the
    /// same length `n`, each strictly increasing. The table keeps `n` tokens and releases
    /// the blocks past them.
    ///
    /// Returns `(private_copies, unit_moves)`. `private_copies` are whole-token copies (every
    /// layer) that give each block of the new layout that is shared or cached a private
    /// replacement, since units may write any of them; perform them first. Then perform
    /// `unit_moves[u]` for unit `u`'s layers and heads only: each reads the old layout's
    /// slot (whose bytes are intact: nothing allocates in between, and shared blocks are
    /// never written) and writes the new layout's slot, in ascending destination order, so
    /// in place it never overwrites a slot a later move of the same unit still reads.
    ///
    /// `None`: no free block for a private copy; nothing has changed.
    ///
    /// Panics if the lists differ in length, are not strictly increasing, or name a token
    /// that is not stored.
    #[must_use = "allocation can fail, and the returned moves must be performed"]
    #[allow(clippy::type_complexity)]
    pub fn compact_units(
        &mut self,
        keeps: &[Vec<u32>],
        pool: &mut BlockPool,
    ) -> Option<(Vec<TokenMove>, Vec<Vec<TokenMove>>)> {
        let n = keeps.first().map_or(0, |k| k.len()) as u32;
        for (unit, keep) in keeps.iter().enumerate() {
            assert_eq!(
                keep.len() as u32,
                n,
                "BlockTable::compact_units: unit {unit} keeps {} tokens, unit 0 keeps {n}",
                keep.len()
            );
            for pair in keep.windows(2) {
                assert!(pair[0] < pair[1], "BlockTable::compact_units: unit {unit}'s keep list is not strictly increasing ({} then {})", pair[0], pair[1]);
            }
            if let Some(&last) = keep.last() {
                assert!(last < self.num_stored_tokens, "BlockTable::compact_units: token {last} is not stored (num_stored_tokens = {})", self.num_stored_tokens);
            }
        }
        let old_slots: Vec<Slot> = (0..self.num_stored_tokens).map(|i| self.slot(i)).collect();
        let private_copies = self.compact_with(n, |to| to, true, pool)?;
        // Units keep different tokens; the table's positions follow unit 0's (the unit
        // that holds sliding-window layers, which are the only readers of positions).
        self.keep_positions(keeps.first().into_iter().flatten().copied());
        let unit_moves = keeps
            .iter()
            .map(|keep| {
                keep.iter()
                    .enumerate()
                    .filter(|&(to, &from)| from != to as u32)
                    .map(|(to, &from)| TokenMove {
                        from_stored_index: from,
                        to_stored_index: to as u32,
                        src: old_slots[from as usize],
                        dst: self.slot(to as u32),
                    })
                    .collect()
            })
            .collect();
        Some((private_copies, unit_moves))
    }

    /// Ragged per-unit compaction (one budget over every unit, as `kvzip:global` spends
    /// it): unit `u` keeps `keeps[u]`, strictly increasing, of its own length `n_u`. The
    /// table keeps `T = max n_u` tokens, and unit `u`'s kept tokens go right-aligned into
    /// stored indices `T - n_u .. T`, so that the tokens stored after this call follow
    /// every unit's own directly and each unit's live keys stay one range, from its first
    /// key `T - n_u` on; the slots before that hold nothing for it.
    ///
    /// Returns `(private_copies, unit_moves, first_keys)`, the first two as for
    /// `compact_units`. Within a unit, destinations rise by exactly one along its keep list
    /// and sources by at least one, so the displacement never grows: the first tokens may
    /// move right, the later ones left. Right moves are listed last to first, then left
    /// moves first to last, so in place no move overwrites a slot a later one still reads.
    ///
    /// `None`: no free block for a private copy; nothing has changed. Panics as
    /// `compact_units` does, except on unequal lengths.
    #[must_use = "allocation can fail, and the returned moves must be performed"]
    #[allow(clippy::type_complexity)]
    pub fn compact_units_ragged(
        &mut self,
        keeps: &[Vec<u32>],
        pool: &mut BlockPool,
    ) -> Option<(Vec<TokenMove>, Vec<Vec<TokenMove>>, Vec<u32>)> {
        for (unit, keep) in keeps.iter().enumerate() {
            for pair in keep.windows(2) {
                assert!(pair[0] < pair[1], "BlockTable::compact_units_ragged: unit {unit}'s keep list is not strictly increasing ({} then {})", pair[0], pair[1]);
            }
            if let Some(&last) = keep.last() {
                assert!(last < self.num_stored_tokens, "BlockTable::compact_units_ragged: token {last} is not stored (num_stored_tokens = {})", self.num_stored_tokens);
            }
        }
        let longest = keeps
            .iter()
            .enumerate()
            .max_by_key(|&(u, k)| (k.len(), std::cmp::Reverse(u)));
        let n = longest.map_or(0, |(_, k)| k.len()) as u32;
        let old_slots: Vec<Slot> = (0..self.num_stored_tokens).map(|i| self.slot(i)).collect();
        let private_copies = self.compact_with(n, |to| to, true, pool)?;
        // Positions follow the longest unit's tokens: only sliding-window layers read them,
        // and a ragged eviction is refused on models that have any.
        self.keep_positions(longest.into_iter().flat_map(|(_, k)| k.iter().copied()));
        let first_keys: Vec<u32> = keeps.iter().map(|k| n - k.len() as u32).collect();
        let unit_moves = keeps
            .iter()
            .zip(&first_keys)
            .map(|(keep, &first)| {
                let mv = |(j, &from): (usize, &u32)| TokenMove {
                    from_stored_index: from,
                    to_stored_index: first + j as u32,
                    src: old_slots[from as usize],
                    dst: self.slot(first + j as u32),
                };
                let right = keep
                    .iter()
                    .enumerate()
                    .rev()
                    .filter(|&(j, &from)| first + j as u32 > from);
                let left = keep
                    .iter()
                    .enumerate()
                    .filter(|&(j, &from)| first + (j as u32) < from);
                right.chain(left).map(mv).collect()
            })
            .collect();
        Some((private_copies, unit_moves, first_keys))
    }

    /// The shared body: new stored token `to` is old stored token `source(to)`, for `to` in
    /// `0..new_num_stored_tokens`, with `source` strictly increasing and `source(to) >= to`.
    /// `all_private`: every block of the new layout that is shared or cached gets a private
    /// copy, whether or not a token moves into it (per-unit moves will write it).
    fn compact_with(
        &mut self,
        new_num_stored_tokens: u32,
        source: impl Fn(u32) -> u32,
        all_private: bool,
        pool: &mut BlockPool,
    ) -> Option<Vec<TokenMove>> {
        let block_size_tokens = self.block_size_tokens;
        let num_blocks_new = new_num_stored_tokens.div_ceil(block_size_tokens) as usize;
        let mut needs_private_copy: Vec<bool> = (0..num_blocks_new)
            .map(|block_index| {
                let block_id = self.block_ids[block_index];
                let writable = pool.ref_count(block_id) == 1 && pool.block_hash(block_id).is_none();
                if writable {
                    return false;
                }
                let first = block_index as u32 * block_size_tokens;
                let end = (first + block_size_tokens).min(new_num_stored_tokens);
                let becomes_partial = end - first < block_size_tokens;
                all_private || becomes_partial || (first..end).any(|to| source(to) != to)
            })
            .collect();
        let mut num_copies = needs_private_copy.iter().filter(|&&copy| copy).count() as u32;
        if num_copies > pool.num_free_blocks() {
            num_copies = self.uncache_instead_of_copying(&mut needs_private_copy, pool)?;
        }
        // Allocate first: it is the only step that can fail, so no undo is needed. The
        // fresh blocks come from the free queue, so none of them is a move's source.
        let mut fresh_block_ids = pool.allocate_n(num_copies)?.into_iter();
        let new_block_ids: Vec<BlockId> = (0..num_blocks_new)
            .map(|block_index| match needs_private_copy[block_index] {
                true => fresh_block_ids.next().expect("one fresh block per copy"),
                false => self.block_ids[block_index],
            })
            .collect();

        let mut moves = Vec::new();
        for to in 0..new_num_stored_tokens {
            let from = source(to);
            debug_assert!(from >= to, "compaction only moves tokens left");
            let block_index = (to / block_size_tokens) as usize;
            if from != to || needs_private_copy[block_index] {
                moves.push(TokenMove {
                    from_stored_index: from,
                    to_stored_index: to,
                    src: self.slot(from),
                    dst: Slot {
                        block_id: new_block_ids[block_index],
                        offset_tokens: to % block_size_tokens,
                    },
                });
            }
        }

        // Release the tail last to first (as `free_all`), then the replaced blocks.
        for &block_id in self.block_ids[num_blocks_new..].iter().rev() {
            pool.decref(block_id);
        }
        for (block_index, &copied) in needs_private_copy.iter().enumerate() {
            if copied {
                pool.decref(self.block_ids[block_index]);
            }
        }
        self.block_ids = new_block_ids;
        self.num_stored_tokens = new_num_stored_tokens;
        Some(moves)
    }

    /// With too few free blocks for the private copies: a block this table alone holds
    /// needs its copy only to keep its prefix-cache entry, so as many such entries as the
    /// free blocks cannot cover are given up and those blocks written in place (a later
    /// prompt misses them; nothing else changes). Blocks another table shares still need
    /// copies. Returns the copies left, or `None`, with nothing changed, when even those do
    /// not fit.
    fn uncache_instead_of_copying(
        &self,
        needs_private_copy: &mut [bool],
        pool: &mut BlockPool,
    ) -> Option<u32> {
        let sole_owner: Vec<bool> = needs_private_copy
            .iter()
            .zip(&self.block_ids)
            .map(|(&copy, &id)| copy && pool.ref_count(id) == 1 && pool.block_hash(id).is_some())
            .collect();
        let shared_copies = needs_private_copy
            .iter()
            .zip(&sole_owner)
            .filter(|&(&copy, &sole)| copy && !sole)
            .count() as u32;
        let free = pool.num_free_blocks();
        if shared_copies > free {
            return None;
        }
        // As few as the free blocks cannot cover, the last first (a prefix hit needs the
        // first blocks).
        let mut copies = needs_private_copy.iter().filter(|&&copy| copy).count() as u32;
        for block_index in (0..sole_owner.len()).rev() {
            if copies <= free {
                break;
            }
            if sole_owner[block_index] {
                pool.uncache(self.block_ids[block_index]);
                needs_private_copy[block_index] = false;
                copies -= 1;
            }
        }
        Some(copies)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(raw: &[u32]) -> Vec<BlockId> {
        raw.iter().copied().map(BlockId).collect()
    }

    fn slot(block: u32, offset_tokens: u32) -> Slot {
        Slot {
            block_id: BlockId(block),
            offset_tokens,
        }
    }

    fn table_with(pool: &mut BlockPool, num_tokens: u32) -> BlockTable {
        let mut table = BlockTable::new(pool.block_size_tokens());
        table
            .append_tokens(num_tokens, pool)
            .expect("test pool too small");
        table
    }

    /// (from, to) pairs, for short assertions.
    fn pairs(moves: &[TokenMove]) -> Vec<(u32, u32)> {
        moves
            .iter()
            .map(|m| (m.from_stored_index, m.to_stored_index))
            .collect()
    }

    #[test]
    fn compact_moves_kept_tokens_left_and_frees_the_tail() {
        let mut pool = BlockPool::new(8, 4);
        let mut table = table_with(&mut pool, 14);
        let moves = table.compact(&[0, 1, 2, 3, 9, 10, 13], &mut pool).unwrap();
        assert_eq!(pairs(&moves), vec![(9, 4), (10, 5), (13, 6)]);
        assert_eq!(moves[0].src, slot(2, 1));
        assert_eq!(moves[0].dst, slot(1, 0));
        assert_eq!(moves[2].src, slot(3, 1));
        assert_eq!(moves[2].dst, slot(1, 2));
        assert_eq!(table.block_ids(), ids(&[0, 1]));
        assert_eq!(table.num_stored_tokens(), 7);
        assert_eq!(table.next_position(), 14, "positions are absolute");
        // The tail is released last to first.
        assert_eq!(pool.free_queue_order(), ids(&[4, 5, 6, 7, 3, 2]));
        table.check_invariants();
        pool.check_invariants();
    }

    #[test]
    fn keeping_everything_changes_nothing() {
        let mut pool = BlockPool::new(4, 4);
        let mut table = table_with(&mut pool, 6);
        let moves = table.compact(&[0, 1, 2, 3, 4, 5], &mut pool).unwrap();
        assert!(moves.is_empty());
        assert_eq!(table.block_ids(), ids(&[0, 1]));
        assert_eq!(table.num_stored_tokens(), 6);
    }

    #[test]
    fn compact_to_nothing_frees_every_block() {
        let mut pool = BlockPool::new(4, 4);
        let mut table = table_with(&mut pool, 6);
        assert!(table.compact(&[], &mut pool).unwrap().is_empty());
        assert_eq!(table.num_blocks(), 0);
        assert_eq!(pool.num_free_blocks(), 4);
        assert_eq!(table.next_position(), 6);
        table.check_invariants();
    }

    #[test]
    fn truncate_frees_tail_blocks_last_to_first() {
        let mut pool = BlockPool::new(6, 4);
        let mut table = table_with(&mut pool, 17);
        assert!(table.truncate(5, &mut pool).unwrap().is_empty());
        assert_eq!(table.block_ids(), ids(&[0, 1]));
        assert_eq!(table.num_stored_tokens(), 5);
        assert_eq!(table.next_position(), 17);
        assert_eq!(pool.free_queue_order(), ids(&[5, 4, 3, 2]));
        table.check_invariants();
        pool.check_invariants();
    }

    #[test]
    fn shared_block_gets_a_private_copy_before_it_is_written() {
        let mut pool = BlockPool::new(8, 4);
        let mut table = table_with(&mut pool, 12);
        // Another table shares every block (as after a fork).
        for &block_id in table.block_ids() {
            pool.incref(block_id);
        }
        let moves = table.compact(&[0, 2, 3, 4, 8, 9], &mut pool).unwrap();
        // Block 0 receives moved tokens, so it is replaced by fresh block 3; new block 1
        // (old block 1) becomes the partial last block, so it is replaced by block 4.
        assert_eq!(table.block_ids(), ids(&[3, 4]));
        assert_eq!(
            pairs(&moves),
            vec![(0, 0), (2, 1), (3, 2), (4, 3), (8, 4), (9, 5)]
        );
        assert_eq!(moves[0].src, slot(0, 0));
        assert_eq!(moves[0].dst, slot(3, 0));
        assert_eq!(moves[5].src, slot(2, 1));
        assert_eq!(moves[5].dst, slot(4, 1));
        // The other table still holds blocks 0, 1 and 2, untouched.
        assert_eq!(pool.ref_count(BlockId(0)), 1);
        assert_eq!(pool.ref_count(BlockId(1)), 1);
        assert_eq!(pool.ref_count(BlockId(2)), 1);
        table.check_invariants();
        pool.check_invariants();
    }

    #[test]
    fn unchanged_full_shared_block_stays_shared() {
        let mut pool = BlockPool::new(8, 4);
        let mut table = table_with(&mut pool, 12);
        pool.incref(BlockId(0));
        let moves = table
            .compact(&[0, 1, 2, 3, 8, 9, 10, 11], &mut pool)
            .unwrap();
        assert_eq!(pairs(&moves), vec![(8, 4), (9, 5), (10, 6), (11, 7)]);
        assert_eq!(table.block_ids(), ids(&[0, 1]));
        assert_eq!(pool.ref_count(BlockId(0)), 2);
        pool.decref(BlockId(0));
    }

    #[test]
    fn truncate_into_a_shared_block_copies_the_kept_part() {
        let mut pool = BlockPool::new(4, 4);
        let mut table = table_with(&mut pool, 8);
        pool.incref(BlockId(1));
        let moves = table.truncate(6, &mut pool).unwrap();
        assert_eq!(pairs(&moves), vec![(4, 4), (5, 5)]);
        assert_eq!(moves[1].src, slot(1, 1));
        assert_eq!(moves[1].dst, slot(2, 1));
        assert_eq!(table.block_ids(), ids(&[0, 2]));
        assert_eq!(pool.ref_count(BlockId(1)), 1);
        table.check_invariants();
        pool.check_invariants();
    }

    #[test]
    fn failed_copy_on_write_changes_nothing() {
        let mut pool = BlockPool::new(2, 4);
        let mut table = table_with(&mut pool, 8);
        pool.incref(BlockId(0));
        assert_eq!(table.compact(&[1, 2, 3, 4], &mut pool), None);
        assert_eq!(table.block_ids(), ids(&[0, 1]));
        assert_eq!(table.num_stored_tokens(), 8);
        assert_eq!(pool.num_free_blocks(), 0);
        pool.decref(BlockId(0));
    }

    #[test]
    #[should_panic(expected = "not strictly increasing (3 then 3)")]
    fn unsorted_keep_list_panics() {
        let mut pool = BlockPool::new(4, 4);
        let mut table = table_with(&mut pool, 8);
        let _ = table.compact(&[1, 3, 3], &mut pool);
    }

    #[test]
    #[should_panic(expected = "token 8 is not stored")]
    fn keep_past_the_end_panics() {
        let mut pool = BlockPool::new(4, 4);
        let mut table = table_with(&mut pool, 8);
        let _ = table.compact(&[1, 8], &mut pool);
    }
}
