//! KVzip's pass scoring on AVX-512 (issue 37): the 256-bit kernel in `kvzip_scores.rs` with
//! twice the keys a vector and the bookkeeping vectorised too.
//!
//! Where the time went in the 256-bit kernel (`perf` of a 2,048-token SmolLM2 pass): the
//! logits loop checked at every multiply-add whether the block's row existed (a partial
//! last block shares the loop), and the row maximum, the division by the row sum and the
//! running maximum of the chunk's scores were scalar loops over every logit. Here a block
//! is always eight rows (the queries are copied, pre-scaled by `1/sqrt(head_dim)`, into a
//! buffer padded with zero rows, whose logits nobody reads), a block covers 32 keys in two
//! vectors so that each broadcast query element feeds two multiply-adds, each row's maximum
//! over its own keys is taken from the accumulators as they are stored, and `exp`, the sum
//! and the scores' update run 16 lanes at a time.
//!
//! Results agree with the portable reference to float rounding, not bit for bit: the
//! sums run in a different order, the scale multiplies the query instead of the logit, and
//! a probability is `e · (1/sum)` instead of `e / sum`.

use std::arch::x86_64::*;

use super::attn512::exp512;

/// Query rows per register block.
const QB: usize = 8;
/// Keys per register block (two vectors).
const KB: usize = 32;

/// See `kvzip_scores::kvzip_max_attention` (the contract of `pk_kv::kvzip_unit_pass_scores`).
///
/// # Safety
/// The CPU must have AVX-512F, AVX-512BW, AVX-512VL, F16C and FMA (`exp512`'s features).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
pub(super) unsafe fn unit_pass_scores(
    keys: &[f32],
    queries: &[f32],
    head_dim: usize,
    n_queries: usize,
    n_sink: usize,
    chunk_scores: &mut [f32],
) {
    SCRATCH.with_borrow_mut(|sc| {
        score_with(sc, keys, queries, head_dim, n_queries, n_sink, chunk_scores)
    });
}

/// A rayon worker's buffers, kept between (layer, KV head) units: allocating them afresh
/// (megabytes each) cost every unit a round of page faults and zeroing.
#[derive(Default)]
struct Scratch {
    /// `kt[d][j]`: key j's element d, zero past the span.
    kt: Vec<f32>,
    /// The queries scaled by `1/sqrt(head_dim)`, then zero rows up to whole blocks.
    q: Vec<f32>,
    /// One block's rows of logits, then of `exp`.
    logits: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// [`unit_pass_scores`] with the worker's buffers.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
unsafe fn score_with(
    sc: &mut Scratch,
    keys: &[f32],
    queries: &[f32],
    head_dim: usize,
    n_queries: usize,
    n_sink: usize,
    chunk_scores: &mut [f32],
) {
    let n_span = keys.len() / head_dim;
    let n_fixed = n_sink + chunk_scores.len();
    let padded = n_span.div_ceil(KB) * KB;
    let (kt, q, logits) = transposed_and_scaled(sc, keys, queries, head_dim, padded);
    let n_rows = queries.len() / head_dim;
    chunk_scores.fill(0.0);
    for r0 in (0..n_rows).step_by(QB) {
        let rows = (n_rows - r0).min(QB);
        let visible = |r: usize| n_fixed + (r0 + r) % n_queries + 1;
        let block = &q[r0 * head_dim..(r0 + QB) * head_dim];
        let mut limits = [0usize; QB];
        for (r, l) in limits.iter_mut().enumerate().take(rows) {
            *l = visible(r);
        }
        let maxima = block_logits(kt, padded, block, head_dim, &limits, logits);
        for r in 0..rows {
            let row = &mut logits[r * padded..r * padded + visible(r)];
            let inv_sum = 1.0 / exp_in_place(row, maxima[r]);
            raise_scores(chunk_scores, &row[n_sink..n_fixed], inv_sum);
        }
    }
}

/// KVzip's scores of one (layer, KV head) from a pass whose softmax runs over every key the
/// forward pass attended (one chunk from the context's first token, so no separate sinks):
/// the forward's attention gave each query row its log-sum-exp (`lse`, `[row]` in the order
/// of `queries`' rows, in units of the scaled scores), so the probabilities of the chunk's
/// keys are `exp(q·k/√d − lse)` and neither the pass's own keys nor the row sums need
/// computing: about a third fewer logits and no second `exp` pass. `keys` holds the
/// chunk's keys only; each of `chunk_scores` becomes the largest probability any row gives
/// its key (every pass token follows the chunk, so every row sees every chunk key).
///
/// # Safety
/// As for [`unit_pass_scores`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
pub(super) unsafe fn unit_pass_scores_lse(
    keys: &[f32],
    queries: &[f32],
    lse: &[f32],
    head_dim: usize,
    chunk_scores: &mut [f32],
) {
    SCRATCH.with_borrow_mut(|sc| score_with_lse(sc, keys, queries, lse, head_dim, chunk_scores));
}

/// [`unit_pass_scores_lse`] with the worker's buffers.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
unsafe fn score_with_lse(
    sc: &mut Scratch,
    keys: &[f32],
    queries: &[f32],
    lse: &[f32],
    head_dim: usize,
    chunk_scores: &mut [f32],
) {
    let n_chunk = keys.len() / head_dim;
    debug_assert_eq!(n_chunk, chunk_scores.len());
    let padded = n_chunk.div_ceil(KB) * KB;
    let (kt, q, logits) = transposed_and_scaled(sc, keys, queries, head_dim, padded);
    let n_rows = queries.len() / head_dim;
    debug_assert_eq!(lse.len(), n_rows);
    chunk_scores.fill(0.0);
    for r0 in (0..n_rows).step_by(QB) {
        let rows = (n_rows - r0).min(QB);
        let mut limits = [0usize; QB];
        limits[..rows].fill(n_chunk);
        let block = &q[r0 * head_dim..(r0 + QB) * head_dim];
        block_logits(kt, padded, block, head_dim, &limits, logits);
        for r in 0..rows {
            let row = &logits[r * padded..r * padded + n_chunk];
            raise_scores_exp(chunk_scores, row, lse[r0 + r]);
        }
    }
}

/// `scores[j] = max(scores[j], exp(logits[j] − lse))`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
unsafe fn raise_scores_exp(scores: &mut [f32], logits: &[f32], lse: f32) {
    let (n, s, lp) = (scores.len(), scores.as_mut_ptr(), logits.as_ptr());
    let vlse = _mm512_set1_ps(lse);
    for i in (0..n).step_by(16) {
        let m = lanes(i, n);
        let p = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, lp.add(i)), vlse));
        let old = _mm512_maskz_loadu_ps(m, s.add(i));
        _mm512_mask_storeu_ps(s.add(i), m, _mm512_max_ps(old, p));
    }
}

