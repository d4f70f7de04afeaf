//! Subcommand implementations. Each parses its flags, builds an engine and reports.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use pk_engine::model_store::resolve_model;
use pk_engine::{Engine, EngineConfig, GenerateParams, SamplingParams};
use pk_model::KvDtype;
use pk_tokenizer::ChatMessage;

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
    /// their window (vLLM's flag of the same name). Tiers turn groups off by themselves.
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
        self.engine_on("cpu", kv_capacity_tokens)
    }

    /// The engine on `device` ("cpu", or "cuda" in a binary built with the feature).
    pub fn engine_on(&self, device: &str, kv_capacity_tokens: Option<usize>) -> Result<Engine> {
        self.build_engine(device, kv_capacity_tokens, false)
    }

    /// The engine on the CPU with one block table for every layer whatever the model, for
    /// a command that needs it (`bench codecs`, which refuses the flag that would ask).
    pub fn engine_one_table(&self, kv_capacity_tokens: Option<usize>) -> Result<Engine> {
        self.build_engine("cpu", kv_capacity_tokens, true)
    }

    fn build_engine(
        &self,
        device: &str,
        kv_capacity_tokens: Option<usize>,
        one_table: bool,
    ) -> Result<Engine> {
        crate::gpu::check_device(device)?;
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
            check_hybrid_flag(true, &model, reuse.is_some())?;
        }
        let config = EngineConfig {
            block_size_tokens: args.block_size,
            kv_dtype,
            kv_capacity_tokens,
            reuse,
            hybrid_kv_cache: !(one_table || args.disable_hybrid_kv_cache_manager),
            ..Default::default()
        };
        crate::gpu::engine(device, &path, config)
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

/// Sizes the kernels' thread pool from `--threads` (or the config file's `threads`). Zero
/// is refused rather than read as rayon's "all cores", which is what leaving it out means.
pub fn set_threads(threads: Option<usize>) -> Result<()> {
    let Some(n) = threads else {
        return Ok(());
    };
    if n == 0 {
        bail!("--threads (or the config file's threads) must be at least 1");
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .context("configuring threads")
}

/// `--disable-hybrid-kv-cache-manager` changes something only where the engine would make
/// KV cache groups: for a model with sliding-window layers, in an engine that neither
/// stores nor reuses prompt KV (such an engine keeps one block table already). Anywhere
/// else it is refused rather than accepted and unused.
pub fn check_hybrid_flag(
    disabled: bool,
    model: &pk_model::ModelConfig,
    has_reuse: bool,
) -> Result<()> {
    if !disabled {
        return Ok(());
    }
    if has_reuse {
        bail!("--disable-hybrid-kv-cache-manager is not used with a tier: an engine that stores or reuses prompt KV keeps one block table for every layer already");
    }
    if model.extras.sliding_window.is_none() {
        bail!(
            "--disable-hybrid-kv-cache-manager is not used with {}: it has no sliding-window layers, so it keeps one block table for every layer already",
            model.name
        );
    }
    Ok(())
}

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
    pub evicpress_profile_metric: pk_engine::profiler::QualityMetric,
    /// Tiers from the `--config` file, used for those no flag or env sets (config.rs).
    #[arg(skip)]
    pub from_file: Option<crate::config::TiersSection>,
}

pub fn parse_profile_metric(
    s: &str,
) -> Result<pk_engine::profiler::QualityMetric, pk_engine::profiler::UnknownMetric> {
    s.parse()
}

impl TierArgs {
    /// The tiered store, fastest first, or `None` when no tier is configured. The slowest
    /// tier is written through, so that a restart (disk) or another server (Redis) sees
    /// every chunk at once.
    pub fn build(&self) -> Result<Option<pk_engine::TieringConfig>> {
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
        Ok(Some(pk_engine::TieringConfig {
            store,
            chunk_size_tokens: self.chunk_tokens(),
            max_pending_bytes: 256 << 20,
        }))
    }
}

impl TierArgs {
    /// The engine's KV reuse connector: the EVICPRESS context store with `--tier-policy
    /// evicpress`, else the chunk tiers if any tier is configured.
    pub fn build_reuse(&self) -> Result<Option<pk_engine::ReuseConfig>> {
        if self.tier_chunk_tokens.is_some() && self.tier_configs()?.is_empty() {
            bail!("--tier-chunk-tokens (or the config file's tiers.chunk_tokens) is not used without a tier: add --tier-ram, --tier-disk or --tier-redis");
        }
        if let Some(c) = self.build_contexts()? {
            return Ok(Some(pk_engine::ReuseConfig::Contexts(c)));
        }
        Ok(self.build()?.map(pk_engine::ReuseConfig::Chunks))
    }

