//! Scores: exact match of expected strings, token F1 and ROUGE-L between two answers, and
//! the teacher-forced divergence of a compressed cache from the full cache.
//!
//! Normalisation (for every text metric): lower case; every character that is not a
//! letter or a digit becomes a space; words are the whitespace-separated pieces. So
//! "The pass key is 12345." and "the PASS key is: 12345" are the same words.

/// The words of `text` after normalisation.
pub fn words(text: &str) -> Vec<String> {
    text.chars()
        .map(|c| {
            if c.is_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                ' '
            }
        })
        .collect::<String>()
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// Whether `expected`'s words occur in `answer`'s words as a contiguous run. Matching
/// whole words means "1234567" does not match inside "12345678".
pub fn contains_words(answer: &str, expected: &str) -> bool {
    let (a, e) = (words(answer), words(expected));
    !e.is_empty() && a.windows(e.len()).any(|w| w == e.as_slice())
}

/// Exact-match score of one answer: the fraction of `expected` strings it contains
/// (RULER's `string_match_all`). 1.0 or 0.0 for single-answer tasks.
pub fn match_score(answer: &str, expected: &[String]) -> f64 {
    if expected.is_empty() {
        return 1.0;
    }
    expected
        .iter()
        .filter(|e| contains_words(answer, e))
        .count() as f64
        / expected.len() as f64
}

/// LongBench's code similarity: the answer's first line that is code (not blank, not a
/// comment or a code fence) against `expected`, by normalised InDel similarity
/// `2·LCS / (|a| + |b|)` over characters (rapidfuzz's `fuzz.ratio` / 100), both trimmed.
pub fn code_similarity(answer: &str, expected: &str) -> f64 {
    let line = answer
        .lines()
        .map(str::trim)
        .find(|l| {
            !l.is_empty() && !l.starts_with("//") && !l.starts_with("```") && !l.starts_with('#')
        })
        .unwrap_or("");
    let (a, b): (Vec<char>, Vec<char>) =
        (line.chars().collect(), expected.trim().chars().collect());
    if a.is_empty() && b.is_empty() {
        return 1.0;
    }
    2.0 * lcs_len(&a, &b) as f64 / (a.len() + b.len()) as f64
}

/// LongBench's count score: the fraction of the numbers in `answer` equal to `expected`
/// (0 when it names none), so "7" scores 1 and "3 or 7" scores 0.5.
pub fn count_score(answer: &str, expected: &str) -> f64 {
    let numbers: Vec<&str> = answer
        .split(|c: char| !c.is_ascii_digit())
        .filter(|n| !n.is_empty())
        .collect();
    match numbers.len() {
        0 => 0.0,
        n => numbers.iter().filter(|&&x| x == expected).count() as f64 / n as f64,
    }
}

fn lcs_len<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    let mut row = vec![0usize; b.len() + 1];
    for x in a {
        let mut diag = 0;
        for (j, y) in b.iter().enumerate() {
            let up = row[j + 1];
            row[j + 1] = if x == y { diag + 1 } else { up.max(row[j]) };
            diag = up;
        }
    }
    row[b.len()]
}

/// SQuAD-style token F1 over normalised words (multiset overlap). Two empty answers agree
/// (1.0); one empty answer scores 0.0.
pub fn token_f1(candidate: &str, reference: &str) -> f64 {
    pk_engine::quality::multiset_f1(&words(candidate), &words(reference))
}

/// ROUGE-L F1: longest common subsequence of normalised words, F-measure with beta = 1.
pub fn rouge_l(candidate: &str, reference: &str) -> f64 {
    let (c, r) = (words(candidate), words(reference));
    if c.is_empty() || r.is_empty() {
        return if c.is_empty() && r.is_empty() {
            1.0
        } else {
            0.0
        };
    }
    let mut prev = vec![0usize; r.len() + 1];
    for cw in &c {
        let mut cur = vec![0usize; r.len() + 1];
        for (j, rw) in r.iter().enumerate() {
            cur[j + 1] = if cw == rw {
                prev[j] + 1
            } else {
                cur[j].max(prev[j + 1])
            };
        }
        prev = cur;
    }
    f_measure(prev[r.len()], c.len(), r.len())
}

fn f_measure(common: usize, candidate_len: usize, reference_len: usize) -> f64 {
    if common == 0 {
        return 0.0;
    }
    let p = common as f64 / candidate_len as f64;
    let r = common as f64 / reference_len as f64;
    2.0 * p * r / (p + r)
}

/// Natural-log probabilities of one logits row (log-softmax in f64).
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|&x| x as f64 - lse).collect()
}

/// KL(p ‖ q) in nats from two logits rows.
pub fn kl_divergence(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let (lp, lq) = (log_softmax(p_logits), log_softmax(q_logits));
    lp.iter()
        .zip(&lq)
        .map(|(&a, &b)| a.exp() * (a - b))
        .sum::<f64>()
        .max(0.0)
}

pub fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv {
                (i, v)
            } else {
                (bi, bv)
            }
        })
        .0
}

/// Divergence of a policy's teacher-forced logits from the full cache's on one text.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Divergence {
    /// Mean per-token KL(p_full ‖ p_policy), nats.
    pub kl_mean: f64,
    /// Fraction of positions where both caches' most likely token is the same.
    pub top1_agreement: f64,
    pub ppl_full: f64,
    pub ppl_policy: f64,
}

