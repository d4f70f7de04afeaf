//! `PolicySpec`: a policy and its parameters as a value, parsed from the names used on the
//! CLI (`--kv-policy`) and the API, printed back in the same canonical form, and turned
//! into a policy by `build`.
//!
//! Grammar: `NAME[:OPTION]...`, where an option is a flag or `key=value`. Options left at
//! their defaults are omitted when printing, so `Display` gives the shortest name and
//! `parse(display(spec)) == spec` for every spec.

use std::fmt;
use std::str::FromStr;

use super::attention::{ExpectedAttentionScorer, H2oScorer, SnapKvScorer, TovaScorer};
use super::kvzip::KvzipScorer;
use super::kvzip_prefix::{KvzipPass, KvzipPrefix};
use super::scored::{Candidates, Protect, ScoredPolicy};
use super::scorers::{KNormScorer, KeyDiffScorer, PagedScorer};
use super::simple::{FullCache, StreamingLlm};
use super::{validate_budget, EvictionPolicy, PolicyError};

/// Every policy name, with its options, for error messages and `--help`.
pub(crate) const VALID_POLICIES: &str = "full, streaming-llm[:n-sink=N], knorm, keydiff, \
     snapkv[:window=N][:kernel=N], h2o, tova, expected-attention[:window=N][:n-sink=N], \
     paged-eviction[:v-norm|:ratio|:inv-k-norm][:local[=N]|:global], kvzip[:chunk=N][:global[:floor=N]][:prefix=context|kept|kvpress] (default: paged-eviction)";

/// SnapKV's observation window and pooling kernel (spec `baselines.md`: w = 64, kernel = 5).
pub const SNAPKV_WINDOW_DEFAULT: u32 = 64;
pub const SNAPKV_KERNEL_DEFAULT: u32 = 5;
const EXPECTED_WINDOW_DEFAULT: u32 = 64;
const EXPECTED_N_SINK_DEFAULT: u32 = 4;
/// PagedEviction's granularity when a request names none (`default_granularity`).
const PAGED_EVICTION_GRANULARITY: super::KvGranularity = super::KvGranularity::Head;
/// The authors' scripts use topk = 3 for the local variant, and so does our default.
const LOCAL_TOPK_DEFAULT: u32 = 3;

/// PagedEviction's token importance (spec "Token importance"); higher is kept.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub enum PagedScore {
    /// `‖v‖ / (‖k‖ + eps)`: the paper's formula (`paged-eviction:ratio`), our default until
    /// issue 38's comparison (`docs/results/eval-issue38/NOTE.md`).
    VOverK,
    /// `‖v‖`: what the authors' code uses, and our default since issue 38's comparison.
    #[default]
    VNorm,
    /// `1 / (‖k‖ + eps)`: the inverse-key-norm variant.
    InvKNorm,
}

/// A KV eviction policy and its parameters. `Default` is `paged-eviction`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum PolicySpec {
    /// `full`: keep everything.
    Full,
    /// `streaming-llm[:n-sink=N]`: sinks + recent; `None` means the whole first block.
    StreamingLlm { n_sink_tokens: Option<u32> },
    /// `knorm`: inverse key L2 norm.
    KNorm,
    /// `keydiff`: key diversity.
    KeyDiff,
    /// `snapkv[:window=N][:kernel=N][:pool=max|avg]`: observation-window attention,
    /// max-pooled (the SnapKV paper's code) or average-pooled (kvpress's `SnapKVPress`).
    SnapKv {
        window_tokens: u32,
        kernel_tokens: u32,
        avg_pool: bool,
    },
    /// `h2o`: heavy hitters + recent window, half the budget each.
    H2o,
    /// `tova`: attention of the newest query.
    Tova,
    /// `expected-attention[:window=N][:n-sink=N]`: attention expected from query statistics.
    ExpectedAttention {
        window_queries: u32,
        n_sink_tokens: u32,
    },
    /// `paged-eviction[:v-norm|:ratio|:inv-k-norm][:local[=N]|:global]`: the method of the
    /// spec. `local_topk`: restrict decode candidates to the oldest N non-sink blocks
    /// (`None`: every evictable block, `global`). The default is the authors' own
    /// configuration, `v-norm` with `local=3`, the best of their family in issue 38.
    PagedEviction {
        score: PagedScore,
        local_topk: Option<u32>,
    },
    /// `kvzip[:chunk=N][:global[:floor=N]]`: KVzip (issue 37), scored by the engine's
    /// context-reconstruction passes over chunks of `chunk_tokens` context tokens
    /// (`policy::kvzip`). `global`: one threshold over every (layer, KV head, token) score,
    /// so each KV head keeps its own count (the budget is their mean; at `head`
    /// granularity only, once at prefill, generated tokens kept). `floor_tokens`: the
    /// fewest tokens a head keeps under `global` (`None`: three blocks; `floor=4`, the
    /// sinks alone, is kvpress's threshold, which may leave a head a handful). `prefix`:
    /// how a chat template's prefix is treated (`policy::kvzip_prefix`).
    Kvzip {
        chunk_tokens: u32,
        global: bool,
        floor_tokens: Option<u32>,
        prefix: KvzipPrefix,
    },
}

