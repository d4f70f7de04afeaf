//! Sliding-window KV cache groups in the manager: window tables stay bounded whatever the
//! context length, release exactly the blocks behind the window, share and cache blocks
//! like main tables, and keep the pool's reference counts exact under any sequence of
//! operations (`check_invariants` after each).

use pk_kv::{KvCacheManager, SeqId, WindowSpec, RELEASED};
use proptest::prelude::*;

const BS: u32 = 4;

fn windowed(num_blocks: u32, num_groups: u32, window_tokens: u32) -> KvCacheManager {
    KvCacheManager::with_windows(
        num_blocks,
        BS,
        Some(WindowSpec {
            num_groups,
            window_tokens,
        }),
    )
}

fn start(manager: &mut KvCacheManager, seq: SeqId, prompt: &[u32]) -> u32 {
    let prefix = manager.get_computed_prefix(prompt, b"m");
    manager.add_sequence(seq, &prefix)
}

#[test]
fn window_tables_stay_bounded_and_release_only_blocks_behind_the_window() {
    // Window 8 positions, blocks of 4: a token sees at most 3 blocks.
    let mut manager = windowed(64, 2, 8);
    let seq = SeqId(1);
    start(&mut manager, seq, &[]);
    for step in 0..100u64 {
        manager.allocate_slots(seq, 1).unwrap();
        manager.check_invariants();
        let tables = manager.window_tables(seq).unwrap();
        assert_eq!(tables.len(), 2);
        let position = step; // the token just appended
        let first_visible_block = ((position + 1).saturating_sub(8) / BS as u64) as usize;
        for table in tables {
            assert_eq!(table.len() as u64, position / BS as u64 + 1);
            for (k, &entry) in table.iter().enumerate() {
                // The step's token was appended after the release for its own window, so
                // blocks before its window may still be held only if the previous token
                // could see them.
                let prev_first = (position.saturating_sub(8) / BS as u64) as usize;
                if k < prev_first.min(first_visible_block) {
                    assert_eq!(entry, RELEASED, "block {k} behind the window at {position}");
                }
                if k >= first_visible_block {
                    assert_ne!(entry, RELEASED, "block {k} inside the window at {position}");
                }
            }
        }
        assert!(
            manager.num_window_blocks(seq) <= 2 * 4,
            "bounded window blocks"
        );
    }
    // The main table holds every token; the windows a few blocks each.
    assert_eq!(manager.block_table(seq).unwrap().num_blocks(), 25);
    assert!(manager.free(seq));
    manager.check_invariants();
    assert_eq!(manager.pool().num_free_blocks(), 64);
}

#[test]
fn a_long_prefill_step_holds_its_own_positions_then_releases_them() {
    let mut manager = windowed(64, 3, 8);
    let seq = SeqId(1);
    start(&mut manager, seq, &[]);
    manager.allocate_slots(seq, 40).unwrap();
    // The step's tokens are all written and read by the forward pass: all held.
    assert_eq!(manager.num_window_blocks(seq), 3 * 10);
    manager.allocate_slots(seq, 1).unwrap();
    manager.check_invariants();
    // Position 40 sees 33..=40: blocks 8, 9 and the new block 10.
    assert_eq!(manager.num_window_blocks(seq), 3 * 3);
    assert_eq!(manager.pool().num_free_blocks(), 64 - 11 - 9);
}

