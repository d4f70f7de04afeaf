//! The container of a context stored with KV cache groups (`KvContext::window`): two
//! ordinary frames (`format`), the full-attention layers under the chosen method and the
//! sliding-window layers' tail under its quantization only, with the window layers' model
//! indices. A context without a window part is one frame, as before, so every frame
//! written earlier still decodes.
//!
//! Layout, container version 1, all integers little-endian:
//!
//! | offset | size | field |
//! |-------:|-----:|-------|
//! | 0  | 4  | magic `b"PKKG"` |
//! | 4  | 2  | container version (1) |
//! | 6  | 2  | reserved, 0 |
//! | 8  | 4  | window layers `w` |
//! | 12 | 4w | model index of each window layer, u32, strictly increasing |
//! | …  | 8  | bytes `m` of the main frame |
//! | …  | m  | the main frame (full-attention layers) |
//! | …  | 8  | bytes `t` of the window frame |
//! | …  | t  | the window frame (window layers' tail) |
//! | …  | 32 | BLAKE3 of every byte before it |
//!
//! Each frame keeps its own checksum and fingerprint; the trailer also covers the layer
//! list. Decoding checks the lengths before reading, then the trailer, then each frame,
//! then the combined context's invariants, and never panics (fuzzed with the frames).

use crate::context::{KvContext, WindowKv, MAX_LAYERS};
use crate::error::CodecError;
use crate::format::{self, Fingerprint, CHECKSUM_BYTES};
use crate::method::Method;

pub const GROUPED_MAGIC: [u8; 4] = *b"PKKG";
pub const GROUPED_VERSION: u16 = 1;
/// Bytes of the container around its frames and layer list.
const FIXED_BYTES: usize = 12 + 8 + 8 + CHECKSUM_BYTES;

/// The method of a window part under `method`: its quantization, never its dropping.
pub fn window_method(method: &Method) -> Method {
    match *method {
        Method::Quant(q) | Method::DropQuant(_, q) => Method::Quant(q),
        Method::None | Method::Drop(_) => Method::None,
    }
}

/// Encodes a context with a window part (validated by the caller).
pub(crate) fn encode(
    ctx: &KvContext,
    window: &WindowKv,
    method: &Method,
    scores: Option<&[f32]>,
    fingerprint: &Fingerprint,
) -> Result<Vec<u8>, CodecError> {
    let main = format::encode_frame(ctx, method, scores, fingerprint)?;
    let tail = format::encode_frame(&window.kv, &window_method(method), None, fingerprint)?;
    let mut out =
        Vec::with_capacity(FIXED_BYTES + 4 * window.layers.len() + main.len() + tail.len());
    out.extend_from_slice(&GROUPED_MAGIC);
    out.extend_from_slice(&GROUPED_VERSION.to_le_bytes());
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&(window.layers.len() as u32).to_le_bytes());
    for l in &window.layers {
        out.extend_from_slice(&l.to_le_bytes());
    }
    for frame in [&main, &tail] {
        out.extend_from_slice(&(frame.len() as u64).to_le_bytes());
        out.extend_from_slice(frame);
    }
    let checksum = blake3::hash(&out);
    out.extend_from_slice(checksum.as_bytes());
    Ok(out)
}

/// The parts of a container whose lengths and trailer are checked.
pub(crate) struct Parts<'a> {
    pub layers: Vec<u32>,
    pub main: &'a [u8],
    pub tail: &'a [u8],
}

/// Splits a container (magic already seen) into its layer list and frames, checking every
/// length before reading and then the trailer.
pub(crate) fn split(bytes: &[u8]) -> Result<Parts<'_>, CodecError> {
    let truncated = |needed_bytes: usize| CodecError::Truncated {
        needed_bytes,
        actual_bytes: bytes.len(),
    };
    let fixed = bytes.get(..12).ok_or(truncated(FIXED_BYTES))?;
    let version = u16::from_le_bytes([fixed[4], fixed[5]]);
    if version != GROUPED_VERSION {
        return Err(CodecError::UnsupportedVersion {
            found: version,
            supported: GROUPED_VERSION,
        });
    }
    let n_layers = u32::from_le_bytes(fixed[8..12].try_into().unwrap()) as usize;
    if n_layers == 0 || n_layers > MAX_LAYERS {
        return Err(CodecError::header("window layers", format!("{n_layers}")));
    }
    let mut at = 12 + 4 * n_layers;
    let mut frames = [&bytes[..0]; 2];
    for frame in &mut frames {
        let len = bytes.get(at..at + 8).ok_or(truncated(at + 8))?;
        let len = u64::from_le_bytes(len.try_into().unwrap());
        let end = usize::try_from(len)
            .ok()
            .and_then(|l| (at + 8).checked_add(l))
            .ok_or(truncated(usize::MAX))?;
        *frame = bytes.get(at + 8..end).ok_or(truncated(end))?;
        at = end;
    }
    let total = at + CHECKSUM_BYTES;
    if bytes.len() != total {
        return Err(match bytes.len() < total {
            true => truncated(total),
            false => CodecError::TrailingBytes {
                expected_bytes: total,
                actual_bytes: bytes.len(),
            },
        });
    }
    if blake3::hash(&bytes[..at]).as_bytes() != &bytes[at..] {
        return Err(CodecError::ChecksumMismatch);
    }
    if reserved_set(fixed) {
        return Err(CodecError::header("reserved", "not 0"));
    }
    let layers = bytes[12..12 + 4 * n_layers]
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Ok(Parts {
        layers,
        main: frames[0],
        tail: frames[1],
    })
}

fn reserved_set(fixed: &[u8]) -> bool {
    fixed[6] != 0 || fixed[7] != 0
}

/// Decodes a container into `out` (buffers reused, the window part's too).
pub(crate) fn decode_into(
    bytes: &[u8],
    expected_fingerprint: &Fingerprint,
    out: &mut KvContext,
) -> Result<(), CodecError> {
    let parts = split(bytes)?;
    let mut window = out.window.take().unwrap_or_else(|| {
        Box::new(WindowKv {
            layers: Vec::new(),
            kv: format::empty_context(),
        })
    });
    format::decode_frame_into(parts.main, expected_fingerprint, out)?;
    format::decode_frame_into(parts.tail, expected_fingerprint, &mut window.kv)?;
    let tail_header = format::inspect_frame(parts.tail)?;
    if tail_header.method.drop_spec().is_some() {
        return Err(CodecError::header(
            "window frame",
            "a window part is never dropped",
        ));
    }
    window.layers = parts.layers;
    out.window = Some(window);
    out.validate()
        .map_err(|e| CodecError::shape(format!("window part: {e}")))
}

/// The exact length of `encode`'s output for a whole context with a window part of
/// `window_shape` (`n_window_layers` layers) under `method`.
pub(crate) fn bytes_estimate(
    method: &Method,
    main: &crate::KvShape,
    window_shape: &crate::KvShape,
) -> usize {
    FIXED_BYTES
        + 4 * window_shape.n_layers
        + format::compressed_bytes_estimate(method, main)
        + format::compressed_bytes_estimate(&window_method(method), window_shape)
}
