//! Whole-context KV reuse through an EVICPRESS `ContextStore` (spec `evicpress.md`): the
//! second [`KvReuse`] connector.
//!
//! A context is a chunk-aligned prompt prefix (LMCache's granularity: chunks of
//! `chunk_size_tokens`, keyed by the same chained hash as the chunk tiers), stored as one
//! entry with one configuration. A waiting request asks once for the longest stored context
//! at the head of its prompt; a hit is loaded (on the engine thread, like the chunk tiers'
//! loads: the request cannot start without it) and written into fresh blocks with its
//! tokens' original positions ([`crate::prefix_kv`]). After a miss is prefilled, the
//! context's KV is copied out of the pool and offered to the store, whose worker thread
//! stores and places it; the engine never waits for that.
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
use pk_model::{Backend, SeqForward};
use pk_tiers::{ChunkKey, ChunkKeyer};

use crate::engine::Engine;
use crate::eviction::table_of;
use crate::namespace::CacheNamespace;
pub use crate::prefix_kv::PrefixKv;
use crate::prefix_kv::{place_prefix, read_prefix};
use crate::reuse::{KvReuse, Placed, ReuseMatch, SeqReuse};

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

impl ContextReuse {
    pub fn new(
        cfg: &ContextReuseConfig,
        model_name: &str,
        namespace: &CacheNamespace,
        block_size_tokens: usize,
    ) -> anyhow::Result<ContextReuse> {
        let keyer = ChunkKeyer::new(
            model_name,
            namespace.as_bytes(),
            cfg.chunk_size_tokens,
            block_size_tokens,
        )
        .map_err(anyhow::Error::msg)?;
        let mut store_cfg = cfg.store.clone();
        store_cfg.fingerprint = namespace.kv_fingerprint();
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

    fn load_context(&mut self, key: &ChunkKey, query: &[u32]) -> Option<(KvContext, LoadReport)> {
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
    fn offer(&mut self, key: ChunkKey, kv: KvContext, window: Option<WindowQueries>) {
        let offered = match window {
            Some(w) => self.store.offer_with_window(key, kv, w),
            None => self.store.offer(key, kv),
        };
        if offered {
            self.stats.offered += 1;
        }
    }

    /// Whether offers should carry the context's window queries.
    fn wants_window(&self) -> bool {
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

impl KvReuse for ContextReuse {
    /// The longest stored context among the prompt's chunk boundaries. A prompt with any
    /// stored context is not offered again (the store placed what it had); one with none is
    /// offered whole once computed.
    fn lookup(&mut self, ids: &[u32], salt: Option<&str>) -> ReuseMatch {
        self.stats.lookups += 1;
        let keys = self.keys(ids, salt);
        let stored = self.store.longest_stored(&keys);
        ReuseMatch {
            loadable_tokens: stored.map_or(0, |i| (i + 1) * self.chunk_size_tokens()),
            saved_chunks: if stored.is_some() { keys.len() } else { 0 },
            keys,
        }
    }

    fn load(
        &mut self,
        m: &ReuseMatch,
        query: &[u32],
        kv: &mut KvCacheManager,
        backend: &mut dyn Backend,
        seq: SeqId,
    ) -> Option<Placed> {
        let tokens = m.loadable_tokens;
        let key = *m
            .keys
            .get((tokens / self.chunk_size_tokens()).checked_sub(1)?)?;
        let (ctx, mut report) = self.load_context(&key, query)?;
        let t0 = std::time::Instant::now();
        let written =
            ctx.n_original_tokens == tokens && place_prefix(&ctx, kv, backend.kv_mut(), seq);
        report.restore_s = t0.elapsed().as_secs_f64();
        if written {
            self.store.observe_restore(ctx.n_tokens(), report.restore_s);
        }
        let placed = written.then(|| Placed {
            tokens,
            exact: ctx.n_tokens() == tokens && report.config.starts_with("none-"),
            saved_chunks: m.keys.len(),
            report: Some(report),
        });
        self.recycle(ctx);
        placed
    }

    fn save(
        &mut self,
        s: &mut SeqReuse,
        ids: &[u32],
        _computed: usize,
        kv: &KvCacheManager,
        backend: &mut dyn Backend,
        seq: SeqId,
    ) {
        let Some(&key) = s.keys.last() else {
            return;
        };
        s.saved_chunks = s.keys.len();
        let tokens = s.keys.len() * self.chunk_size_tokens();
        let Some(kv_copy) = read_prefix(kv, backend.kv(), seq, tokens) else {
            return;
        };
        let window = match self.wants_window() {
            true => window_queries(backend, kv, seq, &ids[..tokens]),
            false => None,
        };
        self.offer(key, kv_copy, window);
    }

    fn observe_prefill(&mut self, tokens: usize, seconds: f64) {
        self.store.observe_prefill(tokens, seconds);
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Tokens of the prefill timed at start-up: `bench perf`'s shortest default context, so
/// that the two figures compare.
const CALIBRATION_PREFILL_TOKENS: usize = 512;
/// Bytes of each tier probe at start-up: about one 2K-token context of SmolLM2 in f16.
const CALIBRATION_PROBE_BYTES: usize = 4 << 20;

/// What [`Engine::calibrate_context_store`] measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DelayCalibration {
    pub prefill_tokens: usize,
    pub prefill_tokens_per_s: f64,
    pub tiers: Vec<pk_evicpress::TierCalibration>,
}

impl Engine {
    /// Measures the EVICPRESS store's delay model on this machine (spec "Profiling": the
    /// utility weighs load delay against quality, so its delays must be this machine's):
    /// times a prefill of `CALIBRATION_PREFILL_TOKENS` tokens of this model and probes
    /// each tier. `Ok(None)` without a store. Runs before serving (no requests in flight);
    /// serving then keeps the figures current from every prefill and load.
    pub fn calibrate_context_store(&mut self) -> anyhow::Result<Option<DelayCalibration>> {
        let Some(store) = self.context_store() else {
            return Ok(None);
        };
        let cfg = self.model_config();
        let n = CALIBRATION_PREFILL_TOKENS.min(cfg.context_length - 1);
        // Any ids do: prefill costs the same whatever the tokens say.
        let vocab = cfg.vocab_size as u64;
        let tokens: Vec<u32> = (0..n as u64)
            .map(|i| ((i * 7919 + 11) % vocab) as u32)
            .collect();
        // A short run first, so that the timed one does not pay for weights paged in.
        self.score(&tokens[..16.min(n)], 16.min(n) - 1)?;
        let t0 = std::time::Instant::now();
        self.score(&tokens, n - 1)?;
        let prefill_tokens_per_s = n as f64 / t0.elapsed().as_secs_f64();
        store.set_calibrated_prefill(prefill_tokens_per_s);
        let tiers = store
            .calibrate_tiers(CALIBRATION_PROBE_BYTES)
            .map_err(anyhow::Error::msg)?;
        Ok(Some(DelayCalibration {
            prefill_tokens: n,
            prefill_tokens_per_s,
            tiers,
        }))
    }
}

impl Engine {
    fn context_reuse(&self) -> Option<&ContextReuse> {
        self.reuse_connector()?
            .as_any()
            .downcast_ref::<ContextReuse>()
    }

    /// The EVICPRESS store, if the engine reuses contexts through one.
    pub fn context_store(&self) -> Option<Arc<ContextStore>> {
        self.context_reuse().map(|c| c.store.clone())
    }

    /// How profiling scores configurations (the default when no store is configured).
    pub fn profile_metric(&self) -> crate::profiler::QualityMetric {
        self.context_reuse()
            .map_or_else(Default::default, |c| c.profile_metric)
    }

    /// The store key of the context made of exactly `tokens` (a multiple of the chunk
    /// size), as a request with `salt` would compute it at admission.
    pub fn context_key(&self, tokens: &[u32], salt: Option<&str>) -> Option<ChunkKey> {
        let c = self.context_reuse()?;
        if tokens.is_empty() || !tokens.len().is_multiple_of(c.chunk_size_tokens()) {
            return None;
        }
        let mut with_query = tokens.to_vec();
        with_query.push(0);
        c.keys(&with_query, salt).last().copied()
    }

    pub fn context_stats(&self) -> Option<ContextReuseStats> {
        self.context_reuse().map(|c| c.stats.clone())
    }
}
