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
        });
        placer.place(&mut items, Some(i));
    }
    for i in 0..contexts.len() {
        placer.place(&mut items, Some(i));
    }
    for r in trace {
        let now = r.arrival_s;
        let it = &items[r.context];
        out.ttft_s
            .push(delay.ttft_s(it.tier, it.bytes[it.config], it.kept_tokens[it.config]));
        out.quality
            .push(contexts[r.context].test_quality[it.config] as f64);
        out.task
            .push(contexts[r.context].test_task[it.config] as f64);
        out.f1.push(contexts[r.context].test_f1[it.config] as f64);
        *out.hits_per_tier
            .entry(delay.tiers[it.tier].name.clone())
            .or_default() += 1;
        freq[r.context].bump(now, half_life_s);
        for (k, item) in items.iter_mut().enumerate() {
            item.frequency = freq[k].value_at(now, half_life_s).max(1e-9);
        }
        items[r.context].last_access_s = now;
        placer.place(&mut items, Some(r.context));
    }
    out
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
