//! Agreement between two answers, shared by EVICPRESS profiling (`pk-connectors`) and the
//! evaluation harness (`pk-eval`), so that both score with one implementation.

use std::collections::HashMap;

/// Token-level F1 of two answers (bags of token ids); 1 when both are empty.
pub fn token_f1(answer: &[u32], reference: &[u32]) -> f64 {
    multiset_f1(answer, reference)
}

/// F1 of two bags of items (multiset overlap; precision over `candidate`, recall over
/// `reference`); 1 when both are empty, 0 when only one is. The one implementation behind
/// profiling's F1 over token ids and evaluation's SQuAD-style F1 over normalised words.
pub fn multiset_f1<T: Eq + std::hash::Hash>(candidate: &[T], reference: &[T]) -> f64 {
    if candidate.is_empty() && reference.is_empty() {
        return 1.0;
    }
    let mut counts: HashMap<&T, usize> = HashMap::new();
    for t in reference {
        *counts.entry(t).or_default() += 1;
    }
    let mut overlap = 0usize;
    for t in candidate {
        if let Some(c) = counts.get_mut(t).filter(|c| **c > 0) {
            *c -= 1;
            overlap += 1;
        }
    }
    if overlap == 0 {
        return 0.0;
    }
    let p = overlap as f64 / candidate.len() as f64;
    let r = overlap as f64 / reference.len() as f64;
    2.0 * p * r / (p + r)
}

#[cfg(test)]
mod tests {
    use super::token_f1;

    #[test]
    fn f1_counts_multisets() {
        assert_eq!(token_f1(&[], &[]), 1.0);
        assert_eq!(token_f1(&[1, 2], &[3]), 0.0);
        assert!((token_f1(&[1, 2, 2], &[2, 1]) - 0.8).abs() < 1e-12);
    }
}
