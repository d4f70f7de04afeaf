//! The engine: one model, one paged KV cache, and a continuous-batching scheduler.
//!
//! The engine is single-owner (`&mut self`): the pool, the block tables and the physical
//! KV store are never shared behind locks; a server drives it from one thread and talks
//! to it over channels. Each `step()` admits waiting requests while blocks are free,
//! builds one batch (a decode token for every running sequence first, then prompt chunks
//! up to a token budget), runs one forward pass over it, samples, and streams events.
//! When a sequence cannot get a block, the most recently admitted other sequence is
//! preempted by recompute (vLLM v1): its blocks are freed and it re-enters the queue
//! with its prompt and generated tokens, to be prefilled again (prefix cache permitting).

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use pk_kv::KvCacheManager;
use pk_model::{Backend, KvBlocks, Llama, ModelConfig};
use pk_tokenizer::{ChatTemplate, Tokenizer};

use crate::connector::KvConnector;
use crate::eviction::EvictionStats;
use crate::executor;
use crate::namespace::CacheNamespace;
pub use crate::params::{
    EngineConfig, EngineStats, FinishReason, GenerateParams, SubmitError, MAX_CHOICES,
    MAX_LOGPROBS, PREFILL_TOKENS_PER_DECODE,
};
pub use crate::request::GenerateOutput;
use crate::request::{RequestError, SeqEvent};
use crate::scheduler::{Chunk, Scheduler};
use crate::sequence::SeqState;

mod build;
mod direct;
mod evict;
mod kvzip_steps;
mod loads;
mod store_scores;
mod submit;
mod update;

pub use submit::check_grammar_use;

pub struct Engine {
    /// What eviction did, per policy name.
    pub eviction_stats: std::collections::BTreeMap<String, EvictionStats>,
    pub tokenizer: Tokenizer,
    pub chat_template: ChatTemplate,
    pub config: EngineConfig,
    pub model_name: String,
    pub stats: EngineStats,
    /// Admission, preemption and the batch of each step, over the KV manager (block
    /// tables, prefix cache) and the waiting and running sequences.
    sched: Scheduler,
    /// The forward pass and the pool of K/V bytes it writes (CPU or GPU). Everything that
    /// decides which block holds what stays here on the host: `kv`, the sequences, the
    /// eviction policies, the connector.
    backend: Box<dyn Backend>,
    /// Mixed into every block hash and stored key, so that caches of different models,
    /// KV precisions or backends never alias.
    cache_namespace: CacheNamespace,
    /// The KV connector, if one is attached (`set_connector`).
    connector: Option<Arc<dyn KvConnector>>,
    /// Built on the first request with a grammar (the token trie costs a moment).
    grammar: Option<crate::grammar::GrammarCompiler>,
    /// KVzip's scores of the last contexts it scored.
    kvzip_scores: crate::eviction::kvzip::ScoreCache,
}

impl Engine {
    /// Bytes of one KV block (every layer slot, K and V).
    pub fn kv_block_bytes(&self) -> usize {
        self.backend.kv().capacity_bytes() / self.sched.kv.pool().num_blocks() as usize
    }

    /// Bytes of the KV pool's blocks in use by sequences now (cached free blocks are free).
    pub fn kv_bytes_in_use(&self) -> usize {
        let pool = self.sched.kv.pool();
        (pool.num_blocks() - pool.num_free_blocks()) as usize * self.kv_block_bytes()
    }

    pub fn kv_manager(&self) -> &KvCacheManager {
        &self.sched.kv
    }

    /// The KV pool's data, whichever backend holds it.
    pub fn kv_store(&self) -> &dyn KvBlocks {
        self.backend.kv()
    }

    /// The model's shape (layers, heads, vocabulary, context length).
    pub fn model_config(&self) -> &ModelConfig {
        self.backend.config()
    }

    /// The backend running the model ("cpu", "cuda").
    pub fn backend(&self) -> &dyn Backend {
        &*self.backend
    }

