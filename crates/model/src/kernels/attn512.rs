//! Attention for a few query rows of one KV head, straight from the paged K/V store (AVX-512).
//!
//! The kernel walks a sequence's block table and reads each block's K and V in place, in
//! the store's own precision (f16, widened with `vcvtph2ps`, or f32): nothing is gathered,
//! converted into scratch or allocated. K is stored transposed per block (`K[d][slot]`, see
//! `kv_store`), so the scores of 16 keys for one query row are the 16 lanes of one vector,
//! `s += q[d] · K[d][slot..slot + 16]`, and each loaded K vector serves up to `R` rows (the
//! query heads of a GQA group, or several tokens of a prefill tile). The rows' online-softmax
//! state (running max, running sum, `head_dim` accumulators) stays in registers for the
//! whole walk, so a 64-wide head with 4 rows uses 16 of the 32 vector registers.
//!
//! NOTE 1 (batch invariance): a row's arithmetic depends only on its query, its range of
//! visible keys and the K/V, never on the other rows of the call or on `R`. Keys are taken
//! in chunks of 16 slots aligned to block starts; a chunk a row cannot see is a no-op for
//! it (its softmax state is left alone; its accumulators get `+ 0·v`, which changes at most
//! the sign of a zero). So a token's attention has the same bits in a prefill tile as
//! alone in a decode step, which the engine's teacher-forcing and batching tests rely on.
//! Reductions are written as fixed shuffle trees for the same reason.
//!
//! NOTE 2 (software pipelining): a row's online-softmax step for one chunk is a chain of
//! dependent operations (a reduction, two `exp`s, a horizontal sum) that the out-of-order
//! window cannot overlap with the next chunk's scores, which are hundreds of instructions
//! further on. So the walk takes `GROUP_CHUNKS` chunks at a time: first all their scores,
//! then every row's softmax steps over them (independent across rows and chunks but for
//! the running max and sum), then their value updates. Each row still sees exactly the
//! same operations in the same order, so the results have the same bits as a chunk-by-chunk
//! walk (checked against the previous kernel on random K/V: 0 of 36,864 outputs differed);
//! measured 1.04–1.08× faster (`hit_bench`'s shapes: 72 rows or 3 rows × 1,560 keys).
//!
//! NOTE 3 (key ranges): a row's arithmetic is a sequence of per-chunk steps in key order,
//! and nothing carries from one chunk to the next but its softmax state (running max, sum
//! and accumulators). [`attend_range`] runs the steps of one range of chunks and leaves
//! that state in memory (f32 stores and loads are exact), so a walk cut into ranges has
//! the bits of one uninterrupted walk. Long prefill uses it to take a range of keys
//! through every row of a tile while the range's K/V stay in L2 (`attention::tile`).
//!
//! NOTE 4 (independent chains): a chunk's scores are two FMA chains per row (even and odd `d`),
//! so with 2 rows (head_dim 128) one chunk kept 4 chains of a 4-cycle FMA in flight, half of
//! what two FMA ports need. Stage 1 takes `SCORE_CHUNKS` chunks in one pass over `d`: more
//! independent chains, and each chunk's own operations are unchanged, so the bits are too
//! (docs/results/benchmarks-history.md, "Issue 39 on an Intel Xeon with AMX").

use std::arch::x86_64::*;

/// One query row: `out = softmax(q · Kᵀ · scale) · V` over stored keys
/// `first_visible..n_visible` (`first_visible` is 0 but in a sliding window).
#[derive(Clone, Copy)]
pub struct Row {
    pub q: *const f32,
    pub out: *mut f32,
    pub first_visible: usize,
    pub n_visible: usize,
    /// Where to write the row's log-sum-exp of its scaled scores, `ln Σ_j exp(q·k_j ·
    /// scale)` (KVzip's scoring reads it, `kernels::kvzip_scores512`); null: nowhere.
    pub lse: *mut f32,
}

