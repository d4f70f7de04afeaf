//! `BlockPool`: every physical KV block, its reference count, the LRU free queue and the
//! prefix-cache index from block hash to block.
//!
//! Design: vLLM v1's `BlockPool` (ref-counted blocks, a free queue that doubles as the
//! prefix-cache eviction order, lazy eviction of cached hashes) with mistral.rs-style
//! storage: per-block state lives in plain arrays indexed by `BlockId`, allocated once.
//!
//! Life of a block:
//! 1. Free (ref count 0, in the free queue, maybe still holding a cached hash).
//! 2. `allocate` pops the queue head: the block's old hash, if any, is dropped from the
//!    cache index, because its K/V is about to be overwritten. Ref count becomes 1.
//! 3. Sharing (`incref`, or `lookup_cached` on a cache hit) raises the ref count.
//! 4. `decref` to 0 pushes the block to the queue tail. Its hash stays, so a later request
//!    with the same prefix can revive it with `lookup_cached` until it is reallocated.
//!
//! Mechanism only: which sequence gets blocks, and which block a sequence gives up, is
//! decided by the caller (`KvCacheManager`, the scheduler, eviction policies).

use std::collections::HashMap;

use crate::block::{BlockHash, BlockId};
use crate::free_queue::FreeQueue;

#[derive(Debug)]
pub struct BlockPool {
    block_size_tokens: u32,
    /// Number of block-table entries holding each block; 0 means free.
    ref_counts: Vec<u32>,
    /// The hash a block is registered under in `cached_blocks`, or `None`.
    block_hashes: Vec<Option<BlockHash>>,
    /// Prefix-cache index. Holds exactly the blocks whose `block_hashes` entry is set.
    cached_blocks: HashMap<BlockHash, BlockId>,
    free_queue: FreeQueue,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks of `block_size_tokens` tokens each, all free, to be
    /// handed out in id order.
    ///
    /// Limits: `block_size_tokens > 0`, and the pool's total capacity in tokens
    /// (`num_blocks * block_size_tokens`) must fit in a `u32`, so that every token count in
    /// this crate is a `u32` that cannot overflow.
    pub fn new(num_blocks: u32, block_size_tokens: u32) -> Self {
        assert!(
            block_size_tokens > 0,
            "BlockPool::new: block_size_tokens must be positive"
        );
        let capacity_tokens = num_blocks as u64 * block_size_tokens as u64;
        assert!(
            capacity_tokens <= u32::MAX as u64,
            "BlockPool::new: {num_blocks} blocks of {block_size_tokens} tokens exceed the u32 token limit"
        );
        BlockPool {
            block_size_tokens,
            ref_counts: vec![0; num_blocks as usize],
            block_hashes: vec![None; num_blocks as usize],
            cached_blocks: HashMap::new(),
            free_queue: FreeQueue::new_full(num_blocks),
        }
    }

    pub fn num_blocks(&self) -> u32 {
        self.ref_counts.len() as u32
    }

    pub fn block_size_tokens(&self) -> u32 {
        self.block_size_tokens
    }

    /// Blocks with ref count 0, including free blocks that still hold a cached hash.
    pub fn num_free_blocks(&self) -> u32 {
        self.free_queue.len()
    }

    /// Blocks registered in the prefix cache, whether in use or free.
    pub fn num_cached_blocks(&self) -> u32 {
        self.cached_blocks.len() as u32
    }

    /// Fraction of blocks in use, in `[0, 1]`, for the `kv_cache_usage_perc` metric.
    /// Free blocks that still hold cached K/V count as free, as in vLLM: they can be
    /// reallocated at any time.
    pub fn usage(&self) -> f64 {
        if self.num_blocks() == 0 {
            return 0.0;
        }
        1.0 - self.num_free_blocks() as f64 / self.num_blocks() as f64
    }

    pub fn ref_count(&self, block_id: BlockId) -> u32 {
        self.ref_counts[self.checked_index(block_id)]
    }

