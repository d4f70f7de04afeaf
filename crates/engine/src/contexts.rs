//! Whole-context KV reuse through an EVICPRESS `ContextStore` (spec `evicpress.md`), and
//! the primitive underneath it: a sequence whose first prompt tokens are not computed but
//! written from a given, possibly compressed, KV ([`PrefixKv`]).
//!
//! A context is a chunk-aligned prompt prefix (LMCache's granularity: chunks of
//! `chunk_size_tokens`, keyed by the same chained hash as the chunk tiers), stored as one
//! entry with one configuration. On admission the engine asks for the longest stored
//! context at the head of the prompt; a hit is loaded (on the engine thread, like the chunk
//! tiers' loads: the request cannot start without it) and written into fresh blocks, with
//! its tokens' original positions, so a dropped context leaves the block table dense while
//! the query is placed after the context's full length. After a miss is prefilled, the
//! context's KV is copied out of the pool and offered to the store, whose worker thread
//! stores and places it; the engine never waits for that.
//!
//! NOTE: KV loaded from a compressed copy is not what prefill would compute, so such a
//! sequence never feeds the pool's prefix cache or the chunk tiers.
//!
//! SnapKV scores a stored context by the attention of its last 64 tokens' queries, which
//! the pool does not keep. When the store's grid has a SnapKV configuration, the offer runs
//! those tokens through the forward pass once more to capture their queries
//! ([`window_queries`]); on the CPU that rewrites their K/V with the same bits (its forward
//! pass is batch-invariant; a GPU's GEMMs may round the last bits differently for another
//! batch shape, which moves those 64 tokens' K/V by at most that rounding), and the store's
//! worker turns the queries into scores.

use std::sync::Arc;

use pk_codec::KvContext;
use pk_evicpress::{ContextStore, LoadReport, StoreConfig, WindowQueries};
use pk_kv::{KvCacheManager, SeqId};
use pk_model::{Backend, KvBlocks, SeqForward};
use pk_tiers::{ChunkKey, ChunkKeyer};

use crate::eviction::table_of;

/// A given KV for the first `kv.n_original_tokens` prompt tokens (stored tokens carry their
/// positions). Used by profiling, evaluation and the context store.
#[derive(Debug, Clone)]
pub struct PrefixKv {
    pub kv: KvContext,
}

impl PrefixKv {
    /// Prompt tokens this KV stands for.
    pub fn n_tokens(&self) -> usize {
        self.kv.n_original_tokens
    }
}

/// How the engine uses an EVICPRESS store.
#[derive(Clone)]
pub struct ContextReuseConfig {
    /// The store's settings; its fingerprint is replaced by the engine's own (model and KV
    /// precision), so that a store never serves another model's KV.
    pub store: StoreConfig,
    /// Context boundaries fall on multiples of this many tokens (a multiple of the block size).
    pub chunk_size_tokens: usize,
    /// How profiling scores a configuration's answers against the full KV's.
    pub profile_metric: crate::profiler::QualityMetric,
}

impl std::fmt::Debug for ContextReuseConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContextReuseConfig")
            .field("policy", &self.store.policy)
            .field("chunk_size_tokens", &self.chunk_size_tokens)
            .finish()
    }
}

#[derive(Debug, Default, Clone)]
pub struct ContextReuseStats {
    pub lookups: u64,
    pub hits: u64,
    pub load_failures: u64,
    pub offered: u64,
    pub hit_tokens: u64,
}

pub(crate) struct ContextReuse {
    pub store: Arc<ContextStore>,
    keyer: ChunkKeyer,
    pub stats: ContextReuseStats,
    pub profile_metric: crate::profiler::QualityMetric,
}

/// The codec fingerprint of a model's KV: a digest of the engine's cache namespace.
pub fn kv_fingerprint(namespace: &[u8]) -> [u8; 32] {
    *blake3::hash(namespace).as_bytes()
}

impl ContextReuse {
    pub fn new(
        cfg: &ContextReuseConfig,
        model_name: &str,
        namespace: &[u8],
        block_size_tokens: usize,
    ) -> anyhow::Result<ContextReuse> {
        let keyer = ChunkKeyer::new(
            model_name,
            namespace,
            cfg.chunk_size_tokens,
            block_size_tokens,
        )
        .map_err(anyhow::Error::msg)?;
        let mut store_cfg = cfg.store.clone();
        store_cfg.fingerprint = kv_fingerprint(namespace);
        Ok(ContextReuse {
            store: ContextStore::new(store_cfg).map_err(anyhow::Error::msg)?,
            keyer,
            stats: ContextReuseStats::default(),
            profile_metric: cfg.profile_metric,
        })
    }

    pub fn chunk_size_tokens(&self) -> usize {
        self.keyer.chunk_size_tokens()
    }

    /// Chained keys of the prompt's full chunks, leaving at least one token to compute.
    pub fn keys(&self, tokens: &[u32], salt: Option<&str>) -> Vec<ChunkKey> {
        let usable = tokens.len().saturating_sub(1);
        self.keyer.keys(&tokens[..usable], salt.map(str::as_bytes))
    }

