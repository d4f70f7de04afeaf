//! `pk-model`: model code and CPU kernels.
//!
//! The forward pass reads and writes K/V only through block tables into a [`KvStore`]
//! indexed by block ids; it knows nothing of how blocks are allocated, shared or evicted
//! (that is `pk-kv`'s job) and nothing of requests or scheduling (`pk-engine`).

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
    #[error("unsupported architecture {0:?} (supported: llama)")]
    UnsupportedArch(String),
    #[error("bad model configuration: {0}")]
    BadConfig(String),
}
