//! Prefill compaction and truncation through `KvCacheManager`: exact moves and block
//! ids, prefix caching stopped after pruning, cached and shared blocks never written, and
//! a property test with arbitrary keep lists checked against a slot-content model.

use proptest::prelude::*;

use pk_kv::{BlockId, KvCacheManager, SeqId, Slot, TokenMove};

const B: u32 = 4;

fn ids(raw: &[u32]) -> Vec<BlockId> {
    raw.iter().copied().map(BlockId).collect()
}

/// Starts `seq` on `prompt` with whatever prefix is cached, computes the rest, and
/// caches its full blocks.
fn prefill(manager: &mut KvCacheManager, seq: SeqId, prompt: &[u32]) {
    let prefix = manager.get_computed_prefix(prompt, b"");
    let cached = manager.add_sequence(seq, &prefix);
    manager
        .allocate_slots(seq, prompt.len() as u32 - cached)
        .unwrap();
    manager.cache_full_blocks(seq, prompt);
    manager.check_invariants();
}

fn pairs(moves: &[TokenMove]) -> Vec<(u32, u32)> {
    moves
        .iter()
        .map(|m| (m.from_stored_index, m.to_stored_index))
        .collect()
}

#[test]
fn compaction_stops_prefix_caching_and_keeps_positions() {
    let mut manager = KvCacheManager::new(16, B);
    let prompt: Vec<u32> = (0..14).collect();
    let prefix = manager.get_computed_prefix(&prompt, b"");
    manager.add_sequence(SeqId(1), &prefix);
    manager.allocate_slots(SeqId(1), 14).unwrap();
    // Not cached before pruning: no block needs a private copy.
    let moves = manager
        .compact(SeqId(1), &[0, 1, 2, 3, 6, 7, 8, 12, 13])
        .unwrap();
    assert_eq!(
        pairs(&moves),
        vec![(6, 4), (7, 5), (8, 6), (12, 7), (13, 8)]
    );
    let table = manager.block_table(SeqId(1)).unwrap();
    assert_eq!(table.block_ids(), ids(&[0, 1, 2]));
    assert_eq!(table.num_stored_tokens(), 9);
    assert_eq!(table.next_position(), 14);
    manager.check_invariants();

    // New tokens continue at position 14; their blocks never reach the prefix cache.
    let slots = manager.allocate_slots(SeqId(1), 7).unwrap();
    assert_eq!(slots.first_position, 14);
    let tokens: Vec<u32> = (0..21).collect();
    manager.cache_full_blocks(SeqId(1), &tokens);
    assert_eq!(manager.pool().num_cached_blocks(), 0);
    manager.check_invariants();
    manager.free(SeqId(1));
    assert_eq!(manager.pool().num_free_blocks(), 16);
}

#[test]
fn keeping_everything_keeps_prefix_caching() {
    let mut manager = KvCacheManager::new(8, B);
    let prompt: Vec<u32> = (0..6).collect();
    prefill(&mut manager, SeqId(1), &prompt);
    let moves = manager.compact(SeqId(1), &[0, 1, 2, 3, 4, 5]).unwrap();
    assert!(moves.is_empty());
    manager.allocate_slots(SeqId(1), 2).unwrap();
    let tokens: Vec<u32> = (0..8).collect();
    manager.cache_full_blocks(SeqId(1), &tokens);
    assert_eq!(manager.pool().num_cached_blocks(), 2, "still caching");
    manager.check_invariants();
}

