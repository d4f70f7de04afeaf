//! `pk_kv::kvzip_unit_pass_scores` on AVX2 with FMA (issue 37): the scoring of KVzip's
//! passes is a dense `queries × keys` product with a softmax per query row, about as much
//! arithmetic as the pass's own attention, and the portable loop (one dot product and one
//! libm `exp` at a time) took longer than the pass itself: 45 % of a 2,048-token SmolLM2
//! scoring run, with `exp` another 9 %.
//!
//! Keys are transposed once per (layer, KV head) so that eight keys' logits are one vector;
//! eight queries share each key load (their eight accumulators stay in registers); `exp`
//! is a vectorised polynomial (relative error about 2e-7; inputs are at most 0, the row's
//! maximum subtracted, and those below -87 count as e^-87 ≈ 1.6e-38, nothing beside a row
//! sum of at least 1).
//! Results agree with the portable path to float rounding, not bit for bit: the sums run
//! in a different order.

use std::arch::x86_64::*;

/// Queries per register block.
const QB: usize = 8;
/// Keys per vector.
const LANES: usize = 8;

/// Whether this CPU runs [`unit_pass_scores`].
fn available() -> bool {
    static YES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *YES.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

/// Whether this CPU runs [`super::kvzip_scores512::unit_pass_scores`] (AVX-512), unless
/// `PK_KVZIP_SCORES_AVX2=1` keeps the 256-bit kernel for a side-by-side measurement.
fn available_512() -> bool {
    static YES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *YES.get_or_init(|| {
        // The switch is read first, so that a bad value is refused on every CPU.
        super::env_switch("PK_KVZIP_SCORES_AVX2") != Some(true)
            && super::x86::has_avx512()
            && is_x86_feature_detected!("f16c")
            && is_x86_feature_detected!("fma")
    })
}

/// KVzip's scores of one (layer, KV head) from one pass, with the contract of
/// `pk_kv::kvzip_unit_pass_scores` (the portable reference): `keys` are the span's (`n_sink`
/// sinks, the chunk, the pass's `n_queries` tokens), `queries` the KV head's query heads'
/// pass queries, and each of `chunk_scores` becomes the largest causal softmax probability
/// any query gives its key. Returns false, touching nothing, on a CPU without AVX2 and
/// FMA (the caller then runs the reference).
pub fn kvzip_max_attention(
    keys: &[f32],
    queries: &[f32],
    head_dim: usize,
    n_queries: usize,
    n_sink: usize,
    chunk_scores: &mut [f32],
) -> bool {
    if available_512() {
        // SAFETY: AVX-512F/BW/VL, F16C and FMA were detected.
        unsafe {
            super::kvzip_scores512::unit_pass_scores(
                keys,
                queries,
                head_dim,
                n_queries,
                n_sink,
                chunk_scores,
            )
        };
        return true;
    }
    if !available() {
        return false;
    }
    // SAFETY: AVX2 and FMA were detected.
    unsafe { unit_pass_scores(keys, queries, head_dim, n_queries, n_sink, chunk_scores) };
    true
}

/// KVzip's scores of one (layer, KV head) from the chunk's keys alone and each query row's
/// log-sum-exp from the pass's own attention (`kvzip_scores512::unit_pass_scores_lse`:
/// valid when the pass attended exactly the span, one chunk from the first token). Returns
/// false, touching nothing, on a CPU without the AVX-512 kernel (or with
/// `PK_KVZIP_SCORES_AVX2=1`): the caller then scores the whole span.
pub fn kvzip_max_attention_lse(
    chunk_keys: &[f32],
    queries: &[f32],
    lse: &[f32],
    head_dim: usize,
    chunk_scores: &mut [f32],
) -> bool {
    if !available_512() {
        return false;
    }
    // SAFETY: AVX-512F/BW/VL, F16C and FMA were detected.
    unsafe {
        super::kvzip_scores512::unit_pass_scores_lse(
            chunk_keys,
            queries,
            lse,
            head_dim,
            chunk_scores,
        )
    };
    true
}

/// See [`kvzip_max_attention`].
///
/// # Safety
/// The CPU must have AVX2 and FMA ([`available`]).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn unit_pass_scores(
    keys: &[f32],
    queries: &[f32],
    head_dim: usize,
    n_queries: usize,
    n_sink: usize,
    chunk_scores: &mut [f32],
) {
    let n_span = keys.len() / head_dim;
    let n_fixed = n_sink + chunk_scores.len();
    let padded = n_span.div_ceil(LANES) * LANES;
    // kt[d][j]: key j's element d, zero past the span.
    let mut kt = vec![0f32; head_dim * padded];
    for (j, k) in keys.chunks_exact(head_dim).enumerate() {
        for (d, &x) in k.iter().enumerate() {
            kt[d * padded + j] = x;
        }
    }
    let scale = 1.0 / (head_dim as f32).sqrt();
    chunk_scores.fill(0.0);
    let n_rows = queries.len() / head_dim;
    let mut logits = vec![0f32; QB * padded];
    for r0 in (0..n_rows).step_by(QB) {
        let rows = (n_rows - r0).min(QB);
        let visible = |r: usize| n_fixed + (r0 + r) % n_queries + 1;
        let widest = (0..rows).map(visible).max().unwrap_or(0);
        let q = &queries[r0 * head_dim..(r0 + rows) * head_dim];
        block_logits(&kt, padded, q, head_dim, widest, scale, &mut logits);
        for r in 0..rows {
            let row = &mut logits[r * padded..r * padded + visible(r)];
            let sum = exp_in_place(row);
            for (s, &e) in chunk_scores.iter_mut().zip(&row[n_sink..n_fixed]) {
                *s = s.max(e / sum);
            }
        }
    }
}

