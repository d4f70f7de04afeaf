//! The engine loop: one OS thread owns the `Engine` and is fed by a bounded channel.
//!
//! No lock is ever taken around the KV cache: HTTP handlers only send commands and read
//! per-request event channels. The loop blocks on the channel when idle and otherwise
//! drains it between steps, so admission happens at step boundaries (continuous batching).
//! Metrics are published from here after every step, and each finished choice's latencies
//! as it finishes. The exporter adds `model_name` to every series (`metrics_builder`).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pk_connectors::kvzip_scoring::{maybe_start_kvzip_scoring, KvzipScoring};
use pk_connectors::profiler::{maybe_start_background_profile, Profiling};
use pk_connectors::ContextReuse;
use pk_engine::{Engine, EngineStats, FinishReason, Request, RequestOutput, SeqEvent, SubmitError};
use tokio::sync::{mpsc, oneshot};

pub enum Command {
    Submit(Box<Request>, oneshot::Sender<Result<(), SubmitError>>),
    /// A request's prompts (a completion with a list of them), queued all or none: queued
    /// one by one, a list longer than the queue's free places had its first prompts
    /// computed and thrown away before a 429 that no retry could cure.
    SubmitAll(Vec<Request>, oneshot::Sender<Result<(), SubmitError>>),
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

/// What the engine thread serves: the engine, and the EVICPRESS context store attached to it
/// as its connector, if any.
pub struct Served {
    pub engine: Engine,
    pub contexts: Option<Arc<ContextReuse>>,
}

/// Longest answer generated per profiling query in the background.
const PROFILE_ANSWER_TOKENS: usize = 16;

/// Bound on commands in flight between the HTTP side and the engine thread.
const COMMAND_QUEUE_LEN: usize = 1024;
/// How often the throughput line is logged.
const LOG_INTERVAL: Duration = Duration::from_secs(10);

impl EngineHandle {
    /// Starts the engine thread; `load` runs on it (so /health can answer 503 meanwhile)
    /// and returns the engine with the EVICPRESS store it was given, if any (the server
    /// profiles its contexts in idle time and `/v1/kv/contexts` reads it).
    pub fn spawn(load: impl FnOnce() -> anyhow::Result<Served> + Send + 'static) -> EngineHandle {
        Self::spawn_with(move |rx, liveness, contexts| match load() {
            Ok(served) => {
                if let Some(c) = &served.contexts {
                    let _ = contexts.set(c.store().clone());
                }
                liveness.set(EngineState::Ready);
                eprintln!(
                    "pagekeeper: {} loaded; serving requests",
                    served.engine.model_name
                );
                run(served, rx);
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
            .try_send(Command::Submit(Box::new(req), reply))
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => SubmitError::QueueFull(COMMAND_QUEUE_LEN),
                mpsc::error::TrySendError::Closed(_) => SubmitError::Stopped,
            })?;
        rx.await.unwrap_or(Err(SubmitError::Stopped))
    }

    /// Queues `reqs` all or none ([`Command::SubmitAll`]).
    pub async fn submit_all(&self, reqs: Vec<Request>) -> Result<(), SubmitError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .try_send(Command::SubmitAll(reqs, reply))
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => SubmitError::QueueFull(COMMAND_QUEUE_LEN),
                mpsc::error::TrySendError::Closed(_) => SubmitError::Stopped,
            })?;
        rx.await.unwrap_or(Err(SubmitError::Stopped))
    }
}

fn run(served: Served, mut rx: mpsc::Receiver<Command>) {
    let Served {
        mut engine,
        contexts,
    } = served;
    let mut published = EngineStats::default();
    let mut published_eviction = std::collections::BTreeMap::new();
    let mut last_log = Instant::now();
    let mut logged = EngineStats::default();
    // EVICPRESS profiling runs in idle capacity, batched with whatever arrives meanwhile,
    // and so do KVzip's passes over stored contexts (a grid with `kvzip-R`), first: a
    // profile can only run the KVzip configurations of a context that has its scores.
    let mut profiling: Option<Profiling> = None;
    let mut scoring: Option<KvzipScoring> = None;
    if let Some(c) = &contexts {
        c.score_kvzip_in_idle_time();
    }
    loop {
        if scoring.as_ref().is_some_and(KvzipScoring::is_done) {
            scoring = None;
        }
        if let (None, None, Some(c)) = (&scoring, &profiling, &contexts) {
            scoring = maybe_start_kvzip_scoring(&mut engine, c);
        }
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
        if let (Some(p), Some(c)) = (finished, &contexts) {
            let _ = c.store().set_profile(&p.key, p.qualities());
        }
        if let (None, None, Some(c)) = (&profiling, &scoring, &contexts) {
            profiling = maybe_start_background_profile(&mut engine, c, PROFILE_ANSWER_TOKENS);
        }
        if !engine.has_work() {
            publish(&engine, &mut published, &mut published_eviction);
            match rx.blocking_recv() {
                Some(cmd) => handle(&mut engine, cmd),
                None => return,
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            handle(&mut engine, cmd);
        }
        engine.step();
        publish(&engine, &mut published, &mut published_eviction);
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
            let _ = reply.send(engine.submit(recording_latencies(*req)));
        }
        Command::SubmitAll(reqs, reply) => {
            let _ = reply.send(submit_all(engine, reqs));
        }
    }
}

