//! Raw results: one JSON line per (cell, sample) in `OUT/results.jsonl`, appended as soon
//! as it is measured, so a killed sweep loses at most the line being written (a torn last
//! line is skipped when reading).

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct RawResult {
    pub model: String,
    pub seed: u64,
    pub task: String,
    pub context_tokens: usize,
    pub sample: usize,
    pub policy: String,
    pub kv_budget: Option<u32>,
    pub block_size: u32,
    pub prompt_tokens: usize,
    /// Exact-match score (generative tasks) or top-1 agreement (`text-kl`), in [0, 1].
    pub score: f64,
    pub depth: Option<f64>,
    pub answer: Option<String>,
    pub expected: Vec<String>,
    /// Agreement with the full cache's greedy answer (generative tasks).
    pub token_f1: Option<f64>,
    pub rouge_l: Option<f64>,
    pub kl_mean: Option<f64>,
    pub top1_agreement: Option<f64>,
    pub ppl_full: Option<f64>,
    pub ppl_policy: Option<f64>,
    pub kv_stored_tokens: usize,
    pub seconds: f64,
    /// Live KV precision of this run (`f16` in records written before the field existed).
    #[serde(default = "default_kv_dtype")]
    pub kv_dtype: String,
    /// Eviction granularity (`shared` in records written before the field existed).
    #[serde(default = "default_kv_granularity")]
    pub kv_granularity: String,
    /// Run query-agnostic (`SweepConfig::query_agnostic`; false in older records).
    #[serde(default)]
    pub query_agnostic: bool,
}

fn default_kv_granularity() -> String {
    "shared".to_string()
}

fn default_kv_dtype() -> String {
    "f16".to_string()
}

/// The sweep-wide settings that change a cell's result without being part of its key:
/// `samples` places each sample's needle (`depth_for(sample, samples)`) and
/// `continuation_tokens` sets the text-kl prefix. Kept in `OUT/sweep.json`, so that a
/// resumed sweep never mixes results of two settings under one key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Manifest {
    samples: usize,
    continuation_tokens: usize,
}

/// Writes `OUT/sweep.json` for a new directory (or one written before it existed), and
/// refuses a sweep whose settings differ from the ones recorded there, naming the flag.
pub fn check_manifest(out_dir: &Path, samples: usize, continuation_tokens: usize) -> Result<()> {
    let path = out_dir.join("sweep.json");
    let this = Manifest {
        samples,
        continuation_tokens,
    };
    let Ok(text) = std::fs::read_to_string(&path) else {
        let json = serde_json::to_string_pretty(&this)?;
        return std::fs::write(&path, json + "\n")
            .with_context(|| format!("writing {}", path.display()));
    };
    let recorded: Manifest = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a sweep manifest", path.display()))?;
    for (flag, was, now) in [
        ("--samples", recorded.samples, samples),
        (
            "--continuation-tokens",
            recorded.continuation_tokens,
            continuation_tokens,
        ),
    ] {
        if was != now {
            anyhow::bail!("{} holds a sweep run with {flag} {was}, which its results depend on; this one asks for {now}: use another --out", out_dir.display());
        }
    }
    Ok(())
}

/// Identifies one measurement; a sweep skips keys already in the file.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CellKey {
    pub model: String,
    pub seed: u64,
    pub task: String,
    pub context_tokens: usize,
    pub sample: usize,
    pub policy: String,
    pub kv_budget: Option<u32>,
    pub block_size: u32,
    pub kv_dtype: String,
    pub kv_granularity: String,
    pub query_agnostic: bool,
}

impl RawResult {
    pub fn key(&self) -> CellKey {
        CellKey {
            model: self.model.clone(),
            seed: self.seed,
            task: self.task.clone(),
            context_tokens: self.context_tokens,
            sample: self.sample,
            policy: self.policy.clone(),
            kv_budget: self.kv_budget,
            block_size: self.block_size,
            kv_dtype: self.kv_dtype.clone(),
            kv_granularity: self.kv_granularity.clone(),
            query_agnostic: self.query_agnostic,
        }
    }

    /// The name summaries and plots give this configuration: the policy, with the
    /// granularity after a slash unless it is `shared` (`snapkv/head`).
    pub fn label(&self) -> String {
        match self.kv_granularity.as_str() {
            "shared" => self.policy.clone(),
            g => format!("{}/{g}", self.policy),
        }
    }
}

/// Every readable record of `path` by key (a later duplicate wins); none if it is missing.
pub fn load(path: &Path) -> Result<HashMap<CellKey, RawResult>> {
    let mut out = HashMap::new();
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e).with_context(|| format!("opening {}", path.display())),
    };
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<RawResult>(&line) {
            Ok(r) => {
                out.insert(r.key(), r);
            }
            Err(e) => tracing::warn!(
                "{}:{}: skipping an unreadable line ({e})",
                path.display(),
                i + 1
            ),
        }
    }
    Ok(out)
}

/// Appends records to a JSON-lines file, one write and flush per record.
pub struct Appender(std::fs::File);

impl Appender {
    pub fn open(path: &Path) -> Result<Appender> {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(Appender(f))
    }

    pub fn append(&mut self, r: &RawResult) -> Result<()> {
        let mut line = serde_json::to_string(r)?;
        line.push('\n');
        self.0.write_all(line.as_bytes())?;
        self.0.flush()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resumed_sweep_must_keep_the_settings_its_results_depend_on() {
        let dir = tempfile::tempdir().unwrap();
        check_manifest(dir.path(), 1, 32).unwrap();
        check_manifest(dir.path(), 1, 32).unwrap();
        let err = check_manifest(dir.path(), 3, 32).unwrap_err().to_string();
        assert!(
            err.contains("--samples 1") && err.contains("asks for 3"),
            "{err}"
        );
        let err = check_manifest(dir.path(), 1, 128).unwrap_err().to_string();
        assert!(err.contains("--continuation-tokens 32"), "{err}");
    }
}
