//! OpenAI API request and response bodies (the subset vLLM and llama-server implement),
//! plus pagekeeper's extensions (`kv_policy`, `kv_budget`, `kv_granularity`, `cache_salt`, `top_k`), which
//! clients that do not know them simply never send.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A flag that may be `null`, which OpenAI's API (and vLLM) read as absent: false.
fn null_is_false<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<bool>::deserialize(d)?.unwrap_or(false))
}

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
    #[serde(default, deserialize_with = "null_is_false")]
    pub include_usage: bool,
    /// vLLM's: every chunk carries the usage so far (`include_usage` adds the final one).
    #[serde(default, deserialize_with = "null_is_false")]
    pub continuous_usage_stats: bool,
    /// Every other key: refused by name (`unsupported_field`), as the body's.
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
    #[serde(default, deserialize_with = "null_is_false")]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    #[serde(default, deserialize_with = "null_is_false")]
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
    /// vLLM's: control tokens generated mid-text (`<|im_start|>`, …) are left out of the
    /// text (the default, `true`) or written out (`false`).
    pub skip_special_tokens: Option<bool>,
    /// vLLM's: whether the tokenizer adds the model's BOS before the prompt (default:
    /// yes where the model wants one and the prompt does not start with it already).
    pub add_special_tokens: Option<bool>,
    /// vLLM's: each prompt token's log-probability given the tokens before it, and this
    /// many most likely alternatives (0–20).
    pub prompt_logprobs: Option<i64>,
    /// Every other field of the body. None is silently ignored: each is refused by name
    /// (`unsupported_field`) unless it is listed in `NO_OP_FIELDS` with the value sent,
    /// that is, a value that asks for exactly what this server does anyway.
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

/// A field's name and whether a value of it asks for nothing this server does not do.
type NoOp = (&'static str, fn(&Value) -> bool);

/// Fields this server does not implement, each with the values that ask for nothing it
/// does not do anyway (an explicit list per field, never a guess from the value's look:
/// `add_generation_prompt: false` looks like a default and asks for something). `null`
/// stands for an absent field everywhere, as in OpenAI's API.
const NO_OP_FIELDS: &[NoOp] = &[
    // An end-user id for the operator's logs; it changes no output.
    ("user", |v| v.is_string()),
    ("best_of", |v| v.as_i64() == Some(1)),
    ("use_beam_search", |v| v == &Value::Bool(false)),
    ("length_penalty", |v| v.as_f64() == Some(1.0)),
    // OpenAI's stored completions: this server stores nothing.
    ("store", |v| v == &Value::Bool(false)),
    ("metadata", |v| v.as_object().is_some_and(|o| o.is_empty())),
    ("functions", |v| v.as_array().is_some_and(|a| a.is_empty())),
    ("function_call", |v| v.as_str() == Some("none")),
    ("modalities", |v| v == &serde_json::json!(["text"])),
    ("include_stop_str_in_output", |v| v == &Value::Bool(false)),
    ("stop_token_ids", |v| {
        v.as_array().is_some_and(|a| a.is_empty())
    }),
    ("return_tokens_as_token_ids", |v| v == &Value::Bool(false)),
    ("echo", |v| v == &Value::Bool(false)),
    ("priority", |v| v.as_i64() == Some(0)),
    ("documents", |v| v.as_array().is_some_and(|a| a.is_empty())),
];

/// Message fields that clients echo back from an earlier reply (OpenAI's SDK returns
/// assistant messages with these set), with the values that change nothing.
const NO_OP_MESSAGE_FIELDS: &[NoOp] = &[
    ("refusal", |v| v.is_null()),
    ("annotations", |v| {
        v.as_array().is_some_and(|a| a.is_empty())
    }),
    ("audio", |v| v.is_null()),
    ("function_call", |v| v.is_null()),
];

/// The first field of `other` that is not a listed no-op, with the message its 400
/// carries; `None` if every one is.
pub fn unsupported_field(other: &serde_json::Map<String, Value>) -> Option<(String, String)> {
    first_unsupported(other, NO_OP_FIELDS)
}

/// As [`unsupported_field`] for a message's fields.
pub fn unsupported_message_field(
    other: &serde_json::Map<String, Value>,
) -> Option<(String, String)> {
    first_unsupported(other, NO_OP_MESSAGE_FIELDS)
}

fn first_unsupported(
    other: &serde_json::Map<String, Value>,
    no_ops: &[NoOp],
) -> Option<(String, String)> {
    let is_no_op = |name: &str, value: &Value| {
        value.is_null()
            || no_ops
                .iter()
                .any(|(n, accepts)| *n == name && accepts(value))
    };
    other
        .iter()
        .find(|(name, value)| !is_no_op(name, value))
        .map(|(name, value)| {
            let why = match no_ops.iter().any(|(n, _)| n == name) {
                true => "is not supported by this server with this value",
                false => "is not a field this server knows",
            };
            (name.clone(), format!("`{name}` = {value} {why}; remove it (a request is never answered with a field ignored)"))
        })
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptField,
    #[serde(default, deserialize_with = "null_is_false")]
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
    /// Other message fields (`name`, …): refused unless listed no-ops
    /// (`unsupported_message_field`).
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
    /// vLLM's: end the prompt with the template's assistant header (default) or not.
    pub add_generation_prompt: Option<bool>,
    /// vLLM's: the last message (an assistant's) is left open and the reply continues it.
    pub continue_final_message: Option<bool>,
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

    /// Known fields land in their places; the others are refused by name unless listed
    /// with the value sent. A value that merely looks like a default is not enough.
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
            r#""store": false"#,
            r#""frobnicate": null"#,
            r#""add_generation_prompt": false"#,
            r#""skip_special_tokens": false"#,
            r#""prompt_logprobs": 0"#,
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
            (r#""frobnicate": false"#, "frobnicate"),
            (r#""frobnicate": """#, "frobnicate"),
            (
                r#""include_stop_str_in_output": true"#,
                "include_stop_str_in_output",
            ),
            (
                r#""spaces_between_special_tokens": false"#,
                "spaces_between_special_tokens",
            ),
            (r#""truncate_prompt_tokens": 0"#, "truncate_prompt_tokens"),
        ] {
            let (field, message) =
                unsupported_field(&fields(&format!("{{{base}, {asks}}}"))).expect(asks);
            assert_eq!(field, name);
            assert!(message.contains(name), "{message}");
        }
        let msg: ChatMessageIn =
            serde_json::from_str(r#"{"role": "user", "content": "hi", "name": "bob"}"#).unwrap();
        assert_eq!(
            unsupported_message_field(&msg.other).map(|f| f.0),
            Some("name".to_string())
        );
        let echoed: ChatMessageIn = serde_json::from_str(
            r#"{"role": "assistant", "content": "hi", "refusal": null, "annotations": []}"#,
        )
        .unwrap();
        assert_eq!(unsupported_message_field(&echoed.other), None);
    }
}
