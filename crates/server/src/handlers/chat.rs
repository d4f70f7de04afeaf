//! `POST /v1/chat/completions`.

use serde_json::Map;

use super::*;

/// Message `i`'s text. A list of text parts is joined with newlines, as vLLM joins them
/// for a template that takes a string: joined with nothing, `["Say", "hi"]` became "Sayhi".
fn message_text(i: usize, content: &Option<Value>) -> Result<String, ApiError> {
    let at = || format!("messages[{i}].content");
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for p in parts {
                // A part's other keys (`cache_control`, …) would be dropped, so a part is
                // exactly `{"type": "text", "text": …}`.
                if let Some(k) = p
                    .as_object()
                    .and_then(|o| o.keys().find(|k| !matches!(k.as_str(), "type" | "text")))
                {
                    return Err(ApiError::at(
                        at(),
                        format!("content part key `{k}` is not supported; a part is {{\"type\": \"text\", \"text\": …}}"),
                    ));
                }
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => texts.push(t),
                    _ => return Err(ApiError::at(at(), "only text content parts are supported")),
                }
            }
            Ok(texts.join("\n"))
        }
        Some(_) => Err(ApiError::at(
            at(),
            "message content must be a string or a list of text parts",
        )),
    }
}

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Json<Value>, JsonRejection>,
) -> Result<Response, ApiError> {
    check_ready(&state)?;
    let req: ChatRequest = super::body::typed(body, state.limits.max_request_body_bytes)?;
    let tools = super::tools::parse(&req.tools, &req.tool_choice, req.parallel_tool_calls)?;
    let (req, tools, prompt_ids) = {
        let st = state.clone();
        let work = move || prompt_ids(&st, &req, tools.as_ref()).map(|ids| (req, tools, ids));
        state.offload.prompt(work).await??
    };
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
    let wants_logprobs = params.logprobs.is_some();
    let usage_mode = StreamUsage::of(&req.common);
    let include_usage = usage_mode.at_end;
    let salt = req.common.cache_salt.clone();
    let s = submit(&state, prompt_ids, params, salt, "messages").await?;
    if req.common.stream && !tools_active {
        return Ok(stream_response(
            Kind::Chat,
            s,
            state.model_name.clone(),
            usage_mode,
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
            let (message, finish) = reply(o, tools.as_ref().filter(|t| t.active()));
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
        let every_chunk = usage_mode.every_chunk.then(|| {
            let tokens: Vec<usize> = outputs.iter().map(|o| o.token_ids.len()).collect();
            (prompt_tokens, tokens)
        });
        return Ok(buffered_stream(
            &state.model_name,
            choices,
            include_usage.then_some(usage),
            every_chunk,
        )
        .into_response());
    }
    let mut body = json!({
        "id": new_id("chatcmpl"), "object": "chat.completion", "created": now_unix(), "model": state.model_name,
        "choices": choices.into_iter().map(|c| c.0).collect::<Vec<_>>(),
        "usage": usage,
    });
    // vLLM puts the prompt's logprobs beside the choices (the prompt is theirs in common).
    if req.common.prompt_logprobs.is_some() {
        let first = outputs.iter().find(|o| o.choice == 0);
        body["prompt_logprobs"] = first.map_or(Value::Null, |o| {
            crate::logprobs::prompt(&state.tokenizer, &o.prompt_logprobs)
        });
    }
    Ok(Json(body).into_response())
}

/// The request's prompt as token ids: its messages checked, rendered through the chat
/// template and tokenized. It runs on the blocking pool: a 4 MiB prompt takes a while.
fn prompt_ids(
    state: &AppState,
    req: &ChatRequest,
    tools: Option<&super::tools::Tools>,
) -> Result<Vec<u32>, ApiError> {
    let msgs = messages(req, state)?;
    let kwargs = template_kwargs(state, req.chat_template_kwargs.as_ref())?;
    let ending = prompt_ending(req)?;
    let prompt = render(state, msgs, tools, &kwargs, ending)?;
    Ok(super::encode_text(
        &state.tokenizer,
        &prompt,
        req.common.add_special_tokens,
    ))
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
    for (i, m) in req.messages.iter().enumerate() {
        check_message(i, m)?;
        let role = if m.role == "developer" {
            "system"
        } else {
            m.role.as_str()
        };
        let mut msg = ChatMessage::new(role, &message_text(i, &m.content)?);
        msg.tool_calls = m.tool_calls.clone().filter(|c| !c.is_null());
        if let Some(calls) = &msg.tool_calls {
            super::tools::check_history_calls(calls)?;
        }
        msg.tool_call_id = m.tool_call_id.clone();
        msgs.push(msg);
    }
    Ok(msgs)
}

/// Message `i`'s role and fields: each refusal names the field by its path.
fn check_message(i: usize, m: &crate::openai::ChatMessageIn) -> Result<(), ApiError> {
    let at = |field: &str| format!("messages[{i}].{field}");
    if !matches!(
        m.role.as_str(),
        "system" | "user" | "assistant" | "developer" | "tool"
    ) {
        return Err(ApiError::at(
            at("role"),
            format!("unsupported role {:?}", m.role),
        ));
    }
    if let Some((name, message)) = crate::openai::unsupported_message_field(&m.other) {
        return Err(ApiError::at(at(&name), format!("message field {message}")));
    }
    if m.tool_calls.as_ref().is_some_and(|c| !c.is_null()) && m.role != "assistant" {
        return Err(ApiError::at(
            at("tool_calls"),
            "only assistant messages carry tool_calls",
        ));
    }
    match (m.role == "tool", m.tool_call_id.is_some()) {
        (true, false) => Err(ApiError::at(
            at("tool_call_id"),
            "a tool message needs tool_call_id",
        )),
        // The templates render it only on a tool message, so elsewhere it would be ignored.
        (false, true) => Err(ApiError::at(
            at("tool_call_id"),
            "only tool messages carry tool_call_id",
        )),
        _ => Ok(()),
    }
}

/// The prompt: the template with the tools where it reads them; otherwise the tools in a
/// system turn of ours when a grammar forces the call.
fn render(
    state: &AppState,
    mut msgs: Vec<ChatMessage>,
    tools: Option<&super::tools::Tools>,
    kwargs: &Map<String, Value>,
    ending: PromptEnding,
) -> Result<String, ApiError> {
    let failed = |e: pk_tokenizer::TokenizerError| {
        ApiError::param("messages", format!("chat template failed: {e}"))
    };
    let template = &state.chat_template;
    if !template.source().contains("tool_calls") {
        super::tools::inline_history_calls(&mut msgs);
    }
    let gen_prompt = ending == PromptEnding::GenerationPrompt;
    let open_tail = |text: String, msgs: &[ChatMessage]| match ending {
        PromptEnding::OpenFinalMessage => open_final_message(text, msgs),
        _ => Ok(text),
    };
    let Some(t) = tools.filter(|t| t.active()) else {
        let text = template
            .render_with_kwargs(&msgs, None, gen_prompt, kwargs)
            .map_err(failed)?;
        return open_tail(text, &msgs);
    };
    if template.renders_tools() {
        let text = template
            .render_with_kwargs(&msgs, Some(&t.defs), gen_prompt, kwargs)
            .map_err(failed)?;
        return open_tail(text, &msgs);
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
    let text = template
        .render_with_kwargs(&msgs, None, gen_prompt, kwargs)
        .map_err(failed)?;
    open_tail(text, &msgs)
}

/// How the rendered prompt ends: vLLM's `add_generation_prompt` (default true) and
/// `continue_final_message` (default false).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PromptEnding {
    /// The template's assistant header: the reply is a new turn.
    GenerationPrompt,
    /// The last message closed as the template closes it, nothing after.
    Closed,
    /// The last (assistant) message left open: the reply continues its text.
    OpenFinalMessage,
}

fn prompt_ending(req: &ChatRequest) -> Result<PromptEnding, ApiError> {
    let add_gen = req.add_generation_prompt.unwrap_or(true);
    match (req.continue_final_message.unwrap_or(false), add_gen) {
        (false, true) => Ok(PromptEnding::GenerationPrompt),
        (false, false) => Ok(PromptEnding::Closed),
        (true, true) => Err(ApiError::param(
            "continue_final_message",
            "continue_final_message needs add_generation_prompt: false (a new assistant turn cannot also continue the last one)",
        )),
        (true, false) => match req.messages.last().map(|m| m.role.as_str()) {
            Some("assistant") => Ok(PromptEnding::OpenFinalMessage),
            _ => Err(ApiError::param(
                "continue_final_message",
                "continue_final_message needs the last message to be the assistant's",
            )),
        },
    }
}

/// The rendered prompt cut right after the last message's text, so that the template's
/// end-of-turn is gone and the model continues that text (as transformers'
/// `continue_final_message`: the text itself, or stripped where the template strips it).
fn open_final_message(text: String, msgs: &[ChatMessage]) -> Result<String, ApiError> {
    let last = msgs.last().map(|m| m.content.as_str()).unwrap_or("");
    let cut = [last, last.trim()]
        .into_iter()
        .filter(|t| !t.is_empty())
        .find_map(|t| text.rfind(t).map(|at| at + t.len()));
    match cut {
        Some(end) => Ok(text[..end].to_string()),
        None => Err(ApiError::param(
            "continue_final_message",
            "the final message's text does not appear in the rendered chat template (an empty final message cannot be continued)",
        )),
    }
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
/// the model may have written more). A forced call that `max_tokens` cut short is still a
/// call, with the arguments written so far and finish reason `length` (as OpenAI's), so a
/// client that forced a call never gets it back as text.
fn reply(o: &RequestOutput, tools: Option<&super::tools::Tools>) -> (Value, &'static str) {
    let finish = finish_str(o.finish_reason);
    let Some(tools) = tools else {
        return (json!({"role": "assistant", "content": o.text}), finish);
    };
    let (content, mut calls) = super::tools::parse_calls(&o.text);
    if !tools.parallel {
        calls.truncate(1);
    }
    let cut_short = o.finish_reason == FinishReason::Length;
    if cut_short && tools.grammar().is_some() {
        calls.extend(super::tools::truncated_call(&o.text, tools.forced_name()));
        let message = json!({"role": "assistant", "content": null, "tool_calls": calls});
        return (message, finish);
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
    every_chunk: Option<(usize, Vec<usize>)>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let (id, created) = (new_id("chatcmpl"), now_unix());
    let mut events = Vec::new();
    // `continuous_usage_stats`: each chunk carries its choice's usage (whole, as the reply
    // was generated before its first chunk went out).
    let chunk = |choice: Value| {
        let mut c = json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]});
        if let Some((prompt, tokens)) = &every_chunk {
            let i = choice["index"].as_u64().unwrap_or(0) as usize;
            c["usage"] = json!(Usage::new(*prompt, tokens.get(i).copied().unwrap_or(0), 0));
        }
        c
    };
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
