//! The versioned, checksummed byte format of one compressed context, and `encode` /
//! `decode` / `inspect` / `compressed_bytes_estimate`. Every tier stores these bytes
//! as-is, so the format is self-describing and validated in full before use.
//!
//! Layout, format version 1, all integers little-endian:
//!
//! | offset | size | field |
//! |-------:|-----:|-------|
//! | 0  | 4  | magic `b"PKKV"` |
//! | 4  | 2  | format version (1) |
//! | 6  | 1  | method tag: 0 none, 1 quant, 2 drop, 3 drop+quant |
//! | 7  | 1  | key bits (16, 8, 4, 2; 16 = f16) |
//! | 8  | 1  | value bits |
//! | 9  | 1  | reserved, 0 |
//! | 10 | 2  | group size (tokens for keys, channels for values) |
//! | 12 | 4  | full-precision window, tokens |
//! | 16 | 4  | drop ratio, f32 (0 without dropping) |
//! | 20 | 4  | protected first tokens (0 without dropping) |
//! | 24 | 4  | protected last tokens (0 without dropping) |
//! | 28 | 4  | layers |
//! | 32 | 4  | KV heads |
//! | 36 | 4  | head dim |
//! | 40 | 4  | stored tokens `n` |
//! | 44 | 4  | original tokens (before dropping) |
//! | 48 | 8  | payload bytes |
//! | 56 | 32 | model fingerprint (caller-supplied) |
//! | 88 | 4n | positions of the stored tokens, u32, strictly increasing |
//! | …  | payload bytes | for each layer, for each KV head: key section, value section (of the first `n − w` tokens; layouts in `quant`), then the newest `w` tokens' keys and values in f16 |
//! | …  | 32 | BLAKE3 of every byte before it |
//!
//! NOTE 4: the checksum is a trailer so that an encoder can stream; a decoder checks the
//! length arithmetic first (so it never reads past the end), then the checksum (so that
//! corruption is reported as such), then the fingerprint, then every field. The header must
//! be canonical, exactly what `encode` writes for the method it names, so one method has
//! one encoding and an unknown bit is never silently ignored.
//!
//! Bump `FORMAT_VERSION` on any change to this layout; decoders refuse other versions.

use crate::context::{KvContext, KvShape};
use crate::drop::select_kept_tokens;
use crate::error::CodecError;
use crate::method::{DropSpec, Method, Precision, QuantSpec};
use crate::quant::{self, Reader, Scratch};

pub const MAGIC: [u8; 4] = *b"PKKV";
pub const FORMAT_VERSION: u16 = 1;
pub const FIXED_HEADER_BYTES: usize = 88;
pub const CHECKSUM_BYTES: usize = 32;
/// Identifies the model (and its KV layout) a context was computed with.
pub type Fingerprint = [u8; 32];

/// What `inspect` reports of a valid encoding, without decoding its payload.
#[derive(Clone, Debug, PartialEq)]
pub struct Header {
    pub method: Method,
    /// Shape of the stored tokens (`n_tokens` = stored, after dropping).
    pub shape: KvShape,
    pub n_original_tokens: usize,
    pub fingerprint: Fingerprint,
    pub payload_bytes: usize,
}

/// Compresses `ctx` with `method`. Dropping methods need `scores` (one per stored token,
/// higher = keep); other methods ignore them. Errors only on invalid input.
/// A context with a window part (`KvContext::window`) is written as a grouped container
/// (`crate::grouped`): the window part is quantized as `method` says but never dropped.
pub fn encode(
    ctx: &KvContext,
    method: &Method,
    scores: Option<&[f32]>,
    fingerprint: &Fingerprint,
) -> Result<Vec<u8>, CodecError> {
    method.validate()?;
    ctx.validate()?;
    match &ctx.window {
        None => encode_frame(ctx, method, scores, fingerprint),
        Some(w) => crate::grouped::encode(ctx, w, method, scores, fingerprint),
    }
}

