//! What an engine is configured with, what a request asks for, and what they can be refused
//! for: plain data shared by the scheduler, the executor and the callers, so that none of
//! them imports the engine to name a request's parameters.

use std::sync::Arc;

use anyhow::{bail, Result};
use pk_kv::{KvGranularity, PolicySpec};
use pk_model::{KvDtype, KvGeometry, ModelConfig};

use crate::connector::KvConnector;
use crate::sampler::SamplingParams;

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
    /// Eviction granularity for requests that give none (`None`: the policy's own,
    /// `PolicySpec::default_granularity`).
    pub default_kv_granularity: Option<KvGranularity>,
    /// Reuse computed blocks across requests through the pool's prefix cache (vLLM's
    /// automatic prefix caching; on by default). Benchmarks of a reuse connector turn it off
    /// so that every reuse is a load.
    pub enable_prefix_caching: bool,
    /// Give a model's sliding-window layers KV cache groups of their own, whose blocks
    /// behind the window are released (vLLM's hybrid KV cache manager; on by default).
    /// It applies to CPU models with both global and windowed layers (Gemma 3). An engine
    /// that a KV connector will be attached to (`Engine::set_connector`) is built with it
    /// off: today's connectors store every layer of every token, as vLLM turns its hybrid
    /// manager off under a KV connector.
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
            default_kv_granularity: None,
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
    /// Return what prefill selection kept in each selection unit
    /// (`GenerateOutput::prefill_keeps`), to compare kept sets with a second implementation.
    /// Only with an evicting policy; not an API field.
    pub record_prefill_keeps: bool,
    /// Teacher forcing: generated token i is `forced_tokens[i]` instead of a sample (while
    /// there are any), so that two cache configurations can be compared on the same text.
    /// A forced end-of-generation token does not end the sequence; a sampled one after the
    /// forced tokens does (unless `ignore_eos`).
    pub forced_tokens: Vec<u32>,
    /// Send each step's full logits as `SeqEvent::Logits` before its token (evaluation).
    pub return_logits: bool,
    /// The KV of the prompt's first `n_tokens()` tokens, given instead of computed (possibly
    /// compressed: fewer tokens, original positions). Profiling and evaluation of stored
    /// contexts use it; such a sequence never feeds the prefix cache.
    /// It is a connector of its own (`pk_connectors::PrefixKv`), which always starts the
    /// request, whatever the pool's prefix cache holds.
    pub prefix_kv: Option<Arc<dyn KvConnector>>,
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
pub(crate) const MAX_PROMPT_LOGITS_BYTES: usize = 256 << 20;

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
            record_prefill_keeps: false,
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
    /// Prompt tokens computed by prefill (a cached prefix is not computed).
    pub prompt_tokens: u64,
    /// Every choice's whole prompt, counted once when its first token is sampled, cached
    /// prefix included: vLLM's `vllm:prompt_tokens_total`.
    pub prompt_tokens_served: u64,
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
    /// Contexts KVzip-scored for the connector's store (its grid drops by KVzip), the
    /// seconds their reconstruction passes took, and those that could not be scored (no
    /// free block for a pass: the context is stored without the scores).
    pub kvzip_store_scored: u64,
    pub kvzip_store_seconds: f64,
    pub kvzip_store_failed: u64,
}
