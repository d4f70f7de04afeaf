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

use anyhow::{bail, Context, Result};
use pk_kv::KvCacheManager;
use pk_model::{Backend, CpuBackend, KvBlocks, KvDtype, KvGeometry, Llama, ModelConfig};
use pk_tokenizer::{ChatTemplate, Tokenizer};

use crate::eviction::EvictionStats;
use crate::executor;
use crate::namespace::CacheNamespace;
pub use crate::params::{
    EngineConfig, EngineStats, FinishReason, GenerateParams, SubmitError, MAX_CHOICES,
    MAX_LOGPROBS, PREFILL_TOKENS_PER_DECODE,
};
pub use crate::request::GenerateOutput;
use crate::request::{RequestError, SeqEvent};
use crate::reuse::{self, KvReuse};
use crate::scheduler::{Chunk, Limits, Scheduler};
use crate::sequence::SeqState;

mod direct;
mod evict;
mod loads;
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
    /// eviction policies, the reuse connector.
    backend: Box<dyn Backend>,
    /// Mixed into every block hash and stored key, so that caches of different models,
    /// KV precisions or backends never alias.
    cache_namespace: CacheNamespace,
    /// The KV reuse connector, if one is configured (`crate::reuse`).
    reuse: Option<Box<dyn KvReuse>>,
    /// Built on the first request with a grammar (the token trie costs a moment).
    grammar: Option<crate::grammar::GrammarCompiler>,
}

impl Engine {
    /// Loads a model file onto the CPU backend.
    pub fn load(model_path: &Path, config: EngineConfig) -> Result<Engine> {
        Engine::load_with(model_path, config, |gguf, geometry, dtype| {
            let model = Llama::from_gguf(gguf).context("building the model")?;
            Ok(Box::new(CpuBackend::new(model, geometry, dtype)))
        })
    }

    /// Loads a model file's tokenizer and chat template, and its weights through `build`,
    /// which makes a backend whose pool has the given geometry and dtype (the engine's
    /// settings applied to the file's model).
    pub fn load_with(
        model_path: &Path,
        config: EngineConfig,
        build: impl FnOnce(&pk_gguf::GgufFile, KvGeometry, KvDtype) -> Result<Box<dyn Backend>>,
    ) -> Result<Engine> {
        let gguf = pk_gguf::GgufFile::open(model_path)
            .with_context(|| format!("loading {}", model_path.display()))?;
        let geometry = config.kv_geometry(
            &ModelConfig::from_gguf(&gguf).context("reading the model's configuration")?,
        )?;
        let backend = build(&gguf, geometry, config.kv_dtype)?;
        let tokenizer = Tokenizer::from_gguf(&gguf).context("building the tokenizer")?;
        let chat_template = ChatTemplate::from_gguf(&gguf).context("reading the chat template")?;
        let name = model_path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let identity = model_content_id(model_path)?;
        Engine::with_backend_identified(backend, tokenizer, chat_template, config, &name, &identity)
    }

    /// An engine running `model` on the CPU.
    pub fn new(
        model: Llama,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate,
        config: EngineConfig,
        model_name: &str,
    ) -> Result<Engine> {
        let geometry = config.kv_geometry(&model.config)?;
        let backend = Box::new(CpuBackend::new(model, geometry, config.kv_dtype));
        Engine::with_backend(backend, tokenizer, chat_template, config, model_name)
    }

    /// An engine over any backend, whose pool must have `config.kv_geometry(backend.config())`
    /// and `config.kv_dtype`.
    pub fn with_backend(
        backend: Box<dyn Backend>,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate,
        config: EngineConfig,
        model_name: &str,
    ) -> Result<Engine> {
        Engine::with_backend_identified(
            backend,
            tokenizer,
            chat_template,
            config,
            model_name,
            model_name,
        )
    }

    /// [`Engine::with_backend`], with `model_identity` naming the weights in every cache
    /// key (the prefix cache's and the reuse connector's): [`model_content_id`] for a model
    /// file, so that two different files of the same name sharing a store never read each
    /// other's KV.
    pub fn with_backend_identified(
        backend: Box<dyn Backend>,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate,
        config: EngineConfig,
        model_name: &str,
        model_identity: &str,
    ) -> Result<Engine> {
        let geometry = Engine::check_pool(&*backend, &config)?;
        let bs = geometry.block_size_tokens;
        let (backend, window) = Engine::kv_cache_groups(backend, &config)?;
        let num_blocks = backend.kv().geometry().num_blocks;
        let kv = KvCacheManager::with_windows(num_blocks as u32, bs as u32, window);
        let limits = Limits::new(&config, backend.config().vocab_size);
        let cache_namespace = CacheNamespace::new(model_identity, config.kv_dtype, backend.name());
        let reuse = match &config.reuse {
            Some(r) => Some(reuse::open(
                r,
                model_name,
                &cache_namespace,
                bs,
                geometry.bytes_per_token(config.kv_dtype),
            )?),
            None => None,
        };
        Ok(Engine {
            eviction_stats: Default::default(),
            tokenizer,
            chat_template,
            config,
            model_name: model_name.to_string(),
            stats: EngineStats::default(),
            sched: Scheduler::new(kv, limits),
            backend,
            cache_namespace,
            reuse,
            grammar: None,
        })
    }

