//! The inner step of attention: a few query rows against one block of keys and values,
//! updating each row's online softmax (running max `m`, running sum `l`, weighted values).
//!
//! The x86 kernel (AVX2 + FMA) takes K transposed (`kt[d][slot]`, slots padded to a
//! multiple of 8) so that the scores of 8 keys for one query row are 8 lanes of one vector:
//! `s[j] += q[d] · kt[d][j]` needs no horizontal sums, and each loaded `kt` vector serves up
//! to [`ROWS`] query rows. `p · V` keeps the row's whole output (`head_dim` floats) in
//! registers. Each row's arithmetic depends only on that row's query and visible keys, never
//! on which other rows share the call, so batching cannot change a token's result.

/// Query rows processed together (they share every loaded key vector).
pub const ROWS: usize = 4;

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

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// Most slots per block held in registers' worth of scores (larger blocks loop).
    const MAX_SLOT_VECS: usize = 8;

    // The slot-vector index `j` addresses both the score registers and the K row pointer
    // (`kt.add(8 * j)`), so the index form is clearer than zipped iterators.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn update<const HD8: usize>(rows: &mut [RowState], blk: &BlockF32, scale: f32) {
        let hd = HD8 * 8;
        let sp = blk.slots_padded;
        let mut scores = [[0f32; 8 * MAX_SLOT_VECS]; ROWS];
        // Scores, in chunks of up to MAX_SLOT_VECS × 8 slots.
        for c0 in (0..sp).step_by(8 * MAX_SLOT_VECS) {
            let nv = ((sp - c0) / 8).min(MAX_SLOT_VECS);
            let mut s = [[_mm256_setzero_ps(); MAX_SLOT_VECS]; ROWS];
            for d in 0..hd {
                let kt = blk.kt.as_ptr().add(d * sp + c0);
                for (r, row) in rows.iter().enumerate() {
                    let qd = _mm256_set1_ps(*row.q.get_unchecked(d));
                    for j in 0..nv {
                        s[r][j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kt.add(8 * j)), s[r][j]);
                    }
                }
            }
            for r in 0..rows.len() {
                for j in 0..nv {
                    _mm256_storeu_ps(
                        scores[r].as_mut_ptr().add(8 * j),
                        _mm256_mul_ps(s[r][j], _mm256_set1_ps(scale)),
                    );
                }
            }
            // Softmax update and p·V for this chunk of slots.
            for (r, row) in rows.iter_mut().enumerate() {
                let n = row.n_visible.saturating_sub(c0).min(8 * nv);
                if n == 0 {
                    continue;
                }
                let sc = &mut scores[r][..n.next_multiple_of(8)];
                let block_max = sc[..n].iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let m_new = row.m.max(block_max);
                let correction = (*row.m - m_new).exp();
                let mut acc = [_mm256_setzero_ps(); HD8];
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_loadu_ps(row.acc.as_ptr().add(8 * i));
                    if correction != 1.0 {
                        *a = _mm256_mul_ps(*a, _mm256_set1_ps(correction));
                    }
                }
                // p = exp(s - m_new), 8 slots at a time; slots past `n` get exactly 0.
                let mut psum = _mm256_setzero_ps();
                for j8 in (0..n).step_by(8) {
                    let valid = _mm256_cmpgt_epi32(
                        _mm256_set1_epi32((n - j8) as i32),
                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                    );
                    let x =
                        _mm256_sub_ps(_mm256_loadu_ps(sc.as_ptr().add(j8)), _mm256_set1_ps(m_new));
                    let p = _mm256_and_ps(exp256(x), _mm256_castsi256_ps(valid));
                    psum = _mm256_add_ps(psum, p);
                    _mm256_storeu_ps(sc.as_mut_ptr().add(j8), p);
                }
                let sum = hsum(psum);
                for (j, &p) in sc[..n].iter().enumerate() {
                    let v = blk.v.as_ptr().add((c0 + j) * hd);
                    let pv = _mm256_set1_ps(p);
                    for (i, a) in acc.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v.add(8 * i)), *a);
                    }
                }
                for (i, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(row.acc.as_mut_ptr().add(8 * i), *a);
                }
                *row.l = *row.l * correction + sum;
                *row.m = m_new;
            }
        }
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
