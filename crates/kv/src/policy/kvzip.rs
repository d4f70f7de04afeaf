//! KVzip's token scores (issue 37; arXiv 2505.23416, as kvpress 0.5.5's `KVzipPress` and
//! the authors' `attention/score.py` compute them): after a context is prefilled, the model
//! is teacher-forced on a reconstruction prompt (the request to repeat the context, the
//! chat template's turn change, then a chunk of the context itself) and each context token
//! of the chunk is scored, per layer and KV head, by the largest attention any query of
//! that pass, in any query head of the KV head's group, gives it. The softmax is taken over
//! the sink tokens, the chunk and the pass's own tokens only (causally), not over the
//! whole context. The pass's own K/V is then discarded.
//!
//! This module is the arithmetic: the chunk plan, the reconstruction prompt of a chunk,
//! the scores of one pass from its queries and the stored keys, and how many entries each
//! (layer, KV head) keeps under a budget. Running the pass is the engine's.

use std::ops::Range;

use super::scored::TokenScorer;
use super::view::{KvView, QueryView};

/// The `kvzip` policy's scorer: the scores of the engine's reconstruction passes for its
/// unit (one per stored token of the context), handed over before prefill selection. Tokens
/// stored after the context (decode) score 1, as the sinks do: KVzip scores a context
/// once, and at decode the lowest-scored context blocks leave first.
#[derive(Debug, Default)]
pub(crate) struct KvzipScorer {
    prior: Option<Vec<f32>>,
}

impl TokenScorer for KvzipScorer {
    fn set_prior(&mut self, scores: Vec<f32>) {
        self.prior = Some(scores);
    }

    fn score(
        &mut self,
        _kv: &dyn KvView,
        _queries: Option<&dyn QueryView>,
        tokens: Range<usize>,
        out: &mut Vec<f32>,
    ) {
        let prior = self
            .prior
            .as_ref()
            .expect("kvzip: no reconstruction scores; the engine runs KVzip's passes first");
        out.clear();
        out.extend(tokens.map(|t| prior.get(t).copied().unwrap_or(1.0)));
    }
}

/// The first tokens, always kept (score 1, the largest an attention weight can be).
pub const KVZIP_SINK_TOKENS: usize = 4;
/// Context tokens a reconstruction pass repeats.
pub const KVZIP_CHUNK_TOKENS: usize = 2048;
/// The most tokens a pass may add to its chunk (the prompt, the quote of the previous
/// chunk and the template's turn change): what admission reserves beyond the chunk.
pub const KVZIP_PROMPT_MAX_TOKENS: usize = 64;
/// Tokens of the previous chunk a later chunk's prompt quotes ("…starting with …").
pub const KVZIP_PREV_POSTFIX_TOKENS: usize = 8;

/// The prompt before the first chunk, and before later ones (then followed by the
/// previous chunk's last [`KVZIP_PREV_POSTFIX_TOKENS`] tokens), as kvpress writes them.
pub const KVZIP_FIRST_PROMPT: &str = "\n\nRepeat the previous context exactly.";
pub const KVZIP_LATER_PROMPT: &str =
    "\n\nRepeat the part of the previous context exactly, starting with";

/// The chunks of a context of `n_context` tokens whose scores the passes compute, after a
/// template prefix of `prefix_tokens` (scored 0 but for the sinks, as kvpress leaves it).
pub fn kvzip_chunks(
    prefix_tokens: usize,
    n_context: usize,
    chunk_tokens: usize,
) -> Vec<Range<usize>> {
    (prefix_tokens..n_context)
        .step_by(chunk_tokens.max(1))
        .map(|s| s..(s + chunk_tokens).min(n_context))
        .collect()
}

