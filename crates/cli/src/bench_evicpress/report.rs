//! The benchmark's sweeps (simulator), its headline comparisons, and its outputs:
//! `results.json`, `REPORT.md`, `quality_vs_ttft.png` in `--out`.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{anyhow, Result};
use pk_evicpress::{DelayModel, Grid, Policy, Ranking};
use plotters::prelude::*;
use serde::Serialize;

use super::sim::{simulate, SimContext};
use super::workload::{self, Request};
use super::{row_of, EvicpressArgs, RunRow};

/// `../shared/tools/host-quiet`'s figure when the tool exists (this machine), else a note.
pub fn host_quiet() -> String {
    for p in [
        "../shared/tools/host-quiet",
        "/work/shared/tools/host-quiet",
    ] {
        if let Ok(o) = std::process::Command::new(p).output() {
            return String::from_utf8_lossy(&o.stdout).trim().to_string();
        }
    }
    "host-quiet unavailable".into()
}

/// The simulated scenario in which loads are free (see `sweeps`).
pub const FREE_LOAD: &str = "free-load";

pub const ALPHAS: [f64; 9] = [0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0];

#[derive(Serialize)]
pub struct Validation {
    pub scenario: String,
    pub policy: String,
    pub alpha: Option<f64>,
    pub real_ttft_mean_s: f64,
    pub sim_ttft_mean_s: f64,
    pub ttft_error_pct: f64,
    pub real_quality: f64,
    pub sim_quality: f64,
    /// Requests recomputed because their context was not stored (bounded tiers).
    pub real_recomputed: u64,
    pub sim_recomputed: u64,
}

/// Requests a row recomputed: the simulator names them `recomputed`, the real runs name
/// every miss `recompute`.
pub fn recomputed(r: &RunRow) -> u64 {
    [super::sim::RECOMPUTED, "recompute"]
        .iter()
        .filter_map(|k| r.hits_per_tier.get(*k))
        .sum()
}

#[allow(clippy::too_many_arguments)]
fn sim_row(
    label: &str,
    alpha: Option<f64>,
    scenario: &str,
    ram_fraction: f64,
    contexts: &[SimContext],
    trace: &[Request],
    delay: &DelayModel,
    caps: &[u64],
    policy: Option<&Policy>,
    full: &[f64],
) -> RunRow {
    let r = simulate(contexts, trace, delay, caps, policy, 60.0, full);
    let mut row = row_of(
        label,
        alpha,
        "sim",
        scenario,
        ram_fraction,
        &r.ttft_s,
        &r.quality,
        &r.task,
        r.hits_per_tier,
    );
    row.quality_f1 = Some(super::sim::mean(&r.f1));
    row.fastest_tier_quality =
        (!r.fastest_quality.is_empty()).then(|| super::sim::mean(&r.fastest_quality));
    row
}

