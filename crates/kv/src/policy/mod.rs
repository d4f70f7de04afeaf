//! KV eviction policies: which prompt tokens to keep at prefill, and which whole block to
//! evict during decode, for one sequence under a token budget.
//!
//! Design: PagedEviction (arXiv 2509.04377; spec in `shared/spec/paged-eviction.md`) and
//! the baselines of `shared/spec/baselines.md`, behind one small trait. Mechanism stays in
//! the pool and the tables (`KvCacheManager::compact`, `remove_block`); a policy only reads
//! K/V (and, for attention-based baselines, a few queries) through `KvView`/`QueryView`
//! and answers with stored indices. It never touches blocks, ids or the pool.
//!
//! Protocol, per sequence (the engine drives it; a policy instance serves one sequence):
//! 1. Prefill: write all `T` prompt tokens, run exact attention over the full prompt, then
//!    `keep = policy.select_prefill(kv, queries, budget, B)` (all of `0..T` when
//!    `T <= budget`, else exactly `budget` sorted stored indices), then
//!    `manager.compact(seq, &keep)` and perform the returned moves. The policy now holds
//!    one score per full block of the kept layout.
//! 2. Decode: after each token, if the last block has just become full, call
//!    `policy.on_block_filled(kv, queries, block_index)` (every time, not only when over
//!    budget: the block is scored once, here). Then, if stored tokens > budget,
//!    `policy.choose_victim(num_blocks)` names a block; `manager.remove_block(seq, i)` and
//!    `policy.on_block_removed(i)`. Stored tokens then cycle between about `budget` and
//!    `budget + B`, never above `budget + B`.
//! 3. Queries: `prefill_queries()`/`decode_queries()` say how many recent queries the
//!    policy reads (`QueryNeed`); key/value-only policies read none and are passed `None`.
//!
//! Decision (spec "which layer decides"): a request chooses (`KvGranularity`, module
//! `granularity`). `shared` is one selection for all layers, from token scores averaged
//! over layers and KV heads (option (b)); `layer` is option (a), one policy instance per
//! layer; `head` one per (layer, KV head), as kvpress does. The table stays one per
//! sequence: every unit keeps the same number of tokens, each in its own slots
//! (`KvCacheManager::compact_units`), so a policy instance sees a `KvView` of its unit
//! only and needs no change.
//!
//! Block-state invariant (NOTE 11 in the crate docs): a policy holds exactly one entry per
//! full block of the table, in table order: `num_scored_blocks() == num_full_blocks()`
//! after `select_prefill`, after each `on_block_filled`, and after each
//! `on_block_removed`. The partial last block is scored when it fills.
//!
//! PagedEviction decisions (spec `paged-eviction.md`):
//! - Default score `‖v‖` (`paged-eviction`, or `:v-norm` by name), what the authors' code
//!   runs. The paper's stated formula `‖v‖/(‖k‖+eps)`, eps = 1e-6, is `paged-eviction:ratio`
//!   (the default until issue 38), and `1/(‖k‖+eps)` is `paged-eviction:inv-k-norm`.
//!   Issue 38's comparison on Qwen2.5-Coder-1.5B (`docs/results/eval-issue38/NOTE.md`)
//!   chose: `v-norm` with local victims had lower text-kl than the ratio in every cell.
//! - Prefill counts: the spec keeps the first block, the tail (`B + T mod B` tokens) and
//!   `C - 2B` middle tokens, which stores `C + T mod B` tokens, over the budget. We keep
//!   `C - 2B - T mod B` middle tokens, so prefill stores exactly `C` and decode cycles
//!   between `C` and `C + B` as the spec says. (`C >= 3B` keeps this count positive.)
//! - Local candidates by default, as the authors' HF harness: the decode victim is the
//!   lowest-scoring of the oldest `topk = 3` non-sink blocks (`paged-eviction:local=N`
//!   for another `topk`); `paged-eviction:global` considers every evictable block (the
//!   default until issue 38). Choosing among the oldest blocks keeps recent context.
//!
//! Ties are deterministic everywhere: at prefill, of equal scores the lower stored index
//! is kept; at decode, of equal block scores the lower table index is evicted. Scores are
//! compared with `f32::total_cmp`.
//!
//! Code map: `view` (the read traits and dense test implementations), `spec` (names,
//! parsing, `build`), `select` (top-k selection and block scores), `scorers` (key/value
//! norm scores: PagedEviction, KNorm, KeyDiff), `attention` (query-based scores: SnapKV,
//! H2O, TOVA, ExpectedAttention), `scored` (the policy shared by every score-based
//! method), `simple` (full cache and StreamingLLM).

