//! `pagekeeper bench evicpress`: EVICPRESS against full prefill, LRU without compression
//! and fixed-ratio + LRU, on the real engine and tiers (RAM → disk → Redis when given),
//! plus a validated trace-driven simulator for the sweeps (issue 9).
//!
//! Method, in order:
//! 1. Setup: generate the contexts; prefill each once (that prefill's time to first token
//!    is the full-prefill baseline for the context), keep its master KV; answer every
//!    profiling and test query from the full KV (the references).
//! 2. Profile every context on the engine (token-F1 vs the full-KV answers, per grid
//!    configuration); also score the test queries per configuration (for the simulator).
//! 3. Measure the tiers (write and read a master-sized payload on each).
//! 4. Real runs, one per policy: a fresh store on fresh tiers, warmed with every context
//!    (inserted in order, placed by the policy), then the trace, each request served by every policy in turn (so that the shared host's drifting
//!    load weighs on all alike). TTFT is submission to first token, one request at a time
//!    (no queueing); quality is the token-F1 of the answer against the full-KV answer, or
//!    with `--quality-metric teacher-forced` the agreement of the served configuration on
//!    the full-KV answer (looked up from setup's per-query table: answers are deterministic,
//!    and the run checks that its measured token-F1 matches the table's).
//!    Placement runs on the store's worker; the run waits for it between requests, so every
//!    policy is measured with its placement complete.
//! 5. The simulator replays the same trace with a delay model fitted to step 4's loads,
//!    reports its error against the real runs, then sweeps.
//!
//! Files: this one runs the steps in order; setup.rs is steps 1 and 2, delay.rs steps 3
//! and the fit of 5, runner.rs (with load.rs for the loaded runs) step 4, sim.rs the
//! simulator, report.rs the sweeps and what goes to `--out`, workload.rs the contexts and
//! the trace.

mod bounded;
mod delay;
mod families;
mod load;
mod report;
mod runner;
mod setup;
mod sim;
mod workload;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use clap::Args;
use pk_connectors::{ContextReuse, ContextReuseConfig, ReuseConfig};
use pk_engine::{Engine, EngineConfig};
use pk_evicpress::{Compression, DelayModel, Grid, Policy, Ranking, StoreConfig};
use pk_tiers::{DiskTier, DiskTierConfig, RamTier, RedisTier, RedisTierConfig, Tier};
use serde::Serialize;

use self::runner::{LoadedRun, Runner};
use self::setup::Setup;
use self::sim::{mean, percentile, SimContext};
use self::workload::WorkloadSpec;

