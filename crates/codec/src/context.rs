//! `KvContext`: the uncompressed KV of one stored context (or chunk), the codec's input
//! and output. Plain `Vec<f32>`s in a fixed layout, so callers can fill it from the paged
//! pool's f16 blocks without a tensor type.

use half::f16;

use crate::error::CodecError;

/// Limits on every dimension, so that no header (or caller) can make the codec allocate or
/// loop without bound. They are far above any model this engine runs.
pub const MAX_LAYERS: usize = 1024;
pub const MAX_KV_HEADS: usize = 1024;
pub const MAX_HEAD_DIM: usize = 4096;
pub const MAX_TOKENS: usize = 1 << 24;

/// The dimensions of a context, without its data. `n_tokens` is the number of tokens
/// before any dropping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub n_tokens: usize,
}

impl KvShape {
    /// Elements in one of K or V at `n_tokens` tokens.
    pub fn elements(&self, n_tokens: usize) -> usize {
        self.n_layers * self.n_kv_heads * n_tokens * self.head_dim
    }

    /// Bytes per token of K and V in f16: the uncompressed baseline
    /// (SmolLM2-135M: 30 × 3 × 64 × 2 × 2 = 23,040 B/token).
    pub fn f16_bytes_per_token(&self) -> usize {
        self.n_layers * self.n_kv_heads * self.head_dim * 2 * 2
    }

    pub(crate) fn validate(&self) -> Result<(), CodecError> {
        let dims = [
            ("n_layers", self.n_layers, MAX_LAYERS),
            ("n_kv_heads", self.n_kv_heads, MAX_KV_HEADS),
            ("head_dim", self.head_dim, MAX_HEAD_DIM),
            ("n_tokens", self.n_tokens, MAX_TOKENS),
        ];
        for (name, value, max) in dims {
            if value == 0 || value > max {
                return Err(CodecError::context(format!(
                    "{name} = {value}, must be in 1..={max}"
                )));
            }
        }
        Ok(())
    }
}

/// The KV of one context.
///
/// Layout of `k` and `v`: `[layer][kv_head][token][head_dim]`, row-major, f32, with
/// `token` indexing the stored tokens in the order of `positions`. Keys are as the engine
/// caches them (post-RoPE), so `positions` must travel with them: after token dropping the
/// stored tokens are no longer `0..n`, and a consumer that appends a query must place it
/// after `n_original_tokens`, not after the stored count.
///
/// Invariants (`validate`): every dimension at least 1 and within the `MAX_*` limits;
/// `positions` strictly increasing; `k.len() == v.len() == layers × heads × tokens × dim`;
/// `n_original_tokens >= positions.len()`; a `window` part is valid on its own, has no
/// window part of its own, the same heads and head dim, and is whole: consecutive
/// positions ending at `n_original_tokens - 1`.
///
/// With a `window` part (a model with sliding-window layers stored by KV cache groups),
/// `k`/`v` hold only the full-attention layers, in model order, and the window part holds
/// the sliding-window layers for the positions the next token's window sees.
#[derive(Clone, Debug, PartialEq)]
pub struct KvContext {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Tokens the context had before any dropping (equal to `positions.len()` if none).
    pub n_original_tokens: usize,
    /// Position (RoPE index) of each stored token.
    pub positions: Vec<u32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// The sliding-window layers' tail, for a context stored with KV cache groups.
    pub window: Option<Box<WindowKv>>,
}

/// The sliding-window layers of a context stored with KV cache groups: only the tail
/// window that a token placed right after the context sees. Token dropping never touches
/// it (its layers read positions, and the tail is what they read); quantization does.
#[derive(Clone, Debug, PartialEq)]
pub struct WindowKv {
    /// Model layer index of each sliding-window layer, strictly increasing. The
    /// context's own `k`/`v` hold the other layers; model layers number
    /// `n_layers + layers.len()` in all.
    pub layers: Vec<u32>,
    /// The window layers' KV (`kv.n_layers == layers.len()`), whole and ending at the
    /// context's last position.
    pub kv: KvContext,
}

impl WindowKv {
    /// Checks the invariants against the context `main` it belongs to.
    fn validate_in(&self, main: &KvContext) -> Result<(), CodecError> {
        let kv = &self.kv;
        kv.validate()?;
        let n_model_layers = main.n_layers + self.layers.len();
        let layers_ok = self.layers.windows(2).all(|w| w[0] < w[1])
            && self
                .layers
                .last()
                .is_some_and(|&l| (l as usize) < n_model_layers)
            && n_model_layers <= MAX_LAYERS;
        if !layers_ok || kv.n_layers != self.layers.len() {
            return Err(CodecError::context(
                "window layers must be strictly increasing model layers, one per window layer",
            ));
        }
        if kv.window.is_some() || (kv.n_kv_heads, kv.head_dim) != (main.n_kv_heads, main.head_dim) {
            return Err(CodecError::context(
                "a window part must have the context's heads and no window of its own",
            ));
        }
        let first = main.n_original_tokens.saturating_sub(kv.n_tokens());
        let whole_tail = kv.n_original_tokens == kv.n_tokens()
            && kv
                .positions
                .iter()
                .enumerate()
                .all(|(i, &p)| p as usize == first + i);
        if !whole_tail || kv.n_tokens() > main.n_original_tokens {
            return Err(CodecError::context(
                "a window part must hold consecutive positions ending at the context's last",
            ));
        }
        Ok(())
    }
}

