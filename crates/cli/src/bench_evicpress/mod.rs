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

mod load;
mod report;
mod sim;
mod workload;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use clap::Args;
use pk_engine::{ContextReuseConfig, Engine, EngineConfig, GenerateParams, PrefixKv, ReuseConfig};
use pk_evicpress::{Compression, DelayModel, Grid, Policy, Ranking, StoreConfig, TierSpec};
use pk_tiers::{DiskTier, DiskTierConfig, Payload, RamTier, RedisTier, RedisTierConfig, Tier};
use serde::Serialize;

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
    pub profile_metric: pk_engine::profiler::QualityMetric,
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
    pub quality_metric: pk_engine::profiler::QualityMetric,
    /// Keep the cold-read behaviour of an SSD: drop written and read disk files from the
    /// page cache (posix_fadvise), so that the OS does not turn the disk tier into RAM.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub cold_disk: bool,
}

/// Per-request results of loaded runs of one policy at one load, pooled over repeats.
#[derive(Default)]
struct LoadedRun {
    ttft: Vec<f64>,
    quality: Vec<f64>,
    task: Vec<f64>,
    f1: Vec<f64>,
    hits: BTreeMap<String, u64>,
}

impl LoadedRun {
    fn extend(&mut self, other: LoadedRun) {
        self.ttft.extend(other.ttft);
        self.quality.extend(other.quality);
        self.task.extend(other.task);
        self.f1.extend(other.f1);
        for (tier, n) in other.hits {
            *self.hits.entry(tier).or_default() += n;
        }
    }
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

struct Setup {
    contexts: Vec<workload::Context>,
    masters: Vec<pk_codec::KvContext>,
    /// Each context's SnapKV scores, computed when the setup's engine offered it.
    snapkv_scores: Vec<Option<Vec<f32>>>,
    master_bytes: Vec<u64>,
    full_prefill_s: Vec<f64>,
    /// Full prefill and the answer's decode, per context.
    full_service_s: Vec<f64>,
    /// references[c][q]: full-KV answer to test query q.
    references: Vec<Vec<Vec<u32>>>,
    profiles: Vec<Vec<f32>>,
    test_quality: Vec<Vec<f32>>,
    /// test_f1[c][config][q] and test_scores[c][config][q]: token-F1 and the quality metric's
    /// score of each test query under each configuration.
    test_f1: Vec<Vec<Vec<f64>>>,
    test_scores: Vec<Vec<Vec<f64>>>,
    /// test_task[c][config]: mean task score of the configuration's test answers.
    test_task: Vec<Vec<f32>>,
    /// reference_task[c][q]: task score of the full-KV answer.
    reference_task: Vec<Vec<f64>>,
    prefill_tokens_per_s: f64,
}

/// The benchmark's tiers, fastest first, and each one's logical capacity in bytes (what the
/// store enforces; the tiers themselves get slack over it).
type TierStack = (Vec<Arc<dyn Tier>>, Vec<u64>);

fn tiers_for(
    a: &EvicpressArgs,
    dir: &std::path::Path,
    run: &str,
    working_set_bytes: u64,
) -> Result<TierStack> {
    let ram_cap = (a.ram_fraction * working_set_bytes as f64) as u64;
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
            (
                vec![ram, disk, redis],
                vec![
                    ram_cap,
                    (a.disk_fraction * working_set_bytes as f64) as u64,
                    u64::MAX,
                ],
            )
        }
        None => (vec![ram, disk], vec![ram_cap, u64::MAX]),
    })
}

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