/// Queues every one of `reqs` or, when the queue cannot take them all, none. A request
/// refused part-way (a validation error) leaves the ones before it queued; the caller then
/// drops their event channels, which cancels them at the next step.
fn submit_all(engine: &mut Engine, reqs: Vec<Request>) -> Result<(), SubmitError> {
    let limit = engine.config.max_waiting_requests;
    if reqs.len() > limit {
        return Err(SubmitError::InvalidParam {
            param: "prompt",
            message: format!(
                "{} prompts in one request exceed this server's queue of {limit} waiting requests (--max-waiting-requests); send at most {limit}",
                reqs.len()
            ),
        });
    }
    if engine.num_waiting() + reqs.len() > limit {
        return Err(SubmitError::QueueFull(engine.num_waiting()));
    }
    for req in reqs {
        engine.submit(recording_latencies(req))?;
    }
    Ok(())
}

/// `req` with its sink wrapped to record each choice's latencies as it finishes: here, on
/// the engine thread, rather than in the handler that reads the events, so that streamed
/// and whole responses count alike, and a choice whose client left after it finished
/// still counts.
fn recording_latencies(mut req: Request) -> Request {
    let mut sink = std::mem::replace(&mut req.sink, Box::new(|_| true));
    req.sink = Box::new(move |event| {
        if let SeqEvent::Finished(o) = &event {
            record_finished(o);
        }
        sink(event)
    });
    req
}

/// Records a finished choice as vLLM does: its outcome, its latencies, and one
/// inter-token latency per gap between consecutive generated tokens (each timed when it
/// was sampled), so that the histogram's count is the number of gaps served.
fn record_finished(o: &RequestOutput) {
    let seconds = |from: Instant, to: Instant| to.saturating_duration_since(from).as_secs_f64();
    let reason = match o.finish_reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    };
    metrics::counter!("vllm:request_success_total", "finished_reason" => reason).increment(1);
    let scheduled = o.scheduled_at.unwrap_or(o.arrival);
    let first = o.first_token_at.unwrap_or(o.finished_at);
    metrics::histogram!("vllm:time_to_first_token_seconds").record(seconds(o.arrival, first));
    metrics::histogram!("vllm:e2e_request_latency_seconds")
        .record(seconds(o.arrival, o.finished_at));
    metrics::histogram!("vllm:request_queue_time_seconds").record(seconds(o.arrival, scheduled));
    metrics::histogram!("vllm:request_prefill_time_seconds").record(seconds(scheduled, first));
    metrics::histogram!("vllm:request_decode_time_seconds").record(seconds(first, o.finished_at));
    metrics::histogram!("vllm:request_inference_time_seconds")
        .record(seconds(scheduled, o.finished_at));
    let itl = metrics::histogram!("vllm:inter_token_latency_seconds");
    for gap in o.token_times.windows(2) {
        itl.record(seconds(gap[0], gap[1]));
    }
}

