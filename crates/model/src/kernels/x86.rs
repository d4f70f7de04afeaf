//! x86-64 SIMD integer matmul over [`Packed`] weights: AVX2 (`vpmaddubsw` + `vpmaddwd`, like
//! ggml) and AVX-512 VNNI on 256-bit vectors (`vpdpbusd`; on Zen 4 a 512-bit op costs two
//! 256-bit ones, so wider vectors would only save instructions, while the EVEX encoding
//! already gives us 32 registers). Chosen at run time by [`detect`].
//!
//! NOTE 1: bit-exact with the scalar reference (`q8::dot_*`). Each 32-bit lane is one weight
//! row; per block it gets the exact integer dot product (integer sums do not depend on
//! order), then `acc += (d_w * d_a) * isum` (+ `m_w * s_a` for Q4_1) with separate multiplies
//! and adds in the reference's order, never FMA. So a token's result does not depend on
//! which other tokens share the call, which ISA ran, or how the work was split. Q6S has two
//! scales a block (one per 16 elements), so its lanes get two integer sums, `ilo` over
//! elements 0..16 and `ihi` over 16..32, and two updates in this order: `acc += (d0 * d_a) *
//! ilo`, then `acc += (d1 * d_a) * ihi`, as `q8::dot_q6s` does.
//!
//! NOTE 2: `vpdpbusd` multiplies unsigned by signed bytes, so signed weights are stored
//! offset (Q8_0 as `q + 128`, Q4_0 as `q + 8`, Q5_0 as `q + 16`, Q6S as `q + 32`) and
//! `offset × Σ a` is subtracted from the block's integer sum (`Q8Acts::sum`; for Q6S from
//! each half's sum, with `Q8Acts::sum_lo` the first half's `Σ a`). `vpmaddubsw` saturates
//! its 16-bit pair sums, which only `(q + 128) · a` could reach (Q6S's weights are below 64,
//! so `2 · 63 · 127` fits): AVX2 runs Q8_0 with the sign trick instead (`|q| · sign(a, q)`).
//!
//! NOTE 3: on AVX2 the multiply port is the prefill bottleneck (Zen 2 issues one
//! `vpmaddubsw` or `vpmaddwd` a cycle), and each 4-byte dot product cost one of each. Their
//! 16-bit pair sums are exact and small for narrow weights, so several are added in 16 bits
//! (`vpaddw`, another port) before one `vpmaddwd` widens them: eight for 4-bit weights
//! (8 · 2 · 15 · 128 < 2^15), four for Q5_0 (4 · 2 · 31 · 128 < 2^15), two for Q6S
//! (2 · 2 · 63 · 128 < 2^15). Integer sums are exact in any order, so the results keep
//! NOTE 1's bits.
//!
//! NOTE 4: AVX2 has 16 vector registers. The general tile keeps a block's 8 unpacked weight
//! vectors live across its tokens, and with the tokens' accumulators it spilled to the stack
//! in its inner loop; 4-bit weights instead unpack one 32-byte load (two weight vectors) at
//! a time and give every token its 16-bit sum (`avx2_q4`), so nothing spills.
//!
//! NOTE 5: the K-quants (Q4K, Q6K) take the activations' K representation (`q8k`: one
//! scale per 256 elements, llama.cpp's Q8_K), so a super-block's sub-block scales apply in
//! integers: each block's integer sums are multiplied by the rows' scales (`vpmulld` on
//! VNNI; on AVX2 the `vpmaddwd` that widens the 16-bit sums takes the scales instead of
//! ones, at no cost) into one accumulator per token, and Q4K's mins and Q6K's `q − 32`
//! offsets come from the activations' 32- and 16-element sums, a few `vpmaddwd` where the
//! super-block's one float update runs. Before, each 32-element block (each 16 for Q6S)
//! had its own float update, six vector operations per 8 rows and token. The references
//! are `q8k::dot_q4k` and `q8k::dot_q6k`, whose integer sums and float steps these are.
//!
//! NOTE 6: a decode tile's weight prefetches for the block ahead are issued at three points of
//! each block's work (its first line before the unpacking, its second after it, the rest after
//! the block's dot products and scale update) instead of all at once before the block's own
//! loads. The burst of up to ten `prefetcht2`/`prefetcht0` in front of the loads made those
//! loads wait; spread out, Qwen2.5-Coder-1.5B's decode went from 14.7–14.9 to 15.4–16.1 tok/s
//! at one thread and from 27.0–27.1 to 27.7–28.2 at two (`decode_bench`, alternating builds;
//! docs/results/benchmarks-history.md, 2026-12-06). Other placements, alternating in one run
//! (median tok/s at one thread, against 15.4–16.0 for this one): all after the block's work, as
//! before; the far ones in a burst with only the near ones spread, 13.6; the far ones alone,
//! spread, 13.6; the near ones in a burst with the far ones spread, 14.4; the near ones a part
//! behind the far ones, 15.1–15.6.
//!
//! NOTE 7: what bounds the AVX2 prefill tiles, measured on an AMD EPYC Zen 3 at 3.2 GHz with
//! independent chains of one instruction or a mix (`examples/pipe_mix.rs`; BENCHMARKS.md,
//! 2026-12-07): `vpmaddubsw` and `vpmaddwd` issue two a cycle and `vpaddw` four, but a
//! one-to-one mix of `vpmaddubsw` and `vpaddw` runs at three operations a cycle, and a
//! broadcast from memory takes no vector pipe: the tiles' chain (product, 16-bit sum) ran at
//! 3.07 operations a cycle fed by `vpbroadcastd` loads and 3.22 fed by registers. A tile needs
//! about one `vpaddw` per `vpmaddubsw` (eight products summed in 16 bits, NOTE 3), so the
//! operation count, not the loads, sets its speed: the Q4K tile does about 21 vector operations
//! a token and block and runs at 2.5 a cycle with its activations in L1 (about 200 GOPS, 48 %
//! of the `vpmaddubsw` peak), and six or eight tokens a tile (less unpacking a token) were no
//! faster. The Q6K prefill tile (`avx2_q6k`) unpacks four weight vectors at a time and adds
//! each token's scaled sums into one 32-bit accumulator, about 27 operations where the general
//! tile took 33 with spills (before Q6K's six-vector layout). On the Zen 4 host (AVX-512
//! hidden, 2.84 GHz) the one-to-one mix of `vpmaddubsw` and `vpaddw` issues four operations a
//! cycle, and the chain 3.22 fed by registers and 3.19 by broadcasts (BENCHMARKS.md, "what
//! bounds one-thread decode").
//!
//! NOTE 8: decode (one token) runs the prefill tiles with one token (`avx2_q4` for Q4K, the
//! general tile for Q6K). On the Zen 4 host, decode-only Q4K tiles ran faster from cache (3–4 %
//! with a super-block unrolled and the prefetch plan a constant, 10 % over two row groups
//! sharing each activation broadcast), but neither raised decode's share of the DRAM bound
//! (79–82 % at one thread either way), so neither was kept. Two row groups a call read two
//! streams a group apart: their prefetches must aim at the next pair's lines, or each group's
//! land 8 KiB ahead in the other's rows and decode fell to 48 % (BENCHMARKS.md, "what bounds
//! one-thread decode").

use std::arch::x86_64::*;
use std::sync::OnceLock;

use pk_gguf::GgmlType;

use super::pack::{Packed, GROUP_ROWS};
use super::q8::{Q8Acts, QK};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Avx2,
    Avx512Vnni,
    /// AVX-512 VNNI with the AMX tile kernel for batches of 16 tokens or more (`amx`).
    Amx,
}

/// The best instruction set this CPU runs, or `None` without AVX2/FMA/F16C; `PK_ISA=avx2`
/// or `PK_ISA=avx512-vnni` asks for a narrower one for side-by-side measurements (a value
/// this CPU cannot run is refused by name). `avx512-vnni` narrows the integer matmul
/// kernels only (no AMX); `avx2` narrows every kernel ([`has_avx512`]).
pub fn detect() -> Option<Isa> {
    static ISA: OnceLock<Option<Isa>> = OnceLock::new();
    *ISA.get_or_init(|| isa_choice().unwrap_or_else(|e| panic!("{e}")))
}

