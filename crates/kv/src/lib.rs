//! `pk-kv`: the pure KV-cache core of pagekeeper — bookkeeping over block ids.
//!
//! This crate decides which physical block holds which token of which sequence. The K/V
//! tensors themselves live in another crate, indexed by the `BlockId`s handed out here.
//! The design follows vLLM v1 (`BlockPool`, free queue, `KVCacheManager`, chained block
//! hashes for prefix caching), with mistral.rs-style `u32` block indices and
//! TigerBeetle-style invariant checks (`check_invariants` on the pool, tables and manager).
//!
//! Architecture invariant: no I/O, no async, no threads, no model code, no tensors, no
//! randomness. Allocation failure is `None`, never an error or a panic; a panic always
//! means a caller broke a documented precondition.
//!
//! Code map:
//! - `block`: `BlockId` and `BlockHash`.
//! - `hash`: chained BLAKE3 block hashes.
//! - `free_queue` (private): intrusive LRU list of free blocks.
//! - `pool`: `BlockPool` — ref counts, free queue, prefix-cache index.
//! - `table`: `BlockTable` — one sequence's blocks, token addressing, eviction, fork;
//!   `table/compact.rs`: prefill compaction and truncation (`TokenMove`).
//! - `window`: sliding-window KV cache groups (position-indexed tables that release the
//!   blocks behind the window), held by the manager beside each main table.
//! - `manager`: `KvCacheManager` — the facade the scheduler uses.
//! - `policy`: eviction policies (`EvictionPolicy`, `PolicySpec`): PagedEviction and the
//!   baselines, reading K/V through the `KvView`/`QueryView` traits, never tensors.
//!
//! Invariants. `B` is `block_size_tokens`. Each is checked by a `check_invariants`.
//!
//! NOTE 1: Block ids never change once in a table, except by whole-block eviction
//! (`remove_block`), which shifts later entries left. Tables never reorder or replace
//! blocks, so block ids given to the attention kernel in one step stay valid in the next.
//!
//! NOTE 2: Tables are dense. Every block but the last is full and none is empty, so
//! `block_ids.len() == ceil(num_stored_tokens / B)` and stored token `i` lives in slot
//! `(block_ids[i / B], i % B)`. Dense tables are what let block-wise eviction work with an
//! unmodified paged-attention kernel.
//!
//! NOTE 3: Full blocks are immutable. New tokens are only written at stored index
//! `num_stored_tokens`, which is in the partial last block or a fresh one. So full blocks
//! can be shared (fork, prefix cache) without copies, a partial block is never shared
//! (ref count 1), and a fork copies only the partial block (`BlockCopy`).
//!
//! NOTE 4: A block is in the free queue exactly when its ref count is 0, and then exactly
//! once. Freed blocks join the tail and allocation takes the head, so the least recently
//! freed block is reused first. A table frees its blocks last to first, so a sequence's
//! prefix blocks, the most shareable, are reused last.
//!
//! NOTE 5: A block's prefix-cache hash is set when its owner registers it (full and in
//! use), survives while the block is free, so `lookup_cached` can revive it, and is dropped
//! only when the block is reallocated. The hash → block index and the per-block hashes
//! agree in both directions; one block per hash, the first registration wins.
//!
//! NOTE 6: Hashes are chained: block k's hash covers tokens `[0, (k + 1) * B)` and the
//! `extra` bytes (model id, cache salt), so a hit means the whole prefix matches. Lookups
//! stop at the first miss, and never cover the last prompt token: its logits are needed.
//!
//! NOTE 7: `next_position` (all tokens ever appended or adopted) is at least
//! `num_stored_tokens` and equal until a block is removed; new tokens get `next_position`
//! as their RoPE position, so positions are never reused after eviction. After its first
//! eviction a sequence adds no more blocks to the prefix cache: their K/V was computed over
//! a pruned context and their table index is no longer their logical block index. Prefill
//! pruning (`compact`, `truncate`) that drops tokens has the same effect.
//!
//! NOTE 8: The manager is the only holder of pool references: each block's ref count equals
//! the number of table entries that list it. A sequence that is freed returns every block
//! it held, so when all sequences are freed every block is free.
//!
//! NOTE 9: Limits. `num_blocks <= u32::MAX - 2` (two sentinel indices follow the blocks)
//! and `num_blocks * B <= u32::MAX`, so every token count in this crate fits a `u32`.
//! Positions are `u64`.
//!
//! NOTE 10: Pruning never writes a block another table or the prefix cache can read.
//! Compaction moves kept tokens left (`keep[j] >= j`, so ascending copies are safe in
//! place) and gives any destination block that is shared or cached, and a new partial last
//! block, a private copy first. So shared and cached blocks stay immutable (NOTE 3). When
//! no block is free for those copies, a cached block that the compacting table alone holds
//! leaves the prefix cache instead (`BlockPool::uncache`) and is written in place: no
//! other reader remains, and a later prompt only misses it.
//!
//! NOTE 11: An eviction policy holds one entry per full block of its sequence's table, in
//! table order (`num_scored_blocks() == num_full_blocks()`): set at prefill for the kept
//! layout, pushed when a block fills, removed at the same index as `remove_block`. A block
//! is scored once, so decode costs one block score per B tokens plus a minimum over at
//! most budget / B blocks. Policies never name block 0 (sinks) or the newest full block.
//!
//! NOTE 12: Window groups (`window`). A manager built `with_windows` gives every sequence,
//! besides its main table, one table per window group, indexed by position; all hold the
//! same positions as the main table's `next_position`. Entries wholly behind the window of
//! the next token to be appended are released (and only those), so a window table holds at
//! most `window / B + 1` blocks plus one step's. Eviction never touches them. Ref counts
//! (NOTE 8) count window entries too; no block is in two tables of one sequence.
//!
//! NOTE 13: A table knows each stored token's RoPE position. While none is missing
//! (`next_position == num_stored_tokens`) stored token `i` is at position `i` and no list
//! is kept; otherwise `positions()` holds one strictly increasing position per stored
//! token, all below `next_position`. Every change of the stored tokens keeps them in step:
//! `append_tokens` adds `next_position..`, `remove_block` drops the block's, `compact` /
//! `truncate` keep the kept tokens' (`compact_units`: unit 0's), `fork` copies them, and
//! `set_positions` declares a context placed with its original positions.
#![forbid(unsafe_code)]

