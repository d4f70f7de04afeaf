//! Reuse of stored KV across requests, restarts and servers through the tiers of `pk-tiers`
//! (RAM → disk → Redis), in the serialisation of `pk-codec`.
//!
//! A prompt's KV is stored in chunks (default 256 tokens, whole blocks), each keyed by a
//! chained hash of its tokens, the model and KV configuration, and the request's cache
//! salt, so keys agree across processes and machines. On admission the engine looks up
//! the longest contiguous run of stored chunks, loads and decodes them into fresh blocks,
//! and prefills only the rest. After a prompt is prefilled, its new full chunks are
//! encoded on the engine thread (a memory copy and a conversion) and handed to a writer
//! thread over a bounded channel; the engine never waits on a tier for stores, and when
//! the channel is full a chunk is simply not stored (counted).
//!
//! An engine with KV cache groups (sliding-window layers in tables of their own) keeps
//! them: its chunks are stored by group, the window layers only where a hit needs them
//! (`groups`).

pub(crate) mod groups;

use std::collections::HashMap;
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

use pk_codec::{CodecError, KvContext, Method};
use pk_engine::{block_ids as table_of, CacheNamespace, KvConnector, Loaded, Lookup, RequestKey};
use pk_kv::{KvCacheManager, SeqId};
use pk_model::{Backend, KvBlocks, KvGroupLayout};
use pk_tiers::{ChunkKey, ChunkKeyer, Payload, TieredStore};

use groups::{Failed, GroupedChunks};

/// Default interval of the window checkpoints of an engine with KV cache groups, in
/// tokens: the shortest that keeps an 8K Gemma-3-270M prompt's stored bytes under 40 % of
/// one table's (37.1 %; 1,024 stores 58 %), while a prompt sharing 6,000 of its tokens
/// still hits 4,096 (BENCHMARKS.md, "KV cache groups in the tiers",
/// `scripts/window_checkpoints.sh`).
pub const DEFAULT_WINDOW_CHECKPOINT_TOKENS: usize = 2048;

/// How the engine uses tiers.
#[derive(Clone)]
pub struct TieringConfig {
    pub store: Arc<TieredStore>,
    /// Tokens per stored chunk; a multiple of the block size.
    pub chunk_size_tokens: usize,
    /// Bound on encoded chunks waiting for the writer thread, in bytes.
    pub max_pending_bytes: usize,
    /// With KV cache groups: the sliding-window layers are also stored at every multiple of
    /// this many tokens inside a prompt (besides its end), so that a prompt sharing only a
    /// prefix hits there. A multiple of the chunk size; `None`:
    /// [`DEFAULT_WINDOW_CHECKPOINT_TOKENS`]. Refused for an engine without groups, which
    /// stores every layer of every chunk.
    pub window_checkpoint_tokens: Option<usize>,
}

impl std::fmt::Debug for TieringConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TieringConfig")
            .field("chunk_size_tokens", &self.chunk_size_tokens)
            .field("max_pending_bytes", &self.max_pending_bytes)
            .field("window_checkpoint_tokens", &self.window_checkpoint_tokens)
            .finish()
    }
}

#[derive(Debug, Default, Clone)]
pub struct TieringStats {
    /// Prefix lookups asked of the tiers (one per waiting request, and one more after each
    /// preemption).
    pub lookups: u64,
    pub chunks_loaded: u64,
    pub chunks_queued: u64,
    pub chunks_skipped_queue_full: u64,
    /// Chunks not stored because no tier holds the prompt's prefix up to them: stored, they
    /// would evict their own prefix's head, and a tail without its head never hits.
    pub chunks_skipped_past_capacity: u64,
    pub load_failures: u64,
    /// Bytes of encoded payloads queued, by layer kind: full-attention layers (every layer
    /// without KV cache groups) and sliding-window layers.
    pub full_attention_bytes_queued: u64,
    pub window_bytes_queued: u64,
    /// Window payloads (one chunk's sliding-window layers) queued and loaded.
    pub window_chunks_queued: u64,
    pub window_chunks_loaded: u64,
    /// Window chunks a checkpoint needed whose blocks the pool had already released (a
    /// prefix adopted from the pool's own cache): that checkpoint is not stored.
    pub window_chunks_unavailable: u64,
    /// Lookups whose hit was cut short because window KV was missing.
    pub hits_shortened_by_window: u64,
}

