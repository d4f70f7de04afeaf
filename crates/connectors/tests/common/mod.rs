//! Shared helpers for the connectors' end-to-end tests against the real default model.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pk_connectors::{ContextReuse, ContextReuseConfig, ReuseConfig, Tiering, TieringConfig};
use pk_engine::{Engine, EngineConfig};
use pk_tiers::TieredStore;

// The engine's tests hold the helpers both crates need (the default model, the book's
// token ids, a request that waits for blocks); compiled here as well, not copied.
#[path = "../../../engine/tests/common/mod.rs"]
mod engine_common;
#[allow(unused_imports)]
pub use engine_common::{book_ids, engine, golden, ids, model_path, run_with_a_waiting_request};

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

/// Chunk tiers over `store` as the tests use them: 256-token chunks, 64 MiB in flight.
#[allow(dead_code)]
pub fn tiers_config(store: Arc<TieredStore>) -> TieringConfig {
    TieringConfig {
        store,
        chunk_size_tokens: 256,
        max_pending_bytes: 64 << 20,
        window_checkpoint_tokens: None,
    }
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