pub mod block;
mod free_queue;
pub mod hash;
pub mod manager;
pub mod policy;
pub mod pool;
pub mod table;
pub mod window;

pub use block::{BlockHash, BlockId};
pub use hash::{hash_block, hash_prefix_blocks};
pub use manager::{CachedPrefix, KvCacheManager, NewSlots, SeqId};
pub use policy::{
    kv_token_scores, kvzip_chunks, kvzip_initial_scores, kvzip_kept, kvzip_pass_ids,
    kvzip_pass_scores, kvzip_span, kvzip_unit_pass_scores, selection_units, snapkv_token_scores,
    validate_budget, DenseKv, DenseQueries, EvictionPolicy, KvGranularity, KvView, KvzipBudget,
    KvzipPass, KvzipPlan, KvzipPrefix, PagedScore, PolicyError, PolicySpec, QueryNeed, QueryView,
    SelectionUnit, KVZIP_CHUNK_TOKENS, KVZIP_FIRST_PROMPT, KVZIP_LATER_PROMPT,
    KVZIP_PREV_POSTFIX_TOKENS, KVZIP_PROMPT_MAX_TOKENS, KVZIP_SINK_TOKENS, MIN_BUDGET_BLOCKS,
    SNAPKV_KERNEL_DEFAULT, SNAPKV_WINDOW_DEFAULT, VALID_GRANULARITIES,
};
pub use pool::BlockPool;
pub use table::{AppendedTokens, BlockCopy, BlockTable, Slot, TokenMove};
pub use window::{window_block_hash, WindowSpec, RELEASED};
