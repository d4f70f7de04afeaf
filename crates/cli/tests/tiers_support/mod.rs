//! Helpers for the tier end-to-end tests: a `pagekeeper serve` child process, HTTP calls,
//! Prometheus counters, prompts, and a real `redis-server`.
//!
//! Which Redis a test gets follows `crates/tiers/tests/common` (no silent skips):
//! `PAGEKEEPER_TEST_REDIS` set (CI): that server, and the test FAILS if it is unreachable;
//! unset: a private `redis-server` from PATH on a free loopback port, and the test FAILS if
//! the binary is missing. Tests that stop Redis always use a private one.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Tokens per stored chunk in these tests: small, so a prompt of a few hundred tokens makes
/// several chunks (and several files to crash in the middle of).
pub const CHUNK_TOKENS: usize = 64;
/// KV pool of each test server: room for two of `prompt`'s prompts, so that cycling through
/// four of them evicts each from the pool before it comes back (its next hit must come from
/// a tier, not the pool's prefix cache).
pub const POOL_TOKENS: usize = 640;

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Where `fetch-model` puts the models.
pub fn model_dir() -> PathBuf {
    std::env::var_os("PAGEKEEPER_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/pagekeeper"))
}

pub fn model_path() -> PathBuf {
    let p = model_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run `pagekeeper fetch-model` first",
        p.display()
    );
    p
}

/// Talks to a server; cheap to clone into client threads.
#[derive(Clone)]
pub struct Api {
    pub port: u16,
    client: reqwest::blocking::Client,
}

impl Api {
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// A completion of one token; returns (prompt_tokens, cached_tokens), or the failure.
    pub fn complete(&self, prompt: &str) -> Result<(usize, usize), String> {
        self.complete_text(prompt, 1).map(|(p, c, _)| (p, c))
    }

    /// A greedy completion of `max_tokens` (EOS ignored); returns (prompt_tokens,
    /// cached_tokens, text), or the failure.
    pub fn complete_text(
        &self,
        prompt: &str,
        max_tokens: usize,
    ) -> Result<(usize, usize, String), String> {
        let body = serde_json::json!({
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": true,
        });
        let response = self
            .client
            .post(self.url("/v1/completions"))
            .json(&body)
            .send()
            .map_err(|e| e.to_string())?;
        let status = response.status();
        let text = response.text().map_err(|e| e.to_string())?;
        if !status.is_success() {
            return Err(format!("HTTP {status}: {text}"));
        }
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{e}: {text}"))?;
        let usage = &v["usage"];
        let prompt_tokens = usage["prompt_tokens"]
            .as_u64()
            .ok_or_else(|| format!("no usage: {text}"))? as usize;
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0) as usize;
        let text = v["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        Ok((prompt_tokens, cached, text))
    }

    pub fn metrics(&self) -> String {
        self.client
            .get(self.url("/metrics"))
            .send()
            .unwrap()
            .text()
            .unwrap()
    }

    /// A tier metric (e.g. `pagekeeper:tier_hits_total`) for `tier`; 0 until first counted.
    pub fn tier_metric(&self, name: &str, tier: &str) -> f64 {
        tier_counter(&self.metrics(), name, tier)
    }
}

/// `pagekeeper serve` on a free port, killed (SIGKILL) when dropped.
pub struct Server {
    pub api: Api,
    child: Option<Child>,
}

impl std::ops::Deref for Server {
    type Target = Api;
    fn deref(&self) -> &Api {
        &self.api
    }
}

impl Server {
    /// Starts the server with the test model, 2 threads, a KV pool of `POOL_TOKENS`,
    /// `CHUNK_TOKENS`-token chunks and `extra` flags (the tiers); waits for `/health` 200.
    pub fn start(extra: &[&str]) -> Server {
        Server::start_model(&model_path(), POOL_TOKENS, extra)
    }