impl Row {
    /// A row with nothing to read or write yet.
    pub const EMPTY: Row = Row {
        q: std::ptr::null(),
        out: std::ptr::null_mut(),
        first_visible: 0,
        n_visible: 0,
        lse: std::ptr::null_mut(),
    };

    /// Writes the log-sum-exp from a row's final softmax state, where it is wanted.
    ///
    /// # Safety
    /// `lse` is null or valid for a write.
    unsafe fn write_lse(&self, m: f32, l: f32) {
        if !self.lse.is_null() {
            *self.lse = m + l.ln();
        }
    }
}

/// One KV head of one layer, as the store lays it out.
pub struct HeadKv<'a> {
    /// Start of the layer's K and V arrays (`f16` or `f32` elements, per `f16`; or the
    /// quantised regions `attn512q` reads, where `f16` is ignored).
    pub k: *const u8,
    pub v: *const u8,
    pub f16: bool,
    pub block_table: &'a [u32],
    pub n_kv_heads: usize,
    pub kv_head: usize,
    pub block_size: usize,
    pub head_dim: usize,
    /// Prefetch blocks ahead of the walk. Worth it on the first pass over a head's blocks
    /// (a decode step reads each block once, from DRAM, and blocks are scattered, which
    /// defeats the hardware prefetcher); wasted instructions on later passes, which hit L2.
    pub prefetch: bool,
}

/// Whether [`attend`] handles this head size on this CPU.
pub fn supported(head_dim: usize) -> bool {
    matches!(head_dim, 64 | 128 | 256)
        && super::x86::has_avx512()
        && is_x86_feature_detected!("f16c")
        && is_x86_feature_detected!("fma")
}

/// Most rows per [`attend`] call: their accumulators must fit in registers.
pub fn max_rows(head_dim: usize) -> usize {
    match head_dim {
        0..=64 => 4,
        65..=128 => 2,
        _ => 1,
    }
}

/// Computes every row (`1..=max_rows(head_dim)` of them).
///
/// # Safety
/// `supported(kv.head_dim)` must hold; every row's `q` and `out` must point at `head_dim`
/// floats; the block table must cover each row's visible keys, and `k`/`v` the blocks in it.
pub unsafe fn attend(kv: &HeadKv, rows: &[Row], scale: f32) {
    attend_range(kv, rows, scale, 0..usize::MAX, None);
}

/// A row's online-softmax state between two key ranges (NOTE 3).
#[derive(Clone)]
pub struct RowState {
    pub m: f32,
    pub l: f32,
    pub acc: [f32; 256],
}

impl Default for RowState {
    fn default() -> Self {
        RowState {
            m: f32::NEG_INFINITY,
            l: 0.0,
            acc: [0.0; 256],
        }
    }
}

