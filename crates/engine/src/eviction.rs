//! Glue between the pure eviction policies of `pk-kv` and the engine's physical KV store.
//!
//! The policies read K/V through `KvView` and queries through `QueryView`; here those are
//! implemented over the backend's KV pool (`KvBlocks`, through the sequence's block table) and over the queries the
//! forward pass captured. The engine calls `after_prefill` once a sequence's prompt is in
//! the cache (exact attention over the full prompt has happened) and `after_decode` after
//! every decode token; both edit the block table through the manager and move K/V in the
//! store as the manager says.

use std::cell::RefCell;

use pk_kv::{
    EvictionPolicy, KvCacheManager, KvGranularity, KvView, PolicySpec, QueryView, SelectionUnit,
    SeqId, TokenMove,
};
use pk_model::{KvBlocks, KvGeometry};

use crate::request::PrefillKeep;

/// One unit of selection (`KvGranularity`) and its own policy instance.
pub(crate) struct UnitPolicy {
    pub unit: SelectionUnit,
    pub policy: Box<dyn EvictionPolicy>,
}

/// A sequence's eviction state: a policy instance per selection unit, and the budget.
/// Unit 0's kept tokens are the ones the sequence's stored positions follow (at `layer`
/// and `head` granularity it is the unit of the sliding-window layers, the only layers
/// that read positions, when the model has any).
pub(crate) struct SeqEviction {
    pub units: Vec<UnitPolicy>,
    pub spec: PolicySpec,
    pub granularity: KvGranularity,
    pub budget_tokens: u32,
    /// The budget applies at prefill only; decode never evicts (`GenerateParams::kv_keep_generated`).
    pub keep_generated: bool,
    /// Prefill selection has run (the policies hold block scores).
    pub initialised: bool,
    /// Post-RoPE queries of the tokens decoded since the last block filled, for policies
    /// that score blocks with queries: (stored index, `[layer][n_heads * head_dim]`). Cleared
    /// whenever a block fills, so stored indices never go stale across an eviction.
    pub recent_queries: Vec<(usize, Vec<f32>)>,
    /// Prune the prompt at every multiple of this many prompt tokens as it is prefilled
    /// (`EngineConfig::prefill_prune_interval_tokens`, for policies that allow it).
    pub prune_interval_tokens: Option<usize>,
    /// A ragged budget (`kvzip:global`): each unit's own count at prefill, set with its
    /// scores before selection. `None`: every unit keeps `budget_tokens`.
    pub unit_budgets: Option<Vec<u32>>,
    /// After a ragged compaction, each (layer, KV head)'s first stored key
    /// (`SeqForward::head_first_keys`); empty otherwise.
    pub head_first_keys: Vec<u32>,
    /// `GenerateParams::record_prefill_keeps`: keep the last selection's kept lists.
    pub record_keeps: bool,
    pub recorded_keeps: Option<Vec<PrefillKeep>>,
    /// With `record_keeps`: each unit's prior scores (KVzip's), kept for the record.
    pub recorded_prior_scores: Vec<Vec<f32>>,
    /// KVzip's reconstruction passes in progress: the prompt is in, selection waits for
    /// the scores, and the sequence is not scheduled until then. Its fork holds blocks:
    /// whoever takes the sequence out of the running set releases it
    /// ([`SeqEviction::release_kvzip_run`]).
    pub kvzip_run: Option<Box<kvzip_run::KvzipRun>>,
}

impl SeqEviction {
    pub fn new(
        spec: PolicySpec,
        budget_tokens: u32,
        granularity: KvGranularity,
        units: Vec<SelectionUnit>,
    ) -> SeqEviction {
        let units = units
            .into_iter()
            .map(|unit| UnitPolicy {
                unit,
                policy: spec.build(),
            })
            .collect();
        SeqEviction {
            units,
            spec,
            granularity,
            budget_tokens,
            keep_generated: false,
            initialised: false,
            recent_queries: Vec::new(),
            prune_interval_tokens: None,
            unit_budgets: None,
            head_first_keys: Vec::new(),
            record_keeps: false,
            recorded_keeps: None,
            recorded_prior_scores: Vec::new(),
            kvzip_run: None,
        }
    }

