//! Glue between the pure eviction policies of `pk-kv` and the engine's physical KV store.
//!
//! The policies read K/V through `KvView` and queries through `QueryView`; here those are
//! implemented over the backend's KV pool (`KvBlocks`, through the sequence's block table) and over the queries the
//! forward pass captured. The engine calls `after_prefill` once a sequence's prompt is in
//! the cache (exact attention over the full prompt has happened) and `after_decode` after
//! every decode token; both edit the block table through the manager and move K/V in the
//! store as the manager says.

use std::cell::RefCell;

use pk_kv::{EvictionPolicy, KvCacheManager, KvView, PolicySpec, QueryView, SeqId};
use pk_model::{KvBlocks, KvGeometry};

/// A sequence's eviction state: its policy instance and budget.
pub(crate) struct SeqEviction {
    pub policy: Box<dyn EvictionPolicy>,
    pub spec: PolicySpec,
    pub budget_tokens: u32,
    /// The budget applies at prefill only; decode never evicts (`GenerateParams::kv_keep_generated`).
    pub keep_generated: bool,
    /// Prefill selection has run (the policy holds block scores).
    pub initialised: bool,
    /// Post-RoPE queries of the tokens decoded since the last block filled, for policies
    /// that score blocks with queries: (stored index, `[layer][n_heads * head_dim]`). Cleared
    /// whenever a block fills, so stored indices never go stale across an eviction.
    pub recent_queries: Vec<(usize, Vec<f32>)>,
}

impl SeqEviction {
    pub fn new(spec: PolicySpec, budget_tokens: u32) -> SeqEviction {
        SeqEviction { policy: spec.build(), spec, budget_tokens, keep_generated: false, initialised: false, recent_queries: Vec::new() }
    }

    /// After a preemption the sequence is recomputed from scratch: start over.
    pub fn reset(&mut self) {
        self.policy = self.spec.build();
        self.initialised = false;
        self.recent_queries.clear();
    }
}