/// `logits[r][j] = scale · q_r · k_j` for the block's rows and keys `0..widest` (rounded up
/// to whole vectors), eight keys a vector and every row's accumulator in a register.
#[target_feature(enable = "avx2,fma")]
unsafe fn block_logits(
    kt: &[f32],
    padded: usize,
    q: &[f32],
    head_dim: usize,
    widest: usize,
    scale: f32,
    logits: &mut [f32],
) {
    let rows = q.len() / head_dim;
    let vscale = _mm256_set1_ps(scale);
    for j0 in (0..widest).step_by(LANES) {
        let mut acc = [_mm256_setzero_ps(); QB];
        for d in 0..head_dim {
            let k = _mm256_loadu_ps(kt.as_ptr().add(d * padded + j0));
            for (r, a) in acc.iter_mut().enumerate().take(rows) {
                let qd = _mm256_broadcast_ss(&*q.as_ptr().add(r * head_dim + d));
                *a = _mm256_fmadd_ps(qd, k, *a);
            }
        }
        for (r, a) in acc.iter().enumerate().take(rows) {
            _mm256_storeu_ps(
                logits.as_mut_ptr().add(r * padded + j0),
                _mm256_mul_ps(*a, vscale),
            );
        }
    }
}

/// `row[j] = exp(row[j] - max(row))`, returning their sum.
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_in_place(row: &mut [f32]) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let vmax = _mm256_set1_ps(max);
    let mut vsum = _mm256_setzero_ps();
    let mut chunks = row.chunks_exact_mut(LANES);
    for c in &mut chunks {
        let e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), vmax));
        _mm256_storeu_ps(c.as_mut_ptr(), e);
        vsum = _mm256_add_ps(vsum, e);
    }
    let mut lanes = [0f32; LANES];
    _mm256_storeu_ps(lanes.as_mut_ptr(), vsum);
    let mut sum: f32 = lanes.iter().sum();
    for x in chunks.into_remainder() {
        *x = (*x - max).exp();
        sum += *x;
    }
    sum
}

/// `e^x` for `x <= 0` (Cephes' polynomial after `x = n ln 2 + r`, |r| <= ln 2 / 2).
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_ps(x: __m256) -> __m256 {
    let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        5e-1,
    ] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let r2 = _mm256_mul_ps(r, r);
    let e = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
    let pow2n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    )));
    _mm256_mul_ps(e, pow2n)
}
