//! `pagekeeper bench tiers`: time to first token for a long context whose KV is served from
//! each tier (RAM, disk with a warm and a cold page cache, Redis when configured) against
//! recomputing it, plus each tier's measured read and write bandwidth on the same chunks.
//!
//! Method. The prompt is `--context-tokens` random token ids plus one: the context is whole
//! chunks, and the one extra token is what every run computes (a prompt is never a full hit).
//! 1. Recompute: an engine without tiers runs the prompt `--runs` times (TTFT = the time to
//!    the first token, `max_tokens` 1).
//! 2. An engine with a RAM tier runs it once; its writer thread stores the context's chunks
//!    (pk-codec f16), and those payloads are what every tier is measured with.
//! 3. Per tier: store every chunk (write bandwidth; the disk tier fsyncs), load every chunk
//!    in order (read bandwidth), then an engine whose only tier is this one runs the prompt
//!    `--runs` times. The pool's prefix cache is off, so every run loads the context from the
//!    tier (checked: a run that did not load every chunk is an error).
//!
//! Disk "cold" reopens the directory with `drop_page_cache` (posix_fadvise DONTNEED after
//! writes and reads), so reads come from the device; "warm" leaves the page cache alone,
//! and right after the writes the pages are all cached. RAM loads hand out a shared pointer,
//! so its bandwidth is the tier's memcpy calibration (what copying into the pool costs).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use pk_connectors::{ReuseConfig, Tiering, TieringConfig};
use pk_engine::model_store::resolve_model;
use pk_engine::{Engine, EngineConfig, GenerateParams};
use pk_tiers::{
    ChunkKey, DiskTier, DiskTierConfig, Payload, RamTier, RedisTier, RedisTierConfig, Tier,
    TierConfig, TieredStore,
};
use rand::{Rng, SeedableRng};

#[derive(Args)]
pub struct TiersBenchArgs {
    /// Model, threads, --config; `--tier-disk DIR:SIZE` places the disk tier (default: a
    /// directory under the system temp dir), `--tier-redis URL` adds Redis (skipped if absent),
    /// `--tier-chunk-tokens` sets the chunk size.
    #[command(flatten)]
    pub model: crate::args::ModelArgs,
    /// Tokens of stored context (whole chunks); the prompt is one token longer.
    #[arg(long, default_value_t = 4096)]
    pub context_tokens: usize,
    /// Timed runs per configuration (the table shows the median).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Print one JSON object on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One measured configuration.
struct Row {
    tier: String,
    ttft_runs_s: Vec<f64>,
    read_bytes_per_s: Option<f64>,
    write_bytes_per_s: Option<f64>,
}

/// The context's chunks as the engine stored them: each key and its encoded payload.
type Chunks = Vec<(ChunkKey, Payload)>;

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

struct Bench {
    path: PathBuf,
    base: EngineConfig,
    chunk_tokens: usize,
    /// `--tier-window-checkpoint-tokens` (models with KV cache groups).
    window_checkpoint_tokens: Option<usize>,
    prompt: Vec<u32>,
    /// Chunks the context makes.
    chunks: usize,
}

/// An engine and the tiers attached to it (none: the baseline that prefills).
struct TierEngine {
    engine: Engine,
    tiers: Option<Arc<Tiering>>,
}

impl TierEngine {
    fn chunks_loaded(&self) -> u64 {
        self.tiers.as_ref().map_or(0, |t| t.stats().chunks_loaded)
    }
}

impl std::ops::Deref for TierEngine {
    type Target = Engine;
    fn deref(&self) -> &Engine {
        &self.engine
    }
}

impl std::ops::DerefMut for TierEngine {
    fn deref_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }
}

impl Bench {
    fn engine(&self, tier: Option<Arc<dyn Tier>>) -> Result<TierEngine> {
        let Some(t) = tier else {
            let engine = Engine::load(&self.path, self.base.clone())?;
            return Ok(TierEngine {
                engine,
                tiers: None,
            });
        };
        // The chunk tiers keep KV cache groups: every row runs the same engine.
        let mut engine = Engine::load(&self.path, self.base.clone())?;
        let reuse = ReuseConfig::Chunks(TieringConfig {
            store: Arc::new(TieredStore::new(vec![t])),
            chunk_size_tokens: self.chunk_tokens,
            max_pending_bytes: 1 << 30,
            window_checkpoint_tokens: self.window_checkpoint_tokens,
        });
        let attached = pk_connectors::attach(&mut engine, &reuse)?;
        let tiers = attached.tiering().cloned();
        Ok(TierEngine { engine, tiers })
    }

