//! Byte-level BPE (GPT-2 style): each pre-tokenized word is mapped to byte tokens and
//! adjacent pairs are merged by rank, lowest rank first.
//!
//! The merge loop follows llama.cpp's `llm_tokenizer_bpe_session`: a priority queue of
//! adjacent pairs ordered by (rank, position of the left symbol), symbols kept in a linked
//! list, and queue entries that went stale after a neighbouring merge skipped on pop. This is
//! the same result as repeatedly merging the leftmost lowest-rank pair, in O(n log n).
//!
//! NOTE 1: Merges are stored by token id. A merge whose parts or result are not in the
//! vocabulary can never produce a token, so it is dropped at load time (well-formed GGUF
//! files, SmolLM2's included, contain none).
//! NOTE 2: Results are cached per word for the duration of one `encode` call; prose repeats
//! words so often that this makes encoding a book several times faster.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::byte_level::{byte_to_char, encode_bytes};
use crate::error::TokenizerError;
use crate::pretokenize::PreTokenizer;
use crate::vocab::Vocab;

/// Marks a byte with no token of its own; such symbols never merge and are dropped.
const NO_TOKEN: u32 = u32::MAX;

/// What a pair of adjacent tokens merges into.
#[derive(Clone, Copy)]
struct Merge {
    rank: u32,
    result: u32,
}

#[derive(Clone)]
pub(crate) struct BpeModel {
    merges: HashMap<(u32, u32), Merge>,
    byte_tokens: [u32; 256],
    pre: PreTokenizer,
    /// Llama 3 emits a whole word directly when it is a token, skipping the merges.
    ignore_merges: bool,
}

/// A symbol in the merge list of one word.
#[derive(Clone, Copy)]
struct Symbol {
    token: u32,
    prev: Option<usize>,
    next: Option<usize>,
    alive: bool,
}

impl BpeModel {
    /// Builds the model from merge strings (`"Ġ t"`) in rank order.
    pub fn new(
        vocab: &Vocab,
        merges: &[&str],
        pre: PreTokenizer,
    ) -> Result<BpeModel, TokenizerError> {
        let mut byte_tokens = [NO_TOKEN; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            *slot = vocab
                .id(byte_to_char(b as u8).encode_utf8(&mut [0; 4]))
                .unwrap_or(NO_TOKEN);
        }
        let mut table = HashMap::with_capacity(merges.len());
        for (rank, merge) in merges.iter().enumerate() {
            // llama.cpp splits at the first space after the first character, so a merge
            // whose left part starts with a space still parses.
            let split = merge
                .char_indices()
                .skip(1)
                .find(|&(_, c)| c == ' ')
                .map(|(i, _)| i);
            let Some(split) = split else {
                return Err(TokenizerError::InvalidMetadata {
                    key: "tokenizer.ggml.merges",
                    reason: format!("merge {rank} ({merge:?}) has no space separator"),
                });
            };
            let (left, right) = (&merge[..split], &merge[split + 1..]);
            let joined = format!("{left}{right}");
            if let (Some(l), Some(r), Some(result)) =
                (vocab.id(left), vocab.id(right), vocab.id(&joined))
            {
                // The first (lowest-rank) entry wins if a pair is listed twice.
                table.entry((l, r)).or_insert(Merge {
                    rank: rank as u32,
                    result,
                });
            }
        }
        let ignore_merges = pre.kind() == crate::pretokenize::PreTokenizerKind::Llama3;
        Ok(BpeModel {
            merges: table,
            byte_tokens,
            pre,
            ignore_merges,
        })
    }

    pub fn pre_tokenizer(&self) -> &PreTokenizer {
        &self.pre
    }

