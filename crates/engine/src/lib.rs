//! `pk-engine`: loads a model, owns the paged KV cache (pool, block tables, physical
//! store), schedules requests with continuous batching (prefill chunks and decode tokens
//! of many sequences in one forward pass), samples, and measures perplexity. Also fetches
//! the default model.
#![forbid(unsafe_code)]

pub mod contexts;
pub mod engine;
pub mod eviction;
mod executor;
pub mod grammar;
pub mod model_store;
pub mod namespace;
pub mod params;
pub mod perplexity;
pub mod prefix_kv;
pub mod profiler;
pub mod request;
pub mod reuse;
pub mod sampler;
mod scheduler;
mod sequence;
pub mod stop;
pub mod tiering;

pub use contexts::{ContextReuseConfig, ContextReuseStats, DelayCalibration};
pub use engine::{
    check_grammar_use, Engine, EngineConfig, EngineStats, FinishReason, GenerateParams,
    SubmitError, MAX_CHOICES, MAX_LOGPROBS,
};
pub use eviction::EvictionStats;
pub use grammar::{CompiledGrammar, Grammar, GrammarCompiler, GrammarSpec};
pub use namespace::{kv_fingerprint, CacheNamespace};
pub use prefix_kv::PrefixKv;
pub use request::{GenerateOutput, Request, RequestError, RequestOutput, SeqEvent};
pub use reuse::ReuseConfig;
pub use sampler::{Sampler, SamplingParams, TokenLogprob};
pub use tiering::{TieringConfig, TieringStats};
