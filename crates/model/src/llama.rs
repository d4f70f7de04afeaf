//! The Llama-family transformer (Llama 2/3, SmolLM2): RMSNorm, RoPE, grouped-query
//! attention over the paged KV store, SwiGLU MLP, optionally tied output head. Gemma 3
//! is the same block with the additions `ArchExtras` lists (scaled embeddings, per-head
//! Q/K norms, post-attention and post-MLP norms, GeGLU, sliding-window local layers with
//! their own RoPE base), each a branch here rather than a second model.
//!
//! Paper: "LLaMA: Open and Efficient Foundation Language Models" (arXiv 2302.13971);
//! "Gemma 3 Technical Report" (arXiv 2503.19786).
//! One forward call processes a batch of sequences, each contributing any number of new
//! tokens (a prompt chunk in prefill, one token in decode), so prefill and continuous
//! batching share one code path. All weight matmuls run once over the whole batch.

use std::sync::Mutex;

use pk_gguf::GgufFile;

use crate::attention::{paged_attention, paged_attention_window, AttnSeq, AttnShape};
use crate::config::{ModelConfig, RopeStyle};
use crate::kernels::{
    add_in_place, gelu_mul_in_place, matmul, matmul_multi, rmsnorm, rmsnorm_rows_in_place,
    silu_mul_in_place, split_attention,
};
use crate::kv_store::KvStore;
use crate::weights::Weights;
use crate::ModelError;

/// One sequence's new tokens in a forward call.
#[derive(Debug, Clone, Copy, Default)]
pub struct SeqForward<'a> {
    pub tokens: &'a [u32],
    /// Absolute position (for RoPE) of `tokens[0]`.
    pub start_position: usize,
    /// Stored index at which `tokens[0]`'s K/V is written; later tokens follow densely.
    pub stored_start: usize,
    /// Physical block ids covering stored indices `0..stored_start + tokens.len()`.
    pub block_table: &'a [u32],
    /// Logits are returned for `tokens[logits_from..]` (use `tokens.len()` for none).
    pub logits_from: usize,
    /// Positions of stored tokens `0..stored_start`, ascending, once eviction has made them
    /// differ from stored indices; empty means stored index = position. Only sliding-window
    /// layers read them (their window is over positions; see `first_visible`).
    pub stored_positions: &'a [u32],
    /// With KV cache groups (`KvStore::grouped`): per sliding-window group, its block
    /// table, indexed by position (entry `p / B` holds position `p`; entries wholly behind
    /// the window may name freed blocks and are never read). Empty without groups.
    pub window_tables: &'a [Vec<u32>],
}

impl SeqForward<'_> {
    /// The first stored index a sliding window of `window` positions lets new token `i`
    /// see: every stored token at position > `start_position + i - window`. Positions
    /// ascend with stored indices, so it is the number of stored tokens before the window.
    pub fn first_visible(&self, i: usize, window: usize) -> usize {
        let lo_pos = (self.start_position + i + 1).saturating_sub(window);
        if self.stored_positions.is_empty() {
            // Stored index = position: the window counts stored tokens.
            return (self.stored_start + i + 1).saturating_sub(window);
        }
        assert_eq!(
            self.stored_positions.len(),
            self.stored_start,
            "a position for every stored token"
        );
        let old = self
            .stored_positions
            .partition_point(|&p| (p as usize) < lo_pos);
        if old < self.stored_start {
            old
        } else {
            // Every older token is outside: the window starts among the new tokens.
            self.stored_start + lo_pos.saturating_sub(self.start_position).min(i)
        }
    }
}

pub struct Llama {
    pub config: ModelConfig,
    pub weights: Weights,
    /// RoPE frequencies of full-attention layers (`ModelConfig::rope_inv_freq`: base,
    /// frequency factors and linear scaling), precomputed once.
    inv_freq: Vec<f32>,
    /// The same for sliding-window layers' own base (Gemma 3); empty without them.
    inv_freq_local: Vec<f32>,
    /// Activation buffers reused across forward calls, so that a decode step allocates
    /// almost nothing. The engine calls `forward` from one thread, so the lock is never
    /// contended; it only keeps `Llama` `Sync`.
    scratch: Mutex<Scratch>,
}

