//! Step 1 and the quality half of step 2 of the benchmark (see mod.rs): the contexts, each
//! prefilled once (the full-prefill baseline) with its master KV kept, the full-KV answers
//! to its test queries (the references), its profile, and the test queries' scores under
//! every grid configuration (for the real runs' quality and for the simulator).

use std::sync::Arc;

use anyhow::{Context as _, Result};
use pk_connectors::profiler::{profile_blocking, start_profile_with};
use pk_connectors::profiler::{Profiling, QualityMetric};
use pk_connectors::{ContextReuse, PrefixKv};
use pk_engine::{Engine, GenerateParams};
use pk_evicpress::{DelayModel, Policy, TierSpec};
use pk_tiers::{RamTier, Tier};

use super::sim::mean;
use super::workload;
use super::{engine_for, store_config, EvicpressArgs, Preset};

#[derive(Default)]
pub struct Setup {
    pub contexts: Vec<workload::Context>,
    pub masters: Vec<pk_codec::KvContext>,
    /// Each context's SnapKV scores, computed when the setup's engine offered it.
    pub snapkv_scores: Vec<Option<Vec<f32>>>,
    /// KVzip scores per context, computed by the engine when setup stored it.
    pub kvzip_scores: Vec<Option<Vec<f32>>>,
    pub master_bytes: Vec<u64>,
    pub full_prefill_s: Vec<f64>,
    /// Full prefill and the answer's decode, per context.
    pub full_service_s: Vec<f64>,
    /// references[c][q]: full-KV answer to test query q.
    pub references: Vec<Vec<Vec<u32>>>,
    pub profiles: Vec<Vec<f32>>,
    pub test_quality: Vec<Vec<f32>>,
    /// test_f1[c][config][q] and test_scores[c][config][q]: token-F1 and the quality metric's
    /// score of each test query under each configuration.
    pub test_f1: Vec<Vec<Vec<f64>>>,
    pub test_scores: Vec<Vec<Vec<f64>>>,
    /// test_task[c][config]: mean task score of the configuration's test answers.
    pub test_task: Vec<Vec<f32>>,
    /// reference_task[c][q]: task score of the full-KV answer.
    pub reference_task: Vec<Vec<f64>>,
    pub prefill_tokens_per_s: f64,
}

pub fn setup(a: &EvicpressArgs, p: &Preset) -> Result<Setup> {
    let (mut e, contexts) = setup_engine(a, p)?;
    let mut s = Setup {
        contexts: workload::contexts(&e.tokenizer, &p.spec),
        ..Default::default()
    };
    let mut prefill_tokens = 0usize;
    for i in 0..s.contexts.len() {
        prefill_tokens += add_references(&mut e, &contexts, p, &mut s, i)?;
    }
    s.prefill_tokens_per_s = prefill_tokens as f64 / s.full_prefill_s.iter().sum::<f64>();
    s.reference_task = s
        .contexts
        .iter()
        .zip(&s.references)
        .map(|(c, refs)| {
            refs.iter()
                .zip(&c.test_answers)
                .map(|(r, gold)| workload::task_score(&e.tokenizer.decode(r), gold))
                .collect()
        })
        .collect();
    for i in 0..s.contexts.len() {
        add_scores(&mut e, &contexts, a, p, &mut s, i)?;
    }
    Ok(s)
}

/// The setup's engine: one RAM tier that holds every master, under LRU, with room for a
/// batch of profiling requests, each holding a context.
fn setup_engine(a: &EvicpressArgs, p: &Preset) -> Result<(Engine, Arc<ContextReuse>)> {
    let ram: Arc<dyn Tier> = Arc::new(RamTier::new(16 << 30));
    let delay = DelayModel {
        tiers: vec![TierSpec {
            name: "ram".into(),
            capacity_bytes: 0,
            read_bytes_per_s: 1e10,
            access_latency_s: 0.0,
        }],
        decode_s_per_byte: 0.0,
        restore_s_per_token: 0.0,
        prefill_tokens_per_s: 300.0,
        query_tokens: 20,
    };
    engine_for(
        a,
        store_config(
            vec![ram],
            vec![u64::MAX],
            &p.grid,
            Policy::Lru,
            &delay,
            pk_evicpress::Copies::MasterAndPlaced,
        ),
        32 * 1024,
    )
}

