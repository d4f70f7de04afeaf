//! `pagekeeper bench`: the benchmarks' subcommands, each in a file of its own
//! (bench_perf.rs, bench_serve.rs and bench_replicas.rs, bench_tiers.rs, bench_codecs.rs,
//! bench_evicpress/).

use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Prefill and decode speed per context length.
    Perf(crate::args::PerfArgs),
    /// Server throughput and TTFT/ITL percentiles at several client concurrencies.
    Serve(crate::bench_serve::ServeBenchArgs),
    /// TTFT of a long context served from each KV tier vs recomputed, and tier bandwidths.
    Tiers(crate::bench_tiers::TiersBenchArgs),
    /// Quality vs bytes of every KV codec and ratio (teacher-forced KL and top-1 vs full).
    Codecs(crate::bench_codecs::CodecsArgs),
    /// EVICPRESS vs full prefill, LRU and fixed compression on real tiers, plus sweeps.
    Evicpress(crate::bench_evicpress::EvicpressArgs),
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Perf(a) => crate::bench_perf::perf(a),
        // `--replicas` makes `bench serve` the replicas benchmark, which is built on
        // bench_serve.rs's client and servers.
        BenchCommand::Serve(a) if !a.replicas.is_empty() => crate::bench_replicas::run(a),
        BenchCommand::Serve(a) => crate::bench_serve::run(a),
        BenchCommand::Tiers(a) => crate::bench_tiers::run(a),
        BenchCommand::Codecs(a) => crate::bench_codecs::run(a),
        BenchCommand::Evicpress(a) => crate::bench_evicpress::run(a),
    }
}