/// [`detect`]'s choice, or the error naming a `PK_ISA` this CPU cannot run.
fn isa_choice() -> Result<Option<Isa>, String> {
    let avx2 = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    let vnni = is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512bw");
    let best = match (avx2, vnni) {
        (true, true) if super::amx::available() => Some(Isa::Amx),
        (true, true) => Some(Isa::Avx512Vnni),
        (true, false) => Some(Isa::Avx2),
        _ => None,
    };
    // `PK_ISA=avx2` (or `avx512-vnni`) runs a narrower kernel than the CPU's best, so
    // that one host can measure the AVX2 hosts' kernel side by side.
    match std::env::var("PK_ISA").as_deref() {
        Err(_) => Ok(best),
        Ok("avx2") if best.is_some() => Ok(Some(Isa::Avx2)),
        Ok("avx512-vnni") if vnni && avx2 => Ok(Some(Isa::Avx512Vnni)),
        Ok(other) => Err(format!(
            "PK_ISA={other:?} is not one this CPU runs (avx2, avx512-vnni)"
        )),
    }
}

/// The switches of this module as its kernels read them (see
/// [`super::check_switches`]).
pub(super) fn check_switches() -> Result<(), String> {
    isa_choice()?;
    pass_act_bytes_choice()?;
    prefetch_plan_choice()?;
    Ok(())
}

/// Whether AVX-512 kernels (activation quantisers, attention, SwiGLU and GeGLU gates, KVzip
/// scores) run: the CPU has AVX-512 F/BW/VL and `PK_ISA=avx2` does not ask every kernel to
/// run as on an AVX2-only host, so that such a host's prefill and decode can be measured
/// whole beside llama.cpp built for AVX2 (`scripts/llama_bench_side_by_side.sh`).
pub fn has_avx512() -> bool {
    static YES: OnceLock<bool> = OnceLock::new();
    *YES.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && std::env::var("PK_ISA").as_deref() != Ok("avx2")
    })
}

/// [`Q8Acts::quantize_scalar`] with 16 lanes at a time, bit-exact: the block maximum of
/// `|x|` does not depend on order; `x * id` is the same single rounding; half-away-from-zero
/// rounding is done as the scalar code does it (truncate, then step by the exact remainder);
/// integer sums are exact; the f16 roundings of `d` and `s` use the same scalar conversion.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL ([`has_avx512`]); `x.len()` is a multiple of 32 and
/// `d`, `s`, `sum`, `sum_lo` hold `x.len() / 32` entries, `qs` `x.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub unsafe fn quantize_avx512(
    x: &[f32],
    d: &mut [f32],
    s: &mut [f32],
    sum: &mut [i32],
    sum_lo: &mut [i32],
    qs: &mut [i8],
) {
    let n_blocks = x.len() / QK;
    assert!(
        d.len() >= n_blocks
            && s.len() >= n_blocks
            && sum.len() >= n_blocks
            && sum_lo.len() >= n_blocks
            && qs.len() >= x.len()
    );
    let (half, mhalf, one) = (
        _mm512_set1_ps(0.5),
        _mm512_set1_ps(-0.5),
        _mm512_set1_epi32(1),
    );
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
                let r =
                    _mm512_mask_add_epi32(r, _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, half), r, one);
                _mm512_mask_sub_epi32(r, _mm512_cmp_ps_mask::<_CMP_LE_OQ>(frac, mhalf), r, one)
            }};
        }
        let (r0, r1) = (round!(v0), round!(v1));
        let q = qs.as_mut_ptr().add(b * QK);
        _mm_storeu_si128(q as *mut __m128i, _mm512_cvtepi32_epi8(r0));
        _mm_storeu_si128(q.add(16) as *mut __m128i, _mm512_cvtepi32_epi8(r1));
        let (slo, shi) = (_mm512_reduce_add_epi32(r0), _mm512_reduce_add_epi32(r1));
        let sb = slo + shi;
        d[b] = half::f16::from_f32(db).to_f32();
        s[b] = half::f16::from_f32(db * sb as f32).to_f32();
        sum[b] = sb;
        sum_lo[b] = slo;
    }
}

/// [`Q8Acts::quantize_scalar`] with 8 lanes at a time, bit-exact as [`quantize_avx512`] is
/// (the same steps on 256-bit vectors): on AVX2 hosts the scalar quantiser was about 3 % of
/// a 512-token prefill.
///
/// # Safety
/// The CPU must have AVX2 ([`detect`] is `Some`); the buffers are sized as for
/// [`quantize_avx512`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_avx2(
    x: &[f32],
    d: &mut [f32],
    s: &mut [f32],
    sum: &mut [i32],
    sum_lo: &mut [i32],
    qs: &mut [i8],
) {
    let n_blocks = x.len() / QK;
    debug_assert!(d.len() >= n_blocks && qs.len() >= x.len());
    let (sign, half, mhalf) = (
        _mm256_set1_ps(-0.0),
        _mm256_set1_ps(0.5),
        _mm256_set1_ps(-0.5),
    );
    let hsum = |v: __m256i| {
        let v = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b01_00_11_10>(v));
        let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b10_11_00_01>(v));
        _mm_cvtsi128_si32(v)
    };
    for b in 0..n_blocks {
        let p = x.as_ptr().add(b * QK);
        let v = [0, 8, 16, 24].map(|i| _mm256_loadu_ps(p.add(i)));
        let a = v.map(|v| _mm256_andnot_ps(sign, v));
        let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)));
        let db = amax / 127.0;
        let id = _mm256_set1_ps(if db != 0.0 { 1.0 / db } else { 0.0 });
        // Half away from zero as the scalar code does it: truncate, then step by the exact
        // remainder (a compare mask is -1 where it holds).
        let r = v.map(|v| {
            let y = _mm256_mul_ps(v, id);
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
            let frac = _mm256_sub_ps(y, t);
            let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half));
            let down = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(frac, mhalf));
            _mm256_add_epi32(_mm256_sub_epi32(_mm256_cvttps_epi32(t), up), down)
        });
        // |r| <= 127, so the saturating packs keep every value; they interleave 128-bit
        // lanes, which the permutation undoes.
        let packed = _mm256_packs_epi16(
            _mm256_packs_epi32(r[0], r[1]),
            _mm256_packs_epi32(r[2], r[3]),
        );
        let ordered =
            _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(qs.as_mut_ptr().add(b * QK) as *mut __m256i, ordered);
        let slo = hsum(_mm256_add_epi32(r[0], r[1]));
        let sb = slo + hsum(_mm256_add_epi32(r[2], r[3]));
        d[b] = half::f16::from_f32(db).to_f32();
        s[b] = half::f16::from_f32(db * sb as f32).to_f32();
        sum[b] = sb;
        sum_lo[b] = slo;
    }
}

pub(super) const Q4_0: u8 = 0;
pub(super) const Q4_1: u8 = 1;
pub(super) const Q8_0: u8 = 2;
pub(super) const Q5_0: u8 = 3;
pub(super) const Q6S: u8 = 4;
pub(super) const Q4K: u8 = 5;
pub(super) const Q6K: u8 = 6;

/// Tokens per register tile: one group's 8 unpacked weight vectors are reused this often.
/// The VNNI module has 32 vector registers, but 6 and 8 tokens were slower there (`gemm_peak`
/// with `PK_AMX=0` on the AMX host, all shapes, one thread: 168 GOPS per core at 4, 153–157
/// at 6, 141 at 8).
const TILE_TOKENS: usize = 4;
/// The same for `avx2_q4`, whose tokens share each unpacked pair of weight vectors.
const Q4_TILE_TOKENS: usize = 4;
/// The same for `avx2_q6k`: six tokens share each unpacked weight vector (its unpacking
/// is about a quarter of the tile's operations at four); eight spilled and were slower
/// (`gemm_peak`, Q6_K at one thread, Zen 3: 134–136 / 126–134 GOPS at 4, 135–140 / 116–133
/// at 6, 120–121 / 107–118 at 8).
const Q6K_TILE_TOKENS: usize = 6;

