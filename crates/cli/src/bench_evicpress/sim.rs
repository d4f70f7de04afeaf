//! A trace-driven simulator of the EVICPRESS benchmark: the same placement code
//! (`pk_evicpress::Placer`) replayed over the trace with a delay model fitted to the real
//! runs' loads, and per-(context, configuration) test quality measured on the engine. It
//! makes the large sweeps (α, every fixed ratio, RAM fractions, equal bandwidths, drift)
//! cheap; real runs on a subset validate it (the report gives the error).

use std::collections::BTreeMap;

use pk_evicpress::{DecayedCount, DelayModel, Item, Placer, Policy};

use super::workload::Request;

/// What the simulator knows about one context.
pub struct SimContext {
    pub bytes: Vec<u64>,
    pub kept_tokens: Vec<usize>,
    /// Profiled quality (what placement sees).
    pub profile_quality: Vec<f32>,
    /// Quality on the test queries (what is reported).
    pub test_quality: Vec<f32>,
    /// Token-F1 on the test queries, per configuration.
    pub test_f1: Vec<f32>,
    /// Task score on the test queries (ground truth), per configuration.
    pub test_task: Vec<f32>,
}

pub struct SimResult {
    pub ttft_s: Vec<f64>,
    pub quality: Vec<f64>,
    pub task: Vec<f64>,
    pub f1: Vec<f64>,
    pub hits_per_tier: BTreeMap<String, u64>,
    /// Quality of the requests served from the fastest tier.
    pub fastest_quality: Vec<f64>,
}

/// Replays `trace` with contexts inserted in order at the start (warm store), as the
/// real runs do. `full_prefill_s[c]` is used by the `None` policy (no reuse).
pub fn simulate(
    contexts: &[SimContext],
    trace: &[Request],
    delay: &DelayModel,
    capacities_bytes: &[u64],
    policy: Option<&Policy>,
    half_life_s: f64,
    full_prefill_s: &[f64],
) -> SimResult {
    let mut out = SimResult {
        ttft_s: Vec::new(),
        quality: Vec::new(),
        task: Vec::new(),
        f1: Vec::new(),
        hits_per_tier: BTreeMap::new(),
        fastest_quality: Vec::new(),
    };
    let Some(policy) = policy else {
        for r in trace {
            out.ttft_s.push(full_prefill_s[r.context]);
            out.quality.push(1.0);
            out.f1.push(1.0);
            out.task.push(contexts[r.context].test_task[0] as f64);
        }
        return out;
    };
    let last = capacities_bytes.len() - 1;
    let placer = Placer {
        delay,
        policy,
        capacities_bytes,
    };
    let mut items: Vec<Item> = Vec::new();
    let mut freq = vec![DecayedCount::default(); contexts.len()];
    for (i, c) in contexts.iter().enumerate() {
        freq[i].bump(0.0, half_life_s);
        items.push(Item {
            bytes: c.bytes.clone(),
            kept_tokens: c.kept_tokens.clone(),
            quality: c.profile_quality.clone(),
            frequency: 1.0,
            last_access_s: 0.0,
            tier: last,
            config: 0,
            master: true,
        });
        warm_place(&placer, &mut items, i);
    }
    for i in 0..contexts.len() {
        warm_place(&placer, &mut items, i);
    }
    for r in trace {
        let now = r.arrival_s;
        let it = &mut items[r.context];
        let c = &contexts[r.context];
        if it.tier >= capacities_bytes.len() {
            // Dropped from bounded tiers: recomputed at full quality, then stored again
            // from the KV the recompute made.
            out.ttft_s.push(full_prefill_s[r.context]);
            (it.config, it.master) = (0, true);
            *out.hits_per_tier.entry(RECOMPUTED.into()).or_default() += 1;
        } else {
            out.ttft_s
                .push(delay.ttft_s(it.tier, it.bytes[it.config], it.kept_tokens[it.config]));
            *out.hits_per_tier
                .entry(delay.tiers[it.tier].name.clone())
                .or_default() += 1;
        }
        if it.tier == 0 {
            out.fastest_quality.push(c.test_quality[it.config] as f64);
        }
        out.quality.push(c.test_quality[it.config] as f64);
        out.task.push(c.test_task[it.config] as f64);
        out.f1.push(c.test_f1[it.config] as f64);
        freq[r.context].bump(now, half_life_s);
        for (k, item) in items.iter_mut().enumerate() {
            item.frequency = freq[k].value_at(now, half_life_s).max(1e-9);
        }
        items[r.context].last_access_s = now;
        placer.place(&mut items, Some(r.context));
    }
    out
}

