//! Activations in 256-element blocks for K-quant weights, as llama.cpp quantises them for
//! its K-quant dot products (`quantize_row_q8_K_ref`), and the scalar references of the Q4_K
//! and Q6_K products over them (`dot_q4k`, `dot_q6k`).
//!
//! Why a second quantisation: with one activation scale per 256 elements, a Q4_K
//! super-block's eight sub-blocks share it, so their integer sums can be combined in
//! integers (`Σ sc_j · Σ q·a` and `Σ m_j · Σ a`) and the float update runs once per
//! super-block instead of once per 32 elements. That update was the bottleneck of the
//! AVX2, VNNI and AMX tiles alike (`x86.rs` NOTE 1, `amx.rs` NOTE 1); llama.cpp takes the
//! same route for every K-quant.
//!
//! The values are llama.cpp's up to sign: it scales by `-127 / max`, `max` being the
//! element of largest magnitude with its sign, and we by `127 / amax`; both round to the
//! nearest integer with ties to even and keep `d = 1 / iscale`, so each `d · q` is the same
//! product and each integer sum is the same up to a sign that `d` carries.

use half::f16;

use super::q8::{Q8Acts, QK};

/// Elements per activation block of the K representation (llama.cpp's `QK_K`).
pub const QK_K: usize = 256;

/// Quantises one 256-element block: returns `d` and fills its 256 quants, its eight
/// 32-element sums and its sixteen 16-element sums.
fn quantize_block_scalar(x: &[f32], qs: &mut [i8], bsum: &mut [i16], bsum16: &mut [i16]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        qs.fill(0);
        bsum.fill(0);
        bsum16.fill(0);
        return 0.0;
    }
    let iscale = 127.0 / amax;
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = nearest_int(iscale * v) as i8;
    }
    for (s, q) in bsum16.iter_mut().zip(qs.chunks_exact(QK / 2)) {
        *s = q.iter().map(|&v| v as i16).sum();
    }
    for (s, pair) in bsum.iter_mut().zip(bsum16.chunks_exact(2)) {
        *s = pair[0] + pair[1];
    }
    1.0 / iscale
}

/// ggml's `nearest_int`: round to nearest, ties to even, for |x| < 2²² (here |x| <= 127),
/// which is what `cvtps2dq` does under the default rounding mode.
#[inline(always)]
fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

impl Q8Acts {
    /// Fills the K representation (`kd`, `kqs`, `kbsum`) of `x`, a multiple of 256 long:
    /// with AVX-512 or AVX2 where the CPU has them (bit-exact with
    /// [`Q8Acts::quantize_k_scalar`], tested), in pieces on rayon's threads for a prefill.
    pub fn quantize_k(&mut self, x: &[f32]) {
        self.resize_k(x.len());
        #[cfg(target_arch = "x86_64")]
        {
            type Quantizer = unsafe fn(&[f32], &mut [f32], &mut [i8], &mut [i16], &mut [i16]);
            let simd: Option<Quantizer> = if super::x86::has_avx512() {
                Some(quantize_k_avx512)
            } else if super::x86::detect().is_some() {
                Some(quantize_k_avx2)
            } else {
                None
            };
            if let Some(f) = simd {
                use rayon::prelude::*;
                let piece = super::ops::PAR_CHUNK_ELEMS;
                if x.len() < super::ops::PAR_MIN_ELEMS || rayon::current_num_threads() == 1 {
                    // SAFETY: `f` was chosen for the features detected above; the buffers
                    // were sized for `x` by `resize_k`.
                    unsafe {
                        f(
                            x,
                            &mut self.kd,
                            &mut self.kqs,
                            &mut self.kbsum,
                            &mut self.kbsum16,
                        )
                    };
                    return;
                }
                x.par_chunks(piece)
                    .zip(self.kd.par_chunks_mut(piece / QK_K))
                    .zip(self.kqs.par_chunks_mut(piece))
                    .zip(self.kbsum.par_chunks_mut(piece / QK))
                    .zip(self.kbsum16.par_chunks_mut(2 * piece / QK))
                    .for_each(|((((x, d), qs), bsum), bsum16)| {
                        // SAFETY: as above; the pieces were cut at block boundaries.
                        unsafe { f(x, d, qs, bsum, bsum16) }
                    });
                return;
            }
        }
        self.quantize_k_scalar(x);
    }

