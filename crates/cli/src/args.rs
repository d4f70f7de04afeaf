//! Flags that more than one file reads: [`ModelArgs`] and [`KvPolicyArgs`] (every command
//! that runs a model), and the flags of `bench perf` ([`PerfArgs`]) and `perplexity`
//! ([`PerplexityArgs`]), which their commands and gpu.rs's standalone CUDA paths both read.
//! Building the engine from these flags is here too ([`ModelArgs::engine`]), through
//! device.rs; the tier flags are in tier_args.rs, the `--config` file's format in config.rs.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use pk_connectors::Attached;
use pk_engine::model_store::resolve_model;
use pk_engine::{Engine, EngineConfig};
use pk_model::KvDtype;

use crate::config::FileConfig;
use crate::tier_args::TierArgs;

/// Options shared by every command that runs a model.
#[derive(Args, Clone)]
pub struct ModelArgs {
    /// A local GGUF file; default: SmolLM2-135M-Instruct Q4_1, fetched on first use.
    #[arg(long, env = "PAGEKEEPER_MODEL")]
    pub model: Option<PathBuf>,
    /// Worker threads for the kernels (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Precision of the live KV cache: f16, f32, q8 (8.5 bits per element: 53 % of f16's
    /// bytes) or q4 (4.5 bits: 28 %), quantised per token in groups of 32.
    #[arg(long, default_value = "f16")]
    pub kv_dtype: String,
    /// Keep one block table for every layer, as before KV cache groups: sliding-window
    /// layers (Gemma 3) then keep every token's K/V instead of releasing the blocks behind
    /// their window (vLLM's flag of the same name). The chunk tiers and the EVICPRESS store
    /// keep the groups without it (and store by group).
    #[arg(long)]
    pub disable_hybrid_kv_cache_manager: bool,
    #[command(flatten)]
    pub tiers: TierArgs,
    /// A TOML file of settings (model, threads, tiers) below flags and env; see
    /// examples/pagekeeper.toml.
    #[arg(long, env = "PAGEKEEPER_CONFIG")]
    pub config: Option<PathBuf>,
}

impl ModelArgs {
    pub fn engine(&self, kv_capacity_tokens: Option<usize>) -> Result<Engine> {
        Ok(self.engine_on("cpu", kv_capacity_tokens)?.0)
    }

    /// The engine on `device` ("cpu", or "cuda" in a binary built with the feature), and
    /// the connector the tier flags attached to it, for its store and statistics.
    pub fn engine_on(
        &self,
        device: &str,
        kv_capacity_tokens: Option<usize>,
    ) -> Result<(Engine, Option<Attached>)> {
        self.build_engine(device, kv_capacity_tokens, false)
    }

    /// The engine on the CPU with one block table for every layer whatever the model, for
    /// a command that needs it (`bench codecs`, which refuses the flag that would ask).
    pub fn engine_one_table(&self, kv_capacity_tokens: Option<usize>) -> Result<Engine> {
        Ok(self.build_engine("cpu", kv_capacity_tokens, true)?.0)
    }

    fn build_engine(
        &self,
        device: &str,
        kv_capacity_tokens: Option<usize>,
        one_table: bool,
    ) -> Result<(Engine, Option<Attached>)> {
        crate::device::check_device(device)?;
        // The --config file under flags and env (config.rs).
        let args = self.resolved()?;
        set_threads(args.threads)?;
        let kv_dtype = args.kv_dtype()?;
        let path = resolve_model(args.model.as_deref(), true)?;
        let reuse = args.tiers.build_reuse()?;
        if args.disable_hybrid_kv_cache_manager {
            let gguf = pk_gguf::GgufFile::open(&path)
                .with_context(|| format!("loading {}", path.display()))?;
            let model = pk_model::ModelConfig::from_gguf(&gguf)?;
            check_hybrid_flag(true, &model)?;
        }
        let one_table = one_table || args.disable_hybrid_kv_cache_manager;
        let config = EngineConfig {
            block_size_tokens: args.block_size,
            kv_dtype,
            kv_capacity_tokens,
            hybrid_kv_cache: !one_table,
            ..Default::default()
        };
        let mut engine = crate::device::engine(device, &path, config)?;
        let attached = match &reuse {
            Some(r) => Some(pk_connectors::attach(&mut engine, r)?),
            None => None,
        };
        Ok((engine, attached))
    }

    /// `--kv-dtype` parsed.
    pub fn kv_dtype(&self) -> Result<KvDtype> {
        KvDtype::parse(&self.kv_dtype).with_context(|| {
            format!(
                "unknown --kv-dtype {:?} (expected {})",
                self.kv_dtype,
                KvDtype::NAMES
            )
        })
    }
}