/// Counters of what eviction did, for metrics.
#[derive(Debug, Default, Clone)]
pub struct EvictionStats {
    pub pruned_prompt_tokens: u64,
    pub evicted_blocks: u64,
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
        StoreView { store, geometry: g, table, n_tokens, cache: RefCell::new(vec![(None, Vec::new()); entries]), prefetched: None }
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
            Err(e) => tracing::warn!("prefetching a sequence's KV for its eviction policy failed: {e}"),
        }
        view
    }

    fn read(&self, is_value: bool, layer: usize, kv_head: usize, token: usize, out: &mut [f32]) {
        let g = &self.geometry;
        let (bs, hd) = (g.block_size_tokens, g.head_dim);
        if let Some((k, v)) = &self.prefetched {
            debug_assert!(token < self.n_tokens, "token {token} of a view of {}", self.n_tokens);
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
    kv.block_table(seq).expect("live sequence").block_ids().iter().map(|b| b.0).collect()
}

/// Runs prefill selection over everything the sequence has stored and compacts the kept
/// tokens (and `positions`, the stored tokens' positions, with them). Returns false when compaction could not get a block for a copy-on-write (the
/// caller then treats it like any other allocation failure).
pub(crate) fn after_prefill(
    ev: &mut SeqEviction,
    kv: &mut KvCacheManager,
    store: &mut dyn KvBlocks,
    seq: SeqId,
    queries: Option<&CapturedQueries>,
    stats: &mut EvictionStats,
    positions: &mut Option<Vec<u32>>,
) -> bool {
    let table = table_of(kv, seq);
    let n_stored = kv.block_table(seq).expect("live").num_stored_tokens() as usize;
    let bs = kv.block_size_tokens();
    let keep = {
        let view = StoreView::prefetched(&*store, &table, n_stored);
        ev.policy.select_prefill(&view, queries.map(|q| q as &dyn QueryView), ev.budget_tokens, bs)
    };
    ev.initialised = true;
    if keep.len() == n_stored {
        return true;
    }
    let Some(moves) = kv.compact(seq, &keep) else { return false };
    let old = positions.take().unwrap_or_else(|| (0..n_stored as u32).collect());
    *positions = Some(keep.iter().map(|&i| old[i as usize]).collect());
    for m in &moves {
        store.copy_slot((m.src.block_id.0, m.src.offset_tokens as usize), (m.dst.block_id.0, m.dst.offset_tokens as usize));
    }
    stats.pruned_prompt_tokens += (n_stored - keep.len()) as u64;
    true
}

/// After a decode token: score a block that just filled, then evict while over budget
/// (dropping the evicted tokens' entries from `positions`).
pub(crate) fn after_decode(ev: &mut SeqEviction, kv: &mut KvCacheManager, store: &dyn KvBlocks, seq: SeqId, n_heads: usize, stats: &mut EvictionStats, positions: &mut Option<Vec<u32>>) {
    let bs = kv.block_size_tokens() as usize;
    let n_stored = kv.block_table(seq).expect("live").num_stored_tokens() as usize;
    if n_stored % bs != 0 {
        return;
    }
    let table = table_of(kv, seq);
    let queries = recent_as_view(ev, store, n_heads);
    {
        let view = StoreView::new(store, &table, n_stored);
        ev.policy.on_block_filled(&view, queries.as_ref().map(|q| q as &dyn QueryView), n_stored / bs - 1);
    }
    ev.recent_queries.clear();
    while !ev.keep_generated && kv.block_table(seq).expect("live").num_stored_tokens() > ev.budget_tokens {
        let n_blocks = kv.block_table(seq).expect("live").num_blocks();
        let Some(victim) = ev.policy.choose_victim(n_blocks) else { break };
        let before = kv.block_table(seq).expect("live").num_stored_tokens() as usize;
        kv.remove_block(seq, victim);
        let removed = before - kv.block_table(seq).expect("live").num_stored_tokens() as usize;
        let p = positions.get_or_insert_with(|| (0..before as u32).collect());
        p.drain(victim * bs..victim * bs + removed);
        ev.policy.on_block_removed(victim);
        stats.evicted_blocks += 1;
    }
}

/// The newest queries the policy asks for, transposed to `CapturedQueries`' layout.
fn recent_as_view(ev: &SeqEviction, store: &dyn KvBlocks, n_heads: usize) -> Option<CapturedQueries> {
    let want = ev.policy.decode_queries().count(ev.recent_queries.len());
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
    Some(CapturedQueries { n_heads, head_dim: g.head_dim, positions: recent.iter().map(|r| r.0).collect(), data })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pk_model::backend::BlockOpsOnly;
    use pk_model::{KvDtype, KvStore};

    /// A prefetched view reads what the block-at-a-time view reads, token by token, in any
    /// order; on a host store it is the block-at-a-time view itself.
    #[test]
    fn prefetched_view_reads_what_block_reads_do() {
        let g = KvGeometry { n_layers: 2, n_kv_heads: 3, head_dim: 8, block_size_tokens: 4, num_blocks: 8 };
        let table = [6u32, 2, 5, 0];
        let n = 14;
        let len = g.n_layers * g.n_kv_heads * n * g.head_dim;
        let k: Vec<f32> = (0..len).map(|i| (i % 97) as f32 / 8.0).collect();
        let v: Vec<f32> = (0..len).map(|i| -((i % 89) as f32) / 4.0).collect();
        let mut pool = BlockOpsOnly(KvStore::new(g, KvDtype::F16));
        pool.write_tokens(&table, 0, &k, &v);
        let (plain, pre) = (StoreView::new(&pool, &table, n), StoreView::prefetched(&pool, &table, n));
        assert!(pre.prefetched.is_some());
        assert!(StoreView::prefetched(&pool.0, &table, n).prefetched.is_none());
        let (mut a, mut b) = (vec![0f32; 8], vec![0f32; 8]);
        for token in (0..n).rev() {
            for layer in 0..2 {
                for h in 0..3 {
                    plain.key(layer, h, token, &mut a);
                    pre.key(layer, h, token, &mut b);
                    assert_eq!(a, b);
                    plain.value(layer, h, token, &mut a);
                    pre.value(layer, h, token, &mut b);
                    assert_eq!(a, b);
                }
            }
        }
    }
}