    /// Frees the fork of KVzip's passes in progress, if any, and drops the run.
    pub fn release_kvzip_run(&mut self, kv: &mut KvCacheManager) {
        if let Some(mut run) = self.kvzip_run.take() {
            run.release(kv);
        }
    }

    /// The most prompt tokens a prompt of `n_prompt` holds while it is prefilled: all of
    /// them, or, pruned as its chunks arrive, the budget plus one interval.
    pub fn prefill_peak_tokens(&self, n_prompt: usize) -> usize {
        match self.prune_interval_tokens {
            Some(n) => n_prompt.min(self.budget_tokens as usize + n),
            None => n_prompt,
        }
    }

    /// Unit 0's policy: every unit runs the same spec, so it answers for all of them what
    /// depends only on the spec (which queries it reads).
    pub fn policy(&self) -> &dyn EvictionPolicy {
        &*self.units[0].policy
    }

    /// After a preemption the sequence is recomputed from scratch: start over (the caller
    /// has released KVzip's passes in progress).
    pub fn reset(&mut self) {
        debug_assert!(
            self.kvzip_run.is_none(),
            "kvzip: a run outlived its sequence's KV"
        );
        for u in &mut self.units {
            u.policy = self.spec.build();
        }
        self.initialised = false;
        self.recent_queries.clear();
        self.unit_budgets = None;
        self.head_first_keys.clear();
    }
}

/// Counters of what eviction did, for metrics.
#[derive(Debug, Default, Clone)]
pub struct EvictionStats {
    pub pruned_prompt_tokens: u64,
    pub evicted_blocks: u64,
    /// What eviction costs the paged cache (issue 38's systems measurement): K/V copied
    /// by compaction, in slots of one token of one layer and one KV head (K and V; bytes
    /// are `2 · head_dim · element size` each). Removing a whole block from a table that
    /// one unit owns copies none.
    pub kv_slot_copies: u64,
    /// Block-table entries moved down by whole-block removals (4 bytes each).
    pub table_entries_shifted: u64,
    /// Blocks the sequence's main table held before eviction and no longer holds.
    pub blocks_freed: u64,
    /// KVzip's reconstruction passes: their forward (the pass tokens run in a fork of the
    /// sequence) and the scoring of their queries, in seconds. Both are part of the
    /// request's time to first token.
    pub reconstruction_forward_seconds: f64,
    pub reconstruction_scoring_seconds: f64,
}

/// `KvView` over one sequence's stored tokens. Reads convert a whole block of one (K or V,
/// layer, KV head) at a time and keep one block per (K or V, layer, KV head), because
/// policies scan tokens in order, either layer by layer or token by token across layers;
/// with a single cached block the token-major order would convert a block per token.
///
/// On a device pool (no host store behind the trait) each block read is a round trip that
/// waits, so a view over a whole prompt can instead be `prefetched`: the range comes over
/// in one bulk `read_tokens` (one pipelined transfer on the GPU) and reads are host copies.
pub(crate) struct StoreView<'a> {
    store: &'a dyn KvBlocks,
    /// The pool's geometry, read once: `read` runs per token.
    geometry: KvGeometry,
    table: &'a [u32],
    n_tokens: usize,
    cache: RefCell<Vec<(Option<u32>, Vec<f32>)>>,
    /// K and V of every stored token in a context's layout (`[layer][kv_head][token][d]`).
    prefetched: Option<(Vec<f32>, Vec<f32>)>,
}

/// The most host memory (K and V as f32) a prefetched view may take; a longer prompt on a
/// device pool is read a block at a time instead.
pub(crate) const PREFETCH_LIMIT_BYTES: usize = 512 << 20;