/// Per-call activations, `n_tokens` rows each; resized (never shrunk) per call.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    positions: Vec<usize>,
    /// `cos`/`sin` of every row's RoPE angles (`head_dim / 2` each), shared by all layers.
    rope_cos: Vec<f32>,
    rope_sin: Vec<f32>,
    /// The local layers' angles (Gemma 3), when their base differs.
    rope_cos_local: Vec<f32>,
    rope_sin_local: Vec<f32>,
    normed: Vec<f32>,
}

/// Resizes `buf` to `len` without reallocating when it is already large enough.
fn sized(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buf.resize(len, 0.0);
    &mut buf[..]
}

impl Llama {
    pub fn from_gguf(f: &GgufFile) -> Result<Llama, ModelError> {
        let config = ModelConfig::from_gguf(f)?;
        let weights = Weights::from_gguf(f, &config)?;
        Ok(Llama::new(config, weights))
    }

    pub fn new(config: ModelConfig, weights: Weights) -> Llama {
        let inv_freq = config.rope_inv_freq(false);
        let inv_freq_local = match config.extras.sliding_window {
            Some(_) => config.rope_inv_freq(true),
            None => Vec::new(),
        };
        Llama {
            config,
            weights,
            inv_freq,
            inv_freq_local,
            scratch: Mutex::new(Scratch::default()),
        }
    }

    /// Runs the new tokens of every sequence through the model, writing their K/V into
    /// `store`, and returns the requested logits rows (`vocab_size` floats each) in order.
    pub fn forward(&self, store: &mut KvStore, seqs: &[SeqForward]) -> Vec<f32> {
        self.forward_with_queries(store, seqs, &[]).0
    }

    /// Like `forward`, and also returns, per sequence, the post-RoPE queries of its last
    /// `capture_last[i]` new tokens (`[layer][token][n_heads * head_dim]`), which
    /// attention-based eviction policies score with. A missing entry means none.
    pub fn forward_with_queries(
        &self,
        store: &mut KvStore,
        seqs: &[SeqForward],
        capture_last: &[usize],
    ) -> (Vec<f32>, Vec<Vec<f32>>) {
        let c = &self.config;
        let (d, qd, kvd) = (c.d_model, c.q_dim(), c.kv_dim());
        let n: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let bs = store.geometry.block_size_tokens;

        // A decode step: the pool times it and chooses whether to split it (see `Pool::step`).
        let _step = (n <= crate::kernels::pool::DECODE_MAX_TOKENS)
            .then(|| crate::kernels::pool::global().step(n));
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let sc = &mut *guard;
        let x = sized(&mut sc.x, n * d);
        let positions = &mut sc.positions;
        positions.clear();
        for s in seqs {
            for (i, &t) in s.tokens.iter().enumerate() {
                let row = positions.len();
                let xr = &mut x[row * d..(row + 1) * d];
                self.weights.token_embd.dequantize_row(t as usize, xr);
                if let Some(scale) = c.extras.embed_scale {
                    xr.iter_mut().for_each(|v| *v *= scale);
                }
                positions.push(s.start_position + i);
            }
        }
        // With KV cache groups, windowed layers read their group's own table, indexed by
        // position, so a row's first visible index is a position.
        let grouping = store.grouping().cloned();
        // Sliding-window layers: each row's first visible stored index (the same for every
        // such layer).
        let first_visible: Vec<usize> = match (c.extras.sliding_window, &grouping) {
            (Some(w), None) => seqs
                .iter()
                .flat_map(|s| (0..s.tokens.len()).map(move |i| s.first_visible(i, w.window_tokens)))
                .collect(),
            (Some(w), Some(_)) => seqs
                .iter()
                .flat_map(|s| {
                    (0..s.tokens.len())
                        .map(move |i| (s.start_position + i + 1).saturating_sub(w.window_tokens))
                })
                .collect(),
            (None, _) => Vec::new(),
        };
        let mut attn_seqs = Vec::with_capacity(seqs.len());
        let mut row = 0;
        for s in seqs {
            attn_seqs.push(AttnSeq {
                block_table: s.block_table,
                stored_start: s.stored_start,
                n_queries: s.tokens.len(),
                row_offset: row,
            });
            row += s.tokens.len();
        }
        let window_attn_seqs: Vec<Vec<AttnSeq>> =
            (0..grouping.as_ref().map_or(0, |g| g.num_window_groups))
                .map(|g| {
                    seqs.iter()
                        .zip(&attn_seqs)
                        .map(|(s, a)| {
                            assert_eq!(
                                s.window_tables.len(),
                                grouping.as_ref().unwrap().num_window_groups,
                                "a table per window group"
                            );
                            AttnSeq {
                                block_table: &s.window_tables[g],
                                stored_start: s.start_position,
                                n_queries: a.n_queries,
                                row_offset: a.row_offset,
                            }
                        })
                        .collect()
                })
                .collect();
        // RoPE angles once per row, not once per layer and head.
        let half = c.head_dim / 2;
        let angles = |inv_freq: &[f32], cos_out: &mut [f32], sin_out: &mut [f32]| {
            for (r, &pos) in positions.iter().enumerate() {
                for i in 0..half {
                    let (sin, cos) = (pos as f32 * inv_freq[i]).sin_cos();
                    cos_out[r * half + i] = cos;
                    sin_out[r * half + i] = sin;
                }
            }
        };
        let (rope_cos, rope_sin) = (
            sized(&mut sc.rope_cos, n * half),
            sized(&mut sc.rope_sin, n * half),
        );
        angles(&self.inv_freq, rope_cos, rope_sin);
        let has_local = !self.inv_freq_local.is_empty();
        let (rope_cos_local, rope_sin_local) = (
            sized(&mut sc.rope_cos_local, if has_local { n * half } else { 0 }),
            sized(&mut sc.rope_sin_local, if has_local { n * half } else { 0 }),
        );
        if has_local {
            angles(&self.inv_freq_local, rope_cos_local, rope_sin_local);
        }

        let mut captured: Vec<Vec<f32>> = vec![Vec::new(); seqs.len()];
        let h = sized(&mut sc.h, n * d);
        let q = sized(&mut sc.q, n * qd);
        let k = sized(&mut sc.k, n * kvd);
        let v = sized(&mut sc.v, n * kvd);
        let attn = sized(&mut sc.attn, n * qd);
        let proj = sized(&mut sc.proj, n * d);
        let gate = sized(&mut sc.gate, n * c.d_ff);
        let up = sized(&mut sc.up, n * c.d_ff);
        let shape = AttnShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
        };

