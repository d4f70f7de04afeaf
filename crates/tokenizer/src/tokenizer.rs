//! [`Tokenizer`]: the public facade that turns text into token ids and back.
//!
//! Construction reads everything from GGUF metadata, the way llama.cpp's `llama_vocab::load`
//! does, so that our ids match llama.cpp's for the same file. Encoding first cuts out
//! special tokens ([`crate::special`]), then hands each stretch of plain text to the model:
//! byte-level BPE ([`crate::bpe`]) or SentencePiece BPE ([`crate::spm`]).
//!
//! NOTE 1: The tokenizer is immutable after construction and therefore `Send + Sync`; the
//! per-word BPE cache lives only for one `encode` call.
//! NOTE 2: The bytes of every token are precomputed once into one buffer, so
//! [`Tokenizer::token_bytes`] is a slice lookup that a streaming printer can call per token.

use pk_gguf::GgufFile;

use crate::bpe::{BpeModel, WordCache};
use crate::byte_level::decode_token_text;
use crate::error::TokenizerError;
use crate::pretokenize::{PreTokenizer, PreTokenizerKind};
use crate::special::{Fragment, SpecialMatcher};
use crate::spm::{SpmModel, SPACE};
use crate::vocab::{optional_bool, optional_id, TokenType, Vocab};

/// Token texts that end generation, taken from llama.cpp's end-of-generation list.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

/// The tokenizer algorithm named by `tokenizer.ggml.model`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerKind {
    /// `"gpt2"`: byte-level BPE with ranked merges, with the given pre-tokenizer.
    ByteLevelBpe(PreTokenizerKind),
    /// `"llama"`: SentencePiece BPE with scores and byte fallback.
    SentencePiece,
}

// One `Model` exists per tokenizer, so the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
enum Model {
    Bpe(BpeModel),
    Spm(SpmModel),
}

