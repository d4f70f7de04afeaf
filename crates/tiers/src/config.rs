//! Tier configuration from strings, for the CLI: `--tier-ram 2GiB`,
//! `--tier-disk PATH:20GiB`, `--tier-redis redis://127.0.0.1:6379[?capacity=8GiB&prefix=pk:]`.
//! Flags are given fastest tier first; [`open_tier`] builds each one.

use std::path::PathBuf;
use std::sync::Arc;

use crate::{DiskTier, DiskTierConfig, RamTier, RedisTier, RedisTierConfig, Tier, TierError};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TierConfig {
    Ram {
        capacity_bytes: u64,
    },
    Disk {
        dir: PathBuf,
        capacity_bytes: u64,
        /// See [`DiskTierConfig::drop_page_cache`]; config files only (the flag has no room).
        drop_page_cache: bool,
    },
    /// `url` without pagekeeper's own query parameters.
    Redis {
        url: String,
        capacity_bytes: Option<u64>,
        key_prefix: Option<String>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("bad byte size {input:?}: {reason} (examples: 512MiB, 2GiB, 1.5GiB, 4096)")]
    ByteSize { input: String, reason: &'static str },
    #[error("bad --tier-disk {input:?}: expected PATH:SIZE, e.g. /var/cache/pagekeeper:20GiB")]
    DiskSpec { input: String },
    #[error("bad --tier-redis {input:?}: {reason}")]
    RedisUrl { input: String, reason: String },
    #[error("unknown tier flag {flag:?}: expected --tier-ram, --tier-disk or --tier-redis")]
    UnknownFlag { flag: String },
}

/// `"2GiB"` → 2147483648. Binary suffixes (KiB, MiB, GiB, TiB), decimal ones (KB, MB, GB, TB),
/// `B` or none; fractions allowed (`1.5GiB`). Case-insensitive suffix, spaces allowed.
pub fn parse_byte_size(input: &str) -> Result<u64, ConfigError> {
    let err = |reason| ConfigError::ByteSize {
        input: input.to_owned(),
        reason,
    };
    let s = input.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(split);
    if number.is_empty() {
        return Err(err("no number"));
    }
    let multiplier: u64 = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" | "k" => 1 << 10,
        "mib" | "m" => 1 << 20,
        "gib" | "g" => 1 << 30,
        "tib" | "t" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(err("unknown suffix")),
    };
    let bytes = if let Ok(whole) = number.parse::<u64>() {
        whole
            .checked_mul(multiplier)
            .ok_or_else(|| err("too large"))?
    } else {
        let value: f64 = number.parse().map_err(|_| err("not a number"))?;
        let bytes = value * multiplier as f64;
        if !bytes.is_finite() || bytes >= u64::MAX as f64 {
            return Err(err("too large"));
        }
        bytes.round() as u64
    };
    if bytes == 0 {
        return Err(err("must be positive"));
    }
    Ok(bytes)
}

impl TierConfig {
    /// Parses one flag's value; `flag` is `--tier-ram`, `--tier-disk` or `--tier-redis`.
    pub fn parse(flag: &str, value: &str) -> Result<TierConfig, ConfigError> {
        match flag.trim_start_matches('-') {
            "tier-ram" => Self::parse_ram(value),
            "tier-disk" => Self::parse_disk(value),
            "tier-redis" => Self::parse_redis(value),
            _ => Err(ConfigError::UnknownFlag {
                flag: flag.to_owned(),
            }),
        }
    }

    pub fn parse_ram(value: &str) -> Result<TierConfig, ConfigError> {
        Ok(TierConfig::Ram {
            capacity_bytes: parse_byte_size(value)?,
        })
    }

    /// `PATH:SIZE`, split at the last colon so paths may contain colons.
    pub fn parse_disk(value: &str) -> Result<TierConfig, ConfigError> {
        let bad = || ConfigError::DiskSpec {
            input: value.to_owned(),
        };
        let (path, size) = value.rsplit_once(':').ok_or_else(bad)?;
        if path.is_empty() {
            return Err(bad());
        }
        Ok(TierConfig::Disk {
            dir: PathBuf::from(path),
            capacity_bytes: parse_byte_size(size)?,
            drop_page_cache: false,
        })
    }

    pub fn parse_redis(value: &str) -> Result<TierConfig, ConfigError> {
        let bad = |reason: String| ConfigError::RedisUrl {
            input: value.to_owned(),
            reason,
        };
        if !(value.starts_with("redis://")
            || value.starts_with("redis+cluster://")
            || value.starts_with("rediss://")
            || value.starts_with("redis+unix://"))
        {
            return Err(bad(
                "expected a redis:// URL or redis+cluster://host:port,host:port,…".into(),
            ));
        }
        let (base, query) = value.split_once('?').unwrap_or((value, ""));
        let (mut capacity_bytes, mut key_prefix) = (None, None);
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("capacity", size)) => {
                    capacity_bytes = Some(parse_byte_size(size).map_err(|e| bad(e.to_string()))?)
                }
                Some(("prefix", prefix)) => {
                    key_prefix = Some(parse_key_prefix(prefix).map_err(bad)?)
                }
                _ => {
                    return Err(bad(format!(
                        "unknown parameter {pair:?} (known: capacity=SIZE, prefix=STRING)"
                    )))
                }
            }
        }
        if base.starts_with("redis+cluster://") {
            crate::redis_link::cluster_seed_urls("redis", base).map_err(|e| bad(e.to_string()))?;
        } else {
            redis::Client::open(base).map_err(|e| bad(e.to_string()))?;
        }
        Ok(TierConfig::Redis {
            url: base.to_owned(),
            capacity_bytes,
            key_prefix,
        })
    }
}

