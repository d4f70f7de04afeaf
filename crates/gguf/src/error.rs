//! Errors of the GGUF reader. Every malformed input maps to one of these; the reader never panics on file contents.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot open {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("not a GGUF file: magic is {found:?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {version} (supported: 2, 3)")]
    UnsupportedVersion { version: u32 },
    #[error("GGUF file is truncated: needed {needed} bytes at offset {offset}, file has {file_len_bytes}")]
    Truncated {
        offset: u64,
        needed: u64,
        file_len_bytes: u64,
    },
    #[error("invalid GGUF: {0}")]
    Invalid(String),
    #[error("unsupported tensor type {type_id} ({name}) for tensor {tensor}")]
    UnsupportedType {
        type_id: u32,
        name: &'static str,
        tensor: String,
    },
    #[error("missing metadata key {0}")]
    MissingKey(String),
    #[error("metadata key {key} has type {found}, expected {expected}")]
    WrongType {
        key: String,
        found: &'static str,
        expected: &'static str,
    },
    #[error("missing tensor {0}")]
    MissingTensor(String),
    /// A metadata key or tensor name given twice. llama.cpp's reader refuses such a file,
    /// and which copy a model was meant to run with cannot be known.
    #[error("invalid GGUF: duplicate {what} {name:?}")]
    Duplicate { what: &'static str, name: String },
}

pub type Result<T> = std::result::Result<T, GgufError>;
