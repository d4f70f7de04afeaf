//! The simulator's delay model (step 5 of the benchmark, see mod.rs): each tier's speed
//! measured on a master-sized payload before the real runs, then fitted to what the real
//! runs' loads took.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use pk_evicpress::{DelayModel, TierSpec};
use pk_tiers::{Payload, Tier};

use super::runner::Load;
use super::setup::Setup;
use super::{tiers_for, EvicpressArgs};

/// The delay model with each tier's speed measured on a master-sized payload (fetch and
/// decode), before the real runs refine it ([`fit`]).
pub fn measured(
    a: &EvicpressArgs,
    setup: &Setup,
    dir: &std::path::Path,
    working_set: u64,
) -> Result<DelayModel> {
    let (probe_tiers, _) = tiers_for(a, dir, "probe", working_set, None)?;
    let sample = pk_codec::encode(&setup.masters[0], &pk_codec::Method::None, None, &[0; 32])?;
    let speeds = measure_tiers(&probe_tiers, &sample, &[0; 32]);
    drop(probe_tiers);
    let names: Vec<String> = if a.redis.is_some() {
        vec!["ram".into(), "disk".into(), "redis".into()]
    } else {
        vec!["ram".into(), "disk".into()]
    };
    let delay = DelayModel {
        tiers: names
            .iter()
            .zip(&speeds)
            .map(|(n, (bw, lat))| TierSpec {
                name: n.clone(),
                capacity_bytes: 0,
                read_bytes_per_s: *bw,
                access_latency_s: *lat,
            })
            .collect(),
        decode_s_per_byte: DECODE_S_PER_BYTE,
        restore_s_per_token: 2.0e-5,
        prefill_tokens_per_s: setup.prefill_tokens_per_s,
        query_tokens: 20,
    };
    eprintln!(
        "tier read speeds (MB/s): {:?}",
        speeds
            .iter()
            .map(|s| (s.0 / 1e6).round())
            .collect::<Vec<_>>()
    );
    Ok(delay)
}

/// The delay model's decode term: zero, since the tier speeds measured and fitted include
/// decoding.
const DECODE_S_PER_BYTE: f64 = 0.0;

/// (bytes/s, latency s) of fetching and decoding an encoded master from each tier
/// (median of 3; the latency from a 4 KiB payload).
fn measure_tiers(
    tiers: &[Arc<dyn Tier>],
    sample: &[u8],
    fingerprint: &[u8; 32],
) -> Vec<(f64, f64)> {
    let small = vec![7u8; 4096];
    tiers
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let key = |n: u8| {
                pk_tiers::ChunkKey([
                    0xEE, i as u8, n, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                    0, 0, 0, 0, 0, 0, 0, 0, 0,
                ])
            };
            let _ = t.store(&key(0), &Payload::from(sample.to_vec()));
            let _ = t.store(&key(1), &Payload::from(small.clone()));
            let time = |k| {
                let mut v: Vec<f64> = (0..3)
                    .map(|_| {
                        let t0 = Instant::now();
                        if let Ok(Some(p)) = t.load(&k) {
                            let _ = pk_codec::decode(&p, fingerprint);
                        }
                        t0.elapsed().as_secs_f64()
                    })
                    .collect();
                v.sort_by(f64::total_cmp);
                v[1]
            };
            let (big_s, small_s) = (time(key(0)), time(key(1)));
            let _ = t.delete(&key(0));
            let _ = t.delete(&key(1));
            let bw = sample.len() as f64 / (big_s - small_s).max(1e-6);
            (bw, small_s)
        })
        .collect()
}

/// Fits the delay model to what the real loads took: each tier's speed (fetch and decode
/// together), then the rest of a hit's TTFT.
pub fn fit(delay: &mut DelayModel, loads: &[Load]) {
    for t in 0..delay.tiers.len() {
        let xs: Vec<&Load> = loads.iter().filter(|l| l.tier == t).collect();
        if xs.len() >= 2 {
            let bytes: f64 = xs.iter().map(|l| l.bytes as f64).sum();
            let secs: f64 = xs.iter().map(|l| l.fetch_decode_s).sum();
            delay.tiers[t].read_bytes_per_s = 1.0 / ((secs / bytes) - DECODE_S_PER_BYTE).max(1e-12);
            delay.tiers[t].access_latency_s = 0.0;
        }
    }
    // The rest of a hit's TTFT (writing the kept tokens into the pool, prefilling the
    // query over them, sampling): least squares on `ttft - fetch - decode = r0 + r1 · kept`.
    if loads.len() >= 4 {
        let n = loads.len() as f64;
        let (mx, my) = (
            loads.iter().map(|l| l.kept_tokens as f64).sum::<f64>() / n,
            loads
                .iter()
                .map(|l| l.ttft_s - l.fetch_decode_s)
                .sum::<f64>()
                / n,
        );
        let sxx: f64 = loads
            .iter()
            .map(|l| (l.kept_tokens as f64 - mx).powi(2))
            .sum();
        let sxy: f64 = loads
            .iter()
            .map(|l| (l.kept_tokens as f64 - mx) * (l.ttft_s - l.fetch_decode_s - my))
            .sum();
        let r1 = if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
        let r0 = (my - r1 * mx).max(0.0);
        delay.restore_s_per_token = r1;
        // The constant is expressed as the query tokens it is worth at the measured speed.
        delay.query_tokens = (r0 * delay.prefill_tokens_per_s).round() as usize;
        eprintln!(
            "fitted: {:.1} µs per kept token, {:.1} ms per request",
            r1 * 1e6,
            r0 * 1e3
        );
    }
}
