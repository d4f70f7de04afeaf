//! `KvCacheManager`: the facade the scheduler talks to. It owns the `BlockPool` and every
//! sequence's `BlockTable`, and it is the only holder of pool references.
//!
//! Design: vLLM v1's `KVCacheManager` (`get_computed_blocks`, `allocate_slots`,
//! `cache_blocks`, `free`). The scheduler sees sequence ids, token counts and block ids;
//! it never touches the pool. Allocation failure is `None` with nothing changed, and the
//! scheduler answers it by preempting or waiting.
//!
//! Typical flow for one request:
//! 1. `get_computed_prefix(prompt, extra)`: how much of the prompt is already cached
//!    (a pure query, so a scheduler can use it for budgeting).
//! 2. `add_sequence(seq, &prefix)`: adopt those blocks.
//! 3. `allocate_slots(seq, n)` for the tokens to compute; write their K/V into the slots.
//! 4. `cache_full_blocks(seq, tokens)` once the K/V of newly completed blocks is written.
//! 5. Repeat 3–4 per decode step; `free(seq)` when done.
//!
//! With an eviction policy (`crate::policy`), after the prompt's K/V is written and its
//! exact attention has run: `compact(seq, &keep)` and perform the returned moves; during
//! decode, `remove_block(seq, index)` whenever the policy names a victim.

use std::collections::BTreeMap;

use crate::block::{BlockHash, BlockId};
use crate::hash::hash_block;
use crate::pool::BlockPool;
use crate::table::{BlockCopy, BlockTable, Slot, TokenMove};
use crate::window::{window_block_hash, WindowSpec, WindowTables};

/// Identifies one sequence (one request, or one branch of a forked request).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct SeqId(pub u64);

/// The longest cached prefix of a prompt, from `get_computed_prefix`.
///
/// It holds no references: it says what was cached when it was computed. `add_sequence`
/// looks every hash up again, so a prefix that went stale in between is safe to pass.
#[derive(Clone, Debug)]
pub struct CachedPrefix {
    block_ids: Vec<BlockId>,
    block_hashes: Vec<BlockHash>,
    block_size_tokens: u32,
    /// The model id / cache salt bytes the hashes were computed with; the sequence keeps
    /// them so that the blocks it caches later chain with the same bytes.
    extra: Vec<u8>,
}

impl CachedPrefix {
    /// The cached blocks, in prompt order; each is full.
    pub fn block_ids(&self) -> &[BlockId] {
        &self.block_ids
    }

    /// Prompt tokens whose K/V is cached: `block_ids().len() * block_size_tokens`.
    pub fn num_cached_tokens(&self) -> u32 {
        self.block_ids.len() as u32 * self.block_size_tokens
    }
}

/// Where `allocate_slots` put the new tokens.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct NewSlots {
    /// Absolute (RoPE) position of `slots[0]`; `slots[i]` has position `first_position + i`.
    pub first_position: u64,
    /// One slot per new token, in order.
    pub slots: Vec<Slot>,
}

#[derive(Debug)]
struct SeqState {
    table: BlockTable,
    /// Chained hashes of the sequence's first `block_hashes.len()` full blocks, in the
    /// sequence's own order. Kept so each block is hashed once, and so a block whose hash
    /// another block already registered still extends the chain.
    block_hashes: Vec<BlockHash>,
    extra: Vec<u8>,
    /// Cleared by the first `remove_block`, or by a `compact`/`truncate` that drops
    /// tokens. From then on, new blocks hold K/V computed
    /// over a pruned context and sit at table indices that no longer equal their logical
    /// block index, so they must never be found by a full-context prefix lookup.
    prefix_cacheable: bool,
    /// The sliding-window groups' tables, when the manager has window groups.
    windows: Option<WindowTables>,
}

#[derive(Debug)]
pub struct KvCacheManager {
    pool: BlockPool,
    /// Sliding-window groups every sequence holds besides its main table (`crate::window`).
    window: Option<WindowSpec>,
    /// Ordered so that iteration (invariant checks, debugging) is deterministic.
    seqs: BTreeMap<SeqId, SeqState>,
}

impl KvCacheManager {
    /// A manager over a fresh pool; see `BlockPool::new` for the limits.
    pub fn new(num_blocks: u32, block_size_tokens: u32) -> Self {
        KvCacheManager::with_windows(num_blocks, block_size_tokens, None)
    }

