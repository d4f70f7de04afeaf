//! The Redis tier: how several pagekeeper servers share KV chunks. Key layout, the
//! payload-before-metadata protocol and the LRU capacity policy are in `redis_scripts.rs`.
//!
//! NOTE 1 (bounded): every socket read and write has a timeout, connects have a timeout, and
//! a pipeline never carries more than `max_in_flight_bytes` of payload (a batch is split),
//! except that an entry larger than that travels alone in its own pipeline.
//! NOTE 2 (outages): any error drops the connection; the next call reconnects. After a failed
//! connect, calls fail at once with `Unavailable` until `reconnect_backoff` has passed, so a
//! dead Redis costs callers microseconds, not a connect timeout each. Callers treat errors as
//! misses and recompute.
//! NOTE 3 (concurrency): one connection behind a mutex; tiers are driven by one background
//! thread, so a pool would buy nothing yet.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use redis::{Connection, RedisResult};

use crate::redis_scripts;
use crate::tier::{BandwidthEstimate, BandwidthMeter, Evicted, Payload, Tier};
use crate::{ChunkKey, TierError};

#[derive(Clone, Debug)]
pub struct RedisTierConfig {
    /// `redis://[user:pass@]host:port[/db]`.
    pub url: String,
    pub name: String,
    /// Namespace of every key; servers that should share chunks use the same prefix.
    pub key_prefix: String,
    /// Payload bytes kept before LRU eviction; `u64::MAX` leaves it to Redis's `maxmemory`.
    pub capacity_bytes: u64,
    pub connect_timeout: Duration,
    pub io_timeout: Duration,
    pub reconnect_backoff: Duration,
    pub max_in_flight_bytes: u64,
    /// Lifetime of a payload whose metadata was never written (the writer died).
    pub pending_ttl_s: u64,
}

impl RedisTierConfig {
    pub fn new(url: &str) -> RedisTierConfig {
        RedisTierConfig {
            url: url.to_owned(),
            name: "redis".to_owned(),
            key_prefix: "pk:tiers:v1:".to_owned(),
            capacity_bytes: u64::MAX,
            connect_timeout: Duration::from_millis(300),
            io_timeout: Duration::from_millis(1000),
            reconnect_backoff: Duration::from_millis(1000),
            // Measured (tier_bench, loopback, 1 MiB payloads): 1-4 MiB pipelines move 600-750
            // MB/s, 16-64 MiB ones about 250 MB/s, so batches stay small.
            max_in_flight_bytes: 4 << 20,
            pending_ttl_s: 60,
        }
    }
}

/// Counters for tests and dashboards.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RedisStats {
    pub pipelines_sent: u64,
    /// Largest payload total carried by one pipeline (write or read).
    pub max_pipeline_payload_bytes: u64,
    pub connects: u64,
    pub connect_failures: u64,
    pub corrupt_entries: u64,
}

struct Conn {
    conn: Connection,
    commit_sha: String,
    touch_sha: String,
    drop_sha: String,
}

#[derive(Default)]
struct ConnSlot {
    conn: Option<Conn>,
    retry_at: Option<Instant>,
}

pub struct RedisTier {
    config: RedisTierConfig,
    client: redis::Client,
    slot: Mutex<ConnSlot>,
    usage_bytes: AtomicU64,
    meter: BandwidthMeter,
    pipelines_sent: AtomicU64,
    max_pipeline_payload_bytes: AtomicU64,
    connects: AtomicU64,
    connect_failures: AtomicU64,
    corrupt_entries: AtomicU64,
}

impl RedisTier {
    /// Parses the URL; does not connect (the first operation does), so a server can start
    /// while Redis is down.
    pub fn open(config: RedisTierConfig) -> Result<RedisTier, TierError> {
        let invalid = |reason: String| TierError::Invalid {
            tier: config.name.clone(),
            reason,
        };
        if config.url.starts_with("redis+cluster://") {
            return Err(invalid(format!(
                "{}: Redis Cluster is not supported yet; use a single redis:// server",
                config.url
            )));
        }
        if config.max_in_flight_bytes == 0 {
            return Err(invalid("max_in_flight_bytes must be positive".into()));
        }
        let client = redis::Client::open(config.url.as_str())
            .map_err(|e| invalid(format!("bad URL {}: {e}", config.url)))?;
        Ok(RedisTier {
            config,
            client,
            slot: Mutex::new(ConnSlot::default()),
            usage_bytes: AtomicU64::new(0),
            meter: BandwidthMeter::default(),
            pipelines_sent: AtomicU64::new(0),
            max_pipeline_payload_bytes: AtomicU64::new(0),
            connects: AtomicU64::new(0),
            connect_failures: AtomicU64::new(0),
            corrupt_entries: AtomicU64::new(0),
        })
    }

