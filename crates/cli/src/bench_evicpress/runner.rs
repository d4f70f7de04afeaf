//! Step 4 of the benchmark (see mod.rs): one engine and store per policy, warmed with
//! every context, serving the trace one request at a time ([`Runner::serve`]) and, for
//! the loaded runs, in real time with continuous batching ([`Runner::serve_loaded`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::Result;
use pk_engine::{Engine, GenerateParams};
use pk_evicpress::{DelayModel, Policy};

use super::setup::Setup;
use super::sim::mean;
use super::{engine_for, load, row_of, store_config, tiers_for, workload};
use super::{EvicpressArgs, Preset, RunRow};

/// Per-request results of loaded runs of one policy at one load, pooled over repeats.
#[derive(Default)]
pub struct LoadedRun {
    pub ttft: Vec<f64>,
    pub quality: Vec<f64>,
    pub task: Vec<f64>,
    pub f1: Vec<f64>,
    pub hits: BTreeMap<String, u64>,
}

impl LoadedRun {
    pub fn extend(&mut self, other: LoadedRun) {
        self.ttft.extend(other.ttft);
        self.quality.extend(other.quality);
        self.task.extend(other.task);
        self.f1.extend(other.f1);
        for (tier, n) in other.hits {
            *self.hits.entry(tier).or_default() += n;
        }
    }
}

/// One real load, for fitting the simulator's delay model.
pub struct Load {
    pub tier: usize,
    pub bytes: u64,
    pub fetch_decode_s: f64,
    pub kept_tokens: usize,
    pub ttft_s: f64,
}

/// One policy's engine and store during the real runs.
pub struct Runner {
    e: Engine,
    store: Arc<pk_evicpress::ContextStore>,
    pub name: String,
    pub alpha: Option<f64>,
    /// The row's scenario: `base`, or `bounded-F` (one copy per context, tiers holding F
    /// of the working set).
    scenario: String,
    ram_fraction: f64,
    ttft: Vec<f64>,
    quality: Vec<f64>,
    pub service: Vec<f64>,
    f1: Vec<f64>,
    /// Requests whose measured token-F1 differed from setup's table (should be none).
    f1_mismatches: usize,
    task: Vec<f64>,
    hits: BTreeMap<String, u64>,
    /// Quality of the requests served from the fastest tier.
    fastest_quality: Vec<f64>,
    loads: Vec<Load>,
}