pub fn run(a: EvicpressArgs) -> Result<()> {
    check_numbers(&a)?;
    let p = preset(&a)?;
    std::fs::create_dir_all(&a.out)
        .with_context(|| format!("creating --out {}", a.out.display()))?;
    crate::args::set_threads(a.model.resolved()?.threads)?;
    let quiet = crate::bench_evicpress::report::host_quiet();
    eprintln!("host-quiet: {quiet}");
    // Check every --fixed configuration against the grid before the long setup.
    for f in &a.fixed {
        let c = Compression::parse(f).map_err(|e| anyhow::anyhow!("--fixed {f}: {e}"))?;
        p.grid.index_of(&c).with_context(|| {
            format!(
                "--fixed {f} is not in the grid ({})",
                p.grid
                    .configs()
                    .iter()
                    .map(|c| c.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })?;
    }
    let t_start = Instant::now();
    let work = tempfile::Builder::new()
        .prefix("pk-bench-evicpress")
        .tempdir()?;
    let setup = setup(&a, &p, work.path())?;
    eprintln!("setup done in {:.0} s", t_start.elapsed().as_secs_f64());
    let working_set: u64 = setup.master_bytes.iter().sum();
    let avg_master = working_set / setup.master_bytes.len() as u64;
    let reqs = workload::trace(
        p.spec.n_contexts,
        p.spec.test_queries,
        p.requests,
        a.zipf,
        a.rate,
        false,
        a.seed,
    );

    // Tier speeds for the delay model, on a master-sized payload.
    let (probe_tiers, _) = tiers_for(&a, work.path(), "probe", working_set)?;
    let sample = pk_codec::encode(&setup.masters[0], &pk_codec::Method::None, None, &[0; 32])?;
    let speeds = measure_tiers(&probe_tiers, &sample, &[0; 32]);
    let _ = avg_master;
    drop(probe_tiers);
    let names: Vec<String> = if a.redis.is_some() {
        vec!["ram".into(), "disk".into(), "redis".into()]
    } else {
        vec!["ram".into(), "disk".into()]
    };
    // The tier speeds above include decoding, so the model's own decode term is zero.
    let decode_s_per_byte = 0.0;
    let mut delay = DelayModel {
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
        decode_s_per_byte,
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

    // Real runs.
    let mut policies: Vec<(String, Option<f64>, Policy)> = vec![("lru".into(), None, Policy::Lru)];
    for f in &a.fixed {
        let c = Compression::parse(f).map_err(|e| anyhow::anyhow!("--fixed {f}: {e}"))?;
        let idx = p
            .grid
            .index_of(&c)
            .with_context(|| format!("--fixed {f} is not in the grid"))?;
        policies.push((format!("fixed-{c}"), None, Policy::Fixed(idx)));
    }
    for &alpha in &a.alphas {
        policies.push((
            "evicpress".into(),
            Some(alpha),
            Policy::Evicpress {
                alpha,
                ranking: Ranking::AbsoluteDrop,
            },
        ));
    }
    let full_task: Vec<f64> = reqs
        .iter()
        .map(|r| setup.reference_task[r.context][r.query])
        .collect();
    let mut rows = vec![row_of(
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
    )];
    rows[0].quality_f1 = Some(1.0);
    rows[0].service_s = reqs
        .iter()
        .map(|r| setup.full_service_s[r.context])
        .collect();
    let mut loads: Vec<Load> = Vec::new();
    // One engine and store per policy, all warm; every request is served by each policy in
    // turn, so that the host's load (shared, drifting) weighs on all policies alike.
    let mut runners = Vec::new();
    for (i, (name, alpha, policy)) in policies.iter().enumerate() {
        runners.push(Runner::new(
            &a,
            &p,
            &setup,
            policy,
            &delay,
            work.path(),
            &format!("run{i}"),
            working_set,
            name,
            *alpha,
        )?);
    }
    let t0 = Instant::now();
    for r in &reqs {
        for runner in runners.iter_mut() {
            runner.serve(&p, &setup, r)?;
        }
    }
    eprintln!(
        "real runs: {} requests × {} policies in {:.0} s",
        reqs.len(),
        runners.len(),
        t0.elapsed().as_secs_f64()
    );
    // Loaded real runs: the same trace in real time at fractions of LRU's capacity, every
    // policy at one load before the next load (so that drifting host load is shared).
    let lru_service_s = mean(&runners[0].service);
    let mut loaded_rows = Vec::new();
    if a.loaded {
        let traces: Vec<Vec<workload::Request>> = (0..a.loaded_repeats as u64)
            .map(|k| {
                if k == 0 {
                    reqs.clone()
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
        for &load in &LOADS {
            let rate = load / lru_service_s.max(1e-9);
            let mut pooled: Vec<LoadedRun> =
                (0..runners.len()).map(|_| LoadedRun::default()).collect();
            for trace in &traces {
                let arrivals: Vec<f64> =
                    trace.iter().map(|r| r.arrival_s * a.rate / rate).collect();
                for (runner, pool) in runners.iter_mut().zip(pooled.iter_mut()) {
                    pool.extend(runner.serve_loaded(&p, &setup, trace, &arrivals)?);
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
                loaded_rows.push(row);
            }
        }
    }
    for runner in runners {
        let (row, run_loads) = runner.finish(a.ram_fraction);
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
    // Fit the delay model's per-tier speed to what the real loads took.
    for t in 0..delay.tiers.len() {
        let xs: Vec<&Load> = loads.iter().filter(|l| l.tier == t).collect();
        if xs.len() >= 2 {
            let bytes: f64 = xs.iter().map(|l| l.bytes as f64).sum();
            let secs: f64 = xs.iter().map(|l| l.fetch_decode_s).sum();
            delay.tiers[t].read_bytes_per_s = 1.0 / ((secs / bytes) - decode_s_per_byte).max(1e-12);
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
    let sim_contexts: Vec<SimContext> = (0..setup.contexts.len())
        .map(|c| {
            let shape = setup.masters[c].shape();
            SimContext {
                bytes: p.grid.configs().iter().map(|g| g.bytes(&shape)).collect(),
                kept_tokens: p
                    .grid
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
        .collect();
    let sweeps = report::sweeps(
        &a,
        &p.grid,
        &sim_contexts,
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
        &setup_summary(&setup, &p, working_set),
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

fn setup_summary(s: &Setup, p: &Preset, working_set: u64) -> serde_json::Value {
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

/// One real load, for fitting the simulator's delay model.
struct Load {
    tier: usize,
    bytes: u64,
    fetch_decode_s: f64,
    kept_tokens: usize,
    ttft_s: f64,
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
    }
}

fn engine_for(a: &EvicpressArgs, store: StoreConfig, kv_capacity_tokens: usize) -> Result<Engine> {
    let path = pk_engine::model_store::resolve_model(a.model.resolved()?.model.as_deref(), true)?;
    let config = EngineConfig {
        block_size_tokens: a.model.block_size,
        kv_dtype: a.model.kv_dtype()?,
        kv_capacity_tokens: Some(kv_capacity_tokens),
        reuse: Some(ReuseConfig::Contexts(ContextReuseConfig {
            store,
            chunk_size_tokens: 256,
            profile_metric: a.profile_metric,
        })),
        // Every reuse must come from the store: the pool's prefix cache would otherwise
        // serve a context asked twice in a row for free, under every policy alike.
        enable_prefix_caching: false,
        ..Default::default()
    };
    Engine::load(&path, config)
}

fn setup(a: &EvicpressArgs, p: &Preset, dir: &std::path::Path) -> Result<Setup> {
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
    let _ = dir;
    // Room for a batch of profiling requests, each holding a context.
    let mut e = engine_for(
        a,
        store_config(vec![ram], vec![u64::MAX], &p.grid, Policy::Lru, &delay),
        32 * 1024,
    )?;
    let contexts = workload::contexts(&e.tokenizer, &p.spec);
    let store = e.context_store().expect("configured");
    let greedy = GenerateParams {
        max_tokens: p.answer_tokens,
        ..Default::default()
    };
    let (mut masters, mut master_bytes, mut full_prefill_s, mut references) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut snapkv_scores = Vec::new();
    let mut full_service_s = Vec::new();
    let mut prefill_tokens = 0usize;
    for (i, c) in contexts.iter().enumerate() {
        // A cold prefill of context and first test query: the full-prefill baseline.
        let prompt = [&c.tokens[..], &c.test_queries[0]].concat();
        let out = e.generate(&prompt, &greedy, &mut |_| {})?;
        full_prefill_s.push(out.prefill_seconds);
        full_service_s.push(out.prefill_seconds + out.decode_seconds);
        prefill_tokens += prompt.len();
        store.flush();
        let key = e.context_key(&c.tokens, None).context("context key")?;
        let master = store.load_master(&key).map_err(anyhow::Error::msg)?;
        snapkv_scores.push(store.snapkv_scores_of(&key));
        master_bytes.push(p.grid.configs()[0].bytes(&master.shape()));
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
        references.push(refs);
        masters.push(master);
        eprintln!(
            "context {i} ({:?}, {} tokens): full prefill {:.2} s",
            c.kind,
            c.tokens.len(),
            full_prefill_s[i]
        );
    }
    let prefill_tokens_per_s = prefill_tokens as f64 / full_prefill_s.iter().sum::<f64>();
    let reference_task: Vec<Vec<f64>> = contexts
        .iter()
        .zip(&references)
        .map(|(c, refs)| {
            refs.iter()
                .zip(&c.test_answers)
                .map(|(r, gold)| workload::task_score(&e.tokenizer.decode(r), gold))
                .collect()
        })
        .collect();
    let (mut profiles, mut test_quality, mut test_task, mut test_f1, mut test_scores) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let n_configs = p.grid.len();
    for (i, c) in contexts.iter().enumerate() {
        let key = e.context_key(&c.tokens, None).context("context key")?;
        profiles.push(e.profile_blocking(key, &c.profile_queries, p.answer_tokens)?);
        // Test queries: token-F1 always (what the real runs measure), and the quality
        // metric's per-query scores when it differs.
        let t = run_profile(
            &mut e,
            key,
            &c.test_queries,
            p.answer_tokens,
            pk_engine::profiler::QualityMetric::AnswerF1,
        )?;
        let n_q = c.test_queries.len();
        let f1: Vec<Vec<f64>> = (0..n_configs)
            .map(|g| (0..n_q).map(|q| t.quality_of(g, q)).collect())
            .collect();
        let scores = if a.quality_metric == pk_engine::profiler::QualityMetric::AnswerF1 {
            f1.clone()
        } else {
            let m = run_profile(
                &mut e,
                key,
                &c.test_queries,
                p.answer_tokens,
                a.quality_metric,
            )?;
            (0..n_configs)
                .map(|g| (0..n_q).map(|q| m.quality_of(g, q)).collect())
                .collect()
        };
        test_quality.push(scores.iter().map(|qs| mean(qs) as f32).collect());
        test_f1.push(f1);
        test_scores.push(scores);
        test_task.push(
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
                .collect(),
        );
        eprintln!(
            "profiled context {i}: {:?}",
            profiles[i]
                .iter()
                .map(|q| (q * 100.0).round() / 100.0)
                .collect::<Vec<_>>()
        );
    }
    Ok(Setup {
        contexts,
        masters,
        snapkv_scores,
        master_bytes,
        full_prefill_s,
        full_service_s,
        references,
        profiles,
        test_quality,
        test_f1,
        test_scores,
        test_task,
        reference_task,
        prefill_tokens_per_s,
    })
}

fn run_profile(
    e: &mut Engine,
    key: pk_tiers::ChunkKey,
    queries: &[Vec<u32>],
    answer_tokens: usize,
    metric: pk_engine::profiler::QualityMetric,
) -> Result<pk_engine::profiler::Profiling> {
    let mut t = e.start_profile_with(key, queries, answer_tokens, metric)?;
    while !t.poll(e)? {
        e.step();
    }
    Ok(t)
}

/// One policy's engine and store during the real runs.
struct Runner {
    e: Engine,
    store: Arc<pk_evicpress::ContextStore>,
    name: String,
    alpha: Option<f64>,
    ttft: Vec<f64>,
    quality: Vec<f64>,
    service: Vec<f64>,
    f1: Vec<f64>,
    /// Requests whose measured token-F1 differed from setup's table (should be none).
    f1_mismatches: usize,
    task: Vec<f64>,
    hits: BTreeMap<String, u64>,
    loads: Vec<Load>,
}

impl Runner {
    /// A fresh store on fresh tiers, warmed with every context (inserted in order and
    /// placed by the policy, with its profile).
    #[allow(clippy::too_many_arguments)]
    fn new(
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
    ) -> Result<Runner> {
        let (tiers, caps) = tiers_for(a, dir, run, working_set)?;
        // Room for four contexts at once, so that loaded runs batch.
        let e = engine_for(
            a,
            store_config(tiers, caps, &p.grid, policy.clone(), delay),
            4 * (p.spec.max_tokens + 256),
        )?;
        let store = e.context_store().expect("configured");
        for (c, ctx) in s.contexts.iter().enumerate() {
            let key = e.context_key(&ctx.tokens, None).expect("aligned");
            store.offer_with_snapkv(key, s.masters[c].clone(), s.snapkv_scores[c].clone());
            store.flush();
            store
                .set_profile(&key, s.profiles[c].clone())
                .map_err(anyhow::Error::msg)?;
            store.flush();
        }
        Ok(Runner {
            e,
            store,
            name: name.into(),
            alpha,
            ttft: Vec::new(),
            quality: Vec::new(),
            service: Vec::new(),
            f1: Vec::new(),
            f1_mismatches: 0,
            task: Vec::new(),
            hits: BTreeMap::new(),
            loads: Vec::new(),
        })
    }

    fn serve(&mut self, p: &Preset, s: &Setup, r: &workload::Request) -> Result<()> {
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
        let f1 = pk_engine::profiler::token_f1(&out.token_ids, &s.references[r.context][r.query]);
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
    fn serve_loaded(
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
            let measured_f1 =
                pk_engine::profiler::token_f1(&out.token_ids, &s.references[r.context][r.query]);
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

    fn finish(self, ram_fraction: f64) -> (RunRow, Vec<Load>) {
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
            "base",
            ram_fraction,
            &self.ttft,
            &self.quality,
            &self.task,
            self.hits,
        );
        row.quality_f1 = Some(mean(&self.f1));
        row.service_s = self.service;
        row.bytes_moved = Some(st.bytes_moved);
        row.placement_cpu_ms_mean =
            Some(1e3 * st.placement_cpu_s_total / st.placement_decisions.max(1) as f64);
        row.placement_cpu_ms_max = Some(1e3 * st.placement_cpu_s_max);
        (row, self.loads)
    }
}