/// Adds the simulator's rows to `rows` and returns its validation against the real rows.
#[allow(clippy::too_many_arguments)]
pub fn sweeps(
    a: &EvicpressArgs,
    grid: &Grid,
    contexts: &[SimContext],
    trace: &[Request],
    delay: &DelayModel,
    working_set: u64,
    full: &[f64],
    real: &[(String, Option<f64>, Policy)],
    rows: &mut Vec<RunRow>,
) -> Vec<Validation> {
    let no_kvzip = super::has_kvzip(grid).then(|| without_kvzip(grid, contexts));
    let sweep = Sweep {
        a,
        grid,
        contexts,
        no_kvzip: no_kvzip.as_deref(),
        working_set,
        n_tiers: delay.tiers.len(),
        full,
    };
    let base = Scenario {
        name: "base".into(),
        ram_fraction: a.ram_fraction,
        tiers_fraction: None,
        trace,
        delay,
    };
    let mut validation = sweep.validation(&base, real, rows);
    sweep.add(rows, &base, true);
    // The paper's regime: all tiers together hold less than the working set.
    for &f in a.tiers_fractions.iter() {
        let bounded = Scenario {
            name: bounded_name(f),
            tiers_fraction: Some(f),
            ..base
        };
        validation.extend(sweep.validation(&bounded, real, rows));
        sweep.add(rows, &bounded, true);
    }
    for f in [0.1, 0.4] {
        if (f - a.ram_fraction).abs() > 1e-9 {
            let sc = Scenario {
                name: format!("ram-{f}"),
                ram_fraction: f,
                ..base
            };
            sweep.add(rows, &sc, false);
        }
    }
    // Where the paper says the gain vanishes: RAM holds everything; equal bandwidths.
    let ram_holds_all = Scenario {
        name: "ram-holds-all".into(),
        ram_fraction: 1.05,
        ..base
    };
    sweep.add(rows, &ram_holds_all, false);
    let flat = equal_bandwidth(delay);
    let equal_bandwidth = Scenario {
        name: "equal-bandwidth".into(),
        delay: &flat,
        ..base
    };
    sweep.add(rows, &equal_bandwidth, false);
    let free = free_loads(delay);
    let free_load = Scenario {
        name: FREE_LOAD.into(),
        delay: &free,
        ..base
    };
    sweep.add(rows, &free_load, false);
    let drift = workload::trace(
        contexts.len(),
        trace.iter().map(|r| r.query).max().unwrap_or(0) + 1,
        trace.len(),
        a.zipf,
        a.rate,
        true,
        a.seed,
    );
    let drifting = Scenario {
        name: "drift".into(),
        trace: &drift,
        ..base
    };
    sweep.add(rows, &drifting, false);
    validation
}

/// `delay` with every tier as fast as the fastest.
fn equal_bandwidth(delay: &DelayModel) -> DelayModel {
    let mut flat = delay.clone();
    let fastest = flat.tiers[0].clone();
    for t in flat.tiers.iter_mut() {
        t.read_bytes_per_s = fastest.read_bytes_per_s;
        t.access_latency_s = fastest.access_latency_s;
    }
    flat
}

/// The ceiling of any placement or quantisation: moving bytes costs nothing (every tier
/// infinitely fast, no decode), so a hit pays only what compression cannot shrink without
/// dropping tokens: writing the kept tokens into the pool and attending over them, and
/// the query's own prefill. LRU here is the fastest TTFT any policy that keeps every
/// token can reach.
fn free_loads(delay: &DelayModel) -> DelayModel {
    let mut free = delay.clone();
    for t in free.tiers.iter_mut() {
        t.read_bytes_per_s = 1e18;
        t.access_latency_s = 0.0;
    }
    free.decode_s_per_byte = 0.0;
    free
}

/// The scenario name of tiers holding `fraction` of the working set.
pub fn bounded_name(fraction: f64) -> String {
    format!("bounded-{fraction}")
}

/// `contexts` with the grid's KVzip configurations unavailable (quality −∞ to placement,
/// as a store gives a context stored without KVzip scores).
fn without_kvzip(grid: &Grid, contexts: &[SimContext]) -> Vec<SimContext> {
    let kvzip: Vec<bool> = grid
        .configs()
        .iter()
        .map(|c| c.drop_score() == Some(pk_evicpress::DropScore::KvZip))
        .collect();
    contexts
        .iter()
        .map(|c| SimContext {
            bytes: c.bytes.clone(),
            kept_tokens: c.kept_tokens.clone(),
            profile_quality: c
                .profile_quality
                .iter()
                .zip(&kvzip)
                .map(|(&q, &k)| if k { f32::NEG_INFINITY } else { q })
                .collect(),
            test_quality: c.test_quality.clone(),
            test_f1: c.test_f1.clone(),
            test_task: c.test_task.clone(),
        })
        .collect()
}

/// What every simulated row of the sweeps shares.
struct Sweep<'a> {
    a: &'a EvicpressArgs,
    grid: &'a Grid,
    contexts: &'a [SimContext],
    /// The contexts with KVzip unavailable, when the grid has KVzip configurations.
    no_kvzip: Option<&'a [SimContext]>,
    working_set: u64,
    /// Tiers of the measured delay model (3 with Redis).
    n_tiers: usize,
    /// Each context's full-prefill time.
    full: &'a [f64],
}

