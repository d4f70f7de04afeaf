//! State-machine property test: random operations on a `KvCacheManager` checked, after
//! every step, against a trivial reference model.
//!
//! The model knows nothing about free queues or hash maps. It keeps, per sequence, the
//! tokens seen, the block ids (learned from the slots the manager returns), the stored
//! token count and whether a block was ever evicted; per block, the number of owning table
//! entries and what the block holds ("identity": the full token prefix a block ends, with
//! the extra bytes, when it was filled by a sequence that never evicted). From that it
//! predicts whether each allocation must succeed, the exact slots, the free-block count,
//! and that every prefix-cache hit returns blocks holding exactly the prompt's tokens.

use proptest::prelude::*;

use pk_kv::{hash_prefix_blocks, BlockCopy, BlockId, KvCacheManager, NewSlots, SeqId};

#[derive(Clone, Debug)]
enum Op {
    /// Start a sequence from a prompt of family `family` (families share their first six
    /// tokens, so prompts overlap in part), reusing the cached prefix.
    Add {
        family: u8,
        len: u8,
        extra: bool,
    },
    /// Append `n` copies of a generated token (a small alphabet, so sequences often
    /// produce identical blocks).
    Append {
        seq: u8,
        n: u8,
        token: u8,
    },
    CacheFull {
        seq: u8,
    },
    Free {
        seq: u8,
    },
    Fork {
        seq: u8,
    },
    RemoveBlock {
        seq: u8,
        index: u8,
    },
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, 0u8..=20, any::<bool>()).prop_map(|(family, len, extra)| Op::Add { family, len, extra }),
        4 => (any::<u8>(), 0u8..=6, 0u8..3).prop_map(|(seq, n, token)| Op::Append { seq, n, token }),
        2 => any::<u8>().prop_map(|seq| Op::CacheFull { seq }),
        2 => any::<u8>().prop_map(|seq| Op::Free { seq }),
        1 => any::<u8>().prop_map(|seq| Op::Fork { seq }),
        2 => (any::<u8>(), any::<u8>()).prop_map(|(seq, index)| Op::RemoveBlock { seq, index }),
    ]
}

/// Tokens come from a three-letter alphabet, so equal blocks after different prefixes are
/// common: only the chained hash tells them apart.
fn prompt_tokens(family: u8, len: u8) -> Vec<u32> {
    (0..len as u32)
        .map(|i| {
            if i < 6 {
                i % 3
            } else {
                (family as u32 + i * i) % 3
            }
        })
        .collect()
}

fn extra_bytes(extra: bool) -> &'static [u8] {
    if extra {
        b"salt"
    } else {
        b""
    }
}

#[derive(Clone)]
struct RefSeq {
    id: SeqId,
    /// Tokens at positions `0 .. tokens.len()`; `tokens.len()` is the next position.
    tokens: Vec<u32>,
    extra: &'static [u8],
    block_ids: Vec<BlockId>,
    num_stored_tokens: u32,
    evicted: bool,
}

