//! Block formats of the quantised live KV cache (`KvDtype::Q8`, `KvDtype::Q4`), shared by
//! the store that writes them and the attention kernels that read them in place.
//!
//! Each token's head vector is quantised on its own, in groups of [`GROUP`] consecutive
//! dimensions with one f16 scale per group, symmetric like llama.cpp's `q8_0` and `q4_0`
//! (`x ≈ scale · q`, q8: `q ∈ [-127, 127]`; q4: `x ≈ scale · (code − 8)`, `code ∈ 0..16`).
//! Per-token groups, rather than KIVI's per-channel groups over a block's slots, are a
//! deliberate choice: a token's stored bytes then depend only on that token, so (1) a
//! token written alone in a decode step has the same bytes as in a prefill chunk, which
//! keeps attention batch-invariant, (2) a partially filled block never needs
//! re-quantising, and (3) moving a token (`copy_slot`, eviction compaction) is a byte copy.
//!
//! Layout of one KV head of one block (`head_bytes` bytes; the store puts these regions
//! where the f16 layout puts its elements, `[block][kv_head]`):
//! - K: quants transposed like the f16 K, `[d][slot]` (q8: one byte each; q4: one byte per
//!   pair of dimensions, `[d / 2][slot]`, even `d` in the low nibble), then the scales
//!   `[group][slot]` as f16. The attention kernel loads the quants of 16 slots for one
//!   (pair of) dimension(s) with one load, exactly as it loads f16 K, and the 16 slots'
//!   scales of one group with another.
//! - V: quants slot-major, `[slot][d]` (q4: `[slot][d / 2]`, where within each group of 32
//!   byte `i` holds dimension `i` in its low nibble and `i + 16` in its high nibble, so one
//!   16-byte load yields two 16-lane vectors of consecutive dimensions), then the scales
//!   `[group][slot]` as f16, like K's: the kernel multiplies a row's 16 softmax weights by
//!   16 slots' scales in one vector operation before the `p · V` loop.

use half::f16;

/// Dimensions per quantisation group (one f16 scale each).
pub const GROUP: usize = 32;

/// Bits per quantised element.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantBits {
    Q8,
    Q4,
}

/// Quantises one group into `q8` codes, returning the scale (f16; the codes are computed
/// against the rounded scale, so that dequantising reproduces what was meant).
pub fn quantize_q8(x: &[f32], codes: &mut [i8]) -> f16 {
    let amax = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
    let scale = f16::from_f32(amax / 127.0);
    let inv = if scale.to_f32() > 0.0 {
        1.0 / scale.to_f32()
    } else {
        0.0
    };
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = (v * inv).round().clamp(-127.0, 127.0) as i8;
    }
    scale
}

/// Quantises one group into `q4` codes `0..16` (value `scale · (code − 8)`), as llama.cpp's
/// `q4_0`: the element of largest magnitude maps to code 0 (−8 · scale) exactly, which uses
/// the asymmetric range's extra level on the side that needs it.
pub fn quantize_q4(x: &[f32], codes: &mut [u8]) -> f16 {
    let extreme = x
        .iter()
        .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
    let scale = f16::from_f32(extreme / -8.0);
    let inv = if scale.to_f32() != 0.0 {
        1.0 / scale.to_f32()
    } else {
        0.0
    };
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = (v * inv + 8.5).clamp(0.0, 15.0) as u8;
    }
    scale
}

/// The layout of one KV head of one block, and the per-token operations on it.
#[derive(Debug, Clone, Copy)]
pub struct QLayout {
    pub bits: QuantBits,
    pub head_dim: usize,
    pub block_size: usize,
}

impl QLayout {
    /// `head_dim` must be a multiple of [`GROUP`].
    pub fn new(bits: QuantBits, head_dim: usize, block_size: usize) -> QLayout {
        assert!(
            head_dim.is_multiple_of(GROUP) && head_dim > 0,
            "quantised KV needs head_dim a multiple of {GROUP}, got {head_dim}"
        );
        QLayout {
            bits,
            head_dim,
            block_size,
        }
    }

    pub fn groups(&self) -> usize {
        self.head_dim / GROUP
    }

    /// Bytes of one token's quants (one head).
    pub fn quant_bytes_per_token(&self) -> usize {
        match self.bits {
            QuantBits::Q8 => self.head_dim,
            QuantBits::Q4 => self.head_dim / 2,
        }
    }