/// One frame of `ctx`'s own layers (its window part, if any, is not in it); `ctx` and
/// `method` already validated.
pub(crate) fn encode_frame(
    ctx: &KvContext,
    method: &Method,
    scores: Option<&[f32]>,
    fingerprint: &Fingerprint,
) -> Result<Vec<u8>, CodecError> {
    let dropped;
    let ctx = match method.drop_spec() {
        None => ctx,
        Some(spec) => {
            let scores =
                scores
                    .filter(|s| s.len() == ctx.n_tokens())
                    .ok_or(CodecError::Scores {
                        expected_len: ctx.n_tokens(),
                        actual_len: scores.map(<[f32]>::len),
                    })?;
            dropped = ctx.retain_tokens(&select_kept_tokens(scores, &spec));
            &dropped
        }
    };
    let shape = ctx.shape();
    let payload_bytes = payload_bytes(method, &shape);
    let header = Header {
        method: *method,
        shape,
        n_original_tokens: ctx.n_original_tokens,
        fingerprint: *fingerprint,
        payload_bytes,
    };

    let mut out = Vec::with_capacity(
        FIXED_HEADER_BYTES + 4 * shape.n_tokens + payload_bytes + CHECKSUM_BYTES,
    );
    write_fixed_header(&header, &mut out);
    for p in &ctx.positions {
        out.extend_from_slice(&p.to_le_bytes());
    }
    let payload_start = out.len();
    let q = method.quant_spec();
    let (n_quant, d, g) = split_window(&q, shape.n_tokens, shape.head_dim);
    let mut scratch = Scratch::default();
    for layer in 0..shape.n_layers {
        for head in 0..shape.n_kv_heads {
            let (k, v) = (ctx.k_head(layer, head), ctx.v_head(layer, head));
            quant::encode_keys(&k[..n_quant * d], d, g, q.key, &mut out, &mut scratch);
            quant::encode_values(&v[..n_quant * d], d, g, q.value, &mut out, &mut scratch);
            quant::encode_f16(&k[n_quant * d..], &mut out, &mut scratch);
            quant::encode_f16(&v[n_quant * d..], &mut out, &mut scratch);
        }
    }
    debug_assert_eq!(out.len() - payload_start, payload_bytes);
    let checksum = blake3::hash(&out);
    out.extend_from_slice(checksum.as_bytes());
    Ok(out)
}

/// Validates `bytes` in full (NOTE 4) and returns its header; for a grouped container,
/// both frames are validated and the main frame's header is returned.
pub fn inspect(bytes: &[u8]) -> Result<Header, CodecError> {
    if bytes.starts_with(&crate::grouped::GROUPED_MAGIC) {
        let parts = crate::grouped::split(bytes)?;
        inspect_frame(parts.tail)?;
        return inspect_frame(parts.main);
    }
    inspect_frame(bytes)
}

/// `inspect` of one frame.
pub(crate) fn inspect_frame(bytes: &[u8]) -> Result<Header, CodecError> {
    let fixed = bytes
        .get(..FIXED_HEADER_BYTES)
        .ok_or(CodecError::Truncated {
            needed_bytes: FIXED_HEADER_BYTES,
            actual_bytes: bytes.len(),
        })?;
    let field = |at: usize, n: usize| &fixed[at..at + n];
    let u32_at = |at: usize| u32::from_le_bytes(field(at, 4).try_into().unwrap());
    if field(0, 4) != MAGIC {
        return Err(CodecError::BadMagic {
            found: field(0, 4).try_into().unwrap(),
        });
    }
    let version = u16::from_le_bytes(field(4, 2).try_into().unwrap());
    if version != FORMAT_VERSION {
        return Err(CodecError::UnsupportedVersion {
            found: version,
            supported: FORMAT_VERSION,
        });
    }

    // Length arithmetic in u64 first: a u32 token count and a u64 payload length cannot
    // overflow it, and a mismatch is reported before anything past the header is read.
    let n_stored = u32_at(40) as u64;
    let payload = u64::from_le_bytes(field(48, 8).try_into().unwrap());
    let total = (FIXED_HEADER_BYTES + CHECKSUM_BYTES) as u64 + 4 * n_stored;
    let total = total
        .checked_add(payload)
        .filter(|&t| t <= usize::MAX as u64);
    let total = total.ok_or(CodecError::Truncated {
        needed_bytes: usize::MAX,
        actual_bytes: bytes.len(),
    })? as usize;
    if bytes.len() < total {
        return Err(CodecError::Truncated {
            needed_bytes: total,
            actual_bytes: bytes.len(),
        });
    }
    if bytes.len() > total {
        return Err(CodecError::TrailingBytes {
            expected_bytes: total,
            actual_bytes: bytes.len(),
        });
    }
    let (body, checksum) = bytes.split_at(total - CHECKSUM_BYTES);
    if blake3::hash(body).as_bytes() != checksum {
        return Err(CodecError::ChecksumMismatch);
    }

    let header = parse_fixed_header(fixed)?;
    let positions: Vec<u32> = positions_of(bytes, header.shape.n_tokens).collect();
    if positions.windows(2).any(|w| w[0] >= w[1]) {
        return Err(CodecError::header("positions", "not strictly increasing"));
    }
    Ok(header)
}

/// Validates `bytes` (NOTE 4), checks it was made for `expected_fingerprint`, and
/// decompresses it. Dropped tokens stay dropped: the result holds the stored tokens.
pub fn decode(bytes: &[u8], expected_fingerprint: &Fingerprint) -> Result<KvContext, CodecError> {
    let mut ctx = empty_context();
    decode_into(bytes, expected_fingerprint, &mut ctx)?;
    Ok(ctx)
}