    pub fn config(&self) -> &RedisTierConfig {
        &self.config
    }

    pub fn stats(&self) -> RedisStats {
        RedisStats {
            pipelines_sent: self.pipelines_sent.load(Ordering::Relaxed),
            max_pipeline_payload_bytes: self.max_pipeline_payload_bytes.load(Ordering::Relaxed),
            connects: self.connects.load(Ordering::Relaxed),
            connect_failures: self.connect_failures.load(Ordering::Relaxed),
            corrupt_entries: self.corrupt_entries.load(Ordering::Relaxed),
        }
    }

    /// Reads the shared usage counter (other servers change it too).
    pub fn refresh_usage_bytes(&self) -> Result<u64, TierError> {
        let key = self.usage_key();
        let used: Option<u64> =
            self.with_conn(|c| redis::cmd("GET").arg(&key).query(&mut c.conn))?;
        self.usage_bytes.store(used.unwrap_or(0), Ordering::Relaxed);
        Ok(used.unwrap_or(0))
    }

    fn data_key(&self, key: &ChunkKey) -> String {
        format!("{}d:{key}", self.config.key_prefix)
    }

    fn meta_key(&self, key: &ChunkKey) -> String {
        format!("{}m:{key}", self.config.key_prefix)
    }

    fn usage_key(&self) -> String {
        format!("{}usage", self.config.key_prefix)
    }

    fn connect(&self) -> RedisResult<Conn> {
        let mut conn = self
            .client
            .get_connection_with_timeout(self.config.connect_timeout)?;
        conn.set_read_timeout(Some(self.config.io_timeout))?;
        conn.set_write_timeout(Some(self.config.io_timeout))?;
        // Loaded on every connect: a restarted Redis has an empty script cache.
        let mut load = |src: &str| -> RedisResult<String> {
            redis::cmd("SCRIPT").arg("LOAD").arg(src).query(&mut conn)
        };
        let commit_sha = load(redis_scripts::COMMIT)?;
        let touch_sha = load(redis_scripts::TOUCH)?;
        let drop_sha = load(redis_scripts::DROP)?;
        Ok(Conn {
            conn,
            commit_sha,
            touch_sha,
            drop_sha,
        })
    }

    /// Runs `op` on a live connection, connecting first if needed (NOTE 2).
    fn with_conn<T>(&self, op: impl FnOnce(&mut Conn) -> RedisResult<T>) -> Result<T, TierError> {
        let mut slot = self.slot.lock().unwrap();
        if slot.conn.is_none() {
            let now = Instant::now();
            if let Some(retry_at) = slot.retry_at.filter(|at| now < *at) {
                return Err(TierError::Unavailable {
                    tier: self.config.name.clone(),
                    reason: format!(
                        "{} unreachable; next connect attempt in {:?}",
                        self.config.url,
                        retry_at - now
                    ),
                });
            }
            match self.connect() {
                Ok(conn) => {
                    slot.conn = Some(conn);
                    slot.retry_at = None;
                    self.connects.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(tier = %self.config.name, url = %self.config.url, "connected to redis");
                }
                Err(e) => {
                    slot.retry_at = Some(now + self.config.reconnect_backoff);
                    self.connect_failures.fetch_add(1, Ordering::Relaxed);
                    return Err(TierError::Unavailable {
                        tier: self.config.name.clone(),
                        reason: format!("connect to {} failed: {e}", self.config.url),
                    });
                }
            }
        }
        let result = op(slot.conn.as_mut().unwrap());
        if let Err(e) = &result {
            // Whatever went wrong, the connection may hold a half-read reply: start afresh.
            tracing::warn!(tier = %self.config.name, error = %e, "redis operation failed; dropping the connection");
            slot.conn = None;
        }
        result.map_err(|source| TierError::Redis {
            tier: self.config.name.clone(),
            source,
        })
    }

    fn note_pipeline(&self, payload_bytes: u64) {
        self.pipelines_sent.fetch_add(1, Ordering::Relaxed);
        self.max_pipeline_payload_bytes
            .fetch_max(payload_bytes, Ordering::Relaxed);
    }

    /// Only the capacity limits an entry's size. An entry above `max_in_flight_bytes` travels
    /// in a pipeline of its own (NOTE 1): refusing it would make the default 256-token chunk
    /// of even a small model (5.9 MB for SmolLM2-135M at f16) impossible to store.
    fn too_large(&self, size_bytes: u64) -> Option<TierError> {
        let limit_bytes = self.config.capacity_bytes;
        (size_bytes > limit_bytes).then(|| TierError::TooLarge {
            tier: self.config.name.clone(),
            size_bytes,
            limit_bytes,
        })
    }

