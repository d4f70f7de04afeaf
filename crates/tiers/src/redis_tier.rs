//! The Redis tier: how several pagekeeper servers share KV chunks, on one Redis server
//! (`redis://`) or a Redis Cluster (`redis+cluster://host:port,…`, see `redis_link.rs`). Key
//! layout, the payload-before-metadata protocol and the LRU capacity policy are in
//! `redis_scripts.rs`.
//!
//! NOTE 1 (bounded): every socket read and write has a timeout, connects have a timeout, and
//! a pipeline never carries more than `max_in_flight_bytes` of payload (a batch is split),
//! except that an entry larger than that travels alone in its own pipeline. Reads ask for
//! no more than the length the metadata gives, so a payload overwritten with something
//! larger cannot break the bound either.
//! NOTE 2 (outages): any error drops the connection; the next call reconnects. After a failed
//! connect, calls fail at once with `Unavailable` until `reconnect_backoff` has passed, so a
//! dead Redis costs callers microseconds, not a connect timeout each. Callers treat errors as
//! misses and recompute. On a cluster, a dead master fails the calls that touch it until its
//! replica is promoted; the reconnect after that reads the new slot map and hits resume.
//! NOTE 3 (concurrency): one connection behind a mutex; tiers are driven by one background
//! thread, so a pool would buy nothing yet.
//! NOTE 4 (shards): keys live in shards, each a key prefix with its own LRU and usage
//! counter. A single server has one shard (the configured prefix, the layout of every earlier
//! version); a cluster has `cluster_shards`, one hash tag each (NOTE 1 of `redis_link.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use redis::{Cmd, RedisResult};

use crate::redis_link::{cluster_shard_prefixes, Link, Script, Target, Timeouts};
use crate::tier::{BandwidthEstimate, BandwidthMeter, Evicted, Payload, Tier};
use crate::{ChunkKey, TierError};

#[derive(Clone, Debug)]
pub struct RedisTierConfig {
    /// `redis://[user:pass@]host:port[/db]`, or `redis+cluster://[user:pass@]host:port,…`
    /// (seed nodes of a Redis Cluster).
    pub url: String,
    pub name: String,
    /// Namespace of every key; servers that should share chunks use the same prefix.
    pub key_prefix: String,
    /// Payload bytes kept before LRU eviction; `u64::MAX` leaves it to Redis's `maxmemory`.
    /// On a cluster each shard holds `capacity_bytes / cluster_shards`.
    pub capacity_bytes: u64,
    pub connect_timeout: Duration,
    pub io_timeout: Duration,
    pub reconnect_backoff: Duration,
    pub max_in_flight_bytes: u64,
    /// Lifetime of a payload whose metadata was never written (the writer died).
    pub pending_ttl_s: u64,
    /// Shards on a cluster (NOTE 4); ignored on a single server. Servers sharing a cluster
    /// must agree on it.
    pub cluster_shards: usize,
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
            // Sixteen spread over three to a few dozen masters evenly enough, and keep a
            // shard's share of a capacity of a few GiB above a chunk's few MB.
            cluster_shards: 16,
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
    /// Control keys (`usage`, `clock`) the scripts found corrupt and rebuilt.
    pub control_key_repairs: u64,
}

#[derive(Default)]
struct ConnSlot {
    link: Option<Link>,
    retry_at: Option<Instant>,
}

pub struct RedisTier {
    config: RedisTierConfig,
    target: Target,
    timeouts: Timeouts,
    /// Key prefix of each shard (NOTE 4).
    shard_prefixes: Vec<String>,
    shard_capacity_bytes: u64,
    slot: Mutex<ConnSlot>,
    /// Last usage each shard's scripts reported (other servers change them too).
    shard_usage_bytes: Vec<AtomicU64>,
    meter: BandwidthMeter,
    pipelines_sent: AtomicU64,
    max_pipeline_payload_bytes: AtomicU64,
    connects: AtomicU64,
    connect_failures: AtomicU64,
    corrupt_entries: AtomicU64,
    control_key_repairs: AtomicU64,
}

/// The tail of every accounting script's reply: status (`ok`, `repaired` or `corrupt`), the
/// keys concerned and why (NOTE 5 of `redis_scripts.rs`).
type ControlReport = (String, String, String);

