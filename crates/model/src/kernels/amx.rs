//! The prefill GEMM on Intel AMX (issue 39): the integer products of 16 tokens × 16 weight
//! rows × one block in one `tdpbsud` tile instruction, then the reference's per-block
//! scaling on AVX-512. The K-quants (Q4K, Q6K), whose activations have one scale per 256
//! elements, go to `amx_kquant.rs`, which sums a whole super-block in the tiles.
//!
//! NOTE 1: bit-exact with the scalar reference, as the AVX2 and VNNI kernels are
//! (`x86.rs`, NOTE 1). A tile multiply sums over one block only (32 bytes; Q6S's two halves
//! of 16 bytes are two "steps" with their own scales), so each (token, row, block) gets its
//! exact integer sum, and the float updates `acc += (d_w * d_a) * isum [+ m_w * s_a]` run
//! per block, in block order, unfused, as in the reference. The per-block float work is so
//! the bottleneck (about 7 vector operations per 16 outputs of a block, against one tile
//! instruction for 256 outputs), and it is what a wider K per tile would save; it would
//! change the results' bits, so it is not done for the 32-element formats (the K-quants'
//! references sum a super-block in integers, so their kernel does it).
//!
//! NOTE 2: `tdpbsud` multiplies signed bytes of its first source (the activations, loaded
//! straight from [`Q8Acts`] with the token stride) by unsigned bytes of its second (the
//! weights, with the same offsets as for `vpdpbusd`, `x86.rs` NOTE 2, corrected with the
//! activation sums). The weight tile wants 4 consecutive bytes of each of 16 rows per 64-byte
//! row, which is the packed layout's vector of one 8-row group twice over: a pair of groups'
//! unpacked vectors side by side, written once per block into a scratch buffer and reused by
//! every 16-token tile of the chunk.
//!
//! NOTE 3: tile registers are not renamed, so consecutive steps alternate between two sets
//! (tmm0/2/4 and tmm1/3/5), and products go to four buffers in turn: the tile product of
//! step s+2 is issued before step s is scaled. The tile work and the scaling overlap little
//! all the same: a 16 × 16 × 32 step costs about 26 ns of tile instructions (most of it
//! `tilestored`) and 36 ns of scaling alone, and 56 ns together (Q4_1, 1,536 × 1,536, Xeon
//! with AMX; issuing one step ahead, or two and scaling two, measured within 5 %). The
//! tile configuration is per thread and is loaded at the start of every call (tens of
//! cycles against a call's thousands of tile products); `tilerelease` at the end keeps
//! threads that never run AMX again from carrying its state through context switches.
//!
//! NOTE 4: Linux grants a process the AMX tile state only on request
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); [`available`] asks once, and a
//! refusal (an old kernel, a seccomp filter) leaves the VNNI kernel in charge.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::OnceLock;

use super::pack::{Packed, GROUP_ROWS};
use super::q8::{Q8Acts, QK};
use super::x86::{unpack_group_block, Q4K, Q4_0, Q4_1, Q5_0, Q6K, Q6S, Q8_0};

/// Tokens per tile product: the tile's 16 rows.
pub(super) const TILE_TOKENS: usize = 16;

/// Activation bytes per chunk of tokens: the unpacked weights of a group pair are reused by
/// every 16-token tile of a chunk, and a chunk's activations stay in L2 (2 MiB on the Xeons
/// with AMX) while the pairs of a task stream past them; each chunk streams the weights
/// once more, so chunks are as large as this allows (672 tokens of 1,536 columns, 112 of
/// 8,960).
const CHUNK_BYTES: usize = 1 << 20;

/// Bytes of one block's record in the scratch buffer: the 8 × 64-byte weight tile, then
/// the pair's 16 scales and its 16 mins (Q4_1) or second scales (Q6S) as f32.
const RECORD_BYTES: usize = 8 * 64 + 64 + 64;

