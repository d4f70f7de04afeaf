//! The crate's one error type. Encoding fails only on caller mistakes (inconsistent
//! shapes, a bad method); decoding fails on anything that is not a valid, intact encoding
//! made for the expected model. Neither ever panics on bad input.

/// Every way `encode` or `decode` can refuse its input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CodecError {
    // --- Caller mistakes, found by `encode` / `KvContext::validate`. ---
    /// A `KvContext` whose arrays do not match its dimensions, or dimensions out of limits.
    #[error("invalid context: {reason}")]
    InvalidContext { reason: String },
    /// A method with a parameter out of range (group size 0, ratio outside [0, 1], ...).
    #[error("invalid method: {reason}")]
    InvalidMethod { reason: String },
    /// A dropping method was given no scores, or scores of the wrong length.
    #[error("token scores: expected {expected_len} scores, got {actual_len:?}")]
    Scores {
        expected_len: usize,
        actual_len: Option<usize>,
    },

    // --- Invalid encodings, found by `decode`. ---
    /// The input ends before the structure it announces.
    #[error("truncated input: need {needed_bytes} bytes, have {actual_bytes}")]
    Truncated {
        needed_bytes: usize,
        actual_bytes: usize,
    },
    /// The input continues after the checksum.
    #[error("trailing bytes: encoding is {expected_bytes} bytes, input is {actual_bytes}")]
    TrailingBytes {
        expected_bytes: usize,
        actual_bytes: usize,
    },
    #[error("bad magic {found:02x?}: not a pk-codec encoding")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported format version {found} (this build reads version {supported})")]
    UnsupportedVersion { found: u16, supported: u16 },
    #[error("checksum mismatch: the encoding is corrupted")]
    ChecksumMismatch,
    /// Intact, but made for another model (or another KV layout of it).
    #[error("model fingerprint mismatch")]
    FingerprintMismatch,
    /// Intact header with a field no encoder writes (unknown method tag, bits 3, ...).
    #[error("invalid header field {field}: {reason}")]
    InvalidHeader { field: &'static str, reason: String },
    /// Header shapes that disagree with each other or with the payload length.
    #[error("shape mismatch: {reason}")]
    ShapeMismatch { reason: String },
}

impl CodecError {
    pub(crate) fn context(reason: impl Into<String>) -> Self {
        CodecError::InvalidContext {
            reason: reason.into(),
        }
    }
    pub(crate) fn method(reason: impl Into<String>) -> Self {
        CodecError::InvalidMethod {
            reason: reason.into(),
        }
    }
    pub(crate) fn header(field: &'static str, reason: impl Into<String>) -> Self {
        CodecError::InvalidHeader {
            field,
            reason: reason.into(),
        }
    }
    pub(crate) fn shape(reason: impl Into<String>) -> Self {
        CodecError::ShapeMismatch {
            reason: reason.into(),
        }
    }
}
