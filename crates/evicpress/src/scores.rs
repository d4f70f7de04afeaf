//! Per-token importance scores of a stored context, for the dropping configurations.
//!
//! One score per token, averaged over every (layer, KV head): the engine's caches share
//! one selection across layers (ARCHITECTURE.md, decision b), and so do stored contexts,
//! which keeps a dropped context loadable into ordinary block tables.

use pk_codec::KvContext;
use pk_kv::{KvView, QueryView};

use crate::config::DropScore;

/// The queries of a context's last tokens (its SnapKV observation window) as the engine's
/// forward pass captured them: post-RoPE, laid out `[layer][query][n_heads * head_dim]`.
#[derive(Clone, Debug)]
pub struct WindowQueries {
    pub n_heads: usize,
    /// Stored index of each query's own token (the context's last tokens, ascending).
    pub positions: Vec<usize>,
    pub data: Vec<f32>,
}

impl WindowQueries {
    pub fn bytes(&self) -> usize {
        self.data.len() * 4 + self.positions.len() * 8
    }
}

struct ContextView<'a>(&'a KvContext);

impl KvView for ContextView<'_> {
    fn n_layers(&self) -> usize {
        self.0.n_layers
    }
    fn n_kv_heads(&self) -> usize {
        self.0.n_kv_heads
    }
    fn head_dim(&self) -> usize {
        self.0.head_dim
    }
    fn n_tokens(&self) -> usize {
        self.0.n_tokens()
    }
    fn key(&self, layer: usize, kv_head: usize, token: usize, out: &mut [f32]) {
        let d = self.0.head_dim;
        out.copy_from_slice(&self.0.k_head(layer, kv_head)[token * d..(token + 1) * d]);
    }
    fn value(&self, layer: usize, kv_head: usize, token: usize, out: &mut [f32]) {
        let d = self.0.head_dim;
        out.copy_from_slice(&self.0.v_head(layer, kv_head)[token * d..(token + 1) * d]);
    }
}

struct WindowView<'a> {
    q: &'a WindowQueries,
    head_dim: usize,
}

impl QueryView for WindowView<'_> {
    fn n_queries(&self) -> usize {
        self.q.positions.len()
    }
    fn n_heads(&self) -> usize {
        self.q.n_heads
    }
    fn query(&self, layer: usize, head: usize, q: usize, out: &mut [f32]) {
        let q_dim = self.q.n_heads * self.head_dim;
        let at = (layer * self.q.positions.len() + q) * q_dim + head * self.head_dim;
        out.copy_from_slice(&self.q.data[at..at + self.head_dim]);
    }
    fn query_position(&self, q: usize) -> usize {
        self.q.positions[q]
    }
}

/// SnapKV scores of `ctx`'s tokens (spec `baselines.md`: w = 64, kernel 5) from the
/// queries of its last tokens; `None` if the queries do not fit the context (shape, count,
/// positions past its end, or a context that was already dropped, whose stored indices
/// are not the positions the queries were captured at).
pub fn snapkv_scores(ctx: &KvContext, queries: &WindowQueries) -> Option<Vec<f32>> {
    let n_q = queries.positions.len();
    let fits = n_q > 0
        && ctx.n_original_tokens == ctx.n_tokens()
        && queries.n_heads > 0
        && queries.n_heads.is_multiple_of(ctx.n_kv_heads)
        && queries.data.len() == ctx.n_layers * n_q * queries.n_heads * ctx.head_dim
        && queries.positions.iter().all(|&p| p < ctx.n_tokens());
    if !fits {
        return None;
    }
    let window = pk_kv::SNAPKV_WINDOW_DEFAULT as usize;
    let kernel = pk_kv::SNAPKV_KERNEL_DEFAULT as usize;
    Some(pk_kv::snapkv_token_scores(
        &ContextView(ctx),
        &WindowView {
            q: queries,
            head_dim: ctx.head_dim,
        },
        window,
        kernel,
    ))
}

/// Scores of every stored token of `ctx` under `score` (higher = keep); `None` for a score
/// the engine supplies (SnapKV's, KVzip's), which the KV alone cannot give.
pub fn token_scores(ctx: &KvContext, score: DropScore) -> Option<Vec<f32>> {
    if score.is_supplied() {
        return None;
    }
    Some(kv_scores(ctx, score))
}

