//! The tiers end to end, through the real `pagekeeper serve` binary and the default model:
//! - a disk tier survives `kill -9` in the middle of a write: after a restart on the same
//!   directory every entry is either intact and served or detected and dropped, and prefixes
//!   stored before the crash are hits;
//! - two servers sharing one Redis: a context prefilled on server A is a hit on server B;
//! - Redis killed mid-run: no request fails, and hits resume once it is back.
//!
//! Hits are read from each server's `/metrics` tier counters (label `tier`). Helpers and the
//! Redis convention (CI's server, else a private one; never a silent skip) are in
//! `tiers_support`.

mod tiers_support;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use pk_tiers::{DiskTier, DiskTierConfig, Tier};
use tiers_support::{
    prompt, stored_chunks, unique_prefix, wait_until, Redis, Server, CHUNK_TOKENS,
};

const HITS: &str = "pagekeeper:tier_hits_total";

/// Files in a disk tier directory: (entries, temporary files of unfinished writes).
fn count_files(dir: &Path) -> (usize, usize) {
    let (mut entries, mut temps) = (0, 0);
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        entries += name.ends_with(".kv") as usize;
        temps += name.ends_with(".tmp") as usize;
    }
    (entries, temps)
}

/// Opens a copy of the directory with the tier itself and loads every entry: returns
/// (intact, detected as corrupt at scan or load). Checks the crash left nothing in between.
fn verify_copy(dir: &Path, scratch: &Path) -> (usize, usize) {
    std::fs::create_dir_all(scratch).unwrap();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        std::fs::copy(e.path(), scratch.join(e.file_name())).unwrap();
    }
    let tier = DiskTier::open(DiskTierConfig::new(scratch, 1 << 30)).unwrap();
    let mut intact = 0;
    for key in tier.keys_lru_first() {
        intact += tier.load(&key).unwrap().is_some() as usize;
    }
    (intact, tier.corrupt_entries() as usize)
}

