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

mod forward;
pub use forward::Captures;

use crate::config::{ModelConfig, RopeStyle};
use crate::kernels::{add_in_place, rmsnorm};
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
    /// After a ragged eviction (`kvzip:global`: each (layer, KV head) keeps its own number
    /// of tokens), per (layer, KV head) at `layer * n_kv_heads + kv_head`: the first stored
    /// index that head attends to. Its kept tokens sit right-aligned just before the
    /// tokens stored after the eviction, and the slots before them hold nothing for it.
    /// Empty: every head sees every stored token. Not with sliding-window layers.
    pub head_first_keys: &'a [u32],
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

    /// `x += out`, through a post-norm first when the architecture has one (Gemma 3), with
    /// `tmp` (as long as `x`) as scratch; row by row, over rayon's threads for a prefill
    /// batch (`forward::par_rows`), with the same bits either way.
    fn residual_add(&self, x: &mut [f32], out: &[f32], post_norm: Option<&[f32]>, tmp: &mut [f32]) {
        let (d, eps) = (self.config.d_model, self.config.rms_eps);
        let tmp = &mut tmp[..x.len()];
        forward::par_rows((x, d), (tmp, d), |r, xr, t| {
            let o = &out[r * d..(r + 1) * d];
            match post_norm {
                None => add_in_place(xr, o),
                Some(w) => {
                    rmsnorm(o, w, eps, t);
                    add_in_place(xr, t);
                }
            }
        });
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
            head_first_keys: &[],
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
                    head_first_keys: &[],
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
                        head_first_keys: &[],
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
                head_first_keys: &[],
            }],
        );
        assert_eq!(one, whole.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    }
}
