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

use crate::eviction::{self, EvictionStats, SeqEviction};
use crate::namespace::CacheNamespace;
use crate::prefix_kv::{self, PrefixKv};
pub use crate::request::GenerateOutput;
use crate::request::{Request, RequestError, SeqEvent};
use crate::reuse::{self, KvReuse, ReuseConfig, SeqReuse};
use crate::sampler::SamplingParams;
use crate::sequence::SeqState;

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
    /// The connector through which prompt KV is reused across requests, restarts and
    /// servers (`crate::reuse`); `None`: the pool's prefix cache only.
    pub reuse: Option<ReuseConfig>,
    /// Reuse computed blocks across requests through the pool's prefix cache (vLLM's
    /// automatic prefix caching; on by default). Benchmarks of a reuse connector turn it off
    /// so that every reuse is a load.
    pub enable_prefix_caching: bool,
    /// Give a model's sliding-window layers KV cache groups of their own, whose blocks
    /// behind the window are released (vLLM's hybrid KV cache manager; on by default).
    /// It applies to CPU models with both global and windowed layers (Gemma 3) and is
    /// off whenever stored KV is reused across requests (`reuse`), which stores every
    /// layer of every token, as vLLM turns it off under a KV connector.
    pub hybrid_kv_cache: bool,
    /// Prune a budgeted prompt every this many prompt tokens while it is prefilled, for
    /// policies that allow it (`PolicySpec::prunes_as_chunks_arrive`: StreamingLLM, KNorm,
    /// KeyDiff), so that the prompt holds at most budget + this many tokens of blocks
    /// instead of the whole prompt; 0 (the default) prunes once, after exact attention
    /// over the whole prompt, as every policy's method is defined. Prefill is then
    /// inexact: later prompt tokens attend to the kept earlier ones only. The points are
    /// multiples of this many prompt tokens whatever the scheduler's chunks, so the
    /// tokens do not depend on batching or preemption. Off for models with sliding-window
    /// KV groups (Gemma 3 under `hybrid_kv_cache`). At least the block size when set.
    pub prefill_prune_interval_tokens: usize,
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
            reuse: None,
            enable_prefix_caching: true,
            hybrid_kv_cache: true,
            prefill_prune_interval_tokens: 0,
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
    /// Background work (a store's profiling): admitted after every waiting request that is
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
    /// Report each prompt token's log-probability given the tokens before it, and this many
    /// most likely alternatives (vLLM's `prompt_logprobs`); at most `MAX_LOGPROBS`. Such a
    /// request computes its whole prompt: it adopts no cached prefix (a cached token's
    /// logits were never computed for it).
    pub prompt_logprobs: Option<usize>,
    /// Leave control tokens generated mid-text (`<|im_start|>`, …) out of the text, as
    /// vLLM's default `skip_special_tokens`; their ids are still reported.
    pub skip_special_tokens: bool,
}

/// The most alternatives per token `GenerateParams::logprobs` may ask for (OpenAI's
/// `top_logprobs` limit).
pub const MAX_LOGPROBS: usize = 20;

/// The most bytes of logits one step returns for one sequence's prompt rows
/// (`GenerateParams::prompt_logprobs`): its prefill runs in chunks of at most this many
/// rows' worth (441 tokens at Qwen2.5's 151,936-token vocabulary).
const MAX_PROMPT_LOGITS_BYTES: usize = 256 << 20;

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
            prompt_logprobs: None,
            skip_special_tokens: true,
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
    /// Grammars compiled by `submit`, on the engine's thread, because the request brought
    /// no `CompiledGrammar` (the server always brings one; tests check that it does).
    pub grammar_compilations: u64,
}

/// One planned piece of a step: `all_ids[from..to]` of sequence `seq`.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    seq: SeqId,
    from: usize,
    to: usize,
}

/// What a plan's forward pass returned: one row of logits per chunk that ends at its
/// sequence's last token, and per chunk the queries captured (`capture[k]` of them).
struct Executed {
    logits: Vec<f32>,
    captured: Vec<Vec<f32>>,
    capture: Vec<usize>,
}

/// Queries of chunk `c` that `s`'s eviction policy scores with: the last prompt chunk's
/// (capped to the chunk) at prefill, each decode token's afterwards, else none.
fn capture_count(s: &SeqState, c: &Chunk) -> usize {
    match &s.eviction {
        // An evicting sequence's prompt ends at `n_prompt` (a recompute replays its
        // generated tokens afterwards, see `SeqState::max_chunk`).
        Some(ev) if !ev.initialised && c.to == s.n_prompt => {
            ev.policy().prefill_queries().count(c.to - c.from)
        }
        Some(ev) if ev.initialised && ev.policy().decode_queries() != pk_kv::QueryNeed::None => 1,
        _ => 0,
    }
}

