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

/// Used when the GGUF has no template but its vocabulary has Llama 3's header markers (the
/// Llama 3 tokenizer alone carries none): llama.cpp's built-in `llama3` format, each
/// message trimmed, no BOS in the text (the tokenizer adds it).
pub const LLAMA3_TEMPLATE: &str = "{% for message in messages %}\
{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + (message['content'] | trim) + '<|eot_id|>' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

/// Variables the renderer itself sets; `chat_template_kwargs` may not replace them.
pub const RESERVED_VARIABLES: &[&str] = &[
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

const TEMPLATE_NAME: &str = "chat_template";

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `"system"`, `"user"`, `"assistant"` or `"tool"` (templates may accept others).
    pub role: String,
    pub content: String,
    /// An assistant turn's calls, in OpenAI's shape (`[{"id", "type": "function",
    /// "function": {"name", "arguments"}}]`). Rendered with each call's `arguments` as a
    /// JSON object where it parses as one, as vLLM passes them to templates (Qwen2.5's
    /// template writes them with `tojson`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// The call a `tool` message answers (templates may show it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
        }
    }

    /// The message as the template sees it: tool-call arguments given as JSON text are
    /// parsed into objects.
    fn for_template(&self) -> ChatMessage {
        let mut m = self.clone();
        if let Some(serde_json::Value::Array(calls)) = &mut m.tool_calls {
            for call in calls.iter_mut() {
                let args = call
                    .get_mut("function")
                    .and_then(|f| f.get_mut("arguments"));
                if let Some(a) = args {
                    if let Some(parsed) = a
                        .as_str()
                        .and_then(|t| serde_json::from_str::<serde_json::Value>(t).ok())
                    {
                        *a = parsed;
                    }
                }
            }
        }
        m
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
    pub fn new(
        source: &str,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<ChatTemplate, TokenizerError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function("raise_exception", raise_exception);
        // HF renders templates in Python, and real ones call Python's string and dict
        // methods (Qwen3's: `content.startswith(...)`, `.split(...)`, `.rstrip(...)`).
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson_like_python);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|source| TokenizerError::Template {
                stage: "compile",
                source,
            })?;
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
            None if tokens.contains(&"<start_of_turn>") && tokens.contains(&"<end_of_turn>") => {
                GEMMA_TEMPLATE
            }
            None if tokens.contains(&"<|start_header_id|>") && tokens.contains(&"<|eot_id|>") => {
                LLAMA3_TEMPLATE
            }
            None => CHATML_TEMPLATE,
        };
        let text_of = |key: &str| -> Result<&str, TokenizerError> {
            Ok(optional_id(f, key, tokens.len())?.map_or("", |id| tokens[id as usize]))
        };
        ChatTemplate::new(
            source,
            text_of("tokenizer.ggml.bos_token_id")?,
            text_of("tokenizer.ggml.eos_token_id")?,
        )
    }

    /// Renders a conversation. With `add_generation_prompt` the result ends with the
    /// header of an assistant turn, ready for generation.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// Renders a conversation with tool definitions (OpenAI's `tools`: `[{"type":
    /// "function", "function": {"name", "description", "parameters"}}]`), which templates
    /// that know tools (Qwen2.5's) write into the system turn. `None` or an empty list
    /// renders as [`ChatTemplate::render`].
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.render_with_kwargs(messages, tools, add_generation_prompt, &Default::default())
    }

    /// Renders with extra template variables (vLLM's `chat_template_kwargs`, e.g. Qwen3's
    /// `enable_thinking`). A variable the renderer sets itself (`messages`, `tools`, …)
    /// is refused by name rather than silently overridden or dropped.
    pub fn render_with_kwargs(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, TokenizerError> {
        if let Some(k) = kwargs
            .keys()
            .find(|k| RESERVED_VARIABLES.contains(&k.as_str()))
        {
            return Err(TokenizerError::ReservedTemplateVariable(k.clone()));
        }
        let render_error = |source| TokenizerError::Template {
            stage: "render",
            source,
        };
        let template = self.env.get_template(TEMPLATE_NAME).map_err(render_error)?;
        let messages: Vec<ChatMessage> = messages.iter().map(ChatMessage::for_template).collect();
        let tools = tools.filter(|t| !t.is_empty());
        let base = context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        };
        let extra = minijinja::Value::from_serialize(kwargs);
        template
            .render(context! { ..base, ..extra })
            .map_err(render_error)
    }

    /// What the template writes between a user turn's text and the start of the assistant's
    /// answer (the end-of-turn marker and the assistant's header), found as kvpress's
    /// KVzip finds it: a one-message conversation rendered with the generation prompt and
    /// split after a separator at the end of the user's text.
    /// What the template writes before a user turn's text (the system turn, if the
    /// template writes a default one, and the user header): a one-message conversation
    /// rendered with the generation prompt, cut where the message's text starts, as
    /// kvpress's KVzip finds its `prefix_length`.
    pub fn user_turn_prefix(&self) -> Result<String, TokenizerError> {
        let dummy = "dummy context";
        let rendered = self.render(&[ChatMessage::new("user", dummy)], true)?;
        let (prefix, _) = rendered.split_once(dummy).ok_or_else(|| {
            TokenizerError::TemplateShape(
                "the template does not write a user message's text verbatim".into(),
            )
        })?;
        Ok(prefix.to_string())
    }

    pub fn user_turn_suffix(&self) -> Result<String, TokenizerError> {
        let dummy = "dummy context";
        let separator = format!("\n{}", "#".repeat(dummy.len()));
        let rendered = self.render(
            &[ChatMessage::new("user", format!("{dummy}{separator}"))],
            true,
        )?;
        let (_, suffix) = rendered.split_once(&separator).ok_or_else(|| {
            TokenizerError::TemplateShape(
                "the template does not write a user message's text verbatim".into(),
            )
        })?;
        Ok(suffix.to_string())
    }

    /// Whether the template reads the variable `name` (so that a caller can refuse a
    /// `chat_template_kwargs` entry the template would ignore).
    pub fn reads_variable(&self, name: &str) -> bool {
        self.env
            .get_template(TEMPLATE_NAME)
            .map(|t| t.undeclared_variables(false).contains(name))
            .unwrap_or(false)
    }

    /// Whether the template reads `tools` (so that a request's tools reach the prompt).
    pub fn renders_tools(&self) -> bool {
        self.source.contains("tools")
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

/// HF's `tojson`: Python's `json.dumps(value, ensure_ascii=False)`, whose separators are
/// `", "` and `": "` and whose keys keep their order (minijinja's own filter writes compact
/// JSON, which would change the prompt's tokens against HF's rendering).
fn tojson_like_python(value: minijinja::Value) -> Result<minijinja::Value, minijinja::Error> {
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_python_json(&json, &mut out);
    Ok(minijinja::Value::from_safe_string(out))
}

fn write_python_json(v: &serde_json::Value, out: &mut String) {
    use serde_json::Value as J;
    match v {
        J::Array(items) => {
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_python_json(x, out);
            }
            out.push(']');
        }
        J::Object(map) => {
            out.push('{');
            for (i, (k, x)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&serde_json::Value::String(k.clone()).to_string());
                out.push_str(": ");
                write_python_json(x, out);
            }
            out.push('}');
        }
        // serde_json escapes strings as Python does with ensure_ascii=False (quotes,
        // backslashes and control characters), and writes numbers and literals alike.
        other => out.push_str(&other.to_string()),
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
        assert_eq!(
            out,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        let out = t.render(&[ChatMessage::new("user", "hi")], false).unwrap();
        assert_eq!(out, "<|im_start|>user\nhi<|im_end|>\n");
    }

    /// Gemma's turns, as Google's template renders them: BOS, the system message folded
    /// into the first user turn, "model" for the assistant, content trimmed, and
    /// alternation enforced.
    #[test]
    fn gemma_fallback() {
        let t = ChatTemplate::new(GEMMA_TEMPLATE, "<bos>", "<eos>").unwrap();
        let msgs = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", " hi "),
            ChatMessage::new("assistant", "Hello."),
            ChatMessage::new("user", "Bye"),
        ];
        let out = t.render(&msgs, true).unwrap();
        assert_eq!(out, "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n");
        let out = t.render(&[ChatMessage::new("user", "x")], false).unwrap();
        assert_eq!(out, "<bos><start_of_turn>user\nx<end_of_turn>\n");
        let err = t
            .render(
                &[ChatMessage::new("user", "a"), ChatMessage::new("user", "b")],
                true,
            )
            .unwrap_err();
        assert!(err.to_string().contains("alternate"), "{err}");
    }

    /// Tools reach the template, `tojson` writes Python's separators in the given key
    /// order, and a call's JSON-text arguments are rendered as an object.
    #[test]
    fn tools_and_tool_calls_render_like_hf() {
        let src = "{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% for m in messages %}{% for c in m.tool_calls %}{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let tool: serde_json::Value = serde_json::from_str(r#"{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": ["x", "é"]}}}"#).unwrap();
        let mut m = ChatMessage::new("assistant", "");
        m.tool_calls = Some(
            serde_json::json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"z\": 2, \"y\": \"q\"}"}}]),
        );
        let out = t.render_with_tools(&[m], Some(&[tool]), false).unwrap();
        assert_eq!(out, "{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"b\": 1, \"a\": [\"x\", \"é\"]}}}\n{\"z\": 2, \"y\": \"q\"}");
    }

    #[test]
    fn bos_eos_and_block_trimming_like_hf() {
        let src = "{{ bos_token }}{% for m in messages %}\n  {{ m.content }}{{ eos_token }}\n{% endfor %}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        let out = t
            .render(
                &[ChatMessage::new("user", "a"), ChatMessage::new("user", "b")],
                false,
            )
            .unwrap();
        assert_eq!(out, "<s>  a</s>\n  b</s>\n");
    }

    #[test]
    fn template_errors_are_values() {
        let err = ChatTemplate::new("{% for %}", "", "").unwrap_err();
        assert!(
            matches!(
                err,
                TokenizerError::Template {
                    stage: "compile",
                    ..
                }
            ),
            "{err}"
        );
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "").unwrap();
        let err = t.render(&[], true).unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
        let t = ChatTemplate::new("{{ messages[0].content.nope() }}", "", "").unwrap();
        assert!(t.render(&[ChatMessage::new("user", "x")], true).is_err());
    }
}
