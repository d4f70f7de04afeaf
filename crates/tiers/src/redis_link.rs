//! The connection under the Redis tier: one Redis server (`redis://`) or a Redis Cluster
//! (`redis+cluster://host:port,host:port,…`), behind one interface so that the tier's
//! protocol (`redis_scripts.rs`) is written once.
//!
//! NOTE 1 (cluster shards): a cluster spreads keys over 16,384 hash slots by CRC16 of the key
//! (or of its `{hash tag}`), and runs a script atomically only over keys of one slot. The
//! tier's scripts keep an entry, its metadata and the LRU and usage accounting consistent, so
//! on a cluster the key space is cut into `cluster_shards` shards, each under its own hash
//! tag. Shard k's tag is chosen so that its slot lies in the k-th of `cluster_shards` equal
//! slot ranges: `redis-cli --cluster create` gives masters equal contiguous ranges, so the
//! shards (and the bytes) spread evenly over the masters. No tag pins everything to one
//! slot. Each shard is its own exact LRU holding `capacity_bytes / cluster_shards`; an entry
//! goes to the shard its key's first bytes name. Every server sharing a cluster must use the
//! same prefix and shard count (the defaults are the same everywhere).
//! NOTE 2 (scripts on a cluster): scripts travel as `EVAL` with their source. redis-rs cannot
//! route `EVALSHA` in a cluster pipeline, and a replica promoted by a failover starts with an
//! empty script cache; the sources are under 1 KiB next to payloads of megabytes.
//! NOTE 3 (pipelines): a cluster pipeline is split by redis-rs into one pipeline per master
//! (all sent, then all read). When a reply is MOVED or ASK (a slot migrating), the commands
//! are resent one at a time, each following its redirects; any other error fails the whole
//! call, which the tier's callers treat as a miss.

use std::time::Duration;

use redis::cluster::{ClusterClient, ClusterClientBuilder, ClusterConnection};
use redis::{Cmd, Connection, ConnectionLike, FromRedisValue, RedisResult};

use crate::{redis_scripts, TierError};

fn invalid(tier: &str, reason: String) -> TierError {
    TierError::Invalid {
        tier: tier.to_owned(),
        reason,
    }
}

/// Hash slots of a Redis Cluster.
const CLUSTER_SLOTS: u32 = 16_384;

/// The cluster slot of a key: CRC16-XMODEM of the key, or of its hash tag when it has one.
pub(crate) fn cluster_slot(key: &[u8]) -> u16 {
    let hashed = match key.iter().position(|&b| b == b'{') {
        Some(open) => match key[open + 1..].iter().position(|&b| b == b'}') {
            Some(len) if len > 0 => &key[open + 1..open + 1 + len],
            _ => key,
        },
        None => key,
    };
    (u32::from(crc16::State::<crc16::XMODEM>::calculate(hashed)) % CLUSTER_SLOTS) as u16
}

/// Shard prefixes for a cluster (NOTE 1): `{prefix}{pk<k>-<j>}:` with the smallest `j` that
/// puts shard k's slot in the k-th equal slot range. Deterministic, so every server agrees.
pub(crate) fn cluster_shard_prefixes(key_prefix: &str, shards: usize) -> Vec<String> {
    let shards = shards.clamp(1, CLUSTER_SLOTS as usize) as u32;
    (0..shards)
        .map(|k| {
            let range = (k * CLUSTER_SLOTS / shards)..((k + 1) * CLUSTER_SLOTS / shards);
            (0u32..)
                .map(|j| format!("pk{k}-{j}"))
                .find(|tag| range.contains(&u32::from(cluster_slot(tag.as_bytes()))))
                .map(|tag| format!("{key_prefix}{{{tag}}}:"))
                .expect("some tag hashes into every slot range")
        })
        .collect()
}