/// Context `i`'s full prefill (timed), master KV and SnapKV and KVzip scores from the store, and the
/// full-KV answers to its test queries. Returns the tokens prefilled.
fn add_references(
    e: &mut Engine,
    contexts: &ContextReuse,
    p: &Preset,
    s: &mut Setup,
    i: usize,
) -> Result<usize> {
    let store = contexts.store();
    let greedy = GenerateParams {
        max_tokens: p.answer_tokens,
        ..Default::default()
    };
    let c = &s.contexts[i];
    // A cold prefill of context and first test query: the full-prefill baseline.
    let prompt = [&c.tokens[..], &c.test_queries[0]].concat();
    let passes_before_s = e.stats.kvzip_store_seconds;
    let out = e.generate(&prompt, &greedy, &mut |_| {})?;
    s.full_prefill_s.push(out.prefill_seconds);
    // Storing the context ran KVzip's passes (when the grid drops by KVzip) between its
    // first and second token: the store's work, not a full prefill's service.
    let passes_s = e.stats.kvzip_store_seconds - passes_before_s;
    s.full_service_s
        .push(out.prefill_seconds + out.decode_seconds - passes_s);
    store.flush();
    let key = contexts
        .context_key(&c.tokens, None)
        .context("context key")?;
    let master = store.load_master(&key).map_err(anyhow::Error::msg)?;
    s.snapkv_scores.push(store.snapkv_scores_of(&key));
    s.kvzip_scores.push(store.kvzip_scores_of(&key));
    if super::has_kvzip(&p.grid) && s.kvzip_scores.last().is_some_and(Option::is_none) {
        anyhow::bail!("context {i} was stored without KVzip scores (see the engine's warning)");
    }
    s.master_bytes
        .push(p.grid.configs()[0].bytes(&master.shape()));
    let prefix = Arc::new(PrefixKv { kv: master.clone() });
    let mut refs = vec![out.token_ids];
    for q in &c.test_queries[1..] {
        let params = GenerateParams {
            prefix_kv: Some(prefix.clone()),
            ..greedy.clone()
        };
        refs.push(
            e.generate(&[&c.tokens[..], q].concat(), &params, &mut |_| {})?
                .token_ids,
        );
    }
    s.references.push(refs);
    s.masters.push(master);
    eprintln!(
        "context {i} ({:?}, {} tokens): full prefill {:.2} s",
        c.kind,
        c.tokens.len(),
        s.full_prefill_s[i]
    );
    Ok(prompt.len())
}

/// Context `i`'s profile, and its test queries' token-F1, quality-metric and task scores
/// under every configuration.
fn add_scores(
    e: &mut Engine,
    contexts: &ContextReuse,
    a: &EvicpressArgs,
    p: &Preset,
    s: &mut Setup,
    i: usize,
) -> Result<()> {
    let n_configs = p.grid.len();
    let c = &s.contexts[i];
    let key = contexts
        .context_key(&c.tokens, None)
        .context("context key")?;
    let queries = &c.profile_queries;
    s.profiles.push(profile_blocking(
        e,
        contexts,
        key,
        queries,
        p.answer_tokens,
    )?);
    // Test queries: token-F1 always (what the real runs measure), and the quality
    // metric's per-query scores when it differs.
    let t = run_profile(
        e,
        contexts,
        key,
        &c.test_queries,
        p.answer_tokens,
        QualityMetric::AnswerF1,
    )?;
    let n_q = c.test_queries.len();
    let f1: Vec<Vec<f64>> = (0..n_configs)
        .map(|g| (0..n_q).map(|q| t.quality_of(g, q)).collect())
        .collect();
    let scores = if a.quality_metric == QualityMetric::AnswerF1 {
        f1.clone()
    } else {
        let m = run_profile(
            e,
            contexts,
            key,
            &c.test_queries,
            p.answer_tokens,
            a.quality_metric,
        )?;
        (0..n_configs)
            .map(|g| (0..n_q).map(|q| m.quality_of(g, q)).collect())
            .collect()
    };
    s.test_quality
        .push(scores.iter().map(|qs| mean(qs) as f32).collect());
    s.test_f1.push(f1);
    s.test_scores.push(scores);
    s.test_task.push(task_scores(e, p, c, &t));
    eprintln!(
        "profiled context {i}: {:?}",
        s.profiles[i]
            .iter()
            .map(|q| (q * 100.0).round() / 100.0)
            .collect::<Vec<_>>()
    );
    Ok(())
}

/// Per configuration, the mean task score of its answers to `c`'s test queries.
fn task_scores(e: &Engine, p: &Preset, c: &workload::Context, t: &Profiling) -> Vec<f32> {
    (0..p.grid.len())
        .map(|g| {
            let scores: Vec<f64> = c
                .test_answers
                .iter()
                .enumerate()
                .map(|(q, gold)| {
                    workload::task_score(
                        &e.tokenizer.decode(&t.answer(g, q).unwrap_or_default()),
                        gold,
                    )
                })
                .collect();
            mean(&scores) as f32
        })
        .collect()
}

fn run_profile(
    e: &mut Engine,
    contexts: &ContextReuse,
    key: pk_tiers::ChunkKey,
    queries: &[Vec<u32>],
    answer_tokens: usize,
    metric: QualityMetric,
) -> Result<Profiling> {
    let mut t = start_profile_with(e, contexts, key, queries, answer_tokens, metric)?;
    while !t.poll(e)? {
        e.step();
    }
    Ok(t)
}

/// The setup's figures for results.json's `summary.setup`.
pub fn summary(s: &Setup, p: &Preset, working_set: u64) -> serde_json::Value {
    serde_json::json!({
        "contexts": s.contexts.iter().map(|c| serde_json::json!({"kind": c.kind, "tokens": c.tokens.len()})).collect::<Vec<_>>(),
        "working_set_bytes": working_set,
        "requests": p.requests,
        "grid": p.grid.configs().iter().map(|c| c.to_string()).collect::<Vec<_>>(),
        "prefill_tokens_per_s": s.prefill_tokens_per_s,
        "full_prefill_s": s.full_prefill_s,
        "profiles": s.profiles,
        "test_quality": s.test_quality,
        "test_f1": s.test_f1,
        "test_scores": s.test_scores,
        "test_task": s.test_task,
    })
}
