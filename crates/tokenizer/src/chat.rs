//! Chat templates: the Jinja template stored in `tokenizer.chat_template`, rendered with
//! minijinja the way Hugging Face `transformers` renders it.
//!
//! HF compiles templates with `trim_blocks` and `lstrip_blocks`, exposes `messages`,
//! `add_generation_prompt`, `bos_token` and `eos_token`, and provides a
//! `raise_exception(message)` function that templates use to reject malformed
//! conversations. We do the same, so the rendered prompt is byte-identical to HF's for the
//! templates our models ship. A GGUF without a template gets Gemma's turn format if its
//! vocabulary has Gemma's turn markers, else plain ChatML.

use minijinja::{context, Environment, ErrorKind};
use pk_gguf::GgufFile;
use serde::{Deserialize, Serialize};

use crate::error::TokenizerError;
use crate::vocab::optional_id;

/// Used when the GGUF has no `tokenizer.chat_template`.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// Used when the GGUF has no template but its vocabulary has Gemma's turn markers (the
/// Gemma 3 base models): Gemma's own turn format, a system message folded into the first
/// user turn, as Google's template does (text content only).
pub const GEMMA_TEMPLATE: &str = "{{ bos_token }}\
{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}\
{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}\
{% for message in loop_messages %}\
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}\
{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}\
{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + (message['content'] | trim) + '<end_of_turn>\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}";

const TEMPLATE_NAME: &str = "chat_template";

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `"system"`, `"user"` or `"assistant"` (templates may accept others).
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// A compiled chat template together with the special-token texts it may reference.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source` (a Jinja template) with the given `bos_token` / `eos_token` texts.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate, TokenizerError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|source| TokenizerError::Template { stage: "compile", source })?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// Reads `tokenizer.chat_template` (ChatML when absent) and the BOS/EOS token texts.
    pub fn from_gguf(f: &GgufFile) -> Result<ChatTemplate, TokenizerError> {
        let tokens = f.get_str_array("tokenizer.ggml.tokens")?;
        let source = match f.get("tokenizer.chat_template") {
            Some(_) => f.get_str("tokenizer.chat_template")?,
            None if tokens.contains(&"<start_of_turn>") && tokens.contains(&"<end_of_turn>") => GEMMA_TEMPLATE,
            None => CHATML_TEMPLATE,
        };
        let text_of = |key: &str| -> Result<&str, TokenizerError> {
            Ok(optional_id(f, key, tokens.len())?.map_or("", |id| tokens[id as usize]))
        };
        ChatTemplate::new(source, text_of("tokenizer.ggml.bos_token_id")?, text_of("tokenizer.ggml.eos_token_id")?)
    }

    /// Renders a conversation. With `add_generation_prompt` the result ends with the
    /// header of an assistant turn, ready for generation.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, TokenizerError> {
        let render_error = |source| TokenizerError::Template { stage: "render", source };
        let template = self.env.get_template(TEMPLATE_NAME).map_err(render_error)?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(render_error)
    }

    /// The source of the compiled template.
    pub fn source(&self) -> &str {
        &self.source
    }
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

/// HF's `raise_exception`: aborts rendering with the template's own message.
fn raise_exception(message: String) -> Result<String, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_fallback() {
        let t = ChatTemplate::new(CHATML_TEMPLATE, "", "").unwrap();
        let out = t.render(&[ChatMessage::new("user", "hi")], true).unwrap();
        assert_eq!(out, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
        let out = t.render(&[ChatMessage::new("user", "hi")], false).unwrap();
        assert_eq!(out, "<|im_start|>user\nhi<|im_end|>\n");
    }

    /// Gemma's turns, as Google's template renders them: BOS, the system message folded
    /// into the first user turn, "model" for the assistant, content trimmed, and
    /// alternation enforced.
    #[test]
    fn gemma_fallback() {
        let t = ChatTemplate::new(GEMMA_TEMPLATE, "<bos>", "<eos>").unwrap();
        let msgs = [ChatMessage::new("system", "Be brief."), ChatMessage::new("user", " hi "), ChatMessage::new("assistant", "Hello."), ChatMessage::new("user", "Bye")];
        let out = t.render(&msgs, true).unwrap();
        assert_eq!(out, "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n");
        let out = t.render(&[ChatMessage::new("user", "x")], false).unwrap();
        assert_eq!(out, "<bos><start_of_turn>user\nx<end_of_turn>\n");
        let err = t.render(&[ChatMessage::new("user", "a"), ChatMessage::new("user", "b")], true).unwrap_err();
        assert!(err.to_string().contains("alternate"), "{err}");
    }

    #[test]
    fn bos_eos_and_block_trimming_like_hf() {
        let src = "{{ bos_token }}{% for m in messages %}\n  {{ m.content }}{{ eos_token }}\n{% endfor %}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        let out = t.render(&[ChatMessage::new("user", "a"), ChatMessage::new("user", "b")], false).unwrap();
        assert_eq!(out, "<s>  a</s>\n  b</s>\n");
    }

    #[test]
    fn template_errors_are_values() {
        let err = ChatTemplate::new("{% for %}", "", "").unwrap_err();
        assert!(matches!(err, TokenizerError::Template { stage: "compile", .. }), "{err}");
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "").unwrap();
        let err = t.render(&[], true).unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
        let t = ChatTemplate::new("{{ messages[0].content.nope() }}", "", "").unwrap();
        assert!(t.render(&[ChatMessage::new("user", "x")], true).is_err());
    }
}
