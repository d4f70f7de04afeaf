//! `POST /v1/chat/completions`.

use serde_json::Map;

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
    let tools = super::tools::parse(&req.tools, &req.tool_choice, req.parallel_tool_calls)?;
    let msgs = messages(&req, &state)?;
    let kwargs = template_kwargs(&state, req.chat_template_kwargs.as_ref())?;
    let prompt = render(&state, msgs, tools.as_ref(), &kwargs)?;
    let prompt_ids = state.tokenizer.encode_prompt(&prompt, true);
    let mut params = generate_params(&req.common, "messages", prompt_ids.len(), None, &state)?;
    if let Some(g) = tools.as_ref().and_then(|t| t.grammar()) {
        if let Some(other) = &params.grammar {
            return Err(ApiError::param(
                other.param,
                format!(
                    "tool_choice and {} both constrain the output; give one",
                    other.param
                ),
            ));
        }
        params.grammar = Some(g);
    }
    let tools_active = tools.as_ref().is_some_and(|t| t.active());
    let parallel_calls = tools.as_ref().is_none_or(|t| t.parallel);
    let wants_logprobs = params.logprobs.is_some();
    let include_usage = req
        .common
        .stream_options
        .as_ref()
        .is_some_and(|o| o.include_usage);
    let s = submit(&state, prompt_ids, params, req.common.cache_salt.clone()).await?;
    if req.common.stream && !tools_active {
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
    let outputs = collect(s).await?;
    let choices: Vec<(Value, &'static str)> = outputs
        .iter()
        .map(|o| {
            let (message, finish) = reply(o, tools_active, parallel_calls);
            let lp = match wants_logprobs {
                true => crate::logprobs::chat(&state.tokenizer, &o.logprobs),
                false => Value::Null,
            };
            (json!({"index": o.choice, "message": message, "logprobs": lp, "finish_reason": finish}), finish)
        })
        .collect();
    let usage = usage_of(prompt_tokens, &outputs);
    if req.common.stream {
        // With tools, a reply is parsed whole; it is then sent as one delta per choice.
        return Ok(
            buffered_stream(&state.model_name, choices, include_usage.then_some(usage))
                .into_response(),
        );
    }
    Ok(Json(json!({
        "id": new_id("chatcmpl"), "object": "chat.completion", "created": now_unix(), "model": state.model_name,
        "choices": choices.into_iter().map(|c| c.0).collect::<Vec<_>>(),
        "usage": usage,
    }))
    .into_response())
}

/// The request's messages for the template, each checked.
fn messages(req: &ChatRequest, state: &AppState) -> Result<Vec<ChatMessage>, ApiError> {
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
            "system" | "user" | "assistant" | "developer" | "tool"
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
        if m.tool_calls.as_ref().is_some_and(|c| !c.is_null()) && m.role != "assistant" {
            return Err(ApiError::param(
                "messages",
                "only assistant messages carry tool_calls",
            ));
        }
        if m.role == "tool" && m.tool_call_id.is_none() {
            return Err(ApiError::param(
                "messages",
                "a tool message needs tool_call_id",
            ));
        }
        let role = if m.role == "developer" {
            "system"
        } else {
            m.role.as_str()
        };
        let mut msg = ChatMessage::new(role, &message_text(&m.content)?);
        msg.tool_calls = m.tool_calls.clone().filter(|c| !c.is_null());
        msg.tool_call_id = m.tool_call_id.clone();
        msgs.push(msg);
    }
    Ok(msgs)
}

