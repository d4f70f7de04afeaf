//! Redraws the summary plots of an eval directory from its `results.jsonl` alone (every
//! record in the file, whatever sweep wrote it), without loading a model, and prints the
//! PagedEviction comparison tables (a preview of a sweep still running):
//! `cargo run --release -p pk-eval --example replot -- DIR [OUT_DIR]`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use pk_eval::{compare, plot, record, report};

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().context("usage: replot DIR [OUT_DIR]")?);
    let out = args.next().map_or_else(|| dir.clone(), PathBuf::from);
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