/// Splits `redis+cluster://[user:pass@]host:port,host:port,…` into one `redis://` URL per
/// seed node (the credentials apply to every node).
pub(crate) fn cluster_seed_urls(tier: &str, url: &str) -> Result<Vec<String>, TierError> {
    let rest = url.strip_prefix("redis+cluster://").ok_or_else(|| {
        invalid(
            tier,
            format!("{url}: expected redis+cluster://host:port,host:port,…"),
        )
    })?;
    let (auth, hosts) = match rest.rsplit_once('@') {
        Some((auth, hosts)) => (format!("{auth}@"), hosts),
        None => (String::new(), rest),
    };
    let hosts = hosts.trim_end_matches('/');
    let mut out = Vec::new();
    for host in hosts.split(',') {
        let host = host.trim();
        let valid = host
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
        if !valid || host.contains('/') {
            return Err(invalid(
                tier,
                format!(
                    "{url}: seed node {host:?} is not host:port (a cluster has no database number)"
                ),
            ));
        }
        out.push(format!("redis://{auth}{host}"));
    }
    Ok(out)
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum Script {
    Commit,
    Touch,
    Drop,
}

impl Script {
    fn source(self) -> &'static str {
        match self {
            Script::Commit => redis_scripts::COMMIT,
            Script::Touch => redis_scripts::TOUCH,
            Script::Drop => redis_scripts::DROP,
        }
    }
}

/// Where the tier connects; parsed at open, connected at first use.
pub(crate) enum Target {
    Single(redis::Client),
    Cluster(ClusterClient),
}

pub(crate) struct Timeouts {
    pub connect: Duration,
    pub io: Duration,
}

impl Target {
    pub fn open(tier: &str, url: &str, timeouts: &Timeouts) -> Result<Target, TierError> {
        if url.starts_with("redis+cluster://") {
            let seeds = cluster_seed_urls(tier, url)?;
            let client = ClusterClientBuilder::new(seeds)
                .connection_timeout(timeouts.connect)
                .response_timeout(timeouts.io)
                // A MOVED or ASK reply (a resharding) needs a retry or two after the slot map
                // is refreshed; more would only stretch an outage the caller treats as a miss.
                .retries(4)
                .min_retry_wait(10)
                .max_retry_wait(100)
                .build()
                .map_err(|e| invalid(tier, format!("bad cluster URL {url}: {e}")))?;
            return Ok(Target::Cluster(client));
        }
        let client =
            redis::Client::open(url).map_err(|e| invalid(tier, format!("bad URL {url}: {e}")))?;
        Ok(Target::Single(client))
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self, Target::Cluster(_))
    }

    pub fn connect(&self, timeouts: &Timeouts) -> RedisResult<Link> {
        match self {
            Target::Single(client) => {
                let mut conn = client.get_connection_with_timeout(timeouts.connect)?;
                conn.set_read_timeout(Some(timeouts.io))?;
                conn.set_write_timeout(Some(timeouts.io))?;
                // Loaded on every connect: a restarted Redis has an empty script cache.
                let mut load = |s: Script| -> RedisResult<String> {
                    redis::cmd("SCRIPT")
                        .arg("LOAD")
                        .arg(s.source())
                        .query(&mut conn)
                };
                let shas = [
                    load(Script::Commit)?,
                    load(Script::Touch)?,
                    load(Script::Drop)?,
                ];
                Ok(Link::Single { conn, shas })
            }
            Target::Cluster(client) => {
                let conn = client.get_connection()?;
                conn.set_write_timeout(Some(timeouts.io))?;
                Ok(Link::Cluster(conn))
            }
        }
    }
}

/// A live connection.
pub(crate) enum Link {
    Single { conn: Connection, shas: [String; 3] },
    Cluster(ClusterConnection),
}

