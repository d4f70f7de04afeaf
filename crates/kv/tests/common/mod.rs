//! A miniature engine for policy tests: it drives an `EvictionPolicy` and a
//! `KvCacheManager` through the documented protocol (prefill, select, compact, decode,
//! score filled blocks, evict) over a physical K/V store it owns, and checks after every
//! step that the cache is consistent:
//! - `check_invariants()` on the manager;
//! - the store holds, at each stored index, the K/V of the position the test expects
//!   (so compaction moves and removals are verified by content, not by bookkeeping);
//! - stored tokens never exceed budget + one block, and at most the budget after an
//!   eviction; `next_position` equals the tokens ever appended;
//! - the policy holds one entry per full block;
//! - prefix-cache lookups of the prompt still return blocks holding the prompt's K/V.
//!
//! Each token's K/V and query are a function of its absolute position (`Data`), as in a
//! real model where a token's K/V never changes once written.

#![allow(dead_code)] // Each test binary uses a different part of the harness.

use pk_kv::{BlockId, EvictionPolicy, KvCacheManager, KvView, PolicySpec, QueryView, SeqId, Slot};

#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub n_heads: usize,
    pub head_dim: usize,
}

/// What the "model" computes for the token at absolute position `position`.
pub trait Data {
    fn kv(&self, position: u64, layer: usize, kv_head: usize, key: &mut [f32], value: &mut [f32]);
    fn query(&self, position: u64, layer: usize, head: usize, query: &mut [f32]);
}

/// Physical K/V: one record per (block, slot), `[layer][kv_head][head_dim]`, plus the
/// position the record was computed for.
struct Store {
    shape: Shape,
    block_size: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
    positions: Vec<Option<u64>>,
}

impl Store {
    fn new(shape: Shape, num_blocks: usize, block_size: usize) -> Self {
        let width = shape.n_layers * shape.n_kv_heads * shape.head_dim;
        let num_slots = num_blocks * block_size;
        Store {
            shape,
            block_size,
            keys: vec![f32::NAN; num_slots * width],
            values: vec![f32::NAN; num_slots * width],
            positions: vec![None; num_slots],
        }
    }

    fn width(&self) -> usize {
        self.shape.n_layers * self.shape.n_kv_heads * self.shape.head_dim
    }

    fn index(&self, slot: Slot) -> usize {
        slot.block_id.index() * self.block_size + slot.offset_tokens as usize
    }

    fn write(&mut self, slot: Slot, position: u64, data: &dyn Data) {
        let (index, width, d) = (self.index(slot), self.width(), self.shape.head_dim);
        for layer in 0..self.shape.n_layers {
            for kv_head in 0..self.shape.n_kv_heads {
                let start = index * width + (layer * self.shape.n_kv_heads + kv_head) * d;
                data.kv(
                    position,
                    layer,
                    kv_head,
                    &mut self.keys[start..start + d],
                    &mut self.values[start..start + d],
                );
            }
        }
        self.positions[index] = Some(position);
    }

    fn copy(&mut self, src: Slot, dst: Slot) {
        let (from, to, width) = (self.index(src), self.index(dst), self.width());
        self.keys
            .copy_within(from * width..(from + 1) * width, to * width);
        self.values
            .copy_within(from * width..(from + 1) * width, to * width);
        self.positions[to] = self.positions[from];
    }

    fn position(&self, slot: Slot) -> Option<u64> {
        self.positions[self.index(slot)]
    }
}

/// The engine's `KvView` over one sequence's block table.
struct TableKv<'a> {
    store: &'a Store,
    block_ids: &'a [BlockId],
    n_tokens: usize,
}

impl TableKv<'_> {
    fn record(&self, layer: usize, kv_head: usize, token: usize) -> usize {
        assert!(token < self.n_tokens, "policy read unstored token {token}");
        let b = self.store.block_size;
        let slot = Slot {
            block_id: self.block_ids[token / b],
            offset_tokens: (token % b) as u32,
        };
        let shape = self.store.shape;
        self.store.index(slot) * self.store.width()
            + (layer * shape.n_kv_heads + kv_head) * shape.head_dim
    }
}

