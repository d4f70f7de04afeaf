//! Subcommand implementations (info, generate, perplexity). Each parses its flags, builds
//! an engine and reports; the flags they share with other commands are in args.rs.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use pk_connectors::Attached;
use pk_engine::model_store::resolve_model;
use pk_engine::perplexity::PerplexityResult;
use pk_engine::sampler::GREEDY_BELOW_TEMPERATURE;
use pk_engine::{GenerateParams, SamplingParams};
use pk_tokenizer::ChatMessage;

use crate::args::{KvPolicyArgs, ModelArgs, PerplexityArgs};

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
    // The checks `generate` runs before loading weights, so that "supported" means it runs.
    let cfg = crate::preflight::runnable_config(&f);
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
            Err(e) => v["not_runnable"] = format!("{e:#}").into(),
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
        Err(e) => println!("not runnable:    {e:#}"),
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

/// Greedy decoding (`--temperature 0`, the default, or any temperature below
/// [`GREEDY_BELOW_TEMPERATURE`]) takes the most likely token, so the sampling flags would be
/// accepted and unused there: refused by name instead.
/// The request's limits, refused as the server refuses them: the engine checks the token
/// limit only after sampling, so 0 gave one token, and an empty stop string never stops.
fn check_limits(a: &GenerateArgs) -> Result<()> {
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if a.stop.iter().any(|s| s.is_empty()) {
        bail!("--stop strings must not be empty");
    }
    Ok(())
}

fn check_sampling(a: &GenerateArgs) -> Result<()> {
    if a.temperature >= GREEDY_BELOW_TEMPERATURE {
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
    check_limits(&a)?;
    check_sampling(&a)?;
    a.kv.check_one_request()?;
    let (mut engine, connector) = a.model.engine_on(&a.device, None)?;
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
    if let Some(c) = connector.as_ref().and_then(Attached::contexts) {
        c.store().flush();
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

pub fn perplexity(a: PerplexityArgs) -> Result<()> {
    pk_engine::perplexity::check_max_chunks(a.chunks)?;
    // Checked here as well as in the library: the chunk count below divides by it first.
    if a.ctx < 4 {
        bail!("--ctx must be at least 4, got {}", a.ctx);
    }
    let r = if a.device == "cuda" {
        crate::gpu::perplexity(&a)?
    } else {
        cpu_perplexity(&a)?
    };
    print_perplexity(&r, a.json)
}

/// `perplexity` through the engine on the CPU; the chunks' running figures go to stderr.
fn cpu_perplexity(a: &PerplexityArgs) -> Result<PerplexityResult> {
    let bytes = std::fs::read(&a.file).with_context(|| format!("reading {}", a.file.display()))?;
    let text = String::from_utf8_lossy(&bytes);
    let mut engine = a.model.engine(Some(a.ctx))?;
    let model_ctx = engine.model_config().context_length;
    if a.ctx > model_ctx {
        bail!(
            "--ctx {} is longer than the model's context ({model_ctx} tokens)",
            a.ctx
        );
    }
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
    Ok(r)
}

/// The result as llama.cpp's `perplexity` prints it, or one JSON object (every backend).
fn print_perplexity(r: &PerplexityResult, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(r)?);
    } else {
        println!("Final estimate: PPL = {:.4} +/- {:.5}", r.ppl, r.ppl_stderr);
    }
    Ok(())
}