impl KvContext {
    /// A full (never dropped) context. Checks the invariants.
    pub fn new(
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
        positions: Vec<u32>,
        k: Vec<f32>,
        v: Vec<f32>,
    ) -> Result<Self, CodecError> {
        let n_original_tokens = positions.len();
        let ctx = KvContext {
            n_layers,
            n_kv_heads,
            head_dim,
            n_original_tokens,
            positions,
            k,
            v,
            window: None,
        };
        ctx.validate()?;
        Ok(ctx)
    }

    /// As `new`, from f16 arrays (the paged pool's dtype).
    pub fn from_f16(
        n_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
        positions: Vec<u32>,
        k: &[f16],
        v: &[f16],
    ) -> Result<Self, CodecError> {
        let widen = |xs: &[f16]| xs.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
        Self::new(
            n_layers,
            n_kv_heads,
            head_dim,
            positions,
            widen(k),
            widen(v),
        )
    }

    /// Number of stored tokens.
    pub fn n_tokens(&self) -> usize {
        self.positions.len()
    }

    /// The shape of the stored tokens.
    pub fn shape(&self) -> KvShape {
        KvShape {
            n_layers: self.n_layers,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            n_tokens: self.n_tokens(),
        }
    }

    /// The `[token][head_dim]` slice of K for one layer and KV head.
    pub fn k_head(&self, layer: usize, kv_head: usize) -> &[f32] {
        &self.k[self.head_range(layer, kv_head)]
    }

    /// The `[token][head_dim]` slice of V for one layer and KV head.
    pub fn v_head(&self, layer: usize, kv_head: usize) -> &[f32] {
        &self.v[self.head_range(layer, kv_head)]
    }

    fn head_range(&self, layer: usize, kv_head: usize) -> std::ops::Range<usize> {
        let len = self.n_tokens() * self.head_dim;
        let start = (layer * self.n_kv_heads + kv_head) * len;
        start..start + len
    }

    /// Checks the invariants listed on the type.
    pub fn validate(&self) -> Result<(), CodecError> {
        self.shape().validate()?;
        let expected = self.shape().elements(self.n_tokens());
        if self.k.len() != expected || self.v.len() != expected {
            return Err(CodecError::context(format!(
                "k has {} and v has {} elements, shape needs {expected}",
                self.k.len(),
                self.v.len()
            )));
        }
        if self.positions.windows(2).any(|w| w[0] >= w[1]) {
            return Err(CodecError::context("positions must be strictly increasing"));
        }
        if self.n_original_tokens < self.n_tokens() || self.n_original_tokens > MAX_TOKENS {
            return Err(CodecError::context(format!(
                "n_original_tokens = {} must be in {}..={MAX_TOKENS}",
                self.n_original_tokens,
                self.n_tokens()
            )));
        }
        match &self.window {
            Some(w) => w.validate_in(self),
            None => Ok(()),
        }
    }

    /// Stored f32 elements of K and V together, the window part's included: what the
    /// context pins in memory.
    pub fn n_elements(&self) -> usize {
        self.k.len() + self.v.len() + self.window.as_ref().map_or(0, |w| w.kv.n_elements())
    }

    /// The context restricted to the stored tokens at indices `kept` (strictly increasing,
    /// in range), positions preserved and `n_original_tokens` unchanged; a window part is
    /// kept as it is. Panics on bad
    /// indices: they come from the caller's own selection, not from untrusted input.
    pub fn retain_tokens(&self, kept: &[usize]) -> KvContext {
        assert!(
            kept.windows(2).all(|w| w[0] < w[1]),
            "kept indices must be strictly increasing"
        );
        assert!(
            kept.last().is_none_or(|&i| i < self.n_tokens()),
            "kept index out of range"
        );
        let d = self.head_dim;
        let n_heads_total = self.n_layers * self.n_kv_heads;
        let gather = |src: &[f32]| {
            let mut out = Vec::with_capacity(n_heads_total * kept.len() * d);
            for head in src.chunks_exact(self.n_tokens() * d) {
                for &t in kept {
                    out.extend_from_slice(&head[t * d..(t + 1) * d]);
                }
            }
            out
        };
        KvContext {
            n_layers: self.n_layers,
            n_kv_heads: self.n_kv_heads,
            head_dim: d,
            n_original_tokens: self.n_original_tokens,
            positions: kept.iter().map(|&t| self.positions[t]).collect(),
            k: gather(&self.k),
            v: gather(&self.v),
            window: self.window.clone(),
        }
    }
}
