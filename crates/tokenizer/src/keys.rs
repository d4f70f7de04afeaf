//! Which `tokenizer.*` metadata keys a GGUF may carry. The tokenizer reads the first list;
//! the second changes nothing in how text becomes ids here; the third must hold the value
//! this tokenizer implements. Any other key is refused by name, so that a vocabulary
//! feature we do not implement (adding EOS, a BERT separator, …) stops the load instead
//! of tokenizing differently from the model's own tokenizer.

use pk_gguf::GgufFile;

use crate::error::TokenizerError;

/// Read by `Tokenizer::from_gguf` and `ChatTemplate::from_gguf`.
const READ: &[&str] = &[
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template",
];

/// Present in real GGUFs and harmless: the padding id (we never pad a sequence), the ids
/// of encoder-only roles (classification, separator, mask) a decoder never emits, the
/// fill-in-the-middle ids (FIM prompts are built from the tokens' texts, which the
/// vocabulary holds), and the Hugging Face tokenizer JSON some converters copy beside
/// the vocabulary they also write.
const HARMLESS: &[&str] = &[
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.cls_token_id",
    "tokenizer.ggml.seperator_token_id",
    "tokenizer.ggml.mask_token_id",
    "tokenizer.ggml.fim_pre_token_id",
    "tokenizer.ggml.fim_suf_token_id",
    "tokenizer.ggml.fim_mid_token_id",
    "tokenizer.ggml.fim_pad_token_id",
    "tokenizer.ggml.fim_rep_token_id",
    "tokenizer.ggml.fim_sep_token_id",
    "tokenizer.ggml.prefix_token_id",
    "tokenizer.ggml.suffix_token_id",
    "tokenizer.ggml.middle_token_id",
    "tokenizer.huggingface.json",
];

/// Booleans this tokenizer implements only as `false`.
const MUST_BE_FALSE: &[&str] = &[
    "tokenizer.ggml.add_eos_token",
    "tokenizer.ggml.add_sep_token",
];

/// Named alternative chat templates (`tokenizer.chat_template.tool_use`, …): the default
/// template is the one rendered, and these are offered, not applied, by llama.cpp too.
const NAMED_TEMPLATE_PREFIX: &str = "tokenizer.chat_template.";

pub(crate) fn check_tokenizer_keys(f: &GgufFile) -> Result<(), TokenizerError> {
    let refuse = |key: &str, why: String| TokenizerError::UnrecognizedKey {
        key: key.to_string(),
        why,
    };
    for (key, value) in &f.metadata {
        if !key.starts_with("tokenizer.") || key.starts_with(NAMED_TEMPLATE_PREFIX) {
            continue;
        }
        if READ.contains(&key.as_str()) || HARMLESS.contains(&key.as_str()) {
            continue;
        }
        if MUST_BE_FALSE.contains(&key.as_str()) {
            match value {
                pk_gguf::MetaValue::Bool(false) => continue,
                _ => return Err(refuse(key, format!(" = {value:?}"))),
            }
        }
        return Err(refuse(key, String::new()));
    }
    Ok(())
}
