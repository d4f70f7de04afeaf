//! Redraws the summary plots of an eval directory from its `results.jsonl` alone (every
//! record in the file, whatever sweep wrote it), without loading a model, and prints the
//! PagedEviction comparison tables (a preview of a sweep still running):
//! `cargo run --release -p pk-eval --example replot -- DIR [OUT_DIR]`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Parser;
use pk_eval::{compare, plot, record, report};

/// Redraws an eval directory's summary plots from its `results.jsonl` alone.
#[derive(Parser)]
#[command(name = "replot")]
struct Args {
    /// The eval directory whose `results.jsonl` is read.
    dir: PathBuf,
    /// Where the plots are written; the eval directory itself without it.
    out_dir: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dir = args.dir;
    let out = args.out_dir.unwrap_or_else(|| dir.clone());
    let records: Vec<record::RawResult> = record::load(&dir.join("results.jsonl"))?
        .into_values()
        .collect();
    let model = records.first().map(|r| r.model.clone()).unwrap_or_default();
    std::fs::create_dir_all(&out)?;
    let summary = report::summarise(&model, &records);
    for p in plot::write_plots(&summary, &out)? {
        eprintln!("wrote {}", p.display());
    }
    print!(
        "{}{}",
        report::calibration_text(&summary),
        compare::markdown(&summary, "paged-eviction")
    );
    Ok(())
}
