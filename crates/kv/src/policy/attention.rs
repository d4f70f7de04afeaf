//! Token scores from attention weights of a few queries: SnapKV, H2O, TOVA and
//! ExpectedAttention. None of them needs the attention kernel to materialise weights: the
//! weights of the queries a policy asks for (`QueryNeed`) are recomputed here from the
//! stored keys, exactly (softmax over each query's causally visible stored tokens, scaled
//! by `1/sqrt(head_dim)`), which costs what attention for those queries costs.
//!
//! Cost per call, with `n` stored tokens and `w` queries passed: `O(L · H_q · w · n · d)`
//! (ExpectedAttention likewise, with the covariance term computed from the `w` centred
//! queries). At decode that is paid
//! once per filled block, with `w <= B`, so amortised per token it is at most one
//! attention pass over the stored tokens (H2O, with all `B` queries) and `1/B` of one for
//! TOVA; key/value-only policies (`scorers`) cost `O(L · H · d)` per token.
//!
//! Each score is formed per (layer, KV head) — averaged over the GQA group of query heads
//! that read that KV head, as kvpress does — and then averaged over layers and KV heads
//! (the shared selection of `policy`).

use std::ops::Range;

use super::scored::TokenScorer;
use super::scorers::{dot, norm};
use super::{KvView, QueryNeed, QueryView};

fn require_queries<'a>(queries: Option<&'a dyn QueryView>, policy: &str) -> &'a dyn QueryView {
    match queries {
        Some(queries) if queries.n_queries() > 0 => queries,
        _ => panic!("{policy}: this policy scores tokens by attention and needs queries"),
    }
}

/// Indices of the (up to) `n` queries with the highest positions, in ascending position.
fn latest_queries(queries: &dyn QueryView, n: usize) -> Vec<usize> {
    let mut ids: Vec<usize> = (0..queries.n_queries()).collect();
    ids.sort_by_key(|&q| (queries.query_position(q), q));
    ids.split_off(ids.len().saturating_sub(n))
}

/// Softmax of `query · key_t * scale` over the keys in `keys` (`head_dim` floats each).
fn softmax_into(keys: &[f32], query: &[f32], scale: f32, out: &mut [f32]) {
    let head_dim = query.len();
    for (logit, key) in out.iter_mut().zip(keys.chunks_exact(head_dim)) {
        *logit = dot(query, key) * scale;
    }
    normalise_exp(out);
}

/// In place: `x -> exp(x - max) / sum`.
fn normalise_exp(logits: &mut [f32]) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for logit in logits.iter_mut() {
        *logit = (*logit - max).exp();
        sum += *logit;
    }
    logits.iter_mut().for_each(|p| *p /= sum);
}

fn group_size(kv: &dyn KvView, queries: &dyn QueryView) -> usize {
    let (n_heads, n_kv_heads) = (queries.n_heads(), kv.n_kv_heads());
    assert!(
        n_heads >= n_kv_heads && n_heads % n_kv_heads == 0,
        "policy: {n_heads} query heads cannot share {n_kv_heads} KV heads"
    );
    n_heads / n_kv_heads
}

/// For each (layer, KV head), in order, calls `each` with the mean attention each token of
/// `tokens` receives from the queries `query_ids` (over the GQA group and over the queries
/// that can see the token; 0 for a token no query sees).
fn attention_received(
    kv: &dyn KvView,
    queries: &dyn QueryView,
    query_ids: &[usize],
    tokens: Range<usize>,
    mut each: impl FnMut(&[f32]),
) {
    let (head_dim, group) = (kv.head_dim(), group_size(kv, queries));
    let visible = query_ids
        .iter()
        .map(|&q| queries.query_position(q) + 1)
        .max()
        .unwrap_or(0);
    assert!(
        visible <= kv.n_tokens(),
        "policy: a query at stored position {} but only {} tokens stored",
        visible - 1,
        kv.n_tokens()
    );
    let seen_until = |q: usize| tokens.end.min(queries.query_position(q) + 1);
    let mut num_views = vec![0u32; tokens.len()];
    for &q in query_ids {
        for token in tokens.start..seen_until(q) {
            num_views[token - tokens.start] += group as u32;
        }
    }
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut keys = vec![0.0; visible * head_dim];
    let (mut query, mut probs) = (vec![0.0; head_dim], vec![0.0; visible]);
    let mut received = vec![0.0; tokens.len()];
    for layer in 0..kv.n_layers() {
        for kv_head in 0..kv.n_kv_heads() {
            for (token, key) in keys.chunks_exact_mut(head_dim).enumerate() {
                kv.key(layer, kv_head, token, key);
            }
            received.fill(0.0);
            for head in kv_head * group..(kv_head + 1) * group {
                for &q in query_ids {
                    let n_visible = queries.query_position(q) + 1;
                    queries.query(layer, head, q, &mut query);
                    softmax_into(&keys, &query, scale, &mut probs[..n_visible]);
                    for token in tokens.start..seen_until(q) {
                        received[token - tokens.start] += probs[token];
                    }
                }
            }
            for (value, &views) in received.iter_mut().zip(&num_views) {
                *value = if views > 0 {
                    *value / views as f32
                } else {
                    0.0
                };
            }
            each(&received);
        }
    }
}

