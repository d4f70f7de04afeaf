//! The three inputs of the utility `(α · quality − ttft) · frequency` (spec "Utility"):
//! a quality curve per context, a delay model per tier, and a decayed access frequency.

use serde::Serialize;

use crate::config::{Compression, Grid};

/// Where a context's quality numbers come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum QualitySource {
    /// Not profiled yet: the store's prior (see [`QualityPrior`]).
    Prior,
    /// Measured on this context's profiling queries.
    Profiled,
}

/// Quality in [0, 1] of each configuration of a grid, for one context.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct QualityCurve {
    pub by_config: Vec<f32>,
    pub source: QualitySource,
}

/// The prior for contexts not yet profiled (spec: a **decision**). Ours: the mean curve of
/// every context profiled so far, since contexts served together tend to be alike; before
/// any profile exists, a conservative built-in curve that trusts near-lossless settings
/// (f16, 8-bit) and discounts the rest steeply, so that an unprofiled context is not
/// crushed on a guess.
#[derive(Clone, Debug, Default)]
pub struct QualityPrior {
    sum: Vec<f64>,
    n_profiles: u32,
}

impl QualityPrior {
    /// The built-in curve for one configuration (used until a profile exists).
    pub fn builtin(c: &Compression) -> f32 {
        match *c {
            Compression::None => 1.0,
            Compression::Quant { key, value } => {
                let bits = key.bits().min(value.bits());
                match bits {
                    16 | 8 => 0.99,
                    4 => 0.9,
                    _ => 0.5,
                }
            }
            Compression::Drop { ratio, .. } => (1.0 - 1.2 * ratio).max(0.0),
        }
    }

    pub fn add(&mut self, curve: &QualityCurve) {
        if self.sum.len() != curve.by_config.len() {
            self.sum = vec![0.0; curve.by_config.len()];
            self.n_profiles = 0;
        }
        for (s, q) in self.sum.iter_mut().zip(&curve.by_config) {
            *s += *q as f64;
        }
        self.n_profiles += 1;
    }

    pub fn curve(&self, grid: &Grid) -> QualityCurve {
        let by_config = if self.n_profiles > 0 && self.sum.len() == grid.len() {
            self.sum
                .iter()
                .map(|s| (s / self.n_profiles as f64) as f32)
                .collect()
        } else {
            grid.configs().iter().map(QualityPrior::builtin).collect()
        };
        QualityCurve {
            by_config,
            source: QualitySource::Prior,
        }
    }
}

/// What the delay model knows about one tier.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TierSpec {
    pub name: String,
    /// Bytes EVICPRESS may place there; `u64::MAX` for the unlimited last tier.
    pub capacity_bytes: u64,
    pub read_bytes_per_s: f64,
    pub access_latency_s: f64,
}

/// Estimated time to first token of a reuse, by the spec's delay model: per-access latency
/// plus bytes over the tier's read bandwidth, plus the CPU work of decoding the payload and
/// writing the kept tokens into the engine's pool, plus prefilling the query (a constant per
/// context, kept so that estimates are comparable with measured TTFT and with recompute).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DelayModel {
    pub tiers: Vec<TierSpec>,
    /// Decoding cost per payload byte (measured: f16 and quantized payloads decode at
    /// different speeds, but per byte the spread is small next to the tier's own).
    pub decode_s_per_byte: f64,
    /// Writing one kept token (all layers) into the pool.
    pub restore_s_per_token: f64,
    /// Measured prefill speed, for the query and for recomputing a miss.
    pub prefill_tokens_per_s: f64,
    /// Tokens of a typical query after the context.
    pub query_tokens: usize,
}

impl DelayModel {
    pub fn load_s(&self, tier: usize, bytes: u64, kept_tokens: usize) -> f64 {
        let t = &self.tiers[tier];
        t.access_latency_s
            + bytes as f64 / t.read_bytes_per_s.max(1.0)
            + bytes as f64 * self.decode_s_per_byte
            + kept_tokens as f64 * self.restore_s_per_token
    }

    pub fn query_s(&self) -> f64 {
        self.query_tokens as f64 / self.prefill_tokens_per_s.max(1.0)
    }

    /// TTFT of a reuse from `tier`.
    pub fn ttft_s(&self, tier: usize, bytes: u64, kept_tokens: usize) -> f64 {
        self.load_s(tier, bytes, kept_tokens) + self.query_s()
    }

    /// TTFT of a miss: prefill context and query.
    pub fn recompute_s(&self, context_tokens: usize) -> f64 {
        (context_tokens + self.query_tokens) as f64 / self.prefill_tokens_per_s.max(1.0)
    }
}

/// An access count that halves every `half_life_s` seconds of store time (the spec's
/// **decision**: a decayed count; EWMA over time rather than over accesses, so a context
/// that stops being asked for loses its place even while nothing else happens).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct DecayedCount {
    value: f64,
    at_s: f64,
}

impl DecayedCount {
    /// A count of `value` at time `at_s` (restoring a persisted one).
    pub fn new(value: f64, at_s: f64) -> DecayedCount {
        DecayedCount { value, at_s }
    }

    pub fn value_at(&self, now_s: f64, half_life_s: f64) -> f64 {
        let dt = (now_s - self.at_s).max(0.0);
        self.value * 0.5f64.powf(dt / half_life_s.max(1e-9))
    }

    pub fn bump(&mut self, now_s: f64, half_life_s: f64) {
        self.value = self.value_at(now_s, half_life_s) + 1.0;
        self.at_s = now_s;
    }
}

/// The paper's utility.
pub fn utility(alpha: f64, quality: f64, ttft_s: f64, frequency: f64) -> f64 {
    (alpha * quality - ttft_s) * frequency
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decayed_count_halves() {
        let mut c = DecayedCount::default();
        c.bump(0.0, 10.0);
        c.bump(0.0, 10.0);
        assert!((c.value_at(10.0, 10.0) - 1.0).abs() < 1e-9);
        c.bump(10.0, 10.0);
        assert!((c.value_at(10.0, 10.0) - 2.0).abs() < 1e-9);
    }

    #[test]
    fn prior_learns_from_profiles() {
        let g = Grid::parse("q4,knorm-0.5").unwrap();
        let mut p = QualityPrior::default();
        let builtin = p.curve(&g).by_config;
        assert!(
            builtin
                .iter()
                .zip([1.0, 0.9, 0.4])
                .all(|(a, b)| (a - b).abs() < 1e-6),
            "{builtin:?}"
        );
        p.add(&QualityCurve {
            by_config: vec![1.0, 0.8, 0.6],
            source: QualitySource::Profiled,
        });
        p.add(&QualityCurve {
            by_config: vec![1.0, 0.6, 0.8],
            source: QualitySource::Profiled,
        });
        let c = p.curve(&g);
        assert_eq!(c.source, QualitySource::Prior);
        assert!((c.by_config[1] - 0.7).abs() < 1e-6 && (c.by_config[2] - 0.7).abs() < 1e-6);
    }
}
