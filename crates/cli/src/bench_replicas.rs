//! `pagekeeper bench serve --replicas 1,2,3 --tier-redis URL`: several servers sharing KV
//! through one Redis (or Redis Cluster) tier, under a repeated-context workload, with two ways
//! of spreading requests over them.
//!
//! The workload: `--contexts` distinct contexts of about `--prompt-tokens` tokens (slices of
//! the bundled book), each asked `--rounds` times with a different question after it, round
//! by round (every context once, then again). A load balancer in front of replicas either
//! spreads requests round-robin or routes by prefix affinity: a hash of the prompt's first
//! 512 bytes picks the server, so a context always lands where its KV already is.
//!
//! Each request is classed when it is sent: `cold` (no earlier request for its context has
//! finished: it recomputes), `other` (one finished on another server only: its KV can come
//! from the shared tier), `same` (one finished on this server: the pool's prefix cache or the
//! tier). The report gives TTFT per class, the hit rate (cached prompt tokens / prompt tokens,
//! from each response's `usage`) and the tier hits of all servers. Every run uses its own key
//! prefix, so each starts with an empty tier.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use crate::bench_serve::{one_request, percentile, start_server, Sample, ServeBenchArgs};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Class {
    Cold,
    Other,
    Same,
}

/// Which servers have finished a request for each context.
#[derive(Default)]
struct Seen {
    finished_on: HashMap<usize, Vec<usize>>,
}

impl Seen {
    fn class(&self, context: usize, server: usize) -> Class {
        match self.finished_on.get(&context) {
            None => Class::Cold,
            Some(servers) if servers.contains(&server) => Class::Same,
            Some(_) => Class::Other,
        }
    }
}

/// FNV-1a: stable across runs and processes, unlike std's randomly seeded hasher.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn sum_series(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{') && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn p50(samples: &[(Class, Sample)], class: Option<Class>) -> f64 {
    let mut v: Vec<f64> = samples
        .iter()
        .filter(|(c, _)| class.is_none_or(|want| *c == want))
        .map(|(_, s)| s.ttft_s)
        .collect();
    v.sort_by(f64::total_cmp);
    percentile(&v, 0.5)
}

/// One configuration: how many servers, how requests reach them, how many clients.
struct Setup<'a> {
    n_servers: usize,
    routing: &'a str,
    concurrency: usize,
}

pub fn run(a: ServeBenchArgs) -> Result<()> {
    let Some(tier_url) = a.tier_redis.clone() else {
        bail!("--replicas needs --tier-redis URL: the tier the replicas share");
    };
    let routings: Vec<String> = if a.routing.is_empty() {
        vec!["round-robin".into(), "prefix-affinity".into()]
    } else {
        a.routing.clone()
    };
    if let Some(r) = routings
        .iter()
        .find(|r| !matches!(r.as_str(), "round-robin" | "prefix-affinity"))
    {
        bail!("--routing {r}: expected round-robin or prefix-affinity");
    }
    if a.replicas.iter().any(|&n| n == 0 || n > 16) {
        bail!("--replicas: each count must be in 1..=16");
    }
    if a.requests.is_some() {
        bail!("--requests does not apply with --replicas: the workload is --contexts × --rounds requests");
    }
    crate::bench_serve::check_request_flags(&a)?;
    crate::bench_serve::check_levels(&a)?;
    let (contexts, rounds) = (a.contexts.unwrap_or(6), a.rounds.unwrap_or(3));
    if contexts == 0 || rounds == 0 {
        bail!("--contexts and --rounds must be positive");
    }
    let requests = workload(&a, contexts, rounds)?;
    if !a.json {
        print_header();
    }
    let mut runs = Vec::new();
    for &concurrency in &a.concurrency {
        for &n_servers in &a.replicas {
            for routing in &routings {
                let setup = Setup {
                    n_servers,
                    routing,
                    concurrency,
                };
                let run = run_one(&a, &tier_url, &setup, &requests)?;
                if !a.json {
                    print_row(&run);
                }
                runs.push(run);
            }
        }
    }
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens,
                "contexts": contexts, "rounds": rounds, "tier_redis": tier_url,
                "runs": runs,
            })
        );
    }
    Ok(())
}

/// `(context, prompt)` pairs, round by round: every context once, then again with the next
/// question.
fn workload(a: &ServeBenchArgs, contexts: usize, rounds: usize) -> Result<Vec<(usize, String)>> {
    let book = include_str!("../../../tests/fixtures/around-the-world-in-80-days.txt");
    let words: Vec<&str> = book.split_whitespace().collect();
    // About 1.3 tokens per word in this text.
    let context_words = (a.prompt_tokens as f64 / 1.3) as usize;
    if context_words * contexts >= words.len() {
        bail!(
            "--contexts {contexts} of --prompt-tokens {} do not fit in the bundled book",
            a.prompt_tokens
        );
    }
    let contexts: Vec<String> = (0..contexts)
        .map(|c| words[c * context_words..(c + 1) * context_words].join(" "))
        .collect();
    Ok((0..rounds)
        .flat_map(|round| {
            contexts.iter().enumerate().map(move |(c, text)| {
                let prompt = format!(
                    "{text}\n\nQuestion {round}: in one sentence, what happens in this passage?"
                );
                (c, prompt)
            })
        })
        .collect())
}

