//! K-quant weights (Q4_K, Q6_K: Gemma 3's Q4_K_M file mixes them with Q5_0 and Q8_0) in
//! block formats our integer SIMD kernels run, instead of the dequantising fallback (a
//! decode step of Gemma-3-270M spent most of its time there): both run as they are unless
//! asked otherwise.
//!
//! - Q4_K runs natively (`pack`'s Q4K layout: 4.625 bits a weight). It was converted to
//!   Q4_1 (5 bits a weight), one block per 32-element sub-block: a Q4_K sub-block is `d·sc·q
//!   − dmin·m` with 4-bit `q`, which is Q4_1's `d'·q + m'` with `d' = d·sc` and `m' =
//!   −dmin·m`, the two products rounded to f16. `PK_Q4K=q4_1` still asks for that
//!   conversion, so that benchmarks can compare the two in one build (`PK_Q4K=native` is
//!   the default; any other value is refused by name).
//! - Q6_K runs natively (`pack`'s Q6K layout: 6.5625 bits a weight, as in the file), its
//!   products over 256-element activation blocks as llama.cpp's (`kernels/q8k.rs`).
//!   `PK_Q6K=q6s` still asks for the conversion below (`PK_Q6K=native` is the default; any
//!   other value is refused by name).
//! - Q6_K → Q6S (pagekeeper's own 6-bit format, see [`GgmlType::Q6S`]), one block per 32
//!   elements: a Q6_K sub-block of 16 is `d·sc·(q − 32)` with 6-bit `q` and an 8-bit signed
//!   `sc`, which is a Q6S half-block's `d'·(q − 32)` with `d' = d·sc`. The quants move
//!   unchanged; only the product is rounded to f16 (relative error ≤ 2⁻¹¹, far below the
//!   6-bit step). This replaced a requantisation to Q8_0, which added up to 1/254 of a
//!   block's largest value of error and stored 8.5 bits a weight where Q6S stores 7 (decode
//!   is bound by the bytes it reads: Qwen2.5-Coder-1.5B's Q6_K tensors, 458 → 378 MB a
//!   token).
//!
//! Each conversion changes numerics slightly against llama.cpp, which runs K-quants
//! directly (only by the f16 rounding of the scale products); the Gemma golden tests
//! (perplexity within 1 %, greedy agreement) hold with both.

use half::f16;
use pk_gguf::{scale_min_k4, GgmlType};

const QK_K: usize = 256;

/// The format a K-quant matrix is converted to, and its bytes; `None` for other formats.
pub fn convert(ty: GgmlType, data: &[u8]) -> Option<(GgmlType, Vec<u8>)> {
    match ty {
        GgmlType::Q4K if convert_q4_k() => Some((GgmlType::Q4_1, q4_k_to_q4_1(data))),
        GgmlType::Q6K if convert_q6_k() => Some((GgmlType::Q6S, q6_k_to_q6s(data))),
        _ => None,
    }
}

/// Whether Q4_K matrices are converted to Q4_1 at load (`PK_Q4K=q4_1`) rather than run
/// natively (see the module's comment).
pub fn convert_q4_k() -> bool {
    static YES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *YES.get_or_init(|| q4_k_choice().unwrap_or_else(|e| panic!("{e}")))
}

/// `PK_Q4K` as [`convert_q4_k`] reads it; a value other than the two is refused by name.
pub(crate) fn q4_k_choice() -> Result<bool, String> {
    conversion_choice("PK_Q4K", "q4_1")
}

/// Whether Q6_K matrices are converted to Q6S at load (`PK_Q6K=q6s`) rather than run
/// natively (see the module's comment).
pub fn convert_q6_k() -> bool {
    static YES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *YES.get_or_init(|| q6_k_choice().unwrap_or_else(|e| panic!("{e}")))
}

/// `PK_Q6K` as [`convert_q6_k`] reads it; a value other than the two is refused by name.
pub(crate) fn q6_k_choice() -> Result<bool, String> {
    conversion_choice("PK_Q6K", "q6s")
}

