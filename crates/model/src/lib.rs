//! `pk-model`: model code and CPU kernels.
//!
//! The forward pass reads and writes K/V only through block tables into a [`KvStore`]
//! indexed by block ids; it knows nothing of how blocks are allocated, shared or evicted
//! (that is `pk-kv`'s job) and nothing of requests or scheduling (`pk-engine`).

pub mod arch;
pub mod attention;
pub mod backend;
pub mod config;
pub mod kernels;
pub mod kquant;
pub mod kv_store;
pub mod llama;
pub mod weights;

pub use backend::{block_runs, token_range_len, Backend, BackendError, CpuBackend, KvBlocks};
pub use config::{ArchExtras, KvGroupLayout, ModelConfig, RopeStyle, SlidingWindow};
pub use kv_store::{KvDtype, KvGeometry, KvStore};
pub use llama::{Llama, SeqForward};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] pk_gguf::GgufError),
    #[error("unsupported architecture {0:?} (supported: llama, gemma3, qwen2, qwen3)")]
    UnsupportedArch(String),
    /// A GGUF tensor or metadata key the engine does not use: refused rather than ignored,
    /// since it may change the model's math (as Llama 3.1's `rope_freqs.weight` does).
    #[error("the GGUF holds {what} {name:?}, which this engine does not use; refusing to load rather than run the model without it")]
    Unrecognized { what: &'static str, name: String },
    #[error("bad model configuration: {0}")]
    BadConfig(String),
}
