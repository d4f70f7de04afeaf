//! `pagekeeper bench serve`: throughput and latency percentiles of the OpenAI server at
//! several client concurrencies, measured over real HTTP with streaming responses.
//!
//! It starts `pagekeeper serve` as a child process (so the numbers include HTTP, SSE and
//! the engine thread exactly as users run them), a fresh one per concurrency level (so each
//! level's peaks are its own), then runs that many client threads, each sending streaming
//! completions back to back. Beside throughput and latency it reports what the KV pool
//! went through: the most blocks in use and sequences running at once (the server's peak
//! gauges), preemptions, and requests that failed.

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::Args;

pub(crate) use crate::bench_child::Server;

#[derive(Args)]
pub struct ServeBenchArgs {
    /// A local GGUF (default: the default model).
    #[arg(long)]
    pub model: Option<std::path::PathBuf>,
    /// Client concurrency levels.
    #[arg(long, default_value = "1,4,16,64", value_delimiter = ',')]
    pub concurrency: Vec<usize>,
    /// Requests per level (default: max(8, 2 × concurrency)).
    #[arg(long)]
    pub requests: Option<usize>,
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Prompt length in tokens: windows of the bundled book's tokens under the model's own
    /// tokenizer, sent as token-id prompts, so every prompt has exactly this many.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// The server's port; 0 lets the kernel pick a free one (for each replica with
    /// `--replicas`, which otherwise take `--port`, `--port + 1`, …).
    #[arg(long, default_value_t = 8471)]
    pub port: u16,
    #[arg(long)]
    pub threads: Option<usize>,
    #[arg(long)]
    pub json: bool,
    /// Passed to the server (`serve --max-prefill-tokens-while-decoding`); its default if unset.
    #[arg(long)]
    pub max_prefill_tokens_while_decoding: Option<usize>,
    /// Passed to the server (`serve --prefill-prune-interval-tokens`); off if unset.
    #[arg(long)]
    pub prefill_prune_interval_tokens: Option<usize>,
    /// Sent with every request (`kv_policy`), e.g. paged-eviction.
    #[arg(long)]
    pub kv_policy: Option<String>,
    /// Sent with every request (`kv_budget`, tokens kept per sequence).
    #[arg(long)]
    pub kv_budget: Option<u32>,
    /// The server's KV pool in tokens (`serve --kv-capacity-tokens`); its default if unset.
    #[arg(long)]
    pub kv_capacity_tokens: Option<usize>,
    /// The server's live KV precision (`serve --kv-dtype`); its default if unset.
    #[arg(long)]
    pub kv_dtype: Option<String>,
    /// The server's limit on running sequences.
    #[arg(long, default_value_t = 64)]
    pub max_running_seqs: usize,
    /// Replica counts to compare (e.g. 1,2,3): each level starts that many servers sharing
    /// `--tier-redis` and sends a repeated-context workload across them (see
    /// `bench_replicas.rs`). Without it, one server per concurrency level as above.
    #[arg(long, value_delimiter = ',')]
    pub replicas: Vec<usize>,
    /// The tier every replica shares (`redis://…` or `redis+cluster://…`); required with
    /// `--replicas`. Each run gets its own key prefix, so every run starts cold.
    #[arg(long)]
    pub tier_redis: Option<String>,
    /// How requests are spread over replicas: round-robin, prefix-affinity (a hash of the
    /// prompt's first 512 bytes picks the server), or both, compared.
    #[arg(long, value_delimiter = ',')]
    pub routing: Vec<String>,
    /// Distinct contexts in the replicas workload (default 6); each is requested
    /// `--rounds` times (default 3).
    #[arg(long)]
    pub contexts: Option<usize>,
    #[arg(long)]
    pub rounds: Option<usize>,
}

