//! Per-token importance scores of a stored context, for the dropping configurations.
//!
//! One score per token, averaged over every (layer, KV head): the engine's caches share
//! one selection across layers (ARCHITECTURE.md, decision b), and so do stored contexts,
//! which keeps a dropped context loadable into ordinary block tables.

use pk_codec::KvContext;

use crate::config::DropScore;

const NORM_EPS: f32 = 1e-6;

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Scores of every stored token of `ctx` under `score` (higher = keep); `None` for a score
/// that needs queries (SnapKV), which the KV alone cannot give.
pub fn token_scores(ctx: &KvContext, score: DropScore) -> Option<Vec<f32>> {
    if score.needs_queries() {
        return None;
    }
    Some(kv_scores(ctx, score))
}

fn kv_scores(ctx: &KvContext, score: DropScore) -> Vec<f32> {
    let n = ctx.n_tokens();
    let d = ctx.head_dim;
    let mut out = vec![0f32; n];
    if score == DropScore::StreamingLlm {
        // Recency: the protected first block is the sink; the rest ranks by position.
        for (o, p) in out.iter_mut().zip(&ctx.positions) {
            *o = *p as f32;
        }
        return out;
    }
    let heads = (ctx.n_layers * ctx.n_kv_heads) as f32;
    let mut mean = vec![0f32; d];
    for layer in 0..ctx.n_layers {
        for h in 0..ctx.n_kv_heads {
            let (k, v) = (ctx.k_head(layer, h), ctx.v_head(layer, h));
            if score == DropScore::KeyDiff {
                mean.iter_mut().for_each(|m| *m = 0.0);
                for kt in k.chunks_exact(d) {
                    mean.iter_mut().zip(kt).for_each(|(m, x)| *m += x);
                }
            }
            let mean_norm = dot(&mean, &mean).sqrt() + NORM_EPS;
            for t in 0..n {
                let kt = &k[t * d..(t + 1) * d];
                let k_norm = dot(kt, kt).sqrt();
                let s = match score {
                    DropScore::PagedEviction => {
                        let vt = &v[t * d..(t + 1) * d];
                        dot(vt, vt).sqrt() / (k_norm + NORM_EPS)
                    }
                    DropScore::KNorm => -k_norm,
                    DropScore::KeyDiff => -dot(kt, &mean) / ((k_norm + NORM_EPS) * mean_norm),
                    DropScore::StreamingLlm | DropScore::SnapKv => unreachable!("handled above"),
                };
                out[t] += s / heads;
            }
        }
    }
    out
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
        assert!(pe.windows(2).all(|w| w[0] > w[1]), "‖v‖/‖k‖ falls as ‖k‖ grows: {pe:?}");
        let kn = token_scores(&c, DropScore::KNorm).unwrap();
        assert!(kn.windows(2).all(|w| w[0] > w[1]));
        let sl = token_scores(&c, DropScore::StreamingLlm).unwrap();
        assert!(sl.windows(2).all(|w| w[0] < w[1]));
        // Every key points the same way: KeyDiff sees no diversity.
        let kd = token_scores(&c, DropScore::KeyDiff).unwrap();
        assert!(kd.iter().all(|s| (s + 1.0).abs() < 1e-4), "{kd:?}");
        assert!(token_scores(&c, DropScore::SnapKv).is_none(), "SnapKV needs queries");
    }
}