/// Like [`attend`], over the stored keys of `keys` only (both ends multiples of 16 from a
/// block start), continuing from `state` and leaving the rows' state there instead of
/// writing their outputs (NOTE 3); with `state` `None`, from scratch to the outputs.
///
/// # Safety
/// As for [`attend`]; `state` has one entry per row.
pub unsafe fn attend_range(
    kv: &HeadKv,
    rows: &[Row],
    scale: f32,
    keys: std::ops::Range<usize>,
    state: Option<&mut [RowState]>,
) {
    macro_rules! go {
        ($hd16:literal, $r:literal) => {{
            let r: &[Row; $r] = rows.try_into().unwrap();
            let st = state.map(|s| <&mut [RowState; $r]>::try_from(s).unwrap());
            if kv.f16 {
                kernel::<$hd16, $r, true>(kv, r, scale, keys, st)
            } else {
                kernel::<$hd16, $r, false>(kv, r, scale, keys, st)
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

/// Writes each row's output from its final state: `acc · (1 / l)`, the operations the
/// kernel's own epilogue does.
///
/// # Safety
/// As for [`attend`]: `supported(head_dim)`, each row's `out` holds `head_dim` floats.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
pub unsafe fn finish(rows: &[Row], state: &[RowState], head_dim: usize) {
    for (row, st) in rows.iter().zip(state) {
        row.write_lse(st.m, st.l);
        let inv = _mm512_set1_ps(1.0 / st.l);
        for i in 0..head_dim / 16 {
            let a = _mm512_loadu_ps(st.acc.as_ptr().add(16 * i));
            _mm512_storeu_ps(row.out.add(16 * i), _mm512_mul_ps(a, inv));
        }
    }
}

/// Widens `n` f16 values (a multiple of 16) at `src` to f32 at `dst`, exactly.
///
/// # Safety
/// The CPU has AVX-512 F and F16C; `src` holds `n` values and `dst` room for them.
#[target_feature(enable = "avx512f,f16c")]
pub unsafe fn widen_f16(src: *const u16, dst: *mut f32, n: usize) {
    for i in (0..n).step_by(16) {
        let h = _mm256_loadu_si256(src.add(i) as *const __m256i);
        _mm512_storeu_ps(dst.add(i), _mm512_cvtph_ps(h));
    }
}

/// Chunks of 16 keys whose scores are computed before any of their softmax updates, and
/// whose softmax updates all come before their value updates (NOTE 2).
const GROUP_CHUNKS: usize = 4;

/// Chunks whose scores are computed in one pass over `d` (NOTE 4).
const SCORE_CHUNKS: usize = 2;

// Indices such as `j` and `i` address several parallel register arrays and pointer
// offsets (`vrows[g].add(j * hd * esz)`, `out.add(16 * i)`) at once, so the index form
// is clearer than zipped iterators in this hot kernel.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
unsafe fn kernel<const HD16: usize, const R: usize, const F16: bool>(
    kv: &HeadKv,
    rows: &[Row; R],
    scale: f32,
    keys: std::ops::Range<usize>,
    state: Option<&mut [RowState; R]>,
) {
    let hd = HD16 * 16;
    let bs = kv.block_size;
    let esz = if F16 { 2 } else { 4 };
    // 16 elements at `p + i` (in elements); lanes outside `mask` read as 0 from no memory.
    // Macros rather than closures, so that they are compiled with this function's features.
    macro_rules! load {
        ($p:expr, $i:expr, $mask:expr) => {
            if F16 {
                _mm512_cvtph_ps(_mm256_maskz_loadu_epi16($mask, ($p as *const i16).add($i)))
            } else {
                _mm512_maskz_loadu_ps($mask, ($p as *const f32).add($i))
            }
        };
        ($p:expr, $i:expr) => {
            if F16 {
                _mm512_cvtph_ps(_mm256_loadu_si256(
                    ($p as *const i16).add($i) as *const __m256i
                ))
            } else {
                _mm512_loadu_ps(($p as *const f32).add($i))
            }
        };
    }

    // Queries copied so that their broadcasts come from one small array; the scale is
    // applied to the dot products, as llama.cpp's `soft_max_ext` does.
    let mut qs = [[0f32; 256]; R];
    for (qr, row) in qs.iter_mut().zip(rows) {
        std::ptr::copy_nonoverlapping(row.q, qr.as_mut_ptr(), hd);
    }
    let scale_v = _mm512_set1_ps(scale);
    let mut m = [f32::NEG_INFINITY; R];
    let mut l = [0f32; R];
    let mut acc = [[_mm512_setzero_ps(); HD16]; R];
    if let Some(st) = state.as_deref() {
        for r in 0..R {
            (m[r], l[r]) = (st[r].m, st[r].l);
            for i in 0..HD16 {
                acc[r][i] = _mm512_loadu_ps(st[r].acc.as_ptr().add(16 * i));
            }
        }
    }
    // Per chunk of the current group: its first stored index, width and V rows; per row
    // and chunk: the scaled scores, then (stage 2) the weights, and the rescale factor.
    let mut bases = [0usize; GROUP_CHUNKS];
    let mut widths = [0usize; GROUP_CHUNKS];
    let mut vrows = [std::ptr::null::<u8>(); GROUP_CHUNKS];
    let mut kbs = [std::ptr::null::<u8>(); GROUP_CHUNKS];
    let mut wmasks: [__mmask16; GROUP_CHUNKS] = [0; GROUP_CHUNKS];
    let mut j_max = [0usize; GROUP_CHUNKS];
    let mut sp = [[[0f32; 16]; GROUP_CHUNKS]; R];
    let mut corr = [[0f32; GROUP_CHUNKS]; R];
    let mut sees = [[false; GROUP_CHUNKS]; R];
    let n_max = rows.iter().map(|r| r.n_visible).max().unwrap_or(0);
    // Chunks wholly before every row's window are skipped (a sliding window's start).
    let first_min = rows.iter().map(|r| r.first_visible).min().unwrap_or(0);

    let n_blocks = n_max.div_ceil(bs);
    let block_bytes = bs * hd * esz;
    let block_at = |b: usize| {
        (*kv.block_table.get_unchecked(b) as usize * kv.n_kv_heads + kv.kv_head) * block_bytes
    };
    let chunks_per_block = bs.div_ceil(16);
    let chunk_of = |key: usize| (key / bs) * chunks_per_block + (key % bs) / 16;
    let n_chunks = (n_blocks * chunks_per_block).min(chunk_of(keys.end.min(n_blocks * bs)));
    let mut c = chunk_of(first_min).max(chunk_of(keys.start));
    while c < n_chunks {
        // Stage 1a: the group's chunks.
        let mut n_group = 0;
        while n_group < GROUP_CHUNKS && c < n_chunks {
            let (b, c0) = (c / chunks_per_block, (c % chunks_per_block) * 16);
            c += 1;
            if b * bs + c0 >= n_max {
                continue;
            }
            if c0 == 0 && kv.prefetch {
                // Two blocks ahead: about one DRAM latency of work at decode's 3–4 rows.
                for ahead in if b * bs <= first_min { 1..3 } else { 2..3 } {
                    if b + ahead < n_blocks {
                        let off = block_at(b + ahead);
                        for line in (0..block_bytes).step_by(64) {
                            _mm_prefetch::<_MM_HINT_T0>(kv.k.add(off + line) as *const i8);
                            _mm_prefetch::<_MM_HINT_T0>(kv.v.add(off + line) as *const i8);
                        }
                    }
                }
            }
            let off = block_at(b);
            let w = (bs - c0).min(16);
            kbs[n_group] = kv.k.add(off + c0 * esz);
            wmasks[n_group] = if w == 16 { 0xFFFF } else { (1 << w) - 1 };
            bases[n_group] = b * bs + c0;
            widths[n_group] = w;
            vrows[n_group] = kv.v.add(off + c0 * hd * esz);
            n_group += 1;
        }
        // Stage 1b: the chunks' scores, `SCORE_CHUNKS` chunks at a time (NOTE 4).
        let mut g0 = 0;
        while g0 < n_group {
            let np = (n_group - g0).min(SCORE_CHUNKS);
            // Two accumulators per row and chunk (even and odd d) halve the FMA chain.
            let mut s0 = [[_mm512_setzero_ps(); R]; SCORE_CHUNKS];
            let mut s1 = [[_mm512_setzero_ps(); R]; SCORE_CHUNKS];
            macro_rules! scores {
                ($np:expr) => {
                    for d in (0..hd).step_by(2) {
                        for x in 0..$np {
                            let (kb, wm) = (kbs[g0 + x], wmasks[g0 + x]);
                            let k0 = load!(kb, d * bs, wm);
                            let k1 = load!(kb, (d + 1) * bs, wm);
                            for r in 0..R {
                                s0[x][r] = _mm512_fmadd_ps(_mm512_set1_ps(qs[r][d]), k0, s0[x][r]);
                                s1[x][r] =
                                    _mm512_fmadd_ps(_mm512_set1_ps(qs[r][d + 1]), k1, s1[x][r]);
                            }
                        }
                    }
                };
            }
            if np == SCORE_CHUNKS {
                scores!(SCORE_CHUNKS);
            } else {
                scores!(np);
            }
            for x in 0..np {
                for r in 0..R {
                    _mm512_storeu_ps(
                        sp[r][g0 + x].as_mut_ptr(),
                        _mm512_mul_ps(_mm512_add_ps(s0[x][r], s1[x][r]), scale_v),
                    );
                }
            }
            g0 += np;
        }
        // Stage 2: each row's online softmax over the chunks it sees, in order (NOTE 1).
        for g in 0..n_group {
            j_max[g] = 0;
            for r in 0..R {
                // Lanes lo..nv of the chunk are this row's keys.
                let nv = rows[r].n_visible.saturating_sub(bases[g]).min(widths[g]);
                let lo = rows[r].first_visible.saturating_sub(bases[g]).min(nv);
                sees[r][g] = nv > lo;
                if nv <= lo {
                    sp[r][g] = [0.0; 16];
                    continue;
                }
                j_max[g] = j_max[g].max(nv);
                let upto: u32 = if nv == 16 { 0xFFFF } else { (1 << nv) - 1 };
                let vmask: __mmask16 = (upto & !((1u32 << lo) - 1)) as u16;
                let s = _mm512_loadu_ps(sp[r][g].as_ptr());
                let m_new = m[r].max(_mm512_mask_reduce_max_ps(vmask, s));
                let cr = _mm512_cvtss_f32(exp512(_mm512_set1_ps(m[r] - m_new)));
                let pv =
                    _mm512_maskz_mov_ps(vmask, exp512(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
                l[r] = l[r] * cr + hsum(pv);
                corr[r][g] = cr;
                _mm512_storeu_ps(sp[r][g].as_mut_ptr(), pv);
                m[r] = m_new;
            }
        }
        // Stage 3: per chunk, rescale then acc += p[j] · V[j]; each V vector serves every row.
        for g in 0..n_group {
            for r in 0..R {
                if sees[r][g] {
                    let cv = _mm512_set1_ps(corr[r][g]);
                    for a in acc[r].iter_mut() {
                        *a = _mm512_mul_ps(*a, cv);
                    }
                }
            }
            for j in 0..j_max[g] {
                let vrow = vrows[g].add(j * hd * esz);
                for i in 0..HD16 {
                    let vv = load!(vrow, 16 * i);
                    for r in 0..R {
                        acc[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(sp[r][g][j]), vv, acc[r][i]);
                    }
                }
            }
        }
    }
    if let Some(st) = state {
        for r in 0..R {
            (st[r].m, st[r].l) = (m[r], l[r]);
            for i in 0..HD16 {
                _mm512_storeu_ps(st[r].acc.as_mut_ptr().add(16 * i), acc[r][i]);
            }
        }
        return;
    }
    for r in 0..R {
        rows[r].write_lse(m[r], l[r]);
        let inv = _mm512_set1_ps(1.0 / l[r]);
        for i in 0..HD16 {
            _mm512_storeu_ps(rows[r].out.add(16 * i), _mm512_mul_ps(acc[r][i], inv));
        }
    }
}

/// Sum of 16 lanes in a fixed order (halves, then quarters, …).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
pub(crate) unsafe fn hsum(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let x = _mm256_add_ps(lo, hi);
    let x = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
    let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)))
}

/// `e^x` (Cephes' `expf`: range reduction by ln 2, degree-5 polynomial, then `scalef`),
/// within about 2 ulp; `exp(0)` is exactly 1 and inputs below -87.3 give about 1e-38.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
pub(crate) unsafe fn exp512(x: __m512) -> __m512 {
    let x = _mm512_max_ps(
        _mm512_min_ps(x, _mm512_set1_ps(88.376_26)),
        _mm512_set1_ps(-87.336_55),
    );
    let fx =
        _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(_mm512_fmadd_ps(
            x,
            _mm512_set1_ps(std::f32::consts::LOG2_E),
            _mm512_set1_ps(0.5),
        ));
    let x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693_359_4), x);
    let x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.121_944_4e-4), x);
    let mut y = _mm512_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(c));
    }
    let y = _mm512_add_ps(
        _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x),
        _mm512_set1_ps(1.0),
    );
    _mm512_scalef_ps(y, fx)
}
