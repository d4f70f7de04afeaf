//! Pre-tokenizers: how text is cut into words before BPE, chosen by `tokenizer.ggml.pre`.
//!
//! The regexes are the ones llama.cpp uses (`llama-vocab.cpp`, `llama_vocab::impl::load`).
//! Those patterns end in `\s+(?!\S)`, a lookahead that would push `fancy-regex` onto its
//! slow backtracking engine. Instead we run the pattern with `\s+(?!\S)|\s+` replaced by
//! plain `\s+` (so the whole regex goes to the fast `regex-automata` engine) and then apply
//! the lookahead by hand, exactly as llama.cpp's own hand-written GPT-2 splitter does: a
//! whitespace run of two or more characters that is not at the end of the segment gives
//! up its last character, which then starts the next word (usually as the ` ` of ` word`).
//!
//! NOTE 1: Each regex stage runs on the segments produced by the previous stage, never
//! across them, so "end of the segment" above means the end of the current segment.
//! NOTE 2: Every character is matched by some alternative of each main pattern, so the
//! words tile the segment; text between matches is still emitted if that ever changes.

use fancy_regex::Regex;

/// GPT-2's pattern with the trailing `\s+(?!\S)|\s+` folded into `\s+` (see the header).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

/// Llama 3's pattern, with the same folding. Its `\s*[\r\n]+` alternative also yields
/// whitespace-only words; those end in a line break and must not be shortened.
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+";

/// Qwen2's pattern: Llama 3's with every digit on its own (`\p{N}` instead of
/// `\p{N}{1,3}`), folded the same way.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+";

/// Which family of splitting rules a vocabulary uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizerKind {
    /// Plain GPT-2 (`gpt-2`, `phi-2`, `olmo`, `mpt`, ...).
    Gpt2,
    /// Every `\p{N}` character on its own, then GPT-2 (`smollm`, `starcoder`, `refact`, ...).
    DigitsThenGpt2,
    /// Llama 3 (`llama-bpe`, `llama3`): digits in groups of up to three.
    Llama3,
    /// Qwen2 (`qwen2`, `deepseek-r1-qwen`): Llama 3's rules with single digits.
    Qwen2,
}

/// The `tokenizer.ggml.pre` values llama.cpp (`llama_vocab::impl::load`) gives each of our
/// kinds, with no other setting than those the kind implies: Llama 3's names also set
/// `ignore_merges` and `add_bos`, as `Llama3` does here; no other name sets either.
///
/// NOTE 1: Left out on purpose, so that they are refused: `default` (and a missing key),
/// whose four-stage split we do not implement; `dbrx` and `smaug-bpe`, Llama 3's regex
/// without its `ignore_merges` and `add_bos`; `jina-v1-en`, `jina-v2-code` and
/// `roberta-bpe`, GPT-2's regex with a BERT separator appended; and every name with a
/// regex of its own (`tekken`, `deepseek-llm`, `deepseek-coder`, `gpt-4o`, `superbpe`, ...).
/// NOTE 2: llama.cpp's `clean_spaces` differs within these lists; it changes only its
/// whole-text `detokenize`, never how text is encoded or how one token renders.
const PRE_NAMES: &[(PreTokenizerKind, &[&str])] = &[
    (
        PreTokenizerKind::Gpt2,
        &[
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "exaone4",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
        ],
    ),
    (
        PreTokenizerKind::DigitsThenGpt2,
        &[
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
    ),
    (
        PreTokenizerKind::Llama3,
        &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ],
    ),
    (
        PreTokenizerKind::Qwen2,
        &[
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
        ],
    ),
];

impl PreTokenizerKind {
    /// Maps a `tokenizer.ggml.pre` value to its rules, following llama.cpp's grouping;
    /// `None` for a value whose splitting we do not implement exactly as llama.cpp does.
    pub fn from_pre(pre: &str) -> Option<PreTokenizerKind> {
        PRE_NAMES
            .iter()
            .find(|(_, names)| names.contains(&pre))
            .map(|&(kind, _)| kind)
    }
}

/// A compiled pre-tokenizer.
#[derive(Clone)]
pub(crate) struct PreTokenizer {
    kind: PreTokenizerKind,
    digits: Option<Regex>,
    main: Regex,
}

impl PreTokenizer {
    pub fn new(kind: PreTokenizerKind) -> PreTokenizer {
        let (digits, main) = match kind {
            PreTokenizerKind::Gpt2 => (None, GPT2),
            PreTokenizerKind::DigitsThenGpt2 => (Some(r"\p{N}"), GPT2),
            PreTokenizerKind::Llama3 => (None, LLAMA3),
            PreTokenizerKind::Qwen2 => (None, QWEN2),
        };
        // The patterns are constants checked by the unit tests, so compilation cannot fail
        // on user input.
        let compile = |p: &str| Regex::new(p).expect("built-in pre-tokenizer regex compiles");
        PreTokenizer {
            kind,
            digits: digits.map(compile),
            main: compile(main),
        }
    }

    pub fn kind(&self) -> PreTokenizerKind {
        self.kind
    }

