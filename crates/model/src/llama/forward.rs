//! One forward call over a batch: embeddings, the per-row tables every layer shares
//! (attention tables, sliding-window bounds, RoPE angles), then per layer an attention
//! block and an MLP block, then the output head over the requested rows only.

use super::{sized, Llama, Scratch, SeqForward};
use crate::attention::{
    paged_attention, paged_attention_lse, paged_attention_window, AttnSeq, AttnShape,
};
use crate::config::KvGroupLayout;
use crate::config::ModelConfig;
use crate::kernels::{
    add_in_place, gelu_mul_in_place, matmul, matmul_multi, rmsnorm, rmsnorm_rows_in_place,
    silu_mul_in_place, split_attention,
};
use crate::kv_store::KvStore;
use crate::weights::LayerWeights;
use rayon::prelude::*;

/// Row-wise work on a batch of at least this many rows (a prefill chunk) is spread over
/// rayon's threads; decode's few rows stay on the calling thread. Norms, RoPE, biases and
/// residual adds were about 2 % of a two-thread 512-token prefill's wall time on one thread
/// while the other waited (Qwen2.5-Coder-1.5B, AVX2 kernels, 2026-12-07).
const PAR_MIN_ROWS: usize = 32;

/// Calls `f(r, a_r, b_r)` for every row `r`, where `a_r` and `b_r` are the `r`-th chunks of
/// `a.0` and `b.0` of widths `a.1` and `b.1` (as many rows as `a` has; a width of 0 gives
/// empty `b_r`); in parallel for large batches. Rows are independent, so the bits do not
/// depend on the split.
pub(super) fn par_rows(
    a: (&mut [f32], usize),
    b: (&mut [f32], usize),
    f: impl Fn(usize, &mut [f32], &mut [f32]) + Sync,
) {
    let ((a, wa), (b, wb)) = (a, b);
    let rows = a.len() / wa;
    let parallel = rows >= PAR_MIN_ROWS && rayon::current_num_threads() > 1;
    if wb == 0 {
        let one = |(r, ar): (usize, &mut [f32])| f(r, ar, &mut []);
        if parallel {
            a.par_chunks_exact_mut(wa)
                .enumerate()
                .with_min_len(8)
                .for_each(one);
        } else {
            a.chunks_exact_mut(wa).enumerate().for_each(one);
        }
        return;
    }
    assert!(b.len() >= rows * wb);
    let b = &mut b[..rows * wb];
    if parallel {
        a.par_chunks_exact_mut(wa)
            .zip(b.par_chunks_exact_mut(wb))
            .enumerate()
            .with_min_len(8)
            .for_each(|(r, (ar, br))| f(r, ar, br));
    } else {
        for (r, (ar, br)) in a
            .chunks_exact_mut(wa)
            .zip(b.chunks_exact_mut(wb))
            .enumerate()
        {
            f(r, ar, br);
        }
    }
}

/// What every layer of one call reads about the batch's sequences.
struct BatchLayout<'a> {
    /// Per sequence, its attention over the main table (stored indices).
    attn_seqs: Vec<AttnSeq<'a>>,
    /// Per window group, per sequence, its attention over the group's own table.
    window_attn_seqs: Vec<Vec<AttnSeq<'a>>>,
    /// Sliding-window layers: each row's first visible stored index (or position, with
    /// groups); empty without sliding-window layers.
    first_visible: Vec<usize>,
    grouping: Option<KvGroupLayout>,
    /// Per sequence, how many of its last rows' queries to capture (missing means none).
    capture_last: &'a [usize],
}

/// What a forward call captures per sequence for the eviction policies that score with
/// attention: the post-RoPE queries of its last rows (`[layer][token][n_heads *
/// head_dim]`) and, when asked for, their attention's log-sum-exp (`[layer][token][n_heads]`,
/// NaN where the kernel that ran does not give it: sliding-window layers, quantised K/V,
/// CPUs without AVX-512).
#[derive(Debug, Default)]
pub struct Captures {
    pub queries: Vec<Vec<f32>>,
    pub lse: Option<Vec<Vec<f32>>>,
}