/// The activation bytes a prefill pass over the row groups reads: [`gemm_groups`] runs its
/// groups over this many tokens at a time, so that they stay in L2 (and mostly L1) while
/// every group reuses them, instead of streaming all of a 512-token batch from L3 for
/// each group of 8 rows. On the AMD EPYC Zen 3 host, `gemm_peak` at one thread, three
/// rounds alternating: Q4_K 175–186 GOPS → 190–198 (q/o, k/v) and 159–184 → 181–196
/// (gate/up), Q6_K 122–128 → 124–132; two threads unchanged to slightly faster
/// (BENCHMARKS.md, 2026-12-07). 32 KiB to 96 KiB measured alike.
const PASS_ACT_BYTES: usize = 64 * 1024;
/// The fewest tokens a pass takes whatever the row width: each pass reads the groups'
/// weights again, and at 32 tokens they are reused 32 times per read (Qwen2.5-1.5B's
/// `ffn_down`, 8,960 wide, would otherwise get passes of 4 tokens, its 7.7 MB of weights
/// read 128 times for a 512-token batch).
const PASS_MIN_TOKENS: usize = 32;

/// [`PASS_ACT_BYTES`], or `PK_GEMM_PASS_BYTES` for side-by-side measurements without a
/// rebuild (`0`: one pass over all the tokens, as before passes; anything but a byte count
/// is refused by name).
fn pass_act_bytes() -> usize {
    static BYTES: OnceLock<usize> = OnceLock::new();
    *BYTES.get_or_init(|| pass_act_bytes_choice().unwrap_or_else(|e| panic!("{e}")))
}

fn pass_act_bytes_choice() -> Result<usize, String> {
    match std::env::var("PK_GEMM_PASS_BYTES") {
        Err(_) => Ok(PASS_ACT_BYTES),
        Ok(v) => match v.parse::<usize>() {
            Ok(0) => Ok(usize::MAX / 2),
            Ok(bytes) => Ok(bytes),
            Err(_) => Err(format!("PK_GEMM_PASS_BYTES={v:?} is not a byte count")),
        },
    }
}

/// Tokens per pass of [`gemm_groups`] over rows of `bpr` blocks, a multiple of `nt` (the
/// tile's tokens) so that only the last pass has a tail.
pub(super) fn pass_tokens(bpr: usize, nt: usize) -> usize {
    let by_bytes = pass_act_bytes() / (bpr * QK).max(1);
    (by_bytes.max(PASS_MIN_TOKENS) / nt * nt).max(nt)
}

/// Computes rows `8g..8g+8` (clipped to `p.rows`) of every row group `g` in
/// `groups.0..groups.1` for tokens `t0..t1` of `acts`, writing `out[t * out_stride + row]`,
/// in passes of [`pass_tokens`] tokens over all the groups. The kernel is chosen once for all the groups: decode runs about 100,000 row groups a
/// token on Qwen2.5-Coder-1.5B, and choosing it per group (the format and ISA match, the
/// group's slice, a call) was about 1 % of one-thread decode's samples.
///
/// # Safety
/// `isa` must be supported by this CPU, `acts` must hold at least `t1` tokens of
/// `p.blocks_per_row` blocks, and `out` must be valid for those writes (no other thread
/// writing the same rows).
// A GEMM kernel entry point: the ISA, the packed weights, the row groups, the token range
// and the raw output with its stride are all independent inputs, so a struct would only
// add indirection.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_groups(
    isa: Isa,
    p: &Packed,
    groups: (usize, usize),
    acts: &Q8Acts,
    t0: usize,
    t1: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let bpr = p.blocks_per_row;
    let group_bytes = bpr * p.group_block_bytes();
    assert!(groups.0 <= groups.1 && groups.1 * group_bytes <= p.data().len());
    let data = p.data().as_ptr();
    macro_rules! run {
        ($m:ident, $fmt:expr) => {
            run!($m, $fmt, TILE_TOKENS)
        };
        ($m:ident, $fmt:expr, $nt:expr) => {{
            let pass = pass_tokens(bpr, $nt);
            let mut c0 = t0;
            while c0 < t1 {
                let c1 = (c0 + pass).min(t1);
                for g in groups.0..groups.1 {
                    let lanes = (p.rows - g * GROUP_ROWS).min(GROUP_ROWS);
                    let (group, o) = (data.add(g * group_bytes), out.add(g * GROUP_ROWS));
                    let mut t = c0;
                    while t + $nt <= c1 {
                        $m::tile::<{ $fmt }, { $nt }>(group, bpr, acts, t, o, out_stride, lanes);
                        t += $nt;
                    }
                    while t < c1 {
                        $m::tile::<{ $fmt }, 1>(group, bpr, acts, t, o, out_stride, lanes);
                        t += 1;
                    }
                }
                c0 = c1;
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
                GgmlType::Q6S => run!($m, Q6S),
                GgmlType::Q4K => run!($m, Q4K),
                GgmlType::Q6K => run!($m, Q6K),
                ty => unreachable!("no packed kernel for {ty:?}"),
            }
        };
    }
    match (isa, p.ty) {
        // 4-bit weights on AVX2 take the kernel with few live registers (NOTE 4).
        (Isa::Avx2, GgmlType::Q4_0) => run!(avx2_q4, Q4_0, Q4_TILE_TOKENS),
        (Isa::Avx2, GgmlType::Q4_1) => run!(avx2_q4, Q4_1, Q4_TILE_TOKENS),
        (Isa::Avx2, GgmlType::Q4K) => run!(avx2_q4, Q4K, Q4_TILE_TOKENS),
        (Isa::Avx2, GgmlType::Q6K) => run!(avx2_q6k, Q6K, Q6K_TILE_TOKENS),
        (Isa::Avx2, _) => by_format!(avx2),
        (Isa::Avx512Vnni | Isa::Amx, _) => by_format!(vnni),
    }
}

/// How far ahead of a decode step's weight stream each group block asks for its cache lines
/// into L1 (`prefetcht0`) under [`PrefetchPlan::Near`]. A token's matrix-vector product
/// reads each weight once from DRAM; the hardware prefetcher alone left one thread at 57 %
/// of the read bandwidth on Qwen2.5-1.5B (AVX2 host), and asking for the lines 1 KiB ahead
/// (about six Q4_1 group blocks, roughly a DRAM latency of work) raised decode by a quarter
/// (BENCHMARKS.md, "Weight prefetch").
pub(super) const PREFETCH_AHEAD_BYTES: usize = 1024;

/// The far distance of [`PrefetchPlan::TwoLevel`] and [`PrefetchPlan::L2`] on AMD before
/// Zen 4:
/// lines are asked for into L2 (`prefetcht2`) this far ahead. An L1 prefetch holds one of the
/// core's few line-fill buffers until its line arrives from DRAM, so a far `prefetcht0`
/// stalls the loads behind it, while an L2 request waits in the much deeper L2 queue.
const PREFETCH_FAR_BYTES: usize = 4096;
/// The far distance on AMD Zen 4 and later and on Intel ([`far_bytes_choice`]). A prefetch
/// covers a DRAM latency only if it runs at least latency × bandwidth ahead. On the Zen 4
/// host (family 25 model 17, 31.9 GB/s on one thread) 4 KiB ahead held one thread's decode
/// of Qwen2.5-Coder-1.5B at 17.6–18.3 tok/s (60 % of the DRAM bound), 2 KiB at 10, and 8 KiB
/// raised it to 24.8–25.2 (81–84 %), with 16 KiB no better (BENCHMARKS.md, "Issue 39 on
/// AMD EPYC Zen 4"). On the Intel AMX host of 2026-12-08 (family 6 model 167), once every
/// line was asked for once, 8 KiB beat 4 KiB in five of six alternating pairs at one
/// thread (by 1.1–3.3 points of the bound; the sixth, on a busier host, lost 0.7), and by
/// about as much at two; 16 KiB was no better (BENCHMARKS.md, "Issue 39 on an Intel Xeon
/// with AMX (model 167)").
const PREFETCH_FAR_BYTES_LONG: usize = 8192;
/// The near distance of [`PrefetchPlan::TwoLevel`], into L1.
pub(super) const PREFETCH_NEAR_BYTES: usize = 512;

