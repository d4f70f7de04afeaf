//! The AMX kernel for the K-quants (Q4K, Q6K) over the K representation of the
//! activations (`q8k`): one activation scale per 256 elements lets a whole super-block be
//! summed in the tiles.
//!
//! NOTE 1: each sub-block's scale is folded into the weight bytes, and the product is
//! stored as two unsigned byte tiles, as `tdpbsud` wants: its low byte and its high byte.
//! Q4K stores `q·sc < 1,024` (6-bit `sc`); Q6K stores `q·sc + 8,192` (signed 8-bit `sc`,
//! 6-bit `q`: 128..16,256). Two accumulators then sum a super-block's 256 elements in four
//! full-depth (64-byte) tile steps each, and `lo_sum + 256·hi_sum` is `Σ_j sc_j · Σ q·a`
//! (Q6K: plus `8,192·Σ a`). The rest of the reference's integer sum comes from the
//! activations' block sums, a few `vpdpwssd` a token: Q4K's mins `Σ_j m_j · Σ a` over its
//! eight sub-blocks of 32, and Q6K's offsets `32·Σ_j (sc_j + 256) · Σ a` over its sixteen
//! sub-blocks of 16 (`q − 32` in the file, and the 8,192 above). So the float update, the
//! bottleneck of the per-block kernel (`amx.rs`, NOTE 1), runs once a super-block instead
//! of eight (sixteen) times, and a product tile is stored twice a super-block.
//!
//! NOTE 2: two 16-token tiles share each weight tile (the eight tile registers hold two
//! activation tiles, a low and a high weight tile, and four accumulators), and the tile
//! products of super-block s are issued before super-block s-1's float updates, so the
//! tile unit and the vector units overlap. Bits are the reference's (`q8k::dot_q4k`,
//! `dot_q6k`): integer sums are exact in any order, and the float steps are the
//! reference's, unfused.

use std::arch::asm;
use std::arch::x86_64::*;

use super::amx::{Line, TILE_TOKENS};
use super::pack::{Packed, GROUP_ROWS, Q4K_M_AT, Q4K_SC_AT, Q6K_SC_AT};
use super::q8::Q8Acts;
use super::q8k::QK_K;
use super::x86::{
    q4k_super_scales, q6k_super_d, unpack_group_block, Q4K, Q4_0, Q4_1, Q5_0, Q6K, Q6S,
};

/// One super-block's record: four 64-element chunks, each a low and a high weight tile (16
/// rows of 64 bytes), then the pair's 16 `d` and (Q4K) 16 `−dmin` as f32, then the integer
/// pairs of NOTE 1 (16 lanes of two i16): Q4K's four `(m_2p, m_2p+1)`, Q6K's eight
/// `(sc_2p + 256, sc_2p+1 + 256)`.
pub(super) const SUPER_RECORD_BYTES: usize = 8 * 1024 + 64 + 64 + 8 * 64;
const SCALES_AT: usize = 8 * 1024;
const PAIRS_AT: usize = SCALES_AT + 128;

/// Loads this thread's tile configuration: all eight tiles 16 rows of 64 bytes (tmm0–3
/// the accumulators, tmm4/5 the two token tiles' activations, tmm6/7 the weight tiles).
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn configure() {
    let mut cfg = Line([0; 64]);
    cfg.0[0] = 1;
    for i in 0..8 {
        cfg.0[16 + 2 * i..18 + 2 * i].copy_from_slice(&64u16.to_le_bytes());
        cfg.0[48 + i] = 16;
    }
    asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
}