#[derive(Args)]
pub struct EvicpressArgs {
    #[command(flatten)]
    pub model: crate::args::ModelArgs,
    /// Small preset (4-7 minutes here): 9 contexts of 1-1.75K tokens, 5 profiling and 3 test
    /// questions each, 40 requests, an 11-configuration grid.
    #[arg(long, conflicts_with = "full")]
    pub quick: bool,
    /// Larger preset: 18 contexts of 1-4K tokens, 6 profiling and 4 test questions each, 120
    /// requests, the default 23-configuration grid.
    #[arg(long)]
    pub full: bool,
    /// Where results.json, REPORT.md and the PNG plot go.
    #[arg(long, default_value = "docs/results/evicpress")]
    pub out: PathBuf,
    /// Print one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    /// Fraction of the working set (masters, f16) the RAM tier holds.
    #[arg(long, default_value_t = 0.2)]
    pub ram_fraction: f64,
    /// Fraction of the working set the disk tier holds when Redis is the last tier.
    #[arg(long, default_value_t = 0.5)]
    pub disk_fraction: f64,
    /// Redis URL for the last tier (else the disk tier is last and unlimited).
    #[arg(long, env = "PAGEKEEPER_BENCH_REDIS")]
    pub redis: Option<String>,
    /// α values of the real EVICPRESS runs.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    pub alphas: Vec<f64>,
    /// Configurations of the real fixed-ratio + LRU runs.
    #[arg(long, value_delimiter = ',', default_value = "knorm-0.5,q4")]
    pub fixed: Vec<String>,
    /// Zipf exponent of context popularity.
    #[arg(long, default_value_t = 1.0)]
    pub zipf: f64,
    /// Mean request rate (Poisson), per second: the clock of popularity drift and of the
    /// simulator's frequency decay (real runs serve requests one at a time; queueing is
    /// not part of the measured TTFT).
    #[arg(long, default_value_t = 1.0)]
    pub rate: f64,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// How profiling scores a configuration (f1 or teacher-forced; see `serve --help`).
    #[arg(long, default_value = "f1", value_parser = crate::tier_args::parse_profile_metric)]
    pub profile_metric: pk_connectors::profiler::QualityMetric,
    /// Also measure every policy under load: the trace in real time at 50/70/90 % of LRU's
    /// capacity, with continuous batching (about a minute per load).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub loaded: bool,
    /// Each loaded cell is this many real-time runs of the trace's length, the first on the
    /// trace itself, the others on fresh traces (same Zipf and rate, seeds seed+1, …) so that
    /// arrivals differ; their requests are pooled into one row. One run of a few tens of
    /// requests near saturation is noisy.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10))]
    pub loaded_repeats: u32,
    /// How test answers are scored for the reported quality (f1 or teacher-forced); token-F1
    /// and the ground-truth task score are reported beside it either way.
    #[arg(long, default_value = "f1", value_parser = crate::tier_args::parse_profile_metric)]
    pub quality_metric: pk_connectors::profiler::QualityMetric,
    /// Configurations added to the preset's grid, e.g. `kvzip-0.5,kvzip-0.25`. When KVzip
    /// configurations are added, every EVICPRESS run (real and simulated) is also run with
    /// them unavailable (`evicpress-no-kvzip`), side by side.
    #[arg(long, value_delimiter = ',')]
    pub grid_add: Vec<String>,
    /// Simulated scenarios in which all tiers together hold this fraction of the working
    /// set's f16 bytes (`bounded-<F>`): what does not fit is dropped and recomputed when
    /// asked for, and a context kept compressed has no master left. Empty
    /// (`--tiers-fractions=`): none.
    #[arg(long, default_value = "0.5,0.25", value_parser = parse_fractions)]
    pub tiers_fractions: Fractions,
    /// Also run each `--tiers-fractions` scenario on the real engine and tiers, with one
    /// copy per context (the paper's store, `Copies::PlacedOnly`): every real policy serves
    /// the trace serially, about as long again as the base real runs per fraction.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub real_bounded: bool,
    /// Keep the cold-read behaviour of an SSD: drop written and read disk files from the
    /// page cache (posix_fadvise), so that the OS does not turn the disk tier into RAM.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub cold_disk: bool,
}

/// Loads of the measured loaded runs, as fractions of LRU's capacity (1 / its mean service
/// time unloaded).
const LOADS: [f64; 3] = [0.5, 0.7, 0.9];

struct Preset {
    spec: WorkloadSpec,
    requests: usize,
    grid: Grid,
    answer_tokens: usize,
}

fn preset(a: &EvicpressArgs) -> Result<Preset> {
    let quick_grid = "q8,k8v4,q4,q2,paged-eviction-0.5,knorm-0.5,keydiff-0.5,snapkv-0.5,paged-eviction-0.8,knorm-0.8";
    let (n, min, max, requests, pq, tq, grid) = if a.full {
        (18, 1024, 4096, 120, 6, 4, Grid::default_grid())
    } else {
        (
            9,
            1024,
            1792,
            40,
            5,
            3,
            Grid::parse(quick_grid).map_err(anyhow::Error::msg)?,
        )
    };
    let grid = with_added(grid, &a.grid_add)?;
    Ok(Preset {
        spec: WorkloadSpec {
            n_contexts: n,
            min_tokens: min,
            max_tokens: max,
            chunk_tokens: 256,
            profile_queries: pq,
            test_queries: tq,
            seed: a.seed,
        },
        requests,
        grid,
        answer_tokens: 10,
    })
}

/// A comma-separated list of numbers that may be empty, one clap value: clap splits a
/// `Vec` flag's value at its delimiter and parses each piece, so an empty value was one
/// empty number and refused, and the bounded scenarios could not be turned off.
#[derive(Clone, Debug, PartialEq)]
pub struct Fractions(pub Vec<f64>);

impl std::ops::Deref for Fractions {
    type Target = [f64];
    fn deref(&self) -> &[f64] {
        &self.0
    }
}