    /// Times `runs` prompts on `engine`; with `expect_loaded`, each must load every chunk.
    fn ttft_runs(
        &self,
        engine: &mut TierEngine,
        runs: usize,
        expect_loaded: bool,
        label: &str,
    ) -> Result<Vec<f64>> {
        let params = GenerateParams {
            max_tokens: 1,
            ignore_eos: true,
            ..Default::default()
        };
        let mut out = Vec::new();
        for _ in 0..runs {
            let loaded_before = engine.chunks_loaded();
            let started = Instant::now();
            let result = engine.generate(&self.prompt, &params, &mut |_| {})?;
            out.push(started.elapsed().as_secs_f64());
            let loaded = engine.chunks_loaded() - loaded_before;
            if expect_loaded
                && (loaded as usize != self.chunks
                    || result.cached_prompt_tokens != self.chunks * self.chunk_tokens)
            {
                bail!("{label}: a run loaded {loaded} of {} chunks ({} cached tokens); the numbers would not measure the tier", self.chunks, result.cached_prompt_tokens);
            }
        }
        Ok(out)
    }

    /// Stores then loads every chunk directly; returns (read, write) bytes per second.
    fn bandwidth(&self, tier: &dyn Tier, chunks: &[(ChunkKey, Payload)]) -> Result<(f64, f64)> {
        let bytes: usize = chunks.iter().map(|c| c.1.len()).sum();
        let started = Instant::now();
        tier.store_many(chunks)
            .with_context(|| format!("storing into {}", tier.name()))?;
        let write_s = started.elapsed().as_secs_f64();
        let read_s = self.read_all(tier, chunks)?;
        Ok((bytes as f64 / read_s, bytes as f64 / write_s))
    }

    fn read_all(&self, tier: &dyn Tier, chunks: &[(ChunkKey, Payload)]) -> Result<f64> {
        let keys: Vec<ChunkKey> = chunks.iter().map(|c| c.0).collect();
        let started = Instant::now();
        let loaded = tier
            .load_many(&keys)
            .with_context(|| format!("loading from {}", tier.name()))?;
        let read_s = started.elapsed().as_secs_f64();
        if loaded
            .iter()
            .zip(chunks)
            .any(|(got, want)| got.as_deref() != Some(&want.1[..]))
        {
            bail!("{} did not return every chunk intact", tier.name());
        }
        Ok(read_s)
    }
}

/// The disk and Redis tiers as the flags and the config file give them: the disk's
/// directory and capacity (`None`: a temp dir sized to the context), and the Redis tier's
/// URL, capacity and key prefix, under which each run gets a namespace of its own so that
/// it starts cold. (A RAM tier is refused by flag_rules: one is always measured.)
struct Configured {
    disk: Option<(PathBuf, u64)>,
    redis: Option<RedisTierConfig>,
}

fn configured(args: &crate::args::ModelArgs) -> Result<Configured> {
    let mut out = Configured {
        disk: None,
        redis: None,
    };
    for (origin, config) in args.tiers.tier_configs()? {
        match config {
            TierConfig::Disk {
                drop_page_cache: true,
                ..
            } => bail!("{origin}: drop_page_cache is not used by `bench tiers`: it measures the disk tier both with and without the page cache"),
            TierConfig::Disk {
                dir,
                capacity_bytes,
                ..
            } => out.disk = Some((dir, capacity_bytes)),
            TierConfig::Redis {
                url,
                capacity_bytes,
                key_prefix,
            } => {
                let mut c = RedisTierConfig::new(&url);
                if let Some(bytes) = capacity_bytes {
                    c.capacity_bytes = bytes;
                }
                let prefix = key_prefix.unwrap_or_else(|| "pk:".into());
                c.key_prefix = format!("{prefix}bench-tiers:{}:", std::process::id());
                out.redis = Some(c);
            }
            TierConfig::Ram { .. } => {}
        }
    }
    Ok(out)
}