impl Default for PolicySpec {
    fn default() -> Self {
        PolicySpec::PagedEviction {
            score: PagedScore::default(),
            local_topk: Some(LOCAL_TOPK_DEFAULT),
        }
    }
}

impl PolicySpec {
    /// The base name, without options.
    pub fn name(&self) -> &'static str {
        match self {
            PolicySpec::Full => "full",
            PolicySpec::StreamingLlm { .. } => "streaming-llm",
            PolicySpec::KNorm => "knorm",
            PolicySpec::KeyDiff => "keydiff",
            PolicySpec::SnapKv { .. } => "snapkv",
            PolicySpec::H2o => "h2o",
            PolicySpec::Tova => "tova",
            PolicySpec::ExpectedAttention { .. } => "expected-attention",
            PolicySpec::PagedEviction { .. } => "paged-eviction",
            PolicySpec::Kvzip { .. } => "kvzip",
        }
    }

    /// Whether the budget is spent by one threshold over every unit's scores, so that units
    /// keep different counts (`kvzip:global`).
    pub fn ragged(&self) -> bool {
        matches!(self, PolicySpec::Kvzip { global: true, .. })
    }

    /// The fewest tokens one KV head keeps under a ragged budget (`kvzip:global`): its
    /// `floor=N`, or three blocks (the smallest budget a block policy takes), which on
    /// Qwen2.5-Coder-1.5B halved the KL at 75 % removed against the sinks alone
    /// (`docs/results/kvzip-global-1.5b/NOTE.md`). 0 for every other policy.
    pub fn ragged_floor_tokens(&self, block_size_tokens: u32) -> u32 {
        match *self {
            PolicySpec::Kvzip {
                global: true,
                floor_tokens,
                ..
            } => floor_tokens.unwrap_or(super::MIN_BUDGET_BLOCKS * block_size_tokens),
            _ => 0,
        }
    }

    /// KV slots a sequence of `n_prompt` prompt tokens needs beyond its prompt once the
    /// prompt is in: KVzip's reconstruction pass, in a fork of the sequence (a chunk, its
    /// prompts, and a copy of the partial last block). Admission reserves them.
    pub fn pass_peak_tokens(&self, n_prompt: usize, block_size_tokens: usize) -> usize {
        match self.reconstruction_chunk_tokens() {
            Some(chunk) => {
                chunk.min(n_prompt) + super::kvzip::KVZIP_PROMPT_MAX_TOKENS + block_size_tokens
            }
            None => 0,
        }
    }

    /// Context tokens per reconstruction pass, for a policy whose scores come from the
    /// engine's KVzip passes rather than from the policy itself; `None` for the others.
    pub fn reconstruction_chunk_tokens(&self) -> Option<usize> {
        self.reconstruction_pass().map(|p| p.chunk_tokens)
    }

    /// The reconstruction passes' chunk size and treatment of a chat template's prefix,
    /// for a policy scored by the engine's KVzip passes; `None` for the others.
    pub fn reconstruction_pass(&self) -> Option<KvzipPass> {
        match *self {
            PolicySpec::Kvzip {
                chunk_tokens,
                prefix,
                ..
            } => Some(KvzipPass {
                chunk_tokens: chunk_tokens as usize,
                prefix,
            }),
            _ => None,
        }
    }

    /// The granularity a request that names none runs at: PagedEviction's is its
    /// authors', per KV head (issue 38's comparison, `docs/results/eval-issue38/NOTE.md`:
    /// it found the most needles of the family, at a little more text-kl than per layer), a ragged
    /// KVzip budget needs one unit per KV head, and every other policy selects once for
    /// all layers and heads, which evicts whole blocks of one table and copies no K/V.
    pub fn default_granularity(&self) -> super::KvGranularity {
        match self {
            PolicySpec::PagedEviction { .. } => PAGED_EVICTION_GRANULARITY,
            spec if spec.ragged() => super::KvGranularity::Head,
            _ => super::KvGranularity::Shared,
        }
    }

    /// Whether this policy ever drops tokens (`full` does not, and ignores the budget).
    pub fn evicts(&self) -> bool {
        *self != PolicySpec::Full
    }

    /// Whether the prompt may be pruned as its chunks arrive rather than once it is all in
    /// (`EngineConfig::prefill_prune_interval_tokens`): only policies that score tokens
    /// from their own keys and values, without queries, and whose method does not ask for
    /// exact prefill attention. StreamingLLM keeps sinks and the most recent tokens, which
    /// is what its paper runs as a rolling cache; KNorm and KeyDiff score keys alone.
    /// PagedEviction's spec computes exact attention over the whole prompt before it
    /// prunes, and SnapKV, H2O, TOVA and expected attention read the prompt's queries, so
    /// they select once, from the whole prompt.
    pub fn prunes_as_chunks_arrive(&self) -> bool {
        matches!(
            self,
            PolicySpec::StreamingLlm { .. } | PolicySpec::KNorm | PolicySpec::KeyDiff
        )
    }

    /// Checks the spec against a per-sequence budget and block size: `validate_budget`
    /// (except for `full`, which ignores the budget), and for `streaming-llm` that the
    /// sinks fit in the first block, which is the block decode never evicts.
    pub fn validate(&self, budget_tokens: u32, block_size_tokens: u32) -> Result<(), PolicyError> {
        if !self.evicts() {
            return match block_size_tokens {
                0 => Err(PolicyError::ZeroBlockSize),
                _ => Ok(()),
            };
        }
        validate_budget(budget_tokens, block_size_tokens)?;
        if let PolicySpec::StreamingLlm {
            n_sink_tokens: Some(n_sink),
        } = *self
        {
            if n_sink > block_size_tokens {
                return Err(PolicyError::InvalidOption {
                    policy: "streaming-llm",
                    option: format!("n-sink={n_sink}"),
                    valid:
                        "n-sink=N with 1 <= N <= the block size (the sinks live in the first block)",
                });
            }
        }
        Ok(())
    }

    /// A fresh policy for one sequence.
    pub fn build(&self) -> Box<dyn EvictionPolicy> {
        let spec = *self;
        let scored = |scorer: Box<dyn super::scored::TokenScorer>, protect, candidates| {
            Box::new(ScoredPolicy::new(spec, scorer, protect, candidates))
                as Box<dyn EvictionPolicy>
        };
        match spec {
            PolicySpec::Full => Box::new(FullCache::default()),
            PolicySpec::StreamingLlm { n_sink_tokens } => {
                Box::new(StreamingLlm::new(n_sink_tokens))
            }
            PolicySpec::KNorm => scored(
                Box::new(KNormScorer),
                Protect::Nothing,
                Candidates::AllOlder,
            ),
            PolicySpec::KeyDiff => scored(
                Box::<KeyDiffScorer>::default(),
                Protect::Nothing,
                Candidates::AllOlder,
            ),
            PolicySpec::SnapKv {
                window_tokens,
                kernel_tokens,
                avg_pool,
            } => scored(
                Box::new(SnapKvScorer {
                    window: window_tokens as usize,
                    kernel: kernel_tokens as usize,
                    avg_pool,
                }),
                Protect::LastTokens(window_tokens as usize),
                Candidates::AllOlder,
            ),
            PolicySpec::H2o => scored(
                Box::new(H2oScorer),
                Protect::RecentHalf,
                Candidates::OlderThanRecentHalf,
            ),
            PolicySpec::Tova => {
                scored(Box::new(TovaScorer), Protect::Nothing, Candidates::AllOlder)
            }
            PolicySpec::ExpectedAttention {
                window_queries,
                n_sink_tokens,
            } => scored(
                Box::new(ExpectedAttentionScorer {
                    window: window_queries as usize,
                    n_sink_tokens: n_sink_tokens as usize,
                }),
                Protect::FirstTokens(n_sink_tokens as usize),
                Candidates::AllOlder,
            ),
            PolicySpec::Kvzip { .. } => scored(
                Box::<KvzipScorer>::default(),
                Protect::FirstTokens(super::kvzip::KVZIP_SINK_TOKENS),
                Candidates::AllOlder,
            ),
            PolicySpec::PagedEviction { score, local_topk } => scored(
                Box::new(PagedScorer { score }),
                Protect::FirstBlockAndTail,
                match local_topk {
                    Some(topk) => Candidates::OldestK(topk as usize),
                    None => Candidates::AllOlder,
                },
            ),
        }
    }

    /// One spec of every policy and variant, with default options: for tests and `--help`.
    pub fn all_defaults() -> Vec<PolicySpec> {
        [
            "full",
            "streaming-llm",
            "knorm",
            "keydiff",
            "snapkv",
            "h2o",
            "tova",
            "expected-attention",
            "paged-eviction",
            "paged-eviction:ratio:global",
            "paged-eviction:inv-k-norm",
            "paged-eviction:global",
            "kvzip",
        ]
        .iter()
        .map(|name| name.parse().expect("built-in names parse"))
        .collect()
    }
}

