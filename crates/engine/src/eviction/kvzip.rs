//! KVzip's reconstruction passes (issue 37), run by the engine once a `kvzip` sequence's
//! prompt is in the cache: for each chunk of the context, the model is teacher-forced on
//! the request to repeat it (`pk_kv::policy::kvzip`) in a fork of the sequence, the pass's
//! queries score the chunk's tokens, and the fork is freed. The sequence itself is not
//! touched: its table, positions and K/V are as the prefill left them, so the pass's K/V
//! never mixes with the context's and its extra blocks are bounded by one chunk's pass.
//! The engine runs the passes a piece per step (`kvzip_run.rs`), beside other sequences.
//!
//! A chat template's prefix (the system turn and the user header) is treated as the
//! policy's `prefix=` says (`pk_kv::KvzipPrefix`): by default the whole prompt is the
//! context, its first `KVZIP_SINK_TOKENS` (4) tokens kept regardless (score 1); `kept`
//! keeps the prefix whole and makes it the passes' sinks, as the authors' code does;
//! `kvpress` scores it 0 but for the sinks, as kvpress does.

use pk_kv::{
    kvzip_unit_pass_scores, KvCacheManager, KvzipPass, SelectionUnit, SeqId, KVZIP_FIRST_PROMPT,
    KVZIP_LATER_PROMPT,
};
use pk_model::Backend;
use pk_tokenizer::{ChatTemplate, Tokenizer};
use rayon::prelude::*;

use super::kvzip_run::KvzipRun;

/// The token ids a pass is built from, in the model's vocabulary and template.
#[derive(Clone, Debug)]
pub(crate) struct KvzipPrompts {
    pub first: Vec<u32>,
    pub later: Vec<u32>,
    /// What the chat template writes between a user turn and the assistant's answer.
    pub turn_change: Vec<u32>,
    /// What the chat template writes before a user turn's text (with the prompt's BOS):
    /// the prefix that `prefix=kept` and `prefix=kvpress` recognise at a context's start.
    pub template_prefix: Vec<u32>,
}

impl KvzipPrompts {
    /// The prompts as kvpress builds them, with this model's chat template.
    pub fn new(tokenizer: &Tokenizer, template: &ChatTemplate) -> Result<KvzipPrompts, String> {
        let suffix = template
            .user_turn_suffix()
            .map_err(|e| format!("kvzip needs the model's chat template: {e}"))?;
        let prefix = template
            .user_turn_prefix()
            .map_err(|e| format!("kvzip needs the model's chat template: {e}"))?;
        Ok(KvzipPrompts {
            first: tokenizer.encode(KVZIP_FIRST_PROMPT, false),
            later: tokenizer.encode(KVZIP_LATER_PROMPT, false),
            turn_change: tokenizer.encode(&suffix, true),
            template_prefix: tokenizer.encode_prompt(&prefix, true),
        })
    }
}

/// Bytes of scores [`ScoreCache`] holds at most (16 MiB: a 4K context of a 28-layer model
/// with 2 KV heads takes 0.9 MiB, a 32K one of a 32-layer model with 8 KV heads 32 MiB,
/// which is then not kept).
pub(crate) const SCORE_CACHE_BYTES: usize = 16 << 20;

/// KVzip's scores of the last contexts scored, by their tokens, chunk size and treatment
/// of the template prefix (`KvzipPass`): the scores
/// depend only on the context's KV, so a context compressed again (at another budget, by
/// the uniform and the global budget alike, or asked again) needs no second pass. Only
/// contexts whose KV is what prefill computes are kept (not a loaded, compressed one).
/// Oldest first out, within [`SCORE_CACHE_BYTES`].
#[derive(Default)]
pub(crate) struct ScoreCache {
    entries: std::collections::VecDeque<(KvzipPass, Vec<u32>, Vec<f32>)>,
}

impl ScoreCache {
    pub fn get(&self, pass: KvzipPass, context: &[u32]) -> Option<Vec<f32>> {
        self.entries
            .iter()
            .find(|(p, ids, _)| *p == pass && ids[..] == *context)
            .map(|(_, _, scores)| scores.clone())
    }

    pub fn insert(&mut self, pass: KvzipPass, context: &[u32], scores: &[f32]) {
        let bytes = |ids: &[u32], s: &[f32]| 4 * (ids.len() + s.len());
        if bytes(context, scores) > SCORE_CACHE_BYTES || self.get(pass, context).is_some() {
            return;
        }
        self.entries
            .push_back((pass, context.to_vec(), scores.to_vec()));
        while self
            .entries
            .iter()
            .map(|(_, i, s)| bytes(i, s))
            .sum::<usize>()
            > SCORE_CACHE_BYTES
        {
            self.entries.pop_front();
        }
    }
}

