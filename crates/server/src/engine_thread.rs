//! The engine loop: one OS thread owns the `Engine` and is fed by a bounded channel.
//!
//! No lock is ever taken around the KV cache: HTTP handlers only send commands and read
//! per-request event channels. The loop blocks on the channel when idle and otherwise
//! drains it between steps, so admission happens at step boundaries (continuous batching).
//! Metrics are published from here after every step.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pk_engine::{Engine, EngineStats, Request, SubmitError};
use tokio::sync::{mpsc, oneshot};

pub enum Command {
    Submit(Request, oneshot::Sender<Result<(), SubmitError>>),
}

/// Where the engine thread is: loading the model, serving, or dead (it panicked; every
/// request then gets 503 and `/health` says so, instead of a live-looking server that
/// refuses everything).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineState {
    Loading,
    Ready,
    Dead,
}

/// The engine thread's state, shared with the HTTP side.
#[derive(Debug, Default)]
pub struct Liveness(AtomicU8);

impl Liveness {
    pub fn get(&self) -> EngineState {
        match self.0.load(Ordering::Acquire) {
            0 => EngineState::Loading,
            1 => EngineState::Ready,
            _ => EngineState::Dead,
        }
    }

    pub fn set(&self, s: EngineState) {
        self.0.store(s as u8, Ordering::Release);
    }
}

/// Runs `body` as the engine thread's work: a panic anywhere in it marks the engine dead
/// (logged once, with its message) rather than leaving a thread-less server that looks
/// alive.
fn run_guarded(liveness: &Liveness, body: impl FnOnce()) {
    if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        liveness.set(EngineState::Dead);
        let msg = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        tracing::error!("the engine thread panicked ({msg}); every request now gets 503");
    }
}

/// Cloneable handle used by the HTTP side.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    pub liveness: Arc<Liveness>,
    /// The engine's EVICPRESS store once loaded (thread-safe; `/v1/kv/contexts` reads it).
    pub contexts: Arc<std::sync::OnceLock<Arc<pk_evicpress::ContextStore>>>,
}

/// Longest answer generated per profiling query in the background.
const PROFILE_ANSWER_TOKENS: usize = 16;

/// Bound on commands in flight between the HTTP side and the engine thread.
const COMMAND_QUEUE_LEN: usize = 1024;
/// How often the throughput line is logged.
const LOG_INTERVAL: Duration = Duration::from_secs(10);

impl EngineHandle {
    /// Starts the engine thread; `load` runs on it (so /health can answer 503 meanwhile).
    pub fn spawn(load: impl FnOnce() -> anyhow::Result<Engine> + Send + 'static) -> EngineHandle {
        Self::spawn_with(move |rx, liveness, contexts| match load() {
            Ok(engine) => {
                if let Some(store) = engine.context_store() {
                    let _ = contexts.set(store);
                }
                liveness.set(EngineState::Ready);
                run(engine, rx);
            }
            Err(e) => {
                tracing::error!("model loading failed: {e:#}");
                std::process::exit(1);
            }
        })
    }

    /// Starts a thread running `body` with the command receiver, under [`run_guarded`].
    fn spawn_with(
        body: impl FnOnce(
                mpsc::Receiver<Command>,
                &Liveness,
                &std::sync::OnceLock<Arc<pk_evicpress::ContextStore>>,
            ) + Send
            + 'static,
    ) -> EngineHandle {
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE_LEN);
        let liveness = Arc::new(Liveness::default());
        let contexts = Arc::new(std::sync::OnceLock::new());
        let (l, c) = (liveness.clone(), contexts.clone());
        std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || run_guarded(&l, || body(rx, &l, &c)))
            .expect("spawning the engine thread");
        EngineHandle {
            tx,
            liveness,
            contexts,
        }
    }

    pub fn state(&self) -> EngineState {
        self.liveness.get()
    }

    pub async fn submit(&self, req: Request) -> Result<(), SubmitError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .try_send(Command::Submit(req, reply))
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => SubmitError::QueueFull(COMMAND_QUEUE_LEN),
                mpsc::error::TrySendError::Closed(_) => SubmitError::Stopped,
            })?;
        rx.await.unwrap_or(Err(SubmitError::Stopped))
    }
}