/// One request's timings.
pub(crate) struct Sample {
    pub ttft_s: f64,
    pub itl_s: Vec<f64>,
    pub e2e_s: f64,
    pub completion_tokens: usize,
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV was reused (pool prefix cache or a tier).
    pub cached_tokens: usize,
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

/// The body of every request: the bench's length, eviction policy and budget.
fn request_body(prompt: &serde_json::Value, a: &ServeBenchArgs) -> serde_json::Value {
    let mut body = serde_json::json!({
        "prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0, "stream": true,
        "ignore_eos": true, "stream_options": {"include_usage": true},
    });
    if let Some(p) = &a.kv_policy {
        body["kv_policy"] = serde_json::json!(p);
    }
    if let Some(b) = a.kv_budget {
        body["kv_budget"] = serde_json::json!(b);
    }
    body
}

/// Sends one streaming completion; `prompt` is text or a list of token ids.
pub(crate) fn one_request(
    http: &reqwest::blocking::Client,
    url: &str,
    prompt: &serde_json::Value,
    a: &ServeBenchArgs,
) -> Result<Sample> {
    let body = request_body(prompt, a);
    let t0 = Instant::now();
    let resp = http.post(url).json(&body).send()?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().unwrap_or_default();
        bail!("the server answered {status}: {}", error_message(&text));
    }
    let mut first = None;
    let mut last = t0;
    let mut itl = Vec::new();
    let (mut completion_tokens, mut prompt_tokens, mut cached_tokens) = (0, 0, 0);
    for line in BufReader::new(resp).lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let v: serde_json::Value = serde_json::from_str(data)?;
        if let Some(e) = v.get("error") {
            bail!("the stream ended with an error: {e}");
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0) as usize;
            prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0) as usize;
            cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0) as usize;
        }
        let has_text = v["choices"].as_array().is_some_and(|c| {
            c.iter()
                .any(|c| c["text"].as_str().is_some_and(|t| !t.is_empty()))
        });
        if has_text {
            let now = Instant::now();
            match first {
                None => first = Some(now.duration_since(t0).as_secs_f64()),
                Some(_) => itl.push(now.duration_since(last).as_secs_f64()),
            }
            last = now;
        }
    }
    Ok(Sample {
        ttft_s: first.unwrap_or(f64::NAN),
        itl_s: itl,
        e2e_s: t0.elapsed().as_secs_f64(),
        completion_tokens,
        prompt_tokens,
        cached_tokens,
    })
}

/// The message of an error response (the OpenAI body's `error.message`), else its body.
fn error_message(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| body.trim().to_string())
}

/// The flags every request is made of, refused here (named) rather than by the server on
/// every request: lengths of at least one token, and a policy and budget that go together.
pub(crate) fn check_request_flags(a: &ServeBenchArgs) -> Result<()> {
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if a.prompt_tokens == 0 {
        bail!("--prompt-tokens must be at least 1");
    }
    crate::args::KvPolicyArgs {
        kv_policy: a.kv_policy.clone(),
        kv_budget: a.kv_budget,
        kv_granularity: None,
    }
    .check_one_request()
}

/// `--concurrency` levels and `--requests` of at least one (a level of none has no figures).
pub(crate) fn check_levels(a: &ServeBenchArgs) -> Result<()> {
    if a.concurrency.is_empty() || a.concurrency.contains(&0) {
        bail!("--concurrency needs levels of at least 1");
    }
    if a.requests == Some(0) {
        bail!("--requests must be at least 1");
    }
    Ok(())
}

/// The `serve` command line for the bench's settings on `port`, `extra` flags last.
fn server_args(a: &ServeBenchArgs, port: u16, extra: &[String]) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> =
        vec!["serve".into(), "--port".into(), port.to_string().into()];
    let mut flag = |name: &str, value: std::ffi::OsString| {
        args.push(name.into());
        args.push(value);
    };
    flag("--max-running-seqs", a.max_running_seqs.to_string().into());
    if let Some(m) = &a.model {
        flag("--model", m.into());
    }
    let numbers = [
        ("--threads", a.threads),
        (
            "--max-prefill-tokens-while-decoding",
            a.max_prefill_tokens_while_decoding,
        ),
        (
            "--prefill-prune-interval-tokens",
            a.prefill_prune_interval_tokens,
        ),
        ("--kv-capacity-tokens", a.kv_capacity_tokens),
    ];
    for (name, value) in numbers {
        if let Some(n) = value {
            flag(name, n.to_string().into());
        }
    }
    if let Some(d) = &a.kv_dtype {
        flag("--kv-dtype", d.into());
    }
    args.extend(extra.iter().map(Into::into));
    args
}

