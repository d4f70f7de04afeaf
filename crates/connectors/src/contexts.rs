//! Whole-context KV reuse through an EVICPRESS `ContextStore` (spec `evicpress.md`): the
//! second store [`KvConnector`].
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
//! With KV cache groups (Gemma 3's sliding-window layers in tables of their own), a
//! context is stored by group (`KvContext::window`): every full-attention layer of every
//! token, under the configuration EVICPRESS chose, and the sliding-window layers' tail
//! window only, quantized as the configuration says but never dropped. The pool releases
//! window blocks as prefill moves on, so the context is copied out after the prefill step
//! that computes its last token, while that window is held; a hit writes the window back
//! and the full-attention layers at their original positions
//! (`KvCacheManager::allocate_placed`).
//!
//! SnapKV scores a stored context by the attention of its last 64 tokens' queries, which
//! the pool does not keep. When the store's grid has a SnapKV configuration, the offer runs
//! those tokens through the forward pass once more to capture their queries
//! ([`window_queries`]); on the CPU that rewrites their K/V with the same bits (its forward
//! pass is batch-invariant; a GPU's GEMMs may round the last bits differently for another
//! batch shape, which moves those 64 tokens' K/V by at most that rounding), and the store's
//! worker turns the queries into scores.
//!
//! KVzip (`kvzip-R`) scores a stored context by the model's reconstruction passes over it.
//! By default the engine runs them when the context is stored (`kvzip_scores_wanted`); a
//! server asks for idle time instead (`score_kvzip_in_idle_time`): the context is offered
//! with its token ids, and `crate::kvzip_scoring` scores it later from its master.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pk_codec::KvContext;
use pk_engine::{
    block_ids as table_of, CacheNamespace, KvConnector, LoadOrigin, Loaded, Lookup, RequestKey,
};
use pk_evicpress::{ContextStore, LoadReport, StoreConfig, WindowQueries};
use pk_kv::{KvCacheManager, SeqId};
use pk_model::{Backend, KvGroupLayout, SeqForward};
use pk_tiers::{ChunkKey, ChunkKeyer};

use crate::prefix_kv::{place_context, read_by_group, read_prefix};
use crate::tiering::lock;

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
    /// Contexts not offered because their window had left the pool (KV cache groups: a
    /// prompt whose first prefill step already ran past the context's window, as after a
    /// prefix-cache hit beyond it).
    pub window_gone: u64,
}

/// The EVICPRESS context store as a [`KvConnector`].
pub struct ContextReuse {
    store: Arc<ContextStore>,
    keyer: ChunkKeyer,
    stats: Mutex<ContextReuseStats>,
    profile_metric: crate::profiler::QualityMetric,
    /// Each request's chunk keys, from its lookup to its end (bounded by the engine's
    /// waiting and running requests).
    requests: Mutex<HashMap<RequestKey, Vec<ChunkKey>>>,
    /// The engine's KV cache groups, when it keeps them: contexts are then stored by group.
    groups: Option<KvGroupLayout>,
    /// KVzip scores the engine computed for a request's coming save (one entry per
    /// running request at most, taken by its save or dropped when it ends).
    kvzip_scores: Mutex<HashMap<RequestKey, Vec<f32>>>,
    /// Whether KVzip scores are computed in idle time ([`crate::kvzip_scoring`]) instead
    /// of when a context is stored: a server's choice, so that the passes never stall
    /// the streams batched with the request that stored the context.
    kvzip_in_idle_time: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for ContextReuse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContextReuse")
            .field("chunk_size_tokens", &self.chunk_size_tokens())
            .field("profile_metric", &self.profile_metric)
            .finish_non_exhaustive()
    }
}

impl ContextReuse {
    pub fn new(
        cfg: &ContextReuseConfig,
        namespace: &CacheNamespace,
        block_size_tokens: usize,
        groups: Option<&KvGroupLayout>,
    ) -> anyhow::Result<ContextReuse> {
        let keyer = ChunkKeyer::new(
            crate::KEY_MODEL_ID,
            namespace.as_bytes(),
            cfg.chunk_size_tokens,
            block_size_tokens,
        )
        .map_err(anyhow::Error::msg)?;
        let mut store_cfg = cfg.store.clone();
        store_cfg.fingerprint = namespace.kv_fingerprint();
        let supplied = store_cfg.grid.configs().iter().find(|c| {
            c.drop_score()
                .is_some_and(pk_evicpress::DropScore::is_supplied)
        });
        if let (Some(c), Some(_)) = (supplied, groups) {
            anyhow::bail!("--evicpress-grid configuration {c} scores a context by a second pass over it (SnapKV's window queries, KVzip's reconstruction), which an engine with KV cache groups does not run (its window layers have released what a second pass would read); leave it out for this model, or turn the groups off with --disable-hybrid-kv-cache-manager");
        }
        Ok(ContextReuse {
            store: ContextStore::new(store_cfg).map_err(anyhow::Error::msg)?,
            keyer,
            stats: Mutex::default(),
            profile_metric: cfg.profile_metric,
            requests: Mutex::default(),
            groups: groups.cloned(),
            kvzip_scores: Mutex::default(),
            kvzip_in_idle_time: Default::default(),
        })
    }