/// One simulated scenario: its name in the rows, the RAM tier's share of the working set,
/// the trace and the delay model.
struct Scenario<'a> {
    name: String,
    ram_fraction: f64,
    /// All tiers together hold this fraction of the working set (bounded tiers).
    tiers_fraction: Option<f64>,
    trace: &'a [Request],
    delay: &'a DelayModel,
}

impl Sweep<'_> {
    /// The scenario's tier capacities (the rule: `super::tier_capacities`).
    fn caps(&self, sc: &Scenario) -> Vec<u64> {
        super::tier_capacities(
            self.a,
            self.n_tiers,
            sc.ram_fraction,
            sc.tiers_fraction,
            self.working_set,
        )
    }

    fn row(
        &self,
        sc: &Scenario,
        label: &str,
        alpha: Option<f64>,
        policy: Option<&Policy>,
    ) -> RunRow {
        let contexts = match (label, self.no_kvzip) {
            (super::NO_KVZIP, Some(masked)) => masked,
            _ => self.contexts,
        };
        sim_row(
            label,
            alpha,
            &sc.name,
            sc.ram_fraction,
            contexts,
            sc.trace,
            sc.delay,
            &self.caps(sc),
            policy,
            self.full,
        )
    }

    /// The real runs' policies, simulated in scenario `sc`, against their real rows there
    /// (none for a scenario run only in the simulator).
    fn validation(
        &self,
        sc: &Scenario,
        real: &[(String, Option<f64>, Policy)],
        rows: &[RunRow],
    ) -> Vec<Validation> {
        let mut validation = Vec::new();
        for (name, alpha, policy) in real {
            let Some(r) = rows.iter().find(|r| {
                r.source == "real"
                    && r.scenario == sc.name
                    && &r.policy == name
                    && r.alpha == *alpha
            }) else {
                continue;
            };
            let s = self.row(sc, name, *alpha, Some(policy));
            {
                validation.push(Validation {
                    scenario: sc.name.clone(),
                    policy: name.clone(),
                    alpha: *alpha,
                    real_ttft_mean_s: r.ttft_mean_s,
                    sim_ttft_mean_s: s.ttft_mean_s,
                    ttft_error_pct: 100.0 * (s.ttft_mean_s - r.ttft_mean_s)
                        / r.ttft_mean_s.max(1e-9),
                    real_quality: r.quality,
                    sim_quality: s.quality,
                    real_recomputed: recomputed(r),
                    sim_recomputed: recomputed(&s),
                });
            }
        }
        validation
    }

    /// One scenario's rows: full prefill, LRU, every fixed configuration (`every_fixed`),
    /// and EVICPRESS at every α of [`ALPHAS`], ranked by absolute drop and by drop per byte
    /// (the scenario's `/per-byte` rows).
    fn add(&self, rows: &mut Vec<RunRow>, sc: &Scenario, every_fixed: bool) {
        rows.push(self.row(sc, "full-prefill", None, None));
        rows.push(self.row(sc, "lru", None, Some(&Policy::Lru)));
        if every_fixed {
            for (i, c) in self.grid.configs().iter().enumerate().skip(1) {
                rows.push(self.row(sc, &format!("fixed-{c}"), None, Some(&Policy::Fixed(i))));
            }
        }
        let per_byte = Scenario {
            name: format!("{}/per-byte", sc.name),
            ..*sc
        };
        for alpha in ALPHAS {
            let absolute = Policy::Evicpress {
                alpha,
                ranking: Ranking::AbsoluteDrop,
            };
            rows.push(self.row(sc, "evicpress", Some(alpha), Some(&absolute)));
            let by_byte = Policy::Evicpress {
                alpha,
                ranking: Ranking::DropPerByte,
            };
            rows.push(self.row(&per_byte, "evicpress", Some(alpha), Some(&by_byte)));
            if self.no_kvzip.is_some() {
                rows.push(self.row(sc, super::NO_KVZIP, Some(alpha), Some(&absolute)));
            }
        }
    }
}