use std::fmt;

mod attention;
mod granularity;
mod kvzip;
mod kvzip_prefix;
mod scored;
mod scorers;
mod select;
mod simple;
mod spec;
mod view;

pub use attention::snapkv_token_scores;
pub use granularity::{selection_units, KvGranularity, SelectionUnit, VALID_GRANULARITIES};
pub use kvzip::{
    kvzip_chunks, kvzip_initial_scores, kvzip_kept, kvzip_pass_ids, kvzip_pass_scores, kvzip_span,
    kvzip_unit_pass_scores, KvzipBudget, KVZIP_CHUNK_TOKENS, KVZIP_FIRST_PROMPT,
    KVZIP_LATER_PROMPT, KVZIP_PREV_POSTFIX_TOKENS, KVZIP_PROMPT_MAX_TOKENS, KVZIP_SINK_TOKENS,
};
pub use kvzip_prefix::{KvzipPass, KvzipPlan, KvzipPrefix};
pub use scorers::kv_token_scores;
pub use spec::{PagedScore, PolicySpec, SNAPKV_KERNEL_DEFAULT, SNAPKV_WINDOW_DEFAULT};
pub use view::{DenseKv, DenseQueries, KvView, QueryView};

/// How many of the most recent queries a policy reads. The engine passes the queries of
/// the last `count(available)` tokens (post-RoPE, every layer and query head), with their
/// stored positions; a policy must work with fewer (at least the newest one).
///
/// At prefill, "available" is the prompt; at decode, it is what the engine kept, at most
/// the just-filled block's own tokens.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum QueryNeed {
    /// Keys and values only; pass `None`.
    None,
    /// The last `n` queries.
    Last(usize),
    /// Every available query (H2O's full attention matrix).
    All,
}

impl QueryNeed {
    /// How many queries to pass when `available` exist.
    pub fn count(self, available: usize) -> usize {
        match self {
            QueryNeed::None => 0,
            QueryNeed::Last(n) => n.min(available),
            QueryNeed::All => available,
        }
    }
}

/// A KV eviction policy for one sequence. See the module docs for the protocol.
pub trait EvictionPolicy: fmt::Debug + Send {
    /// The spec this policy was built from, for logs and metrics.
    fn spec(&self) -> PolicySpec;

    /// Queries `select_prefill` reads.
    fn prefill_queries(&self) -> QueryNeed {
        QueryNeed::None
    }

    /// Queries `on_block_filled` reads.
    fn decode_queries(&self) -> QueryNeed {
        QueryNeed::None
    }

    /// Hands over scores computed outside the policy, one per stored token, for the next
    /// `select_prefill`: the engine's KVzip reconstruction passes, for a spec with
    /// [`PolicySpec::reconstruction_chunk_tokens`]. Other policies are never given any.
    fn set_prior_scores(&mut self, scores: Vec<f32>) {
        let _ = scores;
        unreachable!("{} computes its own scores", self.spec());
    }

    /// Chooses the prompt tokens to keep: sorted, distinct stored indices of `kv`, all of
    /// them when `kv.n_tokens() <= budget_tokens`, else exactly `budget_tokens`. Resets
    /// the policy's state to one score per full block of the kept layout.
    ///
    /// Panics if the budget is below 3 blocks (see `validate_budget`), or if the policy
    /// needs queries and `queries` is `None`.
    fn select_prefill(
        &mut self,
        kv: &dyn KvView,
        queries: Option<&dyn QueryView>,
        budget_tokens: u32,
        block_size_tokens: u32,
    ) -> Vec<u32>;

    /// Block `block_index` of the table (stored tokens `block_index * B ..` `+ B`) has just
    /// become full: score it, once. Blocks between the last scored one and `block_index`
    /// are scored too, so a caller that skipped some stays aligned.
    ///
    /// Panics if `block_index` is already scored or not full in `kv`.
    fn on_block_filled(
        &mut self,
        kv: &dyn KvView,
        queries: Option<&dyn QueryView>,
        block_index: usize,
    );