pub fn run(a: TiersBenchArgs) -> Result<()> {
    let (mut bench, configured) = Bench::new(&a)?;
    let mut engine = bench.engine(None)?;
    let vocab = engine.model_config().vocab_size as u32;
    let model_name = engine.model_name.clone();
    if a.context_tokens + 1 > engine.model_config().context_length {
        bail!(
            "--context-tokens {} exceeds the model's context {}",
            a.context_tokens,
            engine.model_config().context_length
        );
    }
    // Random ids (1000.. skips special tokens), one more than the context.
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    bench.prompt = (0..=a.context_tokens)
        .map(|_| rng.gen_range(1000..vocab))
        .collect();
    let progress = |what: &str| {
        if !a.json {
            eprintln!("bench tiers: {what}");
        }
    };

    progress("recomputing");
    let recompute = bench.ttft_runs(&mut engine, a.runs, false, "recompute")?;
    drop(engine);

    progress("storing the context through the engine");
    let (ram, chunks) = bench.store_context()?;
    let mut rows = Vec::new();
    progress("RAM");
    rows.push(bench.ram_row(ram, a.runs)?);
    progress("disk");
    rows.extend(bench.disk_rows(configured.disk, &chunks, a.runs)?);
    match configured.redis {
        Some(c) => {
            progress("Redis");
            rows.push(bench.redis_row(c, &chunks, a.runs)?);
        }
        None => progress("Redis skipped (no --tier-redis, PAGEKEEPER_TIER_REDIS or [tiers.redis])"),
    }
    let report = Report {
        a: &a,
        model_name: &model_name,
        chunk_tokens: bench.chunk_tokens,
        chunks: bench.chunks,
        payloads: chunks.len(),
        stored_bytes: chunks.iter().map(|c| c.1.len()).sum(),
        recompute_runs_s: &recompute,
        rows: &rows,
    };
    if a.json {
        report.print_json();
    } else {
        report.print_table();
    }
    Ok(())
}

/// The chunk size first (a zero one is `--tier-chunk-tokens`'s fault, not the context's),
/// then a context of whole chunks.
fn check_context_and_chunk(context_tokens: usize, chunk_tokens: usize) -> Result<()> {
    if chunk_tokens == 0 {
        bail!("--tier-chunk-tokens (or the config file's tiers.chunk_tokens) must be at least 1");
    }
    if context_tokens == 0 || !context_tokens.is_multiple_of(chunk_tokens) {
        bail!("--context-tokens must be a positive multiple of the chunk size ({chunk_tokens})");
    }
    Ok(())
}

impl Bench {
    /// The bench's settings from the flags and the config file, checked; its prompt is
    /// made once the model's vocabulary is known.
    fn new(a: &TiersBenchArgs) -> Result<(Bench, Configured)> {
        let args = a.model.resolved()?;
        if a.runs == 0 {
            bail!("--runs must be at least 1");
        }
        crate::args::set_threads(args.threads)?;
        let chunk_tokens = args.tiers.chunk_tokens();
        check_context_and_chunk(a.context_tokens, chunk_tokens)?;
        let path = resolve_model(args.model.as_deref(), true)?;
        if args.disable_hybrid_kv_cache_manager {
            let gguf = pk_gguf::GgufFile::open(&path)?;
            let model = pk_model::ModelConfig::from_gguf(&gguf)?;
            crate::args::check_hybrid_flag(true, &model)?;
        }
        let base = EngineConfig {
            block_size_tokens: args.block_size,
            kv_dtype: args.kv_dtype()?,
            kv_capacity_tokens: Some(a.context_tokens + 64),
            enable_prefix_caching: false,
            hybrid_kv_cache: !args.disable_hybrid_kv_cache_manager,
            ..Default::default()
        };
        let configured = configured(&args)?;
        let bench = Bench {
            path,
            base,
            chunk_tokens,
            window_checkpoint_tokens: args.tiers.tier_window_checkpoint_tokens,
            prompt: Vec::new(),
            chunks: a.context_tokens / chunk_tokens,
        };
        Ok((bench, configured))
    }