#[test]
fn compaction_never_writes_a_block_the_prefix_cache_holds() {
    let mut manager = KvCacheManager::new(16, B);
    let prompt: Vec<u32> = (0..13).collect();
    prefill(&mut manager, SeqId(1), &prompt);
    manager.free(SeqId(1));
    // Blocks 0, 1, 2 hold the prompt's first 12 tokens, cached and free.
    prefill(&mut manager, SeqId(2), &prompt);
    assert_eq!(
        manager.block_table(SeqId(2)).unwrap().block_ids()[..3],
        ids(&[0, 1, 2])[..]
    );
    // Drop tokens 1 and 5: blocks 0 and 1 receive moves and block 2 becomes partial, so
    // all three get private copies; cached blocks 0, 1, 2 keep their bytes.
    let keep = [0, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12];
    let moves = manager.compact(SeqId(2), &keep).unwrap();
    let table = manager.block_table(SeqId(2)).unwrap();
    let new_ids = table.block_ids().to_vec();
    assert_eq!(new_ids.len(), 3);
    assert!(
        new_ids.iter().all(|id| id.0 > 3),
        "fresh blocks, got {new_ids:?}"
    );
    // Every kept token is copied into the private blocks, from the cached ones.
    assert_eq!(moves.len(), keep.len());
    for (to, m) in moves.iter().enumerate() {
        assert_eq!(m.to_stored_index, to as u32);
        assert_eq!(m.from_stored_index, keep[to]);
        assert_eq!(m.dst.block_id, new_ids[to / B as usize]);
    }
    assert_eq!(
        moves[10].src,
        Slot {
            block_id: BlockId(4),
            offset_tokens: 0
        },
        "token 12 came from the sequence's own partial block (the free queue's head)"
    );
    manager.check_invariants();
    // Another request still finds the original cached blocks.
    let prefix = manager.get_computed_prefix(&prompt, b"");
    assert_eq!(prefix.block_ids(), ids(&[0, 1, 2]));
}

#[test]
fn truncate_frees_the_tail_and_stops_caching() {
    let mut manager = KvCacheManager::new(8, B);
    let prompt: Vec<u32> = (0..10).collect();
    prefill(&mut manager, SeqId(1), &prompt);
    // Truncating into cached block 1 makes it partial: it gets a private copy.
    let moves = manager.truncate(SeqId(1), 6).unwrap();
    assert_eq!(pairs(&moves), vec![(4, 4), (5, 5)]);
    let table = manager.block_table(SeqId(1)).unwrap();
    assert_eq!(table.block_ids(), ids(&[0, 3]));
    assert_eq!(table.next_position(), 10);
    manager.check_invariants();
    // Truncating to a block boundary moves nothing.
    assert!(manager.truncate(SeqId(1), 4).unwrap().is_empty());
    assert_eq!(
        manager.block_table(SeqId(1)).unwrap().block_ids(),
        ids(&[0])
    );
    manager.check_invariants();
    manager.free(SeqId(1));
    assert_eq!(manager.pool().num_free_blocks(), 8);
}

#[test]
fn failed_compaction_changes_nothing() {
    let mut manager = KvCacheManager::new(3, B);
    let prompt: Vec<u32> = (0..8).collect();
    prefill(&mut manager, SeqId(1), &prompt);
    assert_eq!(manager.fork(SeqId(1), SeqId(2)), Some(vec![]));
    prefill(&mut manager, SeqId(3), &[9, 9, 9]);
    // Both of SeqId(1)'s blocks are shared with SeqId(2) and would need private copies,
    // but no block is free, so the compaction fails as a value.
    assert_eq!(manager.pool().num_free_blocks(), 0);
    assert_eq!(manager.compact(SeqId(1), &[1, 2, 3, 4, 5]), None);
    assert_eq!(
        manager.block_table(SeqId(1)).unwrap().num_stored_tokens(),
        8
    );
    manager.check_invariants();
}

/// A full pool, and a sequence whose blocks are cached and held by it alone (a prompt that
/// adopted the prefix cache): the copies that would keep the cache entries do not fit, so
/// the entries are given up and the blocks compacted in place; the pool stays full and
/// the prompt no longer hits.
#[test]
fn with_no_free_block_a_sole_owner_gives_up_the_cache_entries_instead() {
    // Nine tokens: two full blocks, cached, and the last token in a third.
    let mut manager = KvCacheManager::new(3, B);
    let prompt: Vec<u32> = (0..9).collect();
    prefill(&mut manager, SeqId(1), &prompt);
    manager.free(SeqId(1));
    prefill(&mut manager, SeqId(2), &prompt);
    assert_eq!(
        manager.block_table(SeqId(2)).unwrap().block_ids(),
        ids(&[0, 1, 2])
    );
    assert_eq!(manager.pool().num_free_blocks(), 0);
    assert_eq!(manager.pool().num_cached_blocks(), 2);
    let moves = manager.compact(SeqId(2), &[1, 2, 3, 4, 5]).unwrap();
    assert_eq!(pairs(&moves), vec![(1, 0), (2, 1), (3, 2), (4, 3), (5, 4)]);
    // Written in place: the same blocks, no longer cached.
    let table = manager.block_table(SeqId(2)).unwrap();
    assert_eq!(table.block_ids(), ids(&[0, 1]));
    assert_eq!(manager.pool().num_cached_blocks(), 0);
    manager.check_invariants();
    assert!(manager
        .get_computed_prefix(&prompt, b"")
        .block_ids()
        .is_empty());
}