impl KvView for TableKv<'_> {
    fn n_layers(&self) -> usize {
        self.store.shape.n_layers
    }
    fn n_kv_heads(&self) -> usize {
        self.store.shape.n_kv_heads
    }
    fn head_dim(&self) -> usize {
        self.store.shape.head_dim
    }
    fn n_tokens(&self) -> usize {
        self.n_tokens
    }
    fn key(&self, layer: usize, kv_head: usize, token: usize, out: &mut [f32]) {
        let start = self.record(layer, kv_head, token);
        out.copy_from_slice(&self.store.keys[start..start + out.len()]);
    }
    fn value(&self, layer: usize, kv_head: usize, token: usize, out: &mut [f32]) {
        let start = self.record(layer, kv_head, token);
        out.copy_from_slice(&self.store.values[start..start + out.len()]);
    }
}

/// The engine's view of `SEQ`. A free function, so that it borrows only the manager and
/// the store while the policy is borrowed mutably.
fn view<'a>(manager: &'a KvCacheManager, store: &'a Store) -> TableKv<'a> {
    let table = manager.block_table(SEQ).expect("sequence exists");
    TableKv {
        store,
        block_ids: table.block_ids(),
        n_tokens: table.num_stored_tokens() as usize,
    }
}

/// The queries of some stored tokens, computed from their absolute positions.
struct Queries {
    shape: Shape,
    stored_indices: Vec<usize>,
    positions: Vec<u64>,
    data: Vec<f32>,
}

impl Queries {
    fn new(shape: Shape, stored_positions: &[u64], count: usize, data: &dyn Data) -> Self {
        let first = stored_positions.len() - count;
        let stored_indices: Vec<usize> = (first..stored_positions.len()).collect();
        let positions: Vec<u64> = stored_positions[first..].to_vec();
        let d = shape.head_dim;
        let mut values = vec![0.0; shape.n_layers * shape.n_heads * count * d];
        for layer in 0..shape.n_layers {
            for head in 0..shape.n_heads {
                for (q, &position) in positions.iter().enumerate() {
                    let start = ((layer * shape.n_heads + head) * count + q) * d;
                    data.query(position, layer, head, &mut values[start..start + d]);
                }
            }
        }
        Queries {
            shape,
            stored_indices,
            positions,
            data: values,
        }
    }
}

impl QueryView for Queries {
    fn n_queries(&self) -> usize {
        self.stored_indices.len()
    }
    fn n_heads(&self) -> usize {
        self.shape.n_heads
    }
    fn query(&self, layer: usize, head: usize, q: usize, out: &mut [f32]) {
        let d = self.shape.head_dim;
        let start = ((layer * self.shape.n_heads + head) * self.n_queries() + q) * d;
        out.copy_from_slice(&self.data[start..start + d]);
    }
    fn query_position(&self, q: usize) -> usize {
        self.stored_indices[q]
    }
}

/// Whether another sequence shares the prompt's blocks through the prefix cache.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Sharing {
    /// The sequence alone; its prompt blocks are not cached before pruning.
    None,
    /// The sequence alone, but it caches its prompt blocks before pruning (as an engine
    /// with prefix caching on would), so compaction must not write into them.
    SelfCached,
    /// A donor computed the prompt, cached it, and is still running (ref count 2).
    DonorAlive,
    /// A donor computed the prompt, cached it, and finished (cached, ref count 1).
    DonorFreed,
}

#[derive(Clone, Copy, Debug)]
pub struct Sim {
    pub shape: Shape,
    pub block_size: u32,
    pub budget: u32,
    pub prompt_len: u32,
    pub decode_len: u32,
    pub sharing: Sharing,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Eviction {
    /// Table index `choose_victim` returned.
    pub index: usize,
    /// Absolute position of the evicted block's first token.
    pub first_position: u64,
}

#[derive(Debug)]
pub struct Trace {
    /// Positions kept at prefill, in stored order.
    pub kept: Vec<u64>,
    pub evictions: Vec<Eviction>,
    /// Positions stored at the end, in stored order.
    pub stored: Vec<u64>,
}

const SEQ: SeqId = SeqId(1);
const DONOR: SeqId = SeqId(2);

struct Engine<'a> {
    sim: Sim,
    data: &'a dyn Data,
    manager: KvCacheManager,
    store: Store,
    policy: Box<dyn EvictionPolicy>,
    prompt: Vec<u32>,
    /// What the test expects at each stored index of `SEQ`.
    stored_positions: Vec<u64>,
    num_appended: u64,
}

