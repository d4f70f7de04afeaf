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

use crate::offload::OffloadError;
use crate::openai::{
    ChatRequest, CommonParams, CompletionRequest, ErrorBody, ErrorDetail, PromptField, Usage,
};
use crate::AppState;

#[derive(Debug)]
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
        ApiError::at(param.to_string(), message)
    }
    /// A 400 naming a field by its path in the request (`messages[2].tool_call_id`).
    fn at(path: String, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(path),
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

/// A known path with another method (a GET of `/v1/chat/completions`): an OpenAI-style
/// JSON 405, not an empty body.
pub async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: format!("{} does not accept {method}", uri.path()),
        param: None,
    }
}

/// Whether a body failed because the client stopped sending it (`listener.rs`, NOTE 1).
fn is_body_timeout(r: &JsonRejection) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(r);
    while let Some(e) = source {
        if e.is::<tower_http::timeout::TimeoutError>() {
            return true;
        }
        source = e.source();
    }
    false
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> ApiError {
        if is_body_timeout(&r) {
            return ApiError {
                status: StatusCode::REQUEST_TIMEOUT,
                message: format!(
                    "the request body stalled: no bytes for {} s",
                    crate::listener::BODY_READ_TIMEOUT.as_secs()
                ),
                param: None,
            };
        }
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

mod body;
mod chat;
mod completions;
mod params;
mod stream;
mod tools;

pub use chat::chat_completions;
pub use completions::completions;
use params::generate_params;
use stream::{stream_response, Kind, StreamUsage};

/// A prompt's text to token ids, with vLLM's `add_special_tokens`: `false` gives exactly
/// the text's tokens; otherwise the model's BOS is put first where its tokenizer adds one
/// and the text does not start with it already (a template that writes BOS itself is not
/// given a second).
fn encode_text(
    tokenizer: &pk_tokenizer::Tokenizer,
    text: &str,
    add_special_tokens: Option<bool>,
) -> Vec<u32> {
    match add_special_tokens {
        Some(false) => tokenizer.encode(text, true),
        _ => tokenizer.encode_prompt(text, true),
    }
}

/// Events sent to a request's handler and not read yet, at most: a client that stops
/// reading its stream while its sequences keep generating would otherwise have every token
/// (with its logprobs) buffered for it, up to `n` × `max_tokens`. Past it the send fails,
/// which cancels the sequences as a disconnect does. A handler that reads as events come
/// (whole responses, a stream whose client keeps up) never nears it.
const MAX_UNREAD_EVENTS: usize = 16_384;

/// The sending side of a request's events, counting what the handler has not read.
struct EventTx {
    tx: mpsc::UnboundedSender<SeqEvent>,
    unread: Arc<std::sync::atomic::AtomicUsize>,
    limit: usize,
}

impl EventTx {
    /// `false` once the handler is gone or `limit` events wait unread.
    fn send(&self, e: SeqEvent) -> bool {
        use std::sync::atomic::Ordering;
        if self.unread.load(Ordering::Relaxed) >= self.limit {
            return false;
        }
        self.unread.fetch_add(1, Ordering::Relaxed);
        self.tx.send(e).is_ok()
    }
}

/// The receiving side of [`EventTx`].
struct EventRx {
    rx: mpsc::UnboundedReceiver<SeqEvent>,
    unread: Arc<std::sync::atomic::AtomicUsize>,
}

impl EventRx {
    async fn recv(&mut self) -> Option<SeqEvent> {
        let e = self.rx.recv().await;
        if e.is_some() {
            self.unread
                .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
        e
    }
}

/// A request's event channel, refusing past `limit` unread events.
fn event_channel(limit: usize) -> (EventTx, EventRx) {
    let (tx, rx) = mpsc::unbounded_channel();
    let unread = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tx = EventTx {
        tx,
        unread: unread.clone(),
        limit,
    };
    (tx, EventRx { rx, unread })
}

struct Submitted {
    rx: EventRx,
    prompt_tokens: usize,
    /// Choices the request asked for; each ends with its own `Finished`.
    n: usize,
}

/// The engine's refusal of a request as an HTTP error.
fn submit_error(e: SubmitError) -> ApiError {
    match e {
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
    }
}

/// As [`submit_error`], naming `prompt_param` for the engine's refusals of a prompt (the
/// only ones without a field of their own: empty, too long, a token outside the
/// vocabulary).
fn submit_error_in(e: SubmitError, prompt_param: &'static str) -> ApiError {
    match e {
        SubmitError::Invalid(m) => ApiError::param(prompt_param, m),
        other => submit_error(other),
    }
}

impl From<OffloadError> for ApiError {
    fn from(e: OffloadError) -> ApiError {
        match e {
            OffloadError::Grammar(param, message) => ApiError::param(param, message),
            OffloadError::Panicked(m) => ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                message: format!("preparing the request failed: {m}"),
                param: None,
            },
            OffloadError::NoGrammarEngine(m) => ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                message: format!("the grammar engine could not start: {m}"),
                param: None,
            },
        }
    }
}

