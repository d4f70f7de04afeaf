//! Kernels for one `[token][head_dim]` section of K or V: KIVI-style asymmetric group
//! quantization (keys per channel, values per token), f16 storage, bit packing, and the
//! byte size of each section. `format` strings sections together; nothing here knows about
//! headers.
//!
//! A group with minimum `lo` and maximum `hi` stores `min = f16 ≤ lo` (rounded down) and
//! `scale = f16 ≥ (hi − min) / (2^bits − 1)` (rounded up), so that every value of the group
//! lies on `[min, min + levels · scale]` and the reconstruction `min + code · scale` is
//! within `scale / 2` of it (NOTE 3). Rounding the parameters to nearest instead would let
//! the group's extremes fall off the grid and be clamped, breaking that bound.
//!
//! Values outside f16's finite range (±65504) saturate: the engine's KV is f16, so they
//! never occur in practice. NaN inputs decode to the group minimum.
//!
//! Section layouts (all little-endian, f16 as IEEE binary16 bits):
//! - F16: `tokens × dim` f16, token-major.
//! - Quantized keys: per group of `G` tokens: `dim` f16 minimums, `dim` f16 scales, then
//!   the group's codes, token-major, packed and padded to a whole byte.
//! - Quantized values: per token: `⌈dim/G⌉` f16 minimums, as many f16 scales, then that
//!   token's `dim` codes, packed and padded to a whole byte.
//!
//! Packing: code `i` of a run goes to bits `(i mod c) · bits` of byte `⌊i / c⌋`, with
//! `c = 8 / bits` codes per byte (low bits first).

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::error::CodecError;
use crate::method::Precision;

const F16_MAX: f32 = 65504.0;

/// Bytes of one quantized key section of `n_tokens × dim`.
pub(crate) fn key_section_bytes(n_tokens: usize, dim: usize, group: usize, p: Precision) -> usize {
    if !p.is_quantized() {
        return n_tokens * dim * 2;
    }
    let full_groups = n_tokens / group;
    let tail_tokens = n_tokens % group;
    let group_bytes = |tokens: usize| 4 * dim + packed_bytes(tokens * dim, p);
    full_groups * group_bytes(group)
        + if tail_tokens > 0 {
            group_bytes(tail_tokens)
        } else {
            0
        }
}

/// Bytes of one quantized value section of `n_tokens × dim`.
pub(crate) fn value_section_bytes(
    n_tokens: usize,
    dim: usize,
    group: usize,
    p: Precision,
) -> usize {
    if !p.is_quantized() {
        return n_tokens * dim * 2;
    }
    n_tokens * (4 * dim.div_ceil(group) + packed_bytes(dim, p))
}

fn packed_bytes(n_codes: usize, p: Precision) -> usize {
    (n_codes * p.bits() as usize).div_ceil(8)
}

/// Reusable buffers, so the hot loops allocate nothing per group or per element.
#[derive(Default)]
pub(crate) struct Scratch {
    codes: Vec<u8>,
    halves: Vec<f16>,
    lo: Vec<f32>,
    hi: Vec<f32>,
    mins: Vec<f32>,
    scales: Vec<f32>,
    inv_scales: Vec<f32>,
}

/// Appends the key section for `x` (`[token][dim]`).
pub(crate) fn encode_keys(
    x: &[f32],
    dim: usize,
    group: usize,
    p: Precision,
    out: &mut Vec<u8>,
    s: &mut Scratch,
) {
    if !p.is_quantized() {
        return encode_f16(x, out, s);
    }
    let levels = levels(p);
    for rows in x.chunks(group * dim) {
        // Per-channel range over the group's tokens: a row-wise pass keeps the inner loop
        // contiguous over channels.
        s.lo.clear();
        s.lo.resize(dim, f32::INFINITY);
        s.hi.clear();
        s.hi.resize(dim, f32::NEG_INFINITY);
        for row in rows.chunks_exact(dim) {
            for ((lo, hi), &v) in s.lo.iter_mut().zip(s.hi.iter_mut()).zip(row) {
                *lo = lo.min(v);
                *hi = hi.max(v);
            }
        }
        params_into(&s.lo, &s.hi, levels, &mut s.mins, &mut s.scales, out);
        s.inv_scales.clear();
        s.inv_scales
            .extend(s.scales.iter().map(|&scale| inv(scale)));
        s.codes.clear();
        s.codes.resize(rows.len(), 0);
        for (row, codes) in rows.chunks_exact(dim).zip(s.codes.chunks_exact_mut(dim)) {
            for (((c, &v), &min), &inv_scale) in
                codes.iter_mut().zip(row).zip(&s.mins).zip(&s.inv_scales)
            {
                *c = quantize(v, min, inv_scale, levels);
            }
        }
        pack(&s.codes, p, out);
    }
}