/// Where a decode tile asks for the weight lines it will read (prefill tiles do not ask:
/// four tokens of work per byte make them bound by arithmetic).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefetchPlan {
    /// Into L1 [`PREFETCH_AHEAD_BYTES`] ahead (`PK_PREFETCH_PLAN=near`).
    Near,
    /// Into L2 `far_bytes` ([`far_bytes_choice`]) ahead and into L1 [`PREFETCH_NEAR_BYTES`]
    /// ahead (`far`), Intel's default: on the AMX host the pair raised Qwen2.5-1.5B decode
    /// 1.10–1.12× at 1 and 2 threads against `near` (docs/results/benchmarks-history.md,
    /// "Issue 39 on an Intel Xeon with AMX").
    TwoLevel { far_bytes: usize },
    /// Into L2 `far_bytes` ([`far_bytes_choice`]) ahead only (`l2`), AMD's default: on an
    /// AMD EPYC (Zen 3, AVX2 only) `near` left one thread at 76–82 % of the DRAM bound on
    /// Qwen2.5-1.5B, 1 KiB being too short for its latency, and this plan decoded faster
    /// than both others at 1 and 2 threads (docs/results/benchmarks-history.md, 2026-12-07,
    /// eighteenth session; BENCHMARKS.md's plan sweep on Zen 3 confirms it at one thread).
    L2 { far_bytes: usize },
    /// No software prefetch (`none`), the hardware prefetchers alone: for comparisons. On the
    /// Zen 4 host it left one thread at 65–66 % of the DRAM bound, against 79–81 % for `l2`
    /// 8 KiB ahead (BENCHMARKS.md, "Issue 39 on AMD EPYC Zen 4").
    Off,
}

/// The decode tiles' [`PrefetchPlan`]: `PK_PREFETCH_PLAN=near|far|l2|none` chooses (any other
/// value is refused by name), so that benchmarks compare the plans without rebuilding;
/// otherwise Intel CPUs take the two levels and others the L2 plan.
pub fn prefetch_plan() -> PrefetchPlan {
    static PLAN: std::sync::OnceLock<PrefetchPlan> = std::sync::OnceLock::new();
    *PLAN.get_or_init(|| prefetch_plan_choice().unwrap_or_else(|e| panic!("{e}")))
}

fn prefetch_plan_choice() -> Result<PrefetchPlan, String> {
    let far_bytes = far_bytes_choice()?;
    Ok(match std::env::var("PK_PREFETCH_PLAN").as_deref() {
        Ok("far") => PrefetchPlan::TwoLevel { far_bytes },
        Ok("near") => PrefetchPlan::Near,
        Ok("none") => PrefetchPlan::Off,
        Ok("l2") => PrefetchPlan::L2 { far_bytes },
        Ok(other) => {
            return Err(format!(
                "PK_PREFETCH_PLAN={other:?} is not one of \"far\", \"near\", \"l2\", \"none\""
            ))
        }
        Err(_) if is_intel() => PrefetchPlan::TwoLevel { far_bytes },
        Err(_) => PrefetchPlan::L2 { far_bytes },
    })
}

/// How far ahead the `far` and `l2` plans ask for lines into L2: `PK_PREFETCH_FAR_BYTES`
/// (a multiple of 64 from 512 to 65,536; anything else is refused by name) so that a sweep
/// can compare distances without rebuilding, otherwise [`PREFETCH_FAR_BYTES_LONG`] on Intel
/// and AMD Zen 4 and later, and [`PREFETCH_FAR_BYTES`] on older AMD (each measured on its
/// host kind).
fn far_bytes_choice() -> Result<usize, String> {
    match std::env::var("PK_PREFETCH_FAR_BYTES") {
        Ok(v) => parse_far_bytes(&v).ok_or_else(|| {
            format!("PK_PREFETCH_FAR_BYTES={v:?} is not a multiple of 64 from 512 to 65536")
        }),
        Err(_) if is_intel() => Ok(PREFETCH_FAR_BYTES_LONG),
        Err(_) if is_amd() && is_zen4_or_later(__cpuid(1).eax) => Ok(PREFETCH_FAR_BYTES_LONG),
        Err(_) => Ok(PREFETCH_FAR_BYTES),
    }
}

fn parse_far_bytes(v: &str) -> Option<usize> {
    v.parse::<usize>()
        .ok()
        .filter(|n| (512..=65536).contains(n) && n % 64 == 0)
}

fn is_amd() -> bool {
    let v = __cpuid(0);
    (v.ebx, v.edx, v.ecx) == (0x6874_7541, 0x6974_6e65, 0x444d_4163)
}

/// Whether CPUID leaf 1's `eax` of an AMD CPU is family 25 (0x19) with a Zen 4 model
/// (Genoa and Bergamo 0x10–0x1f and 0xa0–0xaf, Raphael and Phoenix 0x60–0x7f; Zen 3 is
/// 0x00–0x0f and 0x20–0x5f), or a later family.
fn is_zen4_or_later(eax: u32) -> bool {
    let base_family = (eax >> 8) & 0xf;
    let family = base_family
        + if base_family == 0xf {
            (eax >> 20) & 0xff
        } else {
            0
        };
    let model = ((eax >> 4) & 0xf) | (((eax >> 16) & 0xf) << 4);
    family > 0x19 || (family == 0x19 && matches!(model, 0x10..=0x1f | 0x60..=0x7f | 0xa0..=0xaf))
}

fn is_intel() -> bool {
    let v = __cpuid(0);
    (v.ebx, v.edx, v.ecx) == (0x756e_6547, 0x4965_6e69, 0x6c65_746e)
}

/// Asks, under `plan` (see [`prefetch_plan`]), for the cache lines ahead of the group block
/// `gbb` bytes long at `gb` that a decode tile will read: those whose starts fall in the
/// block's first 64 bytes (`part` 0), its next 64 (1), or the rest (2), so that the stream
/// asks for each line once. A tile asks for the parts at three points of a block's work
/// (NOTE 6). Past the matrix's end a prefetch is harmless: it never faults.
///
/// Each block asked for its `gbb.div_ceil(64)` lines from its own start before 2026-12-08,
/// about a quarter of the stream's lines twice; once a line, one thread's decode of
/// Qwen2.5-Coder-1.5B on the Intel AMX host went from 80.7–84.3 % to 85.6–87.2 % of the
/// DRAM bound, and two threads' from 77.0–80.9 % to 82.8–83.8 % (BENCHMARKS.md, "Issue 39
/// on an Intel Xeon with AMX (model 167)").
#[inline(always)]
unsafe fn prefetch_weights(gb: *const u8, gbb: usize, plan: PrefetchPlan, part: usize) {
    let (from, to) = match part {
        0 => (0, 64),
        1 => (64, 128),
        _ => (128, gbb),
    };
    // One request a line of the stream: the line starts that fall in this part's bytes.
    // Group blocks are not whole lines (Q4K 148 bytes, Q6K 210), so asking for each block's
    // lines from its own start asked for about a quarter of the lines twice.
    let start = gb as usize + from;
    let end = gb as usize + to.min(gbb);
    let mut line = start.next_multiple_of(64);
    while line < end {
        prefetch_line(gb.wrapping_add(line - gb as usize), plan);
        line += 64;
    }
}