impl RedisTier {
    /// Parses the URL; does not connect (the first operation does), so a server can start
    /// while Redis is down.
    pub fn open(config: RedisTierConfig) -> Result<RedisTier, TierError> {
        let invalid = |reason: String| TierError::Invalid {
            tier: config.name.clone(),
            reason,
        };
        crate::config::parse_key_prefix(&config.key_prefix).map_err(invalid)?;
        if config.max_in_flight_bytes == 0 {
            return Err(invalid("max_in_flight_bytes must be positive".into()));
        }
        let timeouts = Timeouts {
            connect: config.connect_timeout,
            io: config.io_timeout,
        };
        let target = Target::open(&config.name, &config.url, &timeouts)?;
        let shard_prefixes = if target.is_cluster() {
            if config.key_prefix.contains(['{', '}']) {
                return Err(invalid(format!(
                    "key prefix {:?}: braces would be read as a cluster hash tag and pin every key to one slot",
                    config.key_prefix
                )));
            }
            if config.cluster_shards == 0 || config.cluster_shards > 16_384 {
                return Err(invalid("cluster_shards must be in 1..=16384".into()));
            }
            cluster_shard_prefixes(&config.key_prefix, config.cluster_shards)
        } else {
            vec![config.key_prefix.clone()]
        };
        let shard_capacity_bytes = config.capacity_bytes / shard_prefixes.len() as u64;
        Ok(RedisTier {
            shard_usage_bytes: shard_prefixes.iter().map(|_| AtomicU64::new(0)).collect(),
            shard_prefixes,
            shard_capacity_bytes,
            config,
            target,
            timeouts,
            slot: Mutex::new(ConnSlot::default()),
            meter: BandwidthMeter::default(),
            pipelines_sent: AtomicU64::new(0),
            max_pipeline_payload_bytes: AtomicU64::new(0),
            connects: AtomicU64::new(0),
            connect_failures: AtomicU64::new(0),
            corrupt_entries: AtomicU64::new(0),
            control_key_repairs: AtomicU64::new(0),
        })
    }

    pub fn config(&self) -> &RedisTierConfig {
        &self.config
    }