/// Whether this process runs the AMX kernel: [`permitted`], and `PK_AMX=0` is not set (for
/// side-by-side measurements against the VNNI kernel).
pub fn available() -> bool {
    static YES: OnceLock<bool> = OnceLock::new();
    // The switch is read first, so that a bad value is refused on every CPU.
    *YES.get_or_init(|| super::env_switch("PK_AMX") != Some(false) && permitted())
}

/// Whether this process may execute AMX instructions: the CPU has AMX-TILE and AMX-INT8 and
/// AVX-512 F/BW/VL/VNNI, the OS saves tile state, and Linux granted the permission (NOTE 4).
pub fn permitted() -> bool {
    static YES: OnceLock<bool> = OnceLock::new();
    *YES.get_or_init(|| cpu_and_os_have_amx() && request_permission())
}

fn cpu_and_os_have_amx() -> bool {
    if !(is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("f16c")
        && is_x86_feature_detected!("xsave"))
    {
        return false;
    }
    // CPUID leaf 7 exists on every CPU with AVX-512.
    let leaf7 = __cpuid_count(7, 0);
    let (tile, int8) = (leaf7.edx & (1 << 24) != 0, leaf7.edx & (1 << 25) != 0);
    let osxsave = __cpuid(1).ecx & (1 << 27) != 0;
    if !(tile && int8 && osxsave) {
        return false;
    }
    // SAFETY: OSXSAVE is set, so XGETBV is enabled. Bits 17 and 18: XTILECFG and XTILEDATA.
    let xcr0 = unsafe { xgetbv0() };
    xcr0 & (0b11 << 17) == 0b11 << 17
}

#[target_feature(enable = "xsave")]
unsafe fn xgetbv0() -> u64 {
    _xgetbv(0)
}

#[cfg(target_os = "linux")]
fn request_permission() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: arch_prctl with these arguments only changes the process's permission to use
    // the tile state; it reads and writes no memory of ours.
    unsafe {
        asm!("syscall", inlateout("rax") SYS_ARCH_PRCTL => ret, in("rdi") ARCH_REQ_XCOMP_PERM,
             in("rsi") XFEATURE_XTILEDATA, lateout("rcx") _, lateout("r11") _,
             options(nostack));
    }
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn request_permission() -> bool {
    false
}

/// Whether the kernel handles this format (every packed one).
pub fn supports(ty: pk_gguf::GgmlType) -> bool {
    format_code(ty).is_some()
}

fn format_code(ty: pk_gguf::GgmlType) -> Option<u8> {
    use pk_gguf::GgmlType as T;
    Some(match ty {
        T::Q4_0 => Q4_0,
        T::Q4_1 => Q4_1,
        T::Q8_0 => Q8_0,
        T::Q5_0 => Q5_0,
        T::Q6S => Q6S,
        T::Q4K => Q4K,
        T::Q6K => Q6K,
        _ => return None,
    })
}

/// 64-byte aligned bytes: tile loads and the tile configuration want them.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct Line(pub(super) [u8; 64]);

