//! The seam through which KV the engine did not compute enters its pool, and prompt KV it did
//! compute leaves it: a [`KvConnector`] (vLLM v1's KV connector, scheduler side, with the
//! loads done on the engine thread). The engine names no store: the chunk tiers, the
//! EVICPRESS context store and a request's given prefix KV all implement this trait in
//! `pk-connectors`, which the CLI builds and hands to the engine
//! ([`crate::Engine::set_connector`], `GenerateParams::prefix_kv`).
//!
//! The engine asks a connector once per waiting request how much of the prompt it holds
//! ([`KvConnector::lookup`], vLLM's `get_num_new_matched_tokens`), tells it to load that into
//! a new sequence's blocks when the pool holds less ([`KvConnector::load`]), hands it each
//! computed prompt to save while it still wants one ([`KvConnector::save`]; after every
//! prefill step for a connector that asks, [`KvConnector::saves_during_prefill`]), and tells it
//! when a request ends ([`KvConnector::request_finished`]). What a connector keeps per
//! request (its chunk keys, what it has saved) it keeps itself, under the [`RequestKey`] the
//! engine gives each request; the engine keeps only what it decides by.
//!
//! Evicting sequences and sequences started from an inexact KV (compressed, or given) never
//! reach a connector's save: their KV is not what prefill computes.

use pk_kv::{KvCacheManager, SeqId};
use pk_model::{Backend, KvGeometry};

/// The engine's name for a request in its dealings with a connector: unique in the engine's
/// life, the same through preemptions, another one for each forked choice.
pub type RequestKey = u64;

/// A connector's answer for a waiting request's tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lookup {
    /// Prompt tokens the connector can load at the head of the prompt (0: nothing).
    pub loadable_tokens: usize,
    /// The connector wants the prompt's KV once it is computed.
    pub wants_save: bool,
}

/// What a load wrote into a sequence's blocks.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// Prompt tokens now covered (the next token to compute is this one).
    pub tokens: usize,
    /// The KV is what prefill would compute (it may feed the prefix cache and be saved).
    pub exact: bool,
    /// The connector still wants the rest of the prompt's KV once it is computed.
    pub wants_save: bool,
    /// Where the KV came from, for the request's output.
    pub origin: Option<LoadOrigin>,
}

/// Where a request's loaded KV came from (a tier and a stored configuration), reported in
/// its output. The engine's own type, so that its callers need no store crate to read it.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct LoadOrigin {
    /// The tier read (`ram`, `disk`, `redis`, …) and its index, fastest first.
    pub tier: String,
    pub tier_index: usize,
    /// The stored configuration (compression method and ratio, `none-1.0` when exact).
    pub config: String,
    pub bytes: u64,
    pub fetch_s: f64,
    pub decode_s: f64,
    /// The placed copy could not be read or decoded; the master copy was used.
    pub fell_back_to_master: bool,
    /// Seconds spent writing the loaded KV into the pool.
    pub restore_s: f64,
}

/// What a connector may be asked for (module documentation). Implementations keep their
/// mutable state behind their own locks: the engine calls them from its thread only, and
/// the callers that built them read their statistics from others.
pub trait KvConnector: Send + Sync + std::fmt::Debug {
    /// What the connector holds at the head of `ids` (a waiting request's tokens). Asked
    /// once per waiting request, and again only after a preemption changed its tokens: a
    /// lookup may be a Redis round trip.
    fn lookup(&self, request: RequestKey, ids: &[u32], salt: Option<&str>) -> Lookup;

    /// Loads the first `tokens` (a lookup's `loadable_tokens`) into `seq`, which the engine
    /// has just added with an empty table; `query` is the prompt after them (a store may
    /// choose what to load by it). `None` when nothing usable was loaded: the engine then
    /// frees the sequence and computes the prompt from the pool's prefix cache.
    #[allow(clippy::too_many_arguments)]
    fn load(
        &self,
        request: RequestKey,
        tokens: usize,
        query: &[u32],
        kv: &mut KvCacheManager,
        backend: &mut dyn Backend,
        seq: SeqId,
    ) -> Option<Loaded>;

