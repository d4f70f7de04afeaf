//! Haystack filler: natural text (Jules Verne, *Around the World in 80 Days*, the body of
//! the Project Gutenberg file without its header and licence) and RULER's repeated noise
//! sentences. Both are cut into sentences so that needles land between sentences.

use std::sync::OnceLock;

use crate::rng::SplitMix64;

/// The book, as shipped in tests/fixtures (also ../shared/data).
pub const VERNE_TEXT: &str =
    include_str!("../../../tests/fixtures/around-the-world-in-80-days.txt");

/// RULER's noise haystack: the same five sentences, over and over.
pub const NOISE_SENTENCES: [&str; 5] = [
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
];

/// Which filler a task's haystack is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Filler {
    Noise,
    Verne,
}

/// The body of the book with whitespace collapsed (the file has CRLF and hard-wrapped lines).
pub fn verne_body() -> &'static str {
    static BODY: OnceLock<String> = OnceLock::new();
    BODY.get_or_init(|| {
        let start = VERNE_TEXT
            .find("*** START OF")
            .and_then(|i| VERNE_TEXT[i..].find('\n').map(|j| i + j + 1))
            .unwrap_or(0);
        let end = VERNE_TEXT.find("*** END OF").unwrap_or(VERNE_TEXT.len());
        VERNE_TEXT[start..end]
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    })
}

/// The book's sentences, split after `.`, `!` or `?` followed by a space.
pub fn verne_sentences() -> &'static [String] {
    static SENTENCES: OnceLock<Vec<String>> = OnceLock::new();
    SENTENCES.get_or_init(|| {
        let body = verne_body();
        let mut out = Vec::new();
        let mut start = 0;
        let bytes = body.as_bytes();
        for i in 0..bytes.len().saturating_sub(1) {
            if matches!(bytes[i], b'.' | b'!' | b'?') && bytes[i + 1] == b' ' {
                let s = body[start..=i].trim();
                if !s.is_empty() {
                    out.push(s.to_string());
                }
                start = i + 2;
            }
        }
        out
    })
}

/// Consecutive filler sentences whose token counts add up to about `target_tokens` (the
/// sum of per-sentence counts; joining with spaces changes it by a token here and there).
/// Natural text starts at a random sentence and wraps around the book.
pub fn sentences(
    filler: Filler,
    target_tokens: usize,
    rng: &mut SplitMix64,
    count_tokens: &dyn Fn(&str) -> usize,
) -> Vec<String> {
    let mut out = Vec::new();
    let mut total = 0;
    match filler {
        Filler::Noise => {
            let costs: Vec<usize> = NOISE_SENTENCES
                .iter()
                .map(|s| count_tokens(&format!(" {s}")))
                .collect();
            let mut i = 0;
            while total < target_tokens {
                out.push(NOISE_SENTENCES[i % 5].to_string());
                total += costs[i % 5];
                i += 1;
            }
        }
        Filler::Verne => {
            let all = verne_sentences();
            let mut i = rng.below(all.len());
            while total < target_tokens {
                let s = &all[i % all.len()];
                total += count_tokens(&format!(" {s}"));
                out.push(s.clone());
                i += 1;
            }
        }
    }
    out
}

/// `n_tokens` consecutive tokens of the book, starting at a random sentence (wrapping
/// around), for teacher-forced divergence. `encode` is the model's tokenizer.
pub fn natural_text_tokens(
    n_tokens: usize,
    rng: &mut SplitMix64,
    encode: &dyn Fn(&str) -> Vec<u32>,
) -> Vec<u32> {
    let all = verne_sentences();
    let mut i = rng.below(all.len());
    let mut text = String::new();
    // About 4 characters per token in English; grow until the text is long enough.
    let mut ids = Vec::new();
    while ids.len() < n_tokens {
        while text.len() < (n_tokens + 64) * 5 + ids.len() {
            if !text.is_empty() {
                text.push(' ');
            }
            text.push_str(&all[i % all.len()]);
            i += 1;
        }
        ids = encode(&text);
        text.push(' ');
    }
    ids.truncate(n_tokens);
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_book_body_has_no_licence() {
        let body = verne_body();
        assert!(!body.contains("Gutenberg-tm"));
        assert!(body.contains("Phileas Fogg"));
        assert!(verne_sentences().len() > 2000);
    }

    #[test]
    fn filler_reaches_the_target() {
        let count = |s: &str| s.len() / 4;
        let mut rng = SplitMix64::new(3);
        for filler in [Filler::Noise, Filler::Verne] {
            let s = sentences(filler, 500, &mut rng, &count);
            let total: usize = s.iter().map(|x| count(&format!(" {x}"))).sum();
            assert!((500..600).contains(&total), "{filler:?}: {total}");
        }
    }
}
