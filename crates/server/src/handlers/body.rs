//! A request body to its typed request, with the offending field named.
//!
//! NOTE 1: both requests flatten `CommonParams` into themselves, and serde deserializes a
//! flattened struct from a buffered copy of the leftover keys, which forgets where a value
//! sat: `"temperature": "hot"` failed as "invalid type: string, expected f32" with no field,
//! and `param: null`. The body is therefore parsed to JSON first and typed with
//! `serde_path_to_error`, which names the path of every field deserialized directly; when the
//! path is lost inside a flattened struct, each top-level key is typed alone as
//! `CommonParams` (all of whose fields are optional, so a key alone fails only for its own
//! value) to find the one at fault.

use axum::extract::rejection::JsonRejection;
use axum::http::StatusCode;
use axum::Json;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::ApiError;
use crate::openai::CommonParams;

/// The typed request of `body`, or a 400 naming the field at fault (a 413 naming the limit
/// when the body is over `limit_bytes`).
pub(super) fn typed<T: DeserializeOwned>(
    body: Result<Json<Value>, JsonRejection>,
    limit_bytes: usize,
) -> Result<T, ApiError> {
    let Json(value) = body.map_err(|r| rejection(r, limit_bytes))?;
    let error = match serde_path_to_error::deserialize::<_, T>(&value) {
        Ok(typed) => return Ok(typed),
        Err(e) => e,
    };
    let (mut param, inner) = match path_of(&error) {
        Some(path) => (Some(path), error.inner().to_string()),
        None => match flattened_culprit(&value) {
            Some((path, message)) => (Some(path), message),
            None => (None, error.inner().to_string()),
        },
    };
    // A missing field's path ends at the object that lacks it: the field itself is named
    // only in the message (`missing field `prompt``), so it is added to the path.
    if let Some(field) = missing_field(&inner) {
        param = Some(match param {
            Some(object) => format!("{object}.{field}"),
            None => field.to_string(),
        });
    }
    let message = match &param {
        Some(p) => format!("`{p}`: {inner}"),
        None => format!("malformed request body: {inner}"),
    };
    Err(ApiError {
        status: StatusCode::BAD_REQUEST,
        message,
        param,
    })
}

/// The field serde's "missing field `X`" names, if that is the error.
fn missing_field(message: &str) -> Option<&str> {
    let rest = message.strip_prefix("missing field `")?;
    rest.split('`').next().filter(|f| !f.is_empty())
}

/// The error's path, unless it is the body itself (a flattened struct's field reports none).
fn path_of(error: &serde_path_to_error::Error<serde_json::Error>) -> Option<String> {
    let path = error.path().to_string();
    (path != "." && !path.is_empty()).then_some(path)
}

/// The first top-level key whose value alone does not type as `CommonParams`, with its
/// full path (`stream_options.include_usage`) and the reason.
fn flattened_culprit(value: &Value) -> Option<(String, String)> {
    let object = value.as_object()?;
    object.iter().find_map(|(key, v)| {
        let mut alone = serde_json::Map::new();
        alone.insert(key.clone(), v.clone());
        let error =
            serde_path_to_error::deserialize::<_, CommonParams>(Value::Object(alone)).err()?;
        let path = path_of(&error).unwrap_or_else(|| key.clone());
        Some((path, error.inner().to_string()))
    })
}

fn rejection(r: JsonRejection, limit_bytes: usize) -> ApiError {
    if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!(
                "the request body is larger than this server's limit of {limit_bytes} bytes"
            ),
            param: None,
        };
    }
    ApiError::from(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::{ChatRequest, CompletionRequest};
    use serde_json::json;

    fn param_of<T: DeserializeOwned + std::fmt::Debug>(body: Value) -> (Option<String>, String) {
        let e = typed::<T>(Ok(Json(body)), 1 << 20).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        (e.param, e.message)
    }

    #[test]
    fn a_flattened_field_of_the_wrong_type_is_named() {
        let msgs = json!([{"role": "user", "content": "hi"}]);
        for (key, value) in [
            ("temperature", json!("hot")),
            ("max_tokens", json!("5")),
            ("n", json!("2")),
            ("seed", json!("x")),
            ("stop", json!(5)),
            ("cache_salt", json!(5)),
        ] {
            let (param, message) = param_of::<ChatRequest>(json!({"messages": msgs, key: value}));
            assert_eq!(param.as_deref(), Some(key), "{message}");
            assert!(message.starts_with(&format!("`{key}`")), "{message}");
        }
    }

    #[test]
    fn a_nested_flattened_field_is_named_by_its_path() {
        let (param, message) = param_of::<CompletionRequest>(
            json!({"prompt": "x", "stream_options": {"include_usage": 3}}),
        );
        assert_eq!(
            param.as_deref(),
            Some("stream_options.include_usage"),
            "{message}"
        );
    }

    #[test]
    fn a_request_field_of_the_wrong_type_is_named() {
        let (param, _) = param_of::<CompletionRequest>(json!({"prompt": "x", "echo": "yes"}));
        assert_eq!(param.as_deref(), Some("echo"));
        let (param, _) = param_of::<ChatRequest>(json!({"messages": "hi"}));
        assert_eq!(param.as_deref(), Some("messages"));
    }

    #[test]
    fn a_missing_field_is_named_by_its_path() {
        let (param, message) = param_of::<CompletionRequest>(json!({"max_tokens": 3}));
        assert_eq!(param.as_deref(), Some("prompt"), "{message}");
        let (param, message) = param_of::<ChatRequest>(json!({"messages": [{"content": "hi"}]}));
        assert_eq!(param.as_deref(), Some("messages[0].role"), "{message}");
    }

    #[test]
    fn null_stands_for_an_absent_flag() {
        let r: CompletionRequest = typed(
            Ok(Json(
                json!({"prompt": "x", "echo": null, "stream": null, "ignore_eos": null,
                "stream_options": {"include_usage": null, "continuous_usage_stats": null}}),
            )),
            1 << 20,
        )
        .unwrap();
        assert!(!r.echo && !r.common.stream && !r.common.ignore_eos);
        let o = r.common.stream_options.unwrap();
        assert!(!o.include_usage && !o.continuous_usage_stats);
    }
}