    /// The portable reference of [`Q8Acts::quantize_k`].
    pub fn quantize_k_scalar(&mut self, x: &[f32]) {
        self.resize_k(x.len());
        for (b, xb) in x.chunks_exact(QK_K).enumerate() {
            self.kd[b] = quantize_block_scalar(
                xb,
                &mut self.kqs[b * QK_K..(b + 1) * QK_K],
                &mut self.kbsum[b * 8..(b + 1) * 8],
                &mut self.kbsum16[b * 16..(b + 1) * 16],
            );
        }
    }

    fn resize_k(&mut self, len: usize) {
        assert_eq!(len % QK_K, 0, "Q4_K activations come in blocks of 256");
        self.kd.resize(len / QK_K, 0.0);
        self.kqs.resize(len, 0);
        self.kbsum.resize(len / QK, 0);
        self.kbsum16.resize(2 * len / QK, 0);
    }
}

/// [`quantize_block_scalar`] over whole blocks with 16 lanes at a time, bit-exact: the
/// maximum of `|x|` does not depend on order, `iscale · x` is the same single rounding and
/// `vcvtps2dq` rounds to nearest even as `nearest_int` does.
///
/// # Safety
/// The CPU must have AVX-512 F/BW; `x.len()` is a multiple of 256, `d` holds
/// `x.len() / 256` entries, `qs` `x.len()`, `bsum` `x.len() / 32` and `bsum16` `x.len() / 16`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn quantize_k_avx512(
    x: &[f32],
    d: &mut [f32],
    qs: &mut [i8],
    bsum: &mut [i16],
    bsum16: &mut [i16],
) {
    use std::arch::x86_64::*;
    let n_blocks = x.len() / QK_K;
    assert!(d.len() >= n_blocks && qs.len() >= x.len() && bsum.len() >= x.len() / QK);
    assert!(bsum16.len() >= 2 * x.len() / QK);
    for b in 0..n_blocks {
        let p = x.as_ptr().add(b * QK_K);
        let v: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(p.add(16 * i)));
        let m = v.iter().fold(_mm512_setzero_ps(), |m, &v| {
            _mm512_max_ps(m, _mm512_abs_ps(v))
        });
        let amax = _mm512_reduce_max_ps(m);
        let q = qs.as_mut_ptr().add(b * QK_K);
        if amax == 0.0 {
            std::ptr::write_bytes(q, 0, QK_K);
            bsum[b * 8..b * 8 + 8].fill(0);
            bsum16[b * 16..b * 16 + 16].fill(0);
            d[b] = 0.0;
            continue;
        }
        let iscale = 127.0 / amax;
        let is = _mm512_set1_ps(iscale);
        for j in 0..8 {
            let r0 = _mm512_cvtps_epi32(_mm512_mul_ps(v[2 * j], is));
            let r1 = _mm512_cvtps_epi32(_mm512_mul_ps(v[2 * j + 1], is));
            _mm_storeu_si128(q.add(32 * j) as *mut __m128i, _mm512_cvtepi32_epi8(r0));
            _mm_storeu_si128(q.add(32 * j + 16) as *mut __m128i, _mm512_cvtepi32_epi8(r1));
            let (s0, s1) = (_mm512_reduce_add_epi32(r0), _mm512_reduce_add_epi32(r1));
            bsum16[b * 16 + 2 * j] = s0 as i16;
            bsum16[b * 16 + 2 * j + 1] = s1 as i16;
            bsum[b * 8 + j] = (s0 + s1) as i16;
        }
        d[b] = 1.0 / iscale;
    }
}

