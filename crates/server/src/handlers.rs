//! HTTP handlers: validation, tokenization, submission, and response shaping (JSON or SSE).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::Stream;
use pk_engine::{
    FinishReason, GenerateParams, Request, RequestError, RequestOutput, SamplingParams, SeqEvent,
    SubmitError,
};

use crate::engine_thread::EngineState;
use pk_tokenizer::ChatMessage;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::openai::{
    ChatRequest, CommonParams, CompletionRequest, ErrorBody, ErrorDetail, PromptField, Usage,
};
use crate::AppState;

pub struct ApiError {
    status: StatusCode,
    message: String,
    param: Option<String>,
}

impl ApiError {
    fn bad(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: None,
        }
    }
    fn param(param: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.to_string()),
        }
    }
}

impl ApiError {
    /// OpenAI's error `type` for this status.
    fn error_type(&self) -> &'static str {
        match self.status {
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable",
            s if s.is_server_error() => "internal_error",
            _ => "invalid_request_error",
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = self.error_type();
        let body = ErrorBody {
            error: ErrorDetail {
                message: self.message,
                kind: kind.into(),
                param: self.param,
                code: Some(self.status.as_u16()),
            },
        };
        let mut response = (self.status, Json(body)).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            // The queue drains in about a step; clients that honour it back off that long.
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        response
    }
}

/// Unknown paths: an OpenAI-style JSON 404, not an empty body.
pub async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("no route for {}", uri.path()),
        param: None,
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> ApiError {
        // axum answers 422 for well-formed JSON of the wrong shape; OpenAI-compatible
        // servers (vLLM, llama-server) answer 400 for every malformed body.
        let status = match r.status() {
            StatusCode::PAYLOAD_TOO_LARGE | StatusCode::UNSUPPORTED_MEDIA_TYPE => r.status(),
            _ => StatusCode::BAD_REQUEST,
        };
        ApiError {
            status,
            message: format!("malformed request body: {}", r.body_text()),
            param: None,
        }
    }
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn new_id(prefix: &str) -> String {
    format!(
        "{prefix}-{:016x}{:016x}",
        rand::random::<u64>(),
        rand::random::<u64>()
    )
}

fn finish_str(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

fn check_ready(state: &AppState) -> Result<(), ApiError> {
    let unavailable = |m: &str| {
        Err(ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: m.into(),
            param: None,
        })
    };
    match state.engine.state() {
        EngineState::Ready => Ok(()),
        EngineState::Loading => unavailable("the model is still loading"),
        EngineState::Dead => {
            unavailable("the engine has stopped after an internal error; restart the server")
        }
    }
}

