//! The quality price of pruning prompts as their chunks arrive
//! (`EngineConfig::prefill_prune_interval_tokens`): teacher-forced KL from the full cache
//! of the same policy and budget with exact prefill (prune once, after the whole prompt)
//! and pruned every N prompt tokens, on windows of the bundled book.
//!
//! `cargo run --release -p pk-eval --example chunk_prune_kl -- [--model NAME|PATH]
//!  [--context 2048] [--samples 4] [--budgets 256,512] [--intervals 128,512]
//!  [--policies streaming-llm,knorm,keydiff] [--continuation 64]`

use anyhow::Result;
use clap::Parser;
use pk_engine::{Engine, EngineConfig, GenerateParams};
use pk_eval::metrics::kl_divergence;
use pk_kv::PolicySpec;

/// Teacher-forced KL from the full cache with exact prefill and with prompts pruned as their
/// chunks arrive.
#[derive(Parser)]
#[command(name = "chunk_prune_kl")]
struct Args {
    /// The model, as a name in the model store or a GGUF path; the default model without it.
    #[arg(long = "model", value_name = "NAME|PATH")]
    model: Option<String>,
    /// Prompt tokens of each window of the book.
    #[arg(long = "context", default_value_t = 2048)]
    context_tokens: usize,
    /// Windows of the book, spread evenly over it.
    #[arg(long, default_value_t = 4)]
    samples: usize,
    /// KV budgets in tokens, comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = trimmed::<u32>, default_value = "256,512")]
    budgets: Vec<u32>,
    /// Prompt tokens between prunings, comma-separated; each gets its own engine.
    #[arg(long, value_delimiter = ',', value_parser = trimmed::<usize>, default_value = "128,512")]
    intervals: Vec<usize>,
    /// Eviction policies, comma-separated, as `pagekeeper` names them.
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = policy_name,
        default_value = "streaming-llm,knorm,keydiff"
    )]
    policies: Vec<String>,
    /// Teacher-forced tokens after each prompt, over which the KL is averaged.
    #[arg(long = "continuation", default_value_t = 64)]
    continuation_tokens: usize,
}

/// One item of a comma-separated list, spaces around it allowed (`256, 512`).
fn trimmed<T: std::str::FromStr>(s: &str) -> Result<T, String> {
    s.trim().parse().map_err(|_| format!("bad list item {s:?}"))
}

/// A policy name as typed (the table prints it so), checked before any model is loaded.
fn policy_name(s: &str) -> Result<String, String> {
    let name = s.trim();
    name.parse::<PolicySpec>().map_err(|e| e.to_string())?;
    Ok(name.to_string())
}

/// Mean per-token KL(full ‖ other) over the forced continuation.
fn mean_kl(full: &[Vec<f32>], other: &[Vec<f32>]) -> f64 {
    let sum: f64 = full
        .iter()
        .zip(other)
        .map(|(p, q)| kl_divergence(p, q))
        .sum();
    sum / full.len() as f64
}

fn main() -> Result<()> {
    let a = Args::parse();
    let path =
        pk_engine::model_store::resolve_model(a.model.as_deref().map(std::path::Path::new), true)?;
    let engine = |interval: usize| {
        Engine::load(
            &path,
            EngineConfig {
                prefill_prune_interval_tokens: interval,
                ..Default::default()
            },
        )
    };
    let mut exact = engine(0)?;
    let mut chunked: Vec<(usize, Engine)> = a
        .intervals
        .iter()
        .map(|&n| engine(n).map(|e| (n, e)))
        .collect::<Result<_>>()?;
    let text = include_str!("../../../tests/fixtures/around-the-world-in-80-days.txt");
    let book = exact.tokenizer.encode(text, false);
    let window = a.context_tokens + a.continuation_tokens;
    let stride = (book.len() - window) / a.samples.max(1);
    // (policy, budget, interval or 0 for exact) -> KL per sample.
    let mut rows: Vec<(String, u32, usize, Vec<f64>)> = Vec::new();
    for s in 0..a.samples {
        let start = s * stride;
        let prompt = &book[start..start + a.context_tokens];
        let cont = &book[start + a.context_tokens..start + window];
        let full = exact.teacher_force(prompt, cont, &GenerateParams::default())?;
        for policy in &a.policies {
            for &budget in &a.budgets {
                let params = GenerateParams {
                    kv_policy: Some(policy.parse().map_err(|e| anyhow::anyhow!("{e}"))?),
                    kv_budget: Some(budget),
                    ..Default::default()
                };
                let mut record = |interval: usize, kl: f64| match rows
                    .iter_mut()
                    .find(|r| r.0 == *policy && r.1 == budget && r.2 == interval)
                {
                    Some(r) => r.3.push(kl),
                    None => rows.push((policy.clone(), budget, interval, vec![kl])),
                };
                let logits = exact.teacher_force(prompt, cont, &params)?;
                record(0, mean_kl(&full, &logits));
                for (n, e) in &mut chunked {
                    let logits = e.teacher_force(prompt, cont, &params)?;
                    record(*n, mean_kl(&full, &logits));
                }
            }
        }
        eprintln!("sample {} of {} done", s + 1, a.samples);
    }
    println!(
        "model {}, context {} tokens, {} forced, {} samples; mean KL(full || policy), nats",
        path.display(),
        a.context_tokens,
        a.continuation_tokens,
        a.samples
    );
    println!("| policy | budget | prefill | mean KL | per sample |");
    println!("|---|---|---|---|---|");
    for (policy, budget, interval, kls) in &rows {
        let mean = kls.iter().sum::<f64>() / kls.len() as f64;
        let how = match interval {
            0 => "exact".to_string(),
            n => format!("pruned every {n}"),
        };
        let each: Vec<String> = kls.iter().map(|k| format!("{k:.3}")).collect();
        println!(
            "| {policy} | {budget} | {how} | {mean:.4} | {} |",
            each.join(" ")
        );
    }
    Ok(())
}