#[test]
fn a_placed_context_holds_dropped_main_tokens_and_only_the_next_tokens_window() {
    // A 40-token context with 10 tokens kept in the main table; window 8, blocks of 4:
    // the next token (position 40) sees 33..=40, so the windows hold blocks 8 and 9.
    let mut manager = windowed(64, 2, 8);
    let seq = SeqId(1);
    start(&mut manager, seq, &[]);
    let kept: Vec<u32> = vec![0, 1, 2, 3, 10, 20, 36, 37, 38, 39];
    assert!(manager.allocate_placed(seq, kept.clone(), 40));
    manager.check_invariants();
    let table = manager.block_table(seq).unwrap();
    assert_eq!((table.num_stored_tokens(), table.next_position()), (10, 40));
    assert_eq!(table.positions(), Some(&kept[..]));
    for t in manager.window_tables(seq).unwrap() {
        assert_eq!(t.len(), 10);
        assert!(t[..8].iter().all(|&b| b == RELEASED));
        assert!(t[8..].iter().all(|&b| b != RELEASED));
    }
    assert_eq!(manager.pool().num_free_blocks(), 64 - 3 - 2 * 2);
    // Decoding goes on as for any sequence: one new block per group at position 40.
    manager.allocate_slots(seq, 1).unwrap();
    manager.check_invariants();
    assert_eq!(manager.num_window_blocks(seq), 2 * 3);
    assert!(manager.free(seq));
    manager.check_invariants();
    assert_eq!(manager.pool().num_free_blocks(), 64);
}

#[test]
fn placing_is_all_or_nothing() {
    let mut manager = windowed(5, 2, 8);
    let seq = SeqId(1);
    start(&mut manager, seq, &[]);
    // 3 main blocks + 2 × 2 window blocks > 5 free; then 1 + 2 × 2 fits.
    assert!(!manager.allocate_placed(seq, (0..12).collect(), 40));
    manager.check_invariants();
    assert_eq!(manager.pool().num_free_blocks(), 5);
    assert!(manager.allocate_placed(seq, vec![5, 39], 40));
    manager.check_invariants();
}

#[test]
fn cached_prefixes_adopt_only_the_window_blocks_they_need() {
    let mut manager = windowed(200, 2, 8);
    let prompt: Vec<u32> = (0..41).collect();
    start(&mut manager, SeqId(1), &[]);
    // Decode-like steps: each window block is cached when full and released later.
    for _ in 0..prompt.len() {
        manager.allocate_slots(SeqId(1), 1).unwrap();
        manager.cache_full_blocks(SeqId(1), &prompt);
    }
    manager.free(SeqId(1));
    manager.check_invariants();
    // Released window blocks stay revivable: the whole prefix (10 blocks) is usable, and
    // the new sequence holds only the window blocks its next token sees.
    assert_eq!(start(&mut manager, SeqId(2), &prompt), 40);
    manager.check_invariants();
    let tables = manager.window_tables(SeqId(2)).unwrap();
    for table in tables {
        // Position 40 sees 33..=40: blocks 8 and 9 of the prefix.
        let held: Vec<usize> = (0..table.len()).filter(|&k| table[k] != RELEASED).collect();
        assert_eq!(held, vec![8, 9]);
    }
    manager.allocate_slots(SeqId(2), 1).unwrap();
    manager.check_invariants();
}

#[test]
fn a_prefix_is_cut_to_the_length_whose_window_blocks_are_cached() {
    let mut manager = windowed(80, 1, 8);
    let prompt: Vec<u32> = (0..41).collect();
    start(&mut manager, SeqId(1), &[]);
    // Registered only at the end: by then the window holds blocks 8..=10 only, so only
    // its full blocks 8 and 9 are cached beside all ten main blocks.
    for _ in 0..prompt.len() {
        manager.allocate_slots(SeqId(1), 1).unwrap();
    }
    manager.cache_full_blocks(SeqId(1), &prompt);
    manager.free(SeqId(1));
    manager.check_invariants();
    // The whole prompt: its next token (position 40) sees blocks 8 and 9: a full hit.
    assert_eq!(
        manager
            .get_computed_prefix(&prompt, b"m")
            .num_cached_tokens(),
        40
    );
    // A shorter prompt sharing 24 tokens: after any k blocks its next token would need
    // window blocks that were released uncached, so nothing is usable.
    let shorter: Vec<u32> = prompt[..25].to_vec();
    assert_eq!(
        manager
            .get_computed_prefix(&shorter, b"m")
            .num_cached_tokens(),
        0
    );
    assert_eq!(start(&mut manager, SeqId(2), &shorter), 0);
    assert_eq!(start(&mut manager, SeqId(3), &prompt), 40);
    manager.check_invariants();
    let table = &manager.window_tables(SeqId(3)).unwrap()[0];
    assert_eq!(table[..8], [RELEASED; 8]);
    assert!(table[8..].iter().all(|&b| b != RELEASED));
}

