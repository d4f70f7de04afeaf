//! Sliding-window KV cache groups: the block tables of layers that attend only to the
//! last `window_tokens` positions (Gemma 3's local layers), after vLLM v1's hybrid KV
//! cache manager.
//!
//! A sequence of a model with such layers holds its main `BlockTable` (the full-attention
//! layers: stored tokens, eviction, prefix caching as everywhere else) and one
//! `WindowTables`: for each of `num_groups` window groups, a table indexed by *position*
//! (entry `k` holds positions `[k·B, (k+1)·B)`). All groups of a sequence hold the same
//! positions, so they grow and shrink together. Before new tokens are appended, every
//! block wholly behind the first new token's window is released: no later token can see
//! it. A window table therefore holds at most `window_tokens / B + 1` blocks plus the
//! blocks of the tokens being computed, whatever the context length.
//!
//! Eviction (`compact`, `remove_block`, `truncate`) acts on the main table only. Windows
//! keep every position inside them: they are bounded already, and their layers read
//! positions, not the main table's stored indices.
//!
//! Prefix caching: a window block full and in use is registered under its main block's
//! chained hash extended by the group index (`window_block_hash`), so one block per
//! group and position is cached. A cached prefix of `k` blocks is usable only if every
//! group still holds the blocks its first new token can see (`blocks_needed_for`).

use crate::block::{BlockHash, BlockId};
use crate::pool::BlockPool;
use crate::table::BlockCopy;

/// Marks a window table entry whose block was released (or never held: a prefix adopted
/// from the cache needs only the blocks inside its window). Never read by attention.
pub const RELEASED: u32 = u32::MAX;

/// The sliding-window groups a manager keeps besides each sequence's main table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowSpec {
    /// Window groups (each a set of layers with a table of its own), at least 1.
    pub num_groups: u32,
    /// Positions a windowed layer's token sees, its own included.
    pub window_tokens: u32,
}

impl WindowSpec {
    /// Index of the first position block a token at `position` can see.
    pub(crate) fn first_visible_block(&self, position: u64, block_size_tokens: u32) -> u64 {
        (position + 1).saturating_sub(self.window_tokens as u64) / block_size_tokens as u64
    }
}

/// The hash a window group's block is cached under: the main table's chained hash of the
/// same position block, extended by the group, so groups never share an entry.
pub fn window_block_hash(main: &BlockHash, group: u32) -> BlockHash {
    let mut hasher = blake3::Hasher::new();
    hasher.update(b"pagekeeper window block");
    hasher.update(&main.0);
    hasher.update(&group.to_le_bytes());
    BlockHash(*hasher.finalize().as_bytes())
}

/// One sequence's window tables (see the module docs).
#[derive(Debug)]
pub(crate) struct WindowTables {
    /// Per group, one entry per position block: a block id or `RELEASED`.
    tables: Vec<Vec<u32>>,
    /// Positions appended (the main table's `next_position`).
    num_positions: u64,
    /// Entries `[0, num_released)` are `RELEASED` in every group.
    num_released: usize,
    /// Blocks `[.., num_registered)` were offered to the prefix cache.
    num_registered: usize,
}

impl WindowTables {
    /// A sequence adopting a cached prefix of `num_blocks` full blocks: `adopted[g]` holds
    /// group g's blocks `[first, num_blocks)`, each already referenced by the caller.
    pub(crate) fn from_cached(
        num_blocks: usize,
        first: usize,
        adopted: Vec<Vec<BlockId>>,
        block_size_tokens: u32,
    ) -> WindowTables {
        let tables = adopted
            .into_iter()
            .map(|ids| {
                let mut table = vec![RELEASED; first];
                table.extend(ids.iter().map(|b| b.0));
                debug_assert_eq!(table.len(), num_blocks);
                table
            })
            .collect();
        WindowTables {
            tables,
            num_positions: num_blocks as u64 * block_size_tokens as u64,
            num_released: first,
            num_registered: num_blocks,
        }
    }

    pub(crate) fn tables(&self) -> &[Vec<u32>] {
        &self.tables
    }

    pub(crate) fn num_positions(&self) -> u64 {
        self.num_positions
    }

    /// Blocks held (not released), over all groups.
    pub(crate) fn num_held_blocks(&self) -> usize {
        self.tables
            .iter()
            .map(|t| t[self.num_released..].len())
            .sum()
    }

    /// Releases every block wholly behind the window of a token at `position`.
    pub(crate) fn release_behind(
        &mut self,
        spec: &WindowSpec,
        position: u64,
        pool: &mut BlockPool,
    ) {
        let bs = pool.block_size_tokens();
        let first_kept = (spec.first_visible_block(position, bs) as usize).min(self.len());
        for table in &mut self.tables {
            for entry in table[self.num_released..first_kept].iter_mut().rev() {
                pool.decref(BlockId(*entry));
                *entry = RELEASED;
            }
        }
        self.num_released = self.num_released.max(first_kept);
    }

    fn len(&self) -> usize {
        self.tables.first().map_or(0, Vec::len)
    }

    /// New blocks (over all groups) that appending `num_new_tokens` positions allocates.
    pub(crate) fn num_new_blocks_needed(&self, num_new_tokens: u32, block_size_tokens: u32) -> u64 {
        let blocks_after =
            (self.num_positions + num_new_tokens as u64).div_ceil(block_size_tokens as u64);
        (blocks_after - self.len() as u64) * self.tables.len() as u64
    }