impl<'a> StoreView<'a> {
    pub fn new(store: &'a dyn KvBlocks, table: &'a [u32], n_tokens: usize) -> StoreView<'a> {
        let g = store.geometry();
        let entries = 2 * g.n_layers * g.n_kv_heads;
        StoreView {
            store,
            geometry: g,
            table,
            n_tokens,
            cache: RefCell::new(vec![(None, Vec::new()); entries]),
            prefetched: None,
        }
    }

    /// A view that reads all `n_tokens` in one bulk transfer first, where that helps (a
    /// device pool) and fits `PREFETCH_LIMIT_BYTES`; otherwise `new`'s block-at-a-time view.
    pub fn prefetched(store: &'a dyn KvBlocks, table: &'a [u32], n_tokens: usize) -> StoreView<'a> {
        let mut view = StoreView::new(store, table, n_tokens);
        let g = view.geometry;
        let len = g.n_layers * g.n_kv_heads * n_tokens * g.head_dim;
        if store.as_kv_store().is_some() || 2 * 4 * len > PREFETCH_LIMIT_BYTES {
            return view;
        }
        let (mut k, mut v) = (vec![0f32; len], vec![0f32; len]);
        match store.read_tokens(table, 0, &mut k, &mut v) {
            Ok(()) => view.prefetched = Some((k, v)),
            // The backend has recorded the failure and fails its next forward pass; the
            // block reads below return what they can until then.
            Err(e) => {
                tracing::warn!("prefetching a sequence's KV for its eviction policy failed: {e}")
            }
        }
        view
    }

    fn read(&self, is_value: bool, layer: usize, kv_head: usize, token: usize, out: &mut [f32]) {
        let g = &self.geometry;
        let (bs, hd) = (g.block_size_tokens, g.head_dim);
        if let Some((k, v)) = &self.prefetched {
            debug_assert!(
                token < self.n_tokens,
                "token {token} of a view of {}",
                self.n_tokens
            );
            let at = ((layer * g.n_kv_heads + kv_head) * self.n_tokens + token) * hd;
            out.copy_from_slice(&(if is_value { v } else { k })[at..at + hd]);
            return;
        }
        let block = self.table[token / bs];
        let mut cache = self.cache.borrow_mut();
        let entry = &mut cache[(is_value as usize * g.n_layers + layer) * g.n_kv_heads + kv_head];
        if entry.0 != Some(block) {
            entry.1.resize(bs * hd, 0.0);
            if is_value {
                self.store.read_v(layer, block, kv_head, &mut entry.1);
            } else {
                self.store.read_k(layer, block, kv_head, &mut entry.1);
            }
            entry.0 = Some(block);
        }
        let slot = token % bs;
        out.copy_from_slice(&entry.1[slot * hd..(slot + 1) * hd]);
    }
}

impl KvView for StoreView<'_> {
    fn n_layers(&self) -> usize {
        self.geometry.n_layers
    }
    fn n_kv_heads(&self) -> usize {
        self.geometry.n_kv_heads
    }
    fn head_dim(&self) -> usize {
        self.geometry.head_dim
    }
    fn n_tokens(&self) -> usize {
        self.n_tokens
    }
    fn key(&self, layer: usize, kv_head: usize, token: usize, out: &mut [f32]) {
        self.read(false, layer, kv_head, token, out)
    }
    fn value(&self, layer: usize, kv_head: usize, token: usize, out: &mut [f32]) {
        self.read(true, layer, kv_head, token, out)
    }
}

/// Post-RoPE queries of a sequence's last few tokens, captured by the forward pass:
/// `data[layer][q][head * head_dim ..]`, with each query's stored index.
pub(crate) struct CapturedQueries {
    pub n_heads: usize,
    pub head_dim: usize,
    pub positions: Vec<usize>,
    pub data: Vec<f32>,
}