thread_local! {
    /// A group pair's unpacked blocks, reused across calls.
    static SCRATCH: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// Computes row groups `g0..g1` of `p` for tokens `0..n_tokens`, writing `out[t *
/// out_stride + row]`: groups in pairs on AMX, over chunks of [`CHUNK_BYTES`]; the tokens
/// past the last whole 16-token tile go to the VNNI kernel.
///
/// # Safety
/// [`available`] must be true and [`supports`] `p.ty`; `acts` must hold `n_tokens` tokens of
/// `p.blocks_per_row` blocks; `out` must be valid for those writes, with no other thread
/// writing rows of groups `g0..g1`.
pub unsafe fn gemm_groups(
    p: &Packed,
    (g0, g1): (usize, usize),
    acts: &Q8Acts,
    n_tokens: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let fmt = format_code(p.ty).expect("a packed format");
    let tiled = n_tokens / TILE_TOKENS * TILE_TOKENS;
    let chunk_tokens = (CHUNK_BYTES / (p.blocks_per_row * QK) / TILE_TOKENS).max(1) * TILE_TOKENS;
    SCRATCH.with_borrow_mut(|scratch| {
        if fmt == Q4K || fmt == Q6K {
            let records = p.blocks_per_row / 8 * super::amx_kquant::SUPER_RECORD_BYTES;
            scratch.resize(records / 64, Line([0; 64]));
            super::amx_kquant::configure();
        } else {
            scratch.resize(p.blocks_per_row * RECORD_BYTES / 64, Line([0; 64]));
            configure(fmt == Q6S);
        }
        for c0 in (0..tiled).step_by(chunk_tokens) {
            let c1 = (c0 + chunk_tokens).min(tiled);
            for g in (g0..g1).step_by(2) {
                let pair = (g, g + 1 < g1);
                let rec = scratch.as_mut_ptr() as *mut u8;
                match fmt {
                    Q4_0 => pair_tiles::<Q4_0>(p, pair, acts, (c0, c1), rec, out, out_stride),
                    Q4_1 => pair_tiles::<Q4_1>(p, pair, acts, (c0, c1), rec, out, out_stride),
                    Q8_0 => pair_tiles::<Q8_0>(p, pair, acts, (c0, c1), rec, out, out_stride),
                    Q5_0 => pair_tiles::<Q5_0>(p, pair, acts, (c0, c1), rec, out, out_stride),
                    // Over the activations' K representation (`amx_kquant`).
                    Q4K => super::amx_kquant::pair_tiles::<Q4K>(
                        p,
                        pair,
                        acts,
                        (c0, c1),
                        rec,
                        out,
                        out_stride,
                    ),
                    Q6K => super::amx_kquant::pair_tiles::<Q6K>(
                        p,
                        pair,
                        acts,
                        (c0, c1),
                        rec,
                        out,
                        out_stride,
                    ),
                    _ => pair_tiles::<Q6S>(p, pair, acts, (c0, c1), rec, out, out_stride),
                }
            }
        }
        asm!("tilerelease", options(nostack, nomem));
    });
    if tiled < n_tokens {
        let isa = super::x86::Isa::Avx512Vnni;
        super::x86::gemm_groups(isa, p, (g0, g1), acts, tiled, n_tokens, out, out_stride);
    }
}

/// Loads this thread's tile configuration: tmm0/1 the 16 × 16 int32 products, tmm2/3 the
/// 16 tokens' activation bytes of one step, tmm4/5 the step's weight tile (NOTE 3). A step
/// is a block (32 bytes), or half a block for Q6S.
#[target_feature(enable = "avx512f")]
unsafe fn configure(half_blocks: bool) {
    let step_bytes: u16 = if half_blocks { 16 } else { 32 };
    let mut cfg = Line([0; 64]);
    cfg.0[0] = 1;
    let tiles: [(u16, u8); 6] = [
        (64, 16),
        (64, 16),
        (step_bytes, 16),
        (step_bytes, 16),
        (64, (step_bytes / 4) as u8),
        (64, (step_bytes / 4) as u8),
    ];
    for (i, (colsb, rows)) in tiles.into_iter().enumerate() {
        cfg.0[16 + 2 * i..18 + 2 * i].copy_from_slice(&colsb.to_le_bytes());
        cfg.0[48 + i] = rows;
    }
    asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
}

/// Unpacks group pair `(g, has_second)` into `rec` (one [`RECORD_BYTES`] record per block),
/// then computes its 16 rows for every 16-token tile of tokens `c0..c1`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn pair_tiles<const FMT: u8>(
    p: &Packed,
    (g, has_second): (usize, bool),
    acts: &Q8Acts,
    (c0, c1): (usize, usize),
    rec: *mut u8,
    out: *mut f32,
    out_stride: usize,
) {
    let bpr = p.blocks_per_row;
    let gbb = p.group_block_bytes();
    let first = p.group(g).as_ptr();
    let second = if has_second {
        Some(p.group(g + 1).as_ptr())
    } else {
        None
    };
    for b in 0..bpr {
        unpack_record::<FMT>((first, second), b, gbb, rec.add(b * RECORD_BYTES));
    }
    let mask = store_mask(p, g, has_second);
    for t in (c0..c1).step_by(TILE_TOKENS) {
        let acc = tile_products::<FMT>(bpr, acts, t, rec);
        for (m, a) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(out.add((t + m) * out_stride + g * GROUP_ROWS), mask, *a);
        }
    }
}

