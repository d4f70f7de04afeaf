//! The tokens each selection unit keeps at prefill, for comparison with a second
//! implementation (issue 37: KVzip's kept sets against `scripts/kvpress_reference.py
//! --dump-kept`, compared by `scripts/compare_kept_sets.py`).
//!
//! Reads the prefixes of a `text-kl-tokens.jsonl` (written by `eval`), runs each through
//! the engine under POLICY at each budget with two generated tokens, and prints one JSON
//! line per (sample, budget): `{"sample", "budget", "policy", "granularity", "units":
//! [{"layers", "kv_head", "kept"}]}`.
//!
//!     cargo run --release -p pk-engine --example kept_sets -- MODEL TOKENS.jsonl \
//!         POLICY GRANULARITY BUDGETS SAMPLES > kept.jsonl
//!
//! for example `… kvzip:global head 1024,512,256 4`.

use std::path::PathBuf;

use clap::Parser;
mod common;
use common::comma_list;
use pk_engine::{Engine, EngineConfig, GenerateParams};
use pk_kv::{KvGranularity, PolicySpec};
use serde_json::{json, Value};

/// The tokens each selection unit keeps at prefill, as JSON lines, one per sample and budget.
#[derive(Parser)]
#[command(name = "kept_sets")]
struct Args {
    /// The GGUF model.
    model: PathBuf,
    /// The `text-kl-tokens.jsonl` whose prefixes are run.
    #[arg(value_name = "TOKENS.jsonl")]
    tokens: PathBuf,
    /// The eviction policy, as `pagekeeper` names it (`kvzip:global`).
    policy: PolicySpec,
    /// Which units choose their kept tokens (`shared`, `layer`, `head`).
    granularity: KvGranularity,
    /// KV budgets in tokens, comma-separated; each prefix runs at every one.
    // `::std::vec::Vec`, so that clap takes one argument and `comma_list` splits it, rather
    // than a run of positionals that would swallow the next one.
    #[arg(value_parser = comma_list::<u32>)]
    budgets: ::std::vec::Vec<u32>,
    /// How many samples are run: those numbered below it, each once.
    samples: u64,
}

fn main() -> anyhow::Result<()> {
    let Args {
        model,
        tokens,
        policy,
        granularity,
        budgets,
        samples,
    } = Args::parse();
    let mut engine = Engine::load(&model, EngineConfig::default())?;
    let mut seen = std::collections::HashSet::new();
    for line in std::fs::read_to_string(tokens)?.lines() {
        let row: Value = serde_json::from_str(line)?;
        let sample = row["sample"].as_u64().unwrap_or(u64::MAX);
        if sample >= samples || !seen.insert(sample) {
            continue;
        }
        let prefix: Vec<u32> = serde_json::from_value(row["prefix"].clone())?;
        for &budget in &budgets {
            // A request whose first token ends it is never pruned: generate two.
            let params = GenerateParams {
                max_tokens: 2,
                ignore_eos: true,
                kv_policy: Some(policy),
                kv_budget: Some(budget),
                kv_granularity: Some(granularity),
                record_prefill_keeps: true,
                ..Default::default()
            };
            let out = engine.generate(&prefix, &params, &mut |_| {})?;
            let units: Vec<Value> = out
                .prefill_keeps
                .unwrap_or_default()
                .into_iter()
                .map(|k| json!({"layers": k.layers, "kv_head": k.kv_head, "kept": k.kept}))
                .collect();
            let line = json!({"sample": sample, "budget": budget, "prompt_tokens": prefix.len(),
                "policy": policy.to_string(), "granularity": granularity.name(), "units": units});
            println!("{line}");
        }
    }
    Ok(())
}
