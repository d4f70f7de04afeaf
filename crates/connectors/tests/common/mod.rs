//! Shared helpers for the connectors' end-to-end tests against the real default model.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pk_connectors::{ContextReuse, ContextReuseConfig, ReuseConfig, Tiering, TieringConfig};
use pk_engine::{Engine, EngineConfig};

/// The default model; tests fail (rather than skip) when it is missing, because CI
/// fetches it before running them.
pub fn model_path() -> std::path::PathBuf {
    let p = pk_engine::model_store::default_model_path();
    assert!(
        p.exists(),
        "{} is missing: run `pagekeeper fetch-model` first",
        p.display()
    );
    p
}

#[allow(dead_code)]
pub fn engine(config: EngineConfig) -> Engine {
    Engine::load(&model_path(), config).expect("engine loads")
}

/// An engine on the default model with the EVICPRESS store `contexts` attached (KV cache
/// groups off, as a connector needs).
#[allow(dead_code)]
pub fn contexts_engine(
    config: EngineConfig,
    contexts: ContextReuseConfig,
) -> (Engine, Arc<ContextReuse>) {
    let mut e = engine(EngineConfig {
        hybrid_kv_cache: false,
        ..config
    });
    let attached = pk_connectors::attach(&mut e, &ReuseConfig::Contexts(contexts)).unwrap();
    let c = attached.contexts().expect("a context store").clone();
    (e, c)
}

/// An engine on the default model with the chunk tiers `tiers` attached.
#[allow(dead_code)]
pub fn tiered_engine(config: EngineConfig, tiers: TieringConfig) -> (Engine, Arc<Tiering>) {
    let mut e = engine(EngineConfig {
        hybrid_kv_cache: false,
        ..config
    });
    let attached = pk_connectors::attach(&mut e, &ReuseConfig::Chunks(tiers)).unwrap();
    let t = attached.tiering().expect("tiers").clone();
    (e, t)
}

#[allow(dead_code)]
pub fn golden() -> serde_json::Value {
    serde_json::from_str(include_str!(
        "../../../../tests/fixtures/smollm2-greedy.json"
    ))
    .unwrap()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[allow(dead_code)]
pub fn book_ids() -> Vec<u32> {
    let v: serde_json::Value = serde_json::from_str(include_str!(
        "../../../../tests/fixtures/eighty-days-token-ids.json"
    ))
    .unwrap();
    ids(&v["token_ids"])
}

/// Runs two requests on `e` (a pool of about 40 blocks): the first (500 book tokens, 48 out)
/// is admitted and prefilled, then the second (400 tokens, 4 out) arrives and waits for
/// blocks while the first decodes. Returns the steps the second waited (asserted > 10), so
/// a test can count what the engine asked a store during them.
#[allow(dead_code)]
pub fn run_with_a_waiting_request(e: &mut Engine) -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let book = book_ids();
    let done = std::sync::Arc::new(AtomicUsize::new(0));
    let submit = |e: &mut Engine, prompt: &[u32], max_tokens: usize| {
        let d = done.clone();
        let sink = Box::new(move |ev: pk_engine::SeqEvent| {
            if matches!(
                ev,
                pk_engine::SeqEvent::Finished(_) | pk_engine::SeqEvent::Error(_)
            ) {
                d.fetch_add(1, Ordering::SeqCst);
            }
            true
        });
        let params = pk_engine::GenerateParams {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        };
        e.submit(pk_engine::Request {
            prompt_ids: prompt.to_vec(),
            params,
            cache_salt: None,
            sink,
        })
        .unwrap();
    };
    submit(e, &book[9000..9500], 48);
    // Its prefill allocates its blocks; only then does the second request arrive.
    e.step();
    submit(e, &book[9600..10000], 4);
    let (mut steps, mut waited_steps) = (0, 0);
    while done.load(Ordering::SeqCst) < 2 {
        e.step();
        steps += 1;
        waited_steps += usize::from(e.num_waiting() > 0);
        assert!(steps < 10_000, "the requests did not finish");
    }
    assert!(
        waited_steps > 10,
        "the second request should have waited for blocks ({waited_steps} steps)"
    );
    e.check_invariants();
    waited_steps
}

/// A Redis URL for a test: `PAGEKEEPER_TEST_REDIS` if set, else a private server on a free
/// loopback port (killed when the returned guard drops). Fails, never skips, without one.
#[allow(dead_code)]
pub fn redis_for_test() -> (String, Option<KillOnDrop>) {
    if let Ok(url) = std::env::var("PAGEKEEPER_TEST_REDIS") {
        return (url, None);
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = std::process::Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("redis-server must be on PATH (scripts/test.sh fetches one) or PAGEKEEPER_TEST_REDIS set");
    let guard = KillOnDrop(child);
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "redis-server did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (format!("redis://127.0.0.1:{port}"), Some(guard))
}

pub struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
