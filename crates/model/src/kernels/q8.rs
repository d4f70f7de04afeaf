//! Activations quantised to 8-bit blocks of 32, and integer dot products against weight
//! blocks: llama.cpp's CPU method (`quantize_row_q8_0/q8_1`, `ggml_vec_dot_q4_1_q8_1`, …).
//!
//! Besides being fast (integer multiply-adds on 8-bit data), this reproduces llama.cpp's
//! rounding: the scale `d` of each activation block (and the Q8_1 block sum `s`) is stored
//! as f16, exactly as there. The rounding is coarse: compared with exact f32 activations it
//! moves SmolLM2's first-step log-probabilities by up to about 0.1 nats, and a change of
//! summation order elsewhere (the KV block size) can flip a rounding and move them as much.

use half::f16;

pub const QK: usize = 32;

/// A row (or several rows) of activations in 8-bit blocks.
#[derive(Default)]
pub struct Q8Acts {
    /// One scale per block (already rounded through f16).
    pub d: Vec<f32>,
    /// `d * Σ qs` per block (rounded through f16), used by formats with a min (Q4_1).
    pub s: Vec<f32>,
    /// `Σ qs` per block, exact; the SIMD kernels subtract `offset × sum` for weights stored
    /// with an unsigned offset.
    pub sum: Vec<i32>,
    /// `Σ qs` over the first 16 values of each block, exact (the second half's is `sum −
    /// sum_lo`): Q6S weights have one scale per 16 values, so the kernels subtract their
    /// offset from each half's integer sum separately.
    pub sum_lo: Vec<i32>,
    pub qs: Vec<i8>,
    /// The K representation for Q4_K weights (`q8k`), filled by [`Q8Acts::quantize_k`]
    /// only where a product needs it: one f32 scale per 256 elements…
    pub kd: Vec<f32>,
    /// …the quants under that scale…
    pub kqs: Vec<i8>,
    /// …`Σ kqs` per 32 elements, exact…
    pub kbsum: Vec<i16>,
    /// …and per 16 (Q6_K's sub-blocks).
    pub kbsum16: Vec<i16>,
}

/// A SIMD quantiser's signature (`x86::quantize_avx512`, `x86::quantize_avx2`): `x`, then
/// the block scales, scaled sums, sums, first-half sums and quants to fill.
#[cfg(target_arch = "x86_64")]
type SimdQuantizer = unsafe fn(&[f32], &mut [f32], &mut [f32], &mut [i32], &mut [i32], &mut [i8]);

impl Q8Acts {
    /// Quantises `x` (any multiple of 32 long) block by block: with AVX-512 where the CPU
    /// has it, else AVX2 (both bit-exact with [`Q8Acts::quantize_scalar`], tested), else
    /// the scalar code.
    pub fn quantize(&mut self, x: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            let simd: Option<SimdQuantizer> = if super::x86::has_avx512() {
                Some(super::x86::quantize_avx512)
            } else if super::x86::detect().is_some() {
                Some(super::x86::quantize_avx2)
            } else {
                None
            };
            if let Some(f) = simd {
                self.resize(x.len());
                self.quantize_pieces(x, f);
                return;
            }
        }
        self.quantize_scalar(x);
    }

    /// Runs the SIMD quantiser `f` over `x`, in pieces on rayon's threads when `x` is a
    /// prefill's batch (blocks are independent, so the bits do not depend on the split).
    #[cfg(target_arch = "x86_64")]
    fn quantize_pieces(&mut self, x: &[f32], f: SimdQuantizer) {
        use rayon::prelude::*;
        let (piece, piece_blocks) = (
            super::ops::PAR_CHUNK_ELEMS,
            super::ops::PAR_CHUNK_ELEMS / QK,
        );
        if x.len() < super::ops::PAR_MIN_ELEMS || rayon::current_num_threads() == 1 {
            // SAFETY: `f` was chosen for the features `quantize` detected (AVX-512 F/BW/VL,
            // or AVX2 with FMA and F16C); every buffer was sized for `x`.
            unsafe {
                f(
                    x,
                    &mut self.d,
                    &mut self.s,
                    &mut self.sum,
                    &mut self.sum_lo,
                    &mut self.qs,
                )
            };
            return;
        }
        let n_blocks = x.len() / QK;
        x.par_chunks(piece)
            .zip(self.d[..n_blocks].par_chunks_mut(piece_blocks))
            .zip(self.s[..n_blocks].par_chunks_mut(piece_blocks))
            .zip(self.sum[..n_blocks].par_chunks_mut(piece_blocks))
            .zip(self.sum_lo[..n_blocks].par_chunks_mut(piece_blocks))
            .zip(self.qs[..x.len()].par_chunks_mut(piece))
            .for_each(|(((((x, d), s), sum), sum_lo), qs)| {
                // SAFETY: as above; each piece of every buffer was cut from buffers sized for
                // `x` at the same block boundaries.
                unsafe { f(x, d, s, sum, sum_lo, qs) }
            });
    }

    fn resize(&mut self, len: usize) {
        debug_assert_eq!(len % QK, 0);
        let n_blocks = len / QK;
        self.d.resize(n_blocks, 0.0);
        self.s.resize(n_blocks, 0.0);
        self.sum.resize(n_blocks, 0);
        self.sum_lo.resize(n_blocks, 0);
        self.qs.resize(len, 0);
    }

    /// The portable reference of [`Q8Acts::quantize`].
    pub fn quantize_scalar(&mut self, x: &[f32]) {
        self.resize(x.len());
        let n_blocks = x.len() / QK;
        for b in 0..n_blocks {
            let xb = &x[b * QK..(b + 1) * QK];
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let (mut sum, mut sum_lo) = (0i32, 0i32);
            for (i, (q, &v)) in self.qs[b * QK..(b + 1) * QK].iter_mut().zip(xb).enumerate() {
                let r = round_half_away(v * id);
                *q = r as i8;
                sum += r;
                if i < QK / 2 {
                    sum_lo += r;
                }
            }
            self.d[b] = f16::from_f32(d).to_f32();
            self.s[b] = f16::from_f32(d * sum as f32).to_f32();
            self.sum[b] = sum;
            self.sum_lo[b] = sum_lo;
        }
    }
}