    /// The hash `block_id` is registered under in the prefix cache, if any.
    pub fn block_hash(&self, block_id: BlockId) -> Option<BlockHash> {
        self.block_hashes[self.checked_index(block_id)]
    }

    /// Takes the least recently freed block, with ref count 1, or `None` if every block is
    /// in use. Any cached hash the block held is dropped from the prefix cache.
    #[must_use = "a dropped BlockId leaks its reference"]
    pub fn allocate(&mut self) -> Option<BlockId> {
        let index = self.free_queue.pop_front()?;
        let block_id = BlockId(index);
        if let Some(old_hash) = self.block_hashes[block_id.index()].take() {
            let removed = self.cached_blocks.remove(&old_hash);
            assert_eq!(
                removed,
                Some(block_id),
                "pool: cache index disagrees with block {index}'s hash"
            );
        }
        debug_assert_eq!(self.ref_counts[block_id.index()], 0);
        self.ref_counts[block_id.index()] = 1;
        Some(block_id)
    }

    /// Takes `num_blocks` blocks, or none at all: on `None` nothing has changed.
    #[must_use = "dropped BlockIds leak their references"]
    pub fn allocate_n(&mut self, num_blocks: u32) -> Option<Vec<BlockId>> {
        if num_blocks > self.num_free_blocks() {
            return None;
        }
        let block_ids: Vec<BlockId> = (0..num_blocks)
            .map(|_| {
                self.allocate()
                    .expect("pool: free queue shorter than its length")
            })
            .collect();
        Some(block_ids)
    }

    /// Adds a reference to a block that is already in use (for example, when a fork shares
    /// it). Reviving a free block goes through `lookup_cached` instead: only a cached hash
    /// says what a free block holds.
    pub fn incref(&mut self, block_id: BlockId) {
        let index = self.checked_index(block_id);
        let ref_count = self.ref_counts[index];
        assert!(
            ref_count > 0,
            "pool: incref of free block {}; only lookup_cached revives free blocks",
            block_id.0
        );
        self.ref_counts[index] = ref_count.checked_add(1).expect("pool: ref count overflow");
    }

    /// Drops a reference. At 0 the block joins the free-queue tail, keeping its cached hash.
    pub fn decref(&mut self, block_id: BlockId) {
        let index = self.checked_index(block_id);
        let ref_count = self.ref_counts[index];
        assert!(
            ref_count > 0,
            "pool: decref of free block {} (double free)",
            block_id.0
        );
        self.ref_counts[index] = ref_count - 1;
        if ref_count == 1 {
            self.free_queue.push_back(block_id.0);
        }
    }

    /// Registers a full, in-use block under `block_hash` so later prompts can reuse it.
    ///
    /// Returns `true` if `block_id` is now the cached block for `block_hash` (including when
    /// it already was). Returns `false` if another block already holds that hash: the first
    /// registration wins, and this block stays uncached and is simply freed when its owners
    /// let go. (Two sequences can compute the same block at the same time; block tables are
    /// never rewritten to merge them, as vLLM does not either.)
    ///
    /// Panics if the block is free (only an owner can vouch for its contents) or already
    /// registered under a different hash (a full block's contents never change).
    pub fn cache_block(&mut self, block_id: BlockId, block_hash: BlockHash) -> bool {
        let index = self.checked_index(block_id);
        assert!(
            self.ref_counts[index] > 0,
            "pool: cache_block of free block {}",
            block_id.0
        );
        if let Some(existing_hash) = self.block_hashes[index] {
            assert_eq!(
                existing_hash, block_hash,
                "pool: block {} is already cached under a different hash",
                block_id.0
            );
            return true;
        }
        if self.cached_blocks.contains_key(&block_hash) {
            return false;
        }
        self.cached_blocks.insert(block_hash, block_id);
        self.block_hashes[index] = Some(block_hash);
        true
    }

