//! The seam through which prompt KV is reused across requests, restarts and servers: one
//! [`KvReuse`] connector per engine (vLLM v1's KV connector, scheduler side). The engine
//! asks it once per waiting request how much of the prompt it holds
//! ([`KvReuse::lookup`], vLLM's `get_num_new_matched_tokens`), tells it to load that into a
//! new sequence's blocks when the pool holds less ([`KvReuse::load`],
//! `update_state_after_alloc`), hands it each computed prompt to save ([`KvReuse::save`]),
//! and tells it when a request ends ([`KvReuse::request_finished`]).
//!
//! Two connectors exist: the chunk tiers (`tiering`: RAM → disk → Redis, chunk by chunk)
//! and the EVICPRESS context store (`contexts`: whole contexts, compressed and placed by
//! utility). The engine names neither; it holds a `Box<dyn KvReuse>` built here from
//! [`ReuseConfig`].
//!
//! Both connectors key KV by the same chained chunk hashes ([`pk_tiers::ChunkKeyer`]), so
//! the per-sequence state ([`SeqReuse`]) is the prompt's chunk keys and how many of them the
//! store already holds. Evicting sequences and sequences started from a given or compressed
//! KV never reach a connector: their KV is not what prefill computes.

use std::any::Any;

use pk_evicpress::LoadReport;
use pk_kv::{KvCacheManager, SeqId};
use pk_model::Backend;
use pk_tiers::ChunkKey;

use crate::contexts::{ContextReuse, ContextReuseConfig};
use crate::namespace::CacheNamespace;
use crate::tiering::{Tiering, TieringConfig};

/// Which connector an engine reuses prompt KV through.
#[derive(Clone, Debug)]
pub enum ReuseConfig {
    /// Chunks of prompt KV in tiers below the pool (`--tier-*`).
    Chunks(TieringConfig),
    /// Whole contexts in an EVICPRESS store (`--tier-policy evicpress`).
    Contexts(ContextReuseConfig),
}

/// A connector's answer for a prompt, asked once while it waits.
#[derive(Debug, Clone, Default)]
pub(crate) struct ReuseMatch {
    /// Chained keys of the prompt's whole chunks, leaving at least one token to compute.
    pub keys: Vec<ChunkKey>,
    /// Prompt tokens the connector can load at the head of the prompt (0: nothing).
    pub loadable_tokens: usize,
    /// Chunks of `keys` the store holds already, which need not be saved again.
    pub saved_chunks: usize,
}

/// What a load wrote into a sequence's blocks.
#[derive(Debug, Clone)]
pub(crate) struct Placed {
    /// Prompt tokens now covered (the next token to compute is this one).
    pub tokens: usize,
    /// The KV is what prefill would compute (it may feed the prefix cache and be saved).
    pub exact: bool,
    /// Chunks of the prompt's keys the store holds after this load.
    pub saved_chunks: usize,
    /// Where a stored context came from (EVICPRESS), for the request's output.
    pub report: Option<LoadReport>,
}

/// A sequence's dealings with the connector.
#[derive(Debug, Clone, Default)]
pub(crate) struct SeqReuse {
    /// While waiting: the answer for `all_ids` of this length (asked again only when a
    /// preemption has changed the tokens).
    pub probe: Option<(usize, ReuseMatch)>,
    /// Once admitted: the prompt's chunk keys, and how many the store holds.
    pub keys: Vec<ChunkKey>,
    pub saved_chunks: usize,
    /// The sequence's KV is not what prefill computes (a compressed context or a given
    /// prefix): it never feeds the prefix cache or the connector.
    pub inexact: bool,
    /// Where its stored context came from, if one was loaded.
    pub load: Option<LoadReport>,
}

impl SeqReuse {
    /// Whether the connector still has chunks of this prompt to save once it is computed.
    pub fn wants_save(&self) -> bool {
        !self.inexact && self.saved_chunks < self.keys.len()
    }
}

/// A store of prompt KV the engine reuses (module documentation).
pub(crate) trait KvReuse: Send {
    /// The KV the store holds at the head of `ids` (a waiting request's tokens). Asked once
    /// per waiting request: a lookup may be a Redis round trip.
    fn lookup(&mut self, ids: &[u32], salt: Option<&str>) -> ReuseMatch;

    /// Loads `m`'s tokens into `seq`, which the engine has just added with an empty table;
    /// `query` is the prompt after them (a store may choose what to load by it). `None`
    /// when nothing usable was loaded: the engine then frees the sequence and computes the
    /// prompt from the pool's prefix cache.
    fn load(
        &mut self,
        m: &ReuseMatch,
        query: &[u32],
        kv: &mut KvCacheManager,
        backend: &mut dyn Backend,
        seq: SeqId,
    ) -> Option<Placed>;

    /// Saves what `s` has not saved of the prompt's chunks, now that `ids[..computed]` are
    /// in `seq`'s blocks (called once the prompt is in, while `s.wants_save()`). Never waits
    /// on a slow tier: stores are queued to a worker.
    fn save(
        &mut self,
        s: &mut SeqReuse,
        ids: &[u32],
        computed: usize,
        kv: &KvCacheManager,
        backend: &mut dyn Backend,
        seq: SeqId,
    );

    /// Told when a request ends, before its blocks are freed. Both connectors copy a
    /// prompt's KV out at `save`, so neither holds blocks past it; a connector that saved
    /// from the blocks asynchronously would release them here.
    fn request_finished(&mut self, _s: &SeqReuse) {}

    /// Told of every step that ran only prompt tokens: `tokens` computed in `seconds`. A
    /// store that weighs loading against recomputing keeps its prefill speed current.
    fn observe_prefill(&mut self, _tokens: usize, _seconds: f64) {}

    /// The concrete connector, for its own statistics and store (`Engine::tiering_stats`,
    /// `Engine::context_store`).
    fn as_any(&self) -> &dyn Any;
}

/// The connector `cfg` describes, keyed under `namespace`.
pub(crate) fn open(
    cfg: &ReuseConfig,
    model_name: &str,
    namespace: &CacheNamespace,
    block_size_tokens: usize,
    bytes_per_token: usize,
) -> anyhow::Result<Box<dyn KvReuse>> {
    Ok(match cfg {
        ReuseConfig::Chunks(t) => Box::new(Tiering::new(
            t,
            model_name,
            namespace,
            block_size_tokens,
            bytes_per_token,
        )?),
        ReuseConfig::Contexts(c) => Box::new(ContextReuse::new(
            c,
            model_name,
            namespace,
            block_size_tokens,
        )?),
    })
}
