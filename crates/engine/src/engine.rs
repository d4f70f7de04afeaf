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

use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use pk_kv::{KvCacheManager, KvGranularity, PolicySpec, SeqId};
use pk_model::{
    Backend, CpuBackend, KvBlocks, KvDtype, KvGeometry, Llama, ModelConfig, SeqForward,
};
use pk_tokenizer::{ChatTemplate, Tokenizer};

use crate::contexts::{
    self, ContextReuse, ContextReuseConfig, ContextReuseStats, PrefixKv, SeqContext,
};
use crate::eviction::{self, EvictionStats, SeqEviction};
use crate::request::{Request, RequestError, SeqEvent};
use crate::sampler::SamplingParams;
use crate::sequence::SeqState;
use crate::tiering::{Tiering, TieringConfig, TieringStats};

mod direct;

/// Prompt tokens a step may carry per decoding sequence beside it (see
/// `EngineConfig::max_prefill_tokens_while_decoding`), so a step's rows stay within five
/// times its decodes' (measured with `bench serve`, BENCHMARKS.md).
pub const PREFILL_TOKENS_PER_DECODE: usize = 4;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub block_size_tokens: u32,
    pub kv_dtype: KvDtype,
    /// Capacity of the KV pool in tokens (rounded up to whole blocks). Defaults to the
    /// model's context length.
    pub kv_capacity_tokens: Option<usize>,
    /// Upper bound on tokens per forward call; bounds activation memory and step latency.
    pub max_batch_tokens: usize,
    /// Prompt tokens a step may carry while any sequence is decoding (chunked prefill with
    /// decode priority, as vLLM schedules): a step's time is what every decoding stream
    /// waits between two tokens, so a large prompt chunk beside the decodes is the ITL
    /// tail. The cap is this or `PREFILL_TOKENS_PER_DECODE` per decoding sequence, whichever
    /// is larger. Prefill alone still runs in chunks of `max_batch_tokens`.
    pub max_prefill_tokens_while_decoding: usize,
    /// Upper bound on sequences decoding at once.
    pub max_running_seqs: usize,
    /// Upper bound on requests waiting for admission; `submit` refuses beyond it.
    pub max_waiting_requests: usize,
    /// Policy for requests that give a budget but no policy.
    pub default_kv_policy: PolicySpec,
    /// Budget applied to requests that give none (`None`: no eviction by default).
    pub default_kv_budget: Option<u32>,
    /// Eviction granularity for requests that give none.
    pub default_kv_granularity: KvGranularity,
    /// Tiers below the pool for reusing prompt KV across requests, restarts and servers.
    pub tiering: Option<TieringConfig>,
    /// Whole-context reuse through an EVICPRESS store (`--tier-policy evicpress`); exclusive
    /// with `tiering`.
    pub contexts: Option<ContextReuseConfig>,
    /// Reuse computed blocks across requests through the pool's prefix cache (vLLM's
    /// automatic prefix caching; on by default). Benchmarks of the tiers turn it off so
    /// that every reuse is a load.
    pub enable_prefix_caching: bool,
    /// Give a model's sliding-window layers KV cache groups of their own, whose blocks
    /// behind the window are released (vLLM's hybrid KV cache manager; on by default).
    /// It applies to CPU models with both global and windowed layers (Gemma 3) and is
    /// off whenever stored KV is reused across requests (`tiering`, `contexts`), which
    /// stores every layer of every token, as vLLM turns it off under a KV connector.
    pub hybrid_kv_cache: bool,
}

impl std::fmt::Debug for TieringConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TieringConfig")
            .field("chunk_size_tokens", &self.chunk_size_tokens)
            .field("max_pending_bytes", &self.max_pending_bytes)
            .finish()
    }
}

impl EngineConfig {
    /// The KV pool's shape for `model` under these settings: what a backend's pool must
    /// have for [`Engine::with_backend`] to accept it.
    pub fn kv_geometry(&self, model: &ModelConfig) -> Result<KvGeometry> {
        let bs = self.block_size_tokens as usize;
        if !(1..=256).contains(&bs) {
            bail!("block size must be between 1 and 256 tokens, got {bs}");
        }
        let capacity_tokens = self.kv_capacity_tokens.unwrap_or(model.context_length);
        let num_blocks = capacity_tokens.div_ceil(bs).max(1);
        Ok(KvGeometry {
            n_layers: model.n_layers,
            n_kv_heads: model.n_kv_heads,
            head_dim: model.head_dim,
            block_size_tokens: bs,
            num_blocks,
        })
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size_tokens: 16,
            kv_dtype: KvDtype::F16,
            kv_capacity_tokens: None,
            max_batch_tokens: 512,
            max_prefill_tokens_while_decoding: 64,
            max_running_seqs: 32,
            max_waiting_requests: 256,
            default_kv_policy: PolicySpec::default(),
            default_kv_budget: None,
            default_kv_granularity: KvGranularity::Shared,
            tiering: None,
            contexts: None,
            enable_prefix_caching: true,
            hybrid_kv_cache: true,
        }
    }
}

#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// KV eviction policy; `None` means the engine's default (`full` unless a budget is
    /// given, then the engine's default evicting policy).
    pub kv_policy: Option<PolicySpec>,
    /// Per-sequence KV budget in tokens (the same for every layer).
    pub kv_budget: Option<u32>,
    /// Which parts of the model choose their kept tokens together (`shared`, per `layer`,
    /// per KV `head`); `None` means the engine's default.
    pub kv_granularity: Option<KvGranularity>,
    /// The budget bounds the prompt only: every token generated (or forced) after it is
    /// kept, as kvpress's presses compress the context at prefill and leave decode alone.
    /// Evaluation uses it to compare with kvpress's numbers (`eval --text-kl-keep-continuation`).
    pub kv_keep_generated: bool,
    /// Teacher forcing: generated token i is `forced_tokens[i]` instead of a sample (while
    /// there are any), so that two cache configurations can be compared on the same text.
    pub forced_tokens: Vec<u32>,
    /// Send each step's full logits as `SeqEvent::Logits` before its token (evaluation).
    pub return_logits: bool,
    /// The KV of the prompt's first `n_tokens()` tokens, given instead of computed (possibly
    /// compressed: fewer tokens, original positions). Profiling and evaluation of stored
    /// contexts use it; such a sequence never feeds the prefix cache.
    pub prefix_kv: Option<Arc<PrefixKv>>,
    /// Background work (EVICPRESS profiling): admitted after every waiting request that is
    /// not background, so that idle-time work never delays a user's request in the queue.
    pub background: bool,
    /// End-of-generation tokens cannot be sampled before this many tokens are generated
    /// (vLLM's `min_tokens`).
    pub min_tokens: usize,
    /// Constrain the output to a grammar (structured output): every sampled token keeps
    /// the text a prefix of the grammar's language, and the text ends only where it is
    /// complete.
    pub grammar: Option<crate::grammar::Grammar>,
    /// Choices to generate from one prompt (OpenAI's `n`): the prompt is computed once and
    /// its blocks forked (copy-on-write) into `n` sequences. At most `MAX_CHOICES`.
    pub n: usize,
    /// Report each generated token's log-probability and this many most likely
    /// alternatives (`Some(0)`: the token's alone); at most `MAX_LOGPROBS`.
    pub logprobs: Option<usize>,
}

