//! Token sampling: logits processing (logit bias, repetition, frequency and presence
//! penalties, banned tokens), then greedy or temperature, top-k, top-p (nucleus), min-p,
//! seeded; and the log-probabilities clients ask for.
//!
//! The order follows vLLM's: processors change the logits first (bias, then penalties),
//! and the distribution they give is what `logprobs` reports; then top-k, temperature,
//! min-p and top-p choose among them. Temperature 0 means greedy (argmax), ties broken
//! towards the lower token id so that greedy output is deterministic; so does any temperature
//! below [`GREEDY_BELOW_TEMPERATURE`], as in vLLM.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Temperatures below this sample greedily, vLLM's `_SAMPLING_EPS`. Dividing logits by a
/// tiny temperature overflows: at 1e-39 (a subnormal f32) `1 / t` is infinite, the top
/// logit's weight `0 × ∞` is NaN, and the draw fell through to the least likely kept token.
pub const GREEDY_BELOW_TEMPERATURE: f32 = 1e-5;

#[derive(Debug, Clone)]
pub struct SamplingParams {
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    /// 1.0 disables top-p.
    pub top_p: f32,
    /// 0 disables min-p: tokens less likely than `min_p` × the most likely one are dropped
    /// (after temperature).
    pub min_p: f32,
    pub seed: Option<u64>,
    /// OpenAI's: subtracted once from the logit of every token already generated.
    pub presence_penalty: f32,
    /// OpenAI's: subtracted per occurrence from the logit of every generated token.
    pub frequency_penalty: f32,
    /// vLLM's (CTRL's): logits of tokens in the prompt or the output are divided by it
    /// when positive and multiplied when negative; 1.0 disables it.
    pub repetition_penalty: f32,
    /// Added to the logits of these token ids (OpenAI: -100 to 100).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
        }
    }
}

/// An invalid sampling parameter, named as the API names it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct SamplingError {
    pub param: &'static str,
    pub message: String,
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(SamplingError {
                param: "temperature",
                message: format!(
                    "temperature must be a finite number >= 0, got {}",
                    self.temperature
                ),
            });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError {
                param: "top_p",
                message: format!("top_p must be in (0, 1], got {}", self.top_p),
            });
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingError {
                param: "min_p",
                message: format!("min_p must be in [0, 1], got {}", self.min_p),
            });
        }
        for (param, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&value) {
                return Err(SamplingError {
                    param,
                    message: format!("{param} must be in [-2, 2], got {value}"),
                });
            }
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= 2.0) {
            return Err(SamplingError {
                param: "repetition_penalty",
                message: format!(
                    "repetition_penalty must be in (0, 2], got {}",
                    self.repetition_penalty
                ),
            });
        }
        if let Some((id, bias)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return Err(SamplingError {
                param: "logit_bias",
                message: format!("logit_bias for token {id} must be in [-100, 100], got {bias}"),
            });
        }
        Ok(())
    }

    /// Whether any processor changes the logits (else they are sampled as they are).
    pub fn processes_logits(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
            || !self.logit_bias.is_empty()
    }
}

/// The state logits processors need: how often each token was generated, and (for the
/// repetition penalty) which tokens the prompt holds.
#[derive(Debug, Default, Clone)]
pub struct TokenHistory {
    output_counts: HashMap<u32, u32>,
    prompt_ids: std::collections::HashSet<u32>,
}

impl TokenHistory {
    pub fn new(prompt: &[u32], params: &SamplingParams) -> TokenHistory {
        TokenHistory {
            output_counts: HashMap::new(),
            // Only the repetition penalty reads the prompt.
            prompt_ids: if params.repetition_penalty != 1.0 {
                prompt.iter().copied().collect()
            } else {
                Default::default()
            },
        }
    }

    pub fn push_output(&mut self, id: u32) {
        *self.output_counts.entry(id).or_insert(0) += 1;
    }
}