/// Each row's RoPE angles (`head_dim / 2` cosines and sines), computed once per call.
struct RopeRows<'s> {
    cos: &'s [f32],
    sin: &'s [f32],
    /// The sliding-window layers' own angles (Gemma 3), empty when they share the base.
    cos_local: &'s [f32],
    sin_local: &'s [f32],
}

/// The per-layer activations, `n` rows each.
struct LayerBufs<'s> {
    h: &'s mut [f32],
    q: &'s mut [f32],
    k: &'s mut [f32],
    v: &'s mut [f32],
    attn: &'s mut [f32],
    proj: &'s mut [f32],
    gate: &'s mut [f32],
    up: &'s mut [f32],
}

impl Llama {
    /// Like `forward`, and also returns, per sequence, the post-RoPE queries of its last
    /// `capture_last[i]` new tokens (`[layer][token][n_heads * head_dim]`), which
    /// attention-based eviction policies score with. A missing entry means none.
    pub fn forward_with_queries(
        &self,
        store: &mut KvStore,
        seqs: &[SeqForward],
        capture_last: &[usize],
    ) -> (Vec<f32>, Vec<Vec<f32>>) {
        let (logits, captures) = self.forward_capturing(store, seqs, capture_last, false);
        (logits, captures.queries)
    }

    /// Like [`Llama::forward_with_queries`], with the captured rows' log-sum-exp too when
    /// `with_lse` (KVzip's scoring then needs no second pass over a pass's own keys).
    pub fn forward_capturing(
        &self,
        store: &mut KvStore,
        seqs: &[SeqForward],
        capture_last: &[usize],
        with_lse: bool,
    ) -> (Vec<f32>, Captures) {
        let c = &self.config;
        let n: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        // A decode step: the pool times it and chooses whether to split it (see `Pool::step`).
        let _step = (n <= crate::kernels::pool::DECODE_MAX_TOKENS)
            .then(|| crate::kernels::pool::global().step(n));
        let mut guard = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let sc = &mut *guard;
        self.embed(seqs, sc);
        let layout = batch_layout(c, seqs, store.grouping().cloned(), capture_last);
        let rope = self.rope_rows(
            &sc.positions,
            [
                &mut sc.rope_cos,
                &mut sc.rope_sin,
                &mut sc.rope_cos_local,
                &mut sc.rope_sin_local,
            ],
        );
        let mut bufs = LayerBufs {
            h: sized(&mut sc.h, n * c.d_model),
            q: sized(&mut sc.q, n * c.q_dim()),
            k: sized(&mut sc.k, n * c.kv_dim()),
            v: sized(&mut sc.v, n * c.kv_dim()),
            attn: sized(&mut sc.attn, n * c.q_dim()),
            proj: sized(&mut sc.proj, n * c.d_model),
            gate: sized(&mut sc.gate, n * c.d_ff),
            up: sized(&mut sc.up, n * c.d_ff),
        };
        let x = &mut sc.x[..n * c.d_model];
        let mut captured = Captures {
            queries: vec![Vec::new(); seqs.len()],
            lse: with_lse.then(|| vec![Vec::new(); seqs.len()]),
        };
        // The last layer's attention output and MLP feed only the logits. Without logits to
        // return (a prefill chunk before the last, KVzip's reconstruction pass), that layer
        // stops once it has written its KV and given its queries.
        let wants_logits = seqs.iter().any(|s| s.logits_from < s.tokens.len());
        let n_layers = self.weights.layers.len();
        for (li, lw) in self.weights.layers.iter().enumerate() {
            let kv_only = !wants_logits && li + 1 == n_layers;
            let parts = (&rope, &layout);
            self.attention_block(li, lw, x, &mut bufs, parts, store, &mut captured, kv_only);
            if !kv_only {
                self.mlp_block(lw, x, &mut bufs);
            }
        }
        let logits = self.output_logits(x, seqs, &layout.attn_seqs, &mut sc.normed);
        (logits, captured)
    }

    /// Fills `sc.x` with the tokens' embeddings and `sc.positions` with their positions.
    fn embed(&self, seqs: &[SeqForward], sc: &mut Scratch) {
        let c = &self.config;
        let d = c.d_model;
        let n: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let x = sized(&mut sc.x, n * d);
        sc.positions.clear();
        for s in seqs {
            for (i, &t) in s.tokens.iter().enumerate() {
                let row = sc.positions.len();
                let xr = &mut x[row * d..(row + 1) * d];
                self.weights.token_embd.dequantize_row(t as usize, xr);
                if let Some(scale) = c.extras.embed_scale {
                    xr.iter_mut().for_each(|v| *v *= scale);
                }
                sc.positions.push(s.start_position + i);
            }
        }
    }

