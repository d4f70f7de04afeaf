//! `pagekeeper serve`: the OpenAI-compatible server.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use pk_connectors::{Attached, ContextReuse, ReuseConfig};
use pk_engine::model_store::resolve_model;
use pk_engine::EngineConfig;
use pk_model::KvDtype;
use pk_server::{AppState, EngineHandle, Offload, Served, ServerLimits};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: crate::args::ModelArgs,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Name clients use in the `model` field (default: the model file's stem).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// KV pool capacity in tokens (default: 4 × the model's context length, capped at what
    /// fits in 1 GiB but never below one context; see `default_pool_tokens`).
    #[arg(long)]
    pub kv_capacity_tokens: Option<usize>,
    /// Sequences decoding at once.
    #[arg(long, default_value_t = 32)]
    pub max_running_seqs: usize,
    /// Requests waiting for admission before new ones get 429.
    #[arg(long, default_value_t = 256)]
    pub max_waiting_requests: usize,
    /// Tokens per forward pass (prefill chunks + decode tokens).
    #[arg(long, default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// Prompt tokens a step may carry while any stream is decoding (chunked prefill with
    /// decode priority): bounds the time between two tokens of every stream. Prefill with
    /// nothing decoding still uses --max-batch-tokens.
    #[arg(long, default_value_t = 64)]
    pub max_prefill_tokens_while_decoding: usize,
    /// Prune a budgeted prompt every N prompt tokens while it is prefilled, for policies
    /// that score without queries (streaming-llm, knorm, keydiff): it then holds at most
    /// budget + N tokens of blocks instead of the whole prompt, at the price of an inexact
    /// prefill. 0: prune once, after exact attention over the whole prompt (every other
    /// policy always does). At least the block size when set.
    #[arg(long, default_value_t = 0)]
    pub prefill_prune_interval_tokens: usize,
    /// Prompt + completion tokens per request (default: the model's context length).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Default policy and budget for requests that set none (`kv_policy`/`kv_budget` in the
    /// request body override them).
    #[command(flatten)]
    pub kv: crate::args::KvPolicyArgs,
    /// Where the model runs: cpu, or cuda (a binary built with --features cuda; the engine,
    /// its cache, policies and tiers as on the CPU, the forward pass and KV pool on the GPU).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub device: String,
}

