//! The tier flags (`--tier-ram`, `--tier-disk`, `--tier-redis`, `--tier-policy`, the
//! EVICPRESS settings): tiers below the KV pool for reusing prompt KV across requests,
//! restarts and servers, merged with the `--config` file's `[tiers]` (config.rs) and built
//! into the engine's KV reuse connector.

use anyhow::{bail, Result};
use clap::Args;
use pk_tiers::TierConfig;

use crate::config::TiersSection;

/// Tiers below the KV pool for reusing prompt KV across requests, restarts and servers.
#[derive(Args, Clone, Default)]
pub struct TierArgs {
    /// A RAM tier of this many bytes (e.g. 2GiB).
    #[arg(long, env = "PAGEKEEPER_TIER_RAM")]
    pub tier_ram: Option<String>,
    /// A disk tier: DIR:CAPACITY (e.g. /var/cache/pk:20GiB); survives restarts.
    #[arg(long, env = "PAGEKEEPER_TIER_DISK")]
    pub tier_disk: Option<String>,
    /// A Redis tier shared by several servers (redis://host:port[?capacity=8GiB]).
    #[arg(long, env = "PAGEKEEPER_TIER_REDIS")]
    pub tier_redis: Option<String>,
    /// Tokens per stored chunk (a multiple of the block size; default 256).
    #[arg(long, env = "PAGEKEEPER_TIER_CHUNK_TOKENS")]
    pub tier_chunk_tokens: Option<usize>,
    /// With a model whose sliding-window layers keep KV cache groups (Gemma 3): store those
    /// layers' window at every multiple of this many tokens inside a prompt, besides its
    /// end, so that a prompt sharing only a prefix still hits there (a multiple of the chunk
    /// size; default 2048). Refused for a model without groups.
    #[arg(long, env = "PAGEKEEPER_TIER_WINDOW_CHECKPOINT_TOKENS")]
    pub tier_window_checkpoint_tokens: Option<usize>,
    /// How stored KV uses the tiers: lru (256-token chunks, uncompressed, LMCache-like) or
    /// evicpress (whole contexts, compression and tier chosen per context by utility).
    #[arg(long, env = "PAGEKEEPER_TIER_POLICY", default_value = "lru", value_parser = ["lru", "evicpress"])]
    pub tier_policy: String,
    /// EVICPRESS α: seconds of TTFT one unit of quality is worth.
    #[arg(long, env = "PAGEKEEPER_EVICPRESS_ALPHA", default_value_t = 1.0)]
    pub evicpress_alpha: f64,
    /// EVICPRESS configurations, comma-separated (e.g. q8,q4,knorm-0.5,paged-eviction-0.8).
    #[arg(long, env = "PAGEKEEPER_EVICPRESS_GRID")]
    pub evicpress_grid: Option<String>,
    /// Rank EVICPRESS's greedy by utility drop per byte freed (AdaptCache) instead of absolute drop.
    #[arg(long)]
    pub evicpress_per_byte: bool,
    /// How profiling scores a configuration: f1 (token-F1 of its greedy answers against the
    /// full KV's) or teacher-forced (how often it predicts the full KV's answer tokens).
    #[arg(long, env = "PAGEKEEPER_EVICPRESS_PROFILE_METRIC", default_value = "f1", value_parser = parse_profile_metric)]
    pub evicpress_profile_metric: pk_connectors::profiler::QualityMetric,
    /// Copies the EVICPRESS store keeps of a context: master-and-placed (default: an
    /// uncompressed master on the slowest tier beside the placed copy, so a hit can fall
    /// back to it and contexts are adopted after a restart) or placed-only (the placed copy
    /// alone, as the EVICPRESS paper's store: compression lets more contexts fit when the
    /// tiers hold less than the working set, the slowest tier's capacity is enforced by
    /// placement, an unreadable copy is recomputed, and nothing is adopted after a restart).
    #[arg(long, env = "PAGEKEEPER_EVICPRESS_COPIES", value_parser = parse_copies)]
    pub evicpress_copies: Option<pk_evicpress::Copies>,
    /// Tiers from the `--config` file, used for those no flag or env sets (config.rs).
    #[arg(skip)]
    pub from_file: Option<TiersSection>,
}

pub fn parse_copies(s: &str) -> Result<pk_evicpress::Copies, String> {
    match s {
        "master-and-placed" => Ok(pk_evicpress::Copies::MasterAndPlaced),
        "placed-only" => Ok(pk_evicpress::Copies::PlacedOnly),
        _ => Err(format!(
            "unknown copies '{s}' (master-and-placed or placed-only)"
        )),
    }
}

