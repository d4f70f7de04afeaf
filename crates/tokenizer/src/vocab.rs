//! The vocabulary: token texts, token types and (for SentencePiece) scores, read from GGUF
//! metadata, plus the lookup from text to id.

use std::collections::HashMap;

use pk_gguf::{GgufFile, MetaValue};

use crate::error::TokenizerError;

/// What kind of token an id is, as stored in `tokenizer.ggml.token_type`.
///
/// The numbering follows llama.cpp's `llama_token_type`: 1 normal, 2 unknown, 3 control,
/// 4 user-defined, 5 unused, 6 byte. Values outside that range are read as `Normal`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenType {
    /// Ordinary text produced by the BPE merges.
    Normal,
    /// The `<unk>` token.
    Unknown,
    /// Chat-format and document markers such as `<|im_start|>`; never produced by merges.
    Control,
    /// Added tokens that are matched literally in any text, like llama.cpp does.
    UserDefined,
    /// Reserved slots.
    Unused,
    /// SentencePiece byte-fallback tokens `<0x00>` .. `<0xFF>`.
    Byte,
}

impl TokenType {
    fn from_gguf(value: i64) -> TokenType {
        match value {
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Normal,
        }
    }
}

/// Token texts and attributes, indexed by id.
#[derive(Clone)]
pub(crate) struct Vocab {
    pub texts: Vec<String>,
    pub types: Vec<TokenType>,
    /// SentencePiece merge scores; empty for byte-level BPE vocabularies.
    pub scores: Vec<f32>,
    ids: HashMap<String, u32>,
}

impl Vocab {
    /// Builds a vocabulary from texts and types. When a text occurs twice the later id
    /// wins, as in llama.cpp's `token_to_id` map.
    pub fn new(
        texts: Vec<String>,
        types: Vec<TokenType>,
        scores: Vec<f32>,
    ) -> Result<Vocab, TokenizerError> {
        if u32::try_from(texts.len()).is_err() {
            return Err(TokenizerError::InvalidMetadata {
                key: "tokenizer.ggml.tokens",
                reason: format!("{} tokens do not fit in u32 ids", texts.len()),
            });
        }
        if types.len() != texts.len() {
            return Err(TokenizerError::InvalidMetadata {
                key: "tokenizer.ggml.token_type",
                reason: format!("{} types for {} tokens", types.len(), texts.len()),
            });
        }
        if !scores.is_empty() && scores.len() != texts.len() {
            return Err(TokenizerError::InvalidMetadata {
                key: "tokenizer.ggml.scores",
                reason: format!("{} scores for {} tokens", scores.len(), texts.len()),
            });
        }
        let ids = texts
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        Ok(Vocab {
            texts,
            types,
            scores,
            ids,
        })
    }

    /// Reads `tokenizer.ggml.tokens`, `.token_type` (all normal when absent) and `.scores`.
    pub fn from_gguf(f: &GgufFile) -> Result<Vocab, TokenizerError> {
        let texts: Vec<String> = f
            .get_str_array("tokenizer.ggml.tokens")?
            .into_iter()
            .map(String::from)
            .collect();
        let types = match f.get("tokenizer.ggml.token_type") {
            None => vec![TokenType::Normal; texts.len()],
            Some(v) => int_array(v, "tokenizer.ggml.token_type")?
                .into_iter()
                .map(TokenType::from_gguf)
                .collect(),
        };
        let scores = match f.get("tokenizer.ggml.scores") {
            None => Vec::new(),
            Some(v) => float_array(v, "tokenizer.ggml.scores")?,
        };
        Vocab::new(texts, types, scores)
    }

    pub fn len(&self) -> usize {
        self.texts.len()
    }

    pub fn id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    pub fn score(&self, id: u32) -> f32 {
        self.scores.get(id as usize).copied().unwrap_or(0.0)
    }
}

fn int_array(v: &MetaValue, key: &'static str) -> Result<Vec<i64>, TokenizerError> {
    let invalid = |reason: &str| TokenizerError::InvalidMetadata {
        key,
        reason: reason.to_string(),
    };
    v.as_array()
        .ok_or_else(|| invalid("expected an array of integers"))?
        .iter()
        .map(|e| {
            e.as_i64()
                .ok_or_else(|| invalid("expected an array of integers"))
        })
        .collect()
}

fn float_array(v: &MetaValue, key: &'static str) -> Result<Vec<f32>, TokenizerError> {
    let invalid = || TokenizerError::InvalidMetadata {
        key,
        reason: "expected an array of numbers".into(),
    };
    v.as_array()
        .ok_or_else(invalid)?
        .iter()
        .map(|e| e.as_f64().map(|x| x as f32).ok_or_else(invalid))
        .collect()
}

/// Reads an optional token-id key. A value outside the vocabulary (GGUF writers store -1
/// as `u32::MAX` to mean "none") is treated as absent, as llama.cpp does.
pub(crate) fn optional_id(
    f: &GgufFile,
    key: &str,
    n_vocab: usize,
) -> Result<Option<u32>, TokenizerError> {
    if f.get(key).is_none() {
        return Ok(None);
    }
    let id = f.get_u64(key)?;
    Ok(u32::try_from(id).ok().filter(|&id| (id as usize) < n_vocab))
}

/// Reads an optional boolean key.
pub(crate) fn optional_bool(
    f: &GgufFile,
    key: &'static str,
) -> Result<Option<bool>, TokenizerError> {
    match f.get(key) {
        None => Ok(None),
        Some(MetaValue::Bool(b)) => Ok(Some(*b)),
        Some(v) => match v.as_u64() {
            Some(n) => Ok(Some(n != 0)),
            None => Err(TokenizerError::InvalidMetadata {
                key,
                reason: format!("expected a bool, found {}", v.type_name()),
            }),
        },
    }
}