pub fn serve(mut a: ServeArgs) -> Result<()> {
    // The --config file under flags and env (config.rs).
    a.model = a.model.resolved()?;
    crate::device::check_device(&a.device)?;
    let path = resolve_model(a.model.model.as_deref(), true)?;
    crate::args::set_threads(a.model.threads)?;
    // Tokenizer and template load in milliseconds on this side; the weights load on the
    // engine thread so that /health can say 503 meanwhile.
    let gguf =
        pk_gguf::GgufFile::open(&path).with_context(|| format!("loading {}", path.display()))?;
    let tokenizer = Arc::new(pk_tokenizer::Tokenizer::from_gguf(&gguf)?);
    let chat_template = Arc::new(pk_tokenizer::ChatTemplate::from_gguf(&gguf)?);
    let model_config = pk_model::ModelConfig::from_gguf(&gguf)?;
    drop(gguf);
    // Before the tiers open in `plan` (they count what they find on disk) and the engine
    // starts.
    let metrics = pk_server::install_metrics(&served_name(&a, &path))
        .context("installing the metrics recorder")?;
    let plan = plan(&a, &path, &model_config)?;
    if a.device == "cpu" {
        let pool_tokens = plan.engine.kv_capacity_tokens.expect("plan sizes the pool");
        let dtype = plan.engine.kv_dtype;
        check_pool_fits_memory(pool_tokens, &model_config, dtype, total_memory_bytes())?;
    }
    let name = plan.model_name.clone();
    let (device, config, reuse) = (a.device.clone(), plan.engine, plan.reuse);
    let engine = EngineHandle::spawn(move || {
        let mut engine = crate::device::engine(&device, &path, config)?;
        engine.model_name = name;
        let attached = match &reuse {
            Some(r) => Some(pk_connectors::attach(&mut engine, r)?),
            None => None,
        };
        let contexts = attached.as_ref().and_then(Attached::contexts).cloned();
        if let Some(c) = &contexts {
            calibrate(&mut engine, c)?;
        }
        Ok(Served { engine, contexts })
    });
    let state = Arc::new(AppState {
        engine,
        offload: Offload::new(tokenizer.clone()),
        tokenizer,
        chat_template,
        model_name: plan.model_name,
        limits: plan.limits,
        metrics,
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(pk_server::serve(state, plan.addr))
}

/// EVICPRESS decides with this machine's delays: measured before the first request (a
/// prefill of this model, a probe of every tier), then kept current from every prefill and
/// load.
fn calibrate(e: &mut pk_engine::Engine, contexts: &ContextReuse) -> Result<()> {
    let c = pk_connectors::calibrate_context_store(e, contexts)?;
    let tiers: Vec<String> = c
        .tiers
        .iter()
        .map(|t| match (&t.skipped, t.read_bytes_per_s) {
            (Some(why), _) => format!("{} not probed ({why})", t.tier),
            (None, Some(r)) => format!("{} {:.0} MB/s read", t.tier, r / 1e6),
            (None, None) => format!("{} unmeasured", t.tier),
        })
        .collect();
    tracing::info!(
        "EVICPRESS delay model calibrated: prefill {:.0} tokens/s ({} tokens), {}",
        c.prefill_tokens_per_s,
        c.prefill_tokens,
        tiers.join(", ")
    );
    Ok(())
}

/// The name the server answers to: `--served-model-name`, else the file's stem.
fn served_name(a: &ServeArgs, path: &Path) -> String {
    a.served_model_name.clone().unwrap_or_else(|| {
        path.file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default()
    })
}

/// What the flags make of a server, before anything loads or binds: the engine's
/// configuration, the request limits, the served name and the address.
pub struct Plan {
    pub engine: EngineConfig,
    /// The connector the tier flags ask for, attached once the engine is built.
    pub reuse: Option<ReuseConfig>,
    pub limits: ServerLimits,
    pub model_name: String,
    pub addr: SocketAddr,
}

/// Every flag of `serve` but `--device`, `--threads` and `--model`/`--config` (used before)
/// lands here, so the unit test below can check that each one changes the plan.
pub fn plan(a: &ServeArgs, path: &Path, model_config: &pk_model::ModelConfig) -> Result<Plan> {
    let kv_dtype = a.model.kv_dtype()?;
    check_nonzero_limits(a)?;
    let pool_tokens = a
        .kv_capacity_tokens
        .unwrap_or_else(|| default_pool_tokens(model_config, kv_dtype));
    let max_total_tokens =
        max_request_tokens(model_config.context_length, a.max_model_len, pool_tokens)?;
    let model_name = served_name(a, path);
    let reuse = a.model.tiers.build_reuse()?;
    crate::args::check_hybrid_flag(a.model.disable_hybrid_kv_cache_manager, model_config)?;
    let engine = EngineConfig {
        block_size_tokens: a.model.block_size,
        kv_dtype,
        kv_capacity_tokens: Some(pool_tokens),
        max_batch_tokens: a.max_batch_tokens,
        max_prefill_tokens_while_decoding: a.max_prefill_tokens_while_decoding,
        prefill_prune_interval_tokens: a.prefill_prune_interval_tokens,
        max_running_seqs: a.max_running_seqs,
        max_waiting_requests: a.max_waiting_requests,
        default_kv_policy: a.kv.spec()?.unwrap_or_default(),
        default_kv_budget: a.kv.kv_budget,
        default_kv_granularity: a.kv.granularity()?,
        // Both KV stores keep the KV cache groups, as the engine does without them.
        hybrid_kv_cache: !a.model.disable_hybrid_kv_cache_manager,
        ..Default::default()
    };
    let addr: SocketAddr = format!("{}:{}", a.host, a.port)
        .parse()
        .with_context(|| format!("bad --host/--port {}:{}", a.host, a.port))?;
    Ok(Plan {
        engine,
        reuse,
        limits: ServerLimits {
            max_request_body_bytes: 4 << 20,
            max_total_tokens,
            max_messages: 1024,
        },
        model_name,
        addr,
    })
}

/// Limits of 0 would start a server that refuses every request (a pool of no tokens, a
/// context of none, a queue of none): refused at start-up instead.
fn check_nonzero_limits(a: &ServeArgs) -> Result<()> {
    for (value, flag) in [
        (a.kv_capacity_tokens, "--kv-capacity-tokens"),
        (a.max_model_len, "--max-model-len"),
        (Some(a.max_waiting_requests), "--max-waiting-requests"),
        (Some(a.max_running_seqs), "--max-running-seqs"),
        (Some(a.max_batch_tokens), "--max-batch-tokens"),
        (
            Some(a.max_prefill_tokens_while_decoding),
            "--max-prefill-tokens-while-decoding",
        ),
    ] {
        if value == Some(0) {
            anyhow::bail!("{flag} 0 would refuse every request; give at least 1");
        }
    }
    if a.served_model_name.as_deref() == Some("") {
        anyhow::bail!("--served-model-name must not be empty: clients name the model by it");
    }
    Ok(())
}

/// The machine's memory (`MemTotal`), if it can be read.
fn total_memory_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// A CPU KV pool larger than the machine's memory is refused before anything is allocated:
/// its pages are committed as blocks are first written, so it would start and then fail (or
/// abort on the allocation) under load. `memory_bytes` `None`: not checked.
pub fn check_pool_fits_memory(
    pool_tokens: usize,
    model: &pk_model::ModelConfig,
    dtype: KvDtype,
    memory_bytes: Option<u64>,
) -> Result<()> {
    let per_token =
        2 * model.n_layers * model.n_kv_heads * dtype.bytes_per_head_token(model.head_dim);
    let pool_bytes = (pool_tokens as u128) * (per_token as u128);
    match memory_bytes {
        Some(memory) if pool_bytes > memory as u128 => anyhow::bail!(
            "--kv-capacity-tokens {pool_tokens} needs a KV pool of {:.1} GiB ({per_token} bytes a token), more than this machine's {:.1} GiB of memory",
            pool_bytes as f64 / (1u64 << 30) as f64,
            memory as f64 / (1u64 << 30) as f64
        ),
        _ => Ok(()),
    }
}

/// The KV pool `serve` sizes when `--kv-capacity-tokens` is not given: room for four
/// full-length sequences, but no more than fits in [`DEFAULT_POOL_BYTES`] unless one
/// full-length sequence needs more. A 32K-context model's four contexts are gigabytes
/// (Qwen2.5-1.5B: 3.8 GB in f16) that a user who runs short chats never asked for; one
/// context always fits, so every request within the model's window can be served. The
/// pool's pages are committed as blocks are first written (`KvStore`), so what is
/// resident grows with use up to this size.
pub fn default_pool_tokens(model: &pk_model::ModelConfig, dtype: KvDtype) -> usize {
    let per_token =
        2 * model.n_layers * model.n_kv_heads * dtype.bytes_per_head_token(model.head_dim);
    let ctx = model.context_length;
    (DEFAULT_POOL_BYTES / per_token.max(1)).clamp(ctx, 4 * ctx)
}

/// The longest request (prompt + completion) the server accepts: the model's context, or
/// `--max-model-len` when smaller, and never more than the KV pool holds, so that a request
/// the pool cannot hold is refused at once instead of computed and then failed. A
/// `--max-model-len` beyond the pool is a configuration error (vLLM refuses it the same
/// way); without it the limit is clamped to the pool, with a warning.
pub fn max_request_tokens(
    ctx: usize,
    max_model_len: Option<usize>,
    pool_tokens: usize,
) -> anyhow::Result<usize> {
    match max_model_len {
        Some(l) if l > pool_tokens => anyhow::bail!("--max-model-len {l} exceeds the KV pool of {pool_tokens} tokens: raise --kv-capacity-tokens or lower --max-model-len"),
        Some(l) => Ok(l.min(ctx)),
        None if pool_tokens < ctx => {
            tracing::warn!("the KV pool holds {pool_tokens} tokens, less than the model's context of {ctx}: requests are limited to {pool_tokens} tokens");
            eprintln!("pagekeeper: requests limited to {pool_tokens} tokens (the KV pool's size; the model's context is {ctx})");
            Ok(pool_tokens)
        }
        None => Ok(ctx),
    }
}

/// The byte cap of the default pool: 1 GiB.
pub const DEFAULT_POOL_BYTES: usize = 1 << 30;

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2 (8K context, 23 KB a token) keeps four contexts; Qwen2.5-1.5B (32K, 28 KB
    /// a token) gets 1 GiB, 37,449 tokens, instead of four contexts' 3.8 GB.
    #[test]
    fn request_limit_never_exceeds_the_pool() {
        assert_eq!(max_request_tokens(8192, None, 32768).unwrap(), 8192);
        assert_eq!(max_request_tokens(32768, None, 4096).unwrap(), 4096);
        assert_eq!(max_request_tokens(32768, Some(2048), 4096).unwrap(), 2048);
        let err = max_request_tokens(32768, Some(8192), 4096)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--max-model-len 8192") && err.contains("4096"),
            "{err}"
        );
    }

    #[test]
    fn limits_of_zero_and_pools_beyond_memory_are_refused() {
        for flag in [
            "--kv-capacity-tokens",
            "--max-model-len",
            "--max-waiting-requests",
        ] {
            let smol = pk_model::ModelConfig::dummy("llama-3.2-1b").unwrap();
            let err = plan(&parse(&[flag, "0"]), Path::new("/m/model.gguf"), &smol)
                .err()
                .unwrap()
                .to_string();
            assert!(err.starts_with(&format!("{flag} 0 ")), "{err}");
        }
        let model = pk_model::ModelConfig::dummy("llama-3.2-1b").unwrap();
        let gib = 1u64 << 30;
        // Llama 3.2 1B in f16: 32 KiB a token, so 1M tokens are 32 GiB.
        let err = check_pool_fits_memory(1 << 20, &model, KvDtype::F16, Some(24 * gib))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("32.0 GiB") && err.contains("24.0 GiB"),
            "{err}"
        );
        check_pool_fits_memory(1 << 19, &model, KvDtype::F16, Some(24 * gib)).unwrap();
        check_pool_fits_memory(1 << 20, &model, KvDtype::F16, None).unwrap();
    }

    /// `serve` flags parsed from `args` alone: their environment variables are cleared
    /// from the definition, since config.rs's test sets some of them while tests run.
    fn parse(args: &[&str]) -> ServeArgs {
        crate::args::parse_flags_for_test(args)
    }

    /// Every flag that `plan` reads changes the plan, each beside the flags it needs: a
    /// flag parsed and then dropped on the way to the engine (issue 34's
    /// `--disable-hybrid-kv-cache-manager`) fails here. The flag walk points here.
    #[test]
    fn every_serve_flag_changes_the_plan() {
        let dir = tempfile::tempdir().unwrap();
        let disk = format!("{}:1GiB", dir.path().display());
        // A shape with sliding-window layers, so that KV cache groups exist to turn off.
        let gemma = pk_model::ModelConfig::dummy("gemma-3-4b").unwrap();
        let plan_of = |args: &[&str]| {
            let p = plan(&parse(args), Path::new("/m/model.gguf"), &gemma).unwrap();
            // The context store's Debug leaves out its grid and profiling metric.
            let store = match &p.reuse {
                Some(pk_connectors::ReuseConfig::Contexts(c)) => {
                    let s = &c.store;
                    format!(
                        "{:?} {:?} {:?}",
                        s.grid.configs(),
                        c.profile_metric,
                        s.copies
                    )
                }
                _ => String::new(),
            };
            let (e, r, l) = (&p.engine, &p.reuse, &p.limits);
            format!("{e:?} {r:?} {store} {l:?} {} {}", p.model_name, p.addr)
        };
        let ram: &[&str] = &["--tier-ram", "64MiB"];
        let evicpress: &[&str] = &["--tier-policy", "evicpress", "--tier-ram", "64MiB"];
        let cases: &[(&[&str], &[&str])] = &[
            (&[], &["--block-size", "32"]),
            (&[], &["--kv-dtype", "q8"]),
            (&[], &["--disable-hybrid-kv-cache-manager"]),
            (&[], &["--tier-ram", "64MiB"]),
            (&[], &["--tier-disk", &disk]),
            (&[], &["--tier-redis", "redis://127.0.0.1:1"]),
            (ram, &["--tier-chunk-tokens", "64"]),
            (ram, &["--tier-window-checkpoint-tokens", "1024"]),
            (ram, &["--tier-policy", "evicpress"]),
            (evicpress, &["--evicpress-alpha", "2"]),
            (evicpress, &["--evicpress-grid", "q8,q4"]),
            (evicpress, &["--evicpress-per-byte"]),
            (evicpress, &["--evicpress-profile-metric", "teacher-forced"]),
            (evicpress, &["--evicpress-copies", "placed-only"]),
            (&[], &["--host", "127.0.0.2"]),
            (&[], &["--port", "8001"]),
            (&[], &["--served-model-name", "m"]),
            (&[], &["--kv-capacity-tokens", "200000"]),
            (&[], &["--max-running-seqs", "3"]),
            (&[], &["--max-waiting-requests", "3"]),
            (&[], &["--max-batch-tokens", "256"]),
            (&[], &["--max-prefill-tokens-while-decoding", "32"]),
            (&[], &["--prefill-prune-interval-tokens", "64"]),
            (&[], &["--max-model-len", "1024"]),
            (&[], &["--kv-policy", "knorm"]),
            (&[], &["--kv-budget", "64"]),
            (&[], &["--kv-granularity", "head"]),
        ];
        for (base, extra) in cases {
            let with: Vec<&str> = base.iter().chain(extra.iter()).copied().collect();
            let before = plan_of(base);
            assert_eq!(
                before,
                plan_of(base),
                "{base:?}: the plan is not reproducible"
            );
            assert_ne!(before, plan_of(&with), "{extra:?} changed nothing");
        }
    }

    #[test]
    fn default_pool_is_capped_at_a_gibibyte_but_holds_one_context() {
        let smol = pk_model::ModelConfig::dummy("smollm2-135m").unwrap();
        assert_eq!(default_pool_tokens(&smol, KvDtype::F16), 4 * 8192);
        let mut qwen = pk_model::ModelConfig::dummy("qwen2.5-1.5b").unwrap();
        qwen.head_dim = 128;
        assert_eq!(default_pool_tokens(&qwen, KvDtype::F16), (1 << 30) / 28_672);
        // A model whose one context exceeds the cap still gets one context.
        qwen.context_length = 131_072;
        assert_eq!(default_pool_tokens(&qwen, KvDtype::F16), 131_072);
        qwen.context_length = 32_768;
        // In q8 (34 bytes a 32-element group) more tokens fit under the same cap.
        let q8 = default_pool_tokens(&qwen, KvDtype::Q8);
        let q8_per_token = 2 * 28 * 2 * KvDtype::Q8.bytes_per_head_token(128);
        assert!(
            q8 > 32768 && q8 * q8_per_token <= DEFAULT_POOL_BYTES,
            "{q8}"
        );
    }
}