#[test]
fn disk_tier_survives_kill_9_mid_write() {
    let started = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("kv");
    let disk_flag = format!("{}:1GiB", dir.display());
    let mut server = Server::start(&["--tier-disk", &disk_flag]);

    // One client sends distinct prompts in order, so the single tier writer stores their
    // chunks in that order: each prompt's files on disk are a prefix of its chunks.
    let sent = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let client = {
        let (api, sent, stop) = (server.api.clone(), sent.clone(), stop.clone());
        std::thread::spawn(move || {
            for i in 0..60 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                sent.store(i + 1, Ordering::SeqCst);
                let _ = api.complete(&prompt(i as u64)); // fails once the server is killed
            }
        })
    };
    // Kill as soon as a write is in progress (a temporary file exists) once a few prompts'
    // worth of entries are down; if no write is ever caught, kill anyway at 24 entries.
    let mut caught_mid_write = false;
    wait_until(
        "entries on disk to kill the server",
        Duration::from_secs(240),
        || {
            let (entries, temps) = count_files(&dir);
            caught_mid_write = entries >= 8 && temps > 0;
            caught_mid_write || entries >= 24
        },
    );
    server.kill9();
    stop.store(true, Ordering::Relaxed);
    client.join().unwrap();
    let sent = sent.load(Ordering::SeqCst);
    let (entries, temps) = count_files(&dir);

    // Independently of the server: every file is intact or detected, nothing in between.
    let (intact, detected) = verify_copy(&dir, &tmp.path().join("verify"));
    assert_eq!(
        intact + detected,
        entries,
        "every entry is intact or detected"
    );
    assert!(intact >= 8, "{intact} intact entries");

    // A kill -9 cannot tear a renamed entry (the rename comes after the fsync), but a power
    // cut can: truncate the newest entry (the last chunk written, the tail of its prompt's
    // stored prefix) as such a torn write would leave it.
    let newest = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".kv"))
        .max_by_key(|e| {
            e.metadata()
                .unwrap()
                .modified()
                .unwrap_or(SystemTime::UNIX_EPOCH)
        })
        .unwrap();
    let len = newest.metadata().unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(newest.path())
        .unwrap()
        .set_len(len / 2)
        .unwrap();

    let server = Server::start(&["--tier-disk", &disk_flag]);
    let metrics = server.metrics();
    let gauge = |name: &str| tiers_support::tier_counter(&metrics, name, "disk") as usize;
    let expected_intact = intact - 1;
    assert_eq!(
        gauge("pagekeeper:tier_entries_found_on_open"),
        expected_intact,
        "entries kept by the restart scan"
    );
    assert_eq!(
        gauge("pagekeeper:tier_corrupt_entries_total"),
        detected + 1,
        "the torn entry is detected and dropped"
    );
    assert_eq!(
        gauge("pagekeeper:tier_temp_files_removed_total"),
        temps,
        "unfinished writes are removed"
    );
    assert_eq!(count_files(&dir), (expected_intact, 0));

    // Every prompt that may have reached the server, again: each intact entry is one chunk
    // hit (prefixes are contiguous on disk), and nothing fails.
    let mut cached_tokens = 0;
    for i in 0..sent {
        let (_, cached) = server.complete(&prompt(i as u64)).unwrap();
        cached_tokens += cached;
    }
    let hits = server.tier_metric(HITS, "disk") as usize;
    assert_eq!(hits, expected_intact, "chunk hits after the restart");
    assert_eq!(cached_tokens, expected_intact * CHUNK_TOKENS);
    eprintln!(
        "crash test: {sent} prompts sent, killed {} a write; {entries} entries and {temps} temporary files on disk; \
         {intact} intact, {detected} torn by the kill, 1 torn on purpose; {hits} chunk hits after restart ({cached_tokens} tokens); {:.1} s",
        if caught_mid_write { "during" } else { "between" },
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn two_servers_share_one_redis() {
    let redis = Redis::shared_or_private();
    let prefix = unique_prefix("two_servers");
    let url = format!("{}?prefix={prefix}", redis.url);
    let a = Server::start(&["--tier-redis", &url]);
    let b = Server::start(&["--tier-redis", &url]);

    // Prefilled on A (a miss there), written through to Redis...
    let (prompt_tokens, cached) = a.complete(&prompt(1000)).unwrap();
    assert_eq!(cached, 0);
    let chunks = stored_chunks(prompt_tokens);
    assert!(chunks >= 3, "{prompt_tokens} tokens");
    wait_until("A's chunks in Redis", Duration::from_secs(30), || {
        redis.entries(&prefix) == chunks
    });
    // ...and a hit on B, which never saw it.
    let (_, cached) = b.complete(&prompt(1000)).unwrap();
    assert_eq!(cached, chunks * CHUNK_TOKENS, "B reuses A's context");
    assert_eq!(b.tier_metric(HITS, "redis") as usize, chunks);
    assert_eq!(a.tier_metric(HITS, "redis"), 0.0);

    // And the other way round.
    let (prompt_tokens, _) = b.complete(&prompt(1001)).unwrap();
    wait_until("B's chunks in Redis", Duration::from_secs(30), || {
        redis.entries(&prefix) == chunks + stored_chunks(prompt_tokens)
    });
    let (_, cached) = a.complete(&prompt(1001)).unwrap();
    assert_eq!(cached, stored_chunks(prompt_tokens) * CHUNK_TOKENS);
    assert_eq!(
        a.tier_metric(HITS, "redis") as usize,
        stored_chunks(prompt_tokens)
    );
}

/// Gemma-3-270M (sliding-window layers, KV cache groups on) on two servers sharing one
/// Redis: server A stores its prompt's full-attention layers per chunk and the window
/// layers its end needs; server B, which never saw it, hits every whole chunk and loads
/// the window payloads (`layers="window"`), and both answer the same greedy tokens.
#[test]
fn gemma3_two_servers_share_kv_cache_groups_through_redis() {
    let gemma = tiers_support::model_dir().join("gemma-3-270m-q4_k_m.gguf");
    assert!(
        gemma.exists(),
        "{} is missing: run `pagekeeper fetch-model --name all`",
        gemma.display()
    );
    let redis = Redis::shared_or_private();
    let prefix = unique_prefix("gemma3_groups");
    let url = format!("{}?prefix={prefix}", redis.url);
    let a = Server::start_model(&gemma, 4096, &["--tier-redis", &url]);
    let b = Server::start_model(&gemma, 4096, &["--tier-redis", &url]);
    let long: String = (0..6).map(prompt).collect::<Vec<_>>().join("\n");

    let (prompt_tokens, cached, text_a) = a.complete_text(&long, 16).unwrap();
    assert_eq!(cached, 0);
    assert!(
        prompt_tokens > 1024,
        "{prompt_tokens} tokens: past two windows"
    );
    let chunks = stored_chunks(prompt_tokens);
    // The window layers of the chunks the end's next token sees: 512 positions, 8 or 9
    // chunks of 64.
    wait_until("A's payloads in Redis", Duration::from_secs(60), || {
        redis.entries(&prefix) >= chunks + 8
    });
    let (_, cached, text_b) = b.complete_text(&long, 16).unwrap();
    assert_eq!(cached, chunks * CHUNK_TOKENS, "B reuses A's context");
    assert_eq!(text_b, text_a, "the same greedy tokens from loaded KV");
    let metrics = b.metrics();
    let window_loads = metrics
        .lines()
        .find(|l| {
            l.starts_with("pagekeeper:tier_chunks_loaded_total") && l.contains("layers=\"window\"")
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(
        window_loads >= 8.0,
        "window payloads loaded on B: {window_loads}"
    );
}

#[test]
fn redis_killed_mid_run_fails_no_request_and_hits_resume() {
    let started = Instant::now();
    let mut redis = Redis::private();
    let server = Server::start(&["--tier-redis", &redis.url]);

    // A client cycles through four prompts; the pool holds two, so every repeat is a Redis
    // hit while Redis is up, and a recompute while it is down.
    let done = Arc::new(AtomicUsize::new(0));
    let failures = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let client = {
        let (api, done, failures, stop) = (
            server.api.clone(),
            done.clone(),
            failures.clone(),
            stop.clone(),
        );
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if let Err(e) = api.complete(&prompt(2000 + i % 4)) {
                    failures.lock().unwrap().push(e);
                }
                done.fetch_add(1, Ordering::SeqCst);
                i += 1;
            }
        })
    };
    let hits = || server.tier_metric(HITS, "redis");
    wait_until(
        "Redis hits before the outage",
        Duration::from_secs(120),
        || hits() >= 6.0,
    );

    redis.stop();
    let hits_at_kill = hits();
    let done_at_kill = done.load(Ordering::SeqCst);
    wait_until(
        "requests during the outage",
        Duration::from_secs(120),
        || done.load(Ordering::SeqCst) >= done_at_kill + 6,
    );
    let errors = server.tier_metric("pagekeeper:tier_errors_total", "redis");
    assert!(errors > 0.0, "the outage was seen by the tier");
    let hits_in_outage = hits() - hits_at_kill;

    // The restarted Redis is empty (no persistence): chunks are stored again, then hit.
    redis.start();
    let hits_at_restart = hits();
    wait_until(
        "Redis hits after the restart",
        Duration::from_secs(120),
        || hits() >= hits_at_restart + 6.0,
    );
    stop.store(true, Ordering::Relaxed);
    client.join().unwrap();

    let failures = failures.lock().unwrap();
    assert!(failures.is_empty(), "failed requests: {failures:?}");
    assert!(
        hits_in_outage <= 1.0,
        "at most a load that began before the kill: {hits_in_outage}"
    );
    eprintln!(
        "redis outage: {} requests, none failed; hits {hits_at_kill} before the kill, {hits_in_outage} during, {} after the restart; {errors} tier errors; {:.1} s",
        done.load(Ordering::SeqCst),
        hits() - hits_at_restart,
        started.elapsed().as_secs_f64()
    );
}

