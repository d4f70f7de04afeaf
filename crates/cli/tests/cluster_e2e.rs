//! Replicas sharing KV through a Redis Cluster, end to end: two `pagekeeper serve` processes
//! with `--tier-redis redis+cluster://…` on a real cluster of three masters and three
//! replicas (started here, `crates/tiers/tests/common/cluster.rs`):
//! - a prompt prefilled on server A is a tier hit on server B, which never saw it;
//! - a master killed: every request to either server still answers (misses and recomputes);
//!   after the replica takes over, a prompt stored by A hits on B again;
//! - every metric the example Grafana dashboard (`examples/grafana`) plots is one the server
//!   exports.

#[path = "../../tiers/tests/common/cluster.rs"]
mod cluster;
mod tiers_support;

use std::time::{Duration, Instant};

use cluster::RedisCluster;
use tiers_support::{prompt, stored_chunks, unique_prefix, wait_until, Server, CHUNK_TOKENS};

const HITS: &str = "pagekeeper:tier_hits_total";

#[test]
fn two_servers_share_a_redis_cluster_through_a_master_failover() {
    let started = Instant::now();
    let mut cluster = RedisCluster::start();
    let prefix = unique_prefix("cluster");
    let url = format!("{}?prefix={prefix}", cluster.url());
    let a = Server::start(&["--tier-redis", &url]);
    let b = Server::start(&["--tier-redis", &url]);

    // Prefilled on A (a miss), written through to the cluster, then a hit on B.
    let (prompt_tokens, cached) = a.complete(&prompt(3000)).unwrap();
    assert_eq!(cached, 0);
    let chunks = stored_chunks(prompt_tokens);
    assert!(chunks >= 3, "{prompt_tokens} tokens");
    wait_until("A's chunks in the cluster", Duration::from_secs(30), || {
        cluster.entries(&prefix) == chunks
    });
    let (_, cached) = b.complete(&prompt(3000)).unwrap();
    assert_eq!(cached, chunks * CHUNK_TOKENS, "B reuses A's context");
    assert_eq!(b.tier_metric(HITS, "redis") as usize, chunks);

    // A master dies: every request still answers.
    let killed = cluster.kill_a_master();
    let mut answered = 0;
    for i in 0..4 {
        for server in [&a, &b] {
            server
                .complete(&prompt(3100 + i))
                .unwrap_or_else(|e| panic!("request failed with master {killed} down: {e}"));
            answered += 1;
        }
    }
    cluster.wait_failover(Duration::from_secs(30));
    let failover_s = started.elapsed().as_secs_f64();

    // After the failover: a new prompt stored by A is a hit on B. The first tries may find
    // the tier's connection still on the old slot map (a miss, then a reconnect).
    let hits_before = b.tier_metric(HITS, "redis");
    let mut resumed = None;
    for i in 0..20 {
        let p = prompt(3200 + i);
        let (prompt_tokens, _) = a.complete(&p).unwrap();
        let want = stored_chunks(prompt_tokens);
        let before = cluster.entries(&prefix);
        let deadline = Instant::now() + Duration::from_secs(5);
        while cluster.entries(&prefix) < before + want && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let (_, cached) = b.complete(&p).unwrap();
        if cached == want * CHUNK_TOKENS {
            resumed = Some(i);
            break;
        }
    }
    let tries = resumed.expect("no hit on B for a prompt A stored after the failover");
    dashboard_metrics_are_exported(&b);
    assert!(b.tier_metric(HITS, "redis") > hits_before);
    eprintln!(
        "cluster: {answered} requests answered with master {killed} down; failover done at {failover_s:.1} s; hits resumed on try {}; {:.1} s in all",
        tries + 1,
        started.elapsed().as_secs_f64()
    );
}

/// Metric names in the example dashboard's queries (`vllm:…`, `pagekeeper:…`), each found
/// in the server's `/metrics` after an evicting request.
fn dashboard_metrics_are_exported(server: &Server) {
    let body = serde_json::json!({
        "prompt": prompt(4000), "max_tokens": 24, "temperature": 0.0,
        "kv_policy": "paged-eviction", "kv_budget": 64,
    });
    let response = reqwest::blocking::Client::new()
        .post(server.url("/v1/completions"))
        .json(&body)
        .send()
        .unwrap();
    assert_eq!(
        response.status().as_u16(),
        200,
        "{}",
        response.text().unwrap()
    );
    let dashboard = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/grafana/pagekeeper-dashboard.json"
    ))
    .unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&dashboard).unwrap();
    let mut names = std::collections::BTreeSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            for start in ["vllm:", "pagekeeper:"] {
                for (at, _) in expr.match_indices(start) {
                    let name: String = expr[at..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                        .collect();
                    names.insert(name);
                }
            }
        }
    }
    assert!(names.len() >= 15, "{names:?}");
    let metrics = server.metrics();
    let missing: Vec<&String> = names
        .iter()
        .filter(|name| {
            !metrics
                .lines()
                .any(|l| l.starts_with(name.as_str()) && l[name.len()..].starts_with(['{', ' ']))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "the dashboard plots metrics the server does not export: {missing:?}"
    );
}

/// The EVICPRESS store with a Redis Cluster as its last (only) tier: a context stored after
/// its first request comes back from the cluster once the pool has dropped it, on the same
/// server and on another one sharing the cluster.
#[test]
fn evicpress_store_on_a_redis_cluster() {
    let cluster = RedisCluster::start();
    let prefix = unique_prefix("cluster_evicpress");
    let url = format!("{}?prefix={prefix}", cluster.url());
    let flags = ["--tier-policy", "evicpress", "--tier-redis", &url];
    let a = Server::start(&flags);
    let context = prompt(5000);
    let (prompt_tokens, cached) = a.complete(&format!("{context} First question?")).unwrap();
    assert_eq!(cached, 0);
    wait_until(
        "the context in the cluster",
        Duration::from_secs(60),
        || cluster.entries(&prefix) > 0,
    );
    // Push the context's blocks out of the small pool, so that only the store has them.
    let mut other_tokens = 0;
    for seed in 0.. {
        if other_tokens > 2 * tiers_support::POOL_TOKENS {
            break;
        }
        other_tokens += a.complete(&prompt(6000 + seed)).unwrap().0;
    }
    let stored_tokens = (prompt_tokens - 1) / CHUNK_TOKENS * CHUNK_TOKENS;
    let (_, cached) = a.complete(&format!("{context} Second question?")).unwrap();
    assert!(
        cached >= stored_tokens,
        "the context ({stored_tokens} tokens) must come from the cluster, got {cached} cached"
    );
    let b = Server::start(&flags);
    let (_, cached) = b.complete(&format!("{context} Third question?")).unwrap();
    assert!(
        cached >= stored_tokens,
        "another server reads the context from the cluster: {cached} of {stored_tokens} cached"
    );
}
