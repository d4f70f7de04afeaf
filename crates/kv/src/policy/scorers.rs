//! Token scores from keys and values alone (no attention weights): PagedEviction's
//! ‖v‖/‖k‖ and its variants, KNorm (inverse key L2 norm) and KeyDiff (key diversity).
//!
//! Every score is computed per (layer, KV head) and averaged over both (the shared
//! selection, see the module docs of `policy`). Keys are post-RoPE; RoPE is a rotation, so
//! norms and the angle between two keys at the same position are the same before and
//! after it.

use std::ops::Range;

use super::scored::TokenScorer;
use super::spec::PagedScore;
use super::{KvView, QueryView};

/// Added to denominators: keeps zero-norm keys finite without changing ordinary scores.
pub(crate) const NORM_EPS: f32 = 1e-6;

/// Dot product with eight independent partial sums, so the compiler can vectorise it
/// (a single running sum must stay in order and cannot be).
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut lanes = [0.0f32; 8];
    let (a_chunks, b_chunks) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a_chunks
        .remainder()
        .iter()
        .zip(b_chunks.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a_chunks.zip(b_chunks) {
        for lane in 0..8 {
            lanes[lane] += x[lane] * y[lane];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

pub(crate) fn norm(a: &[f32]) -> f32 {
    dot(a, a).sqrt()
}

/// Calls `each(token, key, value)` for every token of `tokens`, in every layer and KV head,
/// then divides the accumulated `out` by the number of (layer, head) pairs.
fn mean_over_heads(
    kv: &dyn KvView,
    tokens: Range<usize>,
    out: &mut Vec<f32>,
    mut each: impl FnMut(usize, usize, usize, &[f32], &[f32]) -> f32,
) {
    let head_dim = kv.head_dim();
    let (mut key, mut value) = (vec![0.0; head_dim], vec![0.0; head_dim]);
    out.clear();
    out.resize(tokens.len(), 0.0);
    for layer in 0..kv.n_layers() {
        for kv_head in 0..kv.n_kv_heads() {
            for token in tokens.clone() {
                kv.key(layer, kv_head, token, &mut key);
                kv.value(layer, kv_head, token, &mut value);
                out[token - tokens.start] += each(layer, kv_head, token, &key, &value);
            }
        }
    }
    let n_heads = (kv.n_layers() * kv.n_kv_heads()) as f32;
    out.iter_mut().for_each(|score| *score /= n_heads);
}

/// PagedEviction's token importance (spec "Token importance"):
/// `S_i = mean over layers and KV heads of ‖v‖ / (‖k‖ + eps)`, or a variant.
#[derive(Debug)]
pub(crate) struct PagedScorer {
    pub(crate) score: PagedScore,
}

impl TokenScorer for PagedScorer {
    fn score(
        &mut self,
        kv: &dyn KvView,
        _queries: Option<&dyn QueryView>,
        tokens: Range<usize>,
        out: &mut Vec<f32>,
    ) {
        let score = self.score;
        mean_over_heads(kv, tokens, out, |_, _, _, key, value| match score {
            PagedScore::VOverK => norm(value) / (norm(key) + NORM_EPS),
            PagedScore::VNorm => norm(value),
            PagedScore::InvKNorm => 1.0 / (norm(key) + NORM_EPS),
        });
    }
}

/// KNorm (arXiv 2406.11430): `-‖k‖`, low-norm keys attract attention. The paper skips
/// layers 0 and 1 (where the correlation fails); with one selection shared by all layers
/// there is no per-layer compression to skip, so every layer's norm enters the mean.
#[derive(Debug)]
pub(crate) struct KNormScorer;

impl TokenScorer for KNormScorer {
    fn score(
        &mut self,
        kv: &dyn KvView,
        _queries: Option<&dyn QueryView>,
        tokens: Range<usize>,
        out: &mut Vec<f32>,
    ) {
        mean_over_heads(kv, tokens, out, |_, _, _, key, _| -norm(key));
    }
}

/// KeyDiff (arXiv 2504.15364): `-cos(k_j, a)` with the anchor `a = mean_i k_i / ‖k_i‖` over
/// every stored token, per (layer, KV head): keys most like the average direction go first.
///
/// The paper processes a long prompt in chunks of 128 to bound prefill memory; prefill
/// here is exact over the whole prompt, so the anchor is taken over all of it at once.
/// At decode the anchor is recomputed over the stored tokens when a block fills (cost
/// O(stored · H · d) once per block) and only that block is scored against it.
#[derive(Debug, Default)]
pub(crate) struct KeyDiffScorer {
    /// Anchors, `[layer][kv_head][head_dim]`, reused between calls.
    anchors: Vec<f32>,
}

impl KeyDiffScorer {
    fn compute_anchors(&mut self, kv: &dyn KvView) {
        let head_dim = kv.head_dim();
        let mut key = vec![0.0; head_dim];
        self.anchors.clear();
        self.anchors
            .resize(kv.n_layers() * kv.n_kv_heads() * head_dim, 0.0);
        for (pair, anchor) in self.anchors.chunks_exact_mut(head_dim).enumerate() {
            let (layer, kv_head) = (pair / kv.n_kv_heads(), pair % kv.n_kv_heads());
            for token in 0..kv.n_tokens() {
                kv.key(layer, kv_head, token, &mut key);
                let key_norm = norm(&key);
                if key_norm > 0.0 {
                    for (a, k) in anchor.iter_mut().zip(&key) {
                        *a += k / key_norm;
                    }
                }
            }
            // The mean's scale cancels in the cosine; dividing keeps the numbers readable.
            let n_tokens = kv.n_tokens().max(1) as f32;
            anchor.iter_mut().for_each(|a| *a /= n_tokens);
        }
    }
}

impl TokenScorer for KeyDiffScorer {
    fn score(
        &mut self,
        kv: &dyn KvView,
        _queries: Option<&dyn QueryView>,
        tokens: Range<usize>,
        out: &mut Vec<f32>,
    ) {
        self.compute_anchors(kv);
        let (head_dim, n_kv_heads) = (kv.head_dim(), kv.n_kv_heads());
        let anchors = &self.anchors;
        mean_over_heads(kv, tokens, out, |layer, kv_head, _, key, _| {
            let start = (layer * n_kv_heads + kv_head) * head_dim;
            let anchor = &anchors[start..start + head_dim];
            -dot(key, anchor) / (norm(key) * norm(anchor) + NORM_EPS)
        });
    }
}

/// The scores a key/value-only policy (PagedEviction and its variants, KNorm, KeyDiff)
/// gives every stored token of `kv` (higher = keep), for callers that keep the ranking
/// rather than one selection (EVICPRESS drops a stored context's tokens at several ratios
/// later). `None` for a policy whose score needs queries or positions.
pub fn kv_token_scores(spec: super::PolicySpec, kv: &dyn KvView) -> Option<Vec<f32>> {
    use super::PolicySpec;
    let mut scorer: Box<dyn TokenScorer> = match spec {
        PolicySpec::PagedEviction { score, .. } => Box::new(PagedScorer { score }),
        PolicySpec::KNorm => Box::new(KNormScorer),
        PolicySpec::KeyDiff => Box::<KeyDiffScorer>::default(),
        _ => return None,
    };
    let mut out = Vec::new();
    scorer.score(kv, None, 0..kv.n_tokens(), &mut out);
    Some(out)
}