/// The most alternatives per token `GenerateParams::logprobs` may ask for (OpenAI's
/// `top_logprobs` limit).
pub const MAX_LOGPROBS: usize = 20;

/// The most choices one request may ask for (`GenerateParams::n`).
pub const MAX_CHOICES: usize = 16;

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            sampling: SamplingParams::default(),
            max_tokens: 128,
            stop: Vec::new(),
            ignore_eos: false,
            kv_policy: None,
            kv_budget: None,
            kv_granularity: None,
            kv_keep_generated: false,
            forced_tokens: Vec::new(),
            return_logits: false,
            prefix_kv: None,
            background: false,
            min_tokens: 0,
            logprobs: None,
            n: 1,
            grammar: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
}

/// Result of a blocking `generate` call.
#[derive(Debug, Clone)]
pub struct GenerateOutput {
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    pub cached_prompt_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    pub kv_stored_tokens: usize,
    /// Bytes of the KV blocks the sequence held when it finished (its main table's and
    /// its window groups'), shared blocks included.
    pub kv_bytes: usize,
    /// Per generated token, with `GenerateParams::logprobs`.
    pub logprobs: Vec<crate::sampler::TokenLogprob>,
    /// Where a stored context came from (EVICPRESS store), if one was loaded.
    pub context_load: Option<pk_evicpress::LoadReport>,
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the request queue is full ({0} waiting); retry later")]
    QueueFull(usize),
    #[error("invalid request: {0}")]
    Invalid(String),
    /// Invalid because of one request field, named as the API names it (`kv_budget`).
    #[error("invalid request: {message}")]
    InvalidParam {
        param: &'static str,
        message: String,
    },
    /// The engine thread is gone (it panicked or shut down): nothing will serve the request.
    #[error("the engine has stopped")]
    Stopped,
}

/// Counters for observability; monotonically increasing except the gauges.
#[derive(Debug, Default, Clone)]
pub struct EngineStats {
    pub prefix_queries_tokens: u64,
    pub prefix_hits_tokens: u64,
    pub preemptions: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub steps: u64,
    /// The most bytes of KV blocks in use at once (after a step's allocation).
    pub kv_bytes_peak: usize,
    /// The most sequences running in one step.
    pub max_running_seqs: usize,
    /// Token masks computed for grammars (structured output), and their time.
    pub grammar_masks: u64,
    pub grammar_mask_seconds: f64,
}