/// Builds group pair `(g, has_second)`'s records into `rec`, then computes its 16 rows for
/// tokens `c0..c1` (a multiple of 16), two token tiles at a time.
///
/// # Safety
/// As for `amx::gemm_groups`, with `p` in `FMT` (Q4K or Q6K), `acts` holding the K
/// representation, the configuration of [`configure`] loaded, and `rec` valid for a record
/// per super-block.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn pair_tiles<const FMT: u8>(
    p: &Packed,
    (g, has_second): (usize, bool),
    acts: &Q8Acts,
    (c0, c1): (usize, usize),
    rec: *mut u8,
    out: *mut f32,
    out_stride: usize,
) {
    let nsb = p.blocks_per_row / 8;
    let first = p.group(g).as_ptr();
    let second = has_second.then(|| p.group(g + 1).as_ptr());
    let gbb = p.group_block_bytes();
    for s in 0..nsb {
        let r = rec.add(s * SUPER_RECORD_BYTES);
        build_tiles::<FMT>((first, second), s, gbb, r);
        build_scales::<FMT>((first, second), s, gbb, r);
    }
    let mask = super::amx::store_mask(p, g, has_second);
    let mut t = c0;
    while t < c1 {
        let two = t + 2 * TILE_TOKENS <= c1;
        let acc = if two {
            tile_products::<FMT, true>(nsb, acts, t, rec)
        } else {
            tile_products::<FMT, false>(nsb, acts, t, rec)
        };
        let n = if two { 2 * TILE_TOKENS } else { TILE_TOKENS };
        for (m, a) in acc[..n].iter().enumerate() {
            _mm512_mask_storeu_ps(out.add((t + m) * out_stride + g * GROUP_ROWS), mask, *a);
        }
        t += n;
    }
}

/// Super-block `s`'s weight tiles (see [`SUPER_RECORD_BYTES`]): row r of chunk c's tiles
/// is elements 4r..4r+4 of the chunk for group one's 8 rows, then group two's (zeros
/// without a second group), each the low (low tile) or high byte (high tile) of its
/// product with the scale (NOTE 1).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn build_tiles<const FMT: u8>(
    groups: (*const u8, Option<*const u8>),
    s: usize,
    gbb: usize,
    rec: *mut u8,
) {
    let (low8, high8) = (_mm256_set1_epi16(0x00ff), _mm256_set1_epi16(-256));
    let bias = _mm256_set1_epi16(if FMT == Q6K { 8192 } else { 0 });
    // Each row's scale (Q6K: of elements 0..16 or 16..32) in both 16-bit halves of its
    // 4-byte lane.
    let row_scales = |gb: *const u8, half: usize| {
        let at = if FMT == Q6K {
            Q6K_SC_AT + 8 * half
        } else {
            Q4K_SC_AT
        };
        let bytes = _mm_loadl_epi64(gb.add(at) as *const __m128i);
        let sc = if FMT == Q6K {
            _mm256_and_si256(_mm256_cvtepi8_epi32(bytes), _mm256_set1_epi32(0xffff))
        } else {
            _mm256_cvtepu8_epi32(bytes)
        };
        _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16))
    };
    // The low and high bytes of each quant's product with its row's scale (plus the bias),
    // from the even and odd bytes' 16-bit products.
    let times = |v: __m256i, sc: __m256i| {
        let even = _mm256_add_epi16(_mm256_mullo_epi16(_mm256_and_si256(v, low8), sc), bias);
        let odd = _mm256_add_epi16(_mm256_mullo_epi16(_mm256_srli_epi16(v, 8), sc), bias);
        (
            _mm256_or_si256(_mm256_and_si256(even, low8), _mm256_slli_epi16(odd, 8)),
            _mm256_or_si256(_mm256_srli_epi16(even, 8), _mm256_and_si256(odd, high8)),
        )
    };
    for c in 0..4 {
        for half in 0..2 {
            let b = 8 * s + 2 * c + half;
            for (side, group) in [(0, Some(groups.0)), (32, groups.1)] {
                let (v, sc) = match group {
                    Some(gp) => {
                        let gb = gp.add(b * gbb);
                        (
                            unpack_group_block!(FMT, gb),
                            [row_scales(gb, 0), row_scales(gb, 1)],
                        )
                    }
                    None => ([_mm256_setzero_si256(); 8], [_mm256_setzero_si256(); 2]),
                };
                for (k, vk) in v.iter().enumerate() {
                    let row = rec.add(c * 2048 + (8 * half + k) * 64 + side);
                    // A zero row of a missing group stays zero: no bias there.
                    let (lo, hi) = if group.is_some() {
                        times(*vk, sc[k / 4])
                    } else {
                        (*vk, *vk)
                    };
                    _mm256_store_si256(row as *mut __m256i, lo);
                    _mm256_store_si256(row.add(1024) as *mut __m256i, hi);
                }
            }
        }
    }
}

