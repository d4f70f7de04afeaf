//! TTFT under load: the real runs serve one request at a time, so their TTFT has no
//! queueing in it. Here the measured per-request service times (time to first token plus
//! the answer's decode) are replayed through one FIFO server with the trace's Poisson
//! arrivals rescaled to a request rate (Lindley's recursion): what a prefill-bound server
//! that takes requests in order would show. It ignores batching (a real server overlaps
//! decodes with the next prefill), so it overstates queueing at high load for every policy
//! alike. The paper reports the same shape as "higher request rate at the same TTFT".

use serde::Serialize;

use super::sim::mean;
use super::workload::Request;
use super::RunRow;

/// Mean TTFT (queueing included) of `rows`' requests arriving at `rate_per_s`.
pub fn queued_ttft_mean(trace: &[Request], trace_rate_per_s: f64, rate_per_s: f64, ttft_s: &[f64], service_s: &[f64]) -> f64 {
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
pub fn max_rate_within(trace: &[Request], trace_rate_per_s: f64, ttft_s: &[f64], service_s: &[f64], target_s: f64) -> f64 {
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
    let real: Vec<&RunRow> = rows.iter().filter(|r| r.source == "real" && r.service_s.len() == trace.len()).collect();
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
            ttft_mean_s: rates_per_s.iter().map(|&rate| queued_ttft_mean(trace, trace_rate_per_s, rate, &r.ttft_s, &r.service_s)).collect(),
            max_rate_per_s: max_rate_within(trace, trace_rate_per_s, &r.ttft_s, &r.service_s, target_s),
        })
        .collect();
    Some(UnderLoad { loads, rates_per_s, target_s, rows: out })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_server_queues_and_an_idle_one_does_not() {
        let trace: Vec<Request> = (0..4).map(|i| Request { context: 0, query: 0, arrival_s: i as f64 }).collect();
        let ttft = [0.1; 4];
        // One request per second, each taking 0.5 s: nobody waits.
        assert!((queued_ttft_mean(&trace, 1.0, 1.0, &ttft, &[0.5; 4]) - 0.1).abs() < 1e-12);
        // Four per second: arrivals 0.25 s apart, 0.5 s of work each: waits 0, .25, .5, .75.
        assert!((queued_ttft_mean(&trace, 1.0, 4.0, &ttft, &[0.5; 4]) - (0.1 + 0.375)).abs() < 1e-12);
        let r = max_rate_within(&trace, 1.0, &ttft, &[0.5; 4], 0.1 + 1e-9);
        assert!((1.9..=2.0 + 1e-6).contains(&r), "{r}");
    }
}