    /// Bytes of one token's head vector: quants plus scales.
    pub fn bytes_per_token(&self) -> usize {
        self.quant_bytes_per_token() + 2 * self.groups()
    }

    /// Bytes of one KV head of one block (K and V regions have the same size).
    pub fn head_bytes(&self) -> usize {
        self.block_size * self.bytes_per_token()
    }

    /// Offset of the scales inside a head region.
    pub fn scales_offset(&self) -> usize {
        self.block_size * self.quant_bytes_per_token()
    }

    /// Byte offset of group `g`'s scale of `slot` (K and V alike).
    fn scale_at(&self, g: usize, slot: usize) -> usize {
        self.scales_offset() + 2 * (g * self.block_size + slot)
    }

    /// Writes one token's key (`head_dim` floats) into `slot` of a head region.
    pub fn write_k(&self, head: &mut [u8], slot: usize, k: &[f32]) {
        let bs = self.block_size;
        for g in 0..self.groups() {
            let x = &k[g * GROUP..(g + 1) * GROUP];
            let scale = match self.bits {
                QuantBits::Q8 => {
                    let mut c = [0i8; GROUP];
                    let s = quantize_q8(x, &mut c);
                    for (i, &q) in c.iter().enumerate() {
                        head[(g * GROUP + i) * bs + slot] = q as u8;
                    }
                    s
                }
                QuantBits::Q4 => {
                    let mut c = [0u8; GROUP];
                    let s = quantize_q4(x, &mut c);
                    for i in (0..GROUP).step_by(2) {
                        head[((g * GROUP + i) / 2) * bs + slot] = c[i] | (c[i + 1] << 4);
                    }
                    s
                }
            };
            let at = self.scale_at(g, slot);
            head[at..at + 2].copy_from_slice(&scale.to_le_bytes());
        }
    }

    /// Writes one token's value (`head_dim` floats) into `slot` of a head region.
    pub fn write_v(&self, head: &mut [u8], slot: usize, v: &[f32]) {
        let row = slot * self.quant_bytes_per_token();
        for g in 0..self.groups() {
            let x = &v[g * GROUP..(g + 1) * GROUP];
            let scale = match self.bits {
                QuantBits::Q8 => {
                    let mut c = [0i8; GROUP];
                    let s = quantize_q8(x, &mut c);
                    for (i, &q) in c.iter().enumerate() {
                        head[row + g * GROUP + i] = q as u8;
                    }
                    s
                }
                QuantBits::Q4 => {
                    let mut c = [0u8; GROUP];
                    let s = quantize_q4(x, &mut c);
                    for i in 0..GROUP / 2 {
                        head[row + g * GROUP / 2 + i] = c[i] | (c[i + GROUP / 2] << 4);
                    }
                    s
                }
            };
            let at = self.scale_at(g, slot);
            head[at..at + 2].copy_from_slice(&scale.to_le_bytes());
        }
    }

    fn scale(head: &[u8], at: usize) -> f32 {
        f16::from_le_bytes([head[at], head[at + 1]]).to_f32()
    }

    /// Dequantised element `d` of the key in `slot`.
    #[inline]
    pub fn k_elem(&self, head: &[u8], slot: usize, d: usize) -> f32 {
        let bs = self.block_size;
        let scale = Self::scale(head, self.scale_at(d / GROUP, slot));
        match self.bits {
            QuantBits::Q8 => scale * (head[d * bs + slot] as i8) as f32,
            QuantBits::Q4 => {
                let byte = head[(d / 2) * bs + slot];
                let code = if d.is_multiple_of(2) {
                    byte & 15
                } else {
                    byte >> 4
                };
                scale * (code as i32 - 8) as f32
            }
        }
    }