/// The lanes of a group pair's 16-row output vectors that are real rows of `p` (a missing
/// second group, or padding rows of the last group, are never stored).
pub(super) fn store_mask(p: &Packed, g: usize, has_second: bool) -> __mmask16 {
    let rows = if has_second {
        2 * GROUP_ROWS
    } else {
        GROUP_ROWS
    };
    let lanes = (p.rows - g * GROUP_ROWS).min(rows);
    if lanes == 16 {
        0xffff
    } else {
        (1u16 << lanes) - 1
    }
}

/// One block's record: the pair's unpacked weight vectors side by side (row k of the weight
/// tile is group one's vector k, then group two's; zeros without a second group), then both
/// groups' scales and mins (or second scales) as f32. `groups` are the pair's first group
/// blocks, `b` the block and `gbb` the group block's bytes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn unpack_record<const FMT: u8>(
    groups: (*const u8, Option<*const u8>),
    b: usize,
    gbb: usize,
    rec: *mut u8,
) {
    let (first, second) = (groups.0.add(b * gbb), groups.1.map(|s| s.add(b * gbb)));
    let v0 = unpack_group_block!(FMT, first);
    let v1 = match second {
        Some(s) => unpack_group_block!(FMT, s),
        None => [_mm256_setzero_si256(); 8],
    };
    for k in 0..8 {
        _mm256_store_si256(rec.add(64 * k) as *mut __m256i, v0[k]);
        _mm256_store_si256(rec.add(64 * k + 32) as *mut __m256i, v1[k]);
    }
    let scales = |at: usize| {
        let lo = _mm_loadu_si128(first.add(at) as *const __m128i);
        let hi = second.map_or(_mm_setzero_si128(), |s| {
            _mm_loadu_si128(s.add(at) as *const __m128i)
        });
        _mm512_cvtph_ps(_mm256_set_m128i(hi, lo))
    };
    _mm512_store_ps(rec.add(512) as *mut f32, scales(0));
    if FMT == Q4_1 || FMT == Q6S {
        _mm512_store_ps(rec.add(576) as *mut f32, scales(16));
    }
}