    /// Drops an in-use block's prefix-cache entry, so that its owner may write it in place
    /// (later prompts miss it). Returns whether it had one.
    ///
    /// Panics if the block is free: a free block's hash is all that says what it holds.
    pub fn uncache(&mut self, block_id: BlockId) -> bool {
        let index = self.checked_index(block_id);
        assert!(
            self.ref_counts[index] > 0,
            "pool: uncache of free block {}",
            block_id.0
        );
        let Some(hash) = self.block_hashes[index].take() else {
            return false;
        };
        let removed = self.cached_blocks.remove(&hash);
        assert_eq!(
            removed,
            Some(block_id),
            "pool: cache index disagrees with block {}'s hash",
            block_id.0
        );
        true
    }

    /// The block cached under `block_hash`, without taking a reference. The answer is only
    /// good until the next `allocate`, which may evict it.
    pub fn cached_block(&self, block_hash: &BlockHash) -> Option<BlockId> {
        self.cached_blocks.get(block_hash).copied()
    }

    /// Prefix-cache hit: returns the block cached under `block_hash` and takes a reference
    /// to it. A free block is "touched": removed from the free queue, so it cannot be
    /// reallocated while the caller holds it.
    #[must_use = "a dropped BlockId leaks its reference"]
    pub fn lookup_cached(&mut self, block_hash: &BlockHash) -> Option<BlockId> {
        let block_id = self.cached_block(block_hash)?;
        let index = block_id.index();
        if self.ref_counts[index] == 0 {
            self.free_queue.remove(block_id.0);
        }
        self.ref_counts[index] = self.ref_counts[index]
            .checked_add(1)
            .expect("pool: ref count overflow");
        Some(block_id)
    }

    /// Free blocks from the next to be allocated to the most recently freed. O(free blocks);
    /// for tests and debugging.
    pub fn free_queue_order(&self) -> Vec<BlockId> {
        self.free_queue.to_vec().into_iter().map(BlockId).collect()
    }

    /// Panics with a message naming the broken rule unless:
    /// 1. the free queue is a well-formed list (see `FreeQueue::check_invariants`);
    /// 2. a block is in the free queue exactly when its ref count is 0, so the queue length
    ///    equals the number of ref-0 blocks;
    /// 3. the cache index and the per-block hashes agree in both directions.
    pub fn check_invariants(&self) {
        let num_blocks = self.num_blocks() as usize;
        assert_eq!(
            self.block_hashes.len(),
            num_blocks,
            "pool: block_hashes has the wrong length"
        );
        self.free_queue.check_invariants();

        let mut num_zero_ref_blocks: u32 = 0;
        for (index, &ref_count) in self.ref_counts.iter().enumerate() {
            let in_queue = self.free_queue.contains(index as u32);
            assert_eq!(
                in_queue,
                ref_count == 0,
                "pool: block {index} has ref count {ref_count} but in_free_queue = {in_queue}"
            );
            if ref_count == 0 {
                num_zero_ref_blocks += 1;
            }
        }
        assert_eq!(
            self.free_queue.len(),
            num_zero_ref_blocks,
            "pool: free queue length differs from the number of ref-0 blocks"
        );

        let mut num_hashed_blocks: usize = 0;
        for (index, block_hash) in self.block_hashes.iter().enumerate() {
            if let Some(block_hash) = block_hash {
                num_hashed_blocks += 1;
                assert_eq!(
                    self.cached_blocks.get(block_hash),
                    Some(&BlockId(index as u32)),
                    "pool: block {index} has hash {block_hash:?} but the cache index does not map it back"
                );
            }
        }
        assert_eq!(
            self.cached_blocks.len(),
            num_hashed_blocks,
            "pool: cache index has entries for blocks that hold no hash"
        );
    }