impl QueryView for CapturedQueries {
    fn n_queries(&self) -> usize {
        self.positions.len()
    }
    fn n_heads(&self) -> usize {
        self.n_heads
    }
    fn query(&self, layer: usize, head: usize, q: usize, out: &mut [f32]) {
        let q_dim = self.n_heads * self.head_dim;
        let at = (layer * self.positions.len() + q) * q_dim + head * self.head_dim;
        out.copy_from_slice(&self.data[at..at + self.head_dim]);
    }
    fn query_position(&self, q: usize) -> usize {
        self.positions[q]
    }
}

/// A live sequence's block table as the plain ids the model and the store take.
pub(crate) fn table_of(kv: &KvCacheManager, seq: SeqId) -> Vec<u32> {
    kv.block_table(seq)
        .expect("live sequence")
        .block_ids()
        .iter()
        .map(|b| b.0)
        .collect()
}

/// Runs prefill selection over everything the sequence has stored, in every unit, and
/// compacts the kept tokens (the block table keeps their positions, unit 0's).
/// Returns false when compaction could not get a block for a copy-on-write (the caller
/// then treats it like any other allocation failure).
pub(crate) fn after_prefill(
    ev: &mut SeqEviction,
    kv: &mut KvCacheManager,
    store: &mut dyn KvBlocks,
    seq: SeqId,
    queries: Option<&CapturedQueries>,
    stats: &mut EvictionStats,
) -> bool {
    ev.initialised = true;
    select_and_compact(ev, kv, store, seq, queries, stats)
}

/// Mid-prompt pruning of a prompt pruned as its chunks arrive: the same selection over
/// what is stored so far (a query-free policy), when that exceeds the budget. The policy
/// is not yet initialised for decode: the prompt's last chunk selects again.
pub(crate) fn prune_prompt_so_far(
    ev: &mut SeqEviction,
    kv: &mut KvCacheManager,
    store: &mut dyn KvBlocks,
    seq: SeqId,
    stats: &mut EvictionStats,
) -> bool {
    let n_stored = kv.block_table(seq).expect("live").num_stored_tokens();
    if n_stored <= ev.budget_tokens {
        return true;
    }
    select_and_compact(ev, kv, store, seq, None, stats)
}

fn select_and_compact(
    ev: &mut SeqEviction,
    kv: &mut KvCacheManager,
    store: &mut dyn KvBlocks,
    seq: SeqId,
    queries: Option<&CapturedQueries>,
    stats: &mut EvictionStats,
) -> bool {
    let table = table_of(kv, seq);
    let n_stored = kv.block_table(seq).expect("live").num_stored_tokens() as usize;
    let bs = kv.block_size_tokens();
    let keeps: Vec<Vec<u32>> = {
        let view = StoreView::prefetched(&*store, &table, n_stored);
        let budgets = ev.unit_budgets.clone();
        let default_budget = ev.budget_tokens;
        ev.units
            .iter_mut()
            .enumerate()
            .map(|(i, u)| {
                let budget = budgets.as_ref().map_or(default_budget, |b| b[i]);
                let unit_view = UnitView {
                    inner: &view,
                    unit: &u.unit,
                };
                let unit_queries = queries.map(|q| UnitQueries {
                    inner: q,
                    unit: &u.unit,
                    n_kv_heads: view.n_kv_heads(),
                });
                u.policy.select_prefill(
                    &unit_view,
                    unit_queries.as_ref().map(|q| q as &dyn QueryView),
                    budget,
                    bs,
                )
            })
            .collect()
    };
    if ev.record_keeps {
        let priors = &ev.recorded_prior_scores;
        let record = ev
            .units
            .iter()
            .zip(&keeps)
            .enumerate()
            .map(|(i, (u, kept))| PrefillKeep {
                layers: u.unit.layers.clone(),
                kv_head: u.unit.kv_head,
                kept: kept.clone(),
                prior_scores: priors.get(i).cloned().unwrap_or_default(),
            });
        ev.recorded_keeps = Some(record.collect());
    }
    if keeps.iter().all(|k| k.len() == n_stored) {
        return true;
    }
    let kept = match ev.unit_budgets.is_some() {
        true => compact_ragged(ev, kv, store, seq, &keeps, stats),
        false => compact(ev, kv, store, seq, &keeps, stats).then_some(keeps[0].len()),
    };
    let Some(kept) = kept else {
        return false;
    };
    stats.pruned_prompt_tokens += (n_stored - kept) as u64;
    true
}