fn parse_fractions(list: &str) -> Result<Fractions, String> {
    if list.trim().is_empty() {
        return Ok(Fractions(Vec::new()));
    }
    list.split(',')
        .map(|s| {
            s.trim()
                .parse::<f64>()
                .map_err(|_| format!("{s:?} is not a number"))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Fractions)
}

/// `grid` with the `--grid-add` configurations after its own. One the grid already holds
/// (or that the list names twice) is refused by name: adding it would change nothing, and
/// a report whose command line lists it would claim it was added.
fn with_added(grid: Grid, added: &[String]) -> Result<Grid> {
    let mut configs: Vec<Compression> = grid.configs().to_vec();
    for name in added {
        let c = Compression::parse(name).map_err(|e| anyhow::anyhow!("--grid-add {name}: {e}"))?;
        if configs.contains(&c) {
            anyhow::bail!("--grid-add {name}: the grid already holds it");
        }
        configs.push(c);
    }
    Grid::new(configs.into_iter().skip(1)).map_err(|e| anyhow::anyhow!("--grid-add: {e}"))
}

/// Whether the grid drops by KVzip (and every EVICPRESS run is also run without it).
pub(crate) fn has_kvzip(grid: &Grid) -> bool {
    grid.configs()
        .iter()
        .any(|c| c.drop_score() == Some(pk_evicpress::DropScore::KvZip))
}

/// The policy name of EVICPRESS runs with the grid's KVzip configurations unavailable.
pub(crate) const NO_KVZIP: &str = "evicpress-no-kvzip";

/// One row of the JSON output (the contract, plus extra fields).
#[derive(Serialize, Clone)]
pub struct RunRow {
    pub policy: String,
    pub alpha: Option<f64>,
    pub ttft_mean_s: f64,
    pub ttft_p50_s: f64,
    pub ttft_p95_s: f64,
    pub quality: f64,
    /// Token-F1 against the full-KV answer (= `quality` under the default metric).
    pub quality_f1: Option<f64>,
    /// Ground-truth task score on the test queries (the asked code is the answer's first
    /// number), the measure the paper's "quality drop" uses; `quality` compares with the
    /// full-KV answer instead.
    pub task_score: Option<f64>,
    pub hits_per_tier: BTreeMap<String, u64>,
    /// Mean quality of the requests served from the fastest tier (what the policy chose to
    /// keep closest), where any were.
    pub fastest_tier_quality: Option<f64>,
    /// "real" (engine and tiers) or "sim" (trace-driven simulator).
    pub source: String,
    pub scenario: String,
    pub ram_fraction: f64,
    pub bytes_moved: Option<u64>,
    pub placement_cpu_ms_mean: Option<f64>,
    pub placement_cpu_ms_max: Option<f64>,
    /// Per-request TTFT and service time (TTFT + the answer's decode), in trace order.
    #[serde(skip)]
    pub ttft_s: Vec<f64>,
    #[serde(skip)]
    pub service_s: Vec<f64>,
}

/// The benchmark's tiers, fastest first, and each one's logical capacity in bytes (what the
/// store enforces; the tiers themselves get slack over it).
type TierStack = (Vec<Arc<dyn Tier>>, Vec<u64>);

fn tiers_for(
    a: &EvicpressArgs,
    dir: &std::path::Path,
    run: &str,
    working_set_bytes: u64,
    tiers_fraction: Option<f64>,
) -> Result<TierStack> {
    let n_tiers = 2 + usize::from(a.redis.is_some());
    let caps = tier_capacities(
        a,
        n_tiers,
        a.ram_fraction,
        tiers_fraction,
        working_set_bytes,
    );
    let ram_cap = caps[0];
    // Physical capacities get slack over the logical ones (the store enforces those).
    let ram: Arc<dyn Tier> = Arc::new(RamTier::new(ram_cap * 2 + (64 << 20)));
    let mut disk_cfg = DiskTierConfig::new(dir.join(run), u64::MAX / 4);
    disk_cfg.drop_page_cache = a.cold_disk;
    let disk: Arc<dyn Tier> = Arc::new(DiskTier::open(disk_cfg).context("opening the disk tier")?);
    Ok(match &a.redis {
        Some(url) => {
            let mut rc = RedisTierConfig::new(url);
            rc.key_prefix = format!("pk:bench-evicpress:{run}:");
            rc.io_timeout = Duration::from_secs(10);
            let redis: Arc<dyn Tier> =
                Arc::new(RedisTier::open(rc).context("opening the Redis tier")?);
            (vec![ram, disk, redis], caps)
        }
        None => (vec![ram, disk], caps),
    })
}

/// Tier capacities in bytes with RAM holding `ram_fraction` of the working set, the disk
/// `--disk-fraction` of it when Redis is last, and the last tier unlimited.
///
/// Bounded (`tiers_fraction` F): RAM holds the smaller of its share and F/2, a middle
/// disk the smaller of its share and half of what is left, and the last tier the rest
/// of F, enforced. The simulator and the real bounded runs share this rule.
pub(crate) fn tier_capacities(
    a: &EvicpressArgs,
    n_tiers: usize,
    ram_fraction: f64,
    tiers_fraction: Option<f64>,
    working_set_bytes: u64,
) -> Vec<u64> {
    let ws = working_set_bytes as f64;
    let Some(total) = tiers_fraction else {
        let mut c = vec![(ram_fraction * ws) as u64];
        if n_tiers == 3 {
            c.push((a.disk_fraction * ws) as u64);
        }
        c.push(u64::MAX);
        return c;
    };
    let ram = ram_fraction.min(total / 2.0);
    let mut fractions = vec![ram];
    if n_tiers == 3 {
        fractions.push(a.disk_fraction.min((total - ram) / 2.0));
    }
    fractions.push(total - fractions.iter().sum::<f64>());
    fractions.iter().map(|f| (f * ws) as u64).collect()
}

/// Refuses, by name, numbers the runs cannot use, before minutes of setup.
fn check_numbers(a: &EvicpressArgs) -> Result<()> {
    let positive = |x: f64| x.is_finite() && x > 0.0;
    for (ok, flag) in [
        (
            positive(a.ram_fraction),
            "--ram-fraction must be a positive number",
        ),
        (
            positive(a.disk_fraction),
            "--disk-fraction must be a positive number",
        ),
        (
            !a.alphas.is_empty() && a.alphas.iter().all(|&x| positive(x)),
            "--alphas must be positive numbers",
        ),
        (
            a.tiers_fractions.iter().all(|&x| positive(x) && x < 1.0),
            "--tiers-fractions must be numbers in (0, 1)",
        ),
        (
            a.zipf.is_finite() && a.zipf >= 0.0,
            "--zipf must be at least 0",
        ),
        (positive(a.rate), "--rate must be a positive number"),
    ] {
        if !ok {
            anyhow::bail!("{flag}");
        }
    }
    if let Some(url) = &a.redis {
        pk_tiers::TierConfig::parse_redis(url).map_err(|e| anyhow::anyhow!("--redis: {e}"))?;
    }
    Ok(())
}

/// A real run's policy: its row's name, its α (EVICPRESS only) and the policy itself.
type RealPolicy = (String, Option<f64>, Policy);

pub fn run(a: EvicpressArgs) -> Result<()> {
    check_numbers(&a)?;
    let p = preset(&a)?;
    std::fs::create_dir_all(&a.out)
        .with_context(|| format!("creating --out {}", a.out.display()))?;
    crate::args::set_threads(a.model.resolved()?.threads)?;
    let quiet = report::host_quiet();
    eprintln!("host-quiet: {quiet}");
    check_fixed_in_grid(&a, &p.grid)?;
    let t_start = Instant::now();
    let work = tempfile::Builder::new()
        .prefix("pk-bench-evicpress")
        .tempdir()?;
    let setup = setup::setup(&a, &p)?;
    eprintln!("setup done in {:.0} s", t_start.elapsed().as_secs_f64());
    let working_set: u64 = setup.master_bytes.iter().sum();
    let reqs = workload::trace(
        p.spec.n_contexts,
        p.spec.test_queries,
        p.requests,
        a.zipf,
        a.rate,
        false,
        a.seed,
    );
    let mut delay = delay::measured(&a, &setup, work.path(), working_set)?;
    let policies = real_policies(&a, &p.grid)?;
    let mut rows = vec![full_prefill_row(&a, &setup, &reqs)];
    let dir = work.path();
    let mut runners = warm_runners(&a, &p, &setup, &policies, &delay, dir, working_set, None)?;
    serve_trace(&mut runners, &p, &setup, &reqs)?;
    let loaded_rows = if a.loaded {
        loaded_rows(&a, &p, &setup, &mut runners, &reqs)?
    } else {
        Vec::new()
    };
    let mut loads = Vec::new();
    for runner in runners {
        let (row, run_loads) = runner.finish();
        eprintln!(
            "{} {:?}: TTFT mean {:.3} s, quality {:.3}, task {:.3}",
            row.policy,
            row.alpha,
            row.ttft_mean_s,
            row.quality,
            row.task_score.unwrap_or(f64::NAN)
        );
        rows.push(row);
        loads.extend(run_loads);
    }
    rows.extend(loaded_rows);
    delay::fit(&mut delay, &loads);
    if a.real_bounded {
        let (policies, delay) = (&policies, &delay);
        rows.extend(bounded::real_rows(
            &a,
            &p,
            &setup,
            policies,
            delay,
            dir,
            working_set,
            &reqs,
        )?);
    }
    let sweeps = report::sweeps(
        &a,
        &p.grid,
        &sim_contexts(&p.grid, &setup),
        &reqs,
        &delay,
        working_set,
        &setup.full_prefill_s,
        &policies,
        &mut rows,
    );
    let under_load = load::under_load(&rows, &reqs, a.rate);
    let summary = report::write(
        &a,
        &p.grid,
        &rows,
        &sweeps,
        under_load.as_ref(),
        &delay,
        &setup::summary(&setup, &p, working_set),
        &quiet,
        t_start.elapsed().as_secs_f64(),
    )?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string(
                &serde_json::json!({ "runs": rows, "summary": summary, "host_quiet": quiet })
            )?
        );
    } else {
        println!("{}", std::fs::read_to_string(a.out.join("REPORT.md"))?);
    }
    Ok(())
}