/// Asks for the line `line` will be read from under `plan`, ahead of it.
#[inline(always)]
unsafe fn prefetch_line(line: *const u8, plan: PrefetchPlan) {
    match plan {
        PrefetchPlan::Near => {
            _mm_prefetch::<_MM_HINT_T0>(line.wrapping_add(PREFETCH_AHEAD_BYTES) as *const i8)
        }
        PrefetchPlan::TwoLevel { far_bytes } => {
            _mm_prefetch::<_MM_HINT_T2>(line.wrapping_add(far_bytes) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(line.wrapping_add(PREFETCH_NEAR_BYTES) as *const i8);
        }
        PrefetchPlan::L2 { far_bytes } => {
            _mm_prefetch::<_MM_HINT_T2>(line.wrapping_add(far_bytes) as *const i8)
        }
        PrefetchPlan::Off => {}
    }
}

/// [`super::stream::read_pass_plain`]'s sum of `bytes` (whole 64-byte lines), asking for
/// every line ahead as a decode tile asks for its weights ([`prefetch_weights`]'s plan), so
/// that the DRAM bound decode is measured against uses the same prefetches.
///
/// # Safety
/// The CPU must have AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn read_pass_prefetched(bytes: &[u8]) -> u64 {
    let plan = prefetch_plan();
    let (p, lines) = (bytes.as_ptr(), bytes.len() / 64);
    let (mut a0, mut a1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
    for i in 0..lines {
        let line = p.add(64 * i);
        prefetch_line(line, plan);
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(line as *const __m256i));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(line.add(32) as *const __m256i));
    }
    let mut words = [0u64; 4];
    _mm256_storeu_si256(words.as_mut_ptr() as *mut __m256i, _mm256_add_epi64(a0, a1));
    words.iter().fold(0, |x, &y| x.wrapping_add(y))
}

/// A group block's quants as 8 vectors of unsigned weights (vector k: elements 4k..4k+4 of
/// each of the 8 rows for k < 4, elements 16+4(k-4).. for k >= 4; see `pack`), for every
/// format but Q8_0, whose vectors are stored as they are used. A macro so that it is compiled
/// with the features of the function it is used in (`x86`'s modules, `amx`).
macro_rules! unpack_group_block {
    ($fmt:expr, $gb:expr) => {{
        let (fmt, gb): (u8, *const u8) = ($fmt, $gb);
        let low4 = _mm256_set1_epi8(0x0f);
        let mut v = [_mm256_setzero_si256(); 8];
        if fmt == Q6K {
            for half in 0..2 {
                let (v3, first) = crate::kernels::x86::q6k_half!(gb, half);
                v[4 * half..4 * half + 3].copy_from_slice(&first);
                v[4 * half + 3] = v3;
            }
        } else if fmt == Q4_0 || fmt == Q4_1 || fmt == Q5_0 || fmt == Q6S || fmt == Q4K {
            let at = match fmt {
                Q4_1 | Q6S => 32,
                Q4K => crate::kernels::pack::Q4K_QS_AT,
                _ => 16,
            };
            for k in 0..4 {
                let p = _mm256_loadu_si256(gb.add(at + 32 * k) as *const __m256i);
                v[k] = _mm256_and_si256(p, low4);
                v[k + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low4);
            }
            if fmt == Q5_0 {
                // Bit j of the high-bit vector is vector j's fifth bit (see
                // `pack`): move it to bit 4. The 16-bit shifts carry bits across
                // bytes only into positions the 0x10 mask clears.
                let h =
                    _mm256_loadu_si256(gb.add(crate::kernels::pack::Q5_HIGH_AT) as *const __m256i);
                let bit4 = _mm256_set1_epi8(0x10);
                v[0] = _mm256_or_si256(v[0], _mm256_and_si256(_mm256_slli_epi16(h, 4), bit4));
                v[1] = _mm256_or_si256(v[1], _mm256_and_si256(_mm256_slli_epi16(h, 3), bit4));
                v[2] = _mm256_or_si256(v[2], _mm256_and_si256(_mm256_slli_epi16(h, 2), bit4));
                v[3] = _mm256_or_si256(v[3], _mm256_and_si256(_mm256_slli_epi16(h, 1), bit4));
                v[4] = _mm256_or_si256(v[4], _mm256_and_si256(h, bit4));
                v[5] = _mm256_or_si256(v[5], _mm256_and_si256(_mm256_srli_epi16(h, 1), bit4));
                v[6] = _mm256_or_si256(v[6], _mm256_and_si256(_mm256_srli_epi16(h, 2), bit4));
                v[7] = _mm256_or_si256(v[7], _mm256_and_si256(_mm256_srli_epi16(h, 3), bit4));
            }
            if fmt == Q6S {
                let high = crate::kernels::pack::Q6_HIGH_AT;
                // Bits 2j..2j+2 of H0 (H1) are vector j's (4 + j's) two high bits
                // (see `pack`): move them to bits 4..6. The 16-bit shifts carry
                // bits across bytes only into positions the 0x30 mask clears.
                let hi2 = _mm256_set1_epi8(0x30);
                for (h, at) in [(0, high), (4, high + 32)] {
                    let hv = _mm256_loadu_si256(gb.add(at) as *const __m256i);
                    v[h] = _mm256_or_si256(v[h], _mm256_and_si256(_mm256_slli_epi16(hv, 4), hi2));
                    v[h + 1] =
                        _mm256_or_si256(v[h + 1], _mm256_and_si256(_mm256_slli_epi16(hv, 2), hi2));
                    v[h + 2] = _mm256_or_si256(v[h + 2], _mm256_and_si256(hv, hi2));
                    v[h + 3] =
                        _mm256_or_si256(v[h + 3], _mm256_and_si256(_mm256_srli_epi16(hv, 2), hi2));
                }
            }
        } else {
            for k in 0..8 {
                v[k] = _mm256_loadu_si256(gb.add(16 + 32 * k) as *const __m256i);
            }
        }
        v
    }};
}
pub(super) use unpack_group_block;

/// A Q6K group block's half `half` (0: elements 0..16, 1: 16..32) as its unpacked vectors
/// `(4·half + 3, [4·half, 4·half + 1, 4·half + 2])`, from the half's three quant vectors
/// (see `pack`): three masks, and eight operations for the vector whose bit pairs are the
/// three vectors' top bits. The 16-bit shifts carry bits across bytes only into positions
/// the masks clear. A macro for the same reason as [`unpack_group_block`].
macro_rules! q6k_half {
    ($gb:expr, $half:expr) => {{
        let (gb, half): (*const u8, usize) = ($gb, $half);
        let at = gb.add(crate::kernels::pack::Q6K_QS_AT + 96 * half);
        let b0 = _mm256_loadu_si256(at as *const __m256i);
        let b1 = _mm256_loadu_si256(at.add(32) as *const __m256i);
        let b2 = _mm256_loadu_si256(at.add(64) as *const __m256i);
        let (low6, low2, top2) = (
            _mm256_set1_epi8(0x3f),
            _mm256_set1_epi8(0x03),
            _mm256_set1_epi8(0xc0u8 as i8),
        );
        let bits01 = _mm256_and_si256(_mm256_srli_epi16(b0, 6), low2);
        let bits23 = _mm256_srli_epi16(_mm256_and_si256(b1, top2), 4);
        let bits45 = _mm256_srli_epi16(_mm256_and_si256(b2, top2), 2);
        (
            _mm256_or_si256(bits01, _mm256_or_si256(bits23, bits45)),
            [
                _mm256_and_si256(b0, low6),
                _mm256_and_si256(b1, low6),
                _mm256_and_si256(b2, low6),
            ],
        )
    }};
}
pub(super) use q6k_half;