    /// Checks the settings and that `backend`'s pool has the geometry and dtype they give;
    /// returns that geometry.
    fn check_pool(backend: &dyn Backend, config: &EngineConfig) -> Result<KvGeometry> {
        let geometry = config.kv_geometry(backend.config())?;
        if config.max_batch_tokens == 0 || config.max_running_seqs == 0 {
            bail!("max_batch_tokens and max_running_seqs must be at least 1");
        }
        let interval = config.prefill_prune_interval_tokens;
        if interval != 0 && interval < config.block_size_tokens as usize {
            bail!(
                "prefill_prune_interval_tokens ({interval}) must be 0 (off) or at least the block size ({} tokens)",
                config.block_size_tokens
            );
        }
        let pool = backend.kv().geometry();
        let shape = |g: &KvGeometry| {
            (
                g.n_layers,
                g.n_kv_heads,
                g.head_dim,
                g.block_size_tokens,
                g.num_blocks,
            )
        };
        if shape(&pool) != shape(&geometry) || backend.kv().dtype() != config.kv_dtype {
            bail!("the {} backend's KV pool ({pool:?}, {}) is not the configured one ({geometry:?}, {})", backend.name(), backend.kv().dtype(), config.kv_dtype);
        }
        let (num_blocks, bs) = (geometry.num_blocks, geometry.block_size_tokens);
        tracing::info!(
            "KV cache ({}): {num_blocks} blocks x {bs} tokens = {} tokens, {:.1} MiB ({:?})",
            backend.name(),
            num_blocks * bs,
            backend.kv().capacity_bytes() as f64 / (1 << 20) as f64,
            config.kv_dtype
        );
        Ok(geometry)
    }

    /// Sets up KV cache groups when the model and settings allow (see
    /// `EngineConfig::hybrid_kv_cache`): the pool is rebuilt with blocks of the group size,
    /// as many as keep its bytes, and the manager gets the window groups.
    fn kv_cache_groups(
        mut backend: Box<dyn Backend>,
        config: &EngineConfig,
    ) -> Result<(Box<dyn Backend>, Option<pk_kv::WindowSpec>)> {
        let wanted = config.hybrid_kv_cache && config.reuse.is_none();
        let Some(layout) = backend.config().kv_group_layout().filter(|_| wanted) else {
            return Ok((backend, None));
        };
        let g = backend.kv().geometry();
        let num_blocks = g.num_blocks * g.n_layers / layout.layers_per_block;
        if let Err(e) = backend.use_kv_groups(&layout, num_blocks) {
            tracing::info!("one KV cache group: {e}");
            return Ok((backend, None));
        }
        tracing::info!(
            "KV cache groups: {} full-attention layers and {} window groups of up to {} layers ({} tokens), {num_blocks} blocks of {} layers",
            layout.layers_per_block,
            layout.num_window_groups,
            layout.layers_per_block,
            layout.window_tokens,
            layout.layers_per_block
        );
        let window = pk_kv::WindowSpec {
            num_groups: layout.num_window_groups as u32,
            window_tokens: layout.window_tokens as u32,
        };
        Ok((backend, Some(window)))
    }

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

    /// The KV reuse connector, for the accessors each connector's module adds to `Engine`.
    pub(crate) fn reuse_connector(&self) -> Option<&dyn KvReuse> {
        self.reuse.as_deref()
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

    pub fn has_work(&self) -> bool {
        !self.sched.running.is_empty() || !self.sched.waiting.is_empty()
    }

    /// One engine iteration: the scheduler decides (admissions, preemptions, the batch),
    /// the executor runs the batch in one forward pass, the update applies its output.
    /// Returns the number of tokens run through the model.
    pub fn step(&mut self) -> usize {
        let mut kv_loads = loads::Loads {
            reuse: self.reuse.as_deref_mut(),
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
        let chunks = schedule.chunks;
        if chunks.is_empty() {
            return 0;
        }
        self.stats.kv_bytes_peak = self.stats.kv_bytes_peak.max(self.kv_bytes_in_use());
        self.stats.max_running_seqs = self.stats.max_running_seqs.max(self.sched.running.len());
        let n_tokens = self.execute_and_update(&chunks);
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
            if let Some(r) = self.reuse.as_mut() {
                r.observe_prefill(tokens, seconds);
            }
        }
    }

    fn finish(&mut self, mut s: SeqState) {
        if let Some(r) = self.reuse.as_mut() {
            r.request_finished(&s.reuse);
        }
        if let Some(seq) = s.seq.take() {
            self.sched.kv.free(seq);
        }
        self.stats.grammar_masks += s.grammar_masks;
        self.stats.grammar_mask_seconds += s.grammar_mask_seconds;
        if s.aborted {
            return;
        }
        let out = s.output();
        (s.req.sink)(SeqEvent::Finished(Box::new(out)));
    }

    fn fail(&mut self, mut s: SeqState, err: RequestError) {
        if let Some(r) = self.reuse.as_mut() {
            r.request_finished(&s.reuse);
        }
        if let Some(seq) = s.seq.take() {
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