/// Applies `params`' processors to `logits` in place, in vLLM's order (bias, then the
/// repetition, frequency and presence penalties), and sets the logits of `banned` ids
/// (end-of-generation tokens before `min_tokens`) to -inf.
pub fn process_logits(
    logits: &mut [f32],
    params: &SamplingParams,
    history: &TokenHistory,
    banned: &[u32],
) {
    for &(id, bias) in &params.logit_bias {
        if let Some(l) = logits.get_mut(id as usize) {
            *l += bias;
        }
    }
    if params.repetition_penalty != 1.0 {
        let rp = params.repetition_penalty;
        let seen = history
            .prompt_ids
            .iter()
            .chain(history.output_counts.keys());
        let mut done = std::collections::HashSet::new();
        for &id in seen {
            if done.insert(id) {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = if *l > 0.0 { *l / rp } else { *l * rp };
                }
            }
        }
    }
    for (&id, &count) in &history.output_counts {
        if let Some(l) = logits.get_mut(id as usize) {
            *l -= params.frequency_penalty * count as f32 + params.presence_penalty;
        }
    }
    for &id in banned {
        if let Some(l) = logits.get_mut(id as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// One generated token's log-probability and the most likely alternatives at its step
/// (log-softmax of the processed logits), most likely first.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    /// `id`'s rank among all tokens, 1 for the most likely (vLLM's `rank`: one more than
    /// the number of tokens with a strictly higher logit).
    pub rank: u32,
    pub top: Vec<(u32, f32)>,
}

/// `id`'s log-probability under `logits` and the `n_top` most likely tokens' (ties by
/// lower id).
pub fn token_logprob(logits: &[f32], id: u32, n_top: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + logits
            .iter()
            .map(|&l| (l as f64 - max).exp())
            .sum::<f64>()
            .ln();
    let lp = |l: f32| (l as f64 - lse) as f32;
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n_top);
    if n_top > 0 {
        let mut c: Vec<(f32, u32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (l, i as u32))
            .collect();
        let cmp = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        let k = n_top.min(c.len());
        if k < c.len() {
            c.select_nth_unstable_by(k - 1, cmp);
            c.truncate(k);
        }
        c.sort_unstable_by(cmp);
        top.extend(c.iter().map(|&(l, i)| (i, lp(l))));
    }
    let own = logits[id as usize];
    TokenLogprob {
        id,
        logprob: lp(own),
        rank: 1 + logits.iter().filter(|&&l| l > own).count() as u32,
        top,
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Scratch of (logit, id) pairs, reused between steps to avoid allocating per token.
    candidates: Vec<(f32, u32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_entropy(),
        };
        Sampler {
            params,
            rng,
            candidates: Vec::new(),
        }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature < GREEDY_BELOW_TEMPERATURE {
            return argmax(logits);
        }
        let c = &mut self.candidates;
        c.clear();
        c.extend(logits.iter().enumerate().map(|(i, &l)| (l, i as u32)));
        let k = if self.params.top_k == 0 {
            c.len()
        } else {
            self.params.top_k.min(c.len())
        };
        if k < c.len() {
            c.select_nth_unstable_by(k - 1, |a, b| b.0.total_cmp(&a.0));
            c.truncate(k);
        }
        c.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let max = c[0].0;
        let inv_t = 1.0 / self.params.temperature;
        let mut total = 0.0f64;
        for e in c.iter_mut() {
            e.0 = ((e.0 - max) * inv_t).exp();
            total += e.0 as f64;
        }
        // Min-p: the most likely token has weight 1 here, so the cut is `min_p` itself.
        if self.params.min_p > 0.0 {
            let n = c.partition_point(|e| e.0 >= self.params.min_p).max(1);
            c.truncate(n);
            total = c.iter().map(|e| e.0 as f64).sum();
        }
        // Nucleus: keep the smallest prefix whose mass reaches top_p.
        let mut keep = c.len();
        if self.params.top_p < 1.0 {
            let mut acc = 0.0f64;
            for (i, e) in c.iter().enumerate() {
                acc += e.0 as f64 / total;
                if acc >= self.params.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        let kept_total: f64 = c[..keep].iter().map(|e| e.0 as f64).sum();
        let mut r = self.rng.gen::<f64>() * kept_total;
        for e in &c[..keep] {
            r -= e.0 as f64;
            if r <= 0.0 {
                return e.1;
            }
        }
        c[keep - 1].1
    }
}

pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// `log_softmax(logits)[id]`, computed in f64.
pub fn log_prob(logits: &[f32], id: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + logits
            .iter()
            .map(|&l| (l as f64 - max).exp())
            .sum::<f64>()
            .ln();
    logits[id as usize] as f64 - lse
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_first_max() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.0, 3.0, 3.0, 1.0]), 1);
    }

    #[test]
    fn a_tiny_temperature_is_greedy() {
        // 1e-39 is a subnormal f32 whose inverse is infinite: it once drew the least likely
        // token. Every temperature below the threshold takes the argmax.
        for temperature in [1e-39, 1e-30, 1e-6] {
            let mut s = Sampler::new(SamplingParams {
                temperature,
                seed: Some(3),
                ..Default::default()
            });
            for _ in 0..20 {
                assert_eq!(
                    s.sample(&[-1.0, 2.0, 1.9, -30.0]),
                    1,
                    "temperature {temperature}"
                );
            }
        }
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 5.0,
            top_k: 1,
            top_p: 1.0,
            seed: Some(1),
            ..Default::default()
        });
        for _ in 0..50 {
            assert_eq!(s.sample(&[0.0, 2.0, 1.9, -1.0]), 1);
        }
    }

    #[test]
    fn top_p_excludes_the_tail() {
        // Probabilities ~ [0.64, 0.24, 0.09, 0.03]: top_p 0.8 keeps the first two only.
        let logits = [3.0, 2.0, 1.0, 0.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.8,
            seed: Some(7),
            ..Default::default()
        });
        let mut seen = [0usize; 4];
        for _ in 0..2000 {
            seen[s.sample(&logits) as usize] += 1;
        }
        assert_eq!(seen[2] + seen[3], 0, "{seen:?}");
        assert!(seen[0] > seen[1] && seen[1] > 300, "{seen:?}");
    }

    #[test]
    fn same_seed_same_samples() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            seed: Some(42),
            ..Default::default()
        };
        let (mut a, mut b) = (Sampler::new(p.clone()), Sampler::new(p));
        let xa: Vec<u32> = (0..20).map(|_| a.sample(&logits)).collect();
        let xb: Vec<u32> = (0..20).map(|_| b.sample(&logits)).collect();
        assert_eq!(xa, xb);
    }

    #[test]
    fn min_p_drops_tokens_below_its_share_of_the_top() {
        // At temperature 1 the weights relative to the top are [1, e^-1, e^-2, e^-3]:
        // min_p 0.3 keeps the first two (e^-1 = 0.37).
        let logits = [3.0, 2.0, 1.0, 0.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            min_p: 0.3,
            seed: Some(3),
            ..Default::default()
        });
        let mut seen = [0usize; 4];
        for _ in 0..2000 {
            seen[s.sample(&logits) as usize] += 1;
        }
        assert_eq!(seen[2] + seen[3], 0, "{seen:?}");
        assert!(seen[1] > 300, "{seen:?}");
    }

    #[test]
    fn processors_follow_vllms_definitions() {
        let params = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            repetition_penalty: 2.0,
            logit_bias: vec![(4, -100.0), (0, 1.0)],
            ..Default::default()
        };
        let mut history = TokenHistory::new(&[1], &params);
        history.push_output(2);
        history.push_output(2);
        let mut logits = [1.0f32, 4.0, -3.0, 2.0, 9.0];
        process_logits(&mut logits, &params, &history, &[3]);
        // 0: bias +1, never seen. 1: prompt, positive: halved. 2: output twice:
        // negative so doubled, then 2 × 0.25 + 0.5. 3: banned. 4: biased away.
        assert_eq!(logits[0], 2.0);
        assert_eq!(logits[1], 2.0);
        assert_eq!(logits[2], -6.0 - 1.0);
        assert_eq!(logits[3], f32::NEG_INFINITY);
        assert_eq!(logits[4], -91.0);
        assert!(params.validate().is_ok());
        let bad = SamplingParams {
            frequency_penalty: 2.5,
            ..Default::default()
        };
        assert_eq!(bad.validate().unwrap_err().param, "frequency_penalty");
    }

    #[test]
    fn token_logprobs_are_log_softmax_with_sorted_alternatives() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let t = token_logprob(&logits, 2, 3);
        assert!((t.logprob as f64 - log_prob(&logits, 2)).abs() < 1e-6);
        let ids: Vec<u32> = t.top.iter().map(|x| x.0).collect();
        assert_eq!(ids, vec![1, 3, 2], "most likely first, ties by id");
        let mass: f32 = t.top.iter().map(|x| x.1.exp()).sum();
        assert!(mass <= 1.0 + 1e-6);
    }

    #[test]
    fn log_prob_normalises() {
        let logits = [1.0f32, 2.0, 3.0];
        let total: f64 = (0..3).map(|i| log_prob(&logits, i).exp()).sum();
        assert!((total - 1.0).abs() < 1e-12);
    }
}