/// What became of a payload handed to the writer thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Queued {
    Yes,
    /// Not stored (the queue was full, or encoding failed); counted.
    Skipped,
    /// The writer is gone: nothing more can be stored.
    Closed,
}

/// What the connector keeps of a request between its lookup and its end.
#[derive(Debug, Default)]
struct RequestChunks {
    /// Chained keys of the prompt's whole chunks, leaving at least one token to compute.
    keys: Vec<ChunkKey>,
    /// Chunks of `keys` the tiers hold, or that are queued for them (their full-attention
    /// layers, with KV cache groups).
    saved: usize,
    /// With KV cache groups: per chunk of `keys`, whether its window layers are stored or
    /// queued; and how many of the prompt's hit points (`GroupedChunks::hit_points`) are
    /// dealt with.
    window_present: Vec<bool>,
    hits_done: usize,
}

/// The chunk tiers as a [`KvConnector`].
pub struct Tiering {
    store: Arc<TieredStore>,
    keyer: ChunkKeyer,
    fingerprint: [u8; 32],
    /// `None` only while dropping (closing the channel ends the writer thread).
    tx: Option<SyncSender<(ChunkKey, Payload)>>,
    writer: Option<std::thread::JoinHandle<()>>,
    /// The stored layout by KV cache group (`None`: one table, every layer in one payload).
    groups: Option<GroupedChunks>,
    stats: Mutex<TieringStats>,
    /// Per request in flight (bounded by the engine's waiting and running requests).
    requests: Mutex<HashMap<RequestKey, RequestChunks>>,
}

impl std::fmt::Debug for Tiering {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tiering")
            .field("chunk_size_tokens", &self.chunk_size_tokens())
            .finish_non_exhaustive()
    }
}