    /// Encodes plain text (no special tokens) and appends the ids to `out`.
    pub fn encode<'t>(
        &self,
        vocab: &Vocab,
        text: &'t str,
        cache: &mut WordCache<'t>,
        out: &mut Vec<u32>,
    ) {
        self.pre.split(text, &mut |word| {
            if let Some(&(start, len)) = cache.index.get(word) {
                out.extend_from_slice(&cache.ids[start..start + len]);
                return;
            }
            let start = cache.ids.len();
            self.encode_word(vocab, word, &mut cache.ids);
            let len = cache.ids.len() - start;
            cache.index.insert(word, (start, len));
            out.extend_from_slice(&cache.ids[start..start + len]);
        });
    }

    /// BPE-encodes one word and appends its ids to `out`.
    fn encode_word(&self, vocab: &Vocab, word: &str, out: &mut Vec<u32>) {
        if self.ignore_merges {
            if let Some(id) = vocab.id(&encode_bytes(word.as_bytes())) {
                out.push(id);
                return;
            }
        }
        let n = word.len();
        let mut symbols: Vec<Symbol> = word
            .bytes()
            .enumerate()
            .map(|(i, b)| Symbol {
                token: self.byte_tokens[b as usize],
                prev: i.checked_sub(1),
                next: (i + 1 < n).then_some(i + 1),
                alive: true,
            })
            .collect();

        // Entries are (rank, left index, right index); `Reverse` makes the heap a min-heap,
        // so equal ranks pop leftmost first.
        let mut queue = BinaryHeap::new();
        for left in 1..n {
            self.push_pair(&symbols, left - 1, left, &mut queue);
        }
        while let Some(Reverse((rank, left, right))) = queue.pop() {
            let (l, r) = (symbols[left], symbols[right]);
            if !l.alive || !r.alive || l.next != Some(right) {
                continue;
            }
            let Some(merge) = self
                .merges
                .get(&(l.token, r.token))
                .filter(|m| m.rank == rank)
            else {
                continue;
            };
            symbols[left].token = merge.result;
            symbols[left].next = r.next;
            symbols[right].alive = false;
            if let Some(next) = r.next {
                symbols[next].prev = Some(left);
                self.push_pair(&symbols, left, next, &mut queue);
            }
            if let Some(prev) = l.prev {
                self.push_pair(&symbols, prev, left, &mut queue);
            }
        }

        let mut cursor = (n > 0).then_some(0);
        while let Some(i) = cursor {
            // Only a byte missing from the vocabulary is NO_TOKEN; llama.cpp drops it too.
            if symbols[i].token != NO_TOKEN {
                out.push(symbols[i].token);
            }
            cursor = symbols[i].next;
        }
    }

    fn push_pair(
        &self,
        symbols: &[Symbol],
        left: usize,
        right: usize,
        queue: &mut BinaryHeap<Reverse<(u32, usize, usize)>>,
    ) {
        if let Some(m) = self
            .merges
            .get(&(symbols[left].token, symbols[right].token))
        {
            queue.push(Reverse((m.rank, left, right)));
        }
    }
}

/// Per-call memo of word encodings: word text to a range of `ids`.
#[derive(Default)]
pub(crate) struct WordCache<'t> {
    index: HashMap<&'t str, (usize, usize)>,
    ids: Vec<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pretokenize::PreTokenizerKind;
    use crate::vocab::TokenType;

    /// A vocabulary of the given byte-level texts, all normal tokens.
    fn vocab(texts: &[&str]) -> Vocab {
        let texts: Vec<String> = texts.iter().map(|t| t.to_string()).collect();
        let types = vec![TokenType::Normal; texts.len()];
        Vocab::new(texts, types, Vec::new()).unwrap()
    }

    fn encode(vocab: &Vocab, merges: &[&str], text: &str) -> Vec<u32> {
        let model =
            BpeModel::new(vocab, merges, PreTokenizer::new(PreTokenizerKind::Gpt2)).unwrap();
        let mut out = Vec::new();
        model.encode(vocab, text, &mut WordCache::default(), &mut out);
        out
    }

    #[test]
    fn lower_rank_merges_first() {
        let v = vocab(&["a", "b", "c", "ab", "bc", "abc"]);
        // "b c" outranks "a b", so "abc" becomes a + bc, and only then a + bc merges.
        assert_eq!(encode(&v, &["b c", "a b"], "abc"), vec![0, 4]);
        assert_eq!(encode(&v, &["a b", "b c"], "abc"), vec![3, 2]);
        assert_eq!(encode(&v, &["b c", "a b", "a bc"], "abc"), vec![5]);
        assert_eq!(encode(&v, &[], "abc"), vec![0, 1, 2]);
    }

    #[test]
    fn equal_pairs_merge_leftmost_first() {
        let v = vocab(&["a", "aa", "aaa"]);
        assert_eq!(encode(&v, &["a a"], "aaa"), vec![1, 0]);
        assert_eq!(encode(&v, &["a a", "aa a"], "aaa"), vec![2]);
        assert_eq!(encode(&v, &["a a"], "aaaa"), vec![1, 1]);
    }

    #[test]
    fn words_are_merged_separately_and_bytes_are_mapped() {
        // "Ġ" is the byte-level form of a space; "Ġa" only forms inside the word " a".
        let v = vocab(&["a", "Ġ", "Ġa", "aĠ", "Ċ"]);
        assert_eq!(encode(&v, &["Ġ a", "a Ġ"], "a a\n"), vec![0, 2, 4]);
    }

    #[test]
    fn merges_outside_the_vocabulary_are_ignored_and_bad_merges_rejected() {
        let v = vocab(&["a", "b"]);
        assert_eq!(encode(&v, &["a b"], "ab"), vec![0, 1]);
        assert!(BpeModel::new(&v, &["ab"], PreTokenizer::new(PreTokenizerKind::Gpt2)).is_err());
    }
}
