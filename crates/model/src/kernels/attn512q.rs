//! AVX-512 attention straight from quantised (`q8`, `q4`) paged K/V: the same walk, online
//! softmax and batch-invariance argument as `attn512` (read its NOTE 1), with the blocks'
//! integer codes widened to f32 in registers and their per-group scales applied there.
//! Nothing is dequantised into memory.
//!
//! Scores: for each group of 32 dimensions, `Σ_d q[d] · code[d][slot]` is accumulated over
//! 16 slots at once from K's transposed codes (one 16-byte load per dimension, or per pair
//! of dimensions for q4), then multiplied by the 16 slots' f16 scales of that group and
//! added to the row's scores. Values: the 16 slots' scales of each group are folded into
//! the row's 16 softmax weights with one vector multiply (`pg = p · scale`), so
//! `acc += pg[j] · code[j]` is one FMA per 16 dimensions, as for f16. A row's arithmetic still depends only on its own query, its
//! visible keys and the stored bytes, in a fixed order; a slot it cannot see contributes
//! `0 · scale · code`, i.e. nothing (scales are finite: they are rounded from finite K/V).
//!
//! The block format is `kv_quant`'s.

use std::arch::x86_64::*;

use super::attn512::{exp512, hsum, HeadKv, Row};
use super::kv_quant::{QLayout, QuantBits, GROUP};

/// Computes every row (`1..=attn512::max_rows(head_dim)` of them) over a quantised store.
///
/// # Safety
/// As `attn512::attend`; `kv.k`/`kv.v` point at quantised layers laid out as `layout`.
pub unsafe fn attend(kv: &HeadKv, layout: &QLayout, rows: &[Row], scale: f32) {
    macro_rules! go {
        ($hd16:literal, $r:literal) => {{
            let r: &[Row; $r] = rows.try_into().unwrap();
            match layout.bits {
                QuantBits::Q8 => kernel::<$hd16, $r, false>(kv, layout, r, scale),
                QuantBits::Q4 => kernel::<$hd16, $r, true>(kv, layout, r, scale),
            }
        }};
    }
    match (kv.head_dim, rows.len()) {
        (64, 1) => go!(4, 1),
        (64, 2) => go!(4, 2),
        (64, 3) => go!(4, 3),
        (64, 4) => go!(4, 4),
        (128, 1) => go!(8, 1),
        (128, 2) => go!(8, 2),
        (256, 1) => go!(16, 1),
        (hd, n) => panic!("attend: {n} rows of head_dim {hd} unsupported"),
    }
}

