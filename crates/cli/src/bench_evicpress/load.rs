//! TTFT under load, two ways.
//! - Measured ([`serve_loaded`]): the trace replayed in real time at a request rate, each
//!   request submitted when its (rescaled) Poisson arrival time comes, the engine stepping
//!   continuously (continuous batching, up to four contexts at once), TTFT from arrival to
//!   first token. Placement runs on the store's worker meanwhile, as in a server.
//! - Replayed ([`under_load`]): the unloaded runs' per-request service times (time to first
//!   token plus the answer's decode) through one FIFO server (Lindley's recursion): cheap,
//!   and a check on the measured runs. It ignores batching, so it overstates queueing.
//!
//! The paper reports the same shape as "higher request rate at the same TTFT".

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use pk_engine::request::{Request as EngineRequest, SeqEvent};
use pk_engine::{Engine, GenerateParams};
use serde::Serialize;

use super::sim::mean;
use super::workload::Request;
use super::RunRow;

/// Mean TTFT (queueing included) of `rows`' requests arriving at `rate_per_s`.
pub fn queued_ttft_mean(
    trace: &[Request],
    trace_rate_per_s: f64,
    rate_per_s: f64,
    ttft_s: &[f64],
    service_s: &[f64],
) -> f64 {
    let scale = trace_rate_per_s / rate_per_s;
    let mut free_at = 0.0f64;
    let mut out = Vec::with_capacity(trace.len());
    for ((r, &t), &s) in trace.iter().zip(ttft_s).zip(service_s) {
        let arrival = r.arrival_s * scale;
        let start = free_at.max(arrival);
        out.push(start - arrival + t);
        free_at = start + s;
    }
    mean(&out)
}

