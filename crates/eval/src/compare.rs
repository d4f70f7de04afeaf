//! One policy (PagedEviction, the seed's subject) against every other, cell by cell: the
//! question issue 5's report answers ("at which budgets does it beat each baseline, on
//! which tasks, by how much; where does it lose"), as Markdown tables appended to
//! `summary.md`.
//!
//! Only calibrated cells count for the generated tasks: where the full cache itself scores
//! below 80% (code completion: 0.6 edit similarity, `report::calibration_min_score`), a
//! policy's score says nothing about eviction. Budgets are grouped by their
//! share of the context (the `--full` budgets are fractions, so 25% of 1K and 25% of 2K
//! fall in one group).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use crate::report::{Report, SummaryRow};

/// Score differences below this are ties (scores are means over a few samples).
const TIE: f64 = 1e-9;

/// The budget as a percentage of the context, in tenths of a percent (an exact grouping key).
fn budget_permille(r: &SummaryRow) -> Option<u32> {
    Some((1000.0 * r.kv_budget? as f64 / r.context_tokens as f64).round() as u32)
}

fn percent_label(permille: u32) -> String {
    format!("{}%", permille as f64 / 10.0)
}

/// (task, length, block size, budget) → row, for one policy.
type Cells<'a> = BTreeMap<(&'a str, usize, u32, u32), &'a SummaryRow>;

fn cells<'a>(report: &'a Report, policy: &str) -> Cells<'a> {
    report
        .results
        .iter()
        .filter(|r| r.policy == policy)
        .filter_map(|r| {
            Some((
                (
                    r.task.as_str(),
                    r.context_tokens,
                    r.block_size,
                    r.kv_budget?,
                ),
                r,
            ))
        })
        .collect()
}

/// One budget share's head-to-head tally against one other policy: (wins, ties, losses,
/// Σ score diff, text-kl KL diffs, count of lengths where the subject's KL is lower).
type BudgetTally = (usize, usize, usize, f64, Vec<f64>, usize);

/// Markdown: head-to-head counts per baseline and budget share, mean scores per task and
/// budget share, and text-kl's KL per length and budget share. Empty when `subject` has
/// no rows.
pub fn markdown(report: &Report, subject: &str) -> String {
    let mine = cells(report, subject);
    if mine.is_empty() {
        return String::new();
    }
    let policies: BTreeSet<&str> = report
        .results
        .iter()
        .map(|r| r.policy.as_str())
        .filter(|p| *p != "full")
        .collect();
    let mut s = format!("## {subject} against each policy\n\n");
    s += &format!(
        "Generated tasks, calibrated cells only (task × length where the full cache scores ≥ 80%; code completion ≥ 0.6 edit similarity). \
         A cell is one (task, length, budget); win / tie / loss compares {subject}'s mean score with the other \
         policy's in that cell, Δ is the mean of ({subject} − other). text-kl: ΔKL is the mean of \
         ({subject} − other) over lengths, in nats (negative: {subject} is closer to the full cache), and \
         \"lower KL\" counts the lengths where {subject}'s KL is lower.\n\n"
    );
    s += "| other policy | budget | cells | wins | ties | losses | Δ score | text-kl ΔKL | lower KL |\n|---|---|---|---|---|---|---|---|---|\n";
    for other in policies.iter().filter(|p| **p != subject) {
        let theirs = cells(report, other);
        // Budget share (permille) → its tally.
        let mut by_budget: BTreeMap<u32, BudgetTally> = BTreeMap::new();
        for (k, a) in &mine {
            let (Some(b), Some(pm)) = (theirs.get(k), budget_permille(a)) else {
                continue;
            };
            let e = by_budget.entry(pm).or_default();
            if a.task.starts_with("text-kl") {
                if let (Some(x), Some(y)) = (a.kl_mean, b.kl_mean) {
                    e.4.push(x - y);
                    e.5 += usize::from(x < y);
                }
            } else if a.calibrated {
                let d = a.score - b.score;
                if d > TIE {
                    e.0 += 1;
                } else if d < -TIE {
                    e.2 += 1;
                } else {
                    e.1 += 1;
                }
                e.3 += d;
            }
        }
        for (pm, (w, t, l, sum, kl, lower)) in by_budget {
            let n = w + t + l;
            let delta = if n > 0 {
                format!("{:+.3}", sum / n as f64)
            } else {
                "-".into()
            };
            let kl_delta = if kl.is_empty() {
                "-".into()
            } else {
                format!("{:+.4}", kl.iter().sum::<f64>() / kl.len() as f64)
            };
            let kl_lower = if kl.is_empty() {
                "-".into()
            } else {
                format!("{lower}/{}", kl.len())
            };
            let _ = writeln!(
                s,
                "| {other} | {} | {n} | {w} | {t} | {l} | {delta} | {kl_delta} | {kl_lower} |",
                percent_label(pm)
            );
        }
    }
    s += "\n";
    s += &score_table(report, &policies);
    s += &kl_table(report, &policies, "text-kl");
    s += &kl_table(report, &policies, "text-kl-keep-continuation");
    s
}