/// Runs `attention_received` and averages `transform(per-head scores)` over (layer, head).
fn mean_attention(
    kv: &dyn KvView,
    queries: &dyn QueryView,
    query_ids: &[usize],
    tokens: Range<usize>,
    out: &mut Vec<f32>,
    mut transform: impl FnMut(&[f32], &mut [f32]),
) {
    out.clear();
    out.resize(tokens.len(), 0.0);
    let mut transformed = vec![0.0; tokens.len()];
    attention_received(kv, queries, query_ids, tokens, |received| {
        transform(received, &mut transformed);
        out.iter_mut().zip(&transformed).for_each(|(o, t)| *o += t);
    });
    let n_heads = (kv.n_layers() * kv.n_kv_heads()) as f32;
    out.iter_mut().for_each(|score| *score /= n_heads);
}

/// SnapKV (arXiv 2404.14469): attention from the last `window` queries (the observation
/// window), averaged over the window and the GQA group, then max-pooled over `kernel`
/// neighbouring tokens so that the neighbours of an important token come along. Pooling
/// never crosses into the observation window, whose tokens are kept at prefill anyway
/// (the policy protects them). At decode, the window is the queries the engine passes.
#[derive(Debug)]
pub(crate) struct SnapKvScorer {
    pub(crate) window: usize,
    pub(crate) kernel: usize,
    /// Average instead of maximum over the kernel (kvpress's `avg_pool1d`, whose zero
    /// padding counts at the ends: the sum is always divided by the kernel).
    pub(crate) avg_pool: bool,
}

impl TokenScorer for SnapKvScorer {
    fn prefill_queries(&self) -> QueryNeed {
        QueryNeed::Last(self.window)
    }
    fn decode_queries(&self) -> QueryNeed {
        QueryNeed::Last(self.window)
    }
    fn score(
        &mut self,
        kv: &dyn KvView,
        queries: Option<&dyn QueryView>,
        tokens: Range<usize>,
        out: &mut Vec<f32>,
    ) {
        let queries = require_queries(queries, "snapkv");
        let ids = latest_queries(queries, self.window);
        let window_start = queries
            .query_position(ids[0])
            .clamp(tokens.start, tokens.end);
        let split = window_start - tokens.start;
        let radius = self.kernel / 2;
        let pool = if self.avg_pool { avg_pool } else { max_pool };
        mean_attention(kv, queries, &ids, tokens, out, |received, pooled| {
            let (prefix, window) = received.split_at(split);
            let (pooled_prefix, pooled_window) = pooled.split_at_mut(split);
            pool(prefix, radius, pooled_prefix);
            pool(window, radius, pooled_window);
        });
    }
}

/// SnapKV's score of every stored token of `kv` (higher = keep), with the observation
/// window made of the latest `window` of `queries`, pooled over `kernel` neighbours: what a
/// SnapKV policy ranks prompt tokens by, for callers that keep the ranking rather than one
/// selection (a stored context compressed at several ratios later, when its queries are
/// gone). Panics if `queries` is empty.
pub fn snapkv_token_scores(
    kv: &dyn KvView,
    queries: &dyn QueryView,
    window: usize,
    kernel: usize,
) -> Vec<f32> {
    let mut out = Vec::new();
    SnapKvScorer {
        window,
        kernel,
        avg_pool: false,
    }
    .score(kv, Some(queries), 0..kv.n_tokens(), &mut out);
    out
}

/// `out[i] = sum(x[i - radius ..= i + radius]) / (2 radius + 1)`, zeros past the ends.
fn avg_pool(x: &[f32], radius: usize, out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        let window = &x[i.saturating_sub(radius)..(i + radius + 1).min(x.len())];
        *o = window.iter().sum::<f32>() / (2 * radius + 1) as f32;
    }
}

