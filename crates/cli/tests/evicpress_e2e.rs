//! `pagekeeper serve --tier-policy evicpress` end to end: a context stored after its first
//! request is loaded from the EVICPRESS store by a later one, `GET /v1/kv/contexts`
//! explains where it lives, and the server profiles it in its idle time; on Gemma-3-270M,
//! with KV cache groups, a second server reuses a context stored by the first through
//! Redis.

mod tiers_support;

use std::time::Duration;

use tiers_support::{prompt, unique_prefix, wait_until, Redis, Server, POOL_TOKENS};

fn contexts(server: &Server) -> serde_json::Value {
    reqwest::blocking::get(server.url("/v1/kv/contexts"))
        .unwrap()
        .json()
        .unwrap()
}

#[test]
fn evicpress_store_serves_explains_and_profiles_contexts() {
    let dir = tempfile::tempdir().unwrap();
    let disk = format!("{}:1GiB", dir.path().display());
    let server = Server::start(&[
        "--tier-policy",
        "evicpress",
        "--tier-ram",
        "64MiB",
        "--tier-disk",
        &disk,
        "--evicpress-grid",
        "q8,q4,paged-eviction-0.5,snapkv-0.5,kvzip-0.5",
    ]);

    // The delay model was measured at start-up, not taken from constants: the prefill
    // speed of this model here and every tier's bandwidth, each saying so.
    let delay = &contexts(&server)["delay_model"];
    assert_eq!(
        delay["provenance"]["prefill_tokens_per_s"]["source"], "calibrated",
        "{delay}"
    );
    for (i, tier) in delay["provenance"]["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        assert_eq!(tier["source"], "calibrated", "tier {i}: {delay}");
        assert!(
            delay["write_bytes_per_s"][i]
                .as_f64()
                .is_some_and(|w| w > 0.0),
            "{delay}"
        );
    }
    let calibrated_prefill = delay["model"]["prefill_tokens_per_s"].as_f64().unwrap();
    assert!(calibrated_prefill > 0.0, "{delay}");

    let context = prompt(91);
    let (prompt_tokens, cached) = server
        .complete(&format!("{context} First question?"))
        .unwrap();
    assert_eq!(cached, 0);
    wait_until("the context to be stored", Duration::from_secs(60), || {
        contexts(&server)["contexts"]
            .as_array()
            .is_some_and(|c| !c.is_empty())
    });

    // Push the context's blocks out of the small pool, so that only the store has them.
    let mut other_tokens = 0;
    for seed in 0.. {
        if other_tokens > 2 * POOL_TOKENS {
            break;
        }
        other_tokens += server.complete(&prompt(1000 + seed)).unwrap().0;
    }
    let (_, cached) = server
        .complete(&format!("{context} Second question?"))
        .unwrap();
    let stored_tokens = (prompt_tokens - 1) / 64 * 64;
    assert!(
        cached >= stored_tokens,
        "the context ({stored_tokens} tokens) must come from the store, got {cached} cached tokens"
    );

    let explained = contexts(&server);
    assert_eq!(explained["policy"], "evicpress");
    let rows = explained["contexts"].as_array().unwrap();
    let ours = rows
        .iter()
        .find(|r| r["hits"].as_u64() == Some(1))
        .expect("one context was hit once");
    let options = ours["options"].as_array().unwrap();
    assert_eq!(
        options.len(),
        2 * 6,
        "every (tier, configuration) with its utility"
    );
    assert!(options
        .windows(2)
        .all(|w| w[0]["utility"].as_f64() >= w[1]["utility"].as_f64()));
    // The server's offer carried the context's last queries, so SnapKV is an option for it
    // (an unavailable configuration would show a quality of −∞: null in JSON).
    let snapkv = options
        .iter()
        .find(|o| {
            o["config"]
                .as_str()
                .is_some_and(|c| c.starts_with("snapkv"))
        })
        .unwrap();
    assert!(
        snapkv["quality"].as_f64().is_some_and(f64::is_finite),
        "{snapkv}"
    );
    assert!(server.metrics().contains("pagekeeper:evicpress_hits_total"));
    // The idle server scores the context by KVzip's passes over its master, after which
    // its KVzip configuration is an option too. (Contexts whose passes do not fit this
    // 640-token pool beside them are counted as failed and keep KVzip unavailable.)
    let key = ours["key"].clone();
    wait_until(
        "KVzip scores in idle time",
        Duration::from_secs(120),
        || {
            contexts(&server)["contexts"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|r| r["key"] == key)
                .flat_map(|r| r["options"].as_array().unwrap().iter())
                .filter(|o| o["config"].as_str().is_some_and(|c| c.starts_with("kvzip")))
                .any(|o| o["quality"].as_f64().is_some_and(f64::is_finite))
        },
    );
    assert!(server
        .metrics()
        .contains("pagekeeper:evicpress_kvzip_scored_total"));
    // Serving updated the model: the prefills it ran and the load it served.
    let delay = &explained["delay_model"]["provenance"];
    assert_eq!(
        delay["prefill_tokens_per_s"]["source"], "observed",
        "{delay}"
    );
    // (the load's tier: the context may have moved since, so any tier will do).
    let observed = delay["tiers"].as_array().unwrap();
    assert!(
        observed.iter().any(|t| t["source"] == "observed"),
        "{delay}"
    );
    let metrics = server.metrics();
    assert!(metrics.contains("pagekeeper:evicpress_prefill_tokens_per_second"));
    assert!(metrics.contains("pagekeeper:evicpress_tier_read_bytes_per_second"));

    // The hit recorded its query; the idle server profiles the context with it.
    wait_until("background profiling", Duration::from_secs(120), || {
        contexts(&server)["contexts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["quality_source"] == "profiled")
    });
}

/// The slowest tier's size is honoured: a disk of two or three contexts' masters, offered
/// five, keeps masters within its size (and its files within the tier's slack), the store
/// having dropped whole contexts; a dropped context asked again is computed and stored
/// again.
#[test]
fn a_bounded_disk_tier_drops_whole_contexts_past_its_size() {
    let dir = tempfile::tempdir().unwrap();
    let server = small_tiers_server(dir.path(), &[]);
    let stats = || contexts(&server)["stats"].clone();
    for seed in 0..5 {
        server.complete(&prompt(500 + seed)).unwrap();
        wait_until("the context to be stored", Duration::from_secs(60), || {
            let s = stats();
            s["inserted"].as_u64().unwrap() + s["skipped_too_large"].as_u64().unwrap() > seed
        });
    }
    let s = stats();
    assert_eq!(s["skipped_too_large"], 0, "{s}");
    assert!(s["dropped"].as_u64().unwrap() >= 1, "{s}");
    let rows = contexts(&server)["contexts"].as_array().unwrap().clone();
    let listed = rows.len() as u64;
    assert_eq!(
        listed,
        s["inserted"].as_u64().unwrap() - s["dropped"].as_u64().unwrap()
    );
    // Each kept context's master (the uncompressed configuration on the disk), together
    // within the disk's size.
    let master_bytes: u64 = rows
        .iter()
        .flat_map(|r| r["options"].as_array().unwrap().iter())
        .filter(|o| o["tier"] == "disk" && o["config"].as_str().unwrap().starts_with("none"))
        .map(|o| o["bytes"].as_u64().unwrap())
        .sum();
    assert!(
        listed >= 1 && master_bytes <= DISK_BYTES,
        "{listed}: {master_bytes}"
    );
    assert!(master_bytes > 0, "masters listed");
    let file_bytes: u64 = walk_bytes(dir.path());
    assert!(file_bytes <= 2 * DISK_BYTES, "{file_bytes} bytes on disk");
    assert!(server
        .metrics()
        .contains("pagekeeper:evicpress_dropped_total"));
    // Some of the five were dropped: asked again, they are computed and stored again.
    let before = s["inserted"].as_u64().unwrap();
    for seed in 0..5 {
        server.complete(&prompt(500 + seed)).unwrap();
    }
    wait_until(
        "a dropped context stored again",
        Duration::from_secs(60),
        || stats()["inserted"].as_u64().unwrap() > before,
    );
}

/// `--evicpress-copies placed-only`: one copy per context (no masters), every tier's size
/// enforced by placement. Ten contexts that cannot all fit in a 2 MiB RAM and a 20 MiB disk
/// even at q4: some are dropped, each listed context has exactly one file on the disk or
/// none (when in RAM), and a dropped context asked again is computed and stored again.
#[test]
fn placed_only_keeps_one_copy_per_context_within_every_tier() {
    let dir = tempfile::tempdir().unwrap();
    let server = small_tiers_server(dir.path(), &["--evicpress-copies", "placed-only"]);
    let stats = || contexts(&server)["stats"].clone();
    for seed in 0..10 {
        server.complete(&prompt(700 + seed)).unwrap();
        wait_until("the context to be stored", Duration::from_secs(60), || {
            stats()["inserted"].as_u64().unwrap() > seed
        });
    }
    let s = stats();
    assert!(s["dropped"].as_u64().unwrap() >= 1, "{s}");
    let rows = contexts(&server)["contexts"].as_array().unwrap().clone();
    assert_eq!(
        rows.len() as u64,
        s["inserted"].as_u64().unwrap() - s["dropped"].as_u64().unwrap()
    );
    let placed = |tier: &str| -> u64 {
        rows.iter()
            .filter(|r| r["tier"] == tier)
            .map(|r| r["bytes"].as_u64().unwrap())
            .sum()
    };
    assert!(placed("ram") <= 2 << 20 && placed("disk") <= DISK_BYTES);
    let on_disk = rows.iter().filter(|r| r["tier"] == "disk").count();
    assert_eq!(
        count_files(dir.path()),
        on_disk,
        "no masters, no meta entries"
    );
    let before = s["inserted"].as_u64().unwrap();
    for seed in 0..10 {
        server.complete(&prompt(700 + seed)).unwrap();
    }
    wait_until(
        "a dropped context stored again",
        Duration::from_secs(60),
        || stats()["inserted"].as_u64().unwrap() > before,
    );
}

/// The disk size of the bounded-tier tests.
const DISK_BYTES: u64 = 20 << 20;

/// An EVICPRESS server over a 2 MiB RAM tier and a `DISK_BYTES` disk tier in `dir`, grid
/// q8,q4, with `extra` flags.
fn small_tiers_server(dir: &std::path::Path, extra: &[&str]) -> Server {
    let disk = format!("{}:{DISK_BYTES}", dir.display());
    let mut args = vec!["--tier-policy", "evicpress", "--tier-ram", "2MiB"];
    args.extend(["--tier-disk", &disk, "--evicpress-grid", "q8,q4"]);
    args.extend_from_slice(extra);
    Server::start(&args)
}

/// Every file under `dir`, every level, with its size in bytes.
fn files_under(dir: &std::path::Path) -> Vec<(std::path::PathBuf, u64)> {
    let mut files = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        match e.file_type().unwrap().is_dir() {
            true => files.extend(files_under(&e.path())),
            false => files.push((e.path(), e.metadata().unwrap().len())),
        }
    }
    files
}