/// Parses the `N` of `key=N` as a positive integer.
fn positive(
    policy: &'static str,
    option: &str,
    value: &str,
    valid: &'static str,
) -> Result<u32, PolicyError> {
    match value.parse::<u32>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(PolicyError::InvalidOption {
            policy,
            option: option.to_string(),
            valid,
        }),
    }
}

impl FromStr for PolicySpec {
    type Err = PolicyError;

    fn from_str(text: &str) -> Result<Self, PolicyError> {
        let mut parts = text.trim().split(':');
        let name = parts.next().unwrap_or_default();
        let mut spec = match name {
            "full" => PolicySpec::Full,
            "streaming-llm" => PolicySpec::StreamingLlm {
                n_sink_tokens: None,
            },
            "knorm" => PolicySpec::KNorm,
            "keydiff" => PolicySpec::KeyDiff,
            "snapkv" => PolicySpec::SnapKv {
                window_tokens: SNAPKV_WINDOW_DEFAULT,
                kernel_tokens: SNAPKV_KERNEL_DEFAULT,
                avg_pool: false,
            },
            "h2o" => PolicySpec::H2o,
            "tova" => PolicySpec::Tova,
            "expected-attention" => PolicySpec::ExpectedAttention {
                window_queries: EXPECTED_WINDOW_DEFAULT,
                n_sink_tokens: EXPECTED_N_SINK_DEFAULT,
            },
            "paged-eviction" => PolicySpec::default(),
            "kvzip" => PolicySpec::Kvzip {
                chunk_tokens: super::kvzip::KVZIP_CHUNK_TOKENS as u32,
                global: false,
                floor_tokens: None,
                prefix: KvzipPrefix::default(),
            },
            _ => {
                return Err(PolicyError::UnknownPolicy {
                    name: text.to_string(),
                })
            }
        };
        let mut seen: Vec<&str> = Vec::new();
        for option in parts {
            let (key, value) = match option.split_once('=') {
                Some((key, value)) => (key, Some(value)),
                None => (option, None),
            };
            // `ratio`, `v-norm` and `inv-k-norm` all set the score, and `local` and
            // `global` the victim choice: count each family as one key.
            let slot = match key {
                "ratio" | "v-norm" | "inv-k-norm" => "score",
                "local" | "global" => "victim",
                _ => key,
            };
            let invalid = |valid| PolicyError::InvalidOption {
                policy: spec.name(),
                option: option.to_string(),
                valid,
            };
            if seen.contains(&slot) {
                return Err(invalid("each option at most once"));
            }
            seen.push(slot);
            spec = apply_option(spec, key, value, option)
                .ok_or_else(|| invalid(valid_options(&spec)))??;
        }
        if let PolicySpec::Kvzip {
            global: false,
            floor_tokens: Some(n),
            ..
        } = spec
        {
            return Err(PolicyError::InvalidOption {
                policy: spec.name(),
                option: format!("floor={n}"),
                valid: "floor=N with global only: a uniform budget keeps the same count per head",
            });
        }
        Ok(spec)
    }
}