/// Keeps `keeps[u]` in unit `u` (one KV head of one layer each), of unequal lengths,
/// right-aligned (`KvCacheManager::compact_units_ragged`), and records each head's first
/// key for attention. Returns the mean count kept, or `None` when no block was free for a
/// copy-on-write.
fn compact_ragged(
    ev: &mut SeqEviction,
    kv: &mut KvCacheManager,
    store: &mut dyn KvBlocks,
    seq: SeqId,
    keeps: &[Vec<u32>],
    stats: &mut EvictionStats,
) -> Option<usize> {
    let g = store.geometry();
    let blocks_before = kv.block_table(seq).expect("live").num_blocks();
    let (private, unit_moves, first_keys) = kv.compact_units_ragged(seq, keeps)?;
    let slot = |m: &TokenMove| {
        (
            (m.src.block_id.0, m.src.offset_tokens as usize),
            (m.dst.block_id.0, m.dst.offset_tokens as usize),
        )
    };
    for m in &private {
        let (src, dst) = slot(m);
        store.copy_slot(src, dst);
    }
    stats.kv_slot_copies += private.len() as u64 * (g.n_layers * g.n_kv_heads) as u64;
    ev.head_first_keys = vec![0; g.n_layers * g.n_kv_heads];
    for ((u, moves), &first) in ev.units.iter().zip(&unit_moves).zip(&first_keys) {
        let head = u.unit.kv_head.expect("a ragged budget selects per KV head");
        for m in moves {
            let (src, dst) = slot(m);
            for &layer in &u.unit.layers {
                store.copy_slot_in(layer..layer + 1, head..head + 1, src, dst);
            }
        }
        for &layer in &u.unit.layers {
            ev.head_first_keys[layer * g.n_kv_heads + head] = first;
        }
        stats.kv_slot_copies += (moves.len() * u.unit.layers.len()) as u64;
    }
    count_freed(kv, seq, blocks_before, stats);
    Some(keeps.iter().map(Vec::len).sum::<usize>() / keeps.len().max(1))
}

/// Keeps `keeps[u]` in unit `u` and performs the K/V moves: through `compact` (every layer
/// at once) when one unit holds the whole model, else through `compact_units`.
fn compact(
    ev: &SeqEviction,
    kv: &mut KvCacheManager,
    store: &mut dyn KvBlocks,
    seq: SeqId,
    keeps: &[Vec<u32>],
    stats: &mut EvictionStats,
) -> bool {
    let g = store.geometry();
    let all_slots = (g.n_layers * g.n_kv_heads) as u64;
    let blocks_before = kv.block_table(seq).expect("live").num_blocks();
    let slot = |m: &TokenMove| {
        (
            (m.src.block_id.0, m.src.offset_tokens as usize),
            (m.dst.block_id.0, m.dst.offset_tokens as usize),
        )
    };
    if ev.units.len() == 1 {
        let Some(moves) = kv.compact(seq, &keeps[0]) else {
            return false;
        };
        for m in &moves {
            let (src, dst) = slot(m);
            store.copy_slot(src, dst);
        }
        stats.kv_slot_copies += moves.len() as u64 * all_slots;
        count_freed(kv, seq, blocks_before, stats);
        return true;
    }
    let Some((private, unit_moves)) = kv.compact_units(seq, keeps) else {
        return false;
    };
    for m in &private {
        let (src, dst) = slot(m);
        store.copy_slot(src, dst);
    }
    stats.kv_slot_copies += private.len() as u64 * all_slots;
    let n_kv_heads = g.n_kv_heads;
    for (u, moves) in ev.units.iter().zip(&unit_moves) {
        let heads = u.unit.kv_head.map_or(0..n_kv_heads, |h| h..h + 1);
        for m in moves {
            let (src, dst) = slot(m);
            for &layer in &u.unit.layers {
                store.copy_slot_in(layer..layer + 1, heads.clone(), src, dst);
            }
        }
        stats.kv_slot_copies += (moves.len() * u.unit.layers.len() * heads.len()) as u64;
    }
    count_freed(kv, seq, blocks_before, stats);
    true
}