    /// The context's chunks as the engine encodes them: an engine with a RAM tier runs the
    /// prompt once, and its writer thread stores them there. Returns that tier and its
    /// chunks, in order.
    fn store_context(&self) -> Result<(Arc<RamTier>, Chunks)> {
        let ram = Arc::new(RamTier::new(4 << 30));
        let mut writer = self.engine(Some(ram.clone()))?;
        self.ttft_runs(&mut writer, 1, false, "writer")?;
        let stats = writer.tiers.as_ref().expect("a tier").stats();
        drop(writer); // waits for its writer thread to store every chunk
        let chunks: Chunks = ram
            .keys_lru_first()
            .into_iter()
            .map(|k| (k, ram.load(&k).unwrap().unwrap()))
            .collect();
        // With KV cache groups a chunk's window layers are a payload of their own, stored
        // only where a hit needs them.
        let payloads = stats.chunks_queued + stats.window_chunks_queued;
        if stats.chunks_queued as usize != self.chunks || chunks.len() as u64 != payloads {
            bail!(
                "the engine stored {} payloads ({} chunks and {} chunks' window layers), expected {} chunks",
                chunks.len(),
                stats.chunks_queued,
                stats.window_chunks_queued,
                self.chunks
            );
        }
        Ok((ram, chunks))
    }

    /// The RAM tier: its loads hand out a shared pointer, so its bandwidth is the tier's
    /// memcpy calibration (what copying into the pool costs).
    fn ram_row(&self, ram: Arc<RamTier>, runs: usize) -> Result<Row> {
        let memcpy = ram.bandwidth().read_bytes_per_s;
        let ttft = self.ttft_runs(&mut self.engine(Some(ram.clone()))?, runs, true, "ram")?;
        Ok(Row {
            tier: "ram".into(),
            ttft_runs_s: ttft,
            read_bytes_per_s: memcpy,
            write_bytes_per_s: memcpy,
        })
    }

    /// The disk tier with a warm page cache, then reopened with `drop_page_cache` (cold),
    /// in `configured` (directory, capacity) or else a temp dir removed afterwards.
    fn disk_rows(
        &self,
        configured: Option<(PathBuf, u64)>,
        chunks: &[(ChunkKey, Payload)],
        runs: usize,
    ) -> Result<[Row; 2]> {
        let total_bytes = chunks[0].1.len() * chunks.len();
        // The context's chunks and their file headers; a temp dir gets twice that.
        let needed = total_bytes as u64 + (1 << 20);
        let (dir, capacity, remove_dir) = match configured {
            Some((_, capacity)) if capacity < needed => bail!(
                "--tier-disk: a capacity of {capacity} bytes cannot hold the context's {total_bytes} bytes of chunks"
            ),
            Some((dir, capacity)) => (dir, capacity, false),
            None => (
                std::env::temp_dir().join(format!("pagekeeper-bench-tiers-{}", std::process::id())),
                needed * 2,
                true,
            ),
        };
        let open_disk = |drop_page_cache: bool| -> Result<Arc<DiskTier>> {
            let mut c = DiskTierConfig::new(&dir, capacity);
            c.drop_page_cache = drop_page_cache;
            Ok(Arc::new(DiskTier::open(c).with_context(|| {
                format!("opening the disk tier in {}", dir.display())
            })?))
        };
        let disk = open_disk(false)?;
        for (key, _) in chunks {
            disk.delete(key)?; // a previous run's entries would make the writes no-ops
        }
        let (warm_read, write) = self.bandwidth(disk.as_ref(), chunks)?;
        let ttft = self.ttft_runs(
            &mut self.engine(Some(disk.clone()))?,
            runs,
            true,
            "disk (warm)",
        )?;
        let warm = Row {
            tier: "disk (warm page cache)".into(),
            ttft_runs_s: ttft,
            read_bytes_per_s: Some(warm_read),
            write_bytes_per_s: Some(write),
        };
        drop(disk);
        // Reopening with drop_page_cache evicts each entry's pages during the scan.
        let disk = open_disk(true)?;
        let cold_read = total_bytes as f64 / self.read_all(disk.as_ref(), chunks)?;
        let ttft = self.ttft_runs(
            &mut self.engine(Some(disk.clone()))?,
            runs,
            true,
            "disk (cold)",
        )?;
        let cold = Row {
            tier: "disk (cold, drop_page_cache)".into(),
            ttft_runs_s: ttft,
            read_bytes_per_s: Some(cold_read),
            write_bytes_per_s: None,
        };
        for (key, _) in chunks {
            disk.delete(key)?;
        }
        drop(disk);
        if remove_dir {
            let _ = std::fs::remove_dir_all(&dir);
        }
        Ok([warm, cold])
    }