/// The HTTP status and OpenAI error type of a request the engine failed after accepting it.
fn request_error(e: &RequestError) -> ApiError {
    let status = match e {
        RequestError::TooLarge(_) => StatusCode::BAD_REQUEST,
        RequestError::CacheFull(_) => StatusCode::SERVICE_UNAVAILABLE,
        RequestError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    ApiError {
        status,
        message: e.to_string(),
        param: None,
    }
}

/// Turns the shared request fields into engine parameters, validating every one.
/// `prompt_param` names the prompt's field in errors (`prompt` or `messages`).
fn generate_params(
    c: &CommonParams,
    prompt_param: &'static str,
    prompt_tokens: usize,
    default_max_tokens: Option<usize>,
    state: &AppState,
) -> Result<GenerateParams, ApiError> {
    if let Some(m) = &c.model {
        if m != &state.model_name {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!(
                    "the model `{m}` does not exist; this server serves `{}`",
                    state.model_name
                ),
                param: Some("model".into()),
            });
        }
    }
    if let Some((name, message)) = crate::openai::unsupported_field(&c.other) {
        return Err(ApiError {
            status: StatusCode::BAD_REQUEST,
            message,
            param: Some(name),
        });
    }
    let n = match c.n {
        None => 1,
        Some(n) if (1..=pk_engine::MAX_CHOICES as i64).contains(&n) => n as usize,
        Some(n) => {
            return Err(ApiError::param(
                "n",
                format!("n must be in [1, {}], got {n}", pk_engine::MAX_CHOICES),
            ))
        }
    };
    let kv_policy = match &c.kv_policy {
        Some(p) => Some(
            p.parse::<pk_kv::PolicySpec>()
                .map_err(|e| ApiError::param("kv_policy", e.to_string()))?,
        ),
        None => None,
    };
    let kv_budget = match c.kv_budget {
        Some(b) if b <= 0 || b > u32::MAX as i64 => {
            return Err(ApiError::param(
                "kv_budget",
                format!("kv_budget must be a positive number of tokens, got {b}"),
            ))
        }
        Some(b) => Some(b as u32),
        None => None,
    };
    let kv_granularity = match &c.kv_granularity {
        Some(g) => Some(
            g.parse::<pk_kv::KvGranularity>()
                .map_err(|e| ApiError::param("kv_granularity", e.to_string()))?,
        ),
        None => None,
    };
    let limit = state.limits.max_total_tokens;
    if prompt_tokens >= limit {
        return Err(ApiError::param(prompt_param, format!("This model's maximum context length is {limit} tokens. However, your prompt has {prompt_tokens} tokens.")));
    }
    let max_tokens = match c.max_completion_tokens.or(c.max_tokens) {
        Some(m) if m < 1 => {
            return Err(ApiError::param(
                "max_tokens",
                format!("max_tokens must be at least 1, got {m}"),
            ))
        }
        Some(m) => m as usize,
        None => default_max_tokens.unwrap_or(limit - prompt_tokens),
    };
    if prompt_tokens + max_tokens > limit {
        return Err(ApiError::param(
            "max_tokens",
            format!("This model's maximum context length is {limit} tokens. However, you requested {} tokens ({prompt_tokens} in the prompt, {max_tokens} for the completion).", prompt_tokens + max_tokens),
        ));
    }
    let logit_bias = match &c.logit_bias {
        Some(map) => {
            if map.len() > 300 {
                return Err(ApiError::param("logit_bias", "at most 300 biased tokens"));
            }
            let mut v = Vec::with_capacity(map.len());
            for (id, &bias) in map {
                let id: u32 = id.parse().map_err(|_| {
                    ApiError::param(
                        "logit_bias",
                        format!("logit_bias keys are token ids, got {id:?}"),
                    )
                })?;
                v.push((id, bias));
            }
            v
        }
        None => Vec::new(),
    };
    let sampling = SamplingParams {
        temperature: c.temperature.unwrap_or(1.0),
        top_k: match c.top_k {
            None | Some(-1) => 0,
            Some(k) if k < 0 => {
                return Err(ApiError::param(
                    "top_k",
                    format!("top_k must be -1 or >= 0, got {k}"),
                ))
            }
            Some(k) => k as usize,
        },
        top_p: c.top_p.unwrap_or(1.0),
        min_p: c.min_p.unwrap_or(0.0),
        seed: c.seed.map(|s| s as u64),
        presence_penalty: c.presence_penalty.unwrap_or(0.0),
        frequency_penalty: c.frequency_penalty.unwrap_or(0.0),
        repetition_penalty: c.repetition_penalty.unwrap_or(1.0),
        logit_bias,
    };
    sampling
        .validate()
        .map_err(|e| ApiError::param(e.param, e.message))?;
    let logprobs = requested_logprobs(c, prompt_param)?;
    let min_tokens = match c.min_tokens {
        None => 0,
        Some(m) if m < 0 || m as usize > max_tokens => {
            return Err(ApiError::param(
                "min_tokens",
                format!("min_tokens must be in [0, max_tokens = {max_tokens}], got {m}"),
            ))
        }
        Some(m) => m as usize,
    };
    let stop = c.stop.clone().map(|s| s.into_vec()).unwrap_or_default();
    if stop.len() > 16 {
        return Err(ApiError::param(
            "stop",
            "at most 16 stop strings are supported",
        ));
    }
    Ok(GenerateParams {
        sampling,
        max_tokens,
        stop,
        ignore_eos: c.ignore_eos,
        kv_policy,
        kv_budget,
        kv_granularity,
        min_tokens,
        logprobs,
        n,
        grammar: requested_grammar(c)?,
        ..Default::default()
    })
}

