//! K-quant weights (Q4_K, Q6_K: Gemma 3's Q4_K_M file mixes them with Q5_0 and Q8_0)
//! converted at load into the block formats our integer SIMD kernels run, instead of the
//! dequantising fallback (a decode step of Gemma-3-270M spent most of its time there).
//!
//! - Q4_K → Q4_1, one block per 32-element sub-block: a Q4_K sub-block is `d·sc·q −
//!   dmin·m` with 4-bit `q`, which is Q4_1's `d'·q + m'` with `d' = d·sc` and `m' =
//!   −dmin·m`. The quants move unchanged; only the two products are rounded to f16
//!   (relative error ≤ 2⁻¹¹ on a scale, far below the 4-bit step).
//! - Q6_K → Q8_0: each 32 values (two 16-value sub-blocks with their own 8-bit scales) are
//!   requantised to 8 bits with one scale, as llama.cpp's `quantize_row_q8_0_ref` does: the
//!   added error is at most 1/254 of the block's largest value, about an eighth of the
//!   6-bit step.
//!
//! Both change numerics slightly against llama.cpp, which runs K-quants directly; the
//! Gemma golden tests (perplexity within 1 %, greedy agreement) hold with the conversion.

use half::f16;
use pk_gguf::{dequantize, scale_min_k4, GgmlType};

const QK_K: usize = 256;

/// The format a K-quant matrix is converted to, and its bytes; `None` for other formats.
pub fn convert(ty: GgmlType, data: &[u8]) -> Option<(GgmlType, Vec<u8>)> {
    match ty {
        GgmlType::Q4K => Some((GgmlType::Q4_1, q4_k_to_q4_1(data))),
        GgmlType::Q6K => Some((GgmlType::Q8_0, q6_k_to_q8_0(data))),
        _ => None,
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q4_K blocks (144 bytes per 256 values) → Q4_1 blocks (20 bytes per 32).
pub fn q4_k_to_q4_1(data: &[u8]) -> Vec<u8> {
    let bb = GgmlType::Q4K.block_bytes();
    assert!(data.len().is_multiple_of(bb), "whole Q4_K blocks");
    let mut out = Vec::with_capacity(data.len() / bb * 8 * 20);
    for b in data.chunks_exact(bb) {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        let (scales, qs) = (&b[4..16], &b[16..144]);
        for sub in 0..8 {
            let (sc, m) = scale_min_k4(sub, scales);
            out.extend_from_slice(&f16::from_f32(d * sc as f32).to_le_bytes());
            out.extend_from_slice(&f16::from_f32(-(dmin * m as f32)).to_le_bytes());
            // Sub-block 2j holds the low nibbles of qs[32j..32j + 32], 2j + 1 the high ones;
            // Q4_1 puts element i < 16 in byte i's low nibble and 16 + i in its high nibble.
            let q = &qs[32 * (sub / 2)..32 * (sub / 2) + 32];
            let nib = |l: usize| if sub % 2 == 0 { q[l] & 0x0f } else { q[l] >> 4 };
            for i in 0..16 {
                out.push(nib(i) | (nib(16 + i) << 4));
            }
        }
    }
    out
}

/// Q6_K blocks (210 bytes per 256 values) → Q8_0 blocks (34 bytes per 32), requantised.
pub fn q6_k_to_q8_0(data: &[u8]) -> Vec<u8> {
    let bb = GgmlType::Q6K.block_bytes();
    assert!(data.len().is_multiple_of(bb), "whole Q6_K blocks");
    let mut out = Vec::with_capacity(data.len() / bb * 8 * 34);
    let mut y = [0f32; QK_K];
    for b in data.chunks_exact(bb) {
        dequantize(GgmlType::Q6K, b, &mut y);
        for block in y.chunks_exact(32) {
            let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
            out.extend(block.iter().map(|&x| (x * id).round() as i8 as u8));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Random K-quant blocks with small valid f16 scales (random bytes elsewhere).
    fn random_blocks(ty: GgmlType, n_blocks: usize, seed: u64) -> Vec<u8> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut data = vec![0u8; n_blocks * ty.block_bytes()];
        rng.fill(&mut data[..]);
        for b in data.chunks_exact_mut(ty.block_bytes()) {
            let mut h = |at: usize| b[at..at + 2].copy_from_slice(&f16::from_f32(rng.gen_range(0.0005f32..0.01)).to_le_bytes());
            match ty {
                GgmlType::Q4K => {
                    h(0);
                    h(2);
                }
                _ => h(208),
            }
        }
        data
    }

    fn dq(ty: GgmlType, data: &[u8], n: usize) -> Vec<f32> {
        let mut y = vec![0f32; n];
        dequantize(ty, data, &mut y);
        y
    }

    /// Q4_K → Q4_1 keeps every quant: each value moves by no more than the f16 rounding of
    /// its sub-block's scale and min.
    #[test]
    fn q4_k_converts_to_q4_1_up_to_scale_rounding() {
        let data = random_blocks(GgmlType::Q4K, 12, 1);
        let n = 12 * QK_K;
        let (want, got) = (dq(GgmlType::Q4K, &data, n), dq(GgmlType::Q4_1, &q4_k_to_q4_1(&data), n));
        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
            // |d·sc|·15 + |dmin·m| ≤ 0.01·63·16 ≈ 10, rounded at 2⁻¹¹ relative.
            assert!((a - b).abs() <= 1e-2 * 16.0 * 63.0 * 2f32.powi(-11) + 1e-6, "value {i}: {a} vs {b}");
        }
        // With power-of-two super-block scales the products are exact in f16, and so is
        // every converted value: any misplaced nibble would show.
        let mut exact = data.clone();
        for b in exact.chunks_exact_mut(GgmlType::Q4K.block_bytes()) {
            b[0..2].copy_from_slice(&f16::from_f32(2f32.powi(-9)).to_le_bytes());
            b[2..4].copy_from_slice(&f16::from_f32(2f32.powi(-8)).to_le_bytes());
        }
        assert_eq!(dq(GgmlType::Q4K, &exact, n), dq(GgmlType::Q4_1, &q4_k_to_q4_1(&exact), n));
    }

    /// Q6_K → Q8_0: within half a step of the block's 8-bit grid (amax / 254).
    #[test]
    fn q6_k_requantises_to_q8_0_within_half_a_step() {
        let data = random_blocks(GgmlType::Q6K, 12, 2);
        let n = 12 * QK_K;
        let (want, got) = (dq(GgmlType::Q6K, &data, n), dq(GgmlType::Q8_0, &q6_k_to_q8_0(&data), n));
        for (bw, bg) in want.chunks_exact(32).zip(got.chunks_exact(32)) {
            let amax = bw.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (a, b) in bw.iter().zip(bg) {
                // Half a step, plus the f16 rounding of the scale over up to 127 steps.
                assert!((a - b).abs() <= amax / 254.0 * 1.01 + amax * 2f32.powi(-11), "{a} vs {b} (amax {amax})");
            }
        }
    }
}