/// The headline numbers for one (source, scenario).
#[derive(Serialize, Clone)]
pub struct Headline {
    pub source: String,
    pub scenario: String,
    /// "quality" (token-F1 vs the full-KV answer) or "task" (ground-truth task score).
    pub metric: String,
    /// Largest relative quality loss vs LRU allowed (the bar is 0.03).
    pub quality_tolerance: f64,
    pub lru_ttft_mean_s: f64,
    pub lru_quality: f64,
    /// Best EVICPRESS α whose quality is within `quality_tolerance` of LRU's (relative).
    pub evicpress_alpha: Option<f64>,
    pub evicpress_ttft_mean_s: Option<f64>,
    pub evicpress_quality: Option<f64>,
    pub speedup_vs_lru: Option<f64>,
    pub speedup_vs_full_prefill: Option<f64>,
    /// The fastest fixed configuration with at least EVICPRESS's quality, and the ratio.
    pub fixed_at_equal_quality: Option<String>,
    pub speedup_vs_fixed_at_equal_quality: Option<f64>,
}

/// Which measure of quality a headline holds the policies to.
#[derive(Clone, Copy)]
pub enum Metric {
    Quality,
    F1,
    Task,
}

impl Metric {
    fn of(self, r: &RunRow) -> f64 {
        match self {
            Metric::Quality => r.quality,
            Metric::F1 => r.quality_f1.unwrap_or(f64::NAN),
            Metric::Task => r.task_score.unwrap_or(f64::NAN),
        }
    }
    fn name(self) -> &'static str {
        match self {
            Metric::Quality => "quality",
            Metric::F1 => "f1",
            Metric::Task => "task",
        }
    }
}

pub fn headline(
    rows: &[RunRow],
    source: &str,
    scenario: &str,
    tolerance: f64,
    metric: Metric,
) -> Option<Headline> {
    fn of<'a>(
        rows: &'a [RunRow],
        source: &'a str,
        scenario: &'a str,
        p: &'a str,
    ) -> impl Iterator<Item = &'a RunRow> + 'a {
        rows.iter().filter(move |r| {
            r.source == source && r.scenario == scenario && r.policy.starts_with(p)
        })
    }
    let of = |p: &'static str| of(rows, source, scenario, p);
    let lru = of("lru").next()?;
    let full = of("full-prefill").next();
    let m = |r: &RunRow| metric.of(r);
    let best = of("evicpress")
        .filter(|r| r.policy == "evicpress")
        .filter(|r| m(r) >= (1.0 - tolerance) * m(lru))
        .min_by(|a, b| a.ttft_mean_s.total_cmp(&b.ttft_mean_s));
    let fixed = best.and_then(|b| {
        of("fixed-")
            .filter(|r| m(r) >= m(b) - 1e-9)
            .min_by(|a, c| a.ttft_mean_s.total_cmp(&c.ttft_mean_s))
    });
    Some(Headline {
        source: source.into(),
        scenario: scenario.into(),
        metric: metric.name().into(),
        quality_tolerance: tolerance,
        lru_ttft_mean_s: lru.ttft_mean_s,
        lru_quality: m(lru),
        evicpress_alpha: best.and_then(|b| b.alpha),
        evicpress_ttft_mean_s: best.map(|b| b.ttft_mean_s),
        evicpress_quality: best.map(m),
        speedup_vs_lru: best.map(|b| lru.ttft_mean_s / b.ttft_mean_s),
        speedup_vs_full_prefill: best.zip(full).map(|(b, f)| f.ttft_mean_s / b.ttft_mean_s),
        fixed_at_equal_quality: fixed.map(|f| f.policy.clone()),
        speedup_vs_fixed_at_equal_quality: best
            .zip(fixed)
            .map(|(b, f)| f.ttft_mean_s / b.ttft_mean_s),
    })
}