    /// One pipeline: every payload (pending), then one COMMIT that makes them visible.
    fn store_batch(&self, batch: &[(ChunkKey, Payload)]) -> Result<(), TierError> {
        let batch_bytes: u64 = batch.iter().map(|(_, p)| p.len() as u64).sum();
        let (committed, evicted, used): (u64, u64, u64) = self.with_conn(|c| {
            let mut pipe = redis::pipe();
            for (key, payload) in batch {
                pipe.cmd("SET")
                    .arg(self.data_key(key))
                    .arg(&payload[..])
                    .arg("EX")
                    .arg(self.config.pending_ttl_s)
                    .ignore();
            }
            let commit = pipe
                .cmd("EVALSHA")
                .arg(&c.commit_sha)
                .arg(0)
                .arg(&self.config.key_prefix)
                .arg(self.config.capacity_bytes);
            for (key, payload) in batch {
                let meta = format!("v1 {} {}", payload.len(), crc32c::crc32c(payload));
                commit.arg(key.to_hex()).arg(payload.len()).arg(meta);
            }
            let (result,): ((u64, u64, u64),) = pipe.query(&mut c.conn)?;
            Ok(result)
        })?;
        self.note_pipeline(batch_bytes);
        self.usage_bytes.store(used, Ordering::Relaxed);
        if committed < batch.len() as u64 {
            tracing::warn!(tier = %self.config.name, committed, sent = batch.len(), "payloads vanished before commit (redis maxmemory?)");
        }
        if evicted > 0 {
            tracing::debug!(tier = %self.config.name, evicted, "redis tier evicted LRU entries");
        }
        Ok(())
    }

    fn drop_entries(&self, hexes: &[String]) -> Result<u64, TierError> {
        let (deleted, used): (u64, u64) = self.with_conn(|c| {
            let mut cmd = redis::cmd("EVALSHA");
            cmd.arg(&c.drop_sha)
                .arg(0)
                .arg(&self.config.key_prefix)
                .arg(hexes);
            cmd.query(&mut c.conn)
        })?;
        self.usage_bytes.store(used, Ordering::Relaxed);
        Ok(deleted)
    }
}

/// Parses `v1 <len> <crc32c>`.
fn parse_meta(meta: &[u8]) -> Option<(u64, u32)> {
    let text = std::str::from_utf8(meta).ok()?;
    let mut fields = text.split(' ');
    if fields.next()? != "v1" {
        return None;
    }
    let len = fields.next()?.parse().ok()?;
    let crc = fields.next()?.parse().ok()?;
    fields.next().is_none().then_some((len, crc))
}