    /// Calls `emit` with each word of `text`, in order; the words concatenate to `text`.
    pub fn split<'t>(&self, text: &'t str, emit: &mut dyn FnMut(&'t str)) {
        let Some(digits) = &self.digits else {
            self.split_main(text, emit);
            return;
        };
        let mut pos = 0;
        for m in digits.find_iter(text) {
            // A non-fancy regex runs on regex-automata, which cannot fail at match time.
            let Ok(m) = m else { break };
            if m.start() > pos {
                self.split_main(&text[pos..m.start()], emit);
            }
            emit(m.as_str());
            pos = m.end();
        }
        if pos < text.len() {
            self.split_main(&text[pos..], emit);
        }
    }

    fn split_main<'t>(&self, seg: &'t str, emit: &mut dyn FnMut(&'t str)) {
        let mut pos = 0;
        while pos < seg.len() {
            let Ok(Some(m)) = self.main.find_from_pos(seg, pos) else {
                emit(&seg[pos..]);
                return;
            };
            if m.start() > pos {
                emit(&seg[pos..m.start()]);
            }
            let end = self.apply_lookahead(seg, m.start(), m.end());
            emit(&seg[m.start()..end]);
            pos = end;
        }
    }

    /// Implements `\s+(?!\S)`: shortens a whitespace run by its last character unless the
    /// run ends the segment or is a single character.
    fn apply_lookahead(&self, seg: &str, start: usize, end: usize) -> usize {
        let word = &seg[start..end];
        if end == seg.len() || !word.chars().all(char::is_whitespace) {
            return end;
        }
        if matches!(
            self.kind,
            PreTokenizerKind::Llama3 | PreTokenizerKind::Qwen2
        ) && word.contains(['\r', '\n'])
        {
            return end;
        }
        match word.char_indices().next_back() {
            Some((last, _)) if last > 0 => start + last,
            _ => end,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(kind: PreTokenizerKind, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        PreTokenizer::new(kind).split(text, &mut |w| out.push(w.to_string()));
        assert_eq!(out.concat(), text, "words must tile the text");
        out
    }

    #[test]
    fn gpt2_words() {
        use PreTokenizerKind::Gpt2;
        assert_eq!(
            words(Gpt2, "Hello world's  end"),
            ["Hello", " world", "'s", " ", " end"]
        );
        assert_eq!(words(Gpt2, "a\n\nb"), ["a", "\n", "\n", "b"]);
        assert_eq!(words(Gpt2, "x   "), ["x", "   "]);
        assert_eq!(words(Gpt2, "in 1872, at"), ["in", " 1872", ",", " at"]);
        assert_eq!(words(Gpt2, "  !?x"), [" ", " !?", "x"]);
    }

    #[test]
    fn smollm_splits_every_digit() {
        use PreTokenizerKind::DigitsThenGpt2;
        assert_eq!(
            words(DigitsThenGpt2, "in 1872, at"),
            ["in", " ", "1", "8", "7", "2", ",", " at"]
        );
        // The whitespace run ends its segment (a digit follows), so it is not shortened.
        assert_eq!(words(DigitsThenGpt2, "a  1"), ["a", "  ", "1"]);
    }

    #[test]
    fn llama3_words() {
        use PreTokenizerKind::Llama3;
        assert_eq!(words(Llama3, "12345 don'T"), ["123", "45", " don", "'T"]);
        assert_eq!(words(Llama3, "a  \n\n  b"), ["a", "  \n\n", " ", " b"]);
    }

    #[test]
    fn qwen2_words() {
        use PreTokenizerKind::Qwen2;
        assert_eq!(
            words(Qwen2, "12345 don'T"),
            ["1", "2", "3", "4", "5", " don", "'T"]
        );
        assert_eq!(words(Qwen2, "a  \n\n  b"), ["a", "  \n\n", " ", " b"]);
        assert_eq!(
            words(Qwen2, "fn main() {\n    x"),
            ["fn", " main", "()", " {\n", "   ", " x"]
        );
    }

    #[test]
    fn pre_names() {
        use PreTokenizerKind::*;
        let cases = [
            ("qwen2", Some(Qwen2)),
            ("smollm", Some(DigitsThenGpt2)),
            ("llama-bpe", Some(Llama3)),
            ("gpt-2", Some(Gpt2)),
            ("olmo", Some(Gpt2)),
            ("megrez", Some(Qwen2)),
            // llama.cpp gives each of these rules (or settings) we do not implement.
            ("default", None),
            ("gpt2", None),
            ("tekken", None),
            ("smaug-bpe", None),
            ("dbrx", None),
            ("deepseek-llm", None),
            ("deepseek-coder", None),
            ("gpt-4o", None),
            ("superbpe", None),
            ("roberta-bpe", None),
            ("something-new", None),
        ];
        for (pre, kind) in cases {
            assert_eq!(PreTokenizerKind::from_pre(pre), kind, "{pre}");
        }
    }

    #[test]
    fn each_pre_name_has_one_kind() {
        let mut seen = std::collections::BTreeSet::new();
        for (_, names) in PRE_NAMES {
            for name in *names {
                assert!(seen.insert(*name), "{name} listed twice");
            }
        }
    }
}