    /// The CPU model, when the engine runs on the CPU (benchmarks that call it directly).
    pub fn cpu_model(&self) -> Option<&Llama> {
        self.backend.cpu_model()
    }

    /// Attaches the connector through which prompt KV is stored and reused across
    /// requests, restarts and servers (`pk_connectors` builds them, keyed by
    /// [`Engine::cache_namespace`]). Refused while requests are in flight, and on an
    /// engine with KV cache groups unless the connector stores them
    /// ([`KvConnector::supports_kv_groups`]: the chunk tiers do; a store of whole contexts
    /// writes every layer of every token, which a window group does not keep, so build its
    /// engine with `hybrid_kv_cache` off).
    pub fn set_connector(&mut self, connector: Arc<dyn KvConnector>) -> Result<()> {
        if self.has_work() {
            bail!("a KV connector is attached before requests arrive");
        }
        let grouped = self.sched.kv.window_spec().is_some();
        if grouped && !connector.supports_kv_groups() {
            bail!("this engine keeps sliding-window layers in KV cache groups of their own, which this KV connector does not store; build it with hybrid_kv_cache off");
        }
        if !grouped && connector.requires_kv_groups() {
            bail!("this KV connector stores KV by cache group, but this engine keeps one block table for every layer");
        }
        self.connector = Some(connector);
        Ok(())
    }

    /// The KV cache groups this engine keeps (`None`: one block table for every layer), for
    /// a connector that stores the groups' layers apart.
    pub fn kv_group_layout(&self) -> Option<pk_model::KvGroupLayout> {
        self.sched.kv.window_spec()?;
        self.backend.config().kv_group_layout()
    }

    /// The namespace every cache key of this engine is derived from (model identity, KV
    /// precision, backend): connectors key what they store under it.
    pub fn cache_namespace(&self) -> &CacheNamespace {
        &self.cache_namespace
    }

    /// Bytes of one token's K and V in every layer, in the pool's precision.
    pub fn kv_bytes_per_token(&self) -> usize {
        let g = self.backend.kv().geometry();
        g.bytes_per_token(self.config.kv_dtype)
    }

    /// The codec fingerprint of this engine's KV (model and KV precision).
    pub fn kv_fingerprint(&self) -> [u8; 32] {
        self.cache_namespace.kv_fingerprint()
    }

    pub fn num_running(&self) -> usize {
        self.sched.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.sched.waiting.len()
    }

    /// Running sequences that wait for KVzip's reconstruction passes over their prompt
    /// (run a piece per step beside the batch).
    pub fn num_kvzip_pending(&self) -> usize {
        self.sched
            .running
            .iter()
            .filter(|s| s.kvzip_pending())
            .count()
    }

    pub fn has_work(&self) -> bool {
        !self.sched.running.is_empty() || !self.sched.waiting.is_empty()
    }

    /// One engine iteration: the scheduler decides (admissions, preemptions, the batch),
    /// the executor runs the batch in one forward pass, the update applies its output.
    /// Returns the number of tokens run through the model.
    pub fn step(&mut self) -> usize {
        let mut kv_loads = loads::Loads {
            connector: self.connector.as_deref(),
            backend: &mut *self.backend,
        };
        let schedule = self.sched.schedule(&mut kv_loads);
        for (s, err) in schedule.failed {
            self.fail(s, err);
        }
        let sched_stats = &self.sched.stats;
        self.stats.preemptions = sched_stats.preemptions;
        self.stats.prefix_queries_tokens = sched_stats.prefix_queries_tokens;
        self.stats.prefix_hits_tokens = sched_stats.prefix_hits_tokens;
        let (chunks, pass_tokens) = (schedule.chunks, schedule.kvzip_pass_tokens);
        let pass_seq = schedule.kvzip_pass_seq;
        if chunks.is_empty() && pass_tokens == 0 {
            return 0;
        }
        self.stats.kv_bytes_peak = self.stats.kv_bytes_peak.max(self.kv_bytes_in_use());
        self.stats.max_running_seqs = self.stats.max_running_seqs.max(self.sched.running.len());
        let mut n_tokens = 0;
        if !chunks.is_empty() {
            n_tokens = self.execute_and_update(&chunks);
        }
        if let Some(seq) = pass_seq {
            n_tokens += self.advance_kvzip_run(seq, pass_tokens);
        }
        self.stats.steps += 1;
        n_tokens
    }

