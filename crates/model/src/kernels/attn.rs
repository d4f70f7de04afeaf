//! The inner step of attention: a few query rows against one block of keys and values,
//! updating each row's online softmax (running max `m`, running sum `l`, weighted values).
//!
//! The x86 kernel (AVX2 + FMA) takes K transposed (`kt[d][slot]`, slots padded to a
//! multiple of 8) so that the scores of 8 keys for one query row are 8 lanes of one vector:
//! `s[j] += q[d] · kt[d][j]` needs no horizontal sums, and each loaded `kt` vector serves up
//! to [`ROWS`] query rows; `p · V` then takes all the rows together, a few vectors of the
//! head at a time, so that each loaded `V` vector serves every row too. Each row's arithmetic depends only on that row's query and visible keys, never
//! on which other rows share the call, so batching cannot change a token's result.

/// Query rows processed together (they share every loaded key and value vector). Six rows
/// by two vectors is 12 accumulators, with the two loaded vectors and the broadcast 15 of
/// AVX2's 16 registers; it is also a whole GQA group of Qwen2.5's 1.5B model (12 heads over
/// 2 KV heads). Six rather than four was 1.04–1.07× on the attention of a 512-token tile at
/// 4K–16K keys (`attn_long_bench`, AMD EPYC Zen 3).
pub const ROWS: usize = 6;

/// One query row's online-softmax state.
pub struct RowState<'a> {
    pub q: &'a [f32],
    /// Keys of this block the row may see: slots `0..n_visible` (≥ 1).
    pub n_visible: usize,
    pub m: &'a mut f32,
    pub l: &'a mut f32,
    pub acc: &'a mut [f32],
}

/// A block of K (transposed, `hd × slots_padded`) and V (`slots × hd`) in f32.
pub struct BlockF32<'a> {
    pub kt: &'a [f32],
    pub v: &'a [f32],
    pub slots_padded: usize,
}

/// Whether [`update_x86`] handles this head size on this CPU.
#[cfg(target_arch = "x86_64")]
pub fn x86_supported(head_dim: usize) -> bool {
    (head_dim == 64 || head_dim == 128)
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
}

/// Updates up to [`ROWS`] rows with one block; `scale` multiplies every score.
///
/// # Safety
/// `x86_supported(head_dim)` must hold, and the slices must have the documented sizes.
#[cfg(target_arch = "x86_64")]
pub unsafe fn update_x86(rows: &mut [RowState], blk: &BlockF32, head_dim: usize, scale: f32) {
    debug_assert!(rows.len() <= ROWS);
    match head_dim {
        64 => x86::update::<8>(rows, blk, scale),
        128 => x86::update::<16>(rows, blk, scale),
        _ => unreachable!(),
    }
}

/// Widens `src` (f16 bits) into `dst` with F16C, 8 at a time, inlined into one loop: the
/// per-8 calls of `half`'s slice conversion, one per transposed K row, took over half of a
/// 4K-context decode step (perf, AVX2 host).
///
/// # Safety
/// The CPU must have F16C and AVX; `dst` must be at least as long as `src`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn f16_to_f32_x86(src: &[half::f16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    debug_assert!(dst.len() >= src.len());
    let n8 = src.len() / 8 * 8;
    let (s, d) = (src.as_ptr() as *const u16, dst.as_mut_ptr());
    for i in (0..n8).step_by(8) {
        let h = _mm_loadu_si128(s.add(i) as *const __m128i);
        _mm256_storeu_ps(d.add(i), _mm256_cvtph_ps(h));
    }
    for (i, x) in src.iter().enumerate().skip(n8) {
        *d.add(i) = x.to_f32();
    }
}

/// Widens `rows` rows of `row_len` f16 values (`src`, rows contiguous) into `dst`, row `i`
/// at `dst[i * dst_stride..]`: one block's transposed K (`[d][slot]`) into a column of a
/// wider scratch that holds several blocks side by side.
///
/// # Safety
/// The CPU must have F16C and AVX; `row_len` must be a multiple of 8, `src` must hold
/// `rows × row_len` values and `dst` at least `(rows - 1) × dst_stride + row_len`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn f16_rows_to_f32_x86(
    src: &[half::f16],
    rows: usize,
    row_len: usize,
    dst: &mut [f32],
    dst_stride: usize,
) {
    use std::arch::x86_64::*;
    debug_assert!(row_len.is_multiple_of(8) && src.len() >= rows * row_len);
    debug_assert!(rows == 0 || dst.len() >= (rows - 1) * dst_stride + row_len);
    let (s, d) = (src.as_ptr() as *const u16, dst.as_mut_ptr());
    for r in 0..rows {
        let (sr, dr) = (s.add(r * row_len), d.add(r * dst_stride));
        for i in (0..row_len).step_by(8) {
            let h = _mm_loadu_si128(sr.add(i) as *const __m128i);
            _mm256_storeu_ps(dr.add(i), _mm256_cvtph_ps(h));
        }
    }
}