    /// Whether this tier is on a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.target.is_cluster()
    }

    /// The key prefix of every shard (one on a single server).
    pub fn shard_prefixes(&self) -> &[String] {
        &self.shard_prefixes
    }

    pub fn stats(&self) -> RedisStats {
        RedisStats {
            pipelines_sent: self.pipelines_sent.load(Ordering::Relaxed),
            max_pipeline_payload_bytes: self.max_pipeline_payload_bytes.load(Ordering::Relaxed),
            connects: self.connects.load(Ordering::Relaxed),
            connect_failures: self.connect_failures.load(Ordering::Relaxed),
            corrupt_entries: self.corrupt_entries.load(Ordering::Relaxed),
            control_key_repairs: self.control_key_repairs.load(Ordering::Relaxed),
        }
    }

    /// Reads the shared usage counters (other servers change them too).
    pub fn refresh_usage_bytes(&self) -> Result<u64, TierError> {
        let cmds = self
            .shard_prefixes
            .iter()
            .map(|p| {
                let mut c = redis::cmd("GET");
                c.arg(format!("{p}usage"));
                (c, false)
            })
            .collect();
        let used: Vec<Option<u64>> = self.with_link(|link| link.pipeline(cmds))?;
        for (shard, used) in used.into_iter().enumerate() {
            self.shard_usage_bytes[shard].store(used.unwrap_or(0), Ordering::Relaxed);
        }
        Ok(self.usage_bytes())
    }

    /// The shard of a key: its first eight bytes (a BLAKE3 hash, so uniform) modulo shards.
    fn shard_of(&self, key: &ChunkKey) -> usize {
        let head = u64::from_le_bytes(key.0[..8].try_into().unwrap());
        (head % self.shard_prefixes.len() as u64) as usize
    }

    fn data_key(&self, key: &ChunkKey) -> String {
        format!("{}d:{key}", self.shard_prefixes[self.shard_of(key)])
    }

    fn meta_key(&self, key: &ChunkKey) -> String {
        format!("{}m:{key}", self.shard_prefixes[self.shard_of(key)])
    }

    /// A script call on `shard`: the shard's LRU key routes it, its prefix is ARGV[1].
    fn script(&self, link: &Link, script: Script, shard: usize) -> Cmd {
        let prefix = &self.shard_prefixes[shard];
        let mut cmd = link.script(script, &format!("{prefix}lru"));
        cmd.arg(prefix);
        cmd
    }

    /// Runs `op` on a live connection, connecting first if needed (NOTE 2).
    fn with_link<T>(&self, op: impl FnOnce(&mut Link) -> RedisResult<T>) -> Result<T, TierError> {
        let mut slot = self.slot.lock().unwrap();
        if slot.link.is_none() {
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
            match self.target.connect(&self.timeouts) {
                Ok(link) => {
                    slot.link = Some(link);
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
        let result = op(slot.link.as_mut().unwrap());
        if let Err(e) = &result {
            // Whatever went wrong, the connection may hold a half-read reply: start afresh.
            tracing::warn!(tier = %self.config.name, error = %e, "redis operation failed; dropping the connection");
            slot.link = None;
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

    /// Only a shard's capacity limits an entry's size. An entry above `max_in_flight_bytes`
    /// travels in a pipeline of its own (NOTE 1): refusing it would make the default
    /// 256-token chunk of even a small model (5.9 MB for SmolLM2-135M at f16) impossible to
    /// store.
    fn too_large(&self, size_bytes: u64) -> Option<TierError> {
        let limit_bytes = self.shard_capacity_bytes;
        (size_bytes > limit_bytes).then(|| TierError::TooLarge {
            tier: self.config.name.clone(),
            size_bytes,
            limit_bytes,
        })
    }

    /// Shards in `keys`' order of first appearance, each with the indices of its keys.
    fn group_by_shard<'k>(
        &self,
        keys: impl Iterator<Item = &'k ChunkKey>,
    ) -> Vec<(usize, Vec<usize>)> {
        let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
        for (i, key) in keys.enumerate() {
            let shard = self.shard_of(key);
            match groups.iter_mut().find(|(s, _)| *s == shard) {
                Some((_, members)) => members.push(i),
                None => groups.push((shard, vec![i])),
            }
        }
        groups
    }

    /// Logs what a script reported about the control keys; a corrupt one is an error that
    /// names the key (NOTE 5 of `redis_scripts.rs`).
    fn check_control(&self, (status, key, reason): ControlReport) -> Result<(), TierError> {
        match status.as_str() {
            "ok" => Ok(()),
            "repaired" => {
                tracing::warn!(tier = %self.config.name, %key, %reason, "repaired a corrupt redis control key");
                self.control_key_repairs.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            _ => {
                tracing::warn!(tier = %self.config.name, %key, %reason, "redis control key is corrupt; writes refused");
                Err(TierError::CorruptKey {
                    tier: self.config.name.clone(),
                    key,
                    reason,
                })
            }
        }
    }

    /// One pipeline: every payload (pending), then one COMMIT per shard that makes them
    /// visible.
    fn store_batch(&self, batch: &[(ChunkKey, Payload)]) -> Result<(), TierError> {
        let batch_bytes: u64 = batch.iter().map(|(_, p)| p.len() as u64).sum();
        let groups = self.group_by_shard(batch.iter().map(|(k, _)| k));
        type CommitReply = (u64, u64, u64, String, String, String);
        let results: Vec<CommitReply> = self.with_link(|link| {
            let mut cmds = Vec::with_capacity(batch.len() + groups.len());
            for (key, payload) in batch {
                let mut set = redis::cmd("SET");
                set.arg(self.data_key(key))
                    .arg(&payload[..])
                    .arg("EX")
                    .arg(self.config.pending_ttl_s);
                cmds.push((set, true));
            }
            for (shard, members) in &groups {
                let mut commit = self.script(link, Script::Commit, *shard);
                commit.arg(self.shard_capacity_bytes);
                for &i in members {
                    let (key, payload) = &batch[i];
                    let meta = format!("v1 {} {}", payload.len(), crc32c::crc32c(payload));
                    commit.arg(key.to_hex()).arg(payload.len()).arg(meta);
                }
                cmds.push((commit, false));
            }
            link.pipeline(cmds)
        })?;
        self.note_pipeline(batch_bytes);
        let (mut committed, mut evicted, mut refused) = (0, 0, None);
        for ((shard, _), (c, e, used, status, key, reason)) in groups.iter().zip(results) {
            if let Err(err) = self.check_control((status, key, reason)) {
                // The other shards' commits stand; the payloads of this one expire unseen.
                refused.get_or_insert(err);
                continue;
            }
            committed += c;
            evicted += e;
            self.shard_usage_bytes[*shard].store(used, Ordering::Relaxed);
        }
        if let Some(err) = refused {
            return Err(err);
        }
        if committed < batch.len() as u64 {
            tracing::warn!(tier = %self.config.name, committed, sent = batch.len(), "payloads vanished before commit (redis maxmemory?)");
        }
        if evicted > 0 {
            tracing::debug!(tier = %self.config.name, evicted, "redis tier evicted LRU entries");
        }
        Ok(())
    }

    /// Deletes entries. They are deleted even while a control key is corrupt (that is only
    /// logged), so that bad bytes are never served twice.
    fn drop_entries(&self, keys: &[ChunkKey]) -> Result<u64, TierError> {
        let groups = self.group_by_shard(keys.iter());
        let results: Vec<(u64, u64, String, String, String)> = self.with_link(|link| {
            let cmds = groups
                .iter()
                .map(|(shard, members)| {
                    let mut drop = self.script(link, Script::Drop, *shard);
                    for &i in members {
                        drop.arg(keys[i].to_hex());
                    }
                    (drop, false)
                })
                .collect();
            link.pipeline(cmds)
        })?;
        let mut deleted = 0;
        for ((shard, _), (d, used, status, key, reason)) in groups.iter().zip(results) {
            deleted += d;
            if self.check_control((status, key, reason)).is_ok() {
                self.shard_usage_bytes[*shard].store(used, Ordering::Relaxed);
            }
        }
        Ok(deleted)
    }
}

/// Parses `v1 <len> <crc32c>`.
/// The longest metadata [`parse_meta`] accepts: `v1`, a u64 and a u32 in decimal, spaced.
const MAX_META_BYTES: usize = 2 + 1 + 20 + 1 + 10;

fn parse_meta(meta: &[u8]) -> Option<(u64, u32)> {
    if meta.len() > MAX_META_BYTES {
        return None;
    }
    let text = std::str::from_utf8(meta).ok()?;
    let mut fields = text.split(' ');
    if fields.next()? != "v1" {
        return None;
    }
    let len = fields.next()?.parse().ok()?;
    let crc = fields.next()?.parse().ok()?;
    fields.next().is_none().then_some((len, crc))
}

/// `STRLEN` and `GETRANGE` of a payload whose metadata says `len_bytes`: the read stops at
/// that length whatever the key holds, so a payload overwritten with something larger cannot
/// push a pipeline past `max_in_flight_bytes` (NOTE 1); the length tells it apart.
fn bounded_payload_read(data_key: &str, len_bytes: u64) -> [(Cmd, bool); 2] {
    let mut strlen = redis::cmd("STRLEN");
    strlen.arg(data_key);
    let mut range = redis::cmd("GETRANGE");
    // `GETRANGE k 0 -1` would read the whole value; `1 0` reads nothing.
    match len_bytes.checked_sub(1) {
        Some(last) => range.arg(data_key).arg(0).arg(last),
        None => range.arg(data_key).arg(1).arg(0),
    };
    [(strlen, false), (range, false)]
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
        // Read with GETRANGE up to one byte past the longest valid metadata, so that a huge
        // value written over it behind the tier's back costs no more than that to find out.
        let metas: Vec<Option<Vec<u8>>> = self.with_link(|link| {
            let cmds = keys
                .iter()
                .map(|key| {
                    let mut get = redis::cmd("GETRANGE");
                    get.arg(self.meta_key(key)).arg(0).arg(MAX_META_BYTES);
                    (get, false)
                })
                .collect();
            link.pipeline(cmds)
        })?;
        let mut out: Vec<Option<Payload>> = vec![None; keys.len()];
        let mut corrupt: Vec<ChunkKey> = Vec::new();
        let mut hits: Vec<(usize, u64, u32)> = Vec::new();
        for (i, meta) in metas.iter().enumerate() {
            // GETRANGE answers an empty string for a missing key; no metadata is empty.
            let meta = meta.as_deref().filter(|m| !m.is_empty());
            match meta.map(parse_meta) {
                None => {}
                Some(Some((len, crc))) => hits.push((i, len, crc)),
                Some(None) => corrupt.push(keys[i]),
            }
        }
        // Round trips 2..: payloads, at most `max_in_flight_bytes` per pipeline, each led by
        // one TOUCH per shard that refreshes the LRU.
        let mut bytes_read = 0u64;
        let sizes_bytes: Vec<u64> = hits.iter().map(|h| h.1).collect();
        for range in batches(&sizes_bytes, self.config.max_in_flight_bytes) {
            let batch = &hits[range];
            let groups = self.group_by_shard(batch.iter().map(|&(i, _, _)| &keys[i]));
            let replies: Vec<(u64, Vec<u8>)> = self.with_link(|link| {
                let mut cmds = Vec::with_capacity(groups.len() + 2 * batch.len());
                for (shard, members) in &groups {
                    let mut touch = self.script(link, Script::Touch, *shard);
                    for &m in members {
                        touch.arg(keys[batch[m].0].to_hex());
                    }
                    cmds.push((touch, true));
                }
                for &(i, len, _) in batch {
                    cmds.extend(bounded_payload_read(&self.data_key(&keys[i]), len));
                }
                let flat: Vec<redis::Value> = link.pipeline(cmds)?;
                flat.chunks(2)
                    .map(|pair| redis::from_redis_value(&redis::Value::Array(pair.to_vec())))
                    .collect()
            })?;
            self.note_pipeline(batch.iter().map(|h| h.1).sum());
            for (&(i, len, crc), (stored_len, bytes)) in batch.iter().zip(replies) {
                // A missing payload has length 0, so only a zero-length entry reads as
                // present without one, and its bytes (none) are then right anyway.
                if stored_len == len && bytes.len() as u64 == len && crc32c::crc32c(&bytes) == crc {
                    bytes_read += len;
                    out[i] = Some(Payload::from(bytes));
                } else {
                    corrupt.push(keys[i]);
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
        let found: Vec<bool> = self.with_link(|link| {
            let cmds = keys
                .iter()
                .map(|key| {
                    let mut exists = redis::cmd("EXISTS");
                    exists.arg(self.meta_key(key));
                    (exists, false)
                })
                .collect();
            link.pipeline(cmds)
        })?;
        self.meter.record_access(started.elapsed());
        Ok(found)
    }

    fn delete(&self, key: &ChunkKey) -> Result<bool, TierError> {
        Ok(self.drop_entries(std::slice::from_ref(key))? > 0)
    }

    fn capacity_bytes(&self) -> u64 {
        self.config.capacity_bytes
    }

    fn usage_bytes(&self) -> u64 {
        self.shard_usage_bytes
            .iter()
            .map(|u| u.load(Ordering::Relaxed))
            .sum()
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
    fn cluster_urls_open_with_spread_shards() {
        let tier = RedisTier::open(RedisTierConfig::new(
            "redis+cluster://127.0.0.1:1,127.0.0.1:2",
        ))
        .unwrap();
        assert!(tier.is_cluster());
        assert_eq!(tier.shard_prefixes().len(), 16);
        let mut config = RedisTierConfig::new("redis+cluster://127.0.0.1:1");
        config.key_prefix = "team{a}:".into();
        let err = RedisTier::open(config).err().unwrap();
        assert!(err.to_string().contains("hash tag"), "{err}");
        let err = RedisTier::open(RedisTierConfig::new("redis+cluster://127.0.0.1"))
            .err()
            .unwrap();
        assert!(err.to_string().contains("host:port"), "{err}");
        let mut config = RedisTierConfig::new("redis://127.0.0.1:1");
        config.key_prefix = String::new();
        let err = RedisTier::open(config).err().unwrap();
        assert!(err.to_string().contains("key prefix is empty"), "{err}");
        let single = RedisTier::open(RedisTierConfig::new("redis://127.0.0.1:1")).unwrap();
        assert_eq!(single.shard_prefixes(), ["pk:tiers:v1:"]);
    }
}
