//! The policy families side by side (issue 37): per (source, scenario), the fastest run of
//! LRU, of fixed compression, of EVICPRESS and of EVICPRESS without KVzip whose quality
//! stays within a tolerance of full prefill's, with the quality of what each served from
//! its fastest tier. The bounded scenarios (all tiers together hold less than the working
//! set) are where the families can differ in what they drop; the base one is beside them.

use std::collections::BTreeMap;

use serde::Serialize;

use super::RunRow;

#[derive(Serialize, Clone)]
pub struct FamilyRow {
    pub source: String,
    pub scenario: String,
    pub family: String,
    /// The run chosen: its α (EVICPRESS) or policy name (fixed), where there is a choice.
    pub choice: Option<String>,
    pub ttft_mean_s: f64,
    pub quality: f64,
    pub task_score: Option<f64>,
    pub fastest_tier_quality: Option<f64>,
    /// Requests to contexts that had been dropped (bounded tiers) and were recomputed.
    pub recomputed: u64,
    pub speedup_vs_lru: Option<f64>,
}

/// The families' rows for every (source, scenario) that has a full-prefill row and is
/// `base` or bounded, at `tolerance` (relative quality loss against full prefill).
pub fn families(rows: &[RunRow], tolerance: f64) -> Vec<FamilyRow> {
    let mut groups: BTreeMap<(String, String), Vec<&RunRow>> = BTreeMap::new();
    for r in rows {
        if r.scenario == "base" || r.scenario.starts_with("bounded-") {
            groups
                .entry((r.source.clone(), r.scenario.clone()))
                .or_default()
                .push(r);
        }
    }
    let mut out = Vec::new();
    for ((source, scenario), group) in groups {
        let Some(full) = group.iter().find(|r| r.policy == "full-prefill") else {
            continue;
        };
        let floor = (1.0 - tolerance) * full.quality;
        let fastest = |keep: &dyn Fn(&RunRow) -> bool| {
            group
                .iter()
                .copied()
                .filter(|r| keep(r) && r.quality >= floor)
                .min_by(|a, b| a.ttft_mean_s.total_cmp(&b.ttft_mean_s))
        };
        let lru = fastest(&|r| r.policy == "lru");
        let picks = [
            ("lru", lru),
            ("fixed", fastest(&|r| r.policy.starts_with("fixed-"))),
            ("evicpress", fastest(&|r| r.policy == "evicpress")),
            (super::NO_KVZIP, fastest(&|r| r.policy == super::NO_KVZIP)),
        ];
        for (family, pick) in picks {
            let Some(r) = pick else { continue };
            out.push(FamilyRow {
                source: source.clone(),
                scenario: scenario.clone(),
                family: family.into(),
                choice: match family {
                    "fixed" => Some(r.policy.clone()),
                    _ => r.alpha.map(|a| format!("α={a}")),
                },
                ttft_mean_s: r.ttft_mean_s,
                quality: r.quality,
                task_score: r.task_score,
                fastest_tier_quality: r.fastest_tier_quality,
                recomputed: super::report::recomputed(r),
                speedup_vs_lru: lru.map(|l| l.ttft_mean_s / r.ttft_mean_s),
            });
        }
    }
    out
}

/// REPORT.md's section of [`families`].
pub fn markdown(md: &mut String, rows: &[FamilyRow], tolerance: f64) {
    md.push_str(&format!("\n## Families within {:.0}% of full prefill's quality\n\nPer scenario, the fastest run of each family whose quality is at least {:.0}% of full prefill's. `bounded-F`: all tiers together hold F of the working set's f16 bytes (simulated, and real with one copy per context); what does not fit is dropped and recomputed when asked for (`recomputed`). `fastest-tier quality`: the mean quality of the requests served from the fastest tier.\n\n| source | scenario | family | run | TTFT mean s | vs LRU | quality | task | fastest-tier quality | recomputed |\n|---|---|---|---|---|---|---|---|---|---|\n", 100.0 * tolerance, 100.0 * (1.0 - tolerance)));
    let f = |x: Option<f64>, d: usize| x.map_or("–".to_string(), |v| format!("{v:.d$}"));
    for r in rows {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {:.3} | {}× | {:.3} | {} | {} | {} |\n",
            r.source,
            r.scenario,
            r.family,
            r.choice.clone().unwrap_or("–".into()),
            r.ttft_mean_s,
            f(r.speedup_vs_lru, 2),
            r.quality,
            f(r.task_score, 3),
            f(r.fastest_tier_quality, 3),
            r.recomputed
        ));
    }
}