/// The options a policy accepts, for error messages.
fn valid_options(spec: &PolicySpec) -> &'static str {
    match spec {
        PolicySpec::StreamingLlm { .. } => "n-sink=N (N >= 1)",
        PolicySpec::SnapKv { .. } => "window=N (N >= 1), kernel=N (odd, N >= 1), pool=max|avg",
        PolicySpec::ExpectedAttention { .. } => "window=N (N >= 1), n-sink=N (N >= 0)",
        PolicySpec::PagedEviction { .. } => {
            "v-norm (default), ratio, inv-k-norm; local=N (N >= 1; local is local=3, the default), global"
        }
        PolicySpec::Kvzip { .. } => {
            "chunk=N (N >= 1 context tokens per reconstruction pass), global, floor=N (N >= 4 tokens a head keeps at least under global; default three blocks), prefix=context|kept|kvpress (the chat template's prefix: scored as context, the default; kept whole as the authors do; or as kvpress)"
        }
        _ => "none (this policy takes no options)",
    }
}

/// `None`: the option is not one this policy knows (the caller reports the valid ones).
fn apply_option(
    spec: PolicySpec,
    key: &str,
    value: Option<&str>,
    option: &str,
) -> Option<Result<PolicySpec, PolicyError>> {
    let opt = OptionText {
        policy: spec.name(),
        option,
        valid: valid_options(&spec),
    };
    match (spec, key, value) {
        (PolicySpec::StreamingLlm { .. }, "n-sink", Some(v)) => {
            Some(opt.number(v).map(|n| PolicySpec::StreamingLlm {
                n_sink_tokens: Some(n),
            }))
        }
        (PolicySpec::SnapKv { .. }, _, Some(v)) => apply_snapkv_option(spec, key, v, &opt),
        (PolicySpec::ExpectedAttention { .. }, _, Some(v)) => {
            apply_expected_option(spec, key, v, &opt)
        }
        (PolicySpec::PagedEviction { .. }, _, _) => apply_paged_option(spec, key, value, &opt),
        (PolicySpec::Kvzip { .. }, _, _) => apply_kvzip_option(spec, key, value, &opt),
        _ => None,
    }
}

