//! [`ContextStore`]: stored contexts, their copies on the tiers, and the worker thread that
//! encodes, moves and deletes them.
//!
//! Every context has an uncompressed master copy on the last (slowest) tier, written
//! before the context becomes visible (spec: "the remote tier keeps everything"). A last
//! tier with a capacity drops whole contexts past it (`store/bounded.rs`), never a master
//! alone.
//! Its placed copy, (tier, configuration), is what a hit loads; when that copy is the
//! master itself nothing else is stored. Copies are keyed by `blake3(context key ‖
//! configuration)`, so every process and server computes the same keys.
//!
//! NOTE 1: the engine thread only reads the index and loads; inserting, placing, encoding
//! and moving run on one worker thread fed by a channel bounded in bytes. A move writes the
//! new copy, then updates the index, then deletes the old copy: a load that raced with it
//! finds either copy, or falls back to the master (counted), never a half-written one
//! (tiers write atomically and checksums catch the rest).
//! NOTE 2: logical usage per tier is the sum of the index's placed-copy sizes; the tier
//! objects must be built with some slack above the logical capacities (disk files carry
//! headers), so that they never evict on their own. If one does, the copy is simply gone
//! and the next load falls back to the master.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use pk_codec::{CodecError, KvContext};
use pk_tiers::{ChunkKey, Payload, Tier, TierError};
use serde::Serialize;

use crate::config::{DropScore, Grid};
use crate::meta::{meta_key, unix_now_s, ContextMeta, META_VERSION};
use crate::model::{DecayedCount, DelayModel, QualityCurve, QualityPrior, QualitySource};
use crate::placement::{Item, Placer, Policy};
use crate::scores::{snapkv_scores, token_scores, WindowQueries};

mod bounded;
mod ghosts;
mod measure;
mod persist;
mod single_copy;
mod worker;

pub use ghosts::{MAX_GHOSTS, MAX_GHOST_SCORE_BYTES};
pub use measure::{
    DelayProvenance, DelayReport, Provenance, TierCalibration, MIN_PREFILL_SAMPLE_TOKENS,
};

#[derive(Clone)]
pub struct StoreConfig {
    /// Fastest first; the last one keeps the master copies.
    pub tiers: Vec<Arc<dyn Tier>>,
    /// Bytes EVICPRESS may place on each tier. The last entry bounds the masters and what
    /// is placed beside them: past it, whole contexts are dropped (`store::bounded`);
    /// `u64::MAX` leaves the last tier unlimited.
    pub capacities_bytes: Vec<u64>,
    pub grid: Grid,
    pub policy: Policy,
    /// Identifies the model and KV layout (pk-codec refuses a payload of another model).
    pub fingerprint: [u8; 32],
    pub delay: DelayModel,
    pub frequency_half_life_s: f64,
    /// Re-profile a context when its served quality falls this far below its profile.
    pub reprofile_threshold: f32,
    /// Bound on KV handed to the worker and not yet stored, in bytes (f32 in memory).
    pub max_pending_bytes: u64,
    /// Recent queries kept per context for background profiling.
    pub max_queries_per_context: usize,
    /// Whether every context keeps an uncompressed master beside its placed copy.
    pub copies: Copies,
}

/// How many copies of a context the store keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Copies {
    /// An uncompressed master on the last tier, and the placed copy beside it (when it is
    /// not the master itself). A hit can always fall back to the master, a context can be
    /// re-encoded to any configuration at any time, and contexts survive restarts (they
    /// are adopted from the last tier). A capacity on the last tier drops whole contexts
    /// (`store::bounded`).
    #[default]
    MasterAndPlaced,
    /// Only the placed copy, as the EVICPRESS paper's store keeps: a context compressed is
    /// compressed for good (it cannot change configuration again, only move or be dropped),
    /// so compression lets more contexts fit when all tiers together hold less than the
    /// working set. Every tier's capacity is the placer's to enforce, the last one's
    /// included; a context demoted past the last tier is dropped, and its next request
    /// recomputes it. There is no master to fall back to (an unreadable copy is a miss)
    /// and nothing is adopted after a restart (`store::single_copy`).
    PlacedOnly,
}

/// Where a load came from, for metrics and the benchmark.
#[derive(Clone, Debug, Serialize)]
pub struct LoadReport {
    pub tier: String,
    pub tier_index: usize,
    pub config: String,
    pub bytes: u64,
    pub fetch_s: f64,
    pub decode_s: f64,
    /// The placed copy could not be read or decoded; the master was used.
    pub fell_back_to_master: bool,
    /// Seconds the engine spent writing the loaded KV into its pool (0 until it has).
    pub restore_s: f64,
}

/// One row of [`ContextStore::explain`]: a context, where it lives, and why.
#[derive(Clone, Debug, Serialize)]
pub struct ContextReport {
    pub key: String,
    pub n_tokens: usize,
    pub tier: String,
    pub config: String,
    pub bytes: u64,
    pub frequency: f64,
    pub quality_source: QualitySource,
    pub served_quality: Option<f64>,
    pub hits: u64,
    /// For a context stored with KV cache groups: how `bytes` divides between the
    /// full-attention layers (every kept token) and the sliding-window layers (the tail
    /// window). Absent for one block table.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_by_group: Option<BytesByGroup>,
    /// Utility of every (tier, configuration), best first (the placement's inputs).
    pub options: Vec<OptionReport>,
}