/// `hits_per_tier`'s name for requests to a context dropped from bounded tiers.
pub const RECOMPUTED: &str = "recomputed";

/// Warm-up: context `i` stored from setup's master (every warm-up copy is encoded from
/// it, so even a context that bounded tiers compressed earlier has it here) and placed.
fn warm_place(placer: &Placer, items: &mut [Item], i: usize) {
    items.iter_mut().for_each(|it| it.master = true);
    if items[i].tier >= placer.n_tiers() {
        items[i].config = 0;
    }
    placer.place(items, Some(i));
}

pub fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.iter().sum::<f64>() / xs.len() as f64
}

pub fn percentile(xs: &[f64], p: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[rank.min(v.len() - 1)]
}

#[cfg(test)]
mod tests {
    use super::*;
    use pk_evicpress::{Ranking, TierSpec};

    fn context() -> SimContext {
        SimContext {
            bytes: vec![100, 50],
            kept_tokens: vec![100, 100],
            profile_quality: vec![1.0, 0.95],
            test_quality: vec![1.0, 0.9],
            test_f1: vec![1.0, 0.9],
            test_task: vec![1.0, 1.0],
        }
    }

    #[test]
    fn bounded_tiers_recompute_what_lru_dropped_and_evicpress_compresses_instead() {
        let tier = |name: &str| TierSpec {
            name: name.into(),
            capacity_bytes: 0,
            read_bytes_per_s: 1e4,
            access_latency_s: 0.0,
        };
        let delay = DelayModel {
            tiers: vec![tier("ram"), tier("disk")],
            decode_s_per_byte: 0.0,
            restore_s_per_token: 0.0,
            prefill_tokens_per_s: 100.0,
            query_tokens: 0,
        };
        let contexts: Vec<SimContext> = (0..3).map(|_| context()).collect();
        let trace: Vec<Request> = (0..12)
            .map(|i| Request {
                context: i % 3,
                query: 0,
                arrival_s: i as f64,
            })
            .collect();
        // 200 bytes of tiers for 300 bytes of masters.
        let caps = [100, 100];
        let full = [1.0; 3];
        let lru = simulate(
            &contexts,
            &trace,
            &delay,
            &caps,
            Some(&Policy::Lru),
            60.0,
            &full,
        );
        let recomputed = lru.hits_per_tier.get(RECOMPUTED).copied().unwrap_or(0);
        // Round-robin over 3 with room for 2: once the warm-up's ties are gone (every
        // context warmed at time 0), LRU always drops the next one asked for.
        assert!(recomputed >= 10, "{:?}", lru.hits_per_tier);
        assert!(lru.quality.iter().all(|&q| q == 1.0));
        let evicpress = Policy::Evicpress {
            alpha: 1.0,
            ranking: Ranking::AbsoluteDrop,
        };
        let e = simulate(
            &contexts,
            &trace,
            &delay,
            &caps,
            Some(&evicpress),
            60.0,
            &full,
        );
        assert_eq!(
            e.hits_per_tier.get(RECOMPUTED),
            None,
            "{:?}",
            e.hits_per_tier
        );
        // Two compressed and one whole fit the 200 bytes: nothing is recomputed.
        assert!(e.quality.iter().all(|&q| q > 0.89), "{:?}", e.quality);
        assert!(mean(&e.ttft_s) < mean(&lru.ttft_s));
    }
}