/// Appends the value section for `x` (`[token][dim]`).
pub(crate) fn encode_values(
    x: &[f32],
    dim: usize,
    group: usize,
    p: Precision,
    out: &mut Vec<u8>,
    s: &mut Scratch,
) {
    if !p.is_quantized() {
        return encode_f16(x, out, s);
    }
    let levels = levels(p);
    for row in x.chunks_exact(dim) {
        s.lo.clear();
        s.hi.clear();
        for g in row.chunks(group) {
            s.lo.push(g.iter().fold(f32::INFINITY, |a, &v| a.min(v)));
            s.hi.push(g.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v)));
        }
        params_into(&s.lo, &s.hi, levels, &mut s.mins, &mut s.scales, out);
        s.codes.clear();
        s.codes.resize(dim, 0);
        let groups = row.chunks(group).zip(s.codes.chunks_mut(group));
        for ((g, codes), (&min, &scale)) in groups.zip(s.mins.iter().zip(&s.scales)) {
            let inv_scale = inv(scale);
            for (c, &v) in codes.iter_mut().zip(g) {
                *c = quantize(v, min, inv_scale, levels);
            }
        }
        pack(&s.codes, p, out);
    }
}

/// Decodes a key section into `x` (`[token][dim]`), reading from `r`.
pub(crate) fn decode_keys(
    r: &mut Reader,
    x: &mut [f32],
    dim: usize,
    group: usize,
    p: Precision,
    s: &mut Scratch,
) -> Result<(), CodecError> {
    if !p.is_quantized() {
        return decode_f16(r, x, s);
    }
    for rows in x.chunks_mut(group * dim) {
        read_f16s(r, dim, &mut s.mins)?;
        read_f16s(r, dim, &mut s.scales)?;
        unpack(
            r.take(packed_bytes(rows.len(), p))?,
            rows.len(),
            p,
            &mut s.codes,
        );
        for (row, codes) in rows.chunks_exact_mut(dim).zip(s.codes.chunks_exact(dim)) {
            for (((o, &c), &min), &scale) in row.iter_mut().zip(codes).zip(&s.mins).zip(&s.scales) {
                *o = min + c as f32 * scale;
            }
        }
    }
    Ok(())
}

/// Decodes a value section into `x` (`[token][dim]`), reading from `r`.
pub(crate) fn decode_values(
    r: &mut Reader,
    x: &mut [f32],
    dim: usize,
    group: usize,
    p: Precision,
    s: &mut Scratch,
) -> Result<(), CodecError> {
    if !p.is_quantized() {
        return decode_f16(r, x, s);
    }
    let n_groups = dim.div_ceil(group);
    for row in x.chunks_exact_mut(dim) {
        read_f16s(r, n_groups, &mut s.mins)?;
        read_f16s(r, n_groups, &mut s.scales)?;
        unpack(r.take(packed_bytes(dim, p))?, dim, p, &mut s.codes);
        let groups = row.chunks_mut(group).zip(s.codes.chunks(group));
        for ((g, codes), (&min, &scale)) in groups.zip(s.mins.iter().zip(&s.scales)) {
            for (o, &c) in g.iter_mut().zip(codes) {
                *o = min + c as f32 * scale;
            }
        }
    }
    Ok(())
}

/// Appends `x` as f16.
pub(crate) fn encode_f16(x: &[f32], out: &mut Vec<u8>, s: &mut Scratch) {
    s.halves.clear();
    s.halves.resize(x.len(), f16::ZERO);
    // The slice conversion uses F16C/NEON when the CPU has it, checked once per call.
    s.halves.convert_from_f32_slice(x);
    let start = out.len();
    out.resize(start + x.len() * 2, 0);
    for (b, h) in out[start..].chunks_exact_mut(2).zip(&s.halves) {
        b.copy_from_slice(&h.to_le_bytes());
    }
}

