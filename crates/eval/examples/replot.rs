//! Redraws the summary plots of an eval directory from its `results.jsonl` alone (every
//! record in the file, whatever sweep wrote it), without loading a model:
//! `cargo run --release -p pk-eval --example replot -- DIR [OUT_DIR]`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use pk_eval::{plot, record, report};

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().context("usage: replot DIR [OUT_DIR]")?);
    let out = args.next().map_or_else(|| dir.clone(), PathBuf::from);
    let records: Vec<record::RawResult> = record::load(&dir.join("results.jsonl"))?.into_values().collect();
    let model = records.first().map(|r| r.model.clone()).unwrap_or_default();
    std::fs::create_dir_all(&out)?;
    for p in plot::write_plots(&report::summarise(&model, &records), &out)? {
        println!("{}", p.display());
    }
    Ok(())
}