    /// Appends positions, allocating each group's new blocks. All or nothing.
    #[must_use]
    pub(crate) fn append(&mut self, num_new_tokens: u32, pool: &mut BlockPool) -> Option<()> {
        let bs = pool.block_size_tokens();
        let needed = u32::try_from(self.num_new_blocks_needed(num_new_tokens, bs)).ok()?;
        let mut ids = pool.allocate_n(needed)?.into_iter();
        let per_group = needed as usize / self.tables.len().max(1);
        for table in &mut self.tables {
            table.extend(ids.by_ref().take(per_group).map(|b| b.0));
        }
        self.num_positions += num_new_tokens as u64;
        Some(())
    }

    /// New blocks (over all groups) that [`WindowTables::skip_to`] allocates.
    pub(crate) fn num_blocks_to_skip_to(
        &self,
        spec: &WindowSpec,
        position: u64,
        block_size_tokens: u32,
    ) -> u64 {
        let total = position.div_ceil(block_size_tokens as u64);
        let first = spec
            .first_visible_block(position, block_size_tokens)
            .min(total);
        (total - first) * self.tables.len() as u64
    }

    /// Makes empty tables hold positions `[0, position)` with only the blocks a token at
    /// `position` sees: a context written with its original positions, whose window layers
    /// were stored as that window alone. All or nothing.
    ///
    /// Panics unless the tables are empty.
    #[must_use]
    pub(crate) fn skip_to(
        &mut self,
        spec: &WindowSpec,
        position: u64,
        pool: &mut BlockPool,
    ) -> Option<()> {
        assert_eq!(self.num_positions, 0, "window: skip_to on non-empty tables");
        let bs = pool.block_size_tokens();
        let total = position.div_ceil(bs as u64) as usize;
        let first = (spec.first_visible_block(position, bs) as usize).min(total);
        let needed = u32::try_from(self.num_blocks_to_skip_to(spec, position, bs)).ok()?;
        let mut ids = pool.allocate_n(needed)?.into_iter();
        for table in &mut self.tables {
            table.clear();
            table.resize(first, RELEASED);
            table.extend(ids.by_ref().take(total - first).map(|b| b.0));
        }
        self.num_positions = position;
        self.num_released = first;
        self.num_registered = first;
        Some(())
    }

    /// Registers the full blocks still held under their window hashes; `main_hashes` are
    /// the main table's chained hashes by position block.
    pub(crate) fn cache_full_blocks(
        &mut self,
        main_hashes: &[BlockHash],
        block_size_tokens: u32,
        pool: &mut BlockPool,
    ) {
        let num_full = (self.num_positions / block_size_tokens as u64) as usize;
        let upto = num_full.min(main_hashes.len());
        for k in self.num_registered.max(self.num_released)..upto {
            for (g, table) in self.tables.iter().enumerate() {
                pool.cache_block(
                    BlockId(table[k]),
                    window_block_hash(&main_hashes[k], g as u32),
                );
            }
        }
        self.num_registered = self.num_registered.max(upto);
    }

    /// Releases every block, last to first (see `BlockTable::free_all`).
    pub(crate) fn free_all(&mut self, pool: &mut BlockPool) {
        for table in &mut self.tables {
            for &entry in table[self.num_released..].iter().rev() {
                pool.decref(BlockId(entry));
            }
            table.clear();
        }
        self.num_positions = 0;
        self.num_released = 0;
        self.num_registered = 0;
    }

    /// A child's tables: full blocks shared, each group's partial last block copied into a
    /// fresh block (the returned copies). `None`: no free blocks; nothing changed.
    pub(crate) fn fork(
        &self,
        block_size_tokens: u32,
        pool: &mut BlockPool,
    ) -> Option<(WindowTables, Vec<BlockCopy>)> {
        let num_partial = (self.num_positions % block_size_tokens as u64) as u32;
        let fresh = if num_partial > 0 {
            pool.allocate_n(self.tables.len() as u32)?
        } else {
            Vec::new()
        };
        let mut copies = Vec::new();
        let mut tables = Vec::with_capacity(self.tables.len());
        for (g, table) in self.tables.iter().enumerate() {
            let mut child = table.clone();
            let num_full = table.len() - usize::from(num_partial > 0);
            for &entry in &table[self.num_released..num_full] {
                pool.incref(BlockId(entry));
            }
            if num_partial > 0 {
                let src = BlockId(*table.last().expect("a partial block"));
                copies.push(BlockCopy {
                    src,
                    dst: fresh[g],
                    num_tokens: num_partial,
                });
                *child.last_mut().expect("a partial block") = fresh[g].0;
            }
            tables.push(child);
        }
        let child = WindowTables {
            tables,
            num_positions: self.num_positions,
            num_released: self.num_released,
            num_registered: self.num_registered,
        };
        Some((child, copies))
    }

    /// Every held block, for the manager's reference-count check.
    pub(crate) fn held_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.tables
            .iter()
            .flat_map(move |t| t[self.num_released..].iter().map(|&b| BlockId(b)))
    }

    /// Panics unless the tables agree with their counters.
    pub(crate) fn check_invariants(&self, spec: &WindowSpec, block_size_tokens: u32) {
        let num_blocks = self.num_positions.div_ceil(block_size_tokens as u64) as usize;
        assert_eq!(
            self.tables.len(),
            spec.num_groups as usize,
            "window: a table per group"
        );
        for table in &self.tables {
            assert_eq!(
                table.len(),
                num_blocks,
                "window: a block per position block"
            );
            assert!(
                table[..self.num_released].iter().all(|&b| b == RELEASED)
                    && table[self.num_released..].iter().all(|&b| b != RELEASED),
                "window: released entries are exactly the leading ones"
            );
        }
    }
}