    /// RoPE angles once per row, not once per layer and head.
    /// `bufs` are the scratch vectors for cos, sin, and the local layers' cos and sin.
    fn rope_rows<'s>(&self, positions: &[usize], bufs: [&'s mut Vec<f32>; 4]) -> RopeRows<'s> {
        let half = self.config.head_dim / 2;
        let n = positions.len();
        let [cos_buf, sin_buf, cos_local_buf, sin_local_buf] = bufs;
        let angles = |inv_freq: &[f32], cos_out: &mut [f32], sin_out: &mut [f32]| {
            for (r, &pos) in positions.iter().enumerate() {
                for i in 0..half {
                    let (sin, cos) = (pos as f32 * inv_freq[i]).sin_cos();
                    cos_out[r * half + i] = cos;
                    sin_out[r * half + i] = sin;
                }
            }
        };
        let (cos, sin) = (sized(cos_buf, n * half), sized(sin_buf, n * half));
        angles(&self.inv_freq, cos, sin);
        let local_rows = if self.inv_freq_local.is_empty() { 0 } else { n };
        let (cos_local, sin_local) = (
            sized(cos_local_buf, local_rows * half),
            sized(sin_local_buf, local_rows * half),
        );
        if local_rows > 0 {
            angles(&self.inv_freq_local, cos_local, sin_local);
        }
        RopeRows {
            cos,
            sin,
            cos_local,
            sin_local,
        }
    }

    /// `x += attention(norm(x))` for layer `li`: Q/K/V projections (with biases and Q/K
    /// norms where the architecture has them), RoPE, the new K/V written to the store,
    /// attention over the layer's table, the output projection. With `kv_only` it stops
    /// once the new K/V are written and the queries captured (`x` is left as it was), or
    /// once the attention has given its log-sum-exp when that is captured.
    #[allow(clippy::too_many_arguments)]
    fn attention_block(
        &self,
        li: usize,
        lw: &LayerWeights,
        x: &mut [f32],
        b: &mut LayerBufs,
        (rope, layout): (&RopeRows, &BatchLayout),
        store: &mut KvStore,
        captured: &mut Captures,
        kv_only: bool,
    ) {
        let c = &self.config;
        self.norm_rows(x, &lw.attn_norm, b.h);
        // One pass: the normed input is quantised once for Q, K and V.
        matmul_multi(
            &[&lw.wq, &lw.wk, &lw.wv],
            b.h,
            b.h.len() / c.d_model,
            &mut [&mut *b.q, &mut *b.k, &mut *b.v],
        );
        for (out, bias) in [
            (&mut *b.q, &lw.bq),
            (&mut *b.k, &lw.bk),
            (&mut *b.v, &lw.bv),
        ] {
            if let Some(bias) = bias {
                let w = bias.len();
                par_rows((out, w), (&mut [], 0), |_, row, _| add_in_place(row, bias));
            }
        }
        if let (Some(qn), Some(kn)) = (&lw.q_norm, &lw.k_norm) {
            rmsnorm_rows_in_place(b.q, qn, c.rms_eps);
            rmsnorm_rows_in_place(b.k, kn, c.rms_eps);
        }
        let window = c.layer_window(li);
        self.rope_qk(b, rope, window.is_some());
        capture_rows(c.q_dim(), layout, b.q, &mut captured.queries);
        // The layer's group: 0 (the main table, stored indices) or a window group (its
        // own table, positions).
        let group = layout.grouping.as_ref().map_or(0, |g| g.layer_group[li]);
        let layer_seqs = match group {
            0 => &layout.attn_seqs,
            g => &layout.window_attn_seqs[g - 1],
        };
        write_new_kv(store, li, layer_seqs, b.k, b.v, c.kv_dim());
        if kv_only && captured.lse.is_none() {
            return;
        }
        let shape = AttnShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
        };
        // Decode steps spread attention over the decode pool (same bits, see
        // `kernels::split_attn`); everything else takes the general path.
        let attn_seqs = &layout.attn_seqs;
        if let Some(lse_captured) = captured.lse.as_mut() {
            let mut lse = vec![f32::NAN; b.q.len() / c.q_dim() * c.n_heads];
            if window.is_some() {
                let first_visible = &layout.first_visible;
                paged_attention_window(store, li, shape, layer_seqs, b.q, b.attn, first_visible);
            } else {
                paged_attention_lse(store, li, shape, attn_seqs, b.q, b.attn, &mut lse);
            }
            capture_rows(c.n_heads, layout, &lse, lse_captured);
            if kv_only {
                return;
            }
        } else if window.is_some() {
            let first_visible = &layout.first_visible;
            paged_attention_window(store, li, shape, layer_seqs, b.q, b.attn, first_visible);
        } else if !split_attention(store, li, shape, attn_seqs, b.q, b.attn) {
            paged_attention(store, li, shape, attn_seqs, b.q, b.attn);
        }
        matmul(&lw.wo, b.attn, b.attn.len() / c.q_dim(), b.proj);
        self.residual_add(x, b.proj, lw.post_attn_norm.as_deref(), b.h);
    }

    /// RoPE on every row's queries and keys, with the local angles on sliding-window
    /// layers when they have their own base; then Gemma 3's query scale.
    fn rope_qk(&self, b: &mut LayerBufs, rope: &RopeRows, windowed: bool) {
        let c = &self.config;
        let (half, qd, kvd) = (c.head_dim / 2, c.q_dim(), c.kv_dim());
        let (cos, sin) = if windowed && !rope.cos_local.is_empty() {
            (rope.cos_local, rope.sin_local)
        } else {
            (rope.cos, rope.sin)
        };
        // Attention divides scores by √head_dim; this makes the net scale `qs`.
        let q_mul = c
            .extras
            .query_scale
            .map(|qs| qs * (c.head_dim as f32).sqrt());
        par_rows((&mut *b.q, qd), (&mut *b.k, kvd), |r, q, k| {
            let rows = r * half..(r + 1) * half;
            let (cos, sin) = (&cos[rows.clone()], &sin[rows]);
            self.rope(q, cos, sin);
            self.rope(k, cos, sin);
            if let Some(mul) = q_mul {
                q.iter_mut().for_each(|v| *v *= mul);
            }
        });
    }

    /// `x += mlp(norm(x))`: SwiGLU, or GeGLU where the architecture has it.
    fn mlp_block(&self, lw: &LayerWeights, x: &mut [f32], b: &mut LayerBufs) {
        let c = &self.config;
        let n = x.len() / c.d_model;
        self.norm_rows(x, &lw.ffn_norm, b.h);
        matmul_multi(
            &[&lw.w_gate, &lw.w_up],
            b.h,
            n,
            &mut [&mut *b.gate, &mut *b.up],
        );
        if c.extras.gelu {
            gelu_mul_in_place(b.gate, b.up);
        } else {
            silu_mul_in_place(b.gate, b.up);
        }
        matmul(&lw.w_down, b.gate, n, b.proj);
        self.residual_add(x, b.proj, lw.post_ffn_norm.as_deref(), b.h);
    }

    /// `out` row r = rmsnorm(`x` row r) with `weight`.
    fn norm_rows(&self, x: &[f32], weight: &[f32], out: &mut [f32]) {
        let (d, eps) = (self.config.d_model, self.config.rms_eps);
        let out = &mut out[..x.len()];
        par_rows((out, d), (&mut [], 0), |r, or, _| {
            rmsnorm(&x[r * d..(r + 1) * d], weight, eps, or)
        });
    }

    /// Only the requested rows go through the (large) output head.
    fn output_logits(
        &self,
        x: &[f32],
        seqs: &[SeqForward],
        attn_seqs: &[AttnSeq],
        sel: &mut Vec<f32>,
    ) -> Vec<f32> {
        let c = &self.config;
        let d = c.d_model;
        sel.clear();
        for (s, a) in seqs.iter().zip(attn_seqs) {
            for i in s.logits_from.min(s.tokens.len())..s.tokens.len() {
                let r = a.row_offset + i;
                let at = sel.len();
                sel.resize(at + d, 0.0);
                let out = &mut sel[at..];
                rmsnorm(
                    &x[r * d..(r + 1) * d],
                    &self.weights.output_norm,
                    c.rms_eps,
                    out,
                );
            }
        }
        let n_out = sel.len() / d;
        let mut logits = vec![0f32; n_out * c.vocab_size];
        if n_out > 0 {
            matmul(self.weights.output_head(), sel, n_out, &mut logits);
        }
        logits
    }
}

