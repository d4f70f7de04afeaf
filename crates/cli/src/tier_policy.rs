//! `--tier-policy lru | evicpress`: how the configured tiers are used.
//!
//! - `lru` (default): LMCache-like chunk store (`pk_tiers::TieredStore`), 256-token chunks,
//!   uncompressed, LRU demotion, write-through to the slowest tier.
//! - `evicpress`: an EVICPRESS `ContextStore` on the same tiers: whole chunk-aligned
//!   contexts, each with its own compression and tier chosen by utility; the slowest tier
//!   keeps the uncompressed masters, within its capacity (past it the store drops whole
//!   contexts, the least valuable first; Redis without a size is unlimited, left to its
//!   `maxmemory`). With `--evicpress-copies placed-only` no master is kept: each context
//!   has its placed copy only, every tier's capacity (the slowest one's included) is
//!   enforced by placement, and what does not fit is dropped. The delay model starts
//!   from per-kind priors (RAM 5 GB/s, disk 1 GB/s, Redis 300 MB/s, prefill 400 tokens/s),
//!   which are only placeholders: `serve` measures every figure at start-up
//!   (`pk_connectors::calibrate_context_store`) and serving keeps them current; `/v1/kv/contexts`
//!   shows each figure's source. The engine profiles contexts in its idle time.

use anyhow::{bail, Result};
use pk_evicpress::{DelayModel, Grid, Policy, Ranking, StoreConfig, TierSpec};
use pk_tiers::TierConfig;

/// Builds the EVICPRESS store configuration over `tiers` (fastest first).
pub fn evicpress_config(
    tiers: &[(String, TierConfig)],
    alpha: f64,
    grid: Option<&str>,
    per_byte: bool,
    copies: pk_evicpress::Copies,
) -> Result<StoreConfig> {
    if tiers.is_empty() {
        bail!("--tier-policy evicpress needs at least one tier (--tier-ram, --tier-disk, --tier-redis)");
    }
    if !(alpha.is_finite() && alpha > 0.0) {
        bail!("--evicpress-alpha must be a positive number");
    }
    let grid = match grid {
        Some(g) => Grid::parse(g).map_err(|e| anyhow::anyhow!("--evicpress-grid: {e}"))?,
        None => Grid::default_grid(),
    };
    let mut opened = Vec::new();
    let mut capacities = Vec::new();
    let mut specs = Vec::new();
    for (origin, cfg) in tiers {
        let (name, capacity, bw, latency) = match cfg {
            TierConfig::Ram { capacity_bytes } => ("ram", *capacity_bytes, 5e9, 1e-5),
            TierConfig::Disk { capacity_bytes, .. } => ("disk", *capacity_bytes, 1e9, 2e-4),
            TierConfig::Redis { capacity_bytes, .. } => {
                ("redis", capacity_bytes.unwrap_or(u64::MAX), 3e8, 5e-4)
            }
        };
        // The store keeps its logical capacity; the tier itself gets slack so that it never
        // evicts on its own (disk files carry headers).
        let physical = match cfg {
            TierConfig::Ram { capacity_bytes } => TierConfig::Ram {
                capacity_bytes: capacity_bytes.saturating_mul(2),
            },
            TierConfig::Disk {
                dir,
                capacity_bytes,
                drop_page_cache,
            } => TierConfig::Disk {
                dir: dir.clone(),
                capacity_bytes: capacity_bytes.saturating_mul(2),
                drop_page_cache: *drop_page_cache,
            },
            TierConfig::Redis {
                url,
                capacity_bytes,
                key_prefix,
            } => TierConfig::Redis {
                url: url.clone(),
                capacity_bytes: capacity_bytes.map(|c| c.saturating_mul(2)),
                key_prefix: key_prefix.clone(),
            },
        };
        opened.push(pk_tiers::open_tier(&physical).map_err(|e| anyhow::anyhow!("{origin}: {e}"))?);
        // The last tier's capacity bounds the masters: the store drops whole contexts past
        // it (`pk_evicpress::ContextStore::enforce_last_capacity`).
        capacities.push(capacity);
        specs.push(TierSpec {
            name: name.into(),
            capacity_bytes: capacity,
            read_bytes_per_s: bw,
            access_latency_s: latency,
        });
    }
    Ok(StoreConfig {
        tiers: opened,
        capacities_bytes: capacities,
        grid,
        policy: Policy::Evicpress {
            alpha,
            ranking: if per_byte {
                Ranking::DropPerByte
            } else {
                Ranking::AbsoluteDrop
            },
        },
        fingerprint: [0; 32],
        delay: DelayModel {
            tiers: specs,
            decode_s_per_byte: 2e-10,
            restore_s_per_token: 2e-5,
            prefill_tokens_per_s: 400.0,
            query_tokens: 32,
        },
        frequency_half_life_s: 600.0,
        reprofile_threshold: 0.1,
        max_pending_bytes: 1 << 30,
        max_queries_per_context: 8,
        copies,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every tier's capacity reaches the store, the last one's included (it bounds the
    /// masters); the tier objects get slack above them; Redis without a size is unlimited.
    #[test]
    fn the_last_tiers_capacity_reaches_the_store() {
        let dir = tempfile::tempdir().unwrap();
        let ram = (
            "--tier-ram".to_string(),
            TierConfig::Ram {
                capacity_bytes: 1 << 20,
            },
        );
        let disk = TierConfig::Disk {
            dir: dir.path().to_path_buf(),
            capacity_bytes: 8 << 20,
            drop_page_cache: false,
        };
        let cfg = evicpress_config(
            &[ram.clone(), ("--tier-disk".into(), disk)],
            1.0,
            None,
            false,
            pk_evicpress::Copies::PlacedOnly,
        )
        .unwrap();
        assert_eq!(cfg.capacities_bytes, vec![1 << 20, 8 << 20]);
        assert_eq!(cfg.copies, pk_evicpress::Copies::PlacedOnly);
        assert_eq!(cfg.tiers[1].capacity_bytes(), 16 << 20);
        let redis = TierConfig::Redis {
            url: "redis://127.0.0.1:1".into(),
            capacity_bytes: None,
            key_prefix: None,
        };
        let cfg = evicpress_config(
            &[ram, ("--tier-redis".into(), redis)],
            1.0,
            None,
            false,
            Default::default(),
        )
        .unwrap();
        assert_eq!(cfg.capacities_bytes, vec![1 << 20, u64::MAX]);
    }
}