fn count_freed(kv: &KvCacheManager, seq: SeqId, blocks_before: usize, stats: &mut EvictionStats) {
    let after = kv.block_table(seq).expect("live").num_blocks();
    stats.blocks_freed += blocks_before.saturating_sub(after) as u64;
}

/// After a decode token: score a block that just filled (in every unit), then evict while
/// over budget. With one unit a whole
/// block leaves the table; with several, each unit drops its own block and moves its later
/// blocks down one, and the table's last block is released.
pub(crate) fn after_decode(
    ev: &mut SeqEviction,
    kv: &mut KvCacheManager,
    store: &mut dyn KvBlocks,
    seq: SeqId,
    n_heads: usize,
    stats: &mut EvictionStats,
) {
    let bs = kv.block_size_tokens() as usize;
    let n_stored = kv.block_table(seq).expect("live").num_stored_tokens() as usize;
    if !n_stored.is_multiple_of(bs) {
        return;
    }
    score_filled_block(ev, kv, &*store, seq, n_heads, n_stored);
    // A ragged layout selects once: its heads' counts differ, so no block is one to drop.
    while !ev.keep_generated
        && ev.head_first_keys.is_empty()
        && kv.block_table(seq).expect("live").num_stored_tokens() > ev.budget_tokens
    {
        let n_blocks = kv.block_table(seq).expect("live").num_blocks();
        let before = kv.block_table(seq).expect("live").num_stored_tokens() as usize;
        let victims: Option<Vec<usize>> = ev
            .units
            .iter()
            .map(|u| u.policy.choose_victim(n_blocks))
            .collect();
        let Some(victims) = victims else { break };
        if ev.units.len() == 1 {
            kv.remove_block(seq, victims[0]);
            stats.table_entries_shifted += (n_blocks - victims[0] - 1) as u64;
            stats.blocks_freed += 1;
        } else {
            // Full blocks only here (a block has just filled), so each unit drops B tokens.
            let keeps: Vec<Vec<u32>> = victims
                .iter()
                .map(|&v| {
                    (0..before as u32)
                        .filter(|&i| i as usize / bs != v)
                        .collect()
                })
                .collect();
            if !compact(ev, kv, store, seq, &keeps, stats) {
                tracing::warn!("no free block for a copy-on-write while evicting per {}; the sequence stays over its budget", ev.granularity);
                break;
            }
        }
        for (u, &v) in ev.units.iter_mut().zip(&victims) {
            u.policy.on_block_removed(v);
        }
        stats.evicted_blocks += 1;
    }
}

/// Every unit's policy scores the block of `seq` that has just filled (the last of its
/// `n_stored` tokens), with the decode queries gathered since the last block.
fn score_filled_block(
    ev: &mut SeqEviction,
    kv: &KvCacheManager,
    store: &dyn KvBlocks,
    seq: SeqId,
    n_heads: usize,
    n_stored: usize,
) {
    let bs = kv.block_size_tokens() as usize;
    let table = table_of(kv, seq);
    let queries = recent_as_view(ev, store, n_heads);
    let view = StoreView::new(store, &table, n_stored);
    for u in &mut ev.units {
        let unit_view = UnitView {
            inner: &view,
            unit: &u.unit,
        };
        let unit_queries = queries.as_ref().map(|q| UnitQueries {
            inner: q,
            unit: &u.unit,
            n_kv_heads: view.n_kv_heads(),
        });
        u.policy.on_block_filled(
            &unit_view,
            unit_queries.as_ref().map(|q| q as &dyn QueryView),
            n_stored / bs - 1,
        );
    }
    drop(queries);
    ev.recent_queries.clear();
}