/// Where an admitted sequence's first prompt tokens come from.
enum Start {
    /// The pool's prefix cache (possibly nothing of it).
    Pool(pk_kv::CachedPrefix),
    /// The reuse connector's stored KV.
    Reuse,
    /// The request's given prefix KV (`GenerateParams::prefix_kv`).
    Given,
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
    /// eviction policies, the reuse connector.
    backend: Box<dyn Backend>,
    /// Mixed into every block hash and stored key, so that caches of different models,
    /// KV precisions or backends never alias.
    cache_namespace: CacheNamespace,
    next_seq: u64,
    /// The KV reuse connector, if one is configured (`crate::reuse`).
    reuse: Option<Box<dyn KvReuse>>,
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
            kv,
            backend,
            cache_namespace,
            next_seq: 0,
            reuse,
            waiting: VecDeque::new(),
            running: Vec::new(),
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

    /// The KV reuse connector, for the accessors each connector's module adds to `Engine`.
    pub(crate) fn reuse_connector(&self) -> Option<&dyn KvReuse> {
        self.reuse.as_deref()
    }

    /// The codec fingerprint of this engine's KV (model and KV precision).
    pub fn kv_fingerprint(&self) -> [u8; 32] {
        self.cache_namespace.kv_fingerprint()
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

    /// A matcher for a request's grammar: the one the caller compiled, checked, or else
    /// compiled now (so that a bad one is refused at submission, naming its field).
    fn grammar_matcher(
        &mut self,
        g: &mut crate::grammar::Grammar,
        p: &GenerateParams,
    ) -> Result<llguidance::Matcher, SubmitError> {
        check_grammar_use(g, p)?;
        let invalid = |message: String| SubmitError::InvalidParam {
            param: g.param,
            message,
        };
        if let Some(compiled) = g.compiled.take() {
            let vocab = self.tokenizer.vocab_size();
            if compiled.vocab_size() != vocab {
                return Err(invalid(format!(
                    "{} was compiled for a vocabulary of {} tokens; this model's has {vocab}",
                    g.param,
                    compiled.vocab_size()
                )));
            }
            return Ok(compiled.into_matcher());
        }
        // Compiling here holds the engine thread, and so every running sequence: callers
        // that serve other requests meanwhile compile first (`GrammarCompiler::compile`).
        self.stats.grammar_compilations += 1;
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
            .compile(g)
            .map(crate::grammar::CompiledGrammar::into_matcher)
            .map_err(|e| invalid(e.to_string()))
    }

    fn new_seq_id(&mut self) -> SeqId {
        self.next_seq += 1;
        SeqId(self.next_seq)
    }

    /// Queues a request. Validation errors and a full queue are refused immediately.
    pub fn submit(&mut self, mut req: Request) -> Result<(), SubmitError> {
        if self.waiting.len() >= self.config.max_waiting_requests {
            return Err(SubmitError::QueueFull(self.waiting.len()));
        }
        self.check_prompt(&req.prompt_ids)?;
        self.check_params(&req.params)?;
        let eviction = self.eviction_for(&req.params)?;
        // The budget that applies is the request's or the server's default: choices of a
        // request evicting under either would share blocks that eviction rewrites.
        check_choices(&req.params, eviction.is_some())?;
        if let Some(p) = &req.params.prefix_kv {
            self.check_prefix_kv(p, req.prompt_ids.len(), eviction.is_some())?;
        }
        let namespace = self.cache_namespace.salted(req.cache_salt.as_deref());
        let matcher = match req.params.grammar.take() {
            Some(mut g) => {
                let m = self.grammar_matcher(&mut g, &req.params)?;
                req.params.grammar = Some(g);
                Some(m)
            }
            None => None,
        };
        let background = req.params.background;
        let mut state = SeqState::new(req, namespace);
        state.eviction = eviction;
        state.matcher = matcher;
        // Background work queues behind every user request.
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

    fn check_prompt(&self, ids: &[u32]) -> Result<(), SubmitError> {
        if ids.is_empty() {
            return Err(SubmitError::Invalid("the prompt is empty".into()));
        }
        let ctx = self.backend.config().context_length;
        if ids.len() >= ctx {
            return Err(SubmitError::Invalid(format!(
                "the prompt has {} tokens; the model's context is {ctx}",
                ids.len()
            )));
        }
        let vocab = self.backend.config().vocab_size;
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(SubmitError::Invalid(format!(
                "token id {bad} is outside the vocabulary"
            )));
        }
        Ok(())
    }

    fn check_params(&self, p: &GenerateParams) -> Result<(), SubmitError> {
        let invalid =
            |param: &'static str, message: String| SubmitError::InvalidParam { param, message };
        p.sampling
            .validate()
            .map_err(|e| invalid(e.param, e.message))?;
        let vocab = self.backend.config().vocab_size;
        if let Some((id, _)) = p
            .sampling
            .logit_bias
            .iter()
            .find(|(id, _)| *id as usize >= vocab)
        {
            return Err(invalid(
                "logit_bias",
                format!("logit_bias names token {id}, outside the vocabulary of {vocab}"),
            ));
        }
        if p.logprobs.is_some_and(|n| n > MAX_LOGPROBS) {
            return Err(invalid(
                "top_logprobs",
                format!("at most {MAX_LOGPROBS} alternatives per token"),
            ));
        }
        if p.prompt_logprobs.is_some_and(|n| n > MAX_LOGPROBS) {
            return Err(invalid(
                "prompt_logprobs",
                format!("at most {MAX_LOGPROBS} alternatives per token"),
            ));
        }
        if p.prompt_logprobs.is_some() && p.prefix_kv.is_some() {
            return Err(invalid(
                "prompt_logprobs",
                "a given prefix KV has no logits for its tokens; prompt_logprobs needs the whole prompt computed".into(),
            ));
        }
        if p.min_tokens > p.max_tokens {
            return Err(invalid(
                "min_tokens",
                format!(
                    "min_tokens {} exceeds max_tokens {}",
                    p.min_tokens, p.max_tokens
                ),
            ));
        }
        Ok(())
    }

    fn check_prefix_kv(
        &self,
        p: &PrefixKv,
        prompt_tokens: usize,
        evicting: bool,
    ) -> Result<(), SubmitError> {
        if self.kv.window_spec().is_some() {
            return Err(SubmitError::InvalidParam {
                param: "prefix_kv",
                message: "prefix_kv writes every layer of every token, but this engine keeps sliding-window layers in KV cache groups of their own; build it with hybrid_kv_cache off".into(),
            });
        }
        let g = self.backend.kv().geometry();
        if p.n_tokens() >= prompt_tokens
            || p.kv
                .positions
                .last()
                .is_some_and(|&x| x as usize >= p.n_tokens())
        {
            return Err(SubmitError::Invalid(format!(
                "prefix_kv covers {} tokens of a {prompt_tokens}-token prompt",
                p.n_tokens(),
            )));
        }
        if (p.kv.n_layers, p.kv.n_kv_heads, p.kv.head_dim) != (g.n_layers, g.n_kv_heads, g.head_dim)
        {
            return Err(SubmitError::Invalid(
                "prefix_kv has another model's shape".into(),
            ));
        }
        if evicting {
            return Err(SubmitError::Invalid(
                "prefix_kv and an evicting kv_policy are exclusive".into(),
            ));
        }
        Ok(())
    }

    /// Resolves a request's policy and budget against the engine defaults.
    fn eviction_for(&self, p: &GenerateParams) -> Result<Option<SeqEviction>, SubmitError> {
        let invalid =
            |param: &'static str, message: String| SubmitError::InvalidParam { param, message };
        let budget = p.kv_budget.or(self.config.default_kv_budget);
        let no_eviction = || match p.kv_granularity {
            // A granularity chooses how eviction selects; with nothing evicted it would be
            // accepted and unused.
            Some(g) => Err(invalid(
                "kv_granularity",
                format!("kv_granularity {g} applies only when a kv_budget evicts"),
            )),
            None => Ok(None),
        };
        let spec = match (p.kv_policy, budget) {
            (Some(spec), _) => spec,
            (None, Some(_)) => self.config.default_kv_policy,
            (None, None) => return no_eviction(),
        };
        if !spec.evicts() {
            if p.kv_budget.is_some() {
                return Err(invalid(
                    "kv_budget",
                    format!("kv_policy {spec} keeps every token and takes no kv_budget"),
                ));
            }
            return no_eviction();
        }
        let Some(budget) = budget else {
            return Err(invalid(
                "kv_budget",
                format!("kv_policy {spec} needs a kv_budget (tokens kept per sequence)"),
            ));
        };
        spec.validate(budget, self.config.block_size_tokens)
            .map_err(|e| invalid("kv_budget", e.to_string()))?;
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
        let interval = self.config.prefill_prune_interval_tokens;
        if interval > 0 && spec.prunes_as_chunks_arrive() && self.kv.window_spec().is_none() {
            ev.prune_interval_tokens = Some(interval);
        }
        Ok(Some(ev))
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
    /// A prompt pruned as its chunks arrive needs at most its peak (budget + interval)
    /// less what it holds.
    fn reserved_prefill_blocks(&self) -> usize {
        let block = self.config.block_size_tokens as usize;
        self.running
            .iter()
            .filter(|s| s.num_computed < s.n_prompt)
            .map(|s| {
                let left = s.n_prompt - s.num_computed;
                let chunk_peak = s
                    .eviction
                    .as_ref()
                    .filter(|ev| ev.prune_interval_tokens.is_some())
                    .map(|ev| ev.prefill_peak_tokens(s.n_prompt));
                let need = match (chunk_peak, s.seq) {
                    (Some(peak), Some(seq)) => {
                        let stored = self
                            .kv
                            .block_table(seq)
                            .map_or(0, |t| t.num_stored_tokens() as usize);
                        left.min(peak.saturating_sub(stored))
                    }
                    _ => left,
                };
                need.div_ceil(block)
            })
            .sum()
    }

    /// Moves waiting requests into the running set while blocks and slots allow.
    fn admit(&mut self) {
        while self.running.len() < self.config.max_running_seqs {
            self.probe_front();
            let Some(front) = self.waiting.front() else {
                break;
            };
            let (start, needed) = self.start_for(front);
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
            let s = self.waiting.pop_front().expect("front exists");
            self.admit_from(s, start);
        }
    }

    /// Asks the reuse connector about the head of the queue, once per waiting request (and
    /// again only after a preemption has changed its tokens): while the head waits for
    /// blocks, each step would otherwise re-hash its prompt and make a Redis round trip.
    fn probe_front(&mut self) {
        let (Some(r), Some(front)) = (self.reuse.as_mut(), self.waiting.front_mut()) else {
            return;
        };
        let reusable = front.eviction.is_none()
            && front.req.params.prefix_kv.is_none()
            && !front.wants_prompt_rows();
        let asked = front.reuse.probe.as_ref().map(|p| p.0);
        if reusable && asked != Some(front.all_ids.len()) {
            let m = r.lookup(&front.all_ids, front.req.cache_salt.as_deref());
            front.reuse.probe = Some((front.all_ids.len(), m));
        }
    }

    /// Where a waiting sequence's first tokens would come from, and the blocks it needs to
    /// be admitted: a given prefix KV, else the connector when it holds more of the prompt
    /// than the pool's prefix cache, else the pool.
    fn start_for(&self, s: &SeqState) -> (Start, usize) {
        if s.req.params.prefix_kv.is_some() {
            return (Start::Given, self.blocks_for(s.all_ids.len()));
        }
        // A prompt pruned as its chunks arrive adopts no cached prefix: the cache holds
        // K/V computed with attention over every earlier token, which its later chunks
        // would not have seen, so its tokens would depend on what happened to be cached.
        let chunk_pruned = s
            .eviction
            .as_ref()
            .is_some_and(|ev| ev.prune_interval_tokens.is_some());
        // Nor does one that asks for its prompt's logprobs: cached tokens have no logits.
        let adopts = self.config.enable_prefix_caching && !chunk_pruned && !s.wants_prompt_rows();
        let ids: &[u32] = match adopts {
            true => &s.all_ids,
            false => &[],
        };
        let prefix = self.kv.get_computed_prefix(ids, &s.namespace);
        let cached = prefix.num_cached_tokens() as usize;
        let loadable = s.reuse.probe.as_ref().map_or(0, |p| p.1.loadable_tokens);
        if loadable > cached {
            return (Start::Reuse, self.blocks_for(s.all_ids.len()));
        }
        let to_compute = match &s.eviction {
            Some(ev) if chunk_pruned => ev.prefill_peak_tokens(s.all_ids.len()),
            _ => s.all_ids.len() - cached,
        };
        let needed = self.blocks_for(to_compute) + prefix.block_ids().len();
        (Start::Pool(prefix), needed)
    }

    /// Admits `s` starting from `start`; a given or stored KV that cannot be placed falls
    /// back to computing the prompt from the pool's prefix cache.
    fn admit_from(&mut self, mut s: SeqState, start: Start) {
        let seq = self.new_seq_id();
        let probe = s.reuse.probe.take().map(|p| p.1).unwrap_or_default();
        s.reuse = SeqReuse {
            saved_chunks: probe.saved_chunks,
            keys: probe.keys.clone(),
            ..Default::default()
        };
        let preloaded = match start {
            Start::Given => self.start_from_given(&mut s, seq),
            Start::Reuse => self.start_from_reuse(&mut s, seq, &probe),
            Start::Pool(prefix) => {
                let adopted = self.kv.add_sequence(seq, &prefix) as usize;
                return self.start_running(s, seq, adopted);
            }
        };
        let adopted = match preloaded {
            Some(tokens) => tokens,
            None => {
                // Nothing placed: the sequence was freed; the prefix is looked up again,
                // since a failed placement may have taken cached blocks off the free list.
                s.reuse.inexact = false;
                let ids: &[u32] = if self.config.enable_prefix_caching && !s.wants_prompt_rows() {
                    &s.all_ids
                } else {
                    &[]
                };
                let prefix = self.kv.get_computed_prefix(ids, &s.namespace);
                self.kv.add_sequence(seq, &prefix) as usize
            }
        };
        self.start_running(s, seq, adopted);
    }

    /// An admitted sequence whose first `adopted` tokens are already in its cache.
    fn start_running(&mut self, mut s: SeqState, seq: pk_kv::SeqId, adopted: usize) {
        if s.preemptions == 0 {
            self.stats.prefix_queries_tokens += s.n_prompt as u64;
            self.stats.prefix_hits_tokens += adopted as u64;
            s.cached_prompt_tokens = adopted;
        }
        s.seq = Some(seq);
        s.scheduled_at.get_or_insert_with(std::time::Instant::now);
        s.num_computed = adopted;
        self.running.push(s);
    }

    /// Starts `seq` from the request's given prefix KV. Returns the prompt tokens covered,
    /// or `None` (sequence freed) if it could not be placed.
    fn start_from_given(&mut self, s: &mut SeqState, seq: SeqId) -> Option<usize> {
        let p = s.req.params.prefix_kv.clone().expect("a given prefix");
        let empty = self.kv.get_computed_prefix(&[], &s.namespace);
        self.kv.add_sequence(seq, &empty);
        if !prefix_kv::place_prefix(&p.kv, &mut self.kv, self.backend.kv_mut(), seq) {
            self.kv.free(seq);
            return None;
        }
        s.reuse = SeqReuse {
            inexact: true,
            ..Default::default()
        };
        Some(p.n_tokens())
    }

    /// Starts `seq` from what the reuse connector holds of its prompt. Returns the prompt
    /// tokens covered, or `None` (sequence freed) if nothing could be loaded.
    fn start_from_reuse(
        &mut self,
        s: &mut SeqState,
        seq: SeqId,
        probe: &reuse::ReuseMatch,
    ) -> Option<usize> {
        let r = self.reuse.as_mut().expect("a connector answered");
        let empty = self.kv.get_computed_prefix(&[], &s.namespace);
        self.kv.add_sequence(seq, &empty);
        let query = &s.all_ids[probe.loadable_tokens.min(s.n_prompt)..s.n_prompt];
        let Some(placed) = r.load(probe, query, &mut self.kv, &mut *self.backend, seq) else {
            self.kv.free(seq);
            return None;
        };
        s.reuse.inexact = !placed.exact;
        s.reuse.saved_chunks = placed.saved_chunks;
        s.reuse.load = placed.report;
        Some(placed.tokens)
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
        s.reuse = SeqReuse::default();
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

    /// One scheduler iteration: plan a batch, execute it (one forward pass), apply each
    /// sequence's result. Returns the number of tokens run through the model.
    pub fn step(&mut self) -> usize {
        self.drop_aborted();
        self.admit();
        let plan = self.plan();
        if plan.is_empty() {
            return 0;
        }
        self.stats.kv_bytes_peak = self.stats.kv_bytes_peak.max(self.kv_bytes_in_use());
        self.stats.max_running_seqs = self.stats.max_running_seqs.max(self.running.len());
        let n_tokens = self.run_plan(&plan);
        self.stats.steps += 1;
        n_tokens
    }

    /// Frees the blocks of sequences whose clients went away.
    fn drop_aborted(&mut self) {
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
    }

    /// The next batch: a decode token for every decoding sequence first, then prompt
    /// chunks, within the step's token budget, each with its slots allocated (preempting
    /// the newest other sequences when the pool is out of blocks).
    fn plan(&mut self) -> Vec<Chunk> {
        let mut order: Vec<(bool, SeqId)> = self
            .running
            .iter()
            .map(|s| (s.is_prefilling(), s.seq.expect("running")))
            .collect();
        order.sort_by_key(|&(prefilling, _)| prefilling);
        let mut budget = self.config.max_batch_tokens;
        let mut prefill_left = self.prefill_cap(order.iter().filter(|o| !o.0).count());
        let mut plan: Vec<Chunk> = Vec::new();
        for (prefilling, seq) in order {
            if budget == 0 {
                break;
            }
            let Some(i) = self.running.iter().position(|s| s.seq == Some(seq)) else {
                continue;
            };
            let s = &self.running[i];
            let pending = s.all_ids.len() - s.num_computed;
            let cap = if prefilling { prefill_left } else { usize::MAX };
            let take = pending
                .min(budget)
                .min(cap)
                .min(s.max_chunk())
                .min(self.max_logit_rows(s));
            let from = s.num_computed;
            if take == 0 || !self.allocate_or_preempt(seq, take, &mut plan) {
                continue;
            }
            plan.push(Chunk {
                seq,
                from,
                to: from + take,
            });
            budget -= take;
            if prefilling {
                prefill_left -= take;
            }
        }
        plan
    }

    /// The most tokens of `s` one step may compute: unbounded, except where each row
    /// returns logits (`prompt_logprobs`), whose bytes `MAX_PROMPT_LOGITS_BYTES` bounds.
    fn max_logit_rows(&self, s: &SeqState) -> usize {
        match s.wants_prompt_rows() {
            true => {
                let row_bytes = self.backend.config().vocab_size * std::mem::size_of::<f32>();
                (MAX_PROMPT_LOGITS_BYTES / row_bytes).max(1)
            }
            false => usize::MAX,
        }
    }

    /// Prompt tokens a step may carry beside `n_decoding` decodes. The cap grows with the
    /// decodes (`PREFILL_TOKENS_PER_DECODE` each): a step of many decodes is long already,
    /// and prompt rows beside them cost it proportionally less.
    fn prefill_cap(&self, n_decoding: usize) -> usize {
        match n_decoding {
            0 => usize::MAX,
            n => self
                .config
                .max_prefill_tokens_while_decoding
                .max(PREFILL_TOKENS_PER_DECODE * n)
                .max(1),
        }
    }

    /// Allocates `take` slots for `seq`, preempting the newest other sequences (and taking
    /// them out of `plan`) while the pool is out of blocks. When nothing is left to preempt,
    /// `seq`'s request fails and false is returned.
    fn allocate_or_preempt(&mut self, seq: SeqId, take: usize, plan: &mut Vec<Chunk>) -> bool {
        loop {
            if self.kv.allocate_slots(seq, take as u32).is_some() {
                return true;
            }
            match self.preempt_one(seq) {
                Some(victim) => plan.retain(|c| c.seq != victim),
                None => break,
            }
        }
        let i = self
            .running
            .iter()
            .position(|s| s.seq == Some(seq))
            .expect("still running");
        let s = self.running.remove(i);
        self.fail(s, RequestError::CacheFull("the KV cache is full even with every other sequence preempted; raise the KV capacity".into()));
        false
    }

    /// Executes a plan: one forward pass over every planned chunk, then each sequence's
    /// result is applied (`apply`). Returns the number of tokens run.
    fn run_plan(&mut self, plan: &[Chunk]) -> usize {
        let t0 = std::time::Instant::now();
        let Some(Executed {
            logits,
            mut captured,
            capture,
        }) = self.execute(plan)
        else {
            return 0;
        };
        // A step of prompt chunks only times prefill (a decode's chunk is one token).
        if plan.iter().all(|c| c.to - c.from > 1) {
            let tokens = plan.iter().map(|c| c.to - c.from).sum();
            let seconds = t0.elapsed().as_secs_f64();
            if let Some(r) = self.reuse.as_mut() {
                r.observe_prefill(tokens, seconds);
            }
        }
        let vocab = self.backend.config().vocab_size;
        let mut row = 0;
        let mut finished = Vec::new();
        for (k, c) in plan.iter().enumerate() {
            let i = self.index_of(c.seq);
            let from_row = first_logits_row(&self.running[i], c);
            let rows = c.to - c.from - from_row;
            let seq_logits = &logits[row * vocab..(row + rows) * vocab];
            row += rows;
            // Rows before the sampling row are prompt positions (`prompt_logprobs`).
            for (r, pos) in (c.from + from_row..c.to).enumerate() {
                let l = &seq_logits[r * vocab..(r + 1) * vocab];
                self.running[i].record_prompt_logprob(pos, l);
            }
            let wants_logits = c.to == self.running[i].all_ids.len();
            let l = wants_logits.then(|| &seq_logits[(rows - 1) * vocab..]);
            let queries = (capture[k] > 0).then(|| std::mem::take(&mut captured[k]));
            if self.apply(i, c, l, capture[k], queries) {
                finished.push(c.seq);
            }
        }
        for seq in finished {
            if let Some(i) = self.running.iter().position(|s| s.seq == Some(seq)) {
                let s = self.running.remove(i);
                self.finish(s);
            }
        }
        plan.iter().map(|c| c.to - c.from).sum()
    }

    /// The index in `running` of a planned (so running) sequence.
    fn index_of(&self, seq: SeqId) -> usize {
        self.running
            .iter()
            .position(|s| s.seq == Some(seq))
            .expect("planned sequence is running")
    }

    /// The forward pass of a plan, with the queries attention-based policies score with
    /// (`capture_count`). On failure every planned request fails (a device error may have
    /// left the batch's K/V half-written) and `None` is returned.
    fn execute(&mut self, plan: &[Chunk]) -> Option<Executed> {
        let tables: Vec<Vec<u32>> = plan
            .iter()
            .map(|c| eviction::table_of(&self.kv, c.seq))
            .collect();
        let window_tables: Vec<Vec<Vec<u32>>> = plan
            .iter()
            .map(|c| {
                self.kv
                    .window_tables(c.seq)
                    .map(<[_]>::to_vec)
                    .unwrap_or_default()
            })
            .collect();
        let mut fwd = Vec::with_capacity(plan.len());
        let mut capture = Vec::with_capacity(plan.len());
        for (k, c) in plan.iter().enumerate() {
            let s = &self.running[self.index_of(c.seq)];
            let table = self.kv.block_table(c.seq).expect("live");
            let stored_after = table.num_stored_tokens() as usize;
            let n = c.to - c.from;
            fwd.push(SeqForward {
                tokens: &s.all_ids[c.from..c.to],
                start_position: s.position_of(c.from),
                stored_start: stored_after - n,
                block_table: &tables[k],
                logits_from: first_logits_row(s, c),
                stored_positions: table.positions().unwrap_or(&[]),
                window_tables: &window_tables[k],
            });
            capture.push(capture_count(s, c));
        }
        let forward = self.backend.forward_with_queries(&fwd, &capture);
        drop(fwd);
        match forward {
            Ok((logits, captured)) => Some(Executed {
                logits,
                captured,
                capture,
            }),
            Err(e) => {
                tracing::error!("forward pass failed: {e}");
                for c in plan {
                    if let Some(i) = self.running.iter().position(|s| s.seq == Some(c.seq)) {
                        let s = self.running.remove(i);
                        let msg = format!("the forward pass failed: {e}");
                        self.fail(s, RequestError::Internal(msg));
                    }
                }
                None
            }
        }
    }

    /// Applies one planned chunk's result to `running[i]`: stored positions, sampling and
    /// streaming (`logits` when the chunk ends at the sequence's last token), then eviction
    /// or, for a non-evicting sequence, the reuse connector's save and the prefix cache.
    /// Returns whether the sequence is finished.
    fn apply(
        &mut self,
        i: usize,
        c: &Chunk,
        logits: Option<&[f32]>,
        n_captured: usize,
        queries: Option<Vec<f32>>,
    ) -> bool {
        let ctx = self.backend.config().context_length;
        if let Some(l) = logits {
            if self.running[i].choices_to_fork > 0 {
                self.fork_choices(i, c.to, l);
            }
        }
        let s = &mut self.running[i];
        let seq = s.seq.expect("running");
        if s.is_prefilling() {
            self.stats.prompt_tokens += (c.to - c.from) as u64;
        }
        s.num_computed = c.to;
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
            let queries = queries.map(|data| self.captured_queries(seq, n_captured, data));
            finished = self.apply_eviction(i, c, queries, prefill_done, finished);
        } else if !s.reuse.inexact {
            if prefill_done && s.reuse.wants_save() {
                self.save_prompt(i);
            }
            if self.config.enable_prefix_caching {
                let s = &self.running[i];
                self.kv.cache_full_blocks(seq, &s.all_ids[..s.num_computed]);
            }
        }
        let s = &mut self.running[i];
        s.kv_stored_tokens = self
            .kv
            .block_table(seq)
            .map_or(0, |t| t.num_stored_tokens() as usize);
        s.kv_blocks = held_blocks(&self.kv, seq);
        finished
    }

    /// The queries a step captured for `seq`: the last `n_captured` stored tokens'.
    fn captured_queries(
        &self,
        seq: SeqId,
        n_captured: usize,
        data: Vec<f32>,
    ) -> eviction::CapturedQueries {
        let c = self.backend.config();
        let stored_end = self
            .kv
            .block_table(seq)
            .map_or(0, |t| t.num_stored_tokens() as usize);
        eviction::CapturedQueries {
            n_heads: c.n_heads,
            head_dim: c.head_dim,
            positions: (stored_end - n_captured..stored_end).collect(),
            data,
        }
    }

    /// The eviction part of `apply`: prefill selection once the prompt is in, then a block
    /// score per filled block and evictions while over budget. Returns whether the
    /// sequence is finished (it is, failed, when its pruned prompt has no block to go to).
    fn apply_eviction(
        &mut self,
        i: usize,
        c: &Chunk,
        queries: Option<eviction::CapturedQueries>,
        prefill_done: bool,
        finished: bool,
    ) -> bool {
        let n_heads = self.backend.config().n_heads;
        let s = &mut self.running[i];
        let seq = s.seq.expect("running");
        let ev = s.eviction.as_mut().expect("an evicting sequence");
        let stats = self
            .eviction_stats
            .entry(ev.spec.name().to_string())
            .or_default();
        let (kv, store) = (&mut self.kv, self.backend.kv_mut());
        if ev.initialised {
            if c.to - c.from == 1 {
                if let Some(q) = queries {
                    ev.recent_queries.push((q.positions[0], q.data));
                }
                eviction::after_decode(ev, kv, store, seq, n_heads, stats);
            }
            return finished;
        }
        if !prefill_done {
            // A prompt pruned as its chunks arrive: at each multiple of the interval (the
            // plan ends chunks there), select over what is stored so far.
            let at_point = ev
                .prune_interval_tokens
                .is_some_and(|n| c.to.is_multiple_of(n));
            if finished || !at_point || eviction::prune_prompt_so_far(ev, kv, store, seq, stats) {
                return finished;
            }
        } else {
            // The whole prompt (or, after preemption, everything) is in the cache and its
            // attention is done: select, compact, and from now on evict.
            if finished {
                return finished;
            }
            let q = queries.as_ref();
            if eviction::after_prefill(ev, kv, store, seq, q, stats) {
                return false;
            }
        }
        // No block for a copy-on-write during compaction: give up on this request rather
        // than corrupt a shared block.
        s.aborted = true;
        (s.req.sink)(SeqEvent::Error(RequestError::CacheFull(
            "the KV cache is full: no block to compact the pruned prompt into".into(),
        )));
        true
    }

    /// Once a non-evicting sequence's prompt is in, hands what the connector has not saved
    /// of it to the connector.
    fn save_prompt(&mut self, i: usize) {
        let Some(r) = self.reuse.as_mut() else {
            return;
        };
        let s = &mut self.running[i];
        let seq = s.seq.expect("running");
        r.save(
            &mut s.reuse,
            &s.all_ids,
            s.num_computed,
            &self.kv,
            &mut *self.backend,
            seq,
        );
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
        if let Some(r) = self.reuse.as_mut() {
            r.request_finished(&s.reuse);
        }
        if let Some(seq) = s.seq.take() {
            self.kv.free(seq);
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
            self.kv.free(seq);
        }
        (s.req.sink)(SeqEvent::Error(err));
    }

    /// Checks the KV manager's invariants (tests).
    pub fn check_invariants(&self) {
        self.kv.check_invariants();
    }
}

/// The first row of chunk `c` whose logits the step returns: the prompt positions still
/// missing a `prompt_logprobs` entry, else only the sequence's last token (the one it
/// samples from), else none (`c.to - c.from`).
fn first_logits_row(s: &SeqState, c: &Chunk) -> usize {
    let n = c.to - c.from;
    let last = match c.to == s.all_ids.len() {
        true => n - 1,
        false => n,
    };
    match s.first_prompt_logprob_position(c.from, c.to) {
        Some(pos) => (pos - c.from).min(last),
        None => last,
    }
}

/// Whether `p` can run under grammar `g`: a grammar can neither constrain forced tokens
/// nor let a sequence run past end-of-generation. Callers that compile before submitting
/// check it first, so that a request the engine would refuse is not compiled for nothing.
pub fn check_grammar_use(
    g: &crate::grammar::Grammar,
    p: &GenerateParams,
) -> Result<(), SubmitError> {
    if !p.forced_tokens.is_empty() || p.ignore_eos {
        return Err(SubmitError::InvalidParam {
            param: g.param,
            message: "a grammar cannot constrain forced tokens or run past end-of-generation (ignore_eos)".into(),
        });
    }
    Ok(())
}

/// `n` within its bounds, and not combined with what choices cannot share.
fn check_choices(p: &GenerateParams, evicts: bool) -> Result<(), SubmitError> {
    let n = p.n;
    if n == 0 || n > MAX_CHOICES {
        return Err(SubmitError::InvalidParam {
            param: "n",
            message: format!("n must be in [1, {MAX_CHOICES}], got {n}"),
        });
    }
    if n == 1 {
        return Ok(());
    }
    let clash = [
        (!p.forced_tokens.is_empty(), "forced tokens"),
        (p.return_logits, "returned logits"),
        (p.prefix_kv.is_some(), "prefix_kv"),
        (evicts, "an evicting kv_policy or a kv_budget, the request's or the server's default (choices share the prompt's blocks, which eviction rewrites)"),
    ]
    .into_iter()
    .find(|c| c.0);
    match clash {
        Some((_, what)) => Err(SubmitError::InvalidParam {
            param: "n",
            message: format!("n > 1 cannot be combined with {what}"),
        }),
        None => Ok(()),
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