/// The grammar a request constrains its output to: OpenAI's `response_format` or one of
/// vLLM's `guided_*` fields (at most one of them).
fn requested_grammar(c: &CommonParams) -> Result<Option<pk_engine::Grammar>, ApiError> {
    use pk_engine::{Grammar, GrammarSpec};
    let mut found: Vec<Grammar> = Vec::new();
    if let Some(rf) = &c.response_format {
        match rf.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some("json_object") => found.push(Grammar {
                spec: GrammarSpec::JsonObject,
                param: "response_format",
            }),
            Some("json_schema") => {
                let Some(schema) = rf.pointer("/json_schema/schema").filter(|s| s.is_object())
                else {
                    return Err(ApiError::param(
                        "response_format",
                        "response_format json_schema needs json_schema.schema, an object",
                    ));
                };
                found.push(Grammar {
                    spec: GrammarSpec::JsonSchema(schema.clone()),
                    param: "response_format",
                });
            }
            _ => {
                return Err(ApiError::param(
                    "response_format",
                    format!(
                        "response_format type must be text, json_object or json_schema, got {rf}"
                    ),
                ))
            }
        }
    }
    if let Some(schema) = &c.guided_json {
        let schema = match schema {
            // vLLM accepts the schema as a JSON string too.
            Value::String(s) => serde_json::from_str(s).map_err(|e| {
                ApiError::param("guided_json", format!("guided_json is not JSON: {e}"))
            })?,
            v => v.clone(),
        };
        found.push(Grammar {
            spec: GrammarSpec::JsonSchema(schema),
            param: "guided_json",
        });
    }
    if let Some(rx) = &c.guided_regex {
        found.push(Grammar {
            spec: GrammarSpec::Regex(rx.clone()),
            param: "guided_regex",
        });
    }
    if let Some(choices) = &c.guided_choice {
        if choices.is_empty() {
            return Err(ApiError::param("guided_choice", "guided_choice is empty"));
        }
        found.push(Grammar {
            spec: GrammarSpec::Choice(choices.clone()),
            param: "guided_choice",
        });
    }
    if let Some(lark) = &c.guided_grammar {
        found.push(Grammar {
            spec: GrammarSpec::Lark(lark.clone()),
            param: "guided_grammar",
        });
    }
    match found.len() {
        0 | 1 => Ok(found.pop()),
        _ => Err(ApiError::param(
            found[1].param,
            format!(
                "{} and {} both constrain the output; give one",
                found[0].param, found[1].param
            ),
        )),
    }
}

/// The alternatives per token a request asks for (`None`: no logprobs), in the endpoint's
/// own form: chat's `logprobs: true` with `top_logprobs`, completions' `logprobs: N`.
fn requested_logprobs(c: &CommonParams, prompt_param: &str) -> Result<Option<usize>, ApiError> {
    let max = pk_engine::MAX_LOGPROBS as i64;
    let chat = prompt_param == "messages";
    match (&c.logprobs, chat) {
        (None | Some(Value::Null) | Some(Value::Bool(false)), true) => match c.top_logprobs {
            None | Some(0) => Ok(None),
            Some(_) => Err(ApiError::param(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            )),
        },
        (Some(Value::Bool(true)), true) => match c.top_logprobs {
            None => Ok(Some(0)),
            Some(n) if (0..=max).contains(&n) => Ok(Some(n as usize)),
            Some(n) => Err(ApiError::param(
                "top_logprobs",
                format!("top_logprobs must be in [0, {max}], got {n}"),
            )),
        },
        (Some(v), true) => Err(ApiError::param(
            "logprobs",
            format!("logprobs is a boolean on /v1/chat/completions, got {v}"),
        )),
        (_, false) if c.top_logprobs.is_some() => Err(ApiError::param(
            "top_logprobs",
            "top_logprobs is a chat field; /v1/completions takes logprobs: N",
        )),
        (None | Some(Value::Null), false) => Ok(None),
        (Some(v), false) => match v.as_i64() {
            Some(n) if (0..=max).contains(&n) => Ok(Some(n as usize)),
            _ => Err(ApiError::param(
                "logprobs",
                format!("logprobs must be an integer in [0, {max}] on /v1/completions, got {v}"),
            )),
        },
    }
}