/// The prompt: the template with the tools where it reads them; otherwise the tools in a
/// system turn of ours when a grammar forces the call.
fn render(
    state: &AppState,
    mut msgs: Vec<ChatMessage>,
    tools: Option<&super::tools::Tools>,
    kwargs: &Map<String, Value>,
) -> Result<String, ApiError> {
    let failed = |e: pk_tokenizer::TokenizerError| {
        ApiError::param("messages", format!("chat template failed: {e}"))
    };
    let template = &state.chat_template;
    let Some(t) = tools.filter(|t| t.active()) else {
        return template
            .render_with_kwargs(&msgs, None, true, kwargs)
            .map_err(failed);
    };
    if template.renders_tools() {
        return template
            .render_with_kwargs(&msgs, Some(&t.defs), true, kwargs)
            .map_err(failed);
    }
    if t.grammar().is_none() {
        return Err(ApiError::param(
            "tool_choice",
            "this model's chat template cannot describe tools, so with tool_choice auto the model would not know them; use tool_choice required or a named function",
        ));
    }
    match msgs.first_mut().filter(|m| m.role == "system") {
        Some(system) => system.content = format!("{}\n\n{}", system.content, t.system_text()),
        None => msgs.insert(0, ChatMessage::new("system", t.system_text())),
    }
    template
        .render_with_kwargs(&msgs, None, true, kwargs)
        .map_err(failed)
}

/// `chat_template_kwargs`, each entry checked: one the template never reads would be
/// accepted and ignored, and one the renderer sets itself (`messages`, …) would be
/// overridden, so both are refused by name.
fn template_kwargs(
    state: &AppState,
    kwargs: Option<&Map<String, Value>>,
) -> Result<Map<String, Value>, ApiError> {
    let Some(kwargs) = kwargs else {
        return Ok(Map::new());
    };
    if kwargs.len() > 32 {
        return Err(ApiError::param(
            "chat_template_kwargs",
            "at most 32 entries",
        ));
    }
    for name in kwargs.keys() {
        if pk_tokenizer::RESERVED_VARIABLES.contains(&name.as_str()) {
            return Err(ApiError::param(
                "chat_template_kwargs",
                format!("`{name}` is set from the request itself and cannot be a template keyword argument"),
            ));
        }
        if !state.chat_template.reads_variable(name) {
            return Err(ApiError::param(
                "chat_template_kwargs",
                format!("this model's chat template does not read `{name}`; remove it (a request is never answered with a field ignored)"),
            ));
        }
    }
    Ok(kwargs.clone())
}

/// One choice's message and finish reason; with tools, its calls parsed out of the text
/// (only the first without `parallel_tool_calls`: `auto` is not grammar-constrained, so
/// the model may have written more).
fn reply(o: &RequestOutput, tools_active: bool, parallel_calls: bool) -> (Value, &'static str) {
    let finish = finish_str(o.finish_reason);
    if !tools_active {
        return (json!({"role": "assistant", "content": o.text}), finish);
    }
    let (content, mut calls) = super::tools::parse_calls(&o.text);
    if !parallel_calls {
        calls.truncate(1);
    }
    if calls.is_empty() {
        return (json!({"role": "assistant", "content": o.text}), finish);
    }
    (
        json!({"role": "assistant", "content": content, "tool_calls": calls}),
        "tool_calls",
    )
}

/// A finished reply as an SSE stream of OpenAI chunks: per choice its role, its content
/// or tool calls (with `index`), its finish; then the usage if asked for.
fn buffered_stream(
    model: &str,
    choices: Vec<(Value, &'static str)>,
    usage: Option<Usage>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let (id, created) = (new_id("chatcmpl"), now_unix());
    let mut events = Vec::new();
    let chunk = |choice: Value| json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]});
    for (c, finish) in &choices {
        let index = c["index"].clone();
        let m = &c["message"];
        let mut delta = json!({"role": "assistant", "content": m["content"]});
        if let Some(calls) = m.get("tool_calls").and_then(Value::as_array) {
            let calls: Vec<Value> = calls
                .iter()
                .enumerate()
                .map(|(i, call)| {
                    let mut call = call.clone();
                    call["index"] = json!(i);
                    call
                })
                .collect();
            delta["tool_calls"] = json!(calls);
        }
        events.push(chunk(json!({"index": index, "delta": delta, "logprobs": c["logprobs"], "finish_reason": null})));
        events.push(chunk(
            json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": finish}),
        ));
    }
    if let Some(u) = usage {
        events.push(json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [], "usage": u}));
    }
    let mut events: Vec<Result<Event, Infallible>> = events
        .into_iter()
        .map(|v| Ok(Event::default().data(v.to_string())))
        .collect();
    events.push(Ok(Event::default().data("[DONE]")));
    Sse::new(futures::stream::iter(events))
}
