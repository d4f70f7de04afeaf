//! The quality price of pruning prompts as their chunks arrive
//! (`EngineConfig::prefill_prune_interval_tokens`): teacher-forced KL from the full cache
//! of the same policy and budget with exact prefill (prune once, after the whole prompt)
//! and pruned every N prompt tokens, on windows of the bundled book.
//!
//! `cargo run --release -p pk-eval --example chunk_prune_kl -- [--model NAME|PATH]
//!  [--context 2048] [--samples 4] [--budgets 256,512] [--intervals 128,512]
//!  [--policies streaming-llm,knorm,keydiff] [--continuation 64]`

use anyhow::{bail, Context, Result};
use pk_engine::{Engine, EngineConfig, GenerateParams};
use pk_eval::metrics::kl_divergence;

struct Args {
    model: Option<String>,
    context_tokens: usize,
    samples: usize,
    budgets: Vec<u32>,
    intervals: Vec<usize>,
    policies: Vec<String>,
    continuation_tokens: usize,
}

fn list<T: std::str::FromStr>(s: &str) -> Result<Vec<T>> {
    s.split(',')
        .map(|x| {
            x.trim()
                .parse()
                .ok()
                .context(format!("bad list item {x:?}"))
        })
        .collect()
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        model: None,
        context_tokens: 2048,
        samples: 4,
        budgets: vec![256, 512],
        intervals: vec![128, 512],
        policies: vec!["streaming-llm".into(), "knorm".into(), "keydiff".into()],
        continuation_tokens: 64,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--model" => a.model = Some(v),
            "--context" => a.context_tokens = v.parse()?,
            "--samples" => a.samples = v.parse()?,
            "--budgets" => a.budgets = list(&v)?,
            "--intervals" => a.intervals = list(&v)?,
            "--policies" => a.policies = list(&v)?,
            "--continuation" => a.continuation_tokens = v.parse()?,
            _ => bail!("unknown flag {flag}"),
        }
    }
    Ok(a)
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
    let a = parse_args()?;
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
