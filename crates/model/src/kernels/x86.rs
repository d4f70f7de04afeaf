//! x86-64 SIMD integer matmul over [`Packed`] weights: AVX2 (`vpmaddubsw` + `vpmaddwd`, like
//! ggml) and AVX-512 VNNI on 256-bit vectors (`vpdpbusd`; on Zen 4 a 512-bit op costs two
//! 256-bit ones, so wider vectors would only save instructions, while the EVEX encoding
//! already gives us 32 registers). Chosen at run time by [`detect`].
//!
//! NOTE 1: bit-exact with the scalar reference (`q8::dot_*`). Each 32-bit lane is one weight
//! row; per block it gets the exact integer dot product (integer sums do not depend on
//! order), then `acc += (d_w * d_a) * isum` (+ `m_w * s_a` for Q4_1) with separate multiplies
//! and adds in the reference's order, never FMA. So a token's result does not depend on
//! which other tokens share the call, which ISA ran, or how the work was split.
//!
//! NOTE 2: `vpdpbusd` multiplies unsigned by signed bytes, so signed weights are stored
//! offset (Q8_0 as `q + 128`, Q4_0 as `q + 8`, Q5_0 as `q + 16`) and `offset × Σ a` is
//! subtracted from the block's integer sum (`Q8Acts::sum`). `vpmaddubsw` saturates its
//! 16-bit pair sums, which only `(q + 128) · a` could reach: AVX2 runs Q8_0 with the sign
//! trick instead (`|q| · sign(a, q)`).

use std::arch::x86_64::*;
use std::sync::OnceLock;

use pk_gguf::GgmlType;

use super::pack::{Packed, GROUP_ROWS};
use super::q8::{Q8Acts, QK};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Avx2,
    Avx512Vnni,
}

/// The best instruction set this CPU runs, or `None` without AVX2/FMA/F16C.
pub fn detect() -> Option<Isa> {
    static ISA: OnceLock<Option<Isa>> = OnceLock::new();
    *ISA.get_or_init(|| {
        let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
        let vnni = is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") && is_x86_feature_detected!("avx512bw");
        match (avx2, vnni) {
            (true, true) => Some(Isa::Avx512Vnni),
            (true, false) => Some(Isa::Avx2),
            _ => None,
        }
    })
}

/// Whether the AVX-512 activation quantiser runs on this CPU.
pub fn has_avx512() -> bool {
    static YES: OnceLock<bool> = OnceLock::new();
    *YES.get_or_init(|| is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vl"))
}

/// [`Q8Acts::quantize_scalar`] with 16 lanes at a time, bit-exact: the block maximum of
/// `|x|` does not depend on order; `x * id` is the same single rounding; half-away-from-zero
/// rounding is done as the scalar code does it (truncate, then step by the exact remainder);
/// integer sums are exact; the f16 roundings of `d` and `s` use the same scalar conversion.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL ([`has_avx512`]); `x.len()` is a multiple of 32 and
/// `d`, `s`, `sum` hold `x.len() / 32` entries, `qs` `x.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub unsafe fn quantize_avx512(x: &[f32], d: &mut [f32], s: &mut [f32], sum: &mut [i32], qs: &mut [i8]) {
    let n_blocks = x.len() / QK;
    assert!(d.len() >= n_blocks && s.len() >= n_blocks && sum.len() >= n_blocks && qs.len() >= x.len());
    let (half, mhalf, one) = (_mm512_set1_ps(0.5), _mm512_set1_ps(-0.5), _mm512_set1_epi32(1));
    for b in 0..n_blocks {
        let p = x.as_ptr().add(b * QK);
        let (v0, v1) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        let db = amax / 127.0;
        let id = _mm512_set1_ps(if db != 0.0 { 1.0 / db } else { 0.0 });
        // A macro, not a closure, so that it is compiled with this function's features.
        macro_rules! round {
            ($v:expr) => {{
                let y = _mm512_mul_ps($v, id);
                let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
                let frac = _mm512_sub_ps(y, t);
                let r = _mm512_cvttps_epi32(t);
                let r = _mm512_mask_add_epi32(r, _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, half), r, one);
                _mm512_mask_sub_epi32(r, _mm512_cmp_ps_mask::<_CMP_LE_OQ>(frac, mhalf), r, one)
            }};
        }
        let (r0, r1) = (round!(v0), round!(v1));
        let q = qs.as_mut_ptr().add(b * QK);
        _mm_storeu_si128(q as *mut __m128i, _mm512_cvtepi32_epi8(r0));
        _mm_storeu_si128(q.add(16) as *mut __m128i, _mm512_cvtepi32_epi8(r1));
        let sb = _mm512_reduce_add_epi32(_mm512_add_epi32(r0, r1));
        d[b] = half::f16::from_f32(db).to_f32();
        s[b] = half::f16::from_f32(db * sb as f32).to_f32();
        sum[b] = sb;
    }
}