    /// The table index of the block to evict, given the table's `num_blocks` (full blocks,
    /// plus the partial last block if any). Never the first (sink) block, never the newest
    /// full block, never a partial block. `None` if nothing may be evicted.
    fn choose_victim(&self, num_blocks: usize) -> Option<usize>;

    /// Block `block_index` was removed from the table: drop its state, shifting later
    /// entries left as the table does.
    fn on_block_removed(&mut self, block_index: usize);

    /// Full blocks the policy holds state for (equals the table's full blocks).
    fn num_scored_blocks(&self) -> usize;
}

/// Blocks a budget must hold: the sink block, one evictable block, and the block being
/// filled (spec "Budget").
pub const MIN_BUDGET_BLOCKS: u32 = 3;

/// Checks a per-sequence token budget against the block size: `B > 0` and
/// `budget_tokens >= 3 * B`.
pub fn validate_budget(budget_tokens: u32, block_size_tokens: u32) -> Result<(), PolicyError> {
    if block_size_tokens == 0 {
        return Err(PolicyError::ZeroBlockSize);
    }
    if (budget_tokens as u64) < MIN_BUDGET_BLOCKS as u64 * block_size_tokens as u64 {
        return Err(PolicyError::BudgetTooSmall {
            budget_tokens,
            block_size_tokens,
        });
    }
    Ok(())
}

/// Checks one unit's share of a ragged budget (`kvzip:global`): `B > 0` and at least the
/// `KVZIP_SINK_TOKENS` sinks. A ragged selection happens once, at prefill, so it holds no
/// evictable block and no block being filled; kvpress's global threshold may leave a head
/// nothing, and this keeps its sinks.
pub fn validate_ragged_budget(
    budget_tokens: u32,
    block_size_tokens: u32,
) -> Result<(), PolicyError> {
    if block_size_tokens == 0 {
        return Err(PolicyError::ZeroBlockSize);
    }
    if (budget_tokens as usize) < KVZIP_SINK_TOKENS {
        return Err(PolicyError::RaggedBudgetTooSmall { budget_tokens });
    }
    Ok(())
}

/// Invalid policy names, options or budgets. Messages name what would be valid.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum PolicyError {
    UnknownPolicy {
        name: String,
    },
    UnknownGranularity {
        name: String,
    },
    InvalidOption {
        policy: &'static str,
        option: String,
        valid: &'static str,
    },
    BudgetTooSmall {
        budget_tokens: u32,
        block_size_tokens: u32,
    },
    RaggedBudgetTooSmall {
        budget_tokens: u32,
    },
    ZeroBlockSize,
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicyError::UnknownPolicy { name } => write!(
                f,
                "unknown KV eviction policy `{name}`; valid policies: {}",
                spec::VALID_POLICIES
            ),
            PolicyError::UnknownGranularity { name } => write!(
                f,
                "unknown KV eviction granularity `{name}`; valid: {}",
                granularity::VALID_GRANULARITIES
            ),
            PolicyError::InvalidOption {
                policy,
                option,
                valid,
            } => write!(
                f,
                "invalid option `{option}` for KV eviction policy {policy}; valid options: {valid}"
            ),
            PolicyError::BudgetTooSmall {
                budget_tokens,
                block_size_tokens,
            } => write!(
                f,
                "KV budget of {budget_tokens} tokens is too small: it must be at least {} tokens \
                 ({MIN_BUDGET_BLOCKS} blocks of {block_size_tokens}: the sink block, one evictable \
                 block and the block being filled)",
                MIN_BUDGET_BLOCKS as u64 * *block_size_tokens as u64
            ),
            PolicyError::RaggedBudgetTooSmall { budget_tokens } => write!(
                f,
                "a KV head's share of a global budget is {budget_tokens} tokens: it must hold \
                 at least the {KVZIP_SINK_TOKENS} sink tokens"
            ),
            PolicyError::ZeroBlockSize => write!(f, "KV block size must be at least 1 token"),
        }
    }
}

impl std::error::Error for PolicyError {}
