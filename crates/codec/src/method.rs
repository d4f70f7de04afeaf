//! What to do to a context's KV: the `Method` and its parameters, as chosen per stored
//! context by EVICPRESS (spec `evicpress.md`, "Configuration"). A method is plain data
//! (`Copy`), so the placement code can enumerate a grid of them and ask for their sizes
//! with `compressed_bytes_estimate` without touching any KV.

use crate::error::CodecError;

/// Default quantization group: 32 tokens (keys) or 32 channels (values), as in KIVI.
pub const DEFAULT_GROUP_SIZE: u16 = 32;
/// Default protected head and tail when dropping: one engine block (16 tokens) each,
/// like PagedEviction's first block and tail.
pub const DEFAULT_KEEP_FIRST_TOKENS: u32 = 16;
pub const DEFAULT_KEEP_LAST_TOKENS: u32 = 16;
/// Limit on the protected windows and the full-precision window, so header fields that
/// feed arithmetic stay small.
pub const MAX_WINDOW_TOKENS: u32 = 1 << 24;

/// Storage precision of one tensor (keys or values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    /// IEEE half: the engine's own KV dtype, so lossless for KV that came from the pool.
    F16,
    Q8,
    Q4,
    Q2,
}

impl Precision {
    pub fn bits(self) -> u32 {
        match self {
            Precision::F16 => 16,
            Precision::Q8 => 8,
            Precision::Q4 => 4,
            Precision::Q2 => 2,
        }
    }

    pub(crate) fn from_bits(bits: u8) -> Option<Self> {
        match bits {
            16 => Some(Precision::F16),
            8 => Some(Precision::Q8),
            4 => Some(Precision::Q4),
            2 => Some(Precision::Q2),
            _ => None,
        }
    }

    pub(crate) fn is_quantized(self) -> bool {
        self != Precision::F16
    }
}

/// KIVI-style asymmetric quantization (arXiv 2402.02750).
///
/// Keys are quantized per channel: for each channel, groups of `group_size` consecutive
/// tokens share a minimum and a scale (keys have outlier channels, so a per-channel range
/// keeps one channel's outliers from flattening the others). Values are quantized per
/// token: each token's head vector is cut into groups of `group_size` channels. The last
/// group along either axis may be shorter. Minimum and scale are stored as f16.
///
/// The newest `fp_window_tokens` stored tokens are kept in f16 for both keys and values
/// (KIVI keeps 128; the default here is 0 because a stored context pays for the window in
/// bytes on every tier, and a query appended after it is not yet part of it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QuantSpec {
    pub key: Precision,
    pub value: Precision,
    /// Tokens per key group and channels per value group; at least 1.
    pub group_size: u16,
    pub fp_window_tokens: u32,
}

impl QuantSpec {
    /// Same precision for keys and values, default group, no full-precision window.
    pub fn uniform(precision: Precision) -> Self {
        QuantSpec {
            key: precision,
            value: precision,
            group_size: DEFAULT_GROUP_SIZE,
            fp_window_tokens: 0,
        }
    }

    /// Keys and values at different precisions, e.g. K8V4 (keys are the sensitive half).
    pub fn kv(key: Precision, value: Precision) -> Self {
        QuantSpec {
            key,
            value,
            ..QuantSpec::uniform(key)
        }
    }

    pub(crate) fn validate(&self) -> Result<(), CodecError> {
        if self.group_size == 0 {
            return Err(CodecError::method("group_size must be at least 1"));
        }
        if self.fp_window_tokens > MAX_WINDOW_TOKENS {
            return Err(CodecError::method(format!(
                "fp_window_tokens above {MAX_WINDOW_TOKENS}"
            )));
        }
        Ok(())
    }
}

/// Token dropping: keep the `1 - ratio` most important tokens (by caller-supplied scores),
/// always keeping the first `keep_first_tokens` and the last `keep_last_tokens`.
/// See `drop::select_kept_tokens` for the exact rule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropSpec {
    /// Fraction of the context's tokens to drop, in [0, 1].
    pub ratio: f32,
    pub keep_first_tokens: u32,
    pub keep_last_tokens: u32,
}

impl DropSpec {
    /// Drop `ratio` of the tokens, protecting one 16-token block at each end.
    pub fn new(ratio: f32) -> Self {
        DropSpec {
            ratio,
            keep_first_tokens: DEFAULT_KEEP_FIRST_TOKENS,
            keep_last_tokens: DEFAULT_KEEP_LAST_TOKENS,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), CodecError> {
        if !(0.0..=1.0).contains(&self.ratio) {
            return Err(CodecError::method(format!(
                "drop ratio {} outside [0, 1]",
                self.ratio
            )));
        }
        if self.keep_first_tokens > MAX_WINDOW_TOKENS || self.keep_last_tokens > MAX_WINDOW_TOKENS {
            return Err(CodecError::method(format!(
                "protected windows above {MAX_WINDOW_TOKENS}"
            )));
        }
        Ok(())
    }
}

/// How one stored context is compressed. Dropping happens before quantizing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Method {
    /// Keys and values in f16: 2 bytes per element, the engine's baseline.
    None,
    Quant(QuantSpec),
    /// Dropped tokens; the kept ones in f16.
    Drop(DropSpec),
    DropQuant(DropSpec, QuantSpec),
}

impl Method {
    /// The dropping part, if any.
    pub fn drop_spec(&self) -> Option<DropSpec> {
        match *self {
            Method::Drop(d) | Method::DropQuant(d, _) => Some(d),
            Method::None | Method::Quant(_) => None,
        }
    }

    /// The storage of the kept tokens: `Method::None` and `Method::Drop` are f16/f16.
    pub fn quant_spec(&self) -> QuantSpec {
        match *self {
            Method::Quant(q) | Method::DropQuant(_, q) => q,
            Method::None | Method::Drop(_) => QuantSpec::uniform(Precision::F16),
        }
    }

    pub(crate) fn tag(&self) -> u8 {
        match self {
            Method::None => 0,
            Method::Quant(_) => 1,
            Method::Drop(_) => 2,
            Method::DropQuant(..) => 3,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), CodecError> {
        if let Some(d) = self.drop_spec() {
            d.validate()?;
        }
        self.quant_spec().validate()
    }
}