    /// Saves what the connector has not saved of the prompt, now that `ids[..computed]` are
    /// in `seq`'s blocks (called once the prompt is in, while the connector wants a save).
    /// Returns whether it still wants one. Never waits on a slow tier: stores are queued.
    fn save(
        &self,
        request: RequestKey,
        ids: &[u32],
        computed: usize,
        kv: &KvCacheManager,
        backend: &mut dyn Backend,
        seq: SeqId,
    ) -> bool;

    /// How many of `request`'s first prompt tokens its coming `save` stores with KVzip's
    /// scores, when the connector wants them (a store whose grid drops by KVzip, issue 37).
    /// The engine then runs KVzip's reconstruction passes over that prefix, after the
    /// request's first token is out, and hands the scores over with
    /// [`KvConnector::give_kvzip_scores`] just before `save`.
    fn kvzip_scores_wanted(&self, _request: RequestKey) -> Option<usize> {
        None
    }

    /// KVzip's scores of the tokens [`KvConnector::kvzip_scores_wanted`] named: one per
    /// token, the mean over every layer and KV head of the most attention it received in
    /// the passes.
    fn give_kvzip_scores(&self, _request: RequestKey, _scores: Vec<f32>) {}

    /// Whether `save` is also called after every prefill step of a prompt, not only once
    /// the prompt is in. A connector that stores what the pool releases before the prompt
    /// ends (the sliding-window layers of an engine with KV cache groups release every
    /// block behind the window before the next step allocates) must copy it out between
    /// steps, while the blocks are still held.
    fn saves_during_prefill(&self) -> bool {
        false
    }

    /// Whether the connector stores and loads the KV of an engine with KV cache groups
    /// (sliding-window layers in tables of their own, `pk_kv::window`). Only such a
    /// connector may be attached to one ([`crate::Engine::set_connector`]).
    fn supports_kv_groups(&self) -> bool {
        false
    }

    /// Whether the connector stores KV only by group, so that an engine with one block
    /// table for every layer must refuse it (a chunk-tier connector built for a grouped
    /// layout).
    fn requires_kv_groups(&self) -> bool {
        false
    }

    /// Told when a request ends, before its blocks are freed (and for requests that failed
    /// before admission). Both store connectors copy a prompt's KV out at `save`, so
    /// neither holds blocks past it; they forget the request's keys here.
    fn request_finished(&self, _request: RequestKey) {}

    /// Told of every step that ran only prompt tokens: `tokens` computed in `seconds`. A
    /// store that weighs loading against recomputing keeps its prefill speed current.
    fn observe_prefill(&self, _tokens: usize, _seconds: f64) {}

    /// For a connector a request brings (`GenerateParams::prefix_kv`): whether its KV is
    /// what a prefill computes, every token at its own position in one block table, so
    /// that an evicting policy may select over it as over a computed prompt (KVzip's
    /// scores of a stored context, computed from its master in idle time).
    fn given_is_whole(&self) -> bool {
        false
    }

    /// For a connector a request brings (`GenerateParams::prefix_kv`): whether its KV fits
    /// a prompt of `prompt_tokens` on a pool of `geometry`, checked at submission so that
    /// a bad one is refused by name.
    fn check_given(&self, _prompt_tokens: usize, _geometry: &KvGeometry) -> Result<(), String> {
        Ok(())
    }
}

/// A live sequence's block table as the plain ids the model and the stores take.
pub fn block_ids(kv: &KvCacheManager, seq: SeqId) -> Vec<u32> {
    kv.block_table(seq)
        .expect("live sequence")
        .block_ids()
        .iter()
        .map(|b| b.0)
        .collect()
}