/// Where a sequence's reconstruction passes spent their time, in seconds: the passes'
/// forward (fork, pass tokens, attention) and the scoring of their queries.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PassSeconds {
    pub forward: f64,
    pub scoring: f64,
}

/// Scores `[layer][kv_head][token]` of `seq`'s context (`context`, every token stored at
/// its position) from one reconstruction pass per chunk of `pass.chunk_tokens`, run whole here
/// (the engine advances a [`KvzipRun`] a piece per step instead), adding the passes' time
/// to `seconds`. `child` is a fresh sequence id for the passes' forks. Errors name what was
/// missing (a free block).
pub(crate) fn reconstruction_scores(
    backend: &mut dyn Backend,
    kv: &mut KvCacheManager,
    (seq, child): (SeqId, SeqId),
    context: &[u32],
    (prompts, pass): (&KvzipPrompts, KvzipPass),
    seconds: &mut PassSeconds,
) -> Result<Vec<f32>, String> {
    let mut run = KvzipRun::new(
        backend,
        (seq, child),
        context.to_vec(),
        (prompts.clone(), pass),
    );
    let mut result = Ok(());
    while !run.is_done() && result.is_ok() {
        result = run
            .advance(backend, kv, usize::MAX)
            .map(|_| ())
            .map_err(|e| e.to_string());
    }
    seconds.forward += run.seconds.forward;
    seconds.scoring += run.seconds.scoring;
    result.map(|()| run.into_scores())
}

/// One pass's (or one piece of a pass's) keys and queries, scored one (layer, KV head)
/// per rayon task.
pub(super) struct Pass<'a> {
    /// `[layer][token][n_heads * head_dim]`, as the forward pass captured them.
    pub queries: &'a [f32],
    /// `[layer][token][n_heads]`: each query row's log-sum-exp from the pass's attention,
    /// when it covered exactly the span (NaN where the kernel did not give it).
    pub lse: Option<&'a [f32]>,
    /// `[layer][kv_head][span][head_dim]`: `n_sink` keys every query sees, the chunk's,
    /// then the `n_queries` pass tokens' (causal).
    pub keys: &'a [f32],
    /// KV heads, query heads, head dimension.
    pub geometry: (usize, usize, usize),
    pub n_queries: usize,
    pub n_sink: usize,
}

impl Pass<'_> {
    /// Writes `chunk`'s scores of every (layer, KV head) row of `scores`, or with `raise`
    /// raises them to this pass's where those are higher (a later piece of one pass).
    pub fn score(
        &self,
        chunk: std::ops::Range<usize>,
        n_context: usize,
        scores: &mut [f32],
        raise: bool,
    ) {
        let unit_keys = self.keys.len() / (scores.len() / n_context);
        scores
            .par_chunks_mut(n_context)
            .enumerate()
            .for_each(|(unit, row)| {
                let keys = &self.keys[unit * unit_keys..(unit + 1) * unit_keys];
                let mut piece = vec![0f32; chunk.len()];
                self.unit_scores(unit, keys, &mut piece);
                let row = &mut row[chunk.clone()];
                if raise {
                    row.iter_mut().zip(&piece).for_each(|(r, p)| *r = r.max(*p));
                } else {
                    row.copy_from_slice(&piece);
                }
            });
    }

    /// Unit `unit`'s scores of the chunk's keys into `out`, from its `keys` (the span's).
    fn unit_scores(&self, unit: usize, keys: &[f32], out: &mut [f32]) {
        let (n_kv, n_heads, hd) = self.geometry;
        let group = n_heads / n_kv;
        let (layer, kvh) = (unit / n_kv, unit % n_kv);
        let mut q = vec![0f32; group * self.n_queries * hd];
        for g in 0..group {
            let head = kvh * group + g;
            for qi in 0..self.n_queries {
                let at = ((layer * self.n_queries + qi) * n_heads + head) * hd;
                let to = (g * self.n_queries + qi) * hd;
                q[to..to + hd].copy_from_slice(&self.queries[at..at + hd]);
            }
        }
        if let Some(lse) = self.unit_lse(layer, kvh) {
            let chunk_keys = &keys[self.n_sink * hd..(self.n_sink + out.len()) * hd];
            if pk_model::kernels::kvzip_max_attention_lse(chunk_keys, &q, &lse, hd, out) {
                return;
            }
        }
        let (n_q, n_sink) = (self.n_queries, self.n_sink);
        if !pk_model::kernels::kvzip_max_attention(keys, &q, hd, n_q, n_sink, out) {
            kvzip_unit_pass_scores(keys, &q, hd, n_q, n_sink, out);
        }
    }
}