/// The token ids of the pass over `chunks[c]` of `context`: the first or later prompt
/// (with the previous chunk's last tokens), the template's turn change, the chunk.
pub fn kvzip_pass_ids(
    context: &[u32],
    chunks: &[Range<usize>],
    c: usize,
    first_prompt: &[u32],
    later_prompt: &[u32],
    turn_change: &[u32],
) -> Vec<u32> {
    let mut ids = match c {
        0 => first_prompt.to_vec(),
        _ => {
            let prev = &context[chunks[c - 1].clone()];
            let quote = &prev[prev.len().saturating_sub(KVZIP_PREV_POSTFIX_TOKENS)..];
            [later_prompt, quote].concat()
        }
    };
    ids.extend_from_slice(turn_change);
    ids.extend_from_slice(&context[chunks[c].clone()]);
    ids
}

/// Scores `[layer][kv_head][token]` of a context of `n_context` tokens before any pass:
/// the sinks 1, everything else 0 (tokens of a template prefix keep these; a pass sets
/// its chunk's).
pub fn kvzip_initial_scores(n_layers: usize, n_kv_heads: usize, n_context: usize) -> Vec<f32> {
    let mut s = vec![0f32; n_layers * n_kv_heads * n_context];
    for row in s.chunks_exact_mut(n_context.max(1)) {
        let sinks = KVZIP_SINK_TOKENS.min(row.len());
        row[..sinks].fill(1.0);
    }
    s
}

/// Writes the scores of `chunk`'s tokens into `scores` (`[layer][kv_head][n_context]`)
/// from one pass: `queries` are the pass's (query `q` at stored index `repeat.start + q`,
/// post-RoPE), `kv` holds the context and then the pass's own tokens at `repeat`. One
/// (layer, KV head) at a time through [`kvzip_unit_pass_scores`], which the engine runs in
/// parallel instead.
pub fn kvzip_pass_scores(
    kv: &dyn KvView,
    queries: &dyn QueryView,
    chunk: Range<usize>,
    repeat: Range<usize>,
    n_context: usize,
    scores: &mut [f32],
) {
    let (hd, n_kv) = (kv.head_dim(), kv.n_kv_heads());
    let group = queries.n_heads() / n_kv;
    let span = kvzip_span(chunk.clone(), repeat);
    let n_q = queries.n_queries();
    let (mut keys, mut q) = (vec![0f32; span.len() * hd], vec![0f32; group * n_q * hd]);
    for layer in 0..kv.n_layers() {
        for kvh in 0..n_kv {
            for (i, &t) in span.iter().enumerate() {
                kv.key(layer, kvh, t, &mut keys[i * hd..(i + 1) * hd]);
            }
            for (g, h) in (kvh * group..(kvh + 1) * group).enumerate() {
                for qi in 0..n_q {
                    let at = (g * n_q + qi) * hd;
                    queries.query(layer, h, qi, &mut q[at..at + hd]);
                }
            }
            let row = &mut scores[(layer * n_kv + kvh) * n_context..][..n_context];
            let sinks = span.len() - chunk.len() - n_q;
            kvzip_unit_pass_scores(&keys, &q, hd, n_q, sinks, &mut row[chunk.clone()]);
        }
    }
}

/// The stored indices a pass's softmax spans, in order: the sinks (those before the
/// chunk), the chunk, the pass's own tokens.
pub fn kvzip_span(chunk: Range<usize>, repeat: Range<usize>) -> Vec<usize> {
    let sink = KVZIP_SINK_TOKENS.min(chunk.start);
    (0..sink).chain(chunk).chain(repeat).collect()
}

/// One (layer, KV head)'s scores from one pass: `keys` holds the span's keys
/// ([`kvzip_span`]: `n_sink` sinks, the chunk, then the pass's `n_queries` tokens; `span ×
/// head_dim`), `queries` the pass queries of the KV head's query heads (`group ×
/// n_queries × head_dim`). Each of the chunk's `chunk_scores` becomes the largest attention
/// any query gives it, the softmax over the span causally (the query of pass token `q`
/// sees pass tokens `0..=q`). A pass sets its chunk's scores, the sinks' too when the chunk
/// holds them (no template prefix), as kvpress does: its sinks are meant to be the prefix's.
pub fn kvzip_unit_pass_scores(
    keys: &[f32],
    queries: &[f32],
    head_dim: usize,
    n_queries: usize,
    n_sink: usize,
    chunk_scores: &mut [f32],
) {
    unit_pass_scores_portable(keys, queries, head_dim, n_queries, n_sink, chunk_scores);
}

