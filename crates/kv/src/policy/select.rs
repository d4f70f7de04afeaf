//! The two selection steps every score-based policy shares: top-k of token scores at
//! prefill, and the lowest-scored candidate block at decode.
//!
//! Both orders are total and deterministic: scores compare with `f32::total_cmp`, and
//! equal scores fall back to the index (the lower stored index is kept, the lower table
//! index is evicted).

use std::cmp::Ordering;
use std::ops::Range;

/// The stored indices to keep, sorted: every protected token, then the highest-scored of
/// the others until `budget` tokens are kept (or all of them).
///
/// Panics if more than `budget` tokens are protected: callers clamp their protected sets.
pub(crate) fn select_top(
    scores: &[f32],
    budget: usize,
    is_protected: impl Fn(usize) -> bool,
) -> Vec<u32> {
    let (mut keep, mut others): (Vec<u32>, Vec<u32>) =
        (0..scores.len() as u32).partition(|&token| is_protected(token as usize));
    assert!(
        keep.len() <= budget,
        "select_top: {} protected tokens exceed the budget of {budget}",
        keep.len()
    );
    let num_others = (budget - keep.len()).min(others.len());
    // Best first: higher score, then lower index. The order is total, so the selection
    // does not depend on the unstable partition's internals.
    let best_first = |a: &u32, b: &u32| -> Ordering {
        scores[*b as usize]
            .total_cmp(&scores[*a as usize])
            .then(a.cmp(b))
    };
    if num_others > 0 && num_others < others.len() {
        others.select_nth_unstable_by(num_others - 1, best_first);
    }
    keep.extend_from_slice(&others[..num_others]);
    keep.sort_unstable();
    keep
}

/// One score per full block of a sequence's table, in table order.
#[derive(Clone, Debug, Default)]
pub(crate) struct BlockScores {
    scores: Vec<f32>,
}

impl BlockScores {
    pub(crate) fn clear(&mut self) {
        self.scores.clear();
    }

    pub(crate) fn len(&self) -> usize {
        self.scores.len()
    }

    pub(crate) fn push(&mut self, score: f32) {
        self.scores.push(score);
    }

    /// Removes the entry of a block removed from the table; later entries shift left.
    pub(crate) fn remove(&mut self, block_index: usize) {
        assert!(
            block_index < self.scores.len(),
            "policy: block {block_index} removed, but only {} full blocks are scored",
            self.scores.len()
        );
        self.scores.remove(block_index);
    }

    /// The lowest-scored block among `candidates` (ties: the lower index).
    pub(crate) fn argmin(&self, candidates: Range<usize>) -> Option<usize> {
        let candidates = candidates.start..candidates.end.min(self.scores.len());
        candidates.min_by(|&a, &b| self.scores[a].total_cmp(&self.scores[b]).then(a.cmp(&b)))
    }

    /// Pushes one score per full block of the kept layout: the mean of the kept tokens'
    /// scores, block by block (`token_scores` is indexed by the old stored index).
    pub(crate) fn init_from_kept(&mut self, token_scores: &[f32], keep: &[u32], block_size: usize) {
        self.clear();
        for block in keep.chunks_exact(block_size) {
            let sum: f32 = block
                .iter()
                .map(|&token| token_scores[token as usize])
                .sum();
            self.push(sum / block_size as f32);
        }
    }

    #[cfg(test)]
    pub(crate) fn as_slice(&self) -> &[f32] {
        &self.scores
    }
}

/// Mean of `scores`, the block score of one block's token scores.
pub(crate) fn mean(scores: &[f32]) -> f32 {
    scores.iter().sum::<f32>() / scores.len() as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_protected_then_best_with_lower_index_on_ties() {
        let scores = [9.0, 1.0, 5.0, 5.0, 7.0, 5.0, 0.0];
        // Protect token 6; three more: 0 (9.0), 4 (7.0), then 2 (5.0, lowest of the ties).
        let keep = select_top(&scores, 4, |token| token == 6);
        assert_eq!(keep, vec![0, 2, 4, 6]);
    }

    #[test]
    fn small_input_is_kept_whole() {
        assert_eq!(select_top(&[1.0, 2.0], 5, |_| false), vec![0, 1]);
        assert_eq!(select_top(&[], 5, |_| false), Vec::<u32>::new());
    }

    #[test]
    fn block_scores_argmin_ties_go_to_the_lower_index() {
        let mut blocks = BlockScores::default();
        for score in [0.0, 3.0, 1.0, 1.0, 0.5] {
            blocks.push(score);
        }
        assert_eq!(blocks.argmin(1..4), Some(2));
        assert_eq!(blocks.argmin(1..5), Some(4));
        assert_eq!(blocks.argmin(1..1), None);
        blocks.remove(2);
        assert_eq!(blocks.as_slice(), &[0.0, 3.0, 1.0, 0.5]);
    }

    #[test]
    fn init_from_kept_averages_full_blocks_only() {
        let mut blocks = BlockScores::default();
        let token_scores = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0];
        blocks.init_from_kept(&token_scores, &[0, 2, 3, 5, 6], 2);
        assert_eq!(blocks.as_slice(), &[2.0, 5.0]);
    }
}