struct Submitted {
    rx: mpsc::UnboundedReceiver<SeqEvent>,
    prompt_tokens: usize,
    /// Choices the request asked for; each ends with its own `Finished`.
    n: usize,
}

async fn submit(
    state: &AppState,
    prompt_ids: Vec<u32>,
    params: GenerateParams,
    cache_salt: Option<String>,
) -> Result<Submitted, ApiError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let prompt_tokens = prompt_ids.len();
    let n = params.n;
    let req = Request {
        prompt_ids,
        params,
        cache_salt,
        sink: Box::new(move |e| tx.send(e).is_ok()),
    };
    state.engine.submit(req).await.map_err(|e| match e {
        SubmitError::QueueFull(_) => ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: e.to_string(),
            param: None,
        },
        SubmitError::Stopped => ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: e.to_string(),
            param: None,
        },
        SubmitError::Invalid(m) => ApiError::bad(m),
        SubmitError::InvalidParam { param, message } => ApiError::param(param, message),
    })?;
    Ok(Submitted {
        rx,
        prompt_tokens,
        n,
    })
}

/// Usage of a request's choices: the prompt counted once (it ran once), every choice's
/// tokens, and the first choice's cached prompt tokens (the others share its blocks).
fn usage_of(prompt_tokens: usize, outputs: &[RequestOutput]) -> Usage {
    Usage::new(
        prompt_tokens,
        outputs.iter().map(|o| o.token_ids.len()).sum(),
        outputs.first().map_or(0, |o| o.cached_prompt_tokens),
    )
}

fn record_latencies(model: &str, o: &RequestOutput) {
    let labels = [("model_name", model.to_string())];
    let first = o.first_token_at.unwrap_or(o.finished_at);
    metrics::histogram!("vllm:time_to_first_token_seconds", &labels)
        .record(first.duration_since(o.arrival).as_secs_f64());
    metrics::histogram!("vllm:e2e_request_latency_seconds", &labels)
        .record(o.finished_at.duration_since(o.arrival).as_secs_f64());
    if o.token_ids.len() > 1 {
        let itl =
            o.finished_at.duration_since(first).as_secs_f64() / (o.token_ids.len() - 1) as f64;
        metrics::histogram!("vllm:inter_token_latency_seconds", &labels).record(itl);
    }
}

/// Waits for a request's results (non-streaming responses): one per choice, in order.
async fn collect(mut s: Submitted, model: &str) -> Result<Vec<RequestOutput>, ApiError> {
    let mut outputs = Vec::with_capacity(s.n);
    while let Some(ev) = s.rx.recv().await {
        match ev {
            SeqEvent::Text { .. } | SeqEvent::Logits(_) => {}
            SeqEvent::Finished(o) => {
                record_latencies(model, &o);
                outputs.push(o);
                if outputs.len() == s.n {
                    outputs.sort_by_key(|o| o.choice);
                    return Ok(outputs);
                }
            }
            SeqEvent::Error(e) => return Err(request_error(&e)),
        }
    }
    Err(ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: "the engine dropped the request".into(),
        param: None,
    })
}

/// What differs between the two endpoints' stream chunks.
#[derive(Clone, Copy)]
enum Kind {
    Completion,
    Chat,
}

