//! `pagekeeper bench serve` end to end, small: a real server child, streaming clients with a
//! KV policy and budget on every request, and the per-level report issue 23 names
//! (`peak_kv_blocks`, `preemptions`, `failed`, `max_running_seqs`) read from the server's
//! peak gauges.

use std::process::Command;

#[test]
fn bench_serve_reports_the_pool_per_level() {
    let model = pk_engine::model_store::default_model_path();
    assert!(
        model.exists(),
        "{} is missing: run `pagekeeper fetch-model` first",
        model.display()
    );
    let out = Command::new(env!("CARGO_BIN_EXE_pagekeeper"))
        .args([
            "bench",
            "serve",
            "--concurrency",
            "1,2",
            "--requests",
            "2",
            "--prompt-tokens",
            "160",
        ])
        .args([
            "--max-tokens",
            "4",
            "--kv-capacity-tokens",
            "1024",
            "--threads",
            "2",
            "--json",
        ])
        .args(["--kv-policy", "paged-eviction", "--kv-budget", "64"])
        .args(["--port", "0"])
        .arg("--model")
        .arg(&model)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["kv_policy"], "paged-eviction");
    let levels = v["levels"].as_array().unwrap();
    assert_eq!(levels.len(), 2);
    for l in levels {
        assert_eq!(l["failed"], 0, "{l}");
        assert_eq!(l["completion_tokens"], 8, "{l}");
        assert_eq!(l["kv_blocks_total"], 64.0, "{l}");
        // Prompts are windows of the book's token ids: exactly as many tokens as asked.
        assert_eq!(l["prompt_tokens_mean"], 160.0, "{l}");
        let peak = l["peak_kv_blocks"].as_f64().unwrap();
        // Each 160-token prompt is computed whole (exact prefill attention), then pruned.
        assert!((10.0..=64.0).contains(&peak), "{l}");
        let running = l["max_running_seqs"].as_f64().unwrap();
        assert!(
            running >= 1.0 && running <= l["concurrency"].as_f64().unwrap(),
            "{l}"
        );
        assert!(l["preemptions"].is_number(), "{l}");
    }
}

/// A server that refuses its flags exits before it is healthy; the bench says so at once and
/// quotes the server's own error, not only its exit status.
#[test]
fn a_server_that_exits_early_is_reported_with_its_stderr() {
    let model = pk_engine::model_store::default_model_path();
    assert!(model.exists(), "{} is missing", model.display());
    let out = Command::new(env!("CARGO_BIN_EXE_pagekeeper"))
        .args(["bench", "serve", "--concurrency", "1", "--requests", "1"])
        .args(["--kv-dtype", "int3", "--port", "0", "--json", "--model"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("before it was healthy"), "{stderr}");
    assert!(
        stderr.contains("int3"),
        "the server's own error is quoted: {stderr}"
    );
}