    /// A manager whose sequences also hold `window.num_groups` sliding-window tables
    /// (`crate::window`), all in one pool of `num_blocks` blocks.
    ///
    /// Panics if `window` has no groups or a zero window.
    pub fn with_windows(
        num_blocks: u32,
        block_size_tokens: u32,
        window: Option<WindowSpec>,
    ) -> Self {
        if let Some(w) = window {
            assert!(
                w.num_groups > 0 && w.window_tokens > 0,
                "empty window groups {w:?}"
            );
        }
        KvCacheManager {
            pool: BlockPool::new(num_blocks, block_size_tokens),
            window,
            seqs: BTreeMap::new(),
        }
    }

    /// The sliding-window groups, if the manager has them.
    pub fn window_spec(&self) -> Option<WindowSpec> {
        self.window
    }

    /// `seq`'s window tables (one per group, indexed by position block; released entries
    /// are `window::RELEASED`), or `None` without window groups or such a sequence.
    pub fn window_tables(&self, seq: SeqId) -> Option<&[Vec<u32>]> {
        self.seqs.get(&seq)?.windows.as_ref().map(|w| w.tables())
    }

    /// Blocks `seq`'s window tables hold now, over all groups (0 without them).
    pub fn num_window_blocks(&self, seq: SeqId) -> usize {
        self.seqs
            .get(&seq)
            .and_then(|s| s.windows.as_ref())
            .map_or(0, |w| w.num_held_blocks())
    }

    /// Releases `seq`'s window blocks wholly behind the window of a token at `position`, as
    /// the next `allocate_slots` from there would. A connector that loads a prefix calls it
    /// before writing the window layers, so that every window block still held is one it
    /// writes (a block it allocated on the way and did not write must never reach the
    /// prefix cache). Nothing happens without window groups.
    ///
    /// Panics if `seq` does not exist.
    pub fn release_window_blocks_behind(&mut self, seq: SeqId, position: u64) {
        let state = Self::state_mut(&mut self.seqs, seq, "release_window_blocks_behind");
        if let (Some(windows), Some(spec)) = (state.windows.as_mut(), self.window.as_ref()) {
            windows.release_behind(spec, position, &mut self.pool);
        }
    }

    /// Window-group blocks a sequence holds at most while computing `num_tokens` positions
    /// in steps of at most `max_step_tokens` (0 without window groups): each group keeps
    /// the window before a step plus the step's own positions.
    pub fn window_blocks_bound(&self, num_tokens: u64, max_step_tokens: u64) -> u64 {
        let Some(w) = self.window else { return 0 };
        let bs = self.block_size_tokens() as u64;
        let per_group = num_tokens
            .div_ceil(bs)
            .min((w.window_tokens as u64 + max_step_tokens).div_ceil(bs) + 1);
        per_group * w.num_groups as u64
    }