// Indices such as `j` and `i` address several parallel register arrays and pointer
// offsets (`vb.add((c0 + j) * v_row_bytes)`, `out.add(16 * i)`) at once, so the index
// form is clearer than zipped iterators in this hot kernel.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
unsafe fn kernel<const HD16: usize, const R: usize, const Q4: bool>(
    kv: &HeadKv,
    lay: &QLayout,
    rows: &[Row; R],
    scale: f32,
) {
    let hd = HD16 * 16;
    let n_groups = hd / GROUP;
    let bs = kv.block_size;
    let head_bytes = lay.head_bytes();
    let scales_at = lay.scales_offset();
    let v_row_bytes = lay.quant_bytes_per_token();
    debug_assert!(lay.head_dim == hd && lay.block_size == bs);

    // 16 codes at byte `p` widened to i32 lanes (lanes outside `mask` read as 0 from no
    // memory). Macros rather than closures, so that they compile with this function's features.
    macro_rules! bytes16 {
        ($p:expr, $mask:expr) => {
            if $mask == 0xFFFF {
                _mm_loadu_si128($p as *const __m128i)
            } else {
                _mm_maskz_loadu_epi8($mask, $p as *const i8)
            }
        };
    }
    // q8 codes as f32.
    macro_rules! q8 {
        ($b:expr) => {
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32($b))
        };
    }
    // q4 bytes as (low nibbles − 8, high nibbles − 8) in f32.
    macro_rules! q4 {
        ($b:expr) => {{
            let x = _mm512_cvtepu8_epi32($b);
            let (m, eight) = (_mm512_set1_epi32(15), _mm512_set1_epi32(8));
            (
                _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(x, m), eight)),
                _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32::<4>(x), eight)),
            )
        }};
    }

    let mut qs = [[0f32; 256]; R];
    for (qr, row) in qs.iter_mut().zip(rows) {
        std::ptr::copy_nonoverlapping(row.q, qr.as_mut_ptr(), hd);
    }
    let scale_v = _mm512_set1_ps(scale);
    let mut m = [f32::NEG_INFINITY; R];
    let mut l = [0f32; R];
    let mut acc = [[_mm512_setzero_ps(); HD16]; R];
    // Softmax weights times V's scales, per row and group (at most 4 groups: hd ≤ 128).
    let mut pg = [[[0f32; 16]; 8]; R];
    debug_assert!(
        rows.iter().all(|r| r.first_visible == 0),
        "windows over quantised K/V take the portable kernel"
    );
    let n_max = rows.iter().map(|r| r.n_visible).max().unwrap_or(0);

    let n_blocks = n_max.div_ceil(bs);
    let block_at = |b: usize| {
        (*kv.block_table.get_unchecked(b) as usize * kv.n_kv_heads + kv.kv_head) * head_bytes
    };
    for b in 0..n_blocks {
        if kv.prefetch {
            for ahead in if b == 0 { 1..3 } else { 2..3 } {
                if b + ahead < n_blocks {
                    let off = block_at(b + ahead);
                    for line in (0..head_bytes).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T0>(kv.k.add(off + line) as *const i8);
                        _mm_prefetch::<_MM_HINT_T0>(kv.v.add(off + line) as *const i8);
                    }
                }
            }
        }
        let off = block_at(b);
        let (kb, vb) = (kv.k.add(off), kv.v.add(off));
        let (k_scales, v_scales) = (
            kb.add(scales_at) as *const u16,
            vb.add(scales_at) as *const u16,
        );
        let mut c0 = 0;
        while c0 < bs && b * bs + c0 < n_max {
            let base = b * bs + c0;
            let w = (bs - c0).min(16);
            let wmask: __mmask16 = if w == 16 { 0xFFFF } else { (1 << w) - 1 };
            let mut s = [_mm512_setzero_ps(); R];
            for g in 0..n_groups {
                // Two accumulators per row (even and odd d) halve the FMA chain.
                let mut s0 = [_mm512_setzero_ps(); R];
                let mut s1 = [_mm512_setzero_ps(); R];
                for d in (g * GROUP..(g + 1) * GROUP).step_by(2) {
                    let (k0, k1) = if Q4 {
                        q4!(bytes16!(kb.add((d / 2) * bs + c0), wmask))
                    } else {
                        (
                            q8!(bytes16!(kb.add(d * bs + c0), wmask)),
                            q8!(bytes16!(kb.add((d + 1) * bs + c0), wmask)),
                        )
                    };
                    for r in 0..R {
                        s0[r] = _mm512_fmadd_ps(_mm512_set1_ps(qs[r][d]), k0, s0[r]);
                        s1[r] = _mm512_fmadd_ps(_mm512_set1_ps(qs[r][d + 1]), k1, s1[r]);
                    }
                }
                let sg = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
                    wmask,
                    k_scales.add(g * bs + c0) as *const i16,
                ));
                for r in 0..R {
                    s[r] = _mm512_fmadd_ps(_mm512_add_ps(s0[r], s1[r]), sg, s[r]);
                }
            }
            // Online softmax per row over the slots it sees (attn512's NOTE 1).
            let mut j_max = 0;
            for r in 0..R {
                let nv = rows[r].n_visible.saturating_sub(base).min(w);
                if nv == 0 {
                    pg[r] = [[0.0; 16]; 8];
                    continue;
                }
                j_max = j_max.max(nv);
                let vmask: __mmask16 = if nv == 16 { 0xFFFF } else { (1 << nv) - 1 };
                let sc = _mm512_mul_ps(s[r], scale_v);
                let m_new = m[r].max(_mm512_mask_reduce_max_ps(vmask, sc));
                let corr = exp512(_mm512_set1_ps(m[r] - m_new));
                let pv =
                    _mm512_maskz_mov_ps(vmask, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(m_new))));
                l[r] = l[r] * _mm512_cvtss_f32(corr) + hsum(pv);
                for a in acc[r].iter_mut() {
                    *a = _mm512_mul_ps(*a, corr);
                }
                for (g, pgg) in pg[r][..n_groups].iter_mut().enumerate() {
                    let sv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
                        wmask,
                        v_scales.add(g * bs + c0) as *const i16,
                    ));
                    _mm512_storeu_ps(pgg.as_mut_ptr(), _mm512_mul_ps(pv, sv));
                }
                m[r] = m_new;
            }
            // acc += pg[j] · code[j]; each widened code vector serves every row.
            for j in 0..j_max {
                let vrow = vb.add((c0 + j) * v_row_bytes);
                for g in 0..n_groups {
                    let (v0, v1) = if Q4 {
                        q4!(_mm_loadu_si128(vrow.add(g * GROUP / 2) as *const __m128i))
                    } else {
                        (
                            q8!(_mm_loadu_si128(vrow.add(g * GROUP) as *const __m128i)),
                            q8!(_mm_loadu_si128(vrow.add(g * GROUP + 16) as *const __m128i)),
                        )
                    };
                    for r in 0..R {
                        let w = _mm512_set1_ps(pg[r][g][j]);
                        acc[r][2 * g] = _mm512_fmadd_ps(w, v0, acc[r][2 * g]);
                        acc[r][2 * g + 1] = _mm512_fmadd_ps(w, v1, acc[r][2 * g + 1]);
                    }
                }
            }
            c0 += 16;
        }
    }
    for r in 0..R {
        let inv = _mm512_set1_ps(1.0 / l[r]);
        for i in 0..HD16 {
            _mm512_storeu_ps(rows[r].out.add(16 * i), _mm512_mul_ps(acc[r][i], inv));
        }
    }
}