/// Checks a Redis key prefix, from a URL's `?prefix=` or a config file alike. An empty one
/// is refused: the tier's keys (`lru`, `usage`, `d:<hex>`, …) would then sit bare in the
/// keyspace, among whatever else the database holds.
pub fn parse_key_prefix(prefix: &str) -> Result<String, String> {
    if prefix.is_empty() {
        return Err("the key prefix is empty; give one such as pk:tiers:v1: (servers that share chunks use the same one)".into());
    }
    Ok(prefix.to_owned())
}

/// Builds a tier. Redis does not connect here (the first operation does), so a server starts
/// even while Redis is down.
pub fn open_tier(config: &TierConfig) -> Result<Arc<dyn Tier>, TierError> {
    Ok(match config {
        TierConfig::Ram { capacity_bytes } => Arc::new(RamTier::new(*capacity_bytes)),
        TierConfig::Disk {
            dir,
            capacity_bytes,
            drop_page_cache,
        } => {
            let mut c = DiskTierConfig::new(dir, *capacity_bytes);
            c.drop_page_cache = *drop_page_cache;
            Arc::new(DiskTier::open(c)?)
        }
        TierConfig::Redis {
            url,
            capacity_bytes,
            key_prefix,
        } => {
            let mut c = RedisTierConfig::new(url);
            if let Some(capacity_bytes) = capacity_bytes {
                c.capacity_bytes = *capacity_bytes;
            }
            if let Some(prefix) = key_prefix {
                c.key_prefix = prefix.clone();
            }
            Arc::new(RedisTier::open(c)?)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_byte_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_byte_size("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_byte_size("1.5gib"), Ok(3 << 29));
        assert_eq!(parse_byte_size("4096"), Ok(4096));
        assert_eq!(parse_byte_size("10GB"), Ok(10_000_000_000));
        for bad in ["", "GiB", "2XB", "0", "99999999999TiB", "1.2.3MiB", "-1GiB"] {
            assert!(parse_byte_size(bad).is_err(), "{bad:?} accepted");
        }
        let msg = parse_byte_size("2XB").unwrap_err().to_string();
        assert!(
            msg.contains("unknown suffix") && msg.contains("2GiB"),
            "{msg}"
        );
    }

    #[test]
    fn tier_flags() {
        assert_eq!(
            TierConfig::parse("--tier-ram", "2GiB"),
            Ok(TierConfig::Ram {
                capacity_bytes: 2 << 30
            })
        );
        assert_eq!(
            TierConfig::parse("--tier-disk", "/mnt/a:b/cache:20GiB"),
            Ok(TierConfig::Disk {
                dir: "/mnt/a:b/cache".into(),
                capacity_bytes: 20 << 30,
                drop_page_cache: false
            })
        );
        assert!(matches!(
            TierConfig::parse("--tier-disk", "/mnt/cache"),
            Err(ConfigError::DiskSpec { .. })
        ));
        assert!(matches!(
            TierConfig::parse("--tier-disk", ":1GiB"),
            Err(ConfigError::DiskSpec { .. })
        ));
        assert_eq!(
            TierConfig::parse("--tier-redis", "redis://127.0.0.1:6379"),
            Ok(TierConfig::Redis {
                url: "redis://127.0.0.1:6379".into(),
                capacity_bytes: None,
                key_prefix: None
            })
        );
        assert_eq!(
            TierConfig::parse("--tier-redis", "redis://h:1/2?capacity=8GiB&prefix=team:"),
            Ok(TierConfig::Redis {
                url: "redis://h:1/2".into(),
                capacity_bytes: Some(8 << 30),
                key_prefix: Some("team:".into())
            })
        );
        assert_eq!(
            TierConfig::parse("--tier-redis", "redis+cluster://h:7000,h:7001?prefix=team:"),
            Ok(TierConfig::Redis {
                url: "redis+cluster://h:7000,h:7001".into(),
                capacity_bytes: None,
                key_prefix: Some("team:".into())
            })
        );
        let cluster = TierConfig::parse("--tier-redis", "redis+cluster://h")
            .unwrap_err()
            .to_string();
        assert!(cluster.contains("host:port"), "{cluster}");
        assert!(TierConfig::parse("--tier-redis", "http://h").is_err());
        assert!(TierConfig::parse("--tier-redis", "redis://h:1?ttl=5").is_err());
        let empty = TierConfig::parse("--tier-redis", "redis://h:1?prefix=")
            .unwrap_err()
            .to_string();
        assert!(empty.contains("key prefix is empty"), "{empty}");
        assert!(matches!(
            TierConfig::parse("--tier-s3", "x"),
            Err(ConfigError::UnknownFlag { .. })
        ));
    }
}
