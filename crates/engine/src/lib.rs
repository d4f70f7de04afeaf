//! `pk-engine`: loads a model, owns the paged KV cache (pool, block tables, physical
//! store), runs requests through prefill and decode, samples, and measures perplexity.
//! Also fetches the default model.

pub mod engine;
pub mod model_store;
pub mod perplexity;
pub mod sampler;
pub mod stop;

pub use engine::{Engine, EngineConfig, FinishReason, GenerateOutput, GenerateParams};
pub use sampler::{SamplingParams, Sampler};