/// Whether the switch `var` asks for the format `converted` (`true`) or the native kernels
/// (`native`, or unset); any other value is an error naming the variable.
fn conversion_choice(var: &str, converted: &str) -> Result<bool, String> {
    match std::env::var(var).as_deref() {
        Ok(v) if v == converted => Ok(true),
        Ok("native") | Err(_) => Ok(false),
        Ok(other) => Err(format!(
            "{var}={other:?} is not one of \"native\", \"{converted}\""
        )),
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

/// Q6_K blocks (210 bytes per 256 values) → Q6S blocks (28 bytes per 32), quants unchanged.
pub fn q6_k_to_q6s(data: &[u8]) -> Vec<u8> {
    let bb = GgmlType::Q6K.block_bytes();
    assert!(data.len().is_multiple_of(bb), "whole Q6_K blocks");
    let mut out = Vec::with_capacity(data.len() / bb * 8 * GgmlType::Q6S.block_bytes());
    for b in data.chunks_exact(bb) {
        let (sc, d) = (&b[192..208], f16_at(b, 208));
        let q = q6_k_quants(b);
        // Element e's scale is sc[e / 16], so Q6S block k's halves take sc[2k] and sc[2k + 1].
        for (k, q) in q.chunks_exact(32).enumerate() {
            for s in &sc[2 * k..2 * k + 2] {
                out.extend_from_slice(&f16::from_f32(d * (*s as i8) as f32).to_le_bytes());
            }
            out.extend((0..16).map(|i| (q[i] & 0x0f) | ((q[16 + i] & 0x0f) << 4)));
            out.extend(
                (0..8).map(|j| (0..4).fold(0u8, |acc, i| acc | ((q[4 * j + i] >> 4) << (2 * i)))),
            );
        }
    }
    out
}

/// The unsigned 6-bit quants (0..64) of a Q6_K super-block in element order, as
/// `pk_gguf::dequantize` reads them: each half of 128 takes 64 bytes of `ql` and 32 of `qh`.
pub(crate) fn q6_k_quants(block: &[u8]) -> [u8; QK_K] {
    let (ql, qh) = (&block[0..128], &block[128..192]);
    let mut q = [0u8; QK_K];
    for h in 0..2 {
        let (ql, qh) = (&ql[64 * h..64 * h + 64], &qh[32 * h..32 * h + 32]);
        for l in 0..32 {
            let e = 128 * h + l;
            q[e] = (ql[l] & 0x0f) | ((qh[l] & 3) << 4);
            q[e + 32] = (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4);
            q[e + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            q[e + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    q
}

#[cfg(test)]
mod tests {
    use super::*;
    use pk_gguf::dequantize;
    use rand::{Rng, SeedableRng};

    /// Random K-quant blocks with small valid f16 scales (random bytes elsewhere).
    fn random_blocks(ty: GgmlType, n_blocks: usize, seed: u64) -> Vec<u8> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut data = vec![0u8; n_blocks * ty.block_bytes()];
        rng.fill(&mut data[..]);
        for b in data.chunks_exact_mut(ty.block_bytes()) {
            let mut h = |at: usize| {
                b[at..at + 2]
                    .copy_from_slice(&f16::from_f32(rng.gen_range(0.0005f32..0.01)).to_le_bytes())
            };
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
        let (want, got) = (
            dq(GgmlType::Q4K, &data, n),
            dq(GgmlType::Q4_1, &q4_k_to_q4_1(&data), n),
        );
        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
            // |d·sc|·15 + |dmin·m| ≤ 0.01·63·16 ≈ 10, rounded at 2⁻¹¹ relative.
            assert!(
                (a - b).abs() <= 1e-2 * 16.0 * 63.0 * 2f32.powi(-11) + 1e-6,
                "value {i}: {a} vs {b}"
            );
        }
        // With power-of-two super-block scales the products are exact in f16, and so is
        // every converted value: any misplaced nibble would show.
        let mut exact = data.clone();
        for b in exact.chunks_exact_mut(GgmlType::Q4K.block_bytes()) {
            b[0..2].copy_from_slice(&f16::from_f32(2f32.powi(-9)).to_le_bytes());
            b[2..4].copy_from_slice(&f16::from_f32(2f32.powi(-8)).to_le_bytes());
        }
        assert_eq!(
            dq(GgmlType::Q4K, &exact, n),
            dq(GgmlType::Q4_1, &q4_k_to_q4_1(&exact), n)
        );
    }

    /// Q6_K → Q6S keeps every quant: each value moves by no more than the f16 rounding of
    /// its sub-block's scale, and not at all when that product is exact in f16.
    #[test]
    fn q6_k_converts_to_q6s_up_to_scale_rounding() {
        let data = random_blocks(GgmlType::Q6K, 12, 2);
        let n = 12 * QK_K;
        let (want, got) = (
            dq(GgmlType::Q6K, &data, n),
            dq(GgmlType::Q6S, &q6_k_to_q6s(&data), n),
        );
        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
            // |d·sc·(q − 32)| ≤ 0.01·128·32, rounded at 2⁻¹¹ relative (2⁻¹² plus margin).
            assert!(
                (a - b).abs() <= a.abs() * 2f32.powi(-11) + 1e-6,
                "value {i}: {a} vs {b}"
            );
        }
        // With a power-of-two super-block scale and sub-scales of at most 11 bits the
        // products are exact in f16, and so is every converted value: any misplaced quant or
        // scale would show.
        let mut exact = data.clone();
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for b in exact.chunks_exact_mut(GgmlType::Q6K.block_bytes()) {
            for s in &mut b[192..208] {
                *s = rng.gen_range(-64i8..64) as u8;
            }
            b[208..210].copy_from_slice(&f16::from_f32(2f32.powi(-9)).to_le_bytes());
        }
        let want = dq(GgmlType::Q6K, &exact, n);
        assert!(want.iter().any(|&v| v != 0.0));
        assert_eq!(want, dq(GgmlType::Q6S, &q6_k_to_q6s(&exact), n));
        // Converted only when `PK_Q6K=q6s` asks for it.
        let want = convert_q6_k().then(|| (GgmlType::Q6S, q6_k_to_q6s(&exact)));
        assert_eq!(convert(GgmlType::Q6K, &exact), want);
    }
}
