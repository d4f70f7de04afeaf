//! `pagekeeper eval`: quality of KV eviction policies against the full cache (pk-eval).
//!
//! Writes into `--out`: `results.jsonl` (raw, one line per cell and sample; a rerun skips
//! what is there), `summary.json` (the `--json` object), `summary.csv`, `summary.md`, and
//! PNG plots: `scores_B{B}.png` (score vs budget per policy, a panel per task and length)
//! and `kl_B{B}.png` (text-kl's KL and top-1 agreement vs budget).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use pk_eval::{report, Budget, SweepConfig, Task};

#[derive(Args)]
pub struct EvalArgs {
    /// A few minutes on two cores (the default preset): 1K and 2K tokens, budgets 25% and 50%, B = 16.
    #[arg(long, conflicts_with = "full")]
    pub quick: bool,
    /// The report: every task at 1K and 2K tokens, budgets 12.5–75%, B = 16, 4 samples, 7 policies
    /// (about an hour with one thread on a shared 2-core machine; resumable).
    #[arg(long)]
    pub full: bool,
    /// Evicting policies to compare with the full cache, comma-separated
    /// (default: paged-eviction, streaming-llm, keydiff, knorm). A policy written
    /// `NAME/GRANULARITY` (`snapkv/head`) runs at that granularity only; the others run at
    /// every `--kv-granularity`.
    #[arg(long, value_delimiter = ',')]
    pub policies: Option<Vec<String>>,
    /// KV budgets: percentages of the context (25%) or token counts (512), comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub budgets: Option<Vec<String>>,
    /// passkey, niah-single, niah-multikey, niah-multivalue, kv-retrieval, variable-tracking, text-kl
    /// (the default set), and text-kl-keep-continuation, code-completion (LongBench's LCC
    /// style on the dependency crates' sources), passage-count (LongBench's, on the book).
    #[arg(long, value_delimiter = ',')]
    pub tasks: Option<Vec<String>>,
    /// Context lengths in tokens, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub lengths: Option<Vec<usize>>,
    /// Tokens per KV block, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub block_sizes: Option<Vec<u32>>,
    /// Samples per (task, length); needle depths are swept across them.
    #[arg(long)]
    pub samples: Option<usize>,
    /// Seed of the generated tasks.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Output directory (created; results.jsonl there is resumed).
    #[arg(long, default_value = "eval-out")]
    pub out: PathBuf,
    /// Print one JSON object on stdout instead of tables.
    #[arg(long)]
    pub json: bool,
    /// A local GGUF file; default: SmolLM2-135M-Instruct Q4_1, fetched on first use.
    #[arg(long, env = "PAGEKEEPER_MODEL")]
    pub model: Option<PathBuf>,
    /// Also run text-kl under kvpress's protocol (task `text-kl-keep-continuation`): the
    /// budget bounds the prefix only and every continuation token is kept. Rows of both
    /// protocols are reported side by side.
    #[arg(long)]
    pub text_kl_keep_continuation: bool,
    /// kvpress's query-agnostic convention for the tasks that ask a question: the context is
    /// prefilled and compressed before the question is read (forced after it, and kept),
    /// then the answer is generated; rows carry `query_agnostic`. The text-kl tasks read
    /// their continuation after the compressed prefix already; code completion asks none.
    #[arg(long)]
    pub query_agnostic: bool,
    /// Forced tokens after the prefix in the text-kl tasks (default 64; kvpress's comparison
    /// used 256). Lengths include them.
    #[arg(long)]
    pub continuation_tokens: Option<usize>,
    /// Hide the progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Live KV precision of the runs (f16, f32, q8, q4); `text-kl` rows then compare
    /// against the f16 full cache, so its `full` row measures the precision itself.
    #[arg(long, default_value = "f16")]
    pub kv_dtype: String,
    /// Eviction granularities to sweep, comma-separated (shared, layer, head): each evicting
    /// policy and budget runs at every one; rows carry `kv_granularity`, and summaries name
    /// a non-shared one after the policy (`snapkv/head`). Default: each policy at its own
    /// (head for paged-eviction and kvzip:global, shared for the others).
    #[arg(long, value_delimiter = ',')]
    pub kv_granularity: Option<Vec<String>>,
    /// Worker threads for the kernels (default: all cores). Scores do not depend on it.
    #[arg(long)]
    pub threads: Option<usize>,
}

fn config(a: &EvalArgs) -> Result<SweepConfig> {
    let model = pk_engine::model_store::resolve_model(a.model.as_deref(), true)?;
    config_for(a, model)
}