/// `bench tiers --json` on a short context: the output's shape (a contract), and every tier
/// measured; the command itself fails if a timed run did not load the whole context.
#[test]
fn bench_tiers_json_reports_every_tier() {
    let redis = Redis::shared_or_private();
    let tmp = tempfile::tempdir().unwrap();
    let disk = format!("{}:1GiB", tmp.path().join("kv").display());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pagekeeper"))
        .args([
            "bench",
            "tiers",
            "--context-tokens",
            "256",
            "--runs",
            "1",
            "--threads",
            "2",
            "--json",
        ])
        .args(["--tier-disk", &disk, "--tier-redis", &redis.url, "--model"])
        .arg(tiers_support::model_path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench tiers failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        (
            v["context_tokens"].as_u64(),
            v["chunk_tokens"].as_u64(),
            v["chunks"].as_u64()
        ),
        (Some(256), Some(256), Some(1))
    );
    assert!(v["chunk_bytes"].as_u64().unwrap() > 256 * 1000);
    assert!(v["recompute"]["ttft_s"].as_f64().unwrap() > 0.0);
    let tiers: Vec<&str> = v["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["tier"].as_str().unwrap())
        .collect();
    assert_eq!(
        tiers,
        [
            "ram",
            "disk (warm page cache)",
            "disk (cold, drop_page_cache)",
            "redis"
        ]
    );
    for t in v["tiers"].as_array().unwrap() {
        assert!(
            t["ttft_s"].as_f64().unwrap() > 0.0
                && t["speedup_vs_recompute"].as_f64().unwrap() > 0.0,
            "{t}"
        );
        assert!(t["read_bytes_per_s"].as_f64().unwrap() > 0.0, "{t}");
        assert_eq!(t["ttft_runs_s"].as_array().unwrap().len(), 1);
    }
    // The bench cleans up after itself: no entries left in the disk tier.
    let entries = std::fs::read_dir(tmp.path().join("kv"))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".kv")
        })
        .count();
    assert_eq!(entries, 0);
}