/// Recency for StreamingLLM (the protected first block is the sink; the rest ranks by
/// position); otherwise pk-kv's own scorer of the policy, so a context dropped here ranks
/// its tokens exactly as the eviction policy of the same name does. The `paged-eviction-R`
/// codec keeps the paper's ‖v‖/‖k‖ (`paged-eviction:ratio`), which every EVICPRESS result
/// so far was measured with; the eviction policy's default score became ‖v‖ in issue 38.
fn kv_scores(ctx: &KvContext, score: DropScore) -> Vec<f32> {
    let spec = match score {
        DropScore::StreamingLlm => return ctx.positions.iter().map(|&p| p as f32).collect(),
        DropScore::PagedEviction => pk_kv::PolicySpec::PagedEviction {
            score: pk_kv::PagedScore::VOverK,
            local_topk: None,
        },
        DropScore::KNorm => pk_kv::PolicySpec::KNorm,
        DropScore::KeyDiff => pk_kv::PolicySpec::KeyDiff,
        DropScore::SnapKv | DropScore::KvZip => {
            unreachable!("supplied scores: token_scores returns None first")
        }
    };
    pk_kv::kv_token_scores(spec, &ContextView(ctx)).expect("a key/value-only policy")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(n: usize) -> KvContext {
        let d = 4;
        let mut k = vec![0f32; n * d];
        let mut v = vec![0f32; n * d];
        for t in 0..n {
            k[t * d] = 1.0 + t as f32; // growing key norm
            v[t * d + 1] = 1.0; // constant value norm
        }
        k[d + 1] = 0.0;
        KvContext::new(1, 1, d, (0..n as u32).collect(), k, v).unwrap()
    }

    #[test]
    fn scores_rank_as_the_policies_say() {
        let c = ctx(5);
        let pe = token_scores(&c, DropScore::PagedEviction).unwrap();
        assert!(
            pe.windows(2).all(|w| w[0] > w[1]),
            "‖v‖/‖k‖ falls as ‖k‖ grows: {pe:?}"
        );
        let kn = token_scores(&c, DropScore::KNorm).unwrap();
        assert!(kn.windows(2).all(|w| w[0] > w[1]));
        let sl = token_scores(&c, DropScore::StreamingLlm).unwrap();
        assert!(sl.windows(2).all(|w| w[0] < w[1]));
        // Every key points the same way: KeyDiff sees no diversity.
        let kd = token_scores(&c, DropScore::KeyDiff).unwrap();
        assert!(kd.iter().all(|s| (s + 1.0).abs() < 1e-4), "{kd:?}");
        assert!(
            token_scores(&c, DropScore::SnapKv).is_none(),
            "SnapKV needs queries"
        );
        assert!(
            token_scores(&c, DropScore::KvZip).is_none(),
            "KVzip needs the model's passes"
        );
    }

    #[test]
    fn snapkv_ranks_the_tokens_the_window_attends_to() {
        let (layers, heads, d, n) = (2, 1, 4, 40);
        let f = |i: usize| ((i * 2654435761) % 1000) as f32 / 1000.0 - 0.5;
        // Small keys everywhere but token 10's, which the window's queries point at.
        let k: Vec<f32> = (0..layers * heads * n * d)
            .map(|i| if (i / d) % n == 10 { 1.0 } else { 0.1 * f(i) })
            .collect();
        let c = KvContext::new(
            layers,
            heads,
            d,
            (0..n as u32).collect(),
            k,
            vec![0.5; layers * heads * n * d],
        )
        .unwrap();
        // Two query heads (GQA group of 2), two window queries, all pointing at token 10's key.
        let (n_heads, positions) = (2, vec![n - 2, n - 1]);
        let mut data = Vec::new();
        for layer in 0..layers {
            for _ in &positions {
                for _ in 0..n_heads {
                    data.extend(c.k_head(layer, 0)[10 * d..11 * d].iter().map(|x| 10.0 * x));
                }
            }
        }
        let s = snapkv_scores(
            &c,
            &WindowQueries {
                n_heads,
                positions: positions.clone(),
                data: data.clone(),
            },
        )
        .unwrap();
        assert_eq!(s.len(), n);
        let best = (0..n - 2).max_by(|&a, &b| s[a].total_cmp(&s[b])).unwrap();
        assert!(
            (8..=12).contains(&best),
            "pooled around token 10, got {best}: {s:?}"
        );
        assert!(s[10] > 2.0 * s[25], "{s:?}");
        // Queries that do not fit the context are refused, not misread.
        assert!(snapkv_scores(
            &c,
            &WindowQueries {
                n_heads,
                positions: vec![n],
                data: data[..data.len() / 2].to_vec()
            }
        )
        .is_none());
        assert!(snapkv_scores(
            &c,
            &WindowQueries {
                n_heads: 3,
                positions,
                data
            }
        )
        .is_none());
    }
}
