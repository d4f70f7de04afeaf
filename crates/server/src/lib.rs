//! `pk-server`: the OpenAI-compatible HTTP API (`/v1/completions`, `/v1/chat/completions`,
//! `/v1/models`, `/health`, `/metrics`) over one engine thread, with SSE streaming.
//!
//! Handlers validate on the async side, render and tokenize the prompt and compile any
//! grammar on a bounded blocking pool (`offload.rs`), then hand a `Request` to the engine
//! thread and read its events from a per-request channel. A client that disconnects
//! drops its receiver; the engine notices on the next event and frees the sequence.
#![forbid(unsafe_code)]

mod engine_thread;
mod handlers;
pub mod listener;
mod logprobs;
mod offload;
pub mod openai;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use pk_tokenizer::{ChatTemplate, Tokenizer};

pub use engine_thread::{EngineHandle, EngineState, Served};
pub use offload::Offload;

/// Limits applied before a request reaches the engine.
#[derive(Debug, Clone)]
pub struct ServerLimits {
    pub max_request_body_bytes: usize,
    /// Prompt + completion tokens per request (default: the model's context length).
    pub max_total_tokens: usize,
    /// Messages per chat request.
    pub max_messages: usize,
}

pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: Arc<ChatTemplate>,
    pub model_name: String,
    pub limits: ServerLimits,
    pub metrics: PrometheusHandle,
    /// Prompt rendering and tokenization, and grammar compilation, off the async workers
    /// and off the engine thread.
    pub offload: Offload,
}

/// The exporter's settings: latency buckets, and `model_name` (the served model's name) as
/// a label on every series, as vLLM labels its own. A global label reaches the series that
/// crates without the model's name record (tiers, the EVICPRESS store) as well.
pub fn metrics_builder(model_name: &str) -> anyhow::Result<PrometheusBuilder> {
    const LATENCY_BUCKETS_S: &[f64] = &[
        0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ];
    Ok(PrometheusBuilder::new()
        .set_buckets(LATENCY_BUCKETS_S)?
        .add_global_label("model_name", model_name))
}

/// Installs the global Prometheus recorder (once per process). It must come before the
/// engine and its tiers start, since what is recorded while no recorder is installed is
/// lost.
pub fn install_metrics(model_name: &str) -> anyhow::Result<PrometheusHandle> {
    Ok(metrics_builder(model_name)?.install_recorder()?)
}

pub fn router(state: Arc<AppState>) -> Router {
    let body_limit = state.limits.max_request_body_bytes;
    Router::new()
        .route("/v1/completions", post(handlers::completions))
        .route("/v1/chat/completions", post(handlers::chat_completions))
        .route("/v1/models", get(handlers::models))
        .route("/health", get(handlers::health))
        .route("/metrics", get(handlers::metrics))
        .route("/v1/kv/contexts", get(handlers::kv_contexts))
        .fallback(handlers::not_found)
        .method_not_allowed_fallback(handlers::method_not_allowed)
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

/// How long a shutdown waits for running requests (streams included) to finish before the
/// process exits anyway.
pub const DRAIN_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// Resolves on SIGTERM (what service managers and `kill` send) or Ctrl-C.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!("cannot listen for SIGTERM ({e}); only Ctrl-C drains");
                    let _ = tokio::signal::ctrl_c().await;
                    return;
                }
            };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}

/// Serves until SIGTERM or Ctrl-C, then drains: the listener closes (new connections are
/// refused) while requests already running finish, for at most [`DRAIN_DEADLINE`].
pub async fn serve(state: Arc<AppState>, addr: SocketAddr) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!("listening on http://{}", listener.local_addr()?);
    // This line is a contract: the benches' child servers (`bench_child.rs`) and scripts
    // read the bound port from it, so it keeps its words. The weights may still be loading
    // on the engine thread, so the next line says so, and the engine thread says when they
    // are loaded: a load that fails next is not read as a server that was up.
    eprintln!(
        "pagekeeper: serving {} on http://{}",
        state.model_name,
        listener.local_addr()?
    );
    if state.engine.state() != EngineState::Ready {
        eprintln!("pagekeeper: loading the model; /health answers 503 until it is ready");
    }
    let signal = async {
        shutdown_signal().await;
        eprintln!(
            "pagekeeper: shutting down; draining running requests (at most {} s)",
            DRAIN_DEADLINE.as_secs()
        );
    };
    let warm = state.clone();
    tokio::spawn(async move { warm.offload.prepare_grammars().await });
    let router = listener::with_body_timeout(router(state), listener::BODY_READ_TIMEOUT);
    let drained = listener::serve_connections(
        listener,
        router,
        listener::ConnectionLimits::default(),
        signal,
        DRAIN_DEADLINE,
    )
    .await;
    if !drained {
        eprintln!("pagekeeper: drain deadline passed; exiting with requests still running");
    }
    Ok(())
}