impl Pass<'_> {
    /// The log-sum-exps of (layer, KV head)'s query rows, in the order `score` copies their
    /// queries (group head, then token); `None` without them or where any is missing.
    fn unit_lse(&self, layer: usize, kvh: usize) -> Option<Vec<f32>> {
        let all = self.lse?;
        let (n_kv, n_heads, _) = self.geometry;
        let group = n_heads / n_kv;
        let mut out = Vec::with_capacity(group * self.n_queries);
        for g in 0..group {
            for qi in 0..self.n_queries {
                out.push(all[(layer * self.n_queries + qi) * n_heads + kvh * group + g]);
            }
        }
        out.iter().all(|x| x.is_finite()).then_some(out)
    }
}

/// One unit's scores from the `[layer][kv_head][token]` matrix: the mean over the unit's
/// layers and KV heads (one row at `head` granularity).
pub(crate) fn unit_scores(
    scores: &[f32],
    unit: &SelectionUnit,
    n_kv_heads: usize,
    n_tokens: usize,
) -> Vec<f32> {
    let heads: Vec<usize> = match unit.kv_head {
        Some(h) => vec![h],
        None => (0..n_kv_heads).collect(),
    };
    let mut out = vec![0f32; n_tokens];
    for &layer in &unit.layers {
        for &h in &heads {
            let row = &scores[(layer * n_kv_heads + h) * n_tokens..][..n_tokens];
            out.iter_mut().zip(row).for_each(|(o, s)| *o += s);
        }
    }
    let n = (unit.layers.len() * heads.len()).max(1) as f32;
    out.iter_mut().for_each(|o| *o /= n);
    out
}

/// A ragged budget (`kvzip:global`): how many tokens each unit keeps when one threshold
/// runs over every unit's scores and `budget_tokens` per unit are kept on average, as
/// kvpress's KVzip spends its budget. Ties go to the earlier (unit, token). Each unit first
/// keeps its `min_unit_tokens` best tokens (at most the budget: kvpress's global threshold
/// may leave a head nothing, and the engine keeps at least the sinks), and the threshold
/// shares out the rest, so the counts sum to exactly the budget: a floor moves tokens
/// between heads, never adds any.
pub(crate) fn ragged_budgets(
    unit_scores: &[Vec<f32>],
    budget_tokens: u32,
    n_tokens: usize,
    min_unit_tokens: u32,
) -> Vec<u32> {
    let n_units = unit_scores.len();
    let per_unit = (budget_tokens as usize).min(n_tokens);
    let floor = (min_unit_tokens as usize).min(per_unit);
    let mut extra = (per_unit - floor) * n_units;
    let mut entries: Vec<(usize, usize)> = (0..n_units)
        .flat_map(|u| (0..n_tokens).map(move |t| (u, t)))
        .collect();
    entries.sort_by(|&(ua, ta), &(ub, tb)| {
        unit_scores[ub][tb]
            .total_cmp(&unit_scores[ua][ta])
            .then((ua, ta).cmp(&(ub, tb)))
    });
    // A unit's entries come in the order of its own scores: its first `floor` are the
    // ones it keeps anyway.
    let mut counts = vec![floor as u32; n_units];
    let mut seen = vec![0usize; n_units];
    for &(u, _) in &entries {
        if extra == 0 {
            break;
        }
        seen[u] += 1;
        if seen[u] > floor {
            counts[u] += 1;
            extra -= 1;
        }
    }
    counts
}