/// The sweep `a` asks for on the model file `model`, every flag checked.
fn config_for(a: &EvalArgs, model: std::path::PathBuf) -> Result<SweepConfig> {
    let mut c = if a.full {
        SweepConfig::full(model, a.out.clone())
    } else {
        SweepConfig::quick(model, a.out.clone())
    };
    if let Some(p) = &a.policies {
        (c.policies, c.pinned_policies) = (Vec::new(), Vec::new());
        for s in p {
            let (name, granularity) = match s.split_once('/') {
                Some((name, g)) => (name, Some(g)),
                None => (s.as_str(), None),
            };
            let spec = name
                .parse::<pk_kv::PolicySpec>()
                .map_err(|e| anyhow::anyhow!("--policies: {e}"))?;
            // The full cache always runs as the reference, and takes no granularity.
            match (spec.evicts(), granularity) {
                (false, None) => {}
                (false, Some(_)) => {
                    bail!("--policies: {s:?}: a granularity needs an evicting policy")
                }
                (true, None) => c.policies.push(spec),
                (true, Some(g)) => c.pinned_policies.push((
                    spec,
                    g.parse()
                        .map_err(|e| anyhow::anyhow!("--policies: {s:?}: {e}"))?,
                )),
            }
        }
    }
    if let Some(b) = &a.budgets {
        c.budgets = b
            .iter()
            .map(|s| Budget::parse(s).map_err(|e| anyhow::anyhow!("--budgets: {e}")))
            .collect::<Result<_>>()?;
    }
    if let Some(t) = &a.tasks {
        c.tasks = t
            .iter()
            .map(|s| Task::parse(s).map_err(|e| anyhow::anyhow!("--tasks: {e}")))
            .collect::<Result<_>>()?;
    }
    if let Some(l) = &a.lengths {
        c.lengths = l.clone();
    }
    if let Some(b) = &a.block_sizes {
        c.block_sizes = b.clone();
    }
    if let Some(n) = a.samples {
        c.samples = n;
    }
    if let Some(s) = a.seed {
        c.seed = s;
    }
    if let Some(n) = a.continuation_tokens {
        if n == 0 {
            bail!("--continuation-tokens must be at least 1");
        }
        c.continuation_tokens = n;
    }
    if a.text_kl_keep_continuation && !c.tasks.contains(&Task::TextKlKeepContinuation) {
        c.tasks.push(Task::TextKlKeepContinuation);
    }
    if let Some(g) = &a.kv_granularity {
        c.granularities = g
            .iter()
            .map(|s| {
                s.parse::<pk_kv::KvGranularity>()
                    .map_err(|e| anyhow::anyhow!("--kv-granularity: {e}"))
            })
            .collect::<Result<_>>()?;
    }
    c.progress = !a.no_progress;
    c.query_agnostic = a.query_agnostic;
    c.kv_dtype = pk_model::KvDtype::parse(&a.kv_dtype).with_context(|| {
        format!(
            "unknown --kv-dtype {:?} (expected {})",
            a.kv_dtype,
            pk_model::KvDtype::NAMES
        )
    })?;
    check_used(a, &c)?;
    if c.samples == 0 || c.lengths.is_empty() || c.tasks.is_empty() || c.block_sizes.is_empty() {
        bail!("nothing to run: samples, lengths, tasks and block sizes must not be empty");
    }
    check_values(a, &c)?;
    Ok(c)
}