/// `bench serve --replicas 2 --json` over one Redis: two servers, three contexts asked twice
/// round-robin, so every repeat lands on the other server and must be a tier hit. Checks
/// the output's shape (a contract) and that the classes and hits add up.
#[test]
fn bench_serve_replicas_reports_hits_on_the_other_replica() {
    let redis = Redis::shared_or_private();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_pagekeeper"))
        .args([
            "bench",
            "serve",
            "--replicas",
            "2",
            "--routing",
            "round-robin",
        ])
        // Port 0: each replica binds a port the kernel picks, so no other test's server
        // can hold `--port + 1`: the likely cause of CI stop 52, whose server stderr was lost.
        .args(["--tier-redis", &redis.url, "--port", "0"])
        .args([
            "--concurrency",
            "1",
            "--prompt-tokens",
            "600",
            "--contexts",
            "3",
        ])
        .args([
            "--rounds",
            "2",
            "--max-tokens",
            "2",
            "--threads",
            "2",
            "--json",
        ])
        .arg("--model")
        .arg(tiers_support::model_path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench serve --replicas failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let run = &v["runs"][0];
    assert_eq!(run["replicas"], 2);
    assert_eq!(run["routing"], "round-robin");
    assert_eq!(run["failed"], 0);
    // Requests 0-2 are cold (contexts 0, 1, 2 on servers 0, 1, 0); requests 3-5 send each
    // context to the server that did not see it.
    assert_eq!(
        (run["n_cold"].as_u64(), run["n_other"].as_u64()),
        (Some(3), Some(3))
    );
    assert!(run["tier_hits"].as_f64().unwrap() >= 3.0, "{run}");
    assert!(run["hit_rate"].as_f64().unwrap() > 0.2, "{run}");
    for key in [
        "ttft_cold_p50_s",
        "ttft_other_p50_s",
        "cold_over_other",
        "wall_s",
    ] {
        assert!(run[key].as_f64().is_some_and(|x| x > 0.0), "{key}: {run}");
    }
}