/// Starts `pagekeeper serve` on `port` (0: a free port the kernel picks) with the bench's
/// settings and `extra` flags, and waits until it is healthy; a server that exits first (a
/// flag it refuses, a port taken) is an error at once, quoting its stderr.
pub(crate) fn start_server(
    a: &ServeBenchArgs,
    http: &reqwest::blocking::Client,
    port: u16,
    extra: &[String],
) -> Result<Server> {
    crate::bench_child::start(http, server_args(a, port, extra))
}

/// The bundled book in the model's own tokens (no special tokens): the prompts are windows
/// of it. An estimate from words (1.3 tokens a word, used before) made SmolLM2's prompts
/// about 1.2 times longer than asked.
fn book_token_ids(a: &ServeBenchArgs) -> Result<Vec<u32>> {
    let book = include_str!("../../../tests/fixtures/around-the-world-in-80-days.txt");
    let path = pk_engine::model_store::resolve_model(a.model.as_deref(), true)?;
    let gguf = pk_gguf::GgufFile::open(&path)?;
    let tokenizer = pk_tokenizer::Tokenizer::from_gguf(&gguf)?;
    Ok(tokenizer.encode(book, false))
}

/// The value of a metric in the Prometheus text (its first series), 0 if absent.
pub(crate) fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// `bench serve` without `--replicas` (bench.rs sends those runs to bench_replicas.rs).
pub fn run(a: ServeBenchArgs) -> Result<()> {
    if a.tier_redis.is_some() || !a.routing.is_empty() || a.contexts.is_some() || a.rounds.is_some()
    {
        bail!("--tier-redis, --routing, --contexts and --rounds belong to the replicas benchmark: add --replicas 1,2,3");
    }
    check_request_flags(&a)?;
    check_levels(&a)?;
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(1800))
        .build()?;
    let book_ids = book_token_ids(&a)?;
    if a.prompt_tokens + 1 >= book_ids.len() {
        bail!(
            "--prompt-tokens {} is longer than the bundled book ({} tokens)",
            a.prompt_tokens,
            book_ids.len()
        );
    }
    let mut levels = Vec::new();
    if !a.json {
        print_header();
    }
    for &conc in &a.concurrency {
        levels.push(run_level(&a, &http, &book_ids, conc)?);
    }
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "max_tokens": a.max_tokens, "prompt_tokens": a.prompt_tokens,
                "kv_policy": a.kv_policy, "kv_budget": a.kv_budget,
                "kv_capacity_tokens": a.kv_capacity_tokens, "kv_dtype": a.kv_dtype,
                "levels": levels,
            })
        );
    }
    Ok(())
}

fn print_header() {
    println!(
        "{:>6} {:>8} {:>12} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8} {:>7}",
        "conc",
        "requests",
        "decode t/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "E2E p50",
        "peak blk",
        "max run",
        "preempt",
        "failed"
    );
}

