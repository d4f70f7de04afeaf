//! Splitting text at special tokens (`<|im_start|>`, ...) before BPE.
//!
//! llama.cpp (`tokenizer_st_partition`) walks the special tokens from longest to shortest
//! text and, for each, cuts every occurrence out of the fragments that are still raw text,
//! searching each fragment left to right. We reproduce exactly that result, but find all
//! candidate occurrences in one Aho-Corasick pass and then accept them greedily in that same
//! order (token length descending, then id, then position), rejecting any candidate that
//! overlaps an accepted one. A vocabulary with thousands of added tokens (Gemma) therefore
//! costs one pass over the text rather than one pass per token.
//!
//! NOTE 1: Control and unknown tokens are only matched when the caller asks for special-token
//! parsing; user-defined tokens are always matched, as in llama.cpp.
//! NOTE 2: llama.cpp breaks ties between equally long tokens by an unstable sort; we use the
//! id. The two can only differ when two such tokens overlap in the text.

use std::collections::BTreeMap;
use std::ops::Range;

use aho_corasick::AhoCorasick;

use crate::vocab::{TokenType, Vocab};

/// A piece of the input: raw text to run through the model, or a literal special token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fragment {
    Text(Range<usize>),
    Token(u32),
}

#[derive(Clone)]
pub(crate) struct SpecialMatcher {
    automaton: Option<AhoCorasick>,
    /// Token id of each automaton pattern.
    ids: Vec<u32>,
    /// Whether each pattern is matched without `parse_special` (user-defined tokens).
    always: Vec<bool>,
}

impl SpecialMatcher {
    pub fn new(vocab: &Vocab) -> SpecialMatcher {
        let mut ids = Vec::new();
        let mut always = Vec::new();
        for (id, (text, ty)) in vocab.texts.iter().zip(&vocab.types).enumerate() {
            let special = matches!(
                ty,
                TokenType::Control | TokenType::Unknown | TokenType::UserDefined
            );
            if special && !text.is_empty() {
                ids.push(id as u32);
                always.push(*ty == TokenType::UserDefined);
            }
        }
        let patterns: Vec<&str> = ids
            .iter()
            .map(|&id| vocab.texts[id as usize].as_str())
            .collect();
        // Building only fails for automata beyond aho-corasick's size limits; without an
        // automaton the text is simply not split, which is the safe degradation.
        let automaton = if patterns.is_empty() {
            None
        } else {
            AhoCorasick::new(&patterns).ok()
        };
        SpecialMatcher {
            automaton,
            ids,
            always,
        }
    }

    /// Splits `text` into raw-text fragments and special tokens, in order.
    pub fn split(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        let mut candidates: Vec<(usize, u32, usize, usize)> = Vec::new();
        if let Some(automaton) = &self.automaton {
            for m in automaton.find_overlapping_iter(text) {
                let p = m.pattern().as_usize();
                if parse_special || self.always[p] {
                    candidates.push((usize::MAX - m.len(), self.ids[p], m.start(), m.end()));
                }
            }
        }
        candidates.sort_unstable();

        // Accepted matches keyed by start; they never overlap one another.
        let mut accepted: BTreeMap<usize, (usize, u32)> = BTreeMap::new();
        for (_, id, start, end) in candidates {
            let overlaps_before = accepted
                .range(..end)
                .next_back()
                .is_some_and(|(_, &(e, _))| e > start);
            if !overlaps_before {
                accepted.insert(start, (end, id));
            }
        }

        let mut fragments = Vec::with_capacity(2 * accepted.len() + 1);
        let mut pos = 0;
        for (start, (end, id)) in accepted {
            if start > pos {
                fragments.push(Fragment::Text(pos..start));
            }
            fragments.push(Fragment::Token(id));
            pos = end;
        }
        if pos < text.len() {
            fragments.push(Fragment::Text(pos..text.len()));
        }
        fragments
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab(tokens: &[(&str, TokenType)]) -> Vocab {
        let texts = tokens.iter().map(|(t, _)| t.to_string()).collect();
        let types = tokens.iter().map(|(_, ty)| *ty).collect();
        Vocab::new(texts, types, Vec::new()).unwrap()
    }

    #[test]
    fn longest_token_wins_and_text_between_is_kept() {
        use TokenType::*;
        let v = vocab(&[
            ("<a>", Control),
            ("<a><b>", Control),
            ("<b>", Control),
            ("x", Normal),
        ]);
        let m = SpecialMatcher::new(&v);
        let text = "x<a><b>y<b><a>";
        assert_eq!(
            m.split(text, true),
            vec![
                Fragment::Text(0..1),
                Fragment::Token(1),
                Fragment::Text(7..8),
                Fragment::Token(2),
                Fragment::Token(0)
            ]
        );
        assert_eq!(m.split(text, false), vec![Fragment::Text(0..text.len())]);
    }

    #[test]
    fn user_defined_tokens_match_without_parse_special() {
        use TokenType::*;
        let v = vocab(&[("<c>", Control), ("<u>", UserDefined)]);
        let m = SpecialMatcher::new(&v);
        assert_eq!(
            m.split("<c><u>", false),
            vec![Fragment::Text(0..3), Fragment::Token(1)]
        );
    }

    #[test]
    fn repeated_token_occurrences_do_not_overlap() {
        use TokenType::*;
        let v = vocab(&[("aa", Control)]);
        let m = SpecialMatcher::new(&v);
        // Like repeated `str::find`: matches at 0 and 2, the trailing `a` stays text.
        assert_eq!(
            m.split("aaaaa", true),
            vec![Fragment::Token(0), Fragment::Token(0), Fragment::Text(4..5)]
        );
    }
}