/// Asks for every cache line of `data` to be brought into L1 (a hint: no fault, no result).
#[cfg(target_arch = "x86_64")]
#[inline]
pub fn prefetch<T>(data: &[T]) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let (p, bytes) = (data.as_ptr() as *const i8, std::mem::size_of_val(data));
    for line in (0..bytes).step_by(64) {
        // SAFETY: `line` is inside `data`; a prefetch never faults and changes no state.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(line)) };
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// Most slots per block held in registers' worth of scores (larger blocks loop).
    const MAX_SLOT_VECS: usize = 8;

    /// Dispatches on the number of rows, so that the score loop is unrolled at compile
    /// time: with a run-time row count its accumulators lived in memory and the loop
    /// control took 40 % of prefill attention (perf, 4K-token prompt, AVX2 host).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn update<const HD8: usize>(rows: &mut [RowState], blk: &BlockF32, scale: f32) {
        match rows.len() {
            1 => update_rows::<HD8, 1>(rows, blk, scale),
            2 => update_rows::<HD8, 2>(rows, blk, scale),
            3 => update_rows::<HD8, 3>(rows, blk, scale),
            4 => update_rows::<HD8, 4>(rows, blk, scale),
            5 => update_rows::<HD8, 5>(rows, blk, scale),
            6 => update_rows::<HD8, 6>(rows, blk, scale),
            _ => unreachable!("at most ROWS rows per call"),
        }
    }

    /// Scores of `R` rows against `NV` × 8 slots starting at `kt` (a column offset into the
    /// transposed block), scaled, written to `scores[r][at..at + 8 NV]`. The `R × NV`
    /// accumulators stay in registers (at most 8 of AVX2's 16) for the whole head.
    // `j` indexes both the key registers and each row's accumulators.
    #[allow(clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn scores_chunk<const HD8: usize, const R: usize, const NV: usize>(
        q: &[*const f32; R],
        kt: *const f32,
        slots_padded: usize,
        scale: f32,
        scores: &mut [[f32; 8 * MAX_SLOT_VECS]; R],
        at: usize,
    ) {
        let mut s = [[_mm256_setzero_ps(); NV]; R];
        for d in 0..HD8 * 8 {
            let k = kt.add(d * slots_padded);
            let mut kv = [_mm256_setzero_ps(); NV];
            for (j, v) in kv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(k.add(8 * j));
            }
            for r in 0..R {
                let qd = _mm256_broadcast_ss(&*q[r].add(d));
                for j in 0..NV {
                    s[r][j] = _mm256_fmadd_ps(qd, kv[j], s[r][j]);
                }
            }
        }
        for r in 0..R {
            for j in 0..NV {
                _mm256_storeu_ps(
                    scores[r].as_mut_ptr().add(at + 8 * j),
                    _mm256_mul_ps(s[r][j], _mm256_set1_ps(scale)),
                );
            }
        }
    }

    /// Lanes `0..n` of 8 set (n ≥ 8 sets all).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn first_lanes(n: usize) -> __m256 {
        _mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_set1_epi32(n.min(8) as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        ))
    }

    // Each row's result depends only on its own query and keys: the scores are the same
    // fused multiply-adds in the same order whatever `R` is, and a maximum has one exact
    // answer in any order, so this kernel gives the same bits as its scalar-max predecessor.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn update_rows<const HD8: usize, const R: usize>(
        rows: &mut [RowState],
        blk: &BlockF32,
        scale: f32,
    ) {
        let hd = HD8 * 8;
        let sp = blk.slots_padded;
        let q: [*const f32; R] = std::array::from_fn(|r| rows[r].q.as_ptr());
        let mut scores = [[0f32; 8 * MAX_SLOT_VECS]; R];
        // Scores, in chunks of up to MAX_SLOT_VECS × 8 slots.
        for c0 in (0..sp).step_by(8 * MAX_SLOT_VECS) {
            let nv = ((sp - c0) / 8).min(MAX_SLOT_VECS);
            let kt = blk.kt.as_ptr().add(c0);
            let mut j = 0;
            while j + 2 <= nv {
                scores_chunk::<HD8, R, 2>(&q, kt.add(8 * j), sp, scale, &mut scores, 8 * j);
                j += 2;
            }
            if j < nv {
                scores_chunk::<HD8, R, 1>(&q, kt.add(8 * j), sp, scale, &mut scores, 8 * j);
            }
            // Each row's softmax update, its probabilities left in `scores`, then p·V for
            // all rows together.
            let mut n = [0usize; R];
            for (r, row) in rows.iter_mut().enumerate() {
                n[r] = row.n_visible.saturating_sub(c0).min(8 * nv);
                if n[r] > 0 {
                    softmax_update(row, &mut scores[r][..n[r].next_multiple_of(8)], n[r], hd);
                }
            }
            let v = blk.v.as_ptr().add(c0 * hd);
            let p: [*const f32; R] = std::array::from_fn(|r| scores[r].as_ptr());
            let acc: [*mut f32; R] = std::array::from_fn(|r| rows[r].acc.as_mut_ptr());
            let common = if n.contains(&0) {
                0
            } else {
                *n.iter().min().unwrap()
            };
            if R <= 2 {
                pv::<HD8, R, 4>(p, acc, v, hd, 0, common);
            } else {
                pv::<HD8, R, 2>(p, acc, v, hd, 0, common);
            }
            for r in 0..R {
                pv::<HD8, 1, 4>([p[r]], [acc[r]], v, hd, common, n[r]);
            }
        }
    }

    /// Row `row`'s online-softmax step over `n` scores (`sc`, padded to a multiple of 8):
    /// the running maximum and sum move, the accumulated output is rescaled in place, and
    /// `sc` is left holding the probabilities (exactly 0 past `n`).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn softmax_update(row: &mut RowState, sc: &mut [f32], n: usize, hd: usize) {
        let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
        for j8 in (0..n).step_by(8) {
            let x = _mm256_loadu_ps(sc.as_ptr().add(j8));
            mx = _mm256_max_ps(mx, _mm256_blendv_ps(mx, x, first_lanes(n - j8)));
        }
        let m_new = row.m.max(hmax(mx));
        let correction = (*row.m - m_new).exp();
        if correction != 1.0 {
            let c = _mm256_set1_ps(correction);
            for i in (0..hd).step_by(8) {
                let a = row.acc.as_mut_ptr().add(i);
                _mm256_storeu_ps(a, _mm256_mul_ps(_mm256_loadu_ps(a), c));
            }
        }
        let mut psum = _mm256_setzero_ps();
        for j8 in (0..n).step_by(8) {
            let x = _mm256_sub_ps(_mm256_loadu_ps(sc.as_ptr().add(j8)), _mm256_set1_ps(m_new));
            let p = _mm256_and_ps(exp256(x), first_lanes(n - j8));
            psum = _mm256_add_ps(psum, p);
            _mm256_storeu_ps(sc.as_mut_ptr().add(j8), p);
        }
        *row.l = *row.l * correction + hsum(psum);
        *row.m = m_new;
    }

    /// `acc[r] += p[r][j] · v[j]` for slots `j` in `from..to`, in slot order, for `R` rows
    /// at once: each loaded V vector serves every row, and `CH` vectors of the head at a
    /// time keep the `R × CH` accumulators in registers (the whole head of one row, 16
    /// vectors, with the broadcast probability, needed 17 of AVX2's 16 registers and
    /// spilled in the inner loop). Each accumulator sees the same fused multiply-adds in
    /// the same order as one row alone, so the bits do not depend on `R` or `CH`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn pv<const HD8: usize, const R: usize, const CH: usize>(
        p: [*const f32; R],
        acc: [*mut f32; R],
        v: *const f32,
        hd: usize,
        from: usize,
        to: usize,
    ) {
        if from >= to {
            return;
        }
        for i0 in (0..HD8).step_by(CH) {
            let mut a = [[_mm256_setzero_ps(); CH]; R];
            for (ar, &dst) in a.iter_mut().zip(&acc) {
                for (c, x) in ar.iter_mut().enumerate() {
                    *x = _mm256_loadu_ps(dst.add(8 * (i0 + c)));
                }
            }
            for j in from..to {
                let vj = v.add(j * hd + 8 * i0);
                let vv: [__m256; CH] = std::array::from_fn(|c| _mm256_loadu_ps(vj.add(8 * c)));
                for (ar, &pr) in a.iter_mut().zip(&p) {
                    let pj = _mm256_broadcast_ss(&*pr.add(j));
                    for (x, &vc) in ar.iter_mut().zip(&vv) {
                        *x = _mm256_fmadd_ps(pj, vc, *x);
                    }
                }
            }
            for (ar, &dst) in a.iter().zip(&acc) {
                for (c, x) in ar.iter().enumerate() {
                    _mm256_storeu_ps(dst.add(8 * (i0 + c)), *x);
                }
            }
        }
    }

    /// The largest of 8 lanes.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hmax(v: __m256) -> f32 {
        let x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let x = _mm_max_ps(x, _mm_movehl_ps(x, x));
        _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)))
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
        _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)))
    }

    /// `e^x` for x ≤ 0 (Cephes' `expf`: range reduction by ln 2, degree-5 polynomial),
    /// within about 2 ulp; inputs below -87.3 give about 1e-38, never 0.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp256(x: __m256) -> __m256 {
        let x = _mm256_max_ps(
            _mm256_min_ps(x, _mm256_set1_ps(88.376_26)),
            _mm256_set1_ps(-87.336_55),
        );
        let fx = _mm256_floor_ps(_mm256_fmadd_ps(
            x,
            _mm256_set1_ps(std::f32::consts::LOG2_E),
            _mm256_set1_ps(0.5),
        ));
        let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
        let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), x);
        let mut y = _mm256_set1_ps(1.987_569_1e-4);
        for c in [
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            0.166_666_65,
            0.5,
        ] {
            y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
        }
        let y = _mm256_add_ps(
            _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x),
            _mm256_set1_ps(1.0),
        );
        let pow2n = _mm256_slli_epi32(
            _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)),
            23,
        );
        _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n))
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// Rows run together give the same bits as each row run alone, whatever their visible
    /// counts (the joint p·V covers the slots every row sees, each row's tail runs alone),
    /// and a row with nothing visible in a chunk is left as it was.
    #[test]
    fn rows_together_match_each_row_alone_bit_for_bit() {
        if !x86_supported(128) {
            eprintln!("skipped: no AVX2+FMA on this CPU");
            return;
        }
        // Up to ROWS rows; 64 slots is the tile's chunk of four 16-token blocks.
        for (hd, slots, visible) in [
            (128, 16usize, vec![16, 16, 9, 3]),
            (64, 16, vec![16, 1, 16, 16]),
            (128, 72, vec![72, 64, 65, 40]),
            (64, 72, vec![70, 8, 72, 72]),
            (128, 64, vec![64, 64, 49, 64, 17, 64]),
            (64, 60, vec![60, 60, 60, 60, 60]),
        ] {
            let n_rows = visible.len();
            let sp = slots.next_multiple_of(8);
            let kt = values(hd * sp, 1);
            let v = values(slots * hd, 2);
            let blk = BlockF32 {
                kt: &kt,
                v: &v,
                slots_padded: sp,
            };
            let q: Vec<Vec<f32>> = (0..n_rows as u64).map(|r| values(hd, 10 + r)).collect();
            let start = |r: usize| (0.25 * r as f32, 1.5 + r as f32, values(hd, 20 + r as u64));
            let mut alone = Vec::new();
            for r in 0..n_rows {
                let (mut m, mut l, mut acc) = start(r);
                let mut rows = [RowState {
                    q: &q[r],
                    n_visible: visible[r],
                    m: &mut m,
                    l: &mut l,
                    acc: &mut acc,
                }];
                // SAFETY: x86_supported(hd) holds; the slices have the documented sizes.
                unsafe { update_x86(&mut rows, &blk, hd, 0.088) };
                alone.push((m, l, acc));
            }
            let mut states: Vec<_> = (0..n_rows).map(start).collect();
            let mut rows: Vec<RowState> = states
                .iter_mut()
                .zip(&q)
                .zip(visible.iter().copied())
                .map(|(((m, l, acc), q), n)| RowState {
                    q,
                    n_visible: n,
                    m,
                    l,
                    acc,
                })
                .collect();
            // SAFETY: as above.
            unsafe { update_x86(&mut rows, &blk, hd, 0.088) };
            for (r, ((m, l, acc), (m1, l1, acc1))) in states.iter().zip(&alone).enumerate() {
                let what = format!("hd {hd}, {slots} slots, row {r}");
                assert_eq!(m.to_bits(), m1.to_bits(), "{what}: max");
                assert_eq!(l.to_bits(), l1.to_bits(), "{what}: sum");
                let bits = |a: &[f32]| a.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(acc), bits(acc1), "{what}: output");
                assert_ne!(bits(acc), bits(&start(r).2), "{what}: untouched");
            }
        }
    }
}