/// Splits items into consecutive index ranges of at most `limit_bytes` each (an item larger
/// than the limit travels alone).
fn batches(sizes_bytes: &[u64], limit_bytes: u64) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, &size) in sizes_bytes.iter().enumerate() {
        if i > start && bytes + size > limit_bytes {
            out.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    if start < sizes_bytes.len() {
        out.push(start..sizes_bytes.len());
    }
    out
}

impl Tier for RedisTier {
    fn name(&self) -> &str {
        &self.config.name
    }

    fn store(&self, key: &ChunkKey, payload: &Payload) -> Result<Vec<Evicted>, TierError> {
        self.store_many(&[(*key, payload.clone())])
    }

    fn store_many(&self, entries: &[(ChunkKey, Payload)]) -> Result<Vec<Evicted>, TierError> {
        if let Some(err) = entries
            .iter()
            .find_map(|(_, p)| self.too_large(p.len() as u64))
        {
            return Err(err);
        }
        let started = Instant::now();
        let sizes_bytes: Vec<u64> = entries.iter().map(|(_, p)| p.len() as u64).collect();
        for range in batches(&sizes_bytes, self.config.max_in_flight_bytes) {
            self.store_batch(&entries[range])?;
        }
        let total: u64 = entries.iter().map(|(_, p)| p.len() as u64).sum();
        self.meter.record_write(total, started.elapsed());
        // Redis evicts on the server (NOTE 2 in redis_scripts.rs); it is the last tier, so
        // there is nothing to demote to.
        Ok(Vec::new())
    }

    fn load(&self, key: &ChunkKey) -> Result<Option<Payload>, TierError> {
        Ok(self.load_many(std::slice::from_ref(key))?.pop().flatten())
    }

    fn load_many(&self, keys: &[ChunkKey]) -> Result<Vec<Option<Payload>>, TierError> {
        let started = Instant::now();
        // Round trip 1: metadata, small, tells which keys are visible and how big they are.
        let metas: Vec<Option<Vec<u8>>> = self.with_conn(|c| {
            let mut pipe = redis::pipe();
            for key in keys {
                pipe.cmd("GET").arg(self.meta_key(key));
            }
            pipe.query(&mut c.conn)
        })?;
        let mut out: Vec<Option<Payload>> = vec![None; keys.len()];
        let mut corrupt: Vec<String> = Vec::new();
        let mut hits: Vec<(usize, u64, u32)> = Vec::new();
        for (i, meta) in metas.iter().enumerate() {
            match meta.as_deref().map(parse_meta) {
                None => {}
                Some(Some((len, crc))) => hits.push((i, len, crc)),
                Some(None) => corrupt.push(keys[i].to_hex()),
            }
        }
        // Round trips 2..: payloads, at most `max_in_flight_bytes` per pipeline.
        let mut bytes_read = 0u64;
        let sizes_bytes: Vec<u64> = hits.iter().map(|h| h.1).collect();
        for range in batches(&sizes_bytes, self.config.max_in_flight_bytes) {
            let batch = &hits[range];
            let datas: Vec<Option<Vec<u8>>> = self.with_conn(|c| {
                let mut pipe = redis::pipe();
                let touch = pipe
                    .cmd("EVALSHA")
                    .arg(&c.touch_sha)
                    .arg(0)
                    .arg(&self.config.key_prefix);
                for &(i, _, _) in batch {
                    touch.arg(keys[i].to_hex());
                }
                pipe.ignore();
                for &(i, _, _) in batch {
                    pipe.cmd("GET").arg(self.data_key(&keys[i]));
                }
                pipe.query(&mut c.conn)
            })?;
            self.note_pipeline(batch.iter().map(|h| h.1).sum());
            for (&(i, len, crc), data) in batch.iter().zip(datas) {
                match data {
                    Some(bytes) if bytes.len() as u64 == len && crc32c::crc32c(&bytes) == crc => {
                        bytes_read += len;
                        out[i] = Some(Payload::from(bytes));
                    }
                    _ => corrupt.push(keys[i].to_hex()),
                }
            }
        }
        if !corrupt.is_empty() {
            tracing::warn!(tier = %self.config.name, count = corrupt.len(), "corrupt or incomplete redis entries dropped");
            self.corrupt_entries
                .fetch_add(corrupt.len() as u64, Ordering::Relaxed);
            self.drop_entries(&corrupt)?;
        }
        if bytes_read > 0 {
            self.meter.record_read(bytes_read, started.elapsed());
        } else {
            self.meter.record_access(started.elapsed());
        }
        Ok(out)
    }

    fn contains(&self, key: &ChunkKey) -> Result<bool, TierError> {
        Ok(self.contains_many(std::slice::from_ref(key))?[0])
    }

    fn contains_many(&self, keys: &[ChunkKey]) -> Result<Vec<bool>, TierError> {
        let started = Instant::now();
        let found: Vec<bool> = self.with_conn(|c| {
            let mut pipe = redis::pipe();
            for key in keys {
                pipe.cmd("EXISTS").arg(self.meta_key(key));
            }
            pipe.query(&mut c.conn)
        })?;
        self.meter.record_access(started.elapsed());
        Ok(found)
    }

    fn delete(&self, key: &ChunkKey) -> Result<bool, TierError> {
        Ok(self.drop_entries(&[key.to_hex()])? > 0)
    }

    fn capacity_bytes(&self) -> u64 {
        self.config.capacity_bytes
    }

    fn usage_bytes(&self) -> u64 {
        self.usage_bytes.load(Ordering::Relaxed)
    }

    fn bandwidth(&self) -> BandwidthEstimate {
        self.meter.estimate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_respect_the_byte_limit() {
        let ranges = |sizes: &[u64], limit| -> Vec<(usize, usize)> {
            batches(sizes, limit)
                .into_iter()
                .map(|r| (r.start, r.end))
                .collect()
        };
        assert_eq!(ranges(&[3, 3, 3, 3], 6), vec![(0, 2), (2, 4)]);
        assert_eq!(ranges(&[3, 10, 3], 6), vec![(0, 1), (1, 2), (2, 3)]);
        assert_eq!(ranges(&[], 6), vec![]);
    }

    #[test]
    fn meta_parsing() {
        assert_eq!(parse_meta(b"v1 5 123"), Some((5, 123)));
        assert_eq!(parse_meta(b"v2 5 123"), None);
        assert_eq!(parse_meta(b"v1 5"), None);
        assert_eq!(parse_meta(b"v1 5 123 x"), None);
    }

    #[test]
    fn cluster_urls_are_refused_clearly() {
        let err = RedisTier::open(RedisTierConfig::new("redis+cluster://127.0.0.1:7000"))
            .err()
            .unwrap();
        assert!(err.to_string().contains("not supported yet"), "{err}");
    }
}