/// A stored copy's bytes by KV cache group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct BytesByGroup {
    pub full_attention: u64,
    pub sliding_window: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct OptionReport {
    pub tier: String,
    pub config: String,
    pub bytes: u64,
    pub quality: f32,
    pub ttft_s: f64,
    pub utility: f64,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct StoreStats {
    pub inserted: u64,
    /// Contexts found on the last tier (an earlier process, another server) and adopted.
    pub adopted: u64,
    /// Adopted contexts whose persisted profile and frequency were restored.
    pub meta_restored: u64,
    /// Meta entries written beside masters.
    pub meta_saved: u64,
    pub skipped_queue_full: u64,
    pub moves: u64,
    pub bytes_moved: u64,
    pub fallbacks_to_master: u64,
    /// Contexts dropped whole (master, copy, meta entry) to keep the last tier within its
    /// capacity.
    pub dropped: u64,
    /// Contexts forgotten because their only copy was unreadable (one copy per context).
    pub unreadable_dropped: u64,
    /// Contexts not stored because their master alone exceeds the last tier's capacity.
    pub skipped_too_large: u64,
    pub reprofiles_requested: u64,
    pub placement_decisions: u64,
    pub placement_cpu_s_total: f64,
    pub placement_cpu_s_max: f64,
}

struct Entry {
    n_tokens: usize,
    item: Item,
    quality: QualityCurve,
    freq: DecayedCount,
    served_quality: Option<f64>,
    hits: u64,
    /// Token scores per drop score (computed once, from the full KV).
    scores: HashMap<DropScore, Vec<f32>>,
    queries: Vec<Vec<u32>>,
    needs_profile: bool,
    /// Hits since the last profile: a profile made from a few early queries is refreshed
    /// with the queries actually served (`REFRESH_PROFILE_AFTER_HITS`).
    hits_since_profile: u64,
    /// Per configuration, the bytes of its sliding-window part (a context stored with KV
    /// cache groups); `None` for one block table.
    window_bytes: Option<Vec<u64>>,
    /// The context's token ids, kept while its KVzip scores are wanted and missing, for
    /// the engine to compute them in idle time ([`ContextStore::kvzip_candidates`]).
    pending_kvzip_ids: Option<Vec<u32>>,
    /// Failed scoring attempts (a pass that found no free block while requests ran).
    kvzip_failures: u32,
}

/// A context whose KVzip scoring failed this many times is not tried again.
pub const MAX_KVZIP_ATTEMPTS: u32 = 3;

/// A profiled context is profiled again, with its recent queries, after this many hits:
/// the server cannot measure served quality itself (it has no full-KV answer to compare
/// with), so besides drift reports from callers that can, profiles age out.
pub const REFRESH_PROFILE_AFTER_HITS: u64 = 64;

pub(crate) struct State {
    entries: HashMap<ChunkKey, Entry>,
    prior: QualityPrior,
    pub(crate) stats: StoreStats,
    delay: DelayModel,
    provenance: measure::DelayProvenance,
    /// Contexts no longer (or not yet) stored, remembered (`store::ghosts`).
    ghosts: ghosts::Ghosts,
}

/// What a context's SnapKV scores come from: given, or computed on the worker thread from
/// the queries of its last tokens (an attention pass over the context: 0.4 s for 1.5K tokens,
/// 0.9 s for 4K on one core (`examples/snapkv_bench.rs`), kept off the engine's thread).
pub(crate) enum SnapKvSource {
    Scores(Vec<f32>),
    Window(WindowQueries),
}

impl SnapKvSource {
    /// Bytes it holds while queued (counted against `max_pending_bytes`).
    fn bytes(source: &Option<SnapKvSource>) -> usize {
        match source {
            Some(SnapKvSource::Window(w)) => w.bytes(),
            Some(SnapKvSource::Scores(s)) => s.len() * 4,
            None => 0,
        }
    }
}

/// What the engine supplies with a new context: the sources of the scores that the stored
/// KV alone cannot give.
#[derive(Default)]
pub(crate) struct Supplied {
    pub snapkv: Option<SnapKvSource>,
    /// KVzip's token scores (one per stored token).
    pub kvzip: Option<Vec<f32>>,
    /// The context's token ids, when its KVzip scores are to be computed later.
    pub context_ids: Option<Vec<u32>>,
}

impl Supplied {
    /// Bytes it holds while queued (counted against `max_pending_bytes`).
    fn bytes(&self) -> usize {
        SnapKvSource::bytes(&self.snapkv)
            + self.kvzip.as_ref().map_or(0, |s| s.len() * 4)
            + self.context_ids.as_ref().map_or(0, |s| s.len() * 4)
    }
}

enum Job {
    /// A new context, with the scores (or their sources) the caller supplies.
    Insert(ChunkKey, Box<KvContext>, Supplied),
    Place(ChunkKey),
    /// Write the context's meta entry (profile, frequency) beside its master.
    SaveMeta(ChunkKey),
}

/// A context's meta entry is rewritten every this many hits (and on every profile), so a
/// restart loses at most this many accesses of its frequency.
const SAVE_META_EVERY_HITS: u64 = 16;

pub struct ContextStore {
    tiers: Vec<Arc<dyn Tier>>,
    /// The placer's capacities: the configured ones, with the last tier unlimited (the
    /// placer keeps its bounded model for the simulator; see `store::bounded`).
    capacities_bytes: Vec<u64>,
    /// The configured capacity of the last tier (`u64::MAX`: unlimited).
    last_capacity_bytes: u64,
    copies: Copies,
    grid: Grid,
    policy: Policy,
    fingerprint: [u8; 32],
    half_life_s: f64,
    reprofile_threshold: f32,
    max_queries: usize,
    max_pending_bytes: u64,
    pending_bytes: Arc<AtomicU64>,
    state: Arc<Mutex<State>>,
    /// Jobs queued or running, with a condvar for `flush`.
    in_flight: Arc<(Mutex<usize>, Condvar)>,
    tx: Mutex<Option<SyncSender<Job>>>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
    epoch: Instant,
    /// A decoded context handed back by the engine after it copied it into its pool: the
    /// next load decodes into its buffers instead of faulting in tens of fresh megabytes.
    spare: Mutex<Option<KvContext>>,
}

/// The largest decoded context kept for the next load to decode into (f32 K and V): a
/// 4K-token context of SmolLM2 is about 190 MB.
const MAX_SPARE_BYTES: usize = 256 << 20;

/// Bound on queued jobs regardless of size (placement jobs carry no KV).
const MAX_QUEUED_JOBS: usize = 1024;

pub fn copy_key(ctx: &ChunkKey, config: usize) -> ChunkKey {
    let mut h = blake3::Hasher::new();
    h.update(b"pagekeeper-evicpress-copy-v1");
    h.update(&ctx.0);
    h.update(&(config as u32).to_le_bytes());
    ChunkKey(*h.finalize().as_bytes())
}

/// Errors of the EVICPRESS store. The engine treats a failed load as a miss and
/// recomputes; a failed background move or insert is logged and leaves the context where it
/// was (or unstored).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("EVICPRESS needs at least one tier, with one capacity and one delay entry per tier")]
    TierSpecs,
    #[error("fixed configuration #{0} is not in the grid")]
    FixedNotInGrid(usize),
    #[error("starting the EVICPRESS worker thread: {0}")]
    Spawn(std::io::Error),
    #[error("context not stored")]
    NotStored,
    #[error("copy missing from its tier")]
    CopyMissing,
    #[error("the master copy is unreadable: {0}")]
    MasterUnreadable(Box<StoreError>),
    #[error("the context's only copy is unreadable (it is forgotten and recomputed): {0}")]
    OnlyCopyUnreadable(Box<StoreError>),
    #[error("the context is stored compressed only (one copy per context): its full KV is gone")]
    NoFullKv,
    #[error("{0}: this context was stored without the scores it drops by (SnapKV's and KVzip's come from the engine with the context)")]
    NoSnapKvScores(crate::config::Compression),
    #[error("{got} qualities for a grid of {grid}")]
    ProfileLength { got: usize, grid: usize },
    #[error("{got} KVzip scores for a context of {tokens} tokens (or a grid without KVzip)")]
    ScoresLength { got: usize, tokens: usize },
    #[error(transparent)]
    Tier(#[from] TierError),
    #[error("stored KV: {0}")]
    Codec(#[from] CodecError),
}

/// One queued job fewer; wakes `flush` when none is left.
fn job_done(in_flight: &(Mutex<usize>, Condvar)) {
    let (lock, cv) = in_flight;
    let mut n = lock.lock().unwrap();
    *n -= 1;
    if *n == 0 {
        cv.notify_all();
    }
}

impl ContextStore {
    pub fn new(cfg: StoreConfig) -> Result<Arc<ContextStore>, StoreError> {
        if cfg.tiers.is_empty()
            || cfg.tiers.len() != cfg.capacities_bytes.len()
            || cfg.tiers.len() != cfg.delay.tiers.len()
        {
            return Err(StoreError::TierSpecs);
        }
        if let Policy::Fixed(c) = cfg.policy {
            if c >= cfg.grid.len() {
                return Err(StoreError::FixedNotInGrid(c));
            }
        }
        let (tx, rx) = sync_channel::<Job>(MAX_QUEUED_JOBS);
        // With masters the last tier keeps every one of them: its capacity is not the
        // placer's to enforce (the placer's bounded model lets compressed copies outlive
        // their masters); the store enforces it by dropping whole contexts. With one copy
        // per context that bounded model is exactly the store's.
        let mut capacities_bytes = cfg.capacities_bytes;
        let last_capacity_bytes = *capacities_bytes.last().expect("checked non-empty");
        if cfg.copies == Copies::MasterAndPlaced {
            *capacities_bytes.last_mut().expect("checked non-empty") = u64::MAX;
        }
        let store = Arc::new(ContextStore {
            tiers: cfg.tiers,
            capacities_bytes,
            last_capacity_bytes,
            copies: cfg.copies,
            grid: cfg.grid,
            policy: cfg.policy,
            fingerprint: cfg.fingerprint,
            half_life_s: cfg.frequency_half_life_s,
            reprofile_threshold: cfg.reprofile_threshold,
            max_queries: cfg.max_queries_per_context,
            max_pending_bytes: cfg.max_pending_bytes,
            pending_bytes: Arc::new(AtomicU64::new(0)),
            state: Arc::new(Mutex::new(State {
                entries: HashMap::new(),
                prior: QualityPrior::default(),
                stats: StoreStats::default(),
                provenance: measure::DelayProvenance::priors(cfg.delay.tiers.len()),
                delay: cfg.delay,
                ghosts: ghosts::Ghosts::default(),
            })),
            in_flight: Arc::new((Mutex::new(0), Condvar::new())),
            tx: Mutex::new(Some(tx)),
            worker: Mutex::new(None),
            epoch: Instant::now(),
            spare: Mutex::new(None),
        });
        let worker_store = Arc::downgrade(&store);
        let handle = std::thread::Builder::new()
            .name("evicpress".into())
            .spawn(move || worker::worker_loop(rx, worker_store))
            .map_err(StoreError::Spawn)?;
        *store.worker.lock().unwrap() = Some(handle);
        Ok(store)
    }

    pub fn grid(&self) -> &Grid {
        &self.grid
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    pub fn fingerprint(&self) -> &[u8; 32] {
        &self.fingerprint
    }

    pub fn tier_names(&self) -> Vec<String> {
        self.tiers.iter().map(|t| t.name().to_string()).collect()
    }

    pub(crate) fn now_s(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64()
    }

    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.state.lock().unwrap().entries.contains_key(key)
    }

    /// The index of the longest of `keys` (the prompt's chunk-boundary keys, shortest first)
    /// that is stored: known to this process, or with a master on the last tier written by
    /// an earlier process or another server. Such a master is adopted: registered with the
    /// prior quality, its placement decided by the worker. This is what makes a restart (a
    /// disk last tier) or a second server (a shared Redis) reuse contexts; it costs one
    /// batched `contains` on the last tier for the keys beyond the longest known one.
    pub fn longest_stored(&self, keys: &[ChunkKey]) -> Option<usize> {
        let known = {
            let st = self.state.lock().unwrap();
            keys.iter().rposition(|k| st.entries.contains_key(k))
        };
        let start = known.map_or(0, |i| i + 1);
        if start < keys.len() && self.copies == Copies::MasterAndPlaced {
            let last = self.tiers.len() - 1;
            let masters: Vec<ChunkKey> = keys[start..].iter().map(|k| copy_key(k, 0)).collect();
            if let Ok(present) = self.tiers[last].contains_many(&masters) {
                for j in (0..present.len()).rev().filter(|&j| present[j]) {
                    match self.adopt(&keys[start + j]) {
                        Ok(()) => return Some(start + j),
                        Err(e @ StoreError::Codec(_)) => {
                            // Kept, it would fail every restart's adoption and block the
                            // store of the recomputed context under its key.
                            let _ = self.tiers[last].delete(&masters[j]);
                            tracing::warn!("EVICPRESS: a stored master is unusable ({e}); deleted, it is stored again once recomputed");
                        }
                        Err(e) => tracing::warn!("EVICPRESS: a stored master is unusable: {e}"),
                    }
                }
            }
        }
        known
    }

    /// Registers a context whose master is already on the last tier (read once, to learn
    /// its shape and check it decodes), and asks the worker to place it.
    fn adopt(&self, key: &ChunkKey) -> Result<(), StoreError> {
        let kv = self.load_master(key)?;
        if !self.contains(key) {
            self.register(*key, &kv, HashMap::new());
            self.state.lock().unwrap().stats.adopted += 1;
            self.restore_meta(key);
        }
        self.send(Job::Place(*key));
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.state.lock().unwrap().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn stats(&self) -> StoreStats {
        self.state.lock().unwrap().stats.clone()
    }

    pub fn delay_model(&self) -> DelayModel {
        self.state.lock().unwrap().delay.clone()
    }

    /// Replaces the delay model (a benchmark's fitted one); later placements use it.
    pub fn set_delay_model(&self, delay: DelayModel) {
        self.state.lock().unwrap().delay = delay;
    }

    /// Hands a freshly prefilled context's full KV to the worker, which stores the master
    /// and places it. Never blocks: returns false (counted) when the queue is full.
    pub fn offer(&self, key: ChunkKey, kv: KvContext) -> bool {
        self.offer_with_snapkv(key, kv, None)
    }

    /// [`ContextStore::offer`] with the context's SnapKV token scores (one per stored
    /// token, computed by the engine from the queries of the context's last tokens), which
    /// the SnapKV configurations of the grid drop by. Without them (or with a wrong count)
    /// those configurations are unavailable for this context.
    pub fn offer_with_snapkv(
        &self,
        key: ChunkKey,
        kv: KvContext,
        snapkv_scores: Option<Vec<f32>>,
    ) -> bool {
        self.offer_with_scores(key, kv, snapkv_scores, None)
    }

    /// [`ContextStore::offer`] with the scores the engine supplies: SnapKV's and KVzip's
    /// token scores (one per stored token). A score the grid does not drop by is not
    /// kept; without one (or with a wrong count) its configurations are unavailable.
    pub fn offer_with_scores(
        &self,
        key: ChunkKey,
        kv: KvContext,
        snapkv_scores: Option<Vec<f32>>,
        kvzip_scores: Option<Vec<f32>>,
    ) -> bool {
        let n = kv.n_tokens();
        let fits = |s: &Vec<f32>| s.len() == n;
        let supplied = Supplied {
            snapkv: snapkv_scores
                .filter(|s| fits(s) && self.grid_drops_by(DropScore::SnapKv))
                .map(SnapKvSource::Scores),
            kvzip: kvzip_scores.filter(|s| fits(s) && self.grid_drops_by(DropScore::KvZip)),
            context_ids: None,
        };
        self.offer_job(key, kv, supplied)
    }

    /// [`ContextStore::offer`] with the queries of the context's last tokens, from which
    /// the worker computes its SnapKV scores (when the grid has a SnapKV configuration).
    pub fn offer_with_window(&self, key: ChunkKey, kv: KvContext, window: WindowQueries) -> bool {
        self.offer_scored(key, kv, Some(window), None, None)
    }

    /// The engine's offer: the context with its window queries (for SnapKV, scored on the
    /// worker) and its KVzip scores, each when the engine has them. Without KVzip scores
    /// but with the context's token ids (`context_ids`), the context waits for the engine
    /// to score it in idle time ([`ContextStore::kvzip_candidates`]).
    pub fn offer_scored(
        &self,
        key: ChunkKey,
        kv: KvContext,
        window: Option<WindowQueries>,
        kvzip_scores: Option<Vec<f32>>,
        context_ids: Option<Vec<u32>>,
    ) -> bool {
        let n = kv.n_tokens();
        let wants_kvzip = self.grid_drops_by(DropScore::KvZip);
        let kvzip = kvzip_scores.filter(|s| s.len() == n && wants_kvzip);
        let supplied = Supplied {
            snapkv: window
                .filter(|_| self.grid_drops_by(DropScore::SnapKv))
                .map(SnapKvSource::Window),
            context_ids: context_ids.filter(|ids| ids.len() == n && wants_kvzip && kvzip.is_none()),
            kvzip,
        };
        self.offer_job(key, kv, supplied)
    }

    /// Stored contexts that wait for KVzip scores, with their token ids, the most
    /// frequently used first, at most `max`.
    pub fn kvzip_candidates(&self, max: usize) -> Vec<(ChunkKey, Vec<u32>)> {
        let st = self.state.lock().unwrap();
        let mut v: Vec<_> = st
            .entries
            .iter()
            .filter(|(_, e)| self.has_full_kv(e))
            .filter_map(|(k, e)| {
                let ids = e.pending_kvzip_ids.as_ref()?;
                Some((
                    *k,
                    ids.clone(),
                    e.freq.value_at(self.now_s(), self.half_life_s),
                ))
            })
            .collect();
        v.sort_by(|a, b| b.2.total_cmp(&a.2));
        v.into_iter()
            .take(max)
            .map(|(k, ids, _)| (k, ids))
            .collect()
    }

    /// Records a failed KVzip scoring of `key`. After [`MAX_KVZIP_ATTEMPTS`] (or with
    /// `retry` false: it cannot succeed) the store stops waiting for its scores: its KVzip
    /// configurations stay unavailable, and the idle hook does not try it again.
    pub fn kvzip_scoring_failed(&self, key: &ChunkKey, retry: bool) {
        if let Some(e) = self.state.lock().unwrap().entries.get_mut(key) {
            e.kvzip_failures += 1;
            if !retry {
                e.kvzip_failures = e.kvzip_failures.max(MAX_KVZIP_ATTEMPTS);
            }
            if e.kvzip_failures >= MAX_KVZIP_ATTEMPTS {
                e.pending_kvzip_ids = None;
            }
        }
        metrics::counter!("pagekeeper:evicpress_kvzip_failed_total").increment(1);
    }

    /// A stored context asked for again (`context_ids`: its tokens, from the request's
    /// prompt) waits for KVzip scores if it has none, is not waiting already and was not
    /// given up on. This is how a context adopted after a restart or from another server
    /// (its token ids are not stored, only its KV) gets scored. Returns whether it now
    /// waits.
    pub fn wait_for_kvzip_scores(&self, key: &ChunkKey, context_ids: &[u32]) -> bool {
        if !self.grid_drops_by(DropScore::KvZip) {
            return false;
        }
        let mut st = self.state.lock().unwrap();
        let Some(e) = st.entries.get_mut(key) else {
            return false;
        };
        let wants = !e.scores.contains_key(&DropScore::KvZip)
            && e.pending_kvzip_ids.is_none()
            && e.kvzip_failures < MAX_KVZIP_ATTEMPTS
            && context_ids.len() == e.n_tokens;
        if wants {
            e.pending_kvzip_ids = Some(context_ids.to_vec());
        }
        wants
    }

    /// Gives a stored context the KVzip scores the engine computed in idle time (one per
    /// token). Its KVzip configurations become available; it is profiled again (a profile
    /// made before could not run them) and re-placed.
    pub fn attach_kvzip_scores(&self, key: &ChunkKey, scores: Vec<f32>) -> Result<(), StoreError> {
        {
            let mut st = self.state.lock().unwrap();
            let e = st.entries.get_mut(key).ok_or(StoreError::NotStored)?;
            if scores.len() != e.n_tokens || !self.grid_drops_by(DropScore::KvZip) {
                return Err(StoreError::ScoresLength {
                    got: scores.len(),
                    tokens: e.n_tokens,
                });
            }
            e.scores.insert(DropScore::KvZip, scores);
            e.pending_kvzip_ids = None;
            e.needs_profile = true;
        }
        metrics::counter!("pagekeeper:evicpress_kvzip_scored_total").increment(1);
        self.send(Job::Place(*key));
        self.send(Job::SaveMeta(*key));
        Ok(())
    }

    /// A stored context's SnapKV scores, if it has them (to offer it to another store).
    pub fn snapkv_scores_of(&self, key: &ChunkKey) -> Option<Vec<f32>> {
        self.supplied_scores_of(key, DropScore::SnapKv)
    }

    /// A stored context's KVzip scores, if it has them (to offer it to another store).
    pub fn kvzip_scores_of(&self, key: &ChunkKey) -> Option<Vec<f32>> {
        self.supplied_scores_of(key, DropScore::KvZip)
    }

    fn supplied_scores_of(&self, key: &ChunkKey, score: DropScore) -> Option<Vec<f32>> {
        self.state
            .lock()
            .unwrap()
            .entries
            .get(key)
            .and_then(|e| e.scores.get(&score).cloned())
    }

    /// Whether the grid drops by SnapKV scores (and offers should carry them).
    pub fn wants_snapkv(&self) -> bool {
        self.grid_drops_by(DropScore::SnapKv)
    }

    /// Whether the grid drops by KVzip scores (and offers should carry them).
    pub fn wants_kvzip(&self) -> bool {
        self.grid_drops_by(DropScore::KvZip)
    }

    pub(crate) fn grid_drops_by(&self, score: DropScore) -> bool {
        self.grid
            .configs()
            .iter()
            .any(|c| c.drop_score() == Some(score))
    }

    fn offer_job(&self, key: ChunkKey, kv: KvContext, supplied: Supplied) -> bool {
        if self.contains(&key) {
            return true;
        }
        let bytes = (kv.n_elements() * 4 + supplied.bytes()) as u64;
        if self.pending_bytes.load(Ordering::Relaxed) + bytes > self.max_pending_bytes {
            self.state.lock().unwrap().stats.skipped_queue_full += 1;
            return false;
        }
        self.pending_bytes.fetch_add(bytes, Ordering::Relaxed);
        if !self.send(Job::Insert(key, Box::new(kv), supplied)) {
            self.pending_bytes.fetch_sub(bytes, Ordering::Relaxed);
            self.state.lock().unwrap().stats.skipped_queue_full += 1;
            return false;
        }
        true
    }

    fn send(&self, job: Job) -> bool {
        let tx = self.tx.lock().unwrap();
        let Some(tx) = tx.as_ref() else { return false };
        *self.in_flight.0.lock().unwrap() += 1;
        match tx.try_send(job) {
            Ok(()) => true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.job_done();
                false
            }
        }
    }

    fn job_done(&self) {
        job_done(&self.in_flight);
    }

    /// Takes back a context returned by [`ContextStore::load`] once the caller is done with
    /// it; one is kept for the next load to decode into.
    pub fn recycle(&self, ctx: KvContext) {
        // The spare stays allocated between loads: bound what it may pin.
        if (ctx.k.capacity() + ctx.v.capacity()) * std::mem::size_of::<f32>() <= MAX_SPARE_BYTES {
            *self.spare.lock().unwrap() = Some(ctx);
        }
    }

    /// Waits until every queued insert and placement has been executed.
    pub fn flush(&self) {
        let (lock, cv) = &*self.in_flight;
        let mut n = lock.lock().unwrap();
        while *n > 0 {
            n = cv.wait(n).unwrap();
        }
    }

    /// Loads a context's placed copy (falling back to the master), decoded. Records the
    /// access and, if `query` is given, keeps it for background profiling.
    pub fn load(
        &self,
        key: &ChunkKey,
        query: Option<&[u32]>,
    ) -> Result<(KvContext, LoadReport), StoreError> {
        let (tier, config) = self.record_access(key, query)?;
        let master = (self.tiers.len() - 1, 0);
        let mut fell_back = false;
        let candidates = match self.copies {
            Copies::MasterAndPlaced => &[(tier, config), master][..],
            Copies::PlacedOnly => &[(tier, config)][..],
        };
        for &(t, c) in candidates {
            if fell_back && (t, c) == (tier, config) {
                continue;
            }
            let t0 = Instant::now();
            let payload = self.tiers[t].load(&copy_key(key, c));
            let fetch_s = t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            let decoded = match payload {
                Ok(Some(p)) => {
                    let spare = self.spare.lock().unwrap().take();
                    match spare {
                        Some(mut ctx) => pk_codec::decode_into(&p, &self.fingerprint, &mut ctx)
                            .map(|_| (ctx, p.len() as u64)),
                        None => {
                            pk_codec::decode(&p, &self.fingerprint).map(|ctx| (ctx, p.len() as u64))
                        }
                    }
                    .map_err(StoreError::from)
                }
                Ok(None) => Err(StoreError::CopyMissing),
                Err(e) => Err(StoreError::from(e)),
            };
            match decoded {
                Ok((ctx, bytes)) => {
                    let report = LoadReport {
                        tier: self.tiers[t].name().to_string(),
                        tier_index: t,
                        config: self.grid.configs()[c].to_string(),
                        bytes,
                        fetch_s,
                        decode_s: t1.elapsed().as_secs_f64(),
                        fell_back_to_master: fell_back,
                        restore_s: 0.0,
                    };
                    metrics::counter!("pagekeeper:evicpress_hits_total", "tier" => report.tier.clone())
                        .increment(1);
                    self.observe_load(t, bytes, report.decode_s);
                    self.send(Job::Place(*key));
                    return Ok((ctx, report));
                }
                Err(e) => {
                    tracing::warn!(
                        "EVICPRESS copy {}/{} of a context unreadable: {e}",
                        self.tiers[t].name(),
                        self.grid.configs()[c]
                    );
                    if self.copies == Copies::PlacedOnly {
                        self.forget_unreadable(key, (t, c));
                        return Err(StoreError::OnlyCopyUnreadable(Box::new(e)));
                    }
                    if (t, c) == master {
                        if matches!(e, StoreError::Codec(_) | StoreError::CopyMissing) {
                            self.forget_unusable_master(key, (tier, config));
                        }
                        return Err(StoreError::MasterUnreadable(Box::new(e)));
                    }
                    fell_back = true;
                    let mut st = self.state.lock().unwrap();
                    st.stats.fallbacks_to_master += 1;
                    if let Some(e) = st.entries.get_mut(key) {
                        if (e.item.tier, e.item.config) == (tier, config) {
                            e.item.tier = master.0;
                            e.item.config = 0;
                        }
                    }
                }
            }
        }
        unreachable!("the last candidate returns")
    }

    /// With a master per context: a master that fails the codec's check or is gone. The
    /// context is forgotten and both its copies deleted, so that the next request computes
    /// it and stores it again; kept, every hit would fall through to the same bad master.
    /// `placed` is where the load found the placed copy (a fallback has since pointed the
    /// entry at the master).
    fn forget_unusable_master(&self, key: &ChunkKey, placed: (usize, usize)) {
        let mut st = self.state.lock().unwrap();
        if self.forget(&mut st, key).is_none() {
            return;
        }
        st.stats.unreadable_dropped += 1;
        drop(st);
        let last = self.tiers.len() - 1;
        let _ = self.tiers[last].delete(&copy_key(key, 0));
        if placed != (last, 0) {
            let _ = self.tiers[placed.0].delete(&copy_key(key, placed.1));
        }
        tracing::warn!("EVICPRESS: a context's master is unusable; the context is forgotten and stored again once recomputed");
    }

    /// Counts a hit of `key` (frequency, recency, hits, the query kept for profiling) and
    /// returns where its placed copy is; every few hits its meta entry is rewritten.
    fn record_access(
        &self,
        key: &ChunkKey,
        query: Option<&[u32]>,
    ) -> Result<(usize, usize), StoreError> {
        let (at, save_meta) = {
            let mut st = self.state.lock().unwrap();
            let now = self.now_s();
            let e = st.entries.get_mut(key).ok_or(StoreError::NotStored)?;
            e.freq.bump(now, self.half_life_s);
            e.item.last_access_s = now;
            e.hits += 1;
            e.hits_since_profile += 1;
            if let Some(q) = query {
                if e.queries.len() >= self.max_queries {
                    e.queries.remove(0);
                }
                e.queries.push(q.to_vec());
            }
            let save_meta = e.hits % SAVE_META_EVERY_HITS == 0;
            ((e.item.tier, e.item.config), save_meta)
        };
        if save_meta && self.copies == Copies::MasterAndPlaced {
            self.send(Job::SaveMeta(*key));
        }
        Ok(at)
    }

    /// The full KV of a stored context (its master), for profiling. With one copy per
    /// context: the copy, when uncompressed ([`StoreError::NoFullKv`] otherwise).
    pub fn load_master(&self, key: &ChunkKey) -> Result<KvContext, StoreError> {
        if self.copies == Copies::PlacedOnly {
            return self.load_single_copy_full(key);
        }
        let last = self.tiers.len() - 1;
        let p = self.tiers[last]
            .load(&copy_key(key, 0))?
            .ok_or(StoreError::CopyMissing)?;
        Ok(pk_codec::decode(&p, &self.fingerprint)?)
    }

    /// `full` under grid configuration `config`, through the codec (encode and decode), as a
    /// hit would see it.
    pub fn compress(
        &self,
        key: &ChunkKey,
        full: &KvContext,
        config: usize,
    ) -> Result<KvContext, StoreError> {
        let bytes = self.encode(key, full, config)?;
        Ok(pk_codec::decode(&bytes, &self.fingerprint)?)
    }

    fn encode(
        &self,
        key: &ChunkKey,
        full: &KvContext,
        config: usize,
    ) -> Result<Vec<u8>, StoreError> {
        let c = self.grid.configs()[config];
        let scores = match c.drop_score() {
            None => None,
            Some(s) => {
                let cached = self
                    .state
                    .lock()
                    .unwrap()
                    .entries
                    .get(key)
                    .and_then(|e| e.scores.get(&s).cloned());
                Some(
                    cached
                        .or_else(|| token_scores(full, s))
                        .ok_or(StoreError::NoSnapKvScores(c))?,
                )
            }
        };
        Ok(pk_codec::encode(
            full,
            &c.method(),
            scores.as_deref(),
            &self.fingerprint,
        )?)
    }

    /// Whether configuration `config` can be built for a stored context: every one can,
    /// but a SnapKV configuration only for a context stored with its SnapKV scores.
    pub fn is_available(&self, key: &ChunkKey, config: usize) -> bool {
        match self.grid.configs().get(config).and_then(|c| c.drop_score()) {
            Some(s) if s.is_supplied() => self
                .state
                .lock()
                .unwrap()
                .entries
                .get(key)
                .is_some_and(|e| e.scores.contains_key(&s)),
            _ => config < self.grid.len(),
        }
    }

    /// A context's placement item, with the configurations it cannot use at quality −∞ so
    /// that no utility-driven choice (EVICPRESS, the explain table) picks them.
    fn placement_item(&self, e: &Entry, frequency: f64) -> Item {
        let mut it = e.item.clone();
        it.frequency = frequency;
        for (c, q) in self.grid.configs().iter().zip(it.quality.iter_mut()) {
            if c.drop_score()
                .is_some_and(|s| s.is_supplied() && !e.scores.contains_key(&s))
            {
                *q = f32::NEG_INFINITY;
            }
        }
        it
    }

    /// Contexts that want a (re)profile, with the queries seen for them, at most `max`.
    pub fn profiling_candidates(&self, max: usize) -> Vec<(ChunkKey, Vec<Vec<u32>>)> {
        let st = self.state.lock().unwrap();
        let mut v: Vec<_> = st
            .entries
            .iter()
            .filter(|(_, e)| {
                (e.needs_profile || e.hits_since_profile >= REFRESH_PROFILE_AFTER_HITS)
                    && !e.queries.is_empty()
                    && self.has_full_kv(e)
            })
            .map(|(k, e)| {
                (
                    *k,
                    e.queries.clone(),
                    e.freq.value_at(self.now_s(), self.half_life_s),
                )
            })
            .collect();
        v.sort_by(|a, b| b.2.total_cmp(&a.2));
        v.into_iter().take(max).map(|(k, q, _)| (k, q)).collect()
    }

    /// Refuses a profile that does not give one quality per grid configuration.
    fn check_profile_length(&self, by_config: &[f32]) -> Result<(), StoreError> {
        match by_config.len() == self.grid.len() {
            true => Ok(()),
            false => Err(StoreError::ProfileLength {
                got: by_config.len(),
                grid: self.grid.len(),
            }),
        }
    }

    /// Records a measured quality curve (one value per grid configuration) and re-places.
    pub fn set_profile(&self, key: &ChunkKey, by_config: Vec<f32>) -> Result<(), StoreError> {
        self.check_profile_length(&by_config)?;
        {
            let mut st = self.state.lock().unwrap();
            let curve = QualityCurve {
                by_config,
                source: QualitySource::Profiled,
            };
            st.prior.add(&curve);
            let e = st.entries.get_mut(key).ok_or(StoreError::NotStored)?;
            e.item.quality = curve.by_config.clone();
            e.quality = curve;
            e.needs_profile = false;
            e.hits_since_profile = 0;
            e.served_quality = None;
        }
        self.send(Job::Place(*key));
        self.send(Job::SaveMeta(*key));
        Ok(())
    }

    /// Feeds back the quality a served query got (when the caller can measure it against
    /// the full KV). A drift below the profile by more than the threshold asks for a
    /// re-profile.
    pub fn record_served_quality(&self, key: &ChunkKey, quality: f64) {
        let mut st = self.state.lock().unwrap();
        let threshold = self.reprofile_threshold as f64;
        let Some(e) = st.entries.get_mut(key) else {
            return;
        };
        let ewma = match e.served_quality {
            Some(q) => 0.7 * q + 0.3 * quality,
            None => quality,
        };
        e.served_quality = Some(ewma);
        let expected = e.item.quality[e.item.config] as f64;
        let drifted = e.quality.source == QualitySource::Profiled && ewma < expected - threshold;
        if drifted && !e.needs_profile {
            e.needs_profile = true;
            st.stats.reprofiles_requested += 1;
        }
    }

    /// Every stored context with its placement and utility table, most frequent first.
    pub fn explain(&self) -> Vec<ContextReport> {
        let st = self.state.lock().unwrap();
        let now = self.now_s();
        let placer = Placer {
            delay: &st.delay,
            policy: &self.policy,
            capacities_bytes: &self.capacities_bytes,
        };
        let mut rows: Vec<ContextReport> = st
            .entries
            .iter()
            .map(|(k, e)| {
                let item = self.placement_item(e, e.freq.value_at(now, self.half_life_s).max(1e-9));
                let mut options = Vec::new();
                for t in 0..self.tiers.len() {
                    for c in 0..self.grid.len() {
                        options.push(OptionReport {
                            tier: self.tiers[t].name().to_string(),
                            config: self.grid.configs()[c].to_string(),
                            bytes: item.bytes[c],
                            quality: item.quality[c],
                            ttft_s: st.delay.ttft_s(t, item.bytes[c], item.kept_tokens[c]),
                            utility: placer.utility(&item, c, t),
                        });
                    }
                }
                options.sort_by(|a, b| b.utility.total_cmp(&a.utility));
                ContextReport {
                    key: k.to_hex(),
                    n_tokens: e.n_tokens,
                    tier: self.tiers[e.item.tier].name().to_string(),
                    config: self.grid.configs()[e.item.config].to_string(),
                    bytes: e.item.bytes[e.item.config],
                    frequency: item.frequency,
                    quality_source: e.quality.source,
                    served_quality: e.served_quality,
                    hits: e.hits,
                    bytes_by_group: e.window_bytes.as_ref().map(|w| {
                        let all = e.item.bytes[e.item.config];
                        BytesByGroup {
                            full_attention: all - w[e.item.config],
                            sliding_window: w[e.item.config],
                        }
                    }),
                    options,
                }
            })
            .collect();
        rows.sort_by(|a, b| b.frequency.total_cmp(&a.frequency));
        rows
    }

    /// Bytes placed on each tier (logical).
    pub fn usage_bytes(&self) -> Vec<u64> {
        let st = self.state.lock().unwrap();
        let mut usage = vec![0u64; self.tiers.len()];
        for e in st.entries.values() {
            usage[e.item.tier] += e.item.bytes[e.item.config];
        }
        usage
    }

    /// (tier, configuration) of a stored context.
    pub fn placement_of(&self, key: &ChunkKey) -> Option<(usize, usize)> {
        self.state
            .lock()
            .unwrap()
            .entries
            .get(key)
            .map(|e| (e.item.tier, e.item.config))
    }
}