    /// The EVICPRESS context store over the configured tiers, with `--tier-policy evicpress`.
    pub fn build_contexts(&self) -> Result<Option<pk_engine::ContextReuseConfig>> {
        if self.tier_policy != "evicpress" {
            return Ok(None);
        }
        let store = crate::tier_policy::evicpress_config(
            &self.tier_configs()?,
            self.evicpress_alpha,
            self.evicpress_grid.as_deref(),
            self.evicpress_per_byte,
        )?;
        Ok(Some(pk_engine::ContextReuseConfig {
            store,
            chunk_size_tokens: self.chunk_tokens(),
            profile_metric: self.evicpress_profile_metric,
        }))
    }
}

/// Per-request KV eviction: a policy name and a token budget per sequence.
#[derive(Args, Clone, Default)]
pub struct KvPolicyArgs {
    /// full, streaming-llm, knorm, keydiff, snapkv, h2o, tova, expected-attention,
    /// paged-eviction (variants: paged-eviction:v-norm, paged-eviction:inv-k-norm, …).
    #[arg(long)]
    pub kv_policy: Option<String>,
    /// Tokens each sequence may keep in the KV cache (at least 3 blocks).
    #[arg(long)]
    pub kv_budget: Option<u32>,
    /// Which parts of the model choose their kept tokens together: shared (one selection
    /// for every layer and head), layer (each layer its own), head (each KV head of each
    /// layer its own, as kvpress). The budget is per unit, so the bytes are the same.
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

#[derive(Args)]
pub struct InfoArgs {
    #[arg(long, env = "PAGEKEEPER_MODEL")]
    pub model: Option<PathBuf>,
    /// A real model's shape instead of a file (the names `bench perf --dummy` takes).
    #[arg(long, conflicts_with = "model")]
    pub dummy: Option<String>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// The configuration fields `info --json` prints under `config`.
fn config_json(c: &pk_model::ModelConfig) -> serde_json::Value {
    serde_json::json!({
        "arch": c.arch,
        "n_layers": c.n_layers, "n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim,
        "d_model": c.d_model, "d_ff": c.d_ff, "vocab_size": c.vocab_size, "context_length": c.context_length,
        "rope_theta": c.rope_theta, "rms_eps": c.rms_eps,
        "rope_freq_scale": c.rope_freq_scale,
        "rope_freq_factors": c.rope_freq_factors,
        "sliding_window_tokens": c.extras.sliding_window.map(|w| w.window_tokens),
        "kv_bytes_per_token_f16": 2 * c.n_layers * c.kv_dim() * 2,
    })
}

fn print_config(c: &pk_model::ModelConfig) {
    println!("layers:          {}", c.n_layers);
    println!(
        "heads:           {} query / {} KV (head_dim {})",
        c.n_heads, c.n_kv_heads, c.head_dim
    );
    println!("embedding:       {}  feed-forward: {}", c.d_model, c.d_ff);
    println!("vocabulary:      {}", c.vocab_size);
    println!("context length:  {}", c.context_length);
    println!("rope theta:      {}", c.rope_theta);
    if c.rope_freq_scale != 1.0 {
        println!("rope scaling:    linear, angles × {}", c.rope_freq_scale);
    }
    if let Some(f) = &c.rope_freq_factors {
        let max = f.iter().copied().fold(1.0f32, f32::max);
        println!(
            "rope factors:    {} (rope_freqs.weight, up to {max})",
            f.len()
        );
    }
    if let Some(w) = c.extras.sliding_window {
        println!(
            "sliding window:  {} tokens, every {}th layer global (local rope theta {})",
            w.window_tokens, w.global_every, w.rope_theta_local
        );
    }
    let kv_token_bytes = 2 * c.n_layers * c.kv_dim() * 2;
    println!("KV per token:    {} bytes at f16", kv_token_bytes);
}

/// `info --dummy NAME`: a shape of `ModelConfig::dummy`, no file.
fn info_dummy(name: &str, json: bool) -> Result<()> {
    let c = pk_model::ModelConfig::dummy(name).with_context(|| {
        format!(
            "unknown --dummy {name:?} ({})",
            pk_model::config::DUMMY_SHAPES.join(", ")
        )
    })?;
    if json {
        let v = serde_json::json!({"name": c.name, "architecture": c.arch, "supported": true, "config": config_json(&c)});
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "name:            {} (random weights of the real shape)",
        c.name
    );
    println!("architecture:    {}", c.arch);
    print_config(&c);
    Ok(())
}

pub fn info(a: InfoArgs) -> Result<()> {
    if let Some(name) = &a.dummy {
        return info_dummy(name, a.json);
    }
    let path = resolve_model(a.model.as_deref(), true)?;
    let f =
        pk_gguf::GgufFile::open(&path).with_context(|| format!("loading {}", path.display()))?;
    let arch = f.get_str("general.architecture")?.to_string();
    let mut by_type = std::collections::BTreeMap::<String, (usize, u64)>::new();
    let mut n_params = 0u64;
    for t in &f.tensors {
        let e = by_type.entry(t.ggml_type.to_string()).or_default();
        e.0 += 1;
        e.1 += t.n_elems();
        n_params += t.n_elems();
    }
    let cfg = pk_model::ModelConfig::from_gguf(&f);
    if a.json {
        let mut v = serde_json::json!({
            "path": path.display().to_string(),
            "name": f.get_str("general.name").unwrap_or(""),
            "architecture": arch,
            "file_bytes": f.file_len_bytes(),
            "parameters": n_params,
            "tensor_types": by_type.iter().map(|(k, (n, e))| (k.clone(), serde_json::json!({"tensors": n, "elements": e}))).collect::<serde_json::Map<_, _>>(),
            "supported": cfg.is_ok(),
        });
        match &cfg {
            Ok(c) => v["config"] = config_json(c),
            Err(e) => v["not_runnable"] = e.to_string().into(),
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "file:            {} ({:.1} MiB, GGUF v{})",
        path.display(),
        f.file_len_bytes() as f64 / (1 << 20) as f64,
        f.version
    );
    println!(
        "name:            {}",
        f.get_str("general.name").unwrap_or("?")
    );
    println!("architecture:    {arch}");
    println!("parameters:      {:.1} M", n_params as f64 / 1e6);
    match &cfg {
        Ok(c) => print_config(c),
        Err(e) => println!("not runnable:    {e}"),
    }
    for (t, (n, e)) in &by_type {
        println!(
            "tensors {t:>6}:  {n} tensors, {:.1} M elements",
            *e as f64 / 1e6
        );
    }
    Ok(())
}

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt text (a user message with --chat).
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    pub chat: bool,
    /// Extra chat-template variables for --chat, as a JSON object (vLLM's
    /// `chat_template_kwargs`), e.g. '{"enable_thinking": false}' for Qwen3. Each must be
    /// one the model's template reads.
    #[arg(long, value_name = "JSON")]
    pub chat_template_kwargs: Option<String>,
    /// System message for --chat (default: the template's own).
    #[arg(long)]
    pub system: Option<String>,
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// 0 means greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// 0 disables top-k.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop strings (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    #[command(flatten)]
    pub kv: KvPolicyArgs,
    /// Where the model runs: cpu, or cuda (a binary built with --features cuda; the engine,
    /// its cache and policies as on the CPU, the forward pass and KV pool on the GPU).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub device: String,
}

/// `--chat-template-kwargs`: a JSON object whose every key the template reads (one it
/// would not read is refused rather than ignored).
fn chat_template_kwargs(
    template: &pk_tokenizer::ChatTemplate,
    json: Option<&str>,
) -> Result<serde_json::Map<String, serde_json::Value>> {
    let Some(json) = json else {
        return Ok(Default::default());
    };
    let serde_json::Value::Object(map) = serde_json::from_str(json)
        .map_err(|e| anyhow::anyhow!("--chat-template-kwargs: not JSON: {e}"))?
    else {
        bail!("--chat-template-kwargs must be a JSON object");
    };
    if let Some(k) = map.keys().find(|k| !template.reads_variable(k)) {
        bail!("--chat-template-kwargs: this model's chat template does not read `{k}`");
    }
    Ok(map)
}

/// Greedy decoding (`--temperature 0`, the default) takes the most likely token, so the
/// sampling flags would be accepted and unused there: refused by name instead.
fn check_sampling(a: &GenerateArgs) -> Result<()> {
    if a.temperature != 0.0 {
        return Ok(());
    }
    for (set, flag) in [
        (a.top_k != 0, "--top-k"),
        (a.top_p != 1.0, "--top-p"),
        (a.seed.is_some(), "--seed"),
    ] {
        if set {
            bail!("{flag} is not used by `generate` with --temperature 0: greedy decoding takes the most likely token (set --temperature to sample)");
        }
    }
    Ok(())
}

pub fn generate(a: GenerateArgs) -> Result<()> {
    check_sampling(&a)?;
    a.kv.check_one_request()?;
    let mut engine = a.model.engine_on(&a.device, None)?;
    let prompt_text = if a.chat {
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(ChatMessage::new("system", s));
        }
        msgs.push(ChatMessage::new("user", &a.prompt));
        let kwargs =
            chat_template_kwargs(&engine.chat_template, a.chat_template_kwargs.as_deref())?;
        engine
            .chat_template
            .render_with_kwargs(&msgs, None, true, &kwargs)?
    } else {
        if a.system.is_some() {
            bail!("--system needs --chat");
        }
        if a.chat_template_kwargs.is_some() {
            bail!("--chat-template-kwargs needs --chat");
        }
        a.prompt.clone()
    };
    // Chat templates contain special tokens; raw prompts are plain text.
    let ids = engine.tokenizer.encode_prompt(&prompt_text, a.chat);
    let params = GenerateParams {
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            seed: a.seed,
            ..Default::default()
        },
        max_tokens: a.max_tokens,
        stop: a.stop.clone(),
        ignore_eos: false,
        kv_policy: a.kv.spec()?,
        kv_budget: a.kv.kv_budget,
        kv_granularity: a.kv.granularity()?,
        ..Default::default()
    };
    let mut stdout = std::io::stdout().lock();
    let out = engine.generate(&ids, &params, &mut |s| {
        let _ = stdout.write_all(s.as_bytes());
        let _ = stdout.flush();
    })?;
    let _ = writeln!(stdout);
    // The EVICPRESS store writes on a worker thread that drops what it has not written
    // when the store goes away at exit: wait for it, so that the next run finds this prompt.
    if let Some(store) = engine.context_store() {
        store.flush();
    }
    let n = out.token_ids.len();
    eprintln!(
        "prompt: {} tokens ({} cached) in {:.2} s ({:.1} tok/s); generated: {} tokens in {:.2} s ({:.1} tok/s); finish: {:?}",
        out.prompt_tokens,
        out.cached_prompt_tokens,
        out.prefill_seconds,
        (out.prompt_tokens - out.cached_prompt_tokens) as f64 / out.prefill_seconds.max(1e-9),
        n,
        out.decode_seconds,
        n as f64 / out.decode_seconds.max(1e-9),
        out.finish_reason
    );
    Ok(())
}

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