pub struct Engine {
    /// What eviction did, per policy name.
    pub eviction_stats: std::collections::BTreeMap<String, EvictionStats>,
    pub tokenizer: Tokenizer,
    pub chat_template: ChatTemplate,
    pub config: EngineConfig,
    pub model_name: String,
    pub stats: EngineStats,
    kv: KvCacheManager,
    /// The forward pass and the pool of K/V bytes it writes (CPU or GPU). Everything that
    /// decides which block holds what stays here on the host: `kv`, the sequences, the
    /// eviction policies, the tiers.
    backend: Box<dyn Backend>,
    /// Bytes mixed into every block hash so that caches of different models or KV
    /// precisions never alias.
    cache_namespace: Vec<u8>,
    next_seq: u64,
    tiering: Option<Tiering>,
    contexts: Option<ContextReuse>,
    waiting: VecDeque<SeqState>,
    /// In admission order; preemption takes from the back.
    running: Vec<SeqState>,
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
    /// key (the prefix cache's and the tiers'): [`model_content_id`] for a model file, so
    /// that two different files of the same name sharing a disk or Redis tier never read
    /// each other's KV.
    pub fn with_backend_identified(
        backend: Box<dyn Backend>,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate,
        config: EngineConfig,
        model_name: &str,
        model_identity: &str,
    ) -> Result<Engine> {
        let geometry = config.kv_geometry(backend.config())?;
        if config.max_batch_tokens == 0 || config.max_running_seqs == 0 {
            bail!("max_batch_tokens and max_running_seqs must be at least 1");
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
        let (backend, window) = Engine::kv_cache_groups(backend, &config)?;
        let num_blocks = backend.kv().geometry().num_blocks;
        let kv = KvCacheManager::with_windows(num_blocks as u32, bs as u32, window);
        // Backends compute K/V with different arithmetic (the GPU's f16 GEMMs against the
        // CPU's 8-bit activations), so blocks and stored chunks are never shared between
        // them: a sequence's bits must not depend on where its prefix was computed.
        let mut namespace = format!("{model_identity}|{:?}", config.kv_dtype);
        if backend.name() != "cpu" {
            namespace.push('|');
            namespace.push_str(backend.name());
        }
        let cache_namespace = namespace.into_bytes();
        let tiering = match &config.tiering {
            Some(t) => Some(Tiering::new(
                t,
                model_name,
                &cache_namespace,
                bs,
                geometry.bytes_per_token(config.kv_dtype),
            )?),
            None => None,
        };
        let contexts = match &config.contexts {
            Some(_) if tiering.is_some() => bail!(
                "chunk tiers and an EVICPRESS context store are exclusive (pick one --tier-policy)"
            ),
            Some(c) => Some(ContextReuse::new(c, model_name, &cache_namespace, bs)?),
            None => None,
        };
        Ok(Engine {
            eviction_stats: Default::default(),
            tokenizer,
            chat_template,
            config,
            model_name: model_name.to_string(),
            stats: EngineStats::default(),
            kv,
            backend,
            cache_namespace,
            next_seq: 0,
            tiering,
            contexts,
            waiting: VecDeque::new(),
            running: Vec::new(),
            grammar: None,
        })
    }

    /// Sets up KV cache groups when the model and settings allow (see
    /// `EngineConfig::hybrid_kv_cache`): the pool is rebuilt with blocks of the group size,
    /// as many as keep its bytes, and the manager gets the window groups.
    fn kv_cache_groups(
        mut backend: Box<dyn Backend>,
        config: &EngineConfig,
    ) -> Result<(Box<dyn Backend>, Option<pk_kv::WindowSpec>)> {
        let wanted =
            config.hybrid_kv_cache && config.tiering.is_none() && config.contexts.is_none();
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
        self.backend.kv().capacity_bytes() / self.kv.pool().num_blocks() as usize
    }

    /// Bytes of the KV pool's blocks in use by sequences now (cached free blocks are free).
    pub fn kv_bytes_in_use(&self) -> usize {
        let pool = self.kv.pool();
        (pool.num_blocks() - pool.num_free_blocks()) as usize * self.kv_block_bytes()
    }

    pub fn kv_manager(&self) -> &KvCacheManager {
        &self.kv
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

    /// What the tiers did for this engine, if configured.
    pub fn tiering_stats(&self) -> Option<TieringStats> {
        self.tiering.as_ref().map(|t| t.stats.clone())
    }

    /// The EVICPRESS store, if configured.
    /// How profiling scores configurations (the default when no store is configured).
    pub fn profile_metric(&self) -> crate::profiler::QualityMetric {
        self.contexts
            .as_ref()
            .map_or_else(Default::default, |c| c.profile_metric)
    }

    pub fn context_store(&self) -> Option<Arc<pk_evicpress::ContextStore>> {
        self.contexts.as_ref().map(|c| c.store.clone())
    }

    /// The store key of the context made of exactly `tokens` (a multiple of the chunk
    /// size), as a request with `salt` would compute it at admission.
    pub fn context_key(&self, tokens: &[u32], salt: Option<&str>) -> Option<pk_tiers::ChunkKey> {
        let c = self.contexts.as_ref()?;
        if tokens.is_empty() || tokens.len() % c.chunk_size_tokens() != 0 {
            return None;
        }
        let mut with_query = tokens.to_vec();
        with_query.push(0);
        c.keys(&with_query, salt).last().copied()
    }

    pub fn context_stats(&self) -> Option<ContextReuseStats> {
        self.contexts.as_ref().map(|c| c.stats.clone())
    }

    /// The codec fingerprint of this engine's KV (model and KV precision).
    pub fn kv_fingerprint(&self) -> [u8; 32] {
        contexts::kv_fingerprint(&self.cache_namespace)
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// A matcher for a request's grammar (compiled now, so that a bad one is refused at
    /// submission, naming its field).
    fn grammar_matcher(
        &mut self,
        g: &crate::grammar::Grammar,
        p: &GenerateParams,
    ) -> Result<llguidance::Matcher, SubmitError> {
        let invalid = |message: String| SubmitError::InvalidParam {
            param: g.param,
            message,
        };
        if !p.forced_tokens.is_empty() || p.ignore_eos {
            return Err(invalid(
                "a grammar cannot constrain forced tokens or run past end-of-generation (ignore_eos)".into(),
            ));
        }
        if self.grammar.is_none() {
            let t0 = std::time::Instant::now();
            let compiler =
                crate::grammar::GrammarCompiler::new(std::sync::Arc::new(self.tokenizer.clone()))
                    .map_err(|e| invalid(format!("the grammar engine could not start: {e}")))?;
            tracing::info!(
                "grammar engine ready in {:.2} s",
                t0.elapsed().as_secs_f64()
            );
            self.grammar = Some(compiler);
        }
        let compiler = self.grammar.as_ref().expect("built above");
        compiler
            .matcher(&g.spec)
            .map_err(|e| invalid(format!("{} cannot be compiled: {e}", g.param)))
    }

    fn new_seq_id(&mut self) -> SeqId {
        self.next_seq += 1;
        SeqId(self.next_seq)
    }

    /// Queues a request. Validation errors and a full queue are refused immediately.
    pub fn submit(&mut self, req: Request) -> Result<(), SubmitError> {
        if self.waiting.len() >= self.config.max_waiting_requests {
            return Err(SubmitError::QueueFull(self.waiting.len()));
        }
        if req.prompt_ids.is_empty() {
            return Err(SubmitError::Invalid("the prompt is empty".into()));
        }
        req.params
            .sampling
            .validate()
            .map_err(|e| SubmitError::InvalidParam {
                param: e.param,
                message: e.message,
            })?;
        let vocab = self.backend.config().vocab_size;
        if let Some((id, _)) = req
            .params
            .sampling
            .logit_bias
            .iter()
            .find(|(id, _)| *id as usize >= vocab)
        {
            return Err(SubmitError::InvalidParam {
                param: "logit_bias",
                message: format!("logit_bias names token {id}, outside the vocabulary of {vocab}"),
            });
        }
        if req.params.logprobs.is_some_and(|n| n > MAX_LOGPROBS) {
            return Err(SubmitError::InvalidParam {
                param: "top_logprobs",
                message: format!("at most {MAX_LOGPROBS} alternatives per token"),
            });
        }
        let n = req.params.n;
        if n == 0 || n > MAX_CHOICES {
            return Err(SubmitError::InvalidParam {
                param: "n",
                message: format!("n must be in [1, {MAX_CHOICES}], got {n}"),
            });
        }
        if n > 1 {
            let p = &req.params;
            let clash = [
                (!p.forced_tokens.is_empty(), "forced tokens"),
                (p.return_logits, "returned logits"),
                (p.prefix_kv.is_some(), "prefix_kv"),
                (p.kv_policy.as_ref().is_some_and(|s| s.evicts()) || p.kv_budget.is_some(), "an evicting kv_policy or a kv_budget (choices share the prompt's blocks, which eviction rewrites)"),
            ]
            .into_iter()
            .find(|c| c.0);
            if let Some((_, what)) = clash {
                return Err(SubmitError::InvalidParam {
                    param: "n",
                    message: format!("n > 1 cannot be combined with {what}"),
                });
            }
        }
        if req.params.min_tokens > req.params.max_tokens {
            return Err(SubmitError::InvalidParam {
                param: "min_tokens",
                message: format!(
                    "min_tokens {} exceeds max_tokens {}",
                    req.params.min_tokens, req.params.max_tokens
                ),
            });
        }
        let ctx = self.backend.config().context_length;
        if req.prompt_ids.len() >= ctx {
            return Err(SubmitError::Invalid(format!(
                "the prompt has {} tokens; the model's context is {ctx}",
                req.prompt_ids.len()
            )));
        }
        if let Some(&bad) = req
            .prompt_ids
            .iter()
            .find(|&&t| t as usize >= self.backend.config().vocab_size)
        {
            return Err(SubmitError::Invalid(format!(
                "token id {bad} is outside the vocabulary"
            )));
        }
        let eviction = self.eviction_for(&req.params)?;
        if let Some(p) = &req.params.prefix_kv {
            if self.kv.window_spec().is_some() {
                return Err(SubmitError::InvalidParam {
                    param: "prefix_kv".into(),
                    message: "prefix_kv writes every layer of every token, but this engine keeps sliding-window layers in KV cache groups of their own; build it with hybrid_kv_cache off".into(),
                });
            }
            let g = self.backend.kv().geometry();
            if p.n_tokens() >= req.prompt_ids.len()
                || p.kv
                    .positions
                    .last()
                    .is_some_and(|&x| x as usize >= p.n_tokens())
            {
                return Err(SubmitError::Invalid(format!(
                    "prefix_kv covers {} tokens of a {}-token prompt",
                    p.n_tokens(),
                    req.prompt_ids.len()
                )));
            }
            if (p.kv.n_layers, p.kv.n_kv_heads, p.kv.head_dim)
                != (g.n_layers, g.n_kv_heads, g.head_dim)
            {
                return Err(SubmitError::Invalid(
                    "prefix_kv has another model's shape".into(),
                ));
            }
            if eviction.is_some() {
                return Err(SubmitError::Invalid(
                    "prefix_kv and an evicting kv_policy are exclusive".into(),
                ));
            }
        }
        let mut namespace = self.cache_namespace.clone();
        if let Some(salt) = &req.cache_salt {
            namespace.extend_from_slice(b"|salt|");
            namespace.extend_from_slice(salt.as_bytes());
        }
        let matcher = match &req.params.grammar {
            Some(g) => Some(self.grammar_matcher(g, &req.params)?),
            None => None,
        };
        let background = req.params.background;
        let mut state = SeqState::new(req, namespace);
        state.eviction = eviction;
        state.matcher = matcher;
        let at = if background {
            self.waiting.len()
        } else {
            self.waiting
                .iter()
                .position(|s| s.req.params.background)
                .unwrap_or(self.waiting.len())
        };
        self.waiting.insert(at, state);
        Ok(())
    }

    /// Resolves a request's policy and budget against the engine defaults.
    fn eviction_for(&self, p: &GenerateParams) -> Result<Option<SeqEviction>, SubmitError> {
        let invalid =
            |param: &'static str, message: String| SubmitError::InvalidParam { param, message };
        let budget = p.kv_budget.or(self.config.default_kv_budget);
        let spec = match (p.kv_policy, budget) {
            (Some(spec), _) => spec,
            (None, Some(_)) => self.config.default_kv_policy,
            (None, None) => return Ok(None),
        };
        if !spec.evicts() {
            if p.kv_budget.is_some() {
                return Err(invalid(
                    "kv_budget",
                    format!("kv_policy {spec} keeps every token and takes no kv_budget"),
                ));
            }
            return Ok(None);
        }
        let Some(budget) = budget else {
            return Err(invalid(
                "kv_budget",
                format!("kv_policy {spec} needs a kv_budget (tokens kept per sequence)"),
            ));
        };
        spec.validate(budget, self.config.block_size_tokens)
            .map_err(|e| invalid("kv_budget", e.to_string()))?;
        if spec.build().prefill_queries() != pk_kv::QueryNeed::None
            || spec.build().decode_queries() != pk_kv::QueryNeed::None
        {
            if !self.capture_supported() {
                return Err(invalid("kv_policy", format!("kv_policy {spec} needs attention queries, which this build does not capture yet")));
            }
        }
        let granularity = p
            .kv_granularity
            .unwrap_or(self.config.default_kv_granularity);
        let c = self.backend.config();
        let mut units = pk_kv::selection_units(granularity, c.n_layers, c.n_kv_heads, |layer| {
            c.layer_window(layer).is_some()
        });
        if self.kv.window_spec().is_some() {
            // Windowed layers have tables of their own, bounded already: eviction chooses
            // for the full-attention layers only.
            for unit in &mut units {
                unit.layers.retain(|&layer| c.layer_window(layer).is_none());
            }
            units.retain(|unit| !unit.layers.is_empty());
        }
        let mut ev = SeqEviction::new(spec, budget, granularity, units);
        ev.keep_generated = p.kv_keep_generated;
        Ok(Some(ev))
    }

    fn capture_supported(&self) -> bool {
        true
    }

    /// Blocks needed to compute `n_tokens` more tokens, plus one block of headroom for decode.
    /// With window groups, their blocks while the sequence computes are added.
    fn blocks_for(&self, n_tokens: usize) -> usize {
        let window = self
            .kv
            .window_blocks_bound(n_tokens as u64, self.config.max_batch_tokens as u64);
        n_tokens.div_ceil(self.config.block_size_tokens as usize) + 1 + window as usize
    }

    /// Blocks that running sequences still in their prompt will allocate before the prompt
    /// is in (no credit for a partly filled last block). Admission keeps them free: a long
    /// prompt admitted beside another one still prefilling would otherwise run the pool out
    /// halfway through both and preempt one. This matters most under eviction, where a
    /// prompt of T tokens holds T tokens of blocks only until its last chunk is pruned to
    /// the budget: exact prefill (every prompt token attends to the whole prompt, as
    /// PagedEviction's spec requires) needs all T at once, so such peaks are taken one
    /// after another while the pruned sequences decode beside them.
    fn reserved_prefill_blocks(&self) -> usize {
        let block = self.config.block_size_tokens as usize;
        self.running
            .iter()
            .filter(|s| s.num_computed < s.n_prompt)
            .map(|s| (s.n_prompt - s.num_computed).div_ceil(block))
            .sum()
    }

    /// Moves waiting requests into the running set while blocks and slots allow.
    fn admit(&mut self) {
        while self.running.len() < self.config.max_running_seqs {
            self.probe_tiers_for_front();
            let Some(front) = self.waiting.front() else {
                break;
            };
            let prefix = match self.config.enable_prefix_caching {
                true => self
                    .kv
                    .get_computed_prefix(&front.all_ids, &front.namespace),
                false => self.kv.get_computed_prefix(&[], &front.namespace),
            };
            let cached = prefix.num_cached_tokens() as usize;
            // Tiers are consulted for non-evicting sequences; they win when they hold a
            // longer prefix than the pool.
            let (tier_keys, tier_found) = match (&front.tier_probe, &front.eviction) {
                (Some((_, keys, found)), None) => (keys.clone(), *found),
                _ => (Vec::new(), 0),
            };
            let (context_hit, context_offer) = self.context_lookup(cached);
            let Some(front) = self.waiting.front() else {
                break;
            };
            let preloading = context_hit.is_some()
                || (front.req.params.prefix_kv.is_some() && front.eviction.is_none());
            let use_tiers = !preloading
                && tier_found * self.tiering.as_ref().map_or(0, |t| t.chunk_size_tokens()) > cached;
            let needed = if use_tiers || preloading {
                self.blocks_for(front.all_ids.len())
            } else {
                self.blocks_for(front.all_ids.len() - cached) + prefix.block_ids().len()
            };
            let total = self.kv.pool().num_blocks() as usize;
            if needed > total && self.running.is_empty() {
                let mut s = self.waiting.pop_front().expect("front exists");
                let msg = format!(
                    "the request needs {} KV blocks of {} tokens but the cache has only {total}",
                    needed, self.config.block_size_tokens
                );
                (s.req.sink)(SeqEvent::Error(RequestError::TooLarge(msg)));
                continue;
            }
            let free = (self.kv.pool().num_free_blocks() as usize)
                .saturating_sub(self.reserved_prefill_blocks());
            if needed > free {
                break;
            }
            let mut s = self.waiting.pop_front().expect("front exists");
            let seq = self.new_seq_id();
            if preloading {
                if let Some(adopted) = self.admit_preloaded(&mut s, seq, context_hit) {
                    self.start_running(s, seq, adopted);
                    continue;
                }
                // Not loadable: compute the prompt as usual (from the pool's prefix).
            }
            s.context = SeqContext {
                offer: context_offer,
                ..Default::default()
            };
            let adopted = if use_tiers {
                let empty = self.kv.get_computed_prefix(&[], &s.namespace);
                self.kv.add_sequence(seq, &empty);
                let tiering = self.tiering.as_mut().expect("tiers configured");
                tiering.load_into(
                    &tier_keys[..tier_found],
                    &mut self.kv,
                    self.backend.kv_mut(),
                    seq,
                )
            } else {
                self.kv.add_sequence(seq, &prefix) as usize
            };
            // Chunks already in the tiers are not stored again.
            s.tier_next_chunk = if use_tiers {
                adopted / self.tiering.as_ref().map_or(1, |t| t.chunk_size_tokens())
            } else {
                tier_found
            };
            s.tier_keys = tier_keys;
            self.start_running(s, seq, adopted);
        }
    }

    /// Asks the tiers for the head of the queue, once per waiting request (and again only
    /// after a preemption has changed its tokens): while the head waits for blocks, each
    /// step would otherwise re-hash its prompt and make a Redis round trip.
    fn probe_tiers_for_front(&mut self) {
        if let (Some(t), Some(front)) = (self.tiering.as_mut(), self.waiting.front_mut()) {
            if front.eviction.is_none()
                && front
                    .tier_probe
                    .as_ref()
                    .is_none_or(|p| p.0 != front.all_ids.len())
            {
                let keys = t.keys(&front.all_ids, front.req.cache_salt.as_deref());
                let found = t.lookup(&keys);
                front.tier_probe = Some((front.all_ids.len(), keys, found));
            }
        }
    }

    /// The EVICPRESS store's answer for the head of the queue: a stored context longer than
    /// the pool's `cached` prefix to load, or else (nothing stored) the key to offer its
    /// context under once computed. A given prefix KV wins over both.
    #[allow(clippy::type_complexity)]
    fn context_lookup(
        &mut self,
        cached: usize,
    ) -> (
        Option<(pk_tiers::ChunkKey, usize)>,
        Option<(pk_tiers::ChunkKey, usize)>,
    ) {
        let (Some(front), Some(c)) = (self.waiting.front(), self.contexts.as_mut()) else {
            return (None, None);
        };
        if front.eviction.is_some() || front.req.params.prefix_kv.is_some() {
            return (None, None);
        }
        let keys = c.keys(&front.all_ids, front.req.cache_salt.as_deref());
        match c.lookup(&keys) {
            Some((key, tokens)) if tokens > cached => (Some((key, tokens)), None),
            Some(_) => (None, None),
            None => (
                None,
                keys.last()
                    .map(|k| (*k, keys.len() * c.chunk_size_tokens())),
            ),
        }
    }

    /// An admitted sequence whose first `adopted` tokens are already in its cache.
    fn start_running(&mut self, mut s: SeqState, seq: pk_kv::SeqId, adopted: usize) {
        if s.preemptions == 0 {
            self.stats.prefix_queries_tokens += s.n_prompt as u64;
            self.stats.prefix_hits_tokens += adopted as u64;
            s.cached_prompt_tokens = adopted;
        }
        s.seq = Some(seq);
        s.num_computed = adopted;
        self.running.push(s);
    }

    /// Starts `seq` from a given prefix KV or a stored context. Returns the prompt tokens
    /// covered, or `None` (sequence not created) if the KV could not be loaded or placed.
    fn admit_preloaded(
        &mut self,
        s: &mut SeqState,
        seq: pk_kv::SeqId,
        hit: Option<(pk_tiers::ChunkKey, usize)>,
    ) -> Option<usize> {
        let (ctx, mut load, exact) = match (&s.req.params.prefix_kv, hit) {
            (Some(p), _) => (std::borrow::Cow::Borrowed(&p.kv), None, false),
            (None, Some((key, tokens))) => {
                let c = self.contexts.as_mut()?;
                let (kv, report) = c.load(&key, &s.all_ids[tokens..s.n_prompt])?;
                if kv.n_original_tokens != tokens {
                    return None;
                }
                let exact = kv.n_tokens() == tokens && report.config.starts_with("none-");
                (std::borrow::Cow::Owned(kv), Some(report), exact)
            }
            (None, None) => return None,
        };
        let empty = self.kv.get_computed_prefix(&[], &s.namespace);
        self.kv.add_sequence(seq, &empty);
        let t0 = std::time::Instant::now();
        if !contexts::write_prefix(&ctx, &mut self.kv, self.backend.kv_mut(), seq) {
            self.kv.free(seq);
            return None;
        }
        if let Some(l) = load.as_mut() {
            l.restore_s = t0.elapsed().as_secs_f64();
        }
        let n_original_tokens = ctx.n_original_tokens;
        // A compressed context keeps its tokens' original positions: sliding-window layers
        // need them (`SeqForward::stored_positions`).
        if ctx
            .positions
            .iter()
            .enumerate()
            .any(|(i, &p)| p as usize != i)
        {
            s.stored_positions = Some(ctx.positions.clone());
        }
        if let (std::borrow::Cow::Owned(kv), Some(c)) = (ctx, self.contexts.as_ref()) {
            c.recycle(kv);
        }
        s.context = SeqContext {
            inexact: !exact,
            offer: None,
            load,
        };
        Some(n_original_tokens)
    }

    /// Frees the most recently admitted running sequence other than `keep` and puts it
    /// back at the head of the queue. Returns its (former) sequence id.
    fn preempt_one(&mut self, keep: SeqId) -> Option<SeqId> {
        let victim = (0..self.running.len())
            .rev()
            .find(|&i| self.running[i].seq != Some(keep))?;
        let mut s = self.running.remove(victim);
        let seq = s.seq.take().expect("running sequences hold a block table");
        self.kv.free(seq);
        s.num_computed = 0;
        s.context = SeqContext::default();
        s.stored_positions = None;
        if let Some(ev) = s.eviction.as_mut() {
            ev.reset();
        }
        s.preemptions += 1;
        self.stats.preemptions += 1;
        tracing::debug!(
            "preempted a sequence ({} tokens) to free blocks",
            s.all_ids.len()
        );
        self.waiting.push_front(s);
        Some(seq)
    }

    /// One scheduler iteration. Returns the number of tokens run through the model.
    pub fn step(&mut self) -> usize {
        let mut aborted = Vec::new();
        self.running.retain_mut(|s| {
            if s.aborted {
                aborted.push(s.seq.take());
            }
            !s.aborted
        });
        for seq in aborted.into_iter().flatten() {
            self.kv.free(seq);
        }
        self.admit();
        if self.running.is_empty() {
            return 0;
        }
        // Plan: decode tokens first (one each), then prompt chunks, within the token budget.
        let mut order: Vec<(bool, SeqId)> = self
            .running
            .iter()
            .map(|s| (s.is_prefilling(), s.seq.expect("running")))
            .collect();
        order.sort_by_key(|&(prefilling, _)| prefilling);
        let mut budget = self.config.max_batch_tokens;
        let n_decoding = order.iter().filter(|&&(prefilling, _)| !prefilling).count();
        let mut plan: Vec<(SeqId, usize, usize)> = Vec::new(); // (seq, from, to) in all_ids
                                                               // Decodes are planned first (sorted above); prompt chunks beside them are capped.
                                                               // The cap grows with the decodes (PREFILL_TOKENS_PER_DECODE each): a step of many
                                                               // decodes is long already, and prompt rows beside them cost it proportionally less.
        let mut prefill_left = match n_decoding {
            0 => usize::MAX,
            n => self
                .config
                .max_prefill_tokens_while_decoding
                .max(PREFILL_TOKENS_PER_DECODE * n)
                .max(1),
        };
        for (prefilling, seq) in order {
            if budget == 0 {
                break;
            }
            let Some(i) = self.running.iter().position(|s| s.seq == Some(seq)) else {
                continue;
            };
            let (from, pending) = (
                self.running[i].num_computed,
                self.running[i].all_ids.len() - self.running[i].num_computed,
            );
            let take = if prefilling {
                pending.min(budget).min(prefill_left)
            } else {
                pending.min(budget)
            }
            .min(self.running[i].max_chunk());
            if take == 0 {
                continue;
            }
            let ok = loop {
                if self.kv.allocate_slots(seq, take as u32).is_some() {
                    break true;
                }
                // Out of blocks: preempt the newest other sequence and retry this one.
                match self.preempt_one(seq) {
                    Some(victim) => plan.retain(|p| p.0 != victim),
                    None => break false,
                }
            };
            if !ok {
                let i = self
                    .running
                    .iter()
                    .position(|s| s.seq == Some(seq))
                    .expect("still running");
                let s = self.running.remove(i);
                self.fail(s, RequestError::CacheFull("the KV cache is full even with every other sequence preempted; raise the KV capacity".into()));
                continue;
            }
            plan.push((seq, from, from + take));
            budget -= take;
            if prefilling {
                prefill_left -= take;
            }
        }
        if plan.is_empty() {
            return 0;
        }
        self.stats.kv_bytes_peak = self.stats.kv_bytes_peak.max(self.kv_bytes_in_use());
        self.stats.max_running_seqs = self.stats.max_running_seqs.max(self.running.len());
        let n_tokens = self.run_plan(&plan);
        self.stats.steps += 1;
        n_tokens
    }

    /// Executes a plan: one forward pass over every planned chunk, then each sequence's
    /// result is applied (`apply`). Returns the number of tokens run.
    fn run_plan(&mut self, plan: &[(SeqId, usize, usize)]) -> usize {
        let Some((logits, mut captured, capture)) = self.execute(plan) else {
            return 0;
        };
        let vocab = self.backend.config().vocab_size;
        let mut row = 0;
        let mut n_tokens = 0;
        let mut finished = Vec::new();
        for (k, &(seq, from, to)) in plan.iter().enumerate() {
            n_tokens += to - from;
            let i = self
                .running
                .iter()
                .position(|s| s.seq == Some(seq))
                .expect("planned sequence is running");
            let wants_logits = to == self.running[i].all_ids.len();
            let l = wants_logits.then(|| &logits[row * vocab..(row + 1) * vocab]);
            row += usize::from(wants_logits);
            let queries = (capture[k] > 0).then(|| std::mem::take(&mut captured[k]));
            if self.apply(i, from, to, l, capture[k], queries) {
                finished.push(seq);
            }
        }
        for seq in finished {
            if let Some(i) = self.running.iter().position(|s| s.seq == Some(seq)) {
                let s = self.running.remove(i);
                self.finish(s);
            }
        }
        n_tokens
    }

    /// The forward pass of a plan, with the queries attention-based policies score with
    /// (the last prompt chunk's, capped to the chunk, at prefill; each decode token's
    /// afterwards). On failure every planned request fails (a device error may have left
    /// the batch's K/V half-written) and `None` is returned.
    #[allow(clippy::type_complexity)]
    fn execute(
        &mut self,
        plan: &[(SeqId, usize, usize)],
    ) -> Option<(Vec<f32>, Vec<Vec<f32>>, Vec<usize>)> {
        let idx_of = |running: &[SeqState], seq: SeqId| {
            running
                .iter()
                .position(|s| s.seq == Some(seq))
                .expect("planned sequence is running")
        };
        let tables: Vec<Vec<u32>> = plan
            .iter()
            .map(|(seq, _, _)| eviction::table_of(&self.kv, *seq))
            .collect();
        let window_tables: Vec<Vec<Vec<u32>>> = plan
            .iter()
            .map(|(seq, _, _)| {
                self.kv
                    .window_tables(*seq)
                    .map(<[_]>::to_vec)
                    .unwrap_or_default()
            })
            .collect();
        let mut fwd = Vec::with_capacity(plan.len());
        let mut capture = Vec::with_capacity(plan.len());
        for (k, &(seq, from, to)) in plan.iter().enumerate() {
            let s = &self.running[idx_of(&self.running, seq)];
            let stored_after = self.kv.block_table(seq).expect("live").num_stored_tokens() as usize;
            let n = to - from;
            let wants_logits = to == s.all_ids.len();
            fwd.push(SeqForward {
                tokens: &s.all_ids[from..to],
                start_position: s.position_of(from),
                stored_start: stored_after - n,
                block_table: &tables[k],
                logits_from: if wants_logits { n - 1 } else { n },
                stored_positions: s.stored_positions.as_deref().unwrap_or(&[]),
                window_tables: &window_tables[k],
            });
            capture.push(match &s.eviction {
                // An evicting sequence's prompt ends at `n_prompt` (a recompute replays
                // its generated tokens afterwards, see `SeqState::max_chunk`).
                Some(ev) if !ev.initialised && to == s.n_prompt => {
                    ev.policy().prefill_queries().count(to - from)
                }
                Some(ev)
                    if ev.initialised && ev.policy().decode_queries() != pk_kv::QueryNeed::None =>
                {
                    1
                }
                _ => 0,
            });
        }
        let forward = self.backend.forward_with_queries(&fwd, &capture);
        drop(fwd);
        match forward {
            Ok((logits, captured)) => Some((logits, captured, capture)),
            Err(e) => {
                tracing::error!("forward pass failed: {e}");
                for &(seq, _, _) in plan {
                    if let Some(i) = self.running.iter().position(|s| s.seq == Some(seq)) {
                        let s = self.running.remove(i);
                        self.fail(
                            s,
                            RequestError::Internal(format!("the forward pass failed: {e}")),
                        );
                    }
                }
                None
            }
        }
    }

    /// Applies one planned chunk's result to `running[i]`: stored positions, sampling and
    /// streaming (`logits` when the chunk ends at the sequence's last token), then eviction
    /// or, for a non-evicting sequence, the context offer, the tier stores and the prefix
    /// cache. Returns whether the sequence is finished.
    fn apply(
        &mut self,
        i: usize,
        from: usize,
        to: usize,
        logits: Option<&[f32]>,
        n_captured: usize,
        queries: Option<Vec<f32>>,
    ) -> bool {
        let ctx = self.backend.config().context_length;
        if let Some(l) = logits {
            if self.running[i].choices_to_fork > 0 {
                self.fork_choices(i, to, l);
            }
        }
        let s = &mut self.running[i];
        let seq = s.seq.expect("running");
        let was_prefill = s.is_prefilling();
        let new_positions: Vec<u32> = if s.stored_positions.is_some() {
            (from..to).map(|i| s.position_of(i) as u32).collect()
        } else {
            Vec::new()
        };
        if let Some(p) = s.stored_positions.as_mut() {
            p.extend(new_positions);
        }
        s.num_computed = to;
        if was_prefill {
            self.stats.prompt_tokens += (to - from) as u64;
        }
        let mut finished = false;
        if let Some(l) = logits {
            finished = s.sample_and_emit(l, &self.tokenizer, ctx);
            self.stats.generation_tokens += 1;
        }
        finished |= s.aborted;
        let prefill_done = !s.is_prefilling();
        if s.eviction.is_some() {
            // Evicting sequences never feed the prefix cache: their blocks are about to
            // be compacted or removed, and a cached block would force copies.
            return self.apply_eviction(i, from, to, n_captured, queries, prefill_done, finished);
        }
        s.kv_stored_tokens = self
            .kv
            .block_table(seq)
            .map_or(0, |t| t.num_stored_tokens() as usize);
        s.kv_blocks = held_blocks(&self.kv, seq);
        if s.context.inexact {
            return finished;
        }
        if prefill_done {
            self.offer_and_store(i);
        }
        if self.config.enable_prefix_caching {
            let s = &self.running[i];
            self.kv.cache_full_blocks(seq, &s.all_ids[..s.num_computed]);
        }
        finished
    }

    /// The eviction part of `apply`: prefill selection once the prompt is in, then a block
    /// score per filled block and evictions while over budget.
    #[allow(clippy::too_many_arguments)]
    fn apply_eviction(
        &mut self,
        i: usize,
        from: usize,
        to: usize,
        n_captured: usize,
        queries: Option<Vec<f32>>,
        prefill_done: bool,
        mut finished: bool,
    ) -> bool {
        let c = self.backend.config();
        let (n_heads, head_dim) = (c.n_heads, c.head_dim);
        let s = &mut self.running[i];
        let seq = s.seq.expect("running");
        let ev = s.eviction.as_mut().expect("an evicting sequence");
        let stats = self
            .eviction_stats
            .entry(ev.spec.name().to_string())
            .or_default();
        let stored_now = |kv: &KvCacheManager| {
            kv.block_table(seq)
                .map_or(0, |t| t.num_stored_tokens() as usize)
        };
        let stored_end = stored_now(&self.kv);
        let queries = queries.map(|data| eviction::CapturedQueries {
            n_heads,
            head_dim,
            positions: (stored_end - n_captured..stored_end).collect(),
            data,
        });
        if !ev.initialised {
            // The whole prompt (or, after preemption, everything) is in the cache and its
            // exact attention is done: select, compact, and from now on evict.
            if prefill_done
                && !finished
                && !eviction::after_prefill(
                    ev,
                    &mut self.kv,
                    self.backend.kv_mut(),
                    seq,
                    queries.as_ref(),
                    stats,
                    &mut s.stored_positions,
                )
            {
                // No block for a copy-on-write during compaction: give up on this request
                // rather than corrupt a shared block.
                s.aborted = true;
                (s.req.sink)(SeqEvent::Error(RequestError::CacheFull(
                    "the KV cache is full: no block to compact the pruned prompt into".into(),
                )));
                finished = true;
            }
        } else if to - from == 1 {
            if let Some(q) = queries {
                ev.recent_queries.push((q.positions[0], q.data));
            }
            eviction::after_decode(
                ev,
                &mut self.kv,
                self.backend.kv_mut(),
                seq,
                n_heads,
                stats,
                &mut s.stored_positions,
            );
        }
        s.kv_stored_tokens = stored_now(&self.kv);
        s.kv_blocks = held_blocks(&self.kv, seq);
        finished
    }

    /// Once a non-evicting sequence's prompt is in: offer its context to the EVICPRESS
    /// store (if it asked to be offered) and hand its new full chunks to the tiers.
    fn offer_and_store(&mut self, i: usize) {
        let s = &mut self.running[i];
        let seq = s.seq.expect("running");
        if let (Some((key, tokens)), Some(c)) = (s.context.offer.take(), self.contexts.as_mut()) {
            if let Some(kv) = contexts::read_prefix(&self.kv, self.backend.kv(), seq, tokens) {
                let window = if c.wants_window() {
                    contexts::window_queries(
                        &mut *self.backend,
                        &self.kv,
                        seq,
                        &s.all_ids[..tokens],
                    )
                } else {
                    None
                };
                c.offer(key, kv, window);
            }
        }
        if !s.tier_keys.is_empty() && s.tier_next_chunk < s.tier_keys.len() {
            if let Some(t) = self.tiering.as_mut() {
                s.tier_next_chunk = t.store_chunks(
                    &s.tier_keys,
                    s.tier_next_chunk,
                    s.num_computed,
                    &self.kv,
                    self.backend.kv(),
                    seq,
                );
            }
        }
    }

    /// Starts choices 1..n of `running[i]`'s request (`n > 1`) once its prompt is computed
    /// (`to` tokens): each forks the prompt's blocks (copy-on-write of the partial last
    /// one), so the prompt runs once, and samples its first token from the same `logits`.
    /// A choice with no free block for its copies waits at the queue's head and recomputes
    /// its prompt (from the prefix cache where it can).
    fn fork_choices(&mut self, i: usize, to: usize, logits: &[f32]) {
        let ctx = self.backend.config().context_length;
        let n_more = std::mem::take(&mut self.running[i].choices_to_fork);
        let parent = self.running[i].seq.expect("running");
        for index in 1..=n_more {
            let mut child = self.running[i].new_choice(index);
            let child_seq = self.new_seq_id();
            let Some(copies) = self.kv.fork(parent, child_seq) else {
                child.num_computed = 0;
                self.waiting.push_front(child);
                continue;
            };
            for copy in copies {
                for slot in 0..copy.num_tokens as usize {
                    self.backend
                        .kv_mut()
                        .copy_slot((copy.src.0, slot), (copy.dst.0, slot));
                }
            }
            child.seq = Some(child_seq);
            // The parent's progress is applied after its forks; the prompt is in.
            child.num_computed = to;
            self.stats.generation_tokens += 1;
            if child.sample_and_emit(logits, &self.tokenizer, ctx) || child.aborted {
                self.finish(child);
            } else {
                self.running.push(child);
            }
        }
    }

    fn finish(&mut self, mut s: SeqState) {
        if let Some(seq) = s.seq.take() {
            self.kv.free(seq);
        }
        self.stats.grammar_masks += s.grammar_masks;
        self.stats.grammar_mask_seconds += s.grammar_mask_seconds;
        if s.aborted {
            return;
        }
        let out = s.output();
        (s.req.sink)(SeqEvent::Finished(out));
    }

    fn fail(&mut self, mut s: SeqState, err: RequestError) {
        if let Some(seq) = s.seq.take() {
            self.kv.free(seq);
        }
        (s.req.sink)(SeqEvent::Error(err));
    }

    /// Checks the KV manager's invariants (tests).
    pub fn check_invariants(&self) {
        self.kv.check_invariants();
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

/// Blocks `seq` holds: its main table's and its window groups'.
fn held_blocks(kv: &KvCacheManager, seq: SeqId) -> usize {
    kv.block_table(seq).map_or(0, |t| t.num_blocks()) + kv.num_window_blocks(seq)
}