#[cfg(test)]
mod tests {
    /// The vector kernel against `pk-kv`'s reference on random keys and queries (two query
    /// heads, a span of sinks, a chunk and pass tokens that are not whole vectors).
    #[test]
    fn vector_scores_match_the_reference() {
        let (hd, n_q, n_sink, chunk) = (64, 21, 4, 37);
        let mut seed = 7u64;
        let mut rand = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 6.0
        };
        let keys: Vec<f32> = (0..(n_sink + chunk + n_q) * hd).map(|_| rand()).collect();
        let queries: Vec<f32> = (0..2 * n_q * hd).map(|_| rand()).collect();
        let (mut want, mut got) = (vec![0f32; chunk], vec![0f32; chunk]);
        pk_kv::kvzip_unit_pass_scores(&keys, &queries, hd, n_q, n_sink, &mut want);
        if !pk_model::kernels::kvzip_max_attention(&keys, &queries, hd, n_q, n_sink, &mut got) {
            eprintln!("vector_scores_match_the_reference: no AVX2/FMA here, nothing to compare");
            return;
        }
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-6 + 1e-4 * b.abs(), "{a} vs {b}");
        }
        assert!(want.iter().any(|&x| x > 0.01), "{want:?}");
    }

    /// The scores from the chunk's keys and each row's log-sum-exp (the pass's attention
    /// covered exactly the span: no sinks apart from the chunk) against `pk-kv`'s
    /// reference over the whole span, on random keys and queries (three query heads).
    #[test]
    fn scores_from_the_passes_log_sum_exps_match_the_reference() {
        let (hd, n_q, chunk, group) = (64, 45, 70, 3);
        let mut seed = 9u64;
        let mut rand = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 6.0
        };
        let keys: Vec<f32> = (0..(chunk + n_q) * hd).map(|_| rand()).collect();
        let queries: Vec<f32> = (0..group * n_q * hd).map(|_| rand()).collect();
        let scale = 1.0 / (hd as f64).sqrt();
        // Row (g, qi) sees the chunk and pass tokens 0..=qi, as the forward's causal mask.
        let lse: Vec<f32> = (0..group * n_q)
            .map(|row| {
                let q = &queries[row * hd..(row + 1) * hd];
                let s: Vec<f64> = keys[..(chunk + row % n_q + 1) * hd]
                    .chunks_exact(hd)
                    .map(|k| q.iter().zip(k).map(|(a, b)| (a * b) as f64).sum::<f64>() * scale)
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                (m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln()) as f32
            })
            .collect();
        let (mut want, mut got) = (vec![0f32; chunk], vec![0f32; chunk]);
        pk_kv::kvzip_unit_pass_scores(&keys, &queries, hd, n_q, 0, &mut want);
        let chunk_keys = &keys[..chunk * hd];
        if !pk_model::kernels::kvzip_max_attention_lse(chunk_keys, &queries, &lse, hd, &mut got) {
            eprintln!("scores_from_the_passes_log_sum_exps…: no AVX-512 here, nothing to compare");
            return;
        }
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-6 + 1e-4 * b.abs(), "{a} vs {b}");
        }
        assert!(want.iter().any(|&x| x > 0.01), "{want:?}");
    }

    /// The score cache answers only the same tokens at the same chunk size and prefix
    /// treatment, drops the oldest past its byte bound, and keeps nothing larger than the
    /// bound.
    #[test]
    fn the_score_cache_is_exact_and_bounded() {
        use pk_kv::{KvzipPass, KvzipPrefix};
        let chunk = |chunk_tokens| KvzipPass {
            chunk_tokens,
            prefix: KvzipPrefix::Context,
        };
        let p = chunk(2048);
        let mut cache = super::ScoreCache::default();
        let big = super::SCORE_CACHE_BYTES / 4 / 3;
        let ids = |first: u32| (first..first + 16).collect::<Vec<u32>>();
        cache.insert(p, &ids(0), &vec![0.5; big]);
        assert_eq!(cache.get(p, &ids(0)).map(|s| s.len()), Some(big));
        assert!(cache.get(chunk(1024), &ids(0)).is_none() && cache.get(p, &ids(1)).is_none());
        let kept = KvzipPass {
            prefix: KvzipPrefix::Kept,
            ..p
        };
        assert!(
            cache.get(kept, &ids(0)).is_none(),
            "another prefix treatment"
        );
        cache.insert(p, &ids(1), &vec![0.25; big]);
        cache.insert(p, &ids(2), &vec![0.125; big]);
        assert!(
            cache.get(p, &ids(0)).is_none(),
            "the oldest goes past the bound"
        );
        assert!(cache.get(p, &ids(1)).is_some() && cache.get(p, &ids(2)).is_some());
        cache.insert(p, &ids(3), &vec![1.0; 2 * big + big]);
        assert!(cache.get(p, &ids(3)).is_none() && cache.get(p, &ids(2)).is_some());
    }

    /// One threshold over all units: the unit with the higher scores keeps more, the counts
    /// sum to exactly the budget, and no unit keeps fewer than the floor.
    #[test]
    fn ragged_budgets_follow_one_threshold() {
        let high: Vec<f32> = (0..10).map(|t| 1.0 + t as f32).collect();
        let low = vec![0.5f32; 10];
        // Each keeps its best 4; the other 4 of the budget go to the higher scores.
        let counts = super::ragged_budgets(&[high.clone(), low.clone()], 6, 10, 4);
        assert_eq!(counts, vec![8, 4]);
        // Without a floor the threshold alone decides; a floor above the budget is the
        // budget (the same count everywhere).
        assert_eq!(
            super::ragged_budgets(&[high.clone(), low.clone()], 6, 10, 0),
            vec![10, 2]
        );
        assert_eq!(super::ragged_budgets(&[high, low], 3, 10, 4), vec![3, 3]);
        let a: Vec<f32> = (0..20).map(|t| (2 * t) as f32).collect();
        let b: Vec<f32> = (0..20).map(|t| (2 * t + 1) as f32).collect();
        assert_eq!(super::ragged_budgets(&[a, b], 10, 20, 4), vec![10, 10]);
    }
}
