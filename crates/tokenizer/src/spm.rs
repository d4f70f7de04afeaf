//! SentencePiece BPE (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral, Gemma).
//!
//! Spaces become `▁` (U+2581), the text is split into UTF-8 characters, and adjacent
//! symbols are merged whenever their concatenation is a token, highest token score first
//! (leftmost on ties). Symbols left that are not tokens fall back to `<0xXX>` byte tokens.
//! This follows llama.cpp's `llm_tokenizer_spm_session`, including its queue-staleness rule.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::vocab::Vocab;

/// The character SentencePiece uses for a space.
pub(crate) const SPACE: char = '\u{2581}';

#[derive(Clone)]
pub(crate) struct SpmModel {
    byte_tokens: [Option<u32>; 256],
    unk: Option<u32>,
}

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge; the heap pops the highest score, then the leftmost position.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl SpmModel {
    pub fn new(vocab: &Vocab, unk: Option<u32>) -> SpmModel {
        let mut byte_tokens = [None; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            *slot = vocab.id(&format!("<0x{b:02X}>"));
        }
        SpmModel { byte_tokens, unk }
    }

    /// Encodes one raw-text fragment, prefixing a space when `space_prefix` is set.
    pub fn encode(&self, vocab: &Vocab, text: &str, space_prefix: bool, out: &mut Vec<u32>) {
        let mut escaped = String::with_capacity(text.len() + 3);
        if space_prefix {
            escaped.push(SPACE);
        }
        for c in text.chars() {
            escaped.push(if c == ' ' { SPACE } else { c });
        }
        self.encode_escaped(vocab, &escaped, out);
    }

    fn encode_escaped(&self, vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
        let starts: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
        let n = starts.len();
        let mut symbols: Vec<Symbol> = (0..n)
            .map(|i| Symbol {
                start: starts[i],
                len: starts.get(i + 1).copied().unwrap_or(text.len()) - starts[i],
                prev: i.checked_sub(1),
                next: (i + 1 < n).then_some(i + 1),
            })
            .collect();

        let mut queue = BinaryHeap::new();
        for i in 1..n {
            try_add_bigram(vocab, text, &symbols, i - 1, i, &mut queue);
        }
        while let Some(bigram) = queue.pop() {
            let (l, r) = (symbols[bigram.left], symbols[bigram.right]);
            // A symbol that was merged away has length 0; one that grew no longer adds up.
            if l.len == 0 || r.len == 0 || l.len + r.len != bigram.len {
                continue;
            }
            symbols[bigram.left].len += r.len;
            symbols[bigram.right].len = 0;
            symbols[bigram.left].next = r.next;
            if let Some(next) = r.next {
                symbols[next].prev = Some(bigram.left);
            }
            if let Some(prev) = l.prev {
                try_add_bigram(vocab, text, &symbols, prev, bigram.left, &mut queue);
            }
            if let Some(next) = r.next {
                try_add_bigram(vocab, text, &symbols, bigram.left, next, &mut queue);
            }
        }

        let mut cursor = (n > 0).then_some(0);
        while let Some(i) = cursor {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match vocab.id(piece) {
                Some(id) => out.push(id),
                None => self.byte_fallback(piece, out),
            }
            cursor = s.next;
        }
    }

    /// Emits `<0xXX>` tokens for a piece that is not in the vocabulary (the unknown token
    /// for any byte that has no such token).
    fn byte_fallback(&self, piece: &str, out: &mut Vec<u32>) {
        for b in piece.bytes() {
            if let Some(id) = self.byte_tokens[b as usize].or(self.unk) {
                out.push(id);
            }
        }
    }
}

fn try_add_bigram(
    vocab: &Vocab,
    text: &str,
    symbols: &[Symbol],
    left: usize,
    right: usize,
    queue: &mut BinaryHeap<Bigram>,
) {
    let (l, r) = (symbols[left], symbols[right]);
    let len = l.len + r.len;
    if let Some(id) = vocab.id(&text[l.start..l.start + len]) {
        queue.push(Bigram {
            score: vocab.score(id),
            left,
            right,
            len,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vocab::TokenType;

    fn vocab(tokens: &[(&str, f32)]) -> Vocab {
        let texts: Vec<String> = tokens.iter().map(|(t, _)| t.to_string()).collect();
        let types = texts
            .iter()
            .map(|t| {
                if t.starts_with("<0x") {
                    TokenType::Byte
                } else {
                    TokenType::Normal
                }
            })
            .collect();
        Vocab::new(texts, types, tokens.iter().map(|(_, s)| *s).collect()).unwrap()
    }

    #[test]
    fn merges_by_score_and_falls_back_to_bytes() {
        let v = vocab(&[
            ("<unk>", 0.0),
            ("<0x21>", 0.0),
            ("▁", -1.0),
            ("h", -1.0),
            ("i", -1.0),
            ("hi", -2.0),
            ("▁h", -0.5),
            ("▁hi", -3.0),
        ]);
        let m = SpmModel::new(&v, Some(0));
        let mut out = Vec::new();
        // "▁h" (score -0.5) beats "hi" (-2.0); then "▁h"+"i" = "▁hi" merges; "!" falls back.
        m.encode(&v, "hi!", true, &mut out);
        assert_eq!(out, vec![7, 1]);
        out.clear();
        m.encode(&v, "hi", false, &mut out);
        assert_eq!(out, vec![5]);
    }
}
