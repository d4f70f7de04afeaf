//! What eviction costs a paged cache per decoded token (issue 38's systems measurement),
//! side by side in one run: for each policy and granularity at a 1K budget over long
//! contexts, the K/V bytes compaction copies, the block-table entries whole-block removal
//! shifts, the blocks freed, and the decode step time, against the full cache's step.
//!
//! Positions are absolute and never re-rotated (ARCHITECTURE.md), so no policy pays for
//! re-rotation; what differs is whether a victim leaves as a whole block of a table one
//! unit owns (a table edit) or as tokens compacted out of several units' blocks (copies).
//!
//! Each configuration runs twice on the same prompt, generating 2 and then 2 + N tokens
//! (a request whose first token ends it is never pruned, so the shorter run must decode
//! once); the difference of the two runs' counters is what N decode steps cost, without
//! prefill pruning. The prompt's full-cache run first fills the prefix cache, so later runs
//! adopt it instead of prefilling again.
//!
//!     cargo run --release -p pk-engine --example eviction_cost [MODEL.gguf] [CONTEXTS] [N]
//!
//! CONTEXTS defaults to 4096,8192 and N to 256.

use std::path::PathBuf;

use clap::Parser;
mod common;
use common::comma_list;
use pk_engine::{Engine, EngineConfig, EvictionStats, GenerateParams};

const BUDGET_TOKENS: u32 = 1024;

/// The policies compared, with the granularity each runs at: PagedEviction's default
/// (`v-norm`, victims among the oldest 3 blocks, per layer) and the same shared and per KV
/// head, its default before issue 38 (the ratio score, global victims, shared) and `v-norm`
/// with global victims per head, and the baselines the issue names at their defaults.
const CONFIGS: [(&str, &str); 9] = [
    ("paged-eviction", "layer"),
    ("paged-eviction", "shared"),
    ("paged-eviction", "head"),
    ("paged-eviction:ratio:global", "shared"),
    ("paged-eviction:global", "head"),
    ("streaming-llm", "shared"),
    ("h2o", "shared"),
    ("tova", "shared"),
    ("tova", "head"),
];

/// What eviction costs a paged cache per decoded token, per policy and granularity.
#[derive(Parser)]
#[command(name = "eviction_cost")]
struct Args {
    /// The GGUF model; without it, the default model (fetched if missing).
    model: Option<PathBuf>,
    /// Prompt lengths in tokens, comma-separated; each is measured in turn.
    // `::std::vec::Vec`, so that clap takes one argument and `comma_list` splits it, rather
    // than a run of positionals that would swallow the next one.
    #[arg(value_parser = comma_list::<usize>, default_value = "4096,8192")]
    contexts: ::std::vec::Vec<usize>,
    /// Decoded tokens whose cost is measured, after the first.
    #[arg(default_value_t = 256)]
    decode: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let model = match args.model {
        Some(p) => p,
        None => pk_engine::model_store::resolve_model(None, true)?,
    };
    let (contexts, decode) = (args.contexts, args.decode);
    let max_context = contexts.iter().max().copied().unwrap_or(0);
    let mut engine = Engine::load(
        &model,
        EngineConfig {
            kv_capacity_tokens: Some(2 * (max_context + decode) + 4096),
            ..Default::default()
        },
    )?;
    let cfg = engine.model_config().clone();
    // One slot: K and V of one token, one layer, one KV head, in f16.
    let slot_bytes = 2 * cfg.head_dim * 2;
    println!(
        "model {} | budget {BUDGET_TOKENS} | {decode} decoded tokens | slot {slot_bytes} B | {}",
        model.display(),
        host_quiet()
    );
    println!(
        "{:>7} {:>24} {:>8} {:>10} {:>14} {:>14} {:>14}",
        "context", "policy", "units", "ms/token", "KV B copied/t", "table ent./t", "blocks freed/t"
    );
    for &ctx in &contexts {
        let prompt: Vec<u32> = (0..ctx as u64)
            .map(|i| (1000 + (i * 7919) % (cfg.vocab_size as u64 - 1000)) as u32)
            .collect();
        let full = GenerateParams {
            max_tokens: decode + 1,
            ignore_eos: true,
            ..Default::default()
        };
        let out = engine.generate(&prompt, &full, &mut |_| {})?;
        let full_ms = 1e3 * out.decode_seconds / decode as f64;
        println!(
            "{ctx:>7} {:>24} {:>8} {full_ms:>10.2} {:>14} {:>14} {:>14}",
            "full cache", "-", 0, 0, 0
        );
        for (policy, granularity) in CONFIGS {
            let params = |max_tokens| -> anyhow::Result<GenerateParams> {
                Ok(GenerateParams {
                    max_tokens,
                    ignore_eos: true,
                    kv_policy: Some(policy.parse()?),
                    kv_budget: Some(BUDGET_TOKENS),
                    kv_granularity: Some(granularity.parse()?),
                    ..Default::default()
                })
            };
            let short = run(&mut engine, &prompt, &params(2)?, policy)?;
            let long = run(&mut engine, &prompt, &params(decode + 2)?, policy)?;
            let per =
                |f: fn(&EvictionStats) -> u64| (f(&long.1) - f(&short.1)) as f64 / decode as f64;
            println!(
                "{ctx:>7} {policy:>24} {granularity:>8} {:>10.2} {:>14.0} {:>14.2} {:>14.3}",
                1e3 * (long.0 - short.0) / decode as f64,
                per(|s| s.kv_slot_copies) * slot_bytes as f64,
                per(|s| s.table_entries_shifted),
                per(|s| s.blocks_freed),
            );
        }
    }
    Ok(())
}

/// Decode seconds of one generation and the eviction counters it added.
fn run(
    engine: &mut Engine,
    prompt: &[u32],
    params: &GenerateParams,
    policy: &str,
) -> anyhow::Result<(f64, EvictionStats)> {
    let name = params
        .kv_policy
        .as_ref()
        .map_or(policy.to_string(), |p| p.name().to_string());
    engine.eviction_stats.remove(&name);
    let out = engine.generate(prompt, params, &mut |_| {})?;
    let stats = engine
        .eviction_stats
        .get(&name)
        .cloned()
        .unwrap_or_default();
    Ok((out.decode_seconds, stats))
}

fn host_quiet() -> String {
    let tool = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/tools/host-quiet"
    );
    std::process::Command::new(tool)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().replace('\n', " "))
        .unwrap_or_else(|e| format!("host-quiet unavailable: {e}"))
}