    /// Dequantises the first `block_size` slots of every dimension of K into `out[d *
    /// stride..][..block_size]` (the transposed layout the AVX2 attention kernel reads), with
    /// exactly [`Self::k_elem`]'s arithmetic, a group's scales widened once: element by
    /// element, the scale lookups made q8 prefill attention twice f16's cost on AVX2.
    pub fn read_k_transposed(&self, head: &[u8], stride: usize, out: &mut [f32]) {
        let bs = self.block_size;
        let mut scales = [0f32; 256];
        if bs > scales.len() {
            for d in 0..self.head_dim {
                for slot in 0..bs {
                    out[d * stride + slot] = self.k_elem(head, slot, d);
                }
            }
            return;
        }
        for g in 0..self.groups() {
            for (slot, sc) in scales[..bs].iter_mut().enumerate() {
                *sc = Self::scale(head, self.scale_at(g, slot));
            }
            let sc = &scales[..bs];
            for d in g * GROUP..(g + 1) * GROUP {
                let o = &mut out[d * stride..d * stride + bs];
                match self.bits {
                    QuantBits::Q8 => {
                        let q = &head[d * bs..(d + 1) * bs];
                        for ((x, &q), &s) in o.iter_mut().zip(q).zip(sc) {
                            *x = s * (q as i8) as f32;
                        }
                    }
                    QuantBits::Q4 => {
                        let q = &head[(d / 2) * bs..(d / 2 + 1) * bs];
                        let shift = if d.is_multiple_of(2) { 0 } else { 4 };
                        for ((x, &q), &s) in o.iter_mut().zip(q).zip(sc) {
                            *x = s * (((q >> shift) & 15) as i32 - 8) as f32;
                        }
                    }
                }
            }
        }
    }

    /// Dequantises the value in `slot` into `out` (`head_dim` floats).
    pub fn read_v(&self, head: &[u8], slot: usize, out: &mut [f32]) {
        let row = slot * self.quant_bytes_per_token();
        for g in 0..self.groups() {
            let scale = Self::scale(head, self.scale_at(g, slot));
            let o = &mut out[g * GROUP..(g + 1) * GROUP];
            match self.bits {
                QuantBits::Q8 => {
                    for (i, x) in o.iter_mut().enumerate() {
                        *x = scale * (head[row + g * GROUP + i] as i8) as f32;
                    }
                }
                QuantBits::Q4 => {
                    for i in 0..GROUP / 2 {
                        let byte = head[row + g * GROUP / 2 + i];
                        o[i] = scale * ((byte & 15) as i32 - 8) as f32;
                        o[i + GROUP / 2] = scale * ((byte >> 4) as i32 - 8) as f32;
                    }
                }
            }
        }
    }

    /// Copies one token from `(src head region, src_slot)` to `(dst, dst_slot)` within one
    /// layer's buffer (`src`/`dst` are the regions' byte offsets in `buf`): K's quants and
    /// scales are strided by the block size, so this is a loop of small copies.
    pub fn copy_k_slot(
        &self,
        buf: &mut [u8],
        src: usize,
        src_slot: usize,
        dst: usize,
        dst_slot: usize,
    ) {
        let bs = self.block_size;
        let rows = match self.bits {
            QuantBits::Q8 => self.head_dim,
            QuantBits::Q4 => self.head_dim / 2,
        };
        for r in 0..rows {
            buf[dst + r * bs + dst_slot] = buf[src + r * bs + src_slot];
        }
        self.copy_scales(buf, src, src_slot, dst, dst_slot);
    }

    fn copy_scales(
        &self,
        buf: &mut [u8],
        src: usize,
        src_slot: usize,
        dst: usize,
        dst_slot: usize,
    ) {
        for g in 0..self.groups() {
            let (s, d) = (
                src + self.scale_at(g, src_slot),
                dst + self.scale_at(g, dst_slot),
            );
            buf.copy_within(s..s + 2, d);
        }
    }

