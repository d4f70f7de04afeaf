//! `ScoredPolicy`: the one policy shape shared by every score-based method (PagedEviction,
//! KNorm, KeyDiff, SnapKV, H2O, TOVA, ExpectedAttention). A method is three choices:
//! - a `TokenScorer`: a score per stored token, higher = more worth keeping;
//! - a `Protect` rule: tokens always kept at prefill (sinks, tail, observation window);
//! - a `Candidates` rule: which full blocks decode may evict.
//!
//! Prefill keeps the protected tokens plus the highest-scored others, up to the budget.
//! Each full block of the kept layout gets the mean of its tokens' prefill scores; a block
//! that fills during decode gets the mean of its tokens' scores at that moment. Scores are
//! computed once per block and never recomputed (spec "Decode"); for methods whose score
//! depends on context (KeyDiff's mean key, attention-based scores), that is the context
//! when the block was scored. Decode evicts the lowest-scored candidate.

use std::fmt;
use std::ops::Range;

use super::select::{mean, select_top, BlockScores};
use super::{
    validate_budget, validate_ragged_budget, EvictionPolicy, KvView, PolicySpec, QueryNeed,
    QueryView,
};

/// Scores stored tokens. Higher is kept.
pub(crate) trait TokenScorer: fmt::Debug + Send {
    fn prefill_queries(&self) -> QueryNeed {
        QueryNeed::None
    }
    fn decode_queries(&self) -> QueryNeed {
        QueryNeed::None
    }
    /// Scores computed outside the policy, one per stored token (KVzip's reconstruction
    /// passes); scorers that compute their own never receive any.
    fn set_prior(&mut self, scores: Vec<f32>) {
        let _ = scores;
        unreachable!("{self:?} computes its own scores");
    }
    /// Writes one score per token of `tokens` (a range of `kv`'s stored indices) to `out`,
    /// replacing its contents. `kv` shows every stored token, as context.
    fn score(
        &mut self,
        kv: &dyn KvView,
        queries: Option<&dyn QueryView>,
        tokens: Range<usize>,
        out: &mut Vec<f32>,
    );
}

/// Tokens always kept at prefill, whatever their scores. Each set is clamped to the budget.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Protect {
    Nothing,
    /// PagedEviction: the first block and the tail (last full block + partial block).
    FirstBlockAndTail,
    /// The first `n` tokens (attention sinks).
    FirstTokens(usize),
    /// The last `n` tokens (SnapKV's observation window).
    LastTokens(usize),
    /// The last `budget / 2` tokens (H2O's recent window).
    RecentHalf,
}

/// Full blocks decode may evict. Never block 0 (sinks), never the newest full block.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Candidates {
    /// Every other full block (PagedEviction's global variant, and the default).
    AllOlder,
    /// The oldest `topk` non-sink blocks (PagedEviction's local variant).
    OldestK(usize),
    /// Blocks older than the recent window of `budget / 2` tokens (H2O), at least one
    /// block protected.
    OlderThanRecentHalf,
}

#[derive(Debug)]
pub(crate) struct ScoredPolicy {
    spec: PolicySpec,
    scorer: Box<dyn TokenScorer>,
    protect: Protect,
    candidates: Candidates,
    blocks: BlockScores,
    block_size_tokens: usize,
    budget_tokens: usize,
    /// Scratch for token scores, reused across calls.
    token_scores: Vec<f32>,
}

impl ScoredPolicy {
    pub(crate) fn new(
        spec: PolicySpec,
        scorer: Box<dyn TokenScorer>,
        protect: Protect,
        candidates: Candidates,
    ) -> Self {
        ScoredPolicy {
            spec,
            scorer,
            protect,
            candidates,
            blocks: BlockScores::default(),
            block_size_tokens: 0,
            budget_tokens: 0,
            token_scores: Vec::new(),
        }
    }

    fn is_protected(&self, n_tokens: usize, token: usize) -> bool {
        let budget = self.budget_tokens;
        let block = self.block_size_tokens;
        match self.protect {
            Protect::Nothing => false,
            Protect::FirstBlockAndTail => {
                // Budget >= 3 blocks and the tail is under 2 blocks, so this fits.
                let tail = block + n_tokens % block;
                token < block || token >= n_tokens - tail
            }
            Protect::FirstTokens(n) => token < n.min(budget),
            Protect::LastTokens(n) => token >= n_tokens - n.min(budget),
            Protect::RecentHalf => token >= n_tokens - budget / 2,
        }
    }
}