// -----------------------------------------------------------------------------------------
// Property test: arbitrary keep lists, with the prompt shared through a donor or not.
// -----------------------------------------------------------------------------------------

/// Which position each physical slot holds, as an engine's K/V store would.
struct SlotContents {
    positions: Vec<Option<u32>>,
}

impl SlotContents {
    fn index(slot: Slot) -> usize {
        (slot.block_id.0 * B + slot.offset_tokens) as usize
    }
    fn get(&self, slot: Slot) -> Option<u32> {
        self.positions[Self::index(slot)]
    }
    fn set(&mut self, slot: Slot, position: Option<u32>) {
        self.positions[Self::index(slot)] = position;
    }
}

proptest! {
    #[test]
    fn compaction_moves_the_kept_tokens_and_spares_shared_blocks(
        prompt_len in 0u32..=30,
        keep_mask in proptest::collection::vec(any::<bool>(), 30),
        donor in 0u8..3,
        decode_len in 0u32..=9,
    ) {
        let num_blocks = 24;
        let mut manager = KvCacheManager::new(num_blocks, B);
        let mut contents = SlotContents { positions: vec![None; (num_blocks * B) as usize] };
        let prompt: Vec<u32> = (0..prompt_len).collect();
        let run_prompt = |manager: &mut KvCacheManager, contents: &mut SlotContents, seq: SeqId| {
            let prefix = manager.get_computed_prefix(&prompt, b"");
            let cached = manager.add_sequence(seq, &prefix);
            let new_slots = manager.allocate_slots(seq, prompt_len - cached).unwrap();
            for (i, slot) in new_slots.slots.iter().enumerate() {
                contents.set(*slot, Some(new_slots.first_position as u32 + i as u32));
            }
            manager.cache_full_blocks(seq, &prompt);
        };
        // donor: 0 none, 1 alive (shared blocks), 2 finished (cached, free blocks).
        if donor > 0 {
            run_prompt(&mut manager, &mut contents, SeqId(2));
            if donor == 2 {
                manager.free(SeqId(2));
            }
        }
        run_prompt(&mut manager, &mut contents, SeqId(1));

        let keep: Vec<u32> = (0..prompt_len).filter(|&i| keep_mask[i as usize]).collect();
        let moves = manager.compact(SeqId(1), &keep).unwrap();
        let mut last_to = None;
        for m in &moves {
            prop_assert!(m.from_stored_index >= m.to_stored_index);
            prop_assert!(last_to < Some(m.to_stored_index), "moves in ascending order");
            last_to = Some(m.to_stored_index);
            let position = contents.get(m.src);
            contents.set(m.dst, position);
        }
        manager.check_invariants();
        let table = manager.block_table(SeqId(1)).unwrap();
        prop_assert_eq!(table.num_stored_tokens(), keep.len() as u32);
        prop_assert_eq!(table.next_position(), prompt_len as u64);
        for (index, &position) in keep.iter().enumerate() {
            prop_assert_eq!(contents.get(table.slot(index as u32)), Some(position));
        }
        // Cached prompt blocks still hold the prompt.
        let prefix = manager.get_computed_prefix(&prompt, b"");
        for (k, block_id) in prefix.block_ids().iter().enumerate() {
            for offset in 0..B {
                let slot = Slot { block_id: *block_id, offset_tokens: offset };
                prop_assert_eq!(contents.get(slot), Some(k as u32 * B + offset));
            }
        }
        // The donor's blocks are untouched.
        if donor == 1 {
            let donor_table = manager.block_table(SeqId(2)).unwrap();
            for index in 0..prompt_len {
                prop_assert_eq!(contents.get(donor_table.slot(index)), Some(index));
            }
        }
        // Decode continues at the absolute position, into a private block.
        if decode_len > 0 {
            let new_slots = manager.allocate_slots(SeqId(1), decode_len).unwrap();
            prop_assert_eq!(new_slots.first_position, prompt_len as u64);
            manager.check_invariants();
        }
        manager.free(SeqId(1));
        manager.free(SeqId(2));
        prop_assert_eq!(manager.pool().num_free_blocks(), num_blocks);
    }
}