/// Fills the scratch's `kt` with `keys` transposed (`[d][j]`, zero from the last key to
/// `padded`) and its `q` with `queries` scaled by `1/sqrt(head_dim)` and zero rows up to a
/// whole block; returns both, and a block's rows of logits.
fn transposed_and_scaled<'s>(
    sc: &'s mut Scratch,
    keys: &[f32],
    queries: &[f32],
    head_dim: usize,
    padded: usize,
) -> (&'s mut [f32], &'s mut [f32], &'s mut [f32]) {
    let n_keys = keys.len() / head_dim;
    let kt = sized(&mut sc.kt, head_dim * padded);
    for (j, k) in keys.chunks_exact(head_dim).enumerate() {
        for (d, &x) in k.iter().enumerate() {
            kt[d * padded + j] = x;
        }
    }
    for row in kt.chunks_exact_mut(padded) {
        row[n_keys..].fill(0.0);
    }
    let n_rows = queries.len() / head_dim;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let q = sized(&mut sc.q, n_rows.div_ceil(QB) * QB * head_dim);
    for (to, &x) in q.iter_mut().zip(queries) {
        *to = x * scale;
    }
    q[queries.len()..].fill(0.0);
    (kt, q, sized(&mut sc.logits, QB * padded))
}

/// The first `len` elements of `buf`, grown (never shrunk) to hold them; their values are
/// whatever the last unit left.
fn sized(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    &mut buf[..len]
}

/// `logits[r][j] = q_r · k_j` for the block's eight rows and keys `0..max(limits)` (rounded
/// up to whole blocks of 32), sixteen accumulators in registers; returns each row's largest
/// logit among its own keys `0..limits[r]` (negative infinity for a row with no keys), so
/// that the softmax needs no separate pass for its maximum.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
unsafe fn block_logits(
    kt: &[f32],
    padded: usize,
    q: &[f32],
    head_dim: usize,
    limits: &[usize; QB],
    logits: &mut [f32],
) -> [f32; QB] {
    debug_assert!(q.len() == QB * head_dim && kt.len() == head_dim * padded);
    let (kp, qp, lp) = (kt.as_ptr(), q.as_ptr(), logits.as_mut_ptr());
    let widest = limits.iter().copied().max().unwrap_or(0);
    let mut vmax = [_mm512_set1_ps(f32::NEG_INFINITY); QB];
    for j0 in (0..widest).step_by(KB) {
        let mut lo = [_mm512_setzero_ps(); QB];
        let mut hi = [_mm512_setzero_ps(); QB];
        for d in 0..head_dim {
            let k = kp.add(d * padded + j0);
            let (k0, k1) = (_mm512_loadu_ps(k), _mm512_loadu_ps(k.add(16)));
            for r in 0..QB {
                let qd = _mm512_set1_ps(*qp.add(r * head_dim + d));
                lo[r] = _mm512_fmadd_ps(qd, k0, lo[r]);
                hi[r] = _mm512_fmadd_ps(qd, k1, hi[r]);
            }
        }
        for r in 0..QB {
            let out = lp.add(r * padded + j0);
            _mm512_storeu_ps(out, lo[r]);
            _mm512_storeu_ps(out.add(16), hi[r]);
            let own = limits[r].saturating_sub(j0);
            if own > 0 {
                let m = &mut vmax[r];
                *m = _mm512_mask_max_ps(*m, lanes(0, own), *m, lo[r]);
                *m = _mm512_mask_max_ps(*m, lanes(16.min(own), own), *m, hi[r]);
            }
        }
    }
    let mut maxima = [f32::NEG_INFINITY; QB];
    for (m, v) in maxima.iter_mut().zip(vmax) {
        *m = _mm512_reduce_max_ps(v);
    }
    maxima
}

