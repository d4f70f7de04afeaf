//! The AVX2 prefill tile for Q6K weights (`x86.rs` NOTE 7): per group block, the weight
//! vectors are unpacked four at a time (two of each half), which every token of the tile
//! uses at once, and each token adds its scaled 16-bit pair sums straight into
//! one 32-bit accumulator. The general tile unpacked all eight weight vectors first and
//! kept them live across the tokens with four partial sums per token, which spilled on
//! AVX2's 16 registers. Decode (one token) stays on the general tile, whose weight
//! prefetches were placed for it (NOTE 6).

use super::*;

/// Weight vectors `k`, `k + 1`, `k + 4` and `k + 5` of a Q6K group block (`k` 0 or 2), as
/// `unpack_group_block!` makes them ([`q6k_half`]'s operations for vectors 3 and 7 are spent
/// only when `k` is 2).
#[inline(always)]
unsafe fn unpack(gb: *const u8, k: usize) -> [__m256i; 4] {
    use crate::kernels::pack::Q6K_QS_AT;
    if k == 0 {
        let low6 = _mm256_set1_epi8(0x3f);
        let q = gb.add(Q6K_QS_AT);
        [
            _mm256_and_si256(_mm256_loadu_si256(q as *const __m256i), low6),
            _mm256_and_si256(_mm256_loadu_si256(q.add(32) as *const __m256i), low6),
            _mm256_and_si256(_mm256_loadu_si256(q.add(96) as *const __m256i), low6),
            _mm256_and_si256(_mm256_loadu_si256(q.add(128) as *const __m256i), low6),
        ]
    } else {
        let (v3, lo) = q6k_half!(gb, 0);
        let (v7, hi) = q6k_half!(gb, 1);
        [lo[2], v3, hi[2], v7]
    }
}

/// See [`super::gemm_groups`]; `NT` tokens from `t0`, `lanes` valid rows. The integer sums
/// are those of the general tile (the same pairs of `vpmaddubsw` summed in 16 bits, 2 · 2 ·
/// 63 · 127 < 2^15, each widened by its half's scale), added in another order, so the
/// results keep NOTE 1's bits.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn tile<const FMT: u8, const NT: usize>(
    group: *const u8,
    bpr: usize,
    acts: &Q8Acts,
    t0: usize,
    out: *mut f32,
    out_stride: usize,
    lanes: usize,
) {
    debug_assert_eq!(FMT, Q6K);
    if NT == 1 {
        return super::avx2::tile::<FMT, 1>(group, bpr, acts, t0, out, out_stride, lanes);
    }
    let gbb = crate::kernels::pack::Q6K_GROUP_BLOCK_BYTES;
    let low16 = _mm256_set1_epi32(0xffff);
    let qs = acts.kqs.as_ptr();
    let mut acc = [_mm256_setzero_ps(); NT];
    let mut kacc = [_mm256_setzero_si256(); NT];
    let mut d = _mm256_setzero_ps();
    for b in 0..bpr {
        let gb = group.add(b * gbb);
        if b % 8 == 0 {
            d = q6k_super_d!(gb);
        }
        // Each half's signed scale in both 16-bit halves of its row's lane, for `vpmaddwd`.
        let sc16 = [0, 1].map(|half| {
            let s = q6k_block_sc!(gb, half);
            _mm256_or_si256(_mm256_and_si256(s, low16), _mm256_slli_epi32(s, 16))
        });
        for k in [0, 2] {
            let [w0, w1, w4, w5] = unpack(gb, k);
            for (j, ka) in kacc.iter_mut().enumerate() {
                let a = qs.add(((t0 + j) * bpr + b) * QK);
                let at = |e: usize| _mm256_set1_epi32((a.add(e) as *const i32).read_unaligned());
                let lo = _mm256_add_epi16(
                    _mm256_maddubs_epi16(w0, at(4 * k)),
                    _mm256_maddubs_epi16(w1, at(4 * k + 4)),
                );
                let hi = _mm256_add_epi16(
                    _mm256_maddubs_epi16(w4, at(16 + 4 * k)),
                    _mm256_maddubs_epi16(w5, at(16 + 4 * k + 4)),
                );
                let scaled = _mm256_add_epi32(
                    _mm256_madd_epi16(lo, sc16[0]),
                    _mm256_madd_epi16(hi, sc16[1]),
                );
                *ka = _mm256_add_epi32(*ka, scaled);
            }
        }
        if b % 8 == 7 {
            let sb0 = b - 7;
            q6k_super_update!(group.add(sb0 * gbb), sb0, d, acts, bpr, t0, kacc, acc);
        }
    }
    store_tile(&acc, out.add(t0 * out_stride), out_stride, lanes);
}