fn apply_kvzip_option(
    spec: PolicySpec,
    key: &str,
    value: Option<&str>,
    opt: &OptionText,
) -> Option<Result<PolicySpec, PolicyError>> {
    let PolicySpec::Kvzip {
        chunk_tokens,
        global,
        floor_tokens,
        prefix,
    } = spec
    else {
        return None;
    };
    let sinks = super::kvzip::KVZIP_SINK_TOKENS as u32;
    Some(match (key, value) {
        ("chunk", Some(v)) => opt.number(v).map(|n| PolicySpec::Kvzip {
            chunk_tokens: n,
            global,
            floor_tokens,
            prefix,
        }),
        ("global", None) => Ok(PolicySpec::Kvzip {
            chunk_tokens,
            global: true,
            floor_tokens,
            prefix,
        }),
        ("floor", Some(v)) => match opt.number(v) {
            Ok(n) if n >= sinks => Ok(PolicySpec::Kvzip {
                chunk_tokens,
                global,
                floor_tokens: Some(n),
                prefix,
            }),
            Ok(_) => Err(opt.invalid()),
            Err(e) => Err(e),
        },
        ("prefix", Some(v)) => match KvzipPrefix::parse(v) {
            Some(prefix) => Ok(PolicySpec::Kvzip {
                chunk_tokens,
                global,
                floor_tokens,
                prefix,
            }),
            None => Err(opt.invalid()),
        },
        _ => return None,
    })
}

/// One option as written, for its errors.
struct OptionText<'a> {
    policy: &'static str,
    option: &'a str,
    valid: &'static str,
}

impl OptionText<'_> {
    fn invalid(&self) -> PolicyError {
        PolicyError::InvalidOption {
            policy: self.policy,
            option: self.option.to_string(),
            valid: self.valid,
        }
    }

    fn number(&self, value: &str) -> Result<u32, PolicyError> {
        positive(self.policy, self.option, value, self.valid)
    }
}

/// SnapKV's `window=N`, `kernel=N` (odd) and `pool=max|avg`.
fn apply_snapkv_option(
    spec: PolicySpec,
    key: &str,
    v: &str,
    opt: &OptionText,
) -> Option<Result<PolicySpec, PolicyError>> {
    let PolicySpec::SnapKv {
        window_tokens,
        kernel_tokens,
        avg_pool,
    } = spec
    else {
        return None;
    };
    let with = |window_tokens, kernel_tokens, avg_pool| PolicySpec::SnapKv {
        window_tokens,
        kernel_tokens,
        avg_pool,
    };
    Some(match key {
        "window" => opt.number(v).map(|n| with(n, kernel_tokens, avg_pool)),
        "pool" => match v {
            "max" | "avg" => Ok(with(window_tokens, kernel_tokens, v == "avg")),
            _ => Err(opt.invalid()),
        },
        "kernel" => match opt.number(v) {
            Ok(n) if n % 2 == 1 => Ok(with(window_tokens, n, avg_pool)),
            Ok(_) => Err(opt.invalid()),
            Err(error) => Err(error),
        },
        _ => return None,
    })
}