/// The lanes of a 16-wide step starting at `i` that lie inside `0..n` (none past `n`).
fn lanes(i: usize, n: usize) -> __mmask16 {
    let k = n.saturating_sub(i).min(16) as u32;
    ((1u32 << k) - 1) as __mmask16
}

/// `row[j] = exp(row[j] - max)`, returning their sum (`max` is the row's largest value).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
unsafe fn exp_in_place(row: &mut [f32], max: f32) -> f32 {
    let (n, p) = (row.len(), row.as_mut_ptr());
    let vmax = _mm512_set1_ps(max);
    let mut vsum = _mm512_setzero_ps();
    for i in (0..n).step_by(16) {
        let m = lanes(i, n);
        let e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p.add(i)), vmax));
        let e = _mm512_maskz_mov_ps(m, e);
        _mm512_mask_storeu_ps(p.add(i), m, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    _mm512_reduce_add_ps(vsum)
}

/// `scores[j] = max(scores[j], e[j] · inv_sum)`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
unsafe fn raise_scores(scores: &mut [f32], e: &[f32], inv_sum: f32) {
    let (n, s, ep) = (scores.len(), scores.as_mut_ptr(), e.as_ptr());
    let vinv = _mm512_set1_ps(inv_sum);
    for i in (0..n).step_by(16) {
        let m = lanes(i, n);
        let p = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, ep.add(i)), vinv);
        let old = _mm512_maskz_loadu_ps(m, s.add(i));
        _mm512_mask_storeu_ps(s.add(i), m, _mm512_max_ps(old, p));
    }
}

#[cfg(test)]
mod tests {
    /// This kernel against the 256-bit one on random keys and queries: three query heads
    /// (so that register blocks straddle two heads' rows), spans, chunks and pass lengths
    /// that are not whole vectors, and a head dimension of 64 and of 128.
    #[test]
    fn scores_match_the_256_bit_kernel() {
        let has = |f: &str| match f {
            "avx512f" => is_x86_feature_detected!("avx512f"),
            "avx512bw" => is_x86_feature_detected!("avx512bw"),
            "avx512vl" => is_x86_feature_detected!("avx512vl"),
            "f16c" => is_x86_feature_detected!("f16c"),
            _ => is_x86_feature_detected!("fma") && is_x86_feature_detected!("avx2"),
        };
        if !["avx512f", "avx512bw", "avx512vl", "f16c", "fma"]
            .iter()
            .all(|f| has(f))
        {
            eprintln!("scores_match_the_256_bit_kernel: this CPU has no AVX-512, not run");
            return;
        }
        let mut seed = 11u64;
        let mut rand = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 6.0
        };
        for (hd, n_q, n_sink, chunk) in [(64, 21, 4, 37), (128, 40, 4, 200), (64, 7, 0, 5)] {
            let keys: Vec<f32> = (0..(n_sink + chunk + n_q) * hd).map(|_| rand()).collect();
            let queries: Vec<f32> = (0..3 * n_q * hd).map(|_| rand()).collect();
            let (mut want, mut got) = (vec![0f32; chunk], vec![0f32; chunk]);
            // SAFETY: the features of both kernels were detected above.
            unsafe {
                super::super::kvzip_scores::unit_pass_scores(
                    &keys, &queries, hd, n_q, n_sink, &mut want,
                );
                super::unit_pass_scores(&keys, &queries, hd, n_q, n_sink, &mut got);
            }
            for (a, b) in got.iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-6 + 1e-4 * b.abs(),
                    "{a} vs {b} ({hd}, {n_q})"
                );
            }
            assert!(want.iter().any(|&x| x > 0.01), "{want:?}");
        }
    }
}