/// [`quantize_k_avx512`] on 256-bit vectors, for AVX2 hosts.
///
/// # Safety
/// The CPU must have AVX2; the buffers are sized as for [`quantize_k_avx512`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_k_avx2(
    x: &[f32],
    d: &mut [f32],
    qs: &mut [i8],
    bsum: &mut [i16],
    bsum16: &mut [i16],
) {
    use std::arch::x86_64::*;
    let n_blocks = x.len() / QK_K;
    assert!(d.len() >= n_blocks && qs.len() >= x.len() && bsum.len() >= x.len() / QK);
    assert!(bsum16.len() >= 2 * x.len() / QK);
    let hsum = |s: __m256i| {
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    };
    let sign = _mm256_set1_ps(-0.0);
    for b in 0..n_blocks {
        let p = x.as_ptr().add(b * QK_K);
        let mut m = _mm256_setzero_ps();
        for i in 0..32 {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(p.add(8 * i))));
        }
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)));
        let q = qs.as_mut_ptr().add(b * QK_K);
        if amax == 0.0 {
            std::ptr::write_bytes(q, 0, QK_K);
            bsum[b * 8..b * 8 + 8].fill(0);
            bsum16[b * 16..b * 16 + 16].fill(0);
            d[b] = 0.0;
            continue;
        }
        let iscale = 127.0 / amax;
        let is = _mm256_set1_ps(iscale);
        for j in 0..8 {
            let r: [__m256i; 4] = std::array::from_fn(|i| {
                _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p.add(32 * j + 8 * i)), is))
            });
            // |r| <= 127, so the saturating packs keep every value; they interleave 128-bit
            // lanes, which the permutation undoes.
            let packed = _mm256_packs_epi16(
                _mm256_packs_epi32(r[0], r[1]),
                _mm256_packs_epi32(r[2], r[3]),
            );
            let ordered =
                _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(q.add(32 * j) as *mut __m256i, ordered);
            let (s0, s1) = (
                hsum(_mm256_add_epi32(r[0], r[1])),
                hsum(_mm256_add_epi32(r[2], r[3])),
            );
            bsum16[b * 16 + 2 * j] = s0 as i16;
            bsum16[b * 16 + 2 * j + 1] = s1 as i16;
            bsum[b * 8 + j] = (s0 + s1) as i16;
        }
        d[b] = 1.0 / iscale;
    }
}

/// Σ over super-blocks of a Q4_K weight row (144 bytes per 256 values, llama.cpp's layout)
/// times the K representation of the activations, `b0` being the row's first 32-element
/// block (token × blocks per row). Per super-block the integer sums are exact, `isum = Σ_j
/// sc_j · Σ q·a` and `imin = Σ_j m_j · Σ a`, and the float update is `sum += (d·d_a)·isum −
/// (dmin·d_a)·imin`, each multiply and add rounded separately in that order; the SIMD
/// kernels take the same steps.
pub fn dot_q4k(w: &[u8], a: &Q8Acts, b0: usize) -> f32 {
    let f16_at = |b: &[u8], i: usize| f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
    let mut sum = 0f32;
    for (s, blk) in w.chunks_exact(144).enumerate() {
        let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
        let (scales, qs) = (&blk[4..16], &blk[16..144]);
        let (mut isum, mut imin) = (0i32, 0i32);
        for sub in 0..8 {
            let (sc, m) = pk_gguf::scale_min_k4(sub, scales);
            let b = b0 + 8 * s + sub;
            let q = &qs[32 * (sub / 2)..32 * (sub / 2) + 32];
            let qa = &a.kqs[b * QK..(b + 1) * QK];
            let mut ib = 0i32;
            for (l, &x) in q.iter().enumerate() {
                let nib = if sub % 2 == 0 { x & 0x0f } else { x >> 4 };
                ib += nib as i32 * qa[l] as i32;
            }
            isum += sc as i32 * ib;
            imin += m as i32 * a.kbsum[b] as i32;
        }
        let da = a.kd[b0 / 8 + s];
        let x = (d * da) * isum as f32;
        let y = (dmin * da) * imin as f32;
        sum += x - y;
    }
    sum
}

