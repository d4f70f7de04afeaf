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

use std::collections::HashMap;
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

use pk_codec::{KvContext, Method};
use pk_engine::{block_ids as table_of, CacheNamespace, KvConnector, Loaded, Lookup, RequestKey};
use pk_kv::{KvCacheManager, SeqId};
use pk_model::{Backend, KvBlocks};
use pk_tiers::{ChunkKey, ChunkKeyer, Payload, TieredStore};

/// How the engine uses tiers.
#[derive(Clone)]
pub struct TieringConfig {
    pub store: Arc<TieredStore>,
    /// Tokens per stored chunk; a multiple of the block size.
    pub chunk_size_tokens: usize,
    /// Bound on encoded chunks waiting for the writer thread, in bytes.
    pub max_pending_bytes: usize,
}

impl std::fmt::Debug for TieringConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TieringConfig")
            .field("chunk_size_tokens", &self.chunk_size_tokens)
            .field("max_pending_bytes", &self.max_pending_bytes)
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
    pub load_failures: u64,
}

/// What the connector keeps of a request between its lookup and its end.
#[derive(Debug, Default)]
struct RequestChunks {
    /// Chained keys of the prompt's whole chunks, leaving at least one token to compute.
    keys: Vec<ChunkKey>,
    /// Chunks of `keys` the tiers hold, or that are queued for them.
    saved: usize,
}

/// The chunk tiers as a [`KvConnector`].
pub struct Tiering {
    store: Arc<TieredStore>,
    keyer: ChunkKeyer,
    fingerprint: [u8; 32],
    /// `None` only while dropping (closing the channel ends the writer thread).
    tx: Option<SyncSender<(ChunkKey, Payload)>>,
    writer: Option<std::thread::JoinHandle<()>>,
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
    /// The tiers `cfg` describes, keyed under `namespace` for `model_name`'s KV in blocks of
    /// `block_size_tokens` (`bytes_per_token` sizes the writer's queue).
    pub fn new(
        cfg: &TieringConfig,
        model_name: &str,
        namespace: &CacheNamespace,
        block_size_tokens: usize,
        bytes_per_token: usize,
    ) -> anyhow::Result<Tiering> {
        let keyer = ChunkKeyer::new(
            model_name,
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
        for loaded in self.store.load_prefix(keys) {
            let ctx = match pk_codec::decode(&loaded.payload, &self.fingerprint) {
                Ok(c)
                    if c.positions.len() == chunk
                        && c.n_layers == g.n_layers
                        && c.n_kv_heads == g.n_kv_heads
                        && c.head_dim == g.head_dim =>
                {
                    c
                }
                _ => {
                    lock(&self.stats).load_failures += 1;
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
        let mut next = first_chunk;
        while next < keys.len() && (next + 1) * chunk <= computed_tokens {
            let n = g.n_layers * g.n_kv_heads * chunk * g.head_dim;
            let (mut k, mut v) = (vec![0f32; n], vec![0f32; n]);
            if let Err(e) = store.read_tokens(&table, next * chunk, &mut k, &mut v) {
                // The pool is unusable from here on (the next forward pass fails): store
                // nothing of it.
                tracing::warn!("reading a KV chunk out of the pool failed: {e}");
                return keys.len();
            }
            let positions = ((next * chunk) as u32..((next + 1) * chunk) as u32).collect();
            let encoded = KvContext::new(g.n_layers, g.n_kv_heads, g.head_dim, positions, k, v)
                .and_then(|ctx| pk_codec::encode(&ctx, &Method::None, None, &self.fingerprint));
            match encoded {
                Ok(bytes) => match self
                    .tx
                    .as_ref()
                    .expect("open until drop")
                    .try_send((keys[next], Payload::from(bytes)))
                {
                    Ok(()) => lock(&self.stats).chunks_queued += 1,
                    Err(TrySendError::Full(_)) => lock(&self.stats).chunks_skipped_queue_full += 1,
                    Err(TrySendError::Disconnected(_)) => return keys.len(),
                },
                Err(e) => tracing::warn!("encoding a KV chunk failed: {e}"),
            }
            next += 1;
        }
        next
    }
}

impl KvConnector for Tiering {
    fn lookup(&self, request: RequestKey, ids: &[u32], salt: Option<&str>) -> Lookup {
        lock(&self.stats).lookups += 1;
        let usable = ids.len().saturating_sub(1);
        let keys = self.keyer.keys(&ids[..usable], salt.map(str::as_bytes));
        let found = self.store.lookup_prefix(&keys).chunks_found;
        let answer = Lookup {
            loadable_tokens: found * self.chunk_size_tokens(),
            wants_save: found < keys.len(),
        };
        let chunks = RequestChunks { keys, saved: found };
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
        let loaded = self.load_into(&keys[..found], kv, backend.kv_mut(), seq);
        // Chunks after a failed load are stored again once recomputed: that overwrites a
        // corrupted entry.
        let saved = loaded / chunk;
        if let Some(r) = lock(&self.requests).get_mut(&request) {
            r.saved = saved;
        }
        (loaded > 0).then_some(Loaded {
            tokens: loaded,
            exact: true,
            wants_save: saved < keys.len(),
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
        let Some(chunks) = lock(&self.requests).remove(&request) else {
            return false;
        };
        let saved = self.store_chunks(&chunks.keys, chunks.saved, computed, kv, backend.kv(), seq);
        let wants_more = saved < chunks.keys.len();
        let chunks = RequestChunks { saved, ..chunks };
        lock(&self.requests).insert(request, chunks);
        wants_more
    }

    fn request_finished(&self, request: RequestKey) {
        lock(&self.requests).remove(&request);
    }
}

/// A mutex's data even when a thread panicked holding it: the counters and keys behind it
/// stay meaningful (each update is one assignment).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