/// `out[i] = max(x[i - radius ..= i + radius])`, clipped at the ends.
fn max_pool(x: &[f32], radius: usize, out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        let window = &x[i.saturating_sub(radius)..(i + radius + 1).min(x.len())];
        *o = window.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    }
}

/// H2O (arXiv 2306.14048): accumulated attention a token receives from the queries passed
/// (all prompt queries at prefill: the full matrix), normalised by the number of queries
/// that can see it, so early tokens are not favoured for being visible longer. The recent
/// window is the policy's (`Protect::RecentHalf`, `Candidates::OlderThanRecentHalf`).
///
/// At decode a block is scored once, when it fills, from the queries passed then (at most
/// its own tokens'): later queries do not add to it, unlike per-step H2O.
#[derive(Debug)]
pub(crate) struct H2oScorer;

impl TokenScorer for H2oScorer {
    fn prefill_queries(&self) -> QueryNeed {
        QueryNeed::All
    }
    fn decode_queries(&self) -> QueryNeed {
        QueryNeed::All
    }
    fn score(
        &mut self,
        kv: &dyn KvView,
        queries: Option<&dyn QueryView>,
        tokens: Range<usize>,
        out: &mut Vec<f32>,
    ) {
        let queries = require_queries(queries, "h2o");
        let ids: Vec<usize> = (0..queries.n_queries()).collect();
        mean_attention(kv, queries, &ids, tokens, out, |received, t| {
            t.copy_from_slice(received)
        });
    }
}

/// TOVA (arXiv 2401.06104): attention from the newest query, averaged over heads (and
/// layers). At decode a block is scored once, by the query that filled it.
#[derive(Debug)]
pub(crate) struct TovaScorer;

impl TokenScorer for TovaScorer {
    fn prefill_queries(&self) -> QueryNeed {
        QueryNeed::Last(1)
    }
    fn decode_queries(&self) -> QueryNeed {
        QueryNeed::Last(1)
    }
    fn score(
        &mut self,
        kv: &dyn KvView,
        queries: Option<&dyn QueryView>,
        tokens: Range<usize>,
        out: &mut Vec<f32>,
    ) {
        let queries = require_queries(queries, "tova");
        let ids = latest_queries(queries, 1);
        mean_attention(kv, queries, &ids, tokens, out, |received, t| {
            t.copy_from_slice(received)
        });
    }
}

/// ExpectedAttention (arXiv 2510.00636, kvpress `ExpectedAttentionPress`): the attention a
/// future query is expected to pay, `softmax_j(μᵀk_j/√d + k_jᵀΣk_j/(2d))`, times ‖v_j‖,
/// with μ and Σ the mean and (population) covariance of recent queries per query head,
/// averaged over the GQA group. The softmax runs over every stored token.
///
/// Deviation: kvpress takes pre-RoPE statistics over the whole context and applies the
/// RoPE rotation averaged over the next 512 positions. `pk-kv` has no RoPE, so the
/// statistics are those of the last `window` post-RoPE queries (sinks excluded), which
/// the next positions resemble: slow RoPE frequencies barely move, and fast ones average
/// out in both.
#[derive(Debug)]
pub(crate) struct ExpectedAttentionScorer {
    pub(crate) window: usize,
    pub(crate) n_sink_tokens: usize,
}

impl ExpectedAttentionScorer {
    /// Mean of the chosen queries, and the queries minus that mean (`ids.len()` rows).
    ///
    /// The covariance is never formed: with population covariance Σ of `w` queries,
    /// `kᵀΣk = mean_i ((q_i - μ)·k)²`, which costs `O(w·d)` per key instead of `O(d²)`.
    fn statistics(
        queries: &dyn QueryView,
        ids: &[usize],
        layer: usize,
        head: usize,
        mean: &mut [f32],
        centered: &mut Vec<f32>,
    ) {
        let head_dim = mean.len();
        centered.clear();
        centered.resize(ids.len() * head_dim, 0.0);
        for (query, &q) in centered.chunks_exact_mut(head_dim).zip(ids) {
            queries.query(layer, head, q, query);
        }
        mean.fill(0.0);
        for query in centered.chunks_exact(head_dim) {
            mean.iter_mut().zip(query).for_each(|(m, x)| *m += x);
        }
        mean.iter_mut().for_each(|m| *m /= ids.len() as f32);
        for query in centered.chunks_exact_mut(head_dim) {
            query.iter_mut().zip(mean.iter()).for_each(|(x, m)| *x -= m);
        }
    }
}

