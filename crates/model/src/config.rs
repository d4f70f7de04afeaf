//! Model hyper-parameters read from GGUF metadata (`{arch}.*` keys).

use crate::ModelError;

pub use crate::arch::SUPPORTED_ARCHS;

/// How RoPE pairs dimensions. llama.cpp calls these NORM (adjacent pairs, used by the
/// Llama architecture, whose GGUF converter permutes Q/K weights for it) and NEOX
/// (first half with second half, used by Gemma, Qwen, …).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    Normal,
    Neox,
}

/// Gemma 3's local attention: layers that see only the last `window_tokens` tokens, with
/// their own RoPE base; every `global_every`-th layer (counting from 1) is global.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlidingWindow {
    pub window_tokens: usize,
    pub global_every: usize,
    pub rope_theta_local: f32,
}

/// What an architecture adds to the Llama block. All off (the default) is Llama; Gemma 3
/// turns on every one of them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ArchExtras {
    /// Input embeddings are multiplied by this (Gemma: √d_model).
    pub embed_scale: Option<f32>,
    /// The MLP gates with GELU (tanh approximation) instead of SiLU.
    pub gelu: bool,
    /// Q and K are RMS-normalised per head (weights `attn_q_norm`, `attn_k_norm`) before RoPE.
    pub qk_norm: bool,
    /// The attention and MLP outputs are RMS-normalised before joining the residual stream
    /// (`post_attention_norm`, `post_ffw_norm`).
    pub post_norms: bool,
    pub sliding_window: Option<SlidingWindow>,
    /// Q, K and V projections add a bias (`attn_q.bias`, `attn_k.bias`, `attn_v.bias`):
    /// Qwen2.
    pub qkv_bias: bool,
    /// Queries are scaled by this before attention instead of 1/√head_dim (Gemma 3 27B:
    /// 1/√(d_model / n_heads), as llama.cpp's `f_attention_scale`).
    pub query_scale: Option<f32>,
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: String,
    pub name: String,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub d_model: usize,
    pub d_ff: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    /// Linear RoPE scaling: every angle of the full-attention layers is multiplied by this
    /// (1 / `rope.scaling.factor`; 1.0 without scaling). Sliding-window layers are never
    /// scaled (llama.cpp's `rope_freq_scale_train_swa`).
    pub rope_freq_scale: f32,
    /// Llama 3.1/3.2's per-frequency divisors (`rope_freqs.weight`, `head_dim / 2` of
    /// them): frequency i of the full-attention layers becomes `inv_freq[i] / factors[i]`.
    pub rope_freq_factors: Option<Vec<f32>>,
    pub rms_eps: f32,
    pub extras: ArchExtras,
}