    /// Read-only pool access, for metrics (`usage`, `num_free_blocks`, …) and tests.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn block_size_tokens(&self) -> u32 {
        self.pool.block_size_tokens()
    }

    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    pub fn block_table(&self, seq: SeqId) -> Option<&BlockTable> {
        self.seqs.get(&seq).map(|state| &state.table)
    }

    /// Finds the longest run of cached full blocks at the start of `token_ids`, by
    /// chained hash, stopping at the first miss. Takes no references.
    ///
    /// Never a full hit: at most `(len - 1) / B` blocks are matched, so at least the last
    /// prompt token is always computed, because the model needs its logits to sample the
    /// next token (vLLM's rule).
    pub fn get_computed_prefix(&self, token_ids: &[u32], extra: &[u8]) -> CachedPrefix {
        let block_size_tokens = self.block_size_tokens();
        let num_blocks_max = token_ids.len().saturating_sub(1) / block_size_tokens as usize;
        let mut prefix = CachedPrefix {
            block_ids: Vec::new(),
            block_hashes: Vec::new(),
            block_size_tokens,
            extra: extra.to_vec(),
        };
        for block_token_ids in token_ids
            .chunks_exact(block_size_tokens as usize)
            .take(num_blocks_max)
        {
            let block_hash = hash_block(prefix.block_hashes.last(), block_token_ids, extra);
            let Some(block_id) = self.pool.cached_block(&block_hash) else {
                break;
            };
            prefix.block_ids.push(block_id);
            prefix.block_hashes.push(block_hash);
        }
        let usable = self.window_usable_blocks(&prefix.block_hashes);
        prefix.block_ids.truncate(usable);
        prefix.block_hashes.truncate(usable);
        prefix
    }

    /// The longest prefix (in blocks) of cached main blocks `main_hashes` that the window
    /// groups can serve: every group still caches the blocks its first new token sees.
    fn window_usable_blocks(&self, main_hashes: &[BlockHash]) -> usize {
        let Some(w) = self.window else {
            return main_hashes.len();
        };
        let bs = self.block_size_tokens();
        let mut best = 0;
        let mut run = 0usize; // cached window blocks ending at the current block
        for (k, main) in main_hashes.iter().enumerate() {
            let cached = (0..w.num_groups).all(|g| {
                self.pool
                    .cached_block(&window_block_hash(main, g))
                    .is_some()
            });
            run = if cached { run + 1 } else { 0 };
            let num_blocks = k + 1;
            let first = w.first_visible_block(num_blocks as u64 * bs as u64, bs) as usize;
            if run >= num_blocks - first {
                best = num_blocks;
            }
        }
        best
    }

    /// Starts sequence `seq` with the cached blocks of `prefix`, taking a reference to
    /// each. Returns the number of tokens adopted, which is `prefix.num_cached_tokens()`
    /// unless some of its blocks were reallocated since `get_computed_prefix`; then the
    /// prefix is cut at the first block no longer cached.
    ///
    /// Panics if `seq` already exists.
    pub fn add_sequence(&mut self, seq: SeqId, prefix: &CachedPrefix) -> u32 {
        assert!(
            !self.seqs.contains_key(&seq),
            "add_sequence: {seq:?} already exists"
        );
        assert_eq!(
            prefix.block_size_tokens,
            self.block_size_tokens(),
            "add_sequence: prefix from another pool"
        );
        // With window groups the usable prefix is decided before any reference is taken,
        // from what is cached now; without them each lookup below decides.
        let num_main_cached = prefix
            .block_hashes
            .iter()
            .take_while(|h| self.pool.cached_block(h).is_some())
            .count();
        let usable = match self.window {
            Some(_) => self.window_usable_blocks(&prefix.block_hashes[..num_main_cached]),
            None => prefix.block_hashes.len(),
        };
        let mut block_ids = Vec::with_capacity(usable);
        for block_hash in &prefix.block_hashes[..usable] {
            // The hash, not the remembered id, is what proves the contents: if the block
            // was reallocated and another block cached under the same hash, that one is
            // just as good.
            let Some(block_id) = self.pool.lookup_cached(block_hash) else {
                break;
            };
            block_ids.push(block_id);
        }
        let block_hashes = prefix.block_hashes[..block_ids.len()].to_vec();
        let num_blocks = block_ids.len();
        let table = BlockTable::from_cached_blocks(self.block_size_tokens(), block_ids);
        let num_cached_tokens = table.num_stored_tokens();
        let windows = self.window.map(|w| {
            let bs = self.block_size_tokens();
            let first =
                (w.first_visible_block(num_cached_tokens as u64, bs) as usize).min(num_blocks);
            let adopted = (0..w.num_groups)
                .map(|g| {
                    block_hashes[first..]
                        .iter()
                        .map(|h| {
                            self.pool
                                .lookup_cached(&window_block_hash(h, g))
                                .expect("checked cached above")
                        })
                        .collect()
                })
                .collect();
            WindowTables::from_cached(num_blocks, first, adopted, bs)
        });
        let state = SeqState {
            table,
            block_hashes,
            extra: prefix.extra.clone(),
            prefix_cacheable: true,
            windows,
        };
        self.seqs.insert(seq, state);
        num_cached_tokens
    }

    /// Makes room for `num_new_tokens` more tokens of `seq` and says where they go. All or
    /// nothing: `None` means not enough free blocks, and nothing changed.
    ///
    /// Panics if `seq` does not exist.
    #[must_use = "allocation can fail; check for None"]
    pub fn allocate_slots(&mut self, seq: SeqId, num_new_tokens: u32) -> Option<NewSlots> {
        let state = Self::state_mut(&mut self.seqs, seq, "allocate_slots");
        if let (Some(windows), Some(spec)) = (state.windows.as_mut(), self.window.as_ref()) {
            // Blocks behind the first new token's window are released first, even when
            // the allocation then fails: no later token can see them.
            windows.release_behind(spec, state.table.next_position(), &mut self.pool);
            let bs = self.pool.block_size_tokens();
            let needed = state.table.num_new_blocks_needed(num_new_tokens)
                + windows.num_new_blocks_needed(num_new_tokens, bs);
            if needed > self.pool.num_free_blocks() as u64 {
                return None;
            }
            windows
                .append(num_new_tokens, &mut self.pool)
                .expect("checked free blocks");
        }
        let appended = state.table.append_tokens(num_new_tokens, &mut self.pool)?;
        let slots = state.table.slots(appended.stored_range()).collect();
        Some(NewSlots {
            first_position: appended.first_position,
            slots,
        })
    }

    /// Registers the sequence's newly completed full blocks in the prefix cache.
    ///
    /// `token_ids` are the sequence's tokens from position 0 (prompt then outputs); it may
    /// run past the stored tokens, and only full stored blocks are hashed. Call it once the
    /// K/V of those blocks is written, since from then on other prompts may share them.
    /// Does nothing once the sequence has had a block removed (see `SeqState`).
    ///
    /// Panics if `seq` does not exist or `token_ids` is shorter than its stored tokens.
    pub fn cache_full_blocks(&mut self, seq: SeqId, token_ids: &[u32]) {
        let block_size_tokens = self.block_size_tokens() as usize;
        let state = Self::state_mut(&mut self.seqs, seq, "cache_full_blocks");
        if !state.prefix_cacheable {
            return;
        }
        let num_stored_tokens = state.table.num_stored_tokens() as usize;
        assert!(
            token_ids.len() >= num_stored_tokens,
            "cache_full_blocks: {} token ids for {seq:?}, which stores {num_stored_tokens}",
            token_ids.len()
        );
        for block_index in state.block_hashes.len()..state.table.num_full_blocks() {
            let block_token_ids =
                &token_ids[block_index * block_size_tokens..(block_index + 1) * block_size_tokens];
            let block_hash = hash_block(state.block_hashes.last(), block_token_ids, &state.extra);
            // A `false` here means another block already holds this hash; ours stays
            // uncached but the chain continues from the hash, not from the block.
            self.pool
                .cache_block(state.table.block_ids()[block_index], block_hash);
            state.block_hashes.push(block_hash);
        }
        if let Some(windows) = state.windows.as_mut() {
            windows.cache_full_blocks(
                &state.block_hashes,
                block_size_tokens as u32,
                &mut self.pool,
            );
        }
    }

    /// Ends `seq`, releasing its blocks (cached ones stay revivable until reallocated).
    /// Returns `false` if there was no such sequence, so aborts may call it blindly.
    pub fn free(&mut self, seq: SeqId) -> bool {
        let Some(mut state) = self.seqs.remove(&seq) else {
            return false;
        };
        state.table.free_all(&mut self.pool);
        if let Some(windows) = state.windows.as_mut() {
            windows.free_all(&mut self.pool);
        }
        true
    }

    /// Starts `child` as a copy of `parent`, sharing its full blocks. Returns:
    /// - `None`: no free block for the copy-on-write of a partial last block; nothing changed;
    /// - `Some(copies)`: forked; for each copy the caller must copy `copy.num_tokens` slots
    ///   of K/V from `copy.src` to `copy.dst` (every layer slot of the block) before either
    ///   sequence writes again. At most one per table: the main one, then each window
    ///   group's.
    ///
    /// Panics if `parent` does not exist or `child` does.
    #[must_use = "allocation can fail, and a returned BlockCopy must be performed"]
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Option<Vec<BlockCopy>> {
        assert!(
            !self.seqs.contains_key(&child),
            "fork: child {child:?} already exists"
        );
        let bs = self.block_size_tokens();
        let parent_state = Self::state_mut(&mut self.seqs, parent, "fork");
        // Both forks below allocate only for partial blocks; check their sum first so
        // that neither needs undoing.
        let partial = |n: u64| u64::from(!n.is_multiple_of(bs as u64));
        let needed = partial(parent_state.table.num_stored_tokens() as u64)
            + parent_state
                .windows
                .as_ref()
                .map_or(0, |w| partial(w.num_positions()) * w.tables().len() as u64);
        if needed > self.pool.num_free_blocks() as u64 {
            return None;
        }
        let (child_table, copy) = parent_state.table.fork(&mut self.pool)?;
        let mut copies: Vec<BlockCopy> = copy.into_iter().collect();
        let windows = parent_state.windows.as_ref().map(|w| {
            let (child_windows, window_copies) =
                w.fork(bs, &mut self.pool).expect("checked free blocks");
            copies.extend(window_copies);
            child_windows
        });
        let child_state = SeqState {
            table: child_table,
            block_hashes: parent_state.block_hashes.clone(),
            extra: parent_state.extra.clone(),
            prefix_cacheable: parent_state.prefix_cacheable,
            windows,
        };
        self.seqs.insert(child, child_state);
        Some(copies)
    }

    /// Evicts the full block at `index` of `seq`'s table (see `BlockTable::remove_block`)
    /// and returns its id. The sequence stops adding blocks to the prefix cache.
    ///
    /// Panics if `seq` does not exist, or `index` is out of range or names a partial block.
    pub fn remove_block(&mut self, seq: SeqId, index: usize) -> BlockId {
        let state = Self::state_mut(&mut self.seqs, seq, "remove_block");
        let block_id = state.table.remove_block(index, &mut self.pool);
        Self::stop_prefix_caching(state);
        block_id
    }

    /// Declares `seq`'s stored tokens to sit at `positions` and its next token at
    /// `next_position` (see `BlockTable::set_positions`): a context written with its
    /// original positions, possibly compressed to fewer tokens. Its blocks then never join
    /// the prefix cache (their indices are not their positions).
    ///
    /// Panics if `seq` does not exist, has window groups (their tables are indexed by
    /// position and were filled at the stored indices), or as `BlockTable::set_positions`.
    pub fn set_positions(&mut self, seq: SeqId, positions: Vec<u32>, next_position: u64) {
        let state = Self::state_mut(&mut self.seqs, seq, "set_positions");
        assert!(
            state.windows.is_none(),
            "set_positions: {seq:?} has window groups, indexed by position"
        );
        state.table.set_positions(positions, next_position);
        if state.table.positions().is_some() {
            Self::stop_prefix_caching(state);
        }
    }

    /// Allocates empty `seq` for a context written with its original positions: its main
    /// table stores one token per entry of `positions` (strictly increasing) and its next
    /// token goes to `next_position`; window tables (with window groups) hold positions up
    /// to `next_position` with only the blocks that token's window sees. This is
    /// `allocate_slots` plus `set_positions` for a sequence that may have window groups
    /// (whose tables are indexed by position, so they cannot be placed after the fact).
    /// All or nothing: false means not enough free blocks, and nothing changed.
    ///
    /// Panics if `seq` does not exist or holds anything, or on positions `set_positions`
    /// refuses.
    #[must_use = "allocation can fail; check the result"]
    pub fn allocate_placed(&mut self, seq: SeqId, positions: Vec<u32>, next_position: u64) -> bool {
        let bs = self.pool.block_size_tokens();
        let state = Self::state_mut(&mut self.seqs, seq, "allocate_placed");
        assert_eq!(
            state.table.next_position(),
            0,
            "allocate_placed: {seq:?} is not empty"
        );
        let n = u32::try_from(positions.len()).expect("a context fits in u32 tokens");
        let mut needed = state.table.num_new_blocks_needed(n);
        if let (Some(windows), Some(spec)) = (state.windows.as_ref(), self.window.as_ref()) {
            needed += windows.num_blocks_to_skip_to(spec, next_position, bs);
        }
        if needed > self.pool.num_free_blocks() as u64 {
            return false;
        }
        if let (Some(windows), Some(spec)) = (state.windows.as_mut(), self.window.as_ref()) {
            windows
                .skip_to(spec, next_position, &mut self.pool)
                .expect("checked free blocks");
        }
        state
            .table
            .append_tokens(n, &mut self.pool)
            .expect("checked free blocks");
        state.table.set_positions(positions, next_position);
        if state.table.positions().is_some() {
            Self::stop_prefix_caching(state);
        }
        true
    }

    /// Keeps only the stored tokens listed in `keep` (strictly increasing stored indices),
    /// densely and in order: prefill pruning. Returns the K/V copies the caller must make,
    /// in order, before anything else allocates from the pool (see `TokenMove`). Blocks
    /// shared with other sequences or held in the prefix cache are never written: they
    /// get private copies. If tokens were dropped, the sequence stops adding blocks to the
    /// prefix cache (NOTE 7). Positions do not change.
    ///
    /// `None`: no free block for a copy-on-write; nothing changed.
    ///
    /// Panics if `seq` does not exist or `keep` is not strictly increasing stored indices.
    #[must_use = "allocation can fail, and the returned moves must be performed"]
    pub fn compact(&mut self, seq: SeqId, keep: &[u32]) -> Option<Vec<TokenMove>> {
        let state = Self::state_mut(&mut self.seqs, seq, "compact");
        let num_stored_tokens = state.table.num_stored_tokens();
        let moves = state.table.compact(keep, &mut self.pool)?;
        if (keep.len() as u32) < num_stored_tokens {
            Self::stop_prefix_caching(state);
        }
        Some(moves)
    }

    /// Per-unit compaction of `seq` (eviction at `layer` or `head` granularity): see
    /// `BlockTable::compact_units`. If tokens were dropped, the sequence stops adding blocks
    /// to the prefix cache. `None`: no free block for a private copy; nothing changed.
    ///
    /// Panics if `seq` does not exist, or as `BlockTable::compact_units` does.
    #[must_use = "allocation can fail, and the returned moves must be performed"]
    #[allow(clippy::type_complexity)]
    pub fn compact_units(
        &mut self,
        seq: SeqId,
        keeps: &[Vec<u32>],
    ) -> Option<(Vec<TokenMove>, Vec<Vec<TokenMove>>)> {
        let state = Self::state_mut(&mut self.seqs, seq, "compact_units");
        let num_stored_tokens = state.table.num_stored_tokens();
        let moves = state.table.compact_units(keeps, &mut self.pool)?;
        if state.table.num_stored_tokens() < num_stored_tokens
            || keeps
                .iter()
                .any(|k| !k.iter().enumerate().all(|(to, &from)| from == to as u32))
        {
            Self::stop_prefix_caching(state);
        }
        Some(moves)
    }

    /// Ragged per-unit compaction of `seq` (one budget over every unit): see
    /// `BlockTable::compact_units_ragged`, whose first keys it returns with the moves. The
    /// sequence stops adding blocks to the prefix cache. `None`: no free block for a
    /// private copy; nothing changed.
    #[must_use = "allocation can fail, and the returned moves must be performed"]
    #[allow(clippy::type_complexity)]
    pub fn compact_units_ragged(
        &mut self,
        seq: SeqId,
        keeps: &[Vec<u32>],
    ) -> Option<(Vec<TokenMove>, Vec<Vec<TokenMove>>, Vec<u32>)> {
        let state = Self::state_mut(&mut self.seqs, seq, "compact_units_ragged");
        let moves = state.table.compact_units_ragged(keeps, &mut self.pool)?;
        Self::stop_prefix_caching(state);
        Some(moves)
    }

    /// Keeps the first `new_num_stored_tokens` tokens of `seq` and frees the blocks past
    /// them (see `BlockTable::truncate`; usually no moves). If tokens were dropped, the
    /// sequence stops adding blocks to the prefix cache. Positions do not change.
    ///
    /// `None`: no free block for a copy-on-write of a shared partial block; nothing changed.
    ///
    /// Panics if `seq` does not exist or stores fewer tokens.
    #[must_use = "allocation can fail, and the returned moves must be performed"]
    pub fn truncate(&mut self, seq: SeqId, new_num_stored_tokens: u32) -> Option<Vec<TokenMove>> {
        let state = Self::state_mut(&mut self.seqs, seq, "truncate");
        let num_stored_tokens = state.table.num_stored_tokens();
        let moves = state
            .table
            .truncate(new_num_stored_tokens, &mut self.pool)?;
        if new_num_stored_tokens < num_stored_tokens {
            Self::stop_prefix_caching(state);
        }
        Some(moves)
    }

    fn stop_prefix_caching(state: &mut SeqState) {
        state.prefix_cacheable = false;
        state.block_hashes = Vec::new();
    }

    /// Fraction of blocks in use, for the `kv_cache_usage_perc` metric.
    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Panics with a message naming the broken rule unless the pool, every table, and the
    /// links between them are consistent (see the NOTEs in the crate docs):
    /// - each block's pool ref count equals the number of table entries holding it;
    /// - no table lists a block twice;
    /// - a partial last block belongs to one table only and is not in the prefix cache;
    /// - while a sequence is prefix-cacheable, it has no gap between stored tokens and
    ///   position, and each hashed block is either cached under that hash or uncached.
    pub fn check_invariants(&self) {
        self.pool.check_invariants();
        let block_size_tokens = self.block_size_tokens();
        let mut num_refs_by_block = vec![0u32; self.pool.num_blocks() as usize];
        for (seq, state) in &self.seqs {
            let table = &state.table;
            table.check_invariants();
            assert_eq!(
                table.block_size_tokens(),
                block_size_tokens,
                "manager: {seq:?} has the wrong block size"
            );
            let mut sorted_block_ids = table.block_ids().to_vec();
            sorted_block_ids.sort_unstable();
            sorted_block_ids.dedup();
            assert_eq!(
                sorted_block_ids.len(),
                table.num_blocks(),
                "manager: {seq:?} lists a block twice"
            );
            for block_id in table.block_ids() {
                num_refs_by_block[block_id.index()] += 1;
            }
            match (&state.windows, &self.window) {
                (Some(windows), Some(spec)) => {
                    windows.check_invariants(spec, block_size_tokens);
                    assert_eq!(
                        windows.num_positions(),
                        table.next_position(),
                        "manager: {seq:?}'s windows hold other positions than its table"
                    );
                    let mut held: Vec<BlockId> = windows.held_blocks().collect();
                    held.extend(table.block_ids());
                    held.sort_unstable();
                    held.dedup();
                    assert_eq!(
                        held.len(),
                        table.num_blocks() + windows.num_held_blocks(),
                        "manager: {seq:?} lists a block in two tables"
                    );
                    for block_id in windows.held_blocks() {
                        num_refs_by_block[block_id.index()] += 1;
                    }
                }
                (None, None) => {}
                _ => panic!("manager: {seq:?} has windows unlike the manager"),
            }
            if state.prefix_cacheable {
                self.check_prefix_hashes(*seq, state);
            } else {
                assert!(
                    state.block_hashes.is_empty(),
                    "manager: {seq:?} keeps hashes after eviction"
                );
            }
        }
        for (index, &num_refs) in num_refs_by_block.iter().enumerate() {
            let ref_count = self.pool.ref_count(BlockId(index as u32));
            assert_eq!(
                ref_count, num_refs,
                "manager: block {index} has pool ref count {ref_count} but {num_refs} table entries"
            );
        }
        for (seq, state) in &self.seqs {
            let table = &state.table;
            if table.num_blocks() > table.num_full_blocks() {
                let partial_block = *table.block_ids().last().expect("a partial block exists");
                assert_eq!(
                    num_refs_by_block[partial_block.index()],
                    1,
                    "manager: {seq:?}'s partial block is shared"
                );
                assert_eq!(
                    self.pool.block_hash(partial_block),
                    None,
                    "manager: {seq:?}'s partial block is cached"
                );
            }
        }
    }

    fn check_prefix_hashes(&self, seq: SeqId, state: &SeqState) {
        let table = &state.table;
        assert_eq!(
            table.next_position(),
            table.num_stored_tokens() as u64,
            "manager: {seq:?} is prefix-cacheable but has evicted tokens"
        );
        assert!(
            state.block_hashes.len() <= table.num_full_blocks(),
            "manager: {seq:?} has hashes for blocks that are not full"
        );
        for (block_id, block_hash) in table.block_ids().iter().zip(&state.block_hashes) {
            let cached_hash = self.pool.block_hash(*block_id);
            assert!(
                cached_hash.is_none() || cached_hash == Some(*block_hash),
                "manager: {seq:?}'s block {} is cached under a hash the sequence did not compute",
                block_id.0
            );
        }
    }

    fn state_mut<'a>(
        seqs: &'a mut BTreeMap<SeqId, SeqState>,
        seq: SeqId,
        caller: &str,
    ) -> &'a mut SeqState {
        match seqs.get_mut(&seq) {
            Some(state) => state,
            None => panic!("{caller}: unknown sequence {seq:?}"),
        }
    }
}