/// A tokenizer for one model's vocabulary. Cheap to share: `&Tokenizer` is all any method needs.
#[derive(Clone)]
pub struct Tokenizer {
    vocab: Vocab,
    model: Model,
    special: SpecialMatcher,
    /// Bytes of all tokens, back to back; token `i` is `pieces[offsets[i]..offsets[i + 1]]`.
    pieces: Vec<u8>,
    offsets: Vec<usize>,
    bos: Option<u32>,
    eos: u32,
    eog: Vec<u32>,
    add_bos: bool,
    add_space_prefix: bool,
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.*` metadata.
    pub fn from_gguf(f: &GgufFile) -> Result<Tokenizer, TokenizerError> {
        crate::keys::check_tokenizer_keys(f)?;
        let model_name = f.get_str("tokenizer.ggml.model")?;
        // Defaults are llama.cpp's, used only when a key is absent: (bos, eos, unk).
        let (default_bos, default_eos, default_unk) = match model_name {
            "gpt2" => (Some(11), Some(11), None),
            "llama" => (Some(1), Some(2), Some(0)),
            other => {
                return Err(TokenizerError::UnsupportedModel {
                    model: other.to_string(),
                })
            }
        };
        let vocab = Vocab::from_gguf(f)?;
        let n = vocab.len();
        let id_or = |key: &str, default: Option<u32>| -> Result<Option<u32>, TokenizerError> {
            match f.get(key) {
                Some(_) => optional_id(f, key, n),
                None => Ok(default.filter(|&id| (id as usize) < n)),
            }
        };
        let bos = id_or("tokenizer.ggml.bos_token_id", default_bos)?;
        let eos = id_or("tokenizer.ggml.eos_token_id", default_eos)?.ok_or_else(|| {
            TokenizerError::InvalidMetadata {
                key: "tokenizer.ggml.eos_token_id",
                reason: format!("missing or outside the vocabulary of {n} tokens"),
            }
        })?;
        let unk = id_or("tokenizer.ggml.unknown_token_id", default_unk)?;

        let (model, default_add_bos) = if model_name == "gpt2" {
            let kind = pre_tokenizer_kind(f)?;
            let merges = f.get_str_array("tokenizer.ggml.merges")?;
            let bpe = BpeModel::new(&vocab, &merges, PreTokenizer::new(kind))?;
            (Model::Bpe(bpe), kind == PreTokenizerKind::Llama3)
        } else {
            (Model::Spm(SpmModel::new(&vocab, unk)), true)
        };

        let mut eog = vec![eos];
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            eog.extend(optional_id(f, key, n)?);
        }
        eog.extend(EOG_TEXTS.iter().filter_map(|t| vocab.id(t)));
        eog.sort_unstable();
        eog.dedup();

        let add_bos = optional_bool(f, "tokenizer.ggml.add_bos_token")?.unwrap_or(default_add_bos);
        let add_space_prefix = matches!(model, Model::Spm(_))
            && optional_bool(f, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
        Ok(Tokenizer::assemble(
            vocab,
            model,
            bos,
            eos,
            eog,
            add_bos,
            add_space_prefix,
        ))
    }

    /// Builds a byte-level BPE tokenizer from parts; used by tests with hand-made vocabularies.
    #[cfg(test)]
    pub(crate) fn bpe_for_tests(
        vocab: Vocab,
        merges: &[&str],
        pre: PreTokenizerKind,
        eos: u32,
    ) -> Tokenizer {
        let bpe =
            BpeModel::new(&vocab, merges, PreTokenizer::new(pre)).expect("test merges are valid");
        Tokenizer::assemble(vocab, Model::Bpe(bpe), None, eos, vec![eos], false, false)
    }

    fn assemble(
        vocab: Vocab,
        model: Model,
        bos: Option<u32>,
        eos: u32,
        eog: Vec<u32>,
        add_bos: bool,
        add_space_prefix: bool,
    ) -> Tokenizer {
        let special = SpecialMatcher::new(&vocab);
        let mut pieces = Vec::new();
        let mut offsets = Vec::with_capacity(vocab.len() + 1);
        offsets.push(0);
        for (text, ty) in vocab.texts.iter().zip(&vocab.types) {
            match (&model, ty) {
                (_, TokenType::Control | TokenType::UserDefined | TokenType::Unknown) => {
                    pieces.extend_from_slice(text.as_bytes())
                }
                (_, TokenType::Unused) => {}
                (Model::Bpe(_), TokenType::Normal | TokenType::Byte) => {
                    pieces.extend(decode_token_text(text))
                }
                (Model::Spm(_), TokenType::Byte) => pieces.extend(parse_byte_token(text)),
                (Model::Spm(_), TokenType::Normal) => {
                    pieces.extend_from_slice(text.replace(SPACE, " ").as_bytes())
                }
            }
            offsets.push(pieces.len());
        }
        Tokenizer {
            vocab,
            model,
            special,
            pieces,
            offsets,
            bos,
            eos,
            eog,
            add_bos,
            add_space_prefix,
        }
    }

    /// Encodes a prompt: [`Tokenizer::encode`], with BOS first when the model wants one
    /// (`add_bos`) and the text does not already begin with it (a chat template may write
    /// it), as llama.cpp's `common_tokenize(…, add_special = true)` does.
    pub fn encode_prompt(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let ids = self.encode(text, parse_special);
        match self.bos {
            Some(bos) if self.add_bos() && ids.first() != Some(&bos) => {
                std::iter::once(bos).chain(ids).collect()
            }
            _ => ids,
        }
    }

    /// Encodes `text` to token ids. Adds no BOS; see [`Tokenizer::add_bos`].
    ///
    /// With `parse_special`, control tokens written literally in the text (such as
    /// `<|im_start|>`) become their ids; without it they are tokenized as ordinary text, so
    /// user input cannot inject them. User-defined tokens are always matched, as in llama.cpp.
    pub fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let fragments = self.special.split(text, parse_special);
        match &self.model {
            Model::Bpe(bpe) => {
                let mut cache = WordCache::default();
                for fragment in fragments {
                    match fragment {
                        Fragment::Text(range) => {
                            bpe.encode(&self.vocab, &text[range], &mut cache, &mut out)
                        }
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
            Model::Spm(spm) => {
                // llama.cpp prefixes a space to text at the start and after each special token.
                let mut after_special = true;
                for fragment in fragments {
                    match fragment {
                        Fragment::Text(range) => {
                            let prefix = self.add_space_prefix && after_special;
                            spm.encode(&self.vocab, &text[range], prefix, &mut out);
                            after_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            after_special = true;
                        }
                    }
                }
            }
        }
        out
    }

    /// Decodes ids to text: the concatenated [`Tokenizer::token_bytes`], with invalid UTF-8
    /// replaced by U+FFFD. Control tokens appear as their text; unknown ids as nothing. For
    /// SentencePiece models that add a space prefix, the first token's leading space is
    /// removed so that `decode(encode(s)) == s`.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for (i, &id) in ids.iter().enumerate() {
            let piece = self.token_bytes(id);
            let strip = i == 0 && self.add_space_prefix && piece.first() == Some(&b' ');
            bytes.extend_from_slice(if strip { &piece[1..] } else { piece });
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The raw bytes a token stands for (empty for ids outside the vocabulary). A token may
    /// hold part of a UTF-8 character; see [`crate::StreamDecoder`] for printing streams.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        let i = id as usize;
        match (self.offsets.get(i), self.offsets.get(i + 1)) {
            (Some(&start), Some(&end)) => &self.pieces[start..end],
            _ => &[],
        }
    }

    /// The token's text as stored in the vocabulary (byte-level form, e.g. `"Ġthe"`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.texts.get(id as usize).map(String::as_str)
    }

    /// The id of a vocabulary entry, given in its stored form (`"<|im_end|>"`, `"Ġthe"`).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.id(text)
    }

    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.vocab.token_type(id)
    }

    pub fn is_control(&self, id: u32) -> bool {
        self.vocab.token_type(id) == Some(TokenType::Control)
    }

    /// Whether generating `id` ends the turn (see [`Tokenizer::eog_ids`]).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// End-of-generation ids, sorted: EOS, EOT/EOM when declared, and the tokens llama.cpp
    /// recognises by text (`<|im_end|>`, `<|endoftext|>`, `<end_of_turn>`, ...).
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> u32 {
        self.eos
    }

    /// Whether the model expects a BOS token before the prompt (`tokenizer.ggml.add_bos_token`).
    pub fn add_bos(&self) -> bool {
        self.add_bos && self.bos.is_some()
    }

    pub fn kind(&self) -> TokenizerKind {
        match &self.model {
            Model::Bpe(bpe) => TokenizerKind::ByteLevelBpe(bpe.pre_tokenizer().kind()),
            Model::Spm(_) => TokenizerKind::SentencePiece,
        }
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind())
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eog", &self.eog)
            .field("add_bos", &self.add_bos)
            .finish_non_exhaustive()
    }
}

/// The byte of a SentencePiece `<0xXX>` token (nothing if the text is malformed).
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}

/// The pre-tokenizer `tokenizer.ggml.pre` names. A value whose splitting we do not
/// implement exactly as llama.cpp does is refused by name, and so is a missing key, for
/// which llama.cpp falls back to its `default` rules (not implemented here).
fn pre_tokenizer_kind(f: &GgufFile) -> Result<PreTokenizerKind, TokenizerError> {
    const KEY: &str = "tokenizer.ggml.pre";
    if f.get(KEY).is_none() {
        return Err(TokenizerError::InvalidMetadata {
            key: KEY,
            reason: "missing; llama.cpp would split words by its \"default\" rules, \
                     which this tokenizer does not implement"
                .to_string(),
        });
    }
    let pre = f.get_str(KEY)?;
    PreTokenizerKind::from_pre(pre).ok_or_else(|| TokenizerError::UnrecognizedKey {
        key: KEY.to_string(),
        why: format!(" = {pre:?}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes a, b, space and newline, one merge, and two control tokens.
    fn tiny() -> Tokenizer {
        let tokens = [
            ("<|end|>", TokenType::Control),
            ("<|start|>", TokenType::Control),
            ("a", TokenType::Normal),
            ("b", TokenType::Normal),
            ("Ġ", TokenType::Normal),
            ("Ċ", TokenType::Normal),
            ("ab", TokenType::Normal),
            ("<", TokenType::Normal),
            ("|", TokenType::Normal),
            (">", TokenType::Normal),
        ];
        let texts = tokens.iter().map(|(t, _)| t.to_string()).collect();
        let types = tokens.iter().map(|(_, ty)| *ty).collect();
        let vocab = Vocab::new(texts, types, Vec::new()).unwrap();
        Tokenizer::bpe_for_tests(vocab, &["a b"], PreTokenizerKind::Gpt2, 0)
    }

    #[test]
    fn special_tokens_split_only_when_parsing_special() {
        let t = tiny();
        assert_eq!(t.encode("<|start|>ab\n<|end|>", true), vec![1, 6, 5, 0]);
        let plain = t.encode("<|end|>", false);
        assert!(
            !plain.contains(&0),
            "control text must not become the control token: {plain:?}"
        );
        // The letters e, n and d have no tokens in this vocabulary, so they are dropped.
        assert_eq!(t.decode(&plain), "<||>");
    }

    #[test]
    fn decode_and_token_bytes() {
        let t = tiny();
        assert_eq!(t.token_bytes(4), b" ");
        assert_eq!(t.token_bytes(0), b"<|end|>");
        assert_eq!(t.token_bytes(999), b"");
        assert_eq!(t.decode(&[1, 6, 4, 2, 5, 0]), "<|start|>ab a\n<|end|>");
        assert!(t.is_control(0) && !t.is_control(6));
        assert!(t.is_eog(0) && !t.is_eog(1));
        assert_eq!(t.token_id("ab"), Some(6));
        assert_eq!(t.bos_id(), None);
        assert!(!t.add_bos());
    }

    #[test]
    fn tokenizer_is_shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
    }
}