        for (li, lw) in self.weights.layers.iter().enumerate() {
            for r in 0..n {
                rmsnorm(
                    &x[r * d..(r + 1) * d],
                    &lw.attn_norm,
                    c.rms_eps,
                    &mut h[r * d..(r + 1) * d],
                );
            }
            // One pass: the normed input is quantised once for Q, K and V.
            matmul_multi(
                &[&lw.wq, &lw.wk, &lw.wv],
                h,
                n,
                &mut [&mut *q, &mut *k, &mut *v],
            );
            for (out, bias) in [(&mut *q, &lw.bq), (&mut *k, &lw.bk), (&mut *v, &lw.bv)] {
                if let Some(b) = bias {
                    out.chunks_exact_mut(b.len())
                        .for_each(|row| add_in_place(row, b));
                }
            }
            if let (Some(qn), Some(kn)) = (&lw.q_norm, &lw.k_norm) {
                rmsnorm_rows_in_place(q, qn, c.rms_eps);
                rmsnorm_rows_in_place(k, kn, c.rms_eps);
            }
            let window = c.layer_window(li);
            let (layer_cos, layer_sin): (&[f32], &[f32]) = if window.is_some() && has_local {
                (rope_cos_local, rope_sin_local)
            } else {
                (rope_cos, rope_sin)
            };
            for r in 0..n {
                let (cos, sin) = (
                    &layer_cos[r * half..(r + 1) * half],
                    &layer_sin[r * half..(r + 1) * half],
                );
                self.rope(&mut q[r * qd..(r + 1) * qd], cos, sin);
                self.rope(&mut k[r * kvd..(r + 1) * kvd], cos, sin);
            }
            if let Some(qs) = c.extras.query_scale {
                // Attention divides scores by √head_dim; this makes the net scale `qs`.
                let mul = qs * (c.head_dim as f32).sqrt();
                q.iter_mut().for_each(|v| *v *= mul);
            }
            for (si, a) in attn_seqs.iter().enumerate() {
                let want = capture_last.get(si).copied().unwrap_or(0).min(a.n_queries);
                if want > 0 {
                    let first = a.row_offset + a.n_queries - want;
                    captured[si].extend_from_slice(&q[first * qd..(first + want) * qd]);
                }
            }
            // The layer's group: 0 (the main table, stored indices) or a window group (its
            // own table, positions).
            let group = grouping.as_ref().map_or(0, |g| g.layer_group[li]);
            let layer_seqs = match group {
                0 => &attn_seqs,
                g => &window_attn_seqs[g - 1],
            };
            for a in layer_seqs.iter() {
                for i in 0..a.n_queries {
                    let idx = a.stored_start + i;
                    let r = a.row_offset + i;
                    store.write_token(
                        li,
                        a.block_table[idx / bs],
                        idx % bs,
                        &k[r * kvd..(r + 1) * kvd],
                        &v[r * kvd..(r + 1) * kvd],
                    );
                }
            }
            // Decode steps spread attention over the decode pool (same bits, see
            // `kernels::split_attn`); everything else takes the general path.
            if window.is_some() {
                paged_attention_window(store, li, shape, layer_seqs, q, attn, &first_visible);
            } else if !split_attention(store, li, shape, &attn_seqs, q, attn) {
                paged_attention(store, li, shape, &attn_seqs, q, attn);
            }
            matmul(&lw.wo, attn, n, proj);
            self.residual_add(x, proj, lw.post_attn_norm.as_deref(), h);

            for r in 0..n {
                rmsnorm(
                    &x[r * d..(r + 1) * d],
                    &lw.ffn_norm,
                    c.rms_eps,
                    &mut h[r * d..(r + 1) * d],
                );
            }
            matmul_multi(&[&lw.w_gate, &lw.w_up], h, n, &mut [&mut *gate, &mut *up]);
            if c.extras.gelu {
                gelu_mul_in_place(gate, up);
            } else {
                silu_mul_in_place(gate, up);
            }
            matmul(&lw.w_down, gate, n, proj);
            self.residual_add(x, proj, lw.post_ffn_norm.as_deref(), h);
        }