#[allow(clippy::too_many_arguments)]
fn chunk(
    kind: Kind,
    index: usize,
    id: &str,
    created: u64,
    model: &str,
    text: Option<&str>,
    finish: Option<&str>,
    first: bool,
    logprobs: Value,
) -> Value {
    match kind {
        Kind::Completion => json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish}],
        }),
        Kind::Chat => {
            let mut delta = serde_json::Map::new();
            if first {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = text {
                delta.insert("content".into(), json!(t));
            }
            json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
            })
        }
    }
}

/// Renders streamed tokens' logprobs (`None` when the request asked for none): chat's
/// shape, or completions' with text offsets continuing across a choice's chunks.
struct StreamLogprobs {
    tokenizer: Arc<pk_tokenizer::Tokenizer>,
    kind: Kind,
    /// Per choice.
    text_offsets: Vec<usize>,
}

impl StreamLogprobs {
    fn render(
        this: &mut Option<StreamLogprobs>,
        choice: usize,
        tokens: &[pk_engine::TokenLogprob],
    ) -> Value {
        let Some(l) = this else { return Value::Null };
        match l.kind {
            Kind::Chat => crate::logprobs::chat(&l.tokenizer, tokens),
            Kind::Completion => {
                let offset = &mut l.text_offsets[choice];
                let v = crate::logprobs::completion(&l.tokenizer, tokens, *offset);
                *offset += crate::logprobs::text_len(&l.tokenizer, tokens);
                v
            }
        }
    }
}

fn stream_response(
    kind: Kind,
    s: Submitted,
    model: String,
    include_usage: bool,
    logprobs: Option<Arc<pk_tokenizer::Tokenizer>>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let n = s.n;
    let mut logprobs = logprobs.map(|tokenizer| StreamLogprobs {
        tokenizer,
        kind,
        text_offsets: vec![0; n],
    });
    let id = new_id(match kind {
        Kind::Completion => "cmpl",
        Kind::Chat => "chatcmpl",
    });
    let created = now_unix();
    let prompt_tokens = s.prompt_tokens;
    let mut rx = s.rx;
    let stream = async_stream(move |yield_| async move {
        // Chat streams open every choice with its role.
        if let Kind::Chat = kind {
            for index in 0..n {
                let c = chunk(
                    kind,
                    index,
                    &id,
                    created,
                    &model,
                    Some(""),
                    None,
                    true,
                    Value::Null,
                );
                if !yield_(Event::default().data(c.to_string())).await {
                    return;
                }
            }
        }
        // Per choice: logprobs of tokens whose text is still held back ride with its next
        // text.
        let mut pending: Vec<Vec<pk_engine::TokenLogprob>> = vec![Vec::new(); n];
        let mut outputs: Vec<RequestOutput> = Vec::with_capacity(n);
        while let Some(ev) = rx.recv().await {
            match ev {
                SeqEvent::Logits(_) => {}
                SeqEvent::Text {
                    choice,
                    text,
                    logprobs: token_logprobs,
                    ..
                } => {
                    pending[choice].extend(token_logprobs);
                    if !text.is_empty() {
                        let tokens = std::mem::take(&mut pending[choice]);
                        let lp = StreamLogprobs::render(&mut logprobs, choice, &tokens);
                        let c = chunk(
                            kind,
                            choice,
                            &id,
                            created,
                            &model,
                            Some(&text),
                            None,
                            false,
                            lp,
                        );
                        if !yield_(Event::default().data(c.to_string())).await {
                            return;
                        }
                    }
                }
                SeqEvent::Finished(o) => {
                    record_latencies(&model, &o);
                    let fin = finish_str(o.finish_reason);
                    let text = match kind {
                        Kind::Completion => Some(""),
                        Kind::Chat => None,
                    };
                    let tokens = std::mem::take(&mut pending[o.choice]);
                    let lp = match tokens.is_empty() {
                        true => Value::Null,
                        false => StreamLogprobs::render(&mut logprobs, o.choice, &tokens),
                    };
                    let c = chunk(
                        kind,
                        o.choice,
                        &id,
                        created,
                        &model,
                        text,
                        Some(fin),
                        false,
                        lp,
                    );
                    if !yield_(Event::default().data(c.to_string())).await {
                        return;
                    }
                    outputs.push(o);
                    if outputs.len() < n {
                        continue;
                    }
                    if include_usage {
                        let obj = match kind {
                            Kind::Completion => "text_completion",
                            Kind::Chat => "chat.completion.chunk",
                        };
                        outputs.sort_by_key(|o| o.choice);
                        let usage = usage_of(prompt_tokens, &outputs);
                        let v = json!({"id": id, "object": obj, "created": created, "model": model, "choices": [], "usage": usage});
                        yield_(Event::default().data(v.to_string())).await;
                    }
                    break;
                }
                SeqEvent::Error(e) => {
                    // The status line went out with the stream's first byte; the error
                    // event carries the status the request would have had.
                    let a = request_error(&e);
                    let v = json!({"error": {"message": a.message, "type": a.error_type(), "param": null, "code": a.status.as_u16()}});
                    yield_(Event::default().data(v.to_string())).await;
                    break;
                }
            }
        }
        yield_(Event::default().data("[DONE]")).await;
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// A tiny generator: runs `f` with a callback that feeds a channel-backed stream, so the
/// SSE body can be written as straight-line async code without another dependency.
fn async_stream<F, Fut>(f: F) -> impl Stream<Item = Result<Event, Infallible>>
where
    F: FnOnce(Box<dyn Fn(Event) -> futures::future::BoxFuture<'static, bool> + Send + Sync>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    // Bounded: a slow client applies back-pressure instead of buffering without limit.
    let (tx, rx) = mpsc::channel::<Event>(64);
    let send: Box<dyn Fn(Event) -> futures::future::BoxFuture<'static, bool> + Send + Sync> =
        Box::new(move |e| {
            let tx = tx.clone();
            // `false` once the client is gone: the caller then stops, dropping the request's
            // event receiver, and the engine aborts the sequence at its next token.
            Box::pin(async move { tx.send(e).await.is_ok() })
        });
    tokio::spawn(f(send));
    tokio_stream::wrappers::ReceiverStream::new(rx).map_ok()
}

trait MapOk: Stream<Item = Event> + Sized {
    fn map_ok(self) -> futures::stream::Map<Self, fn(Event) -> Result<Event, Infallible>> {
        futures::StreamExt::map(self, Ok as fn(Event) -> Result<Event, Infallible>)
    }
}
impl<S: Stream<Item = Event>> MapOk for S {}

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

pub async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{"id": state.model_name, "object": "model", "created": now_unix(), "owned_by": "pagekeeper", "max_model_len": state.limits.max_total_tokens}],
    }))
}