impl Link {
    /// `EVALSHA`/`EVAL` of `script` with one declared key, `route_key`, which names the
    /// shard's slot (the scripts derive their keys from the shard prefix in ARGV[1]).
    pub fn script(&self, script: Script, route_key: &str) -> Cmd {
        let mut cmd = match self {
            Link::Single { shas, .. } => {
                let mut c = redis::cmd("EVALSHA");
                c.arg(&shas[script as usize]);
                c
            }
            Link::Cluster(_) => {
                let mut c = redis::cmd("EVAL");
                c.arg(script.source());
                c
            }
        };
        cmd.arg(1).arg(route_key);
        cmd
    }

    /// Runs `cmds` as one pipeline (one per master on a cluster); commands flagged `true` are
    /// left out of the reply.
    pub fn pipeline<T: FromRedisValue>(&mut self, cmds: Vec<(Cmd, bool)>) -> RedisResult<T> {
        match self {
            Link::Single { conn, .. } => {
                let mut pipe = redis::pipe();
                for (cmd, ignore) in cmds {
                    pipe.add_command(cmd);
                    if ignore {
                        pipe.ignore();
                    }
                }
                pipe.query(conn)
            }
            Link::Cluster(conn) => {
                let ignored: Vec<bool> = cmds.iter().map(|(_, ignore)| *ignore).collect();
                let mut pipe = redis::cluster::cluster_pipe();
                for (cmd, ignore) in cmds {
                    pipe.add_command(cmd);
                    if ignore {
                        pipe.ignore();
                    }
                }
                match pipe.query(conn) {
                    Err(e) if e.is_cluster_error() => {
                        // A slot is migrating (ASK) or has moved (MOVED). redis-rs's sync
                        // cluster pipeline returns such a reply as the pipeline's error
                        // instead of following it, while a single command follows its
                        // redirects: send them one at a time. Every command the tier sends
                        // is idempotent, so the ones that already ran may run again.
                        tracing::debug!(error = %e, "cluster redirect inside a pipeline; resending command by command");
                        let mut values = Vec::new();
                        for (cmd, ignore) in pipe.cmd_iter().zip(ignored) {
                            let value = conn.req_command(cmd)?;
                            if !ignore {
                                values.push(value);
                            }
                        }
                        redis::from_owned_redis_value(redis::Value::Array(values))
                    }
                    other => other,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(cluster_slot(b"123456789"), 0x31C3);
        assert_eq!(cluster_slot(b"foo"), 12_182);
        assert_eq!(
            cluster_slot(b"{user1000}.following"),
            cluster_slot(b"user1000")
        );
        assert_eq!(cluster_slot(b"foo{}{bar}"), cluster_slot(b"foo{}{bar}"));
        assert_eq!(cluster_slot(b"foo{{bar}}zap"), cluster_slot(b"{bar"));
    }

    #[test]
    fn shard_tags_spread_over_equal_slot_ranges() {
        let prefixes = cluster_shard_prefixes("pk:tiers:v1:", 16);
        assert_eq!(prefixes.len(), 16);
        for (k, p) in prefixes.iter().enumerate() {
            assert!(p.starts_with("pk:tiers:v1:{pk"), "{p}");
            let slot = u32::from(cluster_slot(format!("{p}lru").as_bytes()));
            assert_eq!(slot * 16 / CLUSTER_SLOTS, k as u32, "{p} in slot {slot}");
        }
        // Deterministic: every server computes the same shards.
        assert_eq!(prefixes, cluster_shard_prefixes("pk:tiers:v1:", 16));
    }

    #[test]
    fn seed_urls() {
        assert_eq!(
            cluster_seed_urls("t", "redis+cluster://127.0.0.1:7000,127.0.0.1:7001").unwrap(),
            vec!["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"]
        );
        assert_eq!(
            cluster_seed_urls("t", "redis+cluster://:pw@h1:1,h2:2/").unwrap(),
            vec!["redis://:pw@h1:1", "redis://:pw@h2:2"]
        );
        assert!(cluster_seed_urls("t", "redis+cluster://h1").is_err());
        assert!(cluster_seed_urls("t", "redis+cluster://h1:1/0").is_err());
        assert!(cluster_seed_urls("t", "redis+cluster://").is_err());
    }
}