/// Expected attention's `window=N` and `n-sink=N` (zero allowed).
fn apply_expected_option(
    spec: PolicySpec,
    key: &str,
    v: &str,
    opt: &OptionText,
) -> Option<Result<PolicySpec, PolicyError>> {
    let PolicySpec::ExpectedAttention {
        window_queries,
        n_sink_tokens,
    } = spec
    else {
        return None;
    };
    Some(match key {
        "window" => opt.number(v).map(|n| PolicySpec::ExpectedAttention {
            window_queries: n,
            n_sink_tokens,
        }),
        "n-sink" => match v.parse::<u32>() {
            Ok(n) => Ok(PolicySpec::ExpectedAttention {
                window_queries,
                n_sink_tokens: n,
            }),
            Err(_) => Err(opt.invalid()),
        },
        _ => return None,
    })
}

/// PagedEviction's score flags (`ratio`, `v-norm`, `inv-k-norm`) and `local[=N]`.
fn apply_paged_option(
    spec: PolicySpec,
    key: &str,
    value: Option<&str>,
    opt: &OptionText,
) -> Option<Result<PolicySpec, PolicyError>> {
    let PolicySpec::PagedEviction { score, local_topk } = spec else {
        return None;
    };
    Some(match (key, value) {
        ("ratio" | "v-norm" | "inv-k-norm", None) => {
            let score = match key {
                "v-norm" => PagedScore::VNorm,
                "inv-k-norm" => PagedScore::InvKNorm,
                _ => PagedScore::VOverK,
            };
            Ok(PolicySpec::PagedEviction { score, local_topk })
        }
        ("local", value) => {
            let topk = match value {
                None => Ok(LOCAL_TOPK_DEFAULT),
                Some(v) => opt.number(v),
            };
            topk.map(|n| PolicySpec::PagedEviction {
                score,
                local_topk: Some(n),
            })
        }
        ("global", None) => Ok(PolicySpec::PagedEviction {
            score,
            local_topk: None,
        }),
        _ => return None,
    })
}

impl fmt::Display for PolicySpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())?;
        match *self {
            PolicySpec::StreamingLlm {
                n_sink_tokens: Some(n),
            } => write!(f, ":n-sink={n}")?,
            PolicySpec::SnapKv {
                window_tokens,
                kernel_tokens,
                avg_pool,
            } => {
                if window_tokens != SNAPKV_WINDOW_DEFAULT {
                    write!(f, ":window={window_tokens}")?;
                }
                if kernel_tokens != SNAPKV_KERNEL_DEFAULT {
                    write!(f, ":kernel={kernel_tokens}")?;
                }
                if avg_pool {
                    write!(f, ":pool=avg")?;
                }
            }
            PolicySpec::ExpectedAttention {
                window_queries,
                n_sink_tokens,
            } => {
                if window_queries != EXPECTED_WINDOW_DEFAULT {
                    write!(f, ":window={window_queries}")?;
                }
                if n_sink_tokens != EXPECTED_N_SINK_DEFAULT {
                    write!(f, ":n-sink={n_sink_tokens}")?;
                }
            }
            PolicySpec::Kvzip {
                chunk_tokens,
                global,
                floor_tokens,
                prefix,
            } => {
                if chunk_tokens as usize != super::kvzip::KVZIP_CHUNK_TOKENS {
                    write!(f, ":chunk={chunk_tokens}")?;
                }
                if global {
                    f.write_str(":global")?;
                }
                if let Some(n) = floor_tokens {
                    write!(f, ":floor={n}")?;
                }
                if prefix != KvzipPrefix::default() {
                    write!(f, ":prefix={}", prefix.name())?;
                }
            }
            PolicySpec::PagedEviction { score, local_topk } => {
                match score {
                    PagedScore::VNorm => {}
                    PagedScore::VOverK => f.write_str(":ratio")?,
                    PagedScore::InvKNorm => f.write_str(":inv-k-norm")?,
                }
                match local_topk {
                    Some(LOCAL_TOPK_DEFAULT) => {}
                    Some(topk) => write!(f, ":local={topk}")?,
                    None => f.write_str(":global")?,
                }
            }
            _ => {}
        }
        Ok(())
    }
}