// -----------------------------------------------------------------------------------------
// Per-unit compaction (`layer`/`head` granularity): each unit keeps its own tokens.
// -----------------------------------------------------------------------------------------

/// A sorted subset of `keep_len` of the stored indices `0..prompt_len`, chosen by a seeded
/// shuffle (xorshift), so that each unit of a test keeps different tokens.
fn seeded_keep(seed: u64, prompt_len: u32, keep_len: u32) -> Vec<u32> {
    let mut order: Vec<u32> = (0..prompt_len).collect();
    let mut x = seed | 1;
    for i in (1..order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let mut keep = order[..keep_len as usize].to_vec();
    keep.sort_unstable();
    keep
}

proptest! {
    /// Every unit ends up holding exactly its own keep list, in order, in the new layout;
    /// a donor's shared blocks and the prefix cache's blocks are never written, in any unit.
    #[test]
    fn unit_compaction_gives_each_unit_its_own_tokens(
        prompt_len in 1u32..=30,
        n_units in 1usize..=4,
        seeds in proptest::collection::vec(any::<u64>(), 4),
        keep_len in 0u32..=30,
        donor in 0u8..3,
    ) {
        let keep_len = keep_len.min(prompt_len);
        let num_blocks = 24;
        let mut manager = KvCacheManager::new(num_blocks, B);
        // One slot-content model per unit: the engine moves each unit's K/V separately.
        let mut contents: Vec<SlotContents> = (0..n_units).map(|_| SlotContents { positions: vec![None; (num_blocks * B) as usize] }).collect();
        let prompt: Vec<u32> = (0..prompt_len).collect();
        let mut run_prompt = |manager: &mut KvCacheManager, seq: SeqId| {
            let prefix = manager.get_computed_prefix(&prompt, b"");
            let cached = manager.add_sequence(seq, &prefix);
            let new_slots = manager.allocate_slots(seq, prompt_len - cached).unwrap();
            for c in contents.iter_mut() {
                for (i, slot) in new_slots.slots.iter().enumerate() {
                    c.set(*slot, Some(new_slots.first_position as u32 + i as u32));
                }
            }
            manager.cache_full_blocks(seq, &prompt);
        };
        if donor > 0 {
            run_prompt(&mut manager, SeqId(2));
            if donor == 2 {
                manager.free(SeqId(2));
            }
        }
        run_prompt(&mut manager, SeqId(1));
        // A different sorted subset of `keep_len` tokens per unit (a seeded shuffle).
        let keeps: Vec<Vec<u32>> = seeds[..n_units].iter().map(|&seed| seeded_keep(seed, prompt_len, keep_len)).collect();
        let (private, unit_moves) = manager.compact_units(SeqId(1), &keeps).unwrap();
        for m in &private {
            prop_assert_eq!(m.from_stored_index, m.to_stored_index, "private copies keep tokens in place");
            for c in contents.iter_mut() {
                let position = c.get(m.src);
                c.set(m.dst, position);
            }
        }
        for (u, moves) in unit_moves.iter().enumerate() {
            let mut last_to = None;
            for m in moves {
                prop_assert!(m.from_stored_index > m.to_stored_index);
                prop_assert!(last_to < Some(m.to_stored_index), "moves in ascending order");
                last_to = Some(m.to_stored_index);
                let position = contents[u].get(m.src);
                contents[u].set(m.dst, position);
            }
        }
        manager.check_invariants();
        let table = manager.block_table(SeqId(1)).unwrap();
        prop_assert_eq!(table.num_stored_tokens(), keep_len);
        prop_assert_eq!(table.next_position(), prompt_len as u64);
        for (u, keep) in keeps.iter().enumerate() {
            for (index, &position) in keep.iter().enumerate() {
                prop_assert_eq!(contents[u].get(table.slot(index as u32)), Some(position), "unit {} token {}", u, index);
            }
        }
        let prefix = manager.get_computed_prefix(&prompt, b"");
        for (k, block_id) in prefix.block_ids().iter().enumerate() {
            for offset in 0..B {
                let slot = Slot { block_id: *block_id, offset_tokens: offset };
                for c in &contents {
                    prop_assert_eq!(c.get(slot), Some(k as u32 * B + offset));
                }
            }
        }
        if donor == 1 {
            let donor_table = manager.block_table(SeqId(2)).unwrap();
            for index in 0..prompt_len {
                for c in &contents {
                    prop_assert_eq!(c.get(donor_table.slot(index)), Some(index));
                }
            }
        }
        manager.free(SeqId(1));
        manager.free(SeqId(2));
        prop_assert_eq!(manager.pool().num_free_blocks(), num_blocks);
    }
}

proptest! {
    /// Ragged compaction (one budget over every unit): each unit ends up holding its own
    /// keep list right-aligned before the table's end, from its first key on, performing
    /// the moves in the order given and in place; shared and cached blocks are never
    /// written, and tokens stored afterwards follow every unit's directly.
    #[test]
    fn ragged_compaction_right_aligns_each_units_tokens(
        prompt_len in 1u32..=30,
        n_units in 1usize..=4,
        seeds in proptest::collection::vec(any::<u64>(), 4),
        keep_lens in proptest::collection::vec(0u32..=30, 4),
        donor in 0u8..3,
    ) {
        let num_blocks = 24;
        let mut manager = KvCacheManager::new(num_blocks, B);
        let mut contents: Vec<SlotContents> = (0..n_units).map(|_| SlotContents { positions: vec![None; (num_blocks * B) as usize] }).collect();
        let prompt: Vec<u32> = (0..prompt_len).collect();
        let mut run_prompt = |manager: &mut KvCacheManager, seq: SeqId| {
            let prefix = manager.get_computed_prefix(&prompt, b"");
            let cached = manager.add_sequence(seq, &prefix);
            let new_slots = manager.allocate_slots(seq, prompt_len - cached).unwrap();
            for c in contents.iter_mut() {
                for (i, slot) in new_slots.slots.iter().enumerate() {
                    c.set(*slot, Some(new_slots.first_position as u32 + i as u32));
                }
            }
            manager.cache_full_blocks(seq, &prompt);
        };
        if donor > 0 {
            run_prompt(&mut manager, SeqId(2));
            if donor == 2 {
                manager.free(SeqId(2));
            }
        }
        run_prompt(&mut manager, SeqId(1));
        let keeps: Vec<Vec<u32>> = seeds[..n_units].iter().zip(&keep_lens).map(|(&seed, &len)| seeded_keep(seed, prompt_len, len.min(prompt_len))).collect();
        let longest = keeps.iter().map(Vec::len).max().unwrap() as u32;
        let (private, unit_moves, first_keys) = manager.compact_units_ragged(SeqId(1), &keeps).unwrap();
        for m in &private {
            for c in contents.iter_mut() {
                let position = c.get(m.src);
                c.set(m.dst, position);
            }
        }
        for (u, moves) in unit_moves.iter().enumerate() {
            for m in moves {
                prop_assert_ne!(m.from_stored_index, m.to_stored_index);
                let position = contents[u].get(m.src);
                contents[u].set(m.dst, position);
            }
        }
        manager.check_invariants();
        let table = manager.block_table(SeqId(1)).unwrap();
        prop_assert_eq!(table.num_stored_tokens(), longest);
        for (u, keep) in keeps.iter().enumerate() {
            prop_assert_eq!(first_keys[u], longest - keep.len() as u32);
            for (j, &position) in keep.iter().enumerate() {
                let index = first_keys[u] + j as u32;
                prop_assert_eq!(contents[u].get(table.slot(index)), Some(position), "unit {} token {}", u, j);
            }
        }
        let prefix = manager.get_computed_prefix(&prompt, b"");
        for (k, block_id) in prefix.block_ids().iter().enumerate() {
            for offset in 0..B {
                let slot = Slot { block_id: *block_id, offset_tokens: offset };
                for c in &contents {
                    prop_assert_eq!(c.get(slot), Some(k as u32 * B + offset));
                }
            }
        }
        if donor == 1 {
            let donor_table = manager.block_table(SeqId(2)).unwrap();
            for index in 0..prompt_len {
                for c in &contents {
                    prop_assert_eq!(c.get(donor_table.slot(index)), Some(index));
                }
            }
        }
        let next = manager.allocate_slots(SeqId(1), 3).unwrap();
        prop_assert_eq!(next.slots[0], manager.block_table(SeqId(1)).unwrap().slot(longest));
        manager.free(SeqId(1));
        manager.free(SeqId(2));
        prop_assert_eq!(manager.pool().num_free_blocks(), num_blocks);
    }
}
