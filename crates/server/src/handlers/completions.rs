//! `POST /v1/completions`.

use super::*;

pub async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Json<CompletionRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    check_ready(&state)?;
    let Json(req) = body?;
    if req.echo {
        return Err(ApiError::param("echo", "echo is not supported"));
    }
    let prompt_ids = match &req.prompt {
        PromptField::Text(t) => state.tokenizer.encode_prompt(t, true),
        PromptField::Tokens(ids) => ids.clone(),
        PromptField::TextBatch(v) if v.len() == 1 => state.tokenizer.encode_prompt(&v[0], true),
        PromptField::TextBatch(_) => {
            return Err(ApiError::param(
                "prompt",
                "only one prompt per request is supported",
            ))
        }
    };
    if prompt_ids.is_empty() {
        return Err(ApiError::param("prompt", "the prompt is empty"));
    }
    let params = generate_params(&req.common, "prompt", prompt_ids.len(), Some(16), &state)?;
    let wants_logprobs = params.logprobs.is_some();
    let include_usage = req
        .common
        .stream_options
        .as_ref()
        .is_some_and(|o| o.include_usage);
    let s = submit(&state, prompt_ids, params, req.common.cache_salt.clone()).await?;
    if req.common.stream {
        return Ok(stream_response(
            Kind::Completion,
            s,
            state.model_name.clone(),
            include_usage,
            wants_logprobs.then(|| state.tokenizer.clone()),
        )
        .into_response());
    }
    let prompt_tokens = s.prompt_tokens;
    let outputs = collect(s, &state.model_name).await?;
    let choices: Vec<Value> = outputs
        .iter()
        .map(|o| {
            json!({"index": o.choice, "text": o.text, "logprobs": match wants_logprobs {
                true => crate::logprobs::completion(&state.tokenizer, &o.logprobs, 0),
                false => Value::Null,
            }, "finish_reason": finish_str(o.finish_reason)})
        })
        .collect();
    Ok(Json(json!({
        "id": new_id("cmpl"), "object": "text_completion", "created": now_unix(), "model": state.model_name,
        "choices": choices,
        "usage": usage_of(prompt_tokens, &outputs),
    }))
    .into_response())
}