/// The batch's attention tables and sliding-window bounds.
fn batch_layout<'a>(
    c: &ModelConfig,
    seqs: &'a [SeqForward<'a>],
    grouping: Option<KvGroupLayout>,
    capture_last: &'a [usize],
) -> BatchLayout<'a> {
    let mut attn_seqs = Vec::with_capacity(seqs.len());
    let mut row = 0;
    for s in seqs {
        assert!(
            s.head_first_keys.is_empty()
                || (s.head_first_keys.len() == c.n_layers * c.n_kv_heads
                    && c.extras.sliding_window.is_none()),
            "head_first_keys: one per (layer, KV head), and not with sliding-window layers"
        );
        attn_seqs.push(AttnSeq {
            block_table: s.block_table,
            stored_start: s.stored_start,
            n_queries: s.tokens.len(),
            row_offset: row,
            head_first_keys: s.head_first_keys,
        });
        row += s.tokens.len();
    }
    let num_window_groups = grouping.as_ref().map_or(0, |g| g.num_window_groups);
    let window_attn_seqs = (0..num_window_groups)
        .map(|g| {
            seqs.iter()
                .zip(&attn_seqs)
                .map(|(s, a)| {
                    assert_eq!(
                        s.window_tables.len(),
                        num_window_groups,
                        "a table per window group"
                    );
                    AttnSeq {
                        block_table: &s.window_tables[g],
                        stored_start: s.start_position,
                        n_queries: a.n_queries,
                        row_offset: a.row_offset,
                        head_first_keys: &[],
                    }
                })
                .collect()
        })
        .collect();
    BatchLayout {
        attn_seqs,
        window_attn_seqs,
        first_visible: first_visible_rows(c, seqs, grouping.is_some()),
        grouping,
        capture_last,
    }
}