/// Starts the servers (each run under its own key prefix, so it starts cold), sends the
/// workload, reads every server's tier hits, and summarises.
fn run_one(
    a: &ServeBenchArgs,
    tier_url: &str,
    setup: &Setup,
    requests: &[(usize, String)],
) -> Result<serde_json::Value> {
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(1800))
        .build()?;
    let prefix = format!(
        "pk:bench-replicas:{}:{}:{}:{}:",
        std::process::id(),
        setup.concurrency,
        setup.n_servers,
        setup.routing
    );
    let sep = if tier_url.contains('?') { '&' } else { '?' };
    let extra = vec![
        "--tier-redis".to_owned(),
        format!("{tier_url}{sep}prefix={prefix}"),
    ];
    let servers = (0..setup.n_servers)
        .map(|k| start_server(a, &http, replica_port(a.port, k)?, &extra))
        .collect::<Result<Vec<_>>>()?;
    let ports: Vec<u16> = servers.iter().map(|s| s.port).collect();
    let started = Instant::now();
    let results = send_all(a, &http, setup, &ports, requests);
    let wall_s = started.elapsed().as_secs_f64();
    let mut tier_hits = 0.0;
    for server in &servers {
        let text = http
            .get(format!("{}/metrics", server.base_url()))
            .send()?
            .text()?;
        tier_hits += sum_series(&text, "pagekeeper:tier_hits_total", "tier=\"redis\"");
    }
    drop(servers);
    let failed: Vec<String> = results
        .iter()
        .filter_map(|(_, r)| r.as_ref().err().map(|e| e.to_string()))
        .collect();
    if let Some(e) = failed.first() {
        eprintln!("{} requests failed; the first: {e}", failed.len());
    }
    let samples: Vec<(Class, Sample)> = results
        .into_iter()
        .filter_map(|(c, r)| r.ok().map(|s| (c, s)))
        .collect();
    let count = |c: Class| samples.iter().filter(|(k, _)| *k == c).count();
    let prompt_tokens: usize = samples.iter().map(|(_, s)| s.prompt_tokens).sum();
    let cached_tokens: usize = samples.iter().map(|(_, s)| s.cached_tokens).sum();
    let (cold, other) = (
        p50(&samples, Some(Class::Cold)),
        p50(&samples, Some(Class::Other)),
    );
    Ok(serde_json::json!({
        "replicas": setup.n_servers, "routing": setup.routing, "concurrency": setup.concurrency,
        "requests": requests.len(), "failed": failed.len(), "wall_s": wall_s,
        "hit_rate": cached_tokens as f64 / prompt_tokens.max(1) as f64,
        "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
        "ttft_p50_s": p50(&samples, None),
        "ttft_cold_p50_s": cold, "ttft_other_p50_s": other,
        "ttft_same_p50_s": p50(&samples, Some(Class::Same)),
        "n_cold": count(Class::Cold), "n_other": count(Class::Other), "n_same": count(Class::Same),
        "cold_over_other": cold / other, "tier_hits": tier_hits,
    }))
}

/// Replica `k`'s port: `base + k`, or 0 (a port the kernel picks) for each when `base` is 0.
fn replica_port(base: u16, k: usize) -> Result<u16> {
    if base == 0 {
        return Ok(0);
    }
    match u16::try_from(k).ok().and_then(|k| base.checked_add(k)) {
        Some(port) => Ok(port),
        None => bail!("--port {base} leaves no port for replica {k}; use --port 0"),
    }
}

/// The clients: each takes the next request, routes it, classes it when sent (module doc)
/// and records which server finished it.
fn send_all(
    a: &ServeBenchArgs,
    http: &reqwest::blocking::Client,
    setup: &Setup,
    ports: &[u16],
    requests: &[(usize, String)],
) -> Vec<(Class, Result<Sample>)> {
    let seen = Mutex::new(Seen::default());
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..setup.concurrency)
            .map(|_| {
                s.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some((context, prompt)) = requests.get(i) else {
                            break;
                        };
                        let server = route(setup, i, prompt);
                        let class = seen.lock().unwrap().class(*context, server);
                        let url = format!("http://127.0.0.1:{}/v1/completions", ports[server]);
                        let result = one_request(http, &url, &serde_json::json!(prompt), a);
                        if result.is_ok() {
                            let mut seen = seen.lock().unwrap();
                            seen.finished_on.entry(*context).or_default().push(server);
                        }
                        out.push((class, result));
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

/// Round-robin by request index, or prefix affinity: a hash of the prompt's first 512 bytes.
fn route(setup: &Setup, index: usize, prompt: &str) -> usize {
    match setup.routing {
        "round-robin" => index % setup.n_servers,
        _ => {
            let head = &prompt.as_bytes()[..prompt.len().min(512)];
            (fnv1a(head) % setup.n_servers as u64) as usize
        }
    }
}

fn print_header() {
    println!(
        "{:>8} {:>16} {:>5} {:>8} {:>7} {:>9} {:>10} {:>14} {:>14} {:>14} {:>9} {:>7}",
        "replicas",
        "routing",
        "conc",
        "requests",
        "failed",
        "hit rate",
        "TTFT p50",
        "cold p50 (n)",
        "other p50 (n)",
        "same p50 (n)",
        "cold/oth",
        "t. hits"
    );
}

fn print_row(r: &serde_json::Value) {
    let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    let n = |k: &str| r[k].as_u64().unwrap_or(0);
    println!(
        "{:>8} {:>16} {:>5} {:>8} {:>7} {:>8.1}% {:>9.3}s {:>9.3}s ({:>2}) {:>9.3}s ({:>2}) {:>9.3}s ({:>2}) {:>8.1}x {:>7}",
        n("replicas"),
        r["routing"].as_str().unwrap_or(""),
        n("concurrency"),
        n("requests"),
        n("failed"),
        100.0 * f("hit_rate"),
        f("ttft_p50_s"),
        f("ttft_cold_p50_s"),
        n("n_cold"),
        f("ttft_other_p50_s"),
        n("n_other"),
        f("ttft_same_p50_s"),
        n("n_same"),
        f("cold_over_other"),
        f("tier_hits")
    );
}