/// Values the sweep would crash on, drop without a word, or count twice: refused by flag.
fn check_values(a: &EvalArgs, c: &SweepConfig) -> Result<()> {
    if let Some(b) = c.block_sizes.iter().find(|&&b| !(1..=256).contains(&b)) {
        bail!("--block-sizes: {b} is not a block size (1 to 256 tokens)");
    }
    let text_kl = c
        .tasks
        .iter()
        .any(|t| matches!(t, Task::TextKl | Task::TextKlKeepContinuation));
    let shortest = c.lengths.iter().copied().min().unwrap_or(0);
    if text_kl && c.continuation_tokens.saturating_add(16) >= shortest {
        bail!(
            "--continuation-tokens {} leaves no prefix in a {shortest}-token context (--lengths): text-kl needs a context longer than the continuation plus 16 tokens",
            c.continuation_tokens
        );
    }
    // A budget that keeps every context whole, or is below 3 blocks, at every length and
    // block size of the sweep would never run: the full cache alone would be reported.
    for (given, budget) in a.budgets.iter().flatten().zip(&c.budgets) {
        let applies = c
            .lengths
            .iter()
            .any(|&l| c.block_sizes.iter().any(|&b| budget.tokens(l, b).is_some()));
        if !applies {
            bail!("--budgets {given}: at every --lengths and --block-sizes it is below 3 blocks or keeps the whole context, so no policy would run under it");
        }
    }
    let lists: [(&str, Vec<String>); 5] = [
        (
            "--lengths",
            c.lengths.iter().map(|l| l.to_string()).collect(),
        ),
        (
            "--block-sizes",
            c.block_sizes.iter().map(|b| b.to_string()).collect(),
        ),
        ("--tasks", a.tasks.clone().unwrap_or_default()),
        ("--policies", a.policies.clone().unwrap_or_default()),
        (
            "--kv-granularity",
            a.kv_granularity.clone().unwrap_or_default(),
        ),
    ];
    for (flag, items) in lists {
        let mut seen = std::collections::HashSet::new();
        if let Some(twice) = items.iter().find(|i| !seen.insert(i.as_str())) {
            bail!("{flag}: {twice} is given twice (each would be run and counted again)");
        }
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(twice) = c.budgets.iter().find(|b| !seen.insert(b.label())) {
        bail!("--budgets: {} is given twice", twice.label());
    }
    Ok(())
}

/// Flags that the sweep as configured would not use, refused by name: the continuation
/// length where no text-kl task runs, and budgets and granularities where no evicting
/// policy does (the full cache always runs, as the reference, and takes neither).
fn check_used(a: &EvalArgs, c: &SweepConfig) -> Result<()> {
    let text_kl = c
        .tasks
        .iter()
        .any(|t| matches!(t, Task::TextKl | Task::TextKlKeepContinuation));
    let asks_question = c.tasks.iter().any(|t| {
        !matches!(
            t,
            Task::TextKl | Task::TextKlKeepContinuation | Task::CodeCompletion
        )
    });
    if a.query_agnostic && !asks_question {
        bail!("--query-agnostic is not used by `eval` without a task that asks a question: the text-kl tasks read their continuation after the compressed prefix already, and code completion asks none");
    }
    if a.continuation_tokens.is_some() && !text_kl {
        bail!("--continuation-tokens is not used by `eval` without a text-kl task: only text-kl and text-kl-keep-continuation force a continuation");
    }
    if c.policies.is_empty() && !c.pinned_policies.is_empty() && a.kv_granularity.is_some() {
        bail!("--kv-granularity is not used by `eval` when every policy in --policies names its own (`snapkv/head`)");
    }
    if c.policies.is_empty() && c.pinned_policies.is_empty() {
        for (set, flag) in [
            (a.budgets.is_some(), "--budgets"),
            (a.kv_granularity.is_some(), "--kv-granularity"),
        ] {
            if set {
                bail!("{flag} is not used by `eval` without an evicting policy in --policies: the full cache runs as the reference with neither");
            }
        }
    }
    Ok(())
}

pub fn run(a: EvalArgs) -> Result<()> {
    let cfg = config(&a)?;
    crate::args::set_threads(a.threads)?;
    let t0 = Instant::now();
    let outcome = pk_eval::run_sweep(&cfg)?;
    let report = report::summarise(&outcome.model, &outcome.records);
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let write = |name: &str, text: String| {
        let p = cfg.out_dir.join(name);
        std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))
    };
    // The report plus the sweep's KV precision and protocol (fields added to the --json
    // contract).
    let mut json = serde_json::to_value(&report)?;
    json["kv_dtype"] = cfg.kv_dtype.to_string().into();
    json["query_agnostic"] = cfg.query_agnostic.into();
    let json = serde_json::to_string(&json)?;
    write("summary.json", json.clone() + "\n")?;
    write("summary.csv", report::csv(&report))?;
    write("summary.md", report::markdown(&report, &command))?;
    let plots = pk_eval::plot::write_plots(&report, &cfg.out_dir)?;
    eprintln!(
        "eval: ran {} new of {} cells in {:.1} s; results in {} ({} plots)",
        outcome.cells_run,
        outcome.cells_total,
        t0.elapsed().as_secs_f64(),
        cfg.out_dir.display(),
        plots.len()
    );
    if a.json {
        println!("{json}");
    } else {
        println!("{}", report::calibration_text(&report));
        print!("{}", report::table_text(&report));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The refusal of `eval` with `flags` (and `--out /tmp/unused`), before any model loads.
    fn refusal(flags: &[&str]) -> String {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            eval: EvalArgs,
        }
        let argv = ["eval", "--out", "/tmp/unused"].iter().chain(flags);
        let a = Cli::try_parse_from(argv).unwrap().eval;
        config_for(&a, "/m/model.gguf".into())
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn values_the_sweep_would_crash_on_drop_or_count_twice_are_refused() {
        let base = ["--tasks", "text-kl", "--policies", "knorm"];
        let with = |extra: &[&'static str]| {
            let mut v = base.to_vec();
            v.extend_from_slice(extra);
            refusal(&v)
        };
        let err = with(&["--block-sizes", "0"]);
        assert!(err.starts_with("--block-sizes: 0"), "{err}");
        let err = with(&[
            "--lengths",
            "256",
            "--continuation-tokens",
            "18446744073709551615",
        ]);
        assert!(
            err.starts_with("--continuation-tokens 18446744073709551615"),
            "{err}"
        );
        let err = with(&["--lengths", "256", "--budgets", "100000"]);
        assert!(err.starts_with("--budgets 100000"), "{err}");
        let err = with(&["--lengths", "256", "--budgets", "10"]);
        assert!(err.starts_with("--budgets 10"), "{err}");
        let err = with(&["--lengths", "256,256"]);
        assert!(err.starts_with("--lengths: 256 is given twice"), "{err}");
        let err = refusal(&["--tasks", "text-kl", "--policies", "knorm,knorm"]);
        assert!(err.starts_with("--policies: knorm is given twice"), "{err}");
        let err = with(&["--budgets", "25%,25%"]);
        assert!(err.starts_with("--budgets: "), "{err}");
    }
}