impl Runner {
    /// A fresh store on fresh tiers, warmed with every context (inserted in order and
    /// placed by the policy, with its profile). With `tiers_fraction` F, the store keeps one
    /// copy per context and all tiers together hold F of the working set.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        a: &EvicpressArgs,
        p: &Preset,
        s: &Setup,
        policy: &Policy,
        delay: &DelayModel,
        dir: &std::path::Path,
        run: &str,
        working_set: u64,
        name: &str,
        alpha: Option<f64>,
        tiers_fraction: Option<f64>,
    ) -> Result<Runner> {
        let (tiers, caps) = tiers_for(a, dir, run, working_set, tiers_fraction)?;
        let copies = match tiers_fraction {
            Some(_) => pk_evicpress::Copies::PlacedOnly,
            None => pk_evicpress::Copies::MasterAndPlaced,
        };
        // Room for four contexts at once, so that loaded runs batch.
        let (e, contexts) = engine_for(
            a,
            store_config(tiers, caps, &p.grid, policy.clone(), delay, copies),
            4 * (p.spec.max_tokens + 256),
        )?;
        let store = contexts.store().clone();
        if name == super::NO_KVZIP {
            // A context recomputed after a drop is offered again; without this the engine
            // would score it by KVzip on the request path. Idle-time scoring, which the
            // benchmark never runs, keeps the KVzip configurations unavailable.
            contexts.score_kvzip_in_idle_time();
        }
        for (c, ctx) in s.contexts.iter().enumerate() {
            let key = contexts.context_key(&ctx.tokens, None).expect("aligned");
            // Without KVzip scores the grid's KVzip configurations are unavailable.
            let kvzip = (name != super::NO_KVZIP)
                .then(|| s.kvzip_scores[c].clone())
                .flatten();
            let snapkv = s.snapkv_scores[c].clone();
            // The profile first, so that the context's first placement already uses it
            // (with one copy per context a compressed copy cannot be re-encoded later).
            store
                .preset_profile(&key, s.profiles[c].clone())
                .map_err(anyhow::Error::msg)?;
            store.offer_with_scores(key, s.masters[c].clone(), snapkv, kvzip);
            store.flush();
        }
        Ok(Runner {
            e,
            store,
            name: name.into(),
            alpha,
            scenario: tiers_fraction.map_or("base".into(), super::report::bounded_name),
            ram_fraction: a.ram_fraction,
            ttft: Vec::new(),
            quality: Vec::new(),
            service: Vec::new(),
            f1: Vec::new(),
            f1_mismatches: 0,
            task: Vec::new(),
            hits: BTreeMap::new(),
            fastest_quality: Vec::new(),
            loads: Vec::new(),
        })
    }

    pub fn serve(&mut self, p: &Preset, s: &Setup, r: &workload::Request) -> Result<()> {
        let greedy = GenerateParams {
            max_tokens: p.answer_tokens,
            ..Default::default()
        };
        let c = &s.contexts[r.context];
        let out = self.e.generate(
            &[&c.tokens[..], &c.test_queries[r.query]].concat(),
            &greedy,
            &mut |_| {},
        )?;
        self.ttft.push(out.prefill_seconds);
        self.service.push(out.prefill_seconds + out.decode_seconds);
        let f1 =
            pk_connectors::profiler::token_f1(&out.token_ids, &s.references[r.context][r.query]);
        let config = out.context_load.as_ref().map_or(0, |l| {
            p.grid
                .configs()
                .iter()
                .position(|g| g.to_string() == l.config)
                .unwrap_or(0)
        });
        if (f1 - s.test_f1[r.context][config][r.query]).abs() > 1e-9 {
            self.f1_mismatches += 1;
        }
        self.f1.push(f1);
        self.quality.push(s.test_scores[r.context][config][r.query]);
        self.task.push(workload::task_score(
            &self.e.tokenizer.decode(&out.token_ids),
            &c.test_answers[r.query],
        ));
        let tier = out
            .context_load
            .as_ref()
            .map_or("recompute".to_string(), |l| l.tier.clone());
        *self.hits.entry(tier).or_insert(0u64) += 1;
        if out.context_load.as_ref().is_some_and(|l| l.tier_index == 0) {
            self.fastest_quality
                .push(s.test_scores[r.context][config][r.query]);
        }
        if let Some(l) = &out.context_load {
            let answered = c.test_queries[r.query].len() + out.token_ids.len();
            self.loads.push(Load {
                tier: l.tier_index,
                bytes: l.bytes,
                fetch_decode_s: l.fetch_s + l.decode_s,
                kept_tokens: out.kv_stored_tokens.saturating_sub(answered),
                ttft_s: out.prefill_seconds,
            });
        }
        // Placement runs on the store's worker; it is complete before the next request.
        self.store.flush();
        Ok(())
    }

    /// Serves the whole trace in real time with arrivals at `arrivals_s` (see load.rs).
    pub fn serve_loaded(
        &mut self,
        p: &Preset,
        s: &Setup,
        reqs: &[workload::Request],
        arrivals_s: &[f64],
    ) -> Result<LoadedRun> {
        let prompts: Vec<Vec<u32>> = reqs
            .iter()
            .map(|r| {
                [
                    &s.contexts[r.context].tokens[..],
                    &s.contexts[r.context].test_queries[r.query],
                ]
                .concat()
            })
            .collect();
        let results = load::serve_loaded(&mut self.e, &prompts, arrivals_s, p.answer_tokens)?;
        let (mut ttft, mut quality, mut f1, mut task, mut hits, mut mismatches) = (
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            BTreeMap::new(),
            0,
        );
        for (r, out) in reqs.iter().zip(&results) {
            let c = &s.contexts[r.context];
            let config = out.config.as_ref().map_or(0, |name| {
                p.grid
                    .configs()
                    .iter()
                    .position(|g| &g.to_string() == name)
                    .unwrap_or(0)
            });
            let measured_f1 = pk_connectors::profiler::token_f1(
                &out.token_ids,
                &s.references[r.context][r.query],
            );
            if (measured_f1 - s.test_f1[r.context][config][r.query]).abs() > 1e-9 {
                mismatches += 1;
            }
            ttft.push(out.ttft_s);
            f1.push(measured_f1);
            quality.push(s.test_scores[r.context][config][r.query]);
            task.push(workload::task_score(
                &self.e.tokenizer.decode(&out.token_ids),
                &c.test_answers[r.query],
            ));
            let tier = out.tier.clone().unwrap_or_else(|| "recompute".to_string());
            *hits.entry(tier).or_insert(0u64) += 1;
        }
        if mismatches > 0 {
            eprintln!("warning: {} under load: {mismatches} requests answered differently from setup's table", self.name);
        }
        self.store.flush();
        Ok(LoadedRun {
            ttft,
            quality,
            task,
            f1,
            hits,
        })
    }

    pub fn finish(self) -> (RunRow, Vec<Load>) {
        let st = self.store.stats();
        if self.f1_mismatches > 0 {
            eprintln!(
                "warning: {}: {} requests answered differently from setup's table",
                self.name, self.f1_mismatches
            );
        }
        let mut row = row_of(
            &self.name,
            self.alpha,
            "real",
            &self.scenario,
            self.ram_fraction,
            &self.ttft,
            &self.quality,
            &self.task,
            self.hits,
        );
        row.quality_f1 = Some(mean(&self.f1));
        row.fastest_tier_quality =
            (!self.fastest_quality.is_empty()).then(|| mean(&self.fastest_quality));
        row.service_s = self.service;
        row.bytes_moved = Some(st.bytes_moved);
        row.placement_cpu_ms_mean =
            Some(1e3 * st.placement_cpu_s_total / st.placement_decisions.max(1) as f64);
        row.placement_cpu_ms_max = Some(1e3 * st.placement_cpu_s_max);
        (row, self.loads)
    }
}