/// Publishes gauges and the counters' increments since the last call.
fn publish(
    engine: &Engine,
    last: &mut EngineStats,
    last_eviction: &mut std::collections::BTreeMap<String, pk_engine::EvictionStats>,
) {
    for (policy, now) in &engine.eviction_stats {
        let before = last_eviction.entry(policy.clone()).or_default();
        let labels = [("policy", policy.clone())];
        metrics::counter!("pagekeeper:kv_evicted_blocks_total", &labels)
            .increment(now.evicted_blocks - before.evicted_blocks);
        metrics::counter!("pagekeeper:kv_pruned_prompt_tokens_total", &labels)
            .increment(now.pruned_prompt_tokens - before.pruned_prompt_tokens);
        // KVzip's reconstruction passes (forward and scoring), in whole microseconds: the
        // counter's value is an integer, and each step's share is rounded alike.
        let pass_us = |e: &pk_engine::EvictionStats| {
            ((e.reconstruction_forward_seconds + e.reconstruction_scoring_seconds) * 1e6) as u64
        };
        metrics::counter!("pagekeeper:kv_reconstruction_us_total", &labels)
            .increment(pass_us(now).saturating_sub(pass_us(before)));
        *before = now.clone();
    }
    metrics::gauge!("vllm:num_requests_running").set(engine.num_running() as f64);
    metrics::gauge!("vllm:num_requests_waiting").set(engine.num_waiting() as f64);
    // Running requests whose KVzip passes are still in progress (no token until they end).
    metrics::gauge!("pagekeeper:num_requests_kvzip_passes").set(engine.num_kvzip_pending() as f64);
    metrics::gauge!("vllm:kv_cache_usage_perc").set(engine.kv_manager().usage());
    let s = &engine.stats;
    // Peaks since the server started (what load tests read): blocks are the pool's unit,
    // whatever their layer count.
    let pool = engine.kv_manager().pool();
    // The pool's size is a gauge, so its name does not end in `_total` (a counter's suffix).
    metrics::gauge!("pagekeeper:kv_pool_blocks").set(pool.num_blocks() as f64);
    metrics::gauge!("pagekeeper:kv_blocks_in_use")
        .set((pool.num_blocks() - pool.num_free_blocks()) as f64);
    metrics::gauge!("pagekeeper:kv_blocks_in_use_peak")
        .set((s.kv_bytes_peak / engine.kv_block_bytes().max(1)) as f64);
    metrics::gauge!("pagekeeper:num_requests_running_peak").set(s.max_running_seqs as f64);
    // vLLM's series: every choice's whole prompt, cached prefix included (the prefix cache's
    // share is `vllm:prefix_cache_hits_total`).
    metrics::counter!("vllm:prompt_tokens_total")
        .increment(s.prompt_tokens_served - last.prompt_tokens_served);
    metrics::counter!("vllm:generation_tokens_total")
        .increment(s.generation_tokens - last.generation_tokens);
    metrics::counter!("vllm:num_preemptions_total").increment(s.preemptions - last.preemptions);
    metrics::counter!("vllm:prefix_cache_queries_total")
        .increment(s.prefix_queries_tokens - last.prefix_queries_tokens);
    metrics::counter!("vllm:prefix_cache_hits_total")
        .increment(s.prefix_hits_tokens - last.prefix_hits_tokens);
    // The server compiles every grammar on its blocking pool, so this stays 0; a request
    // compiled here instead stalled every running stream while it compiled.
    metrics::counter!("pagekeeper:engine_thread_grammar_compilations_total")
        .increment(s.grammar_compilations - last.grammar_compilations);
    *last = s.clone();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A finished choice of four tokens is three inter-token latencies (each gap as it
    /// was), and every series it records carries the exporter's `model_name`; counters end
    /// in `_total`.
    #[test]
    fn a_finished_choice_records_one_inter_token_latency_per_gap() {
        let recorder = crate::metrics_builder("m").unwrap().build_recorder();
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let output = RequestOutput {
            choice: 0,
            token_ids: vec![1, 2, 3, 4],
            text: String::new(),
            finish_reason: FinishReason::Length,
            prompt_tokens: 5,
            cached_prompt_tokens: 0,
            arrival: t0,
            scheduled_at: Some(ms(10)),
            first_token_at: Some(ms(100)),
            token_times: vec![ms(100), ms(103), ms(150), ms(3100)],
            finished_at: ms(3100),
            num_preemptions: 0,
            kv_stored_tokens: 0,
            kv_blocks: 0,
            logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
            context_load: None,
            prefill_keeps: None,
        };
        metrics::with_local_recorder(&recorder, || record_finished(&output));
        let text = recorder.handle().render();
        let sample = |name: &str| {
            text.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("{name} not in {text}"))
        };
        assert_eq!(sample("vllm:inter_token_latency_seconds_count"), 3.0);
        // Gaps of 3 ms, 47 ms and 2.95 s: one per bucket, not their mean (1 s) three times.
        assert_eq!(
            sample("vllm:inter_token_latency_seconds_bucket{model_name=\"m\",le=\"0.005\"}"),
            1.0
        );
        assert_eq!(
            sample("vllm:inter_token_latency_seconds_bucket{model_name=\"m\",le=\"0.05\"}"),
            2.0
        );
        assert!((sample("vllm:inter_token_latency_seconds_sum") - 3.0).abs() < 1e-9);
        assert!((sample("vllm:request_queue_time_seconds_sum") - 0.01).abs() < 1e-9);
        assert!((sample("vllm:request_prefill_time_seconds_sum") - 0.09).abs() < 1e-9);
        assert!((sample("vllm:request_decode_time_seconds_sum") - 3.0).abs() < 1e-9);
        assert_eq!(
            sample("vllm:request_success_total{model_name=\"m\",finished_reason=\"length\"}"),
            1.0
        );
        for line in text
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
        {
            assert!(line.contains("model_name=\"m\""), "{line}");
        }
        for line in text.lines().filter(|l| l.ends_with(" counter")) {
            assert!(
                line.trim_end_matches(" counter").ends_with("_total"),
                "{line}"
            );
        }
    }

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