const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;
const Q5_0: u8 = 3;

/// Tokens per register tile: one group's 8 unpacked weight vectors are reused this often.
const TILE_TOKENS: usize = 4;

/// Computes rows `8g..8g+8` (clipped to `p.rows`) for tokens `t0..t1` of `acts`, writing
/// `out[t * out_stride + row]`.
///
/// # Safety
/// `isa` must be supported by this CPU, `acts` must hold at least `t1` tokens of
/// `p.blocks_per_row` blocks, and `out` must be valid for those writes (no other thread
/// writing the same rows).
pub unsafe fn gemm_group(isa: Isa, p: &Packed, g: usize, acts: &Q8Acts, t0: usize, t1: usize, out: *mut f32, out_stride: usize) {
    let lanes = (p.rows - g * GROUP_ROWS).min(GROUP_ROWS);
    let args = (p.group(g).as_ptr(), p.blocks_per_row, acts, out.add(g * GROUP_ROWS), out_stride, lanes);
    macro_rules! run {
        ($m:ident, $fmt:expr) => {{
            let mut t = t0;
            while t + TILE_TOKENS <= t1 {
                $m::tile::<{ $fmt }, TILE_TOKENS>(args.0, args.1, args.2, t, args.3, args.4, args.5);
                t += TILE_TOKENS;
            }
            while t < t1 {
                $m::tile::<{ $fmt }, 1>(args.0, args.1, args.2, t, args.3, args.4, args.5);
                t += 1;
            }
        }};
    }
    macro_rules! by_format {
        ($m:ident) => {
            match p.ty {
                GgmlType::Q4_0 => run!($m, Q4_0),
                GgmlType::Q4_1 => run!($m, Q4_1),
                GgmlType::Q8_0 => run!($m, Q8_0),
                GgmlType::Q5_0 => run!($m, Q5_0),
                ty => unreachable!("no packed kernel for {ty:?}"),
            }
        };
    }
    match isa {
        Isa::Avx2 => by_format!(avx2),
        Isa::Avx512Vnni => by_format!(vnni),
    }
}

