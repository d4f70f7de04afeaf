//! The paper's regime on the real engine and tiers: all tiers together hold a fraction of
//! the working set (`--tiers-fractions`), and the store keeps one copy per context
//! (`Copies::PlacedOnly`), so what does not fit is dropped and recomputed when asked for,
//! and compression is what lets more contexts stay. Every real policy serves the trace
//! serially, as in the base runs; the simulator's `bounded-F` rows are the same scenario
//! replayed, so the two sit side by side in the report.

use std::time::Instant;

use anyhow::Result;
use pk_evicpress::DelayModel;

use super::setup::Setup;
use super::{serve_trace, warm_runners, workload, EvicpressArgs, Preset, RealPolicy, RunRow};

/// One row per (fraction, real policy), scenario `bounded-F`, and setup's full-prefill row
/// in each scenario. The runners of one fraction
/// live together (each holds an engine) and are finished before the next fraction's start.
#[allow(clippy::too_many_arguments)]
pub fn real_rows(
    a: &EvicpressArgs,
    p: &Preset,
    setup: &Setup,
    policies: &[RealPolicy],
    delay: &DelayModel,
    dir: &std::path::Path,
    working_set: u64,
    reqs: &[workload::Request],
) -> Result<Vec<RunRow>> {
    let mut rows = Vec::new();
    for &fraction in a.tiers_fractions.iter() {
        let t0 = Instant::now();
        let f = Some(fraction);
        let mut runners = warm_runners(a, p, setup, policies, delay, dir, working_set, f)?;
        serve_trace(&mut runners, p, setup, reqs)?;
        for runner in runners {
            let (row, _) = runner.finish();
            eprintln!(
                "{} {:?} with tiers at {fraction} of the working set: TTFT mean {:.3} s, \
                 quality {:.3}, task {:.3}, {:?}",
                row.policy,
                row.alpha,
                row.ttft_mean_s,
                row.quality,
                row.task_score.unwrap_or(f64::NAN),
                row.hits_per_tier
            );
            rows.push(row);
        }
        eprintln!(
            "real bounded-{fraction}: {} policies in {:.0} s",
            policies.len(),
            t0.elapsed().as_secs_f64()
        );
        // Full prefill does not depend on the tiers: setup's measured row, in each scenario.
        let mut full = super::full_prefill_row(a, setup, reqs);
        full.scenario = super::report::bounded_name(fraction);
        rows.push(full);
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::super::tier_capacities;
    use super::*;

    fn args(extra: &[&str]) -> EvicpressArgs {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            a: EvicpressArgs,
        }
        let argv = std::iter::once("bench-evicpress").chain(extra.iter().copied());
        Cli::try_parse_from(argv).unwrap().a
    }

    #[test]
    fn bounded_capacities_split_the_fraction_and_bound_the_last_tier() {
        let a = args(&["--disk-fraction", "0.5"]);
        let ws = 1_000_000;
        // Unbounded: RAM its share, the disk its share when Redis is last, the last unlimited.
        assert_eq!(
            tier_capacities(&a, 3, 0.2, None, ws),
            vec![200_000, 500_000, u64::MAX]
        );
        assert_eq!(
            tier_capacities(&a, 2, 0.2, None, ws),
            vec![200_000, u64::MAX]
        );
        // A quarter: RAM min(0.2, 0.125), disk half of the rest, Redis what is left.
        let caps = tier_capacities(&a, 3, 0.2, Some(0.25), ws);
        assert_eq!(caps, vec![125_000, 62_500, 62_500]);
        // Half, two tiers: RAM its share (under F/2), the disk the rest of F.
        assert_eq!(
            tier_capacities(&a, 2, 0.2, Some(0.5), ws),
            vec![200_000, 300_000]
        );
    }
}