/// `params` with its grammar compiled on the blocking pool (if it has one not compiled
/// yet), so that the engine thread never compiles: it would stall every running stream.
async fn compile_grammar(
    state: &AppState,
    mut params: GenerateParams,
) -> Result<GenerateParams, ApiError> {
    let Some(g) = params.grammar.take_if(|g| g.compiled.is_none()) else {
        return Ok(params);
    };
    // A request the engine would refuse anyway is not compiled for nothing.
    pk_engine::check_grammar_use(&g, &params).map_err(submit_error)?;
    params.grammar = Some(state.offload.compile(g).await?);
    Ok(params)
}

/// A request for the engine and the channel its events arrive on; its grammar compiled.
async fn prepare(
    state: &AppState,
    prompt_ids: Vec<u32>,
    params: GenerateParams,
    cache_salt: Option<String>,
) -> Result<(Request, Submitted), ApiError> {
    let params = compile_grammar(state, params).await?;
    let (tx, rx) = event_channel(MAX_UNREAD_EVENTS);
    let prompt_tokens = prompt_ids.len();
    let n = params.n;
    let req = Request {
        prompt_ids,
        params,
        cache_salt,
        sink: Box::new(move |e| tx.send(e)),
    };
    let submitted = Submitted {
        rx,
        prompt_tokens,
        n,
    };
    Ok((req, submitted))
}

/// Queues one request; engine refusals of its prompt name `prompt_param`.
async fn submit(
    state: &AppState,
    prompt_ids: Vec<u32>,
    params: GenerateParams,
    cache_salt: Option<String>,
    prompt_param: &'static str,
) -> Result<Submitted, ApiError> {
    let (req, submitted) = prepare(state, prompt_ids, params, cache_salt).await?;
    state
        .engine
        .submit(req)
        .await
        .map_err(|e| submit_error_in(e, prompt_param))?;
    Ok(submitted)
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

/// Waits for a request's results (non-streaming responses): one per choice, in order.
/// (Their latencies are recorded on the engine thread, for streams and for these alike.)
async fn collect(mut s: Submitted) -> Result<Vec<RequestOutput>, ApiError> {
    let mut outputs = Vec::with_capacity(s.n);
    while let Some(ev) = s.rx.recv().await {
        match ev {
            SeqEvent::Text { .. } | SeqEvent::Logits(_) => {}
            SeqEvent::Finished(o) => {
                outputs.push(*o);
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
        // The delays placement decides with, each figure with its source (calibrated at
        // start-up, observed since, or a prior).
        "delay_model": store.delay_report(),
        "contexts": store.explain(),
    }))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A handler that stops reading gets at most `limit` events; the next send fails (which
    /// cancels the sequences), and reading makes room again.
    #[tokio::test]
    async fn events_past_the_unread_limit_are_refused() {
        let (tx, mut rx) = event_channel(3);
        let event = || SeqEvent::Logits(vec![0.0]);
        assert!((0..3).all(|_| tx.send(event())));
        assert!(!tx.send(event()), "a fourth unread event is refused");
        assert!(rx.recv().await.is_some());
        assert!(tx.send(event()), "one read, one more fits");
        drop(rx);
        let (tx, rx) = event_channel(3);
        drop(rx);
        assert!(!tx.send(event()), "a handler that is gone takes nothing");
    }
}