pub fn parse_profile_metric(
    s: &str,
) -> Result<pk_connectors::profiler::QualityMetric, pk_connectors::profiler::UnknownMetric> {
    s.parse()
}

impl TierArgs {
    /// The tiered store, fastest first, or `None` when no tier is configured. The slowest
    /// tier is written through, so that a restart (disk) or another server (Redis) sees
    /// every chunk at once.
    pub fn build(&self) -> Result<Option<pk_connectors::TieringConfig>> {
        if self.tier_policy == "evicpress" {
            return Ok(None);
        }
        let mut tiers = Vec::new();
        for (origin, cfg) in self.tier_configs()? {
            tiers.push(pk_tiers::open_tier(&cfg).map_err(|e| anyhow::anyhow!("{origin}: {e}"))?);
        }
        if tiers.is_empty() {
            return Ok(None);
        }
        let store =
            std::sync::Arc::new(pk_tiers::TieredStore::new(tiers).with_write_through_last(true));
        Ok(Some(pk_connectors::TieringConfig {
            store,
            chunk_size_tokens: self.chunk_tokens(),
            max_pending_bytes: 256 << 20,
            window_checkpoint_tokens: self.tier_window_checkpoint_tokens,
        }))
    }

    /// The engine's KV reuse connector: the EVICPRESS context store with `--tier-policy
    /// evicpress`, else the chunk tiers if any tier is configured.
    pub fn build_reuse(&self) -> Result<Option<pk_connectors::ReuseConfig>> {
        if self.tier_window_checkpoint_tokens.is_some() && self.tier_configs()?.is_empty() {
            bail!("--tier-window-checkpoint-tokens is not used without a tier: add --tier-ram, --tier-disk or --tier-redis");
        }
        if self.tier_chunk_tokens.is_some() && self.tier_configs()?.is_empty() {
            bail!("--tier-chunk-tokens (or the config file's tiers.chunk_tokens) is not used without a tier: add --tier-ram, --tier-disk or --tier-redis");
        }
        if let Some(c) = self.build_contexts()? {
            return Ok(Some(pk_connectors::ReuseConfig::Contexts(c)));
        }
        Ok(self.build()?.map(pk_connectors::ReuseConfig::Chunks))
    }

    /// The EVICPRESS context store over the configured tiers, with `--tier-policy evicpress`.
    pub fn build_contexts(&self) -> Result<Option<pk_connectors::ContextReuseConfig>> {
        if self.tier_policy != "evicpress" {
            return Ok(None);
        }
        let store = crate::tier_policy::evicpress_config(
            &self.tier_configs()?,
            self.evicpress_alpha,
            self.evicpress_grid.as_deref(),
            self.evicpress_per_byte,
            self.evicpress_copies.unwrap_or_default(),
        )?;
        Ok(Some(pk_connectors::ContextReuseConfig {
            store,
            chunk_size_tokens: self.chunk_tokens(),
            profile_metric: self.evicpress_profile_metric,
        }))
    }
}

impl TierArgs {
    /// Tokens per stored chunk: flag or env, else the file, else 256.
    pub fn chunk_tokens(&self) -> usize {
        self.tier_chunk_tokens.unwrap_or(256)
    }

    /// The configured tiers, fastest first, each labelled with where it came from (for
    /// error messages): a flag or env value wins over the file's entry for that tier.
    pub fn tier_configs(&self) -> Result<Vec<(String, TierConfig)>> {
        let from_file = self
            .from_file
            .as_ref()
            .map(|f| f.tier_configs())
            .transpose()?
            .unwrap_or_default();
        let mut out = Vec::new();
        for (name, flag, value) in [
            ("ram", "--tier-ram", &self.tier_ram),
            ("disk", "--tier-disk", &self.tier_disk),
            ("redis", "--tier-redis", &self.tier_redis),
        ] {
            if let Some(v) = value {
                out.push((
                    flag.to_owned(),
                    TierConfig::parse(flag, v).map_err(|e| anyhow::anyhow!("{flag}: {e}"))?,
                ));
            } else if let Some((_, config)) = from_file.iter().find(|(n, _)| *n == name) {
                out.push((format!("tiers.{name} (config file)"), config.clone()));
            }
        }
        Ok(out)
    }
}
