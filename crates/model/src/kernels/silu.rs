//! SwiGLU's gate, `gate = silu(gate) · up` with `silu(x) = x / (1 + e^(−x))`, with glibc's
//! `expf` computed eight or sixteen lanes at a time.
//!
//! Why vectorise: libm's `expf` is scalar, and on Qwen2.5-Coder-1.5B it made SiLU about 3 %
//! of a one-thread 512-token prefill and 0.75 % of two-thread decode (where it runs on the
//! calling thread while the other waits). Why glibc's algorithm and not a cheaper one: any
//! other exponential of about the same accuracy changes the last bits of SiLU, and those
//! move near-ties in the tests against llama.cpp (`golden_logits`, `golden_greedy`) across
//! their bounds: Cephes' `expf` (`attn512::exp512`) and llama.cpp's own `ggml_v_expf` both
//! did (2026-12-06 and 2026-12-07). So the gate keeps exactly the bits it had.
//!
//! glibc's `expf` (since 2.27; the ARM optimized-routines algorithm) works in doubles:
//! `x·32/ln2 = k + r` with `k` an integer (rounded by adding 1.5·2⁵²), then
//! `e^x = 2^(k/32) · (1 + C2·r + C1·r² + C0·r³)`, `2^(k/32)` from a 32-entry table of
//! `2^(i/32)` with `k / 32` added to its exponent, and one rounding to float at the end.
//! [`exp_lane`] is that computation for one float with the same fused multiply-adds as
//! glibc's FMA build (`__expf_fma`, read off its disassembly), so every path gives the same
//! bits as the others and as `f32::exp` on glibc; the tests check both. Inputs of magnitude
//! 88 and above (overflow, underflow to subnormals, infinities, NaN) go to `f32::exp`.

/// `2^(i/32)`, correctly rounded, with `i << 47` subtracted so that adding `k << 47` puts
/// `k / 32`'s integer part into the exponent.
const TABLE: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];
/// 32 / ln 2.
const INV_LN2_32: u64 = 0x40471547652b82fe;
/// 1.5 · 2⁵²: adding it rounds a double of magnitude below 2⁵¹ to an integer held in the
/// low mantissa bits.
const SHIFT: u64 = 0x4338000000000000;
/// The polynomial's coefficients of r³, r² and r (scaled for r in units of ln 2 / 32).
const C0: u64 = 0x3ebc6af84b912394;
const C1: u64 = 0x3f2ebfce50fac4f3;
const C2: u64 = 0x3f962e42ff0c52d6;
/// Floats whose bits, sign cleared, reach this (|x| ≥ 88) take `f32::exp`.
const SPECIAL_ABS_BITS: u32 = 0x42b0_0000;

#[inline]
fn d(bits: u64) -> f64 {
    f64::from_bits(bits)
}

/// `e^x` with the bits of glibc's `expf`.
#[inline]
pub(crate) fn exp_lane(x: f32) -> f32 {
    if x.to_bits() & 0x7fff_ffff >= SPECIAL_ABS_BITS {
        return x.exp();
    }
    let xd = x as f64;
    let kd_shifted = d(INV_LN2_32).mul_add(xd, d(SHIFT));
    let ki = kd_shifted.to_bits();
    let kd = kd_shifted - d(SHIFT);
    let r = d(INV_LN2_32).mul_add(xd, -kd);
    let s = d(TABLE[(ki % 32) as usize].wrapping_add(ki << 47));
    let z = d(C0).mul_add(r, d(C1));
    let r2 = r * r;
    let y = d(C2).mul_add(r, 1.0);
    (z.mul_add(r2, y) * s) as f32
}

#[inline]
fn silu_mul_lane(g: f32, u: f32) -> f32 {
    g / (1.0 + exp_lane(-g)) * u
}