/// The f16 super-block scales of a Q4K group's 8 rows as f32 `(d, −dmin)`, read from the
/// first group block `first` of their super-block: the eight rows' `d` then their `dmin`
/// (32 bytes) are spread 4 bytes a block over the super-block's eight group blocks (see
/// `pack`), so they are eight 32-bit loads with no shuffle. A gather (`vpgatherdd`) of
/// row-ordered pairs, then a shuffle, was slower: a one-token product of a 1,024 × 1,536
/// matrix from cache took 27.6–28.2 µs with it, 24.9–25.7 without (Q4_1: 22.1–23.1), on
/// the AMX host; decode from DRAM did not move.
/// The min scale is negated here, once a super-block, so that each sub-block's `−dmin·m`
/// is one product (negation is exact, so this is the reference's `−(dmin·m)` bit for bit).
/// A macro for the same reason as [`unpack_group_block`].
macro_rules! q4k_super_scales {
    ($first:expr) => {{
        let first: *const u8 = $first;
        let gbb = crate::kernels::pack::Q4K_GROUP_BLOCK_BYTES;
        let piece = |j: usize| (first.add(j * gbb) as *const i32).read_unaligned();
        let d = _mm_setr_epi32(piece(0), piece(1), piece(2), piece(3));
        let dmin = _mm_setr_epi32(piece(4), piece(5), piece(6), piece(7));
        (
            _mm256_cvtph_ps(d),
            _mm256_xor_ps(_mm256_cvtph_ps(dmin), _mm256_set1_ps(-0.0)),
        )
    }};
}
pub(super) use q4k_super_scales;

/// A Q4K group block's 8 rows' 6-bit sub-block scales `sc` as 32-bit lanes.
macro_rules! q4k_block_sc {
    ($gb:expr) => {{
        let gb: *const u8 = $gb;
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(
            gb.add(crate::kernels::pack::Q4K_SC_AT) as *const __m128i
        ))
    }};
}

/// Q4K's float update at the end of a super-block (NOTE 5), for each token `t0 + j`:
/// `acc[j] += (d·d_a)·isum + (−dmin·d_a)·imin`, with `isum = kacc[j]` the token's integer
/// `Σ_j sc_j · Σ q·a` (reset here) and `imin = Σ_j m_j · Σ a` from the mins of the
/// super-block's group blocks (`first` the first of them, block `sb0` of the row) and the
/// activations' 32-element sums: four `vpmaddwd` of adjacent pairs. `sup` is the
/// super-block's `(d, −dmin)`. A macro for the same reason as [`unpack_group_block`].
macro_rules! q4k_super_update {
    ($first:expr, $sb0:expr, $sup:expr, $acts:expr, $bpr:expr, $t0:expr, $kacc:expr, $acc:expr) => {{
        let (first, sb0, (d, nd)): (*const u8, usize, (__m256, __m256)) = ($first, $sb0, $sup);
        let (acts, bpr, t0): (&Q8Acts, usize, usize) = ($acts, $bpr, $t0);
        let gbb = crate::kernels::pack::Q4K_GROUP_BLOCK_BYTES;
        let m = |j: usize| {
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                first.add(j * gbb + crate::kernels::pack::Q4K_M_AT) as *const __m128i,
            ))
        };
        let pairs: [__m256i; 4] =
            std::array::from_fn(|p| _mm256_or_si256(m(2 * p), _mm256_slli_epi32(m(2 * p + 1), 16)));
        for (j, (a, k)) in $acc.iter_mut().zip($kacc.iter_mut()).enumerate() {
            let tb = (t0 + j) * bpr + sb0;
            let bs = acts.kbsum.as_ptr().add(tb) as *const i32;
            let mut imin = _mm256_setzero_si256();
            for (p, pair) in pairs.iter().enumerate() {
                let b = _mm256_set1_epi32(bs.add(p).read_unaligned());
                imin = _mm256_add_epi32(imin, _mm256_madd_epi16(*pair, b));
            }
            let da = _mm256_set1_ps(*acts.kd.as_ptr().add(tb / 8));
            let x = _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(*k));
            let y = _mm256_mul_ps(_mm256_mul_ps(nd, da), _mm256_cvtepi32_ps(imin));
            *a = _mm256_add_ps(*a, _mm256_add_ps(x, y));
            *k = _mm256_setzero_si256();
        }
    }};
}

/// The f16 super-block scales `d` of a Q6K group's 8 rows as f32, read from the first group
/// block `first` of their super-block: row r's is the first two bytes of group block r (see
/// `pack`). A macro for the same reason as [`unpack_group_block`].
macro_rules! q6k_super_d {
    ($first:expr) => {{
        let first: *const u8 = $first;
        let gbb = crate::kernels::pack::Q6K_GROUP_BLOCK_BYTES;
        let piece = |j: usize| (first.add(j * gbb) as *const i16).read_unaligned();
        _mm256_cvtph_ps(_mm_setr_epi16(
            piece(0),
            piece(1),
            piece(2),
            piece(3),
            piece(4),
            piece(5),
            piece(6),
            piece(7),
        ))
    }};
}
pub(super) use q6k_super_d;

/// A Q6K group block's 8 rows' signed scales of elements 0..16 (`half` 0) or 16..32 (1) as
/// 32-bit lanes.
macro_rules! q6k_block_sc {
    ($gb:expr, $half:expr) => {{
        let (gb, half): (*const u8, usize) = ($gb, $half);
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(
            gb.add(crate::kernels::pack::Q6K_SC_AT + 8 * half) as *const __m128i,
        ))
    }};
}

/// Q6K's float update at the end of a super-block (NOTE 5), for each token `t0 + j`:
/// `acc[j] += (d·d_a)·(kacc[j] − 32·Σ_j sc_j·Σ a)`, the offset's sum over the sixteen
/// sub-blocks taken from the activations' 16-element sums, eight `vpmaddwd` of adjacent
/// pairs; `kacc` is reset. `first` is the super-block's first group block (block `sb0` of
/// the row) and `d` its rows' scales. A macro for the same reason as [`unpack_group_block`].
macro_rules! q6k_super_update {
    ($first:expr, $sb0:expr, $d:expr, $acts:expr, $bpr:expr, $t0:expr, $kacc:expr, $acc:expr) => {{
        let (first, sb0, d): (*const u8, usize, __m256) = ($first, $sb0, $d);
        let (acts, bpr, t0): (&Q8Acts, usize, usize) = ($acts, $bpr, $t0);
        let gbb = crate::kernels::pack::Q6K_GROUP_BLOCK_BYTES;
        let low16 = _mm256_set1_epi32(0xffff);
        let pairs: [__m256i; 8] = std::array::from_fn(|p| {
            let gb = first.add(p * gbb);
            _mm256_or_si256(
                _mm256_and_si256(q6k_block_sc!(gb, 0), low16),
                _mm256_slli_epi32(q6k_block_sc!(gb, 1), 16),
            )
        });
        for (j, (a, k)) in $acc.iter_mut().zip($kacc.iter_mut()).enumerate() {
            let tb = (t0 + j) * bpr + sb0;
            let bs = acts.kbsum16.as_ptr().add(2 * tb) as *const i32;
            let mut corr = _mm256_setzero_si256();
            for (p, pair) in pairs.iter().enumerate() {
                let b = _mm256_set1_epi32(bs.add(p).read_unaligned());
                corr = _mm256_add_epi32(corr, _mm256_madd_epi16(*pair, b));
            }
            let isum = _mm256_sub_epi32(*k, _mm256_slli_epi32(corr, 5));
            let da = _mm256_set1_ps(*acts.kd.as_ptr().add(tb / 8));
            *a = _mm256_add_ps(
                *a,
                _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(isum)),
            );
            *k = _mm256_setzero_si256();
        }
    }};
}

