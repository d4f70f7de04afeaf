//! The flag walk's second half (issue 34): every entry of `flag_walk/table.rs` that can run
//! is run against the binary — a flag that changes the output must change it, a refused
//! flag must be refused by name. (The first half, a unit test in `src/flag_walk.rs`, walks
//! clap's command tree and fails for a flag that the table does not classify.)
//!
//! Runs take the default model (SmolLM2) and Gemma-3-270M, both fetched by the README's
//! test command, two at a time; about a minute on two cores.

#[path = "flag_walk/table.rs"]
mod table;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use table::{Entry, How, TABLE};

/// A command that runs longer than this has hung (the slowest entry takes a few seconds).
const TIMEOUT: Duration = Duration::from_secs(120);

struct Run {
    ok: bool,
    stdout: String,
    stderr: String,
}

/// Files the placeholders stand for, made once.
struct Fixtures {
    root: tempfile::TempDir,
    files: Vec<(&'static str, PathBuf)>,
}

impl Fixtures {
    fn new() -> Fixtures {
        let root = tempfile::tempdir().unwrap();
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut files = vec![
            (
                "{text}",
                workspace.join("tests/fixtures/around-the-world-in-80-days.txt"),
            ),
            ("{readme}", workspace.join("README.md")),
        ];
        for (name, text) in [
            ("{cfg_model}", "model = \"gemma3-270m\"\n"),
            ("{cfg_threads0}", "threads = 0\n"),
            ("{cfg_ram}", "[tiers]\nram = \"64MiB\"\n"),
            ("{cfg_chunk}", "[tiers]\nchunk_tokens = 64\n"),
        ] {
            let path = root
                .path()
                .join(&name[1..name.len() - 1])
                .with_extension("toml");
            std::fs::write(&path, text).unwrap();
            files.push((name, path));
        }
        Fixtures { root, files }
    }

    /// A fresh directory for `{dir}`.
    fn dir(&self) -> PathBuf {
        tempfile::Builder::new()
            .tempdir_in(self.root.path())
            .unwrap()
            .keep()
    }