/// One dot product and one `exp` at a time: the reference of the engine's vector kernel
/// (`pk_model::kernels::kvzip_max_attention`), and the path of CPUs without AVX2.
fn unit_pass_scores_portable(
    keys: &[f32],
    queries: &[f32],
    head_dim: usize,
    n_queries: usize,
    n_sink: usize,
    chunk_scores: &mut [f32],
) {
    let n_fixed = n_sink + chunk_scores.len();
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut logits = vec![0f32; n_fixed + n_queries];
    chunk_scores.fill(0.0);
    for (i, q) in queries.chunks_exact(head_dim).enumerate() {
        let visible = n_fixed + i % n_queries + 1;
        softmax_row(
            q,
            &keys[..visible * head_dim],
            scale,
            &mut logits[..visible],
        );
        for (s, &p) in chunk_scores.iter_mut().zip(&logits[n_sink..n_fixed]) {
            *s = s.max(p);
        }
    }
}

/// `out` = softmax of `scale · q·k` over the rows of `keys`.
fn softmax_row(q: &[f32], keys: &[f32], scale: f32, out: &mut [f32]) {
    let hd = q.len();
    let mut max = f32::NEG_INFINITY;
    for (o, k) in out.iter_mut().zip(keys.chunks_exact(hd)) {
        *o = dot(q, k) * scale;
        max = max.max(*o);
    }
    let mut sum = 0f32;
    for o in out.iter_mut() {
        *o = (*o - max).exp();
        sum += *o;
    }
    out.iter_mut().for_each(|o| *o /= sum);
}

/// `a · b` in eight independent partial sums, so that the loop vectorises.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// How KVzip spends a budget over (layer, KV head, token) scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvzipBudget {
    /// One threshold over every score (kvpress's default): heads and layers keep different
    /// counts.
    Global,
    /// The same count per layer, shared freely among its heads (kvpress's `layerwise`).
    Layer,
    /// The same count per KV head: what a paged cache with one table per head holds.
    Uniform,
}

/// The entries of each (layer, KV head) that survive removing `ratio` of them under
/// `budget`: per unit, the kept token indices, ascending. Ties go to the earlier token.
pub fn kvzip_kept(
    scores: &[f32],
    n_layers: usize,
    n_kv_heads: usize,
    ratio: f32,
    budget: KvzipBudget,
) -> Vec<Vec<usize>> {
    let n_units = n_layers * n_kv_heads;
    let n = scores.len() / n_units.max(1);
    let pruned = |count: usize| (count as f64 * ratio as f64) as usize;
    let mut keep = vec![true; scores.len()];
    let mut drop_lowest = |entries: &mut dyn Iterator<Item = usize>, count: usize| {
        let mut idx: Vec<usize> = entries.collect();
        idx.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]).then(a.cmp(&b)));
        for &i in &idx[..pruned(count).min(idx.len())] {
            keep[i] = false;
        }
    };
    match budget {
        KvzipBudget::Global => drop_lowest(&mut (0..scores.len()), scores.len()),
        KvzipBudget::Layer => {
            for l in 0..n_layers {
                let r = l * n_kv_heads * n..(l + 1) * n_kv_heads * n;
                drop_lowest(&mut r.clone(), r.len());
            }
        }
        KvzipBudget::Uniform => {
            for u in 0..n_units {
                drop_lowest(&mut (u * n..(u + 1) * n), n);
            }
        }
    }
    (0..n_units)
        .map(|u| (0..n).filter(|&t| keep[u * n + t]).collect())
        .collect()
}