impl ModelArgs {
    /// These arguments with the `--config` file applied under flags and env (see config.rs's
    /// module comment). Commands call this once, before using any field.
    pub fn resolved(&self) -> Result<ModelArgs> {
        let Some(path) = &self.config else {
            return Ok(self.clone());
        };
        let file = FileConfig::load(path)?;
        let mut out = self.clone();
        out.config = None;
        out.model = out.model.or(file.model);
        out.threads = out.threads.or(file.threads);
        out.tiers.tier_chunk_tokens = out.tiers.tier_chunk_tokens.or(file.tiers.chunk_tokens);
        out.tiers.from_file = Some(file.tiers);
        Ok(out)
    }
}

/// The most kernel threads a process starts: llama.cpp's limit (`GGML_MAX_N_THREADS`). A
/// thread count far above the cores only slows every step, and 10,000 threads exhausted the
/// process before the model loaded.
pub const MAX_THREADS: usize = 512;

/// Sizes the kernels' thread pool from `--threads` (or the config file's `threads`). Zero
/// is refused rather than read as rayon's "all cores", which is what leaving it out means.
pub fn set_threads(threads: Option<usize>) -> Result<()> {
    let Some(n) = threads else {
        return Ok(());
    };
    if n == 0 {
        bail!("--threads (or the config file's threads) must be at least 1");
    }
    if n > MAX_THREADS {
        bail!(
            "--threads (or the config file's threads) is {n}; at most {MAX_THREADS} are supported"
        );
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .context("configuring threads")
}

/// `--disable-hybrid-kv-cache-manager` changes something only where the engine would make
/// KV cache groups: for a model with sliding-window layers. Anywhere else it is refused
/// rather than accepted and unused.
pub fn check_hybrid_flag(disabled: bool, model: &pk_model::ModelConfig) -> Result<()> {
    if disabled && model.extras.sliding_window.is_none() {
        bail!(
            "--disable-hybrid-kv-cache-manager is not used with {}: it has no sliding-window layers, so it keeps one block table for every layer already",
            model.name
        );
    }
    Ok(())
}

/// Per-request KV eviction: a policy name and a token budget per sequence.
#[derive(Args, Clone, Default)]
pub struct KvPolicyArgs {
    /// full, streaming-llm, knorm, keydiff, snapkv, h2o, tova, expected-attention,
    /// paged-eviction (‖v‖, victims among the oldest 3 blocks; variants:
    /// paged-eviction:ratio, paged-eviction:inv-k-norm, paged-eviction:global, …).
    #[arg(long)]
    pub kv_policy: Option<String>,
    /// Tokens each sequence may keep in the KV cache (at least 3 blocks).
    #[arg(long)]
    pub kv_budget: Option<u32>,
    /// Which parts of the model choose their kept tokens together: shared (one selection
    /// for every layer and head), layer (each layer its own), head (each KV head of each
    /// layer its own, as kvpress). The budget is per unit, so the bytes are the same.
    /// Default: the policy's own (head for paged-eviction and kvzip:global, shared
    /// for the others).
    #[arg(long)]
    pub kv_granularity: Option<String>,
}

impl KvPolicyArgs {
    pub fn granularity(&self) -> Result<Option<pk_kv::KvGranularity>> {
        self.kv_granularity
            .as_deref()
            .map(|g| {
                g.parse::<pk_kv::KvGranularity>()
                    .map_err(|e| anyhow::anyhow!("--kv-granularity: {e}"))
            })
            .transpose()
    }

    /// The granularity eviction runs at: the one given, else the policy's own (the
    /// default policy's when only a budget is given); `shared` when nothing evicts.
    pub fn effective_granularity(&self) -> Result<pk_kv::KvGranularity> {
        if let Some(g) = self.granularity()? {
            return Ok(g);
        }
        Ok(match (self.spec()?, self.kv_budget) {
            (Some(spec), _) => spec.default_granularity(),
            (None, Some(_)) => pk_kv::PolicySpec::default().default_granularity(),
            (None, None) => pk_kv::KvGranularity::Shared,
        })
    }

    pub fn spec(&self) -> Result<Option<pk_kv::PolicySpec>> {
        self.kv_policy
            .as_deref()
            .map(|p| {
                p.parse::<pk_kv::PolicySpec>()
                    .map_err(|e| anyhow::anyhow!("--kv-policy: {e}"))
            })
            .transpose()
    }

    /// For a command that runs its own requests with these flags (`generate`, `bench perf`):
    /// the engine's refusals of a policy, budget and granularity that do not go together,
    /// named as the flags are. (`serve`'s flags are defaults that a request's own fields
    /// complete, so each is used on its own there.)
    pub fn check_one_request(&self) -> Result<()> {
        let spec = self.spec()?;
        let evicts = match (spec, self.kv_budget) {
            (Some(s), _) => s.evicts(),
            (None, budget) => budget.is_some(),
        };
        if let (Some(s), Some(_)) = (spec, self.kv_budget) {
            if !s.evicts() {
                bail!("--kv-budget is not used with --kv-policy {s}, which keeps every token");
            }
        }
        if let (Some(s), None) = (spec, self.kv_budget) {
            if s.evicts() {
                bail!("--kv-policy {s} needs --kv-budget (tokens kept per sequence)");
            }
        }
        if self.kv_granularity.is_some() && !evicts {
            bail!("--kv-granularity is not used without eviction: it chooses how an evicting --kv-policy with a --kv-budget selects");
        }
        Ok(())
    }

    /// The name reports print: the policy given, else what the engine will use.
    pub fn label(&self) -> String {
        match (&self.kv_policy, self.kv_budget) {
            (Some(p), _) => p.clone(),
            (None, Some(_)) => pk_kv::PolicySpec::default().to_string(),
            (None, None) => "full".into(),
        }
    }
}

// `bench perf`'s flags: bench_perf.rs runs them on the CPU, gpu.rs with `--device cuda`.
// (A `///` comment here would become clap's help text.)
#[derive(Args)]
pub struct PerfArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Random weights of a real shape instead of a file: smollm2-135m, llama-3.2-1b,
    /// llama-3.2-3b, llama-3.1-8b, qwen2.5-1.5b, qwen3-0.6b, qwen3-8b, gemma-3-4b
    /// (`pk_model::config::DUMMY_SHAPES`: real widths, RoPE factors and scaling).
    #[arg(long)]
    pub dummy: Option<String>,
    /// Weight format of --dummy models (Q4_1, Q8_0, Q4_0, F16, …).
    #[arg(long, default_value = "Q4_1")]
    pub dummy_type: String,
    /// Prompt lengths to measure, comma-separated.
    #[arg(long, default_value = "512,2048", value_delimiter = ',')]
    pub contexts: Vec<usize>,
    #[arg(long, default_value_t = 128)]
    pub decode_tokens: usize,
    /// Print one JSON object on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub kv: KvPolicyArgs,
    /// Also run every context through llama.cpp (the PyPI package llama-cpp-python, via
    /// scripts/llamacpp_bench.py) on the same model file, threads and prompt tokens, right
    /// after our own run of that context, and print the ratios ours / llama.cpp.
    #[arg(long)]
    pub compare_llamacpp: bool,
    /// The Python interpreter that has llama-cpp-python installed (e.g. a venv's bin/python).
    #[arg(long, env = "PAGEKEEPER_LLAMACPP_PYTHON", default_value = "python3")]
    pub llamacpp_python: String,
    /// Where the model runs: cpu, or cuda (a binary built with --features cuda; see gpu.rs).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub device: String,
    /// Also decode with each of these thread counts (e.g. 1,2), alternating step by step
    /// in one generation after each context's run, so that every count sees the same host
    /// load; adds `compare_threads` to each run. Needs --threads ≥ the largest.
    #[arg(long, value_delimiter = ',')]
    pub compare_threads: Vec<usize>,
    /// Sequences decoding together, comma-separated (a sweep); --device cuda only.
    #[arg(long, default_value = "1", value_delimiter = ',')]
    pub batch: Vec<usize>,
}

// `perplexity`'s flags: commands.rs runs them on the CPU, gpu.rs with `--device cuda`.
#[derive(Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text file (read as UTF-8; invalid bytes are replaced).
    #[arg(long)]
    pub file: PathBuf,
    /// Tokens per chunk.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Score at most this many chunks (default: all).
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Print one JSON object at the end instead of the llama.cpp-style line.
    #[arg(long)]
    pub json: bool,
    /// Where the model runs: cpu, or cuda (a binary built with --features cuda; see gpu.rs).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub device: String,
}

/// Flags of one command's argument struct parsed from `args` alone, for unit tests: their
/// environment variables are cleared from the definition, since config.rs's test sets some
/// of them while tests run.
#[cfg(test)]
pub fn parse_flags_for_test<T: clap::Args + clap::FromArgMatches>(args: &[&str]) -> T {
    let command = T::augment_args(clap::Command::new("test")).mut_args(|a| a.env(None));
    let matches = command
        .try_get_matches_from(std::iter::once("test").chain(args.iter().copied()))
        .unwrap();
    T::from_arg_matches(&matches).unwrap()
}