    fn fill(&self, args: &[&str], dir: &Path) -> Vec<String> {
        args.iter()
            .map(|a| {
                let mut a = a.replace("{dir}", &dir.display().to_string());
                for (name, path) in &self.files {
                    a = a.replace(name, &path.display().to_string());
                }
                a
            })
            .collect()
    }
}

/// Runs the binary with `args`, `env` added to an environment without `PAGEKEEPER_*`
/// settings (but for where the models are), and a timeout.
fn run(args: &[String], env: &[(&str, &str)], scratch: &Path) -> Run {
    let out = tempfile::tempdir_in(scratch).unwrap();
    let (o, e) = (out.path().join("stdout"), out.path().join("stderr"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pagekeeper"));
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&o).unwrap())
        .stderr(std::fs::File::create(&e).unwrap())
        .env_remove("RUST_LOG")
        .env("RUST_BACKTRACE", "0");
    for (k, _) in std::env::vars() {
        if k.starts_with("PAGEKEEPER_") && k != "PAGEKEEPER_HOME" {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().copied());
    let mut child = cmd.spawn().unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if t0.elapsed() > TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let read = |p: &Path| String::from_utf8_lossy(&std::fs::read(p).unwrap()).into_owned();
    let mut stderr = read(&e);
    if status.is_none() {
        stderr.push_str("\n(killed: it ran past the flag walk's timeout)");
    }
    Run {
        ok: status.is_some_and(|s| s.success()),
        stdout: read(&o),
        stderr,
    }
}

/// Base runs are shared by many entries: each is run once.
struct Runner {
    fixtures: Fixtures,
    cache: Mutex<HashMap<Vec<&'static str>, std::sync::Arc<Run>>>,
}

impl Runner {
    fn run(&self, args: &[&str]) -> Run {
        let dir = self.fixtures.dir();
        run(
            &self.fixtures.fill(args, &dir),
            &[],
            self.fixtures.root.path(),
        )
    }

    fn cached(&self, args: &'static [&'static str]) -> std::sync::Arc<Run> {
        if let Some(r) = self.cache.lock().unwrap().get(args) {
            return r.clone();
        }
        let r = std::sync::Arc::new(self.run(args));
        self.cache.lock().unwrap().insert(args.to_vec(), r.clone());
        r
    }
}

fn succeeded(what: &str, args: &[&str], r: &Run) -> Result<(), String> {
    if r.ok {
        return Ok(());
    }
    Err(format!("{what} run {args:?} failed:\n{}", r.stderr.trim()))
}

/// The prompt tokens a `generate` run reused, from its timing line "(N cached)".
fn cached_tokens(r: &Run) -> Option<usize> {
    let at = r.stderr.find(" cached)")?;
    r.stderr[..at].rsplit('(').next()?.parse().ok()
}

/// Two runs of `args` in one directory: how many prompt tokens each reused.
fn reuse(runner: &Runner, args: &[&str]) -> Result<(usize, usize), String> {
    let dir = runner.fixtures.dir();
    let filled = runner.fixtures.fill(args, &dir);
    let mut reused = Vec::new();
    for _ in 0..2 {
        let r = run(&filled, &[], runner.fixtures.root.path());
        succeeded("the", args, &r)?;
        reused.push(cached_tokens(&r).ok_or(format!("no timing line:\n{}", r.stderr))?);
    }
    Ok((reused[0], reused[1]))
}

fn refused(e: &Entry, args: &[&str], r: &Run, also: &str) -> Result<(), String> {
    if r.ok {
        return Err(format!(
            "{args:?} succeeded; expected a refusal naming {}",
            e.flag
        ));
    }
    if !r.stderr.contains(e.flag) || !r.stderr.contains(also) {
        return Err(format!(
            "{args:?} failed without naming {} {also}:\n{}",
            e.flag,
            r.stderr.trim()
        ));
    }
    Ok(())
}

fn json_at(r: &Run, pointer: &str) -> Result<serde_json::Value, String> {
    let v: serde_json::Value = serde_json::from_str(r.stdout.trim())
        .map_err(|err| format!("stdout is not one JSON object ({err}): {}", r.stdout))?;
    Ok(v.pointer(pointer)
        .cloned()
        .unwrap_or(serde_json::Value::Null))
}

/// Runs one entry; `Err` says how it failed.
fn check(runner: &Runner, e: &Entry) -> Result<(), String> {
    match &e.how {
        How::Output { base, with } => {
            let (b, w) = (runner.cached(base), runner.run(with));
            succeeded("base", base, &b)?;
            succeeded("flag", with, &w)?;
            if b.stdout == w.stdout {
                return Err(format!("{with:?} printed what {base:?} did:\n{}", w.stdout));
            }
        }
        How::Json {
            base,
            with,
            pointer,
        } => {
            let (b, w) = (runner.cached(base), runner.run(with));
            succeeded("base", base, &b)?;
            succeeded("flag", with, &w)?;
            let (bv, wv) = (json_at(&b, pointer)?, json_at(&w, pointer)?);
            if bv == wv {
                return Err(format!("{pointer} is {bv} with and without: {with:?}"));
            }
        }
        How::Reuse { args, without } => {
            let (first, second) = reuse(runner, args)?;
            if first != 0 || second == 0 {
                return Err(format!("{args:?}: reused {first} then {second} tokens"));
            }
            if !without.is_empty() {
                let (_, second) = reuse(runner, without)?;
                if second != 0 {
                    return Err(format!("{without:?} reused {second} tokens too"));
                }
            }
        }
        How::Refused { args } => refused(e, args, &runner.run(args), "")?,
        How::RefusedEnv { var, value, args } => {
            let dir = runner.fixtures.dir();
            let r = run(
                &runner.fixtures.fill(args, &dir),
                &[(var, value)],
                runner.fixtures.root.path(),
            );
            refused(e, args, &r, var)?;
        }
        How::Read { args, error } => {
            let r = runner.run(args);
            if r.ok || !r.stderr.contains(error) {
                return Err(format!(
                    "{args:?}: expected an error with {error:?}; got:\n{}",
                    r.stderr.trim()
                ));
            }
        }
        How::Clap => {
            let mut args: Vec<&str> = e.command.split_whitespace().collect();
            args.push(e.flag);
            succeeded("clap", &args, &runner.run(&args))?;
        }
        How::Test { .. } | How::SameAs { .. } | How::Unchecked { .. } => {}
    }
    Ok(())
}

#[test]
fn every_flag_is_honoured_or_refused_by_name() {
    let runner = Runner {
        fixtures: Fixtures::new(),
        cache: Mutex::new(HashMap::new()),
    };
    let next = AtomicUsize::new(0);
    let (failures, times) = (Mutex::new(Vec::new()), Mutex::new(Vec::new()));
    let t0 = Instant::now();
    // Two at a time: most runs are a model load and a few tokens, bound by start-up.
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(e) = TABLE.get(i) else { break };
                let started = Instant::now();
                let result = check(&runner, e);
                let label = format!("`{}` {}", e.command, e.flag);
                times
                    .lock()
                    .unwrap()
                    .push((started.elapsed(), label.clone()));
                if let Err(why) = result {
                    failures.lock().unwrap().push(format!("{label}: {why}"));
                }
            });
        }
    });
    report(t0.elapsed(), times.into_inner().unwrap());
    let failures = failures.into_inner().unwrap();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// What the walk ran, what it took longest over, and what it leaves to other tests.
fn report(wall: Duration, mut times: Vec<(Duration, String)>) {
    eprintln!(
        "flag walk: {} entries in {:.1} s",
        TABLE.len(),
        wall.as_secs_f64()
    );
    times.sort();
    for (t, label) in times.iter().rev().take(8) {
        eprintln!("  {:>5.1} s  {label}", t.as_secs_f64());
    }
    for e in TABLE {
        match &e.how {
            How::Test { file, name } => {
                eprintln!("  elsewhere: `{}` {} by {file}: {name}", e.command, e.flag)
            }
            How::SameAs { command } => {
                eprintln!("  as for `{command}`: `{}` {}", e.command, e.flag)
            }
            How::Unchecked { why } => {
                eprintln!("  unchecked: `{}` {}: {why}", e.command, e.flag)
            }
            _ => {}
        }
    }
}