/// The headlines of every (source, scenario): the bar (3 % quality loss), and 5 %
/// to show the trade-off when 3 % is not met, for each measure of quality.
fn headlines(a: &EvicpressArgs, rows: &[RunRow]) -> Vec<Headline> {
    let scenarios: Vec<String> =
        rows.iter()
            .map(|r| r.scenario.clone())
            .fold(Vec::new(), |mut v, s| {
                if !v.contains(&s) {
                    v.push(s)
                }
                v
            });
    // The bar (3 % quality loss), and 5 % to show the trade-off when 3 % is not met.
    let mut headlines = Vec::new();
    let metrics: &[Metric] = if a.quality_metric == pk_connectors::profiler::QualityMetric::AnswerF1
    {
        &[Metric::Quality, Metric::Task]
    } else {
        &[Metric::Quality, Metric::F1, Metric::Task]
    };
    for &metric in metrics {
        for tolerance in [0.03, 0.05] {
            for scenario in scenarios.iter().filter(|sc| {
                rows.iter()
                    .any(|r| r.source == "real" && &r.scenario == *sc)
            }) {
                headlines.extend(headline(rows, "real", scenario, tolerance, metric));
            }
            headlines.extend(
                scenarios
                    .iter()
                    .filter_map(|s| headline(rows, "sim", s, tolerance, metric)),
            );
        }
    }
    headlines
}

/// LRU's simulated mean TTFT in the base scenario and with every load free (`FREE_LOAD`).
fn ceiling(rows: &[RunRow]) -> Option<(f64, f64)> {
    let lru_of = |scenario: &str| {
        rows.iter()
            .find(|r| r.source == "sim" && r.scenario == scenario && r.policy == "lru")
            .map(|r| r.ttft_mean_s)
    };
    lru_of("base").zip(lru_of(FREE_LOAD))
}

/// A figure with `digits` decimals, or a dash where there is none.
fn opt(x: Option<f64>, digits: usize) -> String {
    x.map_or("–".to_string(), |v| format!("{v:.digits$}"))
}

#[allow(clippy::too_many_arguments)]
pub fn write(
    a: &EvicpressArgs,
    grid: &Grid,
    rows: &[RunRow],
    validation: &[Validation],
    under_load: Option<&super::load::UnderLoad>,
    delay: &DelayModel,
    setup: &serde_json::Value,
    quiet: &str,
    wall_s: f64,
) -> Result<serde_json::Value> {
    let headlines = headlines(a, rows);
    let ceiling = ceiling(rows);
    let ceiling_json = ceiling.map(|(base, free)| serde_json::json!({ "lru_ttft_mean_s": base, "lru_free_load_ttft_mean_s": free, "max_speedup_keeping_every_token": base / free.max(1e-9) }));
    let families = super::families::families(rows, 0.03);
    let summary = serde_json::json!({ "ceiling": ceiling_json, "headlines": headlines, "families": families, "validation": validation, "under_load": under_load, "delay_model": delay, "setup": setup, "wall_s": wall_s });
    std::fs::write(
        a.out.join("results.json"),
        serde_json::to_string_pretty(
            &serde_json::json!({ "runs": rows, "summary": summary, "host_quiet": quiet }),
        )?,
    )?;
    let report = Markdown {
        a,
        grid,
        rows,
        validation,
        under_load,
        delay,
        setup,
        quiet,
        wall_s,
    };
    let mut md = String::new();
    report.intro(&mut md);
    report.headlines(&mut md, &headlines);
    super::families::markdown(&mut md, &families, 0.03);
    report.ceiling(&mut md, ceiling);
    report.under_load(&mut md);
    report.validation(&mut md);
    report.all_runs(&mut md);
    std::fs::write(a.out.join("REPORT.md"), md)?;
    plot(rows, &a.out.join("quality_vs_ttft.png"), Metric::Quality)?;
    plot(rows, &a.out.join("task_vs_ttft.png"), Metric::Task)?;
    Ok(summary)
}

/// REPORT.md's sections, from what `write` is given.
struct Markdown<'a> {
    a: &'a EvicpressArgs,
    grid: &'a Grid,
    rows: &'a [RunRow],
    validation: &'a [Validation],
    under_load: Option<&'a super::load::UnderLoad>,
    delay: &'a DelayModel,
    setup: &'a serde_json::Value,
    quiet: &'a str,
    wall_s: f64,
}

