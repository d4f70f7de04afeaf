//! `pk-cuda`: the Llama forward pass on an NVIDIA GPU.
//!
//! Built without a CUDA toolkit: `cudarc` opens the driver, NVRTC and cuBLAS with dlopen on
//! first use, and the kernels (`kernels/*.cu`) are compiled at run time by NVRTC for the
//! device found. GEMMs go through cuBLAS (bf16/f16 operands, f32 accumulation and f32
//! outputs); our kernels do RMSNorm, RoPE, SwiGLU, embedding lookup, dequantisation of GGUF
//! weights at load time, K/V writes into a paged device pool, and paged attention that reads
//! block tables (split-K for decode, query tiles for prefill).
//!
//! The contract mirrors `pk_model::Llama::forward`: a batch of [`pk_model::SeqForward`]s,
//! K/V addressed by `(block id, slot)` through each sequence's block table, logits rows for
//! the requested tokens. Block ids and tables come from the caller, as on the CPU.
//! [`CudaBackend`] puts it behind `pk_model::Backend`, the seam the engine drives.

pub mod attention;
pub mod backend;
pub mod device;
pub mod forward;
pub mod kernels;
pub mod kv_pool;
pub mod transfer;
pub mod weights;

pub use backend::CudaBackend;
pub use device::{cuda_or_skip, driver_available, Gpu};
pub use forward::GpuLlama;
pub use kv_pool::GpuKvPool;
pub use weights::GpuWeights;

/// Element type of weights and of the activations fed to cuBLAS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActDtype {
    /// IEEE half: 11 significant bits, the closer match to the CPU's f32 for real models.
    F16,
    /// bfloat16: 8 significant bits, f32's range.
    Bf16,
}

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("cuBLAS: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
    #[error("NVRTC compile failed:\n{0}")]
    Compile(String),
    #[error("unsupported on CUDA: {0}")]
    Unsupported(String),
}