/// Sliding-window layers: each row's first visible stored index (the same for every such
/// layer). With KV cache groups, windowed layers read their group's own table, indexed by
/// position, so a row's first visible index is a position.
fn first_visible_rows(c: &ModelConfig, seqs: &[SeqForward], grouped: bool) -> Vec<usize> {
    let Some(w) = c.extras.sliding_window else {
        return Vec::new();
    };
    let window = w.window_tokens;
    seqs.iter()
        .flat_map(|s| {
            (0..s.tokens.len()).map(move |i| match grouped {
                false => s.first_visible(i, window),
                true => (s.start_position + i + 1).saturating_sub(window),
            })
        })
        .collect()
}

/// Appends each sequence's last `capture_last[si]` rows of `rows` (`width` floats a row:
/// post-RoPE queries, or log-sum-exps) to its capture.
fn capture_rows(width: usize, layout: &BatchLayout, rows: &[f32], captured: &mut [Vec<f32>]) {
    let qd = width;
    for (si, a) in layout.attn_seqs.iter().enumerate() {
        let want = layout
            .capture_last
            .get(si)
            .copied()
            .unwrap_or(0)
            .min(a.n_queries);
        if want > 0 {
            let first = a.row_offset + a.n_queries - want;
            captured[si].extend_from_slice(&rows[first * qd..(first + want) * qd]);
        }
    }
}

/// Writes the new rows' K/V into the layer's table at their stored indices.
fn write_new_kv(
    store: &mut KvStore,
    li: usize,
    layer_seqs: &[AttnSeq],
    k: &[f32],
    v: &[f32],
    kvd: usize,
) {
    let bs = store.geometry.block_size_tokens;
    for a in layer_seqs {
        for i in 0..a.n_queries {
            let idx = a.stored_start + i;
            let r = a.row_offset + i;
            let (kr, vr) = (&k[r * kvd..(r + 1) * kvd], &v[r * kvd..(r + 1) * kvd]);
            store.write_token(li, a.block_table[idx / bs], idx % bs, kr, vr);
        }
    }
}
