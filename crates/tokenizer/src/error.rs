//! The one error type of `pk-tokenizer`.
//!
//! Only construction (reading GGUF metadata) and chat-template rendering can fail.
//! Encoding and decoding are infallible by design: every `&str` can be tokenized and
//! every id sequence can be turned back into text (unknown ids render as nothing).

/// Why a tokenizer or chat template could not be built or rendered.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A required metadata key is missing or has the wrong type.
    #[error("tokenizer metadata: {0}")]
    Gguf(#[from] pk_gguf::GgufError),

    /// The GGUF names a tokenizer model this crate does not implement.
    #[error(
        "unsupported tokenizer model {model:?} (tokenizer.ggml.model); supported: \
         \"gpt2\" (byte-level BPE) and \"llama\" (SentencePiece BPE)"
    )]
    UnsupportedModel { model: String },

    /// The metadata is present but inconsistent (for example, array lengths differ).
    #[error("invalid tokenizer metadata {key}: {reason}")]
    InvalidMetadata { key: &'static str, reason: String },

    /// The chat template failed to compile or to render.
    #[error("chat template failed to {stage}: {source}")]
    Template {
        /// `"compile"` or `"render"`.
        stage: &'static str,
        #[source]
        source: minijinja::Error,
    },

    /// The chat template renders, but not in the shape a caller relies on.
    #[error("chat template: {0}")]
    TemplateShape(String),

    /// A `chat_template_kwargs` entry names a variable the renderer sets itself.
    #[error("chat template variable {0:?} is set by the renderer and cannot be given as a template keyword argument")]
    ReservedTemplateVariable(String),

    /// A `tokenizer.*` key this crate does not use, or one set to what it does not do
    /// (`add_eos_token = true`): refused rather than ignored.
    #[error("the GGUF holds tokenizer metadata {key:?}{why}, which this tokenizer does not implement; refusing to load rather than tokenize differently from the model's own")]
    UnrecognizedKey { key: String, why: String },
}
