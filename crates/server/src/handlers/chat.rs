//! `POST /v1/chat/completions`.

use super::*;

fn message_text(content: &Option<Value>) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for p in parts {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    _ => {
                        return Err(ApiError::param(
                            "messages",
                            "only text content parts are supported",
                        ))
                    }
                }
            }
            Ok(out)
        }
        Some(_) => Err(ApiError::param(
            "messages",
            "message content must be a string or a list of text parts",
        )),
    }
}

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Json<ChatRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    check_ready(&state)?;
    let Json(req) = body?;
    if req.messages.is_empty() {
        return Err(ApiError::param("messages", "messages must not be empty"));
    }
    if req.messages.len() > state.limits.max_messages {
        return Err(ApiError::param(
            "messages",
            format!(
                "at most {} messages are supported",
                state.limits.max_messages
            ),
        ));
    }
    let mut msgs = Vec::with_capacity(req.messages.len());
    for m in &req.messages {
        if !matches!(
            m.role.as_str(),
            "system" | "user" | "assistant" | "developer"
        ) {
            return Err(ApiError::param(
                "messages",
                format!("unsupported role {:?}", m.role),
            ));
        }
        if let Some((name, message)) = crate::openai::unsupported_field(&m.other) {
            return Err(ApiError::param(
                "messages",
                format!("message field {message}; `{name}`"),
            ));
        }
        let role = if m.role == "developer" {
            "system"
        } else {
            m.role.as_str()
        };
        msgs.push(ChatMessage::new(role, &message_text(&m.content)?));
    }
    let prompt = state
        .chat_template
        .render(&msgs, true)
        .map_err(|e| ApiError::param("messages", format!("chat template failed: {e}")))?;
    let prompt_ids = state.tokenizer.encode_prompt(&prompt, true);
    let params = generate_params(&req.common, "messages", prompt_ids.len(), None, &state)?;
    let wants_logprobs = params.logprobs.is_some();
    let include_usage = req
        .common
        .stream_options
        .as_ref()
        .is_some_and(|o| o.include_usage);
    let s = submit(&state, prompt_ids, params, req.common.cache_salt.clone()).await?;
    if req.common.stream {
        return Ok(stream_response(
            Kind::Chat,
            s,
            state.model_name.clone(),
            include_usage,
            wants_logprobs.then(|| state.tokenizer.clone()),
            Vec::new(),
        )
        .into_response());
    }
    let prompt_tokens = s.prompt_tokens;
    let outputs = collect(s, &state.model_name).await?;
    let choices: Vec<Value> = outputs
        .iter()
        .map(|o| {
            json!({"index": o.choice, "message": {"role": "assistant", "content": o.text}, "logprobs": match wants_logprobs {
                true => crate::logprobs::chat(&state.tokenizer, &o.logprobs),
                false => Value::Null,
            }, "finish_reason": finish_str(o.finish_reason)})
        })
        .collect();
    Ok(Json(json!({
        "id": new_id("chatcmpl"), "object": "chat.completion", "created": now_unix(), "model": state.model_name,
        "choices": choices,
        "usage": usage_of(prompt_tokens, &outputs),
    }))
    .into_response())
}