/// C's `roundf` (half away from zero, as ggml's reference code rounds) for |x| < 2³¹,
/// without the libm call `f32::round` compiles to on baseline x86-64: truncation is one
/// instruction and `x - t` is exact, so the result equals `x.round()` for every such x.
#[inline(always)]
fn round_half_away(x: f32) -> i32 {
    let t = x as i32;
    let frac = x - t as f32;
    if frac >= 0.5 {
        t + 1
    } else if frac <= -0.5 {
        t - 1
    } else {
        t
    }
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Σ over blocks of a Q4_1 weight row times Q8_1 activations (block offset `b0`).
pub fn dot_q4_1(w: &[u8], a: &Q8Acts, b0: usize) -> f32 {
    let mut sum = 0f32;
    for (i, blk) in w.chunks_exact(20).enumerate() {
        let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
        let qa = &a.qs[(b0 + i) * QK..(b0 + i + 1) * QK];
        let mut isum = 0i32;
        for j in 0..16 {
            isum += (blk[4 + j] & 0x0f) as i32 * qa[j] as i32
                + (blk[4 + j] >> 4) as i32 * qa[j + 16] as i32;
        }
        sum += d * a.d[b0 + i] * isum as f32 + m * a.s[b0 + i];
    }
    sum
}

pub fn dot_q4_0(w: &[u8], a: &Q8Acts, b0: usize) -> f32 {
    let mut sum = 0f32;
    for (i, blk) in w.chunks_exact(18).enumerate() {
        let qa = &a.qs[(b0 + i) * QK..(b0 + i + 1) * QK];
        let mut isum = 0i32;
        for j in 0..16 {
            isum += ((blk[2 + j] & 0x0f) as i32 - 8) * qa[j] as i32
                + ((blk[2 + j] >> 4) as i32 - 8) * qa[j + 16] as i32;
        }
        sum += f16_at(blk, 0) * a.d[b0 + i] * isum as f32;
    }
    sum
}

pub fn dot_q5_0(w: &[u8], a: &Q8Acts, b0: usize) -> f32 {
    let mut sum = 0f32;
    for (i, blk) in w.chunks_exact(22).enumerate() {
        let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
        let qa = &a.qs[(b0 + i) * QK..(b0 + i + 1) * QK];
        let mut isum = 0i32;
        for j in 0..16 {
            let x0 = ((blk[6 + j] as u32 & 0x0f) | (((qh >> j) << 4) & 0x10)) as i32 - 16;
            let x1 = ((blk[6 + j] as u32 >> 4) | ((qh >> (j + 12)) & 0x10)) as i32 - 16;
            isum += x0 * qa[j] as i32 + x1 * qa[j + 16] as i32;
        }
        sum += f16_at(blk, 0) * a.d[b0 + i] * isum as f32;
    }
    sum
}

pub fn dot_q8_0(w: &[u8], a: &Q8Acts, b0: usize) -> f32 {
    let mut sum = 0f32;
    for (i, blk) in w.chunks_exact(34).enumerate() {
        let qa = &a.qs[(b0 + i) * QK..(b0 + i + 1) * QK];
        let mut isum = 0i32;
        for j in 0..32 {
            isum += (blk[2 + j] as i8) as i32 * qa[j] as i32;
        }
        sum += f16_at(blk, 0) * a.d[b0 + i] * isum as f32;
    }
    sum
}

/// Σ over blocks of a [`pk_gguf::GgmlType::Q6S`] weight row times Q8 activations. Each
/// 16-element half has its own scale, so each gets its own integer sum, and the two are
/// added to the float sum one after the other: `(d0 · d_a) · ilo`, then `(d1 · d_a) · ihi`,
/// each multiply and add rounded separately, the order the SIMD kernels follow.
pub fn dot_q6s(w: &[u8], a: &Q8Acts, b0: usize) -> f32 {
    let mut sum = 0f32;
    for (i, blk) in w.chunks_exact(28).enumerate() {
        let (d0, d1) = (f16_at(blk, 0), f16_at(blk, 2));
        let (ql, qh) = (&blk[4..20], &blk[20..28]);
        let qa = &a.qs[(b0 + i) * QK..(b0 + i + 1) * QK];
        let q = |e: usize| {
            let lo = if e < 16 {
                ql[e] & 0x0f
            } else {
                ql[e - 16] >> 4
            };
            (lo | (((qh[e / 4] >> (2 * (e % 4))) & 3) << 4)) as i32 - 32
        };
        let (mut ilo, mut ihi) = (0i32, 0i32);
        for e in 0..16 {
            ilo += q(e) * qa[e] as i32;
            ihi += q(16 + e) * qa[16 + e] as i32;
        }
        let da = a.d[b0 + i];
        sum += (d0 * da) * ilo as f32;
        sum += (d1 * da) * ihi as f32;
    }
    sum
}

#[cfg(test)]
mod rounding_tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The SIMD quantiser gives the scalar one's bits: random blocks, blocks of exact
    /// halves after scaling (the rounding ties), an all-zero block and an outlier block.
    #[test]
    fn quantize_simd_matches_scalar_exactly() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let mut x: Vec<f32> = (0..32 * 40).map(|_| rng.gen_range(-3.0..3.0)).collect();
        for (i, v) in x[32..64].iter_mut().enumerate() {
            *v = (i as f32 - 16.0) + 0.5; // amax 15.5: many products land on .5 exactly
        }
        x[64..96].fill(0.0);
        x[100] = -300.0;
        for (i, v) in x[128..160].iter_mut().enumerate() {
            *v = (i as f32 - 15.5) * 127.0 / 31.0;
        }
        let mut b = Q8Acts::default();
        b.quantize_scalar(&x);
        let mut a = Q8Acts::default();
        a.quantize(&x);
        check_equal(&a, &b);
        // The AVX2 quantiser too, also on hosts where `quantize` takes AVX-512.
        #[cfg(target_arch = "x86_64")]
        if super::super::x86::detect().is_some() {
            let mut a = Q8Acts::default();
            a.resize(x.len());
            // SAFETY: AVX2, FMA and F16C were detected; the buffers are sized for `x`.
            unsafe {
                super::super::x86::quantize_avx2(
                    &x,
                    &mut a.d,
                    &mut a.s,
                    &mut a.sum,
                    &mut a.sum_lo,
                    &mut a.qs,
                )
            };
            check_equal(&a, &b);
        }
    }

    /// A prefill-sized batch (over `ops::PAR_MIN_ELEMS`, and not a whole number of pieces)
    /// quantised in pieces on two threads: the scalar reference's bits.
    #[test]
    fn quantize_in_parallel_pieces_matches_scalar_exactly() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(10);
        let n = super::super::ops::PAR_MIN_ELEMS * 2 + 32 * 7;
        let x: Vec<f32> = (0..n).map(|_| rng.gen_range(-3.0..3.0)).collect();
        let mut b = Q8Acts::default();
        b.quantize_scalar(&x);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let mut a = Q8Acts::default();
        pool.install(|| a.quantize(&x));
        check_equal(&a, &b);
    }

    fn check_equal(a: &Q8Acts, b: &Q8Acts) {
        assert_eq!(a.qs, b.qs);
        assert_eq!(a.sum, b.sum);
        assert_eq!(a.sum_lo, b.sum_lo);
        assert_eq!(
            b.sum_lo[0],
            b.qs[..16].iter().map(|&q| q as i32).sum::<i32>()
        );
        assert_eq!(
            a.d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            b.d.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(
            a.s.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            b.s.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn round_half_away_equals_roundf() {
        let mut xs = vec![
            0.5f32,
            -0.5,
            1.5,
            -1.5,
            2.5,
            0.49999997,
            -0.49999997,
            126.5,
            -127.0,
            127.49998,
            0.0,
            -0.0,
        ];
        let mut x = -130.0f32;
        while x < 130.0 {
            xs.push(x);
            x += 0.0137;
        }
        for x in xs {
            assert_eq!(round_half_away(x), x.round() as i32, "{x}");
        }
    }
}