/// The 16 rows of the pair for tokens `t..t + 16`, as 16 vectors (one per token), with the
/// tile products of step s+1 issued before step s's scaling (NOTE 3).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn tile_products<const FMT: u8>(
    bpr: usize,
    acts: &Q8Acts,
    t: usize,
    rec: *const u8,
) -> [__m512; TILE_TOKENS] {
    let steps_per_block = if FMT == Q6S { 2 } else { 1 };
    let step_bytes = QK / steps_per_block;
    let n_steps = bpr * steps_per_block;
    // Uninitialised: every line is written by `tilestored` before it is read, and zeroing
    // 4 KiB a call was 8 % of a 512-token prefill.
    let mut products = std::mem::MaybeUninit::<[Line; 4 * TILE_TOKENS]>::uninit();
    let c = products.as_mut_ptr() as *mut u8;
    let qs = acts.qs.as_ptr() as *const u8;
    let a_stride = bpr * QK;
    let issue = |s: usize| {
        let (b, half) = (s / steps_per_block, s % steps_per_block);
        let a = qs.add((t * bpr + b) * QK + half * step_bytes);
        let w = rec.add(b * RECORD_BYTES + half * 256);
        let dst = c.add((s % 4) * TILE_TOKENS * 64);
        // SAFETY (both arms): the tiles were configured by `configure`; `a` reads 16 rows of
        // `step_bytes` at the token stride inside `acts.qs`, `w` one weight tile of the
        // record, `dst` 16 × 64 bytes of `products`.
        if s.is_multiple_of(2) {
            asm!("tileloadd tmm2, [{a} + {sa}*1]", "tileloadd tmm4, [{w} + {sw}*1]",
                 "tilezero tmm0", "tdpbsud tmm0, tmm2, tmm4", "tilestored [{c} + {sc}*1], tmm0",
                 a = in(reg) a, sa = in(reg) a_stride, w = in(reg) w, sw = in(reg) 64usize,
                 c = in(reg) dst, sc = in(reg) 64usize, options(nostack));
        } else {
            asm!("tileloadd tmm3, [{a} + {sa}*1]", "tileloadd tmm5, [{w} + {sw}*1]",
                 "tilezero tmm1", "tdpbsud tmm1, tmm3, tmm5", "tilestored [{c} + {sc}*1], tmm1",
                 a = in(reg) a, sa = in(reg) a_stride, w = in(reg) w, sw = in(reg) 64usize,
                 c = in(reg) dst, sc = in(reg) 64usize, options(nostack));
        }
    };
    let offset: i32 = match FMT {
        Q4_0 => 8,
        Q5_0 => 16,
        Q6S => 32,
        Q8_0 => 128,
        _ => 0,
    };
    // SAFETY (of the reads through these): `acts` holds tokens `t..t + 16` of `bpr` blocks
    // (the caller's contract), and `ab` below indexes only those.
    let (ad, as_, asum, asum_lo) = (
        acts.d.as_ptr(),
        acts.s.as_ptr(),
        acts.sum.as_ptr(),
        acts.sum_lo.as_ptr(),
    );
    let mut acc = [_mm512_setzero_ps(); TILE_TOKENS];
    issue(0);
    if n_steps > 1 {
        issue(1);
    }
    let mut scale = |s: usize| {
        let (b, half) = (s / steps_per_block, s % steps_per_block);
        let r = rec.add(b * RECORD_BYTES);
        // Q6S's second half takes the second scales (NOTE 1).
        let dw = _mm512_load_ps(r.add(512 + 64 * half) as *const f32);
        let mw = _mm512_load_ps(r.add(576) as *const f32);
        let src = c.add((s % 4) * TILE_TOKENS * 64) as *const __m512i;
        let ab0 = t * bpr + b;
        // Unrolled by hand, so that the 16 accumulators stay in registers (a loop over them
        // kept them on the stack: a load and a store per token and step).
        macro_rules! update {
            ($($m:literal)*) => {$({
                let ab = ab0 + $m * bpr;
                let mut isum = _mm512_load_si512(src.add($m));
                if offset != 0 {
                    let sum = if FMT != Q6S {
                        *asum.add(ab)
                    } else if half == 0 {
                        *asum_lo.add(ab)
                    } else {
                        *asum.add(ab) - *asum_lo.add(ab)
                    };
                    isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(offset * sum));
                }
                // The reference's `(d_w * d_a) * isum [+ m_w * s_a]`, unfused (NOTE 1).
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*ad.add(ab)));
                let mut x = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(isum));
                if FMT == Q4_1 {
                    x = _mm512_add_ps(x, _mm512_mul_ps(mw, _mm512_set1_ps(*as_.add(ab))));
                }
                acc[$m] = _mm512_add_ps(acc[$m], x);
            })*};
        }
        update!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
    };
    // Two steps' tile products in flight ahead of the one being scaled (NOTE 3).
    for s in 0..n_steps {
        if s + 2 < n_steps {
            issue(s + 2);
        }
        scale(s);
    }
    acc
}