/// One concurrency level on a fresh server: `conc` clients send the level's requests back
/// to back. Returns the level's JSON object (and prints its row unless `--json`).
fn run_level(
    a: &ServeBenchArgs,
    http: &reqwest::blocking::Client,
    book_ids: &[u32],
    conc: usize,
) -> Result<serde_json::Value> {
    let server = start_server(a, http, a.port, &[])?;
    let base = server.base_url();
    let url = format!("{base}/v1/completions");
    let n_requests = a.requests.unwrap_or((2 * conc).max(8));
    let start = Instant::now();
    let results = send_requests(a, http, &url, book_ids, conc, n_requests);
    let wall = start.elapsed().as_secs_f64();
    let metrics = http.get(format!("{base}/metrics")).send()?.text()?;
    drop(server);
    let failed: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().err().map(|e| e.to_string()))
        .collect();
    if failed.len() == n_requests {
        bail!(
            "every request of the level at concurrency {conc} failed: {}",
            failed[0]
        );
    }
    if let Some(e) = failed.first() {
        eprintln!(
            "{} of {n_requests} requests failed; the first: {e}",
            failed.len()
        );
    }
    let samples: Vec<Sample> = results.into_iter().filter_map(Result::ok).collect();
    let level = Level::new(&samples, &metrics, conc, n_requests, wall, failed.len());
    if !a.json {
        level.print_row();
    }
    Ok(level.to_json())
}

/// Sends `n_requests` streaming completions from `conc` client threads, each taking the
/// next request as soon as its last one finished.
fn send_requests(
    a: &ServeBenchArgs,
    http: &reqwest::blocking::Client,
    url: &str,
    book_ids: &[u32],
    conc: usize,
    n_requests: usize,
) -> Vec<Result<Sample>> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..conc)
            .map(|_| {
                s.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i >= n_requests {
                            break;
                        }
                        // Distinct prompts per request and per level, so prefix caching does
                        // not flatter TTFT.
                        let n = a.prompt_tokens;
                        let at = ((i + 1000 * conc) * 997) % (book_ids.len() - n);
                        let prompt = serde_json::json!(&book_ids[at..at + n]);
                        out.push(one_request(http, url, &prompt, a));
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("client thread"))
            .collect()
    })
}

/// One level's figures: throughput, the TTFT, ITL and end-to-end latencies (sorted) of the
/// requests that succeeded, and the server's peak gauges from its `/metrics` text.
struct Level {
    conc: usize,
    n_requests: usize,
    tokens: usize,
    wall_s: f64,
    prompt_tokens_mean: f64,
    ttft_s: Vec<f64>,
    itl_s: Vec<f64>,
    e2e_s: Vec<f64>,
    peak_blocks: f64,
    kv_blocks_total: f64,
    max_running: f64,
    preemptions: f64,
    failed: usize,
}

impl Level {
    fn new(
        samples: &[Sample],
        metrics: &str,
        conc: usize,
        n_requests: usize,
        wall_s: f64,
        failed: usize,
    ) -> Level {
        let mut ttft_s: Vec<f64> = samples.iter().map(|s| s.ttft_s).collect();
        let mut itl_s: Vec<f64> = samples
            .iter()
            .flat_map(|s| s.itl_s.iter().copied())
            .collect();
        let mut e2e_s: Vec<f64> = samples.iter().map(|s| s.e2e_s).collect();
        for v in [&mut ttft_s, &mut itl_s, &mut e2e_s] {
            v.sort_by(f64::total_cmp);
        }
        Level {
            conc,
            n_requests,
            tokens: samples.iter().map(|s| s.completion_tokens).sum(),
            wall_s,
            prompt_tokens_mean: samples.iter().map(|s| s.prompt_tokens).sum::<usize>() as f64
                / samples.len().max(1) as f64,
            ttft_s,
            itl_s,
            e2e_s,
            peak_blocks: metric(metrics, "pagekeeper:kv_blocks_in_use_peak"),
            kv_blocks_total: metric(metrics, "pagekeeper:kv_pool_blocks"),
            max_running: metric(metrics, "pagekeeper:num_requests_running_peak"),
            preemptions: metric(metrics, "vllm:num_preemptions_total"),
            failed,
        }
    }

