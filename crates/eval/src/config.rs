//! What a sweep covers: policies × budgets × block sizes × tasks × lengths × samples, and
//! the `--quick` / `--full` presets.

use std::path::PathBuf;

use pk_kv::PolicySpec;
use pk_model::KvDtype;

use crate::tasks::{Task, ALL_TASKS};

/// A KV budget: a fraction of the context length, or a fixed number of tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Budget {
    Fraction(f64),
    Tokens(u32),
}

impl Budget {
    /// `25%`, `12.5%`, or a token count such as `512`.
    pub fn parse(s: &str) -> Result<Budget, crate::ArgError> {
        let s = s.trim();
        let bad = || crate::ArgError::BadBudget {
            input: s.to_owned(),
        };
        if let Some(p) = s.strip_suffix('%') {
            let f: f64 = p.parse().map_err(|_| bad())?;
            if !(f > 0.0 && f < 100.0) {
                return Err(bad());
            }
            return Ok(Budget::Fraction(f / 100.0));
        }
        s.parse::<u32>().map(Budget::Tokens).map_err(|_| bad())
    }

    /// Tokens for a context of `context_tokens`: fractions round down to whole blocks and
    /// never go below the 3 blocks every policy needs. `None` when the budget would keep
    /// the whole context (nothing to evict) or is below 3 blocks.
    pub fn tokens(self, context_tokens: usize, block_size_tokens: u32) -> Option<u32> {
        let min = 3 * block_size_tokens;
        let t = match self {
            Budget::Fraction(f) => (((f * context_tokens as f64) as u32) / block_size_tokens
                * block_size_tokens)
                .max(min),
            Budget::Tokens(t) => t,
        };
        (t >= min && (t as usize) < context_tokens).then_some(t)
    }

    pub fn label(self) -> String {
        match self {
            Budget::Fraction(f) => format!("{}%", f * 100.0),
            Budget::Tokens(t) => t.to_string(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct SweepConfig {
    pub model_path: PathBuf,
    /// Evicting policies; the full cache always runs as the reference.
    pub policies: Vec<PolicySpec>,
    pub budgets: Vec<Budget>,
    pub block_sizes: Vec<u32>,
    pub tasks: Vec<Task>,
    pub lengths: Vec<usize>,
    pub samples: usize,
    pub seed: u64,
    /// Forced tokens after the prefix in `text-kl`.
    pub continuation_tokens: usize,
    pub out_dir: PathBuf,
    pub progress: bool,
    /// Live KV precision of every run except `text-kl`'s reference, which is always the
    /// f16 full cache (so a q8 sweep's `full` text-kl row measures q8 itself).
    pub kv_dtype: KvDtype,
    /// Eviction granularities: every evicting (policy, budget) of `policies` runs at each;
    /// empty (the default): each at its own (`PolicySpec::default_granularity`).
    pub granularities: Vec<pk_kv::KvGranularity>,
    /// Evicting policies that run at one granularity only (`--policies snapkv/head`), so
    /// that a comparison of one policy's granularities does not multiply every other
    /// policy's runs.
    pub pinned_policies: Vec<(PolicySpec, pk_kv::KvGranularity)>,
    /// kvpress's query-agnostic convention for the tasks that ask a question: the context
    /// is prefilled and compressed first, then the question and the answer prefix are
    /// read (forced tokens, all kept) and the answer generated, so no policy sees the
    /// question before it selects (how a stored context is reused).
    pub query_agnostic: bool,
}

/// The seeds' comparison: PagedEviction against StreamingLLM, KeyDiff and inverse key L2.
pub fn seed_policies() -> Vec<PolicySpec> {
    ["paged-eviction", "streaming-llm", "keydiff", "knorm"]
        .iter()
        .map(|p| p.parse().expect("valid policy name"))
        .collect()
}

impl SweepConfig {
    /// A few minutes on two cores: lengths 1K and 2K, two budgets, block size 16.
    pub fn quick(model_path: PathBuf, out_dir: PathBuf) -> SweepConfig {
        SweepConfig {
            model_path,
            policies: seed_policies(),
            budgets: vec![Budget::Fraction(0.25), Budget::Fraction(0.5)],
            block_sizes: vec![16],
            tasks: vec![
                Task::Passkey,
                Task::NiahSingle,
                Task::KvRetrieval,
                Task::TextKl,
            ],
            lengths: vec![1024, 2048],
            samples: 2,
            seed: 1,
            continuation_tokens: 64,
            out_dir,
            progress: true,
            kv_dtype: KvDtype::F16,
            granularities: Vec::new(),
            pinned_policies: Vec::new(),
            query_agnostic: false,
        }
    }

    /// The report, sized for a shared 2-core machine with one thread (about an hour):
    /// every task at 1K and 2K tokens, budgets 12.5–75%, B = 16, 4 samples (needle depths
    /// 0, 1/3, 2/3, 1), the seeds' four policies plus PagedEviction's default before issue
    /// 38 (the paper's ratio score, global victims) and its inverse-key variant, and
    /// SnapKV, each at its own granularity. Capped on purpose: 4K and 8K prompts, block
    /// sizes 8/32, fixed token
    /// budgets, TOVA and H2O would multiply the time (SnapKV and TOVA prefill the whole
    /// prompt again for every cell, while the others reuse the full cache's prefix); ask
    /// for them with `--lengths`, `--block-sizes`, `--budgets` and `--policies`.
    pub fn full(model_path: PathBuf, out_dir: PathBuf) -> SweepConfig {
        let mut policies = seed_policies();
        policies.extend(
            [
                "paged-eviction:ratio:global",
                "paged-eviction:inv-k-norm",
                "snapkv",
            ]
            .iter()
            .map(|p| p.parse::<PolicySpec>().expect("valid")),
        );
        SweepConfig {
            budgets: vec![
                Budget::Fraction(0.125),
                Budget::Fraction(0.25),
                Budget::Fraction(0.5),
                Budget::Fraction(0.75),
            ],
            block_sizes: vec![16],
            tasks: ALL_TASKS.to_vec(),
            lengths: vec![1024, 2048],
            samples: 4,
            policies,
            ..SweepConfig::quick(model_path, out_dir)
        }
    }

    /// The distinct token budgets for one (length, block size), in ascending order.
    pub fn budget_tokens(&self, context_tokens: usize, block_size_tokens: u32) -> Vec<u32> {
        let mut t: Vec<u32> = self
            .budgets
            .iter()
            .filter_map(|b| b.tokens(context_tokens, block_size_tokens))
            .collect();
        t.sort_unstable();
        t.dedup();
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_parse_and_resolve() {
        assert_eq!(Budget::parse("12.5%"), Ok(Budget::Fraction(0.125)));
        assert_eq!(Budget::parse("512"), Ok(Budget::Tokens(512)));
        assert!(Budget::parse("150%").is_err() && Budget::parse("x").is_err());
        assert_eq!(Budget::Fraction(0.125).tokens(1000, 16), Some(112));
        assert_eq!(Budget::Fraction(0.01).tokens(1000, 16), Some(48));
        assert_eq!(Budget::Tokens(1024).tokens(1024, 16), None);
        assert_eq!(Budget::Tokens(32).tokens(1024, 16), None);
        let c = SweepConfig {
            budgets: vec![
                Budget::Fraction(0.25),
                Budget::Tokens(256),
                Budget::Tokens(4096),
            ],
            ..SweepConfig::quick("m".into(), "o".into())
        };
        assert_eq!(c.budget_tokens(1024, 16), vec![256]);
        assert_eq!(c.budget_tokens(2048, 16), vec![256, 512]);
    }
}