/// Mean score over calibrated lengths per (task, budget share), one column per policy;
/// the best score of a row is bold.
fn score_table(report: &Report, policies: &BTreeSet<&str>) -> String {
    // (task, budget) → policy → scores
    let mut groups: BTreeMap<(&str, u32), BTreeMap<&str, Vec<f64>>> = BTreeMap::new();
    for r in report
        .results
        .iter()
        .filter(|r| !r.task.starts_with("text-kl") && r.calibrated && r.policy != "full")
    {
        if let Some(pm) = budget_permille(r) {
            groups
                .entry((r.task.as_str(), pm))
                .or_default()
                .entry(r.policy.as_str())
                .or_default()
                .push(r.score);
        }
    }
    if groups.is_empty() {
        return String::new();
    }
    let mut s = String::from("### Mean score per task and budget (calibrated lengths only; best in bold)\n\n| task | budget |");
    for p in policies {
        let _ = write!(s, " {p} |");
    }
    s += "\n|---|---|";
    s += &"---|".repeat(policies.len());
    s += "\n";
    for ((task, pm), by_policy) in &groups {
        let means: Vec<Option<f64>> = policies
            .iter()
            .map(|p| {
                by_policy
                    .get(p)
                    .map(|v| v.iter().sum::<f64>() / v.len() as f64)
            })
            .collect();
        let best = means
            .iter()
            .flatten()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max);
        let _ = write!(s, "| {task} | {} |", percent_label(*pm));
        for m in &means {
            let _ = match m {
                Some(v) if (*v - best).abs() < TIE => write!(s, " **{v:.2}** |"),
                Some(v) => write!(s, " {v:.2} |"),
                None => write!(s, " - |"),
            };
        }
        s += "\n";
    }
    s + "\n"
}

/// A text-kl task's mean KL per (length, budget share), one column per policy; the lowest
/// is bold.
fn kl_table(report: &Report, policies: &BTreeSet<&str>, task: &str) -> String {
    let mut groups: BTreeMap<(usize, u32), BTreeMap<&str, f64>> = BTreeMap::new();
    for r in report
        .results
        .iter()
        .filter(|r| r.task == task && r.policy != "full")
    {
        if let (Some(pm), Some(kl)) = (budget_permille(r), r.kl_mean) {
            groups
                .entry((r.context_tokens, pm))
                .or_default()
                .insert(r.policy.as_str(), kl);
        }
    }
    if groups.is_empty() {
        return String::new();
    }
    let mut s = format!(
        "### {task}: mean KL(p_full ‖ p_policy), nats (lowest in bold)\n\n| length | budget |"
    );
    for p in policies {
        let _ = write!(s, " {p} |");
    }
    s += "\n|---|---|";
    s += &"---|".repeat(policies.len());
    s += "\n";
    for ((len, pm), by_policy) in &groups {
        let best = by_policy.values().copied().fold(f64::INFINITY, f64::min);
        let _ = write!(s, "| {len} | {} |", percent_label(*pm));
        for p in policies {
            let _ = match by_policy.get(p) {
                Some(v) if (*v - best).abs() < TIE => write!(s, " **{v:.3}** |"),
                Some(v) => write!(s, " {v:.3} |"),
                None => write!(s, " - |"),
            };
        }
        s += "\n";
    }
    s + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(
        task: &str,
        policy: &str,
        budget: Option<u32>,
        score: f64,
        kl: Option<f64>,
        calibrated: bool,
    ) -> SummaryRow {
        SummaryRow {
            task: task.into(),
            context_tokens: 1024,
            policy: policy.into(),
            kv_granularity: "shared".into(),
            kv_budget: budget,
            block_size: 16,
            score,
            kl_mean: kl,
            top1_agreement: None,
            samples: 4,
            token_f1: None,
            rouge_l: None,
            delta_ppl: None,
            full_score: Some(1.0),
            calibrated,
        }
    }

    #[test]
    fn counts_wins_ties_and_losses_on_calibrated_cells_only() {
        let results = vec![
            row("passkey", "full", None, 1.0, None, true),
            row("passkey", "paged-eviction", Some(256), 0.75, None, true),
            row("passkey", "knorm", Some(256), 0.25, None, true),
            row("niah-single", "paged-eviction", Some(256), 0.0, None, true),
            row("niah-single", "knorm", Some(256), 0.5, None, true),
            row(
                "kv-retrieval",
                "paged-eviction",
                Some(256),
                1.0,
                None,
                false,
            ), // uncalibrated: ignored
            row("kv-retrieval", "knorm", Some(256), 0.0, None, false),
            row(
                "text-kl",
                "paged-eviction",
                Some(256),
                0.9,
                Some(0.10),
                true,
            ),
            row("text-kl", "knorm", Some(256), 0.9, Some(0.30), true),
        ];
        let md = markdown(
            &Report {
                model: "m".into(),
                results,
            },
            "paged-eviction",
        );
        // 25% of 1024: one win (passkey +0.5), one loss (niah -0.5), mean Δ 0; KL 0.2 lower.
        assert!(
            md.contains("| knorm | 25% | 2 | 1 | 0 | 1 | +0.000 | -0.2000 | 1/1 |"),
            "{md}"
        );
        assert!(md.contains("| passkey | 25% | 0.25 | **0.75** |"), "{md}");
        assert!(
            !md.contains("kv-retrieval"),
            "uncalibrated cells must not count: {md}"
        );
        assert!(md.contains("| 1024 | 25% | 0.300 | **0.100** |"), "{md}");
    }

    #[test]
    fn nothing_without_the_subject() {
        let r = Report {
            model: "m".into(),
            results: vec![row("passkey", "knorm", Some(256), 0.5, None, true)],
        };
        assert_eq!(markdown(&r, "paged-eviction"), "");
    }
}