    /// Runs `chunks` and applies the output. A failed forward pass fails every scheduled
    /// request (a device error may have left the batch's K/V half-written).
    fn execute_and_update(&mut self, chunks: &[Chunk]) -> usize {
        // Indices into `running` stay valid through the update: it only appends (forked
        // choices) until finished sequences leave at its end.
        let index: Vec<usize> = chunks
            .iter()
            .map(|c| {
                self.sched
                    .index_of(c.seq)
                    .expect("a scheduled sequence runs")
            })
            .collect();
        let t0 = std::time::Instant::now();
        let seqs: Vec<&SeqState> = index.iter().map(|&i| &self.sched.running[i]).collect();
        let output = executor::execute(&mut *self.backend, &self.sched.kv, &seqs, chunks);
        drop(seqs);
        match output {
            Ok(out) => {
                self.observe_prefill(chunks, t0.elapsed().as_secs_f64());
                self.update(chunks, &index, out)
            }
            Err(e) => {
                tracing::error!("forward pass failed: {e}");
                for c in chunks {
                    if let Some(i) = self.sched.index_of(c.seq) {
                        let s = self.sched.running.remove(i);
                        self.fail(
                            s,
                            RequestError::Internal(format!("the forward pass failed: {e}")),
                        );
                    }
                }
                0
            }
        }
    }

    /// Tells the connector how fast prefill ran: a step of prompt chunks only times
    /// prefill (a decode's chunk is one token).
    fn observe_prefill(&mut self, chunks: &[Chunk], seconds: f64) {
        if chunks.iter().all(|c| c.n_tokens() > 1) {
            let tokens = chunks.iter().map(Chunk::n_tokens).sum();
            if let Some(r) = &self.connector {
                r.observe_prefill(tokens, seconds);
            }
        }
    }

    fn finish(&mut self, mut s: SeqState) {
        if let Some(r) = &self.connector {
            r.request_finished(s.request_key);
        }
        s.release_extra_kv(&mut self.sched.kv);
        if let Some(seq) = s.kv.seq.take() {
            self.sched.kv.free(seq);
        }
        self.stats.grammar_masks += s.sampling.grammar_masks;
        self.stats.grammar_mask_seconds += s.sampling.grammar_mask_seconds;
        if s.aborted {
            return;
        }
        let out = s.output();
        (s.req.sink)(SeqEvent::Finished(Box::new(out)));
    }

    fn fail(&mut self, mut s: SeqState, err: RequestError) {
        if let Some(r) = &self.connector {
            r.request_finished(s.request_key);
        }
        s.release_extra_kv(&mut self.sched.kv);
        if let Some(seq) = s.kv.seq.take() {
            self.sched.kv.free(seq);
        }
        (s.req.sink)(SeqEvent::Error(err));
    }

    /// Checks the KV manager's invariants (tests).
    pub fn check_invariants(&self) {
        self.sched.kv.check_invariants();
    }
}

/// The identity of a model file's contents, `blake3:` and the hex digest of its bytes: what
/// cache keys name instead of the file's name, which two different GGUFs can share. Reading
/// the file costs about a second per GB (BLAKE3 at memory speed; the pages are the ones the
/// weights are loaded from, so they are usually in the page cache already).
pub fn model_content_id(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = blake3::Hasher::new();
    h.update_reader(&mut f)
        .with_context(|| format!("reading {}", path.display()))?;
    Ok(format!("blake3:{}", h.finalize().to_hex()))
}
