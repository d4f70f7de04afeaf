//! `pk-gguf`: reads GGUF model files (header, metadata, tensor infos, memory-mapped data)
//! and dequantises the GGML block formats our models use.
//!
//! The reader validates every offset and count against the file before using it, so a
//! truncated or corrupted file yields a [`GgufError`], never a panic.
// Two audited unsafe blocks (marked `allow(unsafe_code)`: the map, and dropping a
// converted tensor's resident pages); none elsewhere.
#![deny(unsafe_code)]

mod dequant;
mod error;
mod file;
mod types;

pub use dequant::{dequantize, scale_min_k4};
pub use error::{GgufError, Result};
pub use file::{GgufFile, MetaValue, TensorInfo};
pub use types::GgmlType;
