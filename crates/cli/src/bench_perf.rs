//! `pagekeeper bench perf`: prefill and decode speed versus context length, KV bytes and
//! the peak RSS of each run, on a real GGUF or on random weights of a real model's shape.
//! With `--device cuda` the runs are gpu.rs's.

use std::io::Write;

use anyhow::{bail, Context, Result};
use pk_engine::{Engine, EngineConfig, GenerateParams};
use pk_model::{Llama, ModelConfig};
use rand::{Rng, SeedableRng};

use crate::args::{check_hybrid_flag, set_threads, PerfArgs};

/// llama.cpp's side of `--compare-llamacpp`, embedded so the binary needs no source tree.
const LLAMACPP_SCRIPT: &str = include_str!("../../../scripts/llamacpp_bench.py");

/// Checks that `python` can import llama_cpp, with an error that says what to do if not.
fn check_llamacpp(python: &str) -> Result<()> {
    let out = std::process::Command::new(python)
        .args(["-c", "import llama_cpp"])
        .output()
        .with_context(|| format!("--compare-llamacpp: cannot run {python:?} (set --llamacpp-python or PAGEKEEPER_LLAMACPP_PYTHON to a Python that has llama-cpp-python)"))?;
    if !out.status.success() {
        bail!(
            "--compare-llamacpp needs the Python package llama-cpp-python, which {python:?} cannot import \
             (`pip install llama-cpp-python`, or point --llamacpp-python / PAGEKEEPER_LLAMACPP_PYTHON at a \
             Python that has it): {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Runs scripts/llamacpp_bench.py on one prompt and returns its run object.
fn llamacpp_run(
    python: &str,
    model: &std::path::Path,
    threads: usize,
    prompt: &[u32],
    decode_tokens: usize,
) -> Result<serde_json::Value> {
    let dir = tempfile::tempdir()?;
    let req = dir.path().join("request.json");
    let request = serde_json::json!({
        "model": model,
        "threads": threads,
        "decode_tokens": decode_tokens,
        "n_ctx": prompt.len() + decode_tokens + 16,
        "runs": [{"context_tokens": prompt.len(), "prompt": prompt}],
    });
    std::fs::write(&req, request.to_string())?;
    let out = std::process::Command::new(python)
        .arg("-c")
        .arg(LLAMACPP_SCRIPT)
        .arg(&req)
        .stdin(std::process::Stdio::null())
        .output()
        .with_context(|| format!("running {python:?} for llama.cpp"))?;
    if !out.status.success() {
        bail!(
            "llama.cpp side failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "llama.cpp side printed no JSON: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })?;
    let mut run = v["runs"][0].clone();
    run["llama_cpp_python"] = v["llama_cpp_python"].clone();
    Ok(run)
}

/// Decodes `decode_tokens` steps per thread count after `prompt`, the decode pool switched
/// to the next count before every step, and returns each count's decode speed: mean and
/// median over its steps. The prompt is usually in the prefix cache by now; its prefill
/// steps are not counted either way.
fn compare_threads(
    engine: &mut Engine,
    prompt: &[u32],
    modes: &[usize],
    decode_tokens: usize,
) -> Result<Vec<serde_json::Value>> {
    let pool = pk_model::kernels::pool::global();
    let before = pool.active_threads();
    let (tx, rx) = std::sync::mpsc::channel();
    let params = GenerateParams {
        max_tokens: decode_tokens * modes.len() + 1,
        ignore_eos: true,
        ..Default::default()
    };
    let req = pk_engine::Request {
        prompt_ids: prompt.to_vec(),
        params,
        cache_salt: None,
        sink: Box::new(move |e| tx.send(e).is_ok()),
    };
    engine.submit(req).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut times = vec![Vec::new(); modes.len()];
    let (mut first_token_seen, mut step) = (false, 0usize);
    let mut done = false;
    while !done {
        let m = step % modes.len();
        pool.set_active_threads(modes[m]);
        let t = std::time::Instant::now();
        engine.step();
        let dt = t.elapsed().as_secs_f64();
        if first_token_seen {
            times[m].push(dt);
            step += 1;
        }
        while let Ok(ev) = rx.try_recv() {
            match ev {
                pk_engine::SeqEvent::Text { .. } => first_token_seen = true,
                pk_engine::SeqEvent::Finished(_) => done = true,
                pk_engine::SeqEvent::Error(e) => {
                    pool.set_active_threads(before);
                    bail!("{e}")
                }
                pk_engine::SeqEvent::Logits(_) => {}
            }
        }
        if !done && !engine.has_work() {
            pool.set_active_threads(before);
            bail!("the comparison request ended without a result");
        }
    }
    pool.set_active_threads(before);
    Ok(modes
        .iter()
        .zip(times.iter_mut())
        .map(|(&n, t)| {
            let mean = t.iter().sum::<f64>() / t.len().max(1) as f64;
            t.sort_by(f64::total_cmp);
            let median = t.get(t.len() / 2).copied().unwrap_or(f64::NAN);
            serde_json::json!({ "threads": n, "steps": t.len(), "decode_tok_s": 1.0 / mean, "decode_tok_s_median": 1.0 / median })
        })
        .collect())
}

/// The peak resident set size of this process since it started or since the last
/// [`reset_peak_rss`] (Linux `VmHWM`), in bytes; `None` where /proc/self/status has no
/// such line (not Linux).
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// Starts a new peak-RSS window: Linux keeps `VmHWM` for the process's whole life, so a
/// figure read after the second run would be the largest of all runs so far. Writing 5 to
/// /proc/self/clear_refs (Linux 4.0 and later) sets it back to the current RSS, after
/// which `VmHWM` is the peak since this call.
fn reset_peak_rss() -> std::io::Result<()> {
    std::fs::write("/proc/self/clear_refs", "5")
}

/// One run's peak RSS: `Ok(bytes)` when the window was reset before the run and `VmHWM`
/// could be read after it, else `Err(why)`, so that a lifetime figure is never reported
/// as a run's.
fn run_peak_rss(reset: &std::io::Result<()>) -> std::result::Result<u64, String> {
    match reset {
        Err(e) => Err(format!(
            "resetting the peak (writing 5 to /proc/self/clear_refs) failed: {e}"
        )),
        Ok(()) => peak_rss_bytes().ok_or_else(|| "no VmHWM in /proc/self/status".to_string()),
    }
}

fn dummy_type(name: &str) -> Result<pk_gguf::GgmlType> {
    use pk_gguf::GgmlType::*;
    Ok(match name.to_ascii_uppercase().as_str() {
        "Q4_1" => Q4_1,
        "Q4_0" => Q4_0,
        "Q5_0" => Q5_0,
        "Q8_0" => Q8_0,
        "F16" => F16,
        "BF16" => BF16,
        "F32" => F32,
        other => bail!("unsupported --dummy-type {other}"),
    })
}

fn build_engine(a: &PerfArgs, capacity_tokens: usize) -> Result<Engine> {
    let max_ctx = capacity_tokens;
    let Some(name) = &a.dummy else {
        return a.model.engine(Some(max_ctx));
    };
    // The --config file under flags and env, as for a model file (its `model` key is
    // refused with --dummy by flag_rules, its tiers always).
    let args = a.model.resolved()?;
    set_threads(args.threads)?;
    let cfg = ModelConfig::dummy(name).with_context(|| {
        format!(
            "unknown --dummy {name:?} ({})",
            pk_model::config::DUMMY_SHAPES.join(", ")
        )
    })?;
    check_hybrid_flag(args.disable_hybrid_kv_cache_manager, &cfg)?;
    let weights = pk_model::weights::Weights::random(&cfg, dummy_type(&a.dummy_type)?, 1);
    // The tokenizer only decodes generated ids for streaming; the default model's serves.
    let gguf = pk_gguf::GgufFile::open(pk_engine::model_store::resolve_model(None, true)?)?;
    let tokenizer = pk_tokenizer::Tokenizer::from_gguf(&gguf)?;
    let template = pk_tokenizer::ChatTemplate::from_gguf(&gguf)?;
    let config = EngineConfig {
        block_size_tokens: args.block_size,
        kv_dtype: args.kv_dtype()?,
        kv_capacity_tokens: Some(max_ctx),
        hybrid_kv_cache: !args.disable_hybrid_kv_cache_manager,
        ..Default::default()
    };
    Engine::new(
        Llama::new(cfg, weights),
        tokenizer,
        template,
        config,
        &format!("dummy-{name}"),
    )
}

/// The lengths and sizes every run is made of: positive contexts and batches, and at least
/// one decode token (its first comes from the prefill's logits; with one, only the prefill
/// is measured and the decode speed is absent).
fn check_sizes(a: &PerfArgs) -> Result<()> {
    if a.contexts.is_empty() || a.contexts.contains(&0) {
        bail!("--contexts needs positive lengths");
    }
    if a.batch.is_empty() || a.batch.contains(&0) {
        bail!("--batch needs positive sizes");
    }
    if a.decode_tokens == 0 {
        bail!("--decode-tokens must be at least 1 (1 measures the prefill only; the decode speed needs 2 or more)");
    }
    Ok(())
}

/// Decode tokens/s over the timed steps, the first token excepted (it comes from the
/// prefill's logits); `None` when no step was timed.
fn decode_speed(generated: usize, seconds: f64) -> Option<f64> {
    let steps = generated.saturating_sub(1);
    (steps > 0).then(|| steps as f64 / seconds.max(1e-9))
}

pub fn perf(a: PerfArgs) -> Result<()> {
    check_sizes(&a)?;
    if a.device == "cuda" {
        return crate::gpu::perf(&a);
    }
    if a.batch != [1] {
        bail!("--batch is for --device cuda (the CPU bench decodes one sequence)");
    }
    a.kv.check_one_request()?;
    check_compare_threads(&a)?;
    let max_ctx = *a.contexts.iter().max().expect("non-empty");
    let llamacpp_model = llamacpp_model(&a)?;
    // --compare-threads decodes decode_tokens per listed count in one more generation.
    let decode_max = a.decode_tokens * a.compare_threads.len().max(1) + 1;
    // An evicting policy's extra slots after the prompt (KVzip's reconstruction pass).
    let pass =
        a.kv.spec()?
            .map_or(0, |spec| spec.pass_peak_tokens(max_ctx, 64));
    let mut engine = build_engine(&a, max_ctx + decode_max + 64 + pass)?;
    let model_ctx = engine.model_config().context_length;
    if max_ctx + decode_max > model_ctx {
        bail!("context {max_ctx} + {decode_max} decode tokens exceeds the model's context {model_ctx}");
    }
    let vocab = engine.model_config().vocab_size as u32;
    let threads = rayon::current_num_threads();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let mut runs = Vec::new();
    if !a.json {
        print_header(&a, &engine, threads, llamacpp_model.is_some());
    }
    for &ctx in &a.contexts {
        // Random ids avoid prefix-cache hits between runs; ids 1000.. skip special tokens.
        let prompt: Vec<u32> = (0..ctx).map(|_| rng.gen_range(1000..vocab)).collect();
        runs.push(run_context(
            &a,
            &mut engine,
            &prompt,
            threads,
            llamacpp_model.as_deref(),
        )?);
    }
    if !a.json {
        eprintln!("matmul kernel: {}", pk_model::kernels::matmul_isa());
        let (split, inline) = pk_model::kernels::pool::global().step_counts();
        if split + inline > 0 {
            eprintln!("decode pool: {split} steps split over {threads} threads, {inline} run on one (chosen by measured speed)");
        }
    }
    if a.json {
        let v = serde_json::json!({
            "model": engine.model_name,
            "threads": threads,
            "matmul_isa": pk_model::kernels::matmul_isa(),
            "kv_policy": a.kv.label(),
            "kv_budget": a.kv.kv_budget,
            "kv_granularity": a.kv.effective_granularity()?.name(),
            "runs": runs,
        });
        println!("{v}");
    }
    Ok(())
}

/// `--compare-threads` counts must be ones the pool has: 1 to `--threads`.
fn check_compare_threads(a: &PerfArgs) -> Result<()> {
    if let Some(&most) = a.compare_threads.iter().max() {
        let have = (a.model.resolved()?.threads).unwrap_or_else(rayon::current_num_threads);
        if a.compare_threads.contains(&0) || most > have {
            bail!("--compare-threads needs counts in 1..={have} (raise --threads)");
        }
    }
    Ok(())
}

/// With `--compare-llamacpp`, the file llama.cpp loads: the one our engine loads (never a
/// `--dummy` model), once llama.cpp is known to be importable.
fn llamacpp_model(a: &PerfArgs) -> Result<Option<std::path::PathBuf>> {
    if !a.compare_llamacpp {
        return Ok(None);
    }
    if a.dummy.is_some() {
        bail!("--compare-llamacpp needs a model file, not --dummy");
    }
    check_llamacpp(&a.llamacpp_python)?;
    Ok(Some(pk_engine::model_store::resolve_model(
        a.model.resolved()?.model.as_deref(),
        true,
    )?))
}

/// The model line on stderr and the table's header on stdout.
fn print_header(a: &PerfArgs, engine: &Engine, threads: usize, with_llamacpp: bool) {
    eprintln!(
        "model {} | threads {threads} | block {} | kv {:?}",
        engine.model_name,
        a.model.block_size,
        engine.kv_store().dtype()
    );
    if with_llamacpp {
        println!(
            "{:>8} {:>12} {:>8} {:>12} {:>12} {:>12} | {:>14} {:>14} | {:>8} {:>8}",
            "context",
            "prefill t/s",
            "decode",
            "decode t/s",
            "KV MiB",
            "peak RSS MiB",
            "llama.cpp pp",
            "llama.cpp tg",
            "pp ratio",
            "tg ratio"
        );
    } else {
        println!(
            "{:>8} {:>12} {:>8} {:>12} {:>12} {:>12}",
            "context", "prefill t/s", "decode", "decode t/s", "KV MiB", "peak RSS MiB"
        );
    }
}

/// One context's run: our prefill and decode of `prompt` (with this run's peak RSS), then
/// llama.cpp's (on `threads` threads, as ours) and the thread-count comparison when asked. Returns the run's JSON object
/// and prints its row unless `--json`.
fn run_context(
    a: &PerfArgs,
    engine: &mut Engine,
    prompt: &[u32],
    threads: usize,
    llamacpp_model: Option<&std::path::Path>,
) -> Result<serde_json::Value> {
    let ctx = prompt.len();
    let kv_bytes_per_token = engine
        .kv_store()
        .geometry()
        .bytes_per_token(engine.kv_store().dtype());
    let params = GenerateParams {
        max_tokens: a.decode_tokens,
        ignore_eos: true,
        kv_policy: a.kv.spec()?,
        kv_budget: a.kv.kv_budget,
        kv_granularity: a.kv.granularity()?,
        ..Default::default()
    };
    engine.stats.kv_bytes_peak = 0;
    let passes_before = reconstruction_seconds(engine, &params);
    let rss_reset = reset_peak_rss();
    let out = engine.generate(prompt, &params, &mut |_| {})?;
    let peak_rss = run_peak_rss(&rss_reset);
    let passes = reconstruction_seconds(engine, &params).map(|(f, s)| {
        let (f0, s0) = passes_before.unwrap_or_default();
        (f - f0, s - s0)
    });
    // KVzip's passes run once the first token is out (it comes from the full prompt's
    // logits), so they fall in the decode time: they are reported on their own.
    let pass_seconds = passes.map_or(0.0, |(f, s)| f + s);
    let mut run = serde_json::json!({
        "context_tokens": ctx,
        "prefill_tok_s": ctx as f64 / out.prefill_seconds,
        "decode_tokens": out.token_ids.len(),
        // null when fewer than 2 tokens came out: no decode step was timed.
        "decode_tok_s": decode_speed(out.token_ids.len(), out.decode_seconds - pass_seconds),
        // The blocks the sequence held at its end (window groups' included), and the
        // most the pool held at once during the run.
        "kv_bytes": out.kv_bytes,
        "kv_bytes_peak": engine.stats.kv_bytes_peak,
        "kv_bytes_one_table": out.kv_stored_tokens * kv_bytes_per_token,
        "kv_cache_groups": engine.kv_manager().window_spec().map_or(1, |w| 1 + w.num_groups),
        // This run's peak (prefill and decode), or null with the reason beside it.
        "peak_rss_bytes": peak_rss.as_ref().ok(),
    });
    if let Err(why) = &peak_rss {
        run["peak_rss_error"] = serde_json::json!(why);
    }
    if let Some((forward, scoring)) = passes.filter(|&(f, s)| f + s > 0.0) {
        add_reconstruction_cost(&mut run, out.prefill_seconds, forward, scoring, a.json);
    }
    // llama.cpp right after ours on the same prompt, so both see the same host load.
    let lc = match llamacpp_model {
        Some(path) => {
            let lc = llamacpp_run(&a.llamacpp_python, path, threads, prompt, a.decode_tokens)?;
            let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
            run["ratio_prefill"] =
                serde_json::json!(f(&run, "prefill_tok_s") / f(&lc, "prefill_tok_s"));
            // Absent (null) where either side timed no decode step.
            let ratio_decode = run["decode_tok_s"]
                .as_f64()
                .zip(lc["decode_tok_s"].as_f64().filter(|&v| v > 0.0))
                .map(|(ours, theirs)| ours / theirs);
            run["ratio_decode"] = serde_json::json!(ratio_decode);
            run["llamacpp"] = lc.clone();
            Some(lc)
        }
        None => None,
    };
    if !a.compare_threads.is_empty() {
        let per_mode = compare_threads(engine, prompt, &a.compare_threads, a.decode_tokens)?;
        run["compare_threads"] = serde_json::json!(per_mode);
    }
    if !a.json {
        if let Err(why) = &peak_rss {
            eprintln!("peak RSS of the {ctx}-token run not measured: {why}");
        }
        print_row(&run, ctx, out.token_ids.len(), &peak_rss, lc.as_ref());
    }
    Ok(run)
}

/// KVzip's reconstruction passes so far, (forward, scoring) seconds, for a run whose policy
/// has them; `None` for every other policy.
fn reconstruction_seconds(engine: &Engine, params: &GenerateParams) -> Option<(f64, f64)> {
    let spec = params.kv_policy?;
    spec.reconstruction_chunk_tokens()?;
    let stats = engine
        .eviction_stats
        .get(spec.name())
        .cloned()
        .unwrap_or_default();
    Some((
        stats.reconstruction_forward_seconds,
        stats.reconstruction_scoring_seconds,
    ))
}

/// The cost of KVzip's passes beside the prefill they follow, in one run (the passes run
/// after the prefill, between the first token and the second).
fn add_reconstruction_cost(
    run: &mut serde_json::Value,
    prefill_seconds: f64,
    forward: f64,
    scoring: f64,
    json: bool,
) {
    let ratio = (forward + scoring) / prefill_seconds;
    run["reconstruction_forward_seconds"] = serde_json::json!(forward);
    run["reconstruction_scoring_seconds"] = serde_json::json!(scoring);
    run["reconstruction_cost_ratio"] = serde_json::json!(ratio);
    if !json {
        eprintln!(
            "KVzip's passes: forward {forward:.2} s + scoring {scoring:.2} s against the prefill's {prefill_seconds:.2} s: {ratio:.2}x a prefill"
        );
    }
}

/// One context's row of the table (and its thread-count comparison's lines).
fn print_row(
    run: &serde_json::Value,
    ctx: usize,
    decode_tokens: usize,
    peak_rss: &std::result::Result<u64, String>,
    lc: Option<&serde_json::Value>,
) {
    print!(
        "{:>8} {:>12.1} {:>8} {:>12} {:>12.1} {:>12}",
        ctx,
        run["prefill_tok_s"].as_f64().unwrap(),
        decode_tokens,
        run["decode_tok_s"]
            .as_f64()
            .map_or("—".to_string(), |v| format!("{v:.1}")),
        run["kv_bytes"].as_f64().unwrap() / (1 << 20) as f64,
        peak_rss.as_ref().map_or("n/a".to_string(), |&b| format!(
            "{:.1}",
            b as f64 / (1 << 20) as f64
        ))
    );
    if let Some(lc) = lc {
        print!(
            " | {:>14.1} {:>14.1} | {:>7.2}x {:>8}",
            lc["prefill_tok_s"].as_f64().unwrap_or(f64::NAN),
            lc["decode_tok_s"].as_f64().unwrap_or(f64::NAN),
            run["ratio_prefill"].as_f64().unwrap_or(f64::NAN),
            run["ratio_decode"]
                .as_f64()
                .map_or("—".to_string(), |v| format!("{v:.2}x"))
        );
    }
    println!();
    if let Some(modes) = run["compare_threads"].as_array() {
        for m in modes {
            println!("{:>8} decode alternating step by step, threads {}: {:.1} tok/s (median step {:.1} tok/s)", "", m["threads"], m["decode_tok_s"].as_f64().unwrap_or(f64::NAN), m["decode_tok_s_median"].as_f64().unwrap_or(f64::NAN));
        }
    }
    let _ = std::io::stdout().flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After a reset the peak is the new window's: a 256 MiB spike freed before the reset is
    /// in the first window's peak and not in the second's.
    #[test]
    #[cfg_attr(
        not(target_os = "linux"),
        ignore = "VmHWM and /proc/self/clear_refs are Linux's"
    )]
    fn the_peak_rss_window_starts_at_each_reset() {
        const SPIKE: u64 = 256 << 20;
        reset_peak_rss().expect("writing 5 to /proc/self/clear_refs (bench perf needs it)");
        let start = run_peak_rss(&Ok(())).unwrap();
        {
            let mut v = vec![0u8; SPIKE as usize];
            // Touch every page: untouched pages of a zeroed allocation are never resident.
            for i in (0..v.len()).step_by(4096) {
                v[i] = 1;
            }
            std::hint::black_box(&v);
        }
        let first = run_peak_rss(&Ok(())).unwrap();
        assert!(
            first >= start + SPIKE * 9 / 10,
            "the first window's peak {first} does not hold the spike (start {start})"
        );
        // glibc's malloc serves a block this large with mmap and returns it with munmap on
        // free, so the RSS is back near `start` before the reset.
        let second = run_peak_rss(&reset_peak_rss()).unwrap();
        assert!(
            second + SPIKE / 2 < first,
            "the second window's peak {second} still holds the first's spike ({first})"
        );
    }

    #[test]
    fn a_failed_reset_gives_no_figure_and_says_why() {
        let failed = Err(std::io::Error::from(std::io::ErrorKind::PermissionDenied));
        let why = run_peak_rss(&failed).unwrap_err();
        assert!(why.contains("/proc/self/clear_refs"), "{why}");
    }

    fn parse(args: &[&str]) -> PerfArgs {
        crate::args::parse_flags_for_test(args)
    }

    /// `--decode-tokens 0` is refused naming the flag (it was run as 1); 1 stays allowed,
    /// since prefill-only measurements use it (scripts/llama_bench_side_by_side.sh).
    #[test]
    fn zero_decode_tokens_is_refused_naming_the_flag() {
        let e = check_sizes(&parse(&["--decode-tokens", "0"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--decode-tokens"), "{e}");
        for n in ["1", "2", "128"] {
            check_sizes(&parse(&["--decode-tokens", n])).unwrap();
        }
        for (args, flag) in [
            (&["--contexts", "0"][..], "--contexts"),
            (&["--batch", "0"], "--batch"),
        ] {
            let e = check_sizes(&parse(args)).unwrap_err().to_string();
            assert!(e.contains(flag), "{e}");
        }
    }

    /// With one token out (the prefill's) no decode step was timed: the speed is absent,
    /// not 0; from two on it is the timed steps over their time.
    #[test]
    fn decode_speed_is_absent_without_a_timed_step() {
        assert_eq!(decode_speed(0, 1.0), None);
        assert_eq!(decode_speed(1, 0.0), None);
        assert_eq!(decode_speed(2, 0.5), Some(2.0));
        assert_eq!(decode_speed(11, 2.0), Some(5.0));
    }
}