    /// The longest stored context among the prompt's chunk boundaries: (key, tokens).
    pub fn lookup(&mut self, keys: &[ChunkKey]) -> Option<(ChunkKey, usize)> {
        self.stats.lookups += 1;
        let chunk = self.chunk_size_tokens();
        self.store
            .longest_stored(keys)
            .map(|i| (keys[i], (i + 1) * chunk))
    }

    pub fn load(&mut self, key: &ChunkKey, query: &[u32]) -> Option<(KvContext, LoadReport)> {
        match self.store.load(key, Some(query)) {
            Ok(r) => {
                self.stats.hits += 1;
                self.stats.hit_tokens += r.0.n_original_tokens as u64;
                Some(r)
            }
            Err(e) => {
                tracing::warn!("loading a stored context failed, recomputing: {e}");
                self.stats.load_failures += 1;
                None
            }
        }
    }

    /// Hands a loaded context's buffers back to the store for the next load.
    pub fn recycle(&self, kv: KvContext) {
        self.store.recycle(kv);
    }

    /// Offers a prefilled context to the store, with the queries of its last tokens when
    /// the store scores by SnapKV.
    pub fn offer(&mut self, key: ChunkKey, kv: KvContext, window: Option<WindowQueries>) {
        let offered = match window {
            Some(w) => self.store.offer_with_window(key, kv, w),
            None => self.store.offer(key, kv),
        };
        if offered {
            self.stats.offered += 1;
        }
    }

    /// Whether offers should carry the context's window queries.
    pub fn wants_window(&self) -> bool {
        self.store.wants_snapkv()
    }
}

/// The queries of the last (up to 64) of `ids` — the first `ids.len()` stored tokens of
/// `seq`, at positions equal to their stored indices — computed again by `backend`, for the
/// store's SnapKV scores. `None` if the forward pass fails (the context is then offered
/// without them, and its SnapKV configurations are unavailable).
pub(crate) fn window_queries(
    backend: &mut dyn Backend,
    kv: &KvCacheManager,
    seq: SeqId,
    ids: &[u32],
) -> Option<WindowQueries> {
    let n = ids.len();
    let w = (pk_kv::SNAPKV_WINDOW_DEFAULT as usize).min(n);
    if w == 0 {
        return None;
    }
    let table = table_of(kv, seq);
    let fwd = SeqForward {
        tokens: &ids[n - w..],
        start_position: n - w,
        stored_start: n - w,
        block_table: &table,
        logits_from: w,
        stored_positions: &[],
        window_tables: &[],
    };
    match backend.forward_with_queries(&[fwd], &[w]) {
        Ok((_, mut captured)) if !captured.is_empty() => Some(WindowQueries {
            n_heads: backend.config().n_heads,
            positions: (n - w..n).collect(),
            data: captured.swap_remove(0),
        }),
        Ok(_) => None,
        Err(e) => {
            tracing::warn!("capturing a context's SnapKV window failed: {e}");
            None
        }
    }
}

/// Writes `ctx`'s stored tokens into `seq` (which must be empty), in order. Returns false
/// if the pool has no room (nothing is half-written that the caller would use: it frees
/// the sequence).
pub(crate) fn write_prefix(
    ctx: &KvContext,
    kv: &mut KvCacheManager,
    store: &mut dyn KvBlocks,
    seq: SeqId,
) -> bool {
    let g = store.geometry();
    let n = ctx.n_tokens();
    if ctx.n_layers != g.n_layers || ctx.n_kv_heads != g.n_kv_heads || ctx.head_dim != g.head_dim {
        return false;
    }
    if n > 0 && kv.allocate_slots(seq, n as u32).is_none() {
        return false;
    }
    let table = table_of(kv, seq);
    store.write_tokens(&table, 0, &ctx.k, &ctx.v);
    true
}

/// Copies the first `n_tokens` stored tokens of `seq` (not evicted, so stored index =
/// position) out of the pool.
pub(crate) fn read_prefix(
    kv: &KvCacheManager,
    store: &dyn KvBlocks,
    seq: SeqId,
    n_tokens: usize,
) -> Option<KvContext> {
    let g = store.geometry();
    // The view trusts the count it is given; the sequence must really store that many.
    if kv
        .block_table(seq)
        .map_or(0, |t| t.num_stored_tokens() as usize)
        < n_tokens
    {
        return None;
    }
    let table = table_of(kv, seq);
    let d = g.head_dim;
    let len = g.n_layers * g.n_kv_heads * n_tokens * d;
    let (mut k, mut v) = (vec![0f32; len], vec![0f32; len]);
    if let Err(e) = store.read_tokens(&table, 0, &mut k, &mut v) {
        tracing::warn!("reading a context out of the KV pool failed, not offering it: {e}");
        return None;
    }
    KvContext::new(
        g.n_layers,
        g.n_kv_heads,
        d,
        (0..n_tokens as u32).collect(),
        k,
        v,
    )
    .ok()
}

/// What an admitted sequence got from a stored or given context.
#[derive(Debug, Clone, Default)]
pub(crate) struct SeqContext {
    /// The KV is not what prefill computes: keep it out of the prefix cache and tiers.
    pub inexact: bool,
    /// A context to offer to the store once the prompt is prefilled: (key, tokens).
    pub offer: Option<(ChunkKey, usize)>,
    pub load: Option<LoadReport>,
}