/// A context with no data, for decoding into.
pub(crate) fn empty_context() -> KvContext {
    KvContext {
        n_layers: 0,
        n_kv_heads: 0,
        head_dim: 0,
        n_original_tokens: 0,
        positions: Vec::new(),
        k: Vec::new(),
        v: Vec::new(),
        window: None,
    }
}

/// As `decode`, into `out`, reusing its buffers: a tier decoding chunk after chunk of the
/// same shape then allocates (and page-faults) nothing. On error `out` is unspecified.
pub fn decode_into(
    bytes: &[u8],
    expected_fingerprint: &Fingerprint,
    out: &mut KvContext,
) -> Result<(), CodecError> {
    if bytes.starts_with(&crate::grouped::GROUPED_MAGIC) {
        return crate::grouped::decode_into(bytes, expected_fingerprint, out);
    }
    decode_frame_into(bytes, expected_fingerprint, out)?;
    out.window = None;
    Ok(())
}

/// `decode_into` of one frame (`out.window` untouched).
pub(crate) fn decode_frame_into(
    bytes: &[u8],
    expected_fingerprint: &Fingerprint,
    out: &mut KvContext,
) -> Result<(), CodecError> {
    let header = inspect_frame(bytes)?;
    if &header.fingerprint != expected_fingerprint {
        return Err(CodecError::FingerprintMismatch);
    }
    let shape = header.shape;
    let q = header.method.quant_spec();
    let (n_quant, d, g) = split_window(&q, shape.n_tokens, shape.head_dim);
    let n_elements = shape.elements(shape.n_tokens);
    for buf in [&mut out.k, &mut out.v] {
        buf.clear();
        buf.resize(n_elements, 0.0);
    }
    let payload_start = FIXED_HEADER_BYTES + 4 * shape.n_tokens;
    let mut r = Reader::new(&bytes[payload_start..payload_start + header.payload_bytes]);
    let mut scratch = Scratch::default();
    let head_len = shape.n_tokens * d;
    for (k_head, v_head) in out
        .k
        .chunks_exact_mut(head_len)
        .zip(out.v.chunks_exact_mut(head_len))
    {
        let (k_quant, k_window) = k_head.split_at_mut(n_quant * d);
        let (v_quant, v_window) = v_head.split_at_mut(n_quant * d);
        quant::decode_keys(&mut r, k_quant, d, g, q.key, &mut scratch)?;
        quant::decode_values(&mut r, v_quant, d, g, q.value, &mut scratch)?;
        quant::decode_f16(&mut r, k_window, &mut scratch)?;
        quant::decode_f16(&mut r, v_window, &mut scratch)?;
    }
    if r.pos() != header.payload_bytes {
        return Err(CodecError::shape("payload not fully consumed"));
    }
    out.n_layers = shape.n_layers;
    out.n_kv_heads = shape.n_kv_heads;
    out.head_dim = d;
    out.n_original_tokens = header.n_original_tokens;
    out.positions.clear();
    out.positions.extend(positions_of(bytes, shape.n_tokens));
    Ok(())
}

/// The exact length of `encode`'s output for a context of `shape` that has not been
/// dropped before (`n_original_tokens == shape.n_tokens`), without encoding: what the
/// EVICPRESS delay model divides by bandwidth. Does not validate `method`; for an invalid
/// one the result is finite but meaningless.
pub fn compressed_bytes_estimate(method: &Method, shape: &KvShape) -> usize {
    let n_stored = match method.drop_spec() {
        Some(spec) => crate::drop::n_kept_tokens(shape.n_tokens, &spec),
        None => shape.n_tokens,
    };
    let stored = KvShape {
        n_tokens: n_stored,
        ..*shape
    };
    FIXED_HEADER_BYTES + 4 * n_stored + payload_bytes(method, &stored) + CHECKSUM_BYTES
}

/// The exact length of `encode`'s output for `ctx` (not dropped before) under `method`,
/// its window part included: what a stored context of a model with KV cache groups costs.
pub fn context_bytes_estimate(method: &Method, ctx: &KvContext) -> usize {
    match &ctx.window {
        None => compressed_bytes_estimate(method, &ctx.shape()),
        Some(w) => crate::grouped::bytes_estimate(method, &ctx.shape(), &w.kv.shape()),
    }
}

/// Payload bytes for `shape` (stored tokens) under `method`.
fn payload_bytes(method: &Method, shape: &KvShape) -> usize {
    let q = method.quant_spec();
    let (n_quant, d, g) = split_window(&q, shape.n_tokens, shape.head_dim);
    let n_window = shape.n_tokens - n_quant;
    let per_head = quant::key_section_bytes(n_quant, d, g, q.key)
        + quant::value_section_bytes(n_quant, d, g, q.value)
        + n_window * d * 2 * 2;
    shape.n_layers * shape.n_kv_heads * per_head
}