/// Writes a tile's per-token sums: token `j`'s 8 rows to `out + j · out_stride`, only the
/// first `lanes` of them where the group is the matrix's partial last one. Inlined into
/// each tile so that its stores take the tile's instruction set.
#[inline(always)]
unsafe fn store_tile(acc: &[__m256], out: *mut f32, out_stride: usize, lanes: usize) {
    for (j, a) in acc.iter().enumerate() {
        let dst = out.add(j * out_stride);
        if lanes == GROUP_ROWS {
            _mm256_storeu_ps(dst, *a);
        } else {
            let mut tmp = [0f32; GROUP_ROWS];
            _mm256_storeu_ps(tmp.as_mut_ptr(), *a);
            std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst, lanes);
        }
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
                    _mm256_add_epi32(
                        acc,
                        _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)),
                    )
                }
            }

            /// See [`super::gemm_groups`]; `NT` tokens from `t0`, `lanes` valid rows.
            #[target_feature(enable = $features)]
            pub unsafe fn tile<const FMT: u8, const NT: usize>(
                group: *const u8,
                bpr: usize,
                acts: &Q8Acts,
                t0: usize,
                out: *mut f32,
                out_stride: usize,
                lanes: usize,
            ) {
                let gbb = match FMT {
                    Q4_0 => 16 + 128,
                    Q4_1 => 32 + 128,
                    Q5_0 => 16 + 128 + 32,
                    Q6S => 32 + 128 + 64,
                    Q4K => crate::kernels::pack::Q4K_GROUP_BLOCK_BYTES,
                    Q6K => crate::kernels::pack::Q6K_GROUP_BLOCK_BYTES,
                    _ => 16 + 256,
                };
                // Q8_0 on AVX2 takes the sign trick (NOTE 2), so it has no offset there.
                let offset: i32 = match FMT {
                    Q4_0 => 8,
                    Q5_0 => 16,
                    Q6S => 32,
                    Q8_0 if $vnni => 128,
                    _ => 0,
                };
                // Q4K reads the K representation (`q8k`) and sums each super-block in
                // integers (NOTE 5).
                let (qs, ad, asum, as_, asum_lo) = (
                    if FMT == Q4K || FMT == Q6K {
                        acts.kqs.as_ptr()
                    } else {
                        acts.qs.as_ptr()
                    },
                    acts.d.as_ptr(),
                    acts.sum.as_ptr(),
                    acts.s.as_ptr(),
                    acts.sum_lo.as_ptr(),
                );
                let mut acc = [_mm256_setzero_ps(); NT];
                let mut kacc = [_mm256_setzero_si256(); NT];
                // Only decode tiles prefetch; a prefill tile skips even the plan's lookup.
                let plan = if NT == 1 {
                    prefetch_plan()
                } else {
                    PrefetchPlan::Near
                };
                let mut sup = (_mm256_setzero_ps(), _mm256_setzero_ps());
                for b in 0..bpr {
                    let gb = group.add(b * gbb);
                    // Decode only: a prefill tile does 4 tokens of work per byte and is
                    // bound by arithmetic.
                    if NT == 1 {
                        prefetch_weights(gb, gbb, plan, 0);
                    }
                    if FMT == Q4K && b % 8 == 0 {
                        sup = q4k_super_scales!(gb);
                    }
                    if FMT == Q6K && b % 8 == 0 {
                        sup.0 = q6k_super_d!(gb);
                    }
                    // Q6K's signed scales of the block's two halves, as 32-bit lanes and as
                    // both 16-bit halves of each lane (for `vpmaddwd`).
                    let (sc32, sc16) = if FMT == Q6K {
                        let sc = [q6k_block_sc!(gb, 0), q6k_block_sc!(gb, 1)];
                        let low16 = _mm256_set1_epi32(0xffff);
                        let both = sc.map(|s| {
                            _mm256_or_si256(_mm256_and_si256(s, low16), _mm256_slli_epi32(s, 16))
                        });
                        (sc, both)
                    } else {
                        ([_mm256_setzero_si256(); 2], [_mm256_setzero_si256(); 2])
                    };
                    // The scales; Q4_1's mins, or Q6S's second scales (elements 16..32).
                    let (d, m) = if FMT == Q4K || FMT == Q6K {
                        (_mm256_setzero_ps(), _mm256_setzero_ps())
                    } else if FMT == Q4_1 || FMT == Q6S {
                        (
                            _mm256_cvtph_ps(_mm_loadu_si128(gb as *const __m128i)),
                            _mm256_cvtph_ps(_mm_loadu_si128(gb.add(16) as *const __m128i)),
                        )
                    } else {
                        (
                            _mm256_cvtph_ps(_mm_loadu_si128(gb as *const __m128i)),
                            _mm256_setzero_ps(),
                        )
                    };
                    // v[k]: 4 quants (elements 4k..4k+4) of each of the 8 rows.
                    let mut v = unpack_group_block!(FMT, gb);
                    if NT == 1 {
                        prefetch_weights(gb, gbb, plan, 1);
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
                        if FMT == Q6S || FMT == Q6K {
                            // Two scales a block: one integer sum per half (NOTE 1).
                            let mut i = [_mm256_setzero_si256(); 4];
                            if $vnni {
                                for k in 0..8 {
                                    let ak = _mm256_set1_epi32(
                                        (a.add(4 * k) as *const i32).read_unaligned(),
                                    );
                                    i[2 * (k / 4) + k % 2] = dot4(i[2 * (k / 4) + k % 2], v[k], ak);
                                }
                            } else {
                                // Pairs of `vpmaddubsw` summed in 16 bits before one
                                // `vpmaddwd` (NOTE 3): 2 · 2 · 63 · 128 < 2^15.
                                for k in (0..8).step_by(2) {
                                    let (a0, a1) = (
                                        _mm256_set1_epi32(
                                            (a.add(4 * k) as *const i32).read_unaligned(),
                                        ),
                                        _mm256_set1_epi32(
                                            (a.add(4 * k + 4) as *const i32).read_unaligned(),
                                        ),
                                    );
                                    let s16 = _mm256_add_epi16(
                                        _mm256_maddubs_epi16(v[k], a0),
                                        _mm256_maddubs_epi16(v[k + 1], a1),
                                    );
                                    let at = 2 * (k / 4) + (k / 2) % 2;
                                    // Q6K: the widening applies the half's scale (NOTE 5).
                                    let by = if FMT == Q6K {
                                        sc16[k / 4]
                                    } else {
                                        _mm256_set1_epi16(1)
                                    };
                                    i[at] = _mm256_add_epi32(i[at], _mm256_madd_epi16(s16, by));
                                }
                            }
                            if FMT == Q6K {
                                let (lo, hi) =
                                    (_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
                                let scaled = if $vnni {
                                    _mm256_add_epi32(
                                        _mm256_mullo_epi32(lo, sc32[0]),
                                        _mm256_mullo_epi32(hi, sc32[1]),
                                    )
                                } else {
                                    _mm256_add_epi32(lo, hi)
                                };
                                kacc[j] = _mm256_add_epi32(kacc[j], scaled);
                                continue;
                            }
                            let (slo, s) = (*asum_lo.add(ab), *asum.add(ab));
                            let ilo = _mm256_sub_epi32(
                                _mm256_add_epi32(i[0], i[1]),
                                _mm256_set1_epi32(offset * slo),
                            );
                            let ihi = _mm256_sub_epi32(
                                _mm256_add_epi32(i[2], i[3]),
                                _mm256_set1_epi32(offset * (s - slo)),
                            );
                            let da = _mm256_set1_ps(*ad.add(ab));
                            acc[j] = _mm256_add_ps(
                                acc[j],
                                _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(ilo)),
                            );
                            acc[j] = _mm256_add_ps(
                                acc[j],
                                _mm256_mul_ps(_mm256_mul_ps(m, da), _mm256_cvtepi32_ps(ihi)),
                            );
                            continue;
                        }
                        let (mut i0, mut i1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                        // AVX2, 4-bit and 5-bit weights: `vpmaddubsw` results summed in 16
                        // bits, one `vpmaddwd` per 8 (4-bit) or 4 (5-bit) of them (NOTE 3).
                        if !$vnni && (FMT == Q4_0 || FMT == Q4_1 || FMT == Q5_0 || FMT == Q4K) {
                            let per = if FMT == Q5_0 { 4 } else { 8 };
                            let mut s16 = _mm256_setzero_si256();
                            for k in 0..8 {
                                let ak = _mm256_set1_epi32(
                                    (a.add(4 * k) as *const i32).read_unaligned(),
                                );
                                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(v[k], ak));
                                if (k + 1) % per == 0 {
                                    let wide = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
                                    i0 = _mm256_add_epi32(i0, wide);
                                    s16 = _mm256_setzero_si256();
                                }
                            }
                        } else {
                            for k in (0..8).step_by(2) {
                                let mut a0 = _mm256_set1_epi32(
                                    (a.add(4 * k) as *const i32).read_unaligned(),
                                );
                                let mut a1 = _mm256_set1_epi32(
                                    (a.add(4 * k + 4) as *const i32).read_unaligned(),
                                );
                                if FMT == Q8_0 && !$vnni {
                                    a0 = _mm256_sign_epi8(a0, sign[k]);
                                    a1 = _mm256_sign_epi8(a1, sign[k + 1]);
                                }
                                i0 = dot4(i0, v[k], a0);
                                i1 = dot4(i1, v[k + 1], a1);
                            }
                        }
                        let mut isum = _mm256_add_epi32(i0, i1);
                        if FMT == Q4K {
                            let sc = q4k_block_sc!(gb);
                            kacc[j] = _mm256_add_epi32(kacc[j], _mm256_mullo_epi32(isum, sc));
                            continue;
                        }
                        if offset != 0 {
                            isum =
                                _mm256_sub_epi32(isum, _mm256_set1_epi32(offset * *asum.add(ab)));
                        }
                        // The reference's `(d_w * d_a) * isum [+ m_w * s_a]`, unfused (NOTE 1).
                        let scale = _mm256_mul_ps(d, _mm256_set1_ps(*ad.add(ab)));
                        let mut x = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(isum));
                        if FMT == Q4_1 {
                            x = _mm256_add_ps(x, _mm256_mul_ps(m, _mm256_set1_ps(*as_.add(ab))));
                        }
                        acc[j] = _mm256_add_ps(acc[j], x);
                    }
                    if FMT == Q4K && b % 8 == 7 {
                        let sb0 = b - 7;
                        q4k_super_update!(group.add(sb0 * gbb), sb0, sup, acts, bpr, t0, kacc, acc);
                    }
                    if FMT == Q6K && b % 8 == 7 {
                        let sb0 = b - 7;
                        q6k_super_update!(
                            group.add(sb0 * gbb),
                            sb0,
                            sup.0,
                            acts,
                            bpr,
                            t0,
                            kacc,
                            acc
                        );
                    }
                    if NT == 1 {
                        prefetch_weights(gb, gbb, plan, 2);
                    }
                }
                store_tile(&acc, out.add(t0 * out_stride), out_stride, lanes);
            }
        }
    };
}

