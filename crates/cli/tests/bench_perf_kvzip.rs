//! `pagekeeper bench perf` with KVzip on the real default model: its reconstruction
//! passes are timed on their own (issue 37's cost bar is their time against the prefill's,
//! in one run), and decode's rate leaves them out.

use std::process::Command;

use serde_json::Value;

/// `pagekeeper bench perf --json --threads 1 --model DEFAULT ARGS`: its first run's object.
fn perf_run(args: &[&str]) -> Value {
    let model = pk_engine::model_store::default_model_path();
    assert!(
        model.exists(),
        "{} is missing: run `pagekeeper fetch-model` first (or set PAGEKEEPER_HOME)",
        model.display()
    );
    let o = Command::new(env!("CARGO_BIN_EXE_pagekeeper"))
        .args(["bench", "perf", "--json", "--threads", "1"])
        .args(args)
        .arg("--model")
        .arg(&model)
        .output()
        .expect("running pagekeeper");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "bench perf failed: {stderr}");
    let v: Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    v["runs"][0].clone()
}

#[test]
fn bench_perf_reports_kvzips_passes_beside_the_prefill() {
    let run = perf_run(&[
        "--contexts",
        "512",
        "--decode-tokens",
        "4",
        "--kv-policy",
        "kvzip:chunk=256",
        "--kv-budget",
        "128",
    ]);
    let f = |k: &str| {
        run[k]
            .as_f64()
            .unwrap_or_else(|| panic!("{k} missing: {run}"))
    };
    let forward = f("reconstruction_forward_seconds");
    let scoring = f("reconstruction_scoring_seconds");
    assert!(forward > 0.0 && scoring > 0.0, "{run}");
    // The ratio is the passes' time over the prefill's: 512 tokens at the prefill's rate.
    let prefill_seconds = 512.0 / f("prefill_tok_s");
    let ratio = f("reconstruction_cost_ratio");
    assert!(
        ((forward + scoring) / prefill_seconds - ratio).abs() < 1e-6 * ratio,
        "{run}"
    );
    // Two passes of 256 tokens each (and their prompts) against one prefill of 512: the
    // forward alone is within a few prefills, whatever the host's speed.
    assert!((0.2..20.0).contains(&ratio), "{run}");
    assert!(f("decode_tok_s") > 0.0);

    // A policy without passes reports none.
    let plain = perf_run(&[
        "--contexts",
        "64",
        "--decode-tokens",
        "2",
        "--kv-policy",
        "streaming-llm",
        "--kv-budget",
        "48",
    ]);
    assert!(plain.get("reconstruction_cost_ratio").is_none(), "{plain}");
}