    fn checked_index(&self, block_id: BlockId) -> usize {
        assert!(
            block_id.0 < self.num_blocks(),
            "pool: block {} is out of range (num_blocks = {})",
            block_id.0,
            self.num_blocks()
        );
        block_id.index()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::hash_block;

    fn ids(raw: &[u32]) -> Vec<BlockId> {
        raw.iter().copied().map(BlockId).collect()
    }

    fn hash_of(token_id: u32) -> BlockHash {
        hash_block(None, &[token_id], b"")
    }

    #[test]
    fn fresh_pool_hands_out_ids_in_order() {
        let mut pool = BlockPool::new(4, 16);
        assert_eq!(pool.num_blocks(), 4);
        assert_eq!(pool.block_size_tokens(), 16);
        assert_eq!(pool.allocate(), Some(BlockId(0)));
        assert_eq!(pool.allocate(), Some(BlockId(1)));
        assert_eq!(pool.free_queue_order(), ids(&[2, 3]));
        assert_eq!(pool.ref_count(BlockId(0)), 1);
        assert_eq!(pool.num_free_blocks(), 2);
        pool.check_invariants();
    }

    #[test]
    fn free_queue_order_after_alloc_and_free() {
        let mut pool = BlockPool::new(6, 4);
        let taken = pool.allocate_n(4).unwrap();
        assert_eq!(taken, ids(&[0, 1, 2, 3]));
        assert_eq!(pool.free_queue_order(), ids(&[4, 5]));
        pool.decref(BlockId(2));
        pool.decref(BlockId(0));
        assert_eq!(pool.free_queue_order(), ids(&[4, 5, 2, 0]));
        pool.decref(BlockId(3));
        assert_eq!(pool.free_queue_order(), ids(&[4, 5, 2, 0, 3]));
        pool.check_invariants();
    }

    #[test]
    fn lru_reuse_order() {
        let mut pool = BlockPool::new(3, 4);
        pool.allocate_n(3).unwrap();
        pool.decref(BlockId(1));
        pool.decref(BlockId(2));
        pool.decref(BlockId(0));
        // Least recently freed first.
        assert_eq!(pool.allocate(), Some(BlockId(1)));
        assert_eq!(pool.allocate(), Some(BlockId(2)));
        assert_eq!(pool.allocate(), Some(BlockId(0)));
        assert_eq!(pool.allocate(), None);
        pool.check_invariants();
    }

    #[test]
    fn shared_block_frees_on_last_decref() {
        let mut pool = BlockPool::new(2, 4);
        let block = pool.allocate().unwrap();
        pool.incref(block);
        assert_eq!(pool.ref_count(block), 2);
        pool.decref(block);
        assert_eq!(pool.free_queue_order(), ids(&[1]));
        pool.decref(block);
        assert_eq!(pool.free_queue_order(), ids(&[1, 0]));
        pool.check_invariants();
    }

    #[test]
    fn allocation_failure_leaves_state_unchanged() {
        let mut pool = BlockPool::new(4, 4);
        pool.allocate_n(2).unwrap();
        pool.decref(BlockId(0));
        let before = pool.free_queue_order();
        assert_eq!(before, ids(&[2, 3, 0]));
        assert_eq!(pool.allocate_n(4), None);
        assert_eq!(pool.free_queue_order(), before);
        assert_eq!(pool.num_free_blocks(), 3);
        assert_eq!(pool.allocate_n(0), Some(vec![]));
        pool.check_invariants();
    }

    #[test]
    fn prefix_cache_hit_after_free_revives_the_block() {
        let mut pool = BlockPool::new(4, 4);
        let block = pool.allocate().unwrap();
        assert!(pool.cache_block(block, hash_of(7)));
        pool.decref(block);
        assert_eq!(pool.free_queue_order(), ids(&[1, 2, 3, 0]));
        assert_eq!(pool.num_cached_blocks(), 1, "a freed block keeps its hash");

        assert_eq!(pool.lookup_cached(&hash_of(7)), Some(block));
        assert_eq!(pool.ref_count(block), 1);
        assert_eq!(
            pool.free_queue_order(),
            ids(&[1, 2, 3]),
            "the touch takes it out of the free queue"
        );
        assert_eq!(pool.lookup_cached(&hash_of(8)), None);
        pool.check_invariants();
    }

    #[test]
    fn lookup_of_in_use_block_shares_it() {
        let mut pool = BlockPool::new(2, 4);
        let block = pool.allocate().unwrap();
        pool.cache_block(block, hash_of(1));
        assert_eq!(pool.lookup_cached(&hash_of(1)), Some(block));
        assert_eq!(pool.ref_count(block), 2);
        assert_eq!(pool.num_free_blocks(), 1);
        pool.check_invariants();
    }

    #[test]
    fn prefix_cache_miss_after_reallocation() {
        let mut pool = BlockPool::new(2, 4);
        let block = pool.allocate().unwrap();
        pool.cache_block(block, hash_of(7));
        pool.decref(block);
        // Block 1 is older in the queue, so it goes first and block 0 keeps its hash.
        assert_eq!(pool.allocate(), Some(BlockId(1)));
        assert_eq!(pool.cached_block(&hash_of(7)), Some(block));
        // Now block 0 is reallocated: its hash must be gone.
        assert_eq!(pool.allocate(), Some(block));
        assert_eq!(pool.cached_block(&hash_of(7)), None);
        assert_eq!(pool.block_hash(block), None);
        assert_eq!(pool.num_cached_blocks(), 0);
        pool.check_invariants();
    }

    #[test]
    fn duplicate_hash_first_registration_wins() {
        let mut pool = BlockPool::new(3, 4);
        let first = pool.allocate().unwrap();
        let second = pool.allocate().unwrap();
        assert!(pool.cache_block(first, hash_of(5)));
        assert!(!pool.cache_block(second, hash_of(5)));
        assert!(
            pool.cache_block(first, hash_of(5)),
            "re-registering the same hash is a no-op"
        );
        assert_eq!(pool.block_hash(second), None);
        assert_eq!(pool.cached_block(&hash_of(5)), Some(first));
        pool.check_invariants();
    }

    #[test]
    fn usage_is_fraction_in_use() {
        let mut pool = BlockPool::new(4, 4);
        assert_eq!(pool.usage(), 0.0);
        pool.allocate_n(3).unwrap();
        assert_eq!(pool.usage(), 0.75);
        assert_eq!(BlockPool::new(0, 4).usage(), 0.0);
    }

    #[test]
    #[should_panic(expected = "decref of free block 1 (double free)")]
    fn decref_of_free_block_panics() {
        let mut pool = BlockPool::new(2, 4);
        pool.decref(BlockId(1));
    }

    #[test]
    #[should_panic(expected = "incref of free block 0")]
    fn incref_of_free_block_panics() {
        let mut pool = BlockPool::new(2, 4);
        pool.incref(BlockId(0));
    }

    #[test]
    #[should_panic(expected = "cache_block of free block 0")]
    fn cache_block_of_free_block_panics() {
        let mut pool = BlockPool::new(2, 4);
        pool.cache_block(BlockId(0), hash_of(1));
    }

    #[test]
    #[should_panic(expected = "already cached under a different hash")]
    fn recaching_under_another_hash_panics() {
        let mut pool = BlockPool::new(2, 4);
        let block = pool.allocate().unwrap();
        pool.cache_block(block, hash_of(1));
        pool.cache_block(block, hash_of(2));
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn out_of_range_block_panics() {
        let pool = BlockPool::new(2, 4);
        pool.ref_count(BlockId(2));
    }

    #[test]
    #[should_panic(expected = "exceed the u32 token limit")]
    fn token_capacity_limit_is_enforced() {
        BlockPool::new(u32::MAX / 8, 16);
    }

    #[test]
    #[should_panic(expected = "cache index does not map it back")]
    fn check_invariants_catches_hash_disagreement() {
        let mut pool = BlockPool::new(2, 4);
        let block = pool.allocate().unwrap();
        pool.cache_block(block, hash_of(1));
        pool.cached_blocks.insert(hash_of(1), BlockId(1));
        pool.check_invariants();
    }

    #[test]
    #[should_panic(expected = "ref count 0 but in_free_queue = false")]
    fn check_invariants_catches_a_lost_free_block() {
        let mut pool = BlockPool::new(2, 4);
        let block = pool.allocate().unwrap();
        pool.ref_counts[block.index()] = 0;
        pool.check_invariants();
    }
}
