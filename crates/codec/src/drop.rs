//! Token dropping for a stored context: which tokens to keep, given one importance score
//! per token computed by the caller (PagedEviction, KNorm, KeyDiff, SnapKV live in
//! `pk-kv`; this crate only ranks their output).
//!
//! The rule (NOTE 1), for `n` stored tokens and `DropSpec { ratio, keep_first_tokens: F,
//! keep_last_tokens: L }`:
//! 1. Target drop count `⌊ratio · n⌋`, with a 1e-6 relative tolerance so that an f32 ratio
//!    such as 0.7 (stored as 0.69999999) drops 7 of 10 tokens, not 6.
//! 2. The first `min(F, n)` tokens (the attention sinks: PagedEviction's first block) and
//!    the last `min(L, n - F)` tokens (the local context a following query attends to:
//!    PagedEviction's tail) are always kept. When they outnumber `n - ⌊ratio · n⌋`, fewer
//!    tokens than asked are dropped: protection wins over the ratio.
//! 3. The rest of the budget goes to the highest-scored middle tokens; of equal scores the
//!    lower index is kept (as in `pk-kv`), and scores compare with `f32::total_cmp`, so a
//!    positive NaN ranks above every number. The selection is deterministic.
//!
//! Kept tokens stay in their original order with their original positions (NOTE 2): keys
//! are cached post-RoPE, so a kept key is only valid at its own position.

use crate::method::DropSpec;

/// The number of tokens kept out of `n_tokens` under `spec` (rule NOTE 1). This is the
/// exact length of `select_kept_tokens`'s result, without needing scores.
pub fn n_kept_tokens(n_tokens: usize, spec: &DropSpec) -> usize {
    let (first, last) = protected_counts(n_tokens, spec);
    let exact = spec.ratio.clamp(0.0, 1.0) as f64 * n_tokens as f64;
    let n_drop = ((exact + exact * 1e-6).floor() as usize).min(n_tokens);
    (n_tokens - n_drop).max(first + last)
}

/// Indices (into the stored tokens) of the tokens to keep, strictly increasing.
/// `scores` has one entry per stored token; higher means more worth keeping.
pub fn select_kept_tokens(scores: &[f32], spec: &DropSpec) -> Vec<usize> {
    let n = scores.len();
    let (first, last) = protected_counts(n, spec);
    let n_middle_kept = n_kept_tokens(n, spec) - first - last;

    let mut middle: Vec<usize> = (first..n - last).collect();
    if n_middle_kept < middle.len() {
        // Best first: higher score, then lower index.
        let better = |a: &usize, b: &usize| scores[*b].total_cmp(&scores[*a]).then(a.cmp(b));
        if n_middle_kept > 0 {
            middle.select_nth_unstable_by(n_middle_kept - 1, better);
        }
        middle.truncate(n_middle_kept);
        middle.sort_unstable();
    }

    let mut kept = Vec::with_capacity(first + middle.len() + last);
    kept.extend(0..first);
    kept.extend_from_slice(&middle);
    kept.extend(n - last..n);
    kept
}

/// (first, last) protected token counts, never overlapping.
fn protected_counts(n_tokens: usize, spec: &DropSpec) -> (usize, usize) {
    let first = (spec.keep_first_tokens as usize).min(n_tokens);
    let last = (spec.keep_last_tokens as usize).min(n_tokens - first);
    (first, last)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(ratio: f32, first: u32, last: u32) -> DropSpec {
        DropSpec {
            ratio,
            keep_first_tokens: first,
            keep_last_tokens: last,
        }
    }

    #[test]
    fn keeps_protected_ends_and_best_middle_in_order() {
        // 10 tokens, protect 2 + 2, drop half: keep 5 = 4 protected + the best middle one.
        let scores = [0.0, 0.0, 1.0, 5.0, 3.0, 9.0, 2.0, 0.0, 0.0, 0.0];
        assert_eq!(
            select_kept_tokens(&scores, &spec(0.5, 2, 2)),
            vec![0, 1, 5, 8, 9]
        );
        // Drop 30%: keep 7 = 4 protected + 3 best middle (5, 3, 4), in index order.
        assert_eq!(
            select_kept_tokens(&scores, &spec(0.3, 2, 2)),
            vec![0, 1, 3, 4, 5, 8, 9]
        );
    }

    #[test]
    fn f32_ratio_rounding_is_tolerated() {
        assert_eq!(n_kept_tokens(10, &spec(0.7, 0, 0)), 3);
        assert_eq!(n_kept_tokens(10, &spec(0.9, 0, 0)), 1);
        assert_eq!(n_kept_tokens(256, &spec(0.8, 16, 16)), 52);
        assert_eq!(n_kept_tokens(100, &spec(0.0, 16, 16)), 100);
    }

    #[test]
    fn protection_wins_over_ratio() {
        assert_eq!(n_kept_tokens(40, &spec(1.0, 16, 16)), 32);
        assert_eq!(
            select_kept_tokens(&[0.0; 20], &spec(0.9, 16, 16)),
            (0..20).collect::<Vec<_>>()
        );
    }

    #[test]
    fn ties_keep_lower_index() {
        assert_eq!(
            select_kept_tokens(&[1.0; 8], &spec(0.5, 0, 0)),
            vec![0, 1, 2, 3]
        );
    }
}