/// Reads `x.len()` f16 values into `x`.
pub(crate) fn decode_f16(r: &mut Reader, x: &mut [f32], s: &mut Scratch) -> Result<(), CodecError> {
    let bytes = r.take(x.len() * 2)?;
    // Little-endian f16 bytes at an even address are already a `[f16]`: convert in place
    // rather than copying them into scratch first (a restored context is tens of MB).
    #[cfg(target_endian = "little")]
    {
        // SAFETY: u16 has no invalid bit patterns; `align_to` only yields the aligned middle.
        #[allow(unsafe_code)]
        let (head, mid, tail) = unsafe { bytes.align_to::<u16>() };
        if head.is_empty() && tail.is_empty() {
            use half::slice::HalfBitsSliceExt;
            mid.reinterpret_cast::<f16>().convert_to_f32_slice(x);
            return Ok(());
        }
    }
    s.halves.clear();
    s.halves.resize(x.len(), f16::ZERO);
    for (h, b) in s.halves.iter_mut().zip(bytes.chunks_exact(2)) {
        *h = f16::from_le_bytes([b[0], b[1]]);
    }
    s.halves.convert_to_f32_slice(x);
    Ok(())
}

/// A bounds-checked cursor over a byte slice: every read that would run past the end is an
/// error, so a wrong size computation can never become an out-of-bounds read.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub(crate) fn take(&mut self, n_bytes: usize) -> Result<&'a [u8], CodecError> {
        let end = self
            .pos
            .checked_add(n_bytes)
            .filter(|&e| e <= self.buf.len());
        let end = end.ok_or(CodecError::Truncated {
            needed_bytes: self.pos.saturating_add(n_bytes),
            actual_bytes: self.buf.len(),
        })?;
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    pub(crate) fn pos(&self) -> usize {
        self.pos
    }
}

fn read_f16s(r: &mut Reader, n: usize, out: &mut Vec<f32>) -> Result<(), CodecError> {
    let bytes = r.take(n * 2)?;
    out.clear();
    out.extend(
        bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
    );
    Ok(())
}

fn levels(p: Precision) -> f32 {
    ((1u32 << p.bits()) - 1) as f32
}

fn inv(scale: f32) -> f32 {
    if scale > 0.0 {
        1.0 / scale
    } else {
        0.0
    }
}

/// Code of `v` in the group `(min, 1/scale)`: round to nearest, clamped to the grid.
/// Adding 1.5·2^23 puts `round(y)` (ties to even) in the low mantissa bits, an integer
/// trick that vectorizes where `round()` and the saturating `as u8` cast do not.
/// A NaN `v` stays NaN through the clamp, whose low bits are 0.
#[inline(always)]
fn quantize(v: f32, min: f32, inv_scale: f32, levels: f32) -> u8 {
    const ROUND_MAGIC: f32 = 12_582_912.0;
    let y = ((v - min) * inv_scale).clamp(0.0, levels);
    ((y + ROUND_MAGIC).to_bits() & 0xff) as u8
}

/// Computes each group's (min, scale) per NOTE 3 into `mins`/`scales` (as the f32 values
/// of their f16 encodings, so encoder and decoder use identical numbers) and appends the
/// f16 minimums, then the f16 scales.
fn params_into(
    lo: &[f32],
    hi: &[f32],
    levels: f32,
    mins: &mut Vec<f32>,
    scales: &mut Vec<f32>,
    out: &mut Vec<u8>,
) {
    mins.clear();
    scales.clear();
    for (&lo, &hi) in lo.iter().zip(hi) {
        let (min, scale) = if lo <= hi {
            let min = f16_floor(lo.max(-F16_MAX));
            let range = hi.min(F16_MAX) - min.to_f32();
            (min, f16_ceil(range.max(0.0) / levels))
        } else {
            (f16::ZERO, f16::ZERO) // Only NaNs in the group.
        };
        mins.push(min.to_f32());
        scales.push(scale.to_f32());
    }
    for &m in mins.iter() {
        out.extend_from_slice(&f16::from_f32(m).to_le_bytes());
    }
    for &s in scales.iter() {
        out.extend_from_slice(&f16::from_f32(s).to_le_bytes());
    }
}