pub async fn health(State(state): State<Arc<AppState>>) -> Response {
    match state.engine.state() {
        EngineState::Ready => (StatusCode::OK, "ok").into_response(),
        EngineState::Loading => (StatusCode::SERVICE_UNAVAILABLE, "loading").into_response(),
        EngineState::Dead => (StatusCode::SERVICE_UNAVAILABLE, "engine stopped").into_response(),
    }
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [("content-type", "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}

/// `GET /v1/kv/contexts`: every context in the EVICPRESS store, where it lives and why
/// (its utility table). 404 when the server runs without `--tier-policy evicpress`.
pub async fn kv_contexts(State(state): State<Arc<AppState>>) -> Response {
    let Some(store) = state.engine.contexts.get() else {
        return (StatusCode::NOT_FOUND, Json(serde_json::json!({"error": {"message": "no EVICPRESS context store: start the server with --tier-policy evicpress", "type": "not_found"}}))).into_response();
    };
    let names = store.tier_names();
    let usage = store.usage_bytes();
    Json(serde_json::json!({
        "policy": store.policy().name(),
        "tiers": names.iter().zip(&usage).map(|(n, u)| serde_json::json!({"name": n, "placed_bytes": u})).collect::<Vec<_>>(),
        "stats": store.stats(),
        "contexts": store.explain(),
    }))
    .into_response()
}
