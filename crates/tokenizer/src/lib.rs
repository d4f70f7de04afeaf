//! `pk-tokenizer`: turns text into token ids and back for the models pagekeeper serves, and
//! renders their chat templates.
//!
//! Everything is built from GGUF metadata and matches llama.cpp's tokenization of the same
//! file id for id (the golden tests check a whole book against llama.cpp's output):
//!
//! - `"gpt2"` models (SmolLM2, Llama 3, Qwen, ...): GPT-2 byte-level BPE with ranked merges,
//!   after llama.cpp's pre-tokenizer regex for `tokenizer.ggml.pre` ([`PreTokenizerKind`]).
//! - `"llama"` models (Llama 2, Mistral, Gemma): SentencePiece BPE with scores and
//!   `<0xXX>` byte fallback.
//!
//! Special tokens written literally in the text are matched before either algorithm runs.
//! Chat templates ([`ChatTemplate`]) are Jinja, rendered with minijinja like HF does.
//!
//! **Architecture Invariant:** this crate knows nothing about tensors, sampling or the
//! engine; it reads GGUF metadata and nothing else. Encoding and decoding never fail and
//! never panic on any input; only construction and template rendering return errors.
#![forbid(unsafe_code)]

mod bpe;
mod byte_level;
mod chat;
mod error;
mod keys;
mod pretokenize;
mod special;
mod spm;
mod stream;
mod tokenizer;
mod vocab;

pub use chat::{ChatMessage, ChatTemplate, CHATML_TEMPLATE, RESERVED_VARIABLES};
pub use error::TokenizerError;
pub use pretokenize::PreTokenizerKind;
pub use stream::StreamDecoder;
pub use tokenizer::{Tokenizer, TokenizerKind};
pub use vocab::TokenType;