/// Checks every `--fixed` configuration against the grid before the long setup.
fn check_fixed_in_grid(a: &EvicpressArgs, grid: &Grid) -> Result<()> {
    for f in &a.fixed {
        let c = Compression::parse(f).map_err(|e| anyhow::anyhow!("--fixed {f}: {e}"))?;
        grid.index_of(&c).with_context(|| {
            format!(
                "--fixed {f} is not in the grid ({})",
                grid.configs()
                    .iter()
                    .map(|c| c.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })?;
    }
    Ok(())
}

/// The policies of the real runs: LRU, each `--fixed` configuration with LRU, and EVICPRESS
/// at each `--alphas` value.
fn real_policies(a: &EvicpressArgs, grid: &Grid) -> Result<Vec<RealPolicy>> {
    let mut policies: Vec<RealPolicy> = vec![("lru".into(), None, Policy::Lru)];
    for f in &a.fixed {
        let c = Compression::parse(f).map_err(|e| anyhow::anyhow!("--fixed {f}: {e}"))?;
        let idx = grid
            .index_of(&c)
            .with_context(|| format!("--fixed {f} is not in the grid"))?;
        policies.push((format!("fixed-{c}"), None, Policy::Fixed(idx)));
    }
    let names: &[&str] = match has_kvzip(grid) {
        true => &["evicpress", NO_KVZIP],
        false => &["evicpress"],
    };
    for name in names {
        for &alpha in &a.alphas {
            policies.push((
                name.to_string(),
                Some(alpha),
                Policy::Evicpress {
                    alpha,
                    ranking: Ranking::AbsoluteDrop,
                },
            ));
        }
    }
    Ok(policies)
}

/// The full-prefill baseline's real row: each request's context prefilled from scratch
/// (setup's measurements), at full quality.
fn full_prefill_row(a: &EvicpressArgs, setup: &Setup, reqs: &[workload::Request]) -> RunRow {
    let full_task: Vec<f64> = reqs
        .iter()
        .map(|r| setup.reference_task[r.context][r.query])
        .collect();
    let mut row = row_of(
        "full-prefill",
        None,
        "real",
        "base",
        a.ram_fraction,
        &reqs
            .iter()
            .map(|r| setup.full_prefill_s[r.context])
            .collect::<Vec<_>>(),
        &vec![1.0; reqs.len()],
        &full_task,
        BTreeMap::new(),
    );
    row.quality_f1 = Some(1.0);
    row.service_s = reqs
        .iter()
        .map(|r| setup.full_service_s[r.context])
        .collect();
    row
}

/// One engine and store per policy, all warm; with `tiers_fraction` F, one-copy stores on
/// tiers holding F of the working set (`bounded.rs`).
#[allow(clippy::too_many_arguments)]
fn warm_runners(
    a: &EvicpressArgs,
    p: &Preset,
    setup: &Setup,
    policies: &[RealPolicy],
    delay: &DelayModel,
    dir: &std::path::Path,
    working_set: u64,
    tiers_fraction: Option<f64>,
) -> Result<Vec<Runner>> {
    // Each store's tiers get their own directory and Redis prefix.
    let prefix = tiers_fraction.map_or(String::new(), |f| format!("bounded-{f}-"));
    let mut runners = Vec::new();
    for (i, (name, alpha, policy)) in policies.iter().enumerate() {
        runners.push(Runner::new(
            a,
            p,
            setup,
            policy,
            delay,
            dir,
            &format!("{prefix}run{i}"),
            working_set,
            name,
            *alpha,
            tiers_fraction,
        )?);
    }
    Ok(runners)
}

/// Every request is served by each policy in turn, so that the host's load (shared,
/// drifting) weighs on all policies alike.
fn serve_trace(
    runners: &mut [Runner],
    p: &Preset,
    setup: &Setup,
    reqs: &[workload::Request],
) -> Result<()> {
    let t0 = Instant::now();
    for r in reqs {
        for runner in runners.iter_mut() {
            runner.serve(p, setup, r)?;
        }
    }
    eprintln!(
        "real runs: {} requests × {} policies in {:.0} s",
        reqs.len(),
        runners.len(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Loaded real runs: the same trace in real time at fractions of LRU's capacity, every
/// policy at one load before the next load (so that drifting host load is shared). With
/// `--loaded-repeats`, fresh traces follow the first, their requests pooled into one row
/// per policy and load.
fn loaded_rows(
    a: &EvicpressArgs,
    p: &Preset,
    setup: &Setup,
    runners: &mut [Runner],
    reqs: &[workload::Request],
) -> Result<Vec<RunRow>> {
    let lru_service_s = mean(&runners[0].service);
    let traces: Vec<Vec<workload::Request>> = (0..a.loaded_repeats as u64)
        .map(|k| {
            if k == 0 {
                reqs.to_vec()
            } else {
                workload::trace(
                    p.spec.n_contexts,
                    p.spec.test_queries,
                    p.requests,
                    a.zipf,
                    a.rate,
                    false,
                    a.seed + k,
                )
            }
        })
        .collect();
    let mut rows = Vec::new();
    for &load in &LOADS {
        let rate = load / lru_service_s.max(1e-9);
        let mut pooled: Vec<LoadedRun> = (0..runners.len()).map(|_| LoadedRun::default()).collect();
        for trace in &traces {
            let arrivals: Vec<f64> = trace.iter().map(|r| r.arrival_s * a.rate / rate).collect();
            for (runner, pool) in runners.iter_mut().zip(pooled.iter_mut()) {
                pool.extend(runner.serve_loaded(p, setup, trace, &arrivals)?);
            }
        }
        for (runner, pool) in runners.iter().zip(pooled) {
            let mut row = row_of(
                &runner.name,
                runner.alpha,
                "real",
                &format!("load-{:.0}%", 100.0 * load),
                a.ram_fraction,
                &pool.ttft,
                &pool.quality,
                &pool.task,
                pool.hits,
            );
            row.quality_f1 = Some(mean(&pool.f1));
            eprintln!("{} {:?} at {:.0}% load ({rate:.2}/s, {} requests): TTFT mean {:.3} s, quality {:.3}", row.policy, row.alpha, 100.0 * load, pool.ttft.len(), row.ttft_mean_s, row.quality);
            rows.push(row);
        }
    }
    Ok(rows)
}

/// What the simulator knows of each context: its bytes and kept tokens under every grid
/// configuration, and setup's quality figures.
fn sim_contexts(grid: &Grid, setup: &Setup) -> Vec<SimContext> {
    (0..setup.contexts.len())
        .map(|c| {
            let shape = setup.masters[c].shape();
            SimContext {
                bytes: grid.configs().iter().map(|g| g.bytes(&shape)).collect(),
                kept_tokens: grid
                    .configs()
                    .iter()
                    .map(|g| match g.method().drop_spec() {
                        Some(d) => pk_codec::drop::n_kept_tokens(shape.n_tokens, &d),
                        None => shape.n_tokens,
                    })
                    .collect(),
                profile_quality: setup.profiles[c].clone(),
                test_quality: setup.test_quality[c].clone(),
                test_f1: setup.test_f1[c].iter().map(|qs| mean(qs) as f32).collect(),
                test_task: setup.test_task[c].clone(),
            }
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn row_of(
    policy: &str,
    alpha: Option<f64>,
    source: &str,
    scenario: &str,
    ram_fraction: f64,
    ttft: &[f64],
    quality: &[f64],
    task: &[f64],
    hits: BTreeMap<String, u64>,
) -> RunRow {
    RunRow {
        policy: policy.into(),
        alpha,
        ttft_mean_s: mean(ttft),
        ttft_p50_s: percentile(ttft, 50.0),
        ttft_p95_s: percentile(ttft, 95.0),
        quality: mean(quality),
        quality_f1: None,
        task_score: (!task.is_empty()).then(|| mean(task)),
        hits_per_tier: hits,
        fastest_tier_quality: None,
        source: source.into(),
        scenario: scenario.into(),
        ram_fraction,
        bytes_moved: None,
        placement_cpu_ms_mean: None,
        placement_cpu_ms_max: None,
        ttft_s: ttft.to_vec(),
        service_s: Vec::new(),
    }
}

fn store_config(
    tiers: Vec<Arc<dyn Tier>>,
    capacities: Vec<u64>,
    grid: &Grid,
    policy: Policy,
    delay: &DelayModel,
    copies: pk_evicpress::Copies,
) -> StoreConfig {
    StoreConfig {
        tiers,
        capacities_bytes: capacities,
        grid: grid.clone(),
        policy,
        fingerprint: [0; 32],
        delay: delay.clone(),
        frequency_half_life_s: 60.0,
        reprofile_threshold: 0.1,
        max_pending_bytes: 4 << 30,
        max_queries_per_context: 8,
        copies,
    }
}

/// An engine with the EVICPRESS store `store` attached, and the store's connector.
fn engine_for(
    a: &EvicpressArgs,
    store: StoreConfig,
    kv_capacity_tokens: usize,
) -> Result<(Engine, Arc<ContextReuse>)> {
    let path = pk_engine::model_store::resolve_model(a.model.resolved()?.model.as_deref(), true)?;
    let config = EngineConfig {
        block_size_tokens: a.model.block_size,
        kv_dtype: a.model.kv_dtype()?,
        kv_capacity_tokens: Some(kv_capacity_tokens),
        // Every reuse must come from the store: the pool's prefix cache would otherwise
        // serve a context asked twice in a row for free, under every policy alike.
        enable_prefix_caching: false,
        // The store keeps every layer of every token: its engine keeps one table.
        hybrid_kv_cache: false,
        ..Default::default()
    };
    let mut engine = Engine::load(&path, config)?;
    let reuse = ReuseConfig::Contexts(ContextReuseConfig {
        store,
        chunk_size_tokens: 256,
        profile_metric: a.profile_metric,
    });
    let attached = pk_connectors::attach(&mut engine, &reuse)?;
    let contexts = attached.contexts().expect("a context store").clone();
    Ok((engine, contexts))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_add_refuses_what_the_grid_already_holds() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let grid = Grid::parse("q8,q4").unwrap();
        let added = with_added(grid.clone(), &names(&["kvzip-0.5"])).unwrap();
        assert_eq!(added.configs().len(), grid.configs().len() + 1);
        for dup in [&["q4"][..], &["none"], &["kvzip-0.5", "kvzip-0.5"]] {
            let e = with_added(grid.clone(), &names(dup))
                .unwrap_err()
                .to_string();
            assert!(e.contains("already holds"), "{dup:?}: {e}");
            assert!(e.contains(dup[dup.len() - 1]), "{dup:?}: {e}");
        }
    }

    #[test]
    fn tiers_fractions_may_be_empty_but_not_hold_an_empty_number() {
        assert_eq!(parse_fractions("").unwrap(), Fractions(vec![]));
        assert_eq!(
            parse_fractions("0.5,0.25").unwrap(),
            Fractions(vec![0.5, 0.25])
        );
        assert!(parse_fractions("0.5,,0.25").unwrap_err().contains("\"\""));
        assert!(parse_fractions("half").unwrap_err().contains("half"));
    }
}