type Identity = (&'static [u8], Vec<u32>);

struct Model {
    block_size_tokens: u32,
    seqs: Vec<RefSeq>,
    owners_by_block: Vec<u32>,
    identity_by_block: Vec<Option<Identity>>,
    next_seq_id: u64,
}

impl Model {
    fn new(num_blocks: u32, block_size_tokens: u32) -> Self {
        Model {
            block_size_tokens,
            seqs: Vec::new(),
            owners_by_block: vec![0; num_blocks as usize],
            identity_by_block: vec![None; num_blocks as usize],
            next_seq_id: 0,
        }
    }

    fn num_free_blocks(&self) -> u32 {
        self.owners_by_block
            .iter()
            .filter(|&&owners| owners == 0)
            .count() as u32
    }

    fn num_new_blocks_needed(&self, seq: &RefSeq, num_new_tokens: u32) -> u32 {
        (seq.num_stored_tokens + num_new_tokens).div_ceil(self.block_size_tokens)
            - seq.block_ids.len() as u32
    }

    fn new_seq_id(&mut self) -> SeqId {
        self.next_seq_id += 1;
        SeqId(self.next_seq_id - 1)
    }

    /// Drops sequence `seq_index` from the model, releasing its blocks.
    fn release(&mut self, seq_index: usize) -> RefSeq {
        let seq = self.seqs.remove(seq_index);
        for block_id in &seq.block_ids {
            self.owners_by_block[block_id.index()] -= 1;
        }
        seq
    }

    fn pick(&self, raw: u8) -> Option<usize> {
        (!self.seqs.is_empty()).then(|| raw as usize % self.seqs.len())
    }

    /// Checks the slots the manager returned for `new_tokens` against the model, then
    /// records the new blocks and what was written into them.
    fn apply_append(&mut self, seq_index: usize, new_tokens: &[u32], new_slots: &NewSlots) {
        let block_size_tokens = self.block_size_tokens;
        let seq = &mut self.seqs[seq_index];
        assert_eq!(
            new_slots.first_position,
            seq.tokens.len() as u64,
            "first position"
        );
        assert_eq!(
            new_slots.slots.len(),
            new_tokens.len(),
            "one slot per new token"
        );
        for (slot, &token_id) in new_slots.slots.iter().zip(new_tokens) {
            let stored_index = seq.num_stored_tokens;
            let offset_tokens = stored_index % block_size_tokens;
            assert_eq!(slot.offset_tokens, offset_tokens, "slot offset");
            if offset_tokens == 0 {
                let block = slot.block_id.index();
                assert_eq!(
                    self.owners_by_block[block], 0,
                    "a new block must come from the free blocks"
                );
                self.owners_by_block[block] = 1;
                seq.block_ids.push(slot.block_id);
            } else {
                assert_eq!(
                    Some(&slot.block_id),
                    seq.block_ids.last(),
                    "a partial block is filled before a new one"
                );
            }
            seq.tokens.push(token_id);
            seq.num_stored_tokens += 1;
            let block_full = offset_tokens + 1 == block_size_tokens;
            self.identity_by_block[slot.block_id.index()] =
                (block_full && !seq.evicted).then(|| (seq.extra, seq.tokens.clone()));
        }
    }
}

/// Everything the model can say about the manager's state, asserted after every step.
fn check_against_model(manager: &KvCacheManager, model: &Model) {
    manager.check_invariants();
    let pool = manager.pool();
    assert_eq!(
        pool.num_free_blocks(),
        model.num_free_blocks(),
        "free block count"
    );
    for (index, &owners) in model.owners_by_block.iter().enumerate() {
        assert_eq!(
            pool.ref_count(BlockId(index as u32)),
            owners,
            "ref count of block {index}"
        );
    }
    for block_id in pool.free_queue_order() {
        assert_eq!(
            model.owners_by_block[block_id.index()],
            0,
            "block {block_id:?} is owned but in the free queue"
        );
    }
    assert_eq!(manager.num_sequences(), model.seqs.len());
    for seq in &model.seqs {
        let table = manager
            .block_table(seq.id)
            .expect("model sequence missing from the manager");
        assert_eq!(
            table.block_ids(),
            seq.block_ids.as_slice(),
            "block ids of {:?}",
            seq.id
        );
        assert_eq!(
            table.num_stored_tokens(),
            seq.num_stored_tokens,
            "stored tokens of {:?}",
            seq.id
        );
        assert_eq!(
            table.next_position(),
            seq.tokens.len() as u64,
            "next position of {:?}",
            seq.id
        );
    }
    // A cached block must hold exactly what its hash names.
    for (index, identity) in model.identity_by_block.iter().enumerate() {
        let Some(block_hash) = pool.block_hash(BlockId(index as u32)) else {
            continue;
        };
        let (extra, prefix_tokens) = identity
            .as_ref()
            .expect("a cached block was not filled by a clean sequence");
        let expected = *hash_prefix_blocks(prefix_tokens, model.block_size_tokens, extra)
            .last()
            .unwrap();
        assert_eq!(
            block_hash, expected,
            "block {index} is cached under the wrong hash"
        );
    }
}

fn step(manager: &mut KvCacheManager, model: &mut Model, op: &Op) {
    match *op {
        Op::Add { family, len, extra } => add_prompt(
            manager,
            model,
            &prompt_tokens(family, len),
            extra_bytes(extra),
        ),
        Op::Append { seq, n, token } => {
            let Some(seq_index) = model.pick(seq) else {
                return;
            };
            allocate_and_check(
                manager,
                model,
                seq_index,
                &vec![1000 + token as u32; n as usize],
            );
        }
        Op::CacheFull { seq } => {
            let Some(seq_index) = model.pick(seq) else {
                return;
            };
            let seq = &model.seqs[seq_index];
            manager.cache_full_blocks(seq.id, &seq.tokens);
        }
        Op::Free { seq } => {
            let Some(seq_index) = model.pick(seq) else {
                return;
            };
            let seq = model.release(seq_index);
            assert!(manager.free(seq.id));
        }
        Op::Fork { seq } => {
            let Some(seq_index) = model.pick(seq) else {
                return;
            };
            fork(manager, model, seq_index);
        }
        Op::RemoveBlock { seq, index } => {
            let Some(seq_index) = model.pick(seq) else {
                return;
            };
            remove_block(manager, model, seq_index, index);
        }
    }
}

/// Allocates slots for `new_tokens` and checks the outcome against the model's prediction.
/// Returns whether the allocation succeeded.
fn allocate_and_check(
    manager: &mut KvCacheManager,
    model: &mut Model,
    seq_index: usize,
    new_tokens: &[u32],
) -> bool {
    let num_new_tokens = new_tokens.len() as u32;
    let must_fit = model.num_new_blocks_needed(&model.seqs[seq_index], num_new_tokens)
        <= model.num_free_blocks();
    match manager.allocate_slots(model.seqs[seq_index].id, num_new_tokens) {
        Some(new_slots) => {
            assert!(must_fit, "allocation succeeded without enough free blocks");
            model.apply_append(seq_index, new_tokens, &new_slots);
            true
        }
        None => {
            assert!(!must_fit, "allocation failed with enough free blocks");
            false
        }
    }
}

/// The scheduler's admission path: look up the cached prefix, adopt it, compute the rest
/// of the prompt, register its full blocks; on allocation failure, give everything back.
fn add_prompt(
    manager: &mut KvCacheManager,
    model: &mut Model,
    prompt: &[u32],
    extra: &'static [u8],
) {
    let block_size_tokens = model.block_size_tokens as usize;
    let prefix = manager.get_computed_prefix(prompt, extra);
    assert!(
        prefix.block_ids().len() <= prompt.len().saturating_sub(1) / block_size_tokens,
        "a full hit"
    );
    for (i, block_id) in prefix.block_ids().iter().enumerate() {
        let expected: Identity = (extra, prompt[..(i + 1) * block_size_tokens].to_vec());
        assert_eq!(
            model.identity_by_block[block_id.index()].as_ref(),
            Some(&expected),
            "prefix hit on block {block_id:?} holding other tokens"
        );
    }
    let num_free_before = model.num_free_blocks();
    let id = model.new_seq_id();
    let num_cached_tokens = manager.add_sequence(id, &prefix);
    assert_eq!(
        num_cached_tokens,
        prefix.num_cached_tokens(),
        "nothing went stale in between"
    );
    for block_id in prefix.block_ids() {
        model.owners_by_block[block_id.index()] += 1;
    }
    model.seqs.push(RefSeq {
        id,
        tokens: prompt[..num_cached_tokens as usize].to_vec(),
        extra,
        block_ids: prefix.block_ids().to_vec(),
        num_stored_tokens: num_cached_tokens,
        evicted: false,
    });
    let seq_index = model.seqs.len() - 1;
    if allocate_and_check(
        manager,
        model,
        seq_index,
        &prompt[num_cached_tokens as usize..],
    ) {
        manager.cache_full_blocks(id, prompt);
    } else {
        model.release(seq_index);
        assert!(manager.free(id));
        assert_eq!(
            model.num_free_blocks(),
            num_free_before,
            "a failed admission must give back its prefix"
        );
    }
}

fn fork(manager: &mut KvCacheManager, model: &mut Model, seq_index: usize) {
    let parent = model.seqs[seq_index].clone();
    let num_partial_tokens = parent.num_stored_tokens % model.block_size_tokens;
    let must_fit = num_partial_tokens == 0 || model.num_free_blocks() >= 1;
    let child_id = model.new_seq_id();
    let Some(copy) = manager.fork(parent.id, child_id) else {
        assert!(!must_fit, "fork failed with a free block available");
        return;
    };
    assert!(must_fit, "fork succeeded without a free block for the copy");
    let mut child = RefSeq {
        id: child_id,
        ..parent.clone()
    };
    child
        .block_ids
        .truncate((parent.num_stored_tokens / model.block_size_tokens) as usize);
    for block_id in &child.block_ids {
        model.owners_by_block[block_id.index()] += 1;
    }
    assert!(copy.len() <= 1, "one table, at most one copy");
    match copy.into_iter().next() {
        None => assert_eq!(num_partial_tokens, 0, "a partial block must be copied"),
        Some(BlockCopy {
            src,
            dst,
            num_tokens,
        }) => {
            assert_eq!(
                src,
                *parent.block_ids.last().unwrap(),
                "copy from the parent's partial block"
            );
            assert_eq!(num_tokens, num_partial_tokens);
            assert_eq!(
                model.owners_by_block[dst.index()],
                0,
                "copy target must be a free block"
            );
            model.owners_by_block[dst.index()] = 1;
            model.identity_by_block[dst.index()] = None;
            child.block_ids.push(dst);
        }
    }
    model.seqs.push(child);
}

/// Evicts a full block (chosen by `raw_index`), as an eviction policy would.
fn remove_block(manager: &mut KvCacheManager, model: &mut Model, seq_index: usize, raw_index: u8) {
    let block_size_tokens = model.block_size_tokens;
    let seq = &mut model.seqs[seq_index];
    let num_full_blocks = (seq.num_stored_tokens / block_size_tokens) as usize;
    if num_full_blocks == 0 {
        return;
    }
    let index = raw_index as usize % num_full_blocks;
    let removed = manager.remove_block(seq.id, index);
    assert_eq!(
        removed,
        seq.block_ids.remove(index),
        "removed the block at the index"
    );
    seq.num_stored_tokens -= block_size_tokens;
    seq.evicted = true;
    model.owners_by_block[removed.index()] -= 1;
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn manager_matches_reference_model(
        num_blocks in 1u32..=24,
        block_size_log2 in 0u32..=2,
        ops in proptest::collection::vec(op_strategy(), 1..80),
    ) {
        let block_size_tokens = 1 << block_size_log2;
        let mut manager = KvCacheManager::new(num_blocks, block_size_tokens);
        let mut model = Model::new(num_blocks, block_size_tokens);
        check_against_model(&manager, &model);
        for op in &ops {
            step(&mut manager, &mut model, op);
            check_against_model(&manager, &model);
        }
        // Once every sequence is freed, every block is free again.
        while !model.seqs.is_empty() {
            let seq = model.release(0);
            prop_assert!(manager.free(seq.id));
            check_against_model(&manager, &model);
        }
        prop_assert!(model.owners_by_block.iter().all(|&owners| owners == 0));
        prop_assert_eq!(manager.pool().num_free_blocks(), num_blocks);
        prop_assert_eq!(manager.usage(), 0.0);
    }
}