/// Σ over super-blocks of a Q6_K weight row (210 bytes per 256 values: `ql`, `qh`, 16
/// signed 8-bit sub-block scales, f16 `d`) times the K representation of the activations,
/// `b0` as for [`dot_q4k`]. Per super-block the integer sum is exact, `isum = Σ_j sc_j ·
/// (Σ q·a − 32·Σ a)` over the 16 sub-blocks of 16, and the float update is `sum += (d·d_a)
/// · isum`, each multiply and add rounded separately; the SIMD kernels take the same steps.
pub fn dot_q6k(w: &[u8], a: &Q8Acts, b0: usize) -> f32 {
    let mut sum = 0f32;
    for (s, blk) in w.chunks_exact(210).enumerate() {
        let q = crate::kquant::q6_k_quants(blk);
        let d = f16::from_le_bytes([blk[208], blk[209]]).to_f32();
        let e0 = (b0 + 8 * s) * QK;
        let mut isum = 0i32;
        for (j, &sc) in blk[192..208].iter().enumerate() {
            let qa = &a.kqs[e0 + 16 * j..e0 + 16 * j + 16];
            let ib: i32 = (0..16).map(|l| q[16 * j + l] as i32 * qa[l] as i32).sum();
            isum += (sc as i8) as i32 * (ib - 32 * a.kbsum16[2 * (b0 + 8 * s) + j] as i32);
        }
        sum += (d * a.kd[b0 / 8 + s]) * isum as f32;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The SIMD quantisers give the scalar one's bits: random blocks, a block whose scaled
    /// values land on exact halves (the ties), an all-zero block, an outlier block, and a
    /// batch large enough to be quantised in parallel pieces.
    #[test]
    fn quantize_k_simd_matches_scalar_exactly() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let n = super::super::ops::PAR_MIN_ELEMS * 2 + QK_K * 3;
        let mut x: Vec<f32> = (0..n).map(|_| rng.gen_range(-3.0..3.0)).collect();
        for (i, v) in x[QK_K..2 * QK_K].iter_mut().enumerate() {
            *v = ((i % 64) as f32 - 32.0) + 0.5; // amax 31.5 · 127 / 31.5: many ties
        }
        x[2 * QK_K..3 * QK_K].fill(0.0);
        x[3 * QK_K + 7] = -300.0;
        let mut b = Q8Acts::default();
        b.quantize_k_scalar(&x);
        let expect_sum: i16 = b.kqs[..32].iter().map(|&q| q as i16).sum();
        assert_eq!(b.kbsum[0], expect_sum);
        let expect_sum16: i16 = b.kqs[16..32].iter().map(|&q| q as i16).sum();
        assert_eq!(b.kbsum16[1], expect_sum16);
        assert!(b.kqs[QK_K * 3 + 7] == -127 && b.kd[2] == 0.0);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let mut a = Q8Acts::default();
        pool.install(|| a.quantize_k(&x));
        check_equal(&a, &b);
        #[cfg(target_arch = "x86_64")]
        if super::super::x86::detect().is_some() {
            let mut a = Q8Acts::default();
            a.resize_k(x.len());
            // SAFETY: AVX2 was detected; the buffers were sized for `x`.
            unsafe { quantize_k_avx2(&x, &mut a.kd, &mut a.kqs, &mut a.kbsum, &mut a.kbsum16) };
            check_equal(&a, &b);
        }
    }

    fn check_equal(a: &Q8Acts, b: &Q8Acts) {
        assert_eq!(a.kqs, b.kqs);
        assert_eq!(a.kbsum, b.kbsum);
        assert_eq!(a.kbsum16, b.kbsum16);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a.kd), bits(&b.kd));
    }

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        for (x, r) in [
            (0.5f32, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (126.5, 126),
        ] {
            assert_eq!(nearest_int(x), r, "{x}");
        }
        let mut x = -127.0f32;
        while x <= 127.0 {
            assert_eq!(nearest_int(x), x.round_ties_even() as i32, "{x}");
            x += 0.0173;
        }
    }
}