/// Compares rows `from..` of two teacher-forced runs over `continuation` (row i predicts
/// `continuation[i]`). The evaluation skips row 0: it comes from the exact prefill, before
/// any pruning, so it is the same for every policy and would only dilute the mean.
pub fn divergence(
    full: &[Vec<f32>],
    policy: &[Vec<f32>],
    continuation: &[u32],
    from: usize,
) -> Divergence {
    assert_eq!(
        full.len(),
        policy.len(),
        "teacher-forced runs of different lengths"
    );
    assert_eq!(full.len(), continuation.len());
    assert!(from < full.len(), "nothing to compare");
    let n = (full.len() - from) as f64;
    let (mut kl, mut agree, mut nll_full, mut nll_policy) = (0.0, 0.0, 0.0, 0.0);
    for i in from..full.len() {
        kl += kl_divergence(&full[i], &policy[i]);
        agree += f64::from(u8::from(argmax(&full[i]) == argmax(&policy[i])));
        let t = continuation[i] as usize;
        nll_full -= log_softmax(&full[i])[t];
        nll_policy -= log_softmax(&policy[i])[t];
    }
    Divergence {
        kl_mean: kl / n,
        top1_agreement: agree / n,
        ppl_full: (nll_full / n).exp(),
        ppl_policy: (nll_policy / n).exp(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn normalisation_drops_case_and_punctuation() {
        assert_eq!(
            words("The PASS key is: 12345."),
            ["the", "pass", "key", "is", "12345"]
        );
        assert!(contains_words("the pass key is 12345.", "12345"));
        assert!(!contains_words("123456", "12345"));
        assert!(contains_words("VAR abcde, VAR fghij", "FGHIJ"));
    }

    /// Hand-computed: "let x = 1;" against "let y = 1;" shares 9 of 10 characters each
    /// (2·9/20); comments and fences before the code line are skipped.
    #[test]
    fn code_similarity_and_count_score_on_hand_made_strings() {
        assert!(close(code_similarity("let x = 1;", "let y = 1;"), 0.9));
        assert!(close(
            code_similarity("// note\n```\nlet y = 1;\nmore", "let y = 1;"),
            1.0
        ));
        assert!(close(code_similarity("", "abc"), 0.0));
        assert!(close(count_score("7", "7"), 1.0));
        assert!(close(count_score("There are 3 or 7.", "7"), 0.5));
        assert!(close(count_score("seven", "7"), 0.0));
        assert!(close(count_score("17", "7"), 0.0));
    }

    #[test]
    fn match_score_is_the_fraction_found() {
        let exp: Vec<String> = ["111", "222", "333", "444"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(match_score("111 and 333", &exp), 0.5);
        assert_eq!(match_score("111, 222, 333, 444", &exp), 1.0);
        assert_eq!(match_score("nothing", &exp), 0.0);
    }

    #[test]
    fn token_f1_on_hand_made_strings() {
        // candidate: the cat sat (3), reference: the cat sat on the mat (6), common 3:
        // P = 1, R = 1/2, F1 = 2/3.
        assert!(close(
            token_f1("The cat sat.", "the cat sat on the mat"),
            2.0 / 3.0
        ));
        // Multiset: "the the" vs "the": common 1, P = 1/2, R = 1, F1 = 2/3.
        assert!(close(token_f1("the the", "the"), 2.0 / 3.0));
        assert_eq!(token_f1("a b", "c d"), 0.0);
        assert_eq!(token_f1("", ""), 1.0);
        assert_eq!(token_f1("x", ""), 0.0);
        assert_eq!(token_f1("Same words", "same, WORDS!"), 1.0);
    }

    #[test]
    fn rouge_l_on_hand_made_strings() {
        // LCS("a b c d e", "a c e f") = "a c e" = 3; P = 3/5, R = 3/4, F = 2/3 exactly.
        assert!(close(
            rouge_l("a b c d e", "a c e f"),
            2.0 * 0.6 * 0.75 / 1.35
        ));
        // Order matters for ROUGE-L but not for F1: "b a" vs "a b": LCS 1, F = 1/2.
        assert!(close(rouge_l("b a", "a b"), 0.5));
        assert!(close(token_f1("b a", "a b"), 1.0));
        assert_eq!(rouge_l("", ""), 1.0);
        assert_eq!(rouge_l("q", "r"), 0.0);
    }

    #[test]
    fn kl_and_agreement_on_hand_made_rows() {
        assert!(kl_divergence(&[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]).abs() < 1e-12);
        // p = (1/2, 1/2), q = (e/(1+e), 1/(1+e)): KL = ln(1+e) - 1/2 - ln 2... computed directly.
        let q1 = 1f64.exp() / (1.0 + 1f64.exp());
        let want = 0.5 * (0.5f64 / q1).ln() + 0.5 * (0.5f64 / (1.0 - q1)).ln();
        assert!((kl_divergence(&[0.0, 0.0], &[1.0, 0.0]) - want).abs() < 1e-9);
        let full = vec![vec![0.0, 5.0], vec![5.0, 0.0], vec![0.0, 5.0]];
        let pol = vec![vec![0.0, 5.0], vec![0.0, 5.0], vec![0.0, 5.0]];
        let d = divergence(&full, &pol, &[1, 0, 1], 1);
        assert_eq!(d.top1_agreement, 0.5);
        assert!(d.kl_mean > 0.0 && d.ppl_policy > d.ppl_full);
        let same = divergence(&full, &full, &[1, 0, 1], 0);
        assert_eq!((same.kl_mean, same.top1_agreement), (0.0, 1.0));
    }
}