/// One module per instruction set, from the same source: `target_feature` must be on every
/// function for the intrinsics to inline.
macro_rules! isa_module {
    ($name:ident, $features:literal, $vnni:literal) => {
        mod $name {
            use super::*;

            /// `acc + Σ_{4 bytes} w·a` per 32-bit lane, `w` unsigned (< 128 on AVX2), `a` signed.
            #[target_feature(enable = $features)]
            #[inline]
            unsafe fn dot4(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
                if $vnni {
                    _mm256_dpbusd_epi32(acc, w, a)
                } else {
                    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)))
                }
            }

            /// See [`super::gemm_group`]; `NT` tokens from `t0`, `lanes` valid rows.
            #[target_feature(enable = $features)]
            pub unsafe fn tile<const FMT: u8, const NT: usize>(group: *const u8, bpr: usize, acts: &Q8Acts, t0: usize, out: *mut f32, out_stride: usize, lanes: usize) {
                let gbb = match FMT {
                    Q4_0 => 16 + 128,
                    Q4_1 => 32 + 128,
                    _ => 16 + 256,
                };
                // Q8_0 on AVX2 takes the sign trick (NOTE 2), so it has no offset there.
                let offset: i32 = match FMT {
                    Q4_0 => 8,
                    Q5_0 => 16,
                    Q8_0 if $vnni => 128,
                    _ => 0,
                };
                let low4 = _mm256_set1_epi8(0x0f);
                let (qs, ad, asum, as_) = (acts.qs.as_ptr(), acts.d.as_ptr(), acts.sum.as_ptr(), acts.s.as_ptr());
                let mut acc = [_mm256_setzero_ps(); NT];
                for b in 0..bpr {
                    let gb = group.add(b * gbb);
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(gb as *const __m128i));
                    let m = if FMT == Q4_1 { _mm256_cvtph_ps(_mm_loadu_si128(gb.add(16) as *const __m128i)) } else { _mm256_setzero_ps() };
                    // v[k]: 4 quants (elements 4k..4k+4) of each of the 8 rows.
                    let mut v = [_mm256_setzero_si256(); 8];
                    if FMT == Q4_0 || FMT == Q4_1 {
                        let at = if FMT == Q4_1 { 32 } else { 16 };
                        for k in 0..4 {
                            let p = _mm256_loadu_si256(gb.add(at + 32 * k) as *const __m256i);
                            v[k] = _mm256_and_si256(p, low4);
                            v[k + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low4);
                        }
                    } else {
                        for k in 0..8 {
                            v[k] = _mm256_loadu_si256(gb.add(16 + 32 * k) as *const __m256i);
                        }
                    }
                    // AVX2 Q8_0: v becomes |q| and `sign` keeps q for the activations' sign.
                    let mut sign = [_mm256_setzero_si256(); 8];
                    if FMT == Q8_0 && !$vnni {
                        for k in 0..8 {
                            sign[k] = _mm256_xor_si256(v[k], _mm256_set1_epi8(-128));
                            v[k] = _mm256_abs_epi8(sign[k]);
                        }
                    }
                    for j in 0..NT {
                        let ab = (t0 + j) * bpr + b;
                        let a = qs.add(ab * QK);
                        let (mut i0, mut i1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                        for k in (0..8).step_by(2) {
                            let mut a0 = _mm256_set1_epi32((a.add(4 * k) as *const i32).read_unaligned());
                            let mut a1 = _mm256_set1_epi32((a.add(4 * k + 4) as *const i32).read_unaligned());
                            if FMT == Q8_0 && !$vnni {
                                a0 = _mm256_sign_epi8(a0, sign[k]);
                                a1 = _mm256_sign_epi8(a1, sign[k + 1]);
                            }
                            i0 = dot4(i0, v[k], a0);
                            i1 = dot4(i1, v[k + 1], a1);
                        }
                        let mut isum = _mm256_add_epi32(i0, i1);
                        if offset != 0 {
                            isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(offset * *asum.add(ab)));
                        }
                        // The reference's `(d_w * d_a) * isum [+ m_w * s_a]`, unfused (NOTE 1).
                        let scale = _mm256_mul_ps(d, _mm256_set1_ps(*ad.add(ab)));
                        let mut x = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(isum));
                        if FMT == Q4_1 {
                            x = _mm256_add_ps(x, _mm256_mul_ps(m, _mm256_set1_ps(*as_.add(ab))));
                        }
                        acc[j] = _mm256_add_ps(acc[j], x);
                    }
                }
                for j in 0..NT {
                    let dst = out.add((t0 + j) * out_stride);
                    if lanes == GROUP_ROWS {
                        _mm256_storeu_ps(dst, acc[j]);
                    } else {
                        let mut tmp = [0f32; GROUP_ROWS];
                        _mm256_storeu_ps(tmp.as_mut_ptr(), acc[j]);
                        std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst, lanes);
                    }
                }
            }
        }
    };
}

isa_module!(avx2, "avx2,fma,f16c", false);
isa_module!(vnni, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni", true);