#[test]
fn fork_copies_each_groups_partial_block() {
    let mut manager = windowed(64, 2, 8);
    start(&mut manager, SeqId(1), &[]);
    manager.allocate_slots(SeqId(1), 14).unwrap();
    let copies = manager.fork(SeqId(1), SeqId(2)).unwrap();
    // The main table's partial block and each window group's.
    assert_eq!(copies.len(), 3);
    assert!(copies.iter().all(|c| c.num_tokens == 2));
    manager.check_invariants();
    manager.allocate_slots(SeqId(2), 5).unwrap();
    manager.allocate_slots(SeqId(1), 1).unwrap();
    manager.check_invariants();
    manager.free(SeqId(1));
    manager.free(SeqId(2));
    assert_eq!(manager.pool().num_free_blocks(), 64);
}

#[derive(Clone, Debug)]
enum Op {
    Start { prompt_len: u8 },
    Append { seq: u8, n: u8 },
    Cache { seq: u8 },
    Fork { seq: u8 },
    RemoveBlock { seq: u8 },
    Free { seq: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..60).prop_map(|prompt_len| Op::Start { prompt_len }),
        (any::<u8>(), 1u8..24).prop_map(|(seq, n)| Op::Append { seq, n }),
        any::<u8>().prop_map(|seq| Op::Cache { seq }),
        any::<u8>().prop_map(|seq| Op::Fork { seq }),
        any::<u8>().prop_map(|seq| Op::RemoveBlock { seq }),
        any::<u8>().prop_map(|seq| Op::Free { seq }),
    ]
}

proptest! {
    #[test]
    fn any_operation_sequence_keeps_the_invariants(ops in proptest::collection::vec(op(), 1..60)) {
        let mut manager = windowed(48, 2, 6);
        // Every sequence's tokens are a function of position, so prefixes are shared.
        let token = |p: usize| (p % 7) as u32;
        let mut live: Vec<SeqId> = Vec::new();
        let mut next = 0u64;
        for op in ops {
            let pick = |k: u8, live: &[SeqId]| (!live.is_empty()).then(|| live[k as usize % live.len()]);
            match op {
                Op::Start { prompt_len } => {
                    let prompt: Vec<u32> = (0..prompt_len as usize).map(token).collect();
                    let seq = SeqId(next);
                    next += 1;
                    start(&mut manager, seq, &prompt);
                    live.push(seq);
                }
                Op::Append { seq, n } => {
                    if let Some(seq) = pick(seq, &live) {
                        let _ = manager.allocate_slots(seq, n as u32);
                    }
                }
                Op::Cache { seq } => {
                    if let Some(seq) = pick(seq, &live) {
                        let n = manager.block_table(seq).unwrap().next_position() as usize;
                        let tokens: Vec<u32> = (0..n).map(token).collect();
                        manager.cache_full_blocks(seq, &tokens);
                    }
                }
                Op::Fork { seq } => {
                    if let Some(seq) = pick(seq, &live) {
                        let child = SeqId(next);
                        next += 1;
                        if manager.fork(seq, child).is_some() {
                            live.push(child);
                        }
                    }
                }
                Op::RemoveBlock { seq } => {
                    if let Some(seq) = pick(seq, &live) {
                        let table = manager.block_table(seq).unwrap();
                        if table.num_full_blocks() > 1 {
                            manager.remove_block(seq, 1);
                        }
                    }
                }
                Op::Free { seq } => {
                    if let Some(seq) = pick(seq, &live) {
                        manager.free(seq);
                        live.retain(|&s| s != seq);
                    }
                }
            }
            manager.check_invariants();
            for &seq in &live {
                // At most the window's blocks plus the largest step's, per group.
                prop_assert!(manager.num_window_blocks(seq) <= 2 * ((6 + 60usize).div_ceil(4) + 1));
            }
        }
        for seq in live {
            manager.free(seq);
        }
        manager.check_invariants();
        prop_assert_eq!(manager.pool().num_free_blocks(), 48);
    }
}