fn run(mut engine: Engine, mut rx: mpsc::Receiver<Command>) {
    let model = engine.model_name.clone();
    let mut published = EngineStats::default();
    let mut published_eviction = std::collections::BTreeMap::new();
    let mut last_log = Instant::now();
    let mut logged = EngineStats::default();
    // EVICPRESS profiling runs in idle capacity, batched with whatever arrives meanwhile.
    let mut profiling: Option<pk_engine::profiler::Profiling> = None;
    loop {
        // A profile that cannot submit its second phase (a full queue) is dropped without
        // recording anything; the context stays eligible and is tried again when idle.
        let finished = match profiling.as_mut().map(|p| p.poll(&mut engine)) {
            Some(Ok(true)) => profiling.take(),
            Some(Err(e)) => {
                tracing::debug!("background profiling abandoned: {e}");
                profiling = None;
                None
            }
            _ => None,
        };
        if let Some(p) = finished {
            if let Some(store) = engine.context_store() {
                let _ = store.set_profile(&p.key, p.qualities());
            }
        }
        if profiling.is_none() {
            profiling = engine.maybe_start_background_profile(PROFILE_ANSWER_TOKENS);
        }
        if !engine.has_work() {
            publish(&engine, &model, &mut published, &mut published_eviction);
            match rx.blocking_recv() {
                Some(cmd) => handle(&mut engine, cmd),
                None => return,
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            handle(&mut engine, cmd);
        }
        engine.step();
        publish(&engine, &model, &mut published, &mut published_eviction);
        if last_log.elapsed() >= LOG_INTERVAL {
            let secs = last_log.elapsed().as_secs_f64();
            tracing::info!(
                "Avg prompt throughput: {:.1} tokens/s, Avg generation throughput: {:.1} tokens/s, Running: {} reqs, Waiting: {} reqs, KV cache usage: {:.1}%",
                (engine.stats.prompt_tokens - logged.prompt_tokens) as f64 / secs,
                (engine.stats.generation_tokens - logged.generation_tokens) as f64 / secs,
                engine.num_running(),
                engine.num_waiting(),
                engine.kv_manager().usage() * 100.0
            );
            logged = engine.stats.clone();
            last_log = Instant::now();
        }
    }
}

fn handle(engine: &mut Engine, cmd: Command) {
    match cmd {
        Command::Submit(req, reply) => {
            let _ = reply.send(engine.submit(req));
        }
    }
}

/// Publishes gauges and the counters' increments since the last call.
fn publish(
    engine: &Engine,
    model: &str,
    last: &mut EngineStats,
    last_eviction: &mut std::collections::BTreeMap<String, pk_engine::EvictionStats>,
) {
    for (policy, now) in &engine.eviction_stats {
        let before = last_eviction.entry(policy.clone()).or_default();
        let labels = [
            ("model_name", model.to_string()),
            ("policy", policy.clone()),
        ];
        metrics::counter!("pagekeeper:kv_evicted_blocks", &labels)
            .increment(now.evicted_blocks - before.evicted_blocks);
        metrics::counter!("pagekeeper:kv_pruned_prompt_tokens", &labels)
            .increment(now.pruned_prompt_tokens - before.pruned_prompt_tokens);
        *before = now.clone();
    }
    let labels = [("model_name", model.to_string())];
    metrics::gauge!("vllm:num_requests_running", &labels).set(engine.num_running() as f64);
    metrics::gauge!("vllm:num_requests_waiting", &labels).set(engine.num_waiting() as f64);
    metrics::gauge!("vllm:kv_cache_usage_perc", &labels).set(engine.kv_manager().usage());
    let s = &engine.stats;
    // Peaks since the server started (what load tests read): blocks are the pool's unit,
    // whatever their layer count.
    let pool = engine.kv_manager().pool();
    metrics::gauge!("pagekeeper:kv_blocks_total", &labels).set(pool.num_blocks() as f64);
    metrics::gauge!("pagekeeper:kv_blocks_in_use", &labels)
        .set((pool.num_blocks() - pool.num_free_blocks()) as f64);
    metrics::gauge!("pagekeeper:kv_blocks_in_use_peak", &labels)
        .set((s.kv_bytes_peak / engine.kv_block_bytes().max(1)) as f64);
    metrics::gauge!("pagekeeper:num_requests_running_peak", &labels).set(s.max_running_seqs as f64);
    metrics::counter!("vllm:prompt_tokens", &labels)
        .increment(s.prompt_tokens - last.prompt_tokens);
    metrics::counter!("vllm:generation_tokens", &labels)
        .increment(s.generation_tokens - last.generation_tokens);
    metrics::counter!("vllm:num_preemptions", &labels).increment(s.preemptions - last.preemptions);
    metrics::counter!("vllm:prefix_cache_queries", &labels)
        .increment(s.prefix_queries_tokens - last.prefix_queries_tokens);
    metrics::counter!("vllm:prefix_cache_hits", &labels)
        .increment(s.prefix_hits_tokens - last.prefix_hits_tokens);
    // The server compiles every grammar on its blocking pool, so this stays 0; a request
    // compiled here instead stalled every running stream while it compiled.
    metrics::counter!(
        "pagekeeper:engine_thread_grammar_compilations_total",
        &labels
    )
    .increment(s.grammar_compilations - last.grammar_compilations);
    *last = s.clone();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panic on the engine thread marks it dead, and a request then gets `Stopped`
    /// (503), not `QueueFull` (429) as when the closed channel looked like a full one.
    #[tokio::test]
    async fn a_panicking_engine_thread_is_dead_and_refuses_with_stopped() {
        let h = EngineHandle::spawn_with(|_rx, liveness, _| {
            liveness.set(EngineState::Ready);
            panic!("injected failure");
        });
        for _ in 0..200 {
            if h.state() == EngineState::Dead {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(h.state(), EngineState::Dead);
        let req = Request {
            prompt_ids: vec![1],
            params: Default::default(),
            cache_salt: None,
            sink: Box::new(|_| true),
        };
        assert!(matches!(h.submit(req).await, Err(SubmitError::Stopped)));
    }
}