impl ModelConfig {
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::BadConfig(m));
        if self.n_layers == 0 || self.n_heads == 0 || self.n_kv_heads == 0 || self.head_dim == 0 {
            return bad(format!("zero-sized dimension in {self:?}"));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "{} heads not divisible by {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim {} is odd; RoPE needs pairs",
                self.head_dim
            ));
        }
        Ok(())
    }

    /// The attention window of layer `layer`: `Some(tokens)` for a local layer, `None` for a
    /// global one (every layer of a Llama).
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        self.extras
            .sliding_window
            .filter(|w| !(layer + 1).is_multiple_of(w.global_every))
            .map(|w| w.window_tokens)
    }

    /// How layers share block tables when sliding-window layers get KV cache groups of
    /// their own (vLLM's hybrid KV cache manager): `None` unless the model has both global
    /// and windowed layers, all windows of one size.
    pub fn kv_group_layout(&self) -> Option<KvGroupLayout> {
        let windows: Vec<Option<usize>> =
            (0..self.n_layers).map(|l| self.layer_window(l)).collect();
        KvGroupLayout::for_windows(&windows)
    }

    /// RoPE's per-pair rotation frequencies (radians per position) of a full-attention
    /// layer (`local: false`) or a sliding-window one: `theta^(-2i/head_dim)`, then for full
    /// attention divided by the frequency factors and multiplied by the linear scale, as
    /// llama.cpp's `rope_yarn` does with `ext_factor` 0. Every backend rotates by these.
    pub fn rope_inv_freq(&self, local: bool) -> Vec<f32> {
        let hd = self.head_dim;
        let theta = match (local, self.extras.sliding_window) {
            (true, Some(w)) => w.rope_theta_local,
            _ => self.rope_theta,
        };
        (0..hd / 2)
            .map(|i| {
                let base = theta.powf(-2.0 * i as f32 / hd as f32);
                if local {
                    return base;
                }
                let factor = self.rope_freq_factors.as_ref().map_or(1.0, |f| f[i]);
                base / factor * self.rope_freq_scale
            })
            .collect()
    }

    /// Query heads per KV head (the GQA group size).
    pub fn group_size(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Shapes of real models, for random-weight benchmarks at sizes we cannot download:
    /// each with its real widths, heads, head length, RoPE base and scaling (Llama 3.1/3.2's
    /// frequency factors as llama.cpp's converter computes them, Gemma 3's linear scaling of
    /// its global layers) and architecture extras. The names are [`DUMMY_SHAPES`].
    pub fn dummy(name: &str) -> Option<ModelConfig> {
        let (arch, n_layers, n_heads, n_kv_heads, head_dim, d_model, d_ff, vocab_size, ctx, theta) =
            match name {
                "smollm2-135m" => ("llama", 30, 9, 3, 64, 576, 1536, 49152, 8192, 100000.0),
                "llama-3.2-1b" => ("llama", 16, 32, 8, 64, 2048, 8192, 128256, 131072, 500000.0),
                "llama-3.2-3b" => (
                    "llama", 28, 24, 8, 128, 3072, 8192, 128256, 131072, 500000.0,
                ),
                "llama-3.1-8b" => (
                    "llama", 32, 32, 8, 128, 4096, 14336, 128256, 131072, 500000.0,
                ),
                // Qwen2.5-1.5B's shape without its biases: a Llama of the same size.
                "qwen2.5-1.5b" => (
                    "llama", 28, 12, 2, 128, 1536, 8960, 151936, 32768, 1000000.0,
                ),
                "qwen3-0.6b" => (
                    "qwen3", 28, 16, 8, 128, 1024, 3072, 151936, 40960, 1000000.0,
                ),
                "qwen3-8b" => (
                    "qwen3", 36, 32, 8, 128, 4096, 12288, 151936, 40960, 1000000.0,
                ),
                "gemma-3-4b" => (
                    "gemma3", 34, 8, 4, 256, 2560, 10240, 262144, 131072, 1000000.0,
                ),
                _ => return None,
            };
        let mut cfg = ModelConfig {
            arch: arch.into(),
            name: format!("dummy-{name}"),
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
            d_model,
            d_ff,
            vocab_size,
            context_length: ctx,
            rope_theta: theta,
            rope_style: RopeStyle::Normal,
            rope_freq_scale: 1.0,
            rope_freq_factors: None,
            rms_eps: 1e-5,
            extras: ArchExtras::default(),
        };
        match name {
            "llama-3.2-1b" | "llama-3.2-3b" => {
                cfg.rope_freq_factors = Some(llama3_rope_factors(head_dim, theta, 32.0))
            }
            "llama-3.1-8b" => {
                cfg.rope_freq_factors = Some(llama3_rope_factors(head_dim, theta, 8.0))
            }
            _ => {}
        }
        match arch {
            "qwen3" => {
                cfg.rope_style = RopeStyle::Neox;
                cfg.rms_eps = 1e-6;
                cfg.extras.qk_norm = true;
            }
            "gemma3" => {
                cfg.rope_style = RopeStyle::Neox;
                cfg.rms_eps = 1e-6;
                cfg.rope_freq_scale = 1.0 / 8.0;
                cfg.extras = ArchExtras {
                    embed_scale: Some((d_model as f32).sqrt()),
                    gelu: true,
                    qk_norm: true,
                    post_norms: true,
                    sliding_window: Some(SlidingWindow {
                        window_tokens: 1024,
                        global_every: 6,
                        rope_theta_local: 10_000.0,
                    }),
                    ..Default::default()
                };
            }
            _ => {}
        }
        Some(cfg)
    }
}

/// The names `ModelConfig::dummy` knows.
pub const DUMMY_SHAPES: &[&str] = &[
    "smollm2-135m",
    "llama-3.2-1b",
    "llama-3.2-3b",
    "llama-3.1-8b",
    "qwen2.5-1.5b",
    "qwen3-0.6b",
    "qwen3-8b",
    "gemma-3-4b",
];