/// Super-block `s`'s scales and integer pairs (see [`SUPER_RECORD_BYTES`]).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn build_scales<const FMT: u8>(
    groups: (*const u8, Option<*const u8>),
    s: usize,
    gbb: usize,
    rec: *mut u8,
) {
    for (side, group) in [(0, Some(groups.0)), (32, groups.1)] {
        let Some(gp) = group else {
            for at in (SCALES_AT..SUPER_RECORD_BYTES).step_by(64) {
                _mm256_store_si256(rec.add(at + side) as *mut __m256i, _mm256_setzero_si256());
            }
            continue;
        };
        let first = gp.add(8 * s * gbb);
        if FMT == Q6K {
            _mm256_store_ps(rec.add(SCALES_AT + side) as *mut f32, q6k_super_d!(first));
            let sc = |j: usize, half: usize| {
                let at = first.add(j * gbb + Q6K_SC_AT + 8 * half);
                let v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(at as *const __m128i));
                _mm256_add_epi32(v, _mm256_set1_epi32(256))
            };
            for pair in 0..8 {
                let both = _mm256_or_si256(sc(pair, 0), _mm256_slli_epi32(sc(pair, 1), 16));
                _mm256_store_si256(rec.add(PAIRS_AT + 64 * pair + side) as *mut __m256i, both);
            }
            continue;
        }
        let (d, nd) = q4k_super_scales!(first);
        _mm256_store_ps(rec.add(SCALES_AT + side) as *mut f32, d);
        _mm256_store_ps(rec.add(SCALES_AT + 64 + side) as *mut f32, nd);
        let m = |j: usize| {
            let at = first.add(j * gbb + Q4K_M_AT);
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(at as *const __m128i))
        };
        for pair in 0..4 {
            let both = _mm256_or_si256(m(2 * pair), _mm256_slli_epi32(m(2 * pair + 1), 16));
            _mm256_store_si256(rec.add(PAIRS_AT + 64 * pair + side) as *mut __m256i, both);
        }
    }
}

/// The pair's 16 rows for tokens `t..t + 16` (and `t + 16..t + 32` when `TWO`), as one
/// vector per token (NOTE 1, NOTE 2).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile_products<const FMT: u8, const TWO: bool>(
    nsb: usize,
    acts: &Q8Acts,
    t: usize,
    rec: *const u8,
) -> [__m512; 2 * TILE_TOKENS] {
    let row = nsb * QK_K;
    let qs = acts.kqs.as_ptr();
    // Uninitialised: every line is written by `tilestored` before it is read, and zeroing
    // 8 KiB a call was 8 % of a 512-token prefill.
    let mut products = std::mem::MaybeUninit::<[Line; 2 * 4 * TILE_TOKENS]>::uninit();
    let products = products.as_mut_ptr() as *mut Line;
    let mut acc = [_mm512_setzero_ps(); 2 * TILE_TOKENS];
    for s in 0..=nsb {
        if s < nsb {
            let r = rec.add(s * SUPER_RECORD_BYTES);
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            );
            for c in 0..4 {
                let a1 = qs.add(t * row + s * QK_K + c * 64);
                let blo = r.add(c * 2048);
                // SAFETY (both arms): the tiles were configured by `configure`; `a1` (and
                // `a2`) read 16 rows of 64 bytes at the token stride inside `acts.kqs`,
                // `blo` and `blo + 1024` a weight tile each of the record.
                if TWO {
                    asm!("tileloadd tmm4, [{a1} + {sa}*1]", "tileloadd tmm5, [{a2} + {sa}*1]",
                         "tileloadd tmm6, [{bl} + {sw}*1]", "tileloadd tmm7, [{bh} + {sw}*1]",
                         "tdpbsud tmm0, tmm4, tmm6", "tdpbsud tmm1, tmm4, tmm7",
                         "tdpbsud tmm2, tmm5, tmm6", "tdpbsud tmm3, tmm5, tmm7",
                         a1 = in(reg) a1, a2 = in(reg) a1.add(TILE_TOKENS * row), sa = in(reg) row,
                         bl = in(reg) blo, bh = in(reg) blo.add(1024), sw = in(reg) 64usize,
                         options(nostack));
                } else {
                    asm!("tileloadd tmm4, [{a1} + {sa}*1]",
                         "tileloadd tmm6, [{bl} + {sw}*1]", "tileloadd tmm7, [{bh} + {sw}*1]",
                         "tdpbsud tmm0, tmm4, tmm6", "tdpbsud tmm1, tmm4, tmm7",
                         a1 = in(reg) a1, sa = in(reg) row,
                         bl = in(reg) blo, bh = in(reg) blo.add(1024), sw = in(reg) 64usize,
                         options(nostack));
                }
            }
            let dst = products.add((s % 2) * 4 * TILE_TOKENS) as *mut u8;
            // SAFETY: each store writes 16 × 64 bytes inside `products`.
            asm!("tilestored [{c} + {sc}*1], tmm0", "tilestored [{c1} + {sc}*1], tmm1",
                 c = in(reg) dst, c1 = in(reg) dst.add(1024), sc = in(reg) 64usize,
                 options(nostack));
            if TWO {
                asm!("tilestored [{c} + {sc}*1], tmm2", "tilestored [{c1} + {sc}*1], tmm3",
                     c = in(reg) dst.add(2048), c1 = in(reg) dst.add(3072), sc = in(reg) 64usize,
                     options(nostack));
            }
        }
        if s > 0 {
            let src = products.add(((s - 1) % 2) * 4 * TILE_TOKENS) as *const u8;
            update::<FMT>(&mut acc, TWO, acts, (t, s - 1, nsb), rec, src);
        }
    }
    acc
}