impl Engine<'_> {
    fn allocate_and_write(&mut self, seq: SeqId, num_tokens: u32) {
        let new_slots = self
            .manager
            .allocate_slots(seq, num_tokens)
            .expect("test pool too small");
        for (i, slot) in new_slots.slots.iter().enumerate() {
            self.store
                .write(*slot, new_slots.first_position + i as u64, self.data);
        }
    }

    fn queries(&self, count: usize) -> Option<Queries> {
        (count > 0).then(|| Queries::new(self.sim.shape, &self.stored_positions, count, self.data))
    }

    fn check(&self) {
        self.manager.check_invariants();
        let table = self.manager.block_table(SEQ).expect("sequence exists");
        let stored = table.num_stored_tokens();
        assert_eq!(
            stored as usize,
            self.stored_positions.len(),
            "stored tokens"
        );
        for (index, &position) in self.stored_positions.iter().enumerate() {
            assert_eq!(
                self.store.position(table.slot(index as u32)),
                Some(position),
                "stored token {index} holds the wrong K/V"
            );
        }
        assert_eq!(table.next_position(), self.num_appended, "next_position");
        assert_eq!(
            self.policy.num_scored_blocks(),
            table.num_full_blocks(),
            "policy block state is not parallel to the table"
        );
        if self.policy.spec().evicts() {
            assert!(
                stored <= self.sim.budget + self.sim.block_size,
                "{stored} stored tokens exceed budget {} + one block",
                self.sim.budget
            );
        }
        self.check_prefix_cache();
    }

    /// Every block a prefix lookup of the prompt returns still holds the prompt's K/V.
    fn check_prefix_cache(&self) {
        let prefix = self.manager.get_computed_prefix(&self.prompt, b"");
        for (k, block_id) in prefix.block_ids().iter().enumerate() {
            for offset in 0..self.sim.block_size {
                let slot = Slot {
                    block_id: *block_id,
                    offset_tokens: offset,
                };
                let expected = (k as u32 * self.sim.block_size + offset) as u64;
                assert_eq!(
                    self.store.position(slot),
                    Some(expected),
                    "cached block {k} was overwritten"
                );
            }
        }
    }

    fn prefill(&mut self) -> Vec<u64> {
        let sim = self.sim;
        if matches!(sim.sharing, Sharing::DonorAlive | Sharing::DonorFreed) {
            let prefix = self.manager.get_computed_prefix(&self.prompt, b"");
            self.manager.add_sequence(DONOR, &prefix);
            self.allocate_and_write(DONOR, sim.prompt_len);
            self.manager.cache_full_blocks(DONOR, &self.prompt);
            if sim.sharing == Sharing::DonorFreed {
                self.manager.free(DONOR);
            }
        }
        let prefix = self.manager.get_computed_prefix(&self.prompt, b"");
        let num_cached = self.manager.add_sequence(SEQ, &prefix);
        self.allocate_and_write(SEQ, sim.prompt_len - num_cached);
        if sim.sharing != Sharing::None {
            self.manager.cache_full_blocks(SEQ, &self.prompt);
        }
        self.stored_positions = (0..sim.prompt_len as u64).collect();
        self.num_appended = sim.prompt_len as u64;

        let count = self.policy.prefill_queries().count(sim.prompt_len as usize);
        let queries = self.queries(count);
        if self.policy.spec().reconstruction_chunk_tokens().is_some() {
            // KVzip's scores come from the engine's reconstruction passes; any scores
            // exercise the selection and the decode evictions that follow.
            let scores = (0..sim.prompt_len as usize).map(|t| ((t * 7919) % 101) as f32);
            self.policy.set_prior_scores(scores.collect());
        }
        let keep = self.policy.select_prefill(
            &view(&self.manager, &self.store),
            queries.as_ref().map(|q| q as &dyn QueryView),
            sim.budget,
            sim.block_size,
        );
        assert!(
            keep.windows(2).all(|pair| pair[0] < pair[1]),
            "keep list not sorted: {keep:?}"
        );
        let expected_len = match self.policy.spec().evicts() {
            true => sim.prompt_len.min(sim.budget),
            false => sim.prompt_len,
        };
        assert_eq!(keep.len() as u32, expected_len, "kept tokens");

        let moves = self
            .manager
            .compact(SEQ, &keep)
            .expect("test pool too small");
        for m in &moves {
            self.store.copy(m.src, m.dst);
        }
        self.stored_positions = keep
            .iter()
            .map(|&i| self.stored_positions[i as usize])
            .collect();
        self.check();
        self.stored_positions.clone()
    }

    fn decode_step(&mut self, step: u32) -> Option<Eviction> {
        let b = self.sim.block_size;
        self.allocate_and_write(SEQ, 1);
        self.stored_positions.push(self.num_appended);
        self.num_appended += 1;
        let table = self.manager.block_table(SEQ).expect("sequence exists");
        let (stored, num_blocks) = (table.num_stored_tokens(), table.num_blocks());
        let mut eviction = None;
        if stored % b == 0 {
            // The engine keeps the queries of the decode tokens of the current block.
            let available = (step + 1).min(b) as usize;
            let queries = self.queries(self.policy.decode_queries().count(available));
            self.policy.on_block_filled(
                &view(&self.manager, &self.store),
                queries.as_ref().map(|q| q as &dyn QueryView),
                (stored / b - 1) as usize,
            );
            self.check();
            if stored > self.sim.budget && self.policy.spec().evicts() {
                let index = self
                    .policy
                    .choose_victim(num_blocks)
                    .expect("an evicting policy must name a victim over budget");
                assert!(
                    index > 0 && index + 1 < num_blocks,
                    "victim {index} of {num_blocks} blocks"
                );
                let first_position = self.stored_positions[index * b as usize];
                self.manager.remove_block(SEQ, index);
                self.policy.on_block_removed(index);
                self.stored_positions
                    .drain(index * b as usize..(index + 1) * b as usize);
                eviction = Some(Eviction {
                    index,
                    first_position,
                });
                let stored = self.stored_positions.len() as u32;
                assert!(
                    stored <= self.sim.budget,
                    "{stored} stored after an eviction"
                );
            }
        }
        self.check();
        eviction
    }
}