/// Llama 3.1/3.2's RoPE frequency factors (`rope_type: llama3`: low and high frequency
/// factors 1 and 4, trained at 8,192 tokens), as llama.cpp's converter writes them into
/// `rope_freqs.weight`: 1 for wavelengths under 2,048, `factor` over 8,192, smoothly
/// between.
pub fn llama3_rope_factors(head_dim: usize, theta: f32, factor: f32) -> Vec<f32> {
    let (low_freq_factor, high_freq_factor, old_ctx) = (1.0f64, 4.0f64, 8192.0f64);
    let (low_wavelen, high_wavelen) = (old_ctx / low_freq_factor, old_ctx / high_freq_factor);
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / (theta as f64).powf(2.0 * i as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth =
                    (old_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                (1.0 / ((1.0 - smooth) / factor as f64 + smooth)) as f32
            }
        })
        .collect()
}

/// Layers grouped into KV cache groups (vLLM v1's hybrid allocator). Group 0 holds the
/// full-attention layers and uses the sequence's main block table; every other group holds
/// up to as many sliding-window layers and has a table of its own, indexed by position,
/// whose blocks wholly behind the window are freed. All groups have the same number of
/// layers per block (`layers_per_block`, the number of full-attention layers), so one pool
/// of equal-sized blocks serves them all: a block belongs to one group at a time and holds
/// that group's layers in its `layers_per_block` layer slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGroupLayout {
    /// Per layer: its group (0: full attention; 1..: sliding-window groups).
    pub layer_group: Vec<usize>,
    /// Per layer: the layer slot of a block that holds it.
    pub layer_slot: Vec<usize>,
    pub layers_per_block: usize,
    pub num_window_groups: usize,
    pub window_tokens: usize,
}

impl KvGroupLayout {
    /// The layout for layers with these windows (`None`: full attention), or `None` when
    /// one table serves every layer anyway (no windowed or no full-attention layer, or
    /// windows of different sizes).
    pub fn for_windows(windows: &[Option<usize>]) -> Option<KvGroupLayout> {
        let full: Vec<usize> = (0..windows.len())
            .filter(|&l| windows[l].is_none())
            .collect();
        let local: Vec<usize> = (0..windows.len())
            .filter(|&l| windows[l].is_some())
            .collect();
        let window_tokens = windows[*local.first()?]?;
        if full.is_empty() || local.iter().any(|&l| windows[l] != Some(window_tokens)) {
            return None;
        }
        let per_block = full.len();
        let (mut layer_group, mut layer_slot) = (vec![0; windows.len()], vec![0; windows.len()]);
        for (i, &l) in full.iter().enumerate() {
            layer_slot[l] = i;
        }
        for (j, &l) in local.iter().enumerate() {
            layer_group[l] = 1 + j / per_block;
            layer_slot[l] = j % per_block;
        }
        Some(KvGroupLayout {
            layer_group,
            layer_slot,
            layers_per_block: per_block,
            num_window_groups: local.len().div_ceil(per_block),
            window_tokens,
        })
    }

    /// Number of groups, the full-attention group included.
    pub fn num_groups(&self) -> usize {
        1 + self.num_window_groups
    }
}

#[cfg(test)]
mod layout_tests {
    use super::KvGroupLayout;

    #[test]
    fn gemma3_layers_form_one_global_and_five_window_groups_of_three() {
        // Gemma-3-270M: 18 layers, every 6th global, windows of 512.
        let windows: Vec<Option<usize>> = (0..18)
            .map(|l| (!(l + 1usize).is_multiple_of(6)).then_some(512))
            .collect();
        let g = KvGroupLayout::for_windows(&windows).unwrap();
        assert_eq!(
            (g.layers_per_block, g.num_window_groups, g.num_groups()),
            (3, 5, 6)
        );
        assert_eq!((g.layer_group[5], g.layer_slot[5]), (0, 0));
        assert_eq!((g.layer_group[17], g.layer_slot[17]), (0, 2));
        assert_eq!((g.layer_group[0], g.layer_slot[0]), (1, 0));
        assert_eq!((g.layer_group[16], g.layer_slot[16]), (5, 2));
        // Every (group, slot) holds exactly one layer.
        let mut seen: Vec<(usize, usize)> = (0..18)
            .map(|l| (g.layer_group[l], g.layer_slot[l]))
            .collect();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 18);
        // One table serves all layers of a Llama, or of an all-windowed model.
        assert_eq!(KvGroupLayout::for_windows(&[None; 4]), None);
        assert_eq!(KvGroupLayout::for_windows(&[Some(8); 4]), None);
        assert_eq!(KvGroupLayout::for_windows(&[None, Some(8), Some(4)]), None);
    }
}
