//! `pk-codec`: compression of a stored context's KV cache, for the tiers behind the
//! engine (EVICPRESS, spec `shared/spec/evicpress.md`; issue 8).
//!
//! Three mechanisms, composable as a `Method`:
//! - **Quantization** (`quant`): KIVI-style (arXiv 2402.02750) asymmetric 8/4/2-bit with a
//!   per-group f16 minimum and scale; keys grouped per channel over `G` tokens, values per
//!   token over `G` channels; an optional f16 window of the newest tokens. Keys and values
//!   may use different precisions (K8V4).
//! - **Token dropping** (`drop`): keep the `1 − r` highest-scored tokens given the caller's
//!   per-token scores, always keeping the first and last tokens; kept positions are stored.
//! - **A versioned format** (`format`): header + positions + payload + BLAKE3 trailer,
//!   validated in full on decode; a context stored with KV cache groups (a window part)
//!   is a container of two such frames (`grouped`).
//!
//! ```
//! use pk_codec::{decode, encode, KvContext, Method, Precision, QuantSpec};
//! let (layers, heads, dim, tokens) = (2, 1, 8, 40);
//! let n = layers * heads * dim * tokens;
//! let k: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 0.25).collect();
//! let ctx = KvContext::new(layers, heads, dim, (0..tokens as u32).collect(), k.clone(), k).unwrap();
//! let fingerprint = [7u8; 32];
//! let bytes = encode(&ctx, &Method::Quant(QuantSpec::uniform(Precision::Q8)), None, &fingerprint).unwrap();
//! let back = decode(&bytes, &fingerprint).unwrap();
//! assert_eq!(back.positions, ctx.positions);
//! ```
//!
//! Architecture Invariant: the crate is pure. No I/O, no async, no threads, no knowledge
//! of tiers, the paged pool or the model; it sees `Vec<f32>`s and bytes. Live quantized
//! KV inside the paged pool (attention reading q8/q4 blocks) is not here but in
//! `pk-model` (`KvDtype::Q8`/`Q4`, per-token groups so that decode can append).
//!
//! Architecture Invariant: `decode` and `inspect` never panic and never read out of
//! bounds, whatever the bytes; every failure is a `CodecError` (fuzzed in
//! `tests/format_fuzz.rs`).
//!
//! Code map: `context` (`KvContext`, `KvShape`, limits), `method` (`Method` and its
//! specs), `drop` (which tokens to keep), `quant` (section kernels and their sizes),
//! `format` (header, `encode`, `decode`, `decode_into`, `inspect`, `compressed_bytes_estimate`),
//! `grouped` (the container of a context with a window part), `error`.
// One audited unsafe block (marked `allow(unsafe_code)`); none elsewhere.
#![deny(unsafe_code)]

mod context;
pub mod drop;
mod error;
mod format;
mod grouped;
mod method;
mod quant;

pub use context::{
    KvContext, KvShape, WindowKv, MAX_HEAD_DIM, MAX_KV_HEADS, MAX_LAYERS, MAX_TOKENS,
};
pub use error::CodecError;
pub use format::{
    compressed_bytes_estimate, context_bytes_estimate, decode, decode_into, encode, inspect,
    Fingerprint, Header, CHECKSUM_BYTES, FIXED_HEADER_BYTES, FORMAT_VERSION, MAGIC,
};
pub use grouped::{window_method, GROUPED_MAGIC, GROUPED_VERSION};
pub use method::{
    DropSpec, Method, Precision, QuantSpec, DEFAULT_GROUP_SIZE, DEFAULT_KEEP_FIRST_TOKENS,
    DEFAULT_KEEP_LAST_TOKENS, MAX_WINDOW_TOKENS,
};