/// The largest finite f16 not above `x` (`x` finite, within ±65504).
fn f16_floor(x: f32) -> f16 {
    let h = f16::from_f32(x);
    if h.to_f32() <= x {
        return h;
    }
    let bits = h.to_bits();
    f16::from_bits(match bits {
        0x0000 | 0x8000 => 0x8001, // Below zero: the smallest negative subnormal.
        b if b & 0x8000 == 0 => b - 1,
        b => b + 1,
    })
}

/// The smallest finite f16 not below `x` (`x` finite, within ±65504).
fn f16_ceil(x: f32) -> f16 {
    -f16_floor(-x)
}

fn pack(codes: &[u8], p: Precision, out: &mut Vec<u8>) {
    match p {
        Precision::Q8 => out.extend_from_slice(codes),
        Precision::Q4 => {
            let pairs = codes.chunks_exact(2);
            let tail = pairs.remainder();
            out.extend(pairs.map(|c| c[0] | (c[1] << 4)));
            out.extend(tail.iter().copied());
        }
        Precision::Q2 => {
            let quads = codes.chunks_exact(4);
            let tail = quads.remainder();
            out.extend(quads.map(|c| c[0] | (c[1] << 2) | (c[2] << 4) | (c[3] << 6)));
            if !tail.is_empty() {
                out.push(
                    tail.iter()
                        .enumerate()
                        .fold(0, |b, (i, &c)| b | (c << (2 * i))),
                );
            }
        }
        Precision::F16 => unreachable!("f16 sections are not packed"),
    }
}

/// Unpacks `n_codes` codes from `bytes` (exactly `packed_bytes(n_codes)` long) into `codes`.
fn unpack(bytes: &[u8], n_codes: usize, p: Precision, codes: &mut Vec<u8>) {
    codes.clear();
    match p {
        Precision::Q8 => codes.extend_from_slice(bytes),
        // Sized first, then filled through `chunks_exact_mut`: the loops vectorize, where
        // `extend(flat_map(..))` pushes one code at a time.
        Precision::Q4 => {
            codes.resize(bytes.len() * 2, 0);
            for (pair, &b) in codes.chunks_exact_mut(2).zip(bytes) {
                pair[0] = b & 0x0f;
                pair[1] = b >> 4;
            }
        }
        Precision::Q2 => {
            codes.resize(bytes.len() * 4, 0);
            for (quad, &b) in codes.chunks_exact_mut(4).zip(bytes) {
                quad[0] = b & 3;
                quad[1] = (b >> 2) & 3;
                quad[2] = (b >> 4) & 3;
                quad[3] = b >> 6;
            }
        }
        Precision::F16 => unreachable!("f16 sections are not packed"),
    }
    // Padding codes of the last byte.
    codes.truncate(n_codes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_rounding_directions() {
        for x in [
            0.0f32,
            1e-9,
            -1e-9,
            0.1,
            -0.1,
            1.0 / 3.0,
            -7.77,
            65504.0,
            -65504.0,
            1000.3,
        ] {
            let (lo, hi) = (f16_floor(x).to_f32(), f16_ceil(x).to_f32());
            assert!(lo <= x && x <= hi, "{x}: {lo} {hi}");
            assert!(lo.is_finite() && hi.is_finite());
        }
    }

    #[test]
    fn pack_unpack_round_trip_with_odd_lengths() {
        for p in [Precision::Q8, Precision::Q4, Precision::Q2] {
            for n in [0, 1, 3, 5, 7, 64] {
                let codes: Vec<u8> = (0..n).map(|i| (i * 7 % (1 << p.bits())) as u8).collect();
                let mut packed = Vec::new();
                pack(&codes, p, &mut packed);
                assert_eq!(packed.len(), packed_bytes(n, p));
                let mut back = Vec::new();
                unpack(&packed, n, p, &mut back);
                assert_eq!(back, codes);
            }
        }
    }
}