isa_module!(avx2, "avx2,fma,f16c", false);

mod avx2_q6k;

/// The AVX2 tile for 4-bit weights (Q4_0, Q4_1; NOTE 3 and NOTE 4): per block, each 32-byte
/// load of quants is unpacked into its two weight vectors and used by every token at once,
/// each token summing its eight `vpmaddubsw` in 16 bits; then the reference's scale updates.
mod avx2_q4 {
    use super::*;

    /// See [`super::gemm_groups`]; `NT` tokens from `t0`, `lanes` valid rows.
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
        let (gbb, at) = match FMT {
            Q4_1 => (32 + 128, 32),
            Q4K => (
                crate::kernels::pack::Q4K_GROUP_BLOCK_BYTES,
                crate::kernels::pack::Q4K_QS_AT,
            ),
            _ => (16 + 128, 16),
        };
        let offset: i32 = if FMT == Q4_0 { 8 } else { 0 };
        let (low4, ones) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi16(1));
        // Q4K reads the K representation (`q8k`) and sums each super-block in integers.
        let qs = if FMT == Q4K {
            acts.kqs.as_ptr()
        } else {
            acts.qs.as_ptr()
        };
        let mut acc = [_mm256_setzero_ps(); NT];
        let mut kacc = [_mm256_setzero_si256(); NT];
        let plan = if NT == 1 {
            prefetch_plan()
        } else {
            PrefetchPlan::Near
        };
        let mut sup = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for b in 0..bpr {
            let gb = group.add(b * gbb);
            if NT == 1 {
                // Decode streams the weights from DRAM: as in the general tile.
                prefetch_weights(gb, gbb, plan, 0);
            }
            if FMT == Q4K && b % 8 == 0 {
                sup = q4k_super_scales!(gb);
            }
            let mut s16 = [_mm256_setzero_si256(); NT];
            for k in 0..4 {
                if NT == 1 && k == 2 {
                    prefetch_weights(gb, gbb, plan, 1);
                }
                let p = _mm256_loadu_si256(gb.add(at + 32 * k) as *const __m256i);
                // Elements 4k..4k+4 and 16+4k..16+4k+4 of each of the 8 rows.
                let lo = _mm256_and_si256(p, low4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low4);
                for (j, s) in s16.iter_mut().enumerate() {
                    let a = qs.add(((t0 + j) * bpr + b) * QK);
                    let a_lo = _mm256_set1_epi32((a.add(4 * k) as *const i32).read_unaligned());
                    let a_hi =
                        _mm256_set1_epi32((a.add(4 * k + 16) as *const i32).read_unaligned());
                    let pair = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, a_lo),
                        _mm256_maddubs_epi16(hi, a_hi),
                    );
                    *s = _mm256_add_epi16(*s, pair);
                }
            }
            if FMT == Q4K {
                // `vpmaddwd` by each row's `sc` (both 16-bit halves of its lane) widens the
                // 16-bit sums and applies the sub-block scale in one step (NOTE 5).
                let sc = q4k_block_sc!(gb);
                let sc16 = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
                for (k, s) in kacc.iter_mut().zip(&s16) {
                    *k = _mm256_add_epi32(*k, _mm256_madd_epi16(*s, sc16));
                }
                if b % 8 == 7 {
                    let sb0 = b - 7;
                    q4k_super_update!(group.add(sb0 * gbb), sb0, sup, acts, bpr, t0, kacc, acc);
                }
                if NT == 1 {
                    prefetch_weights(gb, gbb, plan, 2);
                }
                continue;
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(gb as *const __m128i));
            let m = _mm256_cvtph_ps(_mm_loadu_si128(gb.add(16) as *const __m128i));
            for (j, s) in s16.iter().enumerate() {
                let ab = (t0 + j) * bpr + b;
                let mut isum = _mm256_madd_epi16(*s, ones);
                if offset != 0 {
                    isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(offset * acts.sum[ab]));
                }
                // The reference's `(d_w * d_a) * isum [+ m_w * s_a]`, unfused (NOTE 1).
                let scale = _mm256_mul_ps(d, _mm256_set1_ps(acts.d[ab]));
                let mut x = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(isum));
                if FMT == Q4_1 {
                    x = _mm256_add_ps(x, _mm256_mul_ps(m, _mm256_set1_ps(acts.s[ab])));
                }
                acc[j] = _mm256_add_ps(acc[j], x);
            }
            if NT == 1 {
                prefetch_weights(gb, gbb, plan, 2);
            }
        }
        store_tile(&acc, out.add(t0 * out_stride), out_stride, lanes);
    }
}
isa_module!(
    vnni,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    true
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zen4_is_told_from_zen3_and_zen2_by_cpuid() {
        // CPUID leaf 1 `eax` of the hosts measured: Zen 3 (Milan, family 25 model 1), Zen 4
        // (Genoa, family 25 model 17), Zen 2 (Rome, family 23 model 49); then Zen 3's
        // Vermeer (model 0x21), Zen 4's Raphael (0x61), and a Zen 5 (family 26).
        assert!(!is_zen4_or_later(0x00a0_0f11));
        assert!(is_zen4_or_later(0x00a1_0f11));
        assert!(!is_zen4_or_later(0x0083_0f10));
        assert!(!is_zen4_or_later(0x00a2_0f10));
        assert!(is_zen4_or_later(0x00a6_0f12));
        assert!(is_zen4_or_later(0x00b0_0f00));
    }

    #[test]
    fn far_distances_outside_the_range_or_off_a_line_are_refused() {
        assert_eq!(parse_far_bytes("8192"), Some(8192));
        assert_eq!(parse_far_bytes("512"), Some(512));
        assert_eq!(parse_far_bytes("65536"), Some(65536));
        for bad in ["448", "65600", "4100", "", "8k", "-4096"] {
            assert_eq!(parse_far_bytes(bad), None, "{bad:?}");
        }
    }
}