    /// As `start`, with another model and pool size (`--max-model-len` too). A port found
    /// free can be taken before the server binds it (by another test's server, or as the
    /// local port of an outgoing connection), so a server that exits during start-up is
    /// started again on another port, three times at most.
    pub fn start_model(model: &std::path::Path, pool_tokens: usize, extra: &[&str]) -> Server {
        for attempt in 1.. {
            match Server::try_start(model, pool_tokens, extra) {
                Ok(server) => return server,
                Err(status) if attempt < 3 => {
                    eprintln!("pagekeeper serve exited during start-up ({status}); another port")
                }
                Err(status) => panic!("pagekeeper serve exited during start-up: {status}"),
            }
        }
        unreachable!()
    }

    fn try_start(
        model: &std::path::Path,
        pool_tokens: usize,
        extra: &[&str],
    ) -> Result<Server, std::process::ExitStatus> {
        let port = free_port();
        let pool = pool_tokens.to_string();
        // The chunk size applies where a tier stores chunks; serve refuses it without one.
        let has_tier = extra
            .iter()
            .any(|a| matches!(*a, "--tier-ram" | "--tier-disk" | "--tier-redis"));
        let chunk: &[String] = if has_tier {
            &["--tier-chunk-tokens".into(), CHUNK_TOKENS.to_string()]
        } else {
            &[]
        };
        let child = Command::new(env!("CARGO_BIN_EXE_pagekeeper"))
            .args([
                "serve",
                "--port",
                &port.to_string(),
                "--threads",
                "2",
                "--kv-capacity-tokens",
                &pool,
                "--max-model-len",
                &pool,
            ])
            .args(chunk)
            .args(extra)
            .arg("--model")
            .arg(model)
            // The outage test makes the tiers warn on every request; keep the test log short
            // unless the caller asks for more.
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "error".into()),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting pagekeeper serve");
        let client = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(120))
            .build()
            .unwrap();
        let mut server = Server {
            api: Api { port, client },
            child: Some(child),
        };
        let started = Instant::now();
        loop {
            if let Ok(r) = server.api.client.get(server.url("/health")).send() {
                if r.status().as_u16() == 200 {
                    break;
                }
            }
            if let Some(status) = server.child.as_mut().unwrap().try_wait().unwrap() {
                server.child = None;
                return Err(status);
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "server did not become healthy"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(server)
    }

    /// SIGKILL: no drain, no clean shutdown.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill9();
    }
}

pub fn tier_counter(metrics: &str, name: &str, tier: &str) -> f64 {
    let label = format!("tier=\"{tier}\"");
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{') && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Distinct prompts of about 280 tokens: words from a fixed list in an order set by `seed`,
/// so no two prompts share a first chunk.
pub fn prompt(seed: u64) -> String {
    const WORDS: &[&str] = &[
        "river", "lantern", "copper", "meadow", "signal", "harbor", "violet", "engine", "saddle",
        "quartz", "marble", "falcon", "timber", "canyon", "velvet", "orchard", "pepper", "glacier",
        "tunnel", "ember", "compass", "willow", "anchor", "cobalt", "thistle", "beacon",
    ];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = format!("Record {seed}:");
    for _ in 0..250 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push(' ');
        out.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
    }
    out
}

/// Full chunks the engine stores for a prompt of `prompt_tokens` (its last token is always
/// recomputed, so it never counts).
pub fn stored_chunks(prompt_tokens: usize) -> usize {
    (prompt_tokens - 1) / CHUNK_TOKENS
}

pub fn wait_until(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(
            started.elapsed() < within,
            "timed out after {within:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A unique Redis key prefix per test run, so runs against a shared server never meet.
pub fn unique_prefix(test: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("pke2e:{test}:{}:{nanos}:", std::process::id())
}

// The Redis server harness of the tier crate's tests, compiled here too.
#[path = "../../../tiers/tests/common/redis_server.rs"]
mod redis_server;

#[allow(unused_imports)]
pub use redis_server::{RedisServer as Redis, REDIS_ENV};

impl Redis {
    /// Committed (visible) entries under `prefix`.
    pub fn entries(&self, prefix: &str) -> usize {
        let mut conn = redis::Client::open(self.url.as_str())
            .unwrap()
            .get_connection_with_timeout(Duration::from_secs(2))
            .unwrap();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}m:*"))
            .query(&mut conn)
            .unwrap();
        keys.len()
    }
}