/// A unit's part of a sequence's K/V: its layers, and every KV head or one.
struct UnitView<'a> {
    inner: &'a StoreView<'a>,
    unit: &'a SelectionUnit,
}

impl KvView for UnitView<'_> {
    fn n_layers(&self) -> usize {
        self.unit.layers.len()
    }
    fn n_kv_heads(&self) -> usize {
        if self.unit.kv_head.is_some() {
            1
        } else {
            self.inner.n_kv_heads()
        }
    }
    fn head_dim(&self) -> usize {
        self.inner.head_dim()
    }
    fn n_tokens(&self) -> usize {
        self.inner.n_tokens()
    }
    fn key(&self, layer: usize, kv_head: usize, token: usize, out: &mut [f32]) {
        self.inner.key(
            self.unit.layers[layer],
            self.unit.kv_head.unwrap_or(kv_head),
            token,
            out,
        )
    }
    fn value(&self, layer: usize, kv_head: usize, token: usize, out: &mut [f32]) {
        self.inner.value(
            self.unit.layers[layer],
            self.unit.kv_head.unwrap_or(kv_head),
            token,
            out,
        )
    }
}

/// A unit's part of the captured queries: its layers, and for one KV head the query heads
/// of its GQA group.
struct UnitQueries<'a> {
    inner: &'a CapturedQueries,
    unit: &'a SelectionUnit,
    n_kv_heads: usize,
}

impl UnitQueries<'_> {
    fn group(&self) -> usize {
        self.inner.n_heads / self.n_kv_heads
    }
}

impl QueryView for UnitQueries<'_> {
    fn n_queries(&self) -> usize {
        self.inner.n_queries()
    }
    fn n_heads(&self) -> usize {
        if self.unit.kv_head.is_some() {
            self.group()
        } else {
            self.inner.n_heads
        }
    }
    fn query(&self, layer: usize, head: usize, q: usize, out: &mut [f32]) {
        let head = self.unit.kv_head.map_or(head, |h| h * self.group() + head);
        self.inner.query(self.unit.layers[layer], head, q, out)
    }
    fn query_position(&self, q: usize) -> usize {
        self.inner.query_position(q)
    }
}

/// The newest queries the policy asks for, transposed to `CapturedQueries`' layout.
fn recent_as_view(
    ev: &SeqEviction,
    store: &dyn KvBlocks,
    n_heads: usize,
) -> Option<CapturedQueries> {
    let want = ev.policy().decode_queries().count(ev.recent_queries.len());
    if want == 0 {
        return None;
    }
    let g = store.geometry();
    let q_dim = n_heads * g.head_dim;
    let recent = &ev.recent_queries[ev.recent_queries.len() - want..];
    let mut data = vec![0f32; g.n_layers * want * q_dim];
    for layer in 0..g.n_layers {
        for (q, (_, per_layer)) in recent.iter().enumerate() {
            let dst = (layer * want + q) * q_dim;
            data[dst..dst + q_dim].copy_from_slice(&per_layer[layer * q_dim..(layer + 1) * q_dim]);
        }
    }
    Some(CapturedQueries {
        n_heads,
        head_dim: g.head_dim,
        positions: recent.iter().map(|r| r.0).collect(),
        data,
    })
}

pub(crate) mod kvzip;
pub(crate) mod kvzip_keys;
pub(crate) mod kvzip_run;
#[cfg(test)]
mod tests;