/// (tokens quantized, head dim, group size): the newest `fp_window_tokens` are not.
fn split_window(q: &QuantSpec, n_tokens: usize, head_dim: usize) -> (usize, usize, usize) {
    let n_window = (q.fp_window_tokens as usize).min(n_tokens);
    (
        n_tokens - n_window,
        head_dim,
        (q.group_size as usize).max(1),
    )
}

fn positions_of(bytes: &[u8], n_tokens: usize) -> impl Iterator<Item = u32> + '_ {
    let raw = &bytes[FIXED_HEADER_BYTES..FIXED_HEADER_BYTES + 4 * n_tokens];
    raw.chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn write_fixed_header(h: &Header, out: &mut Vec<u8>) {
    let q = h.method.quant_spec();
    let d = h.method.drop_spec().unwrap_or(DropSpec {
        ratio: 0.0,
        keep_first_tokens: 0,
        keep_last_tokens: 0,
    });
    let start = out.len();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&[h.method.tag(), q.key.bits() as u8, q.value.bits() as u8, 0]);
    out.extend_from_slice(&q.group_size.to_le_bytes());
    out.extend_from_slice(&q.fp_window_tokens.to_le_bytes());
    out.extend_from_slice(&d.ratio.to_le_bytes());
    out.extend_from_slice(&d.keep_first_tokens.to_le_bytes());
    out.extend_from_slice(&d.keep_last_tokens.to_le_bytes());
    let s = &h.shape;
    for dim in [
        s.n_layers,
        s.n_kv_heads,
        s.head_dim,
        s.n_tokens,
        h.n_original_tokens,
    ] {
        out.extend_from_slice(&(dim as u32).to_le_bytes());
    }
    out.extend_from_slice(&(h.payload_bytes as u64).to_le_bytes());
    out.extend_from_slice(&h.fingerprint);
    debug_assert_eq!(out.len() - start, FIXED_HEADER_BYTES);
}

/// Parses and validates the fixed header (its length and checksum already checked).
fn parse_fixed_header(fixed: &[u8]) -> Result<Header, CodecError> {
    let u32_at = |at: usize| u32::from_le_bytes(fixed[at..at + 4].try_into().unwrap());
    let precision = |field, bits: u8| {
        Precision::from_bits(bits).ok_or(CodecError::header(field, format!("{bits} bits")))
    };
    let quant = QuantSpec {
        key: precision("key bits", fixed[7])?,
        value: precision("value bits", fixed[8])?,
        group_size: u16::from_le_bytes([fixed[10], fixed[11]]),
        fp_window_tokens: u32_at(12),
    };
    let drop = DropSpec {
        ratio: f32::from_le_bytes(fixed[16..20].try_into().unwrap()),
        keep_first_tokens: u32_at(20),
        keep_last_tokens: u32_at(24),
    };
    let method = match fixed[6] {
        0 => Method::None,
        1 => Method::Quant(quant),
        2 => Method::Drop(drop),
        3 => Method::DropQuant(drop, quant),
        tag => return Err(CodecError::header("method", format!("unknown tag {tag}"))),
    };
    method
        .validate()
        .map_err(|e| CodecError::header("method", e.to_string()))?;

    let shape = KvShape {
        n_layers: u32_at(28) as usize,
        n_kv_heads: u32_at(32) as usize,
        head_dim: u32_at(36) as usize,
        n_tokens: u32_at(40) as usize,
    };
    shape
        .validate()
        .map_err(|e| CodecError::shape(e.to_string()))?;
    let n_original_tokens = u32_at(44) as usize;
    // A non-dropping method may store fewer tokens than the original: re-encoding a
    // decoded dropped context keeps its original length.
    if n_original_tokens < shape.n_tokens || n_original_tokens > crate::context::MAX_TOKENS {
        return Err(CodecError::shape(format!(
            "{} stored tokens of {n_original_tokens} original",
            shape.n_tokens
        )));
    }
    let payload_field = u64::from_le_bytes(fixed[48..56].try_into().unwrap());
    let expected = payload_bytes(&method, &shape);
    if payload_field != expected as u64 {
        return Err(CodecError::shape(format!(
            "payload is {payload_field} bytes, shapes need {expected}"
        )));
    }
    let header = Header {
        method,
        shape,
        n_original_tokens,
        fingerprint: fixed[56..88].try_into().unwrap(),
        payload_bytes: expected,
    };

    let mut canonical = Vec::with_capacity(FIXED_HEADER_BYTES);
    write_fixed_header(&header, &mut canonical);
    if canonical != fixed {
        return Err(CodecError::header(
            "header",
            "not canonical (fields unused by its method are set)",
        ));
    }
    Ok(header)
}