impl TokenScorer for ExpectedAttentionScorer {
    fn prefill_queries(&self) -> QueryNeed {
        QueryNeed::Last(self.window)
    }
    fn decode_queries(&self) -> QueryNeed {
        QueryNeed::Last(self.window)
    }
    fn score(
        &mut self,
        kv: &dyn KvView,
        queries: Option<&dyn QueryView>,
        tokens: Range<usize>,
        out: &mut Vec<f32>,
    ) {
        let queries = require_queries(queries, "expected-attention");
        let latest = latest_queries(queries, self.window);
        let past_sinks: Vec<usize> = latest
            .iter()
            .copied()
            .filter(|&q| queries.query_position(q) >= self.n_sink_tokens)
            .collect();
        let ids = if past_sinks.is_empty() {
            latest
        } else {
            past_sinks
        };
        let (head_dim, group, n_tokens) = (kv.head_dim(), group_size(kv, queries), kv.n_tokens());
        let scale = 1.0 / (head_dim as f32).sqrt();
        let mut keys = vec![0.0; n_tokens * head_dim];
        let mut value = vec![0.0; head_dim];
        let (mut mean, mut centered) = (vec![0.0; head_dim], Vec::new());
        let quadratic_scale = 1.0 / (2.0 * head_dim as f32 * ids.len() as f32);
        let mut probs = vec![0.0; n_tokens];
        let mut expected = vec![0.0; tokens.len()];
        out.clear();
        out.resize(tokens.len(), 0.0);
        for layer in 0..kv.n_layers() {
            for kv_head in 0..kv.n_kv_heads() {
                for (token, key) in keys.chunks_exact_mut(head_dim).enumerate() {
                    kv.key(layer, kv_head, token, key);
                }
                expected.fill(0.0);
                for head in kv_head * group..(kv_head + 1) * group {
                    Self::statistics(queries, &ids, layer, head, &mut mean, &mut centered);
                    for (logit, key) in probs.iter_mut().zip(keys.chunks_exact(head_dim)) {
                        let quadratic: f32 = centered
                            .chunks_exact(head_dim)
                            .map(|c| dot(c, key).powi(2))
                            .sum();
                        *logit = dot(&mean, key) * scale + quadratic * quadratic_scale;
                    }
                    normalise_exp(&mut probs);
                    for token in tokens.clone() {
                        expected[token - tokens.start] += probs[token];
                    }
                }
                for token in tokens.clone() {
                    kv.value(layer, kv_head, token, &mut value);
                    out[token - tokens.start] +=
                        expected[token - tokens.start] / group as f32 * norm(&value);
                }
            }
        }
        let n_heads = (kv.n_layers() * kv.n_kv_heads()) as f32;
        out.iter_mut().for_each(|score| *score /= n_heads);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{DenseKv, DenseQueries};

    #[test]
    fn attention_is_causal_and_normalised_by_viewers() {
        // One layer, one head, head_dim 1, keys all 0: every visible token gets the same
        // weight, 1 / (position + 1).
        let kv = DenseKv::from_fn(1, 1, 1, 3, |_, _, _, k, v| {
            k[0] = 0.0;
            v[0] = 1.0;
        });
        let queries = DenseQueries::from_fn(1, 1, 1, vec![1, 2], |_, _, _, q| q[0] = 1.0);
        let mut seen = Vec::new();
        attention_received(&kv, &queries, &[0, 1], 0..3, |r| seen.push(r.to_vec()));
        // Token 0: (1/2 + 1/3) / 2; token 1 likewise; token 2: seen by query 1 only.
        let both = (0.5 + 1.0 / 3.0) / 2.0;
        assert_eq!(seen.len(), 1);
        let expected = [both, both, 1.0 / 3.0];
        for (got, want) in seen[0].iter().zip(expected) {
            assert!((got - want).abs() < 1e-6, "{:?}", seen[0]);
        }
    }

    #[test]
    fn max_pool_clips_at_the_ends() {
        let mut out = [0.0; 5];
        max_pool(&[1.0, 0.0, 0.0, 0.0, 2.0], 1, &mut out);
        assert_eq!(out, [1.0, 1.0, 0.0, 2.0, 2.0]);
    }

    #[test]
    fn latest_queries_orders_by_position() {
        let queries = DenseQueries::from_fn(1, 1, 1, vec![9, 3, 7], |_, _, _, q| q[0] = 0.0);
        assert_eq!(latest_queries(&queries, 2), vec![2, 0]);
        assert_eq!(latest_queries(&queries, 5), vec![1, 2, 0]);
    }
}