        // Only the requested rows go through the (large) output head.
        let sel = &mut sc.normed;
        sel.clear();
        for (s, a) in seqs.iter().zip(&attn_seqs) {
            for i in s.logits_from.min(s.tokens.len())..s.tokens.len() {
                let r = a.row_offset + i;
                let at = sel.len();
                sel.resize(at + d, 0.0);
                rmsnorm(
                    &x[r * d..(r + 1) * d],
                    &self.weights.output_norm,
                    c.rms_eps,
                    &mut sel[at..],
                );
            }
        }
        let n_out = sel.len() / d;
        let mut logits = vec![0f32; n_out * c.vocab_size];
        if n_out > 0 {
            matmul(self.weights.output_head(), sel, n_out, &mut logits);
        }
        (logits, captured)
    }

    /// `x += out`, through a post-norm first when the architecture has one (Gemma 3), with
    /// `tmp` (as long as `x`) as scratch.
    fn residual_add(&self, x: &mut [f32], out: &[f32], post_norm: Option<&[f32]>, tmp: &mut [f32]) {
        match post_norm {
            None => add_in_place(x, out),
            Some(w) => {
                let d = self.config.d_model;
                for (o, t) in out.chunks_exact(d).zip(tmp.chunks_exact_mut(d)) {
                    rmsnorm(o, w, self.config.rms_eps, t);
                }
                add_in_place(x, &tmp[..out.len()]);
            }
        }
    }

    /// Rotates every head of `x` (a row of q or k) by its position's angles.
    fn rope(&self, x: &mut [f32], cos: &[f32], sin: &[f32]) {
        let hd = self.config.head_dim;
        let half = hd / 2;
        for head in x.chunks_exact_mut(hd) {
            for i in 0..half {
                let (sin, cos) = (sin[i], cos[i]);
                let (a, b) = match self.config.rope_style {
                    RopeStyle::Normal => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos - x1 * sin;
                head[b] = x0 * sin + x1 * cos;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_store::{KvDtype, KvGeometry};
    use pk_gguf::GgmlType;

    /// The window's first stored index: by stored index without positions, by position
    /// with them (tokens dropped before, inside and after the window), and among the new
    /// tokens when every older one is outside.
    #[test]
    fn first_visible_follows_positions() {
        let table = [0u32];
        let plain = SeqForward {
            tokens: &[1, 2, 3],
            start_position: 10,
            stored_start: 10,
            block_table: &table,
            ..Default::default()
        };
        assert_eq!(
            (0..3)
                .map(|i| plain.first_visible(i, 4))
                .collect::<Vec<_>>(),
            [7, 8, 9]
        );
        // Stored tokens at positions 0, 1, 5, 8, 9 (others evicted); new tokens at 10, 11, 12.
        let pos = [0u32, 1, 5, 8, 9];
        let evicted = SeqForward {
            tokens: &[1, 2, 3],
            start_position: 10,
            stored_start: 5,
            block_table: &table,
            stored_positions: &pos,
            window_tables: &[],
            ..Default::default()
        };
        // Window 4 at position 10 covers positions 7..=10: stored 8 and 9 (indices 3, 4).
        assert_eq!(evicted.first_visible(0, 4), 3);
        // Window 6 at position 12 covers 7..=12: still from index 3.
        assert_eq!(evicted.first_visible(2, 6), 3);
        // Window 2 at position 12 covers 11..=12: the new tokens 1 and 2 (stored 6 and 7).
        assert_eq!(evicted.first_visible(2, 2), 6);
        // A window reaching before every token sees everything.
        assert_eq!(evicted.first_visible(1, 100), 0);
    }

    /// Decode steps give the same logits, bit for bit, whether the decode pool runs them on
    /// one thread or on several (matmul chunks and attention heads on any thread), and the
    /// same as the step's token computed inside a prefill: per-token arithmetic does not
    /// depend on the thread count.
    #[test]
    fn decode_bits_do_not_depend_on_pool_threads() {
        let mut cfg = ModelConfig::dummy("smollm2-135m").unwrap();
        cfg.n_layers = 2;
        cfg.vocab_size = 4096;
        let model = Llama::new(cfg.clone(), Weights::random(&cfg, GgmlType::Q4_1, 7));
        let pool = crate::kernels::pool::global();
        let g = KvGeometry {
            n_layers: cfg.n_layers,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            block_size_tokens: 16,
            num_blocks: 8,
        };
        let table: Vec<u32> = (0..8).collect();
        let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 4096).collect();
        let run = |threads: usize| {
            pool.set_active_threads(threads);
            let mut store = KvStore::new(g, KvDtype::F16);
            model.forward(
                &mut store,
                &[SeqForward {
                    tokens: &prompt[..30],
                    start_position: 0,
                    stored_start: 0,
                    block_table: &table,
                    logits_from: 30,
                    stored_positions: &[],
                    window_tables: &[],
                }],
            );
            let mut out = Vec::new();
            for (i, &t) in prompt[30..].iter().enumerate() {
                let pos = 30 + i;
                let l = model.forward(
                    &mut store,
                    &[SeqForward {
                        tokens: &[t],
                        start_position: pos,
                        stored_start: pos,
                        block_table: &table,
                        logits_from: 0,
                        stored_positions: &[],
                        window_tables: &[],
                    }],
                );
                out.extend(l.iter().map(|v| v.to_bits()));
            }
            out
        };
        let one = run(1);
        // Every step split (the tuner could otherwise run them inline).
        pool.set_tuning(false);
        let all = run(pool.threads());
        pool.set_tuning(true);
        pool.set_active_threads(pool.threads());
        assert_eq!(one, all);
        let mut store = KvStore::new(g, KvDtype::F16);
        let whole = model.forward(
            &mut store,
            &[SeqForward {
                tokens: &prompt,
                start_position: 0,
                stored_start: 0,
                block_table: &table,
                logits_from: 30,
                stored_positions: &[],
                window_tables: &[],
            }],
        );
        assert_eq!(one, whole.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    }
}