/// Runs `spec` through prefill and `decode_len` decode steps, checking after every step.
pub fn run(spec: PolicySpec, sim: Sim, data: &dyn Data) -> Trace {
    let b = sim.block_size;
    let num_blocks =
        2 * (sim.prompt_len + sim.decode_len).div_ceil(b) + sim.prompt_len.div_ceil(b) + 4;
    let mut engine = Engine {
        sim,
        data,
        manager: KvCacheManager::new(num_blocks, b),
        store: Store::new(sim.shape, num_blocks as usize, b as usize),
        policy: spec.build(),
        prompt: (0..sim.prompt_len).collect(),
        stored_positions: Vec::new(),
        num_appended: 0,
    };
    if let Err(error) = spec.validate(sim.budget, b) {
        panic!("invalid test configuration: {error}");
    }
    let kept = engine.prefill();
    let evictions = (0..sim.decode_len)
        .filter_map(|step| engine.decode_step(step))
        .collect();
    let stored = engine.stored_positions.clone();
    engine.manager.free(SEQ);
    engine.manager.free(DONOR);
    engine.manager.check_invariants();
    assert_eq!(
        engine.manager.pool().num_free_blocks(),
        num_blocks,
        "blocks leaked"
    );
    Trace {
        kept,
        evictions,
        stored,
    }
}

/// `Data` from two closures.
pub struct FnData<K, Q> {
    pub kv: K,
    pub query: Q,
}

impl<K, Q> Data for FnData<K, Q>
where
    K: Fn(u64, usize, usize, &mut [f32], &mut [f32]),
    Q: Fn(u64, usize, usize, &mut [f32]),
{
    fn kv(&self, position: u64, layer: usize, kv_head: usize, key: &mut [f32], value: &mut [f32]) {
        (self.kv)(position, layer, kv_head, key, value)
    }
    fn query(&self, position: u64, layer: usize, head: usize, query: &mut [f32]) {
        (self.query)(position, layer, head, query)
    }
}