    /// The Redis tier, whose chunks are deleted again afterwards.
    fn redis_row(
        &self,
        config: RedisTierConfig,
        chunks: &[(ChunkKey, Payload)],
        runs: usize,
    ) -> Result<Row> {
        let redis = Arc::new(RedisTier::open(config)?);
        let (read, write) = self.bandwidth(redis.as_ref(), chunks)?;
        let ttft = self.ttft_runs(&mut self.engine(Some(redis.clone()))?, runs, true, "redis")?;
        for (key, _) in chunks {
            redis.delete(key)?;
        }
        Ok(Row {
            tier: "redis".into(),
            ttft_runs_s: ttft,
            read_bytes_per_s: Some(read),
            write_bytes_per_s: Some(write),
        })
    }
}

/// What `bench tiers` prints: the recompute baseline and one row per tier.
struct Report<'a> {
    a: &'a TiersBenchArgs,
    model_name: &'a str,
    chunk_tokens: usize,
    chunks: usize,
    /// Payloads stored: one per chunk, plus one per chunk whose window layers a hit needs
    /// (KV cache groups).
    payloads: usize,
    stored_bytes: usize,
    recompute_runs_s: &'a [f64],
    rows: &'a [Row],
}

impl Report<'_> {
    fn print_json(&self) {
        let recompute_s = median(self.recompute_runs_s);
        let tiers: Vec<_> = self
            .rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "tier": r.tier,
                    "ttft_s": median(&r.ttft_runs_s),
                    "ttft_runs_s": r.ttft_runs_s,
                    "speedup_vs_recompute": recompute_s / median(&r.ttft_runs_s),
                    "read_bytes_per_s": r.read_bytes_per_s,
                    "write_bytes_per_s": r.write_bytes_per_s,
                })
            })
            .collect();
        let v = serde_json::json!({
            "model": self.model_name,
            "threads": rayon::current_num_threads(),
            "context_tokens": self.a.context_tokens,
            "chunk_tokens": self.chunk_tokens,
            "chunks": self.chunks,
            "chunk_bytes": self.stored_bytes / self.chunks.max(1),
            "payloads": self.payloads,
            "stored_bytes": self.stored_bytes,
            "recompute": {"ttft_s": recompute_s, "ttft_runs_s": self.recompute_runs_s},
            "tiers": tiers,
        });
        println!("{v}");
    }

    fn print_table(&self) {
        let recompute_s = median(self.recompute_runs_s);
        println!(
            "model {} | threads {} | context {} tokens = {} chunks of {} tokens in {} payloads, {:.1} MB | median of {} runs",
            self.model_name,
            rayon::current_num_threads(),
            self.a.context_tokens,
            self.chunks,
            self.chunk_tokens,
            self.payloads,
            self.stored_bytes as f64 / 1e6,
            self.a.runs
        );
        println!(
            "{:<30} {:>10} {:>9} {:>12} {:>12}",
            "served from", "TTFT ms", "speedup", "read MB/s", "write MB/s"
        );
        println!(
            "{:<30} {:>10.1} {:>9} {:>12} {:>12}",
            "recompute (no tier)",
            recompute_s * 1e3,
            "1.0x",
            "-",
            "-"
        );
        let mbs = |x: Option<f64>| x.map_or("-".to_owned(), |b| format!("{:.0}", b / 1e6));
        for r in self.rows {
            let t = median(&r.ttft_runs_s);
            println!(
                "{:<30} {:>10.1} {:>8.1}x {:>12} {:>12}",
                r.tier,
                t * 1e3,
                recompute_s / t,
                mbs(r.read_bytes_per_s),
                mbs(r.write_bytes_per_s)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A zero chunk size is refused naming `--tier-chunk-tokens`, not `--context-tokens`.
    #[test]
    fn zero_chunk_names_its_own_flag() {
        let e = check_context_and_chunk(2048, 0).unwrap_err().to_string();
        assert!(e.contains("--tier-chunk-tokens"), "{e}");
        assert!(!e.contains("--context-tokens"), "{e}");
        for context in [0, 1000] {
            let e = check_context_and_chunk(context, 256)
                .unwrap_err()
                .to_string();
            assert!(e.contains("--context-tokens"), "{e}");
        }
        check_context_and_chunk(2048, 256).unwrap();
    }
}
