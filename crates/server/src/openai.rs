//! OpenAI API request and response bodies (the subset vLLM and llama-server implement),
//! plus pagekeeper's extensions (`kv_policy`, `kv_budget`, `kv_granularity`, `cache_salt`, `top_k`), which
//! clients that do not know them simply never send.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `stop` may be a string or a list of strings.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

impl StopField {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }
    }
}

/// A completion prompt: text, or token ids (OpenAI accepts both).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Tokens(Vec<u32>),
    TextBatch(Vec<String>),
    TokensBatch(Vec<Vec<u32>>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
    /// Every other key: refused by name unless its value asks for nothing (as the body's
    /// own catch-all), so `continuous_usage_stats: true` is never accepted and ignored.
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

/// Sampling and pagekeeper fields shared by both endpoints.
#[derive(Debug, Clone, Deserialize)]
pub struct CommonParams {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<StopField>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    #[serde(default)]
    pub ignore_eos: bool,
    pub kv_policy: Option<String>,
    pub kv_budget: Option<i64>,
    pub kv_granularity: Option<String>,
    pub cache_salt: Option<String>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// vLLM's extension.
    pub repetition_penalty: Option<f32>,
    /// Token id (as a string, OpenAI's form) → bias in [-100, 100].
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// vLLM's extension.
    pub min_p: Option<f32>,
    /// vLLM's extension: end-of-generation tokens are banned before this many tokens.
    pub min_tokens: Option<i64>,
    /// Chat: a bool; completions: the number of alternatives (0–20).
    pub logprobs: Option<Value>,
    /// Chat only: alternatives per token (0–20), with `logprobs: true`.
    pub top_logprobs: Option<i64>,
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": …}}`.
    pub response_format: Option<Value>,
    /// vLLM's structured-output extensions.
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
    /// Every other field of the body. None is silently ignored: the handlers refuse each
    /// one whose value asks for something (`unsupported_field`), and accept only values
    /// that mean the default (null, false, 0, empty) and `user` (an end-user id for the
    /// operator's logs, which changes no output).
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

/// The first field of `other` that asks for something this server does not do, with the
/// message its 400 carries; `None` if every one is a no-op.
pub fn unsupported_field(other: &serde_json::Map<String, Value>) -> Option<(String, String)> {
    other.iter().find(|(name, value)| !is_no_op(name, value)).map(|(name, value)| {
        let known = matches!(
            name.as_str(),
            "functions" | "function_call"
                | "best_of" | "prompt_logprobs"
        );
        let why = if known { "is not supported by this server yet" } else { "is not a field this server knows" };
        (name.clone(), format!("`{name}` = {value} {why}; remove it (a request is never answered with a field ignored)"))
    })
}

fn is_no_op(name: &str, value: &Value) -> bool {
    match value {
        Value::Null | Value::Bool(false) => true,
        Value::Number(n) => {
            n.as_f64() == Some(0.0) || (name == "best_of" && n.as_f64() == Some(1.0))
        }
        Value::String(s) => s.is_empty() || name == "user",
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => {
            o.is_empty()
                || (name == "response_format"
                    && o.get("type").and_then(Value::as_str) == Some("text")
                    && o.len() == 1)
        }
        Value::Bool(true) => false,
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptField,
    #[serde(default)]
    pub echo: bool,
    /// Text after the completion: fill-in-the-middle with the model's FIM tokens.
    pub suffix: Option<String>,
    #[serde(flatten)]
    pub common: CommonParams,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    /// A string, or a list of content parts of which only `{"type": "text"}` is supported.
    pub content: Option<Value>,
    /// An assistant turn's calls (OpenAI's shape), given back in later requests.
    pub tool_calls: Option<Value>,
    /// The call a `tool` message answers.
    pub tool_call_id: Option<String>,
    /// Other message fields (`name`, `tool_calls`, …): refused unless no-ops, as for the body.
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessageIn>,
    /// `[{"type": "function", "function": {"name", "description", "parameters"}}]`.
    pub tools: Option<Vec<Value>>,
    /// `"none" | "auto" | "required" | {"type": "function", "function": {"name"}}`.
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// vLLM's extra chat-template variables (Qwen3's `{"enable_thinking": false}`); each
    /// must be one the model's template reads.
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    #[serde(flatten)]
    pub common: CommonParams,
}

#[derive(Debug, Clone, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Usage {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// The error body OpenAI clients parse: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<u16>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(json: &str) -> serde_json::Map<String, Value> {
        serde_json::from_str::<ChatRequest>(json)
            .unwrap()
            .common
            .other
    }

    /// Known fields land in their places; the others are refused by name unless their
    /// value is the default.
    #[test]
    fn fields_that_ask_for_something_are_refused_by_name() {
        let base = r#""messages": [{"role": "user", "content": "hi"}], "temperature": 0"#;
        assert!(fields(&format!("{{{base}}}")).is_empty());
        for no_op in [
            r#""logprobs": false"#,
            r#""presence_penalty": 0"#,
            r#""user": "alice""#,
            r#""best_of": 1"#,
            r#""logit_bias": {}"#,
        ] {
            assert_eq!(
                unsupported_field(&fields(&format!("{{{base}, {no_op}}}"))),
                None,
                "{no_op}"
            );
        }
        for (asks, name) in [
            (r#""functions": [{"name": "f"}]"#, "functions"),
            (r#""best_of": 3"#, "best_of"),
            (r#""frobnicate": 1"#, "frobnicate"),
        ] {
            let (field, message) =
                unsupported_field(&fields(&format!("{{{base}, {asks}}}"))).expect(asks);
            assert_eq!(field, name);
            assert!(message.contains(name), "{message}");
        }
        let msg: ChatMessageIn =
            serde_json::from_str(r#"{"role": "user", "content": "hi", "name": "bob"}"#).unwrap();
        assert_eq!(
            unsupported_field(&msg.other).map(|f| f.0),
            Some("name".to_string())
        );
    }
}