    pub fn chunk_size_tokens(&self) -> usize {
        self.keyer.chunk_size_tokens()
    }

    /// From now on, contexts are offered with their token ids instead of KVzip scores, and
    /// their scores are computed in idle time (`kvzip_scoring::maybe_start_kvzip_scoring`).
    pub fn score_kvzip_in_idle_time(&self) {
        self.kvzip_in_idle_time
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    fn kvzip_in_idle_time(&self) -> bool {
        self.kvzip_in_idle_time
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Chained keys of the prompt's full chunks, leaving at least one token to compute.
    pub fn keys(&self, tokens: &[u32], salt: Option<&str>) -> Vec<ChunkKey> {
        let usable = tokens.len().saturating_sub(1);
        self.keyer.keys(&tokens[..usable], salt.map(str::as_bytes))
    }

    fn load_context(&self, key: &ChunkKey, query: &[u32]) -> Option<(KvContext, LoadReport)> {
        match self.store.load(key, Some(query)) {
            Ok(r) => {
                let mut stats = lock(&self.stats);
                stats.hits += 1;
                stats.hit_tokens += r.0.n_original_tokens as u64;
                Some(r)
            }
            Err(e) => {
                tracing::warn!("loading a stored context failed, recomputing: {e}");
                lock(&self.stats).load_failures += 1;
                None
            }
        }
    }

    /// Hands a loaded context's buffers back to the store for the next load.
    pub fn recycle(&self, kv: KvContext) {
        self.store.recycle(kv);
    }

    /// Offers a prefilled context to the store, with the queries of its last tokens when
    /// the store scores by SnapKV and the KVzip scores the engine computed when it scores
    /// by KVzip.
    fn offer(
        &self,
        key: ChunkKey,
        kv: KvContext,
        window: Option<WindowQueries>,
        kvzip: Option<Vec<f32>>,
        ids: &[u32],
    ) {
        let pending = (self.kvzip_in_idle_time() && kvzip.is_none()).then(|| ids.to_vec());
        let offered = self.store.offer_scored(key, kv, window, kvzip, pending);
        if offered {
            lock(&self.stats).offered += 1;
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
        head_first_keys: &[],
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

impl KvConnector for ContextReuse {
    /// The longest stored context among the prompt's chunk boundaries. A prompt with any
    /// stored context is not offered again (the store placed what it had); one with none is
    /// offered whole once computed.
    fn lookup(&self, request: RequestKey, ids: &[u32], salt: Option<&str>) -> Lookup {
        lock(&self.stats).lookups += 1;
        let keys = self.keys(ids, salt);
        let stored = self.store.longest_stored(&keys);
        if let (Some(i), true) = (stored, self.kvzip_in_idle_time()) {
            // A context adopted from the last tier has no token ids to be scored from.
            let n = (i + 1) * self.chunk_size_tokens();
            self.store.wait_for_kvzip_scores(&keys[i], &ids[..n]);
        }
        let answer = Lookup {
            loadable_tokens: stored.map_or(0, |i| (i + 1) * self.chunk_size_tokens()),
            wants_save: stored.is_none() && !keys.is_empty(),
        };
        lock(&self.requests).insert(request, keys);
        answer
    }

    fn load(
        &self,
        request: RequestKey,
        tokens: usize,
        query: &[u32],
        kv: &mut KvCacheManager,
        backend: &mut dyn Backend,
        seq: SeqId,
    ) -> Option<Loaded> {
        let index = (tokens / self.chunk_size_tokens()).checked_sub(1)?;
        let key = *lock(&self.requests).get(&request)?.get(index)?;
        let (ctx, mut report) = self.load_context(&key, query)?;
        let t0 = std::time::Instant::now();
        let written = ctx.n_original_tokens == tokens && place_context(&ctx, kv, backend, seq);
        report.restore_s = t0.elapsed().as_secs_f64();
        if written {
            self.store.observe_restore(ctx.n_tokens(), report.restore_s);
        }
        let loaded = written.then(|| Loaded {
            tokens,
            exact: ctx.n_tokens() == tokens
                && report.config.starts_with("none-")
                && crate::reload_is_exact(backend.kv()),
            wants_save: false,
            origin: Some(origin_of(report)),
        });
        self.recycle(ctx);
        loaded
    }

    fn save(
        &self,
        request: RequestKey,
        ids: &[u32],
        computed: usize,
        kv: &KvCacheManager,
        backend: &mut dyn Backend,
        seq: SeqId,
    ) -> bool {
        let Some((key, n_chunks)) = lock(&self.requests)
            .get(&request)
            .and_then(|k| Some((*k.last()?, k.len())))
        else {
            return false;
        };
        let tokens = n_chunks * self.chunk_size_tokens();
        let Some(layout) = &self.groups else {
            let Some(kv_copy) = read_prefix(kv, backend.kv(), seq, tokens) else {
                return false;
            };
            let window = match self.wants_window() {
                true => window_queries(backend, kv, seq, &ids[..tokens]),
                false => None,
            };
            let kvzip = lock(&self.kvzip_scores).remove(&request);
            self.offer(key, kv_copy, window, kvzip, &ids[..tokens]);
            return false;
        };
        // By group: called after every prefill step; the context is copied out after the
        // step that computed its last token, while the window that token's successor sees
        // is still held.
        if computed < tokens {
            return true;
        }
        match read_by_group(kv, backend.kv(), layout, seq, tokens) {
            Some(kv_copy) => self.offer(key, kv_copy, None, None, &[]),
            None => {
                tracing::debug!(
                    "a context's window left the pool before it was copied; not offered"
                );
                lock(&self.stats).window_gone += 1;
            }
        }
        false
    }

    fn saves_during_prefill(&self) -> bool {
        self.groups.is_some()
    }

    fn supports_kv_groups(&self) -> bool {
        true
    }

    fn requires_kv_groups(&self) -> bool {
        self.groups.is_some()
    }

    fn request_finished(&self, request: RequestKey) {
        lock(&self.requests).remove(&request);
        lock(&self.kvzip_scores).remove(&request);
    }

    /// The whole context the save offers, when the store drops by KVzip and the engine
    /// keeps one block table (with KV cache groups no grid may hold KVzip: `new`).
    fn kvzip_scores_wanted(&self, request: RequestKey) -> Option<usize> {
        if !self.store.wants_kvzip() || self.groups.is_some() || self.kvzip_in_idle_time() {
            return None;
        }
        let keys = lock(&self.requests).get(&request)?.clone();
        // A context recomputed after it was dropped comes back with the scores the store
        // remembers: the pass would only compute them again.
        let known = self.store.knows_kvzip_scores(keys.last()?);
        (!known).then(|| keys.len() * self.chunk_size_tokens())
    }

    fn give_kvzip_scores(&self, request: RequestKey, scores: Vec<f32>) {
        lock(&self.kvzip_scores).insert(request, scores);
    }

    fn observe_prefill(&self, tokens: usize, seconds: f64) {
        self.store.observe_prefill(tokens, seconds);
    }
}

/// The engine's record of where a context came from.
fn origin_of(r: LoadReport) -> LoadOrigin {
    LoadOrigin {
        tier: r.tier,
        tier_index: r.tier_index,
        config: r.config,
        bytes: r.bytes,
        fetch_s: r.fetch_s,
        decode_s: r.decode_s,
        fell_back_to_master: r.fell_back_to_master,
        restore_s: r.restore_s,
    }
}

impl ContextReuse {
    /// The EVICPRESS store (thread-safe; `/v1/kv/contexts` and profiling read it).
    pub fn store(&self) -> &Arc<ContextStore> {
        &self.store
    }

    /// How profiling scores configurations.
    pub fn profile_metric(&self) -> crate::profiler::QualityMetric {
        self.profile_metric
    }

    /// The store key of the context made of exactly `tokens` (a multiple of the chunk
    /// size), as a request with `salt` would compute it at admission.
    pub fn context_key(&self, tokens: &[u32], salt: Option<&str>) -> Option<ChunkKey> {
        if tokens.is_empty() || !tokens.len().is_multiple_of(self.chunk_size_tokens()) {
            return None;
        }
        let mut with_query = tokens.to_vec();
        with_query.push(0);
        self.keys(&with_query, salt).last().copied()
    }

    /// What the store did for the engine so far.
    pub fn stats(&self) -> ContextReuseStats {
        lock(&self.stats).clone()
    }
}