    fn to_json(&self) -> serde_json::Value {
        let (ttft, itl, e2e) = (&self.ttft_s, &self.itl_s, &self.e2e_s);
        serde_json::json!({
            "concurrency": self.conc, "requests": self.n_requests,
            "completion_tokens": self.tokens, "wall_s": self.wall_s,
            "prompt_tokens_mean": self.prompt_tokens_mean,
            "decode_tok_s": self.tokens as f64 / self.wall_s,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "itl_p50_s": percentile(itl, 0.5), "itl_p99_s": percentile(itl, 0.99),
            "e2e_p50_s": percentile(e2e, 0.5),
            "peak_kv_blocks": self.peak_blocks, "kv_blocks_total": self.kv_blocks_total,
            "preemptions": self.preemptions, "failed": self.failed,
            "max_running_seqs": self.max_running,
        })
    }

    fn print_row(&self) {
        println!(
            "{:>6} {:>8} {:>12.1} {:>9.3}s {:>9.3}s {:>9.4}s {:>9.4}s {:>9.2}s {:>10} {:>8} {:>8} {:>7}",
            self.conc,
            self.n_requests,
            self.tokens as f64 / self.wall_s,
            percentile(&self.ttft_s, 0.5),
            percentile(&self.ttft_s, 0.99),
            percentile(&self.itl_s, 0.5),
            percentile(&self.itl_s, 0.99),
            percentile(&self.e2e_s, 0.5),
            self.peak_blocks,
            self.max_running,
            self.preemptions,
            self.failed
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> ServeBenchArgs {
        crate::args::parse_flags_for_test(args)
    }

    /// Each flag that configures the servers or the requests changes the server's command
    /// line or the request body; the flag walk points here for them.
    #[test]
    fn every_server_and_request_flag_reaches_the_server_or_the_body() {
        let what = |args: &[&str]| {
            let a = parse(args);
            let body = request_body(&serde_json::json!("hi"), &a);
            format!("{:?} {body}", server_args(&a, a.port, &[]))
        };
        let base = what(&[]);
        for extra in [
            &["--model", "/m.gguf"][..],
            &["--port", "9000"],
            &["--threads", "1"],
            &["--max-prefill-tokens-while-decoding", "32"],
            &["--prefill-prune-interval-tokens", "64"],
            &["--kv-capacity-tokens", "4096"],
            &["--kv-dtype", "q8"],
            &["--max-running-seqs", "8"],
            &["--max-tokens", "8"],
            &["--kv-policy", "knorm"],
            &["--kv-budget", "64"],
        ] {
            assert_ne!(base, what(extra), "{extra:?} changed nothing");
        }
    }

    /// Zero concurrency, zero requests, zero-token lengths and a policy the server would
    /// refuse are refused before any server starts, naming the flag.
    #[test]
    fn refuses_flags_that_make_no_figures_naming_them() {
        let err = |args: &[&str]| {
            let a = parse(args);
            check_request_flags(&a)
                .and_then(|()| check_levels(&a))
                .unwrap_err()
                .to_string()
        };
        for (args, flag) in [
            (&["--concurrency", "0"][..], "--concurrency"),
            (&["--concurrency", "1,0"], "--concurrency"),
            (&["--requests", "0"], "--requests"),
            (&["--max-tokens", "0"], "--max-tokens"),
            (&["--prompt-tokens", "0"], "--prompt-tokens"),
            (&["--kv-policy", "bogus"], "--kv-policy"),
            (&["--kv-policy", "knorm"], "--kv-budget"),
        ] {
            let e = err(args);
            assert!(e.contains(flag), "{args:?}: {e}");
        }
        let ok = parse(&[
            "--kv-policy",
            "knorm",
            "--kv-budget",
            "64",
            "--requests",
            "1",
        ]);
        check_request_flags(&ok).unwrap();
        check_levels(&ok).unwrap();
    }

    /// A refused request's error is the body's `error.message`, else the body itself.
    #[test]
    fn error_message_is_the_bodys() {
        let body =
            r#"{"error":{"message":"unknown kv_policy \"bogus\"","type":"invalid_request_error"}}"#;
        assert_eq!(error_message(body), "unknown kv_policy \"bogus\"");
        assert_eq!(error_message(" not json \n"), "not json");
    }
}
