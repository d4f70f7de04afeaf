//! Token sampling: greedy, temperature, top-k, top-p (nucleus), seeded.
//!
//! The order follows llama.cpp's and vLLM's default chain: top-k, then temperature, then
//! top-p over the renormalised distribution. Temperature 0 means greedy (argmax), ties
//! broken towards the lower token id so that greedy output is deterministic.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone)]
pub struct SamplingParams {
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    /// 1.0 disables top-p.
    pub top_p: f32,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
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
        Ok(())
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
        if self.params.temperature == 0.0 {
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
    fn top_k_one_is_greedy_at_any_temperature() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 5.0,
            top_k: 1,
            top_p: 1.0,
            seed: Some(1),
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
        };
        let (mut a, mut b) = (Sampler::new(p.clone()), Sampler::new(p));
        let xa: Vec<u32> = (0..20).map(|_| a.sample(&logits)).collect();
        let xb: Vec<u32> = (0..20).map(|_| b.sample(&logits)).collect();
        assert_eq!(xa, xb);
    }

    #[test]
    fn log_prob_normalises() {
        let logits = [1.0f32, 2.0, 3.0];
        let total: f64 = (0..3).map(|i| log_prob(&logits, i).exp()).sum();
        assert!((total - 1.0).abs() < 1e-12);
    }
}