impl Drop for Tiering {
    /// Waits for queued chunks to reach the tiers, so that a short-lived process (one
    /// `generate`) still leaves its KV on disk for the next one.
    fn drop(&mut self) {
        self.tx.take();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

impl Tiering {
    /// The tiers `cfg` describes, keyed under `namespace` (the model's KV) in blocks of
    /// `block_size_tokens` (`bytes_per_token` sizes the writer's queue), for an engine with
    /// the KV cache groups `groups` (`None`: one table). The namespace of an engine with
    /// groups names their layout (`CacheNamespace::with_kv_groups`).
    pub fn new(
        cfg: &TieringConfig,
        namespace: &CacheNamespace,
        block_size_tokens: usize,
        bytes_per_token: usize,
        groups: Option<&KvGroupLayout>,
    ) -> anyhow::Result<Tiering> {
        if groups.is_none() && cfg.window_checkpoint_tokens.is_some() {
            anyhow::bail!("--tier-window-checkpoint-tokens applies to an engine with KV cache groups (a model with sliding-window layers, without --disable-hybrid-kv-cache-manager); this one stores every layer of every chunk");
        }
        let checkpoint_tokens = cfg
            .window_checkpoint_tokens
            .unwrap_or(DEFAULT_WINDOW_CHECKPOINT_TOKENS);
        let groups = groups
            .map(|g| {
                GroupedChunks::new(g, cfg.chunk_size_tokens, checkpoint_tokens)
                    .map_err(anyhow::Error::msg)
            })
            .transpose()?;
        let keyer = ChunkKeyer::new(
            crate::KEY_MODEL_ID,
            namespace.as_bytes(),
            cfg.chunk_size_tokens,
            block_size_tokens,
        )
        .map_err(anyhow::Error::msg)?;
        let chunk_bytes = cfg.chunk_size_tokens * bytes_per_token;
        let capacity = (cfg.max_pending_bytes / chunk_bytes.max(1)).max(1);
        let (tx, rx) = sync_channel::<(ChunkKey, Payload)>(capacity);
        let store = cfg.store.clone();
        let writer = std::thread::Builder::new()
            .name("tier-writer".into())
            .spawn(move || {
                while let Ok((key, payload)) = rx.recv() {
                    let report = store.store(&key, &payload);
                    if report.errors > 0 {
                        tracing::debug!("storing chunk {key:?}: {} tier errors", report.errors);
                    }
                }
            })
            .map_err(|e| anyhow::anyhow!("starting the tier writer thread: {e}"))?;
        Ok(Tiering {
            store: cfg.store.clone(),
            keyer,
            fingerprint: namespace.kv_fingerprint(),
            tx: Some(tx),
            writer: Some(writer),
            groups,
            stats: Mutex::default(),
            requests: Mutex::default(),
        })
    }

    pub fn chunk_size_tokens(&self) -> usize {
        self.keyer.chunk_size_tokens()
    }

    /// What the tiers did for the engine so far.
    pub fn stats(&self) -> TieringStats {
        lock(&self.stats).clone()
    }

    /// Loads up to `keys.len()` chunks into `seq` (which must be empty), returning the
    /// number of tokens now in the cache. Stops at the first chunk that cannot be loaded,
    /// decoded or placed; a corrupted payload is never used.
    fn load_into(
        &self,
        keys: &[ChunkKey],
        kv: &mut KvCacheManager,
        store: &mut dyn KvBlocks,
        seq: SeqId,
    ) -> usize {
        let chunk = self.chunk_size_tokens();
        let g = store.geometry();
        let mut loaded_tokens = 0;
        for (key, loaded) in keys.iter().zip(self.store.load_prefix(keys)) {
            let decoded = pk_codec::decode(&loaded.payload, &self.fingerprint);
            let ctx = match decoded {
                Ok(c)
                    if c.positions.len() == chunk
                        && c.n_layers == g.n_layers
                        && c.n_kv_heads == g.n_kv_heads
                        && c.head_dim == g.head_dim =>
                {
                    c
                }
                other => {
                    self.discard_corrupt(key, other.err());
                    break;
                }
            };
            if kv.allocate_slots(seq, chunk as u32).is_none() {
                break;
            }
            let table = table_of(kv, seq);
            store.write_tokens(&table, loaded_tokens, &ctx.k, &ctx.v);
            loaded_tokens += chunk;
            lock(&self.stats).chunks_loaded += 1;
            metrics::counter!("pagekeeper:tier_chunks_loaded_total", "layers" => "all")
                .increment(1);
        }
        loaded_tokens
    }

    /// Encodes chunks `first_chunk..` of `seq` that are fully computed (up to
    /// `computed_tokens`) and queues them for storing. Returns the next chunk to store.
    fn store_chunks(
        &self,
        keys: &[ChunkKey],
        first_chunk: usize,
        computed_tokens: usize,
        kv: &KvCacheManager,
        store: &dyn KvBlocks,
        seq: SeqId,
    ) -> usize {
        let chunk = self.chunk_size_tokens();
        let g = store.geometry();
        let table = table_of(kv, seq);
        let storable =
            self.prefix_chunks_that_fit(chunk * g.n_layers * g.n_kv_heads * g.head_dim * 4);
        let mut next = first_chunk;
        while next < keys.len().min(storable) && (next + 1) * chunk <= computed_tokens {
            let n = g.n_layers * g.n_kv_heads * chunk * g.head_dim;
            let (mut k, mut v) = (vec![0f32; n], vec![0f32; n]);
            if let Err(e) = store.read_tokens(&table, next * chunk, &mut k, &mut v) {
                // The pool is unusable from here on (the next forward pass fails): store
                // nothing of it.
                tracing::warn!("reading a KV chunk out of the pool failed: {e}");
                return keys.len();
            }
            let positions = ((next * chunk) as u32..((next + 1) * chunk) as u32).collect();
            let ctx = KvContext::new(g.n_layers, g.n_kv_heads, g.head_dim, positions, k, v);
            if self.queue(keys[next], ctx, "all") == Queued::Closed {
                return keys.len();
            }
            next += 1;
        }
        if next >= storable && storable < keys.len() {
            // Once per request: the rest is never stored, and nothing more is asked for.
            self.skip_past_capacity(keys.len() - next);
            return keys.len();
        }
        next
    }

    /// How many leading chunks of a prompt the largest tier can hold at once, for payloads
    /// of `payload_bytes` (a chunk in f16, the codec's `none`).
    fn prefix_chunks_that_fit(&self, payload_bytes: usize) -> usize {
        let largest = self
            .store
            .tiers()
            .map(|t| t.capacity_bytes())
            .max()
            .unwrap_or(0);
        usize::try_from(largest / payload_bytes.max(1) as u64).unwrap_or(usize::MAX)
    }

    /// Counts chunks left unstored past the tiers' capacity and warns once per process.
    fn skip_past_capacity(&self, chunks: usize) {
        static WARNED: std::sync::Once = std::sync::Once::new();
        lock(&self.stats).chunks_skipped_past_capacity += chunks as u64;
        WARNED.call_once(|| {
            tracing::warn!("a prompt's KV exceeds every tier's capacity: only its leading chunks that fit are stored (a chunk past them would evict its own prefix)");
        });
    }

    /// Encodes one chunk's payload (every layer, the full-attention layers or the window
    /// layers) and queues it for the writer thread, counting its bytes by layer kind.
    /// Returns false once the writer is gone (nothing more can be stored).
    /// `layers` labels the payload's layers in the metrics: `all` (one table), `full`
    /// (the full-attention layers) or `window` (the sliding-window layers).
    fn queue(
        &self,
        key: ChunkKey,
        ctx: Result<KvContext, CodecError>,
        layers: &'static str,
    ) -> Queued {
        let encoded =
            ctx.and_then(|ctx| pk_codec::encode(&ctx, &Method::None, None, &self.fingerprint));
        let bytes = match encoded {
            Ok(bytes) => bytes,
            Err(e) => {
                tracing::warn!("encoding a KV chunk failed: {e}");
                return Queued::Skipped;
            }
        };
        let n_bytes = bytes.len() as u64;
        let tx = self.tx.as_ref().expect("open until drop");
        let mut stats = lock(&self.stats);
        match tx.try_send((key, Payload::from(bytes))) {
            Ok(()) => {
                if layers == "window" {
                    stats.window_chunks_queued += 1;
                    stats.window_bytes_queued += n_bytes;
                } else {
                    stats.chunks_queued += 1;
                    stats.full_attention_bytes_queued += n_bytes;
                }
                metrics::counter!("pagekeeper:tier_bytes_queued_total", "layers" => layers)
                    .increment(n_bytes);
            }
            Err(TrySendError::Full(_)) => {
                stats.chunks_skipped_queue_full += 1;
                return Queued::Skipped;
            }
            Err(TrySendError::Disconnected(_)) => return Queued::Closed,
        }
        Queued::Yes
    }
}

impl KvConnector for Tiering {
    fn lookup(&self, request: RequestKey, ids: &[u32], salt: Option<&str>) -> Lookup {
        lock(&self.stats).lookups += 1;
        let usable = ids.len().saturating_sub(1);
        let keys = self.keyer.keys(&ids[..usable], salt.map(str::as_bytes));
        let found = self.store.lookup_prefix(&keys).chunks_found;
        let mut chunks = RequestChunks {
            keys,
            saved: found,
            ..Default::default()
        };
        let hit = match &self.groups {
            None => found,
            Some(g) => self.grouped_lookup(g, &mut chunks, found),
        };
        // A hit asks for the prompt's KV too: a load that finds a chunk corrupt deletes it
        // and leaves the engine to compute the prompt, whose KV stores it again. A load that
        // succeeds answers for itself.
        let answer = Lookup {
            loadable_tokens: hit * self.chunk_size_tokens(),
            wants_save: self.wants_more(&chunks) || hit > 0,
        };
        lock(&self.requests).insert(request, chunks);
        answer
    }

    fn load(
        &self,
        request: RequestKey,
        tokens: usize,
        _query: &[u32],
        kv: &mut KvCacheManager,
        backend: &mut dyn Backend,
        seq: SeqId,
    ) -> Option<Loaded> {
        let chunk = self.chunk_size_tokens();
        let keys = lock(&self.requests).get(&request)?.keys.clone();
        let found = (tokens / chunk).min(keys.len());
        let loaded = match &self.groups {
            None => self.load_into(&keys[..found], kv, backend.kv_mut(), seq),
            Some(g) => match self.load_grouped(g, &keys, found, kv, backend.kv_mut(), seq) {
                Ok(tokens) => tokens,
                Err(failed) => {
                    // Stored again once recomputed, which overwrites a corrupted entry;
                    // only the payload that failed is.
                    if let Some(r) = lock(&self.requests).get_mut(&request) {
                        match failed {
                            Failed::Window(j) => r.window_present[j] = false,
                            Failed::Full(j) => r.saved = r.saved.min(j),
                        }
                    }
                    0
                }
            },
        };
        let mut requests = lock(&self.requests);
        let r = requests.get_mut(&request)?;
        if self.groups.is_none() {
            // Chunks after a failed load are stored again once recomputed: that overwrites
            // a corrupted entry.
            r.saved = loaded / chunk;
        }
        let wants_save = self.wants_more(r);
        (loaded > 0).then_some(Loaded {
            tokens: loaded,
            exact: crate::reload_is_exact(backend.kv()),
            wants_save,
            origin: None,
        })
    }

    fn save(
        &self,
        request: RequestKey,
        _ids: &[u32],
        computed: usize,
        kv: &KvCacheManager,
        backend: &mut dyn Backend,
        seq: SeqId,
    ) -> bool {
        let Some(mut chunks) = lock(&self.requests).remove(&request) else {
            return false;
        };
        match &self.groups {
            None => {
                chunks.saved =
                    self.store_chunks(&chunks.keys, chunks.saved, computed, kv, backend.kv(), seq);
            }
            Some(g) => self.save_grouped(g, &mut chunks, computed, kv, backend.kv(), seq),
        }
        let wants_more = self.wants_more(&chunks);
        lock(&self.requests).insert(request, chunks);
        wants_more
    }

    fn saves_during_prefill(&self) -> bool {
        // Whole chunks go to the tiers as soon as they are computed; with KV cache groups
        // this is also what lets a checkpoint's window be copied before the pool releases
        // it.
        true
    }

    fn supports_kv_groups(&self) -> bool {
        self.groups.is_some()
    }

    fn requires_kv_groups(&self) -> bool {
        self.groups.is_some()
    }

    fn request_finished(&self, request: RequestKey) {
        lock(&self.requests).remove(&request);
    }
}

impl Tiering {
    /// Deletes a payload a tier served that fails the codec's checks (`why`) or has the
    /// wrong shape (`None`) from every tier, counted and logged: kept, it would fail every
    /// later load of its prefix, since storing the recomputed chunk under its key would only
    /// refresh it.
    pub(crate) fn discard_corrupt(&self, key: &ChunkKey, why: Option<CodecError>) {
        lock(&self.stats).load_failures += 1;
        let held = self.store.discard(key);
        let why = why.map_or_else(
            || "the wrong shape for this pool".to_owned(),
            |e| e.to_string(),
        );
        tracing::warn!("a stored KV chunk is unusable ({why}); deleted from {held} tier(s), it is stored again once recomputed");
    }

    /// Whether a request still has something to store: a whole chunk, or (with KV cache
    /// groups) a hit point's window layers.
    fn wants_more(&self, r: &RequestChunks) -> bool {
        let n = r.keys.len();
        r.saved < n
            || self
                .groups
                .as_ref()
                .is_some_and(|g| r.hits_done < g.hit_points(n).len())
    }
}

/// A mutex's data even when a thread panicked holding it: the counters and keys behind it
/// stay meaningful (each update is one assignment).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