impl EvictionPolicy for ScoredPolicy {
    fn spec(&self) -> PolicySpec {
        self.spec
    }

    fn set_prior_scores(&mut self, scores: Vec<f32>) {
        self.scorer.set_prior(scores);
    }

    fn prefill_queries(&self) -> QueryNeed {
        self.scorer.prefill_queries()
    }

    fn decode_queries(&self) -> QueryNeed {
        self.scorer.decode_queries()
    }

    fn select_prefill(
        &mut self,
        kv: &dyn KvView,
        queries: Option<&dyn QueryView>,
        budget_tokens: u32,
        block_size_tokens: u32,
    ) -> Vec<u32> {
        // A ragged budget (`kvzip:global`) is one unit's share of a threshold over every
        // unit: it selects once, at prefill, and never evicts a block afterwards, so it
        // needs no evictable block and may be as small as the protected sinks. Every
        // other budget must leave the block policy a sink block, one evictable block and
        // the tail.
        let valid = match self.spec.ragged() {
            true => validate_ragged_budget(budget_tokens, block_size_tokens),
            false => validate_budget(budget_tokens, block_size_tokens),
        };
        if let Err(error) = valid {
            panic!("{}: {error}", self.spec);
        }
        self.budget_tokens = budget_tokens as usize;
        self.block_size_tokens = block_size_tokens as usize;
        self.blocks.clear();
        let n_tokens = kv.n_tokens();
        let keep: Vec<u32> = if n_tokens <= self.budget_tokens {
            // Everything is kept; only the full blocks need scores.
            let n_scored = n_tokens / self.block_size_tokens * self.block_size_tokens;
            if n_scored > 0 {
                self.scorer
                    .score(kv, queries, 0..n_scored, &mut self.token_scores);
            }
            (0..n_tokens as u32).collect()
        } else {
            self.scorer
                .score(kv, queries, 0..n_tokens, &mut self.token_scores);
            select_top(&self.token_scores, self.budget_tokens, |token| {
                self.is_protected(n_tokens, token)
            })
        };
        self.blocks
            .init_from_kept(&self.token_scores, &keep, self.block_size_tokens);
        keep
    }

    fn on_block_filled(
        &mut self,
        kv: &dyn KvView,
        queries: Option<&dyn QueryView>,
        block_index: usize,
    ) {
        let block = self.block_size_tokens;
        assert!(
            block > 0,
            "{}: on_block_filled before select_prefill",
            self.spec
        );
        assert!(
            block_index >= self.blocks.len(),
            "{}: block {block_index} is already scored ({} full blocks scored)",
            self.spec,
            self.blocks.len()
        );
        assert!(
            (block_index + 1) * block <= kv.n_tokens(),
            "{}: block {block_index} is not full ({} tokens stored)",
            self.spec,
            kv.n_tokens()
        );
        for index in self.blocks.len()..=block_index {
            let tokens = index * block..(index + 1) * block;
            self.scorer
                .score(kv, queries, tokens, &mut self.token_scores);
            self.blocks.push(mean(&self.token_scores));
        }
    }

    fn choose_victim(&self, num_blocks: usize) -> Option<usize> {
        let num_full = self.blocks.len();
        assert!(
            num_blocks == num_full || num_blocks == num_full + 1,
            "{}: table has {num_blocks} blocks but {num_full} full blocks are scored",
            self.spec
        );
        // Excludes block 0 (sinks) and block `num_full - 1` (the newest full block).
        let newest = num_full.saturating_sub(1);
        let candidates = match self.candidates {
            Candidates::AllOlder => 1..newest,
            Candidates::OldestK(topk) => 1..newest.min(1 + topk),
            Candidates::OlderThanRecentHalf => {
                let recent_blocks = (self.budget_tokens / 2 / self.block_size_tokens).max(1);
                1..num_full.saturating_sub(recent_blocks)
            }
        };
        self.blocks.argmin(candidates)
    }

    fn on_block_removed(&mut self, block_index: usize) {
        self.blocks.remove(block_index);
    }

    fn num_scored_blocks(&self) -> usize {
        self.blocks.len()
    }
}
