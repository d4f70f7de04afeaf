//! `pk-tiers`: a tiered store for KV-cache chunks (RAM → local disk → Redis).
//!
//! The design follows LMCache's storage layer (see `shared/spec/evicpress.md`, "Related
//! systems") and fixes the complaints its users have: chunk keys are a real, unseeded hash
//! (identical across processes and machines), the disk index survives restarts, and the Redis
//! tier bounds its own memory and recovers from outages by itself.
//!
//! Code map:
//! - [`key`]: [`ChunkKey`] and [`ChunkKeyer`], the chained BLAKE3 hash over token chunks.
//! - [`tier`]: the [`Tier`] trait, [`Payload`], and the bandwidth/latency meter that feeds
//!   EVICPRESS's delay model.
//! - [`ram`], [`disk`], [`redis_tier`]: the three backends.
//! - [`store`]: [`TieredStore`], prefix lookup across tiers, promotion and demotion.
//! - [`config`]: `--tier-ram 2GiB`, `--tier-disk PATH:20GiB`, `--tier-redis URL` parsing.
//!
//! How the engine is meant to use it (not wired yet): build a [`TieredStore`] from
//! [`TierConfig`]s (`open_tier`, fastest first, `with_write_through_last(true)` when the last
//! tier is shared Redis); before prefill, `ChunkKeyer::keys(prompt, salt)` then
//! `lookup_prefix` and `load_prefix`, decode with `pk-codec` into the pool, prefill the rest;
//! after prefill, send each new full chunk's encoded bytes to a background thread that calls
//! `store`. Export `metrics()` (or the `metrics` facade counters, label `tier`).
//!
//! **Architecture Invariant:** payloads are opaque bytes. This crate knows nothing about
//! tensors, the block pool or the engine loop; `pk-codec` serializes KV, the engine decides
//! when to call us (from a background thread: every call here may block on I/O).
// One audited unsafe block (marked `allow(unsafe_code)`); none elsewhere.
#![deny(unsafe_code)]

pub mod config;
pub mod disk;
mod disk_format;
pub mod key;
mod lru;
pub mod ram;
mod redis_link;
mod redis_scripts;
pub mod redis_tier;
pub mod store;
pub mod tier;

pub use config::{open_tier, parse_byte_size, parse_key_prefix, ConfigError, TierConfig};
pub use disk::{DiskScanReport, DiskTier, DiskTierConfig};
pub use key::{ChunkKey, ChunkKeyer, ChunkSizeError};
pub use ram::RamTier;
pub use redis_tier::{RedisStats, RedisTier, RedisTierConfig};
pub use store::{Loaded, PrefixLookup, StoreReport, TierMetricsSnapshot, TieredStore};
pub use tier::{
    BandwidthEstimate, BandwidthMeter, Evicted, Payload, Tier, LATENCY_SAMPLE_MAX_BYTES,
};

use std::path::PathBuf;

/// Errors from a tier. A caller of [`TieredStore`] never sees these: the store turns them into
/// misses (and counts them), because the answer to a failing tier is always "recompute".
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error("tier {tier}: I/O error on {path}: {source}")]
    Io {
        tier: String,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("tier {tier}: entry of {size_bytes} bytes exceeds the limit of {limit_bytes} bytes")]
    TooLarge {
        tier: String,
        size_bytes: u64,
        limit_bytes: u64,
    },
    #[error("tier {tier}: unavailable: {reason}")]
    Unavailable { tier: String, reason: String },
    #[error("tier {tier}: redis error: {source}")]
    Redis {
        tier: String,
        source: redis::RedisError,
    },
    #[error("tier {tier}: {reason}")]
    Invalid { tier: String, reason: String },
    /// A Redis key that the tier's scripts own holds something they never wrote (NOTE 5 of
    /// `redis_scripts.rs`): writes are refused, and nothing is made visible, until it is fixed.
    #[error("tier {tier}: redis key {key} is corrupt ({reason}); writes are refused until an operator deletes it, after which the tier rebuilds its accounting")]
    CorruptKey {
        tier: String,
        key: String,
        reason: String,
    },
}