    /// [`Self::copy_k_slot`] for V, whose token rows of quants are contiguous.
    pub fn copy_v_slot(
        &self,
        buf: &mut [u8],
        src: usize,
        src_slot: usize,
        dst: usize,
        dst_slot: usize,
    ) {
        let qb = self.quant_bytes_per_token();
        buf.copy_within(
            src + src_slot * qb..src + (src_slot + 1) * qb,
            dst + dst_slot * qb,
        );
        self.copy_scales(buf, src, src_slot, dst, dst_slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The bulk transposed read is `k_elem`, bit for bit, for both widths and a padded stride.
    #[test]
    fn transposed_k_read_equals_k_elem() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for bits in [QuantBits::Q8, QuantBits::Q4] {
            let lay = QLayout::new(bits, 64, 16);
            let mut kh = vec![0u8; lay.head_bytes()];
            for slot in 0..16 {
                let k: Vec<f32> = (0..64).map(|_| rng.gen_range(-3.0..3.0)).collect();
                lay.write_k(&mut kh, slot, &k);
            }
            let stride = 24;
            let mut out = vec![f32::NAN; 64 * stride];
            lay.read_k_transposed(&kh, stride, &mut out);
            for d in 0..64 {
                for slot in 0..16 {
                    assert_eq!(
                        out[d * stride + slot].to_bits(),
                        lay.k_elem(&kh, slot, d).to_bits(),
                        "{bits:?} d {d} slot {slot}"
                    );
                }
            }
        }
    }

    #[test]
    fn roundtrip_error_is_within_half_a_step() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for bits in [QuantBits::Q8, QuantBits::Q4] {
            let lay = QLayout::new(bits, 64, 16);
            // K and V regions are separate buffers, as in the store.
            let (mut kh, mut vh) = (vec![0u8; lay.head_bytes()], vec![0u8; lay.head_bytes()]);
            let mut rows = Vec::new();
            for slot in 0..16 {
                let k: Vec<f32> = (0..64).map(|_| rng.gen_range(-3.0..3.0)).collect();
                let v: Vec<f32> = (0..64).map(|_| rng.gen_range(-3.0..3.0)).collect();
                lay.write_k(&mut kh, slot, &k);
                lay.write_v(&mut vh, slot, &v);
                rows.push((k, v));
            }
            // Every slot still reads back its own token after its neighbours were written.
            for (slot, (k, v)) in rows.iter().enumerate() {
                let mut vo = vec![0f32; 64];
                lay.read_v(&vh, slot, &mut vo);
                for g in 0..2 {
                    let amax = |x: &[f32]| {
                        x[g * 32..(g + 1) * 32]
                            .iter()
                            .fold(0f32, |a, &b| a.max(b.abs()))
                    };
                    // Half a quantisation step, plus the f16 rounding of the scale; q4's
                    // range is [-8, 7] steps with the extreme at -8, so a value near the
                    // opposite extreme clamps to 7 steps: up to one whole step off.
                    let tol = |m: f32| match bits {
                        QuantBits::Q8 => 0.5 * m / 127.0,
                        QuantBits::Q4 => m / 8.0,
                    };
                    let (tk, tv) = (tol(amax(k)) * 1.01 + 1e-6, tol(amax(v)) * 1.01 + 1e-6);
                    for d in g * 32..(g + 1) * 32 {
                        assert!(
                            (lay.k_elem(&kh, slot, d) - k[d]).abs() <= tk,
                            "{bits:?} K slot {slot} d {d}"
                        );
                        assert!((vo[d] - v[d]).abs() <= tv, "{bits:?} V slot {slot} d {d}");
                    }
                }
            }
        }
    }

    #[test]
    fn representable_values_roundtrip_exactly() {
        // Integers in the code range times a power-of-two scale are exact in both formats.
        for bits in [QuantBits::Q8, QuantBits::Q4] {
            let lay = QLayout::new(bits, 32, 4);
            let (mut kh, mut vh) = (vec![0u8; lay.head_bytes()], vec![0u8; lay.head_bytes()]);
            let x: Vec<f32> = (0..32)
                .map(|i| match bits {
                    // Element 0 sets the scale to 31.75 / 127 = 0.25.
                    QuantBits::Q8 => {
                        if i == 0 {
                            -127.0 * 0.25
                        } else {
                            (i as f32 - 16.0) * 0.25
                        }
                    }
                    QuantBits::Q4 => ((i % 16) as f32 - 8.0) * 0.5,
                })
                .collect();
            lay.write_k(&mut kh, 2, &x);
            lay.write_v(&mut vh, 1, &x);
            let mut vo = vec![0f32; 32];
            lay.read_v(&vh, 1, &mut vo);
            let ko: Vec<f32> = (0..32).map(|d| lay.k_elem(&kh, 2, d)).collect();
            assert_eq!(vo, x, "{bits:?} V");
            assert_eq!(ko, x, "{bits:?} K");
        }
    }

    #[test]
    fn zero_group_has_zero_scale_and_reads_zero() {
        for bits in [QuantBits::Q8, QuantBits::Q4] {
            let lay = QLayout::new(bits, 32, 2);
            let (mut kh, mut vh) = (
                vec![0xA5u8; lay.head_bytes()],
                vec![0xA5u8; lay.head_bytes()],
            );
            lay.write_k(&mut kh, 0, &[0.0; 32]);
            lay.write_v(&mut vh, 0, &[0.0; 32]);
            let mut vo = vec![1f32; 32];
            lay.read_v(&vh, 0, &mut vo);
            assert!(vo.iter().all(|&x| x == 0.0));
            assert!((0..32).all(|d| lay.k_elem(&kh, 0, d) == 0.0));
        }
    }
}