pub fn perplexity(a: PerplexityArgs) -> Result<()> {
    if a.device == "cuda" {
        return crate::gpu::perplexity(&a);
    }
    let bytes = std::fs::read(&a.file).with_context(|| format!("reading {}", a.file.display()))?;
    let text = String::from_utf8_lossy(&bytes);
    let mut engine = a.model.engine(Some(a.ctx))?;
    let ids = engine.tokenizer.encode(&text, false);
    let n_chunks = a
        .chunks
        .map_or(ids.len() / a.ctx, |c| c.min(ids.len() / a.ctx));
    eprintln!(
        "perplexity: {} tokens, calculating over {n_chunks} chunks, n_ctx={}",
        ids.len(),
        a.ctx
    );
    let t0 = std::time::Instant::now();
    let r =
        pk_engine::perplexity::perplexity(&mut engine, &ids, a.ctx, a.chunks, &mut |i, ppl| {
            eprint!("[{i}]{ppl:.4},");
            if i == 1 {
                let per = t0.elapsed().as_secs_f64();
                eprint!(
                    " ({per:.2} s per chunk, ETA {:.0} s) ",
                    per * (n_chunks - 1) as f64
                );
            }
        })?;
    eprintln!();
    print_perplexity(&r, a.json)
}

/// The result as llama.cpp's `perplexity` prints it, or one JSON object (every backend).
pub fn print_perplexity(r: &pk_engine::perplexity::PerplexityResult, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(r)?);
    } else {
        println!("Final estimate: PPL = {:.4} +/- {:.5}", r.ppl, r.ppl_stderr);
    }
    Ok(())
}
