//! `pagekeeper serve --tier-policy evicpress` end to end: a context stored after its first
//! request is loaded from the EVICPRESS store by a later one, `GET /v1/kv/contexts`
//! explains where it lives, and the server profiles it in its idle time.

mod tiers_support;

use std::time::Duration;

use tiers_support::{prompt, wait_until, Server, POOL_TOKENS};

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
        "q8,q4,paged-eviction-0.5,snapkv-0.5",
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
        2 * 5,
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

#[test]
fn contexts_endpoint_is_404_without_evicpress() {
    let server = Server::start(&[]);
    let r = reqwest::blocking::get(server.url("/v1/kv/contexts")).unwrap();
    assert_eq!(r.status().as_u16(), 404);
    assert!(r.text().unwrap().contains("--tier-policy evicpress"));
}
