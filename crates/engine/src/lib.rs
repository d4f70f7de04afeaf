//! `pk-engine`: loads a model, owns the paged KV cache (pool, block tables, physical
//! store), schedules requests with continuous batching (prefill chunks and decode tokens
//! of many sequences in one forward pass), samples, and measures perplexity. Also fetches
//! the default model.
//!
//! KV computed elsewhere enters through a [`connector::KvConnector`]; the stores that
//! implement it (chunk tiers, the EVICPRESS context store, a request's given prefix KV) live
//! in `pk-connectors`, so this crate knows no store.
#![forbid(unsafe_code)]

pub mod connector;
pub mod engine;
pub mod eviction;
mod executor;
pub mod grammar;
pub mod model_store;
pub mod namespace;
pub mod params;
pub mod perplexity;
pub mod quality;
pub mod request;
pub mod sampler;
mod scheduler;
mod sequence;
pub mod stop;

pub use connector::{block_ids, KvConnector, LoadOrigin, Loaded, Lookup, RequestKey};
pub use engine::{
    check_grammar_use, model_content_id, Engine, EngineConfig, EngineStats, FinishReason,
    GenerateParams, SubmitError, MAX_CHOICES, MAX_LOGPROBS,
};
pub use eviction::EvictionStats;
pub use grammar::{CompiledGrammar, Grammar, GrammarCompiler, GrammarSpec};
pub use namespace::{kv_fingerprint, CacheNamespace};
pub use request::{GenerateOutput, PrefillKeep, Request, RequestError, RequestOutput, SeqEvent};
pub use sampler::{Sampler, SamplingParams, TokenLogprob};