/// Super-block `s`'s float update for tokens `t..` from its stored products `src` (NOTE 1):
/// Q4K `acc += (d·d_a)·isum + (−dmin·d_a)·imin`, Q6K `acc += (d·d_a)·isum`, the
/// reference's steps.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn update<const FMT: u8>(
    acc: &mut [__m512; 2 * TILE_TOKENS],
    two: bool,
    acts: &Q8Acts,
    (t, s, nsb): (usize, usize, usize),
    rec: *const u8,
    src: *const u8,
) {
    let r = rec.add(s * SUPER_RECORD_BYTES);
    let d = _mm512_load_ps(r.add(SCALES_AT) as *const f32);
    let nd = _mm512_load_ps(r.add(SCALES_AT + 64) as *const f32);
    let n_pairs = if FMT == Q6K { 8 } else { 4 };
    // Read from the record (L1) by each token's `vpdpwssd`, not held in registers: the 32
    // accumulators already fill them.
    let pair = |i: usize| _mm512_load_si512(r.add(PAIRS_AT + 64 * i) as *const __m512i);
    let n = if two { 2 * TILE_TOKENS } else { TILE_TOKENS };
    for (m, a) in acc[..n].iter_mut().enumerate() {
        let at = src.add((m / TILE_TOKENS) * 2048 + (m % TILE_TOKENS) * 64);
        let lo = _mm512_load_si512(at as *const __m512i);
        let hi = _mm512_load_si512(at.add(1024) as *const __m512i);
        let isum = _mm512_add_epi32(lo, _mm512_slli_epi32::<8>(hi));
        let tok = t + m;
        // Q4K: the 32-element sums against the mins; Q6K: the 16-element sums against the
        // biased scales.
        let bs = if FMT == Q6K {
            acts.kbsum16.as_ptr().add((tok * nsb + s) * 16)
        } else {
            acts.kbsum.as_ptr().add((tok * nsb + s) * 8)
        } as *const i32;
        let mut ints = _mm512_madd_epi16(pair(0), _mm512_set1_epi32(bs.read_unaligned()));
        for i in 1..n_pairs {
            ints =
                _mm512_dpwssd_epi32(ints, pair(i), _mm512_set1_epi32(bs.add(i).read_unaligned()));
        }
        let da = _mm512_set1_ps(*acts.kd.get_unchecked(tok * nsb + s));
        if FMT == Q6K {
            let isum = _mm512_sub_epi32(isum, _mm512_slli_epi32::<5>(ints));
            *a = _mm512_add_ps(
                *a,
                _mm512_mul_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(isum)),
            );
            continue;
        }
        let x = _mm512_mul_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(isum));
        let y = _mm512_mul_ps(_mm512_mul_ps(nd, da), _mm512_cvtepi32_ps(ints));
        *a = _mm512_add_ps(*a, _mm512_add_ps(x, y));
    }
}
