//! Shared test helpers: payload/key makers and a real `redis-server` for the Redis tests.
//!
//! Which Redis a test gets (no silent skips):
//! - `PAGEKEEPER_TEST_REDIS=redis://host:port` set (CI sets it): that server; the test FAILS if
//!   it is unreachable.
//! - unset: a private `redis-server` on a free loopback port, started from PATH; the test FAILS
//!   if the binary is missing, saying to install it.
//!
//! Tests that stop and restart Redis always use a private server.
#![allow(dead_code)]

pub mod cluster;
mod redis_server;

#[allow(unused_imports)]
pub use redis_server::{RedisServer, REDIS_ENV};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use pk_tiers::{ChunkKey, Payload};

pub fn key(n: u64) -> ChunkKey {
    ChunkKey(*blake3::hash(&n.to_le_bytes()).as_bytes())
}

/// Deterministic, distinct bytes for entry `n`.
pub fn payload(n: u64, len: usize) -> Payload {
    let mut out = Vec::with_capacity(len);
    let mut x = n.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    Arc::from(out)
}

/// A key prefix no other test (or earlier run against the same server) uses.
pub fn unique_prefix(test: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!(
        "pktest:{test}:{}:{nanos}:{}:",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}