/// `gate[i] = silu(gate[i]) · up[i]`, sixteen or eight lanes at a time where the CPU has
/// AVX-512 or AVX2 with FMA; the same bits on every path.
pub(super) fn silu_mul_serial(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    #[cfg(target_arch = "x86_64")]
    {
        if super::attn512::supported(64) {
            // SAFETY: the features were detected; both slices have the same length.
            unsafe { x86::silu_mul_avx512(gate, up) };
            return;
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: as above.
            unsafe { x86::silu_mul_avx2(gate, up) };
            return;
        }
    }
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu_mul_lane(*g, u);
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::SPECIAL_ABS_BITS;
    use super::{d, exp_lane, silu_mul_lane, C0, C1, C2, INV_LN2_32, SHIFT, TABLE};
    use std::arch::x86_64::*;

    /// [`exp_lane`]'s ordinary path on four doubles (floats widened exactly).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp_pd256(xd: __m256d) -> __m256d {
        let shift = _mm256_set1_pd(d(SHIFT));
        let inv = _mm256_set1_pd(d(INV_LN2_32));
        let kd_shifted = _mm256_fmadd_pd(inv, xd, shift);
        let ki = _mm256_castpd_si256(kd_shifted);
        let kd = _mm256_sub_pd(kd_shifted, shift);
        let r = _mm256_fmsub_pd(inv, xd, kd);
        let idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
        let t = _mm256_i64gather_epi64::<8>(TABLE.as_ptr() as *const i64, idx);
        let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki)));
        let z = _mm256_fmadd_pd(_mm256_set1_pd(d(C0)), r, _mm256_set1_pd(d(C1)));
        let r2 = _mm256_mul_pd(r, r);
        let y = _mm256_fmadd_pd(_mm256_set1_pd(d(C2)), r, _mm256_set1_pd(1.0));
        _mm256_mul_pd(_mm256_fmadd_pd(z, r2, y), s)
    }

    /// [`exp_lane`] on eight floats.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp256(x: __m256) -> __m256 {
        let lo = exp_pd256(_mm256_cvtps_pd(_mm256_castps256_ps128(x)));
        let hi = exp_pd256(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x)));
        let out = _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo));
        let abs = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fff_ffff));
        let special = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(SPECIAL_ABS_BITS as i32 - 1));
        if _mm256_movemask_epi8(special) == 0 {
            return out;
        }
        let (mut xs, mut ys) = ([0f32; 8], [0f32; 8]);
        _mm256_storeu_ps(xs.as_mut_ptr(), x);
        _mm256_storeu_ps(ys.as_mut_ptr(), out);
        for (y, &x) in ys.iter_mut().zip(&xs) {
            if x.to_bits() & 0x7fff_ffff >= SPECIAL_ABS_BITS {
                *y = exp_lane(x);
            }
        }
        _mm256_loadu_ps(ys.as_ptr())
    }

    /// [`exp_lane`]'s ordinary path on eight doubles; the table is four registers.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
    unsafe fn exp_pd512(xd: __m512d, tab: &[__m512d; 4]) -> __m512d {
        let shift = _mm512_set1_pd(d(SHIFT));
        let inv = _mm512_set1_pd(d(INV_LN2_32));
        let kd_shifted = _mm512_fmadd_pd(inv, xd, shift);
        let ki = _mm512_castpd_si512(kd_shifted);
        let kd = _mm512_sub_pd(kd_shifted, shift);
        let r = _mm512_fmsub_pd(inv, xd, kd);
        // Entries 0..16 and 16..32 by the index's low four bits, then bit 4 chooses.
        let low = _mm512_permutex2var_pd(tab[0], ki, tab[1]);
        let high = _mm512_permutex2var_pd(tab[2], ki, tab[3]);
        let t = _mm512_mask_blend_pd(_mm512_test_epi64_mask(ki, _mm512_set1_epi64(16)), low, high);
        let s = _mm512_castsi512_pd(_mm512_add_epi64(
            _mm512_castpd_si512(t),
            _mm512_slli_epi64::<47>(ki),
        ));
        let z = _mm512_fmadd_pd(_mm512_set1_pd(d(C0)), r, _mm512_set1_pd(d(C1)));
        let r2 = _mm512_mul_pd(r, r);
        let y = _mm512_fmadd_pd(_mm512_set1_pd(d(C2)), r, _mm512_set1_pd(1.0));
        _mm512_mul_pd(_mm512_fmadd_pd(z, r2, y), s)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
    unsafe fn table512() -> [__m512d; 4] {
        std::array::from_fn(|i| _mm512_loadu_pd(TABLE.as_ptr().add(8 * i) as *const f64))
    }

    /// [`exp_lane`] on sixteen floats.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
    pub(super) unsafe fn exp512(x: __m512, tab: &[__m512d; 4]) -> __m512 {
        let lo = exp_pd512(_mm512_cvtps_pd(_mm512_castps512_ps256(x)), tab);
        let x_hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x)));
        let hi = exp_pd512(_mm512_cvtps_pd(x_hi), tab);
        let out = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castps_pd(_mm512_castps256_ps512(_mm512_cvtpd_ps(lo))),
            _mm256_castps_pd(_mm512_cvtpd_ps(hi)),
        ));
        let abs = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fff_ffff));
        let special = _mm512_cmpge_epu32_mask(abs, _mm512_set1_epi32(SPECIAL_ABS_BITS as i32));
        if special == 0 {
            return out;
        }
        let (mut xs, mut ys) = ([0f32; 16], [0f32; 16]);
        _mm512_storeu_ps(xs.as_mut_ptr(), x);
        _mm512_storeu_ps(ys.as_mut_ptr(), out);
        for (y, &x) in ys.iter_mut().zip(&xs) {
            if x.to_bits() & 0x7fff_ffff >= SPECIAL_ABS_BITS {
                *y = exp_lane(x);
            }
        }
        _mm512_loadu_ps(ys.as_ptr())
    }

    /// See [`super::silu_mul_serial`]; `gate` and `up` have the same length.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn silu_mul_avx2(gate: &mut [f32], up: &[f32]) {
        let n8 = gate.len() / 8 * 8;
        let one = _mm256_set1_ps(1.0);
        for i in (0..n8).step_by(8) {
            let x = _mm256_loadu_ps(gate.as_ptr().add(i));
            let e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), x));
            let s = _mm256_div_ps(x, _mm256_add_ps(one, e));
            let y = _mm256_mul_ps(s, _mm256_loadu_ps(up.as_ptr().add(i)));
            _mm256_storeu_ps(gate.as_mut_ptr().add(i), y);
        }
        for i in n8..gate.len() {
            gate[i] = silu_mul_lane(gate[i], up[i]);
        }
    }

    /// See [`super::silu_mul_serial`]; `gate` and `up` have the same length.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
    pub(super) unsafe fn silu_mul_avx512(gate: &mut [f32], up: &[f32]) {
        let tab = table512();
        let n16 = gate.len() / 16 * 16;
        let one = _mm512_set1_ps(1.0);
        for i in (0..n16).step_by(16) {
            let x = _mm512_loadu_ps(gate.as_ptr().add(i));
            let e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), x), &tab);
            let s = _mm512_div_ps(x, _mm512_add_ps(one, e));
            let y = _mm512_mul_ps(s, _mm512_loadu_ps(up.as_ptr().add(i)));
            _mm512_storeu_ps(gate.as_mut_ptr().add(i), y);
        }
        for i in n16..gate.len() {
            gate[i] = silu_mul_lane(gate[i], up[i]);
        }
    }

    /// Each SIMD exponential the host has, applied to `xs` (a multiple of 16 long).
    #[cfg(test)]
    pub(super) fn exp_paths(xs: &[f32]) -> Vec<(&'static str, Vec<f32>)> {
        let mut paths = Vec::new();
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            let mut out = vec![0f32; xs.len()];
            for (o, c) in out.chunks_exact_mut(8).zip(xs.chunks_exact(8)) {
                // SAFETY: the features were detected; each chunk holds eight floats.
                unsafe { _mm256_storeu_ps(o.as_mut_ptr(), exp256(_mm256_loadu_ps(c.as_ptr()))) };
            }
            paths.push(("avx2", out));
        }
        if crate::kernels::attn512::supported(64) {
            let mut out = vec![0f32; xs.len()];
            // SAFETY: as above, sixteen floats a chunk.
            unsafe {
                let tab = table512();
                for (o, c) in out.chunks_exact_mut(16).zip(xs.chunks_exact(16)) {
                    _mm512_storeu_ps(o.as_mut_ptr(), exp512(_mm512_loadu_ps(c.as_ptr()), &tab));
                }
            }
            paths.push(("avx512", out));
        }
        paths
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inputs over the whole range at a fine step, every float in a window around 1, the
    /// edges of the special range, and a length that is a multiple of sixteen.
    fn inputs() -> Vec<f32> {
        let mut xs: Vec<f32> = (-240_000..240_000).map(|i| i as f32 / 2000.0).collect();
        xs.extend((0..200_000u32).map(|i| f32::from_bits(0x3f80_0000 - 100_000 + i)));
        xs.extend([
            -103.9,
            -103.98,
            -104.0,
            -88.0,
            -87.99999,
            87.99999,
            88.0,
            88.38,
            89.0,
            -0.0,
            0.0,
            1e-8,
            -1e-8,
            1e30,
            -1e30,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MIN_POSITIVE,
        ]);
        while !xs.len().is_multiple_of(16) {
            xs.push(0.5);
        }
        xs
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    /// The table holds 2^(i/32) to within an ulp of `exp2` (it is correctly rounded).
    #[test]
    fn table_is_powers_of_two() {
        for (i, &t) in TABLE.iter().enumerate() {
            let v = f64::from_bits(t + ((i as u64) << 47));
            let want = (i as f64 / 32.0).exp2();
            assert!((v - want).abs() <= f64::EPSILON * want, "entry {i}");
        }
    }

    /// On glibc the portable computation is libm's `expf` bit for bit.
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn exp_lane_is_glibc_expf() {
        for x in inputs() {
            assert!(
                same(exp_lane(x), x.exp()),
                "x {x}: {} vs {}",
                exp_lane(x),
                x.exp()
            );
        }
    }

    /// Every SIMD path the host has gives the portable computation's bits.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn simd_paths_match_the_lane_bits() {
        let xs = inputs();
        let paths = x86::exp_paths(&xs);
        eprintln!(
            "paths checked: {:?}",
            paths.iter().map(|p| p.0).collect::<Vec<_>>()
        );
        for (name, got) in paths {
            for (&x, &g) in xs.iter().zip(&got) {
                assert!(
                    same(g, exp_lane(x)),
                    "{name}: x {x}: {g} vs {}",
                    exp_lane(x)
                );
            }
        }
    }

    /// Whichever path the host runs gives `x / (1 + e^(−x)) · u` with libm's exponential,
    /// the bits the gate had before it was vectorised, at a length that leaves a remainder.
    #[test]
    fn silu_keeps_the_scalar_bits() {
        let xs: Vec<f32> = (-40_000..40_001)
            .map(|i| i as f32 / 200.0)
            .chain([-100.0, -88.0, -50.0, 50.0, 88.0, 100.0, 0.0, -0.0])
            .collect();
        let up: Vec<f32> = (0..xs.len()).map(|i| 0.5 + (i % 7) as f32 / 7.0).collect();
        let mut g = xs.clone();
        silu_mul_serial(&mut g, &up);
        for ((&x, &u), &got) in xs.iter().zip(&up).zip(&g) {
            assert!(same(got, silu_mul_lane(x, u)), "x {x}");
            #[cfg(all(target_os = "linux", target_env = "gnu"))]
            assert!(same(got, x / (1.0 + (-x).exp()) * u), "x {x}");
        }
    }
}