/// The highest rate (bisection) at which the mean queued TTFT stays within `target_s`.
pub fn max_rate_within(
    trace: &[Request],
    trace_rate_per_s: f64,
    ttft_s: &[f64],
    service_s: &[f64],
    target_s: f64,
) -> f64 {
    let (mut lo, mut hi) = (1e-3, 1e3);
    if queued_ttft_mean(trace, trace_rate_per_s, lo, ttft_s, service_s) > target_s {
        return 0.0;
    }
    for _ in 0..60 {
        let mid = (lo * hi).sqrt();
        if queued_ttft_mean(trace, trace_rate_per_s, mid, ttft_s, service_s) <= target_s {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

#[derive(Serialize)]
pub struct LoadRow {
    pub policy: String,
    pub alpha: Option<f64>,
    pub quality: f64,
    pub service_mean_s: f64,
    /// Mean queued TTFT at each load of `UnderLoad::loads` (fractions of LRU's capacity).
    pub ttft_mean_s: Vec<f64>,
    /// The highest request rate whose mean TTFT stays within `UnderLoad::target_s`.
    pub max_rate_per_s: f64,
}

#[derive(Serialize)]
pub struct UnderLoad {
    /// Request rates as fractions of LRU's capacity (1 / its mean service time).
    pub loads: Vec<f64>,
    pub rates_per_s: Vec<f64>,
    /// Twice LRU's unloaded mean TTFT.
    pub target_s: f64,
    pub rows: Vec<LoadRow>,
}

pub fn under_load(rows: &[RunRow], trace: &[Request], trace_rate_per_s: f64) -> Option<UnderLoad> {
    let real: Vec<&RunRow> = rows
        .iter()
        .filter(|r| r.source == "real" && r.service_s.len() == trace.len())
        .collect();
    let lru = real.iter().find(|r| r.policy == "lru")?;
    let capacity_per_s = 1.0 / mean(&lru.service_s).max(1e-9);
    let loads = vec![0.5, 0.7, 0.9];
    let rates_per_s: Vec<f64> = loads.iter().map(|l| l * capacity_per_s).collect();
    let target_s = 2.0 * lru.ttft_mean_s;
    let out = real
        .iter()
        .map(|r| LoadRow {
            policy: r.policy.clone(),
            alpha: r.alpha,
            quality: r.quality,
            service_mean_s: mean(&r.service_s),
            ttft_mean_s: rates_per_s
                .iter()
                .map(|&rate| {
                    queued_ttft_mean(trace, trace_rate_per_s, rate, &r.ttft_s, &r.service_s)
                })
                .collect(),
            max_rate_per_s: max_rate_within(
                trace,
                trace_rate_per_s,
                &r.ttft_s,
                &r.service_s,
                target_s,
            ),
        })
        .collect();
    Some(UnderLoad {
        loads,
        rates_per_s,
        target_s,
        rows: out,
    })
}

/// One request's outcome in a loaded run.
pub struct LoadedResult {
    pub ttft_s: f64,
    /// The stored configuration it was served from (grid name) and the tier, if any.
    pub config: Option<String>,
    pub tier: Option<String>,
    pub token_ids: Vec<u32>,
}

/// Serves `prompts` (one per trace entry) arriving at `arrivals_s` in real time; returns
/// each request's TTFT (arrival to first token) and answer, in trace order.
pub fn serve_loaded(
    e: &mut Engine,
    prompts: &[Vec<u32>],
    arrivals_s: &[f64],
    answer_tokens: usize,
) -> Result<Vec<LoadedResult>> {
    type Slot = Arc<Mutex<Option<(Instant, Option<pk_engine::LoadOrigin>, Vec<u32>)>>>;
    let slots: Vec<Slot> = (0..prompts.len())
        .map(|_| Arc::new(Mutex::new(None)))
        .collect();
    let t0 = Instant::now();
    let (mut next, mut finished) = (0, 0);
    while finished < prompts.len() {
        let now = t0.elapsed().as_secs_f64();
        while next < prompts.len() && arrivals_s[next] <= now {
            let slot = slots[next].clone();
            let sink = Box::new(move |ev: SeqEvent| {
                if let SeqEvent::Finished(o) = ev {
                    let first = o.first_token_at.unwrap_or(o.finished_at);
                    *slot.lock().unwrap() = Some((first, o.context_load, o.token_ids));
                }
                true
            });
            let params = GenerateParams {
                max_tokens: answer_tokens,
                ..Default::default()
            };
            e.submit(EngineRequest {
                prompt_ids: prompts[next].clone(),
                params,
                cache_salt: None,
                sink,
            })
            .map_err(|err| anyhow::anyhow!("{err}"))?;
            next += 1;
        }
        if e.has_work() {
            e.step();
        } else if next < prompts.len() {
            std::thread::sleep(Duration::from_secs_f64(
                (arrivals_s[next] - t0.elapsed().as_secs_f64()).clamp(0.0, 0.05),
            ));
        }
        finished = slots.iter().filter(|s| s.lock().unwrap().is_some()).count();
        if next == prompts.len() && !e.has_work() && finished < prompts.len() {
            anyhow::bail!(
                "{} requests ended without a result",
                prompts.len() - finished
            );
        }
    }
    Ok(slots
        .iter()
        .zip(arrivals_s)
        .map(|(s, &a)| {
            let (first, load, token_ids) = s.lock().unwrap().take().expect("finished");
            LoadedResult {
                ttft_s: first.duration_since(t0).as_secs_f64() - a,
                config: load.as_ref().map(|l| l.config.clone()),
                tier: load.map(|l| l.tier),
                token_ids,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Requests arriving while others run are batched, and still get the answers they get
    /// alone (the engine's batch invariance), which the bench's quality lookup relies on.
    #[test]
    fn loaded_serving_gives_the_answers_of_unloaded_serving() {
        let path = pk_engine::model_store::resolve_model(None, false).unwrap();
        let mut e = Engine::load(&path, pk_engine::EngineConfig::default()).unwrap();
        let prompts: Vec<Vec<u32>> = [
            "The capital of France is",
            "One, two, three,",
            "Water boils at a temperature of",
        ]
        .iter()
        .map(|t| e.tokenizer.encode(t, true))
        .collect();
        let alone: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| {
                e.generate(
                    p,
                    &GenerateParams {
                        max_tokens: 6,
                        ..Default::default()
                    },
                    &mut |_| {},
                )
                .unwrap()
                .token_ids
            })
            .collect();
        let loaded = serve_loaded(&mut e, &prompts, &[0.0, 0.0, 0.02], 6).unwrap();
        for (got, want) in loaded.iter().zip(&alone) {
            assert_eq!(&got.token_ids, want);
            assert!(got.ttft_s > 0.0 && got.ttft_s < 60.0, "{}", got.ttft_s);
            assert!(got.config.is_none() && got.tier.is_none());
        }
    }

    #[test]
    fn a_busy_server_queues_and_an_idle_one_does_not() {
        let trace: Vec<Request> = (0..4)
            .map(|i| Request {
                context: 0,
                query: 0,
                arrival_s: i as f64,
            })
            .collect();
        let ttft = [0.1; 4];
        // One request per second, each taking 0.5 s: nobody waits.
        assert!((queued_ttft_mean(&trace, 1.0, 1.0, &ttft, &[0.5; 4]) - 0.1).abs() < 1e-12);
        // Four per second: arrivals 0.25 s apart, 0.5 s of work each: waits 0, .25, .5, .75.
        assert!(
            (queued_ttft_mean(&trace, 1.0, 4.0, &ttft, &[0.5; 4]) - (0.1 + 0.375)).abs() < 1e-12
        );
        let r = max_rate_within(&trace, 1.0, &ttft, &[0.5; 4], 0.1 + 1e-9);
        assert!((1.9..=2.0 + 1e-6).contains(&r), "{r}");
    }
}