impl Markdown<'_> {
    /// The title, the command as run, the tiers, the grid and the metrics.
    fn intro(&self, md: &mut String) {
        let Markdown {
            a,
            grid,
            delay,
            setup,
            quiet,
            wall_s,
            ..
        } = *self;
        let preset = if a.full { "--full" } else { "--quick" };
        // The command as run, flags that change the results included (the Redis URL is elided).
        let mut flags = String::new();
        if let Some(t) = a.model.threads {
            flags.push_str(&format!(" --threads {t}"));
        }
        if a.redis.is_some() {
            flags.push_str(" --redis URL");
        }
        flags.push_str(&format!(
            " --profile-metric {} --quality-metric {} --ram-fraction {} --zipf {} --seed {}",
            a.profile_metric, a.quality_metric, a.ram_fraction, a.zipf, a.seed
        ));
        if !a.grid_add.is_empty() {
            flags.push_str(&format!(" --grid-add {}", a.grid_add.join(",")));
        }
        flags.push_str(&format!(
            " --tiers-fractions={}",
            a.tiers_fractions
                .iter()
                .map(f64::to_string)
                .collect::<Vec<_>>()
                .join(",")
        ));
        if a.loaded_repeats > 1 {
            flags.push_str(&format!(" --loaded-repeats {}", a.loaded_repeats));
        }
        md.push_str(&format!("# EVICPRESS benchmark ({preset})\n\nCommand: `pagekeeper bench evicpress {preset}{flags} --out {}`; host-quiet: `{quiet}`; wall time {:.0} s.\n\n", a.out.display(), wall_s));
        md.push_str(&format!("Tiers: {} with RAM holding {:.0}% of the working set ({:.1} MB of f16 masters); delay model fitted to the real loads: {}.\n\n", delay.tiers.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(" → "), 100.0 * a.ram_fraction, setup["working_set_bytes"].as_f64().unwrap_or(0.0) / 1e6,
            delay.tiers.iter().map(|t| format!("{} {:.0} MB/s", t.name, t.read_bytes_per_s / 1e6)).collect::<Vec<_>>().join(", ")));
        md.push_str(&format!(
            "Grid: {}.\n\n",
            grid.configs()
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
        md.push_str(&format!(
            "Profiles scored by `{}`; reported quality by `{}`.\n\n",
            a.profile_metric, a.quality_metric
        ));
    }

    fn headlines(&self, md: &mut String, headlines: &[Headline]) {
        md.push_str("## Headlines\n\n`quality`: the bench's quality metric (`f1` is the token-F1 of the answer against the full-KV answer; `teacher-forced`, the share of the full-KV answer's tokens the served KV ranks first). `f1`: token-F1 when the quality metric is another. `task`: the ground-truth score (the answer's first number is the asked code), the measure of the paper's \"quality drop\".\n\n| source | scenario | metric | loss ≤ | LRU TTFT s | LRU score | EVICPRESS α | EVICPRESS TTFT s | score | vs LRU | vs full prefill | fixed at ≥ equal score | vs fixed |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
        for h in headlines {
            md.push_str(&format!(
                "| {} | {} | {} | {:.0}% | {:.3} | {:.3} | {} | {} | {} | {}× | {}× | {} | {}× |\n",
                h.source,
                h.scenario,
                h.metric,
                100.0 * h.quality_tolerance,
                h.lru_ttft_mean_s,
                h.lru_quality,
                opt(h.evicpress_alpha, 2),
                opt(h.evicpress_ttft_mean_s, 3),
                opt(h.evicpress_quality, 3),
                opt(h.speedup_vs_lru, 2),
                opt(h.speedup_vs_full_prefill, 1),
                h.fixed_at_equal_quality.clone().unwrap_or("–".into()),
                opt(h.speedup_vs_fixed_at_equal_quality, 2)
            ));
        }
    }

    fn ceiling(&self, md: &mut String, ceiling: Option<(f64, f64)>) {
        if let Some((base, free)) = ceiling {
            md.push_str(&format!(
                "\nCeiling (simulated, `{FREE_LOAD}`): with every load free, LRU's mean TTFT would be {free:.3} s against {base:.3} s, so no policy that keeps every token (placement and quantisation alone) can be more than {:.2}× faster than LRU on this trace; only dropping tokens goes below it. The rest of a hit is the query's prefill and the per-kept-token restore and attention ({:.1} µs per token in the fitted delay model).\n",
                base / free.max(1e-9),
                1e6 * self.delay.restore_s_per_token
            ));
        }
    }

    /// The loaded runs' section, when there were loaded runs.
    fn under_load(&self, md: &mut String) {
        if let Some(u) = self.under_load {
            md.push_str(&format!("\n## Under load (real runs' service times replayed through one FIFO server; see load.rs)\n\nLoads are fractions of LRU's capacity ({}); the last column is the highest request rate whose mean TTFT stays within {:.3} s (twice LRU's unloaded mean).\n\n| policy | α | quality | service s | {} | max rate /s | vs LRU |\n|---|---|---|---|{}---|---|\n",
                u.rates_per_s.iter().map(|r| format!("{r:.2}/s")).collect::<Vec<_>>().join(", "), u.target_s,
                u.loads.iter().map(|l| format!("TTFT s at {:.0}%", 100.0 * l)).collect::<Vec<_>>().join(" | "), "---|".repeat(u.loads.len())));
            let lru_rate = u
                .rows
                .iter()
                .find(|r| r.policy == "lru")
                .map_or(f64::NAN, |r| r.max_rate_per_s);
            for r in &u.rows {
                md.push_str(&format!(
                    "| {} | {} | {:.3} | {:.3} | {} | {:.2} | {:.2}× |\n",
                    r.policy,
                    opt(r.alpha, 2),
                    r.quality,
                    r.service_mean_s,
                    r.ttft_mean_s
                        .iter()
                        .map(|t| format!("{t:.3}"))
                        .collect::<Vec<_>>()
                        .join(" | "),
                    r.max_rate_per_s,
                    r.max_rate_per_s / lru_rate
                ));
            }
        }
    }

    fn validation(&self, md: &mut String) {
        md.push_str("\n## Simulator validation (same trace, same policies)\n\n| scenario | policy | α | real TTFT s | sim TTFT s | error | real quality | sim quality | recomputed real / sim |\n|---|---|---|---|---|---|---|---|---|\n");
        for v in self.validation {
            md.push_str(&format!(
                "| {} | {} | {} | {:.3} | {:.3} | {:+.1}% | {:.3} | {:.3} | {} / {} |\n",
                v.scenario,
                v.policy,
                opt(v.alpha, 2),
                v.real_ttft_mean_s,
                v.sim_ttft_mean_s,
                v.ttft_error_pct,
                v.real_quality,
                v.sim_quality,
                v.real_recomputed,
                v.sim_recomputed
            ));
        }
    }

    fn all_runs(&self, md: &mut String) {
        md.push_str("\n## All runs\n\n| source | scenario | policy | α | TTFT mean | p50 | p95 | quality | f1 | task | hits per tier | bytes moved | placement ms (mean/max) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
        for r in self.rows {
            let hits: BTreeMap<_, _> = r.hits_per_tier.clone();
            md.push_str(&format!(
                "| {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {} | {} | {} | {} | {} |\n",
                r.source,
                r.scenario,
                r.policy,
                opt(r.alpha, 2),
                r.ttft_mean_s,
                r.ttft_p50_s,
                r.ttft_p95_s,
                r.quality,
                opt(r.quality_f1, 3),
                opt(r.task_score, 3),
                hits.iter()
                    .map(|(k, v)| format!("{k}:{v}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                r.bytes_moved
                    .map_or("–".into(), |b| format!("{:.0} MB", b as f64 / 1e6)),
                match (r.placement_cpu_ms_mean, r.placement_cpu_ms_max) {
                    (Some(m), Some(x)) => format!("{m:.2}/{x:.2}"),
                    _ => "–".into(),
                }
            ));
        }
    }
}

/// One plotted series: its legend label, its colour and its (mean TTFT, metric) points.
type Series<'a> = (&'a str, RGBColor, Vec<(f64, f64)>);

fn plot(rows: &[RunRow], path: &Path, metric: Metric) -> Result<()> {
    static FONT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *FONT.get_or_init(|| {
        plotters::style::register_font(
            "sans-serif",
            plotters::style::FontStyle::Normal,
            include_bytes!("../../../eval/assets/DejaVuSans.ttf"),
        )
        .is_ok()
    });
    if !ok {
        return Err(anyhow!("the embedded font does not parse"));
    }
    let (w, h) = (900u32, 600u32);
    let mut pixels = vec![0u8; (w * h * 3) as usize];
    draw(&mut pixels, (w, h), rows, metric)?;
    // plotters' bitmap backend without its image feature: encode the RGB buffer ourselves.
    let file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut enc = png::Encoder::new(file, w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header()?.write_image_data(&pixels)?;
    Ok(())
}

/// Draws the plot into an RGB buffer of `size` pixels: the simulated base scenario's
/// policies as curves and points, the real runs as crosses.
fn draw(pixels: &mut [u8], size: (u32, u32), rows: &[RunRow], metric: Metric) -> Result<()> {
    let base: Vec<&RunRow> = rows
        .iter()
        .filter(|r| r.scenario == "base" && r.source == "sim")
        .collect();
    let max_ttft = base
        .iter()
        .map(|r| r.ttft_mean_s)
        .filter(|t| t.is_finite())
        .fold(0.0f64, f64::max)
        .max(1e-3);
    let min_ttft = base
        .iter()
        .map(|r| r.ttft_mean_s)
        .filter(|t| t.is_finite() && *t > 0.0)
        .fold(f64::MAX, f64::min)
        .min(max_ttft);
    let root = BitMapBackend::with_buffer(pixels, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "{} vs TTFT (simulated, base scenario; crosses: real runs)",
                if matches!(metric, Metric::Task) {
                    "Task score"
                } else {
                    "Quality"
                }
            ),
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(55)
        .build_cartesian_2d((min_ttft * 0.7..max_ttft * 1.4).log_scale(), 0.0..1.05)
        .map_err(|e| anyhow!("{e}"))?;
    let y_desc = match metric {
        Metric::Quality => "quality (the bench's metric vs full KV)",
        Metric::F1 => "token-F1 vs full KV",
        Metric::Task => "task score (ground truth)",
    };
    chart
        .configure_mesh()
        .x_desc("mean TTFT (s, log)")
        .y_desc(y_desc)
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    for (label, colour, pts) in series(&base, metric) {
        let c = colour;
        // Fixed configurations are separate points, not a curve: only EVICPRESS's α sweep
        // and the LRU / full-prefill pair are joined.
        let line = if label.starts_with("fixed") {
            Vec::new()
        } else {
            pts.clone()
        };
        chart
            .draw_series(LineSeries::new(line, c.stroke_width(2)))
            .map_err(|e| anyhow!("{e}"))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 4, c.filled())))
            .map_err(|e| anyhow!("{e}"))?;
    }
    let real: Vec<(f64, f64)> = rows
        .iter()
        .filter(|r| r.source == "real")
        .map(|r| (r.ttft_mean_s, metric.of(r)))
        .collect();
    chart
        .draw_series(
            real.iter()
                .map(|&p| Cross::new(p, 7, BLACK.stroke_width(2))),
        )
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

/// The plotted series of the simulated base scenario's rows, each sorted by TTFT.
fn series(base: &[&RunRow], metric: Metric) -> [Series<'static>; 3] {
    let curve = |pred: &dyn Fn(&RunRow) -> bool| {
        let mut pts: Vec<(f64, f64)> = base
            .iter()
            .filter(|r| pred(r))
            .map(|r| (r.ttft_mean_s, metric.of(r)))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        pts
    };
    [
        (
            "EVICPRESS (α sweep)",
            RGBColor(214, 39, 40),
            curve(&|r| r.policy == "evicpress"),
        ),
        (
            "fixed config + LRU",
            RGBColor(31, 119, 180),
            curve(&|r| r.policy.starts_with("fixed-")),
        ),
        (
            "LRU / full prefill",
            RGBColor(44, 160, 44),
            curve(&|r| r.policy == "lru" || r.policy == "full-prefill"),
        ),
    ]
}
