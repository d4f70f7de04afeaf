//! Exact-behaviour tests of `KvCacheManager` through the public API: slot placement,
//! prefix-cache hits and misses, the never-a-full-hit rule, fork with copy-on-write,
//! eviction, and failure atomicity. `check_invariants` runs after every mutation.

use pk_kv::{BlockCopy, BlockId, KvCacheManager, NewSlots, SeqId, Slot};

const BLOCK_SIZE_TOKENS: u32 = 4;

fn ids(raw: &[u32]) -> Vec<BlockId> {
    raw.iter().copied().map(BlockId).collect()
}

fn tokens(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

/// Adds `seq` with whatever prefix of `prompt` is cached, computes the rest, and registers
/// its full blocks. Returns the number of cached prompt tokens.
fn run_prompt(manager: &mut KvCacheManager, seq: SeqId, prompt: &[u32], extra: &[u8]) -> u32 {
    let prefix = manager.get_computed_prefix(prompt, extra);
    let num_cached_tokens = manager.add_sequence(seq, &prefix);
    assert_eq!(num_cached_tokens, prefix.num_cached_tokens());
    manager
        .allocate_slots(seq, prompt.len() as u32 - num_cached_tokens)
        .expect("test pool too small");
    manager.cache_full_blocks(seq, prompt);
    manager.check_invariants();
    num_cached_tokens
}

#[test]
fn allocate_slots_reports_positions_and_slots() {
    let mut manager = KvCacheManager::new(8, BLOCK_SIZE_TOKENS);
    let prefix = manager.get_computed_prefix(&tokens(0..6), b"");
    assert_eq!(manager.add_sequence(SeqId(1), &prefix), 0);
    let new_slots = manager.allocate_slots(SeqId(1), 6).unwrap();
    let slot = |block, offset| Slot {
        block_id: BlockId(block),
        offset_tokens: offset,
    };
    assert_eq!(
        new_slots,
        NewSlots {
            first_position: 0,
            slots: vec![
                slot(0, 0),
                slot(0, 1),
                slot(0, 2),
                slot(0, 3),
                slot(1, 0),
                slot(1, 1)
            ],
        }
    );
    let decode = manager.allocate_slots(SeqId(1), 1).unwrap();
    assert_eq!(
        decode,
        NewSlots {
            first_position: 6,
            slots: vec![slot(1, 2)]
        }
    );
    assert_eq!(
        manager.block_table(SeqId(1)).unwrap().block_ids(),
        ids(&[0, 1])
    );
    assert_eq!(manager.usage(), 0.25);
    manager.check_invariants();
}

#[test]
fn prefix_hit_after_free_reuses_the_same_blocks() {
    let mut manager = KvCacheManager::new(8, BLOCK_SIZE_TOKENS);
    let prompt = tokens(0..10);
    assert_eq!(run_prompt(&mut manager, SeqId(1), &prompt, b"m"), 0);
    assert_eq!(
        manager.pool().num_cached_blocks(),
        2,
        "two full blocks of ten tokens"
    );
    assert!(manager.free(SeqId(1)));
    assert_eq!(
        manager.pool().free_queue_order(),
        ids(&[3, 4, 5, 6, 7, 2, 1, 0])
    );

    let prefix = manager.get_computed_prefix(&prompt, b"m");
    assert_eq!(prefix.block_ids(), ids(&[0, 1]));
    assert_eq!(prefix.num_cached_tokens(), 8);
    assert_eq!(manager.add_sequence(SeqId(2), &prefix), 8);
    assert_eq!(
        manager.pool().free_queue_order(),
        ids(&[3, 4, 5, 6, 7, 2]),
        "the hit blocks left the free queue"
    );
    let new_slots = manager.allocate_slots(SeqId(2), 2).unwrap();
    assert_eq!(new_slots.first_position, 8);
    assert_eq!(
        new_slots.slots[0],
        Slot {
            block_id: BlockId(3),
            offset_tokens: 0
        }
    );
    assert_eq!(
        manager.block_table(SeqId(2)).unwrap().block_ids(),
        ids(&[0, 1, 3])
    );
    manager.check_invariants();
}

#[test]
fn prefix_is_shared_by_running_sequences() {
    let mut manager = KvCacheManager::new(8, BLOCK_SIZE_TOKENS);
    run_prompt(&mut manager, SeqId(1), &tokens(0..9), b"");
    // Same first 8 tokens, different tail.
    let mut prompt = tokens(0..8);
    prompt.extend([100, 101, 102]);
    assert_eq!(run_prompt(&mut manager, SeqId(2), &prompt, b""), 8);
    assert_eq!(manager.pool().ref_count(BlockId(0)), 2);
    assert_eq!(manager.pool().ref_count(BlockId(1)), 2);
    assert_eq!(
        manager.block_table(SeqId(2)).unwrap().block_ids(),
        ids(&[0, 1, 3])
    );
}

#[test]
fn never_a_full_hit() {
    let mut manager = KvCacheManager::new(8, BLOCK_SIZE_TOKENS);
    run_prompt(&mut manager, SeqId(1), &tokens(0..8), b"");
    manager.allocate_slots(SeqId(1), 1).unwrap();
    manager.cache_full_blocks(SeqId(1), &tokens(0..9));
    assert_eq!(manager.pool().num_cached_blocks(), 2);
    // Both blocks of an 8-token prompt are cached, but the last token must be computed.
    assert_eq!(
        manager
            .get_computed_prefix(&tokens(0..8), b"")
            .num_cached_tokens(),
        4
    );
    assert_eq!(
        manager
            .get_computed_prefix(&tokens(0..9), b"")
            .num_cached_tokens(),
        8
    );
    assert_eq!(
        manager
            .get_computed_prefix(&tokens(0..1), b"")
            .num_cached_tokens(),
        0
    );
    assert_eq!(manager.get_computed_prefix(&[], b"").num_cached_tokens(), 0);
}

#[test]
fn extra_bytes_isolate_caches() {
    let mut manager = KvCacheManager::new(8, BLOCK_SIZE_TOKENS);
    run_prompt(&mut manager, SeqId(1), &tokens(0..9), b"model-a");
    assert_eq!(
        manager
            .get_computed_prefix(&tokens(0..9), b"model-b")
            .num_cached_tokens(),
        0
    );
    assert_eq!(
        manager
            .get_computed_prefix(&tokens(0..9), b"model-a")
            .num_cached_tokens(),
        8
    );
    // A different first block breaks the chain even if the second block matches.
    let mut prompt = tokens(0..9);
    prompt[0] = 99;
    assert_eq!(
        manager
            .get_computed_prefix(&prompt, b"model-a")
            .num_cached_tokens(),
        0
    );
}

#[test]
fn lru_evicts_the_tail_of_a_freed_prompt_first() {
    let mut manager = KvCacheManager::new(4, BLOCK_SIZE_TOKENS);
    run_prompt(&mut manager, SeqId(1), &tokens(0..16), b"");
    assert_eq!(manager.pool().num_cached_blocks(), 4);
    manager.free(SeqId(1));
    assert_eq!(manager.pool().free_queue_order(), ids(&[3, 2, 1, 0]));
    // Another sequence needs one block: the prompt's last block is the one reused.
    run_prompt(&mut manager, SeqId(2), &[500, 501], b"");
    assert_eq!(
        manager.block_table(SeqId(2)).unwrap().block_ids(),
        ids(&[3])
    );
    assert_eq!(manager.pool().num_cached_blocks(), 3);
    let prefix = manager.get_computed_prefix(&tokens(0..17), b"");
    assert_eq!(
        prefix.block_ids(),
        ids(&[0, 1, 2]),
        "blocks 0..3 are still cached"
    );
}

#[test]
fn stale_prefix_is_cut_at_the_first_reallocated_block() {
    let mut manager = KvCacheManager::new(3, BLOCK_SIZE_TOKENS);
    run_prompt(&mut manager, SeqId(1), &tokens(0..12), b"");
    manager.free(SeqId(1));
    let prefix = manager.get_computed_prefix(&tokens(0..13), b"");
    assert_eq!(prefix.block_ids(), ids(&[0, 1, 2]));
    // Before the prefix is adopted, another sequence takes block 2 (the LRU head).
    run_prompt(&mut manager, SeqId(2), &[7], b"");
    assert_eq!(
        manager.block_table(SeqId(2)).unwrap().block_ids(),
        ids(&[2])
    );
    assert_eq!(
        manager.add_sequence(SeqId(3), &prefix),
        8,
        "only blocks 0 and 1 are still cached"
    );
    assert_eq!(
        manager.block_table(SeqId(3)).unwrap().block_ids(),
        ids(&[0, 1])
    );
    manager.check_invariants();
}

#[test]
fn failed_allocation_changes_nothing() {
    let mut manager = KvCacheManager::new(3, BLOCK_SIZE_TOKENS);
    run_prompt(&mut manager, SeqId(1), &tokens(0..6), b"");
    let free_before = manager.pool().free_queue_order();
    assert_eq!(
        manager.allocate_slots(SeqId(1), 7),
        None,
        "6 + 7 tokens need 4 blocks of 3"
    );
    assert_eq!(manager.pool().free_queue_order(), free_before);
    let table = manager.block_table(SeqId(1)).unwrap();
    assert_eq!(table.block_ids(), ids(&[0, 1]));
    assert_eq!(table.num_stored_tokens(), 6);
    assert!(
        manager.allocate_slots(SeqId(1), 6).is_some(),
        "exactly the free capacity fits"
    );
    manager.check_invariants();
}

#[test]
fn fork_with_copy_on_write_then_diverge() {
    let mut manager = KvCacheManager::new(8, BLOCK_SIZE_TOKENS);
    run_prompt(&mut manager, SeqId(1), &tokens(0..6), b"");
    let copy = manager.fork(SeqId(1), SeqId(2)).unwrap();
    assert_eq!(
        copy,
        vec![BlockCopy {
            src: BlockId(1),
            dst: BlockId(2),
            num_tokens: 2
        }]
    );
    assert_eq!(
        manager.block_table(SeqId(2)).unwrap().block_ids(),
        ids(&[0, 2])
    );
    manager.check_invariants();

    // Each branch writes its own next token into its own partial block.
    let parent_slots = manager.allocate_slots(SeqId(1), 1).unwrap();
    let child_slots = manager.allocate_slots(SeqId(2), 1).unwrap();
    assert_eq!(
        parent_slots.slots,
        vec![Slot {
            block_id: BlockId(1),
            offset_tokens: 2
        }]
    );
    assert_eq!(
        child_slots.slots,
        vec![Slot {
            block_id: BlockId(2),
            offset_tokens: 2
        }]
    );
    assert_eq!(child_slots.first_position, 6);
    manager.check_invariants();

    manager.free(SeqId(1));
    assert_eq!(
        manager.pool().ref_count(BlockId(0)),
        1,
        "the child still holds the shared block"
    );
    manager.free(SeqId(2));
    assert_eq!(manager.pool().num_free_blocks(), 8);
    manager.check_invariants();
}

#[test]
fn fork_fails_as_a_value_when_no_block_for_the_copy() {
    let mut manager = KvCacheManager::new(2, BLOCK_SIZE_TOKENS);
    run_prompt(&mut manager, SeqId(1), &tokens(0..6), b"");
    assert_eq!(manager.fork(SeqId(1), SeqId(2)), None);
    assert_eq!(manager.num_sequences(), 1);
    assert!(manager.block_table(SeqId(2)).is_none());
    manager.check_invariants();
}

#[test]
fn forked_child_caches_its_own_blocks() {
    let mut manager = KvCacheManager::new(8, BLOCK_SIZE_TOKENS);
    let prompt = tokens(0..6);
    run_prompt(&mut manager, SeqId(1), &prompt, b"");
    manager.fork(SeqId(1), SeqId(2)).unwrap();
    let mut child_tokens = prompt.clone();
    child_tokens.extend([70, 71]);
    manager.allocate_slots(SeqId(2), 2).unwrap();
    manager.cache_full_blocks(SeqId(2), &child_tokens);
    manager.check_invariants();
    let prefix = manager.get_computed_prefix(&[child_tokens.clone(), vec![0]].concat(), b"");
    assert_eq!(
        prefix.block_ids(),
        ids(&[0, 2]),
        "the child's copied block is now cached"
    );
}

#[test]
fn remove_block_evicts_and_stops_prefix_caching() {
    let mut manager = KvCacheManager::new(8, BLOCK_SIZE_TOKENS);
    let mut all_tokens = tokens(0..14);
    run_prompt(&mut manager, SeqId(1), &all_tokens, b"");
    assert_eq!(manager.pool().num_cached_blocks(), 3);
    assert_eq!(manager.remove_block(SeqId(1), 1), BlockId(1));
    let table = manager.block_table(SeqId(1)).unwrap();
    assert_eq!(table.block_ids(), ids(&[0, 2, 3]));
    assert_eq!(table.num_stored_tokens(), 10);
    assert_eq!(table.next_position(), 14);
    assert_eq!(manager.pool().free_queue_order(), ids(&[4, 5, 6, 7, 1]));
    manager.check_invariants();

    // Decode continues at the absolute position; the newly filled block is not cached.
    let new_slots = manager.allocate_slots(SeqId(1), 2).unwrap();
    assert_eq!(new_slots.first_position, 14);
    all_tokens.extend([14, 15]);
    manager.cache_full_blocks(SeqId(1), &all_tokens);
    assert_eq!(
        manager.pool().num_cached_blocks(),
        3,
        "block 3 filled after eviction stays uncached"
    );
    manager.check_invariants();

    // Blocks cached before the eviction are still valid prefix-cache entries.
    assert_eq!(
        manager.get_computed_prefix(&tokens(0..13), b"").block_ids(),
        ids(&[0, 1, 2])
    );
}

#[test]
fn free_of_unknown_sequence_is_false() {
    let mut manager = KvCacheManager::new(2, BLOCK_SIZE_TOKENS);
    assert!(!manager.free(SeqId(9)));
}

#[test]
#[should_panic(expected = "add_sequence: SeqId(1) already exists")]
fn adding_a_sequence_twice_panics() {
    let mut manager = KvCacheManager::new(2, BLOCK_SIZE_TOKENS);
    let prefix = manager.get_computed_prefix(&[], b"");
    manager.add_sequence(SeqId(1), &prefix);
    manager.add_sequence(SeqId(1), &prefix);
}

#[test]
#[should_panic(expected = "allocate_slots: unknown sequence SeqId(4)")]
fn allocating_for_an_unknown_sequence_panics() {
    let mut manager = KvCacheManager::new(2, BLOCK_SIZE_TOKENS);
    let _ = manager.allocate_slots(SeqId(4), 1);
}

#[test]
#[should_panic(expected = "is the partial last block")]
fn evicting_the_partial_block_panics() {
    let mut manager = KvCacheManager::new(4, BLOCK_SIZE_TOKENS);
    run_prompt(&mut manager, SeqId(1), &tokens(0..6), b"");
    manager.remove_block(SeqId(1), 1);
}