/// Bytes of every file under `dir`.
fn walk_bytes(dir: &std::path::Path) -> u64 {
    files_under(dir).iter().map(|(_, bytes)| bytes).sum()
}

/// The disk tier's entry files (`*.kv`) under `dir`.
fn count_files(dir: &std::path::Path) -> usize {
    let is_entry = |p: &std::path::PathBuf| p.extension().is_some_and(|x| x == "kv");
    files_under(dir).iter().filter(|(p, _)| is_entry(p)).count()
}

#[test]
fn contexts_endpoint_is_404_without_evicpress() {
    let server = Server::start(&[]);
    let r = reqwest::blocking::get(server.url("/v1/kv/contexts")).unwrap();
    assert_eq!(r.status().as_u16(), 404);
    assert!(r.text().unwrap().contains("--tier-policy evicpress"));
}

/// Gemma-3-270M (sliding-window layers, KV cache groups on) on two EVICPRESS servers over
/// one Redis: A stores a context by group (`bytes_by_group` in `/v1/kv/contexts`), B, which
/// never saw it, adopts and loads it uncompressed (α makes quality dominate) and answers
/// A's greedy tokens, then profiles it in its idle time.
#[test]
fn gemma3_two_evicpress_servers_share_a_context_by_group_through_redis() {
    let gemma = tiers_support::model_dir().join("gemma-3-270m-q4_k_m.gguf");
    assert!(
        gemma.exists(),
        "{} is missing: run `pagekeeper fetch-model --name all`",
        gemma.display()
    );
    let redis = Redis::shared_or_private();
    let url = format!("{}?prefix={}", redis.url, unique_prefix("gemma3_evicpress"));
    let flags = [
        "--tier-policy",
        "evicpress",
        "--tier-ram",
        "64MiB",
        "--tier-redis",
        &url,
        "--evicpress-grid",
        "q8,q4",
        "--evicpress-alpha",
        "1000",
    ];
    let a = Server::start_model(&gemma, 4096, &flags);
    let b = Server::start_model(&gemma, 4096, &flags);
    let long: String = (0..6).map(prompt).collect::<Vec<_>>().join("\n");

    let (prompt_tokens, cached, text_a) = a.complete_text(&long, 16).unwrap();
    assert_eq!(cached, 0);
    assert!(
        prompt_tokens > 1024,
        "{prompt_tokens} tokens: past two windows"
    );
    wait_until("A's context stored", Duration::from_secs(60), || {
        contexts(&a)["contexts"]
            .as_array()
            .is_some_and(|c| !c.is_empty())
    });
    let row = contexts(&a)["contexts"][0].clone();
    let by_group = &row["bytes_by_group"];
    let (full, window) = (
        by_group["full_attention"].as_u64().unwrap(),
        by_group["sliding_window"].as_u64().unwrap(),
    );
    assert_eq!(full + window, row["bytes"].as_u64().unwrap(), "{row}");
    // 15 window layers of at most 511 positions, 3 full-attention layers of every token.
    let stored_tokens = row["n_tokens"].as_u64().unwrap();
    assert!(window < 15 * 512 * 1024 + 4096, "{row}");
    assert!(full >= 3 * stored_tokens * 1024, "{row}");

    let (_, cached, text_b) = b.complete_text(&long, 16).unwrap();
    assert_eq!(cached as u64, stored_tokens, "B reuses A's context");
    assert_eq!(
        text_b, text_a,
        "the same greedy tokens from the stored context"
    );
    assert!(b.metrics().contains("pagekeeper:evicpress_hits_total"));
    let metrics = a.metrics();
    for layers in ["full", "window"] {
        let counted = metrics.lines().any(|l| {
            l.starts_with("pagekeeper:evicpress_master_bytes_total")
                && l.contains(&format!("layers=\"{layers}\""))
        });
        assert!(counted, "{layers}: {metrics}");
    }
    wait_until("B profiles the context", Duration::from_secs(180), || {
        contexts(&b)["contexts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["quality_source"] == "profiled")
    });
}
